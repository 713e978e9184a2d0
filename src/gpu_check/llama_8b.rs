//! A Llama-8B-shaped model (`ModelConfig::llama3_8b`) on the GPU, with random bf16 weights
//! made on the device (no download): its matmuls timed alone at batch 1, 4, 16 and 64, then whole decode steps as
//! `bbc serve` runs them. Issue [4]'s target: batch-1 decode at 70% or more of the copy
//! bandwidth (weight bytes per step over time per step).

use anyhow::{anyhow, Result};
use codegen::gpu::{self, expr};
use codegen::Target;
use kernels_gen::dsl::{Kernel, Ty};
use kernels_gen::templates::gemv::{gemv, GemvSpec};
use kernels_gen::templates::quant::WeightFormat;
use kernels_gen::templates::{gemm_wgmma, prefill_gemm, split_k};
use models::{ComputeDtype, LogitsFor};
use runtime::cuda::CudaDevice;
use runtime::generated::{fill_kernels, fill_on_device, Fill};
use runtime::plan_exec::{DeviceArg, PlanDevice, PlanExecutor};

/// Whole decode steps of a Llama-8B-shaped model with bf16 weights made on the device: the
/// serving plan `bbc compile` writes for `target`, run as `bbc serve` runs it.
pub fn decode(target: Target, arch: &str, bandwidth: f64, prefill_chunk: usize) -> Result<()> {
    use runtime::decode_timing::{time_decode, DecodeRun};
    let config = models::ModelConfig::llama3_8b();
    let options = models::LowerOptions {
        logits: LogitsFor::LastToken,
        compute: ComputeDtype::Bf16,
    };
    let graph = models::lower_without_weights(&config, options)?;
    let graph = passes::optimized(&graph, crate::model_ref::cost_model(target))?;
    // The serving graph `bbc compile` writes: each sequence's argmax beside its logits.
    let graph = models::with_greedy_token(&graph)?;
    let run = DecodeRun {
        prompt: 512,
        // 4: a small batch, through the few-rows GEMV; 16 and 64 through the GEMM.
        batches: vec![1, 4, 16, 64],
        steps: 10,
        prefill_chunk,
    };
    let block_size = 16;
    let cache = gpu::BatchedCache {
        blocks: run.sequences() * run.positions_per_sequence().div_ceil(block_size),
        block_size,
    };
    let started = std::time::Instant::now();
    let (plan, kernels) = gpu::build_batched(&graph, target, 512, cache)?;
    let kernels: Vec<Kernel> = kernels.into_iter().chain(runtime::generated::fill_kernels()).collect();
    let device = CudaDevice::compile(&kernels, arch)?;
    let exec = PlanExecutor::with_generated_weights(device, plan, graph, 8, 1024)?.capture_graphs_up_to(64);
    println!(
        "\nLlama-8B-shaped model: compiled, weights made on the device, KV pool of {} blocks in {:.1} s",
        cache.blocks,
        started.elapsed().as_secs_f64()
    );
    let timings = time_decode(&exec, &run)?;
    if prefill_chunk < gpu::PREFILL_TOKENS {
        println!("(prompts prefilled {prefill_chunk} rows a step: through the GEMV, not the tensor-core GEMM)");
    }
    println!(
        "\n| Llama-8B-shaped decode, {}-token prompts | wall ms/step, logits / ids read back | tok/s (ids) | device ms/step | weight GB/step | weight GB/s (device) | % of copy bandwidth (device / wall, ids) |",
        run.prompt
    );
    println!("|---|---|---|---|---|---|---|");
    for t in &timings {
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
    for t in &timings {
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
    Ok(())
}

/// Llama-3-8B's matmuls: (name, output rows, input width, count per decode step).
const SHAPES: [(&str, usize, usize, usize); 5] = [
    ("qkv", 6144, 4096, 32),
    ("o", 4096, 4096, 32),
    ("gate_up", 28672, 4096, 32),
    ("down", 4096, 14336, 32),
    ("lm_head", 128256, 4096, 1),
];

/// Time every shape's matmul alone at batch 1 (the decode GEMV), 4 (the 4-tokens-per-pass
/// GEMV small batches take), 16 and 64 (the tensor-core GEMM, K split as the plans split it,
/// the reduction included; and the 4-tokens-per-pass GEMV for comparison); the table as markdown, with the step the matmuls alone would add up to
/// (the whole step is [`decode`]'s).
pub fn matmul_timings(target: Target, arch: &str, bandwidth: f64) -> Result<String> {
    let spec = |k: usize| GemvSpec::decode(WeightFormat::Dense(Ty::Bf16), k).with_x_vectors();
    let mut table = String::from(
        "| matmul | batch | kernel | µs | weight GB/s | % of copy bandwidth |\n|---|---|---|---|---|---|\n",
    );
    let mut step = [0f64; 3];
    for (name, n, k, count) in SHAPES {
        let kernels: Vec<Kernel> = vec![
            gemv("gemv", "gpu-check", spec(k)),
            gemv("gemv_prefill", "gpu-check", spec(k).prefill()),
            // The target's tensor-core GEMM: wgmma on sm_90a, tcgen05 on sm_100a, mma.sync on sm_120a.
            prefill_gemm(arch, WeightFormat::Dense(Ty::Bf16), k, None, None, "gemm", "gpu-check")
                .ok_or_else(|| anyhow!("a bf16 GEMM"))?,
            split_k::reduce("split_k_reduce", "gpu-check", gpu::PREFILL_TOKENS, None),
        ];
        let mut device = CudaDevice::compile(&[kernels.clone(), fill_kernels()].concat(), arch)?;
        // Random weights and activations (never zeros: they can run faster than real data).
        let w = device.alloc(n * k * 2)?;
        fill_on_device(&mut device, &w, 0, n * k, Ty::Bf16, Fill::of(1, name, &[n, k]))?;
        let x = device.alloc(64 * k * 4)?;
        fill_on_device(&mut device, &x, 0, 64 * k, Ty::F32, Fill::of(2, name, &[64, k]))?;
        let out = device.alloc(64 * n * 4)?;
        let partial_bytes = split_k::partial_len(n, k, gemm_wgmma::TILES, target.multiprocessors()) * 4;
        let partial = device.alloc(partial_bytes)?;
        for (batch, kernel) in [
            (1, "gemv"),
            // What a small decode batch runs (the plans' few-rows kernel).
            (4, "gemv_prefill"),
            (16, "gemm"),
            (16, "gemv_prefill"),
            (64, "gemm"),
            (64, "gemv_prefill"),
        ] {
            let program = kernels
                .iter()
                .find(|kk| kk.name == kernel)
                .ok_or_else(|| anyhow!("a timed kernel"))?;
            let split_k = program.param("splits").is_some();
            let splits = match split_k {
                true => {
                    let expr = split_k::splits_expr("tokens", n, k, gemm_wgmma::TILES, target.multiprocessors());
                    let vars = [("tokens", expr::Value::Int(batch as i64))].into_iter().collect();
                    expr::eval(&expr, &vars)?.as_i64() as usize
                }
                false => 1,
            };
            let grid = grid_of(program, batch, n, k, splits)?;
            let mut args = vec![
                DeviceArg::Buffer(&x, 0..64 * k * 4),
                DeviceArg::Buffer(&w, 0..n * k * 2),
                DeviceArg::Buffer(&out, 0..64 * n * 4),
                DeviceArg::I32(batch as i32),
                DeviceArg::I32(n as i32),
                DeviceArg::I32(k as i32),
                DeviceArg::I32(k as i32),
            ];
            if split_k {
                args.extend([
                    DeviceArg::Buffer(&partial, 0..partial_bytes),
                    DeviceArg::I32(splits as i32),
                ]);
            }
            let reduce_args = [
                DeviceArg::Buffer(&partial, 0..partial_bytes),
                DeviceArg::Buffer(&out, 0..64 * n * 4),
                DeviceArg::I32(batch as i32),
                DeviceArg::I32(n as i32),
                DeviceArg::I32(splits as i32),
                // Into `out`'s rows, n wide, from column 0.
                DeviceArg::I32(n as i32),
                DeviceArg::I32(0),
            ];
            let reduce_grid = (batch * n).div_ceil(kernels_gen::templates::BLOCK as usize) as u32;
            let seconds = device.time(20, |d| {
                d.launch(kernel, grid, program.block_dim, &args)?;
                match splits > 1 {
                    true => d.launch(
                        "split_k_reduce",
                        reduce_grid,
                        kernels_gen::templates::BLOCK,
                        &reduce_args,
                    ),
                    false => Ok(()),
                }
            })?;
            let rate = (n * k * 2) as f64 / seconds;
            let label = match splits {
                1 => kernel.to_string(),
                _ => format!("{kernel}, {splits} K splits + reduction"),
            };
            table += &format!(
                "| {name} {n}×{k} | {batch} | {label} | {:.1} | {:.0} | {:.0}% |\n",
                seconds * 1e6,
                rate / 1e9,
                100.0 * rate / bandwidth
            );
            // The decode step: the GEMV at batch 1, the GEMM at 16 and 64.
            match (batch, kernel) {
                (1, _) => step[0] += seconds * count as f64,
                (16, "gemm") => step[1] += seconds * count as f64,
                (64, "gemm") => step[2] += seconds * count as f64,
                _ => {}
            }
        }
    }
    let weight_bytes: usize = SHAPES.iter().map(|&(_, n, k, count)| n * k * 2 * count).sum();
    for (batch, seconds) in [1, 16, 64].into_iter().zip(step) {
        table += &format!(
            "\nLlama-8B-shaped matmuls alone, batch {batch}: {:.2} ms per step, {:.0} tok/s, {:.0}% of copy bandwidth",
            seconds * 1e3,
            batch as f64 / seconds,
            100.0 * weight_bytes as f64 / seconds / bandwidth
        );
    }
    Ok(table)
}

/// Blocks for `kernel` over `batch` tokens, `n` rows, width `k` and `splits` K splits: its
/// grid expression.
fn grid_of(kernel: &Kernel, batch: usize, n: usize, k: usize, splits: usize) -> Result<u32> {
    let scalars = [
        ("tokens", batch),
        ("n", n),
        ("k", k),
        ("x_stride", k),
        ("splits", splits),
    ]
    .into_iter()
    .map(|(name, v)| (name, expr::Value::Int(v as i64)))
    .collect();
    match expr::eval(&kernels_gen::cuda::grid_expr(kernel), &scalars)? {
        expr::Value::Int(blocks) => Ok(blocks as u32),
        other => Err(anyhow!("grid of {}: {other:?}", kernel.name)),
    }
}
