//! The serving loop: each step runs the scheduler's work on the backend, sequence by sequence
//! (the CPU backend computes one sequence per call; a batched step is the GPU backend's job),
//! samples where a sequence reached its last position, and reports new tokens and finished
//! sequences. Preempted sequences lose their cached state and recompute it when readmitted.
//!
//! On the CPU backend a sequence's keys and values live in its own contiguous cache; the block
//! manager accounts for them in blocks, so admission and preemption follow the configured KV
//! budget exactly, but blocks are not yet physical pages there (the GPU kernels take a block
//! table; see `kernels_gen::templates::cache_layout`).

use super::scheduler::{AddError, Finished, Scheduler, SchedulerConfig, SeqId};
use crate::error::{Result, RuntimeError};
use crate::generate::Backend;
use crate::sampling::{Sampler, SamplingParams, TokenLogprobs};
use ir::Tensor;
use std::collections::HashMap;

/// A token chosen this step.
#[derive(Debug)]
pub struct Sampled {
    pub seq: SeqId,
    pub token: u32,
    /// When the request asked for them.
    pub logprobs: Option<TokenLogprobs>,
}

/// What one step produced.
#[derive(Debug, Default)]
pub struct StepOutput {
    pub tokens: Vec<Sampled>,
    pub finished: Vec<Finished>,
}

pub struct ServingEngine<B: Backend> {
    backend: B,
    scheduler: Scheduler,
    states: HashMap<SeqId, B::Sequence>,
    samplers: HashMap<SeqId, Sampler>,
}

impl<B: Backend> ServingEngine<B> {
    pub fn new(backend: B, config: SchedulerConfig) -> Self {
        Self {
            backend,
            scheduler: Scheduler::new(config),
            states: HashMap::new(),
            samplers: HashMap::new(),
        }
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
        let sampler = Sampler::with_prompt(sampling, &prompt);
        let id = self.scheduler.add(prompt, max_tokens, stop_tokens)?;
        self.samplers.insert(id, sampler);
        Ok(id)
    }

    /// Drop a request (its client went away): its blocks and state are freed now.
    pub fn abort(&mut self, id: SeqId) -> bool {
        self.states.remove(&id);
        self.samplers.remove(&id);
        self.scheduler.abort(id)
    }

    /// Run one step of scheduled work.
    pub fn step(&mut self) -> Result<StepOutput> {
        self.step_while(|_| true)
    }

    /// Run one step, first asking `wanted` about each sequence before computing it: one that is
    /// no longer wanted (its client left) is aborted there, so a step over many sequences never
    /// spends time on a request nobody is waiting for.
    pub fn step_while(&mut self, mut wanted: impl FnMut(SeqId) -> bool) -> Result<StepOutput> {
        let schedule = self.scheduler.schedule();
        for id in &schedule.preempted {
            self.states.remove(id);
        }
        let mut out = StepOutput::default();
        for work in &schedule.work {
            if !wanted(work.seq) {
                self.abort(work.seq);
                continue;
            }
            let state = self
                .states
                .entry(work.seq)
                .or_insert_with(|| self.backend.new_sequence());
            let outputs = self.backend.step(state, &work.tokens)?;
            let sampled = match work.samples {
                true => Some(self.sample(work.seq, &outputs)?),
                false => None,
            };
            let token = sampled.as_ref().map(|s| s.token);
            out.tokens.extend(sampled);
            if let Some(done) = self.scheduler.complete(work, token) {
                self.states.remove(&done.seq);
                self.samplers.remove(&done.seq);
                out.finished.push(done);
            }
        }
        Ok(out)
    }

    /// Choose `seq`'s next token from the last row of the step's logits.
    fn sample(&mut self, seq: SeqId, outputs: &HashMap<String, Tensor>) -> Result<Sampled> {
        let logits = outputs
            .get("logits")
            .ok_or_else(|| RuntimeError::Graph("the graph has no `logits` output".into()))?;
        let row = logits.row(logits.rows() - 1);
        let sampler = self.samplers.get_mut(&seq).expect("every sequence has a sampler");
        let token = sampler.sample(row);
        let logprobs = sampler.params().logprobs.map(|top| TokenLogprobs::of(row, token, top));
        Ok(Sampled { seq, token, logprobs })
    }
}
