//! The `experts` section: a GLM-4.5-Air-shaped MoE model (128 experts of 1 408 hidden units,
//! 8 a token, a shared expert; its first layer dense) cut to [`LAYERS`] layers (about 34 GB
//! of bf16 weights, one executor at a time), with random weights made on the device. Prompts of 512 and
//! 2 048 tokens prefill with the experts on the tensor cores (the plans' default: `wgmma` on
//! Hopper, `tcgen05` on the B200, where `mma.sync` is timed too, `--prefill-experts mma`) and
//! on the CUDA cores
//! (`--prefill-experts cuda-cores`), each kernel's share; then decode steps at
//! batch 1, 16 and 64 (the same kernels either way below 16 rows; from 16 rows the step's
//! experts take the prefill kernels).

use super::decode::{print_kernel_shares, print_prefill, print_profiles, print_steps, serving_executor};
use anyhow::{Context, Result};
use codegen::gpu;
use codegen::Target;
use runtime::decode_timing::{kernel_totals, profile_prefill, time_decode, DecodeRun};
use runtime::plan_exec::PlanExecutor;
use runtime_cuda::CudaDevice;

/// Layers kept of GLM-4.5-Air's 46: 7 MoE layers (4.4 GB of experts each in bf16).
const LAYERS: usize = 8;

/// The long prompt: 2 048 rows, 16 384 (row, expert) pairs a layer, 128 a expert on average.
const LONG: usize = 2048;

pub fn experts(target: Target, arch: &str, bandwidth: f64, prefill_chunk: usize) -> Result<()> {
    let mut json = models::config::shapes::config_json("glm-4.5-air").context("the glm-4.5-air shape")?;
    json["num_hidden_layers"] = LAYERS.into();
    let config = models::ModelConfig::from_hf_json(json, std::path::Path::new("glm-4.5-air"))?;
    let run = DecodeRun {
        prompt: 512,
        batches: vec![1, 16, 64],
        steps: 10,
        prefill_chunk,
        drafts: 0,
    };
    // On Hopper and the B200 the tensor cores' default is `wgmma` or `tcgen05`: `mma.sync` is
    // timed beside it.
    let choices = match arch {
        "sm_90a" | "sm_100a" => vec![
            gpu::PrefillExperts::TensorCores,
            gpu::PrefillExperts::Mma,
            gpu::PrefillExperts::CudaCores,
        ],
        _ => vec![gpu::PrefillExperts::TensorCores, gpu::PrefillExperts::CudaCores],
    };
    for experts in choices {
        let name = format!("GLM-4.5-Air-shaped ({LAYERS} layers), experts on {experts:?}");
        let kernels = gpu::PlanKernels {
            prefill_experts: experts,
            ..Default::default()
        };
        let exec = serving_executor(&name, &config, (target, arch), (&run, LONG), kernels)?;
        print_prefill(&name, &exec, &run)?;
        print_expert_shares(&name, &exec, &run)?;
        let timings = time_decode(&exec, &run)?;
        print_steps(&name, &run, &timings, bandwidth)?;
        print_profiles(&timings, bandwidth);
    }
    Ok(())
}

/// A [`LONG`]-token prompt's prefill with each launch timed: the MoE kernels' time and share,
/// then every kernel's.
fn print_expert_shares(name: &str, exec: &PlanExecutor<CudaDevice>, run: &DecodeRun) -> Result<()> {
    let long = DecodeRun {
        prompt: LONG,
        batches: Vec::new(),
        ..run.clone()
    };
    let launches = profile_prefill(exec, &long)?;
    let totals = kernel_totals(&launches);
    let device: f64 = totals.iter().filter_map(|k| k.seconds).sum();
    let experts: f64 = totals
        .iter()
        .filter(|k| k.kernel.starts_with("moe_"))
        .filter_map(|k| k.seconds)
        .sum();
    println!(
        "\n{name} prefill of a {LONG}-token prompt, launches timed one by one: {:.2} ms, the MoE kernels {:.2} ms ({:.0}%)",
        device * 1e3,
        experts * 1e3,
        100.0 * experts / device
    );
    print_kernel_shares(&format!("{LONG}-token prefill"), &totals, device);
    Ok(())
}
