//! bbc's HTTP server: OpenAI's completions, chat and Responses APIs and Anthropic's Messages
//! API over the serving engine. One thread owns the engine (`worker`); axum handlers (`http`)
//! parse (`request`, `responses_request`, `anthropic_request`) and admit a request, follow its
//! sequences (`generation`, detokenizing with `text`) and answer in the API's format
//! (`completions_output`, `responses_output`, `anthropic_output`), reporting through
//! `metrics` and `error`. Structured outputs compile with llguidance (`grammar`,
//! `structured`); tool calls and reasoning are read out of the answer (`tool_parser`,
//! `reasoning`). Loading a model and building its backend is the caller's (`bbc serve`).

pub mod answer_parts;
pub mod anthropic_output;
pub mod anthropic_request;
pub mod completions_output;
pub mod error;
pub mod generation;
pub mod grammar;
pub mod http;
pub mod logits;
pub mod messages;
pub mod metrics;
pub mod output_spec;
pub mod reasoning;
pub mod request;
pub mod responses_output;
pub mod responses_request;
pub mod special_tokens;
pub mod structured;
pub mod text;
pub mod tool_parser;
pub mod tools;
pub mod worker;

use anyhow::{Context, Result};
use runtime::serving::{SchedulerConfig, ServingEngine};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// Where requests go to the engine thread, and where it takes them.
pub fn request_channel() -> (
    tokio::sync::mpsc::UnboundedSender<worker::NewRequest>,
    tokio::sync::mpsc::UnboundedReceiver<worker::NewRequest>,
) {
    tokio::sync::mpsc::unbounded_channel()
}

/// What the engine starts with besides its backend.
pub struct EngineSetup {
    pub config: SchedulerConfig,
    pub policy: runtime::serving::SchedulingPolicy,
    /// A drafter other than prompt lookup (a draft model, multi-token prediction layers), with
    /// words to say it by ("the draft model …").
    pub drafter: Option<(String, Box<dyn runtime::serving::Drafter>)>,
    /// Draft only while at most this many sequences run (vLLM's `disable_by_batch_size`).
    pub speculate_up_to: Option<usize>,
    /// Where the server's requests come in.
    pub inbox: tokio::sync::mpsc::UnboundedReceiver<worker::NewRequest>,
    pub metrics: Arc<metrics::Metrics>,
}

/// Run an engine over `backend` on its own thread, taking requests from `setup.inbox`; say
/// whether it drafts (the engine turns off speculation its backend cannot verify).
pub fn start_engine<B>(backend: B, setup: EngineSetup) -> Result<()>
where
    B: runtime::serving::PagedBackend + Send + 'static,
    B::Pages: Send,
{
    let EngineSetup {
        config,
        policy,
        drafter,
        speculate_up_to,
        inbox,
        metrics,
    } = setup;
    let mut engine = ServingEngine::new(backend, config);
    engine.set_scheduling_policy(policy);
    if let Some(sequences) = speculate_up_to {
        engine.speculate_up_to(sequences);
    }
    let on = engine.scheduler().config().speculation;
    let draft_model = drafter.and_then(|(name, drafter)| engine.use_drafter(drafter).then_some(name));
    match (config.speculation.is_on(), on.is_on()) {
        (_, true) => {
            match draft_model {
                Some(name) => eprintln!(
                    "speculative decoding: drafts from {name}, up to {} drafted tokens a step",
                    on.tokens
                ),
                None => eprintln!(
                    "speculative decoding: prompt lookup, up to {} drafted tokens a step (matches of {}..={} tokens)",
                    on.tokens, on.min, on.max
                ),
            }
            if let Some(sequences) = speculate_up_to {
                eprintln!("speculative decoding pauses while more than {sequences} sequences run");
            }
        }
        (true, false) => eprintln!(
            "speculative decoding is off: this plan cannot verify drafted tokens (it was compiled before its kernels sampled several rows, or, for a model with recurrent state, kept the states to rewind drafts to: compile it again)"
        ),
        (false, false) => {}
    }
    let used = engine.scheduler().config();
    if used.recurrent_state && used.state_cache.capacity == 0 {
        eprintln!("prefix cache: off, this model's recurrent state is not snapshotted (--state-snapshots 0)");
    }
    std::thread::Builder::new()
        .name("bbc-engine".into())
        .spawn(move || worker::run(engine, inbox, metrics))
        .context("starting the engine thread")?;
    Ok(())
}

/// What the server answers with, besides its engine.
pub struct ServerOptions {
    /// The model id clients send.
    pub model_name: String,
    pub tokenizer: Arc<models::Tokenizer>,
    pub context_length: usize,
    pub api_key: Option<String>,
    /// Where chat responses split reasoning from the answer.
    pub reasoning: Option<reasoning::Markers>,
    /// The format `tool_choice` auto reads the model's calls in; none refuses it.
    pub tool_calls: Option<tool_parser::CallFormat>,
    /// The sampling settings requests that leave them out get.
    pub generation_defaults: models::GenerationDefaults,
    /// Whether requests wait in order of their `priority`.
    pub priority_scheduling: bool,
    /// Where the seeds of requests that give none come from (vLLM's `--seed`).
    pub seed: u64,
}

/// Serve HTTP on `address` (`host:port`; port 0 picks one, printed) until interrupted,
/// submitting requests to the engine through `requests`.
pub fn listen(
    address: &str,
    options: ServerOptions,
    requests: tokio::sync::mpsc::UnboundedSender<worker::NewRequest>,
    metrics: Arc<metrics::Metrics>,
) -> Result<()> {
    let tokenizer = options.tokenizer;
    let state = Arc::new(http::AppState {
        model_name: options.model_name,
        structured: structured::LazyStructuredOutputs::new(tokenizer.clone()),
        silent_special_tokens: Arc::new(special_tokens::silent(&tokenizer)),
        tokenizer,
        context_length: options.context_length,
        api_key: options.api_key,
        reasoning: options.reasoning,
        tool_calls: options.tool_calls,
        generation_defaults: options.generation_defaults,
        priority_scheduling: options.priority_scheduling,
        seeds: request::RequestSeeds::new(options.seed),
        requests,
        metrics,
        next_id: AtomicU64::new(0),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    // The grammar compiler for the vocabulary is built while the first requests come.
    let warming = state.clone();
    runtime.spawn(async move {
        let _ = warming.structured.get().await;
    });
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(address)
            .await
            .with_context(|| format!("binding {address}"))?;
        let bound = listener.local_addr()?;
        eprintln!("serving `{}` on http://{bound}", state.model_name);
        axum::serve(listener, http::router(state))
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
            .context("serving HTTP")
    })
}
