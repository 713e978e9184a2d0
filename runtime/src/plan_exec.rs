//! Running a GPU plan (`plan.json`), the device-independent half of the GPU backend: upload the
//! weights in the layout the kernels expect (row-stacked, bf16 or GGUF blocks as the plan says;
//! the INT8 heads from the artifact), allocate the activation arena and the KV cache, and run
//! a step as the plan's launches in order, each argument resolved from the plan (arena offsets,
//! views, scalars that are expressions of `tokens` and `first`), then read the outputs back. A
//! one-sequence plan steps one sequence over a contiguous cache (`step`); a batched plan steps
//! rows of many sequences over a paged pool, with the scheduler's block tables (`step_batch`).
//!
//! The device ([`PlanDevice`]) owns memory and launches kernels: CUDA through cudarc
//! (`crate::cuda`), or the kernels-gen emulator (`crate::emulated`), which runs the very same
//! plan on the CPU, so everything above the kernels is tested without a GPU.

use crate::error::{Result, RuntimeError};
use crate::kv::Segment;
use codegen::gpu::expr::{self, Value};
use codegen::gpu::{GpuPlan, LaunchArg, PREFILL_TOKENS};
use half::bf16;
use ir::{DType, Graph, Tensor};
use models::WeightSource;
use passes::weight_transforms::Int8Rows;
use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::sync::Mutex;

/// Which rows of a batched step's per-token outputs come back to the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rows {
    All,
    LastOfEachSegment,
}

/// Memory and launches on one device.
pub trait PlanDevice {
    type Buffer;
    /// A zeroed buffer of `bytes`.
    fn alloc(&mut self, bytes: usize) -> Result<Self::Buffer>;
    fn upload(&mut self, bytes: &[u8]) -> Result<Self::Buffer>;
    /// Copy `bytes` into `buffer` at byte `at`, after every launch already issued.
    fn write(&mut self, buffer: &Self::Buffer, at: usize, bytes: &[u8]) -> Result<()>;
    fn read(&mut self, buffer: &Self::Buffer, range: Range<usize>) -> Result<Vec<u8>>;
    /// Launch `kernel` as `grid` blocks of `block` threads.
    fn launch(&mut self, kernel: &str, grid: u32, block: u32, args: &[DeviceArg<'_, Self::Buffer>]) -> Result<()>;

    /// Launch as [`launch`](Self::launch) does and return how long the launch ran on the
    /// device, in seconds, where the device can measure it (the emulator measures its own wall
    /// time); a device that cannot keeps this default.
    fn launch_timed(
        &mut self,
        kernel: &str,
        grid: u32,
        block: u32,
        args: &[DeviceArg<'_, Self::Buffer>],
    ) -> Result<Option<f64>> {
        self.launch(kernel, grid, block, args)?;
        Ok(None)
    }

    /// Whether the device keeps replayable launch sequences (CUDA graphs): launches between
    /// `begin_capture` and `end_capture(key)` are recorded instead of run, and `replay(key)`
    /// runs them again. Devices without them keep these defaults and launch one by one.
    fn records_graphs(&self) -> bool {
        false
    }
    fn begin_capture(&mut self) -> Result<()> {
        Err(RuntimeError::Cuda("this device records no graphs".into()))
    }
    fn end_capture(&mut self, _key: usize) -> Result<()> {
        Err(RuntimeError::Cuda("this device records no graphs".into()))
    }
    /// Run the launches recorded under `key`; `false` when there are none.
    fn replay(&mut self, _key: usize) -> Result<bool> {
        Ok(false)
    }
}

/// A launch argument as the device takes it.
pub enum DeviceArg<'a, B> {
    /// The bytes `range` of a buffer: the kernel gets a pointer to its start and may touch
    /// nothing outside it.
    Buffer(&'a B, Range<usize>),
    I32(i32),
    F32(f32),
}

/// Where a plan's weights come from.
#[derive(Clone, Copy)]
pub enum PlanWeights<'a> {
    /// The model's tensors, converted on the host to the plan's dtypes and uploaded.
    Host(&'a WeightSource),
    /// Made on the device by the fill kernels (see [`crate::generated`]) from this seed: for
    /// models lowered without weights.
    Generated { seed: u32 },
}

/// One launch of a profiled step.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchProfile {
    pub kernel: String,
    /// Device time, where the device measures it.
    pub seconds: Option<f64>,
    /// Bytes of weights (and derived INT8 rows) the launch reads: all it is given, but only
    /// the gathered rows of an embedding table.
    pub weight_bytes: usize,
}

/// A step's scalars (`tokens`, `seqs`, ...) by name: what launch arguments are computed from.
type StepScalars = HashMap<&'static str, Value>;

/// Everything the plan's launches point into.
struct Buffers<B> {
    arena: B,
    weights: HashMap<usize, B>,
    derived: HashMap<(String, String), B>,
    constants: HashMap<String, B>,
    kv: HashMap<(usize, bool), B>,
    /// A batched plan's per-step inputs, by name.
    step_inputs: HashMap<String, B>,
    /// Byte sizes, for the ranges handed to launches.
    sizes: HashMap<BufferKey, usize>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum BufferKey {
    Weight(usize),
    Derived(String, String),
    Constant(String),
    Kv(usize, bool),
    StepInput(String),
}

/// A GPU plan loaded on a device, with its KV cache: one sequence's, or a batched plan's pool.
pub struct PlanExecutor<D: PlanDevice> {
    plan: GpuPlan,
    graph: Graph,
    context_length: usize,
    /// Batched steps of up to this many rows run as recorded graphs (0: never).
    graph_rows: usize,
    /// In a batched plan, the nodes with one row per sequence (see
    /// `codegen::gpu::per_sequence_nodes`).
    per_sequence: BTreeSet<usize>,
    state: Mutex<(D, Buffers<D::Buffer>)>,
}

/// A sequence's state on the device is the executor's KV cache; this is its length.
#[derive(Debug, Default, Clone)]
pub struct PlanSequence {
    pub len: usize,
}

impl<D: PlanDevice> PlanExecutor<D> {
    /// Put `plan`'s weights, INT8 rows, constants, KV cache and arena on `device`.
    pub fn new(
        device: D,
        plan: GpuPlan,
        graph: Graph,
        weights: &WeightSource,
        int8: &[(String, Int8Rows)],
        context_length: usize,
    ) -> Result<Self> {
        Self::load(device, plan, graph, PlanWeights::Host(weights), int8, context_length)
    }

    /// Like [`new`](Self::new) for a graph lowered without weights: each weight is made on
    /// the device from `seed` (the device must have loaded [`crate::generated::fill_kernels`]).
    pub fn with_generated_weights(
        device: D,
        plan: GpuPlan,
        graph: Graph,
        seed: u32,
        context_length: usize,
    ) -> Result<Self> {
        Self::load(
            device,
            plan,
            graph,
            PlanWeights::Generated { seed },
            &[],
            context_length,
        )
    }

    fn load(
        mut device: D,
        plan: GpuPlan,
        graph: Graph,
        weights: PlanWeights<'_>,
        int8: &[(String, Int8Rows)],
        context_length: usize,
    ) -> Result<Self> {
        // A batched plan's cache is the block pool; a one-sequence plan's, its context.
        let cache_rows = plan.batched.map_or(context_length, |c| c.blocks * c.block_size);
        // Kernels index the cache with 32-bit integers (f32 elements): refuse before uploading.
        if let Some(layout) = plan
            .kv_cache
            .iter()
            .find(|l| cache_rows.saturating_mul(l.kv_dim) > i32::MAX as usize)
        {
            return Err(RuntimeError::Input(format!(
                "a KV cache of {cache_rows} positions × {} values is past the kernels' 32-bit indices: ask for fewer blocks",
                layout.kv_dim
            )));
        }
        let mut sizes = HashMap::new();
        let mut device_weights = HashMap::new();
        for w in &plan.weights {
            let buffer = match weights {
                PlanWeights::Host(source) => {
                    let bytes = weight_bytes(w.dtype, &w.parts, source)?;
                    sizes.insert(BufferKey::Weight(w.node), bytes.len());
                    device.upload(&bytes)?
                }
                PlanWeights::Generated { seed } => {
                    let (buffer, bytes) = crate::generated::make_weight(&mut device, &graph, w, seed)?;
                    sizes.insert(BufferKey::Weight(w.node), bytes);
                    buffer
                }
            };
            device_weights.insert(w.node, buffer);
        }
        let mut upload = |device: &mut D, key: BufferKey, bytes: &[u8]| {
            sizes.insert(key, bytes.len());
            device.upload(bytes)
        };
        let mut derived = HashMap::new();
        for (name, rows) in int8 {
            for (tensor, bytes) in int8_tensors(rows) {
                let key = BufferKey::Derived(name.clone(), tensor.to_string());
                derived.insert((name.clone(), tensor.to_string()), upload(&mut device, key, &bytes)?);
            }
        }
        let mut constants = HashMap::new();
        for (name, values) in &plan.constants {
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            constants.insert(
                name.clone(),
                upload(&mut device, BufferKey::Constant(name.clone()), &bytes)?,
            );
        }
        let mut kv = HashMap::new();
        for layout in &plan.kv_cache {
            for value in [false, true] {
                let bytes = cache_rows * layout.bytes_per_token;
                sizes.insert(BufferKey::Kv(layout.slot, value), bytes);
                kv.insert((layout.slot, value), device.alloc(bytes)?);
            }
        }
        let mut step_inputs = HashMap::new();
        if let Some(cache) = plan.batched {
            // Every row a sequence of its own, each with a table for the whole context.
            let rows = plan.max_tokens;
            let table_entries = rows * context_length.div_ceil(cache.block_size);
            let inputs = [
                ("block_tables", table_entries),
                ("row_table", rows),
                ("row_pos", rows),
                ("last_rows", rows),
            ];
            for (name, entries) in inputs {
                sizes.insert(BufferKey::StepInput(name.into()), 4 * entries);
                step_inputs.insert(name.to_string(), device.alloc(4 * entries)?);
            }
        }
        let arena = device.alloc(plan.memory.arena_bytes.max(1))?;
        let buffers = Buffers {
            arena,
            weights: device_weights,
            derived,
            constants,
            kv,
            step_inputs,
            sizes,
        };
        let per_sequence = match plan.batched {
            Some(_) => codegen::gpu::per_sequence_nodes(&graph),
            None => BTreeSet::new(),
        };
        Ok(Self {
            plan,
            graph,
            context_length,
            graph_rows: 0,
            per_sequence,
            state: Mutex::new((device, buffers)),
        })
    }

    /// Run decode steps (one row per sequence) of up to `rows` sequences as graphs, where the
    /// device records them: each size is captured the first time it comes and replayed after,
    /// so a decode step is one launch for the host instead of one per kernel. Sound because a
    /// batched step's launches depend on its row and sequence counts alone: everything else
    /// the kernels read (ids, positions, block tables, last rows) sits in device buffers that
    /// never move.
    pub fn capture_graphs_up_to(mut self, rows: usize) -> Self {
        self.graph_rows = rows;
        self
    }

    pub fn context_length(&self) -> usize {
        self.context_length
    }

    /// A batched plan's KV pool; `None` for a one-sequence plan.
    pub fn batched_cache(&self) -> Option<codegen::gpu::BatchedCache> {
        self.plan.batched
    }

    /// Look at the device (e.g. what a comparing device recorded).
    pub fn with_device<R>(&self, f: impl FnOnce(&D) -> R) -> Result<R> {
        let state = self
            .state
            .lock()
            .map_err(|_| RuntimeError::Cuda("device state poisoned".into()))?;
        Ok(f(&state.0))
    }

    pub fn new_sequence(&self) -> PlanSequence {
        PlanSequence::default()
    }

    /// Process `ids` as the next tokens of `seq` (the one sequence the KV cache holds).
    pub fn step(&self, seq: &mut PlanSequence, ids: &[u32]) -> Result<HashMap<String, Tensor>> {
        if self.plan.batched.is_some() {
            return Err(RuntimeError::Artifact(
                "this plan runs batched steps (step_batch), not one sequence".into(),
            ));
        }
        let tokens = ids.len();
        self.check_rows(tokens)?;
        if seq.len + tokens > self.context_length {
            return Err(RuntimeError::ContextOverflow {
                needed: seq.len + tokens,
                limit: self.context_length,
            });
        }
        let mut state = self.lock()?;
        let (device, buffers) = &mut *state;
        let positions: Vec<usize> = (seq.len..seq.len + tokens).collect();
        self.write_inputs(device, buffers, ids, &positions)?;
        let vars = HashMap::from([
            ("tokens", Value::Int(tokens as i64)),
            ("first", Value::Int(seq.len as i64)),
        ]);
        self.launch_all(device, buffers, &vars, None)?;
        seq.len += tokens;
        self.read_outputs(device, buffers, tokens, seq.len)
    }

    /// Process every segment's tokens in one batched step over the paged KV cache (a plan from
    /// `codegen::gpu::build_batched`); each segment's outputs (its rows), in order.
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

    /// Each segment's `next_token` (the argmax of its last logits row, on the device), the only
    /// output read back: a serving plan from `models::with_greedy_token`. `None` for a plan
    /// without a per-sequence `next_token`.
    pub fn step_batch_greedy_tokens(&self, batch: &[Segment]) -> Option<Result<Vec<u32>>> {
        if !self.has_greedy_tokens() {
            return None;
        }
        let read = self.step_batch_reading(batch, Rows::LastOfEachSegment, Some("next_token"));
        Some(read.map(|outputs| {
            outputs
                .iter()
                .map(|o| o["next_token"].data.first().map_or(0, |&id| id as u32))
                .collect()
        }))
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
        Ok(profile)
    }

    /// A batched step, reading back `rows` of every output, or of `only` that one.
    fn step_batch_reading(
        &self,
        batch: &[Segment],
        rows: Rows,
        only: Option<&str>,
    ) -> Result<Vec<HashMap<String, Tensor>>> {
        let mut state = self.lock()?;
        let (device, buffers) = &mut *state;
        let (segment_rows, vars) = self.write_batch(device, buffers, batch)?;
        let tokens = segment_rows.last().map_or(0, |r| r.end);
        self.launch_batched(device, buffers, &vars, tokens, batch.len())?;
        // The rows read back: each segment's, or its last.
        let wanted: Vec<Range<usize>> = match rows {
            Rows::All => segment_rows,
            Rows::LastOfEachSegment => segment_rows.iter().map(|r| r.end - 1..r.end).collect(),
        };
        // Per-sequence outputs (from `last_token` on) have row i for segment i.
        let one_each: Vec<Range<usize>> = (0..batch.len()).map(|i| i..i + 1).collect();
        let mut per_segment = vec![HashMap::new(); batch.len()];
        for (name, node) in &self.plan.outputs {
            if only.is_some_and(|o| o != name) {
                continue;
            }
            let wanted = match self.per_sequence.contains(node) {
                true => &one_each,
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
        // Each segment's rows of the step.
        let mut segment_rows: Vec<Range<usize>> = Vec::with_capacity(batch.len());
        for seg in batch {
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
            row_table.extend(std::iter::repeat_n(tables.len() as i32, seg.ids.len()));
            tables.extend(seg.table[..blocks].iter().map(|b| b.0 as i32));
        }
        self.write_inputs(device, buffers, &ids, &positions)?;
        let row_pos: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        // Each segment's last row, where per-sequence values (`last_token` on) gather from.
        let last_rows: Vec<i32> = segment_rows.iter().map(|r| r.end as i32 - 1).collect();
        for (name, values) in [
            ("block_tables", &tables),
            ("row_table", &row_table),
            ("row_pos", &row_pos),
            ("last_rows", &last_rows),
        ] {
            let buffer = buffers
                .step_inputs
                .get(name)
                .ok_or_else(|| RuntimeError::Artifact(format!("no step input `{name}`")))?;
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            device.write(buffer, 0, &bytes)?;
        }
        let vars = HashMap::from([
            ("tokens", Value::Int(tokens as i64)),
            ("seqs", Value::Int(batch.len() as i64)),
            ("first", Value::Int(0)),
            ("block_size", Value::Int(cache.block_size as i64)),
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
        let integer = self.graph.nodes()[node].dtype == DType::I32;
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
            let values: Vec<f32> = bytes
                .chunks_exact(4)
                .map(|c| [c[0], c[1], c[2], c[3]])
                .map(|w| match integer {
                    true => i32::from_le_bytes(w) as f32,
                    false => f32::from_le_bytes(w),
                })
                .collect();
            for range in &wanted[i..j] {
                let from = (range.start - rows.start) * width;
                out.push(values[from..from + range.len() * width].to_vec());
            }
            i = j;
        }
        Ok(out)
    }

    fn check_rows(&self, tokens: usize) -> Result<()> {
        if tokens == 0 || tokens > self.plan.max_tokens {
            return Err(RuntimeError::Input(format!(
                "a GPU step takes 1 to {} tokens, got {tokens}",
                self.plan.max_tokens
            )));
        }
        Ok(())
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, (D, Buffers<D::Buffer>)>> {
        self.state
            .lock()
            .map_err(|_| RuntimeError::Cuda("device state poisoned".into()))
    }

    /// Token ids and positions as i32 at their planned offsets.
    fn write_inputs(
        &self,
        device: &mut D,
        buffers: &Buffers<D::Buffer>,
        ids: &[u32],
        positions: &[usize],
    ) -> Result<()> {
        let ids: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        let positions: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        for (node, values) in [(self.plan.token_ids, &ids), (self.plan.positions, &positions)] {
            if let Some(node) = node {
                let at = self.buffer(node, None)?.start;
                let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                device.write(&buffers.arena, at, &bytes)?;
            }
        }
        Ok(())
    }

    /// A batched step's launches: replayed from the graph of its row and sequence counts,
    /// captured first if there is none yet (see `capture_graphs_up_to`), or launched one by one.
    fn launch_batched(
        &self,
        device: &mut D,
        buffers: &Buffers<D::Buffer>,
        vars: &HashMap<&str, Value>,
        tokens: usize,
        seqs: usize,
    ) -> Result<()> {
        // Decode steps only (a row per sequence): the shapes that repeat step after step.
        // Mixed steps with prompt chunks come in too many shapes to be worth a graph each.
        if tokens > self.graph_rows || seqs != tokens || !device.records_graphs() {
            return self.launch_all(device, buffers, vars, None);
        }
        // The launches depend on the row count and the sequence count (per-sequence rows).
        let key = tokens * (self.plan.max_tokens + 1) + seqs;
        if device.replay(key)? {
            return Ok(());
        }
        device.begin_capture()?;
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

    /// The plan's launches in order, arguments resolved against `vars`.
    /// With `profile`, each launch is timed and recorded there.
    fn launch_all(
        &self,
        device: &mut D,
        buffers: &Buffers<D::Buffer>,
        vars: &HashMap<&str, Value>,
        mut profile: Option<&mut Vec<LaunchProfile>>,
    ) -> Result<()> {
        let step_tokens = vars.get("tokens").map_or(0, |v| v.as_i64());
        for launch in &self.plan.launches {
            // The prefill variant pays for launches of many rows: the launch's own row count
            // (its `tokens` argument; a per-sequence launch has one row per sequence), else
            // the step's.
            let rows = match launch.args.iter().find_map(|a| match a {
                LaunchArg::Scalar { name, value } if name == "tokens" => Some(value),
                _ => None,
            }) {
                Some(value) => expr::eval(value, vars)
                    .map_err(|e| RuntimeError::Artifact(e.to_string()))?
                    .as_i64(),
                None => step_tokens,
            };
            let name = match &launch.prefill_kernel {
                Some(p) if rows >= PREFILL_TOKENS as i64 => p,
                _ => &launch.kernel,
            };
            let kernel = self
                .plan
                .kernels
                .iter()
                .find(|k| &k.name == name)
                .ok_or_else(|| RuntimeError::Artifact(format!("no kernel {name}")))?;
            let mut args = Vec::with_capacity(launch.args.len());
            let mut scalars: HashMap<&str, Value> = vars.clone();
            for (arg, param) in launch.args.iter().zip(&kernel.params) {
                args.push(match arg {
                    LaunchArg::Scalar { value, .. } => {
                        let v = expr::eval(value, vars).map_err(|e| RuntimeError::Artifact(e.to_string()))?;
                        scalars.insert(param.name.as_str(), v);
                        match param.kind.as_str() {
                            "float" => DeviceArg::F32(v.as_f64() as f32),
                            _ => DeviceArg::I32(v.as_i64() as i32),
                        }
                    }
                    other => self.resolve(other, buffers, vars)?,
                });
            }
            let grid = expr::eval(&kernel.grid, &scalars)
                .map_err(|e| RuntimeError::Artifact(e.to_string()))?
                .as_i64();
            if grid <= 0 {
                continue;
            }
            match profile.as_deref_mut() {
                None => device.launch(name, grid as u32, kernel.block, &args)?,
                Some(profile) => {
                    let seconds = device.launch_timed(name, grid as u32, kernel.block, &args)?;
                    let weight_bytes = self.weight_bytes_read(launch, &args, rows.max(0) as usize);
                    profile.push(LaunchProfile {
                        kernel: name.clone(),
                        seconds,
                        weight_bytes,
                    });
                }
            }
        }
        Ok(())
    }

    /// Bytes of weights `launch` reads over `rows` rows: all it is given, except that an
    /// embedding gathers one table row per row.
    fn weight_bytes_read(
        &self,
        launch: &codegen::gpu::Launch,
        args: &[DeviceArg<'_, D::Buffer>],
        rows: usize,
    ) -> usize {
        let node = &self.graph.nodes()[launch.node];
        let given = launch
            .args
            .iter()
            .zip(args)
            .map(|(arg, device_arg)| match (arg, device_arg) {
                (LaunchArg::Weight { node }, DeviceArg::Buffer(_, r)) => (*node, r.len()),
                (LaunchArg::Derived { .. }, DeviceArg::Buffer(_, r)) => (usize::MAX, r.len()),
                _ => (usize::MAX, 0),
            });
        given
            .map(|(weight, bytes)| match (&node.op, self.graph.nodes().get(weight)) {
                (ir::Op::Embedding, Some(table)) => {
                    let table_rows = table.shape.resolve(0, 0).first().copied().unwrap_or(1).max(1);
                    bytes / table_rows * rows.min(table_rows)
                }
                _ => bytes,
            })
            .sum()
    }

    /// The graph's outputs after a step of `tokens` rows (`cached` positions in the cache).
    fn read_outputs(
        &self,
        device: &mut D,
        buffers: &Buffers<D::Buffer>,
        tokens: usize,
        cached: usize,
    ) -> Result<HashMap<String, Tensor>> {
        let mut outputs = HashMap::new();
        for (name, node) in &self.plan.outputs {
            let shape = self.graph.nodes()[*node].shape.resolve(tokens, cached);
            let at = self.buffer(*node, None)?.start;
            let len = shape.iter().product::<usize>();
            let bytes = device.read(&buffers.arena, at..at + 4 * len)?;
            let words = bytes.chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]);
            let data: Vec<f32> = match self.graph.nodes()[*node].dtype {
                DType::I32 => words.map(|w| i32::from_le_bytes(w) as f32).collect(),
                _ => words.map(f32::from_le_bytes).collect(),
            };
            outputs.insert(name.clone(), Tensor::new(shape, data));
        }
        Ok(outputs)
    }

    /// The arena bytes of `node`'s value, or of one of its launches' scratch buffers.
    fn buffer(&self, node: usize, scratch: Option<&str>) -> Result<Range<usize>> {
        self.plan
            .memory
            .buffers
            .iter()
            .find(|b| b.node == node && b.scratch.as_deref() == scratch)
            .map(|b| b.offset..b.offset + b.bytes)
            .ok_or_else(|| RuntimeError::Artifact(format!("no planned buffer for %{node} {scratch:?}")))
    }

    /// A buffer argument: which buffer, and the bytes of it the launch may touch.
    fn resolve<'b>(
        &self,
        arg: &LaunchArg,
        buffers: &'b Buffers<D::Buffer>,
        vars: &HashMap<&str, Value>,
    ) -> Result<DeviceArg<'b, D::Buffer>> {
        let missing = |what: String| RuntimeError::Artifact(format!("{what} missing"));
        let whole = |key: BufferKey| 0..buffers.sizes.get(&key).copied().unwrap_or(0);
        Ok(match arg {
            LaunchArg::Activation { node, offset } => {
                let elems = expr::eval(offset, vars)
                    .map_err(|e| RuntimeError::Artifact(e.to_string()))?
                    .as_i64() as usize;
                let range = self.buffer(*node, None)?;
                DeviceArg::Buffer(&buffers.arena, (range.start + 4 * elems).min(range.end)..range.end)
            }
            LaunchArg::Scratch { node, name, .. } => DeviceArg::Buffer(&buffers.arena, self.buffer(*node, Some(name))?),
            LaunchArg::Weight { node } => DeviceArg::Buffer(
                buffers
                    .weights
                    .get(node)
                    .ok_or_else(|| missing(format!("weight %{node}")))?,
                whole(BufferKey::Weight(*node)),
            ),
            LaunchArg::KvCache { slot, value } => DeviceArg::Buffer(
                buffers
                    .kv
                    .get(&(*slot, *value))
                    .ok_or_else(|| missing(format!("KV cache {slot}")))?,
                whole(BufferKey::Kv(*slot, *value)),
            ),
            LaunchArg::Constant { name } => DeviceArg::Buffer(
                buffers
                    .constants
                    .get(name)
                    .ok_or_else(|| missing(format!("constant `{name}`")))?,
                whole(BufferKey::Constant(name.clone())),
            ),
            LaunchArg::Derived { weight, tensor } => DeviceArg::Buffer(
                buffers
                    .derived
                    .get(&(weight.clone(), tensor.clone()))
                    .ok_or_else(|| missing(format!("INT8 rows of `{weight}` (from the artifact)")))?,
                whole(BufferKey::Derived(weight.clone(), tensor.clone())),
            ),
            LaunchArg::StepInput { name } => DeviceArg::Buffer(
                buffers
                    .step_inputs
                    .get(name)
                    .ok_or_else(|| missing(format!("step input `{name}` (the plan is not batched)")))?,
                whole(BufferKey::StepInput(name.clone())),
            ),
            LaunchArg::Scalar { .. } => unreachable!("scalars are resolved by the caller"),
        })
    }
}

/// The tensors of an INT8 head as the kernels read them.
fn int8_tensors(rows: &Int8Rows) -> [(&'static str, Vec<u8>); 5] {
    let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    [
        ("q", rows.q.iter().map(|&q| q as u8).collect()),
        ("scale", f32s(&rows.scale)),
        ("err_norm", f32s(&rows.err_norm)),
        ("quant_norm", f32s(&rows.quant_norm)),
        ("norm", f32s(&rows.norm)),
    ]
}

/// A weight as the kernels read it: the parts stacked by rows, converted to `dtype` (f32, bf16)
/// or kept as GGUF blocks.
fn weight_bytes(dtype: DType, parts: &[String], source: &WeightSource) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    for name in parts {
        let view = source
            .get(name)
            .ok_or_else(|| RuntimeError::Weight(format!("`{name}` is not in the weights")))?;
        match dtype {
            DType::F32 => out.extend(view.to_f32().data.iter().flat_map(|v| v.to_le_bytes())),
            DType::BF16 => out.extend(view.to_f32().data.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes())),
            quant if models::weights::ir_dtype(view.dtype) == quant => out.extend_from_slice(view.bytes),
            other => {
                return Err(RuntimeError::Weight(format!(
                    "`{name}` is {} but the plan wants {other}",
                    view.dtype.name()
                )))
            }
        }
    }
    Ok(out)
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

    fn step_batch(&self, pages: &mut usize, batch: &[Segment]) -> Result<Vec<HashMap<String, Tensor>>> {
        // Serving samples from each segment's last row only.
        self.check_block_size(*pages)?;
        self.step_batch_last_rows(batch)
    }

    fn step_batch_greedy(&self, pages: &mut usize, batch: &[Segment]) -> Option<Result<Vec<u32>>> {
        if let Err(e) = self.check_block_size(*pages) {
            return Some(Err(e));
        }
        self.step_batch_greedy_tokens(batch)
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
