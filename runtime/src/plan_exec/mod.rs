//! Running a GPU plan (`plan.json`), the device-independent half of the GPU backend: upload the
//! weights in the layout the kernels expect (row-stacked, bf16 or GGUF blocks as the plan says;
//! the INT8 heads from the artifact), allocate the activation arena and the KV cache, and run
//! a step as the plan's launches in order, each argument resolved from the plan (arena offsets,
//! views, scalars that are expressions of `tokens` and `first`), then read the outputs back. A
//! one-sequence plan steps one sequence over a contiguous cache (`step`); a batched plan steps
//! rows of many sequences over a paged pool, with the scheduler's block tables (`step_batch`).
//!
//! The device ([`PlanDevice`]) owns memory and launches kernels: CUDA through cudarc
//! (`runtime_cuda`), or the kernels-gen emulator (`crate::emulator_device`), which runs the very same
//! plan on the CPU, so everything above the kernels is tested without a GPU.
//!
//! This file: the device interface, loading a plan, one-sequence steps. `batched`: batched
//! steps over the paged pool (and graphs of them), serving. `launch`: a step's launches with
//! their arguments resolved. `weight_bytes`: weights as the kernels read them, made on the
//! host; `device_convert`: made on the device from their stored form.

mod batched;
mod device_convert;
mod launch;
mod weight_bytes;

use crate::error::{Result, RuntimeError};
use gpu_plan::expr::Value;
use gpu_plan::{GpuPlan, WeightPart};
use half::bf16;
use ir::{DType, Graph, Tensor};
use kernels_gen::templates::weight_convert::convert_kernel_name;
use quant::int8_rows::Int8Rows;
use quant::tensor::Tensors;
use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::sync::Mutex;
pub(crate) use weight_bytes::weight_bytes;

/// Memory and launches on one device.
pub trait PlanDevice {
    type Buffer;
    /// A zeroed buffer of `bytes`.
    fn alloc(&mut self, bytes: usize) -> Result<Self::Buffer>;
    fn upload(&mut self, bytes: &[u8]) -> Result<Self::Buffer>;
    /// Copy `bytes` into `buffer` at byte `at`, after every launch already issued.
    fn write(&mut self, buffer: &Self::Buffer, at: usize, bytes: &[u8]) -> Result<()>;
    fn read(&mut self, buffer: &Self::Buffer, range: Range<usize>) -> Result<Vec<u8>>;
    /// Copy `bytes` from `from` at byte `from_at` to `to` at byte `to_at`, on the device and
    /// after every launch already issued (the buffers differ).
    fn copy(
        &mut self,
        from: &Self::Buffer,
        from_at: usize,
        to: &Self::Buffer,
        to_at: usize,
        bytes: usize,
    ) -> Result<()>;
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

    /// Whether kernels prefetch the next matmul's weights into L2 where the plan has them do
    /// it (the step's `prefetch` variable; `templates::weight_prefetch`). Only a cache makes
    /// that worth anything; the emulator does it to check the prefetches' bounds.
    fn prefetches_weights(&self) -> bool {
        false
    }

    /// The device's memory now, where it can say (what sizes the KV pool by a share of it).
    fn memory(&self) -> Option<crate::kv_sizing::DeviceMemory> {
        None
    }

    /// Wait until everything issued has finished (uploads and launches).
    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }

    /// Wait until every kernel can be launched, for a device that loads them while weights
    /// upload; the error of one that failed to load.
    fn kernels_loaded(&mut self) -> Result<()> {
        Ok(())
    }

    /// Give `buffer`'s memory back to the device.
    fn release(&mut self, buffer: Self::Buffer) {
        drop(buffer);
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

// By hand: the buffer is borrowed, so an argument clones whatever the buffer's type.
impl<B> Clone for DeviceArg<'_, B> {
    fn clone(&self) -> Self {
        match self {
            Self::Buffer(buffer, range) => Self::Buffer(buffer, range.clone()),
            Self::I32(v) => Self::I32(*v),
            Self::F32(v) => Self::F32(*v),
        }
    }
}

/// Where a plan's weights come from.
#[derive(Clone, Copy)]
pub enum PlanWeights<'a> {
    /// The model's tensors, converted on the host to the plan's dtypes and uploaded.
    Host(&'a dyn Tensors),
    /// Made on the device by the fill kernels (see [`crate::random_weights`]) from this seed: for
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

/// Everything the plan's launches point into: the activation arena, and every other buffer
/// by what it holds, with its size in bytes (the range a launch is handed).
struct Buffers<B> {
    arena: B,
    held: HashMap<BufferKey, (B, usize)>,
}

impl<B> Buffers<B> {
    /// The buffer holding `key` and its whole byte range.
    fn whole(&self, key: &BufferKey) -> Option<(&B, Range<usize>)> {
        self.held.get(key).map(|(buffer, bytes)| (buffer, 0..*bytes))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum BufferKey {
    Weight(usize),
    Derived(String, String),
    Constant(String),
    Kv(usize, bool),
    /// A recurrent layer's states, a slot per sequence.
    State(usize),
    /// Snapshots of a recurrent layer's states, a place per snapshot (see
    /// [`PlanExecutor::keep_state_snapshots`]).
    Snapshots(usize),
    /// The states a recurrent layer's kernels keep after rows a verifying step may rewind to,
    /// a place per (state slot, draft) (see [`PlanExecutor::verify_drafts_up_to`]).
    Checkpoints(usize),
    /// A batched plan's per-step inputs, by name.
    StepInput(String),
    /// The plan's position scores (`LaunchArg::PositionScores`).
    PositionScores,
}

/// A GPU plan loaded on a device, with its KV cache: one sequence's, or a batched plan's pool.
pub struct PlanExecutor<D: PlanDevice> {
    plan: GpuPlan,
    graph: Graph,
    context_length: usize,
    /// Batched steps of up to this many rows run as recorded graphs (0: never).
    graph_rows: usize,
    /// In a batched plan, the nodes with one row per sequence (see
    /// `gpu_plan::per_sequence_nodes`).
    per_sequence: BTreeSet<usize>,
    /// Whether a segment may sample several rows (see `samples_several_rows`).
    several_rows: bool,
    /// Whether the kernels keep the recurrent states a refused draft is rewound to, where the
    /// model has any (see `keeps_draft_checkpoints`).
    draft_checkpoint_kernels: bool,
    /// The step inputs listing the step's tiles of query rows that a batched plan's attention
    /// reads, each with its tiles' rows (written each step only where read).
    query_tile_inputs: Vec<(String, usize)>,
    /// Places for snapshots of recurrent states (0: none kept).
    snapshot_places: usize,
    /// Drafts a sequence's recurrent state can be rewound past: a checkpoint each (0: none).
    draft_checkpoints: usize,
    /// Whether a step was captured as a graph (which holds the buffers' addresses as they
    /// were: `verify_drafts_up_to` may no longer move the checkpoints).
    captured: std::sync::atomic::AtomicBool,
    /// The plan's launches resolved once (see `launch`).
    launches: Vec<launch::PreparedLaunch>,
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
        weights: &dyn Tensors,
        int8: &[(String, Int8Rows)],
        context_length: usize,
    ) -> Result<Self> {
        Self::with_weights(device, plan, graph, PlanWeights::Host(weights), int8, context_length)
    }

    /// Like [`new`](Self::new) for a graph lowered without weights: each weight is made on
    /// the device from `seed` (the device must have loaded [`crate::random_weights::fill_kernels`]).
    pub fn with_generated_weights(
        device: D,
        plan: GpuPlan,
        graph: Graph,
        seed: u32,
        context_length: usize,
    ) -> Result<Self> {
        Self::with_weights(
            device,
            plan,
            graph,
            PlanWeights::Generated { seed },
            &[],
            context_length,
        )
    }

    /// Like [`new`](Self::new), the weights from wherever `weights` says.
    pub fn with_weights(
        device: D,
        plan: GpuPlan,
        graph: Graph,
        weights: PlanWeights<'_>,
        int8: &[(String, Int8Rows)],
        context_length: usize,
    ) -> Result<Self> {
        Self::load(device, plan, graph, weights, int8, context_length, &|_| None)
    }

    /// Like [`with_weights`](Self::with_weights) on a `device` sharing memory with `beside`'s
    /// (another plan on the same GPU): each weight `beside` holds already, the same tensors
    /// in the same form, is read from its buffer instead of uploaded again (an MTP head's
    /// embedding and LM head are its target's).
    pub fn with_weights_beside(
        device: D,
        plan: GpuPlan,
        graph: Graph,
        weights: PlanWeights<'_>,
        int8: &[(String, Int8Rows)],
        context_length: usize,
        beside: &SharedWeights<D::Buffer>,
    ) -> Result<Self>
    where
        D::Buffer: Clone,
    {
        Self::load(device, plan, graph, weights, int8, context_length, &|w| beside.find(w))
    }

    /// Load the plan, each weight `shared` gives a buffer for taken from it.
    fn load(
        mut device: D,
        plan: GpuPlan,
        graph: Graph,
        weights: PlanWeights<'_>,
        int8: &[(String, Int8Rows)],
        context_length: usize,
        shared: FindShared<'_, D::Buffer>,
    ) -> Result<Self> {
        // Before anything is uploaded: an artifact whose launches do not resolve is refused.
        let launches = launch::prepare(&plan)?;
        // A batched plan's cache is the block pool; a one-sequence plan's, its context.
        let cache_rows = plan.batched.map_or(context_length, |c| c.blocks * c.block_size);
        if let Some(cache) = plan.batched.filter(|c| c.block_size % plan.block_multiple.max(1) != 0) {
            return Err(RuntimeError::Input(format!(
                "this plan's kernels copy KV blocks {m} positions at a time: blocks of {} positions do not hold whole copies (give a block size that is a multiple of {m})",
                cache.block_size,
                m = plan.block_multiple
            )));
        }
        // Kernels index the cache with 32-bit integers (f32 elements): refuse before uploading.
        if let Some(layout) = plan
            .kv_cache
            .iter()
            .find(|l| cache_rows.saturating_mul(l.widest_row()) > i32::MAX as usize)
        {
            return Err(RuntimeError::Input(format!(
                "a KV cache of {cache_rows} positions × {} values is past the kernels' 32-bit indices: ask for fewer blocks",
                layout.widest_row()
            )));
        }
        // The indexer's scores: a row per step row, a column per position of the context.
        let position_scores = plan.max_tokens.saturating_mul(context_length);
        if plan.position_scores && position_scores > i32::MAX as usize {
            return Err(RuntimeError::Input(format!(
                "position scores for {} rows × {context_length} positions are past the kernels' 32-bit indices: ask for a shorter context",
                plan.max_tokens
            )));
        }
        let mut held = HashMap::new();
        // Those the plan beside this one holds already; the rest made here.
        let mut own = Vec::new();
        for w in &plan.weights {
            match shared(w) {
                Some(buffer) => drop(held.insert(BufferKey::Weight(w.node), buffer)),
                None => own.push(w.clone()),
            }
        }
        match weights {
            PlanWeights::Host(source) => {
                // The conversions the plan carries kernels for.
                let kernels: BTreeSet<&str> = plan.kernels.iter().map(|k| k.name.as_str()).collect();
                let converts = |stored: DType, to: DType| kernels.contains(convert_kernel_name(stored, to).as_str());
                upload_weights(&mut device, &own, source, &converts, &mut held)?
            }
            PlanWeights::Generated { seed } => {
                for w in &own {
                    let weight = crate::random_weights::make_weight(&mut device, &graph, w, seed)?;
                    held.insert(BufferKey::Weight(w.node), weight);
                }
            }
        }
        let mut upload = |device: &mut D, key: BufferKey, bytes: &[u8]| -> Result<()> {
            held.insert(key, (device.upload(bytes)?, bytes.len()));
            Ok(())
        };
        for (name, rows) in int8 {
            for (tensor, bytes) in int8_tensors(rows) {
                upload(
                    &mut device,
                    BufferKey::Derived(name.clone(), tensor.to_string()),
                    &bytes,
                )?;
            }
        }
        for (name, w) in shortlisted_heads(&plan) {
            let bytes = four_bit_copy(w, &weights)?;
            upload(
                &mut device,
                BufferKey::Derived(name, gpu_plan::SHORTLIST_TENSOR.into()),
                &bytes,
            )?;
        }
        for (name, values) in &plan.constants {
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            upload(&mut device, BufferKey::Constant(name.clone()), &bytes)?;
        }
        alloc_kv_cache(&mut device, &mut held, &plan.kv_cache, cache_rows)?;
        if plan.position_scores {
            let bytes = position_scores * 4;
            held.insert(BufferKey::PositionScores, (device.alloc(bytes)?, bytes));
        }
        // Zero: a slot's first step starts it afresh anyway (`templates::delta_net`).
        let state_slots = plan.batched.map_or(1, |c| c.sequences);
        for layout in &plan.recurrent_states {
            let bytes = state_slots * layout.len * 4;
            if state_slots * layout.len > i32::MAX as usize {
                return Err(RuntimeError::Input(format!(
                    "{state_slots} recurrent states of {} values are past the kernels' 32-bit indices: run fewer sequences at once",
                    layout.len
                )));
            }
            held.insert(BufferKey::State(layout.slot), (device.alloc(bytes.max(4))?, bytes));
            // No checkpoints until drafts are verified (`verify_drafts_up_to`); the kernels
            // take the buffer all the same.
            held.insert(BufferKey::Checkpoints(layout.slot), (device.alloc(4)?, 0));
        }
        if let Some(cache) = plan.batched {
            // Every row a sequence of its own, each with a table for the whole context.
            let rows = plan.max_tokens;
            let table_entries = rows * context_length.div_ceil(cache.block_size);
            let inputs = [
                ("block_tables", table_entries),
                ("row_table", rows),
                ("row_pos", rows),
                ("last_rows", rows),
                ("sampled_rows", rows),
                ("sampled_row_table", rows),
                ("sampled_row_pos", rows),
                ("row_seq", rows),
                ("state_slots", rows),
                ("row_checkpoint", rows),
            ]
            .map(|(name, entries)| (name.to_string(), entries));
            // Two entries a tile: one tile a sequence at most, and one more a tile's rows.
            let query_tiles = batched::query_tile_inputs(&plan).into_iter().map(|(name, tile_rows)| {
                let tiles = kernels_gen::templates::flash_attention::max_query_tiles(rows, rows, tile_rows);
                (name, 2 * tiles)
            });
            for (name, entries) in inputs.into_iter().chain(query_tiles) {
                held.insert(BufferKey::StepInput(name), (device.alloc(4 * entries)?, 4 * entries));
            }
        }
        let arena = device.alloc(plan.memory.arena_bytes.max(1))?;
        device.kernels_loaded()?;
        let buffers = Buffers { arena, held };
        let per_sequence = match plan.batched {
            Some(_) => gpu_plan::per_sequence_nodes(&graph),
            None => BTreeSet::new(),
        };
        let several_rows = batched::samples_several_rows(&plan, &per_sequence);
        let draft_checkpoint_kernels = batched::keeps_draft_checkpoints(&plan);
        let query_tile_inputs = batched::query_tile_inputs(&plan);
        Ok(Self {
            launches,
            plan,
            graph,
            context_length,
            graph_rows: 0,
            per_sequence,
            several_rows,
            draft_checkpoint_kernels,
            query_tile_inputs,
            snapshot_places: 0,
            draft_checkpoints: 0,
            captured: Default::default(),
            state: Mutex::new((device, buffers)),
        })
    }

    /// Keep `places` snapshots of every recurrent layer's state on the device, for the prefix
    /// cache of a model with recurrent state: a segment may start its state from one
    /// (`StateSnapshots::restore`) and save its state at its end into one; a copy on the
    /// device each way. Nothing for a plan without recurrent state.
    pub fn keep_state_snapshots(mut self, places: usize) -> Result<Self> {
        if self.plan.recurrent_states.is_empty() || places == 0 {
            return Ok(self);
        }
        {
            let (device, buffers) = self
                .state
                .get_mut()
                .map_err(|_| RuntimeError::Cuda("device state poisoned".into()))?;
            for layout in &self.plan.recurrent_states {
                let bytes = places.checked_mul(layout.len * 4).ok_or_else(|| {
                    RuntimeError::Input(format!("{places} snapshots of recurrent states do not fit in memory"))
                })?;
                buffers
                    .held
                    .insert(BufferKey::Snapshots(layout.slot), (device.alloc(bytes)?, bytes));
            }
        }
        self.snapshot_places = places;
        Ok(self)
    }

    /// Size a batched plan's KV pool to what fits in `share` of the device's memory once
    /// everything else is allocated (vLLM's `--gpu-memory-utilization`; see
    /// [`crate::kv_sizing::gpu_kv_blocks`]), in place of the blocks it was loaded with: called
    /// last, after [`keep_state_snapshots`](Self::keep_state_snapshots) and
    /// [`verify_drafts_up_to`](Self::verify_drafts_up_to), and before the first step is
    /// captured as a graph (which holds the pool's address). Refused where the pool would not
    /// hold one request of the full context.
    pub fn size_kv_pool(self, share: f64) -> Result<Self> {
        self.size_kv_pool_beside(share, 0)
    }

    /// [`size_kv_pool`](Self::size_kv_pool), each block of the share also paying for
    /// `beside` bytes of another pool on the same device that gets as many blocks (an MTP
    /// head's: [`resize_kv_pool`](Self::resize_kv_pool) to this pool's blocks after).
    pub fn size_kv_pool_beside(mut self, share: f64, beside: usize) -> Result<Self> {
        let cache = self.release_kv_pool()?;
        let block_bytes = cache.block_size * self.kv_bytes_per_position();
        let context = self.context_length;
        let most = self.most_kv_blocks(cache.block_size);
        let device = &mut self.lock_mut()?.0;
        let memory = device.memory().ok_or_else(|| {
            RuntimeError::Input("this device does not report its memory: give the KV pool's blocks".into())
        })?;
        let per_block = block_bytes + beside;
        let blocks = crate::kv_sizing::gpu_kv_blocks(memory, share, per_block)
            .map_err(RuntimeError::Input)?
            .min(most);
        if blocks * cache.block_size < context {
            let gib = |b: usize| b as f64 / f64::from(1 << 30);
            return Err(RuntimeError::Input(format!(
                "{share} of this device's {:.1} GiB leaves {:.2} GiB for the KV cache once the model is loaded ({:.1} GiB free): {} positions, less than one request of the model's context ({context}); raise --gpu-memory-utilization, lower --max-model-len, or free the device",
                gib(memory.total),
                gib(blocks * per_block),
                gib(memory.free),
                blocks * cache.block_size
            )));
        }
        self.alloc_kv_pool(cache, blocks)?;
        Ok(self)
    }

    /// Replace a batched plan's KV pool with one of `blocks` blocks (an MTP head's, as many as
    /// its target's pool was sized to), before the first step is captured as a graph.
    pub fn resize_kv_pool(mut self, blocks: usize) -> Result<Self> {
        let cache = self.release_kv_pool()?;
        let most = self.most_kv_blocks(cache.block_size);
        if blocks == 0 || blocks > most {
            return Err(RuntimeError::Input(format!(
                "a KV pool of {blocks} blocks: it takes 1 to {most} (the kernels' 32-bit indices)"
            )));
        }
        self.alloc_kv_pool(cache, blocks)?;
        Ok(self)
    }

    /// The batched plan's cache, its pool's buffers given back to the device; refused for a
    /// plan that is not batched or once a step holds the pool's address in a graph.
    fn release_kv_pool(&mut self) -> Result<gpu_plan::BatchedCache> {
        let Some(cache) = self.plan.batched else {
            return Err(RuntimeError::Input(
                "only a batched plan's KV pool is sized to memory".into(),
            ));
        };
        if *self.captured.get_mut() {
            return Err(RuntimeError::Input(
                "the KV pool is sized before the first step captured as a graph (it holds the pool's address)".into(),
            ));
        }
        let (device, buffers) = self.lock_mut()?;
        let loaded: Vec<BufferKey> = buffers
            .held
            .keys()
            .filter(|k| matches!(k, BufferKey::Kv(..)))
            .cloned()
            .collect();
        for key in loaded {
            if let Some((buffer, _)) = buffers.held.remove(&key) {
                device.release(buffer);
            }
        }
        Ok(cache)
    }

    /// A pool of `blocks` blocks of `cache`'s size, allocated and recorded as the plan's.
    fn alloc_kv_pool(&mut self, mut cache: gpu_plan::BatchedCache, blocks: usize) -> Result<()> {
        let (device, buffers) = self
            .state
            .get_mut()
            .map_err(|_| RuntimeError::Cuda("device state poisoned".into()))?;
        alloc_kv_cache(
            device,
            &mut buffers.held,
            &self.plan.kv_cache,
            blocks * cache.block_size,
        )?;
        cache.blocks = blocks;
        self.plan.batched = Some(cache);
        Ok(())
    }

    /// The most blocks of `block_size` positions the kernels index (32-bit, f32 elements).
    fn most_kv_blocks(&self, block_size: usize) -> usize {
        let widest = self.plan.kv_cache.iter().map(|l| l.widest_row()).max().unwrap_or(1);
        i32::MAX as usize / widest / block_size
    }

    /// The device and buffers, held by this executor alone.
    fn lock_mut(&mut self) -> Result<(&mut D, &mut Buffers<D::Buffer>)> {
        let (device, buffers) = self
            .state
            .get_mut()
            .map_err(|_| RuntimeError::Cuda("device state poisoned".into()))?;
        Ok((device, buffers))
    }

    /// Bytes a cached position takes, keys and values of every layer.
    pub fn kv_bytes_per_position(&self) -> usize {
        self.plan
            .kv_cache
            .iter()
            .map(|l| l.row_bytes(false) + l.row_bytes(true))
            .sum()
    }

    /// Let a batched plan of a model with recurrent state verify up to `drafts` drafted tokens
    /// a sequence: every recurrent layer keeps, per state slot, the states after each sampled
    /// row but the last (`drafts` places of a state's size), which
    /// [`rewind_state`](crate::serving::PagedBackend::rewind_state) copies back where drafts
    /// are refused. Nothing for a plan without recurrent state (nothing to rewind), or one
    /// whose kernels keep no checkpoints (compiled before they did: it verifies no drafts).
    /// Refused once a step was captured as a CUDA graph (which holds the checkpoints'
    /// address): `bbc serve` calls it before the first step.
    pub fn verify_drafts_up_to(mut self, drafts: usize) -> Result<Self> {
        if self.plan.recurrent_states.is_empty() || !self.can_verify_drafts() || drafts == 0 {
            return Ok(self);
        }
        if *self.captured.get_mut() {
            return Err(RuntimeError::Input(
                "drafts to verify are set before the first step captured as a graph (it holds the checkpoints' address)"
                    .into(),
            ));
        }
        let slots = self.plan.batched.map_or(1, |c| c.sequences);
        let total = slots
            .saturating_mul(drafts)
            .saturating_mul(self.state_bytes_per_sequence());
        // Say what the memory was for where the device has too little.
        let too_big = |e: RuntimeError| {
            RuntimeError::Cuda(format!(
                "keeping {drafts} copies of the recurrent states of {slots} sequences ({:.1} GiB) to rewind drafts to: {e}; draft fewer tokens or run fewer sequences at once",
                total as f64 / f64::from(1 << 30)
            ))
        };
        {
            let (device, buffers) = self
                .state
                .get_mut()
                .map_err(|_| RuntimeError::Cuda("device state poisoned".into()))?;
            for layout in &self.plan.recurrent_states {
                let values = slots
                    .checked_mul(drafts)
                    .and_then(|places| places.checked_mul(layout.len))
                    .filter(|&v| v <= i32::MAX as usize)
                    .ok_or_else(|| {
                        RuntimeError::Input(format!(
                            "{drafts} drafts for each of {slots} recurrent states of {} values are past the kernels' 32-bit indices: draft fewer tokens or run fewer sequences at once",
                            layout.len
                        ))
                    })?;
                let bytes = values * 4;
                buffers.held.insert(
                    BufferKey::Checkpoints(layout.slot),
                    (device.alloc(bytes).map_err(too_big)?, bytes),
                );
            }
        }
        self.draft_checkpoints = drafts;
        Ok(self)
    }

    /// Bytes of recurrent state one sequence keeps on the device (one snapshot of it as much).
    pub fn state_bytes_per_sequence(&self) -> usize {
        self.plan.recurrent_states.iter().map(|l| l.len * 4).sum()
    }

    /// Drafts a sequence's recurrent state can be rewound past (see
    /// [`verify_drafts_up_to`](Self::verify_drafts_up_to)); 0 where none are kept.
    pub fn draft_checkpoints(&self) -> usize {
        self.draft_checkpoints
    }

    /// Places kept for snapshots of recurrent states (see [`keep_state_snapshots`](Self::keep_state_snapshots)).
    pub fn snapshot_places(&self) -> usize {
        self.snapshot_places
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
    pub fn batched_cache(&self) -> Option<gpu_plan::BatchedCache> {
        self.plan.batched
    }

    /// Look at the device (e.g. what a comparing device recorded).
    pub fn with_device<R>(&self, f: impl FnOnce(&D) -> R) -> Result<R> {
        Ok(f(&self.lock()?.0))
    }

    /// Change how the device works between steps (e.g. how it launches kernels).
    pub fn with_device_mut<R>(&self, f: impl FnOnce(&mut D) -> R) -> Result<R> {
        Ok(f(&mut self.lock()?.0))
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
        self.write_inputs(device, buffers, ids, &positions, &[])?;
        let vars = HashMap::from([
            ("tokens", Value::Int(tokens as i64)),
            ("first", Value::Int(seq.len as i64)),
            ("context", Value::Int(self.context_length as i64)),
            ("prefetch", Value::Int(device.prefetches_weights() as i64)),
        ]);
        self.launch_all(device, buffers, &vars, None)?;
        seq.len += tokens;
        self.read_outputs(device, buffers, tokens, seq.len)
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

    /// Token ids and positions as i32, and the hidden states a multi-token prediction head
    /// reads (a row per token, as f32), at their planned offsets.
    fn write_inputs(
        &self,
        device: &mut D,
        buffers: &Buffers<D::Buffer>,
        ids: &[u32],
        positions: &[usize],
        hidden_states: &[f32],
    ) -> Result<()> {
        let ids: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        let positions: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        let as_bytes = |values: &[i32]| -> Vec<u8> { values.iter().flat_map(|v| v.to_le_bytes()).collect() };
        let mut inputs = vec![
            (self.plan.token_ids, as_bytes(&ids)),
            (self.plan.positions, as_bytes(&positions)),
        ];
        if let Some(node) = self.plan.hidden_states {
            let width = self.graph.nodes()[node]
                .shape
                .resolve(ids.len(), 0)
                .last()
                .copied()
                .unwrap_or(1);
            if hidden_states.len() != ids.len() * width {
                return Err(RuntimeError::Input(format!(
                    "{} hidden-state values for a step of {} tokens of {width}",
                    hidden_states.len(),
                    ids.len()
                )));
            }
            let bytes = hidden_states.iter().flat_map(|v| v.to_le_bytes()).collect();
            inputs.push((Some(node), bytes));
        }
        for (node, bytes) in inputs {
            if let Some(node) = node {
                let at = self.buffer(node, None)?.start;
                device.write(&buffers.arena, at, &bytes)?;
            }
        }
        Ok(())
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
            let data = output_values(&bytes, self.graph.nodes()[*node].dtype);
            outputs.insert(name.clone(), Tensor::new(shape, data));
        }
        Ok(outputs)
    }

    /// The arena bytes of `node`'s value, or of one of its launches' scratch buffers.
    fn buffer(&self, node: usize, scratch: Option<&str>) -> Result<Range<usize>> {
        planned_buffer(&self.plan, node, scratch)
    }
}

/// The arena bytes the plan gives `node`'s value (or its scratch of that name).
fn planned_buffer(plan: &GpuPlan, node: usize, scratch: Option<&str>) -> Result<Range<usize>> {
    plan.memory
        .buffers
        .iter()
        .find(|b| b.node == node && b.scratch.as_deref() == scratch)
        .map(|b| b.offset..b.offset + b.bytes)
        .ok_or_else(|| RuntimeError::Artifact(format!("no planned buffer for %{node} {scratch:?}")))
}

/// An output's values as read back (4-byte words): f32, or i32 ids (`next_token`) as f32.
fn output_values(bytes: &[u8], dtype: DType) -> Vec<f32> {
    let words = bytes.chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]);
    match dtype {
        DType::I32 => words.map(|w| i32::from_le_bytes(w) as f32).collect(),
        _ => words.map(f32::from_le_bytes).collect(),
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

/// The buffer (and its bytes) of a weight another plan holds already, if it does.
type FindShared<'a, B> = &'a dyn Fn(&gpu_plan::WeightUse) -> Option<(B, usize)>;

/// A loaded plan's weights as another plan on the same device memory may read them
/// ([`PlanExecutor::shared_weights`], [`PlanExecutor::with_weights_beside`]): each weight's
/// tensors and form, with its buffer.
pub struct SharedWeights<B> {
    weights: Vec<(Vec<WeightPart>, DType, B, usize)>,
}

impl<B: Clone> SharedWeights<B> {
    /// The buffer of the weight made of `w`'s tensors, in `w`'s form, if there is one.
    fn find(&self, w: &gpu_plan::WeightUse) -> Option<(B, usize)> {
        self.weights
            .iter()
            .find(|(parts, dtype, _, _)| *parts == w.parts && *dtype == w.dtype)
            .map(|(_, _, buffer, bytes)| (buffer.clone(), *bytes))
    }
}

impl<D: PlanDevice> PlanExecutor<D>
where
    D::Buffer: Clone,
{
    /// This plan's weights for a plan loaded beside it on the same memory
    /// ([`with_weights_beside`](Self::with_weights_beside)), once every upload and conversion
    /// has landed (the other plan's kernels run on a stream of their own).
    pub fn shared_weights(&self) -> Result<SharedWeights<D::Buffer>> {
        let mut state = self
            .state
            .lock()
            .map_err(|_| RuntimeError::Cuda("device state poisoned".into()))?;
        let (device, buffers) = &mut *state;
        device.synchronize()?;
        let weights = self
            .plan
            .weights
            .iter()
            .filter_map(|w| {
                let (buffer, bytes) = buffers.held.get(&BufferKey::Weight(w.node))?;
                Some((w.parts.clone(), w.dtype, buffer.clone(), *bytes))
            })
            .collect();
        Ok(SharedWeights { weights })
    }
}

/// The heads whose Q4_0 copy a launch reads (a drafter's `shortlist_top_k`), by name, with
/// their use in the plan.
fn shortlisted_heads(plan: &GpuPlan) -> Vec<(String, &gpu_plan::WeightUse)> {
    let mut heads: Vec<(String, &gpu_plan::WeightUse)> = Vec::new();
    for arg in plan.launches.iter().flat_map(|l| &l.args) {
        let gpu_plan::LaunchArg::Derived { weight, tensor } = arg else {
            continue;
        };
        let whole = |w: &&gpu_plan::WeightUse| matches!(&w.parts[..], [WeightPart::Whole(name)] if name == weight);
        if tensor == gpu_plan::SHORTLIST_TENSOR && heads.iter().all(|(name, _)| name != weight) {
            if let Some(w) = plan.weights.iter().find(whole) {
                heads.push((weight.clone(), w));
            }
        }
    }
    heads
}

/// The Q4_0 blocks of head `w`'s rows, as the plan holds its values (`ops::four_bit_row`'s
/// rounding): from the host's weights, or the values the device makes for it.
fn four_bit_copy(w: &gpu_plan::WeightUse, weights: &PlanWeights<'_>) -> Result<Vec<u8>> {
    let bf16 = |v: f32| bf16::from_f32(v).to_f32();
    let f16 = |v: f32| half::f16::from_f32(v).to_f32();
    let values: Vec<f32> = match weights {
        PlanWeights::Host(source) => {
            let bytes = weight_bytes(DType::F32, &w.parts, *source)?;
            let values = bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            // The stored values rounded as the plan's head holds them.
            match w.dtype {
                DType::BF16 => values.map(bf16).collect(),
                DType::F16 => values.map(f16).collect(),
                _ => values.collect(),
            }
        }
        PlanWeights::Generated { seed } => {
            let name = w.parts.first().map_or("", |p| p.name());
            let values = crate::random_weights::host_values(*seed, name, &w.shape);
            // As `random_weights::make_weight` makes them (an f16 plan's from the bf16 values).
            match w.dtype {
                DType::BF16 => values.into_iter().map(bf16).collect(),
                DType::F16 => values.into_iter().map(|v| f16(bf16(v))).collect(),
                _ => values,
            }
        }
    };
    let d = w.shape.last().copied().unwrap_or(0);
    if d == 0 || !d.is_multiple_of(32) || !values.len().is_multiple_of(d) {
        return Err(RuntimeError::Weight(format!(
            "a 4-bit copy of {:?} needs rows of whole blocks of 32 (shape {:?})",
            w.parts, w.shape
        )));
    }
    Ok(values.chunks(d).flat_map(quant::q4_0::quantize_row).collect())
}

/// Every weight of `weights` from `source` onto `device`, into `held`: each weight converted
/// on the device where its stored form needs converting and the device has the kernel
/// (`converts(stored, plan dtype)`, see `device_convert`), else its bytes made on the host (on
/// other threads) while the weight before it uploads.
fn upload_weights<D: PlanDevice>(
    device: &mut D,
    weights: &[gpu_plan::WeightUse],
    source: &dyn Tensors,
    converts: &dyn Fn(DType, DType) -> bool,
    held: &mut HashMap<BufferKey, (D::Buffer, usize)>,
) -> Result<()> {
    std::thread::scope(|scope| {
        // How weight `i` is made: its stored runs, or its bytes on a thread of the scope.
        let make = |i: usize| -> Result<Option<Making<'_, '_>>> {
            let Some(w) = weights.get(i) else { return Ok(None) };
            // Parts the source makes as they are read: made on the thread, uploaded and
            // dropped, never held by the source.
            if w.parts.iter().any(|p| source.made_as_read(p.name())) {
                return Ok(Some(Making::OnHost(scope.spawn(move || {
                    let made = weight_bytes::MadeAfresh::of(source, w.parts.iter().map(|p| p.name()));
                    weight_bytes(w.dtype, &w.parts, &made).map(|bytes| std::borrow::Cow::Owned(bytes.into_owned()))
                }))));
            }
            let on_device = |stored: DType| converts(stored, w.dtype);
            Ok(Some(
                match weight_bytes::stored_runs(w.dtype, &w.parts, source, &on_device)? {
                    Some(runs) => Making::OnDevice(runs),
                    None => Making::OnHost(scope.spawn(move || weight_bytes(w.dtype, &w.parts, source))),
                },
            ))
        };
        let mut next = make(0)?;
        for (i, w) in weights.iter().enumerate() {
            let Some(making) = next.take() else { break };
            let made = match making {
                Making::OnDevice(runs) => {
                    next = make(i + 1)?;
                    device_convert::make_on_device(device, w.dtype, &runs, device_convert::CONVERT_CHUNK)?
                }
                Making::OnHost(thread) => {
                    let bytes = thread
                        .join()
                        .map_err(|_| RuntimeError::Weight(format!("making weight %{} panicked", w.node)))??;
                    next = make(i + 1)?;
                    (device.upload(&bytes)?, bytes.len())
                }
            };
            held.insert(BufferKey::Weight(w.node), made);
        }
        Ok(())
    })
}

/// How a weight is being made: from its stored bytes on the device, or on a host thread.
enum Making<'s, 'scope> {
    OnDevice(Vec<weight_bytes::StoredRun<'s>>),
    OnHost(std::thread::ScopedJoinHandle<'scope, Result<std::borrow::Cow<'s, [u8]>>>),
}

/// Every layer's key and value caches for `rows` positions, zeroed, into `held`.
fn alloc_kv_cache<D: PlanDevice>(
    device: &mut D,
    held: &mut HashMap<BufferKey, (D::Buffer, usize)>,
    kv_cache: &[gpu_plan::KvLayout],
    rows: usize,
) -> Result<()> {
    for layout in kv_cache {
        for value in [false, true] {
            let bytes = rows * layout.row_bytes(value);
            held.insert(BufferKey::Kv(layout.slot, value), (device.alloc(bytes)?, bytes));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::weight_bytes::tests::{spread_values, tensor};
    use super::*;
    use quant::tensor::MemoryTensors;
    use quant::GgmlType;

    /// A head's 4-bit copy (a drafter's shortlist) quantizes the values the plan's head holds:
    /// for a bf16 or half head of an f32 file, the file's values rounded so.
    #[test]
    fn four_bit_copies_quantize_the_values_the_head_holds() {
        let values = spread_values(3, 4 * 64);
        let source: MemoryTensors = [("head".to_string(), tensor(GgmlType::F32, 4, 64, &values))].into();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let round = |v: f32| match dtype {
                DType::BF16 => bf16::from_f32(v).to_f32(),
                DType::F16 => half::f16::from_f32(v).to_f32(),
                _ => v,
            };
            let head = gpu_plan::WeightUse {
                node: 0,
                parts: vec![WeightPart::Whole("head".into())],
                dtype,
                shape: vec![4, 64],
            };
            let got = four_bit_copy(&head, &PlanWeights::Host(&source)).unwrap();
            let want: Vec<u8> = values
                .chunks(64)
                .flat_map(|row| quant::q4_0::quantize_row(&row.iter().map(|&v| round(v)).collect::<Vec<_>>()))
                .collect();
            assert_eq!(got, want, "{dtype}");
        }
    }
}
