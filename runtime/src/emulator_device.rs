//! The emulated device: a GPU plan's kernels run by the kernels-gen emulator on the CPU, with
//! device memory as byte vectors. Slow, and meant for tiny models: it checks everything a GPU
//! run depends on above the kernels themselves (buffer offsets and sizes, views, scalars, the
//! choice of prefill kernels, the KV cache, the order of launches) against the CPU backend,
//! on machines without a GPU, and each kernel's indexing against the bytes the plan gives it
//! (a launch that touches anything outside its argument's range is an error). It keeps graphs
//! as CUDA does (launches recorded during a capture instead of run, replayed by key), so the
//! executor's graph path runs here too.

use crate::error::{Result, RuntimeError};
use crate::plan_exec::{DeviceArg, PlanDevice, PlanExecutor};
use gpu_plan::GpuPlan;
use ir::Graph;
use kernels_gen::dsl::{Kernel, Param};
use kernels_gen::emulator::{self, Array, Scalar};
use quant::int8_rows::Int8Rows;
use quant::tensor::Tensors;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// Device memory and the plan's kernels as DSL programs.
pub struct EmulatorDevice {
    kernels: HashMap<String, Kernel>,
    /// Buffers by index; shared with the devices made [`beside`](Self::beside) this one, as two
    /// plans on one GPU share its memory.
    memory: Arc<Mutex<Vec<Vec<u8>>>>,
    /// Graphs as CUDA keeps them: launches recorded during a capture, by key.
    recording: Option<Vec<RecordedLaunch>>,
    graphs: HashMap<usize, Vec<RecordedLaunch>>,
    replays: usize,
    /// Launches run, by kernel.
    launched: HashMap<String, usize>,
    /// The memory it says it has, where it is to say (see [`with_memory`](Self::with_memory)).
    capacity: Option<usize>,
}

/// One launch of a graph, its arguments owned.
struct RecordedLaunch {
    kernel: String,
    block: u32,
    args: Vec<RecordedArg>,
}

enum RecordedArg {
    Buffer(usize, Range<usize>),
    I32(i32),
    F32(f32),
}

impl EmulatorDevice {
    /// `kernels` are the DSL programs of the plan's kernels (same names).
    pub fn new(kernels: Vec<Kernel>) -> Self {
        Self {
            kernels: kernels.into_iter().map(|k| (k.name.clone(), k)).collect(),
            memory: Arc::default(),
            recording: None,
            graphs: HashMap::new(),
            replays: 0,
            launched: HashMap::new(),
            capacity: None,
        }
    }

    /// The same, saying it has `bytes` of memory, of which what it holds is in use: a stand-in
    /// for a GPU's memory where the KV pool is sized by a share of it.
    pub fn with_memory(mut self, bytes: usize) -> Self {
        self.capacity = Some(bytes);
        self
    }

    /// A device running `kernels` on this one's memory (and saying it has as much): another
    /// plan on the same GPU, which may read this one's buffers (an MTP head its target's
    /// embedding and head, `PlanExecutor::with_weights_beside`).
    pub fn beside(&self, kernels: Vec<Kernel>) -> Self {
        Self {
            memory: self.memory.clone(),
            capacity: self.capacity,
            ..Self::new(kernels)
        }
    }

    /// Bytes its buffers hold (with those of the devices beside it).
    pub fn bytes_held(&self) -> usize {
        self.buffers().iter().map(Vec::len).sum()
    }

    fn buffers(&self) -> std::sync::MutexGuard<'_, Vec<Vec<u8>>> {
        // A launch that panicked mid-write leaves bytes no worse than a faulting kernel would.
        self.memory.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// How many steps ran as a replayed graph, and how many graphs were recorded.
    pub fn graph_counts(&self) -> (usize, usize) {
        (self.replays, self.graphs.len())
    }

    /// How many launches of `kernel` have run (replayed ones included).
    pub fn launches_of(&self, kernel: &str) -> usize {
        self.launched.get(kernel).copied().unwrap_or(0)
    }

    /// Run one launch on the emulator.
    fn run(&mut self, kernel: &str, block: u32, args: &[DeviceArg<'_, usize>]) -> Result<()> {
        match self.launched.get_mut(kernel) {
            Some(count) => *count += 1,
            None => drop(self.launched.insert(kernel.to_string(), 1)),
        }
        let k = self
            .kernels
            .get(kernel)
            .ok_or_else(|| fault(format!("no kernel {kernel}")))?;
        if block != k.block_dim {
            return Err(fault(format!(
                "{kernel}: launched with {block} threads, built for {}",
                k.block_dim
            )));
        }
        let mut arrays = HashMap::new();
        let mut scalars = HashMap::new();
        let mut written = Vec::new();
        for (param, arg) in k.launch_params().zip(args) {
            match (param, arg) {
                (Param::Buffer { name, ty, writable }, DeviceArg::Buffer(&buffer, range)) => {
                    // Buffers start aligned, as device allocations do; the range may not.
                    arrays.insert(
                        name.clone(),
                        Array::from_le_bytes(*ty, &self.buffers()[buffer][range.clone()])
                            .placed_at(range.start / ty.bytes()),
                    );
                    if *writable {
                        written.push((name.clone(), buffer, range.clone()));
                    }
                }
                (Param::Scalar { name, .. }, DeviceArg::I32(v)) => {
                    scalars.insert(name.clone(), Scalar::Int(*v as i64));
                }
                (Param::Scalar { name, .. }, DeviceArg::F32(v)) => {
                    scalars.insert(name.clone(), Scalar::F32(*v));
                }
                (p, _) => {
                    return Err(fault(format!(
                        "{kernel}: argument for `{}` of the wrong kind",
                        p.name()
                    )))
                }
            }
        }
        check_no_aliased_writes(kernel, k, args)?;
        emulator::run(k, &mut arrays, &scalars).map_err(fault)?;
        for (name, buffer, range) in written {
            let bytes = arrays[&name].to_le_bytes();
            self.buffers()[buffer][range.start..range.start + bytes.len()].copy_from_slice(&bytes);
        }
        Ok(())
    }
}

fn fault(e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Cuda(format!("emulated launch: {e}"))
}

impl PlanDevice for EmulatorDevice {
    /// An index into the device's memory.
    type Buffer = usize;

    /// Always: the emulator checks every prefetch's bounds.
    fn prefetches_weights(&self) -> bool {
        true
    }

    fn alloc(&mut self, bytes: usize) -> Result<usize> {
        let mut memory = self.buffers();
        memory.push(vec![0; bytes]);
        Ok(memory.len() - 1)
    }

    fn upload(&mut self, bytes: &[u8]) -> Result<usize> {
        let mut memory = self.buffers();
        memory.push(bytes.to_vec());
        Ok(memory.len() - 1)
    }

    fn memory(&self) -> Option<crate::kv_sizing::DeviceMemory> {
        self.capacity.map(|total| crate::kv_sizing::DeviceMemory {
            free: total.saturating_sub(self.bytes_held()),
            total,
        })
    }

    fn release(&mut self, buffer: usize) {
        self.buffers()[buffer] = Vec::new();
    }

    fn write(&mut self, buffer: &usize, at: usize, bytes: &[u8]) -> Result<()> {
        self.buffers()[*buffer][at..at + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    fn read(&mut self, buffer: &usize, range: Range<usize>) -> Result<Vec<u8>> {
        Ok(self.buffers()[*buffer][range].to_vec())
    }

    fn copy(&mut self, from: &usize, from_at: usize, to: &usize, to_at: usize, bytes: usize) -> Result<()> {
        let mut memory = self.buffers();
        let source = memory[*from]
            .get(from_at..from_at + bytes)
            .ok_or_else(|| fault("a copy reads past its buffer"))?
            .to_vec();
        memory[*to]
            .get_mut(to_at..to_at + bytes)
            .ok_or_else(|| fault("a copy writes past its buffer"))?
            .copy_from_slice(&source);
        Ok(())
    }

    fn launch(&mut self, kernel: &str, grid: u32, block: u32, args: &[DeviceArg<'_, usize>]) -> Result<()> {
        let _ = grid; // the emulator evaluates the kernel's own grid expression from the scalars
        match &mut self.recording {
            Some(graph) => {
                graph.push(RecordedLaunch {
                    kernel: kernel.to_string(),
                    block,
                    args: args
                        .iter()
                        .map(|a| match a {
                            DeviceArg::Buffer(&b, range) => RecordedArg::Buffer(b, range.clone()),
                            DeviceArg::I32(v) => RecordedArg::I32(*v),
                            DeviceArg::F32(v) => RecordedArg::F32(*v),
                        })
                        .collect(),
                });
                Ok(())
            }
            None => self.run(kernel, block, args),
        }
    }

    /// The emulator's own wall time (a launch cannot be timed while a graph is recorded).
    fn launch_timed(
        &mut self,
        kernel: &str,
        grid: u32,
        block: u32,
        args: &[DeviceArg<'_, usize>],
    ) -> Result<Option<f64>> {
        if self.recording.is_some() {
            return Err(fault("a launch cannot be timed during a capture"));
        }
        let started = std::time::Instant::now();
        self.launch(kernel, grid, block, args)?;
        Ok(Some(started.elapsed().as_secs_f64()))
    }

    fn records_graphs(&self) -> bool {
        true
    }

    fn begin_capture(&mut self) -> Result<()> {
        match self.recording.replace(Vec::new()) {
            Some(_) => Err(fault("a capture is already running")),
            None => Ok(()),
        }
    }

    fn end_capture(&mut self, key: usize) -> Result<()> {
        let graph = self.recording.take().ok_or_else(|| fault("no capture is running"))?;
        self.graphs.insert(key, graph);
        Ok(())
    }

    fn replay(&mut self, key: usize) -> Result<bool> {
        let Some(graph) = self.graphs.remove(&key) else {
            return Ok(false);
        };
        let result = graph.iter().try_for_each(|launch| {
            let args: Vec<DeviceArg<'_, usize>> = launch
                .args
                .iter()
                .map(|a| match a {
                    RecordedArg::Buffer(b, range) => DeviceArg::Buffer(b, range.clone()),
                    RecordedArg::I32(v) => DeviceArg::I32(*v),
                    RecordedArg::F32(v) => DeviceArg::F32(*v),
                })
                .collect();
            self.run(&launch.kernel, launch.block, &args)
        });
        self.graphs.insert(key, graph);
        self.replays += 1;
        result.map(|()| true)
    }
}

/// Each buffer argument is emulated as its own array, so a launch whose written range overlaps
/// another argument's range would not see its own writes there: refuse it rather than emulate
/// it wrongly.
fn check_no_aliased_writes(kernel: &str, k: &Kernel, args: &[DeviceArg<'_, usize>]) -> Result<()> {
    let buffers: Vec<(&Param, usize, &Range<usize>)> = k
        .launch_params()
        .zip(args)
        .filter_map(|(p, a)| match a {
            DeviceArg::Buffer(&b, r) => Some((p, b, r)),
            _ => None,
        })
        .collect();
    for (i, (p, b, r)) in buffers.iter().enumerate() {
        for (q, c, s) in &buffers[i + 1..] {
            let writes =
                matches!(p, Param::Buffer { writable: true, .. }) || matches!(q, Param::Buffer { writable: true, .. });
            if b == c && writes && r.start < s.end && s.start < r.end {
                return Err(fault(format!("{kernel}: `{}` and `{}` overlap", p.name(), q.name())));
            }
        }
    }
    Ok(())
}

/// A GPU plan run by the emulator.
pub type EmulatorBackend = PlanExecutor<EmulatorDevice>;

impl EmulatorBackend {
    /// `plan` and its DSL `kernels` (from `gpu_plan::build_with_kernels`) for `graph`.
    pub fn emulated(
        plan: GpuPlan,
        kernels: Vec<Kernel>,
        graph: Graph,
        weights: &dyn Tensors,
        int8: &[(String, Int8Rows)],
        context_length: usize,
    ) -> Result<Self> {
        PlanExecutor::new(EmulatorDevice::new(kernels), plan, graph, weights, int8, context_length)
    }
}
