//! `bbc compile` of SmolLM2 and Gemma 3 (bf16 weights, and the GGUF files' own quantization)
//! for h200, b200 and rtx-pro-6000: a
//! kernel for every launch, and a memory plan whose buffers never overlap while live. With
//! NVRTC installed (CI installs it) the full artifact is written, PTX included.

mod common;

use codegen::gpu::{self, LaunchArg};
use codegen::Target;
use models::{ComputeDtype, LogitsFor, Model, ModelSpec};
use std::collections::HashSet;

/// SmolLM2's serving graph (logits for every row) fused for the H200.
/// Whether NVRTC can compile here; without it the test says it skipped, unless CI requires
/// NVRTC (`BBC_REQUIRE_NVRTC`), where its absence is a failure.
fn nvrtc_present() -> bool {
    if codegen::nvrtc::ensure_loaded().is_ok() {
        return true;
    }
    assert!(
        std::env::var_os("BBC_REQUIRE_NVRTC").is_none(),
        "BBC_REQUIRE_NVRTC is set but NVRTC is missing"
    );
    eprintln!("skipped: NVRTC not installed");
    false
}

/// The logits graph alone.
fn graphs(logits: &ir::Graph) -> codegen::CompiledGraphs<'_> {
    codegen::CompiledGraphs {
        logits,
        greedy: None,
        serving: None,
        mtp: None,
        eagle: None,
    }
}

fn fused(name: &str, target: Target, dtype: ComputeDtype) -> (Model, ir::Graph) {
    let mut spec = ModelSpec::for_weights(&common::real_model(name));
    spec.dtype = dtype;
    let model = Model::open(spec).unwrap();
    let graph = model.lower(LogitsFor::LastToken).unwrap();
    let fused = passes::optimized(&graph, bbc::model_ref::cost_model(target)).unwrap();
    (model, fused)
}

/// `config`'s graph in bf16, lowered without weights.
fn bf16_graph(config: &models::ModelConfig) -> ir::Graph {
    let options = models::LowerOptions {
        logits: LogitsFor::LastToken,
        compute: ComputeDtype::Bf16,
        kv_cache: models::KvCacheDtype::Auto,
    };
    models::lower_without_weights(config, options).unwrap()
}

/// The Llama-3-8B-shaped graph in bf16, lowered without weights.
fn llama_8b_graph() -> ir::Graph {
    bf16_graph(&models::ModelConfig::llama3_8b())
}

/// `graph`'s serving plan for `target` as `bbc compile` writes it (each sequence's argmax
/// beside its logits; a pool of 64 blocks of 16 positions), with its kernels.
fn serving_plan(graph: &ir::Graph, target: Target) -> (gpu::GpuPlan, Vec<kernels_gen::dsl::Kernel>) {
    let fused = passes::optimized(graph, bbc::model_ref::cost_model(target)).unwrap();
    let serving = models::with_greedy_token(&fused).unwrap();
    let cache = gpu::BatchedCache {
        blocks: 64,
        block_size: 16,
        sequences: 64,
    };
    gpu::build_batched(&serving, target, 512, cache).unwrap()
}

#[test]
fn plans_for_every_gpu_target_are_complete_and_never_overlap() {
    for (name, dtype) in [
        ("smollm2", ComputeDtype::Bf16),
        ("gemma3-270m", ComputeDtype::Bf16),
        ("smollm2", ComputeDtype::Native),
        ("gemma3-270m", ComputeDtype::Native),
    ] {
        for target in [Target::H200, Target::B200, Target::RtxPro6000] {
            let (_, graph) = fused(name, target, dtype);
            let plan = gpu::build(&graph, target, 512).unwrap();
            assert_eq!(plan.arch, target.cuda_arch().unwrap());
            if let Some((a, b)) = plan.memory.conflict() {
                panic!(
                    "{name} on {}: buffers of %{} and %{} overlap while both live",
                    target.name(),
                    a.node,
                    b.node
                );
            }
            let kernels: HashSet<&str> = plan.kernels.iter().map(|k| k.name.as_str()).collect();
            let planned: HashSet<usize> = plan.memory.buffers.iter().map(|b| b.node).collect();
            for launch in &plan.launches {
                assert!(kernels.contains(launch.kernel.as_str()), "{}", launch.kernel);
                // Arguments bind to the parameters of the kernel, and of its prefill variant (a
                // tensor-core GEMM or a several-tokens-per-pass GEMV), in order: each kernel
                // takes the first of them, and one of the two takes all (a GEMM that splits K
                // takes two more than the GEMV).
                let mut widest = 0;
                let variants = [&launch.prefill_kernel, &launch.few_rows_kernel, &launch.batch_kernel];
                for kernel in std::iter::once(&launch.kernel).chain(variants.into_iter().flatten()) {
                    assert!(kernels.contains(kernel.as_str()), "{kernel}");
                    let params = &plan.kernels.iter().find(|k| &k.name == kernel).unwrap().params;
                    assert!(launch.args.len() >= params.len(), "{kernel}");
                    widest = widest.max(params.len());
                    for (arg, param) in launch.args.iter().zip(params) {
                        assert_eq!(
                            matches!(arg, LaunchArg::Scalar { .. }),
                            param.kind != "buffer",
                            "{kernel} {}",
                            param.name
                        );
                    }
                }
                assert_eq!(widest, launch.args.len(), "{}", launch.kernel);
                for arg in &launch.args {
                    if let LaunchArg::Activation { node, .. } = arg {
                        assert!(planned.contains(node), "%{node} has no buffer");
                    }
                }
            }
            // Each weight is on the device once: read by a launch, and no part of a stack
            // (joined Q/K/V, gate/up) uploaded by itself as well.
            let read = gpu::weights_read(&plan.launches);
            let mut parts = HashSet::new();
            for w in &plan.weights {
                assert!(
                    read.contains(&w.node),
                    "{name}: weight %{} is read by no launch",
                    w.node
                );
                for part in &w.parts {
                    assert!(parts.insert(part), "{name}: `{part}` is on the device twice");
                }
            }
            // Every matmul's GEMV reads its activation 16 bytes at a time (the views of these
            // models all start 16-byte aligned); scalar loads would bound a GPU decode.
            for launch in plan.launches.iter().filter(|l| l.kernel.contains("gemv")) {
                let source = &plan.kernels.iter().find(|k| k.name == launch.kernel).unwrap().source;
                assert!(
                    source.contains("*reinterpret_cast<const float4*>(x + "),
                    "{name}: {} reads x with scalar loads",
                    launch.kernel
                );
            }
            // Every op of the graph that computes something has a launch (`last_token` is a view).
            let launched: HashSet<usize> = plan.launches.iter().map(|l| l.node).collect();
            let views = graph.nodes().iter().filter(|n| n.op == ir::Op::LastToken).count();
            assert_eq!(
                launched.len(),
                graph.op_count() - views,
                "{name}: one launch group per op"
            );
            assert_eq!(
                plan.kv_cache.len(),
                graph
                    .nodes()
                    .iter()
                    .filter(|n| n.op.appended_attention().is_some())
                    .count()
            );
            // Plain matmuls get a tensor-core GEMM for prefill steps (bf16 weights, or GGUF
            // blocks decoded into its tiles), norm-fused ones too on Hopper with bf16 weights
            // (where a layer's residual add and pre-norm are the prologue of its QKV and
            // gate/up projections); every matmul has a prefill variant.
            let prefill = |prefix: &str| {
                plan.launches
                    .iter()
                    .filter(|l| l.prefill_kernel.as_deref().is_some_and(|k| k.starts_with(prefix)))
                    .count()
            };
            let gemms = prefill("gemm");
            assert!(gemms > 0, "{name} {dtype:?}: no prefill GEMM");
            if target == Target::H200 && dtype == ComputeDtype::Bf16 {
                assert!(prefill("rms_norm_gemm") > 0, "{name}: no norm GEMM on Hopper");
                assert!(
                    prefill("add_rms_norm_gemm") > 0,
                    "{name}: no residual norm GEMM on Hopper"
                );
            }
            let matmuls = graph
                .nodes()
                .iter()
                .filter(|n| {
                    matches!(
                        n.op,
                        ir::Op::MatMul | ir::Op::RmsNormMatMul { .. } | ir::Op::AddRmsNormMatMul { .. }
                    )
                })
                .count();
            // The prologue kernels (`rms_norm_…`, `add_rms_norm_…`, the latter perhaps with the
            // GLU epilogue: `add_rms_norm_swiglu_gemm`).
            assert_eq!(
                gemms + prefill("gemv") + prefill("rms_norm_") + prefill("add_rms_norm_"),
                matmuls,
                "{name} {dtype:?}"
            );
            // And a GEMV carrying several rows per pass for small batches.
            let few_rows = plan.launches.iter().filter(|l| l.few_rows_kernel.is_some()).count();
            assert_eq!(few_rows, matmuls, "{name} {dtype:?}");
        }
    }
}

#[test]
fn gpu_artifacts_carry_kernels_ptx_cubins_and_plan() {
    if !nvrtc_present() {
        return;
    }
    for target in [Target::H200, Target::B200, Target::RtxPro6000] {
        let (model, graph) = fused("smollm2", target, ComputeDtype::Native);
        let scratch = common::scratch_dir(&format!("bbc-gpu-{}-", target.name()));
        let dir = scratch.path();
        let manifest = codegen::compile(&model, graphs(&graph), target, dir).unwrap();
        assert_eq!(manifest.greedy_plan, None);
        assert_eq!(manifest.plan.as_deref(), Some("plan.json"));
        let plan: gpu::GpuPlan =
            serde_json::from_str(&std::fs::read_to_string(dir.join("plan.json")).unwrap()).unwrap();
        for k in &plan.kernels {
            assert!(dir.join(format!("kernels/{}.cu", k.name)).is_file());
            let ptx = std::fs::read_to_string(dir.join(k.ptx.as_ref().unwrap())).unwrap();
            assert!(ptx.contains(&format!(".entry {}", k.name)));
            assert!(k.registers.unwrap() > 0);
            // The cubin: an ELF image of the target's machine code, naming the kernel.
            let cubin = std::fs::read(dir.join(k.cubin.as_ref().unwrap())).unwrap();
            assert_eq!(&cubin[..4], b"\x7fELF", "{}", k.name);
            assert!(
                cubin.windows(k.name.len()).any(|w| w == k.name.as_bytes()),
                "{}",
                k.name
            );
        }
    }
}

/// `bbc compile` of a GGUF MoE model in its own blocks (the tiny Qwen3-Next, Q8_0; the tiny
/// GLM-4.5 as llama.cpp's MXFP4_MOE, experts in MXFP4) builds for every GPU target: the
/// experts' gate/up kernel decodes two rows' blocks in one loop (each decode's temporaries had
/// the same names, which NVRTC refused as declared twice).
#[test]
fn a_quantized_moe_gguf_compiles_for_every_gpu_target() {
    if !nvrtc_present() {
        return;
    }
    let scratch = common::scratch_dir("bbc-gpu-moe-q8-");
    for file in ["qwen3_next.q8_0", "glm4_moe.mxfp4_moe"] {
        let weights = common::fixture(&format!("gguf-tiny/{file}.gguf"));
        for target in [Target::H200, Target::B200, Target::RtxPro6000] {
            compile_every_plan(&weights, target, &scratch.path().join(file).join(target.name()));
        }
    }
}

/// `bbc compile` of a GGUF into bf16 plans: each plan carries the kernels that convert the
/// file's block formats on the device where it loads (with their cubins); kept in its blocks,
/// none, but a plan taking steps of more than `BATCH_ROWS` rows carries the kernels decoding
/// each format into a bf16 copy for such a step's GEMM. Kept in blocks, every matmul's steps
/// of many rows run a tensor-core GEMM over rows made bf16 before it.
#[test]
fn gguf_blocks_compiled_to_bf16_carry_their_conversions() {
    if !nvrtc_present() {
        return;
    }
    let scratch = common::scratch_dir("bbc-gpu-convert-");
    let weights = bbc::gpu_check::tiny_gguf::quantized_llama(scratch.path()).unwrap();
    for (dtype, conversions) in [
        ("bf16", ["convert_q8_0_to_bf16", "convert_q4_0_to_bf16"].as_slice()),
        ("native", &[]),
    ] {
        let toml = scratch.path().join(format!("{dtype}.toml"));
        std::fs::write(&toml, format!("[model]\nweights = {weights:?}\ndtype = \"{dtype}\"\n")).unwrap();
        let output = scratch.path().join(dtype);
        compile_every_plan(&toml, Target::H200, &output);
        let manifest = codegen::read_manifest(&output).unwrap();
        let mut wide_plans = 0;
        for file in [manifest.plan, manifest.greedy_plan, manifest.serving_plan]
            .iter()
            .flatten()
        {
            let plan: gpu::GpuPlan =
                serde_json::from_str(&std::fs::read_to_string(output.join(file)).unwrap()).unwrap();
            let (for_prefill, carried): (Vec<&str>, Vec<&str>) = plan
                .kernels
                .iter()
                .map(|k| k.name.as_str())
                .filter(|name| name.starts_with("convert_"))
                .partition(|name| name.contains("_for_prefill"));
            assert_eq!(carried, conversions, "{dtype}: {file}");
            let formats: Vec<&str> = for_prefill
                .iter()
                .map(|name| name.trim_start_matches("convert_").split("_to_").next().unwrap())
                .collect();
            let expected: &[&str] = match dtype == "native" && plan.max_tokens > gpu::BATCH_ROWS {
                true => &["q8_0", "q4_0"],
                false => &[],
            };
            assert_eq!(formats, expected, "{dtype}: {file} ({} rows)", plan.max_tokens);
            wide_plans += usize::from(plan.max_tokens > gpu::BATCH_ROWS);
            // Kept in blocks, every matmul multiplies many rows on the tensor cores after the
            // launch making its rows bf16: the decoding GEMM, or beyond a batch's rows the TMA
            // GEMM over the copy.
            for (i, launch) in plan.launches.iter().enumerate() {
                if dtype != "native" || !launch.kernel.contains("gemv") {
                    continue;
                }
                let gemm = |kernel: &Option<String>, stem: &str| kernel.as_deref().is_some_and(|k| k.contains(stem));
                let wide = plan.max_tokens > gpu::BATCH_ROWS;
                let (prefill, batch) = match wide {
                    true => ("gemm_tma", "gemm_after_rows"),
                    false => ("gemm_after_rows", "none"),
                };
                assert!(gemm(&launch.prefill_kernel, prefill), "{file}: {launch:?}");
                assert_eq!(gemm(&launch.batch_kernel, batch), wide, "{file}: {launch:?}");
                let before = &plan.launches[i - 1].kernel;
                assert!(before.contains("bf16_rows"), "{file}: {} after {before}", launch.kernel);
            }
        }
        assert!(
            wide_plans > 0,
            "{dtype}: no plan takes more than {} rows",
            gpu::BATCH_ROWS
        );
    }
}

/// `bbc compile` of `model` (weights or a model.toml) for `target` into `output`: every plan
/// there, each kernel with its cubin and register count (ptxas built it without spills).
fn compile_every_plan(model: &std::path::Path, target: Target, output: &std::path::Path) {
    let args = bbc::commands::compile::CompileArgs {
        model: model.to_str().unwrap(),
        target: target.name(),
        output,
        emit: None,
        emit_after: None,
        verify: false,
        tokenizer: None,
        draft_head: bbc::serve::DraftHead::Full,
        speculative_config: None,
        prefill_gemm: Default::default(),
        prefill_attention: Default::default(),
        decode_attention: Default::default(),
        prefill_delta_rule: Default::default(),
        prefill_experts: Default::default(),
        kv_cache_dtype: None,
        dtype: None,
        load_format: Default::default(),
        quantization: None,
    };
    bbc::commands::compile::compile(&args)
        .unwrap_or_else(|e| panic!("{} on {}: {e:#}", model.display(), target.name()));
    let manifest = codegen::read_manifest(output).unwrap();
    assert!(manifest.plan.is_some() && manifest.serving_plan.is_some());
    for file in [manifest.plan, manifest.greedy_plan, manifest.serving_plan]
        .iter()
        .flatten()
    {
        let plan: gpu::GpuPlan = serde_json::from_str(&std::fs::read_to_string(output.join(file)).unwrap()).unwrap();
        assert!(plan.kernels.iter().all(|k| k.cubin.is_some() && k.registers.is_some()));
    }
}

/// `bbc compile` of the tiny Llama and Gemma 3 (HF safetensors) in f32 and bf16 builds every
/// plan for every GPU target: each kernel through ptxas without spills (an f32 decode GEMV
/// spilled on sm_100a under ptxas's own register choice, so `bbc compile --target b200` failed
/// for every f32 model).
#[test]
fn tiny_models_compile_for_every_gpu_target_in_f32_and_bf16() {
    if !nvrtc_present() {
        return;
    }
    let scratch = common::scratch_dir("bbc-gpu-tiny-");
    let dir = scratch.path();
    for family in bbc::gpu_check::kernels::GPU_FAMILIES {
        for dtype in ["f32", "bf16"] {
            let weights = common::fixture(&format!("hf-tiny/{family}"));
            let toml = dir.join(format!("{family}-{dtype}.toml"));
            std::fs::write(&toml, format!("[model]\nweights = {weights:?}\ndtype = \"{dtype}\"\n")).unwrap();
            for target in [Target::H200, Target::B200, Target::RtxPro6000] {
                let output = dir.join(format!("{family}-{dtype}-{}", target.name()));
                compile_every_plan(&toml, target, &output);
            }
        }
    }
}

/// A config of Gemma 4's released shapes (`models::config::shapes`): E2B's (35 layers, the
/// last 20 KV-shared with double-wide MLPs, heads of 256 and 512 over one KV head, per-layer
/// inputs) or 26B-A4B's (30 layers, 128 experts of 704 beside each MLP, 8 a token;
/// full-attention layers with keys as values over 2 KV heads of 512).
fn gemma4_config(moe: bool) -> models::ModelConfig {
    let name = if moe { "gemma4-26b-a4b" } else { "gemma4-e2b" };
    let json = models::config::shapes::config_json(name).unwrap();
    models::ModelConfig::from_hf_json(json, std::path::Path::new(name)).unwrap()
}

/// Every kernel of the 8B-shaped serving plan (what `bbc gpu-check` times, and what a served
/// Llama 3 8B runs), of the Qwen3.5-27B-shaped one (its DeltaNet layers' heads of 128, gated
/// attention with heads of 256) and of Gemma 4 E2B's and 26B-A4B's shapes (attention over
/// heads of 512, KV-shared layers on the sampled rows, MoE routing among 128 experts) builds
/// for each GPU target without register spills, as artifacts build kernels
/// (`codegen::spill_free`): ptxas's own register choice spilled the 8B attention kernel on
/// every target. Nor does ptxas warn, or note a loss of performance.
#[test]
fn the_8b_qwen3_5_27b_and_gemma4_shaped_plans_kernels_build_without_spills() {
    if !nvrtc_present() {
        return;
    }
    let graphs = [
        llama_8b_graph(),
        bf16_graph(&models::ModelConfig::qwen3_5_27b()),
        bf16_graph(&gemma4_config(false)),
        bf16_graph(&gemma4_config(true)),
    ];
    for (graph, target) in graphs
        .iter()
        .flat_map(|g| [Target::H200, Target::B200, Target::RtxPro6000].map(|t| (g, t)))
    {
        let (plan, kernels) = serving_plan(graph, target);
        for k in &kernels {
            let source = kernels_gen::cuda::emit(k);
            let built = codegen::spill_free::build(&k.name, &source, k.block_dim, &plan.arch).unwrap();
            let resources = built.resources.as_ref().expect("a ptxas report");
            assert!(!built.spills(), "{} on {}: {resources:?}", k.name, plan.arch);
            // No ptxas warning, nor a note of lost performance (a serialised `wgmma`).
            assert!(
                resources.warnings.is_empty(),
                "{} on {}: {resources:?}",
                k.name,
                plan.arch
            );
            if let Some(blocks) = built.min_blocks_per_sm {
                println!(
                    "{} on {}: {} registers, {blocks} blocks an SM asked for",
                    k.name, plan.arch, resources.registers
                );
            }
        }
    }
}

/// A dense table past 2³¹ elements that only embedding lookups read is planned (they index
/// its rows in 64 bits: Gemma 4 E2B's per-layer embeddings), the same size read by a GEMV is
/// refused by name: an 8B shape with a vocabulary of 600 000 (its untied head 2.46 G elements).
#[test]
fn only_embedding_lookups_read_tables_past_32_bit_indices() {
    let e2b = bf16_graph(&gemma4_config(false));
    gpu::build(
        &passes::optimized(&e2b, passes::CostModel::H200).unwrap(),
        Target::H200,
        64,
    )
    .unwrap();
    let mut wide = models::ModelConfig::llama3_8b();
    wide.vocab_size = 600_000;
    let graph = passes::optimized(&bf16_graph(&wide), passes::CostModel::H200).unwrap();
    let err = gpu::build(&graph, Target::H200, 64).unwrap_err().to_string();
    assert!(
        err.contains("lm_head.weight") && err.contains("32-bit indices"),
        "{err}"
    );
}

/// The 8B-shaped serving plan prefills every matmul (four a layer and the head) through the
/// target's TMA GEMM, each after the launch making its bf16 rows; asked for the pipelined
/// GEMM, none; decode steps take the same GEMVs either way.
#[test]
fn plans_prefill_through_the_tma_gemm_unless_asked_otherwise() {
    // Each decode launch's kernel source (its plan-given name taken out) and arguments.
    fn decode(plan: &gpu::GpuPlan) -> Vec<(String, Vec<gpu::LaunchArg>)> {
        let source = |name: &str| {
            let kernel = plan.kernels.iter().find(|k| k.name == name).unwrap();
            kernel.source.replace(name, "")
        };
        plan.launches
            .iter()
            .filter(|l| !l.kernel.contains("bf16_rows") && !l.kernel.starts_with("split_k_reduce"))
            .map(|l| {
                let gemv_args = l
                    .args
                    .iter()
                    .take_while(|a| !matches!(a, gpu::LaunchArg::Scratch { .. }));
                (source(&l.kernel), gemv_args.cloned().collect())
            })
            .collect()
    }
    let cache = gpu::BatchedCache {
        blocks: 64,
        block_size: 16,
        sequences: 64,
    };
    let plan = |target, prefill| {
        let fused = passes::optimized(&llama_8b_graph(), bbc::model_ref::cost_model(target)).unwrap();
        let serving = models::with_greedy_token(&fused).unwrap();
        gpu::build_program(&serving, target, 512, Some(cache), prefill)
            .unwrap()
            .0
    };
    let tma_gemms = |plan: &gpu::GpuPlan| {
        let prefill = |l: &gpu::Launch| l.prefill_kernel.as_deref().unwrap_or("").contains("gemm_tma");
        let after_rows = (1..plan.launches.len())
            .filter(|&i| prefill(&plan.launches[i]))
            .all(|i| plan.launches[i - 1].kernel.contains("bf16_rows"));
        (plan.launches.iter().filter(|l| prefill(l)).count(), after_rows)
    };
    for target in [Target::H200, Target::B200, Target::RtxPro6000] {
        let tma = plan(target, gpu::PrefillGemm::Tma);
        assert_eq!(tma_gemms(&tma), (4 * 32 + 1, true), "{}", target.name());
        let pipelined = plan(target, gpu::PrefillGemm::Pipelined);
        assert_eq!(tma_gemms(&pipelined).0, 0, "{}", target.name());
        assert!(!pipelined.launches.iter().any(|l| l.kernel.contains("bf16_rows")));
        assert!(
            decode(&tma) == decode(&pipelined),
            "{}: decode launches differ",
            target.name()
        );
        // Warp-specialised: Hopper's GEMMs gain a producer warp (9 warps a block), the B200's
        // a producer and an MMA warp (6); the RTX PRO 6000 has no such form and plans as with
        // `Tma`.
        let specialised = plan(target, gpu::PrefillGemm::Specialised);
        assert_eq!(tma_gemms(&specialised), (4 * 32 + 1, true), "{}", target.name());
        let blocks: std::collections::BTreeSet<u32> = specialised
            .kernels
            .iter()
            .filter(|k| k.name.contains("gemm_tma"))
            .map(|k| k.block)
            .collect();
        match target {
            Target::H200 => assert_eq!(blocks, [288].into()),
            Target::B200 => assert_eq!(blocks, [192].into()),
            _ => assert!(specialised == tma, "{}", target.name()),
        }
        assert!(decode(&specialised) == decode(&tma), "{}", target.name());
        // Persistent: Hopper's and the B200's GEMMs are the warp-specialised ones in at most a
        // block a multiprocessor, named for it; the RTX PRO 6000 plans as with `Tma`.
        let persistent = plan(target, gpu::PrefillGemm::Persistent);
        assert_eq!(tma_gemms(&persistent), (4 * 32 + 1, true), "{}", target.name());
        let gemms: Vec<&gpu::KernelEntry> = persistent
            .kernels
            .iter()
            .filter(|k| k.name.contains("gemm_tma"))
            .collect();
        let persistent_with = |block| {
            gemms
                .iter()
                .all(|k| k.block == block && k.name.contains("_tma_persistent"))
        };
        match target {
            Target::H200 => assert!(persistent_with(288)),
            Target::B200 => assert!(persistent_with(192)),
            _ => assert!(persistent == tma, "{}", target.name()),
        }
        assert!(decode(&persistent) == decode(&tma), "{}", target.name());
    }
}

/// `bbc compile` of `toml` for `target` into a directory of `scratch` named for the choice,
/// with `flag` set to `choice` where one is given: the artifact's path and the command's
/// output.
fn compile_choosing(
    toml: &std::path::Path,
    target: &str,
    scratch: &std::path::Path,
    (flag, choice): (&str, Option<&str>),
) -> (std::path::PathBuf, std::process::Output) {
    let artifact = scratch.join(format!("{target}-{}", choice.unwrap_or("default")));
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_bbc"));
    command
        .args(["compile", toml.to_str().unwrap(), "--target", target, "-o"])
        .arg(&artifact);
    if let Some(choice) = choice {
        command.args([flag, choice]);
    }
    (artifact, command.output().unwrap())
}

/// `bbc compile --prefill-gemm`: by default a bf16 model's plans carry the TMA GEMMs (their
/// entries stating their tensor maps) and the launches making their rows; `specialised` and
/// `persistent`, the warp-specialised TMA GEMMs (Hopper's a ninth warp, the B200's a producer
/// and an MMA warp beside four epilogue warps), built spill-free; `pipelined`, none.
#[test]
fn compile_chooses_the_prefill_gemm() {
    if !nvrtc_present() {
        return;
    }
    let scratch = common::scratch_dir("bbc-gpu-prefill-gemm-");
    let weights = common::fixture("hf-tiny/llama");
    let toml = scratch.path().join("llama-bf16.toml");
    std::fs::write(&toml, format!("[model]\nweights = {weights:?}\ndtype = \"bf16\"\n")).unwrap();
    // (target, choice, TMA GEMMs, their threads a block)
    for (target, choice, tma, block) in [
        ("h200", None, true, 256),
        ("h200", Some("specialised"), true, 288),
        ("h200", Some("persistent"), true, 288),
        ("h200", Some("pipelined"), false, 0),
        ("b200", Some("specialised"), true, 192),
        ("b200", Some("persistent"), true, 192),
    ] {
        let (artifact, out) = compile_choosing(&toml, target, scratch.path(), ("--prefill-gemm", choice));
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let manifest = codegen::read_manifest(&artifact).unwrap();
        let recorded = serde_json::to_value(manifest.prefill_gemm).unwrap();
        assert_eq!(
            recorded,
            serde_json::json!(choice.unwrap_or("tma")),
            "{target} {choice:?}"
        );
        for file in [manifest.plan, manifest.serving_plan].iter().flatten() {
            let plan: gpu::GpuPlan =
                serde_json::from_str(&std::fs::read_to_string(artifact.join(file)).unwrap()).unwrap();
            let gemms: Vec<&gpu::KernelEntry> = plan.kernels.iter().filter(|k| k.name.contains("gemm_tma")).collect();
            let rows = plan.kernels.iter().any(|k| k.name.contains("bf16_rows"));
            assert_eq!((!gemms.is_empty(), rows), (tma, tma), "{target} {choice:?}: {file}");
            assert!(gemms
                .iter()
                .all(|k| k.tensor_maps.len() == 2 && k.cubin.is_some() && k.block == block));
        }
    }
    let (_, out) = compile_choosing(&toml, "h200", scratch.path(), ("--prefill-gemm", Some("fast")));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("tma") && stderr.contains("pipelined"),
        "{stderr}"
    );
}

/// `bbc compile --prefill-attention`: by default (`mma`) the plans' prompts attend with the
/// `mma.sync` flash kernel; `wgmma`, on Hopper with the `wgmma` one (the B200 keeps the
/// `mma.sync` one); `tcgen05`, on the B200 with the `tcgen05` one (Hopper keeps `mma.sync`);
/// the manifest records the choice, and an unknown one is refused.
#[test]
fn compile_chooses_the_prefill_attention() {
    if !nvrtc_present() {
        return;
    }
    let scratch = common::scratch_dir("bbc-gpu-prefill-attention-");
    let weights = common::fixture("hf-tiny/llama");
    let toml = scratch.path().join("llama-bf16.toml");
    std::fs::write(&toml, format!("[model]\nweights = {weights:?}\ndtype = \"bf16\"\n")).unwrap();
    let compile = |target: &str, choice: Option<&str>| {
        compile_choosing(&toml, target, scratch.path(), ("--prefill-attention", choice))
    };
    // (target, choice, the flash kernel its plans launch)
    for (target, choice, flash) in [
        ("h200", None, "flash_attention"),
        ("h200", Some("wgmma"), "flash_attention_wgmma"),
        ("h200", Some("wgmma-specialised"), "flash_attention_wgmma_specialised"),
        // The fixture's heads of 16 dims are no whole TMA box: the copying schedule.
        ("h200", Some("wgmma-tma"), "flash_attention_wgmma_specialised"),
        ("b200", Some("wgmma"), "flash_attention"),
        ("b200", Some("tcgen05"), "flash_attention_tcgen05"),
        ("b200", Some("tcgen05-tma"), "flash_attention_tcgen05"),
        ("h200", Some("tcgen05"), "flash_attention"),
    ] {
        let (artifact, out) = compile(target, choice);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let manifest = codegen::read_manifest(&artifact).unwrap();
        let recorded = serde_json::to_value(manifest.prefill_attention).unwrap();
        assert_eq!(
            recorded,
            serde_json::json!(choice.unwrap_or("mma")),
            "{target} {choice:?}"
        );
        for file in [manifest.plan, manifest.serving_plan].iter().flatten() {
            let plan: gpu::GpuPlan =
                serde_json::from_str(&std::fs::read_to_string(artifact.join(file)).unwrap()).unwrap();
            let kernels: Vec<&str> = plan
                .launches
                .iter()
                .map(|l| l.kernel.as_str())
                .filter(|k| k.starts_with("flash_attention"))
                .collect();
            // Each launch's form: the longest form's name it starts with.
            let form = |k: &str| {
                [
                    "flash_attention_wgmma_specialised",
                    "flash_attention_wgmma_tma",
                    "flash_attention_wgmma",
                    "flash_attention_tcgen05_tma",
                    "flash_attention_tcgen05",
                    "flash_attention",
                ]
                .into_iter()
                .find(|form| k.starts_with(form))
            };
            assert_eq!(kernels.len(), 3, "{target} {choice:?} {file}: a launch a layer");
            assert!(
                kernels.iter().all(|k| form(k) == Some(flash)),
                "{target} {choice:?} {file}: {kernels:?}"
            );
        }
    }
    let (_, out) = compile("h200", Some("fast"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("mma") && stderr.contains("wgmma"),
        "{stderr}"
    );
}

/// `bbc compile --prefill-delta-rule`: by default (`chunked`) the plans hold both forms of
/// each Gated DeltaNet layer's delta rule (the chunked kernels for prompts, the recurrent one
/// for the other steps, each launch gated by the step's shape); `recurrent`, the recurrent
/// one alone; the manifest records the choice, and an unknown one is refused.
#[test]
fn compile_chooses_the_prefill_delta_rule() {
    if !nvrtc_present() {
        return;
    }
    let scratch = common::scratch_dir("bbc-gpu-delta-rule-");
    let toml = scratch.path().join("qwen3_5.toml");
    let weights = common::fixture("hf-tiny/qwen3_5");
    std::fs::write(&toml, format!("[model]\nweights = {weights:?}\n")).unwrap();
    let compile =
        |choice: Option<&str>| compile_choosing(&toml, "h200", scratch.path(), ("--prefill-delta-rule", choice));
    for (choice, chunked) in [(None, true), (Some("recurrent"), false), (Some("chunked"), true)] {
        let (artifact, out) = compile(choice);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let manifest = codegen::read_manifest(&artifact).unwrap();
        let recorded = serde_json::to_value(manifest.prefill_delta_rule).unwrap();
        assert_eq!(recorded, serde_json::json!(choice.unwrap_or("chunked")), "{choice:?}");
        for file in [manifest.plan, manifest.serving_plan].iter().flatten() {
            let plan: gpu::GpuPlan =
                serde_json::from_str(&std::fs::read_to_string(artifact.join(file)).unwrap()).unwrap();
            let count = |name: &str| plan.launches.iter().filter(|l| l.kernel.starts_with(name)).count();
            // The fixture's three Gated DeltaNet layers.
            assert_eq!(count("delta_rule"), 3, "{choice:?} {file}");
            let chunk_launches = if chunked { 3 } else { 0 };
            assert_eq!(count("delta_chunk_prepare"), chunk_launches, "{choice:?} {file}");
            assert_eq!(count("delta_chunk_state"), chunk_launches, "{choice:?} {file}");
        }
    }
    let (_, out) = compile(Some("parallel"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("chunked") && stderr.contains("recurrent"),
        "{stderr}"
    );
}

/// `bbc compile --prefill-experts`: by default (`tensor-cores`) a bf16 MoE model's plans make
/// each layer's rows bf16, list each expert's pairs and prefill its experts on the tensor cores
/// (the H200's `wgmma`, the B200's `tcgen05`; `mma`, `mma.sync` on both) (the decode kernels beside
/// them, each launch gated by the step's shape); `cuda-cores`, expert by expert on the CUDA
/// cores, no lists; the manifest records the choice, and an unknown one is refused.
#[test]
fn compile_chooses_the_prefill_experts() {
    if !nvrtc_present() {
        return;
    }
    let scratch = common::scratch_dir("bbc-gpu-experts-");
    let toml = scratch.path().join("glm4_moe.toml");
    let weights = common::fixture("hf-tiny/glm4_moe");
    std::fs::write(&toml, format!("[model]\nweights = {weights:?}\ndtype = \"bf16\"\n")).unwrap();
    let compile =
        |target, choice: Option<&str>| compile_choosing(&toml, target, scratch.path(), ("--prefill-experts", choice));
    // Each target's own tensor-core instruction for bf16 experts.
    let targets = [("h200", "wgmma.mma_async"), ("b200", "tcgen05.mma")];
    let choices = [
        (None, true),
        (Some("cuda-cores"), false),
        (Some("tensor-cores"), true),
        (Some("mma"), true),
    ];
    for ((target, own), (choice, tensor_cores)) in targets.into_iter().flat_map(|t| choices.map(|c| (t, c))) {
        let (artifact, out) = compile(target, choice);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let manifest = codegen::read_manifest(&artifact).unwrap();
        let recorded = serde_json::to_value(manifest.prefill_experts).unwrap();
        assert_eq!(
            recorded,
            serde_json::json!(choice.unwrap_or("tensor-cores")),
            "{choice:?}"
        );
        let plans = [(manifest.plan, "kernels"), (manifest.serving_plan, "kernels/serving")];
        for (file, kernels) in plans.iter().filter_map(|(f, k)| Some((f.as_ref()?, k))) {
            let plan: gpu::GpuPlan =
                serde_json::from_str(&std::fs::read_to_string(artifact.join(file)).unwrap()).unwrap();
            let moe: Vec<&gpu::Launch> = plan
                .launches
                .iter()
                .filter(|l| l.kernel.starts_with("moe_gate_up"))
                .collect();
            assert!(!moe.is_empty(), "{choice:?} {file}");
            let launches_of = |stem: &str| plan.launches.iter().filter(|l| l.kernel.starts_with(stem)).count();
            // Each layer's pairs listed, then their tiles.
            let lists = (launches_of("moe_group_pairs"), launches_of("moe_list_tiles"));
            let expected = if tensor_cores { moe.len() } else { 0 };
            assert_eq!(lists, (expected, expected), "{choice:?} {file}");
            // Before the lists, the rows made bf16: the buffer the tensor cores' gate/up gathers.
            for (j, _) in plan
                .launches
                .iter()
                .enumerate()
                .filter(|(_, l)| l.kernel.starts_with("moe_group_pairs"))
            {
                let rows = &plan.launches[j - 1];
                assert!(
                    rows.kernel.starts_with("bf16_rows"),
                    "{choice:?} {file}: {}",
                    rows.kernel
                );
                let gate_up = plan.launches[j..]
                    .iter()
                    .find(|l| l.kernel.starts_with("moe_gate_up"))
                    .unwrap();
                assert_eq!(gate_up.args[gate_up.args.len() - 2], rows.args[1], "{choice:?} {file}");
            }
            // bf16 experts take the target's own instruction, unless asked for `mma.sync`.
            let owns = tensor_cores && choice != Some("mma");
            for launch in moe {
                let prefill = launch.prefill_kernel.as_deref().expect("a prefill kernel");
                let source = std::fs::read_to_string(artifact.join(kernels).join(format!("{prefill}.cu"))).unwrap();
                let instructions = (source.contains(own), source.contains("mma.sync.aligned"));
                assert_eq!(
                    instructions,
                    (owns, tensor_cores && !owns),
                    "{target} {choice:?} {file}: {prefill}"
                );
            }
        }
    }
    let (_, out) = compile("h200", Some("tensor"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("tensor-cores") && stderr.contains("cuda-cores"),
        "{stderr}"
    );
}

/// `bbc compile --decode-attention`: by default (`scalar`) the plans' split attention takes a
/// key a warp at a time; `vector`, 16 bytes of a row a lane (its kernel built spill-free with
/// the others); the manifest records the choice, and an unknown one is refused.
#[test]
fn compile_chooses_the_decode_attention() {
    if !nvrtc_present() {
        return;
    }
    let scratch = common::scratch_dir("bbc-gpu-decode-attention-");
    let weights = common::fixture("hf-tiny/llama");
    let toml = scratch.path().join("llama-bf16.toml");
    std::fs::write(&toml, format!("[model]\nweights = {weights:?}\ndtype = \"bf16\"\n")).unwrap();
    let compile =
        |choice: Option<&str>| compile_choosing(&toml, "h200", scratch.path(), ("--decode-attention", choice));
    for (choice, vector) in [(None, false), (Some("vector"), true)] {
        let (artifact, out) = compile(choice);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let manifest = codegen::read_manifest(&artifact).unwrap();
        let recorded = serde_json::to_value(manifest.decode_attention).unwrap();
        assert_eq!(recorded, serde_json::json!(choice.unwrap_or("scalar")), "{choice:?}");
        for file in [manifest.plan, manifest.serving_plan].iter().flatten() {
            let plan: gpu::GpuPlan =
                serde_json::from_str(&std::fs::read_to_string(artifact.join(file)).unwrap()).unwrap();
            // The split passes: every attention launch but the merge and the tensor-core one.
            let splits: Vec<&str> = plan
                .launches
                .iter()
                .map(|l| l.kernel.as_str())
                .filter(|k| k.starts_with("attention") && !k.starts_with("attention_combine"))
                .collect();
            assert_eq!(splits.len(), 3, "{choice:?} {file}: a launch a layer: {splits:?}");
            assert!(
                splits.iter().all(|k| k.starts_with("attention_vector") == vector),
                "{choice:?} {file}: {splits:?}"
            );
        }
    }
    let (_, out) = compile(Some("wide"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("scalar") && stderr.contains("vector"),
        "{stderr}"
    );
}

/// A model whose caches hold FP8 (model.toml's `kv_cache_dtype = "fp8"`, or `bbc compile
/// --kv-cache-dtype fp8` over a model.toml without it) compiles for every GPU target, its
/// decode steps' vector split pass included (built spill-free with the rest): each layer's
/// cache takes a byte an element, its appends, split passes and tensor-core attention read
/// and write FP8 codes. Asked for `wgmma` in any schedule, Hopper's prompts attend on its
/// lockstep one (which widens each tile to bf16); asked for `tcgen05` in any form, the B200's
/// on it copying its tiles (widening them too), never by TMA.
#[test]
fn fp8_kv_caches_compile_for_every_gpu_target() {
    if !nvrtc_present() {
        return;
    }
    let scratch = common::scratch_dir("bbc-gpu-fp8-cache-");
    let weights = common::fixture("hf-tiny/llama");
    let model = format!("[model]\nweights = {weights:?}\ndtype = \"bf16\"\n");
    let (in_toml, plain) = (scratch.path().join("llama-fp8.toml"), scratch.path().join("llama.toml"));
    std::fs::write(&in_toml, format!("{model}kv_cache_dtype = \"fp8\"\n")).unwrap();
    std::fs::write(&plain, model).unwrap();
    for (target, toml, flags) in [
        ("h200", &in_toml, &["--prefill-attention", "wgmma-tma"][..]),
        (
            "b200",
            &plain,
            &["--kv-cache-dtype", "fp8", "--prefill-attention", "tcgen05-tma"][..],
        ),
        ("rtx-pro-6000", &plain, &["--kv-cache-dtype", "fp8"][..]),
    ] {
        let artifact = scratch.path().join(target);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_bbc"))
            .args(["compile", toml.to_str().unwrap(), "--target", target, "-o"])
            .arg(&artifact)
            .args(["--decode-attention", "vector"])
            .args(flags)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{target}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let manifest = codegen::read_manifest(&artifact).unwrap();
        for file in [manifest.plan, manifest.serving_plan].iter().flatten() {
            let plan: gpu::GpuPlan =
                serde_json::from_str(&std::fs::read_to_string(artifact.join(file)).unwrap()).unwrap();
            assert!(!plan.kv_cache.is_empty(), "{target} {file}");
            for layout in &plan.kv_cache {
                assert_eq!(layout.bytes_per_token, layout.kv_dim, "{target} {file}: {layout:?}");
            }
            let attention: Vec<&str> = plan
                .launches
                .iter()
                .map(|l| l.kernel.as_str())
                .filter(|k| k.contains("attention") && !k.starts_with("attention_combine"))
                .collect();
            // A split pass and a tensor-core attention a layer, gated by the step's shape.
            let is = |stem: &str| attention.iter().filter(|k| k.starts_with(stem)).count();
            assert_eq!(
                (is("attention_vector"), is("flash_attention_"), attention.len()),
                (3, 3, 6),
                "{target} {file}: {attention:?}"
            );
            let wgmma = attention.iter().filter(|k| k.contains("wgmma")).count();
            let lockstep = attention
                .iter()
                .filter(|k| k.contains("wgmma") && !k.contains("specialised") && !k.contains("wgmma_tma"))
                .count();
            let expected = if target == "h200" { 3 } else { 0 };
            assert_eq!(
                (wgmma, lockstep),
                (expected, expected),
                "{target} {file}: {attention:?}"
            );
            let tcgen05 = attention.iter().filter(|k| k.contains("tcgen05")).count();
            let tma = attention.iter().filter(|k| k.contains("tcgen05_tma")).count();
            let expected = if target == "b200" { 3 } else { 0 };
            assert_eq!((tcgen05, tma), (expected, 0), "{target} {file}: {attention:?}");
            // A kernel's source lies beside its PTX (the serving plan's in a folder of its own).
            let source = |kernel: &str| {
                let entry = plan.kernels.iter().find(|k| k.name == kernel).unwrap();
                let ptx = artifact.join(entry.ptx.as_ref().unwrap());
                std::fs::read_to_string(ptx.with_extension("cu")).unwrap()
            };
            for kernel in &attention {
                assert!(
                    source(kernel).contains("const unsigned char* __restrict__ k,"),
                    "{target} {kernel}"
                );
            }
            let appends: Vec<&str> = plan
                .launches
                .iter()
                .map(|l| l.kernel.as_str())
                .filter(|k| k.contains("kv_append"))
                .collect();
            assert_eq!(appends.len(), 3, "{target} {file}: {appends:?}");
            for kernel in appends {
                assert!(
                    source(kernel).contains("k_cache[(at + kc)] = bbc_f32_to_fp8("),
                    "{target} {kernel}"
                );
            }
        }
    }
}

/// In the 8B-shaped serving plan every attention split pass prefetches the weights of the
/// launch after attention's combine pass (the output projection): 24 MiB of its 32 at up to 4
/// rows, nothing at more rows or with the runtime's `prefetch` off; and the prefetch is not
/// counted as a read of those weights.
#[test]
fn attention_prefetches_the_output_projection_at_few_rows() {
    use codegen::gpu::expr::{eval, Value};
    let (plan, _) = serving_plan(&llama_8b_graph(), Target::H200);
    let attention: Vec<usize> = (0..plan.launches.len())
        .filter(|&i| plan.launches[i].kernel.starts_with("attention_") && !plan.launches[i].kernel.contains("combine"))
        .collect();
    assert_eq!(attention.len(), 32);
    for i in attention {
        let args = &plan.launches[i].args;
        let prefetched = args.iter().find_map(|a| match a {
            LaunchArg::WeightPrefetch { node } => Some(*node),
            _ => None,
        });
        // The o projection: the first launch after the combine pass reading weights (on
        // Hopper the launch making its bf16 rows for the TMA GEMM comes between).
        let o_weights = plan.launches[i + 2..].iter().find_map(|l| {
            l.args.iter().find_map(|a| match a {
                LaunchArg::Weight { node } => Some(*node),
                _ => None,
            })
        });
        assert!(prefetched.is_some() && prefetched == o_weights, "launch {i}");
        let bytes = args
            .iter()
            .find_map(|a| match a {
                LaunchArg::Scalar { name, value } if name == "prefetch_bytes" => Some(value.clone()),
                _ => None,
            })
            .unwrap();
        let at = |rows: i64, prefetch: i64| {
            let vars = [
                ("tokens", Value::Int(rows)),
                ("seqs", Value::Int(rows)),
                ("prefetch", Value::Int(prefetch)),
            ];
            eval(&bytes, &vars.into_iter().collect()).unwrap().as_i64()
        };
        assert_eq!(
            (at(1, 1), at(4, 1), at(5, 1), at(1, 0)),
            (24 << 20, 24 << 20, 0, 0),
            "{bytes}"
        );
    }
    // Only the projections read the weights.
    let count = |kind: fn(&LaunchArg) -> bool| plan.launches.iter().flat_map(|l| &l.args).filter(|a| kind(a)).count();
    let reads = count(|a| matches!(a, LaunchArg::Weight { .. }));
    let prefetches = count(|a| matches!(a, LaunchArg::WeightPrefetch { .. }));
    assert_eq!(prefetches, 32);
    assert!(reads > prefetches);
}

/// A GPU artifact carries the batched serving plan `bbc serve` runs, with its graph (the logits
/// graph: each sequence's last row gathered before the head) and its own compiled kernels, and
/// the graph reads back under the manifest's hash.
#[test]
fn gpu_artifacts_carry_the_batched_serving_plan() {
    if !nvrtc_present() {
        return;
    }
    let (model, graph) = fused("smollm2", Target::H200, ComputeDtype::Native);
    // As `bbc compile` makes it: the logits graph with each sequence's argmax beside.
    let serving = models::with_greedy_token(&graph).unwrap();
    let scratch = common::scratch_dir("bbc-gpu-serving-");
    let dir = scratch.path();
    let all = codegen::CompiledGraphs {
        logits: &graph,
        greedy: None,
        serving: Some(&serving),
        mtp: None,
        eagle: None,
    };
    let manifest = codegen::compile(&model, all, Target::H200, dir).unwrap();
    assert_eq!(manifest.serving_plan.as_deref(), Some("serving_plan.json"));
    let plan: gpu::GpuPlan =
        serde_json::from_str(&std::fs::read_to_string(dir.join("serving_plan.json")).unwrap()).unwrap();
    assert!(plan.batched.is_some());
    assert!(plan
        .launches
        .iter()
        .any(|l| l.args.iter().any(|a| matches!(a, LaunchArg::StepInput { .. }))));
    for k in &plan.kernels {
        assert!(dir.join(k.ptx.as_ref().unwrap()).is_file(), "{}", k.name);
    }
    let read = codegen::read_graphs(dir, &manifest).unwrap();
    assert_eq!(read.serving.map(|g| g.op_count()), Some(serving.op_count()));
    // The rows sampled from are gathered (a step input names them: each sequence's last, or
    // its last `drafts + 1`), and the head runs on those alone.
    let gather = |a: &LaunchArg| matches!(a, LaunchArg::StepInput { name } if name == "sampled_rows");
    assert!(plan.launches.iter().any(|l| l.args.iter().any(gather)));
    let per_sequence = gpu::per_sequence_nodes(&serving);
    assert!(!per_sequence.is_empty());
    let next_token = plan.outputs.iter().find(|(name, _)| name == "next_token");
    assert!(
        next_token.is_some_and(|(_, node)| per_sequence.contains(node)),
        "a per-sequence argmax"
    );
    for l in plan.launches.iter().filter(|l| per_sequence.contains(&l.node)) {
        let rows = l.args.iter().find_map(|a| match a {
            LaunchArg::Scalar { name, value } if name == "tokens" || name == "rows" => Some(value.as_str()),
            _ => None,
        });
        assert!(rows.is_none_or(|r| r == "sampled"), "{}: {rows:?} rows", l.kernel);
    }
}

/// With a full-precision head, the greedy graph's GPU plan runs the INT8-bound head: its
/// kernels in order, scratch memory planned with everything else, the INT8 rows derived.
#[test]
fn greedy_plans_run_the_int8_head() {
    let mut spec = ModelSpec::for_weights(&common::real_model("smollm2"));
    spec.dtype = ComputeDtype::Bf16;
    let model = Model::open(spec).unwrap();
    let greedy = model.lower(LogitsFor::GreedyToken).unwrap();
    let greedy = passes::optimized(&greedy, passes::CostModel::H200).unwrap();
    assert!(greedy
        .nodes()
        .iter()
        .any(|n| matches!(n.op, ir::Op::Int8BoundTopK { k: 1, .. })));
    let plan = gpu::build(&greedy, Target::H200, 512).unwrap();
    assert!(plan.memory.conflict().is_none());
    let order: Vec<&str> = plan
        .launches
        .iter()
        .rev()
        .take(6)
        .map(|l| l.kernel.split('_').next().unwrap())
        .collect();
    assert_eq!(
        order,
        ["argmax", "int8", "max", "max", "int8", "int8"],
        "{:?}",
        plan.launches
            .iter()
            .rev()
            .take(6)
            .map(|l| &l.kernel)
            .collect::<Vec<_>>()
    );
    assert!(plan
        .memory
        .buffers
        .iter()
        .any(|b| b.scratch.as_deref() == Some("upper")));
    assert!(plan
        .launches
        .iter()
        .flat_map(|l| &l.args)
        .any(|a| matches!(a, LaunchArg::Derived { tensor, .. } if tensor == "err_norm")));
}

/// Without an NVIDIA driver, running a GPU artifact is a clear error, never a panic.
#[test]
fn running_a_gpu_artifact_without_a_driver_says_so() {
    if runtime_cuda::driver_present() {
        eprintln!("skipped: this machine has a CUDA driver (tests/gpu_runtime.rs runs there)");
        return;
    }
    if !nvrtc_present() {
        return;
    }
    let (model, graph) = fused("smollm2", Target::H200, ComputeDtype::Native);
    // The serving plan is built from the logits graph, as `bbc compile` builds it.
    let serving = models::with_greedy_token(&graph).unwrap();
    let scratch = common::scratch_dir("bbc-gpu-nodriver-");
    let dir = scratch.path();
    let all = codegen::CompiledGraphs {
        logits: &graph,
        greedy: None,
        serving: Some(&serving),
        mtp: None,
        eagle: None,
    };
    codegen::compile(&model, all, Target::H200, dir).unwrap();
    // `bbc run` and `bbc serve` both say what is missing, and neither panics.
    for command in [
        vec!["run", dir.to_str().unwrap(), "--prompt", "hi"],
        vec!["serve", dir.to_str().unwrap(), "--port", "0"],
        vec!["gpu-check", "--target", "h200"],
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_bbc"))
            .args(&command)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{command:?}");
        assert!(
            stderr.contains("no CUDA driver") && !stderr.contains("panicked"),
            "{command:?}: {stderr}"
        );
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_bbc"))
        .args(["gpu-check", "--target", "cpu"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("not a GPU target"), "{stderr}");
}

/// The GPU check's Llama-8B-shaped serving plan (no weights: they are made on the device)
/// builds for every target, and holds Llama-3-8B's 8.03 B parameters once each, in bf16.
#[test]
fn the_8b_shaped_serving_plan_holds_each_weight_once() {
    let graph = llama_8b_graph();
    for target in [Target::H200, Target::B200, Target::RtxPro6000] {
        let (plan, _) = serving_plan(&graph, target);
        let bytes: usize = plan
            .weights
            .iter()
            .map(|w| w.shape.iter().product::<usize>() * if w.dtype == ir::DType::BF16 { 2 } else { 4 })
            .sum();
        let norms = (2 * 32 + 1) * 4096 * 4;
        assert_eq!(
            bytes,
            (8_030_261_248 - (2 * 32 + 1) * 4096) * 2 + norms,
            "{}",
            target.name()
        );
        assert!(plan.memory.conflict().is_none());
    }
    // What a batch-1 decode step launches on every target: 7 kernels a layer (QKV with the
    // residual add and norm before it, rope + KV append, attention's two passes, o, gate/up
    // with the SwiGLU after it, down) and 6 around the layers (embedding, the last residual
    // add, the last rows' gather, the final norm for the `hidden` output, the LM head with
    // that norm as its prologue, the argmax). The split-K reductions after the GEMMs and the
    // launches making the TMA GEMMs' bf16 rows before them have no blocks below 16 rows, nor
    // has the tensor-core attention in steps of sequences averaging fewer: not counted.
    for target in [Target::H200, Target::B200, Target::RtxPro6000] {
        let (plan, _) = serving_plan(&graph, target);
        let one_row: Vec<&str> = plan
            .launches
            .iter()
            .map(|l| l.kernel.as_str())
            .filter(|k| {
                !k.starts_with("split_k_reduce") && !k.contains("bf16_rows") && !k.starts_with("flash_attention")
            })
            .collect();
        assert_eq!(one_row.len(), 7 * 32 + 6, "{}: {one_row:?}", target.name());
    }
    // An embedding table and head past 2^31 elements would be indexed at wrapped 32-bit
    // offsets: refused.
    let huge = models::ModelConfig {
        vocab_size: 600_000,
        ..models::ModelConfig::llama3_8b()
    };
    let graph = bf16_graph(&huge);
    let fused = passes::optimized(&graph, passes::CostModel::H200).unwrap();
    let err = gpu::build(&fused, Target::H200, 512).unwrap_err().to_string();
    assert!(err.contains("2457600000") && err.contains("32-bit"), "{err}");
    // Heads wider than the attention templates take are refused by name, not a panic.
    let wide_heads = models::ModelConfig {
        head_dim: 1024,
        ..models::ModelConfig::llama3_8b()
    };
    let graph = bf16_graph(&wide_heads);
    let fused = passes::optimized(&graph, passes::CostModel::H200).unwrap();
    let err = gpu::build(&fused, Target::H200, 512).unwrap_err().to_string();
    assert!(err.contains("head_dim 1024"), "{err}");
}

/// A model with random weights compiled for a GPU (a `config.json`: vLLM's dummy load format)
/// has them made where its plans run: every plan carries the fill kernels, compiled with the
/// rest, and loading the artifact makes nothing on the host (the plans' weights are generated
/// from the recorded seed). Compiled for the CPU, it keeps making them on the host.
#[test]
fn a_random_weight_model_compiled_for_the_gpu_makes_its_weights_there() {
    if !nvrtc_present() {
        return;
    }
    let scratch = common::scratch_dir("bbc-gpu-random-");
    let config = scratch.path().join("config.json");
    std::fs::copy(common::fixture("hf-tiny/llama/config.json"), &config).unwrap();
    let options = || bbc::model_ref::LoadOptions {
        greedy: true,
        fuse: false,
        quiet: true,
        ..Default::default()
    };
    for (target, on_device) in [("h200", true), ("cpu", false)] {
        let artifact = scratch.path().join(target);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_bbc"))
            .args(["compile", config.to_str().unwrap(), "--target", target, "-o"])
            .arg(&artifact)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let manifest = codegen::read_manifest(&artifact).unwrap();
        assert!(
            manifest.mtp_plan.is_none(),
            "Llama has no multi-token prediction layers"
        );
        let plans = [&manifest.plan, &manifest.greedy_plan, &manifest.serving_plan];
        for file in plans.into_iter().flatten() {
            let plan: gpu::GpuPlan =
                serde_json::from_str(&std::fs::read_to_string(artifact.join(file)).unwrap()).unwrap();
            for fill in runtime::random_weights::fill_kernels() {
                let entry = plan.kernels.iter().find(|k| k.name == fill.name);
                let cubin = entry.and_then(|k| k.cubin.as_ref()).map(|c| artifact.join(c));
                assert!(cubin.is_some_and(|c| c.is_file()), "{file}: {}", fill.name);
            }
        }
        let loaded = bbc::model_ref::load(artifact.to_str().unwrap(), options()).unwrap();
        let held = quant::tensor::Tensors::tensor(&loaded.model.weights, "model.embed_tokens.weight").is_some();
        match on_device {
            true => {
                assert_eq!(loaded.generated_weights, Some(manifest.random_weights.unwrap()));
                assert!(!held, "nothing made on the host");
            }
            false => assert!(loaded.generated_weights.is_none() && held, "{target}"),
        }
    }
}

/// A checkpoint with multi-token prediction layers (here the tiny Qwen3.5's shape with one,
/// random weights) compiled for a GPU carries its head's batched plan beside the serving plan,
/// which then outputs the hidden states the head reads; both load back. The head's plan takes
/// those states as a step input, joins them to the embedding with a `concat_columns` kernel
/// and makes its weights on the device as the others do.
#[test]
fn a_checkpoint_with_mtp_layers_compiles_its_head_plan_for_the_gpu() {
    if !nvrtc_present() {
        return;
    }
    let scratch = common::scratch_dir("bbc-gpu-mtp-");
    let fixture = std::fs::read_to_string(common::fixture("hf-tiny/qwen3_5/config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&fixture).unwrap();
    config["mtp_num_hidden_layers"] = 1.into();
    let path = scratch.path().join("config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    let artifact = scratch.path().join("h200");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_bbc"))
        .args(["compile", path.to_str().unwrap(), "--target", "h200", "-o"])
        .arg(&artifact)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let manifest = codegen::read_manifest(&artifact).unwrap();
    assert_eq!(manifest.mtp_plan.as_deref(), Some("mtp_plan.json"));
    assert!(artifact.join("mtp.ir").is_file());
    let graphs = codegen::read_graphs(&artifact, &manifest).unwrap();
    let serving = graphs.serving.unwrap();
    assert!(serving.output(ir::multi_token::TARGET_HIDDEN_STATES).is_some());
    let head = graphs.mtp.unwrap();
    for output in ["next_token", ir::multi_token::DRAFT_HIDDEN_STATE] {
        assert!(head.output(output).is_some(), "{output}");
    }
    let plan: gpu::GpuPlan =
        serde_json::from_str(&std::fs::read_to_string(artifact.join("mtp_plan.json")).unwrap()).unwrap();
    let input = plan.hidden_states.expect("the hidden states a step input");
    assert_eq!(head.nodes()[input].op, ir::Op::Input(ir::InputKind::HiddenStates));
    assert!(plan.batched.is_some());
    let kernel_of = |name: &str| plan.kernels.iter().find(|k| k.name.starts_with(name));
    assert!(kernel_of("concat_columns").and_then(|k| k.cubin.as_ref()).is_some());
    for fill in runtime::random_weights::fill_kernels() {
        assert!(kernel_of(&fill.name).is_some(), "{}", fill.name);
    }
    let options = bbc::model_ref::LoadOptions {
        greedy: true,
        fuse: false,
        quiet: true,
        ..bbc::model_ref::LoadOptions::default()
    };
    let loaded = bbc::model_ref::load(artifact.to_str().unwrap(), options).unwrap();
    let plans = loaded.gpu_plan.unwrap();
    assert_eq!(plans.mtp.map(|(file, _)| file).as_deref(), Some("mtp_plan.json"));
    assert!(!head.nodes().iter().any(|n| n.op.name() == "shortlist_top_k"));
}

/// `--draft-head shortlist` gives the head's plan the 4-bit shortlist in place of the full
/// head's argmax: the Q4_0 GEMV over its derived copy, the one-pass top 64, the rescoring;
/// a head whose rows are not whole blocks of 32 is refused by name.
#[test]
fn the_mtp_head_plan_takes_the_four_bit_shortlist_when_asked() {
    if !nvrtc_present() {
        return;
    }
    let scratch = common::scratch_dir("bbc-gpu-mtp-shortlist-");
    let compile = |hidden: usize, dir: &str| {
        let fixture = std::fs::read_to_string(common::fixture("hf-tiny/qwen3_5/config.json")).unwrap();
        let mut config: serde_json::Value = serde_json::from_str(&fixture).unwrap();
        config["mtp_num_hidden_layers"] = 1.into();
        config["hidden_size"] = hidden.into();
        let path = scratch.path().join(format!("{dir}.json"));
        std::fs::write(&path, config.to_string()).unwrap();
        let artifact = scratch.path().join(dir);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_bbc"))
            .args(["compile", path.to_str().unwrap(), "--target", "h200"])
            .args(["--draft-head", "shortlist", "-o"])
            .arg(&artifact)
            .output()
            .unwrap();
        (out, artifact)
    };
    let (out, artifact) = compile(64, "shortlist");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let manifest = codegen::read_manifest(&artifact).unwrap();
    let head = codegen::read_graphs(&artifact, &manifest).unwrap().mtp.unwrap();
    assert!(head.nodes().iter().any(|n| n.op.name() == "shortlist_top_k"));
    assert!(head.output("next_token").is_some());
    let plan: gpu::GpuPlan =
        serde_json::from_str(&std::fs::read_to_string(artifact.join("mtp_plan.json")).unwrap()).unwrap();
    for kernel in [
        "shortlist_coarse",
        "shortlist_top_k_chunks",
        "shortlist_rescore",
        "shortlist_best",
    ] {
        assert!(
            plan.kernels
                .iter()
                .any(|k| k.name.starts_with(kernel) && k.cubin.is_some()),
            "{kernel}"
        );
    }
    let (out, _) = compile(48, "ragged");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("not whole blocks of 32"), "{stderr}");
}
