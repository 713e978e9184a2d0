//! `bbc serve MODEL`: the model loaded and its backend built (the CPU backend, or a GPU
//! artifact's batched plan), the serving engine started over it, and the HTTP server
//! (`http_server`) in front of it.

mod draft;
mod eagle;
mod generation_config;
mod mtp;
pub(crate) mod speculation;

use crate::model_ref;
use anyhow::{bail, ensure, Context, Result};
use http_server::{metrics, reasoning, tool_parser, EngineSetup};
use models::ComputeDtype;
use runtime::serving::SchedulerConfig;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct ServeArgs {
    /// An artifact directory, a model.toml, a weights path, a model name (fetched on first use),
    /// or a config.json or named shape (`llama3-8b`, …) run with random weights.
    pub model: String,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// 0 picks a free port (printed on start).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1 endpoints.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Requests allowed to wait; past it the server answers 503.
    #[arg(long, default_value_t = 256)]
    pub max_queued: usize,
    /// Sequences computed together.
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// KV-cache blocks for all sequences together (default: on a GPU, what
    /// `--gpu-memory-utilization` leaves once the model is loaded; on the CPU, enough for
    /// `--max-num-seqs` requests of the full context, at most half the memory available).
    #[arg(long)]
    pub kv_blocks: Option<usize>,
    /// The share of the GPU's memory this server may use, the KV cache taking what the model,
    /// its activations and everything else on the device leave of it (vLLM's flag).
    #[arg(long, default_value_t = runtime::kv_sizing::DEFAULT_GPU_SHARE)]
    pub gpu_memory_utilization: f64,
    /// Positions per KV-cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Models with recurrent layers (Gated DeltaNet): snapshots of sequences' states the
    /// prefix cache keeps, so that a request sharing a prefix starts from one instead of
    /// computing it (0: such models share no cached prefix). On a GPU they take device memory
    /// from the start.
    #[arg(long, default_value_t = 16)]
    pub state_snapshots: usize,
    /// Positions between a sequence's state snapshots (rounded up to whole blocks): a request
    /// sharing a prefix recomputes up to this many of its positions.
    #[arg(long, default_value_t = 128)]
    pub state_snapshot_interval: usize,
    /// Tokens computed per step across all sequences (a step's length bounds every
    /// running request's time per output token); vLLM's `--max-num-batched-tokens`. Default:
    /// on a GPU, the rows a step of the serving plan takes (2048: long prompts prefill in a
    /// few large chunks beside the running decodes); on the CPU, 128.
    #[arg(long, alias = "max-num-batched-tokens")]
    pub token_budget: Option<usize>,
    /// The model id clients send (default: the model's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Compute dtype for matrices: f32, bf16, f16 or native (the file's own storage, its
    /// quantization kept); vLLM's float32, bfloat16, float16/half and auto read too.
    #[arg(long, value_parser = crate::commands::run::parse_dtype)]
    pub dtype: Option<ComputeDtype>,
    /// What the KV cache stores keys and values as: auto (bf16 for a bf16 dtype, half for
    /// f16, f32 for f32; native: the weights' float type, or f16 for quantized blocks, as
    /// llama.cpp), f32, bf16 or f16 (half the memory of f32), or fp8 (E4M3, a quarter;
    /// vLLM's). A GPU artifact's caches are fixed when compiled (`bbc compile
    /// --kv-cache-dtype`).
    #[arg(long, value_parser = crate::commands::run::parse_kv_cache_dtype)]
    pub kv_cache_dtype: Option<models::KvCacheDtype>,
    /// The longest context (prompt and output tokens) a request may use, at most the model's
    /// own (default: the model's, or model.toml's `context_length`); longer ones get a 400.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// The chat template to render chat requests with instead of the model's: a Jinja file,
    /// or the template itself (e.g. for a base model, which has none).
    #[arg(long)]
    pub chat_template: Option<String>,
    /// The tokenizer to use instead of the model's (vLLM's flag): a GGUF file, a
    /// tokenizer.json, a directory holding one, or a model name such as `smollm2`; for a
    /// config.json or named shape served with random weights.
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// Where the weights come from (vLLM's flag): `auto`, the model's files; `dummy`, random
    /// weights of its shape (an HF directory's config.json), its tokenizer kept.
    #[arg(long, value_enum, default_value_t = model_ref::LoadFormat::Auto)]
    pub load_format: model_ref::LoadFormat,
    /// How the weights are quantized (vLLM's flag): `fp8` quantizes a checkpoint of floats as
    /// it loads (linear layers' weights into FP8 blocks of 32, the rest as `--dtype` says);
    /// over quantized files it is checked against what they say: `fp8`,
    /// `compressed-tensors`, `fbgemm_fp8`, `modelopt` (FP8 checkpoints, then held as FP8
    /// whatever `--dtype`), `gguf`.
    #[arg(long, short = 'q')]
    pub quantization: Option<String>,
    /// Speculative decoding by prompt lookup: draft up to N tokens a step from earlier text
    /// of the request and verify them in the same pass (0: off; overrides a model.toml's
    /// `[speculative]`). Tokens are unchanged. On the GPU, a model with recurrent state
    /// keeps N copies of each sequence's state to rewind refused drafts to.
    #[arg(long)]
    pub speculative_ngram: Option<usize>,
    /// Speculative decoding with a draft model (vLLM's `--speculative-model`): a smaller
    /// model sharing the target's tokenizer (weights, a model.toml, a model name or an
    /// artifact; a GPU artifact on its serving plan, anything else on the CPU backend, in its
    /// own dtype) drafts up to `--num-speculative-tokens` tokens a step for each decoding
    /// request, verified in the target's next pass. Tokens are unchanged.
    #[arg(long)]
    pub speculative_model: Option<String>,
    /// Tokens the draft model drafts a step at most (default model.toml's, or 4).
    #[arg(long)]
    pub num_speculative_tokens: Option<usize>,
    /// vLLM's `--speculative-config`, a JSON object in place of the flags above and below:
    /// `{"model": "draft.gguf", "num_speculative_tokens": 4}` (method `draft_model`, implied
    /// by `model`), `{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}`,
    /// or `{"method": "mtp", "num_speculative_tokens": 3}` (the checkpoint's multi-token
    /// prediction layers draft, on the CPU backend; tokens default to their number).
    #[arg(long)]
    pub speculative_config: Option<String>,
    /// Shortest match prompt lookup tries (default 2, or model.toml's).
    #[arg(long)]
    pub prompt_lookup_min: Option<usize>,
    /// Longest match prompt lookup tries (default 4, or model.toml's).
    #[arg(long)]
    pub prompt_lookup_max: Option<usize>,
    /// How a drafter on the CPU backend (a draft model, MTP layers) picks its guesses from the
    /// vocabulary: `shortlist` scores every row with a 4-bit copy of its head and rescores the
    /// best 64 in full precision; `full` finds the exact best (the INT8-bound head). The target
    /// verifies every guess either way. A drafter's GPU plan takes the head it was compiled
    /// with (`bbc compile --draft-head`).
    #[arg(long, value_enum, default_value_t = DraftHead::Shortlist)]
    pub draft_head: DraftHead,
    /// Chat responses split the model's reasoning from its answer (`reasoning_content` beside
    /// `content`) at the markers of: the model's family (`auto`: `<think>…</think>` for
    /// Qwen3.5, Qwen3-Next, GLM-4.5 and GLM-5, `<|channel>thought\n…<channel|>` for Gemma 4),
    /// none, or the named pair.
    #[arg(long, value_enum, default_value_t = reasoning::ReasoningParser::Auto)]
    pub reasoning_parser: reasoning::ReasoningParser,
    /// The format `tool_choice` auto (the default where a request gives `tools`) reads the
    /// model's calls in: the one its chat template writes (`auto`: `<|tool_call>` Gemma 4,
    /// `<arg_key>` GLM, `<function=`/`<parameter=` Qwen3-Coder and Qwen3.5, `<tool_call>` JSON
    /// Hermes), none (auto refused), or the named one.
    #[arg(long, value_enum, default_value_t = tool_parser::ToolCallParser::Auto)]
    pub tool_call_parser: tool_parser::ToolCallParser,
    /// Where the sampling settings a request leaves out come from (vLLM's flag): `auto`, the
    /// model's recommended ones (an HF directory's `generation_config.json`, a GGUF file's
    /// `general.sampling.*`; its `max_new_tokens` caps every answer); `vllm`, the API's own
    /// (temperature 1, no top-k/top-p/min-p, no penalty); or a directory holding a
    /// `generation_config.json`.
    #[arg(long, default_value = "auto")]
    pub generation_config: String,
    /// Settings over those (vLLM's flag), a JSON object of `temperature`, `top_p`, `top_k`,
    /// `min_p`, `repetition_penalty` and `max_new_tokens`.
    #[arg(long)]
    pub override_generation_config: Option<String>,
    /// The order requests wait in (vLLM's flag): `fcfs`, first come first served, or
    /// `priority`, by each request's `priority` (lower first, then arrival), the running
    /// request last in that order preempted first when the KV cache runs out or a waiting
    /// request of strictly lower `priority` needs its place. Under `fcfs` a request giving a
    /// priority other than 0 is refused.
    #[arg(long, value_enum, default_value_t = SchedulingPolicyArg::Fcfs)]
    pub scheduling_policy: SchedulingPolicyArg,
    /// Where the seeds of requests that give none come from (vLLM's flag): each such request
    /// samples with another seed, the same sequence of them each time the server starts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Admitted requests start from the cached KV blocks of earlier prompts sharing their
    /// prefix (the default, as vLLM's).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Every prompt computed in full, no cached prefix shared (vLLM's flag).
    #[arg(long, overrides_with = "enable_prefix_caching")]
    pub no_enable_prefix_caching: bool,
    /// GPUs to split the model over (vLLM's flag): bbc serves on one.
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel_size: usize,
    /// Accepted for vLLM command lines: bbc runs no code a checkpoint ships (its families are
    /// built in), so there is nothing to trust.
    #[arg(long)]
    pub trust_remote_code: bool,
    /// A GPU artifact launches every step's kernels one by one, no decode step replayed from a
    /// CUDA graph (vLLM's flag: for debugging; a graph spares the host a launch per kernel).
    #[arg(long)]
    pub enforce_eager: bool,
}

/// `--draft-head`'s values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DraftHead {
    Shortlist,
    Full,
}

impl DraftHead {
    /// `greedy` (a drafter's graph giving its greedy token) with its head as chosen, optimized
    /// for the CPU.
    fn optimized(self, greedy: &ir::Graph) -> Result<ir::Graph> {
        let graph = match self {
            Self::Shortlist => passes::shortlisted_draft_head(greedy)?,
            Self::Full => greedy.clone(),
        };
        Ok(passes::optimized(&graph, passes::CostModel::CPU)?)
    }
}

/// `--scheduling-policy`'s values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SchedulingPolicyArg {
    Fcfs,
    Priority,
}

impl SchedulingPolicyArg {
    fn policy(self) -> runtime::serving::SchedulingPolicy {
        match self {
            Self::Fcfs => runtime::serving::SchedulingPolicy::Fcfs,
            Self::Priority => runtime::serving::SchedulingPolicy::Priority,
        }
    }
}

pub fn serve(args: &ServeArgs) -> Result<()> {
    ensure!(
        args.tensor_parallel_size == 1,
        "--tensor-parallel-size {}: bbc serves a model on one GPU",
        args.tensor_parallel_size
    );
    let speculation_flags = speculation::SpeculationFlags::from_args(args)?;
    for (name, value) in [
        ("--max-queued", args.max_queued),
        ("--max-num-seqs", args.max_num_seqs),
        ("--kv-blocks", args.kv_blocks.unwrap_or(1)),
        ("--block-size", args.block_size),
        ("--token-budget", args.token_budget.unwrap_or(1)),
        ("--state-snapshot-interval", args.state_snapshot_interval),
        ("--max-model-len", args.max_model_len.unwrap_or(1)),
    ] {
        if value == 0 {
            bail!("{name} must be at least 1");
        }
    }
    let options = model_ref::LoadOptions {
        dtype: args.dtype,
        load_format: args.load_format,
        quantization: args.quantization.clone(),
        kv_cache_dtype: args.kv_cache_dtype,
        max_model_len: args.max_model_len,
        greedy: true,
        tokenizer: args.tokenizer.clone(),
        ..model_ref::LoadOptions::default()
    };
    let mut loaded = model_ref::load(&args.model, options)?;
    let mut tokenizer = loaded
        .model
        .tokenizer
        .take()
        .context("this model has no tokenizer; bbc serve needs one to read prompts and write text")?;
    if let Some(arg) = &args.chat_template {
        model_ref::use_chat_template(&mut tokenizer, arg)?;
    }
    let tokenizer = Arc::new(tokenizer);
    let context_length = loaded.model.config.context_length;
    let family = loaded.model.config.family;
    let (speculation, drafting) = speculation_flags.resolve(&loaded)?;
    let generation_defaults = generation_config::resolve(
        &args.generation_config,
        args.override_generation_config.as_deref(),
        loaded.model.generation_defaults,
    )?;
    if let Some(settings) = generation_config::describe(&generation_defaults) {
        eprintln!(
            "requests that leave them out sample with: {settings} (--generation-config vllm: the API's defaults)"
        );
    }
    // Blocks and budget are settled once the backend is loaded (they depend on it).
    let mut config = SchedulerConfig {
        max_waiting: args.max_queued,
        max_running: args.max_num_seqs,
        token_budget: 0,
        kv_blocks: 0,
        block_size: args.block_size,
        context_length,
        // The engine turns it off for models with recurrent state.
        prefix_caching: !args.no_enable_prefix_caching,
        // And this where the backend cannot verify drafts.
        speculation,
        // Set by the engine from the backend, which may also turn the snapshots off.
        recurrent_state: false,
        state_cache: runtime::serving::StateCacheConfig::every(args.state_snapshot_interval, args.state_snapshots),
    };

    let draft_cache = draft::DraftCache {
        blocks: args.kv_blocks.unwrap_or(DRAFT_KV_BLOCKS),
        block_size: args.block_size,
        token_budget: args.token_budget.unwrap_or(CPU_TOKEN_BUDGET),
        sequences: args.max_num_seqs,
        graphs: !args.enforce_eager,
    };
    // The multi-token prediction or EAGLE head, built beside the target on the CPU backend.
    let mut mtp_head = None;
    let mut eagle_head = None;
    let drafter = match &drafting {
        speculation::Drafting::Model(arg) => {
            let (drafter, place) = draft::load(arg, &tokenizer, draft_cache, args.draft_head)?;
            Some((format!("the draft model {arg} ({place})"), drafter))
        }
        // A GPU artifact's head is a plan of its own, loaded beside the target's below.
        speculation::Drafting::Mtp if loaded.gpu_plan.is_some() => None,
        speculation::Drafting::Mtp => {
            mtp_head = Some(mtp::prepare(&mut loaded, args.draft_head)?);
            None
        }
        // A GPU artifact's head is a plan of its own, loaded beside the target's below.
        speculation::Drafting::Eagle(..) if loaded.gpu_plan.is_some() => None,
        speculation::Drafting::Eagle(method, dir) => {
            let (graph, head) = eagle::prepare(&mut loaded, *method, dir, args.draft_head)?;
            mtp_head = Some(graph);
            eagle_head = Some(head);
            None
        }
        speculation::Drafting::PromptLookup => None,
    };

    let metrics = Arc::new(metrics::Metrics::default());
    let (requests, inbox) = http_server::request_channel();
    let block_size = args.block_size;
    // The width of the states the model's MTP layers read: its hidden size.
    let hidden = loaded.model.config.hidden;
    match loaded.gpu_plan.take() {
        Some(plans) => {
            // A GPU artifact: its batched serving plan, with the KV pool sized here.
            let (plan, graph) = plans
                .serving
                .clone()
                .context("this GPU artifact has no serving plan (an older bbc compiled it); compile it again")?;
            let mtp_plan = match &drafting {
                speculation::Drafting::Mtp => Some(mtp::gpu_plan(&plans, &graph)?),
                speculation::Drafting::Eagle(method, dir) => {
                    let (head, plan) = eagle::gpu_plan(&loaded, &plans, *method, dir)?;
                    eagle_head = Some(head);
                    Some(plan)
                }
                _ => None,
            };
            // The tensors the plans read: the target's, and an EAGLE head's beside them.
            let joined = eagle_head.as_ref().map(|e| e.weights_beside(&loaded.model.weights));
            let head_weights = match &joined {
                Some(joined) => runtime::plan_exec::PlanWeights::Host(joined),
                None => loaded.plan_weights(),
            };
            let cache = codegen::gpu::BatchedCache {
                // Sized to the device's memory below unless given.
                blocks: args.kv_blocks.unwrap_or(1),
                block_size,
                sequences: args.max_num_seqs,
            };
            let weights = head_weights;
            let int8 = &loaded.int8_heads;
            // A decode step has a row per running sequence, and one per drafted token beside
            // it: those row counts run as graphs (none under `--enforce-eager`).
            let graph_rows = match args.enforce_eager {
                true => 0,
                false => args.max_num_seqs * (1 + config.speculation.tokens),
            };
            let backend =
                runtime_cuda::load_batched_plan(&plans.dir, &plan, graph, weights, int8, context_length, cache)?
                    .capture_graphs_up_to(graph_rows)
                    // The scheduler files no more than one a block.
                    .keep_state_snapshots(args.state_snapshots.min(args.kv_blocks.unwrap_or(usize::MAX)))?
                    .verify_drafts_up_to(config.speculation.tokens)?;
            // An MTP head's plan loads before the pools are sized: each block of the target's
            // also pays for the head's block beside it, and the head gets as many blocks.
            let head = match mtp_plan {
                Some((plan, graph)) => {
                    // One block until the pools are sized, unless they are given.
                    let placeholder = draft::DraftCache {
                        blocks: cache.blocks,
                        ..draft_cache
                    };
                    Some(mtp::gpu_head(
                        &plans.dir,
                        &plan,
                        graph,
                        (head_weights, context_length),
                        &placeholder,
                        &backend,
                    )?)
                }
                None => None,
            };
            // The plans hold the weights on the device now.
            loaded.model.weights.release_converted();
            let head_block_bytes = head.as_ref().map_or(0, |h| block_size * h.kv_bytes_per_position());
            let backend = match args.kv_blocks {
                Some(_) => backend,
                None => backend.size_kv_pool_beside(args.gpu_memory_utilization, head_block_bytes)?,
            };
            config.kv_blocks = backend.batched_cache().map_or(cache.blocks, |c| c.blocks);
            let head = match (head, args.kv_blocks) {
                (Some(head), None) => Some(head.resize_kv_pool(config.kv_blocks)?),
                (head, _) => head,
            };
            config.token_budget = args.token_budget.unwrap_or_else(|| {
                runtime::serving::PagedBackend::max_step_tokens(&backend).unwrap_or(CPU_TOKEN_BUDGET)
            });
            let block_bytes = block_size * backend.kv_bytes_per_position();
            eprintln!(
                "KV cache on the GPU: {}",
                runtime::kv_sizing::describe(config.kv_blocks, block_size, context_length, block_bytes)
            );
            announce_snapshots(
                backend.state_bytes_per_sequence(),
                backend.snapshot_places(),
                "on the GPU",
            );
            announce_checkpoints(&backend, args.max_num_seqs);
            eprintln!("steps of up to {} tokens", config.token_budget);
            let drafter = match head {
                Some(head) => {
                    // Its catch-up passes go through prompts as fast as the target's steps do.
                    let cache = draft::DraftCache {
                        token_budget: config.token_budget,
                        blocks: config.kv_blocks,
                        ..draft_cache
                    };
                    Some(head_drafter(
                        head,
                        eagle_head.as_ref(),
                        (hidden, context_length),
                        &cache,
                        "the GPU",
                    )?)
                }
                None => drafter,
            };
            let engine = engine_setup(
                (config, speculation_flags.speculate_up_to()),
                args,
                drafter,
                inbox,
                &metrics,
            );
            http_server::start_engine(backend, engine)?;
        }
        None => {
            let (backend, head) = cpu_serving_with_head(loaded, mtp_head, eagle_head.as_ref())?;
            let drafter = match head {
                Some(head) => Some(head_drafter(
                    head,
                    eagle_head.as_ref(),
                    (hidden, context_length),
                    &draft_cache,
                    "the CPU backend",
                )?),
                None => drafter,
            };
            let logits = backend.logits();
            let block_bytes = block_size * logits.kv_bytes_per_position();
            config.kv_blocks = args.kv_blocks.unwrap_or_else(|| {
                // Unknown (not Linux): as if 8 GiB were available.
                let available = runtime::kv_sizing::available_memory().unwrap_or(8 << 30);
                let per_context = context_length.div_ceil(block_size);
                runtime::kv_sizing::cpu_kv_blocks(available, block_bytes, per_context, args.max_num_seqs)
            });
            config.token_budget = args.token_budget.unwrap_or(CPU_TOKEN_BUDGET);
            eprintln!(
                "KV cache: {} (taken as it fills)",
                runtime::kv_sizing::describe(config.kv_blocks, block_size, context_length, block_bytes)
            );
            if logits.has_recurrent_state() {
                let places = args.state_snapshots.min(config.kv_blocks);
                announce_snapshots(logits.state_bytes_per_sequence(), places, "as it fills");
            }
            eprintln!("steps of up to {} tokens", config.token_budget);
            if backend.has_greedy_graph() {
                eprintln!("greedy steps: the INT8-bound head (exact argmax)");
            }
            let engine = engine_setup(
                (config, speculation_flags.speculate_up_to()),
                args,
                drafter,
                inbox,
                &metrics,
            );
            http_server::start_engine(backend, engine)?;
        }
    }
    let template = tokenizer.chat_template.as_ref().map(|t| t.source());
    let tool_calls = args.tool_call_parser.format(template);
    match tool_calls {
        Some(format) => eprintln!("tool calls (tool_choice auto) read in the {} format", format.name()),
        None => {
            eprintln!("tool_choice auto: refused (no tool-call format in the chat template; see --tool-call-parser)")
        }
    }
    let options = http_server::ServerOptions {
        model_name: args
            .served_model_name
            .clone()
            .unwrap_or_else(|| served_name(&args.model)),
        tokenizer,
        context_length,
        api_key: args.api_key.clone(),
        reasoning: args.reasoning_parser.markers(family),
        tool_calls,
        generation_defaults,
        priority_scheduling: args.scheduling_policy == SchedulingPolicyArg::Priority,
        seed: args.seed,
    };
    http_server::listen(&format!("{}:{}", args.host, args.port), options, requests, metrics)
}

/// `loaded` (loaded with its greedy graph) on the CPU backend as serving runs it: its greedy
/// graph beside the logits graph where that graph's head is a cheaper one (the INT8-bound
/// head of an f32, bf16 or half head, which it reads a fraction of the bytes of, or a drafter's
/// 4-bit shortlist); a quantized head's greedy graph computes what the logits graph does, so
/// then the logits graph alone.
pub(crate) fn cpu_serving(loaded: model_ref::Loaded) -> Result<runtime::serving::CpuGreedyServing> {
    Ok(cpu_serving_with_head(loaded, None, None)?.0)
}

/// [`cpu_serving`], and a backend of `head` (a graph over the same weights, a multi-token
/// prediction head's, or over them and `eagle`'s) sharing the weights both read.
fn cpu_serving_with_head(
    mut loaded: model_ref::Loaded,
    head: Option<ir::Graph>,
    eagle: Option<&models::eagle::EagleHead>,
) -> Result<(runtime::serving::CpuGreedyServing, Option<runtime::CpuBackend>)> {
    let context_length = loaded.model.config.context_length;
    let mut cache = loaded.weight_cache();
    let target = &loaded.model.weights;
    // An EAGLE head's tensors beside the target's: its graph reads both, and the target's
    // graphs read its `fc`.
    let joined = eagle.map(|e| e.weights_beside(target));
    let weights: &dyn quant::tensor::Tensors = match &joined {
        Some(joined) => joined,
        None => target,
    };
    // Every graph's weights through the one cache, so those they share are loaded once.
    let mut backend = |graph| runtime::CpuBackend::with_cache(graph, weights, context_length, &mut cache);
    let head = head.map(&mut backend).transpose()?;
    let logits = backend(loaded.graph)?;
    let greedy = loaded
        .greedy
        .take()
        .filter(has_cheap_head)
        .map(&mut backend)
        .transpose()?;
    Ok((runtime::serving::CpuGreedyServing::new(logits, greedy)?, head))
}

/// Whether a greedy graph's head is cheaper than the logits graph's (the INT8-bound head, or
/// a drafter's 4-bit shortlist), so that greedy steps are worth running on it.
fn has_cheap_head(graph: &ir::Graph) -> bool {
    graph
        .nodes()
        .iter()
        .any(|n| matches!(n.op, ir::Op::Int8BoundTopK { .. } | ir::Op::ShortlistTopK { .. }))
}

/// The drafter over a draft head's backend `head`: `eagle`'s where given, else the model's
/// multi-token prediction layers' (reading states `hidden` wide); named with `place`, where it
/// runs.
fn head_drafter<B>(
    head: B,
    eagle: Option<&models::eagle::EagleHead>,
    (hidden, context_length): (usize, usize),
    cache: &draft::DraftCache,
    place: &str,
) -> Result<(String, Box<dyn runtime::serving::Drafter>)>
where
    B: runtime::serving::PagedBackend + Send + 'static,
    B::Pages: Send,
{
    Ok(match eagle {
        Some(eagle) => (
            format!(
                "the {} head in {} (on {place})",
                eagle.method.name(),
                eagle.dir.display()
            ),
            eagle::drafter(head, eagle, context_length, cache)?,
        ),
        None => (
            format!("the model's multi-token prediction layers (on {place})"),
            mtp::drafter(head, hidden, context_length, cache)?,
        ),
    })
}

/// Say what the prefix cache keeps of a model's recurrent states: `places` snapshots of
/// `state_bytes` each (`held`: where, or when, that memory is taken).
fn announce_snapshots(state_bytes: usize, places: usize, held: &str) {
    if places > 0 {
        let mib = state_bytes as f64 / f64::from(1 << 20);
        eprintln!(
            "recurrent states: {mib:.1} MiB a sequence; the prefix cache keeps up to {places} snapshots of them ({:.1} MiB {held})",
            places as f64 * mib
        );
    }
}

/// Say what verifying drafts keeps of a GPU plan's recurrent states: a copy per draft and
/// sequence.
fn announce_checkpoints(backend: &runtime_cuda::CudaBackend, sequences: usize) {
    let drafts = backend.draft_checkpoints();
    if drafts > 0 {
        let mib = (sequences * drafts * backend.state_bytes_per_sequence()) as f64 / f64::from(1 << 20);
        eprintln!(
            "recurrent states: {drafts} copies a sequence to rewind refused drafts to ({mib:.1} MiB on the GPU for {sequences} sequences)"
        );
    }
}

/// The CPU backend's default token budget: a step's length bounds every running request's
/// time per output token, and a CPU computes few tokens a millisecond.
const CPU_TOKEN_BUDGET: usize = 128;

/// A draft model's KV blocks where `--kv-blocks` is not given (its cache on the CPU grows as
/// it fills; on a GPU it is allocated beside the target's).
const DRAFT_KV_BLOCKS: usize = 1024;

/// The engine's setup once the backend settled the scheduler's blocks and budget.
fn engine_setup(
    (config, speculate_up_to): (SchedulerConfig, Option<usize>),
    args: &ServeArgs,
    drafter: Option<(String, Box<dyn runtime::serving::Drafter>)>,
    inbox: tokio::sync::mpsc::UnboundedReceiver<http_server::worker::NewRequest>,
    metrics: &Arc<metrics::Metrics>,
) -> EngineSetup {
    metrics.kv_blocks_total.store(config.kv_blocks as u64, Relaxed);
    EngineSetup {
        config,
        policy: args.scheduling_policy.policy(),
        drafter,
        speculate_up_to,
        inbox,
        metrics: metrics.clone(),
    }
}

/// The model id clients send: a known model's name or shape's, or the file or directory name
/// (a `config.json`'s directory's).
fn served_name(model: &str) -> String {
    let mut path = std::path::Path::new(model.trim_end_matches('/'));
    if path.file_name().is_some_and(|n| n == "config.json") {
        path = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(path);
    }
    path.file_stem()
        .map_or_else(|| model.to_string(), |s| s.to_string_lossy().into_owned())
}
