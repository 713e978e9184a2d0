//! `bbc compile MODEL --target T -o DIR [--emit ir|fused-ir] [--emit-after PASS] [--verify]`.

use crate::model_ref::{self, ModelRef};
use crate::serve::DraftHead;
use anyhow::{bail, Context, Result};
use codegen::Target;
use std::path::Path;

pub struct CompileArgs<'a> {
    pub model: &'a str,
    pub target: &'a str,
    pub output: &'a Path,
    /// `ir` (as lowered) or `fused-ir` (after the pipeline), printed to stdout.
    pub emit: Option<&'a str>,
    /// Stop the pipeline after this pass and print its graph.
    pub emit_after: Option<&'a str>,
    /// Check every pass on random inputs before writing the artifact.
    pub verify: bool,
    /// The tokenizer to use instead of the model's (`model_ref::tokenizer_file`).
    pub tokenizer: Option<&'a str>,
    /// The head of the multi-token prediction layers' plan (GPU targets).
    pub draft_head: DraftHead,
    /// GPU targets: an EAGLE head to compile a draft plan for (vLLM's JSON).
    pub speculative_config: Option<&'a str>,
    /// The tensor-core GEMM the GPU plans' bf16 matmuls prefill through.
    pub prefill_gemm: PrefillGemm,
    /// The tensor-core attention the GPU plans' prompts attend with.
    pub prefill_attention: PrefillAttention,
    /// The split attention the GPU plans' decode steps attend with.
    pub decode_attention: DecodeAttention,
    /// How the GPU plans' prompts go through Gated DeltaNet layers' delta rule.
    pub prefill_delta_rule: PrefillDeltaRule,
    /// How the GPU plans' prompts run MoE layers' experts.
    pub prefill_experts: PrefillExperts,
    /// Overrides the model's KV cache type (model.toml's `kv_cache_dtype`).
    pub kv_cache_dtype: Option<models::KvCacheDtype>,
    /// Overrides the model's compute dtype (model.toml's `dtype`).
    pub dtype: Option<models::ComputeDtype>,
    /// Random weights of the model's shape in place of its files (`--load-format dummy`).
    pub load_format: crate::model_ref::LoadFormat,
    /// What the weights must be quantized as (`--quantization`; `fp8` quantizes floats).
    pub quantization: Option<&'a str>,
}

/// How GPU plans' prompts go through the delta rule (`codegen::gpu::PrefillDeltaRule`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PrefillDeltaRule {
    /// In chunks of 64 rows, most of the work for every chunk at once (key heads a multiple
    /// of 8 up to 128 wide, value heads a multiple of 4 up to 128; others as `recurrent`).
    #[default]
    Chunked,
    /// A row after another, as decode steps.
    Recurrent,
}

impl From<PrefillDeltaRule> for codegen::gpu::PrefillDeltaRule {
    fn from(rule: PrefillDeltaRule) -> Self {
        match rule {
            PrefillDeltaRule::Chunked => Self::Chunked,
            PrefillDeltaRule::Recurrent => Self::Recurrent,
        }
    }
}

/// How GPU plans' prompts run MoE layers' experts (`codegen::gpu::PrefillExperts`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PrefillExperts {
    /// Each expert's rows gathered into tiles on the target's tensor cores (bf16, f16 and
    /// GGUF-block experts over sizes that are multiples of 8; others as `cuda-cores`): bf16
    /// experts on `wgmma` on Hopper and `tcgen05` on the B200, `mma.sync` otherwise.
    #[default]
    TensorCores,
    /// As `tensor-cores`, on `mma.sync` on every target.
    Mma,
    /// Expert by expert on the CUDA cores, a warp a row and output.
    CudaCores,
}

impl From<PrefillExperts> for codegen::gpu::PrefillExperts {
    fn from(experts: PrefillExperts) -> Self {
        match experts {
            PrefillExperts::TensorCores => Self::TensorCores,
            PrefillExperts::Mma => Self::Mma,
            PrefillExperts::CudaCores => Self::CudaCores,
        }
    }
}

/// The split attention GPU plans' decode steps attend with (`codegen::gpu::DecodeAttention`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DecodeAttention {
    /// A warp takes a key at a time, each lane an element of its rows.
    #[default]
    Scalar,
    /// Each lane loads 16 bytes of a row, a warp several keys at once (heads a power of two
    /// of 16-byte loads; others as `scalar`).
    Vector,
}

impl From<DecodeAttention> for codegen::gpu::DecodeAttention {
    fn from(attention: DecodeAttention) -> Self {
        match attention {
            DecodeAttention::Scalar => Self::Scalar,
            DecodeAttention::Vector => Self::Vector,
        }
    }
}

/// The tensor-core attention GPU plans' prompts attend with
/// (`codegen::gpu::PrefillAttention`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PrefillAttention {
    /// FlashAttention-2's schedule on `mma.sync` (every target).
    #[default]
    Mma,
    /// FlashAttention-3's schedule on `wgmma` (Hopper, heads up to 128 dims; elsewhere as `mma`).
    Wgmma,
    /// The same, a producer warpgroup copying the tiles for the two consumer warpgroups.
    WgmmaSpecialised,
    /// The same, the producer loading the tiles by TMA (heads of 64 or 128 dims; others as
    /// `wgmma-specialised`). Blocks of the KV cache then hold a multiple of 16 positions.
    WgmmaTma,
    /// Both products on `tcgen05` into tensor memory (B200, heads up to 128 dims; elsewhere
    /// as `mma`).
    Tcgen05,
    /// The same, thread 0 loading the tiles by TMA (heads of 64 or 128 dims; others as
    /// `tcgen05`). Blocks of the KV cache then hold a multiple of 16 positions.
    Tcgen05Tma,
}

impl From<PrefillAttention> for codegen::gpu::PrefillAttention {
    fn from(attention: PrefillAttention) -> Self {
        match attention {
            PrefillAttention::Mma => Self::Mma,
            PrefillAttention::Wgmma => Self::Wgmma,
            PrefillAttention::WgmmaSpecialised => Self::WgmmaSpecialised,
            PrefillAttention::WgmmaTma => Self::WgmmaTma,
            PrefillAttention::Tcgen05 => Self::Tcgen05,
            PrefillAttention::Tcgen05Tma => Self::Tcgen05Tma,
        }
    }
}

/// The tensor-core GEMM GPU plans prefill bf16 matmuls through (`codegen::gpu::PrefillGemm`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PrefillGemm {
    /// The target's TMA-fed GEMM, after a launch making the rows bf16.
    #[default]
    Tma,
    /// The TMA-fed GEMM with a producer warp feeding the tensor cores (Hopper, B200;
    /// elsewhere as `tma`).
    Specialised,
    /// The producer-warp GEMM with as many blocks as multiprocessors, each taking tiles in
    /// turn (Hopper, B200; elsewhere as `tma`).
    Persistent,
    /// The GEMM with the norm inside and its weights through a `cp.async` pipeline.
    Pipelined,
}

impl From<PrefillGemm> for codegen::gpu::PrefillGemm {
    fn from(gemm: PrefillGemm) -> Self {
        match gemm {
            PrefillGemm::Tma => Self::Tma,
            PrefillGemm::Specialised => Self::Specialised,
            PrefillGemm::Persistent => Self::Persistent,
            PrefillGemm::Pipelined => Self::Pipelined,
        }
    }
}

pub fn compile(args: &CompileArgs) -> Result<()> {
    let Some(target) = Target::parse(args.target) else {
        let names: Vec<&str> = Target::ALL.iter().map(|t| t.name()).collect();
        bail!("unknown target `{}`; choose one of {}", args.target, names.join(", "));
    };
    if matches!(ModelRef::parse(args.model)?, ModelRef::Artifact(_)) {
        bail!(
            "{} is already an artifact; compile a model.toml, a weights path or a model name",
            args.model
        );
    }
    let options = model_ref::LoadOptions {
        greedy: true,
        fuse: false,
        tokenizer: args.tokenizer.map(str::to_string),
        kv_cache_dtype: args.kv_cache_dtype,
        dtype: args.dtype,
        load_format: args.load_format,
        quantization: args.quantization.map(str::to_string),
        ..model_ref::LoadOptions::default()
    };
    let loaded = model_ref::load(args.model, options)?;
    // An EAGLE head named by the flag, or by the model.toml (compiled for GPU targets only).
    let eagle = match (args.speculative_config, &loaded.speculative) {
        (Some(_), _) if target == Target::Cpu => bail!(
            "--speculative-config: EAGLE heads are compiled into GPU artifacts; on the CPU backend `bbc serve` reads the head as it is"
        ),
        (Some(json), _) => {
            let (method, dir) = crate::serve::speculation::eagle_head(json)?;
            Some(eagle_head(&loaded, method, Path::new(&dir))?)
        }
        (None, Some(models::Speculative::Eagle { method, dir, .. })) if target != Target::Cpu => {
            Some(eagle_head(&loaded, *method, dir)?)
        }
        _ => None,
    };
    let stages = passes::optimize(&loaded.graph, model_ref::cost_model(target), args.emit_after)?;
    for stage in &stages {
        let r = &stage.report;
        let applied: Vec<String> = r.applied.iter().map(|(rule, n)| format!("{rule}×{n}")).collect();
        eprintln!(
            "pass {:<24} ops {:>4} → {:<4} ({} iterations, {} e-nodes, {}) {}",
            r.pass,
            r.ops_before,
            r.ops_after,
            r.iterations,
            r.egraph_nodes,
            r.stop,
            applied.join(" ")
        );
    }
    if args.verify {
        crate::verify::verify_stages(&loaded, &stages)?;
    }
    let fused = stages.last().map_or(&loaded.graph, |s| &s.graph);
    // The greedy graph goes through the same pipeline (its LM head may become INT8-bound).
    let greedy = match (&loaded.greedy, args.emit_after) {
        (Some(g), None) => Some(passes::optimized(g, model_ref::cost_model(target))?),
        _ => None,
    };
    match (args.emit, args.emit_after) {
        (_, Some(_)) => print!("{}", fused.to_text()),
        (None, None) => {}
        (Some("ir"), None) => print!("{}", loaded.graph.to_text()),
        (Some("fused-ir"), None) => print!("{}", fused.to_text()),
        (Some("kernel-report"), None) if target == Target::Cpu => bail!("--emit kernel-report is for GPU targets"),
        (Some("kernel-report"), None) => {}
        (Some(other), None) => bail!("--emit {other}: choose `ir`, `fused-ir` or `kernel-report`"),
    }
    if args.emit_after.is_some() {
        return Ok(());
    }
    // GPU targets also get the batched serving plan, over the same logits graph: in a batched
    // step its `last_token` gathers each sequence's last row before the final norm and head.
    // It also outputs each sequence's argmax, read back instead of the logits when every
    // request of a step decodes greedily.
    // A checkpoint with multi-token prediction layers also gets their plan, to draft with:
    // the serving plan then outputs its hidden state at every row, which they read.
    // An EAGLE head given takes the place of the checkpoint's own layers.
    let mtp = match (target, &eagle) {
        (Target::Cpu, _) => None,
        (_, Some(head)) => Some(eagle_head_graph(&loaded, head, target, args.draft_head)?),
        (_, None) => mtp_head(&loaded, target, args.draft_head)?,
    };
    let serving = match (target, &mtp) {
        (Target::Cpu, _) => None,
        (_, None) => Some(models::with_greedy_token(fused)?),
        (_, Some(_)) => {
            let target_graph = match &eagle {
                Some(head) => {
                    let options = loaded.model.lower_options(models::LogitsFor::LastToken);
                    head.target_graph(&loaded.graph, &loaded.model.weights, options)?
                }
                None => models::with_hidden_states(&loaded.graph)?,
            };
            let fused = passes::optimized(&target_graph, model_ref::cost_model(target))?;
            Some(models::with_greedy_token(&fused)?)
        }
    };
    let eagle_weights = eagle.as_ref().map(|head| head.weights_beside(&loaded.model.weights));
    let graphs = codegen::CompiledGraphs {
        logits: fused,
        greedy: greedy.as_ref(),
        serving: serving.as_ref(),
        mtp: mtp.as_ref(),
        eagle: eagle
            .as_ref()
            .zip(eagle_weights.as_ref())
            .map(|(head, weights)| codegen::EagleGraphs {
                method: head.method.name(),
                dir: &head.dir,
                weights,
            }),
    };
    if target != Target::Cpu {
        crate::fetch::ensure_nvrtc(false)?;
    }
    let kernels = codegen::gpu::PlanKernels {
        prefill_gemm: args.prefill_gemm.into(),
        prefill_attention: args.prefill_attention.into(),
        decode_attention: args.decode_attention.into(),
        prefill_delta_rule: args.prefill_delta_rule.into(),
        prefill_experts: args.prefill_experts.into(),
    };
    let manifest = codegen::compile_with(&loaded.model, graphs, target, args.output, kernels)?;
    if args.emit == Some("kernel-report") {
        print_kernel_report(&args.output.join("plan.json"))?;
    }
    eprintln!(
        "compiled {} ({} → {} ops per step, dtype {}) for {} into {}",
        manifest.family.name(),
        loaded.graph.op_count(),
        fused.op_count(),
        manifest.dtype.name(),
        target.name(),
        args.output.display()
    );
    Ok(())
}

/// The draft step of the model's multi-token prediction layers, fused for `target` (see
/// [`draft_plan_graph`]), where its checkpoint carries layers bbc lowers. Where the checkpoint
/// carries layers bbc cannot lower (llama.cpp's Qwen files), why not, said on stderr, and none;
/// a head that cannot be shortlisted (rows not whole blocks of 32) is an error.
fn mtp_head(loaded: &model_ref::Loaded, target: Target, draft_head: DraftHead) -> Result<Option<ir::Graph>> {
    let model = &loaded.model;
    if model.config.mtp_layers == 0 || !model.config.family.lowers_mtp() {
        return Ok(None);
    }
    let options = draft_options(model, draft_head);
    let graph = match models::lower_mtp(&model.config, &model.weights, options) {
        Ok(graph) => graph,
        Err(e) => {
            eprintln!("multi-token prediction layers not compiled (no `method: mtp` drafts): {e:#}");
            return Ok(None);
        }
    };
    Ok(Some(draft_plan_graph(&graph, target, draft_head, model.config.hidden)?))
}

/// How a draft head's graph is lowered for its plan: its logits for the full head's argmax, or
/// its greedy token for the shortlist.
fn draft_options(model: &models::Model, draft_head: DraftHead) -> models::LowerOptions {
    model.lower_options(match draft_head {
        DraftHead::Full => models::LogitsFor::LastToken,
        DraftHead::Shortlist => models::LogitsFor::GreedyToken,
    })
}

/// A draft head's `graph` fused for `target`: with the full head, its argmax beside its logits
/// (as the serving plan's: a batched step computes it from each sequence's logits row); with
/// the shortlist, its token alone, refused where the head's rows (`hidden` wide) are not whole
/// blocks of 32.
fn draft_plan_graph(graph: &ir::Graph, target: Target, draft_head: DraftHead, hidden: usize) -> Result<ir::Graph> {
    let cost = model_ref::cost_model(target);
    Ok(match draft_head {
        DraftHead::Full => models::with_greedy_token(&passes::optimized(graph, cost)?)?,
        DraftHead::Shortlist => {
            let shortlisted = passes::shortlisted_draft_head(graph)?;
            if !shortlisted
                .nodes()
                .iter()
                .any(|n| matches!(n.op, ir::Op::ShortlistTopK { .. }))
            {
                bail!(
                    "--draft-head shortlist: the head's rows ({hidden} wide) are not whole blocks of 32, \
                     which its 4-bit copy needs; `--draft-head full` compiles the full head"
                );
            }
            passes::optimized(&shortlisted, cost)?
        }
    })
}

/// The EAGLE head in `dir` read as `method` against `loaded`'s model, which must have weights
/// of its own (a head drafts for the model it was trained with, not for random weights).
fn eagle_head(
    loaded: &model_ref::Loaded,
    method: models::eagle::EagleMethod,
    dir: &Path,
) -> Result<models::eagle::EagleHead> {
    let name = method.name();
    if loaded.model.spec.random_weights.is_some() {
        bail!("method `{name}`: an EAGLE head drafts for the weights it was trained with; this model's are random");
    }
    if !dir.is_dir() {
        bail!(
            "method `{name}`: `model` must be the head's directory (config.json and safetensors), not {}",
            dir.display()
        );
    }
    models::eagle::EagleHead::open(dir, method, &loaded.model.config).with_context(|| format!("method `{name}`"))
}

/// `head`'s draft step, fused for `target`, as [`mtp_head`] compiles the checkpoint's own.
fn eagle_head_graph(
    loaded: &model_ref::Loaded,
    head: &models::eagle::EagleHead,
    target: Target,
    draft_head: DraftHead,
) -> Result<ir::Graph> {
    let model = &loaded.model;
    let options = draft_options(model, draft_head);
    let graph = head.lower(&model.config, &model.weights, options)?;
    draft_plan_graph(&graph, target, draft_head, head.config.hidden)
}

/// One line per generated kernel: registers per thread on the target, launches per step.
fn print_kernel_report(plan: &Path) -> Result<()> {
    let plan: codegen::gpu::GpuPlan = serde_json::from_str(&std::fs::read_to_string(plan)?)?;
    println!(
        "{:<24} {:>9} {:>8} {:>9}  (arch {}, 0 spill bytes)",
        "kernel", "registers", "threads", "launches", plan.arch
    );
    for k in &plan.kernels {
        let launches = plan.launches.iter().filter(|l| l.kernel == k.name).count();
        println!(
            "{:<24} {:>9} {:>8} {:>9}",
            k.name,
            k.registers.map_or("-".into(), |r| r.to_string()),
            k.block,
            launches
        );
    }
    println!(
        "activation arena: {} bytes for {} tokens",
        plan.memory.arena_bytes, plan.max_tokens
    );
    Ok(())
}
