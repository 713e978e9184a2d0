//! The CUDA backend: a GPU artifact's plan (see [`runtime::plan_exec`]) on an NVIDIA GPU through
//! cudarc (the driver is loaded at run time, so this builds and links everywhere): every
//! kernel's cubin (or PTX) loaded as a module on a thread of its own while the weights upload
//! (`modules`), buffers as device allocations, launches on one stream.
//!
//! Decode steps of `bbc serve` (a row per sequence) up to a chosen batch size run as CUDA
//! graphs, one per size, captured on first use (see `PlanExecutor::capture_graphs_up_to`).
//!
//! Without an NVIDIA driver, [`CudaBackend::from_artifact`] returns [`RuntimeError::NoCudaDriver`]: never
//! a panic. The plan executor above it (one sequence, and batched steps with their graphs)
//! runs on the emulator in CI (`tests/gpu_plan_emulated.rs`); this device is checked on a GPU
//! by `bbc gpu-check` (`docs/gpu-check.md`).

mod cublaslt;
mod launch;
mod modules;
mod tensor_map;

pub use cublaslt::{CublasGemm, CublasLt};

use cudarc::driver::{CudaContext, CudaGraph, CudaSlice, CudaStream, DevicePtr};
use cudarc::nvrtc::Ptx;
use gpu_plan::GpuPlan;
use ir::Graph;
use modules::{Image, KernelImage, Kernels};
use quant::int8_rows::Int8Rows;
use runtime::plan_exec::{DeviceArg, PlanDevice, PlanExecutor, PlanWeights, SharedWeights};
use runtime::{Result, RuntimeError};
use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// Whether an NVIDIA driver can be loaded here.
pub fn driver_present() -> bool {
    // SAFETY: probing for the library has no side effect beyond loading it.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

fn driver(e: cudarc::driver::DriverError) -> RuntimeError {
    RuntimeError::Cuda(format!("{e:?}"))
}

/// GPU 0: its stream and the plan's kernels, loaded from the artifact's PTX.
pub struct CudaDevice {
    stream: Arc<CudaStream>,
    /// The plan's kernels, loading while the weights upload.
    kernels: Kernels,
    /// Whether kernels that wait for the prior kernel are launched before it finishes
    /// (programmatic dependent launch, `launch`): on Hopper and newer, unless `BBC_PDL=0`.
    programmatic_launch: bool,
    /// Whether the GPU and driver take programmatic launches (Hopper and newer, probed).
    programmatic_launch_works: bool,
    /// Whether the last thing put on the stream was a kernel launch: only then is the next one
    /// launched programmatically (behind a copy, an event, a graph or a capture's start there
    /// is no kernel to overlap, and no reason to ask the driver for it).
    after_launch: bool,
    /// Whether kernels prefetch the next matmul's weights into L2 where the plan has them (the
    /// `prefetch` variable of its steps): unless `BBC_WEIGHT_PREFETCH=0`.
    weight_prefetch: bool,
    /// Instantiated graphs by key (a batched step's row count).
    graphs: HashMap<usize, OwnedGraph>,
}

/// An on/off environment switch, on unless set to `0` (`BBC_PDL`, `BBC_WEIGHT_PREFETCH`: to
/// compare, or to rule one out).
fn switched_on(variable: &str) -> bool {
    std::env::var(variable).map_or(true, |v| v.trim() != "0")
}

/// A CUDA graph that may move between threads.
struct OwnedGraph(CudaGraph);

// SAFETY: CUDA graph handles are not tied to the thread that made them; cudarc binds the
// context to the calling thread before each use, and the device that owns the graphs is used
// by one thread at a time (the plan executor keeps it behind a mutex).
unsafe impl Send for OwnedGraph {}

impl CudaDevice {
    /// Load every kernel of `plan` from its files under `dir`: the cubin where the artifact has
    /// one (nothing for the driver to compile, and no PTX version it could refuse), else PTX.
    /// The kernels no step launches (those that make weights) load first: they run while the
    /// rest load.
    pub fn new(dir: &Path, plan: &GpuPlan) -> Result<Self> {
        let launched: std::collections::HashSet<&str> = plan
            .launches
            .iter()
            .flat_map(|l| {
                [
                    Some(&l.kernel),
                    l.prefill_kernel.as_ref(),
                    l.few_rows_kernel.as_ref(),
                    l.batch_kernel.as_ref(),
                ]
            })
            .flatten()
            .map(String::as_str)
            .collect();
        let mut kernels: Vec<&gpu_plan::KernelEntry> = plan.kernels.iter().collect();
        kernels.sort_by_key(|k| launched.contains(k.name.as_str()));
        let modules = kernels.into_iter().map(|k| {
            let image = match (&k.cubin, &k.ptx) {
                (Some(cubin), _) => Image::Cubin(dir.join(cubin)),
                (None, Some(ptx)) => Image::Ptx(dir.join(ptx)),
                (None, None) => return Err(RuntimeError::Artifact(format!("kernel {} has no cubin or PTX", k.name))),
            };
            // A missing file is refused now, not after the weights have uploaded.
            if let Image::Cubin(path) | Image::Ptx(path) = &image {
                if !path.is_file() {
                    return Err(RuntimeError::Artifact(format!("{}: no such file", path.display())));
                }
            }
            Ok(KernelImage {
                name: k.name.clone(),
                image,
                params: tensor_map::KernelParams::of_entry(k)?,
                awaits_prior_kernel: kernels_gen::cuda::awaits_prior_kernel(&k.source),
                shared_bytes: k.shared_bytes,
            })
        });
        Self::load(modules.collect::<Result<Vec<_>>>()?)
    }

    /// Load DSL `kernels` compiled elsewhere (`codegen::spill_free`, as artifacts build them):
    /// `cubins[i]` is the machine code of `kernels[i]`.
    pub fn from_cubins(kernels: &[kernels_gen::dsl::Kernel], cubins: Vec<Vec<u8>>) -> Result<Self> {
        if kernels.len() != cubins.len() {
            return Err(RuntimeError::Artifact(format!(
                "{} kernels but {} cubins",
                kernels.len(),
                cubins.len()
            )));
        }
        let modules = kernels.iter().zip(cubins).map(|(k, cubin)| {
            let layout = k.shared_layout();
            Ok(KernelImage {
                name: k.name.clone(),
                image: Image::Loaded(Ptx::from_binary(cubin)),
                params: tensor_map::KernelParams::of(k)?,
                awaits_prior_kernel: kernels_gen::cuda::awaits_prior_kernel(&kernels_gen::cuda::emit(k)),
                shared_bytes: if layout.dynamic { layout.bytes as u32 } else { 0 },
            })
        });
        Self::load(modules.collect::<Result<Vec<_>>>()?)
    }

    fn load(modules: Vec<KernelImage>) -> Result<Self> {
        if !driver_present() {
            return Err(RuntimeError::NoCudaDriver);
        }
        let ctx = CudaContext::new(0).map_err(driver)?;
        // One stream orders everything, so cudarc's cross-stream events are not needed; they
        // would also put waits on events recorded before a capture into it, which CUDA refuses.
        // SAFETY: every buffer is allocated, used and freed on `stream` alone.
        unsafe { ctx.disable_event_tracking() };
        // Graphs are captured from a stream of our own: the legacy default stream cannot be.
        let stream = ctx.new_stream().map_err(driver)?;
        let kernels = Kernels::load(&ctx, modules)?;
        let programmatic_launch_works =
            ctx.compute_capability().map_err(driver)?.0 >= 9 && launch::programmatic_launch_works(&ctx, &stream);
        Ok(Self {
            stream,
            kernels,
            programmatic_launch: programmatic_launch_works && switched_on("BBC_PDL"),
            programmatic_launch_works,
            after_launch: false,
            weight_prefetch: switched_on("BBC_WEIGHT_PREFETCH"),
            graphs: HashMap::new(),
        })
    }

    /// Whether kernels are launched before the kernel they wait for has finished.
    pub fn programmatic_launch(&self) -> bool {
        self.programmatic_launch
    }

    /// Launch kernels programmatically (where the GPU can) or the ordinary way from now on.
    /// Graphs captured so far are dropped: they hold the launches as they were made.
    pub fn set_programmatic_launch(&mut self, on: bool) {
        self.programmatic_launch = on && self.programmatic_launch_works;
        self.graphs.clear();
    }

    /// Whether kernels prefetch the next matmul's weights where the plan has them.
    pub fn weight_prefetch(&self) -> bool {
        self.weight_prefetch
    }

    /// Prefetch the next matmul's weights (where the plan has kernels do it) or not, from the
    /// next step on. Graphs captured so far are dropped: they hold the prefetch sizes as they
    /// were.
    pub fn set_weight_prefetch(&mut self, on: bool) {
        self.weight_prefetch = on;
        self.graphs.clear();
    }

    /// Seconds per call of `work` (device time between two events around `iterations` calls,
    /// after one call to warm up).
    pub fn time(&mut self, iterations: usize, mut work: impl FnMut(&mut Self) -> Result<()>) -> Result<f64> {
        work(self)?;
        let seconds = self.elapsed(|device| (0..iterations).try_for_each(|_| work(device)))?;
        Ok(seconds / iterations.max(1) as f64)
    }

    /// Device seconds `work` takes: between two events recorded on the stream around it.
    fn elapsed(&mut self, work: impl FnOnce(&mut Self) -> Result<()>) -> Result<f64> {
        let timed = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.stream.record_event(timed).map_err(driver)?;
        self.after_launch = false;
        work(self)?;
        let end = self.stream.record_event(timed).map_err(driver)?;
        self.after_launch = false;
        Ok(start.elapsed_ms(&end).map_err(driver)? as f64 / 1e3)
    }

    /// Device-to-device copy bandwidth in bytes per second (bytes read plus bytes written),
    /// over a buffer of `bytes`.
    pub fn copy_bandwidth(&mut self, bytes: usize) -> Result<f64> {
        let stream = self.stream.clone();
        let src = stream.alloc_zeros::<u8>(bytes.max(1)).map_err(driver)?;
        let mut dst = stream.alloc_zeros::<u8>(bytes.max(1)).map_err(driver)?;
        let seconds = self.time(20, |_| stream.memcpy_dtod(&src, &mut dst).map_err(driver))?;
        Ok(2.0 * bytes as f64 / seconds)
    }
}

impl PlanDevice for CudaDevice {
    /// Shared: a plan loaded beside another on the GPU reads some of its weights
    /// (`PlanExecutor::with_weights_beside`); the memory is freed with the last handle.
    type Buffer = Arc<CudaSlice<u8>>;

    fn prefetches_weights(&self) -> bool {
        self.weight_prefetch
    }

    fn alloc(&mut self, bytes: usize) -> Result<Self::Buffer> {
        self.after_launch = false;
        self.stream
            .alloc_zeros::<u8>(bytes.max(1))
            .map(Arc::new)
            .map_err(driver)
    }

    fn synchronize(&mut self) -> Result<()> {
        self.stream.synchronize().map_err(driver)
    }

    fn memory(&self) -> Option<runtime::kv_sizing::DeviceMemory> {
        // Frees are ordered on the stream: what was released is free once it has run.
        self.stream.synchronize().ok()?;
        let (free, total) = self.stream.context().mem_get_info().ok()?;
        Some(runtime::kv_sizing::DeviceMemory { free, total })
    }

    fn upload(&mut self, bytes: &[u8]) -> Result<Self::Buffer> {
        self.after_launch = false;
        self.stream.clone_htod(bytes).map(Arc::new).map_err(driver)
    }

    fn write(&mut self, buffer: &Self::Buffer, at: usize, bytes: &[u8]) -> Result<()> {
        if at + bytes.len() > buffer.len() {
            return Err(RuntimeError::Cuda(format!(
                "a write of {} bytes at {at} overruns a {}-byte buffer",
                bytes.len(),
                buffer.len()
            )));
        }
        // Launches already issued may read or write these bytes: let them finish first.
        self.stream.synchronize().map_err(driver)?;
        self.after_launch = false;
        let (ptr, _synced) = buffer.device_ptr(&self.stream);
        // SAFETY: the range lies inside the allocation (checked above) and no launch is in
        // flight on the stream.
        unsafe { cudarc::driver::result::memcpy_htod_sync(ptr + at as u64, bytes) }.map_err(driver)
    }

    fn copy(
        &mut self,
        from: &Self::Buffer,
        from_at: usize,
        to: &Self::Buffer,
        to_at: usize,
        bytes: usize,
    ) -> Result<()> {
        if from_at + bytes > from.len() || to_at + bytes > to.len() {
            return Err(RuntimeError::Cuda(format!(
                "a copy of {bytes} bytes from {from_at} of {} to {to_at} of {} overruns a buffer",
                from.len(),
                to.len()
            )));
        }
        // In stream order, so after the launches already issued and before later ones; the
        // next launch must not overlap it (no programmatic dependent launch across a copy).
        self.after_launch = false;
        let (source, _read) = from.device_ptr(&self.stream);
        let (target, _written) = to.device_ptr(&self.stream);
        // SAFETY: both ranges lie inside their allocations (checked above), which are distinct
        // buffers, and the copy is ordered on the stream every launch uses.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                target + to_at as u64,
                source + from_at as u64,
                bytes,
                self.stream.cu_stream(),
            )
        }
        .map_err(driver)
    }

    fn read(&mut self, buffer: &Self::Buffer, range: Range<usize>) -> Result<Vec<u8>> {
        self.after_launch = false;
        self.stream.clone_dtoh(&buffer.slice(range)).map_err(driver)
    }

    fn launch(&mut self, kernel: &str, grid: u32, block: u32, args: &[DeviceArg<'_, Self::Buffer>]) -> Result<()> {
        let loaded = self.kernels.get(kernel)?;
        if args.len() != loaded.params.arguments() {
            return Err(RuntimeError::Artifact(format!(
                "kernel {kernel} takes {} arguments, given {}",
                loaded.params.arguments(),
                args.len()
            )));
        }
        // Each argument's value in 8 bytes of room: the driver copies as many bytes as the
        // parameter has from the start, so a 32-bit value takes the first 4.
        let mut values: Vec<u64> = args
            .iter()
            .map(|a| match a {
                DeviceArg::Buffer(b, range) => b.device_ptr(&self.stream).0 + range.start as u64,
                DeviceArg::I32(v) => low_half(v.to_ne_bytes()),
                DeviceArg::F32(v) => low_half(v.to_ne_bytes()),
            })
            .collect();
        let mut maps = loaded
            .params
            .encodings(args, |i| values[i])?
            .iter()
            .map(|(encoding, address)| tensor_map::encode(encoding, *address))
            .collect::<Result<Vec<_>>>()?;
        let mut params = loaded.params.pointers(&mut values, &mut maps);
        let programmatic = self.programmatic_launch && loaded.awaits_prior_kernel && self.after_launch;
        let shape = launch::Shape {
            grid,
            block,
            shared_bytes: loaded.shared_bytes,
        };
        // SAFETY: one pointer per parameter (counted above) to a value of its size (a tensor
        // map's 128 bytes, 64-byte aligned) that lives through the call; buffer pointers lie
        // inside buffers sized by the plan; a kernel launched programmatically waits for the
        // kernel before it first.
        unsafe { launch::launch(&self.stream, &loaded.function, shape, &mut params, programmatic) }.map_err(driver)?;
        self.after_launch = true;
        Ok(())
    }

    /// Events on the stream around the launch (`elapsed`).
    fn launch_timed(
        &mut self,
        kernel: &str,
        grid: u32,
        block: u32,
        args: &[DeviceArg<'_, Self::Buffer>],
    ) -> Result<Option<f64>> {
        // Loaded before the clock starts: the time is the kernel's alone.
        self.kernels.get(kernel)?;
        self.elapsed(|device| device.launch(kernel, grid, block, args))
            .map(Some)
    }

    fn kernels_loaded(&mut self) -> Result<()> {
        self.kernels.all_loaded()
    }

    fn records_graphs(&self) -> bool {
        true
    }

    fn begin_capture(&mut self) -> Result<()> {
        self.after_launch = false;
        let mode = cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        self.stream.begin_capture(mode).map_err(driver)
    }

    fn end_capture(&mut self, key: usize) -> Result<()> {
        self.after_launch = false;
        let flags = cudarc::driver::sys::CUgraphInstantiate_flags(0);
        let graph = self
            .stream
            .end_capture(flags)
            .map_err(driver)?
            .ok_or_else(|| RuntimeError::Cuda("the capture recorded nothing".into()))?;
        graph.upload().map_err(driver)?;
        self.graphs.insert(key, OwnedGraph(graph));
        Ok(())
    }

    fn replay(&mut self, key: usize) -> Result<bool> {
        self.after_launch = false;
        match self.graphs.get(&key) {
            Some(graph) => graph.0.launch().map_err(driver).map(|()| true),
            None => Ok(false),
        }
    }
}

/// 4 bytes at the start of 8, as a kernel parameter's value is read.
fn low_half(bytes: [u8; 4]) -> u64 {
    let mut all = [0u8; 8];
    all[..4].copy_from_slice(&bytes);
    u64::from_ne_bytes(all)
}

/// The plan file `plan_file` of the artifact in `dir`; first, whether a driver is there at all.
fn read_plan(dir: &Path, plan_file: &str) -> Result<GpuPlan> {
    if !driver_present() {
        return Err(RuntimeError::NoCudaDriver);
    }
    let text = std::fs::read_to_string(dir.join(plan_file))
        .map_err(|e| RuntimeError::Artifact(format!("{plan_file}: {e}")))?;
    serde_json::from_str(&text).map_err(|e| RuntimeError::Artifact(format!("{plan_file}: {e}")))
}

/// A GPU artifact on GPU 0: its plan executed on the CUDA device (generation and serving go
/// through the executor's `Backend` and `PagedBackend` implementations).
pub type CudaBackend = PlanExecutor<CudaDevice>;

/// Load `plan_file` of the artifact in `dir` for `graph`, with the model's weights (uploaded,
/// or made on the device from a seed by the fill kernels the artifact carries).
pub fn load_plan(
    dir: &Path,
    plan_file: &str,
    graph: Graph,
    weights: PlanWeights<'_>,
    int8: &[(String, Int8Rows)],
    context_length: usize,
) -> Result<CudaBackend> {
    let plan = read_plan(dir, plan_file)?;
    PlanExecutor::with_weights(CudaDevice::new(dir, &plan)?, plan, graph, weights, int8, context_length)
}

/// The batched serving plan `plan_file` of the artifact in `dir`, its KV pool `cache`: for
/// `bbc serve` (continuous batching through [`runtime::serving::PagedBackend`]).
pub fn load_batched_plan(
    dir: &Path,
    plan_file: &str,
    graph: Graph,
    weights: PlanWeights<'_>,
    int8: &[(String, Int8Rows)],
    context_length: usize,
    cache: gpu_plan::BatchedCache,
) -> Result<CudaBackend> {
    let plan = read_batched_plan(dir, plan_file, cache)?;
    let device = CudaDevice::new(dir, &plan)?;
    PlanExecutor::with_weights(device, plan, graph, weights, int8, context_length)
}

/// [`load_batched_plan`] beside another plan on the GPU (no INT8 rows: a drafter's plan),
/// the weights it holds already read from its buffers (an MTP head's embedding and LM head).
pub fn load_batched_plan_beside(
    dir: &Path,
    plan_file: &str,
    graph: Graph,
    weights: PlanWeights<'_>,
    context_length: usize,
    cache: gpu_plan::BatchedCache,
    beside: &SharedWeights<Arc<CudaSlice<u8>>>,
) -> Result<CudaBackend> {
    let plan = read_batched_plan(dir, plan_file, cache)?;
    let device = CudaDevice::new(dir, &plan)?;
    PlanExecutor::with_weights_beside(device, plan, graph, weights, &[], context_length, beside)
}

/// The batched plan `plan_file` of the artifact in `dir`, its pool sized as `cache` says.
fn read_batched_plan(dir: &Path, plan_file: &str, cache: gpu_plan::BatchedCache) -> Result<GpuPlan> {
    let mut plan = read_plan(dir, plan_file)?;
    if plan.batched.is_none() {
        return Err(RuntimeError::Artifact(format!("{plan_file} is not a batched plan")));
    }
    // The pool is sized at run time; the kernels take the block size as a scalar.
    plan.batched = Some(cache);
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_32_bit_argument_takes_the_first_4_bytes_of_its_room() {
        let room = low_half((-7i32).to_ne_bytes()).to_ne_bytes();
        assert_eq!(i32::from_ne_bytes(room[..4].try_into().unwrap()), -7);
        let room = low_half(1.5f32.to_ne_bytes()).to_ne_bytes();
        assert_eq!(f32::from_ne_bytes(room[..4].try_into().unwrap()), 1.5);
        assert_eq!(&room[4..], &[0; 4]);
    }
}
