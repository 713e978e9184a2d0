//! How the paged KV cache is addressed, shared by the block manager (which hands blocks out)
//! and the backends (which keep keys and values in them): position `p` of a sequence lives in
//! block `table[p / block_size]`, at row `p % block_size` of that block.

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
}

/// The cache row holding position `pos` of the sequence with block table `table`.
pub fn cache_row(table: &[BlockId], block_size: usize, pos: usize) -> usize {
    table[pos / block_size].0 as usize * block_size + pos % block_size
}
