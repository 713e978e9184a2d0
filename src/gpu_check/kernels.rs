//! The generated kernels on the GPU: every kernel of the tiny Llama, Gemma 3, Gemma 4 (also
//! with KV-shared layers and with its MoE block), Qwen3.5 (also its multi-token prediction
//! head's plans), GLM-4.5 and Qwen3-Next plans in lockstep with the emulator (the Llama's and
//! Gemma 3's serving plans too, prompts attending on the tensor cores over the paged pool; the
//! Llama's also drafted for by an EAGLE-3 head),
//! batched decode steps replayed from CUDA graphs against the
//! same steps launched one kernel at a time, and requests served from snapshots of recurrent
//! states kept on the device, or speculating with their states rewound past refused drafts,
//! against the CPU backend.

use anyhow::{bail, Result};
use codegen::gpu;
use codegen::Target;
use kernels_gen::dsl::{Kernel, Ty};
use models::{ComputeDtype, LogitsFor, Model, ModelSpec};
use runtime::compare::CompareDevice;
use runtime::emulator_device::EmulatorDevice;
use runtime::plan_exec::PlanExecutor;
use runtime::plan_exec::{DeviceArg, PlanDevice};
use runtime::serving::SchedulerConfig;
use runtime_cuda::CudaDevice;
use std::path::Path;

/// The tiny HF fixtures (`tests/fixtures/hf-tiny/`) of the families compiled for the GPU
/// targets: what the lockstep below runs, and what the tests compile for every target.
pub const GPU_FAMILIES: [&str; 9] = [
    "llama",
    "gemma3",
    "gemma4",
    "gemma4_kv_shared",
    "gemma4_moe",
    "qwen3_5",
    "glm4_moe",
    "qwen3_next",
    "glm_moe_dsa",
];

/// Run the tiny models' plans in lockstep on the GPU and the emulator (the HF fixtures in f32
/// and bf16, the MoE ones also in half, the tiny Llama and Gemma 3 also with half KV caches,
/// FP8, GPTQ and FP4 checkpoints held as stored, tiny Llama GGUF files with GGUF-block and f16
/// weights); print
/// each kernel's max relative error; the worst.
pub fn kernel_errors(target: Target, arch: &str, fixtures: &Path) -> Result<f64> {
    let mut worst = 0f64;
    println!("| model | kernel | launches | max relative error |");
    println!("|-------|--------|----------|--------------------|");
    for family in GPU_FAMILIES {
        for dtype in [ComputeDtype::F32, ComputeDtype::Bf16] {
            let mut spec = ModelSpec::for_weights(&fixtures.join(family));
            spec.dtype = dtype;
            worst = worst.max(lockstep(
                &format!("{family} {dtype:?}"),
                &Model::open(spec)?,
                target,
                arch,
            )?);
        }
    }
    // Serving plans over the paged pool: prompts of two sequences in one step (attention on
    // the tensor cores, each sequence's tiles), then decode steps (the split attention, in
    // either form).
    let vector = gpu::PlanKernels {
        decode_attention: gpu::DecodeAttention::Vector,
        ..Default::default()
    };
    for family in ["llama", "gemma3"] {
        let mut spec = ModelSpec::for_weights(&fixtures.join(family));
        spec.dtype = ComputeDtype::Bf16;
        let model = Model::open(spec)?;
        for (how, kernels) in [("", gpu::PlanKernels::default()), (", vector decode attention", vector)] {
            let name = format!("{family} Bf16, batched{how}");
            let errors = batched_kernel_errors(&model, (target, kernels), |kernels| {
                super::compile_device(kernels, arch)
            })?;
            for (kernel, launches, error) in errors {
                println!("| {name} | {kernel} | {launches} | {error:.2e} |");
                worst = worst.max(error);
            }
        }
    }
    // Half and FP8 caches: the appends' f32 -> half / E4M3 conversions and attention's loads
    // widening them, on hardware; FP8's through the vector split pass of a serving plan too.
    for (cache, family) in [
        (models::KvCacheDtype::F16, "llama"),
        (models::KvCacheDtype::F16, "gemma3"),
        (models::KvCacheDtype::Fp8, "llama"),
        (models::KvCacheDtype::Fp8, "gemma3"),
    ] {
        let mut spec = ModelSpec::for_weights(&fixtures.join(family));
        spec.dtype = ComputeDtype::F32;
        spec.kv_cache_dtype = cache;
        let model = Model::open(spec)?;
        worst = worst.max(lockstep(
            &format!("{family} F32, {} KV cache", cache.name()),
            &model,
            target,
            arch,
        )?);
        if cache == models::KvCacheDtype::Fp8 {
            let name = format!("{family} F32, fp8 KV cache, batched, vector decode attention");
            let errors =
                batched_kernel_errors(&model, (target, vector), |kernels| super::compile_device(kernels, arch))?;
            for (kernel, launches, error) in errors {
                println!("| {name} | {kernel} | {launches} | {error:.2e} |");
                worst = worst.max(error);
            }
        }
    }
    worst = worst.max(mtp_kernel_errors(target, fixtures, |kernels| {
        super::compile_device(kernels, arch)
    })?);
    worst = worst.max(eagle_kernel_errors(target, fixtures, |kernels| {
        super::compile_device(kernels, arch)
    })?);
    // Half experts multiplied as stored (the tensor cores' MoE kernels over halves).
    for family in ["glm4_moe", "gemma4_moe"] {
        let mut spec = ModelSpec::for_weights(&fixtures.join(family));
        spec.dtype = ComputeDtype::F16;
        worst = worst.max(lockstep(&format!("{family} F16"), &Model::open(spec)?, target, arch)?);
    }
    // Quantized checkpoints held as stored, their blocks decoded on the device: FP8 (dense and
    // experts), GPTQ in 4-bit blocks of 128 and 32, NVFP4 (dense, and experts with a
    // dequantized shared-expert projection) and MXFP4 in FP4 blocks.
    for family in [
        "llama_fp8",
        "glm4_moe_fp8",
        "llama_gptq_g128",
        "llama_nvfp4",
        "qwen3_next_nvfp4",
        "llama_mxfp4",
    ] {
        let mut spec = ModelSpec::for_weights(&fixtures.join(family));
        spec.dtype = ComputeDtype::Native;
        worst = worst.max(lockstep(
            &format!("{family} as stored"),
            &Model::open(spec)?,
            target,
            arch,
        )?);
    }
    let scratch = super::scratch_dir("bbc-gpu-check-gguf-")?;
    for (name, path) in [
        ("llama Q8_0/Q4_0", super::tiny_gguf::quantized_llama(scratch.path())?),
        ("llama f16", super::tiny_gguf::f16_llama(scratch.path())?),
        // llama.cpp's MXFP4_MOE: experts in MXFP4 blocks, the rest in Q8_0.
        (
            "glm4_moe MXFP4/Q8_0",
            fixtures
                .parent()
                .unwrap_or(fixtures)
                .join("gguf-tiny/glm4_moe.mxfp4_moe.gguf"),
        ),
    ] {
        worst = worst.max(lockstep(
            name,
            &Model::open(ModelSpec::for_weights(&path))?,
            target,
            arch,
        )?);
    }
    Ok(worst)
}

/// `model`'s plan for `target` on the GPU and the emulator in lockstep over a prefill long
/// enough for the prefill GEMM and three decode steps; prints and returns the worst error.
fn lockstep(name: &str, model: &Model, target: Target, arch: &str) -> Result<f64> {
    let graph = model.lower(LogitsFor::LastToken)?;
    let graph = passes::optimized(&graph, crate::model_ref::cost_model(target))?;
    let (plan, kernels) = gpu::build_with_kernels(&graph, target, 64)?;
    let device = CompareDevice::new(
        super::compile_device(&kernels, arch)?,
        EmulatorDevice::new(kernels.clone()),
        &kernels,
    );
    let exec = PlanExecutor::new(device, plan, graph, &model.weights, &[], 256)?;
    let mut seq = exec.new_sequence();
    let prompt: Vec<u32> = (0..gpu::PREFILL_TOKENS as u32 + 3)
        .map(|i| (7 + 13 * i) % 300)
        .collect();
    for ids in [prompt, vec![5], vec![77], vec![123]] {
        exec.step(&mut seq, &ids)?;
    }
    worst_error(name, &exec)
}

/// Print each kernel `exec` compared (a row of `name`'s table: launches, max relative error)
/// and return the worst error.
fn worst_error<D: PlanDevice>(name: &str, exec: &PlanExecutor<CompareDevice<D, EmulatorDevice>>) -> Result<f64> {
    let mut worst = 0f64;
    for (kernel, error) in exec.with_device(|d| d.errors().clone())? {
        println!("| {name} | {kernel} | {} | {:.2e} |", error.launches, error.relative);
        worst = worst.max(error.relative);
    }
    Ok(worst)
}

/// `model`'s serving plan (paged pool, rows of many sequences) for `target`, taking `chosen`
/// kernels, on the device `device` makes for its kernels and on the emulator in lockstep: two
/// prompts of 20 and 17 tokens in one step, then three decode steps of both; each kernel's
/// launches and max relative error.
pub fn batched_kernel_errors<D: PlanDevice>(
    model: &Model,
    (target, chosen): (Target, gpu::PlanKernels),
    mut device: impl FnMut(&[Kernel]) -> Result<D>,
) -> Result<Vec<(String, usize, f64)>> {
    let graph = model.lower(LogitsFor::LastToken)?;
    batched_graph_errors(graph, &model.weights, (target, chosen), &mut device)
}

/// [`batched_kernel_errors`] of a lowered `graph` over `weights`.
fn batched_graph_errors<D: PlanDevice>(
    graph: ir::Graph,
    weights: &dyn quant::tensor::Tensors,
    (target, chosen): (Target, gpu::PlanKernels),
    device: &mut impl FnMut(&[Kernel]) -> Result<D>,
) -> Result<Vec<(String, usize, f64)>> {
    use runtime::kv::{BlockId, Segment, StateSnapshots};
    let graph = passes::optimized(&graph, crate::model_ref::cost_model(target))?;
    let cache = gpu::BatchedCache {
        blocks: 8,
        block_size: 16,
        sequences: 2,
    };
    let exec = compared_serving_executor(graph, weights, (target, cache, chosen), device)?;
    // Each sequence's blocks, in reverse order.
    let tables: [Vec<BlockId>; 2] = [(0..4).rev().map(BlockId).collect(), (4..8).rev().map(BlockId).collect()];
    let prompts: [Vec<u32>; 2] = [
        (0..20).map(|i| (7 + 13 * i) % 300).collect(),
        (0..17).map(|i| (11 + 29 * i) % 300).collect(),
    ];
    let mut starts = [0usize; 2];
    let mut ids = prompts;
    for step in 0..4 {
        let batch: Vec<Segment> = (0..2)
            .map(|s| Segment {
                hidden_states: &[],
                table: &tables[s],
                start: starts[s],
                ids: &ids[s],
                state_slot: s,
                sampled_rows: 1,
                drafts: 0,
                snapshots: StateSnapshots::NONE,
            })
            .collect();
        exec.step_batch_last_rows(&batch)?;
        for s in 0..2 {
            starts[s] += ids[s].len();
        }
        ids = [vec![5 + step], vec![77 + step]];
    }
    let errors = exec.with_device(|d| d.errors().clone())?;
    Ok(errors
        .into_iter()
        .map(|(kernel, error)| (kernel, error.launches, error.relative))
        .collect())
}

/// `graph`'s batched plan (steps of up to 64 rows over `cache`, sequences of up to 64
/// positions) for `target` with `weights`, taking `chosen` kernels, on the device `device`
/// makes for its kernels and on the emulator in lockstep.
fn compared_serving_executor<D: PlanDevice>(
    graph: ir::Graph,
    weights: &dyn quant::tensor::Tensors,
    (target, cache, chosen): (Target, gpu::BatchedCache, gpu::PlanKernels),
    device: &mut impl FnMut(&[Kernel]) -> Result<D>,
) -> Result<PlanExecutor<CompareDevice<D, EmulatorDevice>>> {
    let (plan, kernels) = gpu::build_program(&graph, target, 64, Some(cache), chosen)?;
    let compared = CompareDevice::new(device(&kernels)?, EmulatorDevice::new(kernels.clone()), &kernels);
    Ok(PlanExecutor::new(compared, plan, graph, weights, &[], 64)?)
}

/// The tiny Qwen3.5 with one multi-token prediction layer (random weights from its config):
/// its head's batched plans for `target` (the argmax beside its logits, and the 4-bit
/// shortlist) in lockstep on the device `device` makes for their kernels and on the emulator,
/// over two sequences' catch-up step and three one-row drafting steps, each row reading a
/// hidden state; prints each kernel's max relative error and returns the worst.
pub fn mtp_kernel_errors<D: PlanDevice>(
    target: Target,
    fixtures: &Path,
    mut device: impl FnMut(&[Kernel]) -> Result<D>,
) -> Result<f64> {
    let scratch = super::scratch_dir("bbc-gpu-check-mtp-")?;
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures.join("qwen3_5/config.json"))?)?;
    config["mtp_num_hidden_layers"] = 1.into();
    let path = scratch.path().join("config.json");
    std::fs::write(&path, config.to_string())?;
    let options = crate::model_ref::LoadOptions {
        fuse: false,
        quiet: true,
        ..crate::model_ref::LoadOptions::default()
    };
    let model = crate::model_ref::load(path.to_str().unwrap_or_default(), options)?.model;
    let lower = |logits| {
        let options = models::LowerOptions {
            logits,
            compute: model.spec.dtype,
            kv_cache: model.spec.kv_cache_dtype,
        };
        models::lower_mtp(&model.config, &model.weights, options)
    };
    let cost = crate::model_ref::cost_model(target);
    let argmax = models::with_greedy_token(&passes::optimized(&lower(LogitsFor::LastToken)?, cost)?)?;
    let shortlisted = passes::optimized(&passes::shortlisted_draft_head(&lower(LogitsFor::GreedyToken)?)?, cost)?;
    let mut worst = 0f64;
    for (name, graph) in [
        ("qwen3_5 MTP head", argmax),
        ("qwen3_5 MTP head, 4-bit shortlist", shortlisted),
    ] {
        let head = (name, graph, model.config.hidden);
        worst = worst.max(head_plan_errors(head, &model.weights, target, &mut device)?);
    }
    Ok(worst)
}

/// A draft head's batched plan `graph` (named `name`, reading states `hidden` wide) for
/// `target` over `weights`, in lockstep on the device `device` makes for its kernels and on the
/// emulator, over two sequences' catch-up step and three one-row drafting steps, each row
/// reading a hidden state; prints each kernel's max relative error and returns the worst.
fn head_plan_errors<D: PlanDevice>(
    (name, graph, hidden): (&str, ir::Graph, usize),
    weights: &dyn quant::tensor::Tensors,
    target: Target,
    device: &mut impl FnMut(&[Kernel]) -> Result<D>,
) -> Result<f64> {
    let cache = gpu::BatchedCache {
        blocks: 8,
        block_size: 8,
        sequences: 2,
    };
    let exec = compared_serving_executor(graph, weights, (target, cache, gpu::PlanKernels::default()), device)?;
    let tables = [[0, 1, 2].map(runtime::kv::BlockId), [3, 4, 5].map(runtime::kv::BlockId)];
    let mut seed = 11;
    let mut starts = [0usize, 0];
    for (step, lens) in [[11usize, 5], [1, 1], [1, 1], [1, 1]].into_iter().enumerate() {
        let ids: Vec<Vec<u32>> = (0..2)
            .map(|s| {
                (0..lens[s] as u32)
                    .map(|j| (7 + 13 * j + 31 * step as u32 + s as u32) % 300)
                    .collect()
            })
            .collect();
        let states: Vec<Vec<f32>> = (0..2)
            .map(|s| random_bf16_values(&mut seed, lens[s] * hidden, 2.0))
            .collect();
        let batch: Vec<runtime::kv::Segment> = (0..2)
            .map(|s| runtime::kv::Segment {
                table: &tables[s],
                start: starts[s],
                ids: &ids[s],
                state_slot: s,
                sampled_rows: 1,
                drafts: 0,
                snapshots: runtime::kv::StateSnapshots::NONE,
                hidden_states: &states[s],
            })
            .collect();
        exec.step_batch(&batch)?;
        for (start, len) in starts.iter_mut().zip(lens) {
            *start += len;
        }
    }
    worst_error(name, &exec)
}

/// The tiny Llama drafted for by the EAGLE-3 fixture head (`tests/fixtures/eagle/eagle3`,
/// beside `fixtures`): the target's serving plan, which also outputs the head's states (`fc`
/// over three layers' residual streams), over two prompts and three decode steps, and the
/// head's plans (the argmax beside its logits, and the 4-bit shortlist) as
/// [`head_plan_errors`] runs them, all in lockstep on the device `device` makes for their
/// kernels and on the emulator; prints each kernel's max relative error and returns the worst.
pub fn eagle_kernel_errors<D: PlanDevice>(
    target: Target,
    fixtures: &Path,
    mut device: impl FnMut(&[Kernel]) -> Result<D>,
) -> Result<f64> {
    use models::eagle::{EagleHead, EagleMethod};
    let model = Model::open(ModelSpec::for_weights(&fixtures.join("llama")))?;
    let dir = fixtures.parent().unwrap_or(fixtures).join("eagle/eagle3");
    let head = EagleHead::open(&dir, EagleMethod::Eagle3, &model.config)?;
    let weights = head.weights_beside(&model.weights);
    let serving = model.lower(LogitsFor::LastToken)?;
    let serving = head.target_graph(&serving, &model.weights, model.lower_options(LogitsFor::LastToken))?;
    let mut worst = 0f64;
    let chosen = (target, gpu::PlanKernels::default());
    for (kernel, launches, error) in batched_graph_errors(serving, &weights, chosen, &mut device)? {
        println!("| llama EAGLE-3 target | {kernel} | {launches} | {error:.2e} |");
        worst = worst.max(error);
    }
    let cost = crate::model_ref::cost_model(target);
    let lower = |logits| head.lower(&model.config, &model.weights, model.lower_options(logits));
    let argmax = models::with_greedy_token(&passes::optimized(&lower(LogitsFor::LastToken)?, cost)?)?;
    let shortlisted = passes::optimized(&passes::shortlisted_draft_head(&lower(LogitsFor::GreedyToken)?)?, cost)?;
    for (name, graph) in [
        ("llama EAGLE-3 head", argmax),
        ("llama EAGLE-3 head, 4-bit shortlist", shortlisted),
    ] {
        let plan = (name, graph, head.config.hidden);
        worst = worst.max(head_plan_errors(plan, &weights, target, &mut device)?);
    }
    Ok(worst)
}

/// `count` pseudo-random values uniform in ±`range`, each exactly a bf16 (the operands the
/// unplanned kernels' checks upload), from the generator state `seed`.
fn random_bf16_values(seed: &mut u32, count: usize, range: f32) -> Vec<f32> {
    random_values(Ty::Bf16, seed, count, range)
}

/// [`random_bf16_values`] exact in `ty`, bf16 or f16 (most halves are not bf16s).
fn random_values(ty: Ty, seed: &mut u32, count: usize, range: f32) -> Vec<f32> {
    (0..count)
        .map(|_| {
            *seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let unit = (*seed >> 8) as f32 / (1u32 << 24) as f32;
            let value = range * (2.0 * unit - 1.0);
            match ty {
                Ty::F16 => half::f16::from_f32(value).to_f32(),
                _ => half::bf16::from_f32(value).to_f32(),
            }
        })
        .collect()
}

/// The shape the TMA GEMMs are checked on: 130 tokens, 300 weight rows, K 264 with
/// activation rows 272 apart (partial tiles and a partial last K step, which TMA fills with
/// zeros).
const TMA_CHECK: (usize, usize, usize, usize) = (130, 300, 264, 272);

/// The kernels no plan launches yet, in lockstep with the emulator: the target's TMA GEMMs
/// ([`tma_gemm_kernels`]) on [`TMA_CHECK`]'s shape, in one piece and K split in three with the
/// reduction; on every target the tensor-core prefill attention ([`FLASH_CHECKS`]), on Hopper
/// also on `wgmma` (each schedule), on the B200 on `tcgen05`. Prints each kernel's max
/// relative error and returns the worst.
pub fn unplanned_kernel_errors(arch: &str) -> Result<f64> {
    let gemms = tma_gemm_kernels(arch);
    let flash = flash_attention_kernels(arch);
    let kernels = [gemms.clone(), flash.iter().map(|(kernel, _)| kernel.clone()).collect()].concat();
    let mut device = CompareDevice::new(
        super::compile_device(&kernels, arch)?,
        EmulatorDevice::new(kernels.clone()),
        &kernels,
    );
    if !gemms.is_empty() {
        run_tma_gemms(&mut device, &gemms)?;
    }
    run_flash_attention(&mut device, &flash)?;
    let mut worst = 0f64;
    println!("| kernel no plan launches yet | launches | max relative error |\n|---|---|---|");
    for (kernel, error) in device.errors() {
        println!("| {kernel} | {} | {:.2e} |", error.launches, error.relative);
        worst = worst.max(error.relative);
    }
    Ok(worst)
}

/// The shapes the prefill attention is checked on: ragged tiles, grouped heads, the split
/// head; over a bf16 cache, and over a half one (the tensor cores multiplying halves).
const FLASH_CHECKS: [FlashCheck; 3] = [
    FlashCheck::new((100, 30), (4, 2, 128), true, Ty::Bf16),
    FlashCheck::new((70, 0), (2, 1, 256), false, Ty::Bf16),
    FlashCheck::new((100, 30), (4, 2, 128), true, Ty::F16),
];

/// One prefill attention check (see [`FLASH_CHECKS`]).
#[derive(Debug, Clone, Copy)]
struct FlashCheck {
    /// Rows, and the positions cached before them.
    tokens: usize,
    first: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// A paged cache (blocks in reverse order), or a contiguous one.
    paged: bool,
    /// The cache's elements: bf16 or f16.
    cache: Ty,
}

impl FlashCheck {
    const fn new(
        (tokens, first): (usize, usize),
        (heads, kv_heads, head_dim): (usize, usize, usize),
        paged: bool,
        cache: Ty,
    ) -> Self {
        Self {
            tokens,
            first,
            heads,
            kv_heads,
            head_dim,
            paged,
            cache,
        }
    }

    /// Its kernels' name for `family`: the family, the head, and a half cache's `_f16`.
    fn name(&self, family: &str) -> String {
        let cache = if self.cache == Ty::F16 { "_f16" } else { "" };
        format!("{family}_{}{cache}", self.head_dim)
    }
}
/// Positions a block of the paged check's cache holds.
const FLASH_BLOCK: usize = 16;

/// The prefill attention kernels checked on `arch`, each with its check: every
/// [`FLASH_CHECKS`] shape on `mma.sync`, and on Hopper those `wgmma` takes on it too, in each
/// schedule (loading by TMA where the head is whole boxes); on the B200 those `tcgen05` takes.
fn flash_attention_kernels(arch: &str) -> Vec<(Kernel, FlashCheck)> {
    use kernels_gen::templates::cache_layout::CacheLayout;
    use kernels_gen::templates::flash_attention::{flash_attention_over, Masking};
    use kernels_gen::templates::flash_attention_tcgen05;
    use kernels_gen::templates::flash_attention_wgmma::{
        flash_attention_wgmma_over, supports as wgmma_supports, Schedule,
    };
    use kernels_gen::templates::flash_tma::supports as supports_tma;
    let layout = |paged: bool| match paged {
        true => CacheLayout::Paged,
        false => CacheLayout::Contiguous,
    };
    let mma = FLASH_CHECKS.iter().map(|&check| {
        let head = (check.head_dim, check.cache);
        (
            flash_attention_over(
                &check.name("flash_attention"),
                "gpu-check",
                layout(check.paged),
                head,
                Masking::CutTiles,
            ),
            check,
        )
    });
    let wgmma = FLASH_CHECKS
        .iter()
        .filter(|check| arch == "sm_90a" && wgmma_supports(check.head_dim))
        .flat_map(|&check| {
            let (head_dim, paged) = (check.head_dim, check.paged);
            [
                ("", Schedule::Lockstep),
                ("_specialised", Schedule::Specialised),
                ("_tma", Schedule::Tma),
            ]
            .into_iter()
            .filter(move |&(_, schedule)| schedule != Schedule::Tma || supports_tma(head_dim))
            .map(move |(form, schedule)| {
                let name = check.name(&format!("flash_attention_wgmma{form}"));
                let head = (head_dim, check.cache);
                (
                    flash_attention_wgmma_over(&name, "gpu-check", layout(paged), head, schedule),
                    check,
                )
            })
        });
    let tcgen05 = FLASH_CHECKS
        .iter()
        .filter(|check| arch == "sm_100a" && flash_attention_tcgen05::supports(check.head_dim))
        .flat_map(|&check| {
            use flash_attention_tcgen05::Loads;
            let (head_dim, paged) = (check.head_dim, check.paged);
            [("", Loads::Copies), ("_tma", Loads::Tma)]
                .into_iter()
                .filter(move |&(_, loads)| loads == Loads::Copies || supports_tma(head_dim))
                .map(move |(form, loads)| {
                    let name = check.name(&format!("flash_attention_tcgen05{form}"));
                    (
                        flash_attention_tcgen05::flash_attention_tcgen05_over(
                            &name,
                            "gpu-check",
                            layout(paged),
                            (head_dim, check.cache),
                            loads,
                        ),
                        check,
                    )
                })
        });
    mma.chain(wgmma).chain(tcgen05).collect()
}

/// The `checks`' attentions on `device` over random queries, keys and values exact in the
/// cache's type (bf16, or halves bf16 would round), the same for each kernel of a check (the
/// paged cache's blocks in reverse order): for each, the queries, keys, values (as f32, keys
/// and values by position) and the output read back.
fn run_flash_attention<D: PlanDevice>(device: &mut D, checks: &[(Kernel, FlashCheck)]) -> Result<Vec<[Vec<f32>; 4]>> {
    let mut results = Vec::new();
    let f32_bytes = |v: &[f32]| v.iter().flat_map(|e| e.to_le_bytes()).collect::<Vec<u8>>();
    for (kernel, check) in checks {
        let FlashCheck {
            tokens,
            first,
            heads,
            kv_heads,
            head_dim,
            paged,
            cache,
        } = *check;
        let cache_bytes = |v: &[f32]| -> Vec<u8> {
            match cache {
                Ty::F16 => v.iter().flat_map(|&e| half::f16::from_f32(e).to_le_bytes()).collect(),
                _ => v.iter().flat_map(|&e| half::bf16::from_f32(e).to_le_bytes()).collect(),
            }
        };
        // The same inputs for each kernel checked on a shape.
        let mut seed = 0x2545_f491_u32 ^ (tokens * 1000 + head_dim) as u32;
        let mut random = |count: usize| random_values(cache, &mut seed, count, 1.0);
        let (len, row) = (first + tokens, kv_heads * head_dim);
        let (q, k, v) = (random(tokens * heads * head_dim), random(len * row), random(len * row));
        let blocks = len.div_ceil(FLASH_BLOCK);
        // Position p's cache row: in block `blocks - p / 16` (block 0 spare) when paged.
        let cache_row = |p: usize| match paged {
            true => (blocks - p / FLASH_BLOCK) * FLASH_BLOCK + p % FLASH_BLOCK,
            false => p,
        };
        let rows = if paged { (blocks + 1) * FLASH_BLOCK } else { len };
        let (mut cache_k, mut cache_v) = (vec![0f32; rows * row], vec![0f32; rows * row]);
        for p in 0..len {
            let at = cache_row(p) * row;
            cache_k[at..at + row].copy_from_slice(&k[p * row..(p + 1) * row]);
            cache_v[at..at + row].copy_from_slice(&v[p * row..(p + 1) * row]);
        }
        let table: Vec<u8> = (0..blocks).flat_map(|b| ((blocks - b) as i32).to_le_bytes()).collect();
        let q_buffer = device.upload(&f32_bytes(&q))?;
        let k_buffer = device.upload(&cache_bytes(&cache_k))?;
        let v_buffer = device.upload(&cache_bytes(&cache_v))?;
        let table_buffer = device.upload(&table)?;
        let out = device.alloc(q.len() * 4)?;
        let value = |name: &str| -> Option<DeviceArg<'_, D::Buffer>> {
            let int = |v: usize| DeviceArg::I32(v as i32);
            Some(match name {
                "q" => DeviceArg::Buffer(&q_buffer, 0..q.len() * 4),
                "k" => DeviceArg::Buffer(&k_buffer, 0..cache_k.len() * 2),
                "v" => DeviceArg::Buffer(&v_buffer, 0..cache_v.len() * 2),
                "out" => DeviceArg::Buffer(&out, 0..q.len() * 4),
                "block_table" => DeviceArg::Buffer(&table_buffer, 0..table.len()),
                "block_size" => int(FLASH_BLOCK),
                "cache_rows" => int(rows),
                "cache_width" => int(row),
                "tokens" => int(tokens),
                "q_stride" => int(heads * head_dim),
                "first" => int(first),
                "heads" => int(heads),
                "kv_heads" => int(kv_heads),
                "window" => int(0),
                "scale" => DeviceArg::F32(1.0 / (head_dim as f32).sqrt()),
                _ => return None,
            })
        };
        let scalar = |name: &str| match value(name) {
            Some(DeviceArg::I32(v)) => Some(v as i64),
            _ => None,
        };
        let args = super::llama_8b::bind(kernel, value)?;
        let grid = kernel
            .grid
            .eval_int(&scalar)
            .map_err(|e| anyhow::anyhow!("{}: {e}", kernel.name))?;
        device.launch(&kernel.name, grid as u32, kernel.block_dim, &args)?;
        let result = device.read(&out, 0..q.len() * 4)?;
        let result = result
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        results.push([q, k, v, result]);
    }
    Ok(results)
}

/// The TMA GEMMs [`unplanned_kernel_errors`] checks on `arch` (Hopper's two tiles, each also
/// warp-specialised, and the persistent schedule; B200's tcgen05 one, also warp-specialised
/// and persistent; the RTX PRO 6000's `mma.sync` one), then the split-K reduction.
fn tma_gemm_kernels(arch: &str) -> Vec<Kernel> {
    use kernels_gen::templates::gemm_tma_tcgen05::{gemm_tma_tcgen05_bf16, TcgenTile};
    use kernels_gen::templates::gemm_tma_wgmma::{gemm_tma_wgmma_bf16, TmaTile};
    let gemms = match arch {
        "sm_90a" => vec![
            gemm_tma_wgmma_bf16("gemm_tma", "gpu-check", TmaTile::WIDE),
            gemm_tma_wgmma_bf16("gemm_tma_n256", "gpu-check", TmaTile::WIDEST),
            gemm_tma_wgmma_bf16("gemm_tma_specialised", "gpu-check", TmaTile::SPECIALISED),
            gemm_tma_wgmma_bf16("gemm_tma_specialised_n256", "gpu-check", TmaTile::SPECIALISED_WIDEST),
            // Two blocks: each takes three of the check's six tiles through its ring.
            gemm_tma_wgmma_bf16("gemm_tma_persistent", "gpu-check", TmaTile::SPECIALISED.persistent(2)),
        ],
        "sm_100a" => vec![
            gemm_tma_tcgen05_bf16("gemm_tma", "gpu-check", TcgenTile::WIDE),
            gemm_tma_tcgen05_bf16("gemm_tma_specialised", "gpu-check", TcgenTile::SPECIALISED),
            // Two blocks: each takes three of the check's six tiles, two accumulators in turn.
            gemm_tma_tcgen05_bf16("gemm_tma_persistent", "gpu-check", TcgenTile::WIDE.persistent(2)),
        ],
        "sm_120a" => vec![kernels_gen::templates::gemm_tma_mma::gemm_tma_mma_bf16(
            "gemm_tma",
            "gpu-check",
        )],
        _ => return vec![],
    };
    [
        gemms,
        vec![kernels_gen::templates::split_k::reduce(
            "split_k_reduce",
            "gpu-check",
            16,
            None,
            None,
        )],
    ]
    .concat()
}

/// Each GEMM of `kernels` (the last is the reduction) on random bf16 operands of
/// [`TMA_CHECK`]'s shape, in one piece and in three K splits: the operands and the last
/// result read back (x, w as f32; out).
fn run_tma_gemms<D: PlanDevice>(device: &mut D, kernels: &[Kernel]) -> Result<[Vec<f32>; 3]> {
    let (tokens, n, k, x_stride) = TMA_CHECK;
    let mut seed = 0x9e37_79b9_u32;
    let mut random = |count: usize| random_bf16_values(&mut seed, count, 0.5);
    let bytes = |v: &[f32]| {
        v.iter()
            .flat_map(|&e| half::bf16::from_f32(e).to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let (x_values, w_values) = (random(tokens * x_stride), random(n * k));
    let x = device.upload(&bytes(&x_values))?;
    let w = device.upload(&bytes(&w_values))?;
    let out = device.alloc(tokens * n * 4)?;
    let partial = device.alloc(3 * tokens * n * 4)?;
    let (gemms, reduce) = kernels.split_at(kernels.len() - 1);
    for gemm in gemms {
        for splits in [1usize, 3] {
            let value = |name: &str| -> Option<DeviceArg<'_, D::Buffer>> {
                let int = |v: usize| DeviceArg::I32(v as i32);
                Some(match name {
                    "x" => DeviceArg::Buffer(&x, 0..tokens * x_stride * 2),
                    "w" => DeviceArg::Buffer(&w, 0..n * k * 2),
                    "out" => DeviceArg::Buffer(&out, 0..tokens * n * 4),
                    "partial" => DeviceArg::Buffer(&partial, 0..3 * tokens * n * 4),
                    "tokens" => int(tokens),
                    "n" | "out_stride" => int(n),
                    "k" => int(k),
                    "x_stride" => int(x_stride),
                    "splits" => int(splits),
                    "out_col" => int(0),
                    _ => return None,
                })
            };
            let scalar = |name: &str| match value(name) {
                Some(DeviceArg::I32(v)) => Some(v as i64),
                _ => None,
            };
            for kernel in std::iter::once(gemm).chain(reduce.iter().filter(|_| splits > 1)) {
                let args = super::llama_8b::bind(kernel, value)?;
                let grid = kernel
                    .grid
                    .eval_int(&scalar)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", kernel.name))?;
                device.launch(&kernel.name, grid as u32, kernel.block_dim, &args)?;
            }
        }
    }
    let result = device.read(&out, 0..tokens * n * 4)?;
    Ok([
        x_values,
        w_values,
        result
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    ])
}

/// Eight sequences of the tiny Llama (bf16) decoding together on the serving plan (the rows
/// sampled from gathered before the head), every other step verifying two drafted tokens (3
/// rows a sequence, all sampled), with every kernel launched by itself and replayed from CUDA
/// graphs, each with kernels launched the ordinary way and programmatically (before the kernel
/// they wait for has finished): the logits must agree bit for bit; prints the wall time per
/// step of each (logits read back included).
pub fn graph_check(target: Target, arch: &str, fixtures: &Path) -> Result<()> {
    use runtime::kv::{BlockId, Segment};
    let mut spec = ModelSpec::for_weights(&fixtures.join("llama"));
    spec.dtype = ComputeDtype::Bf16;
    let model = Model::open(spec)?;
    let graph = passes::optimized(
        &model.lower(LogitsFor::LastToken)?,
        crate::model_ref::cost_model(target),
    )?;
    let (sequences, steps) = (8usize, 32usize);
    // Rows a sequence feeds at `step`: one, or a token and two drafted after it.
    let rows_at = |step: usize| if step.is_multiple_of(2) { 1 } else { 3 };
    let positions: usize = (0..steps).map(rows_at).sum();
    let cache = gpu::BatchedCache {
        blocks: sequences * (positions + 4).div_ceil(4),
        block_size: 4,
        sequences,
    };
    let (plan, kernels) = gpu::build_batched(&graph, target, 64, cache)?;
    let executor = |graph_rows: usize, programmatic: bool| -> Result<PlanExecutor<CudaDevice>> {
        let mut device = super::compile_device(&kernels, arch)?;
        device.set_programmatic_launch(programmatic);
        if device.programmatic_launch() != programmatic {
            println!("(this GPU or driver refused programmatic launches: those rows launch the ordinary way)");
        }
        let exec = PlanExecutor::new(device, plan.clone(), graph.clone(), &model.weights, &[], 256)?;
        Ok(exec.capture_graphs_up_to(graph_rows))
    };
    let per_sequence = cache.blocks / sequences;
    let tables: Vec<Vec<BlockId>> = (0..sequences)
        .map(|s| (0..per_sequence).map(|b| BlockId((b * sequences + s) as u32)).collect())
        .collect();
    let runs = [
        ("kernel by kernel", 0, false),
        ("kernel by kernel, programmatic", 0, true),
        ("CUDA graph", 3 * sequences, false),
        ("CUDA graph, programmatic", 3 * sequences, true),
    ];
    let mut results = Vec::new();
    for (_, graph_rows, programmatic) in runs {
        let exec = executor(graph_rows, programmatic)?;
        let mut logits = Vec::new();
        let started = std::time::Instant::now();
        let mut start = 0;
        for step in 0..steps {
            let rows = rows_at(step);
            let ids: Vec<Vec<u32>> = (0..sequences)
                .map(|s| (0..rows).map(|r| ((7 * s + 13 * step + r) % 300) as u32).collect())
                .collect();
            let batch: Vec<Segment> = (0..sequences)
                .map(|s| Segment {
                    hidden_states: &[],
                    table: &tables[s],
                    start,
                    ids: &ids[s],
                    state_slot: s,
                    sampled_rows: rows,
                    drafts: rows - 1,
                    snapshots: runtime::kv::StateSnapshots::NONE,
                })
                .collect();
            start += rows;
            for out in exec.step_batch(&batch)? {
                logits.extend_from_slice(&out["logits"].data);
            }
        }
        results.push((started.elapsed().as_secs_f64() / steps as f64, logits));
    }
    println!("\n| {sequences}-sequence step, decoding or verifying 2 drafts (tiny Llama, bf16) | wall ms per step |\n|---|---|");
    for ((how, ..), (seconds, _)) in runs.iter().zip(&results) {
        println!("| {how} | {:.3} |", seconds * 1e3);
    }
    for ((how, ..), (_, logits)) in runs.iter().zip(&results).skip(1) {
        if *logits != results[0].1 {
            bail!("decode steps ({how}) differ from the same steps launched kernel by kernel, the ordinary way");
        }
    }
    Ok(())
}

/// The tiny Qwen3.5 (f32) served on its batched plan with snapshots of recurrent states kept
/// in device memory (`keep_state_snapshots`): requests sharing a prompt prefix start from a
/// snapshot (device copies into their state slots before a step, out of them after one) and
/// must generate the CPU backend's greedy tokens; prints both engines' prefix-cache hits.
pub fn snapshot_check(target: Target, arch: &str, fixtures: &Path) -> Result<()> {
    use runtime::serving::{NgramConfig, ServingEngine, StateCacheConfig};
    let config = SchedulerConfig {
        state_cache: StateCacheConfig::every(8, 6),
        ..hybrid_serving(NgramConfig::OFF)
    };
    let (gpu, cpu) = hybrid_backends(target, arch, fixtures, &config)?;
    let gpu = gpu.keep_state_snapshots(6)?;
    let prompts = prompts_sharing_a_prefix(21, 4);
    let (want, cpu_hits) = serve_first_then_rest(&mut ServingEngine::new(cpu, config), &prompts)?;
    let (got, gpu_hits) = serve_first_then_rest(&mut ServingEngine::new(gpu, config), &prompts)?;
    println!("\n| tiny Qwen3.5, 4 requests sharing 21 tokens | positions restored from snapshots |\n|---|---|");
    println!("| CPU backend | {cpu_hits} |\n| GPU plan | {gpu_hits} |");
    if got != want {
        bail!("requests started from state snapshots on the GPU generate {got:?}, the CPU backend {want:?}");
    }
    if gpu_hits == 0 {
        bail!("no request started from a state snapshot on the GPU");
    }
    Ok(())
}

/// The tiny Qwen3.5 (f32) served on its batched plan with speculative decoding (prompt lookup,
/// up to 3 drafts): the DeltaNet kernels keep each sequence's states after its sampled rows
/// but the last, and refused drafts are rewound by copying one back (`verify_drafts_up_to`).
/// Must generate the CPU backend's greedy tokens without speculation; prints the drafts.
pub fn draft_rewind_check(target: Target, arch: &str, fixtures: &Path) -> Result<()> {
    use runtime::serving::{NgramConfig, ServingEngine};
    let config = hybrid_serving(DRAFTING);
    let (gpu, cpu) = hybrid_backends(target, arch, fixtures, &config)?;
    let gpu = gpu.verify_drafts_up_to(DRAFTING.tokens)?;
    let prompts = periodic_prompts(&QWEN3_5_DRAFTED);
    let plain = SchedulerConfig {
        speculation: NgramConfig::OFF,
        ..config
    };
    let greedy = runtime::SamplingParams::default();
    let want = serve_all_counting(&mut ServingEngine::new(cpu, plain), &prompts, greedy, DRAFTED_TOKENS)?.tokens;
    let mut on_gpu = ServingEngine::new(gpu, config);
    let Served {
        tokens: got,
        drafted,
        accepted,
    } = serve_all_counting(&mut on_gpu, &prompts, greedy, DRAFTED_TOKENS)?;
    println!("\n| tiny Qwen3.5 speculating on the GPU | drafted | accepted |\n|---|---|---|");
    println!(
        "| {} requests of {DRAFTED_TOKENS} tokens | {drafted} | {accepted} |",
        prompts.len()
    );
    if got != want {
        bail!("speculating on the GPU generates {got:?}, the CPU backend without speculation {want:?}");
    }
    if accepted == drafted {
        bail!("no draft was refused on the GPU: rewinding went unchecked");
    }
    Ok(())
}

/// Serving limits for the tiny Qwen3.5's checks: 3 running sequences of up to 64 positions.
pub fn hybrid_serving(speculation: runtime::serving::NgramConfig) -> SchedulerConfig {
    SchedulerConfig {
        max_waiting: 16,
        max_running: 3,
        token_budget: 24,
        kv_blocks: 48,
        block_size: 4,
        context_length: 64,
        prefix_caching: true,
        speculation,
        recurrent_state: false,
        state_cache: runtime::serving::StateCacheConfig::OFF,
    }
}

/// The tiny Qwen3.5 (f32) as `config` serves it: its greedy serving plan on the GPU (decode
/// steps as graphs) and the CPU backend.
fn hybrid_backends(
    target: Target,
    arch: &str,
    fixtures: &Path,
    config: &SchedulerConfig,
) -> Result<(PlanExecutor<CudaDevice>, runtime::CpuBackend)> {
    let model = Model::open(ModelSpec::for_weights(&fixtures.join("qwen3_5")))?;
    let lowered = model.lower(LogitsFor::LastToken)?;
    let graph = models::with_greedy_token(&passes::optimized(&lowered, crate::model_ref::cost_model(target))?)?;
    let cache = gpu::BatchedCache {
        blocks: config.kv_blocks,
        block_size: config.block_size,
        sequences: config.max_running,
    };
    let (plan, kernels) = gpu::build_batched(&graph, target, 32, cache)?;
    let device = super::compile_device(&kernels, arch)?;
    let gpu = PlanExecutor::new(device, plan, graph, &model.weights, &[], config.context_length)?
        .capture_graphs_up_to(config.max_running * (1 + config.speculation.tokens));
    let cpu_graph = passes::optimized(&lowered, passes::CostModel::CPU)?;
    let cpu = runtime::CpuBackend::new(cpu_graph, &model.weights, config.context_length)?;
    Ok((gpu, cpu))
}

/// How the drafting checks draft: prompt lookup, up to 3 tokens, from matches of 1 to 3.
pub const DRAFTING: runtime::serving::NgramConfig = runtime::serving::NgramConfig {
    tokens: 3,
    min: 1,
    max: 3,
};

/// Greedy tokens each of the drafting checks' requests generates.
pub const DRAFTED_TOKENS: usize = 28;

/// Patterns (`base`, `period`) of [`periodic_prompts`] after which the tiny random Qwen3.5's
/// greedy tokens sometimes follow what prompt lookup drafts (found by a search on the CPU
/// backend: within [`DRAFTED_TOKENS`] tokens, drafts both accepted and refused).
pub const QWEN3_5_DRAFTED: [(u32, u32); 2] = [(92, 8), (64, 2)];

/// As [`QWEN3_5_DRAFTED`], for the tiny Qwen3-Next.
pub const QWEN3_NEXT_DRAFTED: [(u32, u32); 2] = [(8, 3), (141, 1)];

/// A prompt of 36 tokens per pattern (`base`, `period`): `period` ids from `base`, 17 apart,
/// over and over, which prompt lookup drafts from.
pub fn periodic_prompts(patterns: &[(u32, u32)]) -> Vec<Vec<u32>> {
    patterns
        .iter()
        .map(|&(base, period)| (0..36u32).map(|j| base + 17 * (j % period)).collect())
        .collect()
}

/// What [`serve_all_counting`] served.
pub struct Served {
    /// Each prompt's tokens, in order.
    pub tokens: Vec<Vec<u32>>,
    pub drafted: usize,
    pub accepted: usize,
}

/// Every prompt added (`max_tokens` tokens each, sampled by `params`) and stepped until all
/// are done: each one's tokens, and the tokens drafted and accepted on the way.
pub fn serve_all_counting<B: runtime::serving::PagedBackend>(
    engine: &mut runtime::serving::ServingEngine<B>,
    prompts: &[Vec<u32>],
    params: runtime::SamplingParams,
    max_tokens: usize,
) -> Result<Served> {
    let ids: Vec<_> = prompts
        .iter()
        .map(|p| engine.add(p.clone(), max_tokens, vec![], params))
        .collect::<std::result::Result<_, _>>()?;
    let (mut done, mut drafted, mut accepted) = (std::collections::HashMap::new(), 0, 0);
    while !engine.scheduler().is_idle() {
        let out = engine.step()?;
        drafted += out.drafted;
        accepted += out.accepted;
        done.extend(out.finished.into_iter().map(|f| (f.seq, f.generated)));
    }
    let tokens = ids.iter().map(|id| done.remove(id).unwrap_or_default()).collect();
    Ok(Served {
        tokens,
        drafted,
        accepted,
    })
}

/// `count` prompts of the tiny models' vocabulary (ids under 300) that share their first
/// `shared` tokens, then differ (the i-th has 2 + i tokens of its own).
pub fn prompts_sharing_a_prefix(shared: usize, count: u32) -> Vec<Vec<u32>> {
    let prefix: Vec<u32> = (0..shared as u32).map(|j| (31 + 7 * j) % 300).collect();
    (0..count)
        .map(|i| {
            prefix
                .iter()
                .copied()
                .chain((0..2 + i).map(|j| 250 + 5 * i + j))
                .collect()
        })
        .collect()
}

/// The first prompt served alone (filling the cache), then the rest together, 6 greedy tokens
/// each: their tokens, and the positions the prefix cache spared so far.
pub fn serve_first_then_rest<B: runtime::serving::PagedBackend>(
    engine: &mut runtime::serving::ServingEngine<B>,
    prompts: &[Vec<u32>],
) -> Result<(Vec<Vec<u32>>, u64)> {
    let greedy = runtime::SamplingParams::default();
    let (first, rest) = prompts.split_at(prompts.len().min(1));
    let mut tokens = serve_all_counting(engine, first, greedy, 6)?.tokens;
    tokens.extend(serve_all_counting(engine, rest, greedy, 6)?.tokens);
    Ok((tokens, engine.scheduler().prefix_cache_stats().hit))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the prefill attention check launches on Hopper (`mma.sync` and `wgmma` in each
    /// schedule) and on the B200 (`mma.sync` and `tcgen05`) binds and runs on the emulator,
    /// over bf16 and half caches, and gives the reference's attention (to bf16's precision:
    /// probabilities meet values in bf16, or half), the `wgmma` forms the same as each other
    /// on the same inputs (the same 128-key tiles; `mma.sync` takes 64, rescaling the softmax
    /// at other keys), and so the `tcgen05` ones.
    #[test]
    fn the_flash_attention_check_runs_its_launches() {
        // The checks `wgmma` and `tcgen05` take: heads of 128 dims, over each cache.
        let wide = FLASH_CHECKS.iter().filter(|c| c.head_dim == 128).count();
        let hopper = flash_attention_kernels("sm_90a");
        assert_eq!(hopper.len(), FLASH_CHECKS.len() + 3 * wide);
        let blackwell = flash_attention_kernels("sm_100a");
        assert_eq!(blackwell.len(), FLASH_CHECKS.len() + 2 * wide);
        for (kernels, forms) in [(hopper, 3), (blackwell, 2)] {
            let mut device = EmulatorDevice::new(kernels.iter().map(|(kernel, _)| kernel.clone()).collect());
            let results = run_flash_attention(&mut device, &kernels).unwrap();
            // On the same inputs each check's `wgmma` forms compute the same, and its
            // `tcgen05` ones (by TMA the same products in the same order as copied).
            for group in results[FLASH_CHECKS.len()..].chunks(forms) {
                assert!(group.iter().all(|r| *r == group[0]));
            }
            check_flash_results(&results, &kernels);
        }
    }

    /// Each of `results` (of `checks`) within bf16's precision of the reference's attention
    /// (over the cache's values as stored).
    fn check_flash_results(results: &[[Vec<f32>; 4]], checks: &[(Kernel, FlashCheck)]) {
        for ([q, k, v, out], (_, check)) in results.iter().zip(checks) {
            let FlashCheck {
                tokens,
                first,
                heads,
                kv_heads,
                head_dim,
                ..
            } = *check;
            let spec = ir::AttentionSpec {
                heads,
                kv_heads,
                head_dim,
                scale: 1.0 / (head_dim as f64).sqrt(),
                window: None,
                cache_slot: 0,
                cache_dtype: ir::DType::BF16,
            };
            let len = first + tokens;
            let slot = ir::reference::KvSlot {
                positions: (0..len).collect(),
                k: k.clone(),
                v: v.clone(),
            };
            let positions: Vec<usize> = (first..len).collect();
            let q = ir::Tensor::new(vec![tokens, heads * head_dim], q.clone());
            let want = ir::reference::attention_over_slot(&spec, &q, &slot, &positions);
            let top = want.data.iter().fold(0f32, |m, w| m.max(w.abs()));
            for (i, (got, want)) in out.iter().zip(&want.data).enumerate() {
                assert!(
                    (got - want).abs() <= 2e-3 * top,
                    "head_dim {head_dim} [{i}]: {got} vs {want}"
                );
            }
        }
    }

    /// What the TMA GEMM check launches on every GPU target binds and runs on the
    /// emulator, and the last result (the last GEMM, three K splits and the reduction) is the
    /// product.
    #[test]
    fn the_tma_gemm_check_runs_its_launches() {
        for arch in ["sm_90a", "sm_100a", "sm_120a"] {
            let kernels = tma_gemm_kernels(arch);
            let mut device = EmulatorDevice::new(kernels.clone());
            let [x, w, out] = run_tma_gemms(&mut device, &kernels).unwrap();
            check_product(&x, &w, &out);
        }
    }

    /// `out` is the product of the TMA check's `x` and `w`, where sampled.
    fn check_product(x: &[f32], w: &[f32], out: &[f32]) {
        let (tokens, n, k, x_stride) = TMA_CHECK;
        for t in [0, 77, tokens - 1] {
            for r in [0, 150, n - 1] {
                let want: f32 = (0..k).map(|i| x[t * x_stride + i] * w[r * k + i]).sum();
                let got = out[t * n + r];
                assert!(
                    (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "{t}, {r}: {got} vs {want}"
                );
            }
        }
    }
}
