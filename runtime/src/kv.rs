//! How the paged KV cache is addressed, shared by the block manager (which hands blocks out)
//! and the backends (which keep keys and values in them): position `p` of a sequence lives in
//! block `table[p / block_size]`, at row `p % block_size` of that block.

use crate::error::{Result, RuntimeError};
use std::ops::Range;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// One sequence's share of a batched step: its tokens at positions `start..start + ids.len()`,
/// whose keys and values go to (and whose attention reads from) the blocks of `table`.
#[derive(Debug, Clone, Copy)]
pub struct Segment<'a> {
    pub table: &'a [BlockId],
    pub start: usize,
    pub ids: &'a [u32],
    /// Where the sequence keeps the recurrent state of its Gated DeltaNet layers (models
    /// without them ignore it): sequences in one step have different slots, and a segment that
    /// starts at position 0 starts its slot's state afresh.
    pub state_slot: usize,
    /// How many of the segment's last rows the step's per-sequence outputs (after
    /// `last_token`) hold: 1, or 1 + the drafted tokens the engine verifies in one pass.
    pub sampled_rows: usize,
}

impl Segment<'_> {
    /// One past the last position this segment computes.
    pub fn end(&self) -> usize {
        self.start + self.ids.len()
    }

    /// Its rows sampled from are some of its own: 1 to all of them.
    pub fn check_sampled_rows(&self) -> Result<()> {
        match (1..=self.ids.len()).contains(&self.sampled_rows) {
            true => Ok(()),
            false => Err(RuntimeError::Input(format!(
                "a segment of {} tokens cannot sample {} rows",
                self.ids.len(),
                self.sampled_rows
            ))),
        }
    }
}

/// Each segment's rows of a step's outputs that hold only the rows sampled from (from
/// `last_token` on): consecutive, segment after segment.
pub fn sampled_ranges(batch: &[Segment]) -> Vec<Range<usize>> {
    let mut ranges: Vec<Range<usize>> = Vec::with_capacity(batch.len());
    for seg in batch {
        let first = ranges.last().map_or(0, |r| r.end);
        ranges.push(first..first + seg.sampled_rows);
    }
    ranges
}

/// For a model with recurrent state: no two sequences of a step share a state slot (their
/// states would mix), and each slot is one of the backend's `slots` where it keeps a fixed
/// number.
pub fn check_state_slots(batch: &[Segment], slots: Option<usize>) -> Result<()> {
    let mut used: Vec<usize> = Vec::with_capacity(batch.len());
    for seg in batch {
        let slot = seg.state_slot;
        if let Some(slots) = slots.filter(|&n| slot >= n) {
            return Err(RuntimeError::Input(format!(
                "recurrent state slot {slot} is past the plan's {slots} (its most sequences at once)"
            )));
        }
        if used.contains(&slot) {
            return Err(RuntimeError::Input(format!(
                "two sequences of one step share recurrent state slot {slot}"
            )));
        }
        used.push(slot);
    }
    Ok(())
}

/// The cache row holding position `pos` of the sequence with block table `table`.
pub fn cache_row(table: &[BlockId], block_size: usize, pos: usize) -> usize {
    table[pos / block_size].0 as usize * block_size + pos % block_size
}
