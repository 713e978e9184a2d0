//! Whole decode steps of a model shape with random bf16 weights made on the device (no
//! download), timed as `bbc serve` runs them (`runtime::decode_timing`), and their tables:
//! the Llama-8B-shaped model (`llama_8b::decode`) and the
//! Qwen3.5-27B-shaped hybrid (`hybrid`: three Gated DeltaNet layers to one of gated attention).

use anyhow::{anyhow, Result};
use codegen::gpu;
use codegen::Target;
use kernels_gen::dsl::Kernel;
use models::{ComputeDtype, LogitsFor};
use runtime::decode_timing::{
    kernel_totals, profile_prefill, time_decode, time_prefill, DecodeRun, DecodeTiming, KernelTotal,
};
use runtime::plan_exec::PlanExecutor;
use runtime::serving::PagedBackend;
use runtime_cuda::CudaDevice;

/// `config`'s serving plan for `target` (as `bbc compile` writes it: each sequence's argmax
/// beside its logits; taking `kernels` where it has a choice), on this GPU with bf16 weights made there
/// and a KV pool (and recurrent state slots) for `run`, decode steps of up to 64 rows replayed
/// as graphs. Sequences hold up to `context` positions (at least `run`'s, and 1 024).
pub(super) fn serving_executor(
    name: &str,
    config: &models::ModelConfig,
    target: (Target, &str),
    served: (&DecodeRun, usize),
    kernels: impl Into<gpu::PlanKernels>,
) -> Result<PlanExecutor<CudaDevice>> {
    quantized_serving_executor(name, config, target, served, kernels, None)
}

/// [`serving_executor`] of the model with the weights a checkpoint quantized as it loads
/// would quantize held as `blocks` (FP8 blocks as `--quantization fp8` makes, or the 4-bit
/// blocks a GPTQ or AWQ checkpoint is held as): made on the host from the values the device
/// would fill, and uploaded.
pub(super) fn quantized_serving_executor(
    name: &str,
    config: &models::ModelConfig,
    (target, arch): (Target, &str),
    (run, context): (&DecodeRun, usize),
    kernels: impl Into<gpu::PlanKernels>,
    blocks: Option<quant::GgmlType>,
) -> Result<PlanExecutor<CudaDevice>> {
    let options = models::LowerOptions {
        logits: LogitsFor::LastToken,
        compute: ComputeDtype::Bf16,
        kv_cache: models::KvCacheDtype::Auto,
    };
    let graph = models::lower_without_weights_in_blocks(config, options, blocks)?;
    let graph = passes::optimized(&graph, crate::model_ref::cost_model(target))?;
    let graph = models::with_greedy_token(&graph)?;
    let block_size = 16;
    let context = context.max(run.positions_per_sequence()).max(1024);
    let cache = gpu::BatchedCache {
        // Room for the run's sequences, or for one of the whole context.
        blocks: (run.sequences() * run.positions_per_sequence().div_ceil(block_size)).max(context.div_ceil(block_size)),
        block_size,
        sequences: run.sequences(),
    };
    let started = std::time::Instant::now();
    let (plan, kernels) = gpu::build_program(&graph, target, 512, Some(cache), kernels)?;
    let kernels: Vec<Kernel> = kernels
        .into_iter()
        .chain(runtime::random_weights::fill_kernels())
        .collect();
    let device = super::compile_device(&kernels, arch)?;
    let exec = PlanExecutor::with_generated_weights(device, plan, graph, 8, context)?
        .capture_graphs_up_to(64)
        .verify_drafts_up_to(run.drafts)?;
    println!(
        "\n{name} model: compiled, weights made on the device, KV pool of {} blocks in {:.1} s",
        cache.blocks,
        started.elapsed().as_secs_f64()
    );
    if run.prefill_chunk < gpu::PREFILL_TOKENS {
        println!(
            "(prompts prefilled {} rows a step: through the GEMV, not the tensor-core GEMM)",
            run.prefill_chunk
        );
    }
    Ok(exec)
}

/// One sequence's prompt prefilled (after a first, untimed one: kernels load lazily), wall
/// time and tokens a second.
pub(super) fn print_prefill(name: &str, exec: &PlanExecutor<CudaDevice>, run: &DecodeRun) -> Result<()> {
    time_prefill(exec, run)?;
    let seconds = time_prefill(exec, run)?;
    println!(
        "\n{name} prefill of a {}-token prompt, {} rows a step: {:.2} ms ({:.0} tok/s)",
        run.prompt,
        run.prefill_chunk.min(512),
        seconds * 1e3,
        run.prompt as f64 / seconds
    );
    Ok(())
}

/// Each batch size's step: wall times (logits or ids read back), device time, weight bytes
/// and their rate against the copy bandwidth.
pub(super) fn print_steps(name: &str, run: &DecodeRun, timings: &[DecodeTiming], bandwidth: f64) -> Result<()> {
    println!(
        "\n| {name} decode, {}-token prompts | wall ms/step, logits / ids read back | tok/s (ids) | device ms/step | weight GB/step | weight GB/s (device) | % of copy bandwidth (device / wall, ids) |",
        run.prompt
    );
    println!("|---|---|---|---|---|---|---|");
    for t in timings {
        let device = t.device_seconds().ok_or_else(|| anyhow!("CUDA times every launch"))?;
        let greedy = t.greedy_wall_seconds.unwrap_or(t.wall_seconds);
        let bytes = t.weight_bytes() as f64;
        println!(
            "| batch {} | {:.3} / {:.3} | {:.0} | {:.3} | {:.2} | {:.0} | {:.0}% / {:.0}% |",
            t.batch,
            t.wall_seconds * 1e3,
            greedy * 1e3,
            t.batch as f64 / greedy,
            device * 1e3,
            bytes / 1e9,
            bytes / device / 1e9,
            100.0 * bytes / device / bandwidth,
            100.0 * bytes / greedy / bandwidth,
        );
    }
    Ok(())
}

/// A prompt long enough that attention is much of its prefill.
pub(super) const LONG_PROMPT: usize = 8192;

/// One sequence's prefill of a [`LONG_PROMPT`]-token prompt, `run.prefill_chunk` rows a step
/// as served (after an untimed one): its wall time, then a run timing each launch: each
/// kernel's share, and attention's (its kernels: tensor-core, split and merge) with its rate
/// against the causal attention's FLOPs (`config`'s attention layers, QKᵀ and PV).
pub(super) fn print_long_prefill(
    name: &str,
    exec: &PlanExecutor<CudaDevice>,
    run: &DecodeRun,
    config: &models::ModelConfig,
) -> Result<()> {
    let long = DecodeRun {
        prompt: LONG_PROMPT,
        batches: Vec::new(),
        ..run.clone()
    };
    time_prefill(exec, &long)?;
    let seconds = time_prefill(exec, &long)?;
    let launches = profile_prefill(exec, &long)?;
    let totals = kernel_totals(&launches);
    let device: f64 = totals.iter().filter_map(|k| k.seconds).sum();
    let attention: f64 = totals
        .iter()
        .filter(|k| k.kernel.starts_with("flash_attention") || k.kernel.starts_with("attention"))
        .filter_map(|k| k.seconds)
        .sum();
    let flops = causal_attention_flops(config, LONG_PROMPT);
    println!(
        "\n{name} prefill of a {LONG_PROMPT}-token prompt, {} rows a step: {:.1} ms wall ({:.0} tok/s); \
         launches timed one by one {:.1} ms, attention {:.1} ms of them ({:.0}%), {:.0} TFLOP/s",
        long.prefill_chunk.min(PagedBackend::max_step_tokens(exec).unwrap_or(1)),
        seconds * 1e3,
        LONG_PROMPT as f64 / seconds,
        device * 1e3,
        attention * 1e3,
        100.0 * attention / device,
        flops / attention / 1e12
    );
    print_kernel_shares("long prefill", &totals, device);
    Ok(())
}

/// Each kernel's launches, time and share of `device` seconds, as a table headed `what`.
pub(super) fn print_kernel_shares(what: &str, totals: &[KernelTotal], device: f64) {
    println!("\n| kernel ({what}) | launches | ms | % of the launches' time |\n|---|---|---|---|");
    for k in totals {
        let seconds = k.seconds.unwrap_or(0.0);
        println!(
            "| {} | {} | {:.2} | {:.1}% |",
            k.kernel,
            k.launches,
            seconds * 1e3,
            100.0 * seconds / device
        );
    }
}

/// FLOPs of causal attention over a prompt of `tokens` in `config`'s softmax-attention
/// layers: row p's query against its keys (p + 1, or the window's), QKᵀ and PV each
/// `2 · head_dim` FLOPs a key and head.
pub(super) fn causal_attention_flops(config: &models::ModelConfig, tokens: usize) -> f64 {
    let keys = |window: usize| -> f64 { (0..tokens).map(|p| (p + 1).min(window) as f64).sum() };
    let pairs: f64 = config
        .layer_attention
        .iter()
        .map(|a| match a {
            models::LayerAttention::Full => keys(usize::MAX),
            models::LayerAttention::Sliding => keys(config.sliding_window.unwrap_or(usize::MAX)),
            models::LayerAttention::Linear => 0.0,
        })
        .sum();
    pairs * config.heads as f64 * 4.0 * config.head_dim as f64
}

/// Each batch size's profiled step, by kernel: launches, time, share, weight rate.
pub(super) fn print_profiles(timings: &[DecodeTiming], bandwidth: f64) {
    for t in timings {
        let step: f64 = t.device_seconds().unwrap_or(0.0);
        println!(
            "\n| kernel (batch {}) | launches | µs | % of step | weight GB/s | % of copy bandwidth |\n|---|---|---|---|---|---|",
            t.batch
        );
        for k in t.by_kernel() {
            let seconds = k.seconds.unwrap_or(0.0);
            let (rate, share) = match k.weight_bytes {
                0 => ("–".to_string(), "–".to_string()),
                bytes => {
                    let rate = bytes as f64 / seconds;
                    (
                        format!("{:.0}", rate / 1e9),
                        format!("{:.0}%", 100.0 * rate / bandwidth),
                    )
                }
            };
            println!(
                "| {} | {} | {:.1} | {:.1}% | {rate} | {share} |",
                k.kernel,
                k.launches,
                seconds * 1e6,
                100.0 * seconds / step
            );
        }
    }
}

/// A Qwen3.5-27B-shaped hybrid (`ModelConfig::qwen3_5_27b`: 48 Gated DeltaNet layers, 16 of
/// gated attention, 54 GB of bf16 weights) decoding at batch 1 and 16 after 512-token prompts,
/// each kernel's share: what the DeltaNet kernels (convolution, window, delta rule over each
/// sequence's f32 state) cost beside the matmuls. Then the same batches verifying 3 drafted
/// tokens a sequence (4 rows each, the states after the first 3 kept as checkpoints, 150 MiB
/// each a sequence): what a speculating step costs against a decode step. Then an 8 192-token
/// prompt's prefill, each kernel's share, with the delta rule in chunks (the plans' default)
/// and again a row at a time (`gpu::PrefillDeltaRule::Recurrent`).
pub fn hybrid(target: Target, arch: &str, bandwidth: f64, prefill_chunk: usize) -> Result<()> {
    let name = "Qwen3.5-27B-shaped";
    let run = DecodeRun {
        prompt: 512,
        batches: vec![1, 16],
        steps: 10,
        prefill_chunk,
        drafts: 0,
    };
    let verifying = DecodeRun {
        drafts: 3,
        ..run.clone()
    };
    // Sized for the verifying run, the larger.
    let config = models::ModelConfig::qwen3_5_27b();
    let exec = serving_executor(
        name,
        &config,
        (target, arch),
        (&verifying, LONG_PROMPT),
        gpu::PrefillGemm::default(),
    )?;
    print_prefill(name, &exec, &run)?;
    let timings = time_decode(&exec, &run)?;
    print_steps(name, &run, &timings, bandwidth)?;
    print_profiles(&timings, bandwidth);
    let verified = time_decode(&exec, &verifying)?;
    print_verifying(&verifying, &timings, &verified);
    print_long_prefill(name, &exec, &run, &config)?;
    // The weights of one executor at a time: 54 GB each.
    drop(exec);
    let recurrent = "Qwen3.5-27B-shaped, recurrent delta rule";
    let kernels = gpu::PlanKernels {
        prefill_delta_rule: gpu::PrefillDeltaRule::Recurrent,
        ..Default::default()
    };
    let exec = serving_executor(recurrent, &config, (target, arch), (&run, LONG_PROMPT), kernels)?;
    print_prefill(recurrent, &exec, &run)?;
    print_long_prefill(recurrent, &exec, &run, &config)
}

/// Each batch size's verifying step against its decode step (ids read back, as greedy serving
/// does): wall times and their ratio, what a step that accepts `a` drafts a sequence must
/// stay under `1 + a` times for speculation to pay.
fn print_verifying(run: &DecodeRun, decoding: &[DecodeTiming], verifying: &[DecodeTiming]) {
    println!(
        "\n| batch | decode step ms | step verifying {} drafts a sequence ms | ratio |\n|---|---|---|---|",
        run.drafts
    );
    for (d, v) in decoding.iter().zip(verifying) {
        let (plain, verify) = (
            d.greedy_wall_seconds.unwrap_or(d.wall_seconds),
            v.greedy_wall_seconds.unwrap_or(v.wall_seconds),
        );
        println!(
            "| {} | {:.3} | {:.3} | {:.2} |",
            d.batch,
            plain * 1e3,
            verify * 1e3,
            verify / plain
        );
    }
}

#[cfg(test)]
mod tests {
    use super::causal_attention_flops;

    #[test]
    fn attention_flops_count_each_rows_keys_within_its_window() {
        let mut config = models::ModelConfig::llama3_8b();
        // Llama-3-8B at 8 192 tokens: 32 layers × 32 heads × 4 × 128 × (8 192 · 8 193 / 2).
        let full = 32.0 * 32.0 * 4.0 * 128.0 * (8192.0 * 8193.0 / 2.0);
        assert_eq!(causal_attention_flops(&config, 8192), full);
        // Rows past a window of 4 see 4 keys: 1 + 2 + 3 + 4 + 4 + 4 for 6 rows.
        config.layer_attention = vec![models::LayerAttention::Sliding, models::LayerAttention::Linear];
        config.sliding_window = Some(4);
        assert_eq!(causal_attention_flops(&config, 6), 18.0 * 32.0 * 4.0 * 128.0);
    }
}
