//! The serving loop: each step runs all of the scheduler's work as one batched pass of the
//! backend over a shared, paged KV cache (the block tables come from the scheduler), samples
//! where a sequence reached its last position, and reports new tokens and finished sequences.
//! Preempted sequences lose their blocks and recompute what the prefix cache no longer holds
//! when readmitted.

use super::draft_model::Drafter;
use super::scheduler::{AddError, Finished, Scheduler, SchedulerConfig, SeqId, Work};
use crate::error::{Result, RuntimeError};
use crate::kv::Segment;
use crate::logits_processor::{sample_processed, LogitsProcessor};
use crate::sampling::{Sampler, SamplingParams, TokenLogprobs};
use ir::Tensor;
use std::collections::{HashMap, HashSet};

/// What serving needs of a backend: a KV cache in blocks, and steps over many sequences at once.
pub trait PagedBackend {
    /// The KV cache of every sequence, in blocks addressed through block tables.
    type Pages;
    fn new_pages(&self, block_size: usize) -> Self::Pages;
    /// The most tokens one step may carry, where the backend has a limit (a GPU plan is
    /// compiled for a number of rows).
    fn max_step_tokens(&self) -> Option<usize> {
        None
    }
    /// The most sequences that may run at once, where the backend keeps something per
    /// running sequence in a fixed number of places (a GPU plan's recurrent state slots).
    fn max_sequences(&self) -> Option<usize> {
        None
    }
    /// The most drafted tokens one segment may carry, where the backend keeps something per
    /// draft in a fixed number of places (a GPU plan's recurrent-state checkpoints).
    fn max_drafts(&self) -> Option<usize> {
        None
    }
    /// Whether the model keeps a recurrent state per sequence (Gated DeltaNet layers), which
    /// cached blocks do not hold.
    fn has_recurrent_state(&self) -> bool {
        false
    }
    /// How a step restores and saves snapshots of recurrent states (`Segment::snapshots`),
    /// so that the prefix cache can serve models that keep them.
    fn snapshots_states(&self) -> StateSnapshotting {
        StateSnapshotting::None
    }
    /// Whether a step can return several rows of one sequence (`Segment::sampled_rows`), as
    /// a request's prompt log-probabilities need.
    fn samples_several_rows(&self) -> bool {
        false
    }
    /// Whether a step can sample several rows of one sequence (`Segment::sampled_rows`), and
    /// so verify drafted tokens: a recurrent state that drafts advance must be put back where
    /// they are refused ([`rewind_state`](Self::rewind_state)).
    fn verifies_drafts(&self) -> bool {
        false
    }
    /// After a step that sampled `sampled_rows` rows of the sequence in `state_slot` kept only
    /// the first `kept` (its later drafts refused): its recurrent state as the last row kept
    /// left it. Nothing to do for a model without recurrent state (refused rows' keys and
    /// values lie past the sequence's end and are overwritten).
    fn rewind_state(
        &self,
        _pages: &mut Self::Pages,
        _state_slot: usize,
        _sampled_rows: usize,
        _kept: usize,
    ) -> Result<()> {
        Ok(())
    }
    /// Process every segment's tokens in one pass; each segment's outputs by name, in order:
    /// per-token outputs with at least the segment's last row (the one sampled from).
    fn step_batch(&self, pages: &mut Self::Pages, batch: &[Segment]) -> Result<Vec<HashMap<String, Tensor>>>;
    /// Like `step_batch`, but each segment's greedy tokens come back in place of its logits
    /// (`next_token`: the argmax of each row it samples, by [`crate::sampling::argmax`]'s
    /// rule, at least its sampled rows'; see [`greedy_ids`]), with the per-token outputs
    /// named in `also` (a multi-token prediction head's hidden states), where the backend
    /// computes them itself (a GPU serving plan with a `next_token` output: ids cross to the
    /// host rather than vocabulary-wide rows, and no host thread scans them); `None`, running
    /// nothing, where it does not.
    fn step_batch_greedy(
        &self,
        _pages: &mut Self::Pages,
        _batch: &[Segment],
        _also: &[&str],
    ) -> Option<Result<Vec<HashMap<String, Tensor>>>> {
        None
    }
}

/// A segment's greedy tokens from the outputs [`PagedBackend::step_batch_greedy`] gave it: the
/// last `sampled_rows` of its `next_token`.
pub(crate) fn greedy_ids(outputs: &HashMap<String, Tensor>, sampled_rows: usize) -> Result<Vec<u32>> {
    let next = outputs
        .get("next_token")
        .ok_or_else(|| RuntimeError::Graph("a greedy step returned no `next_token`".into()))?;
    let rows = next.data.len();
    if rows < sampled_rows {
        return Err(RuntimeError::Graph(format!(
            "{rows} greedy tokens for a segment sampling {sampled_rows} rows"
        )));
    }
    Ok(next.data[rows - sampled_rows..].iter().map(|&id| id as u32).collect())
}

impl PagedBackend for crate::CpuBackend {
    type Pages = crate::KvPages;
    fn new_pages(&self, block_size: usize) -> Self::Pages {
        crate::CpuBackend::new_pages(self, block_size)
    }
    fn step_batch(&self, pages: &mut Self::Pages, batch: &[Segment]) -> Result<Vec<HashMap<String, Tensor>>> {
        crate::CpuBackend::step_batch(self, pages, batch)
    }
    fn has_recurrent_state(&self) -> bool {
        crate::CpuBackend::has_recurrent_state(self)
    }
    fn samples_several_rows(&self) -> bool {
        true
    }
    fn verifies_drafts(&self) -> bool {
        true
    }
    fn snapshots_states(&self) -> StateSnapshotting {
        StateSnapshotting::AfterAnyRow
    }
    fn rewind_state(&self, pages: &mut Self::Pages, state_slot: usize, sampled_rows: usize, kept: usize) -> Result<()> {
        match self.has_recurrent_state() {
            true => pages.rewind_state(state_slot, sampled_rows, kept),
            false => Ok(()),
        }
    }
}

/// How a backend keeps snapshots of recurrent states for the prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateSnapshotting {
    /// Not at all: a model with recurrent state runs without the prefix cache.
    None,
    /// After any row of a step, in as many places as asked (the CPU backend).
    AfterAnyRow,
    /// At the end of a sequence's rows of a step only, in `places` places (a GPU plan's
    /// kernels leave a state only there).
    AtSegmentEnds { places: usize },
}

/// A token chosen this step.
#[derive(Debug)]
pub struct Sampled {
    pub seq: SeqId,
    pub token: u32,
    /// When the request asked for them.
    pub logprobs: Option<TokenLogprobs>,
    /// The row of logits it was sampled from, as the model gave it, for a sequence that asked
    /// for them ([`ServingEngine::return_logits`]).
    pub logits: Option<Vec<f32>>,
}

/// Prompt tokens' log-probabilities computed this step, for a request that asked for them
/// (`SamplingParams::prompt_logprobs`): those of its prompt positions `first..first +
/// logprobs.len()`, each given the positions before it. Position 0 has none; a sequence's
/// positions come in order, each once, all before its first token.
#[derive(Debug)]
pub struct PromptLogprobs {
    pub seq: SeqId,
    pub first: usize,
    pub logprobs: Vec<TokenLogprobs>,
}

/// A request's prompt still to be scored.
struct PromptScoring {
    prompt: Vec<u32>,
    /// The next position whose log-probability is wanted.
    next: usize,
    /// Alternatives reported at each.
    top: usize,
}

impl PromptScoring {
    /// Of a work computing positions `start..end`, the rows (from the first) whose logits
    /// score positions still wanted: row `q` scores position `q + 1`.
    fn rows(&self, start: usize, end: usize) -> std::ops::Range<usize> {
        let from = start.max(self.next - 1);
        let to = end.min(self.prompt.len() - 1);
        from.min(to)..to
    }
}

/// What one step produced.
#[derive(Debug, Default)]
pub struct StepOutput {
    /// In order; a sequence that accepted drafted tokens has several.
    pub tokens: Vec<Sampled>,
    /// Before any of a sequence's tokens.
    pub prompt_logprobs: Vec<PromptLogprobs>,
    pub finished: Vec<Finished>,
    /// Tokens drafted for this step's sequences, and of those the ones accepted.
    pub drafted: usize,
    pub accepted: usize,
    /// This step's sequences that carried drafts.
    pub verified: usize,
}

pub struct ServingEngine<B: PagedBackend> {
    backend: B,
    scheduler: Scheduler,
    pages: B::Pages,
    samplers: HashMap<SeqId, Sampler>,
    /// The sequences whose logits go through processors before they sample (structured
    /// outputs, `logit_bias`, `min_tokens`).
    processors: HashMap<SeqId, Vec<Box<dyn LogitsProcessor>>>,
    /// The sequences whose prompt is still being scored (`SamplingParams::prompt_logprobs`).
    scoring: HashMap<SeqId, PromptScoring>,
    /// The sequences whose sampled rows' logits come back with their tokens.
    returning_logits: HashSet<SeqId>,
    /// Where drafts come from a draft model rather than prompt lookup.
    drafter: Option<Box<dyn Drafter>>,
}

impl<B: PagedBackend> ServingEngine<B> {
    /// An engine over `backend`; a token budget above what the backend takes in one step is
    /// lowered to it (prompts are then chunked smaller), so no step is refused for its size,
    /// and so are running sequences past the ones it keeps state for, and drafts past the ones
    /// it keeps checkpoints for; a model with recurrent state runs without the prefix cache
    /// where the backend keeps no snapshots of it, and a backend that cannot verify drafted
    /// tokens without speculation.
    pub fn new(backend: B, mut config: SchedulerConfig) -> Self {
        if let Some(limit) = backend.max_step_tokens() {
            config.token_budget = config.token_budget.min(limit);
        }
        if let Some(limit) = backend.max_sequences() {
            config.max_running = config.max_running.min(limit);
        }
        config.recurrent_state = backend.has_recurrent_state();
        match backend.snapshots_states() {
            StateSnapshotting::None => config.state_cache = super::StateCacheConfig::OFF,
            StateSnapshotting::AfterAnyRow => config.state_cache.at_segment_ends = false,
            StateSnapshotting::AtSegmentEnds { places } => {
                config.state_cache.capacity = config.state_cache.capacity.min(places);
                config.state_cache.at_segment_ends = true;
            }
        }
        if !backend.verifies_drafts() {
            config.speculation = super::ngram::NgramConfig::OFF;
        }
        let mut scheduler = Scheduler::new(config);
        if let Some(most) = backend.max_drafts() {
            scheduler.cap_drafts(most);
        }
        Self {
            pages: backend.new_pages(config.block_size),
            backend,
            scheduler,
            samplers: HashMap::new(),
            processors: HashMap::new(),
            scoring: HashMap::new(),
            returning_logits: HashSet::new(),
            drafter: None,
        }
    }

    /// Drafts from `drafter` (a draft model) instead of prompt lookup, up to the
    /// configuration's `speculation.tokens` a step; false, leaving the engine as it was, where
    /// the engine does not speculate (none asked for, or a backend that cannot verify drafts).
    pub fn use_drafter(&mut self, drafter: Box<dyn Drafter>) -> bool {
        let speculates = self.scheduler.config().speculation.is_on();
        if speculates {
            self.drafter = Some(drafter);
        }
        speculates
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend back, the engine's cache and requests dropped (to serve again from a cold
    /// cache without loading the model again).
    pub fn into_backend(self) -> B {
        self.backend
    }

    pub fn pages(&self) -> &B::Pages {
        &self.pages
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    pub fn add(
        &mut self,
        prompt: Vec<u32>,
        max_tokens: usize,
        stop_tokens: Vec<u32>,
        sampling: SamplingParams,
    ) -> std::result::Result<SeqId, AddError> {
        self.add_processed(prompt, max_tokens, stop_tokens, sampling, Vec::new(), 0)
    }

    /// Order the queue and choose whom to preempt by `policy` (before anything is added;
    /// false after).
    /// Draft only while at most `sequences` run (see [`Scheduler::speculate_up_to`]).
    pub fn speculate_up_to(&mut self, sequences: usize) {
        self.scheduler.speculate_up_to(sequences);
    }

    pub fn set_scheduling_policy(&mut self, policy: super::SchedulingPolicy) -> bool {
        self.scheduler.set_policy(policy)
    }

    /// Like [`add`](Self::add), each row sampled from after `processors`, in order, and with a
    /// `priority` (lower first; it orders the queue under the priority policy). Where
    /// `sampling` asks for the prompt's log-probabilities, every prompt position is computed
    /// (none taken from the prefix cache) and its logits scored.
    pub fn add_processed(
        &mut self,
        prompt: Vec<u32>,
        max_tokens: usize,
        stop_tokens: Vec<u32>,
        sampling: SamplingParams,
        processors: Vec<Box<dyn LogitsProcessor>>,
        priority: i32,
    ) -> std::result::Result<SeqId, AddError> {
        let scoring = match sampling.prompt_logprobs {
            Some(_) if !self.backend.samples_several_rows() => return Err(AddError::PromptLogprobsUnsupported),
            Some(top) if prompt.len() > 1 => Some(PromptScoring {
                prompt: prompt.clone(),
                next: 1,
                top,
            }),
            _ => None,
        };
        let sampler = Sampler::with_prompt(sampling, &prompt);
        let id = self
            .scheduler
            .add_with_priority(prompt, max_tokens, stop_tokens, priority)?;
        if let Some(scoring) = scoring {
            self.scheduler.compute_whole_prompt(id);
            self.scoring.insert(id, scoring);
        }
        self.samplers.insert(id, sampler);
        if !processors.is_empty() {
            self.processors.insert(id, processors);
        }
        Ok(id)
    }

    /// Score sequence `id`'s prompt (added asking for `prompt_logprobs`) from `position` on
    /// only: rows before it return no logits (a perplexity's window scores its second half).
    /// False where `id` is not scoring, or has scored past `position` already.
    pub fn score_prompt_from(&mut self, id: SeqId, position: usize) -> bool {
        match self.scoring.get(&id) {
            Some(scoring) if scoring.next <= position.max(1) => {
                self.score_from(id, position.max(1));
                true
            }
            _ => false,
        }
    }

    /// Return the logits row each token of sequence `id` is sampled from with it (`bbc run
    /// --dump-logits`); false where `id` is not waiting or running.
    pub fn return_logits(&mut self, id: SeqId) -> bool {
        let known = self.samplers.contains_key(&id);
        if known {
            self.returning_logits.insert(id);
        }
        known
    }

    /// Drop a request (its client went away): its blocks and state are freed now.
    pub fn abort(&mut self, id: SeqId) -> bool {
        self.samplers.remove(&id);
        self.processors.remove(&id);
        self.scoring.remove(&id);
        self.returning_logits.remove(&id);
        self.scheduler.abort(id)
    }

    /// Run one step of scheduled work.
    pub fn step(&mut self) -> Result<StepOutput> {
        self.step_while(|_| true)
    }

    /// Run one step, first asking `wanted` about each scheduled sequence: one that is no longer
    /// wanted (its client left) is aborted there, so a step never spends time on a request
    /// nobody is waiting for.
    pub fn step_while(&mut self, mut wanted: impl FnMut(SeqId) -> bool) -> Result<StepOutput> {
        if let Some(drafter) = self.drafter.as_mut() {
            let scheduler = &self.scheduler;
            drafter.retain(&mut |id| scheduler.is_running(id));
            let drafts = drafter.propose(&scheduler.draft_requests())?;
            self.scheduler.offer_drafts(drafts);
        }
        self.offer_forced_drafts();
        let mut schedule = self.scheduler.schedule();
        schedule.work.retain(|w| {
            let keep = wanted(w.seq);
            if !keep {
                self.abort(w.seq);
            }
            keep
        });
        let mut out = StepOutput::default();
        if schedule.work.is_empty() {
            return Ok(out);
        }
        // Each work's rows that score its prompt (from the first row the step returns).
        let scored: Vec<std::ops::Range<usize>> = schedule
            .work
            .iter()
            .map(|w| self.scoring.get(&w.seq).map_or(0..0, |s| s.rows(w.start, w.end)))
            .collect();
        let batch: Vec<Segment> = schedule
            .work
            .iter()
            .zip(&scored)
            .map(|(w, scored)| {
                let sampled = if w.samples { w.drafts + 1 } else { 1 };
                Segment {
                    hidden_states: &[],
                    table: &w.table,
                    start: w.start,
                    ids: &w.tokens,
                    state_slot: w.state_slot,
                    // The rows scoring the prompt, then to the end.
                    sampled_rows: match scored.is_empty() {
                        true => sampled,
                        false => sampled.max(w.end - scored.start),
                    },
                    drafts: w.drafts,
                    snapshots: crate::kv::StateSnapshots {
                        restore: w.restore,
                        save: &w.saves,
                    },
                }
            })
            .collect();
        // Requests that take the argmax and want nothing else of the logits can have it
        // computed by the backend (one whose logits are processed first cannot, nor a step
        // scoring a prompt; once its prompt is scored, a request decodes like any other).
        let greedy = scored.iter().all(|rows| rows.is_empty())
            && schedule.work.iter().filter(|w| w.samples).all(|w| {
                self.samplers.get(&w.seq).is_some_and(|s| s.params().is_plain_greedy())
                    && !self.processors.contains_key(&w.seq)
                    && !self.returning_logits.contains(&w.seq)
            });
        // What the drafter reads of the target's rows comes back with greedy tokens too.
        let also: Vec<&str> = self
            .drafter
            .as_ref()
            .and_then(|d| d.reads_target_output())
            .into_iter()
            .collect();
        let greedy_outputs = match greedy {
            true => self
                .backend
                .step_batch_greedy(&mut self.pages, &batch, &also)
                .transpose()?,
            false => None,
        };
        let greedy_tokens = greedy_outputs.is_some();
        let outputs = match greedy_outputs {
            Some(outputs) => outputs,
            None => {
                // The processors of the sequences sampled this step get ready for their first
                // row while the backend computes it (a grammar's mask takes milliseconds with a
                // large vocabulary; on a GPU the host is idle meanwhile).
                let processors = &mut self.processors;
                let processed: Vec<SeqId> = match processors.is_empty() {
                    true => Vec::new(),
                    false => schedule
                        .work
                        .iter()
                        .filter(|w| w.samples && processors.contains_key(&w.seq))
                        .map(|w| w.seq)
                        .collect(),
                };
                let (backend, pages) = (&self.backend, &mut self.pages);
                match processed.is_empty() {
                    true => backend.step_batch(pages, &batch)?,
                    false => std::thread::scope(|scope| {
                        scope.spawn(|| {
                            for id in &processed {
                                processors.get_mut(id).into_iter().flatten().for_each(|p| p.prepare());
                            }
                        });
                        backend.step_batch(pages, &batch)
                    })?,
                }
            }
        };
        let missing = || RuntimeError::Graph("the backend returned fewer results than the step had segments".into());
        for (i, (work, rows)) in schedule.work.iter().zip(scored).enumerate() {
            if !rows.is_empty() {
                let scores = self.score_prompt(work, rows, outputs.get(i).ok_or_else(missing)?)?;
                out.prompt_logprobs.push(scores);
            }
        }
        for (i, work) in schedule.work.iter().enumerate() {
            let sampled = match (work.samples, greedy_tokens) {
                (false, _) => Vec::new(),
                (true, true) => accept_greedy(
                    work.drafted(),
                    &greedy_ids(outputs.get(i).ok_or_else(missing)?, work.drafts + 1)?,
                )?
                .into_iter()
                .map(|token| Sampled {
                    seq: work.seq,
                    token,
                    logprobs: None,
                    logits: None,
                })
                .collect(),
                (true, false) => self.sample(work, outputs.get(i).ok_or_else(missing)?)?,
            };
            let tokens: Vec<u32> = sampled.iter().map(|s| s.token).collect();
            let (taken, done) = self.scheduler.complete(work, &tokens);
            let accepted = work.accepted(taken);
            if taken > 0 && work.drafts > 0 {
                // Refused drafts ran through its recurrent state: take them back out (and let
                // go of the states the step kept for that, all drafts accepted or not).
                self.backend
                    .rewind_state(&mut self.pages, work.state_slot, work.drafts + 1, accepted + 1)?;
            }
            if let (Some(drafter), Some(outputs)) = (self.drafter.as_mut(), outputs.get(i)) {
                show_target_rows(drafter.as_mut(), work, accepted, outputs);
            }
            out.drafted += work.drafts;
            out.accepted += accepted;
            out.verified += usize::from(work.drafts > 0);
            out.tokens.extend(sampled.into_iter().take(taken));
            if let Some(done) = done {
                self.samplers.remove(&done.seq);
                self.processors.remove(&done.seq);
                self.scoring.remove(&done.seq);
                self.returning_logits.remove(&done.seq);
                out.finished.push(done);
            }
        }
        Ok(out)
    }

    /// What each sequence's logits processors expect next (a grammar's forced text), offered
    /// to the next step as drafts where the backend verifies drafts (the scheduler cuts them to
    /// what it can verify):
    /// a choice's rest, a JSON schema's property name, then take one step for several tokens
    /// (SGLang's jump-forward decoding, as speculation: the model still chooses every token,
    /// so the output is the same).
    fn offer_forced_drafts(&mut self) {
        if self.processors.is_empty() || !self.backend.verifies_drafts() {
            return;
        }
        let forced = self
            .processors
            .iter_mut()
            .filter_map(|(&id, processors)| {
                let proposals = processors.iter_mut().map(|p| p.proposals()).find(|p| !p.is_empty())?;
                Some((id, proposals))
            })
            .collect();
        self.scheduler.offer_forced_drafts(forced);
    }

    /// The log-probabilities of `work`'s prompt positions that its rows `rows` (positions,
    /// each scoring the next) score, from the step's logits, whose last rows are the work's
    /// from the first of them; the sequence's scoring moves past them, and ends after the
    /// prompt's last position.
    fn score_prompt(
        &mut self,
        work: &Work,
        rows: std::ops::Range<usize>,
        outputs: &HashMap<String, Tensor>,
    ) -> Result<PromptLogprobs> {
        let logits = outputs
            .get("logits")
            .ok_or_else(|| RuntimeError::Graph("the graph has no `logits` output".into()))?;
        let returned = logits.rows();
        if returned < work.end - rows.start {
            return Err(RuntimeError::Graph(format!(
                "{returned} logits rows for a step scoring prompt positions from {}",
                rows.start + 1
            )));
        }
        let scoring = self.scoring.get(&work.seq).expect("a scored sequence is scoring");
        // Row of position q among those returned.
        let first_returned = work.end - returned;
        let logprobs = rows
            .clone()
            .map(|q| TokenLogprobs::of(logits.row(q - first_returned), scoring.prompt[q + 1], scoring.top))
            .collect();
        self.score_from(work.seq, rows.end + 1);
        Ok(PromptLogprobs {
            seq: work.seq,
            first: rows.start + 1,
            logprobs,
        })
    }

    /// Sequence `id`'s prompt scored from `next` on; its scoring over past the prompt's end.
    fn score_from(&mut self, id: SeqId, next: usize) {
        match self.scoring.get_mut(&id) {
            Some(scoring) if next < scoring.prompt.len() => scoring.next = next,
            _ => {
                self.scoring.remove(&id);
            }
        }
    }

    /// Choose `work`'s next tokens from the step's logits: at its last row, or, where it carries
    /// drafted tokens, at each of its last `drafts + 1` rows in turn while the token chosen is
    /// the one drafted there. Each row is sampled as if alone (the sampler's penalties and
    /// random stream see exactly the tokens taken before it), so the tokens are those that
    /// decoding one at a time would have chosen. A sequence with logits processors samples
    /// each row as they leave it (its log-probabilities stay the model's).
    fn sample(&mut self, work: &Work, outputs: &HashMap<String, Tensor>) -> Result<Vec<Sampled>> {
        let logits = outputs
            .get("logits")
            .ok_or_else(|| RuntimeError::Graph("the graph has no `logits` output".into()))?;
        let rows = logits.rows();
        if rows < work.drafts + 1 {
            return Err(RuntimeError::Graph(format!(
                "{rows} logits rows for a step verifying {} drafted tokens",
                work.drafts
            )));
        }
        let drafted = work.drafted();
        let sampler = self.samplers.get_mut(&work.seq).expect("every sequence has a sampler");
        let mut processors = self.processors.get_mut(&work.seq);
        let mut processed = Vec::new();
        let mut out = Vec::with_capacity(work.drafts + 1);
        for j in 0..=work.drafts {
            let row = logits.row(rows - 1 - work.drafts + j);
            let token = match processors.as_mut() {
                Some(processors) => sample_processed(sampler, processors, row, &mut processed),
                None => sampler.sample(row),
            };
            let logprobs = sampler.params().logprobs.map(|top| TokenLogprobs::of(row, token, top));
            out.push(Sampled {
                seq: work.seq,
                token,
                logprobs,
                logits: self.returning_logits.contains(&work.seq).then(|| row.to_vec()),
            });
            if drafted.get(j) != Some(&token) {
                break;
            }
        }
        Ok(out)
    }
}

/// Give `drafter` the rows of the output it reads (where it reads one) of the positions `work`'s
/// sequence keeps: all of a prompt chunk's, and of a sampled work's, those before its drafts
/// and the `accepted` drafts.
fn show_target_rows(drafter: &mut dyn Drafter, work: &Work, accepted: usize, outputs: &HashMap<String, Tensor>) {
    let output = drafter.reads_target_output().and_then(|name| outputs.get(name));
    let Some(rows) = output.filter(|rows| rows.rows() == work.tokens.len()) else {
        return;
    };
    let kept = match work.samples {
        true => work.tokens.len() - work.drafts + accepted,
        false => work.tokens.len(),
    };
    let width = rows.row_len();
    let kept_rows = Tensor::new(vec![kept, width], rows.data[..kept * width].to_vec());
    drafter.observe(work.seq, work.start, &kept_rows);
}

/// The tokens a greedy sequence takes from the argmax `ids` of its sampled rows (one per
/// drafted token, then one after them): each drafted token while the argmax before it chose
/// it, then the argmax after the last one accepted, as decoding one token at a time would.
fn accept_greedy(drafted: &[u32], ids: &[u32]) -> Result<Vec<u32>> {
    if ids.len() < drafted.len() + 1 {
        return Err(RuntimeError::Graph(format!(
            "{} greedy tokens for a step verifying {} drafted tokens",
            ids.len(),
            drafted.len()
        )));
    }
    let accepted = drafted.iter().zip(ids).take_while(|(d, id)| d == id).count();
    Ok(ids[..=accepted].to_vec())
}

#[cfg(test)]
mod tests {
    use super::accept_greedy;

    /// Drafts are kept while the argmax before each chose it; the argmax after the last kept
    /// one follows (the next token, or the bonus token after all of them).
    #[test]
    fn greedy_verification_keeps_the_agreeing_drafts_and_the_token_after() {
        assert_eq!(accept_greedy(&[], &[7]).unwrap(), [7]);
        assert_eq!(accept_greedy(&[5, 6, 7], &[5, 6, 7, 8]).unwrap(), [5, 6, 7, 8]);
        assert_eq!(accept_greedy(&[5, 6, 7], &[5, 9, 7, 8]).unwrap(), [5, 9]);
        assert_eq!(accept_greedy(&[5, 6], &[4, 6, 1]).unwrap(), [4]);
        assert!(accept_greedy(&[5, 6], &[5, 6]).is_err(), "one id short");
    }
}
