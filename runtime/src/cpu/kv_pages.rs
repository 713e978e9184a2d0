//! The CPU backend's KV cache: per attention slot, one pool of rows in blocks of `block_size`
//! positions, addressed through each sequence's block table (see [`crate::kv`]). Sequences that
//! share a prompt prefix share its blocks, so a prefix-cache hit skips computing it.
//!
//! A slot's rows are stored in its attention's `cache_dtype` (f32, bf16, half or FP8): written
//! narrowed, read through [`PagesOf`] by kernels that widen them as they load.
//!
//! The pool grows on first use of a block rather than at creation: a server configured for
//! thousands of blocks holds memory only for the blocks it has used (block ids are handed out
//! lowest first, so the pool's size follows the peak working set).
//!
//! Beside the pages, the recurrent states of Gated DeltaNet layers: one f32 vector per (layer
//! state slot, sequence state slot), made on first use; the scheduler hands a running sequence
//! its slot, so their number follows the running sequences, not the blocks. A step that
//! verifies drafted tokens also keeps each state as it stood after every sampled row but the
//! last, so that refused drafts can be taken back out of it ([`KvPages::rewind_state`]).
//! And the states' snapshots (see [`crate::kv::StateSnapshots`]): copies by (layer state
//! slot, snapshot), made when a step saves one and kept until a later save overwrites it.

use super::kv_element::KvElement;
use super::line_aligned::LineAligned;
use crate::error::{Result, RuntimeError};
use crate::kv::{block_runs, cache_row, BlockId};
use half::{bf16, f16};
use ir::{DType, F8E4M3};
use std::collections::HashMap;
use std::ops::Range;

#[derive(Debug, Clone)]
pub struct KvPages {
    block_size: usize,
    layers: Vec<LayerPages>,
    /// Per layer state slot: a sequence's state length (0 for slots no layer uses).
    state_lens: Vec<usize>,
    /// By (layer state slot, sequence state slot).
    states: HashMap<(usize, usize), Vec<f32>>,
    /// By (layer state slot, sequence state slot): the state after each sampled row but the
    /// last of the sequence's latest step (none unless it verified drafts).
    checkpoints: HashMap<(usize, usize), Vec<Vec<f32>>>,
    /// By (layer state slot, snapshot).
    snapshots: HashMap<(usize, usize), Vec<f32>>,
}

/// What one attention slot caches a position as: key and value row widths (they differ for
/// latent attention, which caches no values) and the element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub dim: usize,
    pub v_dim: usize,
    pub dtype: DType,
}

impl KvLayout {
    /// Bytes one position takes in this slot.
    pub fn bytes_per_position(&self) -> usize {
        let element = match self.dtype {
            DType::BF16 | DType::F16 => 2,
            DType::F8E4M3 => 1,
            _ => 4,
        };
        (self.dim + self.v_dim) * element
    }
}

/// Keys and values of one attention slot: row `r` of the pool is `k[r·dim..(r+1)·dim]` and
/// `v[r·v_dim..(r+1)·v_dim]`.
#[derive(Debug, Clone)]
pub struct LayerPages {
    dim: usize,
    v_dim: usize,
    block_size: usize,
    k: Rows,
    v: Rows,
}

/// A pool of rows in the slot's element type.
#[derive(Debug, Clone)]
enum Rows {
    F32(LineAligned<f32>),
    Bf16(LineAligned<bf16>),
    F16(LineAligned<f16>),
    F8(LineAligned<F8E4M3>),
}

impl Rows {
    fn new(dtype: DType) -> Self {
        match dtype {
            DType::BF16 => Self::Bf16(LineAligned::new()),
            DType::F16 => Self::F16(LineAligned::new()),
            DType::F8E4M3 => Self::F8(LineAligned::new()),
            _ => Self::F32(LineAligned::new()),
        }
    }

    fn len(&self) -> usize {
        match self {
            Self::F32(r) => r.len(),
            Self::Bf16(r) => r.len(),
            Self::F16(r) => r.len(),
            Self::F8(r) => r.len(),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Self::F32(r) => r.len() * 4,
            Self::Bf16(r) => r.len() * 2,
            Self::F16(r) => r.len() * 2,
            Self::F8(r) => r.len(),
        }
    }

    /// `values` narrowed into elements `at..`, the pool grown to `len` elements first if
    /// shorter.
    fn write(&mut self, at: usize, values: &[f32], len: usize) {
        fn narrowed<T: KvElement>(rows: &mut LineAligned<T>, at: usize, values: &[f32], len: usize) {
            rows.grow(len);
            T::narrow_into(values, &mut rows.as_mut_slice()[at..at + values.len()]);
        }
        match self {
            Self::F32(r) => narrowed(r, at, values, len),
            Self::Bf16(r) => narrowed(r, at, values, len),
            Self::F16(r) => narrowed(r, at, values, len),
            Self::F8(r) => narrowed(r, at, values, len),
        }
    }
}

/// A slot's rows as their element type: what attention's kernels read.
pub enum PagesOf<'a> {
    F32(TypedPages<'a, f32>),
    Bf16(TypedPages<'a, bf16>),
    F16(TypedPages<'a, f16>),
    F8(TypedPages<'a, F8E4M3>),
}

/// A slot's keys and values, elements of type `T`.
pub struct TypedPages<'a, T> {
    dim: usize,
    v_dim: usize,
    k: &'a [T],
    v: &'a [T],
}

impl<'a, T> TypedPages<'a, T> {
    /// Cache row `row`'s key, columns `cols` (one KV head).
    pub fn key(&self, row: usize, cols: std::ops::Range<usize>) -> &'a [T] {
        &self.k[row * self.dim + cols.start..row * self.dim + cols.end]
    }

    pub fn value(&self, row: usize, cols: std::ops::Range<usize>) -> &'a [T] {
        &self.v[row * self.v_dim + cols.start..row * self.v_dim + cols.end]
    }

    /// [`Self::key`] of the cache row of each of `positions` of the sequence with block table
    /// `table`, in order, appended to `out`.
    pub fn keys_into(
        &self,
        table: &[BlockId],
        block_size: usize,
        positions: Range<usize>,
        cols: Range<usize>,
        out: &mut Vec<&'a [T]>,
    ) {
        rows_into(self.k, self.dim, block_runs(table, block_size, positions), cols, out)
    }

    /// [`Self::value`] of each of `positions`, as [`Self::keys_into`].
    pub fn values_into(
        &self,
        table: &[BlockId],
        block_size: usize,
        positions: Range<usize>,
        cols: Range<usize>,
        out: &mut Vec<&'a [T]>,
    ) {
        rows_into(self.v, self.v_dim, block_runs(table, block_size, positions), cols, out)
    }
}

/// Columns `cols` of each of the cache rows `runs` of `dim`-wide rows, appended to `out`. Its
/// own function, a run at a time, so the widths and bounds sit in registers and `out` grows
/// once a run (a long context's decode lists every cached row of every head, each layer).
fn rows_into<'a, T>(
    data: &'a [T],
    dim: usize,
    runs: impl Iterator<Item = Range<usize>>,
    cols: Range<usize>,
    out: &mut Vec<&'a [T]>,
) {
    let (start, width) = (cols.start, cols.len());
    for run in runs {
        out.extend(run.map(|row| {
            let at = row * dim + start;
            &data[at..at + width]
        }));
    }
}

impl KvPages {
    /// An empty pool for attention slots of the given layouts, and recurrent layers of the
    /// given state lengths.
    pub fn new(layouts: &[KvLayout], state_lens: &[usize], block_size: usize) -> Self {
        assert!(block_size > 0, "blocks hold at least one position");
        Self {
            block_size,
            state_lens: state_lens.to_vec(),
            states: HashMap::new(),
            checkpoints: HashMap::new(),
            snapshots: HashMap::new(),
            layers: layouts
                .iter()
                .map(|l| LayerPages {
                    dim: l.dim,
                    v_dim: l.v_dim,
                    block_size,
                    k: Rows::new(l.dtype),
                    v: Rows::new(l.dtype),
                })
                .collect(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn layer(&self, slot: usize) -> &LayerPages {
        &self.layers[slot]
    }

    pub fn layer_mut(&mut self, slot: usize) -> &mut LayerPages {
        &mut self.layers[slot]
    }

    /// Bytes held by the pool now.
    pub fn bytes(&self) -> usize {
        let pages: usize = self.layers.iter().map(|l| l.k.bytes() + l.v.bytes()).sum();
        let checkpoints: usize = self.checkpoints.values().flatten().map(Vec::len).sum();
        let states: usize = self.states.values().chain(self.snapshots.values()).map(Vec::len).sum();
        pages + (states + checkpoints) * 4
    }

    /// The recurrent state of layer slot `layer` for the sequence in state slot `sequence`;
    /// all zeros when `fresh` (the sequence starts at position 0) or first used.
    pub fn recurrent_state(&mut self, layer: usize, sequence: usize, fresh: bool) -> &mut [f32] {
        let len = self.state_lens.get(layer).copied().unwrap_or(0);
        slot_state(&mut self.states, len, (layer, sequence), fresh)
    }

    /// As [`recurrent_state`](Self::recurrent_state), with the sequence's checkpoints of that
    /// layer emptied for this step to fill (`Vec::push` a copy of the state after each sampled
    /// row but the last).
    pub fn recurrent_state_and_checkpoints(
        &mut self,
        layer: usize,
        sequence: usize,
        fresh: bool,
    ) -> (&mut [f32], &mut Vec<Vec<f32>>) {
        let checkpoints = self.checkpoints.entry((layer, sequence)).or_default();
        checkpoints.clear();
        let len = self.state_lens.get(layer).copied().unwrap_or(0);
        (slot_state(&mut self.states, len, (layer, sequence), fresh), checkpoints)
    }

    /// Layer slot `layer`'s state for the sequence in state slot `sequence` set to its copy in
    /// snapshot `snapshot`.
    pub fn restore_state(&mut self, layer: usize, sequence: usize, snapshot: usize) -> Result<()> {
        let saved = self
            .snapshots
            .get(&(layer, snapshot))
            .ok_or_else(|| RuntimeError::Input(format!("recurrent-state snapshot {snapshot} was never saved")))?;
        let len = self.state_lens.get(layer).copied().unwrap_or(0);
        slot_state(&mut self.states, len, (layer, sequence), false).copy_from_slice(saved);
        Ok(())
    }

    /// Keep `state` (of layer slot `layer`) as snapshot `snapshot`, in place of what it held.
    pub fn save_state(&mut self, layer: usize, snapshot: usize, state: Vec<f32>) {
        self.snapshots.insert((layer, snapshot), state);
    }

    /// After a step that sampled `sampled_rows` rows of the sequence in state slot `sequence`
    /// kept only the first `kept` of them (drafts after them refused): every layer's state back
    /// to what it was after the last row kept, as if the refused rows had never run. Then the
    /// checkpoints are let go.
    pub fn rewind_state(&mut self, sequence: usize, sampled_rows: usize, kept: usize) -> Result<()> {
        if !(1..=sampled_rows).contains(&kept) {
            return Err(RuntimeError::Input(format!(
                "cannot keep {kept} of {sampled_rows} sampled rows"
            )));
        }
        for layer in (0..self.state_lens.len()).filter(|&l| self.state_lens[l] > 0) {
            let checkpoints = self.checkpoints.remove(&(layer, sequence)).unwrap_or_default();
            if kept == sampled_rows {
                continue;
            }
            let (Some(state), Some(saved)) = (self.states.get_mut(&(layer, sequence)), checkpoints.get(kept - 1))
            else {
                return Err(RuntimeError::Input(format!(
                    "state slot {sequence} has no state saved after row {kept} of its last step's {sampled_rows} sampled"
                )));
            };
            state.copy_from_slice(saved);
        }
        Ok(())
    }

    /// Whether any layer keeps a recurrent state.
    pub fn has_recurrent_state(&self) -> bool {
        self.state_lens.iter().any(|&l| l > 0)
    }
}

/// The state of `len` values kept under `key`: made (zeros) on first use, zeroed when `fresh`.
fn slot_state(
    states: &mut HashMap<(usize, usize), Vec<f32>>,
    len: usize,
    key: (usize, usize),
    fresh: bool,
) -> &mut [f32] {
    let state = states.entry(key).or_insert_with(|| vec![0.0; len]);
    if fresh {
        state.fill(0.0);
    }
    state
}

impl LayerPages {
    pub fn dim(&self) -> usize {
        self.dim
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Store the keys and values of positions `start..start + rows` (`k` is `[rows, dim]`, `v`
    /// `[rows, v_dim]`; empty where the layer caches no values) in the blocks of `table`,
    /// rounded to the slot's element type.
    pub fn write(&mut self, table: &[BlockId], start: usize, k: &[f32], v: &[f32]) {
        let (dim, v_dim) = (self.dim, self.v_dim);
        debug_assert_eq!(k.len() / dim.max(1) * v_dim, v.len());
        for (i, k) in k.chunks_exact(dim).enumerate() {
            let v = &v[i * v_dim..(i + 1) * v_dim];
            let row = cache_row(table, self.block_size, start + i);
            // The pool grows to whole blocks up to the row's.
            let rows = (row / self.block_size + 1) * self.block_size;
            let grow = |have: usize, width: usize| if have < (row + 1) * width { rows * width } else { 0 };
            let (k_len, v_len) = (grow(self.k.len(), dim), grow(self.v.len(), v_dim));
            self.k.write(row * dim, k, k_len);
            self.v.write(row * v_dim, v, v_len);
        }
    }

    /// The rows as their element type.
    pub fn typed(&self) -> PagesOf<'_> {
        match (&self.k, &self.v) {
            (Rows::F32(k), Rows::F32(v)) => PagesOf::F32(self.typed_as(k, v)),
            (Rows::Bf16(k), Rows::Bf16(v)) => PagesOf::Bf16(self.typed_as(k, v)),
            (Rows::F16(k), Rows::F16(v)) => PagesOf::F16(self.typed_as(k, v)),
            (Rows::F8(k), Rows::F8(v)) => PagesOf::F8(self.typed_as(k, v)),
            _ => unreachable!("a slot's keys and values share their element type"),
        }
    }

    fn typed_as<'a, T: KvElement>(&self, k: &'a LineAligned<T>, v: &'a LineAligned<T>) -> TypedPages<'a, T> {
        TypedPages {
            dim: self.dim,
            v_dim: self.v_dim,
            k: k.as_slice(),
            v: v.as_slice(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(dim: usize, dtype: DType) -> KvLayout {
        KvLayout { dim, v_dim: dim, dtype }
    }

    #[test]
    fn rows_land_in_their_blocks_and_the_pool_grows_to_the_highest_block() {
        let mut pages = KvPages::new(&[layout(2, DType::F32)], &[], 2);
        let layer = pages.layer_mut(0);
        // Positions 0..3 of a sequence whose table is [block 3, block 1].
        let table = [BlockId(3), BlockId(1)];
        let k = [1.0, 1.5, 2.0, 2.5, 3.0, 3.5];
        let v = k.map(|x| -x);
        layer.write(&table, 0, &k, &v);
        let PagesOf::F32(rows) = layer.typed() else {
            panic!("an f32 slot")
        };
        assert_eq!(rows.key(6, 0..2), &[1.0, 1.5], "position 0: block 3, row 0");
        assert_eq!(rows.key(7, 0..2), &[2.0, 2.5]);
        assert_eq!(rows.value(2, 1..2), &[-3.5], "position 2: block 1, row 0");
        assert_eq!(
            pages.bytes(),
            2 * 8 * 2 * 4,
            "blocks 0..=3 of 2 rows of 2 floats, k and v"
        );
    }

    /// A narrow slot stores each value rounded to its type, in half the bytes.
    #[test]
    fn narrow_slots_keep_rounded_values_in_half_the_bytes() {
        let mut pages = KvPages::new(&[layout(2, DType::F16), layout(2, DType::BF16)], &[], 2);
        let (k, v) = ([0.1, 70000.0], [1.0 / 3.0, -2.0]);
        for slot in 0..2 {
            pages.layer_mut(slot).write(&[BlockId(0)], 1, &k, &v);
        }
        let PagesOf::F16(half) = pages.layer(0).typed() else {
            panic!("a half slot")
        };
        assert_eq!(half.key(1, 0..2), &[f16::from_f32(0.1), f16::INFINITY]);
        assert_eq!(
            half.value(1, 0..1)[0].to_f32(),
            ir::reference::ops::stored_as(1.0 / 3.0, DType::F16)
        );
        let PagesOf::Bf16(bf) = pages.layer(1).typed() else {
            panic!("a bf16 slot")
        };
        assert_eq!(bf.key(1, 0..2), &[bf16::from_f32(0.1), bf16::from_f32(70000.0)]);
        assert_eq!(
            pages.bytes(),
            2 * (2 * 2 * 2 * 2),
            "one block of 2 rows of 2 halves, k and v, twice"
        );
        assert_eq!(layout(2, DType::F16).bytes_per_position(), 8);
    }

    #[test]
    fn recurrent_states_start_at_zero_persist_and_restart_when_fresh() {
        let mut pages = KvPages::new(&[], &[0, 3], 4);
        assert!(pages.has_recurrent_state());
        pages.recurrent_state(1, 7, true).copy_from_slice(&[1.0, 2.0, 3.0]);
        assert_eq!(pages.recurrent_state(1, 7, false), &[1.0, 2.0, 3.0]);
        assert_eq!(pages.recurrent_state(1, 8, false), &[0.0; 3], "another sequence's own");
        assert_eq!(pages.recurrent_state(1, 7, true), &[0.0; 3]);
        assert_eq!(pages.bytes(), 2 * 3 * 4);
    }

    /// A snapshot restores into any sequence's slot what was saved, layer by layer; a save
    /// replaces the snapshot; a snapshot never saved is an error.
    #[test]
    fn snapshots_restore_what_was_saved_into_any_slot() {
        let mut pages = KvPages::new(&[], &[2, 0, 1], 4);
        pages.save_state(0, 5, vec![1.0, 2.0]);
        pages.save_state(2, 5, vec![3.0]);
        pages.recurrent_state(0, 1, true).fill(9.0);
        for layer in [0, 2] {
            pages.restore_state(layer, 1, 5).unwrap();
        }
        assert_eq!(pages.recurrent_state(0, 1, false), &[1.0, 2.0]);
        assert_eq!(pages.recurrent_state(2, 1, false), &[3.0]);
        pages.save_state(0, 5, vec![4.0, 4.0]);
        pages.restore_state(0, 2, 5).unwrap();
        assert_eq!(pages.recurrent_state(0, 2, false), &[4.0, 4.0]);
        assert_eq!(pages.recurrent_state(0, 1, false), &[1.0, 2.0], "a copy, not shared");
        assert!(pages.restore_state(0, 1, 6).is_err());
        // Slot 1's states (2 + 1 values), slot 2's (2), the snapshot's (2 + 1).
        assert_eq!(pages.bytes(), (3 + 2 + 3) * 4);
    }

    /// A verifying step's checkpoints put the state back to the last row kept, in every
    /// layer; keeping every row changes nothing; checkpoints do not outlive the rewind.
    #[test]
    fn rewinding_restores_each_layers_state_after_the_last_row_kept() {
        let mut pages = KvPages::new(&[], &[2, 0, 1], 4);
        // Three sampled rows: the state after row r holds 10·layer + r; after rows 0 and 1
        // saved, after row 2 current.
        for (layer, width) in [(0, 2), (2, 1)] {
            let (state, saved) = pages.recurrent_state_and_checkpoints(layer, 3, true);
            for row in 0..2 {
                saved.push(vec![(10 * layer + row) as f32; width]);
            }
            state.fill((10 * layer + 2) as f32);
        }
        // Rows 0 and 1 kept: the state after row 1.
        pages.rewind_state(3, 3, 2).unwrap();
        assert_eq!(pages.recurrent_state(0, 3, false), &[1.0, 1.0]);
        assert_eq!(pages.recurrent_state(2, 3, false), &[21.0]);
        assert!(
            pages.rewind_state(3, 3, 1).is_err(),
            "checkpoints are gone after a rewind"
        );
        pages.rewind_state(3, 3, 3).unwrap();
        assert_eq!(pages.recurrent_state(0, 3, false), &[1.0, 1.0], "all kept: unchanged");
        assert!(pages.rewind_state(3, 3, 0).is_err() && pages.rewind_state(3, 3, 4).is_err());
    }
}
