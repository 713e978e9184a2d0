//! One kernel launch through the driver (`cuLaunchKernelEx`), optionally as a programmatic
//! dependent launch: the driver may start the kernel while the one before it on the stream
//! still runs, so that its launch and the filling of the SMs overlap that kernel's tail. At
//! batch 1 a decode step of a Llama-8B-shaped model is 230 launches of a few µs each, so the
//! gaps between kernels are a tenth of the step. Only for kernels that wait for the prior
//! kernel before touching memory (`kernels_gen::cuda::awaits_prior_kernel`), on GPUs from
//! compute capability 9.0 (Hopper).

use cudarc::driver::{sys, CudaFunction, CudaStream, DriverError};
use std::ffi::c_void;

/// Launch `function` on `stream` with `grid` blocks of `block` threads.
///
/// # Safety
/// `params` holds one pointer per kernel parameter, in order, each to a value of the
/// parameter's type that lives through the call; device pointers among them address memory
/// the kernel may touch. With `programmatic`, the kernel waits for the prior kernel before it
/// touches memory.
pub unsafe fn launch(
    stream: &CudaStream,
    function: &CudaFunction,
    grid: u32,
    block: u32,
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
        gridDimX: grid,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
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
