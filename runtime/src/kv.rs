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
    /// `last_token`) hold: 1, 1 + the drafted tokens the engine verifies in one pass, or more
    /// where it also wants the logits of prompt rows (a request's prompt log-probabilities).
    pub sampled_rows: usize,
    /// How many of those rows, the last ones, carry drafted tokens being verified: a model
    /// with recurrent state keeps its state after each sampled row before them, to rewind a
    /// refused draft to. Less than `sampled_rows`.
    pub drafts: usize,
    /// Where its recurrent state starts from and where copies of it are kept (the prefix
    /// cache of models with recurrent state); [`StateSnapshots::NONE`] elsewhere.
    pub snapshots: StateSnapshots<'a>,
    /// Another model's hidden state at each of its tokens, row after row, for a graph that
    /// reads them (a multi-token prediction head); empty for every other graph.
    pub hidden_states: &'a [f32],
}

/// A segment's use of recurrent-state snapshots: copies of a sequence's state after a number
/// of positions, kept in numbered places beside the state slots, so that another sequence
/// with the same prefix can start from one instead of computing the prefix.
#[derive(Debug, Clone, Copy, Default)]
pub struct StateSnapshots<'a> {
    /// Start the segment's state from this snapshot (the state after its first `start`
    /// positions) instead of continuing its slot's.
    pub restore: Option<usize>,
    /// Copies of the state to keep as it stands after some of the segment's positions, in
    /// ascending order.
    pub save: &'a [StateSave],
}

impl StateSnapshots<'_> {
    pub const NONE: StateSnapshots<'static> = StateSnapshots {
        restore: None,
        save: &[],
    };

    pub fn is_none(&self) -> bool {
        self.restore.is_none() && self.save.is_empty()
    }
}

/// Keep the state as it stands after the first `positions` positions of the sequence in
/// snapshot `snapshot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateSave {
    pub positions: usize,
    pub snapshot: usize,
}

impl Segment<'_> {
    /// One past the last position this segment computes.
    pub fn end(&self) -> usize {
        self.start + self.ids.len()
    }

    /// Its rows sampled from are some of its own, 1 to all of them, and its drafts fewer.
    pub fn check_sampled_rows(&self) -> Result<()> {
        match (1..=self.ids.len()).contains(&self.sampled_rows) && self.drafts < self.sampled_rows {
            true => Ok(()),
            false => Err(RuntimeError::Input(format!(
                "a segment of {} tokens cannot sample {} rows verifying {} drafts",
                self.ids.len(),
                self.sampled_rows,
                self.drafts
            ))),
        }
    }

    /// Its snapshots fit it: a restore where it starts past position 0, saves after positions
    /// it computes, ascending, and none inside the drafted rows it verifies (their state may
    /// be taken back).
    pub fn check_snapshots(&self) -> Result<()> {
        if self.snapshots.restore.is_some() && self.start == 0 {
            return Err(RuntimeError::Input(
                "a segment starting at position 0 starts its state afresh, not from a snapshot".into(),
            ));
        }
        let own_end = self.end() - self.drafts;
        let mut after = self.start;
        for save in self.snapshots.save {
            if save.positions <= after || save.positions > own_end {
                return Err(RuntimeError::Input(format!(
                    "a segment computing positions {}..{} (the last {} verifying drafts) cannot keep its state after {} positions",
                    self.start,
                    self.end(),
                    self.drafts,
                    save.positions
                )));
            }
            after = save.positions;
        }
        Ok(())
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

/// [`cache_row`] of each of `positions` in order, found a block at a time ([`block_runs`])
/// rather than by a division each.
pub fn cache_rows(table: &[BlockId], block_size: usize, positions: Range<usize>) -> impl Iterator<Item = usize> + '_ {
    block_runs(table, block_size, positions).flatten()
}

/// `positions` of the sequence with block table `table` as runs of consecutive cache rows, one
/// run a block, in order: attention lists every cached row a query sees, and a division and
/// a table lookup per position cost as much as the dots in a long context's decode.
pub fn block_runs(
    table: &[BlockId],
    block_size: usize,
    positions: Range<usize>,
) -> impl Iterator<Item = Range<usize>> + '_ {
    let blocks = match positions.is_empty() {
        true => 0..0,
        false => positions.start / block_size..positions.end.div_ceil(block_size),
    };
    table[blocks.clone()].iter().zip(blocks).map(move |(block, b)| {
        let first = b * block_size;
        let base = block.0 as usize * block_size;
        base + positions.start.max(first) - first..base + positions.end.min(first + block_size) - first
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every range of positions of a scattered table gives `cache_row`'s rows, in order.
    #[test]
    fn cache_rows_are_each_positions_cache_row() {
        let table = [5, 0, 3, 7, 1].map(BlockId);
        for block_size in [1, 2, 3, 4] {
            let positions = table.len() * block_size;
            for start in 0..=positions {
                for end in start..=positions {
                    let rows: Vec<usize> = cache_rows(&table, block_size, start..end).collect();
                    let want: Vec<usize> = (start..end).map(|p| cache_row(&table, block_size, p)).collect();
                    assert_eq!(rows, want, "blocks of {block_size}, positions {start}..{end}");
                }
            }
        }
    }

    /// Positions 8..12 of a sequence, the last two rows verifying one drafted token.
    fn segment<'a>(restore: Option<usize>, save: &'a [StateSave], start: usize) -> Segment<'a> {
        Segment {
            hidden_states: &[],
            table: &[],
            start,
            ids: &[1, 2, 3, 4],
            state_slot: 0,
            sampled_rows: 2,
            drafts: 1,
            snapshots: StateSnapshots { restore, save },
        }
    }

    fn save(positions: usize) -> StateSave {
        StateSave { positions, snapshot: 0 }
    }

    /// Snapshots are saved after positions the segment computes, ascending, before its
    /// drafts; a restore needs a start past position 0.
    #[test]
    fn snapshots_must_fit_their_segment() {
        assert!(segment(Some(1), &[save(9), save(11)], 8).check_snapshots().is_ok());
        assert!(segment(None, &[], 0).check_snapshots().is_ok());
        assert!(segment(Some(1), &[], 0).check_snapshots().is_err(), "restored at 0");
        assert!(
            segment(None, &[save(8)], 8).check_snapshots().is_err(),
            "before the segment"
        );
        assert!(
            segment(None, &[save(12)], 8).check_snapshots().is_err(),
            "after the draft"
        );
        assert!(
            segment(None, &[save(10), save(9)], 8).check_snapshots().is_err(),
            "descending"
        );
        assert!(
            segment(None, &[save(10), save(10)], 8).check_snapshots().is_err(),
            "twice"
        );
    }
}
