//! `bbc bench`: a load client that measures a running OpenAI-compatible server the way the
//! InferenceX benchmark does (its fork of vLLM's `benchmark_serving.py`): random prompts of
//! ISL tokens, OSL output tokens with `ignore_eos`, warm-up requests first; output throughput
//! and TTFT/TPOT/ITL/E2EL at mean/p50/p90/p99. Point it at `bbc serve`, vLLM or SGLang alike.
//!
//! Modes: `concurrency` keeps C requests in flight (one run per ISL × OSL × C given); `sweep`
//! is the same over the seeds' grid unless told otherwise (ISL 1 024 and 8 192, OSL 1 024,
//! C 1/4/16/64); `rate` admits requests at a sustained rate for a duration, and `burst` sends
//! bursts of requests at once, both whatever is still running. Each run's prompts are fresh
//! unless `--seed` repeats a run's: the same prompts twice would find the server's prefix
//! cache warm.

mod client;
mod load;
mod plot;
mod prompts;
mod report;

use crate::model_ref;
use anyhow::{bail, Context, Result};
use client::Server;
use load::Outcome;
use plot::{Chart, Series};
use prompts::{BenchRequest, Lengths};
use report::Report;
use runtime::sampling::SplitMix64;
use serde::Serialize;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// A fixed number of requests in flight (InferenceX's concurrency).
    Concurrency,
    /// The concurrency runs over a grid (default: ISL 1024 and 8192, OSL 1024, C 1/4/16/64).
    Sweep,
    /// Requests admitted at `--request-rate` a second (Poisson arrivals) for `--duration`.
    Rate,
    /// `--bursts` bursts of `--burst-size` requests at once, `--burst-interval` apart.
    Burst,
}

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
    #[arg(long, value_enum, default_value = "concurrency")]
    pub mode: Mode,
    /// Input (prompt) lengths in tokens, ISL, comma-separated (default 1024; sweep: 1024,8192).
    #[arg(long, value_delimiter = ',')]
    pub input_len: Vec<usize>,
    /// Output lengths in tokens, OSL, comma-separated (default 1024).
    #[arg(long, value_delimiter = ',')]
    pub output_len: Vec<usize>,
    /// Lengths are drawn from [ratio·LEN, LEN].
    #[arg(long, default_value_t = 0.8)]
    pub range_ratio: f64,
    /// Requests in flight at once, comma-separated (default 1; sweep: 1,4,16,64).
    #[arg(long, value_delimiter = ',')]
    pub concurrency: Vec<usize>,
    /// Measured requests of a concurrency run (default: 10 × its concurrency).
    #[arg(long)]
    pub num_prompts: Option<usize>,
    /// Unmeasured requests before each run (default: 2 × its concurrency; 2 for rate and burst).
    #[arg(long)]
    pub warmups: Option<usize>,
    /// Rate mode: requests a second.
    #[arg(long)]
    pub request_rate: Option<f64>,
    /// Rate mode: seconds of admission.
    #[arg(long, default_value_t = 60.0)]
    pub duration: f64,
    /// Burst mode: requests a burst.
    #[arg(long, default_value_t = 16)]
    pub burst_size: usize,
    /// Burst mode: bursts.
    #[arg(long, default_value_t = 4)]
    pub bursts: usize,
    /// Burst mode: seconds between bursts.
    #[arg(long, default_value_t = 10.0)]
    pub burst_interval: f64,
    #[arg(long)]
    pub api_key: Option<String>,
    /// Seeds the prompts, lengths and arrivals: the same seed, the same requests (default: a
    /// fresh one, printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Sampling temperature of every request (0, InferenceX's, is greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// `top_p` of every request (1 keeps every token).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// `top_k` of every request (0 keeps every token).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Also write the runs as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Also draw them as SVG here: output throughput against interactivity (concurrency,
    /// sweep), or each request's latencies against when it was sent (rate, burst).
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// How one run sends its requests.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "load", rename_all = "snake_case")]
pub enum Load {
    Concurrency {
        concurrency: usize,
    },
    Rate {
        request_rate: f64,
        duration_s: f64,
    },
    Burst {
        burst_size: usize,
        bursts: usize,
        interval_s: f64,
    },
}

/// One measured run: its workload and what it measured.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    pub input_len: usize,
    pub output_len: usize,
    #[serde(flatten)]
    pub load: Load,
    #[serde(flatten)]
    pub report: Report,
}

pub fn bench(args: &BenchArgs) -> Result<()> {
    let (input_lens, output_lens, concurrencies) = grid(args)?;
    let loads = loads(args, &concurrencies)?;
    if !(0.0..=1.0).contains(&args.range_ratio) {
        bail!("--range-ratio must be within [0, 1], got {}", args.range_ratio);
    }
    if !(args.temperature >= 0.0 && args.top_p > 0.0 && args.top_p <= 1.0) {
        bail!("--temperature must be at least 0 and --top-p within (0, 1]");
    }
    let server = Server::parse(&args.url, args.api_key.clone())?;
    let seed = args.seed.unwrap_or_else(fresh_seed);
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
    eprintln!("bench: seed {seed} (`--seed {seed}` sends the same requests again)");
    let mut workloads: Vec<(usize, usize, Load)> = Vec::new();
    for &input_len in &input_lens {
        for &output_len in &output_lens {
            workloads.extend(loads.iter().map(|&load| (input_len, output_len, load)));
        }
    }
    let mut runs = Vec::new();
    for (index, &(input_len, output_len, load)) in workloads.iter().enumerate() {
        // Each run draws its own prompts, so none finds another's in the prefix cache.
        let mut rng = SplitMix64(seed ^ (index as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
        let run_seed = rng.next_u64();
        let lengths = Lengths {
            input: input_len,
            output: output_len,
            range_ratio: args.range_ratio,
        };
        let (warmups, measured, arrivals) = match load {
            Load::Concurrency { concurrency } => (
                args.warmups.unwrap_or(2 * concurrency),
                args.num_prompts.unwrap_or(10 * concurrency),
                None,
            ),
            Load::Rate {
                request_rate,
                duration_s,
            } => {
                let arrivals = load::poisson_arrivals(request_rate, Duration::from_secs_f64(duration_s), &mut rng);
                (args.warmups.unwrap_or(2), arrivals.len(), Some(arrivals))
            }
            Load::Burst {
                burst_size,
                bursts,
                interval_s,
            } => {
                let arrivals = load::burst_arrivals(burst_size, bursts, Duration::from_secs_f64(interval_s));
                (args.warmups.unwrap_or(2), arrivals.len(), Some(arrivals))
            }
        };
        let mut requests = prompts::random_requests(&tokenizer, warmups + measured, lengths, run_seed)?;
        let measured_requests = requests.split_off(warmups);
        let path = match args.endpoint.as_str() {
            "chat" => "/v1/chat/completions",
            _ => "/v1/completions",
        };
        let bodies = |rs: &[BenchRequest]| rs.iter().map(|r| body(args, &model, r)).collect::<Vec<_>>();
        eprintln!(
            "bench: {warmups} warm-up + {measured} requests to {}{path}, ISL {input_len} OSL {output_len}, {}",
            server.address,
            describe(load)
        );
        let warmup_concurrency = match load {
            Load::Concurrency { concurrency } => concurrency,
            _ => 1,
        };
        runtime.block_on(load::closed_loop(&server, path, bodies(&requests), warmup_concurrency));
        let speculation = || {
            let page = runtime.block_on(server.get_text("/metrics")).ok()?;
            report::Speculation::counters(&page)
        };
        let before = speculation();
        let (outcomes, wall): (Vec<Outcome>, Duration) = match (&arrivals, load) {
            (Some(arrivals), _) => {
                runtime.block_on(load::open_loop(&server, path, bodies(&measured_requests), arrivals))
            }
            (None, Load::Concurrency { concurrency }) => runtime.block_on(load::closed_loop(
                &server,
                path,
                bodies(&measured_requests),
                concurrency,
            )),
            (None, _) => unreachable!("rate and burst runs have arrivals"),
        };
        let mut report = Report::new(&outcomes, wall);
        report.speculation = before
            .zip(speculation())
            .and_then(|(b, a)| report::Speculation::between(b, a));
        let run = Run {
            input_len,
            output_len,
            load,
            report,
        };
        println!("ISL {input_len}, OSL {output_len}, {}", describe(load));
        print!("{}", run.report);
        runs.push(run);
    }
    if let Some(path) = &args.json {
        let document = json!({ "mode": args.mode, "seed": seed, "runs": runs });
        std::fs::write(path, serde_json::to_string_pretty(&document)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.plot {
        std::fs::write(path, chart(args.mode, &runs).to_svg())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let failed: Vec<&Run> = runs.iter().filter(|r| !r.report.acceptable()).collect();
    if let Some(run) = failed.first() {
        bail!(
            "{} of {} requests failed (over 5%) in the run of ISL {}, OSL {}, {}",
            run.report.failed,
            run.report.failed + run.report.completed,
            run.input_len,
            run.output_len,
            describe(run.load)
        );
    }
    Ok(())
}

/// The lengths and concurrencies to run: the flags', else the mode's defaults.
fn grid(args: &BenchArgs) -> Result<(Vec<usize>, Vec<usize>, Vec<usize>)> {
    let or = |given: &Vec<usize>, default: &[usize]| match given.is_empty() {
        true => default.to_vec(),
        false => given.clone(),
    };
    let sweep = args.mode == Mode::Sweep;
    let input = or(&args.input_len, if sweep { &[1024, 8192] } else { &[1024] });
    let output = or(&args.output_len, &[1024]);
    let concurrency = or(&args.concurrency, if sweep { &[1, 4, 16, 64] } else { &[1] });
    if [&input, &output, &concurrency].iter().any(|v| v.contains(&0)) {
        bail!("--concurrency, --input-len and --output-len must be at least 1");
    }
    Ok((input, output, concurrency))
}

/// How each run of the mode sends its requests.
fn loads(args: &BenchArgs, concurrencies: &[usize]) -> Result<Vec<Load>> {
    let positive = |v: f64, flag: &str| match v.is_finite() && v > 0.0 {
        true => Ok(v),
        false => bail!("{flag} must be a positive number of seconds or requests, got {v}"),
    };
    Ok(match args.mode {
        Mode::Concurrency | Mode::Sweep => concurrencies
            .iter()
            .map(|&concurrency| Load::Concurrency { concurrency })
            .collect(),
        Mode::Rate => vec![Load::Rate {
            request_rate: positive(
                args.request_rate.context("--mode rate needs --request-rate")?,
                "--request-rate",
            )?,
            duration_s: positive(args.duration, "--duration")?,
        }],
        Mode::Burst => {
            if args.burst_size == 0 || args.bursts == 0 {
                bail!("--burst-size and --bursts must be at least 1");
            }
            vec![Load::Burst {
                burst_size: args.burst_size,
                bursts: args.bursts,
                interval_s: positive(args.burst_interval, "--burst-interval")?,
            }]
        }
    })
}

fn describe(load: Load) -> String {
    match load {
        Load::Concurrency { concurrency } => format!("concurrency {concurrency}"),
        Load::Rate {
            request_rate,
            duration_s,
        } => format!("{request_rate} requests/s for {duration_s} s"),
        Load::Burst {
            burst_size,
            bursts,
            interval_s,
        } => format!("{bursts} bursts of {burst_size}, {interval_s} s apart"),
    }
}

/// A seed no earlier run used: the clock's nanoseconds and the process id, mixed.
fn fresh_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    SplitMix64(nanos ^ ((std::process::id() as u64) << 32)).next_u64()
}

/// The chart of the runs: throughput against interactivity, a series per (ISL, OSL) with a
/// point per concurrency, for closed-loop runs; each request's TTFT and end-to-end latency
/// against when it was sent, for open-loop ones.
fn chart(mode: Mode, runs: &[Run]) -> Chart {
    match mode {
        Mode::Concurrency | Mode::Sweep => {
            let mut series: Vec<Series> = Vec::new();
            for run in runs {
                let name = format!("ISL {} / OSL {}", run.input_len, run.output_len);
                if series.last().is_none_or(|s| s.name != name) {
                    series.push(Series {
                        name,
                        points: Vec::new(),
                        labels: Vec::new(),
                        joined: true,
                    });
                }
                let s = series.last_mut().expect("just pushed");
                s.points
                    .push((run.report.interactivity(), run.report.output_throughput));
                if let Load::Concurrency { concurrency } = run.load {
                    s.labels.push(format!("C{concurrency}"));
                }
            }
            Chart {
                title: "Output throughput against interactivity".into(),
                x_label: "interactivity (tok/s per request: 1000 / mean TPOT ms)".into(),
                y_label: "output throughput (tok/s)".into(),
                series,
            }
        }
        Mode::Rate | Mode::Burst => {
            let latency = |name: String, pick: fn(&report::RequestTiming) -> Option<f64>, run: &Run| Series {
                name,
                points: run
                    .report
                    .requests
                    .iter()
                    .filter_map(|r| Some((r.sent_s, pick(r)?)))
                    .collect(),
                labels: Vec::new(),
                joined: false,
            };
            let series = runs
                .iter()
                .flat_map(|run| {
                    let suffix = match runs.len() {
                        1 => String::new(),
                        _ => format!(" (ISL {}, OSL {})", run.input_len, run.output_len),
                    };
                    [
                        latency(format!("TTFT{suffix}"), |r| r.ttft_ms, run),
                        latency(format!("E2EL{suffix}"), |r| r.e2el_ms, run),
                    ]
                })
                .collect();
            Chart {
                title: "Latency over time".into(),
                x_label: "sent at (s from the start)".into(),
                y_label: "latency (ms)".into(),
                series,
            }
        }
    }
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

/// One streamed, greedy completion of `max_tokens` for `prompt` from the server at `url` (its
/// first listed model): the time to its first token and to its end.
pub fn one_completion(url: &str, prompt: &str, max_tokens: usize) -> Result<(Duration, Duration)> {
    let server = Server::parse(url, None)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let model = first_model(&server).await?;
        let body = json!({
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": true,
            "stream_options": {"include_usage": true},
            "ignore_eos": true,
        });
        let measured = server.stream("/v1/completions", &body).await?;
        Ok((measured.ttft, measured.e2e))
    })
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
