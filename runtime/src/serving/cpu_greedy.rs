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
    fn step_batch_greedy(&self, pages: &mut KvPages, batch: &[Segment]) -> Option<Result<Vec<Vec<u32>>>> {
        let ids = |(outputs, segment): (&HashMap<String, Tensor>, &Segment)| {
            let next = outputs
                .get("next_token")
                .ok_or_else(|| RuntimeError::Graph("the greedy graph returned no `next_token`".into()))?;
            let rows = next.data.len();
            if rows < segment.sampled_rows {
                return Err(RuntimeError::Graph(format!(
                    "{rows} greedy tokens for a segment sampling {} rows",
                    segment.sampled_rows
                )));
            }
            // Its sampled rows are the last ones.
            Ok(next.data[rows - segment.sampled_rows..]
                .iter()
                .map(|&id| id as u32)
                .collect())
        };
        let greedy = self.greedy.as_ref()?;
        Some(
            greedy
                .step_batch(pages, batch)
                .and_then(|outputs| outputs.iter().zip(batch).map(ids).collect()),
        )
    }
}
