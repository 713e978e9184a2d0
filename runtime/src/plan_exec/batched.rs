//! Batched steps of a plan from `gpu_plan::build_batched`: rows of many sequences over one
//! paged KV pool addressed by the scheduler's block tables; decode steps replayed as graphs;
//! what serving reads back (each segment's last row, or only its greedy token).

use super::{BufferKey, Buffers, LaunchProfile, PlanDevice, PlanExecutor, StepScalars};
use crate::error::{Result, RuntimeError};
use crate::kv::Segment;
use gpu_plan::expr::Value;
use gpu_plan::LaunchArg;
use ir::multi_token::TARGET_HIDDEN_STATES;
use ir::Tensor;
use std::collections::HashMap;
use std::ops::Range;

/// Which way a state crosses between a sequence's slot and a [`Place`].
#[derive(Debug, Clone, Copy)]
enum Direction {
    Restore,
    Save,
}

/// Where a sequence's recurrent state is kept besides its slot.
#[derive(Debug, Clone, Copy)]
enum Place {
    /// A snapshot for the prefix cache (see [`PlanExecutor::keep_state_snapshots`]).
    Snapshot(usize),
    /// A checkpoint the kernels left for a rewind (see [`PlanExecutor::verify_drafts_up_to`]).
    Checkpoint(usize),
}

/// Which rows of a batched step's per-token outputs come back to the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rows {
    All,
    LastOfEachSegment,
}

impl<D: PlanDevice> PlanExecutor<D> {
    /// Process every segment's tokens in one batched step over the paged KV cache (a plan from
    /// `gpu_plan::build_batched`); each segment's outputs (its rows), in order.
    pub fn step_batch(&self, batch: &[Segment]) -> Result<Vec<HashMap<String, Tensor>>> {
        self.step_batch_reading(batch, Rows::All, None)
    }

    /// Like `step_batch`, reading back only each segment's last row: what serving samples
    /// from, and a prefill chunk's logits are otherwise most of the bytes a step copies to
    /// the host.
    pub fn step_batch_last_rows(&self, batch: &[Segment]) -> Result<Vec<HashMap<String, Tensor>>> {
        self.step_batch_reading(batch, Rows::LastOfEachSegment, None)
    }

    /// Whether batched steps can read back each sequence's `next_token` alone.
    pub fn has_greedy_tokens(&self) -> bool {
        self.plan
            .outputs
            .iter()
            .any(|(name, node)| name == "next_token" && self.per_sequence.contains(node))
    }

    /// Each segment's `next_token` at each row it samples (the argmax of the logits there, on
    /// the device: one, or `drafts + 1` where it verifies drafted tokens), the only output read
    /// back: a serving plan from `models::with_greedy_token`. `None` for a plan without a
    /// per-sequence `next_token`.
    pub fn step_batch_greedy_tokens(&self, batch: &[Segment]) -> Option<Result<Vec<Vec<u32>>>> {
        let read = self.greedy_reads(&[])?;
        let outputs = self.step_batch_reading(batch, Rows::LastOfEachSegment, Some(&read));
        Some(outputs.map(|outputs| {
            outputs
                .iter()
                .map(|o| o["next_token"].data.iter().map(|&id| id as u32).collect())
                .collect()
        }))
    }

    /// The outputs a greedy step reads back: `next_token` and those in `also`; `None` for a
    /// plan without a per-sequence `next_token` or without one of them.
    fn greedy_reads<'a>(&self, also: &[&'a str]) -> Option<Vec<&'a str>> {
        let outputs = |name: &str| self.plan.outputs.iter().any(|(n, _)| n == name);
        if !self.has_greedy_tokens() || !also.iter().all(|name| outputs(name)) {
            return None;
        }
        Some(std::iter::once("next_token").chain(also.iter().copied()).collect())
    }

    /// Whether a segment may sample several rows (`Segment::sampled_rows`: to verify drafted
    /// tokens, or for prompt rows' logits): see [`samples_several_rows`].
    pub fn samples_several_rows(&self) -> bool {
        self.several_rows
    }

    /// Whether a segment may verify drafted tokens: it samples several rows, and the kernels
    /// keep the recurrent states a refused draft is rewound to, where the model has any.
    pub(super) fn can_verify_drafts(&self) -> bool {
        self.several_rows && self.draft_checkpoint_kernels
    }

    /// Run `batch` as [`step_batch`](Self::step_batch) does but kernel by kernel (no graph),
    /// each launch timed where the device can; the step's launches in order. Reads nothing
    /// back.
    pub fn profile_step_batch(&self, batch: &[Segment]) -> Result<Vec<LaunchProfile>> {
        let mut state = self.lock()?;
        let (device, buffers) = &mut *state;
        let (_, vars) = self.write_batch(device, buffers, batch)?;
        let mut profile = Vec::with_capacity(self.plan.launches.len());
        self.launch_all(device, buffers, &vars, Some(&mut profile))?;
        self.save_snapshots(device, buffers, batch)?;
        Ok(profile)
    }

    /// A segment's snapshots as a batched plan takes them (see [`keep_state_snapshots`]):
    /// places it keeps, and a save only at the segment's end, since the kernels leave a state
    /// only after a sequence's last row of the step.
    ///
    /// [`keep_state_snapshots`]: PlanExecutor::keep_state_snapshots
    fn check_snapshots(&self, seg: &Segment) -> Result<()> {
        seg.check_snapshots()?;
        let places = self.snapshot_places;
        let used = seg
            .snapshots
            .restore
            .into_iter()
            .chain(seg.snapshots.save.iter().map(|s| s.snapshot));
        if let Some(place) = used.into_iter().find(|&p| p >= places) {
            return Err(RuntimeError::Input(format!(
                "recurrent-state snapshot {place} is past the {places} this plan keeps"
            )));
        }
        match seg.snapshots.save {
            [] => Ok(()),
            [save] if save.positions == seg.end() && seg.drafts == 0 => Ok(()),
            _ => Err(RuntimeError::Input(
                "a GPU plan saves a recurrent state only at the end of a segment".into(),
            )),
        }
    }

    /// A segment's sampled rows and drafts as this plan takes them: several sampled rows only
    /// where it gathers them, and, for a model with recurrent state, no more drafts than it
    /// keeps checkpoints for.
    fn check_drafts(&self, seg: &Segment) -> Result<()> {
        let drafts = seg.drafts;
        if seg.sampled_rows > 1 && !self.samples_several_rows() {
            return Err(RuntimeError::Input(
                "this plan samples one row per sequence (compile it again to read several rows' logits)".into(),
            ));
        }
        if drafts == 0 {
            return Ok(());
        }
        if !self.can_verify_drafts() {
            return Err(RuntimeError::Input(match self.plan.recurrent_states.is_empty() {
                true => "this plan samples one row per sequence (compile it again to verify drafted tokens)",
                false => "this plan of a model with recurrent state keeps no states to rewind drafted tokens to (compile it again to verify them)",
            }.into()));
        }
        if !self.plan.recurrent_states.is_empty() && drafts > self.draft_checkpoints {
            return Err(RuntimeError::Input(format!(
                "a segment verifies {drafts} drafted tokens where the recurrent states keep checkpoints for {} (see verify_drafts_up_to)",
                self.draft_checkpoints
            )));
        }
        Ok(())
    }

    /// Checkpoint `i` of the sequence in state slot `slot`: the state after its `i + 1`-th
    /// sampled row (see [`verify_drafts_up_to`](Self::verify_drafts_up_to)).
    fn checkpoint_place(&self, slot: usize, i: usize) -> usize {
        slot * self.draft_checkpoints + i
    }

    /// Each of a segment's rows' `row_checkpoint`: the row before its drafts and each draft
    /// but the last keep the state after them, in the sequence's checkpoints, where the model
    /// has a recurrent state; −1 for the others (`templates::delta_net`).
    fn row_checkpoints(&self, seg: &Segment) -> Vec<i32> {
        let mut places = vec![-1; seg.ids.len()];
        if !self.plan.recurrent_states.is_empty() {
            let first_verified = seg.ids.len() - 1 - seg.drafts;
            for i in 0..seg.drafts {
                places[first_verified + i] = self.checkpoint_place(seg.state_slot, i) as i32;
            }
        }
        places
    }

    /// After a step's launches: each segment's state saved where it asks.
    fn save_snapshots(&self, device: &mut D, buffers: &Buffers<D::Buffer>, batch: &[Segment]) -> Result<()> {
        for seg in batch {
            for save in seg.snapshots.save {
                let place = Place::Snapshot(save.snapshot);
                self.copy_states(device, buffers, seg.state_slot, place, Direction::Save)?;
            }
        }
        Ok(())
    }

    /// Every recurrent layer's state of sequence slot `slot` copied from `place` (restore) or
    /// into it (save), on the device.
    fn copy_states(
        &self,
        device: &mut D,
        buffers: &Buffers<D::Buffer>,
        slot: usize,
        place: Place,
        direction: Direction,
    ) -> Result<()> {
        for layout in &self.plan.recurrent_states {
            let bytes = layout.len * 4;
            let buffer = |key: BufferKey| {
                buffers
                    .whole(&key)
                    .map(|(b, _)| b)
                    .ok_or_else(|| RuntimeError::Artifact(format!("no buffer for {key:?}")))
            };
            let state = (buffer(BufferKey::State(layout.slot))?, slot * bytes);
            let kept = match place {
                Place::Snapshot(p) => (buffer(BufferKey::Snapshots(layout.slot))?, p * bytes),
                Place::Checkpoint(p) => (buffer(BufferKey::Checkpoints(layout.slot))?, p * bytes),
            };
            let (from, to) = match direction {
                Direction::Restore => (kept, state),
                Direction::Save => (state, kept),
            };
            device.copy(from.0, from.1, to.0, to.1, bytes)?;
        }
        Ok(())
    }

    /// A batched step, reading back `rows` of every output, or of `only` those.
    fn step_batch_reading(
        &self,
        batch: &[Segment],
        rows: Rows,
        only: Option<&[&str]>,
    ) -> Result<Vec<HashMap<String, Tensor>>> {
        let mut state = self.lock()?;
        let (device, buffers) = &mut *state;
        let (segment_rows, vars) = self.write_batch(device, buffers, batch)?;
        let tokens = segment_rows.last().map_or(0, |r| r.end);
        // Each segment's rows sampled from, as the per-sequence outputs hold them.
        let sampled = crate::kv::sampled_ranges(batch);
        let sampled_total = sampled.last().map_or(0, |r| r.end);
        self.launch_batched(device, buffers, &vars, (tokens, batch.len(), sampled_total))?;
        self.save_snapshots(device, buffers, batch)?;
        // The rows read back: each segment's, or those it samples from.
        let wanted: Vec<Range<usize>> = match rows {
            Rows::All => segment_rows.clone(),
            Rows::LastOfEachSegment => segment_rows
                .iter()
                .zip(batch)
                .map(|(r, seg)| r.end - seg.sampled_rows..r.end)
                .collect(),
        };
        let one_each = sampled;
        let mut per_segment = vec![HashMap::new(); batch.len()];
        for (name, node) in &self.plan.outputs {
            if only.is_some_and(|only| !only.contains(&name.as_str())) {
                continue;
            }
            // A multi-token prediction head drafting for this model reads its hidden state at
            // every position.
            let wanted = match self.per_sequence.contains(node) {
                true => &one_each,
                false if name == TARGET_HIDDEN_STATES => &segment_rows,
                false => &wanted,
            };
            let width = self.graph.nodes()[*node]
                .shape
                .resolve(tokens, 0)
                .last()
                .copied()
                .unwrap_or(1);
            let data = self.read_rows(device, buffers, *node, width, wanted)?;
            for ((range, out), data) in wanted.iter().zip(per_segment.iter_mut()).zip(data) {
                out.insert(name.clone(), Tensor::new(vec![range.len(), width], data));
            }
        }
        Ok(per_segment)
    }

    /// Check a batched step and write its inputs (ids, positions, block tables, rows); each
    /// segment's rows of the step, and the launches' scalars.
    fn write_batch(
        &self,
        device: &mut D,
        buffers: &Buffers<D::Buffer>,
        batch: &[Segment],
    ) -> Result<(Vec<Range<usize>>, StepScalars)> {
        let cache = self
            .plan
            .batched
            .ok_or_else(|| RuntimeError::Artifact("this plan runs one sequence; it has no batched steps".into()))?;
        let tokens: usize = batch.iter().map(|s| s.ids.len()).sum();
        self.check_rows(tokens)?;
        let (mut ids, mut positions) = (Vec::new(), Vec::new());
        let (mut tables, mut row_table) = (Vec::new(), Vec::new());
        let (mut row_seq, mut state_slots, mut row_checkpoint) = (Vec::new(), Vec::new(), Vec::new());
        // Each segment's rows of the step.
        let mut segment_rows: Vec<Range<usize>> = Vec::with_capacity(batch.len());
        for seg in batch {
            seg.check_sampled_rows()?;
            self.check_snapshots(seg)?;
            self.check_drafts(seg)?;
            let first = segment_rows.last().map_or(0, |r| r.end);
            segment_rows.push(first..first + seg.ids.len());
            if seg.ids.is_empty() || seg.end() > self.context_length {
                return Err(RuntimeError::Input(format!(
                    "a segment of {} tokens at {} does not fit a context of {}",
                    seg.ids.len(),
                    seg.start,
                    self.context_length
                )));
            }
            let blocks = seg.end().div_ceil(cache.block_size);
            if seg.table.len() < blocks || seg.table[..blocks].iter().any(|b| b.0 as usize >= cache.blocks) {
                return Err(RuntimeError::Input(format!(
                    "a block table of {} blocks cannot hold {} positions in a pool of {}",
                    seg.table.len(),
                    seg.end(),
                    cache.blocks
                )));
            }
            ids.extend_from_slice(seg.ids);
            positions.extend(seg.start..seg.end());
            row_seq.extend(std::iter::repeat_n(state_slots.len() as i32, seg.ids.len()));
            row_checkpoint.extend(self.row_checkpoints(seg));
            state_slots.push(seg.state_slot as i32);
            row_table.extend(std::iter::repeat_n(tables.len() as i32, seg.ids.len()));
            tables.extend(seg.table[..blocks].iter().map(|b| b.0 as i32));
        }
        if !self.plan.recurrent_states.is_empty() {
            crate::kv::check_state_slots(batch, Some(cache.sequences))?;
        }
        for seg in batch {
            if let Some(place) = seg.snapshots.restore {
                let place = Place::Snapshot(place);
                self.copy_states(device, buffers, seg.state_slot, place, Direction::Restore)?;
            }
        }
        let hidden_states: Vec<f32> = match self.plan.hidden_states {
            Some(_) => batch.iter().flat_map(|s| s.hidden_states).copied().collect(),
            None => Vec::new(),
        };
        self.write_inputs(device, buffers, &ids, &positions, &hidden_states)?;
        let row_pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        // Each segment's last row, and the rows per-sequence values (`last_token` on) gather
        // from: its last `sampled_rows`.
        let last_rows: Vec<i32> = segment_rows.iter().map(|r| r.end as i32 - 1).collect();
        let sampled_rows: Vec<i32> = segment_rows
            .iter()
            .zip(batch)
            .flat_map(|(r, seg)| (r.end - seg.sampled_rows..r.end).map(|row| row as i32))
            .collect();
        // What attends for the sampled rows alone (Gemma 4's KV-shared layers) reads their
        // tables and positions.
        let of_sampled = |per_row: &[i32]| -> Vec<i32> { sampled_rows.iter().map(|&r| per_row[r as usize]).collect() };
        let (sampled_row_table, sampled_row_pos) = (of_sampled(&row_table), of_sampled(&row_pos));
        for (name, values) in [
            ("block_tables", &tables),
            ("row_table", &row_table),
            ("row_pos", &row_pos),
            ("last_rows", &last_rows),
            ("sampled_rows", &sampled_rows),
            ("sampled_row_table", &sampled_row_table),
            ("sampled_row_pos", &sampled_row_pos),
            ("row_seq", &row_seq),
            ("state_slots", &state_slots),
            ("row_checkpoint", &row_checkpoint),
        ] {
            let (buffer, _) = buffers
                .whole(&BufferKey::StepInput(name.into()))
                .ok_or_else(|| RuntimeError::Artifact(format!("no step input `{name}`")))?;
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            device.write(buffer, 0, &bytes)?;
        }
        let lens: Vec<usize> = segment_rows.iter().map(|r| r.len()).collect();
        for (name, tile_rows) in &self.query_tile_inputs {
            let tiles = kernels_gen::templates::flash_attention::query_tiles(&lens, *tile_rows);
            let (buffer, _) = buffers
                .whole(&BufferKey::StepInput(name.clone()))
                .ok_or_else(|| RuntimeError::Artifact(format!("no step input `{name}`")))?;
            let bytes: Vec<u8> = tiles.iter().flat_map(|v| v.to_le_bytes()).collect();
            device.write(buffer, 0, &bytes)?;
        }
        let vars = HashMap::from([
            ("tokens", Value::Int(tokens as i64)),
            ("seqs", Value::Int(batch.len() as i64)),
            ("sampled", Value::Int(sampled_rows.len() as i64)),
            ("first", Value::Int(0)),
            ("block_size", Value::Int(cache.block_size as i64)),
            ("cache_rows", Value::Int((cache.blocks * cache.block_size) as i64)),
            ("context", Value::Int(self.context_length as i64)),
            ("prefetch", Value::Int(device.prefetches_weights() as i64)),
        ]);
        Ok((segment_rows, vars))
    }

    /// Rows `wanted` (ascending, disjoint) of `node`'s `width`-wide value, each range's values;
    /// adjacent ranges are read in one copy.
    fn read_rows(
        &self,
        device: &mut D,
        buffers: &Buffers<D::Buffer>,
        node: usize,
        width: usize,
        wanted: &[Range<usize>],
    ) -> Result<Vec<Vec<f32>>> {
        let at = self.buffer(node, None)?.start;
        let dtype = self.graph.nodes()[node].dtype;
        let mut out = Vec::with_capacity(wanted.len());
        let mut i = 0;
        while i < wanted.len() {
            // The run of ranges that touch each other.
            let mut j = i + 1;
            while j < wanted.len() && wanted[j].start == wanted[j - 1].end {
                j += 1;
            }
            let rows = wanted[i].start..wanted[j - 1].end;
            let bytes = device.read(&buffers.arena, at + 4 * width * rows.start..at + 4 * width * rows.end)?;
            let values = super::output_values(&bytes, dtype);
            for range in &wanted[i..j] {
                let from = (range.start - rows.start) * width;
                out.push(values[from..from + range.len() * width].to_vec());
            }
            i = j;
        }
        Ok(out)
    }

    /// A batched step's launches: replayed from the graph of its row, sequence and sampled
    /// row counts, captured first if there is none yet (see `capture_graphs_up_to`), or
    /// launched one by one.
    fn launch_batched(
        &self,
        device: &mut D,
        buffers: &Buffers<D::Buffer>,
        vars: &HashMap<&str, Value>,
        (tokens, seqs, sampled): (usize, usize, usize),
    ) -> Result<()> {
        // Steps that sample every row only (decoding, and verifying drafted tokens): the shapes
        // that repeat step after step. Mixed steps with prompt chunks come in too many shapes
        // to be worth a graph each.
        if tokens > self.graph_rows || sampled != tokens || !device.records_graphs() {
            return self.launch_all(device, buffers, vars, None);
        }
        // The launches depend on these counts alone.
        let counts = self.plan.max_tokens + 1;
        let key = (tokens * counts + seqs) * counts + sampled;
        if device.replay(key)? {
            return Ok(());
        }
        device.begin_capture()?;
        self.captured.store(true, std::sync::atomic::Ordering::Relaxed);
        // The capture ends even when a launch fails, so the device is usable after the error.
        let launched = self.launch_all(device, buffers, vars, None);
        let captured = device.end_capture(key);
        launched?;
        captured?;
        match device.replay(key)? {
            true => Ok(()),
            false => Err(RuntimeError::Cuda(format!(
                "the graph of a {tokens}-row, {seqs}-sequence step was not kept"
            ))),
        }
    }
}

/// Whether a segment of `plan` may sample several rows: every row has logits (no
/// `per_sequence` nodes), or the plan gathers the rows sampled from by the step input
/// `sampled_rows` (an older plan gathered each sequence's last row alone).
pub(super) fn samples_several_rows(plan: &gpu_plan::GpuPlan, per_sequence: &std::collections::BTreeSet<usize>) -> bool {
    per_sequence.is_empty() || takes_step_input(plan, "sampled_rows")
}

/// Whether, where the model keeps a recurrent state (which drafts advance), `plan`'s kernels
/// keep the states a refused draft is rewound to (the step input `row_checkpoint`; older
/// plans' did not).
pub(super) fn keeps_draft_checkpoints(plan: &gpu_plan::GpuPlan) -> bool {
    plan.recurrent_states.is_empty() || takes_step_input(plan, "row_checkpoint")
}

pub(super) fn takes_step_input(plan: &gpu_plan::GpuPlan, input: &str) -> bool {
    plan.launches
        .iter()
        .flat_map(|l| &l.args)
        .any(|a| matches!(a, LaunchArg::StepInput { name } if name == input))
}

/// The step inputs listing query tiles that `plan` reads (see
/// `kernels_gen::templates::flash_attention::query_tiles_input`), each with its tiles' rows.
pub(super) fn query_tile_inputs(plan: &gpu_plan::GpuPlan) -> Vec<(String, usize)> {
    let inputs: std::collections::BTreeSet<&str> = plan
        .launches
        .iter()
        .flat_map(|l| &l.args)
        .filter_map(|a| match a {
            LaunchArg::StepInput { name } => Some(name.as_str()),
            _ => None,
        })
        .collect();
    inputs
        .into_iter()
        .filter_map(|name| {
            kernels_gen::templates::flash_attention::query_tile_rows(name).map(|rows| (name.to_string(), rows))
        })
        .collect()
}

/// A batched plan serves like the CPU backend: the KV pool lives on the device, addressed by
/// the scheduler's block tables.
impl<D: PlanDevice> crate::serving::PagedBackend for PlanExecutor<D> {
    /// The pool is the executor's own; this records the block size it was built for.
    type Pages = usize;

    fn new_pages(&self, block_size: usize) -> usize {
        block_size
    }

    fn max_step_tokens(&self) -> Option<usize> {
        Some(self.plan.max_tokens)
    }

    fn max_sequences(&self) -> Option<usize> {
        match self.has_recurrent_state() {
            true => self.plan.batched.map(|c| c.sequences),
            false => None,
        }
    }

    fn max_drafts(&self) -> Option<usize> {
        (!self.plan.recurrent_states.is_empty()).then_some(self.draft_checkpoints)
    }

    fn has_recurrent_state(&self) -> bool {
        !self.plan.recurrent_states.is_empty()
    }

    fn step_batch(&self, pages: &mut usize, batch: &[Segment]) -> Result<Vec<HashMap<String, Tensor>>> {
        // Serving samples from each segment's last row only.
        self.check_block_size(*pages)?;
        self.step_batch_last_rows(batch)
    }

    fn verifies_drafts(&self) -> bool {
        self.can_verify_drafts() && (self.plan.recurrent_states.is_empty() || self.draft_checkpoints > 0)
    }

    fn samples_several_rows(&self) -> bool {
        PlanExecutor::samples_several_rows(self)
    }

    fn rewind_state(&self, _pages: &mut usize, state_slot: usize, sampled_rows: usize, kept: usize) -> Result<()> {
        if !(1..=sampled_rows).contains(&kept) {
            return Err(RuntimeError::Input(format!(
                "cannot keep {kept} of {sampled_rows} sampled rows"
            )));
        }
        if kept == sampled_rows || self.plan.recurrent_states.is_empty() {
            return Ok(());
        }
        if sampled_rows - 1 > self.draft_checkpoints {
            return Err(RuntimeError::Input(format!(
                "state slot {state_slot} keeps no state after row {kept} of {sampled_rows} sampled"
            )));
        }
        let mut state = self.lock()?;
        let (device, buffers) = &mut *state;
        let place = Place::Checkpoint(self.checkpoint_place(state_slot, kept - 1));
        self.copy_states(device, buffers, state_slot, place, Direction::Restore)
    }

    fn snapshots_states(&self) -> crate::serving::StateSnapshotting {
        match self.snapshot_places {
            0 => crate::serving::StateSnapshotting::None,
            places => crate::serving::StateSnapshotting::AtSegmentEnds { places },
        }
    }

    fn step_batch_greedy(
        &self,
        pages: &mut usize,
        batch: &[Segment],
        also: &[&str],
    ) -> Option<Result<Vec<HashMap<String, Tensor>>>> {
        let read = self.greedy_reads(also)?;
        if let Err(e) = self.check_block_size(*pages) {
            return Some(Err(e));
        }
        Some(self.step_batch_reading(batch, Rows::LastOfEachSegment, Some(&read)))
    }
}

impl<D: PlanDevice> PlanExecutor<D> {
    /// The scheduler's blocks are the plan's.
    fn check_block_size(&self, block_size: usize) -> Result<()> {
        match self.plan.batched {
            Some(cache) if cache.block_size == block_size => Ok(()),
            Some(cache) => Err(RuntimeError::Artifact(format!(
                "the plan's KV blocks hold {} positions, the scheduler's {block_size}",
                cache.block_size
            ))),
            None => Err(RuntimeError::Artifact(
                "this plan runs one sequence; it has no batched steps".into(),
            )),
        }
    }
}
