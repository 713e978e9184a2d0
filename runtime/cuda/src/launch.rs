//! One kernel launch through the driver (`cuLaunchKernelEx`), optionally as a programmatic
//! dependent launch: the driver may start the kernel while the one before it on the stream
//! still runs, so that its launch and the filling of the SMs overlap that kernel's tail. At
//! batch 1 a decode step of a Llama-8B-shaped model is 230 launches of a few µs each, so the
//! gaps between kernels are a tenth of the step. Only for kernels that wait for the prior
//! kernel before touching memory (`kernels_gen::cuda::awaits_prior_kernel`), on GPUs from
//! compute capability 9.0 (Hopper).

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaStream, DriverError};
use cudarc::nvrtc::Ptx;
use std::ffi::c_void;
use std::sync::Arc;

/// A kernel that does nothing but what every generated kernel does first (PTX the driver
/// compiles itself: serving needs no NVRTC).
const PROBE_PTX: &str = r#".version 7.8
.target sm_90
.address_size 64
.visible .entry bbc_programmatic_launch_probe()
{
    griddepcontrol.wait;
    griddepcontrol.launch_dependents;
    ret;
}
"#;

/// Whether this GPU and driver take programmatic dependent launches: two launches of a probe
/// kernel, the second programmatic, run on the stream, then captured into a CUDA graph that is
/// instantiated and run (decode steps replay graphs). A driver that refuses either costs the
/// speed-up, never a step.
pub fn programmatic_launch_works(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>) -> bool {
    let probe = || -> Result<(), DriverError> {
        let module = ctx.load_module(Ptx::from_src(PROBE_PTX))?;
        let function = module.load_function("bbc_programmatic_launch_probe")?;
        let pair = || -> Result<(), DriverError> {
            for programmatic in [false, true] {
                // SAFETY: the probe takes no parameters and waits for the prior kernel first.
                let shape = Shape {
                    grid: 1,
                    block: 32,
                    shared_bytes: 0,
                };
                unsafe { launch(stream, &function, shape, &mut [], programmatic)? };
            }
            Ok(())
        };
        pair()?;
        stream.synchronize()?;
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        // The capture ends whatever the launches said, so the stream is usable after a refusal.
        let launched = pair();
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        launched?;
        if let Some(graph) = graph? {
            graph.launch()?;
        }
        stream.synchronize()
    };
    probe().is_ok()
}

/// A launch's blocks, threads a block and dynamic shared memory a block.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub grid: u32,
    pub block: u32,
    pub shared_bytes: u32,
}

/// Launch `function` on `stream` in `shape`.
///
/// # Safety
/// `params` holds one pointer per kernel parameter, in order, each to a value of the
/// parameter's type that lives through the call; device pointers among them address memory
/// the kernel may touch. With `programmatic`, the kernel waits for the prior kernel before it
/// touches memory.
pub unsafe fn launch(
    stream: &CudaStream,
    function: &CudaFunction,
    shape: Shape,
    params: &mut [*mut c_void],
    programmatic: bool,
) -> Result<(), DriverError> {
    stream.context().bind_to_thread()?;
    let mut value: sys::CUlaunchAttributeValue = std::mem::zeroed();
    value.programmaticStreamSerializationAllowed = 1;
    let mut attribute = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value,
    };
    let config = sys::CUlaunchConfig {
        gridDimX: shape.grid,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: shape.block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: shape.shared_bytes,
        hStream: stream.cu_stream(),
        attrs: if programmatic {
            &mut attribute
        } else {
            std::ptr::null_mut()
        },
        numAttrs: u32::from(programmatic),
    };
    sys::cuLaunchKernelEx(
        &config,
        function.cu_function(),
        params.as_mut_ptr(),
        std::ptr::null_mut(),
    )
    .result()
}
