//! `bbc run MODEL --prompt TEXT | --prompt-ids 1,2,3 [...]`: generate and stream text.

use crate::model_ref;
use anyhow::{bail, ensure, Context, Result};
use http_server::grammar::{GrammarConstraint, OutputSpec, Reasoning, StructuredOutputs};
use models::{ChatMessage, ComputeDtype, KvCacheDtype, LogitsFor, StreamDecoder, Tokenizer};
use runtime::serving::{AddError, PagedBackend, SchedulerConfig, ServingEngine};
use runtime::{LogitsProcessor, SamplingParams};
use std::collections::HashSet;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args)]
pub struct RunArgs {
    pub model: String,
    /// The prompt text (tokenized with the model's tokenizer; BOS added when the model wants it).
    #[arg(long)]
    pub prompt: Option<String>,
    /// The prompt as token ids, comma-separated (for models without a tokenizer).
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Send the prompt as a user message through the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// With --chat: a system message first.
    #[arg(long)]
    pub system: Option<String>,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// With a temperature: sample from the smallest set of most likely tokens holding this
    /// share of the probability (1 keeps every token).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// With a temperature: sample from this many most likely tokens (0 keeps every token).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// With a temperature: sample from the tokens at least this many times as likely as the
    /// most likely one (0 keeps every token).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON object {prompt_ids, ids, text} instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Print special tokens (an end-of-turn token past `--ignore-eos`, say); by default they
    /// write no text, as in servers' answers, but for those spelling part of a reasoning or
    /// tool-call marker.
    #[arg(long)]
    pub special: bool,
    /// Write the logits of the last prompt position and of every generated step (safetensors, `logits` [steps, vocab]).
    #[arg(long)]
    pub dump_logits: Option<PathBuf>,
    /// Compute dtype for matrices: f32, bf16, f16 or native (the file's own storage, its
    /// quantization kept); vLLM's float32, bfloat16, float16/half and auto read too.
    #[arg(long, value_parser = parse_dtype)]
    pub dtype: Option<ComputeDtype>,
    /// What the KV cache stores keys and values as: auto (bf16 for a bf16 dtype, half for
    /// f16, f32 for f32; native: the weights' float type, or f16 for quantized blocks, as
    /// llama.cpp), f32, bf16 or f16 (half the bytes of f32), or fp8 (E4M3, a quarter;
    /// vLLM's). A GPU artifact's caches are fixed when compiled (`bbc compile
    /// --kv-cache-dtype`).
    #[arg(long, value_parser = parse_kv_cache_dtype)]
    pub kv_cache_dtype: Option<KvCacheDtype>,
    /// The longest context (prompt and output tokens) to allow, at most the model's own
    /// (default: the model's, or model.toml's `context_length`).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// The tokenizer to use instead of the model's (vLLM's flag): a GGUF file, a
    /// tokenizer.json, a directory holding one, or a model name such as `smollm2`.
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
    /// With --chat: the chat template to use instead of the model's (a Jinja file, or the
    /// template itself).
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Run the graph as lowered, without the fusion passes.
    #[arg(long)]
    pub no_fuse: bool,
    /// Structured output: JSON valid under the JSON schema in this file.
    #[arg(long, group = "structured")]
    pub json_schema: Option<PathBuf>,
    /// Structured output: text matching this regular expression (Rust's syntax), whole.
    #[arg(long, group = "structured")]
    pub regex: Option<String>,
    /// Structured output: one of these strings (repeat the flag for each).
    #[arg(long, group = "structured")]
    pub choice: Vec<String>,
    /// Structured output: text in the grammar in this file (llguidance's Lark syntax).
    #[arg(long, group = "structured")]
    pub grammar: Option<PathBuf>,
}

/// `--dtype` as clap reads it (shared by `run` and `serve`).
pub fn parse_dtype(d: &str) -> std::result::Result<ComputeDtype, String> {
    ComputeDtype::parse(d).ok_or_else(|| format!("--dtype {d}: choose one of {}", ComputeDtype::choices()))
}

/// `--kv-cache-dtype` as clap reads it (shared by `run` and `serve`).
pub fn parse_kv_cache_dtype(d: &str) -> std::result::Result<KvCacheDtype, String> {
    KvCacheDtype::parse(d).ok_or_else(|| format!("--kv-cache-dtype {d}: choose one of {}", KvCacheDtype::choices()))
}

pub fn run(args: &RunArgs) -> Result<()> {
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        bail!(
            "--temperature must be a finite number ≥ 0 (0 is greedy), got {}",
            args.temperature
        );
    }
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", args.top_p);
    }
    if !(0.0..=1.0).contains(&args.min_p) {
        bail!("--min-p must be in [0, 1], got {}", args.min_p);
    }
    let started = Instant::now();
    let options = model_ref::LoadOptions {
        dtype: args.dtype,
        load_format: args.load_format,
        quantization: args.quantization.clone(),
        kv_cache_dtype: args.kv_cache_dtype,
        max_model_len: args.max_model_len,
        logits: LogitsFor::LastToken,
        greedy: true,
        fuse: !args.no_fuse,
        quiet: args.json,
        tokenizer: args.tokenizer.clone(),
    };
    let mut loaded = model_ref::load(&args.model, options)?;
    if let Some(arg) = &args.chat_template {
        ensure!(args.chat, "--chat-template applies to --chat prompts");
        let tokenizer = loaded.model.tokenizer.as_mut().context("this model has no tokenizer")?;
        model_ref::use_chat_template(tokenizer, arg)?;
    }
    // Shared with the grammar compiler, which keeps it (a server drafts forced text with it).
    let tokenizer = loaded.model.tokenizer.take().map(Arc::new);
    let tokenizer = tokenizer.as_ref();
    let prompt = prompt_ids(args, tokenizer.map(|t| &**t))?;
    let spec = output_spec(args)?;
    let context = loaded.model.config.context_length;
    // One request through the serving engine, as `bbc serve` runs many: room in the KV cache
    // for the prompt and every token it may generate, and the whole prompt in one step where
    // the backend takes it.
    let block_size = 16;
    let positions = (prompt.len() + args.max_tokens).min(context);
    let config = SchedulerConfig {
        max_waiting: 1,
        max_running: 1,
        token_budget: prompt.len().max(1),
        kv_blocks: positions.div_ceil(block_size) + 1,
        block_size,
        context_length: context,
        prefix_caching: false,
        speculation: runtime::serving::NgramConfig::OFF,
        recurrent_state: false,
        state_cache: runtime::serving::StateCacheConfig::OFF,
    };
    if let Some(plans) = loaded.gpu_plan.take() {
        // A GPU artifact runs its batched serving plan on the CUDA backend, a decode step
        // replayed as a CUDA graph; its greedy steps take the argmax on the device.
        let (plan, graph) = plans
            .serving
            .context("this GPU artifact has no serving plan (an older bbc compiled it); compile it again")?;
        let cache = codegen::gpu::BatchedCache {
            blocks: config.kv_blocks,
            block_size,
            sequences: 1,
        };
        let (weights, int8) = (loaded.plan_weights(), &loaded.int8_heads);
        let backend = runtime_cuda::load_batched_plan(&plans.dir, &plan, graph, weights, int8, context, cache)?
            .capture_graphs_up_to(1);
        // The plan holds the weights on the device now.
        loaded.model.weights.release_converted();
        let engine = ServingEngine::new(backend, config);
        return stream(args, engine, &prompt, tokenizer, spec.as_ref(), started.elapsed());
    }
    let engine = ServingEngine::new(crate::serve::cpu_serving(loaded)?, config);
    stream(args, engine, &prompt, tokenizer, spec.as_ref(), started.elapsed())
}

/// The structured output the flags ask for, if any (clap lets at most one through).
fn output_spec(args: &RunArgs) -> Result<Option<OutputSpec>> {
    let read = |path: &PathBuf| std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()));
    if let Some(path) = &args.json_schema {
        let schema = serde_json::from_str(&read(path)?)
            .with_context(|| format!("--json-schema {}: not JSON", path.display()))?;
        return Ok(Some(OutputSpec::JsonSchema(schema)));
    }
    if let Some(path) = &args.grammar {
        return Ok(Some(OutputSpec::Grammar(read(path)?)));
    }
    if let Some(regex) = &args.regex {
        return Ok(Some(OutputSpec::Regex(regex.clone())));
    }
    if args.choice.iter().any(String::is_empty) {
        bail!("--choice: an empty string is not a choice");
    }
    Ok((!args.choice.is_empty()).then(|| OutputSpec::Choice(args.choice.clone())))
}

/// The logits processors of `spec`'s grammar (none without one). The grammar holds from the
/// first token: `bbc run` prints a reasoning model's reasoning as text, unsplit.
fn processors(
    spec: Option<&OutputSpec>,
    tokenizer: Option<&Arc<Tokenizer>>,
    stop_tokens: &[u32],
) -> Result<Vec<Box<dyn LogitsProcessor>>> {
    let Some(spec) = spec else { return Ok(Vec::new()) };
    let tokenizer = tokenizer.context("a structured output needs the model's tokenizer (its tokens' bytes)")?;
    let compiler = StructuredOutputs::new(tokenizer.clone()).map_err(anyhow::Error::msg)?;
    let matcher = compiler
        .matcher(spec)
        .map_err(|e| anyhow::anyhow!("the structured output does not compile: {e}"))?;
    let ends = stop_tokens.iter().chain(&tokenizer.eos).copied().collect();
    Ok(vec![Box::new(GrammarConstraint::new(matcher, ends, Reasoning::None))])
}

/// Generate with `engine` (one request), streaming text (or printing JSON), dumping logits,
/// reporting speed.
fn stream<B: PagedBackend>(
    args: &RunArgs,
    mut engine: ServingEngine<B>,
    prompt: &[u32],
    shared_tokenizer: Option<&Arc<Tokenizer>>,
    spec: Option<&OutputSpec>,
    load_time: std::time::Duration,
) -> Result<()> {
    let tokenizer = shared_tokenizer.map(|t| &**t);
    let sampling = SamplingParams {
        temperature: args.temperature,
        seed: args.seed,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: args.min_p,
        ..SamplingParams::default()
    };
    let stop_tokens = match (args.ignore_eos, tokenizer) {
        (false, Some(t)) => t.eos.clone(),
        _ => Vec::new(),
    };
    let processors = processors(spec, shared_tokenizer, &stop_tokens)?;
    let silent = match (args.special, tokenizer) {
        (false, Some(t)) => http_server::special_tokens::silent(t),
        _ => HashSet::new(),
    };
    let mut decoder = StreamDecoder::new();
    let mut logits_rows: Vec<f32> = Vec::new();
    let mut stdout = std::io::stdout().lock();
    let generation_start = Instant::now();
    let mut first_token_at = None;
    let id = engine
        .add_processed(
            prompt.to_vec(),
            args.max_tokens,
            stop_tokens.clone(),
            sampling,
            processors,
            0,
        )
        .map_err(|e| match e {
            AddError::TooLong { needed, limit, .. } => runtime::RuntimeError::ContextOverflow { needed, limit }.into(),
            other => anyhow::anyhow!("{other}"),
        })?;
    if args.dump_logits.is_some() {
        engine.return_logits(id);
    }
    let mut ids = Vec::new();
    while !engine.scheduler().is_idle() {
        let out = engine.step()?;
        for sampled in out.tokens {
            first_token_at.get_or_insert_with(Instant::now);
            ids.push(sampled.token);
            if let Some(logits) = sampled.logits {
                logits_rows.extend_from_slice(&logits);
            }
            let writes = !stop_tokens.contains(&sampled.token) && !silent.contains(&sampled.token);
            if !args.json && writes {
                match tokenizer {
                    Some(t) => {
                        let text = decoder
                            .push(t, sampled.token)
                            .map_err(|e| runtime::RuntimeError::Input(format!("decoding the output: {e}")))?;
                        write!(stdout, "{text}")
                    }
                    None => write!(stdout, "{} ", sampled.token),
                }
                .and_then(|_| stdout.flush())
                .map_err(|e| runtime::RuntimeError::Input(format!("writing to stdout: {e}")))?;
            }
        }
    }
    let done = Instant::now();
    // The text leaves out a final stop token (it ends the answer, it is not part of it).
    let shown = match ids.last() {
        Some(last) if stop_tokens.contains(last) => &ids[..ids.len() - 1],
        _ => &ids[..],
    };
    let shown: Vec<u32> = shown.iter().copied().filter(|id| !silent.contains(id)).collect();
    let text = match tokenizer {
        Some(t) => Some(t.decode(&shown)?),
        None => None,
    };
    if args.json {
        let out = serde_json::json!({ "prompt_ids": prompt, "ids": ids, "text": text });
        writeln!(stdout, "{out}")?;
    } else {
        if let Some(t) = tokenizer {
            write!(stdout, "{}", decoder.finish(t)?)?;
        }
        writeln!(stdout)?;
    }
    if let Some(path) = &args.dump_logits {
        write_logits(path, &logits_rows, logits_rows.len() / ids.len().max(1))?;
    }
    if !args.json {
        let first = first_token_at.unwrap_or(done);
        let prefill = first - generation_start;
        let decode = done - first;
        let decode_rate = (ids.len().saturating_sub(1)) as f64 / decode.as_secs_f64().max(1e-9);
        eprintln!(
            "[load {:.2}s | prompt {} tokens in {:.2}s ({:.1} tok/s) | {} generated, decode {:.1} tok/s | {} threads, {}]",
            load_time.as_secs_f64(),
            prompt.len(),
            prefill.as_secs_f64(),
            prompt.len() as f64 / prefill.as_secs_f64().max(1e-9),
            ids.len(),
            decode_rate,
            rayon::current_num_threads(),
            runtime::cpu::simd::isa(),
        );
    }
    Ok(())
}

fn prompt_ids(args: &RunArgs, tokenizer: Option<&Tokenizer>) -> Result<Vec<u32>> {
    match (&args.prompt, &args.prompt_ids) {
        (Some(_), Some(_)) => bail!("give --prompt or --prompt-ids, not both"),
        (None, None) => bail!("give a prompt: --prompt TEXT or --prompt-ids 1,2,3"),
        (None, Some(ids)) => {
            if args.chat {
                bail!("--chat renders text through the chat template; it needs --prompt, not --prompt-ids");
            }
            if ids.is_empty() {
                bail!("--prompt-ids is empty");
            }
            Ok(ids.clone())
        }
        (Some(text), None) => {
            let tokenizer = tokenizer.context("this model has no tokenizer; give --prompt-ids instead of --prompt")?;
            if !args.chat {
                if args.system.is_some() {
                    bail!("--system applies to --chat prompts");
                }
                return Ok(tokenizer.encode(text, true)?);
            }
            let template = tokenizer
                .chat_template
                .as_ref()
                .context("this model has no chat template (a base model?); run without --chat")?;
            let mut messages = Vec::new();
            if let Some(system) = &args.system {
                messages.push(ChatMessage::new("system", system));
            }
            messages.push(ChatMessage::new("user", text));
            let rendered = template.render(&messages, true)?;
            // The template writes BOS itself when the model wants it.
            let ids = tokenizer.encode(&rendered, false)?;
            if ids.is_empty() {
                bail!("the rendered chat prompt is empty");
            }
            Ok(ids)
        }
    }
}

/// One tensor `logits` [steps, vocab] f32.
fn write_logits(path: &std::path::Path, rows: &[f32], vocab: usize) -> Result<()> {
    let bytes: Vec<u8> = rows.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![rows.len() / vocab.max(1), vocab], &bytes)
            .context("building the logits tensor")?;
    safetensors::serialize_to_file([("logits", view)], None, path)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
