//! SmolLM2 with bf16 weights on the GPU: compiled for the target as `bbc compile` compiles it,
//! run by the CUDA backend through the logits plan and through the greedy plan (the INT8-bound
//! head). Its greedy tokens must equal the CPU backend's from the same bf16 weights where it
//! computes as the CPU does (see [`check`]); then both generate 128 tokens, timed.

use anyhow::{bail, Context, Result};
use codegen::Target;
use models::{ComputeDtype, LogitsFor, Model, ModelSpec};
use runtime::plan_exec::PlanWeights;
use runtime::{generate, Backend, CpuBackend, Engine, GenerateOptions};
use runtime_cuda::CudaBackend;
use std::path::Path;
use std::time::Instant;

/// The prompts compared: a short chat-like one and a 40-token one.
fn prompts() -> [Vec<u32>; 2] {
    [vec![504, 3575, 282, 4649, 314], (0..40).map(|i| 100 + 7 * i).collect()]
}

/// Compare SmolLM2's greedy tokens on the GPU with the CPU's, then time both; `model` is the
/// GGUF file. Prints a line per comparison and the timing table.
///
/// Each prompt is prefilled twice on the GPU: in chunks of 15 rows, which keep to the GEMV and
/// its f32 activations as the CPU backend does (these must equal the CPU's tokens), and whole,
/// through the tensor-core GEMM, which rounds activations to bf16 (as vLLM's bf16 GEMMs do) and
/// may part from the CPU at a near-tie: reported, not failed.
pub fn check(model: &Path, target: Target) -> Result<()> {
    let (gpu, cpu) = engines(model, target)?;
    let mut mismatches = 0;
    for prompt in prompts() {
        let want = generate(&cpu, &prompt, &greedy(32, 512, false), |_| Ok(true))?;
        for (prefill, chunk, strict) in [("GEMV prefill", 15, true), ("GEMM prefill", 512, false)] {
            // The logits plan (the greedy plan left out), then the greedy plan.
            for (plan, need_logits) in [("logits plan", true), ("greedy plan", false)] {
                let got = generate(&gpu, &prompt, &greedy(32, chunk, need_logits), |_| Ok(true))?;
                let what = format!("SmolLM2 bf16, {plan}, {prefill}, {}-token prompt", prompt.len());
                match got.iter().zip(&want).position(|(g, w)| g != w) {
                    None if got.len() == want.len() => {
                        println!("{what}: {} tokens equal to the CPU's", got.len())
                    }
                    at => {
                        mismatches += strict as usize;
                        let at = at.unwrap_or(got.len().min(want.len()));
                        let verdict = if strict { "FAILS" } else { "allowed" };
                        println!(
                            "{what}: differs from the CPU at token {at} ({verdict})\n  gpu {got:?}\n  cpu {want:?}"
                        );
                    }
                }
            }
        }
    }
    print_timings(&gpu, &cpu)?;
    if mismatches > 0 {
        bail!("{mismatches} GPU generations with f32 activations differ from the CPU's");
    }
    Ok(())
}

/// Greedy generation of `tokens` tokens, prompts prefilled `chunk` rows a step.
fn greedy(tokens: usize, chunk: usize, need_logits: bool) -> GenerateOptions {
    GenerateOptions {
        max_tokens: tokens,
        prefill_chunk: chunk,
        need_logits,
        ..Default::default()
    }
}

/// The CUDA engine (logits and greedy plans of an artifact compiled into a temporary
/// directory) and the CPU engine, both on SmolLM2's weights as bf16.
fn engines(model: &Path, target: Target) -> Result<(Engine<CudaBackend>, Engine)> {
    let mut spec = ModelSpec::for_weights(model);
    spec.dtype = ComputeDtype::Bf16;
    let model = Model::open(spec)?;
    let cost = crate::model_ref::cost_model(target);
    let graph = model.lower(LogitsFor::LastToken)?;
    let gpu_graph = passes::optimized(&graph, cost)?;
    let greedy_graph = passes::optimized(&model.lower(LogitsFor::GreedyToken)?, cost)?;
    let scratch = super::scratch_dir("bbc-gpu-check-")?;
    let dir = scratch.path();
    let graphs = codegen::CompiledGraphs {
        logits: &gpu_graph,
        greedy: Some(&greedy_graph),
        serving: None,
        mtp: None,
        eagle: None,
    };
    let manifest = codegen::compile(&model, graphs, target, dir)?;
    let int8 = codegen::read_int8_heads(dir, &manifest.int8_heads)?;
    let context = model.config.context_length;
    let greedy_plan = manifest
        .greedy_plan
        .as_deref()
        .context("the artifact has a greedy plan")?;
    let greedy = runtime_cuda::load_plan(
        dir,
        greedy_plan,
        greedy_graph,
        PlanWeights::Host(&model.weights),
        &int8,
        context,
    )?;
    let logits = runtime_cuda::load_plan(
        dir,
        "plan.json",
        gpu_graph,
        PlanWeights::Host(&model.weights),
        &[],
        context,
    )?;
    drop(scratch);
    let cpu_graph = passes::optimized(&graph, passes::CostModel::CPU)?;
    let cpu = Engine::from(CpuBackend::new(cpu_graph, &model.weights, context)?);
    let gpu = Engine {
        logits: Some(logits),
        greedy: Some(greedy),
    };
    Ok((gpu, cpu))
}

/// 128 greedy tokens after the 40-token prompt on each engine: prompt and decode rates.
fn print_timings(gpu: &Engine<CudaBackend>, cpu: &Engine) -> Result<()> {
    let prompt = &prompts()[1];
    println!("\n| SmolLM2 bf16, greedy | prompt tok/s | decode tok/s |\n|---|---|---|");
    for (name, (prefill, decode)) in [("cuda", rates(gpu, prompt, 128)?), ("cpu", rates(cpu, prompt, 128)?)] {
        println!("| {name} | {prefill:.0} | {decode:.0} |");
    }
    Ok(())
}

/// Prompt tokens per second (until the first token) and decode tokens per second (after it)
/// of `tokens` greedy tokens after `prompt`.
fn rates<B: Backend>(engine: &Engine<B>, prompt: &[u32], tokens: usize) -> Result<(f64, f64)> {
    let options = greedy(tokens, 512, false);
    let started = Instant::now();
    let mut first = None;
    generate(engine, prompt, &options, |_| {
        first.get_or_insert_with(Instant::now);
        Ok(true)
    })?;
    let first = first.context("a generated token")?;
    let prefill = first.duration_since(started).as_secs_f64();
    Ok((
        prompt.len() as f64 / prefill,
        (tokens - 1) as f64 / first.elapsed().as_secs_f64(),
    ))
}
