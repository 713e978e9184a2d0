//! Continuous batching: which sequences compute which tokens in the next step.
//!
//! Policy, in one place (after nano-vllm): every step first serves the running sequences in
//! arrival order — a decode token, or the next chunk of a prompt — within a token budget; when
//! the cache has no block for one, the most recently admitted running sequence is preempted
//! (its blocks released, its tokens recomputed later: prompt and what it generated so far) and
//! put back at the head of the queue. Then waiting sequences are admitted while the budget,
//! the running limit and free blocks allow. The waiting queue is bounded: a request beyond it is
//! refused at once (the server answers 503).
//!
//! Under the priority policy (vLLM's `--scheduling-policy priority`) each sequence has a
//! priority (lower first), and both queues are kept in (priority, arrival) order: waiting
//! sequences are admitted in it, a preempted one going back to its place, and running ones are
//! served in it, so a prefill of lower priority never takes the budget from one of higher. The
//! sequence preempted is the running one last in that order, even one already given work this
//! step (its work is withdrawn and its tokens go back to the budget). A waiting sequence of
//! strictly higher priority than that one does not wait for it: where the running limit or the
//! cache keeps it out, it preempts running sequences of lower priority, last first, until it is
//! admitted (vLLM's scheduler waits for them to finish: a priority inversion, its issue #40004).
//! Equal priorities never preempt each other for admission, so two never take turns.
//!
//! Prefix caching: a sequence being admitted starts from the longest cached prefix of its
//! tokens in whole blocks (see [`BlockManager`]), but never all of them: its last token is
//! always computed, since its output chooses the next token. Each block a sequence fills is
//! registered as it completes, prompt and generated tokens alike, so a preempted sequence
//! readmitted soon after finds most of its work still cached.
//!
//! Models with recurrent layers (Gated DeltaNet) keep a state per sequence beside the KV cache:
//! each running sequence holds one of `max_running` state slots, given on admission and taken
//! back on preemption or removal. Such a state sums up the whole prefix, which cached blocks
//! do not hold, so for those models the prefix cache also keeps snapshots of states
//! ([`StateCache`]): a work that computes past a multiple of the snapshot interval saves the
//! state there, filed under that block's registration when the work completes, and a
//! sequence being admitted starts from cached blocks only as far as the deepest snapshot
//! along them, its work restoring that snapshot into its slot. Without a snapshot it starts
//! from position 0, where the backend starts its slot afresh.
//!
//! Speculative decoding: with `speculation` on, a decoding sequence's work carries, after its
//! last token, tokens drafted by prompt lookup ([`NgramConfig`]), within the token budget and
//! its `max_tokens`; the engine verifies them in the same pass and [`Scheduler::complete`]
//! keeps the accepted ones: the cache then holds positions up to the last accepted draft, and
//! what the rejected ones wrote is overwritten later (those blocks are the sequence's own).
//! Verifying a draft is not free (on a CPU it costs about a prompt token), so each sequence
//! drafts adaptively: one more token after a step that accepted all its drafts, as many as it
//! accepted after one that did not, and none for a few steps after one that accepted none.
//!
//! Invariants (checked by [`Scheduler::check`], property-tested): the block manager's (no block
//! free and owned, none owned twice, none leaked); a running sequence's table covers exactly
//! the positions it has cached, and every block it will write (from its first uncached
//! position on) is its alone; its registered chain covers exactly its full cached blocks;
//! waiting sequences hold no blocks; under the priority policy both queues are in (priority,
//! arrival) order; every sequence is in exactly one place; running sequences
//! hold distinct state slots, waiting ones none; every snapshot place is free, filed, or
//! pending in the work of exactly one running sequence, and every filed snapshot's block is
//! still registered.

use super::block_manager::{BlockId, BlockManager, Serial};
use super::ngram::{NgramConfig, NgramIndex};
use super::state_cache::{StateCache, StateCacheConfig};
use crate::kv::StateSave;
use std::collections::{BTreeMap, VecDeque};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Sequences waiting to start, at most.
    pub max_waiting: usize,
    /// Sequences running at once, at most.
    pub max_running: usize,
    /// Tokens computed per step, at most (decode tokens and prompt chunks together).
    pub token_budget: usize,
    pub kv_blocks: usize,
    pub block_size: usize,
    /// Positions a sequence may reach (prompt + generated).
    pub context_length: usize,
    /// Whether an admitted sequence may start from cached blocks of another's prefix.
    pub prefix_caching: bool,
    /// Drafting for speculative decoding (`NgramConfig::OFF` for none).
    pub speculation: NgramConfig,
    /// Whether the model keeps a recurrent state per sequence (the engine sets it from its
    /// backend): cached blocks are then shared only as far as a snapshot of the state.
    pub recurrent_state: bool,
    /// The snapshots of recurrent states the prefix cache keeps (`StateCacheConfig::OFF`:
    /// none, so a model with recurrent state shares no cached blocks).
    pub state_cache: StateCacheConfig,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddError {
    #[error("the waiting queue is full ({0} requests); retry later")]
    QueueFull(usize),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("This model's maximum context length is {limit} tokens. However, your request has {needed} tokens ({prompt} in the prompt, {max_tokens} to generate).")]
    TooLong {
        limit: usize,
        needed: usize,
        prompt: usize,
        max_tokens: usize,
    },
    #[error("the request can never fit the KV cache ({needed} blocks, {total} in all)")]
    NeverFits { needed: usize, total: usize },
    #[error("this model's compiled plan returns one row of logits per sequence, so it cannot score a prompt (compile it again for prompt log-probabilities)")]
    PromptLogprobsUnsupported,
}

#[derive(Debug, Clone)]
struct Seq {
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Positions whose keys and values are in the cache.
    cached: usize,
    table: Vec<BlockId>,
    /// Registration serials of the first full blocks of `table` (the prefix-cache keys' chain).
    chain: Vec<Serial>,
    max_tokens: usize,
    stop_tokens: Vec<u32>,
    /// The recurrent-state slot it holds while running.
    state_slot: Option<usize>,
    /// The snapshots its scheduled work saves, filed when that work completes.
    pending_saves: Vec<StateSave>,
    /// The prefix of the last snapshot it filed (demoted when it files the next).
    last_snapshot: Option<Serial>,
    /// Speculation: how many tokens it may draft next, and for how many more decode steps it
    /// drafts none (after a step whose drafts were all rejected).
    draft_len: usize,
    draft_pause: usize,
    /// How many forced tokens it may draft next: [`FORCED_DRAFTS_MOST`] at first, cut to what
    /// the model accepted after a refusal (a small model may spell the forced text its own
    /// way, and every refused draft is a row computed for nothing), doubled back after a step
    /// that accepted them all.
    forced_len: usize,
    /// Its tokens' n-grams, for prompt lookup (filled on its first lookup).
    ngrams: NgramIndex,
    /// Whether its admission may start it from cached blocks (not where every prompt row's
    /// output is wanted: a cached position is never computed).
    reads_prefix_cache: bool,
    /// Lower first, under the priority policy.
    priority: i32,
}

impl Seq {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

/// One sequence's share of a step: compute positions `start..end` of its tokens, keeping their
/// keys and values in the blocks of `table`; when `end` is the last position, the step's output
/// there chooses its next token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Work {
    pub seq: SeqId,
    pub start: usize,
    pub end: usize,
    pub tokens: Vec<u32>,
    pub table: Vec<BlockId>,
    pub samples: bool,
    /// The sequence's recurrent-state slot (see the module's notes).
    pub state_slot: usize,
    /// How many of `tokens` (the last ones) are drafted, not yet the sequence's: the engine
    /// samples at each of the last `drafts + 1` positions and keeps drafts while they agree.
    pub drafts: usize,
    /// The recurrent-state snapshot its state starts from (a sequence admitted onto cached
    /// blocks of a model with recurrent state).
    pub restore: Option<usize>,
    /// The snapshots of its recurrent state it saves, ascending.
    pub saves: Vec<StateSave>,
    /// Whether its drafts are forced ones ([`Scheduler::offer_forced_drafts`]), which leave
    /// the sequence's speculation (its draft length, its pauses) as it was.
    pub forced: bool,
}

impl Work {
    /// The drafted tokens it carries (its last `drafts`).
    pub fn drafted(&self) -> &[u32] {
        &self.tokens[self.tokens.len() - self.drafts..]
    }

    /// Of `taken` tokens the sequence took from this work, the drafts accepted: all but the
    /// last (the token after them, computed next), at most the drafts it carried.
    pub fn accepted(&self, taken: usize) -> usize {
        taken.saturating_sub(1).min(self.drafts)
    }
}

/// Prefix-cache effect so far, in tokens (vLLM's `prefix_cache_queries` and `_hits`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Tokens looked up on admission.
    pub queried: u64,
    /// Of those, tokens found cached (not computed).
    pub hit: u64,
}

/// What a step's schedule is: the work, and the sequences whose cached state was dropped.
#[derive(Debug, Default)]
pub struct Schedule {
    pub work: Vec<Work>,
    pub preempted: Vec<SeqId>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    pub seq: SeqId,
    pub generated: Vec<u32>,
    pub reason: FinishReason,
}

/// The order waiting sequences are admitted in and preempted by (vLLM's `--scheduling-policy`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SchedulingPolicy {
    /// First come, first served; the newest running sequence is preempted.
    #[default]
    Fcfs,
    /// By each sequence's priority (lower first), then arrival; the running sequence last in
    /// that order is preempted, for the blocks of a running one or to admit a waiting one of
    /// strictly higher priority.
    Priority,
}

/// Decode steps a sequence drafts nothing after its drafts were all rejected.
const DRAFT_PAUSE: usize = 4;

/// The most forced drafts a step verifies for one sequence: a grammar's forced text is rarely
/// longer, and every draft is a row the step computes.
pub const FORCED_DRAFTS_MOST: usize = 16;

pub struct Scheduler {
    config: SchedulerConfig,
    blocks: BlockManager,
    waiting: VecDeque<SeqId>,
    /// In admission order, or under the priority policy in (priority, arrival) order: the
    /// order they are served in each step, the last preempted first.
    running: Vec<SeqId>,
    seqs: BTreeMap<SeqId, Seq>,
    next_id: u64,
    prefix_cache: PrefixCacheStats,
    /// State slots no running sequence holds (lowest last, handed out first).
    free_state_slots: Vec<usize>,
    /// Snapshots of recurrent states for the prefix cache.
    states: StateCache,
    /// Drafts offered for the next step (a draft model's, see [`Scheduler::offer_drafts`]),
    /// taken there instead of prompt lookup's.
    offered: Option<BTreeMap<SeqId, Vec<u32>>>,
    /// Forced drafts for the next step (see [`Scheduler::offer_forced_drafts`]).
    forced: BTreeMap<SeqId, Vec<u32>>,
    policy: SchedulingPolicy,
    /// Drafted tokens (of any kind) one sequence may carry in a step, at most (see
    /// [`Scheduler::cap_drafts`]).
    max_drafts: usize,
    /// Speculation pauses while more sequences than this run (see
    /// [`Scheduler::speculate_up_to`]).
    speculating_batch: usize,
}

/// A decoding sequence that may carry drafted tokens in the next step: its tokens so far, and
/// at most how many to draft after them (see [`Scheduler::draft_requests`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraftRequest<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    pub limit: usize,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Self {
        Self {
            config,
            blocks: BlockManager::new(config.kv_blocks, config.block_size),
            waiting: VecDeque::new(),
            running: Vec::new(),
            seqs: BTreeMap::new(),
            next_id: 0,
            prefix_cache: PrefixCacheStats::default(),
            free_state_slots: (0..config.max_running).rev().collect(),
            // No more snapshots than blocks to file them under.
            states: StateCache::new(
                StateCacheConfig {
                    capacity: config.state_cache.capacity.min(config.kv_blocks),
                    ..config.state_cache
                },
                config.block_size,
            ),
            offered: None,
            forced: BTreeMap::new(),
            policy: SchedulingPolicy::Fcfs,
            max_drafts: usize::MAX,
            speculating_batch: usize::MAX,
        }
    }

    /// Draft (prompt lookup, a draft model or head) only while at most `sequences` run, as
    /// vLLM's `disable_by_batch_size`: a large batch is bound by arithmetic, where verifying
    /// drafts costs as much as the tokens it may save. A grammar's forced drafts still go.
    pub fn speculate_up_to(&mut self, sequences: usize) {
        self.speculating_batch = sequences;
    }

    /// Let no sequence carry more than `most` drafted tokens in a step, whatever proposed them
    /// (prompt lookup, a draft model, a grammar's forced text): where the backend keeps
    /// something per draft in a fixed number of places (a GPU plan's recurrent-state
    /// checkpoints). The engine sets it from its backend.
    pub fn cap_drafts(&mut self, most: usize) {
        self.max_drafts = most;
    }

    /// Order the queue and choose whom to preempt by `policy` from now on (set it before
    /// adding anything: a queue already ordered otherwise is refused).
    pub fn set_policy(&mut self, policy: SchedulingPolicy) -> bool {
        if !self.seqs.is_empty() {
            return false;
        }
        self.policy = policy;
        true
    }

    pub fn policy(&self) -> SchedulingPolicy {
        self.policy
    }

    /// Drafted tokens one sequence may carry in a step, at most (`usize::MAX` for no cap).
    pub fn draft_cap(&self) -> usize {
        self.max_drafts
    }

    /// The configuration in force (the engine may have narrowed the one it was given).
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn used_blocks(&self) -> usize {
        self.blocks.used_blocks()
    }

    /// Blocks nobody holds that still cache a prefix (reusable, or evicted when needed).
    pub fn cached_blocks(&self) -> usize {
        self.blocks.cached_blocks()
    }

    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.prefix_cache
    }

    /// Recurrent-state snapshots the prefix cache holds now.
    pub fn state_snapshots(&self) -> usize {
        self.states.filed()
    }

    /// Whether an admitted sequence may start from cached blocks: with the prefix cache on,
    /// and for a model with recurrent state where snapshots of it are kept.
    fn shares_prefixes(&self) -> bool {
        self.config.prefix_caching && (!self.config.recurrent_state || self.states.is_on())
    }

    /// Whether works save snapshots of their recurrent states.
    fn saves_states(&self) -> bool {
        self.config.prefix_caching && self.config.recurrent_state && self.states.is_on()
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Whether sequence `id` is running (admitted, not waiting or gone).
    pub fn is_running(&self, id: SeqId) -> bool {
        self.running.contains(&id)
    }

    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Queue a request; refused at once when the queue is full or it can never run.
    pub fn add(&mut self, prompt: Vec<u32>, max_tokens: usize, stop_tokens: Vec<u32>) -> Result<SeqId, AddError> {
        self.add_with_priority(prompt, max_tokens, stop_tokens, 0)
    }

    /// [`add`](Self::add) with a priority (lower first), which orders the queue under the
    /// priority policy and is ignored otherwise.
    pub fn add_with_priority(
        &mut self,
        prompt: Vec<u32>,
        max_tokens: usize,
        stop_tokens: Vec<u32>,
        priority: i32,
    ) -> Result<SeqId, AddError> {
        if prompt.is_empty() {
            return Err(AddError::EmptyPrompt);
        }
        let needed = prompt.len() + max_tokens;
        if needed > self.config.context_length {
            return Err(AddError::TooLong {
                limit: self.config.context_length,
                needed,
                prompt: prompt.len(),
                max_tokens,
            });
        }
        // The last generated token is never cached: positions up to needed − 1.
        let blocks = self.blocks.blocks_for(needed - 1);
        if blocks > self.blocks.total() {
            return Err(AddError::NeverFits {
                needed: blocks,
                total: self.blocks.total(),
            });
        }
        if self.waiting.len() >= self.config.max_waiting {
            return Err(AddError::QueueFull(self.config.max_waiting));
        }
        let id = SeqId(self.next_id);
        self.next_id += 1;
        let prompt_len = prompt.len();
        self.seqs.insert(
            id,
            Seq {
                tokens: prompt,
                prompt_len,
                cached: 0,
                table: Vec::new(),
                chain: Vec::new(),
                max_tokens,
                stop_tokens,
                state_slot: None,
                pending_saves: Vec::new(),
                last_snapshot: None,
                draft_len: self.config.speculation.tokens,
                draft_pause: 0,
                forced_len: FORCED_DRAFTS_MOST,
                ngrams: NgramIndex::default(),
                reads_prefix_cache: true,
                priority,
            },
        );
        self.enqueue(id, false);
        Ok(id)
    }

    /// Put `id` in the queue: last (or, `preempted`, first) under first come first served,
    /// at its place in (priority, arrival) order under the priority policy.
    fn enqueue(&mut self, id: SeqId, preempted: bool) {
        match self.policy {
            SchedulingPolicy::Fcfs if preempted => self.waiting.push_front(id),
            SchedulingPolicy::Fcfs => self.waiting.push_back(id),
            SchedulingPolicy::Priority => {
                let key = self.queue_key(id);
                let at = self.waiting.partition_point(|&w| self.queue_key(w) < key);
                self.waiting.insert(at, id);
            }
        }
    }

    /// A sequence's place in the priority policy's order (ids grow with arrival).
    fn queue_key(&self, id: SeqId) -> (i32, SeqId) {
        (self.seqs[&id].priority, id)
    }

    /// The running sequence to preempt for blocks: the last running, which is the newest, or
    /// under the priority policy the last in (priority, arrival) order.
    fn preemption_victim(&self) -> SeqId {
        *self.running.last().expect("a sequence runs")
    }

    /// The running sequence waiting sequence `id` may preempt to be admitted: under the
    /// priority policy, the last running one if its priority is strictly lower than `id`'s.
    fn displaceable_by(&self, id: SeqId) -> Option<SeqId> {
        let victim = *self.running.last()?;
        let lower = self.seqs[&victim].priority > self.seqs[&id].priority;
        (self.policy == SchedulingPolicy::Priority && lower).then_some(victim)
    }

    /// Preempt running sequence `victim` during a step being scheduled: its work, if it was
    /// given one already, is withdrawn and its tokens go back to `budget`.
    fn preempt_in_step(&mut self, victim: SeqId, budget: &mut usize, out: &mut Schedule) {
        self.preempt(victim);
        out.preempted.push(victim);
        if let Some(w) = out.work.iter().position(|w| w.seq == victim) {
            let withdrawn = out.work.remove(w);
            *budget += withdrawn.end - withdrawn.start;
        }
    }

    /// Compute every position of waiting sequence `id`'s prompt whenever it is admitted,
    /// none taken from the prefix cache (its blocks are still filed there for others): for a
    /// request that wants an output at each prompt row. False where no such sequence waits.
    pub fn compute_whole_prompt(&mut self, id: SeqId) -> bool {
        match self.seqs.get_mut(&id) {
            Some(seq) if self.waiting.contains(&id) => {
                seq.reads_prefix_cache = false;
                true
            }
            _ => false,
        }
    }

    /// The running sequences that would carry drafts in the next step if drafts were to be
    /// had (decoding, not pausing their drafting), each with the most it may carry (its own
    /// draft length, and room for every draft accepted plus the token after them within its
    /// `max_tokens`). The step may carry fewer where its token budget or free blocks run out.
    pub fn draft_requests(&self) -> Vec<DraftRequest<'_>> {
        self.running
            .iter()
            .map(|id| (*id, &self.seqs[id]))
            .filter_map(|(id, seq)| {
                let limit = self.draft_limit(seq);
                (limit > 0).then_some(DraftRequest {
                    seq: id,
                    tokens: &seq.tokens,
                    limit,
                })
            })
            .collect()
    }

    /// Drafts for the next [`schedule`](Self::schedule), by sequence, proposed for
    /// [`draft_requests`](Self::draft_requests) (a draft model's): that step takes these,
    /// cut to what it can carry, instead of prompt lookup's, and none for a sequence missing
    /// here. They are for that step only.
    pub fn offer_drafts(&mut self, drafts: BTreeMap<SeqId, Vec<u32>>) {
        self.offered = Some(drafts);
    }

    /// Drafts for the next [`schedule`](Self::schedule) that their proposer is all but sure
    /// of (the text a sequence's grammar forces): a decoding sequence carries them, cut to
    /// [`FORCED_DRAFTS_MOST`] and what the step and its `max_tokens` have room for, in place of
    /// its speculation's drafts, whether speculation is on or not. They are for that step only.
    pub fn offer_forced_drafts(&mut self, drafts: BTreeMap<SeqId, Vec<u32>>) {
        self.forced = drafts;
    }

    /// Decide the next step.
    pub fn schedule(&mut self) -> Schedule {
        let schedule = self.schedule_work();
        self.offered = None;
        self.forced.clear();
        schedule
    }

    fn schedule_work(&mut self) -> Schedule {
        let mut out = Schedule::default();
        let mut budget = self.config.token_budget;
        self.states.begin_step();
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let seq = &self.seqs[&id];
            let end = self.chunk_end(seq.cached, seq.cached + (seq.tokens.len() - seq.cached).min(budget));
            let n = end - seq.cached;
            let (mut drafts, forced) = self.drafts(id, budget);
            let mut table = std::mem::take(&mut self.seqs.get_mut(&id).expect("running").table);
            // Drafts only where blocks are free for them: never preempt for a guess.
            if !drafts.is_empty() && self.grow(&mut table, end + drafts.len()).is_err() {
                drafts.clear();
            }
            match self.grow(&mut table, end) {
                Ok(()) => {
                    self.seqs.get_mut(&id).expect("running").table = table;
                    budget -= n + drafts.len();
                    let mut work = self.work(id, end, drafts, None);
                    work.forced = forced && work.drafts > 0;
                    out.work.push(work);
                    i += 1;
                }
                Err(_) => {
                    self.seqs.get_mut(&id).expect("running").table = table;
                    // Free memory from the newest running sequence, or the lowest priority
                    // one (possibly this one).
                    let victim = self.preemption_victim();
                    let at = self.running.iter().position(|&r| r == victim).expect("running");
                    self.preempt_in_step(victim, &mut budget, &mut out);
                    if at < i {
                        i -= 1;
                    }
                }
            }
        }
        while budget > 0 {
            let Some(&id) = self.waiting.front() else { break };
            if self.running.len() < self.config.max_running && self.admit(id, &mut budget, &mut out) {
                continue;
            }
            // Kept out by the running limit or the cache: it may take a lower priority's place.
            match self.displaceable_by(id) {
                Some(victim) => self.preempt_in_step(victim, &mut budget, &mut out),
                None => break,
            }
        }
        out
    }

    /// Start waiting sequence `id` from its longest cached prefix and schedule its next chunk;
    /// false when the cache cannot hold that chunk (the sequence stays waiting and the shared
    /// blocks go back to the cache).
    fn admit(&mut self, id: SeqId, budget: &mut usize, out: &mut Schedule) -> bool {
        let Some(&slot) = self.free_state_slots.last() else {
            return false;
        };
        let seq = &self.seqs[&id];
        let mut table = Vec::new();
        // All but the last token may come from the cache: the last one's output is the point.
        let reads_cache = self.shares_prefixes() && seq.reads_prefix_cache;
        let mut chain = match reads_cache {
            true => self
                .blocks
                .share_prefix(&mut table, &seq.tokens[..seq.tokens.len() - 1]),
            false => Vec::new(),
        };
        // A recurrent state goes only as far as the deepest snapshot of it.
        let mut restore = None;
        if self.config.recurrent_state {
            let deepest = self.states.deepest(&chain);
            let depth = deepest.map_or(0, |(blocks, _)| blocks);
            self.blocks.release(&mut table.split_off(depth));
            chain.truncate(depth);
            restore = deepest.map(|(_, place)| place);
        }
        let cached = chain.len() * self.blocks.block_size();
        let n = self.chunk_end(cached, cached + (seq.tokens.len() - cached).min(*budget)) - cached;
        if self.grow(&mut table, cached + n).is_err() {
            self.blocks.release(&mut table);
            return false;
        }
        if restore.is_some() {
            self.states.restore(*chain.last().expect("a snapshot covers a block"));
        }
        let seq = self.seqs.get_mut(&id).expect("waiting");
        // A sequence that computes its whole prompt looks nothing up.
        if seq.reads_prefix_cache {
            self.prefix_cache.queried += seq.tokens.len() as u64;
            self.prefix_cache.hit += cached as u64;
        }
        seq.table = table;
        seq.chain = chain;
        seq.cached = cached;
        seq.state_slot = self.free_state_slots.pop();
        debug_assert_eq!(seq.state_slot, Some(slot));
        self.waiting.pop_front();
        self.start_running(id);
        let work = self.work(id, cached + n, Vec::new(), restore);
        out.work.push(work);
        *budget -= n;
        true
    }

    /// Add `id` to the running sequences: last, or under the priority policy at its place in
    /// (priority, arrival) order.
    fn start_running(&mut self, id: SeqId) {
        let at = match self.policy {
            SchedulingPolicy::Fcfs => self.running.len(),
            SchedulingPolicy::Priority => {
                let key = self.queue_key(id);
                self.running.partition_point(|&r| self.queue_key(r) < key)
            }
        };
        self.running.insert(at, id);
    }

    /// Grow `table` to hold `tokens` positions (see [`BlockManager::grow`]); snapshots filed
    /// under blocks evicted for it are let go, since nothing can reach them now.
    fn grow(&mut self, table: &mut Vec<BlockId>, tokens: usize) -> Result<(), super::OutOfBlocks> {
        let grown = self.blocks.grow(table, tokens);
        for serial in self.blocks.take_evicted() {
            self.states.forget(serial);
        }
        grown
    }

    /// How many tokens `seq` may draft after its last one: none unless speculation is on, not
    /// paused for it, and the batch is within [`speculate_up_to`](Self::speculate_up_to)'s;
    /// at most its draft length, within its [`draft_room`](Self::draft_room).
    fn draft_limit(&self, seq: &Seq) -> usize {
        let speculating = self.config.speculation.is_on() && self.running.len() <= self.speculating_batch;
        match speculating && seq.draft_pause == 0 {
            true => self.draft_room(seq).min(seq.draft_len),
            false => 0,
        }
    }

    /// The most drafts of any kind `seq` may carry after its last token: none unless it
    /// decodes; so many that every draft accepted plus the token sampled after them stays
    /// within its `max_tokens`, and no more than [`cap_drafts`](Self::cap_drafts) allows.
    fn draft_room(&self, seq: &Seq) -> usize {
        let decoding = seq.tokens.len() - seq.cached == 1;
        match decoding {
            true => seq.max_tokens.saturating_sub(seq.generated() + 1).min(self.max_drafts),
            false => 0,
        }
    }

    /// Tokens to draft after sequence `id`'s last one, within the step's `budget` (its own
    /// token first), and whether they are forced: the forced drafts offered for it, within its
    /// forced draft length and [`draft_room`](Self::draft_room); else, within its
    /// [`draft_limit`](Self::draft_limit), those offered for it where drafts were offered,
    /// else prompt lookup's.
    fn drafts(&mut self, id: SeqId, budget: usize) -> (Vec<u32>, bool) {
        let seq = &self.seqs[&id];
        if let Some(mut forced) = self.forced.remove(&id) {
            forced.truncate(self.draft_room(seq).min(seq.forced_len).min(budget - 1));
            if !forced.is_empty() {
                return (forced, true);
            }
        }
        let limit = self.draft_limit(seq).min(budget - 1);
        let drafts = match self.offered.as_mut() {
            Some(offered) => {
                let mut drafts = offered.remove(&id).unwrap_or_default();
                drafts.truncate(limit);
                drafts
            }
            None => {
                let seq = self.seqs.get_mut(&id).expect("scheduled");
                self.config
                    .speculation
                    .propose_indexed(&seq.tokens, &mut seq.ngrams, limit)
            }
        };
        (drafts, false)
    }

    /// The work computing `seq`'s positions from its first uncached one to `end`, then `drafts`,
    /// its recurrent state starting from snapshot `restore` where given; it saves a snapshot
    /// at each multiple of the interval it computes, where a place is to be had.
    fn work(&mut self, id: SeqId, end: usize, drafts: Vec<u32>, restore: Option<usize>) -> Work {
        let start = self.seqs[&id].cached;
        let saves = match self.saves_states() {
            // Where states are saved only at a work's end, none before drafts.
            true if self.config.state_cache.at_segment_ends => match drafts.is_empty() {
                true => self.take_save_places(end - 1, end),
                false => Vec::new(),
            },
            true => self.take_save_places(start, end),
            false => Vec::new(),
        };
        let seq = self.seqs.get_mut(&id).expect("scheduled");
        // Saves of an earlier work whose result never came back (a failed step) are void.
        for save in std::mem::replace(&mut seq.pending_saves, saves.clone()) {
            self.states.discard(save.snapshot);
        }
        let seq = &self.seqs[&id];
        let mut tokens = seq.tokens[seq.cached..end].to_vec();
        let count = drafts.len();
        tokens.extend(drafts);
        Work {
            seq: id,
            start: seq.cached,
            end: end + count,
            tokens,
            table: seq.table.clone(),
            samples: end == seq.tokens.len(),
            state_slot: seq.state_slot.expect("running sequences hold a state slot"),
            drafts: count,
            restore,
            saves,
            forced: false,
        }
    }

    /// Where a chunk of a sequence's positions from `start` to at most `end` ends: at `end`,
    /// but where states are saved only at a work's end and `end` is no multiple of the
    /// snapshot interval, at the last one before it (when there is one past `start`), so the
    /// chunk's state is saved there.
    fn chunk_end(&self, start: usize, end: usize) -> usize {
        let interval = self.states.interval();
        if !(self.saves_states() && self.config.state_cache.at_segment_ends) || end.is_multiple_of(interval) {
            return end;
        }
        match end / interval * interval {
            boundary if boundary > start => boundary,
            _ => end,
        }
    }

    /// Places for the snapshots after every multiple of the interval in `start + 1..=end`,
    /// while places are to be had.
    fn take_save_places(&mut self, start: usize, end: usize) -> Vec<StateSave> {
        let interval = self.states.interval();
        let boundaries = (start / interval + 1..).map(|k| k * interval).take_while(|&p| p <= end);
        boundaries
            .map_while(|positions| self.states.take().map(|snapshot| StateSave { positions, snapshot }))
            .collect()
    }

    /// File the snapshots `id`'s completed work saved, each under the registration of the
    /// last block it covers.
    fn file_saves(&mut self, id: SeqId) {
        let seq = self.seqs.get_mut(&id).expect("running");
        let size = self.blocks.block_size();
        for save in std::mem::take(&mut seq.pending_saves) {
            let serial = seq.chain[save.positions / size - 1];
            self.states.file(serial, save.snapshot, seq.last_snapshot);
            seq.last_snapshot = Some(serial);
        }
    }

    /// Free the snapshot places `seq`'s scheduled work would have saved into.
    fn discard_saves(states: &mut StateCache, seq: &mut Seq) {
        for save in seq.pending_saves.drain(..) {
            states.discard(save.snapshot);
        }
    }

    fn preempt(&mut self, id: SeqId) {
        let seq = self.seqs.get_mut(&id).expect("running");
        self.blocks.release(&mut seq.table);
        seq.chain.clear();
        seq.cached = 0;
        Self::discard_saves(&mut self.states, seq);
        self.free_state_slots.extend(seq.state_slot.take());
        self.running.retain(|&r| r != id);
        self.enqueue(id, true);
    }

    /// Record that `work` ran; `sampled` are the tokens chosen where it samples: the drafts it
    /// accepted, then the token after them (empty where it does not sample). Tokens after one
    /// that finishes the sequence are dropped. Returns how many of `sampled` the sequence took,
    /// and how it finished if it did.
    pub fn complete(&mut self, work: &Work, sampled: &[u32]) -> (usize, Option<Finished>) {
        let Some(seq) = self.seqs.get_mut(&work.seq) else {
            return (0, None);
        };
        if seq.cached != work.start {
            // Preempted or replaced since it was scheduled: the result is stale.
            return (0, None);
        }
        let mut reason = None;
        let mut taken: usize = 0;
        if work.samples {
            for &token in sampled.iter().take(work.drafts + 1) {
                seq.tokens.push(token);
                taken += 1;
                if seq.stop_tokens.contains(&token) {
                    reason = Some(FinishReason::Stop);
                } else if seq.generated() >= seq.max_tokens {
                    reason = Some(FinishReason::Length);
                }
                if reason.is_some() {
                    break;
                }
            }
        }
        // The positions computed and kept: the work's own tokens and the accepted drafts.
        let accepted = work.accepted(taken);
        seq.cached = work.end - work.drafts + accepted;
        if work.forced {
            seq.forced_len = match accepted == work.drafts {
                true => (2 * seq.forced_len).min(FORCED_DRAFTS_MOST),
                false => accepted.max(1),
            };
        }
        if work.samples && (work.drafts == 0 || work.forced) {
            seq.draft_pause = seq.draft_pause.saturating_sub(1);
        } else if work.drafts > 0 {
            let most = self.config.speculation.tokens;
            (seq.draft_len, seq.draft_pause) = match accepted {
                0 => (1, DRAFT_PAUSE),
                a if a == work.drafts => ((a + 1).min(most), 0),
                a => (a, 0),
            };
        }
        self.register_full_blocks(work.seq);
        self.file_saves(work.seq);
        let Some(reason) = reason else {
            return (taken, None);
        };
        let seq = &self.seqs[&work.seq];
        let generated = seq.tokens[seq.prompt_len..].to_vec();
        self.remove(work.seq);
        let done = Finished {
            seq: work.seq,
            generated,
            reason,
        };
        (taken, Some(done))
    }

    /// Register every block of `id` that its cached positions now fill, so that later
    /// sequences with the same prefix (or this one, readmitted after preemption) reuse it.
    fn register_full_blocks(&mut self, id: SeqId) {
        let seq = self.seqs.get_mut(&id).expect("running");
        let size = self.blocks.block_size();
        while (seq.chain.len() + 1) * size <= seq.cached {
            let i = seq.chain.len();
            let serial = self.blocks.register(
                seq.table[i],
                seq.chain.last().copied(),
                &seq.tokens[i * size..(i + 1) * size],
            );
            seq.chain.push(serial);
        }
    }

    /// Drop a sequence wherever it is (a client went away); its blocks are free at once.
    pub fn abort(&mut self, id: SeqId) -> bool {
        self.seqs.contains_key(&id) && {
            self.remove(id);
            true
        }
    }

    fn remove(&mut self, id: SeqId) {
        if let Some(mut seq) = self.seqs.remove(&id) {
            Self::discard_saves(&mut self.states, &mut seq);
            self.blocks.release(&mut seq.table);
            self.free_state_slots.extend(seq.state_slot);
        }
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&w| w != id);
    }

    /// Check the invariants above; the first violation, if any.
    pub fn check(&self) -> Result<(), String> {
        self.blocks.check(self.seqs.values().map(|s| s.table.as_slice()))?;
        for (id, seq) in &self.seqs {
            let places =
                self.running.iter().filter(|&&r| r == *id).count() + self.waiting.iter().filter(|&&w| w == *id).count();
            if places != 1 {
                return Err(format!("{id:?} is in {places} places"));
            }
            if self.waiting.contains(id) && !(seq.table.is_empty() && seq.chain.is_empty()) {
                return Err(format!("waiting {id:?} holds blocks"));
            }
            if self.waiting.contains(id) && !seq.pending_saves.is_empty() {
                return Err(format!("waiting {id:?} holds snapshot places"));
            }
            let size = self.blocks.block_size();
            if self.running.contains(id) && seq.chain.len() != seq.cached / size {
                return Err(format!(
                    "{id:?} caches {} positions but its chain has {} blocks",
                    seq.cached,
                    seq.chain.len()
                ));
            }
            let unwritten = seq.table.get(seq.cached / size..).unwrap_or_default();
            if let Some(shared) = unwritten.iter().find(|&&b| self.blocks.holders(b) != 1) {
                return Err(format!("{id:?} will write {shared:?}, which it shares"));
            }
            if self.running.contains(id) && seq.table.len() < self.blocks.blocks_for(seq.cached) {
                return Err(format!(
                    "{id:?} caches {} positions in {} blocks",
                    seq.cached,
                    seq.table.len()
                ));
            }
        }
        if self.running.len() + self.waiting.len() != self.seqs.len() {
            return Err("a queue holds an unknown sequence".into());
        }
        if self.policy == SchedulingPolicy::Priority {
            let waiting: Vec<SeqId> = self.waiting.iter().copied().collect();
            for (queue, verb) in [(&waiting, "waits"), (&self.running, "runs")] {
                let keys: Vec<(i32, SeqId)> = queue.iter().map(|&id| self.queue_key(id)).collect();
                if let Some(pair) = keys.windows(2).find(|pair| pair[0] > pair[1]) {
                    return Err(format!("{:?} {verb} ahead of {:?}", pair[0], pair[1]));
                }
            }
        }
        let pending = self
            .seqs
            .values()
            .flat_map(|s| s.pending_saves.iter().map(|save| save.snapshot));
        self.states.check(pending)?;
        if let Some(serial) = self.states.filed_serials().find(|&s| !self.blocks.is_registered(s)) {
            return Err(format!("a snapshot is filed under {serial:?}, whose block was evicted"));
        }
        self.check_state_slots()
    }

    /// Running sequences hold distinct state slots, waiting ones none, and every slot is
    /// either held or free.
    fn check_state_slots(&self) -> Result<(), String> {
        let mut held: Vec<usize> = self.free_state_slots.clone();
        for (id, seq) in &self.seqs {
            match (self.running.contains(id), seq.state_slot) {
                (true, Some(slot)) => held.push(slot),
                (false, None) => {}
                (running, slot) => return Err(format!("{id:?} (running: {running}) holds state slot {slot:?}")),
            }
        }
        held.sort_unstable();
        if held != (0..self.config.max_running).collect::<Vec<_>>() {
            return Err(format!("state slots held or free: {held:?}"));
        }
        Ok(())
    }
}
