//! `bbc bench`: a load client that measures a running OpenAI-compatible server the way the
//! InferenceX benchmark does (its fork of vLLM's `benchmark_serving.py`): random prompts of
//! ISL tokens, OSL output tokens with `ignore_eos`, CONC requests in flight, each on a new
//! connection, warm-up requests first; output throughput and TTFT/TPOT/ITL/E2EL at
//! mean/p50/p90/p99. Point it at `bbc serve`, vLLM or SGLang alike.

mod client;
mod prompts;
mod report;

use crate::model_ref;
use anyhow::{bail, Context, Result};
use client::{Measured, Server};
use prompts::{BenchRequest, Lengths};
use report::Report;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// The server, `http://HOST:PORT`.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// The model id to request (default: the first the server lists).
    #[arg(long)]
    pub model: Option<String>,
    /// Where the prompts' tokenizer comes from: a model name, weights path, model.toml or
    /// artifact (default: the model id, e.g. `smollm2`).
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// `completions` or `chat`.
    #[arg(long, default_value = "completions", value_parser = ["completions", "chat"])]
    pub endpoint: String,
    /// Input (prompt) length in tokens, ISL.
    #[arg(long, default_value_t = 1024)]
    pub input_len: usize,
    /// Output length in tokens, OSL.
    #[arg(long, default_value_t = 1024)]
    pub output_len: usize,
    /// Lengths are drawn from [ratio·LEN, LEN].
    #[arg(long, default_value_t = 0.8)]
    pub range_ratio: f64,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// Measured requests (default: 10 × concurrency).
    #[arg(long)]
    pub num_prompts: Option<usize>,
    /// Unmeasured requests first (default: 2 × concurrency).
    #[arg(long)]
    pub warmups: Option<usize>,
    #[arg(long)]
    pub api_key: Option<String>,
    /// Seeds the prompts and lengths: the same seed, the same requests.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Sampling temperature of every request (0, InferenceX's, is greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// `top_p` of every request (1 keeps every token).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// `top_k` of every request (0 keeps every token).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Also write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub fn bench(args: &BenchArgs) -> Result<()> {
    if args.concurrency == 0 || args.input_len == 0 || args.output_len == 0 {
        bail!("--concurrency, --input-len and --output-len must be at least 1");
    }
    if !(0.0..=1.0).contains(&args.range_ratio) {
        bail!("--range-ratio must be within [0, 1], got {}", args.range_ratio);
    }
    if !(args.temperature >= 0.0 && args.top_p > 0.0 && args.top_p <= 1.0) {
        bail!("--temperature must be at least 0 and --top-p within (0, 1]");
    }
    let server = Server::parse(&args.url, args.api_key.clone())?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => runtime.block_on(first_model(&server))?,
    };
    let tokenizer = load_tokenizer(args.tokenizer.as_deref().unwrap_or(&model))?;
    let warmups = args.warmups.unwrap_or(2 * args.concurrency);
    let measured = args.num_prompts.unwrap_or(10 * args.concurrency);
    let lengths = Lengths {
        input: args.input_len,
        output: args.output_len,
        range_ratio: args.range_ratio,
    };
    let mut requests = prompts::random_requests(&tokenizer, warmups + measured, lengths, args.seed)?;
    let measured_requests = requests.split_off(warmups);
    let path = match args.endpoint.as_str() {
        "chat" => "/v1/chat/completions",
        _ => "/v1/completions",
    };
    let bodies = |rs: &[BenchRequest]| rs.iter().map(|r| body(args, &model, r)).collect::<Vec<_>>();
    eprintln!(
        "bench: {warmups} warm-up + {measured} requests to {}{path}, ISL {} OSL {} concurrency {}",
        server.address, args.input_len, args.output_len, args.concurrency
    );
    runtime.block_on(run_all(&server, path, bodies(&requests), args.concurrency));
    let start = Instant::now();
    let results = runtime.block_on(run_all(&server, path, bodies(&measured_requests), args.concurrency));
    let report = Report::new(args.concurrency, &results, start.elapsed());
    print!("{report}");
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if !report.acceptable() {
        bail!("{} of {} requests failed (over 5%)", report.failed, results.len());
    }
    Ok(())
}

/// The request body the InferenceX client sends, with the sampling settings asked for.
fn body(args: &BenchArgs, model: &str, r: &BenchRequest) -> Value {
    let mut body = json!({
        "model": model,
        "temperature": args.temperature,
        "stream": true,
        "stream_options": {"include_usage": true},
        "ignore_eos": true,
    });
    if args.top_p < 1.0 {
        body["top_p"] = json!(args.top_p);
    }
    if args.top_k > 0 {
        body["top_k"] = json!(args.top_k);
    }
    if args.endpoint == "chat" {
        body["messages"] = json!([{"role": "user", "content": r.prompt}]);
        body["max_completion_tokens"] = json!(r.max_tokens);
    } else {
        body["prompt"] = json!(r.prompt);
        body["max_tokens"] = json!(r.max_tokens);
        body["best_of"] = json!(1);
        body["logprobs"] = Value::Null;
    }
    body
}

/// Send every body with at most `concurrency` in flight; each one's result, in order.
async fn run_all(server: &Server, path: &str, bodies: Vec<Value>, concurrency: usize) -> Vec<Result<Measured, String>> {
    let bodies = Arc::new(bodies);
    let next = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for _ in 0..concurrency.min(bodies.len()) {
        let (server, path, bodies, next) = (server.clone(), path.to_string(), bodies.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            let mut done = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(body) = bodies.get(i) else { break done };
                done.push((i, server.stream(&path, body).await.map_err(|e| format!("{e:#}"))));
            }
        }));
    }
    let mut results: Vec<Option<Result<Measured, String>>> = vec![None; bodies.len()];
    for worker in workers {
        match worker.await {
            Ok(done) => done.into_iter().for_each(|(i, r)| results[i] = Some(r)),
            Err(e) => return vec![Err(format!("a client task failed: {e}")); bodies.len()],
        }
    }
    results
        .into_iter()
        .map(|r| r.expect("every request was taken"))
        .collect()
}

async fn first_model(server: &Server) -> Result<String> {
    let models = server.get_json("/v1/models").await?;
    models["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .context("the server lists no model; pass --model")
}

fn load_tokenizer(model: &str) -> Result<models::Tokenizer> {
    model_ref::tokenizer(model)
        .with_context(|| format!("loading the tokenizer of `{model}` (choose another with --tokenizer)"))
}
