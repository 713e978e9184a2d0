//! The HTTP surface: routes, authentication, and admitting a request: validate, tokenize,
//! check its length and submit its sequences to the engine thread. What happens next is
//! `generation`'s (events to outputs) and `completions_output`'s (outputs to OpenAI's
//! completions and chat formats).

use super::completions_output::{self, json_response, unix_time};
use super::error::ApiError;
use super::generation::{Generation, PromptReport, RequestInfo, RequestPrompt};
use super::logits::Processing;
use super::metrics::Metrics;
use super::reasoning::Markers;
use super::request::{self, ChatEnding, Endpoint, GenerationRequest, PromptInput};
use super::structured::LazyStructuredOutputs;
use super::tool_parser::CallFormat;
use super::tools::ToolCalling;
use super::worker::{Event, NewRequest};
use super::{anthropic_output, anthropic_request, responses_output, responses_request};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use models::Tokenizer;
use runtime::serving::AddError;
use runtime::SamplingParams;
use serde_json::json;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};

pub struct AppState {
    pub model_name: String,
    pub tokenizer: Arc<Tokenizer>,
    pub context_length: usize,
    pub api_key: Option<String>,
    /// Where chat responses split reasoning from the answer (`crate::reasoning`).
    pub reasoning: Option<Markers>,
    /// The format `tool_choice` auto reads the model's calls in (`crate::tool_parser`); none
    /// refuses it.
    pub tool_calls: Option<CallFormat>,
    /// The grammar compiler over the model's vocabulary (structured outputs).
    pub structured: LazyStructuredOutputs,
    /// The sampling settings requests that leave them out get (`--generation-config`).
    pub generation_defaults: models::GenerationDefaults,
    /// Whether requests wait in order of their `priority` (`--scheduling-policy priority`).
    pub priority_scheduling: bool,
    /// The seeds of requests that give none (`--seed`).
    pub seeds: crate::request::RequestSeeds,
    /// The special tokens `skip_special_tokens` keeps out of output text.
    pub silent_special_tokens: Arc<std::collections::HashSet<u32>>,
    pub requests: mpsc::UnboundedSender<NewRequest>,
    pub metrics: Arc<Metrics>,
    pub next_id: AtomicU64,
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        // vLLM's: load balancers' liveness probe (SageMaker's), and the server's version.
        .route("/ping", get(|| async { "ok" }).post(|| async { "ok" }))
        .route("/version", get(version))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(list_models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(responses))
        .route("/v1/messages", post(anthropic_messages))
        .route("/v1/messages/count_tokens", post(anthropic_count_tokens))
        .route("/tokenize", post(tokenize_prompt))
        .route("/detokenize", post(detokenize))
        .with_state(state)
}

async fn version() -> Response {
    let body = serde_json::json!({"version": env!("CARGO_PKG_VERSION")}).to_string();
    ([("content-type", "application/json")], body).into_response()
}

async fn metrics(State(app): State<Arc<AppState>>) -> Response {
    ([("content-type", "text/plain; version=0.0.4")], app.metrics.render()).into_response()
}

async fn list_models(State(app): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&app, &headers) {
        return e.into_response();
    }
    let model = json!({
        "id": app.model_name, "object": "model", "created": unix_time(), "owned_by": "bbc",
        "max_model_len": app.context_length,
    });
    json_response(json!({ "object": "list", "data": [model] }))
}

async fn completions(State(app): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    answer(app, headers, body, Endpoint::Completions).await
}

async fn chat_completions(State(app): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    answer(app, headers, body, Endpoint::Chat).await
}

/// OpenAI's Responses API: the chat pipeline behind its request and output formats.
async fn responses(State(app): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let response = match start_response(&app, &headers, &body).await {
        Ok((generation, echo)) if generation.info.stream => responses_output::stream(generation, echo).into_response(),
        Ok((generation, echo)) => responses_output::complete(generation, echo).await,
        Err(e) => e.into_response(),
    };
    app.metrics.count_request(response.status().as_u16());
    response
}

/// A Responses request admitted, and the settings its response echoes.
async fn start_response(
    app: &Arc<AppState>,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(Generation, serde_json::Map<String, serde_json::Value>), ApiError> {
    let started = Instant::now();
    authorize(app, headers)?;
    let obj = request::json_object(body)?;
    let generation = admit(app, responses_request::parse(&obj)?, Endpoint::Chat, started).await?;
    Ok((generation, responses_output::echo(&obj)))
}

/// Anthropic's Messages API: the chat pipeline behind its request and output formats, errors
/// in its shape.
async fn anthropic_messages(State(app): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let started = Instant::now();
    let admitted = match authorize(&app, &headers)
        .and_then(|()| request::json_object(&body))
        .and_then(|obj| anthropic_request::parse(&obj))
    {
        Ok(request) => admit(&app, request, Endpoint::Chat, started).await,
        Err(e) => Err(e),
    };
    let response = match admitted {
        Ok(generation) if generation.info.stream => anthropic_output::stream(generation).into_response(),
        Ok(generation) => anthropic_output::complete(generation).await,
        Err(e) => anthropic_output::error_response(e),
    };
    app.metrics.count_request(response.status().as_u16());
    response
}

/// Anthropic's token count of a Messages body: the tokens its rendered chat prompt runs as.
async fn anthropic_count_tokens(State(app): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let counted = authorize(&app, &headers).and_then(|()| {
        let mut obj = request::json_object(&body)?;
        // The count needs no answer: `max_tokens` may be left out.
        obj.entry("max_tokens").or_insert(json!(1));
        tokenize(&app.tokenizer, &anthropic_request::parse(&obj)?)
    });
    match counted {
        Ok((ids, _)) => json_response(json!({ "input_tokens": ids.len() })),
        Err(e) => anthropic_output::error_response(e),
    }
}

async fn answer(app: Arc<AppState>, headers: HeaderMap, body: Bytes, endpoint: Endpoint) -> Response {
    let response = match start(&app, &headers, &body, endpoint).await {
        Ok(generation) if generation.info.stream => completions_output::stream(generation).into_response(),
        Ok(generation) => completions_output::complete(generation).await,
        Err(e) => e.into_response(),
    };
    app.metrics.count_request(response.status().as_u16());
    response
}

/// vLLM's `/tokenize`: the ids a completion's `prompt` or a chat's `messages` (the template
/// rendered, with `tools` and `chat_template_kwargs`) would run as.
async fn tokenize_prompt(State(app): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let ids = authorize(&app, &headers).and_then(|()| {
        let obj = request::json_object(&body)?;
        let endpoint = match obj.contains_key("messages") {
            true => Endpoint::Chat,
            false => Endpoint::Completions,
        };
        tokenize(&app.tokenizer, &request::parse_object(&obj, endpoint)?)
    });
    match ids {
        Ok((ids, _)) => json_response(json!({"count": ids.len(), "max_model_len": app.context_length, "tokens": ids})),
        Err(e) => e.into_response(),
    }
}

/// vLLM's `/detokenize`: the text of `tokens`.
async fn detokenize(State(app): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let text = authorize(&app, &headers).and_then(|()| {
        let tokens = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v.get("tokens").cloned())
            .and_then(|t| serde_json::from_value::<Vec<u32>>(t).ok())
            .ok_or_else(|| ApiError::invalid("tokens", "`tokens` must be an array of token ids"))?;
        let vocab = app.tokenizer.vocab_size();
        if let Some(bad) = tokens.iter().find(|&&id| id as usize >= vocab) {
            return Err(ApiError::invalid(
                "tokens",
                format!("token id {bad} is outside the vocabulary"),
            ));
        }
        app.tokenizer
            .decode(&tokens)
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
    });
    match text {
        Ok(text) => json_response(json!({ "prompt": text })),
        Err(e) => e.into_response(),
    }
}

fn authorize(app: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &app.api_key else { return Ok(()) };
    // OpenAI's clients send a bearer token, Anthropic's an `x-api-key` header.
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let given = header("authorization")
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| header("x-api-key"));
    match given {
        Some(g) if g == key => Ok(()),
        _ => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)",
        )),
    }
}

/// Validate, tokenize and submit a request; the admitted generation.
async fn start(
    app: &Arc<AppState>,
    headers: &HeaderMap,
    body: &[u8],
    endpoint: Endpoint,
) -> Result<Generation, ApiError> {
    let started = Instant::now();
    authorize(app, headers)?;
    admit(app, request::parse(body, endpoint)?, endpoint, started).await
}

/// Submit a parsed request (its model checked, its prompt tokenized and its length checked);
/// the admitted generation.
async fn admit(
    app: &Arc<AppState>,
    mut request: GenerationRequest,
    endpoint: Endpoint,
    started: Instant,
) -> Result<Generation, ApiError> {
    request.fill_unset(&app.generation_defaults);
    if request.unset.seed {
        request.sampling.seed = app.seeds.next();
    }
    if request.priority != 0 && !app.priority_scheduling {
        return Err(ApiError::invalid(
            "priority",
            format!(
                "Got priority {} but Priority scheduling is not enabled (start bbc serve with --scheduling-policy priority).",
                request.priority
            ),
        ));
    }
    if let Some(model) = &request.model {
        if model != &app.model_name {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "The model `{model}` does not exist; this server serves `{}`.",
                    app.model_name
                ),
            ));
        }
    }
    let auto_calls = matches!(
        request.tools.as_ref().and_then(|t| t.calling.as_ref()),
        Some(ToolCalling::Auto { .. })
    );
    if auto_calls && app.tool_calls.is_none() {
        return Err(ApiError::invalid(
            "tool_choice",
            "`tool_choice` auto (the default where `tools` are given) reads calls in the model's own format, and this model's chat template writes none bbc knows: start `bbc serve` with `--tool-call-parser`, or ask for `required` or a named function",
        ));
    }
    let mut tokenized = request
        .prompts
        .iter()
        .map(|prompt| tokenize_prompt_input(&app.tokenizer, prompt, &request))
        .collect::<Result<Vec<_>, _>>()?;
    // Prompts cut to their last tokens (whose echo is then the text those tokens make).
    let mut truncated = vec![false; tokenized.len()];
    if let Some(truncation) = request.truncate_prompt {
        for ((ids, _), cut) in tokenized.iter_mut().zip(&mut truncated) {
            *cut = truncation.apply(ids, app.context_length)?;
        }
    }
    // Chat answers only (one prompt): completions return the text as the model wrote it.
    let reasoning = match (endpoint, tokenized.as_slice()) {
        (Endpoint::Chat, [(_, Some(rendered))]) => {
            app.reasoning.map(|m| (m, starts_in_reasoning(m, rendered, &request)))
        }
        _ => None,
    };
    let max_tokens = tokenized
        .iter()
        .zip(&request.prompts)
        .map(|((ids, _), given)| check_length(app.context_length, ids.len(), &request, given))
        .collect::<Result<Vec<_>, _>>()?;
    let mut stop_tokens = request.stop_token_ids.clone();
    if !request.ignore_eos {
        stop_tokens.extend(&app.tokenizer.eos);
    }
    let processing = Processing::of(&request, &app.tokenizer, &app.structured, &stop_tokens, reasoning).await?;
    let prompts_and_lengths: Vec<(&[u32], usize)> = tokenized
        .iter()
        .map(|(ids, _)| ids.as_slice())
        .zip(max_tokens)
        .collect();
    let events = submit_choices(app, &request, &prompts_and_lengths, &stop_tokens, &processing).await?;
    let prompt_tokens = tokenized.iter().map(|(ids, _)| ids.len()).sum();
    app.metrics.prompt_tokens.fetch_add(prompt_tokens as u64, Relaxed);
    let prefix = match endpoint {
        Endpoint::Completions => "cmpl",
        Endpoint::Chat => "chatcmpl",
    };
    let prompts = tokenized
        .into_iter()
        .zip(&request.prompts)
        .zip(truncated)
        .map(|(((ids, _), given), truncated)| RequestPrompt {
            echo: request.echo.then(|| match truncated {
                true => app.tokenizer.decode(&ids).unwrap_or_default(),
                false => echo_text(&app.tokenizer, given, &ids),
            }),
            ids,
        })
        .collect();
    let info = RequestInfo {
        app: app.clone(),
        id: format!("{prefix}-{}", app.next_id.fetch_add(1, Relaxed)),
        created: unix_time(),
        endpoint,
        stream: request.stream,
        include_usage: request.include_usage,
        continuous_usage: request.continuous_usage,
        skip_special_tokens: request.skip_special_tokens,
        logprobs: request.sampling.logprobs,
        return_token_ids: request.return_token_ids,
        tokens_as_ids: request.return_tokens_as_token_ids,
        prompt: PromptReport {
            prompts,
            choices_each: request.n,
            echo_only: request.echo && request.max_tokens == Some(0),
            logprobs: request.prompt_logprobs,
        },
        stop_strings: request.stop,
        include_stop_str: request.include_stop_str,
        min_tokens: request.min_tokens,
        stop_tokens,
        prompt_tokens,
        reasoning,
        tool_calling: request.tools.and_then(|t| t.calling),
        started,
    };
    Ok(Generation::new(info, events))
}

/// Submit each prompt's `n` choices (`n` sequences, seeded apart) with the number of tokens
/// to generate for it; their event channels, in choice order, once all are admitted (or an
/// error, and none is kept: dropping a receiver aborts its sequence).
async fn submit_choices(
    app: &AppState,
    request: &GenerationRequest,
    prompts: &[(&[u32], usize)],
    stop_tokens: &[u32],
    processing: &Processing,
) -> Result<Vec<mpsc::UnboundedReceiver<Event>>, ApiError> {
    let engine_gone = || ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the engine has stopped");
    let mut events = Vec::new();
    let mut admissions = Vec::new();
    for &(prompt, max_tokens) in prompts {
        for i in 0..request.n {
            let (events_tx, events_rx) = mpsc::unbounded_channel();
            let (admitted_tx, admitted_rx) = oneshot::channel();
            let sampling = SamplingParams {
                seed: request.sampling.seed.wrapping_add(i as u64),
                ..request.sampling
            };
            let submitted = NewRequest {
                prompt: prompt.to_vec(),
                // An echo of the prompt alone still has the engine take a token (dropped).
                max_tokens: max_tokens.max(1),
                stop_tokens: stop_tokens.to_vec(),
                sampling,
                processors: processing.for_sequence(),
                priority: request.priority,
                events: events_tx,
                admitted: admitted_tx,
            };
            app.requests.send(submitted).map_err(|_| engine_gone())?;
            events.push(events_rx);
            admissions.push(admitted_rx);
        }
    }
    let scored_for = match request.prompt_logprobs {
        Some(_) => "prompt_logprobs",
        None => "echo",
    };
    for admitted in admissions {
        admitted
            .await
            .map_err(|_| engine_gone())?
            .map_err(|e| admission_error(e, scored_for))?;
    }
    Ok(events)
}

/// The ids of a request that carries one prompt (what `/tokenize` and the token counts of
/// the other APIs take), and for chat messages the text the template rendered.
fn tokenize(tokenizer: &Tokenizer, request: &GenerationRequest) -> Result<(Vec<u32>, Option<String>), ApiError> {
    match request.prompts.as_slice() {
        [prompt] => tokenize_prompt_input(tokenizer, prompt, request),
        _ => Err(ApiError::invalid("prompt", "give one prompt to tokenize")),
    }
}

/// One of a request's prompts as ids (the request's tools and template variables apply to a
/// chat), and for chat messages the text the template rendered.
fn tokenize_prompt_input(
    tokenizer: &Tokenizer,
    prompt: &PromptInput,
    request: &GenerationRequest,
) -> Result<(Vec<u32>, Option<String>), ApiError> {
    let internal = |e: models::ModelError| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
    let mut rendered = None;
    let ids = match prompt {
        PromptInput::Ids(ids) => {
            // Once: the size is counted over a copy of the vocabulary (a 9000-id prompt took
            // minutes when it was asked per id).
            let vocab = tokenizer.vocab_size();
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("token id {bad} is outside the vocabulary"),
                ));
            }
            ids.clone()
        }
        PromptInput::Text(text) => tokenizer.encode(text, true).map_err(internal)?,
        PromptInput::Chat(messages) => {
            let template = tokenizer
                .chat_template
                .as_ref()
                .ok_or_else(|| ApiError::bad_request("this model has no chat template; use /v1/completions"))?;
            // The request's tools are the template's `tools`, as transformers passes them.
            let mut variables = request.chat_template_kwargs.clone();
            if let Some(tools) = &request.tools {
                variables.insert("tools".into(), serde_json::Value::Array(tools.definitions.clone()));
            }
            let text = match request.chat_ending {
                ChatEnding::NewTurn => template.render_with(messages, true, &variables),
                ChatEnding::AsRendered => template.render_with(messages, false, &variables),
                ChatEnding::ContinueFinalMessage => template.render_continuing(messages, &variables),
            }
            .map_err(|e| ApiError::invalid("messages", format!("the chat template refused the messages: {e}")))?;
            let text = rendered.insert(text);
            // The template writes BOS itself when the model wants it.
            tokenizer.encode(text, false).map_err(internal)?
        }
    };
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    Ok((ids, rendered))
}

/// Whether a chat answer begins inside the model's reasoning: the rendered prompt opened it
/// (a template that starts every answer thinking), or the answer being continued left it open.
fn starts_in_reasoning(markers: Markers, rendered: &str, request: &GenerationRequest) -> bool {
    let begun = match (request.chat_ending, request.prompts.as_slice()) {
        (ChatEnding::ContinueFinalMessage, [PromptInput::Chat(messages)]) => messages.last(),
        _ => None,
    };
    match begun {
        Some(message) => markers.left_open_by(&message.content),
        None => markers.opened_by(rendered),
    }
}

/// The text a completion's `echo` repeats: the prompt as given, or its ids' text.
fn echo_text(tokenizer: &Tokenizer, given: &PromptInput, ids: &[u32]) -> String {
    match given {
        PromptInput::Text(text) => text.clone(),
        PromptInput::Ids(_) | PromptInput::Chat(_) => tokenizer.decode(ids).unwrap_or_default(),
    }
}

/// The number of tokens to generate, or the context-length error vLLM gives.
fn check_length(
    context: usize,
    prompt: usize,
    request: &GenerationRequest,
    given: &PromptInput,
) -> Result<usize, ApiError> {
    let param = match given {
        PromptInput::Chat(_) => "messages",
        _ => "prompt",
    };
    if prompt >= context {
        return Err(ApiError::invalid(
            param,
            format!(
                "This model's maximum context length is {context} tokens. However, your request has {prompt} input tokens. Please reduce the length of the input messages."
            ),
        ));
    }
    let default = match given {
        PromptInput::Chat(_) => context - prompt,
        _ => 16.min(context - prompt),
    };
    let max_tokens = request.max_tokens.unwrap_or(default);
    if prompt + max_tokens > context {
        let name = if request.max_tokens.is_some() && matches!(given, PromptInput::Chat(_)) {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        return Err(ApiError::invalid(
            name,
            format!(
                "'{name}' is too large: {max_tokens}. This model's maximum context length is {context} tokens and your request has {prompt} input tokens ({max_tokens} > {context} - {prompt})."
            ),
        ));
    }
    // A model's longest answer caps a request's after the request is checked, as in vLLM.
    Ok(request.max_tokens_cap.map_or(max_tokens, |cap| max_tokens.min(cap)))
}

/// An admission's refusal as the API's error; `scored_for`: the parameter that asked for the
/// prompt's log-probabilities, where the backend cannot compute them.
fn admission_error(e: AddError, scored_for: &str) -> ApiError {
    match e {
        AddError::QueueFull(_) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        AddError::EmptyPrompt => ApiError::invalid("prompt", e.to_string()),
        AddError::TooLong { .. } => ApiError::invalid("max_tokens", e.to_string()),
        AddError::NeverFits { .. } => ApiError::invalid("max_tokens", e.to_string()),
        AddError::PromptLogprobsUnsupported => ApiError::invalid(scored_for, e.to_string()),
    }
}
