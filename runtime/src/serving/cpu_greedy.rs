//! The CPU backend serving with two graphs of one model over one paged cache: the logits
//! graph for steps that sample, score or process logits, and the greedy graph (its head only
//! the argmax of each sampled row: the INT8-bound head where the head is f32 or bf16, which
//! reads a quarter of an f32 head's bytes) for steps whose requests all decode greedily, as
//! a GPU serving plan's `next_token` output serves them. Without a greedy graph it is the
//! logits graph alone.

use super::engine::{PagedBackend, StateSnapshotting};
use crate::error::{Result, RuntimeError};
use crate::kv::Segment;
use crate::{CpuBackend, KvPages};
use ir::Tensor;
use std::collections::HashMap;

pub struct CpuGreedyServing {
    logits: CpuBackend,
    greedy: Option<CpuBackend>,
}

impl CpuGreedyServing {
    /// `logits` and `greedy` must be graphs of one model (a `logits` output, and a
    /// `next_token` one): the same cache slots and recurrent states, so either runs over the
    /// other's pages. Without `greedy`, every step takes the logits graph.
    pub fn new(logits: CpuBackend, greedy: Option<CpuBackend>) -> Result<Self> {
        if logits.graph().output("logits").is_none() {
            return Err(RuntimeError::Graph("the graph has no `logits` output".into()));
        }
        if let Some(greedy) = &greedy {
            if !logits.shares_cache_with(greedy) {
                return Err(RuntimeError::Graph(
                    "the greedy graph caches positions or keeps states other than the logits graph does".into(),
                ));
            }
            if greedy.graph().output("next_token").is_none() {
                return Err(RuntimeError::Graph("the graph has no `next_token` output".into()));
            }
        }
        Ok(Self { logits, greedy })
    }

    /// The logits graph's backend (what the cache holds a position as, and so on).
    pub fn logits(&self) -> &CpuBackend {
        &self.logits
    }

    /// Whether greedy steps take the greedy graph.
    pub fn has_greedy_graph(&self) -> bool {
        self.greedy.is_some()
    }
}

impl PagedBackend for CpuGreedyServing {
    type Pages = KvPages;
    fn new_pages(&self, block_size: usize) -> KvPages {
        self.logits.new_pages(block_size)
    }
    fn has_recurrent_state(&self) -> bool {
        self.logits.has_recurrent_state()
    }
    fn snapshots_states(&self) -> StateSnapshotting {
        PagedBackend::snapshots_states(&self.logits)
    }
    fn samples_several_rows(&self) -> bool {
        PagedBackend::samples_several_rows(&self.logits)
    }
    fn verifies_drafts(&self) -> bool {
        PagedBackend::verifies_drafts(&self.logits)
    }
    fn max_drafts(&self) -> Option<usize> {
        PagedBackend::max_drafts(&self.logits)
    }
    fn rewind_state(&self, pages: &mut KvPages, state_slot: usize, sampled_rows: usize, kept: usize) -> Result<()> {
        PagedBackend::rewind_state(&self.logits, pages, state_slot, sampled_rows, kept)
    }
    fn step_batch(&self, pages: &mut KvPages, batch: &[Segment]) -> Result<Vec<HashMap<String, Tensor>>> {
        self.logits.step_batch(pages, batch)
    }
    /// The greedy graph's outputs: `next_token` of each sampled row, and every other output
    /// it has (those in `also` among them, or the step is not the greedy graph's to take).
    fn step_batch_greedy(
        &self,
        pages: &mut KvPages,
        batch: &[Segment],
        also: &[&str],
    ) -> Option<Result<Vec<HashMap<String, Tensor>>>> {
        let greedy = self.greedy.as_ref()?;
        if also.iter().any(|name| greedy.graph().output(name).is_none()) {
            return None;
        }
        Some(greedy.step_batch(pages, batch))
    }
}
