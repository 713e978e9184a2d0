//! On a machine with an NVIDIA GPU (and NVRTC): SmolLM2 with bf16 weights, compiled for the GPU
//! (`BBC_GPU_TARGET`, default h200) and run by the CUDA backend, generates exactly the greedy
//! tokens the CPU backend generates from the same bf16 weights, through the logits plan and
//! through the greedy plan (INT8-bound head). Skipped elsewhere.

mod common;

use codegen::Target;
use models::{ComputeDtype, LogitsFor, Model, ModelSpec};
use runtime::{generate, CpuBackend, Engine, GenerateOptions};

#[test]
fn smollm2_bf16_greedy_on_the_gpu_equals_the_cpu() {
    if !runtime::cuda::driver_present() || codegen::nvrtc::ensure_loaded().is_err() {
        eprintln!("skipped: needs an NVIDIA driver and NVRTC");
        return;
    }
    let target = std::env::var("BBC_GPU_TARGET")
        .ok()
        .and_then(|t| Target::parse(&t))
        .unwrap_or(Target::H200);
    let mut spec = ModelSpec::for_weights(&common::real_model("smollm2"));
    spec.dtype = ComputeDtype::Bf16;
    let model = Model::open(spec).unwrap();
    let graph = model.lower(LogitsFor::LastToken).unwrap();
    let cost = bbc::model_ref::cost_model(target);
    let gpu_graph = passes::optimized(&graph, cost).unwrap();
    let greedy_graph = model.lower(LogitsFor::GreedyToken).unwrap();
    let greedy_graph = passes::optimized(&greedy_graph, cost).unwrap();
    let dir = std::env::temp_dir().join(format!("bbc-gpu-run-{}", std::process::id()));
    let graphs = codegen::CompiledGraphs {
        logits: &gpu_graph,
        greedy: Some(&greedy_graph),
        serving: None,
    };
    let manifest = codegen::compile(&model, graphs, target, &dir).unwrap();
    let int8 = codegen::read_int8_heads(&dir, &manifest.int8_heads).unwrap();
    let greedy = runtime::cuda::CudaBackend::new(
        &dir,
        manifest.greedy_plan.as_deref().expect("a greedy plan"),
        greedy_graph,
        &model.weights,
        &int8,
        model.config.context_length,
    )
    .unwrap();
    let gpu = runtime::cuda::CudaBackend::new(
        &dir,
        "plan.json",
        gpu_graph,
        &model.weights,
        &[],
        model.config.context_length,
    )
    .unwrap();
    let cpu_graph = passes::optimized(&graph, passes::CostModel::CPU).unwrap();
    let cpu = Engine::from(CpuBackend::new(cpu_graph, &model.weights, model.config.context_length).unwrap());
    // Each generation starts a new sequence at position 0; the GPU's one cache is rewritten.
    let gpu = Engine {
        logits: Some(gpu),
        greedy: Some(greedy),
    };
    let options = GenerateOptions {
        max_tokens: 32,
        ..Default::default()
    };
    for prompt in [
        vec![504u32, 3575, 282, 4649, 314],
        (0..40).map(|i| 100 + 7 * i).collect(),
    ] {
        let want = generate(&cpu, &prompt, &options, |_| Ok(true)).unwrap();
        // The logits plan (with the greedy plan left out), then the greedy plan.
        let logits_only = GenerateOptions {
            need_logits: true,
            ..options.clone()
        };
        let got = generate(&gpu, &prompt, &logits_only, |_| Ok(true)).unwrap();
        assert_eq!(got, want, "logits plan, {prompt:?}");
        let got = generate(&gpu, &prompt, &options, |_| Ok(true)).unwrap();
        assert_eq!(got, want, "greedy plan, {prompt:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
