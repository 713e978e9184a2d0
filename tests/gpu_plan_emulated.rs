//! The GPU plan, run without a GPU: the tiny random models of every family (and tiny models
//! with GGUF-block weights) compiled for each GPU target, their plans executed by the same
//! executor the CUDA backend uses, on the kernels-gen emulator. In f32, the batched plans give
//! HF transformers' logits at every prompt row and cached step of each family's reference. In
//! f32 and bf16 they agree with the CPU backend step by step: a prefill long enough for the
//! prefill kernels (the tensor-core GEMM for bf16 weights), one short enough for the decode
//! kernels, then decode steps over the KV cache. Every buffer offset, view, scalar and launch
//! of the plan is exercised; each kernel may touch only the bytes its arguments give it. The
//! greedy graph's plan (the INT8-bound LM head with its compile-time INT8 rows) picks exactly
//! the argmax of the CPU backend's full-precision logits.

use bbc::gpu_check::kernels::serve_first_then_rest;
use bbc::gpu_check::tiny_gguf;
use codegen::gpu::{self, BATCH_ROWS, PREFILL_TOKENS};
use codegen::Target;
use common::fixture;
use common::hf_reference::Reference;
use models::{ComputeDtype, LogitsFor, Model, ModelSpec};
use runtime::compare::CompareDevice;
use runtime::emulator_device::{EmulatorBackend, EmulatorDevice};
use runtime::plan_exec::{DeviceArg, PlanDevice, PlanExecutor};
use runtime::serving::SchedulerConfig;
use runtime::CpuBackend;

mod common;

fn open(family: &str, dtype: ComputeDtype) -> Model {
    open_at(&fixture(&format!("hf-tiny/{family}")), dtype)
}

/// The model at `weights` (a GGUF file or an HF directory), computed in `dtype`.
fn open_at(weights: &std::path::Path, dtype: ComputeDtype) -> Model {
    let mut spec = ModelSpec::for_weights(weights);
    spec.dtype = dtype;
    Model::open(spec).unwrap()
}

/// `model`'s logits graph, fused for the CPU, on the CPU backend with `context` positions: the
/// reference the plans are checked against.
fn cpu_backend(model: &Model, context: usize) -> CpuBackend {
    let graph = passes::optimized(&model.lower(LogitsFor::LastToken).unwrap(), passes::CostModel::CPU).unwrap();
    CpuBackend::new(graph, &model.weights, context).unwrap()
}

/// `graph` through the pass pipeline for `target`.
fn fused_for(graph: &ir::Graph, target: Target) -> ir::Graph {
    passes::optimized(graph, bbc::model_ref::cost_model(target)).unwrap()
}

/// Max |got − want| over max |want|; infinite where a value is not finite (`f32::max` would
/// pass a NaN by).
fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    if !got.iter().chain(want).all(|v| v.is_finite()) {
        return f32::INFINITY;
    }
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    got.iter().zip(want).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max) / scale
}

/// `family`'s plans in f32 and bf16 on every GPU target (see [`check`]).
fn check_everywhere(family: &str) {
    for dtype in [ComputeDtype::F32, ComputeDtype::Bf16] {
        for target in [Target::H200, Target::B200, Target::RtxPro6000] {
            check(family, dtype, target);
        }
    }
}

fn check(family: &str, dtype: ComputeDtype, target: Target) {
    let model = open(family, dtype);
    // The tensor-core GEMM rounds activations to bf16; every other kernel computes in f32.
    // Behind a router (Qwen3-Next's four experts, two a token) that rounding can change which
    // expert a prompt token takes where two score alike, and the prompt's last row then
    // differs by more (6.6e-2 on H200); a prompt short enough for the GEMV still agrees to 1e-4.
    let prefill_tolerance: f32 = match dtype {
        ComputeDtype::Bf16 if family == "qwen3_next" => 1e-1,
        ComputeDtype::Bf16 => 2e-2,
        _ => 1e-4,
    };
    check_against(family, &model, &model, target, prefill_tolerance);
}

/// `model`'s plan for `target` on the emulator against the CPU backend running `reference`
/// (the same model, or its weights dequantized), step by step; logits within
/// `prefill_tolerance` after a prefill through the tensor-core GEMM, within 1e-4 otherwise.
fn check_against(family: &str, model: &Model, reference: &Model, target: Target, prefill_tolerance: f32) {
    check_within(family, model, reference, target, prefill_tolerance, 1e-4);
}

/// [`check_against`], steps after short prompts within `step_tolerance`.
fn check_within(
    family: &str,
    model: &Model,
    reference: &Model,
    target: Target,
    prefill_tolerance: f32,
    step_tolerance: f32,
) {
    let dtype = model.spec.dtype;
    let graph = model.lower(LogitsFor::LastToken).unwrap();
    let context = model.config.context_length.min(256);
    let gpu_graph = fused_for(&graph, target);
    let (plan, kernels) = gpu::build_with_kernels(&gpu_graph, target, 64).unwrap();
    // Weights quantized as they load stay blocks under a 16-bit dtype: their steps of up to 64
    // rows take `mma.sync` tiles, so the count below is of float models.
    let blocks = gpu_graph
        .nodes()
        .iter()
        .any(|n| matches!(n.op, ir::Op::Weight { .. }) && n.dtype.is_quantized());
    if matches!(dtype, ComputeDtype::Bf16 | ComputeDtype::F16) && !blocks {
        // bf16 and half prefill run the target's own TMA-fed tensor-core GEMM: wgmma on Hopper and
        // tcgen05 on B200 (each only there; plain, with the norm prologue, with the residual
        // add before the norm, and that with the gated MLP's GLU after; each also in tiles of
        // 64 tokens for steps of up to 64 rows), mma.sync on the RTX PRO 6000.
        // Qwen3-Next's MLPs are MoE layers (no GLU epilogue GEMM); no Gemma 4 layer adds the
        // residual before a norm without a GLU after it (no plain residual-prologue GEMM).
        let special: Vec<_> = kernels.iter().filter_map(kernels_gen::cuda::required_arch).collect();
        let variants = match family {
            "qwen3_next" | "gemma4" | "gemma4_kv_shared" | "gemma4_moe" => 3,
            _ => 4,
        };
        // MoE layers prefill their bf16 or half experts on `wgmma` and `tcgen05` too (gate/up,
        // down).
        let moe = 2 * usize::from(gpu_graph.nodes().iter().any(|n| matches!(n.op, ir::Op::Moe(_))));
        let expected = match target {
            Target::H200 => vec!["sm_90a"; 2 * variants + moe],
            Target::B200 => vec!["sm_100a"; 2 * variants + moe],
            _ => vec![],
        };
        assert_eq!(special, expected, "{family} on {}", target.name());
        // A half model's multiply its halves as stored, a bf16 model's none.
        for k in kernels.iter().filter(|k| kernels_gen::cuda::required_arch(k).is_some()) {
            let over_halves = k.name.contains("_f16");
            assert_eq!(
                over_halves,
                dtype == ComputeDtype::F16,
                "{family} on {}: {}",
                target.name(),
                k.name
            );
        }
    }
    let gpu = EmulatorBackend::emulated(plan, kernels, gpu_graph, &model.weights, &[], context).unwrap();
    let cpu = cpu_backend(reference, context);
    // GLM-5's indexer keeps 8 of the tiny model's positions by their scores against the cached
    // index keys: after a bf16 prefill through the tensor cores (bf16 matrices, and FP8 or GGUF
    // blocks converted to bf16 for it) those keys are rounded, the choice differs where scores
    // were close, and so do the logits (0.27 on H200 in bf16, 0.17 over FP8 blocks), while
    // with every position kept (`index_topk` 64) the steps agree within 2e-2. So after that
    // prefill only its own logits are compared; the short prompt's steps, which choose too,
    // still are.
    let rounded_prompt = graph
        .nodes()
        .iter()
        .any(|n| matches!(n.op, ir::Op::Weight { .. }) && n.dtype != ir::DType::F32);
    let choice_follows_rounding = family.starts_with("glm_moe_dsa") && rounded_prompt;
    for prompt_len in [PREFILL_TOKENS + 3, 5] {
        let prompt: Vec<u32> = (0..prompt_len as u32).map(|i| (7 + 13 * i) % 300).collect();
        let (mut g, mut c) = (gpu.new_sequence(), cpu.new_sequence());
        let mut ids = prompt;
        let steps = match choice_follows_rounding && prompt_len >= PREFILL_TOKENS {
            true => 1,
            false => 4,
        };
        for step in 0..steps {
            let got = gpu.step(&mut g, &ids).unwrap();
            let want = cpu.step(&mut c, &ids).unwrap();
            let (got, want) = (&got["logits"], &want["logits"]);
            assert_eq!(got.shape, want.shape, "{family} {dtype:?} {target:?}");
            let tolerance: f32 = if ids.len() >= PREFILL_TOKENS {
                prefill_tolerance
            } else {
                step_tolerance
            };
            // After a bf16 prefill the cache holds slightly different keys, so decode inherits it.
            let tolerance = if prompt_len >= PREFILL_TOKENS {
                tolerance.max(prefill_tolerance)
            } else {
                tolerance
            };
            let error = relative_error(&got.data, &want.data);
            assert!(
                error <= tolerance,
                "{family} {dtype:?} on {}: step {step} of a {prompt_len}-token prompt: error {error} > {tolerance}",
                target.name()
            );
            ids = vec![runtime::sampling::argmax(want.row(want.rows() - 1))];
        }
    }
}

/// Models computed in IEEE half (`--dtype half`: every matrix rounded to half; Gemma's
/// embedding scale too; half KV caches) on every GPU target against the CPU backend computing
/// the same: the target's TMA GEMMs over halves for prompts (the same own-instruction kernels
/// as bf16's, asserted in `check_within`), GLM-4.5's experts multiplied as halves. After
/// 19-token prompts within 5e-3 (measured 4.0e-4 Llama, 1.4e-3 Gemma 3, 2.4e-4 GLM-4.5,
/// 2.1e-3 Qwen3.5: the CPU keeps the activations f32 where the GEMMs round them to half);
/// steps after 5-token prompts (GEMVs, f32 activations) within 1e-4 (1.7e-5 measured).
#[test]
fn tiny_f16_plans_agree_with_the_cpu_backend() {
    for family in ["llama", "gemma3", "glm4_moe", "qwen3_5"] {
        let model = open(family, ComputeDtype::F16);
        for target in [Target::H200, Target::B200, Target::RtxPro6000] {
            check_within(family, &model, &model, target, 5e-3, 1e-4);
        }
    }
}

#[test]
fn tiny_llama_plans_agree_with_the_cpu_backend() {
    check_everywhere("llama");
}

#[test]
fn tiny_gemma3_plans_agree_with_the_cpu_backend() {
    check_everywhere("gemma3");
}

/// Qwen3.5's hybrid (Gated DeltaNet layers, each sequence's f32 state carried from step to
/// step; gated attention with partial RoPE and q/k norms) on every GPU target.
#[test]
fn tiny_qwen3_5_plans_agree_with_the_cpu_backend() {
    check_everywhere("qwen3_5");
}

/// Qwen3-Next with its matrices in Q8_0 (stacked experts kept in their blocks: picked per
/// expert as the plan uploads them, dotted from blocks by the MoE decode kernels and decoded
/// into tensor-core tiles in prefill) against the CPU
/// backend on the same file dequantized to f32, on every GPU target: within 1e-4 but after a
/// prefill through the tensor-core GEMM, whose bf16-rounded activations switch an expert of
/// the tiny 4-expert router as in `check` (there 1e-1).
#[test]
fn quantized_stacked_experts_agree_with_the_dequantized_cpu_backend() {
    let path = fixture("gguf-tiny/qwen3_next.q8_0.gguf");
    let (native, dequantized) = (open_at(&path, ComputeDtype::Native), open_at(&path, ComputeDtype::F32));
    for target in [Target::H200, Target::B200, Target::RtxPro6000] {
        check_against("qwen3_next", &native, &dequantized, target, 1e-1);
    }
}

/// GLM-4.5 as `llama-quantize … MXFP4_MOE` writes it (stacked experts in GGUF's MXFP4, other
/// matrices in Q8_0) against the CPU backend on the same file dequantized to f32, on every GPU
/// target: the experts decoded from their 17-byte blocks as stored by the MoE decode kernels
/// and into tensor-core tiles in prefill. The plan keeps a quantized model's keys and values
/// in half, the dequantized CPU model in f32: steps after short prompts within 5e-4 (2.5e-4
/// measured, as with the experts in Q8_0), after a 19-token prompt within 1e-2 (3.1e-3).
#[test]
fn mxfp4_stacked_experts_agree_with_the_dequantized_cpu_backend() {
    let path = fixture("gguf-tiny/glm4_moe.mxfp4_moe.gguf");
    let (native, dequantized) = (open_at(&path, ComputeDtype::Native), open_at(&path, ComputeDtype::F32));
    let graph = fused_for(&native.lower(LogitsFor::LastToken).unwrap(), Target::H200);
    let mxfp4 = graph
        .nodes()
        .iter()
        .filter(|n| matches!(n.op, ir::Op::Weight { .. }) && n.dtype == ir::DType::MXFP4)
        .count();
    assert!(mxfp4 >= 6, "the plan's graph has {mxfp4} MXFP4 weights");
    for target in [Target::H200, Target::B200, Target::RtxPro6000] {
        check_within("glm4_moe", &native, &dequantized, target, 1e-2, 5e-4);
    }
}

/// Qwen3.5, Qwen3-Next, Qwen3.5-MoE, GLM-4.5 and Gemma 4 (26B-A4B's shape) as llama.cpp's
/// converter writes them to GGUF: the DeltaNet kernels read each value head's key head and
/// decay rate as its spec says (Qwen3.5's value heads tiled over the key heads, `A` stored
/// instead of `A_log`), and the experts are picked from their stacked tensors as the plan
/// uploads them (Gemma 4's gate and up rows fused in one), on every GPU target.
#[test]
fn tiny_gguf_hybrid_and_moe_plans_agree_with_the_cpu_backend() {
    for family in ["qwen3_5", "qwen3_next", "qwen3_5_moe", "glm4_moe", "gemma4_moe"] {
        let model = open_at(&fixture(&format!("gguf-tiny/{family}.gguf")), ComputeDtype::F32);
        for target in [Target::H200, Target::B200, Target::RtxPro6000] {
            check_against(family, &model, &model, target, 1e-4);
        }
    }
}

/// GLM-4.5's MoE layers (DeepSeek-V3's grouped sigmoid router, experts run per row, a shared
/// expert beside them) and attention with Q/K/V biases, on every GPU target.
#[test]
fn tiny_glm4_moe_plans_agree_with_the_cpu_backend() {
    check_everywhere("glm4_moe");
}

/// GLM-5: latent attention with DeepSeek's sparse indexer (the tiny model keeps 8 of its
/// positions: the long prompt's rows and steps choose, the short prompt keeps all until its
/// last step), layer-normed index keys, interleaved RoPE, GLM-4.5's MoE layers, on every GPU
/// target.
#[test]
fn tiny_glm5_plans_agree_with_the_cpu_backend() {
    check_everywhere("glm_moe_dsa");
}

/// `name`'s batched plan for `target` in f32 (every row's logits) on the emulator against HF
/// transformers' `reference`: its prompt prefilled in chunks of at most `chunk` rows over a
/// paged cache of 16-position blocks, then its cached greedy steps; logits at every prompt row
/// and step within 1e-4 of HF's (relative to the largest), and HF's greedy ids.
fn check_plan_against_hf(reference: &Reference, name: &str, target: Target, chunk: usize) {
    use runtime::kv::{BlockId, Segment, StateSnapshots};
    let model = open(name, ComputeDtype::F32);
    let (n, v) = (reference.input_ids.len(), reference.vocab);
    let positions = n + reference.greedy_ids.len();
    let gpu_graph = fused_for(&model.lower(LogitsFor::AllTokens).unwrap(), target);
    let cache = gpu::BatchedCache {
        blocks: positions.div_ceil(16),
        block_size: 16,
        sequences: 1,
    };
    let (plan, kernels) = gpu::build_batched(&gpu_graph, target, chunk, cache).unwrap();
    let gpu = EmulatorBackend::emulated(plan, kernels, gpu_graph, &model.weights, &[], positions).unwrap();
    // Blocks in reverse, so a position's block is never its index's.
    let table: Vec<BlockId> = (0..cache.blocks as u32).rev().map(BlockId).collect();
    let step = |start: usize, ids: &[u32]| -> Vec<f32> {
        let segment = Segment {
            hidden_states: &[],
            table: &table,
            start,
            ids,
            state_slot: 0,
            sampled_rows: 1,
            drafts: 0,
            snapshots: StateSnapshots::NONE,
        };
        gpu.step_batch(&[segment])
            .unwrap()
            .remove(0)
            .remove("logits")
            .unwrap()
            .data
    };
    let label = format!("{name} on {}", target.name());
    let mut prompt = Vec::with_capacity(n * v);
    for (i, ids) in reference.input_ids.chunks(chunk).enumerate() {
        prompt.extend(step(i * chunk, ids));
    }
    let error = relative_error(&prompt, &reference.logits);
    assert!(error <= 1e-4, "{label}: prompt logits off by {error}");
    let mut last = prompt[(n - 1) * v..].to_vec();
    for (s, &id) in reference.greedy_ids.iter().enumerate() {
        let error = relative_error(&last, reference.step(s));
        assert!(error <= 1e-4, "{label}: step {s} off by {error}");
        assert_eq!(runtime::sampling::argmax(&last), id, "{label}: greedy id at step {s}");
        last = step(n + s, &[id]);
    }
}

/// GLM-5's held-out models (prompts of 48 and 96 ids, the indexer keeping 8 of them on most
/// rows and at every step; 8 and 16 index heads) and the tiny model with two index heads
/// against transformers with tied index scores kept earliest (see `hf_tiny`'s
/// `glm_moe_dsa_matches_hf_with_tied_index_scores_kept_earliest`): HF's logits at every prompt
/// row and cached step, prefilled in chunks of 32 rows. In f32 every target's plan launches
/// the same kernels (the tensor-core GEMMs are bf16's), checked here, so H200's run covers
/// all three.
#[test]
fn glm5_plans_match_hf_at_every_row_and_step() {
    let model = open("glm_moe_dsa_held_out_48", ComputeDtype::F32);
    let graph = model.lower(LogitsFor::AllTokens).unwrap();
    let cache = gpu::BatchedCache {
        blocks: 4,
        block_size: 16,
        sequences: 1,
    };
    let plan_for = |target| {
        let (plan, mut kernels) = gpu::build_batched(&fused_for(&graph, target), target, 32, cache).unwrap();
        for kernel in &mut kernels {
            kernel.origin.clear();
        }
        (plan.launches, kernels)
    };
    let h200 = plan_for(Target::H200);
    for target in [Target::B200, Target::RtxPro6000] {
        assert!(plan_for(target) == h200, "f32 plans differ on {}", target.name());
    }
    for name in ["glm_moe_dsa_held_out_48", "glm_moe_dsa_held_out_96"] {
        check_plan_against_hf(&Reference::of(name), name, Target::H200, 32);
    }
    let ties = Reference::from_fixture("hf-tiny/glm_moe_dsa-earliest-ties-reference.safetensors");
    check_plan_against_hf(&ties, "glm_moe_dsa", Target::H200, 32);
}

/// Every other family's tiny model, its batched f32 plan on the emulator against HF's logits
/// at every prompt row and cached step (prefilled in chunks of 16 rows), as GLM-5's above:
/// the other plan tests compare with the CPU backend on prompts of their own.
#[test]
fn plans_match_hf_at_every_row_and_step() {
    for name in ["llama", "gemma3", "gemma4", "qwen3_next", "qwen3_5", "glm4_moe"] {
        check_plan_against_hf(&Reference::of(name), name, Target::H200, 16);
    }
}

/// Hopper's and the B200's bf16 plans prefill steps of 16 to 64 rows through the TMA GEMM in
/// 64-token tiles (the launches' batch kernels: on Hopper with the weights as wgmma's M) and
/// longer ones through the 128-token tiles: a step of 40 rows launches the former for every
/// TMA matmul and none of the latter, one of 80 the other way round, and both agree with the
/// CPU backend.
#[test]
fn plans_take_the_batch_gemm_up_to_64_rows() {
    let model = open("llama", ComputeDtype::Bf16);
    let graph = model.lower(LogitsFor::LastToken).unwrap();
    let cpu = CpuBackend::new(
        passes::optimized(&graph, passes::CostModel::CPU).unwrap(),
        &model.weights,
        128,
    )
    .unwrap();
    for target in [Target::H200, Target::B200] {
        batch_gemm_up_to_64_rows(&model, &graph, &cpu, target);
    }
}

fn batch_gemm_up_to_64_rows(model: &Model, graph: &ir::Graph, cpu: &CpuBackend, target: Target) {
    use runtime::kv::{BlockId, Segment, StateSnapshots};
    let gpu_graph = fused_for(graph, target);
    let cache = gpu::BatchedCache {
        blocks: 8,
        block_size: 16,
        sequences: 1,
    };
    let (plan, kernels) = gpu::build_batched(&gpu_graph, target, 128, cache).unwrap();
    let gpu = EmulatorBackend::emulated(plan, kernels, gpu_graph, &model.weights, &[], 128).unwrap();
    let target = target.name();
    let table: Vec<BlockId> = (0..cache.blocks as u32).rev().map(BlockId).collect();
    for (rows, batch) in [(40u32, true), (80, false)] {
        let ids: Vec<u32> = (0..rows).map(|i| (7 + 13 * i) % 300).collect();
        let segment = || Segment {
            hidden_states: &[],
            table: &table,
            start: 0,
            ids: &ids,
            state_slot: 0,
            sampled_rows: 1,
            drafts: 0,
            snapshots: StateSnapshots::NONE,
        };
        let launched: Vec<String> = gpu
            .profile_step_batch(&[segment()])
            .unwrap()
            .into_iter()
            .map(|l| l.kernel)
            .collect();
        let tma = |batch: bool| {
            launched
                .iter()
                .filter(|k| k.contains("gemm_tma") && k.contains("_batch") == batch)
                .count()
        };
        assert!(
            tma(batch) > 0 && tma(!batch) == 0,
            "{target}, {rows} rows: {launched:?}"
        );
        // The same step again (its keys written again, the same), against the CPU backend.
        let got = gpu
            .step_batch(&[segment()])
            .unwrap()
            .remove(0)
            .remove("logits")
            .unwrap();
        let want = cpu
            .step(&mut cpu.new_sequence(), &ids)
            .unwrap()
            .remove("logits")
            .unwrap();
        let error = relative_error(&got.data, want.row(want.rows() - 1));
        assert!(error <= 2e-2, "{target}, {rows} rows: error {error}");
    }
}

/// Qwen3.5's held-out model (a 72-id prompt) against HF's logits at every prompt row and
/// cached step and its greedy ids: the prompt in one step (the delta rule in chunks: 64 rows,
/// then 8) and in steps of 5 rows (a row at a time).
#[test]
fn qwen3_5_plans_match_hf_in_chunks_and_row_by_row() {
    let reference = Reference::of("qwen3_5_held_out");
    for rows_a_step in [72, 5] {
        check_plan_against_hf(&reference, "qwen3_5_held_out", Target::H200, rows_a_step);
    }
}

/// Llama 3.1's RoPE scaling: the rotations read the rescaled frequencies the plan carries as
/// a constant, in f32 and bf16 on H200.
#[test]
fn tiny_llama_with_llama3_rope_plans_agree_with_the_cpu_backend() {
    for dtype in [ComputeDtype::F32, ComputeDtype::Bf16] {
        check("llama_rope_llama3", dtype, Target::H200);
    }
}

/// YaRN: the rotations read the blended frequencies the plan carries as a constant and
/// multiply cos and sin by the attention factor (the tiny Llama: whole heads rotate; Qwen3.5:
/// a quarter of each; GLM-5: the latent attention's rotated part and the indexer's, its
/// softmax scale changed instead), in f32 on H200 (the launches are the same on every target).
#[test]
fn tiny_yarn_plans_agree_with_the_cpu_backend() {
    for name in ["llama_rope_yarn", "qwen3_5_rope_yarn", "glm_moe_dsa_rope_yarn"] {
        check(name, ComputeDtype::F32, Target::H200);
    }
}

/// GLM-5.2's shared indexers: layers without an indexer read the cut the previous full layer
/// made (and the position scores it left), in f32 and bf16 on H200 (the launches are the same
/// on every target).
#[test]
fn tiny_glm5_shared_indexer_plans_agree_with_the_cpu_backend() {
    for dtype in [ComputeDtype::F32, ComputeDtype::Bf16] {
        check("glm_moe_dsa_shared", dtype, Target::H200);
    }
}

/// Gemma 4: per-layer inputs, value norms without a weight (`unit_rms_norm`), global layers
/// with heads of 512 and proportional RoPE, layer scalars (`scale_rows` by a weight), on
/// every GPU target.
#[test]
fn tiny_gemma4_plans_agree_with_the_cpu_backend() {
    check_everywhere("gemma4");
}

/// Gemma 4 E2B/E4B's shape: KV-shared layers attending over an earlier layer's cache slot
/// (no append of their own), double-wide MLPs, soft-capped logits (an `elementwise` launch),
/// on every GPU target.
#[test]
fn tiny_gemma4_kv_shared_plans_agree_with_the_cpu_backend() {
    check_everywhere("gemma4_kv_shared");
}

/// Gemma 4 26B-A4B's shape: MoE blocks beside the MLPs (softmax routing scaled per expert,
/// GELU experts), values from the key projection, on every GPU target.
#[test]
fn tiny_gemma4_moe_plans_agree_with_the_cpu_backend() {
    check_everywhere("gemma4_moe");
}

/// Qwen3-Next: Qwen3.5's hybrid with MoE layers under a softmax router, a shared expert gated
/// by a sigmoid (`scale_rows`), and DeltaNet projections regrouped from their per-key-head
/// interleaving as the plan uploads them (`WeightPart::RowGroups`), on every GPU target.
#[test]
fn tiny_qwen3_next_plans_agree_with_the_cpu_backend() {
    check_everywhere("qwen3_next");
}

/// The GGUF model at `path` computed as stored (`Native`), its cache f32 rows: where what is
/// checked is the weights' decoding.
fn open_native_with_f32_cache(path: &std::path::Path) -> Model {
    let mut spec = ModelSpec::for_weights(path);
    spec.dtype = ComputeDtype::Native;
    spec.kv_cache_dtype = models::KvCacheDtype::F32;
    Model::open(spec).unwrap()
}

/// The plans of the GGUF model `make` writes into a scratch directory against the CPU backend
/// on the same file dequantized to f32, on every GPU target, norms fused into the matmuls
/// there; every matmul's steps of many rows through a GEMM named with `gemm`, after a launch
/// making its rows named with `rows`.
fn check_gguf(
    name: &str,
    make: fn(&std::path::Path) -> std::io::Result<std::path::PathBuf>,
    (gemm, rows): (&str, &str),
) {
    let scratch = tempfile::Builder::new()
        .prefix(&format!("bbc-tiny-{}-", name.replace(' ', "-")))
        .tempdir()
        .unwrap();
    let path = make(scratch.path()).unwrap();
    // What is checked is the weights' decoding, so both sides cache f32 rows (a native model's
    // cache is half by default, as llama.cpp's; `plans_with_half_kv_caches_agree_with_the_cpu_backend`
    // checks those).
    let native = open_native_with_f32_cache(&path);
    let dequantized = open_at(&path, ComputeDtype::F32);
    for target in [Target::H200, Target::B200, Target::RtxPro6000] {
        let fused = fused_for(&native.lower(LogitsFor::LastToken).unwrap(), target);
        let fused_norms = fused
            .nodes()
            .iter()
            .filter(|n| matches!(n.op, ir::Op::AddRmsNormMatMul { .. } | ir::Op::RmsNormMatMul { .. }))
            .count();
        assert!(
            fused_norms >= 2 * 3,
            "{name} on {}: {fused_norms} norm-fused matmuls",
            target.name()
        );
        // Plans of up to a decode batch's rows copy no weights: every matmul's steps of many
        // rows run a tensor-core GEMM over rows a launch before it made (the norm applied
        // there once a step).
        let (plan, _) = gpu::build_with_kernels(&fused, target, 64).unwrap();
        let matmuls: Vec<usize> = (0..plan.launches.len())
            .filter(|&i| plan.launches[i].kernel.contains("gemv"))
            .collect();
        assert!(matmuls.len() >= fused_norms, "{name} on {}", target.name());
        for i in matmuls {
            let (launch, before) = (&plan.launches[i], &plan.launches[i - 1].kernel);
            let prefill = launch.prefill_kernel.as_deref().unwrap_or("");
            assert!(prefill.contains(gemm), "{name}: {launch:?}");
            assert!(before.contains(rows), "{name}: {prefill} after {before}");
        }
        check_against(name, &native, &dequantized, target, 2e-2);
    }
}

/// A GGUF model's plans (weights kept in their blocks, Q8_0 attention and embedding, Q4_0
/// MLP; norms and residual adds fused into the matmuls on every GPU target) against the CPU
/// backend on the same file dequantized to f32: the GEMVs decode blocks exactly (1e-4); a
/// prefill through the decoding tensor-core GEMM, over rows made bf16 (normed) before it,
/// rounds weights and activations to bf16 (2e-2).
#[test]
fn tiny_quantized_llama_plans_agree_with_the_cpu_backend() {
    check_gguf(
        "quantized llama",
        tiny_gguf::quantized_llama,
        ("gemm_after_rows", "bf16_rows"),
    );
}

/// A GGUF model's prompts of more rows than a decode batch's: each matmul's blocks decoded
/// into a bf16 copy for the step (a launch of its own, none at fewer rows), multiplied by the
/// target's TMA GEMM as bf16 weights are; a chunk of batch rows then through the GEMM that
/// decodes blocks into its tiles, over the same normed bf16 rows; then decode steps; on every
/// GPU target against the CPU backend on the file dequantized to f32 (both round weights and
/// activations to bf16 in the GEMMs: 2e-2, as
/// `tiny_quantized_llama_plans_agree_with_the_cpu_backend`). Hidden 128, so that the normed
/// projections' GEMMs split K (their rows come normalised: the splits' reduction must not
/// scale them again).
#[test]
fn quantized_prompts_of_many_rows_multiply_by_weights_converted_for_them() {
    use tiny_gguf::{q4_0, q8_0};
    check_converted_prefill("quantized", (&mut q8_0, &mut q4_0), &["q8_0", "q4_0"]);
}

/// A tiny Llama (hidden 128) with every matrix in IEEE half, in plans of more rows than a
/// decode batch: no matrix is copied; every matmul's steps of many rows run the target's TMA
/// GEMM over the halves as stored (`halves::over_halves`), after a launch making its rows
/// half, and on Hopper and the B200 its batch GEMM does the same up to a batch's rows, the
/// gated MLP's joined gate/up too (its GLU gated by the TMA GEMM itself there). A prompt of
/// more rows, a chunk of fewer and decode steps against the CPU backend on the file in f32:
/// within 5e-3 (measured 2.1e-3 on every target: the activations rounded to half, the weights
/// exact).
#[test]
fn half_prompts_multiply_the_halves_on_the_tma_gemms() {
    use tiny_gguf::f16_values;
    let scratch = tempfile::Builder::new().prefix("bbc-half-prefill-").tempdir().unwrap();
    let path = scratch.path().join("f16-llama.gguf");
    let (native, dequantized) = wide_llama(&path, (&mut f16_values, &mut f16_values));
    let context = native.config.context_length.min(256);
    let cpu = cpu_backend(&dequantized, context);
    let rows = BATCH_ROWS + 6;
    for target in [Target::H200, Target::B200, Target::RtxPro6000] {
        let label = format!("f16 on {}", target.name());
        let graph = fused_for(&native.lower(LogitsFor::LastToken).unwrap(), target);
        let (plan, kernels) = gpu::build_with_kernels(&graph, target, rows).unwrap();
        assert!(
            !plan.kernels.iter().any(|k| k.name.starts_with("convert_")),
            "{label}: a matrix copied"
        );
        let batch_too = matches!(target, Target::H200 | Target::B200);
        let matmuls: Vec<usize> = (0..plan.launches.len())
            .filter(|&i| plan.launches[i].kernel.contains("gemv"))
            .collect();
        let mut gated = 0;
        for &i in &matmuls {
            let (launch, before) = (&plan.launches[i], &plan.launches[i - 1].kernel);
            let Some(prefill) = launch.prefill_kernel.as_deref() else {
                // The head's GEMV over the rows sampled.
                continue;
            };
            assert!(prefill.contains("gemm_tma_f16"), "{label}: {launch:?}");
            assert!(before.contains("f16_rows"), "{label}: {prefill} after {before}");
            let batch = launch.batch_kernel.as_deref();
            assert_eq!(
                batch.is_some_and(|b| b.contains("_batch_f16")),
                batch_too,
                "{label}: {launch:?}"
            );
            gated += usize::from(prefill.contains("swiglu"));
        }
        assert!(gated > 0 && matmuls.len() > gated, "{label}: {matmuls:?}");
        let gpu = EmulatorBackend::emulated(plan, kernels, graph, &native.weights, &[], context).unwrap();
        let (mut g, mut c) = (gpu.new_sequence(), cpu.new_sequence());
        let prompt: Vec<u32> = (0..rows as u32).map(|i| (11 + 29 * i) % 300).collect();
        let chunk: Vec<u32> = (0..PREFILL_TOKENS as u32 + 4).map(|i| (5 + 7 * i) % 300).collect();
        let mut ids = prompt;
        for step in 0..4 {
            let (got, want) = (gpu.step(&mut g, &ids).unwrap(), cpu.step(&mut c, &ids).unwrap());
            let error = relative_error(&got["logits"].data, &want["logits"].data);
            assert!(
                error <= 5e-3,
                "{label}: step {step} of {} rows: error {error}",
                ids.len()
            );
            ids = match step {
                0 => chunk.clone(),
                _ => vec![runtime::sampling::argmax(want["logits"].row(want["logits"].rows() - 1))],
            };
        }
    }
}

/// The MoE families' tiny GGUF files with their matrices in IEEE half (as llama.cpp's F16
/// conversion writes them: routers and norms in f32), served natively (half KV caches): every
/// MoE layer's prompt steps multiply the half experts as stored (the bf16 experts' kernels over
/// halves: `wgmma` on Hopper, `tcgen05` on the B200, `mma.sync` on the RTX PRO 6000) after a
/// launch making the rows half, and the plans against the CPU backend on the file in f32:
/// after 19-token prompts within 5e-3 (measured 2.5e-3 Qwen3-Next, 2.6e-4 GLM-4.5, 6.2e-4
/// Gemma 4: activations and caches rounded to half, the weights exact; the experts decoded into
/// bf16 tiles instead measure 1.3e-2, 9.8e-4, 3.8e-3), steps after 5-token ones (GEMVs) within
/// 1e-3 (4.2e-4 measured).
#[test]
fn half_experts_multiply_as_stored_on_the_tensor_cores() {
    let scratch = tempfile::Builder::new().prefix("bbc-half-experts-").tempdir().unwrap();
    for family in ["qwen3_next", "glm4_moe", "gemma4_moe"] {
        let path = scratch.path().join(format!("{family}.f16.gguf"));
        tiny_gguf::with_half_matrices(&fixture(&format!("gguf-tiny/{family}.gguf")), &path).unwrap();
        let (native, dequantized) = (open_at(&path, ComputeDtype::Native), open_at(&path, ComputeDtype::F32));
        for target in [Target::H200, Target::B200, Target::RtxPro6000] {
            let label = format!("{family} f16 on {}", target.name());
            let graph = fused_for(&native.lower(LogitsFor::LastToken).unwrap(), target);
            let (plan, kernels) = gpu::build_with_kernels(&graph, target, 64).unwrap();
            let moe_layers = graph.nodes().iter().filter(|n| matches!(n.op, ir::Op::Moe(_))).count();
            let experts: Vec<(usize, &str)> = plan
                .launches
                .iter()
                .enumerate()
                .filter_map(|(i, l)| Some((i, l.prefill_kernel.as_deref()?)))
                .filter(|(_, k)| k.starts_with("moe_gate_up") || k.starts_with("moe_down"))
                .collect();
            assert_eq!(experts.len(), 2 * moe_layers, "{label}: {experts:?}");
            let own = match target {
                Target::H200 => Some("sm_90a"),
                Target::B200 => Some("sm_100a"),
                _ => None,
            };
            for &(i, name) in &experts {
                assert!(name.contains("_f16"), "{label}: {name}");
                let kernel = kernels.iter().find(|k| k.name == name).unwrap();
                assert_eq!(kernels_gen::cuda::required_arch(kernel), own, "{label}: {name}");
                if name.starts_with("moe_gate_up") {
                    // The rows made half, then the pairs and tiles listed.
                    let made = &plan.launches[i - 3].kernel;
                    assert!(made.starts_with("f16_rows"), "{label}: {name} after {made}");
                }
            }
            check_within(family, &native, &dequantized, target, 5e-3, 1e-3);
        }
    }
}

/// The tiny Llama widened to hidden 128 (8 heads, 4 KV heads: rows enough for the TMA GEMMs'
/// tiles) written to `path` as a GGUF file of `matrices` (attention and embedding, MLP): the
/// file opened natively (f32 caches) and dequantized to f32.
fn wide_llama(path: &std::path::Path, matrices: (tiny_gguf::Matrix, tiny_gguf::Matrix)) -> (Model, Model) {
    use tiny_gguf::{gguf_llama, LlamaShape};
    let shape = LlamaShape {
        hidden: 128,
        heads: 8,
        kv_heads: 4,
        ..LlamaShape::TINY
    };
    gguf_llama(path, &shape, matrices.0, matrices.1).unwrap();
    (open_native_with_f32_cache(path), open_at(path, ComputeDtype::F32))
}

/// A tiny Llama (hidden 128) as a GGUF file of `matrices` (attention and embedding, MLP)
/// through [`quantized_prompts_of_many_rows_multiply_by_weights_converted_for_them`]'s
/// checks: its plans carry the conversions of `formats`, one before each matmul's GEMMs.
fn check_converted_prefill(name: &str, matrices: (tiny_gguf::Matrix, tiny_gguf::Matrix), formats: &[&str]) {
    let scratch = tempfile::Builder::new()
        .prefix("bbc-converted-prefill-")
        .tempdir()
        .unwrap();
    let path = scratch.path().join(format!("{name}-llama.gguf"));
    let (native, dequantized) = wide_llama(&path, matrices);
    let context = native.config.context_length.min(256);
    let cpu = cpu_backend(&dequantized, context);
    let rows = BATCH_ROWS + 6;
    for target in [Target::H200, Target::B200, Target::RtxPro6000] {
        let label = format!("{name} on {}", target.name());
        let graph = fused_for(&native.lower(LogitsFor::LastToken).unwrap(), target);
        let (plan, kernels) = gpu::build_with_kernels(&graph, target, rows).unwrap();
        let converting: Vec<String> = plan
            .kernels
            .iter()
            .map(|k| k.name.clone())
            .filter(|name| name.contains("_to_bf16_for_prefill"))
            .collect();
        for format in formats {
            let named = format!("convert_{format}_to_bf16_for_prefill");
            assert!(
                converting.iter().any(|n| n.starts_with(&named)),
                "{label}: no {named} in {converting:?}"
            );
        }
        // A conversion before each GEMM over a copy, and every matmul's GEMM over one (the
        // tiny model's matrices are all small enough).
        let conversions = plan.launches.iter().filter(|l| converting.contains(&l.kernel)).count();
        let over_copies = plan
            .launches
            .iter()
            .filter(|l| l.prefill_kernel.as_deref().is_some_and(|k| k.contains("_converted")))
            .count();
        let decoding = plan
            .launches
            .iter()
            .filter(|l| l.batch_kernel.as_deref().is_some_and(|k| k.contains("gemm_after_rows")))
            .count();
        assert!(conversions > 0, "{label}");
        assert_eq!((over_copies, decoding), (conversions, conversions), "{label}");
        // Those over every row of the step (all but the head's, over the rows sampled: one
        // a step here, so its GEMV).
        let over_every_row = plan
            .launches
            .iter()
            .filter(|l| converting.contains(&l.kernel))
            .filter(|l| {
                l.args.iter().any(|a| {
                    matches!(a, codegen::gpu::LaunchArg::Scalar { name, value } if name == "tokens" && value == "tokens")
                })
            })
            .count();
        assert_eq!(over_every_row, conversions - 1, "{label}");
        let gpu = EmulatorBackend::emulated(plan, kernels, graph, &native.weights, &[], context).unwrap();
        let launched = || -> usize {
            converting
                .iter()
                .map(|n| gpu.with_device(|d| d.launches_of(n)).unwrap())
                .sum()
        };
        let (mut g, mut c) = (gpu.new_sequence(), cpu.new_sequence());
        let prompt: Vec<u32> = (0..rows as u32).map(|i| (11 + 29 * i) % 300).collect();
        let chunk: Vec<u32> = (0..PREFILL_TOKENS as u32 + 4).map(|i| (5 + 7 * i) % 300).collect();
        let mut ids = prompt;
        for step in 0..4 {
            let before = launched();
            let (got, want) = (gpu.step(&mut g, &ids).unwrap(), cpu.step(&mut c, &ids).unwrap());
            let error = relative_error(&got["logits"].data, &want["logits"].data);
            assert!(
                error <= 2e-2,
                "{label}: step {step} of {} rows: error {error}",
                ids.len()
            );
            let converted = launched() - before;
            let expected = if ids.len() > BATCH_ROWS { over_every_row } else { 0 };
            assert_eq!(converted, expected, "{label}: conversions at {} rows", ids.len());
            ids = match step {
                0 => chunk.clone(),
                _ => vec![runtime::sampling::argmax(want["logits"].row(want["logits"].rows() - 1))],
            };
        }
    }
}

/// An f16 model's plans (IEEE half weights: read exactly by the GEMVs, multiplied as stored
/// by the TMA GEMMs over rows made half) against the CPU backend on the same file in f32.
#[test]
fn tiny_f16_llama_plans_agree_with_the_cpu_backend() {
    check_gguf("f16 llama", tiny_gguf::f16_llama, ("gemm_tma_f16", "f16_rows"));
}

/// A GGUF's blocks and an f16 file loaded into bf16 plans, and the blocks into a half plan: the
/// plan carries the kernels that convert their stored forms (`gpu::weight_conversions`, as
/// `bbc compile` adds them), the executor uploads the stored bytes and converts them on the
/// device, and the plan computes bit for bit what it computes on weights converted on the host.
#[test]
fn weights_converted_on_the_device_equal_those_converted_on_the_host() {
    for (name, make, stored, dtype) in [
        (
            "quantized",
            tiny_gguf::quantized_llama as fn(&std::path::Path) -> _,
            ["q8_0", "q4_0"].as_slice(),
            ComputeDtype::Bf16,
        ),
        ("f16", tiny_gguf::f16_llama, ["f16"].as_slice(), ComputeDtype::Bf16),
        // `--dtype f16` of the GGUF's blocks.
        (
            "quantized into half",
            tiny_gguf::quantized_llama,
            ["q8_0", "q4_0"].as_slice(),
            ComputeDtype::F16,
        ),
    ] {
        let scratch = tempfile::Builder::new().prefix("bbc-converted-").tempdir().unwrap();
        let model = open_at(&make(scratch.path()).unwrap(), dtype);
        let graph = fused_for(&model.lower(LogitsFor::LastToken).unwrap(), Target::H200);
        let (plan, kernels) = gpu::build_with_kernels(&graph, Target::H200, 32).unwrap();
        let conversions = gpu::weight_conversions(&plan, &model.weights);
        let names: Vec<&str> = conversions.iter().map(|k| k.name.as_str()).collect();
        let to = match dtype {
            ComputeDtype::F16 => "f16",
            _ => "bf16",
        };
        let expected: Vec<String> = stored.iter().map(|s| format!("convert_{s}_to_{to}")).collect();
        assert_eq!(names, expected, "{name}");
        let mut converting = plan.clone();
        converting.kernels.extend(conversions.iter().map(gpu::kernel_entry));
        let on_host = EmulatorBackend::emulated(plan, kernels.clone(), graph.clone(), &model.weights, &[], 64).unwrap();
        let with_conversions = [kernels, conversions].concat();
        let on_device =
            EmulatorBackend::emulated(converting, with_conversions, graph, &model.weights, &[], 64).unwrap();
        for kernel in &expected {
            let launched = on_device.with_device(|d| d.launches_of(kernel)).unwrap();
            assert!(launched > 0, "{name}: {kernel} never ran");
        }
        // A prompt through the tensor-core GEMM, then a decode step.
        let (mut a, mut b) = (on_host.new_sequence(), on_device.new_sequence());
        let prompt: Vec<u32> = (0..PREFILL_TOKENS as u32 + 1).map(|i| (3 + 17 * i) % 300).collect();
        for ids in [prompt, vec![5]] {
            let (want, got) = (
                on_host.step(&mut a, &ids).unwrap(),
                on_device.step(&mut b, &ids).unwrap(),
            );
            assert_eq!(got["logits"].data, want["logits"].data, "{name}");
        }
    }
}

/// Half KV caches (`kv_cache_dtype = "f16"`, llama.cpp's default): the plans' appends round
/// keys and values to IEEE half as the CPU backend's pages do, and attention reads them back
/// exactly, on every target. A 5-token prompt and the steps after it attend through the split
/// pass in f32; keys a last f32 bit apart (GPU and CPU sum in different orders) can round to
/// neighbouring halves, so Gemma 3 agrees to 2e-4 (measured 1.7e-4) where Llama keeps 1e-4
/// (3e-7); either bound is below what the half cache's rounding moves the logits (against an
/// f32 cache: 1.9e-4 and 5.4e-4), so a plan that did not round, or rounded to bf16, would
/// fail. A 19-token prompt attends on the tensor cores, multiplying the halves as halves with
/// queries and probabilities rounded to half: within 1.2e-4 (Llama, measured 7.9e-5) and
/// 2e-3 (Gemma 3, 1.2e-3), below what bf16 queries and probabilities give (1.0e-3 and
/// 5.0e-3 over a bf16 cache).
#[test]
fn plans_with_half_kv_caches_agree_with_the_cpu_backend() {
    check_kv_cache(
        models::KvCacheDtype::F16,
        &[("llama", 1.2e-4, 1e-4), ("gemma3", 2e-3, 2e-4)],
    );
}

/// FP8 KV caches (`kv_cache_dtype = "fp8"`, vLLM's E4M3 without scales): the plans' appends
/// round keys and values to FP8 as the CPU backend's pages do (nearest even, saturating), and
/// attention widens them exactly, on every target. A 5-token prompt and the steps after it
/// attend through the split pass in f32: within 1e-5 (measured 5.6e-7 and below). A 19-token
/// prompt attends on the tensor cores, whose queries and probabilities are bf16 (1.0e-3 and
/// 5.0e-3 from the CPU's f32 over a bf16 cache); from the second layer on the keys it appends
/// then differ in f32's last bits, and some land on the neighbouring FP8 code (a step of 2⁻³
/// relative), so those steps agree within 4e-3 (Llama, measured 2.9e-3) and 3e-2 (Gemma 3,
/// 2.4e-2). The FP8 rounding itself moves the logits 2.8e-2 and 9.5e-2 from an f32 cache's,
/// far more than the split pass's bound, so a plan that kept wider keys would fail.
#[test]
fn plans_with_fp8_kv_caches_agree_with_the_cpu_backend() {
    check_kv_cache(
        models::KvCacheDtype::Fp8,
        &[("llama", 4e-3, 1e-5), ("gemma3", 3e-2, 1e-5)],
    );
}

/// Batched plans over FP8 caches (what `bbc serve` runs from an FP8 artifact) against the
/// CPU backend over FP8 pages, every row's logits, decode steps through the scalar split pass
/// and through the vector one (16 codes a load: one lane a row at Llama's 16 dims, two at
/// Gemma 3's 32, whose sliding window masks its local layers). Two short prompts in one step
/// (7 rows a sequence: the split pass) and a decode step agree within 1e-5; then both
/// continue by prompts of 34 and 26 rows over their cached ones (on the tensor cores, the
/// codes widened to bf16: bf16 queries and probabilities, and keys from the second layer on
/// landing on neighbouring codes, as `plans_with_fp8_kv_caches_agree_with_the_cpu_backend`
/// says) and decode again: within 1e-2 (Llama, measured 6.9e-3, where a bf16 cache's plan
/// gives 1.1e-3) and 6e-2 (Gemma 3, 4.4e-2), bounds that catch a wrong table, position or
/// code (errors of the logits' own size); the tensor-core kernel over FP8 pools is checked
/// against the reference to bf16's precision on the emulator. The prompts attend on
/// `mma.sync`, and again on Hopper's `wgmma` (its lockstep schedule, asked for by TMA) and
/// the B200's `tcgen05` (copying its tiles, asked for by TMA).
#[test]
fn batched_plans_over_fp8_caches_agree_with_the_cpu_backend() {
    // Asked for `wgmma` by TMA, prompts over FP8 take its lockstep schedule, which widens
    // each tile.
    check_batched_over(
        models::KvCacheDtype::Fp8,
        &[("llama", 1e-5, 1e-2), ("gemma3", 1e-5, 6e-2)],
        "flash_attention_wgmma",
    );
}

/// Batched plans over half caches (a GGUF artifact's, as llama.cpp keeps them) against the
/// CPU backend over half pages, as [`batched_plans_over_fp8_caches_agree_with_the_cpu_backend`]
/// runs them: two 7-row prompts and a decode step through the split pass within 1e-5 (Llama,
/// measured 3.0e-7) and 2e-4 (Gemma 3, 1.2e-4: keys landing on neighbouring halves, as
/// `plans_with_half_kv_caches_agree_with_the_cpu_backend` says), then prompts of 34 and 26
/// rows on the tensor cores, multiplying halves (queries and probabilities rounded to half),
/// and a decode step: within 2e-4 (Llama, 1.3e-4, where bf16 tensor cores over a bf16 cache
/// give 1.1e-3) and 2e-3 (Gemma 3, 9.9e-4). On `mma.sync`, Hopper's warp-specialised `wgmma`
/// and the B200's `tcgen05` copying its tiles (their TMA forms over half caches:
/// `prefill_attention_by_tma_computes_what_the_copying_one_does`).
#[test]
fn batched_plans_over_half_caches_agree_with_the_cpu_backend() {
    // Asked for by TMA, whose boxes do not tile these heads of 16 and 32 dims, `wgmma` is
    // warp-specialised.
    check_batched_over(
        models::KvCacheDtype::F16,
        &[("llama", 1e-5, 2e-4), ("gemma3", 2e-4, 2e-3)],
        "flash_attention_wgmma_specialised",
    );
}

/// Batched plans of `families` over caches of `cache` against the CPU backend over the same
/// pages (see [`batched_plans_over_fp8_caches_agree_with_the_cpu_backend`]), the steps after
/// the first two (the split pass's) within each family's first tolerance, the others within
/// its second; the prompts on the tensor cores take one kernel: `mma.sync`'s where asked for,
/// `wgmma_kernel` on Hopper asked for `wgmma` by TMA, and on the B200 asked for `tcgen05` by
/// TMA the copying `tcgen05` one (these heads of 16 and 32 dims are not whole TMA boxes).
fn check_batched_over(cache_dtype: models::KvCacheDtype, families: &[(&str, f32, f32)], wgmma_kernel: &str) {
    let cache = two_sequence_pool();
    let steps = [
        vec![(0, pool_prompt(9, 5)), (0, pool_prompt(5, 11))],
        vec![(9, vec![7]), (5, vec![9])],
        vec![(10, pool_prompt(34, 23)), (6, pool_prompt(26, 29))],
        vec![(44, vec![3]), (32, vec![4])],
    ];
    // Each step's bound: the split pass's, then the tensor cores' (and what follows them).
    let split_steps = 2;
    let tables = pool_tables();
    for &(family, split_tolerance, flash_tolerance) in families {
        let mut spec = ModelSpec::for_weights(&fixture(&format!("hf-tiny/{family}")));
        spec.dtype = ComputeDtype::F32;
        spec.kv_cache_dtype = cache_dtype;
        let model = Model::open(spec).unwrap();
        let graph = model.lower(LogitsFor::AllTokens).unwrap();
        let cpu = CpuBackend::new(graph.clone(), &model.weights, 64).unwrap();
        let mut pages = cpu.new_pages(cache.block_size);
        let want: Vec<Vec<f32>> = steps
            .iter()
            .flat_map(|segments| cpu.step_batch(&mut pages, &batch_of(segments, &tables)).unwrap())
            .map(|outputs| outputs["logits"].data.clone())
            .collect();
        for (target, decode_attention, prefill_attention) in [
            (Target::H200, gpu::DecodeAttention::Scalar, gpu::PrefillAttention::Mma),
            (Target::H200, gpu::DecodeAttention::Vector, gpu::PrefillAttention::Mma),
            (
                Target::H200,
                gpu::DecodeAttention::Scalar,
                gpu::PrefillAttention::WgmmaTma,
            ),
            (
                Target::B200,
                gpu::DecodeAttention::Scalar,
                gpu::PrefillAttention::Tcgen05Tma,
            ),
        ] {
            let kernels = gpu::PlanKernels {
                decode_attention,
                prefill_attention,
                ..Default::default()
            };
            let gpu_graph = fused_for(&graph, target);
            let (got, kernels) = pool_steps_on(&model, (&gpu_graph, target), kernels, &steps);
            // The one tensor-core attention the plan launches (named with its hash after).
            let flash = match prefill_attention {
                gpu::PrefillAttention::Mma => "flash_attention",
                gpu::PrefillAttention::WgmmaTma => wgmma_kernel,
                _ => "flash_attention_tcgen05",
            };
            let flashes: Vec<_> = kernels
                .iter()
                .filter(|k| k.starts_with("flash_attention"))
                .map(|k| k.rsplit_once('_').map_or(k.as_str(), |(name, _)| name))
                .collect();
            assert!(
                !flashes.is_empty() && flashes.iter().all(|&k| k == flash),
                "{family}: {kernels:?}"
            );
            let decode_attention = (target, decode_attention, prefill_attention);
            assert_eq!(got.len(), want.len());
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let tolerance = match i / 2 < split_steps {
                    true => split_tolerance,
                    false => flash_tolerance,
                };
                let error = relative_error(g, w);
                assert!(
                    error <= tolerance,
                    "{family} {decode_attention:?}: output {i}: error {error} > {tolerance}"
                );
            }
        }
    }
}

/// `families`' f32 plans over caches of `cache` against the CPU backend over the same caches,
/// on every target, each within its tolerances (after a prompt of [`PREFILL_TOKENS`] or more,
/// and after a shorter one: see [`check_within`]); the shorter one's, through the split pass,
/// must be below what the cache's rounding moves the logits.
fn check_kv_cache(cache: models::KvCacheDtype, families: &[(&str, f32, f32)]) {
    for &(family, prefill_tolerance, step_tolerance) in families {
        let mut spec = ModelSpec::for_weights(&fixture(&format!("hf-tiny/{family}")));
        spec.dtype = ComputeDtype::F32;
        spec.kv_cache_dtype = cache;
        let model = Model::open(spec).unwrap();
        let graph = model.lower(LogitsFor::LastToken).unwrap();
        let caches: Vec<ir::DType> = graph
            .nodes()
            .iter()
            .filter_map(|n| n.op.appended_attention().map(|a| a.cache_dtype))
            .collect();
        let stored = cache.resolve(ComputeDtype::F32, quant::GgmlType::F32);
        assert!(
            !caches.is_empty() && caches.iter().all(|&d| d == stored),
            "{family}: {caches:?}"
        );
        let exact = open(family, ComputeDtype::F32);
        let context = model.config.context_length.min(256);
        let logits = |m: &Model| {
            let cpu = CpuBackend::new(m.lower(LogitsFor::LastToken).unwrap(), &m.weights, context).unwrap();
            let mut seq = cpu.new_sequence();
            let prompt: Vec<u32> = (0..PREFILL_TOKENS as u32 + 3).map(|i| (7 + 13 * i) % 300).collect();
            cpu.step(&mut seq, &prompt).unwrap().remove("logits").unwrap().data
        };
        // The split pass's bound: what shows the cache's own rounding.
        let moved = relative_error(&logits(&model), &logits(&exact));
        assert!(
            moved > 1.5 * step_tolerance,
            "{family}: the {stored} cache moves the logits {moved}"
        );
        for target in [Target::H200, Target::B200, Target::RtxPro6000] {
            check_within(family, &model, &model, target, prefill_tolerance, step_tolerance);
        }
    }
}

/// The greedy plan's `next_token` at every step equals the argmax of the CPU logits, the model
/// computed in `dtype` by both.
fn check_greedy(family: &str, dtype: ComputeDtype, target: Target) {
    let model = open(family, dtype);
    let context = model.config.context_length.min(256);
    let greedy = model.lower(LogitsFor::GreedyToken).unwrap();
    let greedy = fused_for(&greedy, target);
    assert!(
        greedy
            .nodes()
            .iter()
            .any(|n| matches!(n.op, ir::Op::Int8BoundTopK { .. })),
        "the greedy graph of {family} takes the INT8-bound head"
    );
    let int8 = codegen::int8_heads(&greedy, &model.weights).unwrap();
    let (plan, kernels) = gpu::build_with_kernels(&greedy, target, 64).unwrap();
    let gpu = EmulatorBackend::emulated(plan, kernels, greedy, &model.weights, &int8, context).unwrap();
    let logits = model.lower(LogitsFor::LastToken).unwrap();
    let cpu = CpuBackend::new(logits, &model.weights, context).unwrap();
    for prompt_len in [PREFILL_TOKENS + 2, 3] {
        let (mut g, mut c) = (gpu.new_sequence(), cpu.new_sequence());
        let mut ids: Vec<u32> = (0..prompt_len as u32).map(|i| (11 + 29 * i) % 310).collect();
        for step in 0..6 {
            let got = gpu.step(&mut g, &ids).unwrap()["next_token"].data[0] as u32;
            let outputs = cpu.step(&mut c, &ids).unwrap();
            let logits = &outputs["logits"];
            let want = runtime::sampling::argmax(logits.row(logits.rows() - 1));
            assert_eq!(
                got,
                want,
                "{family} {dtype:?} on {}: step {step} of a {prompt_len}-token prompt",
                target.name()
            );
            ids = vec![want];
        }
    }
}

/// FP8 checkpoints run their plans as the CPU backend runs them, each taking the weights as
/// they are made (the source holds none after). Read in bf16 (the dense
/// layers and the Gated DeltaNet's projections, experts with a block of scales each, one scale
/// a row): greedy plans pick the CPU's argmax. Held as FP8 blocks of 32 on every target: steps
/// after a short prompt (GEMVs over the blocks, each weight code × scale in f32 as the CPU
/// widens it; GLM-5.2's latent up-projection transposed into f32) within 1e-5 (5e-7
/// measured); after a 19-token prompt, which multiplies on the tensor cores in bf16 (weights
/// and activations rounded, where the CPU keeps f32), within 2e-2 (8e-3 Llama, 4.6e-3
/// GLM-4.5 measured).
#[test]
fn fp8_checkpoints_run_their_plans_as_the_cpu_backend_does() {
    for family in ["qwen3_next_fp8", "glm4_moe_fp8"] {
        check_greedy(family, ComputeDtype::Bf16, Target::H200);
    }
    for (family, target) in [
        ("llama_fp8", Target::H200),
        ("glm_moe_dsa_fp8", Target::H200),
        ("glm4_moe_fp8", Target::B200),
        ("glm4_moe_fp8", Target::RtxPro6000),
    ] {
        let held = open(family, ComputeDtype::Native);
        let (stored, _) = held.weights.describe("model.layers.0.mlp.down_proj.weight").unwrap();
        assert_eq!(stored, quant::GgmlType::F8E4M3B32);
        let reads_codes = kernels_reading_fp8_codes(&held, target);
        assert!(
            reads_codes >= 2,
            "{family} on {}: {reads_codes} kernels read FP8 codes",
            target.name()
        );
        // GLM-5.2's prompt logits also follow which positions its indexer keeps, and which
        // experts its routers pick, after the rounding (6.2e-2 measured).
        let prefill_tolerance = match family {
            "glm_moe_dsa_fp8" => 1e-1,
            _ => 2e-2,
        };
        check_within(family, &held, &held, target, prefill_tolerance, 1e-5);
        assert_eq!(
            held.weights.converted_bytes(),
            0,
            "{family}: the plan and the CPU backend took the weights as made"
        );
    }
}

/// Integer checkpoints held as blocks (their levels with their groups' scales and zero
/// points) run their plans as the CPU backend runs them (4-bit and Q8_0 blocks as it runs the
/// same weights dequantized: it multiplies those blocks against int8 activations): GPTQ's
/// 128-wide Llama in groups of 128 (4-bit blocks of 128, its down projection's of 32), its
/// act-order Llama (4-bit blocks of its columns by group, each layer's input gathered into
/// that order), compressed-tensors' symmetric Llama (FP8 blocks of 32) and its 8-bit Llama
/// with bf16 scales (Q8_0 blocks) on Hopper, and compressed-tensors' Qwen3-Next (experts, Gated
/// DeltaNet, attention in 4-bit blocks; its shared expert's down projection dequantized to
/// f32) on the RTX PRO 6000. Steps after a short prompt within 1e-5; after a 19-token prompt
/// (bf16 tensor cores) within 2e-2, Qwen3-Next's within 1e-1 (its router follows the
/// rounding, as in [`fp8_quantized_on_load_models_run_their_plans_as_the_cpu_backend_does`]).
#[test]
fn integer_checkpoints_run_their_plans_as_the_cpu_backend_does() {
    use quant::GgmlType::{F8E4M3B32, U4B128, U4B32};
    check_held_blocks("llama_gptq_g128", Target::H200, &[U4B128, U4B32], 2e-2);
    check_held_blocks("llama_gptq_act_order", Target::H200, &[U4B32], 2e-2);
    let act_order = open_at(&fixture("hf-tiny/llama_gptq_act_order"), ComputeDtype::Native);
    let graph = fused_for(&act_order.lower(LogitsFor::LastToken).unwrap(), Target::H200);
    let plan = gpu::build(&graph, Target::H200, 64).unwrap();
    let gathers = plan
        .launches
        .iter()
        .filter(|l| l.kernel.starts_with("gather_columns_"))
        .count();
    let layers = graph.nodes().iter().filter(|n| n.op.attention().is_some()).count();
    // q, k and v (k and v joined: the fixture orders q's columns apart), o, gate and up
    // (joined), down: five gathers a layer.
    assert_eq!(
        gathers,
        5 * layers,
        "the act-order Llama's plan gathers columns {gathers} times"
    );
    check_held_blocks("llama_w4a16", Target::H200, &[F8E4M3B32], 2e-2);
    check_held_blocks("qwen3_next_w4a16", Target::RtxPro6000, &[U4B32], 1e-1);
    let w8 = common::checkpoint_copies::with_bf16_scales(&fixture("hf-tiny/llama_w8a16"));
    check_held_blocks_at("llama_w8a16", w8.path(), Target::H200, &[quant::GgmlType::Q8_0], 2e-2);
}

/// FP4 checkpoints held as FP4 blocks run their plans as the CPU backend runs them:
/// compressed-tensors' NVFP4 Llama on the B200 (NVFP4's own GPU), ModelOpt's NVFP4 Qwen3-Next
/// (experts, Gated DeltaNet, attention; its shared expert's 48-column down projection
/// dequantized to f32) on Hopper, compressed-tensors' MXFP4 Llama on the RTX PRO 6000;
/// tolerances as for the integer checkpoints above.
#[test]
fn fp4_checkpoints_run_their_plans_as_the_cpu_backend_does() {
    use quant::GgmlType::F4E2M1B32;
    check_held_blocks("llama_nvfp4", Target::B200, &[F4E2M1B32], 2e-2);
    check_held_blocks("qwen3_next_nvfp4", Target::H200, &[F4E2M1B32], 1e-1);
    check_held_blocks("llama_mxfp4", Target::RtxPro6000, &[F4E2M1B32], 2e-2);
}

/// The checkpoint `family`, its weights held as they are stored, runs `target`'s plans as the
/// CPU backend runs it (`check_within`: steps after a short prompt within 1e-5, after a
/// 19-token prompt within `prefill_tolerance`), with at least two weights of each of `held_as`
/// in the plan's graph and nothing held twice.
fn check_held_blocks(family: &str, target: Target, held_as: &[quant::GgmlType], prefill_tolerance: f32) {
    let path = fixture(&format!("hf-tiny/{family}"));
    check_held_blocks_at(family, &path, target, held_as, prefill_tolerance);
}

/// [`check_held_blocks`] of the checkpoint at `path`.
fn check_held_blocks_at(
    family: &str,
    path: &std::path::Path,
    target: Target,
    held_as: &[quant::GgmlType],
    prefill_tolerance: f32,
) {
    let held = open_at(path, ComputeDtype::Native);
    let graph = fused_for(&held.lower(LogitsFor::LastToken).unwrap(), target);
    for &held_as in held_as {
        let format = quant::tensor::ir_dtype(held_as);
        let blocks = graph
            .nodes()
            .iter()
            .filter(|n| matches!(n.op, ir::Op::Weight { .. }) && n.dtype == format)
            .count();
        assert!(
            blocks >= 2,
            "{family}: the plan's graph has {blocks} weights of {format}"
        );
    }
    // The CPU backend multiplies 4-bit and Q8_0 blocks on its int8 kernels (int8 activations):
    // the plan is checked against the same weights dequantized, where the CPU computes in f32
    // as the plan's GEMVs do.
    let int8 = held_as
        .iter()
        .any(|&t| quant::u4_blocks::Size::of(t).is_some() || t == quant::GgmlType::Q8_0);
    let dequantized = int8.then(|| open_at(path, ComputeDtype::F32));
    check_within(
        family,
        &held,
        dequantized.as_ref().unwrap_or(&held),
        target,
        prefill_tolerance,
        1e-5,
    );
    assert_eq!(held.weights.converted_bytes(), 0, "{family}: nothing held twice");
}

/// How many kernels of `model`'s plan for `target` widen FP8 codes.
fn kernels_reading_fp8_codes(model: &Model, target: Target) -> usize {
    let graph = fused_for(&model.lower(LogitsFor::LastToken).unwrap(), target);
    let (_, kernels) = gpu::build_with_kernels(&graph, target, 64).unwrap();
    kernels
        .iter()
        .filter(|k| kernels_gen::cuda::emit(k).contains("bbc_fp8_to_f32("))
        .count()
}

/// Models quantized to FP8 as they load (`--quantization fp8`) run their plans as the CPU
/// backend runs them: Qwen3-Next's Gated DeltaNet projections, experts and shared expert, and
/// Gemma 4's stacked experts, as FP8 blocks of 32 under a bf16 model (embeddings and head
/// bf16): steps after a short prompt within 1e-5; after a 19-token prompt (bf16 tensor cores)
/// within 2e-2, Qwen3-Next's within 1e-1 (its router's choices follow the rounding, as in
/// [`check`]: 6.6e-2 measured, as there). The source holds no quantized copy after.
#[test]
fn fp8_quantized_on_load_models_run_their_plans_as_the_cpu_backend_does() {
    let qkvz = "model.layers.0.linear_attn.in_proj_qkvz.weight";
    for (family, target, quantized, prefill_tolerance) in [
        ("qwen3_next", Target::H200, qkvz, 1e-1),
        ("gemma4_moe", Target::B200, "model.layers.0.experts.gate_up_proj", 2e-2),
    ] {
        let mut spec = ModelSpec::for_weights(&fixture(&format!("hf-tiny/{family}")));
        spec.dtype = ComputeDtype::Bf16;
        spec.quantization = Some("fp8".into());
        let model = Model::open(spec).unwrap();
        assert_eq!(model.weights.describe(quantized).unwrap().0, quant::GgmlType::F8E4M3B32);
        let reads_codes = kernels_reading_fp8_codes(&model, target);
        assert!(reads_codes >= 2, "{family}: {reads_codes} kernels read FP8 codes");
        check_within(family, &model, &model, target, prefill_tolerance, 1e-5);
        assert_eq!(model.weights.converted_bytes(), 0, "{family}: nothing held twice");
    }
}

/// Over f32 heads, and over bf16 and half ones (their INT8 rows quantized from the values the
/// head holds, rounded from the f32 file, so the bounds hold for what is rescored).
#[test]
fn greedy_plans_with_the_int8_head_pick_the_exact_argmax() {
    // gemma4_kv_shared's logits are soft-capped: the head ranks the capped values.
    for family in ["llama", "gemma3", "gemma4_kv_shared"] {
        check_greedy(family, ComputeDtype::F32, Target::H200);
    }
    check_greedy("llama", ComputeDtype::F32, Target::RtxPro6000);
    for dtype in [ComputeDtype::Bf16, ComputeDtype::F16] {
        check_greedy("gemma3", dtype, Target::H200);
    }
}

/// The emulated device, except that after launches of `kernel` it adds 1 to the first element
/// of its last buffer argument (the output): a stand-in for a GPU kernel that is wrong; and
/// that it refuses allocations over `largest_alloc` bytes, as a device short of memory does.
struct FaultyDevice {
    device: EmulatorDevice,
    kernel: String,
    largest_alloc: usize,
}

impl PlanDevice for FaultyDevice {
    type Buffer = usize;
    fn alloc(&mut self, bytes: usize) -> runtime::Result<usize> {
        if bytes > self.largest_alloc {
            return Err(runtime::RuntimeError::Cuda(format!("out of memory for {bytes} bytes")));
        }
        self.device.alloc(bytes)
    }
    fn upload(&mut self, bytes: &[u8]) -> runtime::Result<usize> {
        self.device.upload(bytes)
    }
    fn write(&mut self, buffer: &usize, at: usize, bytes: &[u8]) -> runtime::Result<()> {
        self.device.write(buffer, at, bytes)
    }
    fn read(&mut self, buffer: &usize, range: std::ops::Range<usize>) -> runtime::Result<Vec<u8>> {
        self.device.read(buffer, range)
    }
    fn copy(&mut self, from: &usize, from_at: usize, to: &usize, to_at: usize, bytes: usize) -> runtime::Result<()> {
        self.device.copy(from, from_at, to, to_at, bytes)
    }
    fn launch(&mut self, kernel: &str, grid: u32, block: u32, args: &[DeviceArg<'_, usize>]) -> runtime::Result<()> {
        self.device.launch(kernel, grid, block, args)?;
        if kernel == self.kernel {
            let out = args.iter().rev().find_map(|a| match a {
                DeviceArg::Buffer(b, r) => Some((**b, r.start)),
                _ => None,
            });
            let (buffer, at) = out.expect("a buffer argument");
            let v = f32::from_le_bytes(self.device.read(&buffer, at..at + 4)?.try_into().unwrap());
            self.device.write(&buffer, at, &(v + 1.0).to_le_bytes())?;
        }
        Ok(())
    }
}

/// The lockstep comparison the GPU check runs (GPU against emulator), here with the emulator on
/// both sides: every launched kernel is reported, exact where both agree, and a wrong kernel
/// is named alone (outputs are made equal again after each launch, so errors do not spread).
#[test]
fn the_lockstep_comparison_names_exactly_the_wrong_kernel() {
    let model = open("llama", ComputeDtype::F32);
    let graph = model.lower(LogitsFor::LastToken).unwrap();
    let graph = fused_for(&graph, Target::H200);
    let (plan, kernels) = gpu::build_with_kernels(&graph, Target::H200, 64).unwrap();
    let wrong = plan
        .launches
        .iter()
        .find(|l| l.kernel.starts_with("rope"))
        .unwrap()
        .kernel
        .clone();
    let test = FaultyDevice {
        device: EmulatorDevice::new(kernels.clone()),
        kernel: wrong.clone(),
        largest_alloc: usize::MAX,
    };
    let device = CompareDevice::new(test, EmulatorDevice::new(kernels.clone()), &kernels);
    let gpu = PlanExecutor::new(device, plan.clone(), graph, &model.weights, &[], 64).unwrap();
    let mut seq = gpu.new_sequence();
    for ids in [vec![5u32, 9, 200, 17, 3], vec![42]] {
        gpu.step(&mut seq, &ids).unwrap();
    }
    let errors = gpu.with_device(|d| d.errors().clone()).unwrap();
    // The 5-row step takes the matmuls' few-rows GEMVs, the 1-row step their decode GEMVs.
    let launched: std::collections::BTreeSet<&String> = plan
        .launches
        .iter()
        .flat_map(|l| std::iter::once(&l.kernel).chain(&l.few_rows_kernel))
        .collect();
    assert_eq!(errors.keys().collect::<std::collections::BTreeSet<_>>(), launched);
    for (kernel, error) in &errors {
        // Each kernel ran in both steps, or in the one of its row count (the few-rows GEMVs).
        assert!(error.launches >= 1, "{kernel}: {error:?}");
        match kernel == &wrong {
            true => assert!(error.relative > 1e-3, "{kernel}: {error:?}"),
            false => assert_eq!(error.relative, 0.0, "{kernel} inherited the wrong kernel's error"),
        }
    }
}

/// A batched bf16 plan's prompts attend on the tensor cores over the paged pool: a step of
/// three prompts (one longer than a query tile, one a tile's rows, one of a few), then one
/// continuing the long prompt past its cached rows beside the second's first decode row (a
/// tile of one row), then a decode step (the split attention); every row's logits against the
/// CPU backend, each sequence in blocks of its own, shuffled. Gemma 3's sliding windows cut
/// the tiles' keys. The tolerance is the bf16 prefill's, widened for these longer prompts:
/// the rows the tensor-core GEMMs round to bf16 leave Gemma 3's logits up to 2.1e-2 from the
/// CPU's (which keeps f32 activations) with the split attention as well, and 1.8e-2 with this
/// one; the attention kernel's own precision is checked to 2e-3 on the emulator
/// (kernels-gen), and a plan passing it a wrong window is off by 1.4.
#[test]
fn batched_bf16_plans_attend_over_prompts_on_tensor_cores_like_the_cpu_backend() {
    use runtime::kv::BlockId;
    for family in ["llama", "gemma3"] {
        let model = open(family, ComputeDtype::Bf16);
        let graph = model.lower(LogitsFor::AllTokens).unwrap();
        let gpu_graph = fused_for(&graph, Target::H200);
        let cache = gpu::BatchedCache {
            blocks: 24,
            block_size: 16,
            sequences: 3,
        };
        let (plan, kernels) = gpu::build_batched(&gpu_graph, Target::H200, 144, cache).unwrap();
        let flash: Vec<String> = plan
            .kernels
            .iter()
            .filter(|k| k.name.starts_with("flash_attention"))
            .map(|k| k.name.clone())
            .collect();
        assert!(!flash.is_empty(), "{family}: no tensor-core attention in the plan");
        let gpu = EmulatorBackend::emulated(plan, kernels, gpu_graph, &model.weights, &[], 128).unwrap();
        let cpu = CpuBackend::new(graph, &model.weights, 128).unwrap();
        let mut pages = cpu.new_pages(cache.block_size);
        let tables: Vec<Vec<BlockId>> = (0..3u32)
            .map(|s| (0..8).rev().map(|b| BlockId(3 * b + s)).collect())
            .collect();
        let prompt = |len: u32, seed: u32| -> Vec<u32> { (0..len).map(|i| (seed + 37 * i) % 300).collect() };
        // Each sequence's (first position, ids), in table order.
        let steps: [Vec<(usize, Vec<u32>)>; 3] = [
            vec![(0, prompt(70, 5)), (0, prompt(64, 11)), (0, prompt(3, 17))],
            vec![(70, prompt(40, 23)), (64, vec![42])],
            vec![(110, vec![7]), (65, vec![9]), (3, vec![4])],
        ];
        // Whether each step attends on the tensor cores: sequences averaging 16 rows or more.
        let on_tensor_cores = [true, true, false];
        for (step, (segments, flash_step)) in steps.iter().zip(on_tensor_cores).enumerate() {
            let batch = batch_of(segments, &tables);
            let launched = || -> usize {
                flash
                    .iter()
                    .map(|k| gpu.with_device(|d| d.launches_of(k)).unwrap())
                    .sum()
            };
            let before = launched();
            let got = gpu.step_batch(&batch).unwrap();
            assert_eq!(launched() > before, flash_step, "{family}: step {step}");
            let want = cpu.step_batch(&mut pages, &batch).unwrap();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let error = relative_error(&g["logits"].data, &w["logits"].data);
                assert!(error <= 3e-2, "{family}: step {step}, sequence {i}: error {error}");
            }
        }
    }
}

/// A batched step's segments: each sequence's (first position, ids) with its block table.
fn batch_of<'a, T: AsRef<[runtime::kv::BlockId]>>(
    segments: &'a [(usize, Vec<u32>)],
    tables: &'a [T],
) -> Vec<runtime::kv::Segment<'a>> {
    segments
        .iter()
        .zip(tables)
        .enumerate()
        .map(|(i, ((start, ids), table))| runtime::kv::Segment {
            hidden_states: &[],
            table: table.as_ref(),
            start: *start,
            ids,
            state_slot: i,
            sampled_rows: 1,
            drafts: 0,
            snapshots: runtime::kv::StateSnapshots::NONE,
        })
        .collect()
}

/// A batched plan (continuous batching over one paged KV pool) on the emulator: two sequences
/// with interleaved blocks, prefilled together, then decoding together into new blocks, give
/// each row the logits the CPU backend gives in the same batched steps. GLM-5's indexer
/// chooses 8 of the first sequence's 10 and 11 positions, each row by its own position.
#[test]
fn batched_plans_keep_sequences_apart_like_the_cpu_backend() {
    use runtime::kv::{BlockId, Segment};
    for family in ["llama", "gemma3", "glm_moe_dsa"] {
        let model = open(family, ComputeDtype::F32);
        let graph = model.lower(LogitsFor::AllTokens).unwrap();
        let gpu_graph = fused_for(&graph, Target::H200);
        let cache = gpu::BatchedCache {
            blocks: 8,
            block_size: 4,
            sequences: 8,
        };
        let (plan, kernels) = gpu::build_batched(&gpu_graph, Target::H200, 32, cache).unwrap();
        let gpu = EmulatorBackend::emulated(plan, kernels, gpu_graph, &model.weights, &[], 64).unwrap();
        let last_graph = fused_for(&model.lower(LogitsFor::LastToken).unwrap(), Target::H200);
        let (plan, kernels) = gpu::build_batched(&last_graph, Target::H200, 32, cache).unwrap();
        let per_sequence = EmulatorBackend::emulated(plan, kernels, last_graph, &model.weights, &[], 64).unwrap();
        let cpu = CpuBackend::new(graph, &model.weights, 64).unwrap();
        let mut pages = cpu.new_pages(cache.block_size);
        let tables = [
            [BlockId(3), BlockId(0), BlockId(6)],
            [BlockId(5), BlockId(1), BlockId(2)],
        ];
        let prompts: [Vec<u32>; 2] = [
            (0..10).map(|i| 5 + 11 * i).collect(),
            (0..3).map(|i| 200 + 3 * i).collect(),
        ];
        let steps: [[(usize, Vec<u32>); 2]; 2] = [
            [(0, prompts[0].clone()), (0, prompts[1].clone())],
            [(10, vec![42]), (3, vec![17])],
        ];
        for (step, segments) in steps.iter().enumerate() {
            let batch = batch_of(segments, &tables);
            let got = gpu.step_batch(&batch).unwrap();
            let want = cpu.step_batch(&mut pages, &batch).unwrap();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let error = relative_error(&g["logits"].data, &w["logits"].data);
                assert!(error <= 1e-4, "{family}: step {step}, sequence {i}: error {error}");
            }
            // The same step again (it rewrites the same cache positions with the same values),
            // reading back only each sequence's last row, as serving does.
            let last = gpu.step_batch_last_rows(&batch).unwrap();
            // And on the plan that gathers each sequence's last row before the head.
            let gathered = per_sequence.step_batch(&batch).unwrap();
            for ((g, l), p) in got.iter().zip(&last).zip(&gathered) {
                let logits = &g["logits"];
                assert_eq!(l["logits"].shape, vec![1, logits.row_len()]);
                assert_eq!(l["logits"].data, logits.row(logits.rows() - 1));
                assert_eq!(p["logits"].shape, vec![1, logits.row_len()]);
                let error = relative_error(&p["logits"].data, logits.row(logits.rows() - 1));
                assert!(error <= 1e-5, "{family}: step {step}: gathered rows differ by {error}");
            }
        }
        // Out-of-range block ids and tables too short for the step are refused.
        let short = [BlockId(0)];
        let ids = [1u32; 6];
        let too_long = Segment {
            hidden_states: &[],
            table: &short,
            start: 0,
            ids: &ids,
            state_slot: 0,
            sampled_rows: 1,
            drafts: 0,
            snapshots: runtime::kv::StateSnapshots::NONE,
        };
        assert!(gpu.step_batch(&[too_long]).is_err());
        let outside = [BlockId(99)];
        assert!(gpu
            .step_batch(&[Segment {
                hidden_states: &[],
                table: &outside,
                start: 0,
                ids: &ids[..1],
                state_slot: 0,
                sampled_rows: 1,
                drafts: 0,
                snapshots: runtime::kv::StateSnapshots::NONE,
            }])
            .is_err());
        // So are state snapshots where the plan keeps no places for them.
        let table = [BlockId(0)];
        let saves = [runtime::kv::StateSave {
            positions: 1,
            snapshot: 0,
        }];
        let snapshotting = Segment {
            hidden_states: &[],
            table: &table,
            start: 0,
            ids: &ids[..1],
            state_slot: 0,
            sampled_rows: 1,
            drafts: 0,
            snapshots: runtime::kv::StateSnapshots {
                restore: None,
                save: &saves,
            },
        };
        let refused = gpu.step_batch(&[snapshotting]).unwrap_err().to_string();
        assert!(refused.contains("past the 0 this plan keeps"), "{refused}");
    }
}

/// The serving engine (scheduler, block tables, prefix cache, sampling) on a batched GPU plan
/// run by the emulator generates, for concurrent greedy requests sharing a prefix, exactly the
/// tokens it generates on the CPU backend: `bbc serve` on a GPU artifact, without the GPU. With
/// the serving plan `bbc compile` writes (`next_token` beside the logits), steps whose requests
/// are all plain greedy read back only token ids; requests that want log-probabilities read the
/// logits, with the same tokens. Over the model's f32 caches and over FP8 ones (both sides'
/// pages, and the prefix cache's blocks, holding FP8 codes; the prompts, shorter than 16 rows,
/// attend through the split pass in f32).
#[test]
fn the_serving_engine_on_a_batched_plan_generates_what_it_generates_on_the_cpu() {
    for cache in [models::KvCacheDtype::Auto, models::KvCacheDtype::Fp8] {
        let mut spec = ModelSpec::for_weights(&fixture("hf-tiny/llama"));
        spec.dtype = ComputeDtype::F32;
        spec.kv_cache_dtype = cache;
        serving_engine_generates_on_a_batched_plan_what_it_generates_on_the_cpu(&Model::open(spec).unwrap());
    }
}

fn serving_engine_generates_on_a_batched_plan_what_it_generates_on_the_cpu(model: &Model) {
    use runtime::serving::ServingEngine;
    let graph = model.lower(LogitsFor::AllTokens).unwrap();
    // A token budget above the 32 rows the plan is built for: the engine lowers it to 32 for
    // the GPU backend (else its first step, four prompts at once, would be refused).
    let config = serving_config(100, 24);
    let (gpu_graph, plan, kernels) = serving_plan(model, &config, config.max_running);
    let prompts: Vec<Vec<u32>> = (0..5u32)
        .map(|i| {
            [9, 8, 7, 6, 5, 4, 3, 2]
                .into_iter()
                .chain((0..2 + i).map(|j| 30 + 17 * i + j))
                .collect()
        })
        .collect();
    let plain = runtime::SamplingParams::default();
    let with_logprobs = runtime::SamplingParams {
        logprobs: Some(2),
        ..plain
    };
    let cpu = CpuBackend::new(graph, &model.weights, 64).unwrap();
    let mut on_cpu = ServingEngine::new(cpu, config);
    let want = serve_all(&mut on_cpu, &prompts, plain);
    for (params, greedy_steps) in [(plain, true), (with_logprobs, false)] {
        // Decode batches run as graphs, as `bbc serve` runs them on a GPU.
        let gpu = emulated_serving(model, &gpu_graph, &plan, &kernels).capture_graphs_up_to(config.max_running);
        let mut on_gpu = ServingEngine::new(Counted::new(gpu), config);
        assert_eq!(serve_all(&mut on_gpu, &prompts, params), want, "{params:?}");
        let (greedy, full) = on_gpu.backend().counts();
        match greedy_steps {
            true => assert!(greedy > 0 && full == 0, "{greedy} greedy steps, {full} with logits"),
            false => assert!(greedy == 0 && full > 0, "{greedy} greedy steps, {full} with logits"),
        }
        assert!(
            on_gpu.scheduler().prefix_cache_stats().hit > 0,
            "the shared prefix was reused"
        );
        assert_eq!(on_gpu.scheduler().used_blocks(), 0);
    }
}

/// A draft model on a batched plan (a GPU target's; here on the emulator) proposes what it
/// proposes on the CPU backend, round after round of partly accepted drafts, through the
/// plan's greedy ids (no logits read back); as the drafter of an engine on the CPU backend it
/// leaves the tokens as they are without drafts, its drafts accepted. The same with a draft
/// model with recurrent state (the tiny Qwen3.5 under YaRN drafting for the tiny Qwen3.5),
/// whose plan goes back to each sequence's snapshot in device memory past refused drafts.
#[test]
fn a_draft_model_on_a_batched_plan_drafts_as_on_the_cpu() {
    for (draft, target) in [("llama_rope_yarn", "llama"), ("qwen3_5_rope_yarn", "qwen3_5")] {
        draft_model_on_a_batched_plan_drafts_as_on_the_cpu(draft, target);
    }
}

fn draft_model_on_a_batched_plan_drafts_as_on_the_cpu(draft: &str, target: &str) {
    use runtime::serving::{DraftModel, NgramConfig, ServingEngine};
    let draft = open(draft, ComputeDtype::F32);
    let config = serving_config(32, 48);
    let (gpu_graph, plan, kernels) = serving_plan(&draft, &config, config.max_running);
    let on_plan = || {
        let gpu = emulated_serving(&draft, &gpu_graph, &plan, &kernels)
            .capture_graphs_up_to(config.max_running)
            .keep_state_snapshots(config.max_running)
            .unwrap();
        DraftModel::new(Counted::new(gpu), config.kv_blocks, config.block_size, 32, 64).unwrap()
    };
    let on_cpu = || {
        let graph = draft.lower(LogitsFor::LastToken).unwrap();
        let cpu = CpuBackend::new(graph, &draft.weights, 64).unwrap();
        DraftModel::new(cpu, config.kv_blocks, config.block_size, 32, 64).unwrap()
    };
    let (mut gpu, mut cpu) = (on_plan(), on_cpu());
    let sequences = vec![(0..19u32).map(|j| 5 + 11 * j).collect(), vec![3, 1, 4], vec![200]];
    common::drafting::propose_alike(&mut cpu, &mut gpu, sequences, 4, target);
    let (greedy, full) = gpu.backend().counts();
    assert!(greedy > 0 && full == 0, "{greedy} greedy passes, {full} with logits");

    let target = open(target, ComputeDtype::F32);
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|i| (0..4 + 5 * i).map(|j| 7 + 13 * i + 3 * j).collect())
        .collect();
    let speculating = SchedulerConfig {
        speculation: NgramConfig {
            tokens: 3,
            min: 1,
            max: 1,
        },
        ..config
    };
    let target_backend = || CpuBackend::new(target.lower(LogitsFor::LastToken).unwrap(), &target.weights, 64).unwrap();
    let want = serve_all(
        &mut ServingEngine::new(target_backend(), config),
        &prompts,
        Default::default(),
    );
    let mut engine = ServingEngine::new(target_backend(), speculating);
    assert!(engine.use_drafter(Box::new(on_plan())));
    let served = bbc::gpu_check::kernels::serve_all_counting(&mut engine, &prompts, Default::default(), 6).unwrap();
    assert_eq!(served.tokens, want);
    assert!(
        served.accepted > 0,
        "{} of {} drafts accepted",
        served.accepted,
        served.drafted
    );
}

/// A greedy request whose logits go through a processor (here `logit_bias`) never takes the
/// plan's greedy-ids shortcut, which would skip the processor: on a batched plan it generates
/// what it generates on the CPU backend with the same processor, from logits read back.
#[test]
fn processed_logits_keep_greedy_requests_off_the_plans_argmax() {
    use runtime::serving::{LogitBias, LogitsProcessor, ServingEngine};
    let model = open("llama", ComputeDtype::F32);
    let config = serving_config(100, 24);
    let (gpu_graph, plan, kernels) = serving_plan(&model, &config, config.max_running);
    let prompts: Vec<Vec<u32>> = (0..3u32).map(|i| vec![9, 8, 7, 30 + i]).collect();
    // Token 77 a little ahead: chosen where it is near the top, not everywhere.
    let bias = || -> Vec<Box<dyn LogitsProcessor>> { vec![Box::new(LogitBias(vec![(77, 4.0)]))] };
    fn run<B: runtime::serving::PagedBackend>(
        engine: &mut ServingEngine<B>,
        prompts: &[Vec<u32>],
        processors: impl Fn() -> Vec<Box<dyn LogitsProcessor>>,
    ) -> Vec<Vec<u32>> {
        let params = runtime::SamplingParams::default();
        let ids: Vec<_> = prompts
            .iter()
            .map(|p| {
                engine
                    .add_processed(p.clone(), 6, vec![], params, processors(), 0)
                    .unwrap()
            })
            .collect();
        let mut got = std::collections::HashMap::new();
        while !engine.scheduler().is_idle() {
            got.extend(
                engine
                    .step()
                    .unwrap()
                    .finished
                    .into_iter()
                    .map(|d| (d.seq, d.generated)),
            );
        }
        ids.iter().map(|id| got[id].clone()).collect()
    }
    let graph = model.lower(LogitsFor::AllTokens).unwrap();
    let mut on_cpu = ServingEngine::new(CpuBackend::new(graph, &model.weights, 64).unwrap(), config);
    let (plain, want) = (run(&mut on_cpu, &prompts, Vec::new), run(&mut on_cpu, &prompts, bias));
    assert_ne!(plain, want, "the bias changes some token");
    let gpu = EmulatorBackend::emulated(plan, kernels, gpu_graph, &model.weights, &[], 64)
        .unwrap()
        .capture_graphs_up_to(config.max_running);
    let mut on_gpu = ServingEngine::new(Counted::new(gpu), config);
    assert_eq!(run(&mut on_gpu, &prompts, bias), want);
    let (greedy, full) = on_gpu.backend().counts();
    assert!(greedy == 0 && full > 0, "{greedy} greedy steps, {full} with logits");
}

/// A request scoring its prompt (`prompt_logprobs`) on a batched plan gets the CPU backend's
/// log-probabilities at every prompt position, its prompt chunked; for a model with
/// recurrent state too (its scored rows keep no checkpoints), beside a greedy request.
#[test]
fn batched_plans_score_prompts_like_the_cpu_backend() {
    use runtime::serving::{PagedBackend, ServingEngine};
    fn scores<B: PagedBackend>(engine: &mut ServingEngine<B>, prompt: &[u32]) -> Vec<runtime::TokenLogprobs> {
        let scoring = runtime::SamplingParams {
            prompt_logprobs: Some(2),
            ..Default::default()
        };
        let id = engine.add(prompt.to_vec(), 3, vec![], scoring).unwrap();
        engine.add(vec![3, 1, 4, 1, 5], 5, vec![], Default::default()).unwrap();
        let mut got = Vec::new();
        while !engine.scheduler().is_idle() {
            let out = engine.step().unwrap();
            got.extend(
                out.prompt_logprobs
                    .into_iter()
                    .filter(|p| p.seq == id)
                    .flat_map(|p| p.logprobs),
            );
        }
        got
    }
    for family in ["llama", "qwen3_5"] {
        let model = open(family, ComputeDtype::F32);
        let config = serving_config(8, 24);
        let (gpu_graph, plan, kernels) = serving_plan(&model, &config, 3);
        let prompt: Vec<u32> = (0..19u32).map(|j| (17 + 41 * j) % 300).collect();
        let cpu = CpuBackend::new(model.lower(LogitsFor::AllTokens).unwrap(), &model.weights, 64).unwrap();
        let want = scores(&mut ServingEngine::new(cpu, config), &prompt);
        let gpu = EmulatorBackend::emulated(plan, kernels, gpu_graph, &model.weights, &[], 64)
            .unwrap()
            .capture_graphs_up_to(config.max_running);
        let mut on_gpu = ServingEngine::new(Counted::new(gpu), config);
        let got = scores(&mut on_gpu, &prompt);
        assert_eq!(got.len(), prompt.len() - 1, "{family}");
        for (at, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g.logprob - w.logprob).abs() < 1e-4,
                "{family} position {}: {g:?} vs {w:?}",
                at + 1
            );
            assert_eq!(g.top[0].0, w.top[0].0, "{family} position {}", at + 1);
        }
    }
}

/// The serving engine on batched plans of Qwen3.5 (its DeltaNet layers' states in slots on
/// the device), GLM-4.5 (MoE layers: each row routed on its own), Qwen3-Next (both) and
/// Gemma 4 with KV-shared layers (attending for each sequence's last row alone) generates what
/// it generates on the CPU backend, for more requests than run at once (finished sequences'
/// slots start new ones afresh) and a KV pool small enough that sequences are preempted and
/// recomputed from position 0. The plans keep states for 3 sequences: the engine runs no more
/// at once than that where the model has recurrent layers, and drops the prefix cache.
#[test]
fn the_serving_engine_runs_hybrid_and_moe_plans_like_the_cpu_backend() {
    use runtime::serving::ServingEngine;
    for (family, recurrent) in [
        ("qwen3_5", true),
        ("glm4_moe", false),
        ("qwen3_next", true),
        // KV-shared layers attending for each sequence's last row alone.
        ("gemma4_kv_shared", false),
    ] {
        let model = open(family, ComputeDtype::F32);
        let graph = model.lower(LogitsFor::AllTokens).unwrap();
        // Snapshots of recurrent states asked for: the CPU backend keeps them, a GPU plan does
        // not (the engine turns them off, and with them the prefix cache of hybrid models).
        let config = SchedulerConfig {
            state_cache: runtime::serving::StateCacheConfig::every(4, 4),
            ..serving_config(24, 9)
        };
        let (gpu_graph, plan, kernels) = serving_plan(&model, &config, 3);
        let prompts: Vec<Vec<u32>> = (0..6u32)
            .map(|i| (0..5 + 2 * i).map(|j| (11 + 29 * i + 7 * j) % 300).collect())
            .collect();
        let plain = runtime::SamplingParams::default();
        let cpu = CpuBackend::new(graph, &model.weights, 64).unwrap();
        let want = serve_all(&mut ServingEngine::new(cpu, config), &prompts, plain);
        let gpu = EmulatorBackend::emulated(plan, kernels, gpu_graph, &model.weights, &[], 64)
            .unwrap()
            .capture_graphs_up_to(config.max_running);
        let mut on_gpu = ServingEngine::new(Counted::new(gpu), config);
        let engine_config = on_gpu.scheduler().config();
        let running = if recurrent { 3 } else { 4 };
        assert_eq!(engine_config.max_running, running, "{family}");
        assert_eq!(engine_config.recurrent_state, recurrent, "{family}");
        assert_eq!(engine_config.state_cache.capacity, 0, "{family}");
        assert_eq!(serve_all(&mut on_gpu, &prompts, plain), want, "{family}");
        let starts = on_gpu.backend().starts.get();
        assert!(
            starts > prompts.len(),
            "{family}: {starts} starts: the pool was small enough to preempt"
        );
        assert_eq!(on_gpu.scheduler().used_blocks(), 0);
    }
}

/// Hybrid models on a batched plan that keeps snapshots of recurrent states
/// (`keep_state_snapshots`): requests sharing a prompt prefix start from a snapshot, restored
/// into their slot on the device (saved at the end of a step's rows: prompt chunks end at
/// multiples of the interval), and generate what they generate on the CPU backend, which
/// saves snapshots after any row.
#[test]
fn hybrid_plans_start_shared_prefixes_from_state_snapshots_like_the_cpu_backend() {
    use runtime::serving::{PagedBackend, ServingEngine, StateCacheConfig, StateSnapshotting};
    for family in ["qwen3_5", "qwen3_next"] {
        let model = open(family, ComputeDtype::F32);
        let graph = model.lower(LogitsFor::AllTokens).unwrap();
        let config = SchedulerConfig {
            state_cache: StateCacheConfig::every(8, 6),
            ..serving_config(24, 48)
        };
        let (gpu_graph, plan, kernels) = serving_plan(&model, &config, 3);
        let prompts = bbc::gpu_check::kernels::prompts_sharing_a_prefix(21, 4);
        let cpu = CpuBackend::new(graph, &model.weights, 64).unwrap();
        let mut on_cpu = ServingEngine::new(cpu, config);
        let (want, _) = serve_first_then_rest(&mut on_cpu, &prompts).unwrap();
        let gpu = EmulatorBackend::emulated(plan, kernels, gpu_graph, &model.weights, &[], 64)
            .unwrap()
            .capture_graphs_up_to(config.max_running)
            .keep_state_snapshots(6)
            .unwrap();
        assert_eq!(gpu.snapshots_states(), StateSnapshotting::AtSegmentEnds { places: 6 });
        let mut on_gpu = ServingEngine::new(gpu, config);
        assert!(on_gpu.scheduler().config().state_cache.at_segment_ends, "{family}");
        let (got, _) = serve_first_then_rest(&mut on_gpu, &prompts).unwrap();
        assert_eq!(got, want, "{family}");
        // The three later prompts from the snapshot at 16, on both.
        for hit in [
            on_cpu.scheduler().prefix_cache_stats().hit,
            on_gpu.scheduler().prefix_cache_stats().hit,
        ] {
            assert!(hit >= 3 * 16, "{family}: {hit} positions hit");
        }
        assert_eq!(on_gpu.scheduler().used_blocks(), 0);
    }
}

/// A recurrent model's batched plan refuses, before running anything, a step whose sequences
/// share a state slot or name one past the plan's, and a segment verifying more drafts than
/// its states keep checkpoints for (none until asked: it could not take back refused drafts):
/// errors, not corrupted states.
#[test]
fn recurrent_state_slots_are_checked_per_step() {
    use runtime::kv::BlockId;
    let model = open("qwen3_5", ComputeDtype::F32);
    let config = serving_config(32, 8);
    let (gpu_graph, plan, kernels) = serving_plan(&model, &config, 2);
    let fresh = || emulated_serving(&model, &gpu_graph, &plan, &kernels);
    let gpu = fresh();
    assert!(gpu.samples_several_rows());
    let tables = [
        [BlockId(0), BlockId(1), BlockId(2)],
        [BlockId(3), BlockId(4), BlockId(5)],
    ];
    let segments = [(0, vec![5, 6]), (0, vec![7])];
    let mut batch = batch_of(&segments, &tables);
    assert!(gpu.step_batch(&batch).is_ok());
    batch[1].state_slot = 0;
    let shared = gpu.step_batch(&batch).unwrap_err().to_string();
    assert!(shared.contains("share recurrent state slot 0"), "{shared}");
    batch[1].state_slot = 2;
    let past = gpu.step_batch(&batch).unwrap_err().to_string();
    assert!(past.contains("slot 2 is past the plan's 2"), "{past}");
    batch[1].state_slot = 1;
    // Two rows' logits (a prompt scored), no drafts: nothing to keep for a rewind.
    batch[0].sampled_rows = 2;
    assert!(gpu.step_batch(&batch).is_ok());
    batch[0].drafts = 1;
    let drafts = gpu.step_batch(&batch).unwrap_err().to_string();
    assert!(drafts.contains("keep checkpoints for 0"), "{drafts}");
    let gpu = gpu.verify_drafts_up_to(1).unwrap();
    assert_eq!(gpu.draft_checkpoints(), 1);
    // Once a step is captured as a graph (holding the checkpoints' address) they stay put.
    let captured = fresh().capture_graphs_up_to(4);
    captured.step_batch(&batch_of(&[(0, vec![5])], &tables)).unwrap();
    let late = captured
        .verify_drafts_up_to(2)
        .err()
        .expect("refused after a capture")
        .to_string();
    assert!(late.contains("before the first step captured"), "{late}");
    assert!(gpu.step_batch(&batch).is_ok());
    batch[0].sampled_rows = 3;
    batch[0].drafts = 2;
    batch[0].ids = &[5, 6, 7];
    let more = gpu.step_batch(&batch).unwrap_err().to_string();
    assert!(more.contains("verifies 2 drafted tokens"), "{more}");
    let indexed = fresh().verify_drafts_up_to(usize::MAX / 2);
    assert!(indexed.is_err());
    // A device without the memory for the checkpoints: the error says what they were for.
    let state_bytes = plan.recurrent_states.iter().map(|l| l.len * 4).max().unwrap();
    let device = FaultyDevice {
        device: EmulatorDevice::new(kernels.clone()),
        kernel: String::new(),
        largest_alloc: usize::MAX,
    };
    let short = PlanExecutor::new(device, plan.clone(), gpu_graph.clone(), &model.weights, &[], 64).unwrap();
    short.with_device_mut(|d| d.largest_alloc = 2 * state_bytes).unwrap();
    let err = short
        .verify_drafts_up_to(3)
        .err()
        .expect("3 drafts for 2 sequences do not fit")
        .to_string();
    assert!(
        err.contains("3 copies of the recurrent states of 2 sequences") && err.contains("draft fewer tokens"),
        "{err}"
    );
    // Snapshots: saved only at a segment's end, into places the plan keeps, as many as fit.
    let too_many = fresh().keep_state_snapshots(usize::MAX);
    assert!(too_many.is_err());
    batch[0].sampled_rows = 1;
    batch[0].drafts = 0;
    let gpu = gpu.keep_state_snapshots(2).unwrap();
    let mid = [runtime::kv::StateSave {
        positions: 1,
        snapshot: 0,
    }];
    batch[0].snapshots.save = &mid;
    let inside = gpu.step_batch(&batch).unwrap_err().to_string();
    assert!(inside.contains("only at the end of a segment"), "{inside}");
    let past = [runtime::kv::StateSave {
        positions: 2,
        snapshot: 2,
    }];
    batch[0].snapshots.save = &past;
    let place = gpu.step_batch(&batch).unwrap_err().to_string();
    assert!(place.contains("snapshot 2 is past the 2 this plan keeps"), "{place}");
}

/// Speculative decoding on a batched GPU plan: the engine drafts by prompt lookup and the plan
/// verifies each sequence's drafts in one step (the rows it samples gathered before the head,
/// their argmax read back as ids, steps of every row sampled replayed as graphs), and every
/// request generates exactly the tokens it generates on the CPU backend without speculation;
/// some drafts are accepted (and, for Llama, some refused). Gemma 4's KV-shared layers attend
/// for the sampled rows, each with its own position and table.
#[test]
fn speculative_decoding_on_a_batched_plan_keeps_every_token() {
    for family in ["llama", "gemma4_kv_shared"] {
        speculative_decoding_keeps_every_token(family);
    }
}

/// Hybrid models on a batched plan verify drafts too: the DeltaNet kernels keep each
/// sequence's state after its sampled rows but the last (`verify_drafts_up_to`), and where
/// drafts are refused the engine has the plan copy the state after the last row kept back
/// into the sequence's slot. Every request generates what it generates on the CPU backend
/// without speculation, with drafts both accepted and refused (as `bbc gpu-check`'s graphs
/// section checks on hardware, for the tiny Qwen3.5), and again where the plan keeps
/// checkpoints for fewer drafts than prompt lookup proposes.
#[test]
fn speculative_decoding_on_hybrid_plans_rewinds_refused_drafts() {
    use bbc::gpu_check::kernels::{self as check, DRAFTED_TOKENS};
    use runtime::serving::{NgramConfig, ServingEngine};
    for (family, patterns) in [
        ("qwen3_5", check::QWEN3_5_DRAFTED),
        ("qwen3_next", check::QWEN3_NEXT_DRAFTED),
    ] {
        let model = open(family, ComputeDtype::F32);
        let config = check::hybrid_serving(check::DRAFTING);
        let plain = SchedulerConfig {
            speculation: NgramConfig::OFF,
            ..config
        };
        let prompts = check::periodic_prompts(&patterns);
        let cpu = CpuBackend::new(model.lower(LogitsFor::AllTokens).unwrap(), &model.weights, 64).unwrap();
        let want = greedy_tokens(&mut ServingEngine::new(cpu, plain), &prompts, DRAFTED_TOKENS);
        let (gpu_graph, plan, kernels) = serving_plan(&model, &config, config.max_running);
        let plan_keeping = |checkpoints| {
            emulated_serving(&model, &gpu_graph, &plan, &kernels)
                .capture_graphs_up_to(config.max_running * 4)
                .verify_drafts_up_to(checkpoints)
                .unwrap()
        };
        let mut on_gpu = ServingEngine::new(plan_keeping(3), config);
        let (drafted, accepted) = speculating_serves(&mut on_gpu, &prompts, DRAFTED_TOKENS, &want, family);
        assert!(
            accepted > 0 && drafted > accepted,
            "{family}: {accepted} of {drafted} drafted tokens accepted; both kinds were meant to happen"
        );
        // A plan keeping checkpoints for fewer drafts than prompt lookup proposes: the engine
        // caps every sequence's drafts at them (the plan refuses a step carrying more).
        let mut capped = ServingEngine::new(plan_keeping(2), config);
        assert_eq!(capped.scheduler().draft_cap(), 2, "{family}");
        let (drafted, _) = speculating_serves(&mut capped, &prompts, DRAFTED_TOKENS, &want, family);
        assert!(drafted > 0, "{family}: nothing drafted under the cap");
    }
}

/// Forced drafts (a grammar's proposals) on batched plans, speculation off: on the tiny
/// Llama's, six-token proposals verified whole; on the tiny Qwen3.5's, keeping checkpoints
/// for two drafts a sequence, cut to the two it can rewind; the tokens the CPU backend's.
#[test]
fn forced_drafts_on_batched_plans_stay_within_what_they_verify() {
    use bbc::gpu_check::kernels as check;
    use runtime::serving::NgramConfig;
    let llama = open("llama", ComputeDtype::F32);
    let config = serving_config(32, 64);
    let (graph, plan, kernels) = serving_plan(&llama, &config, config.max_running);
    let gpu = EmulatorBackend::emulated(plan, kernels, graph, &llama.weights, &[], 64).unwrap();
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|i| (0..9).map(|j| 30 + 5 * i + 3 * j).collect())
        .collect();
    let (drafted, accepted) = serves_forced_drafts(&llama, gpu, config, &prompts);
    assert!(
        drafted > 12 && accepted == drafted,
        "llama: {accepted} of {drafted} accepted"
    );

    let qwen = open("qwen3_5", ComputeDtype::F32);
    let config = SchedulerConfig {
        speculation: NgramConfig::OFF,
        ..check::hybrid_serving(check::DRAFTING)
    };
    let (graph, plan, kernels) = serving_plan(&qwen, &config, config.max_running);
    let gpu = EmulatorBackend::emulated(plan, kernels, graph, &qwen.weights, &[], 64)
        .unwrap()
        .verify_drafts_up_to(2)
        .unwrap();
    let prompts = check::periodic_prompts(&check::QWEN3_5_DRAFTED);
    let (drafted, accepted) = serves_forced_drafts(&qwen, gpu, config, &prompts);
    assert!(
        drafted > 0 && accepted == drafted,
        "qwen3_5: {accepted} of {drafted} accepted"
    );
}

/// `prompts` served greedily, 12 tokens each, on `gpu`, each sequence proposing as forced
/// drafts the tokens it takes on the CPU backend (where it serves without proposals); checked
/// to take those tokens. The tokens drafted and accepted.
fn serves_forced_drafts<B: runtime::serving::PagedBackend>(
    model: &Model,
    gpu: B,
    config: SchedulerConfig,
    prompts: &[Vec<u32>],
) -> (usize, usize) {
    use common::drafting::Foreseeing;
    use runtime::serving::ServingEngine;
    let cpu = CpuBackend::new(model.lower(LogitsFor::AllTokens).unwrap(), &model.weights, 64).unwrap();
    let want = greedy_tokens(&mut ServingEngine::new(cpu, config), prompts, 12);
    let mut engine = ServingEngine::new(gpu, config);
    let ids: Vec<_> = prompts
        .iter()
        .zip(&want)
        .map(|(prompt, tokens)| {
            let foreseeing: Box<dyn runtime::LogitsProcessor> = Box::new(Foreseeing::new(tokens.clone(), 0));
            let greedy = runtime::SamplingParams::default();
            engine
                .add_processed(prompt.clone(), 12, vec![], greedy, vec![foreseeing], 0)
                .unwrap()
        })
        .collect();
    let (mut drafted, mut accepted, mut got) = (0, 0, std::collections::HashMap::new());
    while !engine.scheduler().is_idle() {
        let out = engine.step().unwrap();
        drafted += out.drafted;
        accepted += out.accepted;
        got.extend(out.finished.into_iter().map(|d| (d.seq, d.generated)));
    }
    let got: Vec<Vec<u32>> = ids.iter().map(|id| got[id].clone()).collect();
    assert_eq!(got, want);
    (drafted, accepted)
}

/// The mechanism beneath, on the device: after a step verifying three drafts, the plan's
/// rewind leaves a sequence exactly where one that ran only the rows kept is (its next step's
/// logits are bit for bit the same), for every `kept`: both the convolution's window (reaching
/// back into the state before the step where fewer rows were kept than it is wide) and the
/// delta rule's matrix come back from the checkpoints.
#[test]
fn a_rewound_state_on_the_device_continues_like_one_that_never_saw_the_refused_drafts() {
    use runtime::kv::{BlockId, Segment};
    use runtime::serving::PagedBackend;
    for family in ["qwen3_5", "qwen3_next"] {
        let model = open(family, ComputeDtype::F32);
        let (gpu_graph, plan, kernels) = serving_plan(&model, &serving_config(32, 16), 2);
        let gpu = EmulatorBackend::emulated(plan, kernels, gpu_graph, &model.weights, &[], 64)
            .unwrap()
            .verify_drafts_up_to(3)
            .unwrap();
        let (prompt, verified, next) = ([5u32, 40, 77, 120, 3, 9, 250, 31, 64, 200], [44u32, 17, 93, 141], 58u32);
        // Slot 0 verifies and rewinds, slot 1 runs only the rows kept; their own blocks.
        let tables: [Vec<BlockId>; 2] = [(0..4).map(BlockId).collect(), (4..8).map(BlockId).collect()];
        let step = |slot: usize, start: usize, ids: &[u32], sampled_rows: usize| {
            let segment = Segment {
                hidden_states: &[],
                table: &tables[slot],
                start,
                ids,
                state_slot: slot,
                sampled_rows,
                drafts: sampled_rows - 1,
                snapshots: runtime::kv::StateSnapshots::NONE,
            };
            let mut out = gpu.step_batch(&[segment]).unwrap();
            out.remove(0).remove("logits").unwrap().data
        };
        let mut pages = PagedBackend::new_pages(&gpu, 4);
        let end = prompt.len();
        for kept in 1..=4 {
            step(0, 0, &prompt, 1);
            step(0, end, &verified, 4);
            gpu.rewind_state(&mut pages, 0, 4, kept).unwrap();
            step(1, 0, &prompt, 1);
            step(1, end, &verified[..kept], 1);
            assert_eq!(
                step(0, end + kept, &[next], 1),
                step(1, end + kept, &[next], 1),
                "{family}: {kept} of 4 sampled rows kept"
            );
        }
        assert!(gpu.rewind_state(&mut pages, 0, 4, 0).is_err() && gpu.rewind_state(&mut pages, 0, 4, 5).is_err());
        assert!(
            gpu.rewind_state(&mut pages, 0, 5, 2).is_err(),
            "past the checkpoints kept"
        );
    }
}

fn speculative_decoding_keeps_every_token(family: &str) {
    use runtime::serving::ServingEngine;
    let model = open(family, ComputeDtype::F32);
    let graph = model.lower(LogitsFor::AllTokens).unwrap();
    let plain = serving_config(32, 64);
    let speculative = SchedulerConfig {
        speculation: bbc::gpu_check::kernels::DRAFTING,
        ..plain
    };
    let (gpu_graph, plan, kernels) = serving_plan(&model, &plain, plain.max_running);
    // Prompts that repeat themselves, so lookups find drafts.
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|i| (0..12).map(|j| 40 + 7 * i + (j % (3 + i))).collect())
        .collect();
    let cpu = CpuBackend::new(graph, &model.weights, 64).unwrap();
    let want = greedy_tokens(&mut ServingEngine::new(cpu, plain), &prompts, 12);
    let gpu = EmulatorBackend::emulated(plan, kernels, gpu_graph, &model.weights, &[], 64)
        .unwrap()
        .capture_graphs_up_to(32);
    let mut on_gpu = ServingEngine::new(Counted::new(gpu), speculative);
    let (drafted, accepted) = speculating_serves(&mut on_gpu, &prompts, 12, &want, family);
    assert!(
        accepted > 0 && (drafted > accepted || family != "llama"),
        "{family}: {accepted} of {drafted} drafted tokens accepted"
    );
    let (greedy, full) = on_gpu.backend().counts();
    assert!(greedy > 0 && full == 0, "{greedy} greedy steps, {full} with logits");
}

/// Each prompt's `max_tokens` greedy tokens as `engine` serves them all.
fn greedy_tokens<B: runtime::serving::PagedBackend>(
    engine: &mut runtime::serving::ServingEngine<B>,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> Vec<Vec<u32>> {
    let greedy = runtime::SamplingParams::default();
    bbc::gpu_check::kernels::serve_all_counting(engine, prompts, greedy, max_tokens)
        .unwrap()
        .tokens
}

/// `prompts` served greedily by `engine` (a plan speculating as `gpu_check::kernels::DRAFTING`
/// drafts), checked to generate `want` (the CPU backend's tokens without speculation); the
/// tokens drafted and accepted.
fn speculating_serves<B: runtime::serving::PagedBackend>(
    engine: &mut runtime::serving::ServingEngine<B>,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    want: &[Vec<u32>],
    family: &str,
) -> (usize, usize) {
    assert_eq!(
        engine.scheduler().config().speculation,
        bbc::gpu_check::kernels::DRAFTING,
        "{family}: the plan verifies drafts"
    );
    let greedy = runtime::SamplingParams::default();
    let served = bbc::gpu_check::kernels::serve_all_counting(engine, prompts, greedy, max_tokens).unwrap();
    assert_eq!(served.tokens, want, "{family}");
    (served.drafted, served.accepted)
}

/// Serving limits for the engine tests: 4 running sequences of up to 64 positions, blocks of
/// 4, the token budget and pool size given, prefix caching on, no speculation.
fn serving_config(token_budget: usize, kv_blocks: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_waiting: 16,
        max_running: 4,
        token_budget,
        kv_blocks,
        block_size: 4,
        context_length: 64,
        prefix_caching: true,
        speculation: runtime::serving::NgramConfig::OFF,
        recurrent_state: false,
        state_cache: runtime::serving::StateCacheConfig::OFF,
    }
}

/// A fresh emulated backend of a serving plan (`serving_plan`'s graph, plan and kernels) over
/// `model`'s weights, 64 positions a sequence.
fn emulated_serving(
    model: &Model,
    graph: &ir::Graph,
    plan: &gpu::GpuPlan,
    kernels: &[kernels_gen::dsl::Kernel],
) -> EmulatorBackend {
    EmulatorBackend::emulated(plan.clone(), kernels.to_vec(), graph.clone(), &model.weights, &[], 64).unwrap()
}

/// The serving plan `bbc compile` writes for `model` (each sequence's sampled rows gathered
/// before the head, their argmax as `next_token`) on H200, 32 rows a step, its KV pool as
/// `config` says and recurrent states for `sequences`: the graph, the plan, its kernels.
fn serving_plan(
    model: &Model,
    config: &SchedulerConfig,
    sequences: usize,
) -> (ir::Graph, gpu::GpuPlan, Vec<kernels_gen::dsl::Kernel>) {
    let graph = fused_for(&model.lower(LogitsFor::LastToken).unwrap(), Target::H200);
    let graph = models::with_greedy_token(&graph).unwrap();
    let cache = gpu::BatchedCache {
        blocks: config.kv_blocks,
        block_size: config.block_size,
        sequences,
    };
    let (plan, kernels) = gpu::build_batched(&graph, Target::H200, 32, cache).unwrap();
    (graph, plan, kernels)
}

/// A backend that counts the steps the engine ran with device-side greedy tokens and with
/// logits.
struct Counted<B> {
    inner: B,
    greedy: std::cell::Cell<usize>,
    full: std::cell::Cell<usize>,
    /// Segments run from position 0: each admission, and each recomputation after preemption.
    starts: std::cell::Cell<usize>,
}

impl<B> Counted<B> {
    fn new(inner: B) -> Self {
        Self {
            inner,
            greedy: Default::default(),
            full: Default::default(),
            starts: Default::default(),
        }
    }

    fn counts(&self) -> (usize, usize) {
        (self.greedy.get(), self.full.get())
    }

    fn count_starts(&self, batch: &[runtime::kv::Segment]) {
        let starts = batch.iter().filter(|s| s.start == 0).count();
        self.starts.set(self.starts.get() + starts);
    }
}

impl<B: runtime::serving::PagedBackend> runtime::serving::PagedBackend for Counted<B> {
    type Pages = B::Pages;
    fn new_pages(&self, block_size: usize) -> B::Pages {
        self.inner.new_pages(block_size)
    }
    fn max_step_tokens(&self) -> Option<usize> {
        self.inner.max_step_tokens()
    }
    fn max_sequences(&self) -> Option<usize> {
        self.inner.max_sequences()
    }
    fn max_drafts(&self) -> Option<usize> {
        self.inner.max_drafts()
    }
    fn has_recurrent_state(&self) -> bool {
        self.inner.has_recurrent_state()
    }
    fn samples_several_rows(&self) -> bool {
        self.inner.samples_several_rows()
    }
    fn verifies_drafts(&self) -> bool {
        self.inner.verifies_drafts()
    }
    fn rewind_state(
        &self,
        pages: &mut B::Pages,
        state_slot: usize,
        sampled_rows: usize,
        kept: usize,
    ) -> runtime::Result<()> {
        self.inner.rewind_state(pages, state_slot, sampled_rows, kept)
    }
    fn snapshots_states(&self) -> runtime::serving::StateSnapshotting {
        self.inner.snapshots_states()
    }
    fn step_batch(
        &self,
        pages: &mut B::Pages,
        batch: &[runtime::kv::Segment],
    ) -> runtime::Result<Vec<std::collections::HashMap<String, ir::Tensor>>> {
        self.full.set(self.full.get() + 1);
        self.count_starts(batch);
        self.inner.step_batch(pages, batch)
    }
    fn step_batch_greedy(
        &self,
        pages: &mut B::Pages,
        batch: &[runtime::kv::Segment],
        also: &[&str],
    ) -> Option<runtime::Result<Vec<std::collections::HashMap<String, ir::Tensor>>>> {
        let tokens = self.inner.step_batch_greedy(pages, batch, also);
        if tokens.is_some() {
            self.greedy.set(self.greedy.get() + 1);
            self.count_starts(batch);
        }
        tokens
    }
}

#[test]
fn batched_steps_replayed_as_graphs_match_launching_kernel_by_kernel() {
    use runtime::kv::BlockId;
    let model = open("llama", ComputeDtype::F32);
    let graph = fused_for(&model.lower(LogitsFor::LastToken).unwrap(), Target::H200);
    let cache = gpu::BatchedCache {
        blocks: 8,
        block_size: 4,
        sequences: 8,
    };
    let (plan, kernels) = gpu::build_batched(&graph, Target::H200, 32, cache).unwrap();
    let build = || EmulatorBackend::emulated(plan.clone(), kernels.clone(), graph.clone(), &model.weights, &[], 64);
    let (eager, graphs) = (build().unwrap(), build().unwrap().capture_graphs_up_to(2));
    let tables = [
        [BlockId(3), BlockId(0), BlockId(6)],
        [BlockId(5), BlockId(1), BlockId(2)],
    ];
    // Prompts (9 rows: launched one by one), four 2-row decode steps, a 1-row one, and a chunk.
    let mut steps: Vec<Vec<(usize, Vec<u32>)>> =
        vec![vec![(0, vec![5, 16, 27, 38, 49]), (0, vec![200, 203, 206, 209])]];
    steps.extend((0..4).map(|i| vec![(5 + i, vec![40 + i as u32]), (4 + i, vec![90 + 7 * i as u32])]));
    steps.push(vec![(9, vec![3])]);
    // Two rows of one sequence: few enough rows, but not a decode step.
    steps.push(vec![(10, vec![5, 6])]);
    // Then those two rows again, both sampled (verifying a drafted token): every row sampled.
    steps.push(vec![(10, vec![5, 6])]);
    for (n, segments) in steps.iter().enumerate() {
        let mut batch = batch_of(segments, &tables);
        if n == steps.len() - 1 {
            batch[0].sampled_rows = 2;
        }
        let (want, got) = (eager.step_batch(&batch).unwrap(), graphs.step_batch(&batch).unwrap());
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g["logits"].rows(), batch[0].sampled_rows, "step {n}");
            assert_eq!(g["logits"].data, w["logits"].data, "step {n}");
        }
    }
    // Graphs for 2 and 1 rows of as many sequences, and for 2 rows of one sequence both
    // sampled, run by the five decode steps and the verifying one (the first of each captured
    // its graph, then ran it); the prompt step and the two-row chunk launched kernel by kernel.
    assert_eq!(graphs.with_device(|d| d.graph_counts()).unwrap(), (6, 3));
    assert_eq!(eager.with_device(|d| d.graph_counts()).unwrap(), (0, 0));
}

/// Add every prompt (6 greedy tokens each) and step until all are done; each one's tokens.
fn serve_all<B: runtime::serving::PagedBackend>(
    engine: &mut runtime::serving::ServingEngine<B>,
    prompts: &[Vec<u32>],
    params: runtime::SamplingParams,
) -> Vec<Vec<u32>> {
    bbc::gpu_check::kernels::serve_all_counting(engine, prompts, params, 6)
        .unwrap()
        .tokens
}

/// A tiny family's shape lowered without weights for the H200, its batched plan (room for
/// `sequences`) on the emulator twice: with weights made on the device from a seed, and with
/// the same values written as a checkpoint (matrices bf16, norm gains f32) and uploaded.
/// Where `quantization` is given, both quantize as they load.
struct GeneratedAndUploaded {
    config: models::ModelConfig,
    graph: ir::Graph,
    plan: gpu::GpuPlan,
    generated: PlanExecutor<EmulatorDevice>,
    uploaded: EmulatorBackend,
}

fn generated_and_uploaded(family: &str, compute: ComputeDtype, seed: u32, sequences: usize) -> GeneratedAndUploaded {
    generated_and_uploaded_quantized(family, compute, None, seed, sequences)
}

fn generated_and_uploaded_quantized(
    family: &str,
    compute: ComputeDtype,
    quantization: Option<&str>,
    seed: u32,
    sequences: usize,
) -> GeneratedAndUploaded {
    let config = open(family, compute).config;
    let options = models::LowerOptions {
        logits: LogitsFor::LastToken,
        compute,
        kv_cache: models::KvCacheDtype::Auto,
    };
    let lowered = models::lower_without_weights_quantized(&config, options, quantization).unwrap();
    let graph = fused_for(&lowered, Target::H200);
    let scratch = tempfile::Builder::new().prefix("bbc-generated-").tempdir().unwrap();
    let dir = scratch.path();
    std::fs::copy(
        fixture(&format!("hf-tiny/{family}/config.json")),
        dir.join("config.json"),
    )
    .unwrap();
    runtime::random_weights::write_checkpoint(&graph, seed, &dir.join("model.safetensors")).unwrap();
    let mut spec = ModelSpec::for_weights(dir);
    spec.dtype = compute;
    spec.quantization = quantization.map(str::to_string);
    let written = Model::open(spec).unwrap();
    generated_and_uploaded_over(config, graph, &written.weights, seed, sequences)
}

/// [`GeneratedAndUploaded`] of `graph` (lowered without weights, fused for the H200), the
/// uploaded plan's weights `weights`.
fn generated_and_uploaded_over(
    config: models::ModelConfig,
    graph: ir::Graph,
    weights: &models::WeightSource,
    seed: u32,
    sequences: usize,
) -> GeneratedAndUploaded {
    use runtime::random_weights::fill_kernels;
    let cache = gpu::BatchedCache {
        blocks: 8,
        block_size: 8,
        sequences,
    };
    let (plan, kernels) = gpu::build_batched(&graph, Target::H200, 32, cache).unwrap();
    let device = EmulatorDevice::new(kernels.iter().cloned().chain(fill_kernels()).collect());
    let generated = PlanExecutor::with_generated_weights(device, plan.clone(), graph.clone(), seed, 64).unwrap();
    let uploaded = EmulatorBackend::emulated(plan.clone(), kernels, graph.clone(), weights, &[], 64).unwrap();
    GeneratedAndUploaded {
        config,
        graph,
        plan,
        generated,
        uploaded,
    }
}

/// The block tables of the two sequences the generated-weights tests step.
const GENERATED_TABLES: [[runtime::kv::BlockId; 3]; 2] = {
    use runtime::kv::BlockId;
    [
        [BlockId(3), BlockId(0), BlockId(6)],
        [BlockId(5), BlockId(1), BlockId(2)],
    ]
};

/// Two sequences' prompts (one past the tensor-core GEMM's rows), then a decode row each, on
/// both sides: their logits equal bit for bit, and finite. The longer prompt.
fn generated_steps_agree(both: &GeneratedAndUploaded) -> Vec<u32> {
    let prompt: Vec<u32> = (0..PREFILL_TOKENS as u32 + 2).map(|i| (5 + 11 * i) % 300).collect();
    let steps: [[(usize, Vec<u32>); 2]; 2] = [
        [(0, prompt.clone()), (0, vec![9, 8, 7])],
        [(prompt.len(), vec![42]), (3, vec![17])],
    ];
    for segments in &steps {
        let batch = batch_of(segments, &GENERATED_TABLES);
        let (got, want) = (
            both.generated.step_batch(&batch).unwrap(),
            both.uploaded.step_batch(&batch).unwrap(),
        );
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g["logits"].data, w["logits"].data);
            assert!(g["logits"].data.iter().all(|v| v.is_finite()));
        }
    }
    prompt
}

/// A model whose plan regroups the rows of some weights (GLM-5's MLA projections, taken in
/// transposed row groups): those are made from the same values on the host and uploaded, the
/// others filled on the device, and the plan computes bit for bit what it computes on all of
/// them uploaded.
#[test]
fn regrouped_weights_made_for_the_device_equal_their_host_values_uploaded() {
    let both = generated_and_uploaded("glm_moe_dsa", ComputeDtype::Bf16, 11, 2);
    let regrouped = |w: &gpu::WeightUse| !w.parts.iter().all(|p| matches!(p, gpu::WeightPart::Whole(_)));
    assert!(
        both.plan.weights.iter().any(regrouped),
        "the plan regroups some weights"
    );
    generated_steps_agree(&both);
}

/// A half model's random weights (no fill of halves on the device: made on the host from the
/// bf16 values a checkpoint of them holds, rounded to half, and uploaded) compute bit for bit
/// what that checkpoint loaded as half computes.
#[test]
fn half_weights_made_for_the_device_equal_their_host_values_uploaded() {
    let both = generated_and_uploaded("llama", ComputeDtype::F16, 5, 2);
    assert!(both.plan.weights.iter().any(|w| w.dtype == ir::DType::F16));
    generated_steps_agree(&both);
}

/// Random weights quantized to FP8 as they load (`--load-format dummy --quantization fp8` on a
/// GPU): the plan's FP8 blocks are made on the host from the bf16 values the device would
/// fill, quantized as a checkpoint of them is, and uploaded; the rest filled on the device.
/// Bit for bit what that checkpoint quantized as it loads computes.
#[test]
fn fp8_weights_made_for_the_device_equal_a_checkpoint_quantized_as_it_loads() {
    let both = generated_and_uploaded_quantized("llama", ComputeDtype::Bf16, Some("fp8"), 3, 2);
    assert!(both.plan.weights.iter().any(|w| w.dtype == ir::DType::F8E4M3B32));
    assert!(both.plan.weights.iter().any(|w| w.dtype == ir::DType::BF16));
    generated_steps_agree(&both);
}

/// Random weights in the 4-bit blocks GPTQ and AWQ checkpoints are held as (the GPU check's
/// 4-bit decode): the plan's blocks are made on the host from the bf16 values the device would
/// fill, each block rounded to nearest (`u4_blocks::quantize_matrix`), and uploaded; the rest
/// filled on the device. Bit for bit what those blocks made on the host and uploaded compute.
/// The model is 128 wide, so its q/k/v and gate/up projections are blocks of 128, its o and
/// down projections (64 and 160 wide rows) blocks of 32.
#[test]
fn u4_weights_made_for_the_device_equal_their_host_blocks_uploaded() {
    let mut config = open("llama", ComputeDtype::Bf16).config;
    config.hidden = 128;
    let layers = config.layers;
    let made = blocks_made_for_the_device_agree(config, quant::GgmlType::U4B32);
    assert_eq!(
        made,
        [("u4_b128", 5 * layers), ("u4_b32", 2 * layers)].into(),
        "every projection of every layer"
    );
}

/// The same for blocks of 32 under every projection of the 64-wide Llama: the FP4 blocks NVFP4
/// checkpoints are held as (`--quantization modelopt_fp4` over random weights:
/// `fp4_blocks::quantize_matrix`), GGUF's MXFP4 blocks (`mxfp4::quantize_matrix`, decoded as
/// stored) and the Q8_0 blocks 8-bit integer checkpoints are held as (`q8_0::quantize_matrix`,
/// ggml's reference quantizer): the GPU check's decode rows in each.
#[test]
fn blocks_of_32_made_for_the_device_equal_their_host_blocks_uploaded() {
    for blocks in [
        quant::GgmlType::F4E2M1B32,
        quant::GgmlType::MXFP4,
        quant::GgmlType::Q8_0,
    ] {
        let config = open("llama", ComputeDtype::Bf16).config;
        let layers = config.layers;
        let made = blocks_made_for_the_device_agree(config, blocks);
        let name = quant::tensor::ir_dtype(blocks).name();
        assert_eq!(made, [(name, 7 * layers)].into(), "{name}");
    }
}

/// `config` lowered without weights, its projections in `blocks`, run on an H200 plan with its
/// blocks made on the host from the bf16 values the device would fill
/// (`quant::tensor::quantize_matrix`) and uploaded, the rest filled on the device, against
/// the same blocks and values uploaded: bit for bit. How many weights of each block type the
/// graph holds, by the type's name.
fn blocks_made_for_the_device_agree(
    config: models::ModelConfig,
    blocks: quant::GgmlType,
) -> std::collections::BTreeMap<&'static str, usize> {
    let options = models::LowerOptions {
        logits: LogitsFor::LastToken,
        compute: ComputeDtype::Bf16,
        kv_cache: models::KvCacheDtype::Auto,
    };
    let lowered = models::lower_without_weights_in_blocks(&config, options, Some(blocks)).unwrap();
    let graph = fused_for(&lowered, Target::H200);
    let seed = 4;
    let mut tensors = runtime::random_weights::host_weights(&lowered, seed);
    let mut made = std::collections::BTreeMap::new();
    for node in lowered.nodes() {
        let ir::Op::Weight { name } = &node.op else { continue };
        let Some(format) = quant::GgmlType::MADE_FROM_FLOATS
            .into_iter()
            .find(|&f| quant::tensor::ir_dtype(f) == node.dtype)
        else {
            continue;
        };
        let tensor = tensors.get_mut(name).unwrap();
        let view = quant::tensor::TensorView {
            shape: &tensor.shape,
            dtype: tensor.dtype,
            bytes: &tensor.bytes,
        };
        tensor.bytes = quant::tensor::quantize_matrix(&view, format).unwrap();
        tensor.dtype = format;
        *made.entry(node.dtype.name()).or_insert(0) += 1;
    }
    let weights = models::WeightSource::Memory(tensors);
    let both = generated_and_uploaded_over(config, graph, &weights, seed, 2);
    for name in made.keys() {
        assert!(both.plan.weights.iter().any(|w| w.dtype.name() == *name), "{name}");
    }
    assert!(both.plan.weights.iter().any(|w| w.dtype == ir::DType::BF16));
    generated_steps_agree(&both);
    made
}

/// Weights made on the device (`PlanExecutor::with_generated_weights`, for models lowered
/// without weights: the GPU check's 8B-shaped decode) are the values `runtime::random_weights`
/// gives on the host: a batched plan on them computes bit for bit what it computes on those
/// values written to a safetensors file and uploaded. A profiled step times every launch and
/// counts the weights each reads: every matrix once per step, one table row per token.
#[test]
fn weights_made_on_the_device_equal_their_host_values_uploaded() {
    let both = generated_and_uploaded("llama", ComputeDtype::Bf16, 7, 8);
    let prompt = generated_steps_agree(&both);
    let (config, graph, plan, generated) = (&both.config, &both.graph, &both.plan, &both.generated);
    let decode = [(prompt.len() + 1, vec![1]), (4, vec![2])];
    let profile = generated
        .profile_step_batch(&batch_of(&decode, &GENERATED_TABLES))
        .unwrap();
    assert!(profile.iter().all(|p| p.seconds.is_some_and(|s| s > 0.0)));
    let kernels_launched: std::collections::BTreeSet<&str> = profile.iter().map(|p| p.kernel.as_str()).collect();
    assert!(kernels_launched.len() > 5 && !kernels_launched.iter().any(|k| k.starts_with("fill")));
    // Matrices once each (bf16), the embedding's two rows, the norms (f32).
    let (hidden, rows) = (config.hidden, 2);
    let expected: usize = plan
        .weights
        .iter()
        .map(|w| {
            let elements: usize = w.shape.iter().product();
            let width = if w.dtype == ir::DType::BF16 { 2 } else { 4 };
            match graph
                .nodes()
                .iter()
                .any(|n| n.op == ir::Op::Embedding && n.inputs[0] == ir::NodeId(w.node))
            {
                true => rows * hidden * width,
                false => elements * width,
            }
        })
        .sum();
    let read: usize = profile.iter().map(|p| p.weight_bytes).sum();
    // A tied head reads the embedding table whole, besides the two gathered rows; a norm gain
    // may be read twice (its own launch, and a matmul's fused prologue).
    let tied = if config.tied_embeddings {
        config.vocab_size * hidden * 2
    } else {
        0
    };
    let gains: usize = plan
        .weights
        .iter()
        .filter(|w| w.shape.len() == 1)
        .map(|w| 4 * w.shape[0])
        .sum();
    assert!(
        (expected + tied..=expected + tied + gains).contains(&read),
        "{read} bytes read, {expected} + {tied} expected"
    );
}

/// The decode timing the GPU check runs on its 8B-shaped model and its Qwen3.5-27B-shaped one,
/// here on the tiny Llama's and Qwen3.5's shapes with weights made on the emulated device:
/// every batch size decodes (from a recorded graph, one per size), its profiled step times
/// each launch, and a step reads its weights once whatever the batch, but for one embedding
/// row per sequence; and as the hybrid section times speculating steps, steps verifying
/// drafts.
#[test]
fn decode_timing_runs_every_batch_size_from_its_graph() {
    for family in ["llama", "qwen3_5"] {
        decode_timing_runs(family);
    }
}

fn decode_timing_runs(family: &str) {
    use runtime::decode_timing::{time_decode, DecodeRun};
    let config = open(family, ComputeDtype::Bf16).config;
    let options = models::LowerOptions {
        logits: LogitsFor::LastToken,
        compute: ComputeDtype::Bf16,
        kv_cache: models::KvCacheDtype::Auto,
    };
    let graph = fused_for(&models::lower_without_weights(&config, options).unwrap(), Target::H200);
    let graph = models::with_greedy_token(&graph).unwrap();
    let run = DecodeRun {
        prompt: PREFILL_TOKENS + 4,
        batches: vec![1, 3],
        steps: 2,
        prefill_chunk: 8,
        drafts: 0,
    };
    let block_size = 4;
    let cache = gpu::BatchedCache {
        blocks: run.sequences() * run.positions_per_sequence().div_ceil(block_size),
        block_size,
        sequences: run.sequences(),
    };
    let (plan, kernels) = gpu::build_batched(&graph, Target::H200, 32, cache).unwrap();
    let device = EmulatorDevice::new(
        kernels
            .into_iter()
            .chain(runtime::random_weights::fill_kernels())
            .collect(),
    );
    let exec = PlanExecutor::with_generated_weights(device, plan, graph.clone(), 1, 64)
        .unwrap()
        .capture_graphs_up_to(3);
    assert!(runtime::decode_timing::time_prefill(&exec, &run).unwrap() > 0.0);
    // A prefill profiled 16 rows a step: its first step attends on the tensor cores, the 4
    // rows after it split each row's keys and merge the splits; every launch timed.
    let chunked = DecodeRun {
        prefill_chunk: PREFILL_TOKENS,
        ..run.clone()
    };
    let launches = runtime::decode_timing::profile_prefill(&exec, &chunked).unwrap();
    let launched = |stem: &str| launches.iter().filter(|l| l.kernel.starts_with(stem)).count();
    let attention_layers = graph.nodes().iter().filter(|n| n.op.attention().is_some()).count();
    assert!(attention_layers > 0);
    assert_eq!(launched("flash_attention"), attention_layers, "{family}");
    assert_eq!(launched("attention_combine"), attention_layers, "{family}");
    assert!(launches.iter().all(|l| l.seconds.is_some_and(|s| s > 0.0)));
    let timings = time_decode(&exec, &run).unwrap();
    assert_eq!(timings.iter().map(|t| t.batch).collect::<Vec<_>>(), run.batches);
    // Per batch size: one graph recorded, replayed for the untimed and the timed steps, those
    // reading logits and those reading tokens.
    assert_eq!(
        exec.with_device(|d| d.graph_counts()).unwrap(),
        (2 * 2 * (run.steps + 1), 2)
    );
    for t in &timings {
        assert!(t.wall_seconds > 0.0 && t.device_seconds().is_some_and(|s| s > 0.0));
        assert!(t.greedy_wall_seconds.is_some_and(|s| s > 0.0));
        let by_kernel = t.by_kernel();
        assert_eq!(by_kernel.iter().map(|k| k.launches).sum::<usize>(), t.launches.len());
        assert_eq!(
            by_kernel.iter().map(|k| k.weight_bytes).sum::<usize>(),
            t.weight_bytes()
        );
    }
    assert_eq!(
        timings[1].weight_bytes() - timings[0].weight_bytes(),
        2 * config.hidden * 2,
        "{family}: two more bf16 embedding rows"
    );
    // A run that does not fit the pool is refused before anything runs.
    let too_long = DecodeRun {
        prompt: 60,
        ..run.clone()
    };
    assert!(time_decode(&exec, &too_long).is_err());
    // Steps verifying 2 drafts a sequence (3 rows each, all sampled; the hybrid's states kept
    // after the first two), each batch size from its own graph: they read the same weights
    // as decode steps but for an embedding row per draft.
    let verifying = DecodeRun {
        prompt: 8,
        drafts: 2,
        ..run
    };
    let cache = gpu::BatchedCache {
        blocks: verifying.sequences() * verifying.positions_per_sequence().div_ceil(block_size),
        block_size,
        sequences: verifying.sequences(),
    };
    let (plan, kernels) = gpu::build_batched(&graph, Target::H200, 32, cache).unwrap();
    let device = EmulatorDevice::new(
        kernels
            .into_iter()
            .chain(runtime::random_weights::fill_kernels())
            .collect(),
    );
    let exec = PlanExecutor::with_generated_weights(device, plan, graph, 1, 64)
        .unwrap()
        .capture_graphs_up_to(9)
        .verify_drafts_up_to(2)
        .unwrap();
    let verified = time_decode(&exec, &verifying).unwrap();
    assert_eq!(
        exec.with_device(|d| d.graph_counts()).unwrap(),
        (2 * 2 * (verifying.steps + 1), 2)
    );
    for (plain, verify) in timings.iter().zip(&verified) {
        assert_eq!(
            verify.weight_bytes() - plain.weight_bytes(),
            plain.batch * 2 * config.hidden * 2,
            "{family}: an embedding row more per draft"
        );
    }
}

/// A KV pool sized by a share of the device's memory (`bbc serve --gpu-memory-utilization`)
/// takes what the share leaves once the weights, constants, states and activations are on the
/// device, less the headroom kept for CUDA graphs; it replaces the pool the plan was loaded
/// with, and a step over its last block gives the CPU backend's logits. A share that leaves
/// less than one request of the context is refused, naming the flag.
#[test]
fn a_kv_pool_sized_by_memory_takes_the_share_the_model_leaves() {
    use runtime::kv::{BlockId, Segment};
    use runtime::kv_sizing::GPU_HEADROOM;
    let model = open("llama", ComputeDtype::F32);
    let graph = fused_for(&model.lower(LogitsFor::AllTokens).unwrap(), Target::H200);
    let cache = gpu::BatchedCache {
        blocks: 1,
        block_size: 16,
        sequences: 4,
    };
    let (plan, kernels) = gpu::build_batched(&graph, Target::H200, 32, cache).unwrap();
    let capacity = 1 << 30;
    let load = |capacity: usize| {
        let device = EmulatorDevice::new(kernels.clone()).with_memory(capacity);
        PlanExecutor::new(device, plan.clone(), graph.clone(), &model.weights, &[], 64).unwrap()
    };
    let executor = load(capacity).size_kv_pool(0.75).unwrap();
    let blocks = executor.batched_cache().unwrap().blocks;
    let block_bytes = 16 * executor.kv_bytes_per_position();
    let held = executor.with_device(|d| d.bytes_held()).unwrap();
    let model_bytes = held - blocks * block_bytes;
    assert_eq!(
        blocks,
        ((0.75 * capacity as f64) as usize - model_bytes - GPU_HEADROOM) / block_bytes
    );
    assert!(blocks > 1000, "{blocks} blocks of {block_bytes} bytes");

    let cpu = CpuBackend::new(graph.clone(), &model.weights, 64).unwrap();
    let mut pages = cpu.new_pages(16);
    let table = [BlockId(blocks as u32 - 1)];
    let ids: Vec<u32> = (0..9).map(|i| 3 + 17 * i).collect();
    let segment = Segment {
        hidden_states: &[],
        table: &table,
        start: 0,
        ids: &ids,
        state_slot: 0,
        sampled_rows: 1,
        drafts: 0,
        snapshots: runtime::kv::StateSnapshots::NONE,
    };
    let got = executor.step_batch(&[segment]).unwrap();
    let want = cpu.step_batch(&mut pages, &[segment]).unwrap();
    let error = relative_error(&got[0]["logits"].data, &want[0]["logits"].data);
    assert!(error <= 1e-4, "a step over the last block: {error}");
    let outside = [BlockId(blocks as u32)];
    assert!(executor
        .step_batch(&[Segment {
            table: &outside,
            ..segment
        }])
        .is_err());

    let refused = load(GPU_HEADROOM + (1 << 20))
        .size_kv_pool(0.9)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        refused.contains("less than one request") && refused.contains("--gpu-memory-utilization"),
        "{refused}"
    );
    let refused = load(capacity).size_kv_pool(1.5).err().expect("refused").to_string();
    assert!(refused.contains("within (0, 1]"), "{refused}");
}

/// A KV pool past the kernels' 32-bit indices (`bbc serve --kv-blocks` too many) is refused
/// before anything is uploaded, naming the problem.
#[test]
fn a_kv_pool_past_32_bit_indices_is_refused() {
    let model = open("llama", ComputeDtype::F32);
    let graph = fused_for(&model.lower(LogitsFor::LastToken).unwrap(), Target::H200);
    let cache = gpu::BatchedCache {
        blocks: 1 << 24,
        block_size: 16,
        sequences: 1,
    };
    let (plan, kernels) = gpu::build_batched(&graph, Target::H200, 32, cache).unwrap();
    let err = EmulatorBackend::emulated(plan, kernels, graph, &model.weights, &[], 64)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("32-bit indices"), "{err}");
}

/// A plan whose launches do not resolve (a kernel it does not carry, an expression that does
/// not parse, a buffer it did not plan) is refused when it is loaded, naming what is wrong,
/// not at its first step.
#[test]
fn a_plan_whose_launches_do_not_resolve_is_refused_at_load() {
    let model = open("llama", ComputeDtype::F32);
    let graph = fused_for(&model.lower(LogitsFor::LastToken).unwrap(), Target::H200);
    let (plan, kernels) = gpu::build_with_kernels(&graph, Target::H200, 32).unwrap();
    let refused = |mutate: &dyn Fn(&mut gpu::GpuPlan)| {
        let mut plan = plan.clone();
        mutate(&mut plan);
        EmulatorBackend::emulated(plan, kernels.clone(), graph.clone(), &model.weights, &[], 64)
            .err()
            .expect("refused")
            .to_string()
    };
    let err = refused(&|p| p.launches[3].kernel = "no_such_kernel".into());
    assert!(err.contains("no kernel no_such_kernel"), "{err}");
    let err = refused(&|p| {
        let scalar = p.launches[0]
            .args
            .iter_mut()
            .find_map(|a| match a {
                gpu::LaunchArg::Scalar { value, .. } => Some(value),
                _ => None,
            })
            .unwrap();
        *scalar = "(tokens *".into();
    });
    assert!(err.contains("expression `(tokens *`"), "{err}");
    let err = refused(&|p| p.memory.buffers.retain(|b| b.node != p.launches[0].node));
    assert!(err.contains("no planned buffer"), "{err}");
    let err = refused(&|p| {
        p.launches[1].args.pop();
    });
    assert!(err.contains("arguments for its"), "{err}");
    // The plan as built loads.
    assert!(EmulatorBackend::emulated(plan, kernels, graph, &model.weights, &[], 64).is_ok());
}

/// Hopper and B200 plans prefilling through the warp-specialised TMA GEMM (`--prefill-gemm
/// specialised`, and `persistent`, its blocks taking tiles in turn) compute what the plan on
/// the block-driven TMA GEMM does, bit for bit: the same MMAs in the same order, only who
/// refills the buffers, how the warps wait and which block takes a tile differ.
#[test]
fn warp_specialised_prefill_gemms_compute_what_the_others_do() {
    let model = open("llama", ComputeDtype::Bf16);
    let prompt: Vec<u32> = (0..PREFILL_TOKENS as u32 + 3).map(|i| (7 + 13 * i) % 300).collect();
    // (target, threads a block of its warp-specialised GEMM)
    for (target, block) in [(Target::H200, 288), (Target::B200, 192)] {
        let graph = fused_for(&model.lower(LogitsFor::LastToken).unwrap(), target);
        let logits = |prefill: gpu::PrefillGemm| {
            let (plan, kernels) = gpu::build_program(&graph, target, 64, None, prefill).unwrap();
            let specialised = plan
                .kernels
                .iter()
                .filter(|k| k.name.contains("gemm_tma") && k.block == block);
            assert_eq!(specialised.count() > 0, prefill != gpu::PrefillGemm::Tma);
            let persistent = plan.kernels.iter().filter(|k| k.name.contains("_tma_persistent"));
            assert_eq!(persistent.count() > 0, prefill == gpu::PrefillGemm::Persistent);
            let gpu = EmulatorBackend::emulated(plan, kernels, graph.clone(), &model.weights, &[], 64).unwrap();
            let mut sequence = gpu.new_sequence();
            let first = gpu.step(&mut sequence, &prompt).unwrap()["logits"].data.clone();
            let next = gpu.step(&mut sequence, &[5]).unwrap()["logits"].data.clone();
            [first, next]
        };
        let tma = logits(gpu::PrefillGemm::Tma);
        assert_eq!(logits(gpu::PrefillGemm::Specialised), tma, "{}", target.name());
        assert_eq!(logits(gpu::PrefillGemm::Persistent), tma, "{}", target.name());
    }
}

/// A Hopper plan whose prompts attend on `wgmma` (`--prefill-attention wgmma` and
/// `wgmma-specialised`) computes what the plan on the `mma.sync` flash kernel does, within
/// rounding ([`each_wgmma_attention_gives_the_mma_ones`]).
#[test]
fn wgmma_prefill_attention_computes_what_the_mma_sync_one_does() {
    let model = open("llama", ComputeDtype::Bf16);
    let graph = fused_for(&model.lower(LogitsFor::LastToken).unwrap(), Target::H200);
    let logits = |attention: gpu::PrefillAttention| {
        let kernels = gpu::PlanKernels {
            prefill_attention: attention,
            ..Default::default()
        };
        let (plan, kernels) = gpu::build_program(&graph, Target::H200, 64, None, kernels).unwrap();
        let wgmma = plan
            .launches
            .iter()
            .filter(|l| l.kernel.starts_with("flash_attention_wgmma"));
        assert_eq!(wgmma.count() > 0, attention != gpu::PrefillAttention::Mma);
        let gpu = EmulatorBackend::emulated(plan, kernels, graph.clone(), &model.weights, &[], 64).unwrap();
        prompt_then_decode(&gpu)
    };
    each_wgmma_attention_gives_the_mma_ones(logits);
}

/// A batched Hopper plan attending on `wgmma` (either schedule) computes what the one on
/// `mma.sync` does within rounding, its prompts cut into the wgmma kernel's tiles of 128 rows
/// (the step input the runtime writes for it): a prompt longer than a tile beside a short
/// one, then both continued past their cached rows, then a decode step (the split
/// attention).
#[test]
fn batched_plans_attend_on_wgmma_as_on_mma_sync() {
    let model = open("llama", ComputeDtype::Bf16);
    let graph = fused_for(&model.lower(LogitsFor::LastToken).unwrap(), Target::H200);
    let (cache, steps) = (two_sequence_pool(), prompts_past_a_tile());
    let logits = |attention: gpu::PrefillAttention| {
        let kernels = gpu::PlanKernels {
            prefill_attention: attention,
            ..Default::default()
        };
        let (plan, kernels) = gpu::build_program(&graph, Target::H200, 176, Some(cache), kernels).unwrap();
        let wgmma = plan
            .kernels
            .iter()
            .filter(|k| k.name.starts_with("flash_attention_wgmma"))
            .count();
        assert_eq!(wgmma > 0, attention != gpu::PrefillAttention::Mma);
        let gpu = EmulatorBackend::emulated(plan, kernels, graph.clone(), &model.weights, &[], 256).unwrap();
        pool_steps_logits(&gpu, &steps)
    };
    each_wgmma_attention_gives_the_mma_ones(logits);
}

/// Plans whose prompts attend loading the tiles by TMA compute what those copying them do,
/// bit for bit: on Hopper `wgmma` by TMA (`--prefill-attention wgmma-tma`) as `wgmma`'s
/// producer copying (`wgmma-specialised`), on the B200 `tcgen05` by TMA (`tcgen05-tma`) as
/// `tcgen05` copying; over the model's bf16 caches and over half ones (f16 tensor maps). A
/// Llama with heads of 64 dims (whole TMA boxes; the fixtures' 16-dim heads take the copying
/// forms) and random weights: one sequence's prompt and a decode step after it, and the
/// batched steps of
/// [`prompts_past_a_tile`] over blocks in reverse order. The batched plans by TMA ask for
/// blocks of a multiple of 16 positions, and a pool of blocks of 8 is refused with the reason.
#[test]
fn prefill_attention_by_tma_computes_what_the_copying_one_does() {
    let scratch = common::scratch_dir("bbc-tma-attention-");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("hf-tiny/llama/config.json")).unwrap()).unwrap();
    config["head_dim"] = 64.into();
    config["num_attention_heads"] = 2.into();
    config["num_key_value_heads"] = 1.into();
    let config_path = scratch.path().join("config.json");
    std::fs::write(&config_path, config.to_string()).unwrap();
    let model = |kv_cache_dtype| {
        let options = bbc::model_ref::LoadOptions {
            dtype: Some(ComputeDtype::Bf16),
            kv_cache_dtype: Some(kv_cache_dtype),
            fuse: false,
            quiet: true,
            ..Default::default()
        };
        bbc::model_ref::load(config_path.to_str().unwrap(), options)
            .unwrap()
            .model
    };
    let models = [models::KvCacheDtype::Auto, models::KvCacheDtype::F16].map(model);
    for (model, stored) in models.iter().zip([ir::DType::BF16, ir::DType::F16]) {
        let graph = model.lower(LogitsFor::LastToken).unwrap();
        let caches: Vec<_> = graph
            .nodes()
            .iter()
            .filter_map(|n| n.op.appended_attention().map(|a| a.cache_dtype))
            .collect();
        assert!(!caches.is_empty() && caches.iter().all(|&d| d == stored), "{caches:?}");
    }
    use gpu::PrefillAttention::{Tcgen05, Tcgen05Tma, WgmmaSpecialised, WgmmaTma};
    let forms = [
        (Target::H200, WgmmaTma, WgmmaSpecialised, "flash_attention_wgmma_tma"),
        (Target::B200, Tcgen05Tma, Tcgen05, "flash_attention_tcgen05_tma"),
    ];
    for (model, (target, tma, copying, tma_kernel)) in models.iter().flat_map(|m| forms.map(|f| (m, f))) {
        let graph = fused_for(&model.lower(LogitsFor::LastToken).unwrap(), target);
        let kernels = |prefill_attention| gpu::PlanKernels {
            prefill_attention,
            ..Default::default()
        };
        let by_tma = |plan: &gpu::GpuPlan| plan.launches.iter().any(|l| l.kernel.starts_with(tma_kernel));
        let one_sequence = |attention: gpu::PrefillAttention| {
            let (plan, compiled) = gpu::build_program(&graph, target, 64, None, kernels(attention)).unwrap();
            assert_eq!(by_tma(&plan), attention == tma);
            let gpu = EmulatorBackend::emulated(plan, compiled, graph.clone(), &model.weights, &[], 64).unwrap();
            prompt_then_decode(&gpu)
        };
        let (cache, steps) = (two_sequence_pool(), prompts_past_a_tile());
        let batched = |attention: gpu::PrefillAttention| {
            let (plan, compiled) = gpu::build_program(&graph, target, 176, Some(cache), kernels(attention)).unwrap();
            assert_eq!(by_tma(&plan), attention == tma);
            assert_eq!(plan.block_multiple, if attention == tma { 16 } else { 1 });
            let gpu = EmulatorBackend::emulated(plan, compiled, graph.clone(), &model.weights, &[], 256).unwrap();
            pool_steps_logits(&gpu, &steps)
        };
        for run in [
            &one_sequence as &dyn Fn(gpu::PrefillAttention) -> Vec<Vec<f32>>,
            &batched,
        ] {
            assert_eq!(run(tma), run(copying), "{}", target.name());
        }
        let eights = gpu::BatchedCache {
            blocks: 48,
            block_size: 8,
            sequences: 2,
        };
        let (plan, compiled) = gpu::build_program(&graph, target, 176, Some(eights), kernels(tma)).unwrap();
        let refused = EmulatorBackend::emulated(plan, compiled, graph.clone(), &model.weights, &[], 256)
            .err()
            .expect("blocks of 8 refused")
            .to_string();
        assert!(refused.contains("a multiple of 16"), "{refused}");
    }
}

/// B200 plans whose prompts attend on `tcgen05` (`--prefill-attention tcgen05`) compute what
/// those on the `mma.sync` flash kernel do, within f32 rounding: the same bf16 products, each
/// tile's `P·V` summed into a fresh accumulator and added to the rescaled output, where
/// `mma.sync` adds it to the output directly, and each row's sum taken in another order (the
/// bf16 rounding of the activations after attention absorbs that here: the logits agree
/// exactly on this model). One
/// sequence's prompt (and a decode step after it), and the batched steps of
/// [`prompts_past_a_tile`].
#[test]
fn tcgen05_prefill_attention_computes_what_the_mma_sync_one_does() {
    let model = open("llama", ComputeDtype::Bf16);
    let graph = fused_for(&model.lower(LogitsFor::LastToken).unwrap(), Target::B200);
    let kernels = |prefill_attention| gpu::PlanKernels {
        prefill_attention,
        ..Default::default()
    };
    let one_sequence = |attention: gpu::PrefillAttention| {
        let (plan, compiled) = gpu::build_program(&graph, Target::B200, 64, None, kernels(attention)).unwrap();
        let tcgen05 = plan
            .launches
            .iter()
            .filter(|l| l.kernel.starts_with("flash_attention_tcgen05"));
        assert_eq!(tcgen05.count() > 0, attention == gpu::PrefillAttention::Tcgen05);
        let gpu = EmulatorBackend::emulated(plan, compiled, graph.clone(), &model.weights, &[], 64).unwrap();
        prompt_then_decode(&gpu)
    };
    let (cache, steps) = (two_sequence_pool(), prompts_past_a_tile());
    let batched = |attention: gpu::PrefillAttention| {
        let (plan, compiled) = gpu::build_program(&graph, Target::B200, 176, Some(cache), kernels(attention)).unwrap();
        let tcgen05 = plan
            .kernels
            .iter()
            .filter(|k| k.name.starts_with("flash_attention_tcgen05"));
        assert_eq!(tcgen05.count() > 0, attention == gpu::PrefillAttention::Tcgen05);
        let gpu = EmulatorBackend::emulated(plan, compiled, graph.clone(), &model.weights, &[], 256).unwrap();
        pool_steps_logits(&gpu, &steps)
    };
    for run in [
        &one_sequence as &dyn Fn(gpu::PrefillAttention) -> Vec<Vec<f32>>,
        &batched,
    ] {
        let mma = run(gpu::PrefillAttention::Mma);
        let tcgen05 = run(gpu::PrefillAttention::Tcgen05);
        for (i, (t, m)) in tcgen05.iter().zip(&mma).enumerate() {
            let error = relative_error(t, m);
            assert!(error <= 1e-5, "output {i}: error {error}");
        }
    }
}

/// Batched plans whose decode steps attend with the vector split pass (`--decode-attention
/// vector`) compute what those on the scalar one do, within f32 rounding (the same products
/// summed in another order: 16-byte loads of 2 to 8 lanes a row, several keys a warp): heads
/// of 16 and 32 dims over f32 and bf16 caches, a prompt step (on the tensor cores where the
/// cache is bf16, through the split pass where it is f32), then decode steps over caches
/// whose blocks lie in reverse order.
#[test]
fn batched_plans_decode_with_the_vector_split_pass_as_with_the_scalar_one() {
    let steps = [
        vec![(0, pool_prompt(40, 5)), (0, pool_prompt(9, 11))],
        vec![(40, vec![7]), (9, vec![9])],
        vec![(41, vec![3]), (10, vec![4])],
    ];
    for (family, dtype) in [
        ("llama", ComputeDtype::F32),
        ("llama", ComputeDtype::Bf16),
        ("gemma3", ComputeDtype::Bf16),
    ] {
        let model = open(family, dtype);
        let graph = fused_for(&model.lower(LogitsFor::LastToken).unwrap(), Target::H200);
        let logits = |decode_attention| {
            let kernels = gpu::PlanKernels {
                decode_attention,
                ..Default::default()
            };
            pool_steps_on(&model, (&graph, Target::H200), kernels, &steps).0
        };
        let scalar = logits(gpu::DecodeAttention::Scalar);
        let vector = logits(gpu::DecodeAttention::Vector);
        for (i, (v, s)) in vector.iter().zip(&scalar).enumerate() {
            let error = relative_error(v, s);
            assert!(error <= 1e-5, "{family} {dtype:?}: output {i}: error {error}");
        }
    }
}

/// Each step's logits ([`pool_steps_logits`]) on `graph`'s batched plan for `target` over
/// [`two_sequence_pool`] taking `kernels`, its decode steps through their split pass (checked
/// to be the plan's), and the names of the plan's kernels.
fn pool_steps_on(
    model: &Model,
    (graph, target): (&ir::Graph, Target),
    kernels: gpu::PlanKernels,
    steps: &[Vec<(usize, Vec<u32>)>],
) -> (Vec<Vec<f32>>, Vec<String>) {
    let decode_attention = kernels.decode_attention;
    let (plan, kernels) = gpu::build_program(graph, target, 64, Some(two_sequence_pool()), kernels).unwrap();
    let names: Vec<String> = plan.kernels.iter().map(|k| k.name.clone()).collect();
    let vector = names.iter().any(|k| k.starts_with("attention_vector"));
    assert_eq!(vector, decode_attention == gpu::DecodeAttention::Vector);
    let gpu = EmulatorBackend::emulated(plan, kernels, graph.clone(), &model.weights, &[], 64).unwrap();
    (pool_steps_logits(&gpu, steps), names)
}

/// One sequence's logits on `gpu` (a one-sequence plan): after a prompt past the GEMV's rows,
/// then after a decode step.
fn prompt_then_decode(gpu: &EmulatorBackend) -> Vec<Vec<f32>> {
    let prompt: Vec<u32> = (0..PREFILL_TOKENS as u32 + 3).map(|i| (7 + 13 * i) % 300).collect();
    let mut sequence = gpu.new_sequence();
    let first = gpu.step(&mut sequence, &prompt).unwrap()["logits"].data.clone();
    let next = gpu.step(&mut sequence, &[5]).unwrap()["logits"].data.clone();
    vec![first, next]
}

/// The pool the batched attention comparisons run over: 24 blocks of 16 positions for two
/// sequences (see [`pool_steps_logits`] for their tables).
fn two_sequence_pool() -> gpu::BatchedCache {
    gpu::BatchedCache {
        blocks: 24,
        block_size: 16,
        sequences: 2,
    }
}

/// A prompt of `len` tokens, `seed` its first.
fn pool_prompt(len: u32, seed: u32) -> Vec<u32> {
    (0..len).map(|i| (seed + 37 * i) % 300).collect()
}

/// Steps of two sequences whose prompts are cut into tensor-core attention's tiles: a prompt
/// longer than a tile of 128 rows beside a short one, then both continued past their cached
/// rows, then a decode step of each (the split attention).
fn prompts_past_a_tile() -> [Vec<(usize, Vec<u32>)>; 3] {
    [
        vec![(0, pool_prompt(130, 5)), (0, pool_prompt(9, 11))],
        vec![(130, pool_prompt(40, 23)), (9, pool_prompt(20, 29))],
        vec![(170, vec![7]), (29, vec![9])],
    ]
}

/// The block tables of [`two_sequence_pool`]'s sequences: sequence s holds blocks 2b + s, in
/// reverse order.
fn pool_tables() -> Vec<Vec<runtime::kv::BlockId>> {
    (0..2u32)
        .map(|s| (0..12).rev().map(|b| runtime::kv::BlockId(2 * b + s)).collect())
        .collect()
}

/// Each step's logits, every sequence's, on `gpu` over [`two_sequence_pool`] ([`pool_tables`]).
fn pool_steps_logits(gpu: &EmulatorBackend, steps: &[Vec<(usize, Vec<u32>)>]) -> Vec<Vec<f32>> {
    let tables = pool_tables();
    steps
        .iter()
        .flat_map(|segments| gpu.step_batch(&batch_of(segments, &tables)).unwrap())
        .map(|outputs| outputs["logits"].data.clone())
        .collect()
}

/// `logits` of a Hopper plan attending on each `wgmma` form as on `mma.sync`, within the
/// rounding of the activations to bf16: the same bf16 products summed in f32, but over key
/// tiles of 128 where `mma.sync` takes 64, so a row's exponents past its 64th key are taken
/// against its running max once, not twice, and its sum added up in another order. The
/// attention outputs then differ in f32's last bits, which flips the bf16 rounding of some
/// activations the next GEMMs read (a step of 2⁻⁸ relative), so the logits agree within
/// 4e-3 of their largest (1.7e-3 on the batched steps past a tile).
fn each_wgmma_attention_gives_the_mma_ones(logits: impl Fn(gpu::PrefillAttention) -> Vec<Vec<f32>>) {
    let mma = logits(gpu::PrefillAttention::Mma);
    for attention in [gpu::PrefillAttention::Wgmma, gpu::PrefillAttention::WgmmaSpecialised] {
        for (i, (w, m)) in logits(attention).iter().zip(&mma).enumerate() {
            let error = relative_error(w, m);
            assert!(error <= 4e-3, "{attention:?}: output {i}: error {error}");
        }
    }
}

/// `bbc gpu-check`'s lockstep of a serving plan (two prompts in one step, then decode steps)
/// runs end to end: with the emulator standing in for the GPU every kernel agrees exactly,
/// the prompts' step attending on the tensor cores (a launch a layer) and the decode steps
/// through the split attention (either form) and its merge.
#[test]
fn the_gpu_checks_batched_lockstep_runs_on_the_emulator() {
    let model = open("llama", ComputeDtype::Bf16);
    for decode_attention in [gpu::DecodeAttention::Scalar, gpu::DecodeAttention::Vector] {
        let kernels = gpu::PlanKernels {
            decode_attention,
            ..Default::default()
        };
        let errors = bbc::gpu_check::kernels::batched_kernel_errors(&model, (Target::H200, kernels), |kernels| {
            Ok(EmulatorDevice::new(kernels.to_vec()))
        })
        .unwrap();
        assert!(errors.iter().all(|(_, _, error)| *error == 0.0), "{errors:?}");
        let layers = model.config.layers;
        let launches = |stem: &str| -> usize {
            errors
                .iter()
                .filter(|(kernel, ..)| kernel.starts_with(stem))
                .map(|(_, launches, _)| launches)
                .sum()
        };
        assert_eq!(launches("flash_attention"), layers, "{errors:?}");
        assert_eq!(launches("attention_combine"), 3 * layers, "{errors:?}");
        // The split passes, a launch a layer each decode step, all of the chosen form.
        let splits: Vec<&(String, usize, f64)> = errors
            .iter()
            .filter(|(kernel, ..)| kernel.starts_with("attention") && !kernel.starts_with("attention_combine"))
            .collect();
        assert_eq!(
            splits.iter().map(|(_, n, _)| n).sum::<usize>(),
            3 * layers,
            "{errors:?}"
        );
        let vector = decode_attention == gpu::DecodeAttention::Vector;
        assert!(
            splits
                .iter()
                .all(|(kernel, ..)| kernel.starts_with("attention_vector") == vector),
            "{decode_attention:?}: {splits:?}"
        );
    }
    // Over an FP8 cache (as the check runs it: f32 weights, the vector split pass) the prompts
    // attend on the tensor cores too, the decode steps through the vector pass.
    let mut spec = ModelSpec::for_weights(&fixture("hf-tiny/llama"));
    spec.dtype = ComputeDtype::F32;
    spec.kv_cache_dtype = models::KvCacheDtype::Fp8;
    let model = Model::open(spec).unwrap();
    let kernels = gpu::PlanKernels {
        decode_attention: gpu::DecodeAttention::Vector,
        ..Default::default()
    };
    let errors = bbc::gpu_check::kernels::batched_kernel_errors(&model, (Target::H200, kernels), |kernels| {
        Ok(EmulatorDevice::new(kernels.to_vec()))
    })
    .unwrap();
    assert!(errors.iter().all(|(_, _, error)| *error == 0.0), "{errors:?}");
    let launches = |stem: &str| -> usize {
        errors
            .iter()
            .filter(|(kernel, ..)| kernel.starts_with(stem))
            .map(|(_, launches, _)| launches)
            .sum()
    };
    assert_eq!(launches("flash_attention"), model.config.layers, "{errors:?}");
    assert_eq!(launches("attention_vector"), 3 * model.config.layers, "{errors:?}");
}
