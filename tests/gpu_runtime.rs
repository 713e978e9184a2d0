//! On a machine with an NVIDIA GPU (and NVRTC): SmolLM2 with bf16 weights, compiled for the GPU
//! (`BBC_GPU_TARGET`, default h200) and run by the CUDA backend, generates exactly the greedy
//! tokens the CPU backend generates from the same bf16 weights, through the logits plan and
//! through the greedy plan (INT8-bound head): `bbc gpu-check`'s SmolLM2 section. Skipped
//! elsewhere.

mod common;

use codegen::Target;

#[test]
fn smollm2_bf16_greedy_on_the_gpu_equals_the_cpu() {
    if !runtime_cuda::driver_present() || codegen::nvrtc::ensure_loaded().is_err() {
        eprintln!("skipped: needs an NVIDIA driver and NVRTC");
        return;
    }
    let target = std::env::var("BBC_GPU_TARGET")
        .ok()
        .and_then(|t| Target::parse(&t))
        .unwrap_or(Target::H200);
    bbc::gpu_check::smollm2::check(&common::real_model("smollm2"), target).unwrap();
}
