//! A Llama-8B-shaped model (`ModelConfig::llama3_8b`) on the GPU, with random bf16 weights
//! made on the device (no download): its matmuls timed alone at batch 1, 4, 16 and 64, then
//! whole decode steps as `bbc serve` runs them, each as a share of the copy bandwidth (weight
//! bytes per step over time per step).

use anyhow::{anyhow, Result};
use codegen::gpu::{self, expr};
use codegen::Target;
use kernels_gen::dsl::{Kernel, Param, Ty};
use kernels_gen::templates::gemm_tma_mma::{self, gemm_tma_mma_bf16};
use kernels_gen::templates::gemm_tma_tcgen05::{gemm_tma_tcgen05_bf16, TcgenTile};
use kernels_gen::templates::gemm_tma_wgmma::{self, gemm_tma_wgmma_bf16, TmaTile};
use kernels_gen::templates::gemm_wgmma::{self, Schedule};
use kernels_gen::templates::gemv::{self, gemv, GemvSpec, NormPrologue};
use kernels_gen::templates::quant::WeightFormat;
use kernels_gen::templates::{prefill_gemm, split_k};
use runtime::plan_exec::{DeviceArg, PlanDevice};
use runtime::random_weights::{fill_kernels, fill_on_device, Fill};

/// Whole decode steps of a Llama-8B-shaped model with bf16 weights made on the device: the
/// serving plan `bbc compile` writes for `target`, run as `bbc serve` runs it; batch 1 also
/// without each of the two ways a step overlaps its kernels.
pub fn decode(target: Target, arch: &str, bandwidth: f64, prefill_chunk: usize) -> Result<()> {
    use super::decode::{
        print_long_prefill, print_prefill, print_profiles, print_steps, serving_executor, LONG_PROMPT,
    };
    use runtime::decode_timing::{time_decode, DecodeRun};
    let name = "Llama-8B-shaped";
    let run = DecodeRun {
        prompt: 512,
        // 4: a small batch, through the few-rows GEMV; 16 and 64 through the GEMM.
        batches: vec![1, 4, 16, 64],
        steps: 10,
        prefill_chunk,
        drafts: 0,
    };
    let config = models::ModelConfig::llama3_8b();
    // Sequences as long as the long prompt: its prefill runs in the same plan.
    let served = (&run, LONG_PROMPT);
    let exec = serving_executor(name, &config, (target, arch), served, codegen::gpu::PrefillGemm::Tma)?;
    print_prefill(name, &exec, &run)?;
    // Beside it, the GEMM plans prefilled through before the TMA GEMM, and on Hopper and the
    // B200 the warp-specialised TMA GEMM, a block a tile and persistent; one plan loaded at a
    // time beside the served one.
    let mut others = vec![("Llama-8B-shaped, pipelined GEMM", codegen::gpu::PrefillGemm::Pipelined)];
    if kernels_gen::templates::TmaSchedule::has_forms(arch) {
        others.extend([
            (
                "Llama-8B-shaped, warp-specialised TMA GEMM",
                codegen::gpu::PrefillGemm::Specialised,
            ),
            (
                "Llama-8B-shaped, persistent warp-specialised TMA GEMM",
                codegen::gpu::PrefillGemm::Persistent,
            ),
        ]);
    }
    for (name, prefill) in others {
        let other = serving_executor(name, &config, (target, arch), (&run, 0), prefill)?;
        print_prefill(name, &other, &run)?;
    }
    print_long_prefill(name, &exec, &run, &config)?;
    // On Hopper, prompts attending on `wgmma` too, in each of its schedules, and on the B200 on
    // `tcgen05`: the 8 192-token prefill where attention weighs most.
    let wide = [
        (
            "sm_90a",
            "Llama-8B-shaped, wgmma prefill attention",
            codegen::gpu::PrefillAttention::Wgmma,
        ),
        (
            "sm_90a",
            "Llama-8B-shaped, warp-specialised wgmma prefill attention",
            codegen::gpu::PrefillAttention::WgmmaSpecialised,
        ),
        (
            "sm_90a",
            "Llama-8B-shaped, wgmma prefill attention loading by TMA",
            codegen::gpu::PrefillAttention::WgmmaTma,
        ),
        (
            "sm_100a",
            "Llama-8B-shaped, tcgen05 prefill attention",
            codegen::gpu::PrefillAttention::Tcgen05,
        ),
        (
            "sm_100a",
            "Llama-8B-shaped, tcgen05 prefill attention loading by TMA",
            codegen::gpu::PrefillAttention::Tcgen05Tma,
        ),
    ];
    for (_, name, attention) in wide.into_iter().filter(|(on, ..)| *on == arch) {
        let kernels = codegen::gpu::PlanKernels {
            prefill_attention: attention,
            ..Default::default()
        };
        let executor = serving_executor(name, &config, (target, arch), served, kernels)?;
        print_prefill(name, &executor, &run)?;
        print_long_prefill(name, &executor, &run, &config)?;
    }
    let timings = time_decode(&exec, &run)?;
    // Batch 1 again without each of the two ways a step overlaps its kernels, side by side in
    // one run: without the weight prefetch during attention (`templates::weight_prefetch`),
    // then without programmatic dependent launch (each kernel launched once the one before
    // has finished).
    let batch_1 = DecodeRun {
        batches: vec![1],
        ..run.clone()
    };
    let (prefetching, programmatic) = exec.with_device(|d| (d.weight_prefetch(), d.programmatic_launch()))?;
    let mut variants = Vec::new();
    if prefetching {
        exec.with_device_mut(|d| d.set_weight_prefetch(false))?;
        variants.extend(
            time_decode(&exec, &batch_1)?
                .into_iter()
                .map(|t| ("no weight prefetch", t)),
        );
        exec.with_device_mut(|d| d.set_weight_prefetch(true))?;
    }
    if programmatic {
        exec.with_device_mut(|d| d.set_programmatic_launch(false))?;
        variants.extend(
            time_decode(&exec, &batch_1)?
                .into_iter()
                .map(|t| ("ordinary launches", t)),
        );
    }
    print_steps(name, &run, &timings, bandwidth)?;
    if let Some(both) = timings.first() {
        let wall = |t: &runtime::decode_timing::DecodeTiming| t.greedy_wall_seconds.unwrap_or(t.wall_seconds);
        println!(
            "\n| batch 1, ids read back | wall ms/step | % of copy bandwidth | wall / first row's |\n|---|---|---|---|"
        );
        let served = format!(
            "as served ({}, {})",
            if prefetching {
                "weight prefetch"
            } else {
                "no weight prefetch"
            },
            if programmatic {
                "programmatic launches"
            } else {
                "ordinary launches"
            }
        );
        let first = [(served.as_str(), both)];
        for (how, t) in first.into_iter().chain(variants.iter().map(|(how, t)| (*how, t))) {
            let percent = 100.0 * t.weight_bytes() as f64 / wall(t) / bandwidth;
            println!(
                "| {how} | {:.3} | {percent:.0}% | {:.3} |",
                wall(t) * 1e3,
                wall(t) / wall(both)
            );
        }
        println!(
            "(switched off before the run: BBC_WEIGHT_PREFETCH=0, BBC_PDL=0; programmatic launches need Hopper or newer and a driver that passed the probe)"
        );
    }
    print_profiles(&timings, bandwidth);
    // The steps again attending with the vector split pass (`--decode-attention vector`), its
    // plan loaded once the served one is gone.
    drop(exec);
    let name = "Llama-8B-shaped, vector decode attention";
    let kernels = codegen::gpu::PlanKernels {
        decode_attention: codegen::gpu::DecodeAttention::Vector,
        ..Default::default()
    };
    let vector = serving_executor(name, &config, (target, arch), served, kernels)?;
    print_steps(name, &run, &time_decode(&vector, &run)?, bandwidth)?;
    drop(vector);
    // And quantized to FP8 as it loads (`--quantization fp8`): 9 bits a weight where bf16
    // takes 16, the steps' GEMVs decoding the blocks as they stream them.
    // And in the 4-bit blocks a GPTQ or AWQ checkpoint is held as (4.5 bits a weight: blocks
    // of 128), in the FP4 blocks of an NVFP4 checkpoint (6 bits), in GGUF's MXFP4 blocks
    // (4.25 bits, decoded through a table as llama.cpp's MXFP4_MOE experts are), and in the
    // Q8_0 blocks an 8-bit integer checkpoint is held as (8.5 bits).
    for (name, blocks) in [
        (
            "Llama-8B-shaped, FP8 weights (--quantization fp8)",
            quant::GgmlType::F8E4M3B32,
        ),
        (
            "Llama-8B-shaped, 4-bit weights (as GPTQ and AWQ are held)",
            quant::GgmlType::U4B32,
        ),
        (
            "Llama-8B-shaped, NVFP4 weights (--quantization modelopt_fp4)",
            quant::GgmlType::F4E2M1B32,
        ),
        ("Llama-8B-shaped, GGUF MXFP4 weights", quant::GgmlType::MXFP4),
        (
            "Llama-8B-shaped, 8-bit weights (as W8A16 and W8A8 are held: Q8_0)",
            quant::GgmlType::Q8_0,
        ),
    ] {
        let quantized = super::decode::quantized_serving_executor(
            name,
            &config,
            (target, arch),
            (&run, 0),
            codegen::gpu::PlanKernels::default(),
            Some(blocks),
        )?;
        print_prefill(name, &quantized, &run)?;
        print_steps(name, &run, &time_decode(&quantized, &run)?, bandwidth)?;
    }
    Ok(())
}

/// The rows the matmul table times the tensor-core GEMMs at: decode batches of 16 and 64,
/// and prompt chunks of 256, 512 (as the decode section prefills its prompts) and 2 048.
const GEMM_ROWS: [usize; 5] = [16, 64, 256, 512, 2048];
/// The most rows a timed matmul takes (the buffers' size).
const MOST_ROWS: usize = 2048;

/// Llama-3-8B's matmuls: (name, output rows, input width, count per decode step).
pub(super) const SHAPES: [(&str, usize, usize, usize); 5] = [
    ("qkv", 6144, 4096, 32),
    ("o", 4096, 4096, 32),
    ("gate_up", 28672, 4096, 32),
    ("down", 4096, 14336, 32),
    ("lm_head", 128256, 4096, 1),
];

/// The plain GEMVs the table times for a shape of width `k`, each with the batch it runs:
/// the decode GEMV (batch 1) with one, two and four weight rows a warp and prefetching its
/// weights into L2; the four-tokens-a-pass GEMV small batches take (batch 4), with one, two
/// and four rows a warp; and that GEMV at 16 and 64 rows, for comparison with the GEMM.
fn plain_gemvs(k: usize) -> Vec<(usize, Kernel)> {
    let spec = GemvSpec::decode(WeightFormat::Dense(Ty::Bf16), k).with_x_vectors();
    let mut out = vec![(1, gemv("gemv", "gpu-check", spec))];
    out.extend(rows_variants("gemv", 1, spec));
    out.push((
        1,
        gemv(
            "gemv_l2_prefetch",
            "gpu-check",
            spec.with_prefetch_steps(gemv::PREFETCH_STEPS),
        ),
    ));
    let prefill = gemv("gemv_prefill", "gpu-check", spec.prefill());
    out.push((4, prefill.clone()));
    out.extend(rows_variants("gemv_prefill", 4, spec.prefill()));
    out.extend([(16, prefill.clone()), (64, prefill)]);
    out
}

/// `spec` named `{stem}_rows2` and `{stem}_rows4`: two and four weight rows a warp.
fn rows_variants(stem: &str, batch: usize, spec: GemvSpec) -> Vec<(usize, Kernel)> {
    [2, 4]
        .map(|rows| {
            let name = format!("{stem}_rows{rows}");
            (batch, gemv(&name, "gpu-check", spec.with_rows_per_warp(rows)))
        })
        .into()
}

/// The GEMVs a shape takes in the serving plan where they are not the plain ones: QKV and
/// gate/up behind the residual add and norm (`add_rms_norm_matmul`), gate/up with the SwiGLU
/// after it; at batch 1 with one, two and four weight rows a warp and with the L2 prefetch
/// (see `templates::gemv`), at batch 4 four tokens a pass with one, two and four rows.
fn fused_gemvs(name: &str, k: usize) -> Vec<(usize, Kernel)> {
    let spec = GemvSpec::decode(WeightFormat::Dense(Ty::Bf16), k)
        .with_x_vectors()
        .with_norm(NormPrologue::new(1e-5, 0.0).with_residual());
    let (stem, spec) = match name {
        "qkv" => ("add_rms_norm_gemv", spec),
        "gate_up" => ("add_rms_norm_swiglu_gemv", spec.with_glu(ir::GluAct::Silu)),
        _ => return vec![],
    };
    let mut out = vec![(1, gemv(stem, "gpu-check", spec))];
    out.extend(rows_variants(stem, 1, spec));
    out.push((
        1,
        gemv(
            &format!("{stem}_l2_prefetch"),
            "gpu-check",
            spec.with_prefetch_steps(gemv::PREFETCH_STEPS),
        ),
    ));
    let prefill = format!("{stem}_prefill");
    out.push((4, gemv(&prefill, "gpu-check", spec.prefill())));
    out.extend(rows_variants(&prefill, 4, spec.prefill()));
    out
}

/// One timed case of the 8B matmul table: its buffers (each with its length in bytes) and
/// sizes.
pub(super) struct MatmulCase<'a, B> {
    pub(super) x: (&'a B, usize),
    pub(super) b: (&'a B, usize),
    pub(super) g: (&'a B, usize),
    pub(super) w: (&'a B, usize),
    pub(super) out: (&'a B, usize),
    pub(super) partial: (&'a B, usize),
    pub(super) batch: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) splits: usize,
}

impl<'a, B> MatmulCase<'a, B> {
    /// A case binding `buffer` (4 bytes) to every buffer, for tests that bind kernels.
    #[cfg(test)]
    pub(super) fn every_buffer(buffer: &'a B, batch: usize) -> Self {
        Self {
            x: (buffer, 4),
            b: (buffer, 4),
            g: (buffer, 4),
            w: (buffer, 4),
            out: (buffer, 4),
            partial: (buffer, 4),
            batch,
            n: 6144,
            k: 4096,
            splits: 1,
        }
    }

    /// The argument for the parameter named `param` of any kernel the table times.
    pub(super) fn value(&self, param: &str) -> Option<DeviceArg<'a, B>> {
        let buffer = |(b, len): (&'a B, usize)| DeviceArg::Buffer(b, 0..len);
        let int = |v: usize| DeviceArg::I32(v as i32);
        Some(match param {
            "x" => buffer(self.x),
            "b" => buffer(self.b),
            "g" => buffer(self.g),
            "w" => buffer(self.w),
            "out" => buffer(self.out),
            "partial" => buffer(self.partial),
            "tokens" => int(self.batch),
            "n" => int(self.n),
            "k" | "x_stride" | "b_stride" => int(self.k),
            "splits" => int(self.splits),
            // The reduction writes `out`'s rows, n wide, from column 0.
            "out_stride" => int(self.n),
            "out_col" => int(0),
            _ => return None,
        })
    }
}

/// `kernel`'s arguments in its parameters' order, each from `value` by parameter name: a
/// parameter `value` has nothing for is an error, not a misplaced argument.
pub(super) fn bind<'a, B>(
    kernel: &Kernel,
    value: impl Fn(&str) -> Option<DeviceArg<'a, B>>,
) -> Result<Vec<DeviceArg<'a, B>>> {
    kernel
        .launch_params()
        .map(|p| value(p.name()).ok_or_else(|| anyhow!("{}: nothing for parameter `{}`", kernel.name, p.name())))
        .collect()
}

/// Hopper's GEMM on the schedules earlier runs timed, named as the matmul table shows them.
const EARLIER_HOPPER_SCHEDULES: [(&str, Schedule); 2] = [
    ("gemm_a_in_step", Schedule::IN_STEP_TWO_STAGES),
    ("gemm_2_stages", Schedule::AHEAD_TWO_STAGES),
];

/// The tensor-core GEMMs the table times on `arch`, each with its tiles (for the K splits):
/// `gemm` (wgmma with activations in registers on sm_90a, tcgen05 on sm_100a, mma.sync on
/// sm_120a: the plans' but on Hopper); on Hopper also the schedules earlier runs timed
/// ([`EARLIER_HOPPER_SCHEDULES`]) and the TMA GEMMs on bf16 activations: 128-row weight
/// tiles with each step's MMAs overlapping the next step (`gemm_tma`, the plans') or waited
/// for in their step, and 256-row tiles, each also warp-specialised, a block a tile and in a
/// persistent schedule of a block for each of the `sms` multiprocessors, and with the weights
/// as wgmma's M over tiles of 16 and 64 tokens; on Blackwell the
/// TMA-fed tcgen05 GEMM, also warp-specialised and persistent, and over tiles of 16 and 64
/// tokens, and on the RTX PRO 6000 the TMA-fed `mma.sync` GEMM, on bf16 activations.
fn tensor_core_gemms(
    arch: &str,
    sms: u32,
    gemm: (Kernel, (usize, usize, usize)),
) -> Vec<(Kernel, (usize, usize, usize))> {
    let mut out = vec![gemm];
    if arch == "sm_100a" {
        let tiles = [
            ("gemm_tma", TcgenTile::WIDE),
            ("gemm_tma_specialised", TcgenTile::SPECIALISED),
            ("gemm_tma_persistent", TcgenTile::WIDE.persistent(sms)),
            // Decode batches' tiles: the tensor cores' work sized to 16 and 64 tokens.
            ("gemm_tma_batch_16", TcgenTile::batch(16)),
            ("gemm_tma_batch_64", TcgenTile::batch(64)),
        ];
        for (name, tile) in tiles {
            out.push((gemm_tma_tcgen05_bf16(name, "gpu-check", tile), tile.tiles()));
        }
    }
    if arch == "sm_120a" {
        out.push((gemm_tma_mma_bf16("gemm_tma", "gpu-check"), gemm_tma_mma::TILES));
    }
    if arch == "sm_90a" {
        out.extend(EARLIER_HOPPER_SCHEDULES.iter().map(|(name, schedule)| {
            let kernel = gemm_wgmma::gemm_wgmma_bf16_scheduled(name, "gpu-check", None, None, *schedule);
            (kernel, gemm_wgmma::TILES)
        }));
        let in_step = TmaTile {
            overlapped: false,
            ..TmaTile::WIDE
        };
        let tma = [
            ("gemm_tma", TmaTile::WIDE),
            ("gemm_tma_in_step", in_step),
            ("gemm_tma_n256", TmaTile::WIDEST),
            ("gemm_tma_specialised", TmaTile::SPECIALISED),
            ("gemm_tma_specialised_n256", TmaTile::SPECIALISED_WIDEST),
            ("gemm_tma_persistent", TmaTile::SPECIALISED.persistent(sms)),
            ("gemm_tma_persistent_n256", TmaTile::SPECIALISED_WIDEST.persistent(sms)),
            // The weights as wgmma's M: no tensor-core work on absent rows at 16 and 64.
            ("gemm_tma_batch_16", TmaTile::batch(16)),
            ("gemm_tma_batch_64", TmaTile::batch(64)),
        ];
        for (name, tile) in tma {
            out.push((gemm_tma_wgmma_bf16(name, "gpu-check", tile), tile.tiles()));
        }
    }
    out
}

/// The TMA GEMM with the SwiGLU epilogue (its tile half gates, half their ups), timed for the
/// gate/up shape beside the plain GEMMs over the same weights.
const GATED_GEMM: &str = "gemm_tma_gated";
/// The reduction after it where K splits.
const GATED_REDUCE: &str = "split_k_reduce_gated";

/// On Hopper and the B200, for the gate/up shape, the TMA GEMM gating its own products
/// ([`GATED_GEMM`]), in the tile the plans take.
fn gated_gemm(shape: &str, arch: &str) -> Option<(Kernel, (usize, usize, usize))> {
    let act = ir::GluAct::Silu;
    match (shape, arch) {
        ("gate_up", "sm_90a") => {
            let tile = TmaTile::WIDE;
            let kernel = gemm_tma_wgmma::gemm_tma_wgmma_bf16_gated(GATED_GEMM, "gpu-check", tile, act);
            Some((kernel, tile.tiles()))
        }
        ("gate_up", "sm_100a") => {
            use kernels_gen::templates::gemm_tma_tcgen05::{gemm_tma_tcgen05_bf16_gated, TcgenTile};
            let tile = TcgenTile::WIDE;
            Some((
                gemm_tma_tcgen05_bf16_gated(GATED_GEMM, "gpu-check", tile, act),
                tile.tiles(),
            ))
        }
        _ => None,
    }
}

/// The reductions after the table's GEMMs' K splits: the plain sum, and the gated one.
fn reductions() -> [Kernel; 2] {
    [
        split_k::reduce("split_k_reduce", "gpu-check", gpu::PREFILL_TOKENS, None, None),
        split_k::reduce_after_gating(GATED_REDUCE, "gpu-check", gpu::PREFILL_TOKENS, ir::GluAct::Silu),
    ]
}

/// Whether `kernel` takes its activations in bf16 (the TMA GEMMs) rather than f32.
fn takes_bf16_activations(kernel: &Kernel) -> bool {
    matches!(kernel.param("x"), Some(Param::Buffer { ty: Ty::Bf16, .. }))
}

/// Time every shape's matmul alone at batch 1 (the decode GEMV, and for QKV and gate/up the
/// fused GEMV the serving plan takes; each with one, two and four weight rows a warp, and
/// prefetching), 4 (the 4-tokens-per-pass GEMVs small batches take, likewise), and at
/// [`GEMM_ROWS`] the tensor-core GEMMs ([`tensor_core_gemms`], K split as the plans split it,
/// the reduction included; at 16 and 64 also the 4-tokens-per-pass GEMV); beside each, its
/// time over cuBLASLt's for the same shape on bf16 operands (where cuBLASLt loads); the table
/// as markdown, with the step the matmuls alone would add up to (the whole step is
/// [`decode`]'s).
pub fn matmul_timings(target: Target, arch: &str, bandwidth: f64) -> Result<String> {
    let mut table = String::from(
        "| matmul | batch | kernel | µs | weight GB/s | % of copy bandwidth | × cuBLASLt |\n|---|---|---|---|---|---|---|\n",
    );
    let mut step = [0f64; 3];
    let mut cublas_note = None;
    for (name, n, k, count) in SHAPES {
        let gemvs = [plain_gemvs(k), fused_gemvs(name, k)].concat();
        let gemm = prefill_gemm(arch, WeightFormat::Dense(Ty::Bf16), k, None, None, "gemm", "gpu-check")
            .ok_or_else(|| anyhow!("a bf16 GEMM"))?;
        let sms = target.multiprocessors() as u32;
        let mut gemms = tensor_core_gemms(arch, sms, (gemm.kernel.clone(), gemm.tiles));
        gemms.extend(gated_gemm(name, arch));
        // A kernel timed at several batches is compiled once.
        let mut names = std::collections::HashSet::new();
        let mut kernels: Vec<Kernel> = gemvs
            .iter()
            .filter(|(_, kernel)| names.insert(kernel.name.as_str()))
            .map(|(_, kernel)| kernel.clone())
            .collect();
        kernels.extend(gemms.iter().map(|(kernel, _)| kernel.clone()));
        kernels.extend(reductions());
        let mut device = super::compile_device(&[kernels.clone(), fill_kernels()].concat(), arch)?;
        // Each kernel's own time, as the first run measured it: with programmatic launches the
        // repeated launches would overlap (what they gain is the decode section's to show).
        device.set_programmatic_launch(false);
        // Random weights and activations (never zeros: they can run faster than real data).
        let w = device.alloc(n * k * 2)?;
        fill_on_device(&mut device, &w, 0, n * k, Ty::Bf16, Fill::of(1, name, &[n, k]))?;
        let rows = MOST_ROWS;
        let (x, x_bf16) = random_activations(&mut device, name, rows, k)?;
        // The residual and the norm weight of the fused GEMVs.
        let b = device.alloc(rows * k * 4)?;
        fill_on_device(&mut device, &b, 0, rows * k, Ty::F32, Fill::of(3, name, &[rows, k]))?;
        let g = device.alloc(k * 4)?;
        fill_on_device(&mut device, &g, 0, k, Ty::F32, Fill::of(4, name, &[k]))?;
        // Wide enough for the fused GEMVs' `[x + b | product]` rows.
        let out_bytes = rows * (k + n) * 4;
        let out = device.alloc(out_bytes)?;
        let partial_bytes = gemms
            .iter()
            .map(|(_, tiles)| split_k::partial_len(n, k, *tiles, target.multiprocessors()) * 4)
            .max()
            .unwrap_or(4);
        let partial = device.alloc(partial_bytes)?;
        let mut cases: Vec<(usize, &Kernel, (usize, usize, usize))> = gemvs
            .iter()
            .map(|(batch, kernel)| (*batch, kernel, gemm.tiles))
            .collect();
        for batch in GEMM_ROWS {
            cases.extend(gemms.iter().map(|(kernel, tiles)| (batch, kernel, *tiles)));
        }
        // cuBLASLt at every batch a row is timed at.
        let cublas = match device.cublaslt() {
            Ok(lt) => {
                let out = device.alloc(rows * n * 2)?;
                let mut times = std::collections::BTreeMap::new();
                for batch in cases.iter().map(|(batch, _, _)| *batch) {
                    if let std::collections::btree_map::Entry::Vacant(slot) = times.entry(batch) {
                        let plan = lt.plan(batch, n, k, k)?;
                        slot.insert(device.time(20, |_| lt.run(&plan, &x_bf16, &w, &out))?);
                    }
                }
                times
            }
            Err(e) => {
                cublas_note = Some(e.to_string());
                Default::default()
            }
        };
        for (batch, &seconds) in &cublas {
            let rate = (n * k * 2) as f64 / seconds;
            table += &format!(
                "| {name} {n}×{k} | {batch} | cuBLASLt (bf16 out) | {:.1} | {:.0} | {:.0}% | 1.00 |\n",
                seconds * 1e6,
                rate / 1e9,
                100.0 * rate / bandwidth
            );
        }
        for (batch, program, tiles) in cases {
            let kernel = program.name.as_str();
            let splits = match program.param("splits").is_some() {
                true => {
                    let expr = split_k::splits_expr("tokens", n, k, tiles, target.multiprocessors());
                    let vars = [("tokens", expr::Value::Int(batch as i64))].into_iter().collect();
                    expr::eval(&expr, &vars)?.as_i64() as usize
                }
                false => 1,
            };
            let grid = grid_of(program, batch, n, k, splits)?;
            let case = MatmulCase {
                x: match takes_bf16_activations(program) {
                    true => (&x_bf16, rows * k * 2),
                    false => (&x, rows * k * 4),
                },
                b: (&b, rows * k * 4),
                g: (&g, k * 4),
                w: (&w, n * k * 2),
                out: (&out, out_bytes),
                partial: (&partial, partial_bytes),
                batch,
                n,
                k,
                splits,
            };
            let value = |param: &str| case.value(param);
            let args = bind(program, value)?;
            // A gated GEMM's splits are summed and gated over half the columns.
            let (reduce, columns) = match kernel == GATED_GEMM {
                true => (GATED_REDUCE, n / 2),
                false => ("split_k_reduce", n),
            };
            let reduce_kernel = kernels
                .iter()
                .find(|kk| kk.name == reduce)
                .ok_or_else(|| anyhow!("the split-K reduction {reduce}"))?;
            let reduce_args = bind(reduce_kernel, value)?;
            let reduce_grid = (batch * columns).div_ceil(kernels_gen::templates::BLOCK as usize) as u32;
            let seconds = device.time(20, |d| {
                d.launch(kernel, grid, program.block_dim, &args)?;
                match splits > 1 {
                    true => d.launch(reduce, reduce_grid, kernels_gen::templates::BLOCK, &reduce_args),
                    false => Ok(()),
                }
            })?;
            let rate = (n * k * 2) as f64 / seconds;
            let label = match splits {
                1 => kernel.to_string(),
                _ => format!("{kernel}, {splits} K splits + reduction"),
            };
            let versus = cublas
                .get(&batch)
                .map_or("–".to_string(), |reference| format!("{:.2}", seconds / reference));
            table += &format!(
                "| {name} {n}×{k} | {batch} | {label} | {:.1} | {:.0} | {:.0}% | {versus} |\n",
                seconds * 1e6,
                rate / 1e9,
                100.0 * rate / bandwidth
            );
            // The decode step: the GEMV at batch 1, the GEMM at 16 and 64.
            match (batch, kernel) {
                (1, "gemv") => step[0] += seconds * count as f64,
                (16, "gemm") => step[1] += seconds * count as f64,
                (64, "gemm") => step[2] += seconds * count as f64,
                _ => {}
            }
        }
    }
    if let Some(note) = cublas_note {
        table += &format!("\nNo cuBLASLt to compare with: {note}\n");
    }
    let weight_bytes: usize = SHAPES.iter().map(|&(_, n, k, count)| n * k * 2 * count).sum();
    for (batch, seconds) in [1, 16, 64].into_iter().zip(step) {
        table += &format!(
            "\nLlama-8B-shaped matmuls alone (plain GEMV at batch 1), batch {batch}: {:.2} ms per step, {:.0} tok/s, {:.0}% of copy bandwidth",
            seconds * 1e3,
            batch as f64 / seconds,
            100.0 * weight_bytes as f64 / seconds / bandwidth
        );
    }
    Ok(table)
}

/// A device buffer of the GPU check's.
type DeviceBuffer = <runtime_cuda::CudaDevice as PlanDevice>::Buffer;
/// The same activations in f32 and in bf16.
type Activations = (DeviceBuffer, DeviceBuffer);

/// `rows` × `k` random activations (never zeros: they can run faster than real data) for
/// shape `name`, in f32 and the same values in bf16.
pub(super) fn random_activations(
    device: &mut runtime_cuda::CudaDevice,
    name: &str,
    rows: usize,
    k: usize,
) -> Result<Activations> {
    let fill = Fill::of(2, name, &[rows, k]);
    let x = device.alloc(rows * k * 4)?;
    fill_on_device(device, &x, 0, rows * k, Ty::F32, fill)?;
    let x_bf16 = device.alloc(rows * k * 2)?;
    fill_on_device(device, &x_bf16, 0, rows * k, Ty::Bf16, fill)?;
    Ok((x, x_bf16))
}

/// Blocks for `kernel` over `batch` tokens, `n` rows, width `k` and `splits` K splits: its
/// grid expression.
pub(super) fn grid_of(kernel: &Kernel, batch: usize, n: usize, k: usize, splits: usize) -> Result<u32> {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Arguments follow the kernel's parameters whatever order the values come in, and a
    /// parameter without a value is an error naming it.
    #[test]
    fn arguments_are_bound_by_parameter_name() {
        let reduce = split_k::reduce("reduce", "test", 16, None, None);
        let buffer = 7usize;
        let value = |param: &str| -> Option<DeviceArg<'_, usize>> {
            Some(match param {
                "partial" | "out" => DeviceArg::Buffer(&buffer, 0..8),
                "tokens" => DeviceArg::I32(1),
                "n" => DeviceArg::I32(2),
                "splits" => DeviceArg::I32(3),
                "out_stride" => DeviceArg::I32(4),
                "out_col" => DeviceArg::I32(5),
                _ => return None,
            })
        };
        let Ok(args) = bind(&reduce, value) else {
            panic!("every parameter has a value")
        };
        let scalars: Vec<i32> = args
            .iter()
            .filter_map(|a| match a {
                DeviceArg::I32(v) => Some(*v),
                _ => None,
            })
            .collect();
        assert_eq!(scalars, [1, 2, 3, 4, 5]);
        let missing = |param: &str| match param {
            "out_col" => None,
            other => value(other),
        };
        let Err(err) = bind(&reduce, missing) else {
            panic!("`out_col` has no value")
        };
        assert!(err.to_string().contains("`out_col`"), "{err}");
    }

    /// Every kernel the 8B matmul table times (on every GPU target) finds all its arguments.
    #[test]
    fn the_matmul_table_binds_every_kernel() {
        let buffer = 0usize;
        let case = MatmulCase::every_buffer(&buffer, 1);
        for arch in ["sm_90a", "sm_100a", "sm_120a"] {
            let gemm = prefill_gemm(arch, WeightFormat::Dense(Ty::Bf16), 4096, None, None, "gemm", "test")
                .unwrap()
                .kernel;
            let gemvs = [
                plain_gemvs(4096),
                fused_gemvs("qkv", 4096),
                fused_gemvs("gate_up", 4096),
            ]
            .concat();
            let mut kernels: Vec<Kernel> = gemvs.into_iter().map(|(_, kernel)| kernel).collect();
            kernels.extend(reductions());
            kernels.extend(gated_gemm("gate_up", arch).map(|(kernel, _)| kernel));
            assert_eq!(gated_gemm("gate_up", arch).is_some(), arch != "sm_120a");
            let gemms = tensor_core_gemms(arch, 132, (gemm, (0, 0, 0)));
            let expected = match arch {
                "sm_90a" => 12,
                "sm_100a" => 6,
                _ => 2,
            };
            assert_eq!(gemms.len(), expected, "{arch}");
            kernels.extend(gemms.into_iter().map(|(kernel, _)| kernel));
            for kernel in &kernels {
                if let Err(e) = bind(kernel, |p| case.value(p)) {
                    panic!("{arch}: {e}");
                }
            }
        }
    }
}
