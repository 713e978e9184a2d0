//! `bbc perplexity MODEL --file TEXT`: how well a model predicts a text, as llama.cpp's
//! `llama-perplexity` measures it, so a quantization or a dtype can be judged against another
//! (and against llama.cpp's figure on the same file): the text's tokens cut into windows of
//! `--context`, each window's first token the model's BOS where it has one, and each window
//! scored on its second half (the first half is context), `exp` of the mean negative
//! log-likelihood over all scored tokens. The windows run through the serving engine as
//! requests scoring their prompts (`SamplingParams::prompt_logprobs`), several per step.

use crate::model_ref;
use anyhow::{bail, Context, Result};
use models::{ComputeDtype, KvCacheDtype};
use runtime::serving::{SchedulerConfig, SeqId, ServingEngine};
use runtime::SamplingParams;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct PerplexityArgs {
    pub model: String,
    /// The text to score (UTF-8).
    #[arg(long)]
    pub file: PathBuf,
    /// Tokens per window (llama.cpp's `-c`); each window is scored on its second half.
    #[arg(long, default_value_t = 512)]
    pub context: usize,
    /// Score at most this many windows (default: every whole window of the text).
    #[arg(long)]
    pub windows: Option<usize>,
    /// Compute dtype for matrices: f32, bf16, f16 or native (the file's own storage, its
    /// quantization kept); vLLM's float32, bfloat16, float16/half and auto read too.
    #[arg(long, value_parser = super::run::parse_dtype)]
    pub dtype: Option<ComputeDtype>,
    /// What the KV cache stores keys and values as (see `bbc run --help`).
    #[arg(long, value_parser = super::run::parse_kv_cache_dtype)]
    pub kv_cache_dtype: Option<KvCacheDtype>,
    /// How the weights are quantized (see `bbc run --help`): `fp8` quantizes a checkpoint of
    /// floats as it loads, so its cost shows beside the floats' perplexity.
    #[arg(long, short = 'q')]
    pub quantization: Option<String>,
    /// Print one JSON object instead of a line.
    #[arg(long)]
    pub json: bool,
}

/// What a run measured.
#[derive(Debug, serde::Serialize)]
struct Perplexity {
    perplexity: f64,
    /// llama.cpp's uncertainty: the standard error of the mean log-likelihood, carried
    /// through `exp`.
    uncertainty: f64,
    scored_tokens: usize,
    windows: usize,
    context: usize,
    seconds: f64,
}

pub fn perplexity(args: &PerplexityArgs) -> Result<()> {
    if args.context < 4 {
        bail!("--context must be at least 4 tokens, got {}", args.context);
    }
    if args.windows == Some(0) {
        bail!("--windows must be at least 1");
    }
    let text = std::fs::read_to_string(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let options = model_ref::LoadOptions {
        dtype: args.dtype,
        kv_cache_dtype: args.kv_cache_dtype,
        quantization: args.quantization.clone(),
        quiet: args.json,
        ..model_ref::LoadOptions::default()
    };
    let mut loaded = model_ref::load(&args.model, options)?;
    if loaded.gpu_plan.is_some() {
        bail!("bbc perplexity runs on the CPU backend: give it the model, not a GPU artifact");
    }
    let tokenizer = loaded.model.tokenizer.take().context("this model has no tokenizer")?;
    let context_length = loaded.model.config.context_length;
    // Each window also takes the one token the engine generates after it.
    if args.context >= context_length {
        bail!(
            "--context {} must be below the model's context of {context_length}",
            args.context
        );
    }
    // As llama.cpp tokenizes it: the model's BOS first where it wants one.
    let tokens = tokenizer.encode(&text, true).context("tokenizing the text")?;
    let mut windows: Vec<Vec<u32>> = tokens.chunks_exact(args.context).map(<[u32]>::to_vec).collect();
    windows.truncate(args.windows.unwrap_or(usize::MAX));
    if windows.is_empty() {
        bail!(
            "the text is {} tokens, shorter than one window of --context {}",
            tokens.len(),
            args.context
        );
    }
    if let Some(bos) = tokenizer.bos.filter(|_| tokenizer.add_bos) {
        windows.iter_mut().for_each(|w| w[0] = bos);
    }
    let mut cache = loaded.weight_cache();
    let backend = runtime::CpuBackend::with_cache(loaded.graph, &loaded.model.weights, context_length, &mut cache)?;
    let started = Instant::now();
    let scores = window_scores(backend, &windows, args.context)?;
    let measured = measure(&scores, args.context, windows.len(), started.elapsed().as_secs_f64());
    match args.json {
        true => println!("{}", serde_json::to_string(&measured)?),
        false => println!(
            "perplexity {:.4} ± {:.4} over {} tokens ({} windows of {}, the second half of each scored), {:.1} s",
            measured.perplexity,
            measured.uncertainty,
            measured.scored_tokens,
            measured.windows,
            measured.context,
            measured.seconds
        ),
    }
    Ok(())
}

/// Each window's log-likelihoods of its scored tokens (positions `context / 2 + 1` on, as
/// llama.cpp scores them), the windows run together as requests that score their prompts.
fn window_scores(backend: runtime::CpuBackend, windows: &[Vec<u32>], context: usize) -> Result<Vec<Vec<f64>>> {
    let config = SchedulerConfig {
        max_waiting: windows.len(),
        max_running: 4,
        token_budget: context,
        kv_blocks: 4 * context.div_ceil(16) + 4,
        block_size: 16,
        context_length: context + 1,
        prefix_caching: false,
        speculation: runtime::serving::NgramConfig::OFF,
        recurrent_state: false,
        state_cache: runtime::serving::StateCacheConfig::OFF,
    };
    let mut engine = ServingEngine::new(backend, config);
    let scoring = SamplingParams {
        prompt_logprobs: Some(0),
        ..SamplingParams::default()
    };
    // The first half of a window is its context: no logits are computed for it.
    let first_scored = context / 2 + 1;
    let mut ids = Vec::with_capacity(windows.len());
    for window in windows {
        let id = engine
            .add(window.clone(), 1, Vec::new(), scoring)
            .context("queueing the windows")?;
        engine.score_prompt_from(id, first_scored);
        ids.push(id);
    }
    let mut by_seq: HashMap<SeqId, Vec<f64>> = HashMap::new();
    while !engine.scheduler().is_idle() {
        for scored in engine.step()?.prompt_logprobs {
            debug_assert!(scored.first >= first_scored);
            let logprobs = scored.logprobs.iter().map(|lp| f64::from(lp.logprob));
            by_seq.entry(scored.seq).or_default().extend(logprobs);
        }
    }
    Ok(ids.iter().map(|id| by_seq.remove(id).unwrap_or_default()).collect())
}

/// Perplexity and its uncertainty from every window's log-likelihoods.
fn measure(scores: &[Vec<f64>], context: usize, windows: usize, seconds: f64) -> Perplexity {
    let all: Vec<f64> = scores.iter().flatten().map(|lp| -lp).collect();
    let n = all.len() as f64;
    let mean = all.iter().sum::<f64>() / n;
    let variance = all.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    let perplexity = mean.exp();
    Perplexity {
        perplexity,
        uncertainty: perplexity * (variance / n).sqrt(),
        scored_tokens: all.len(),
        windows,
        context,
        seconds,
    }
}
