//! The HTTP surface: routes, authentication, and turning a request into a stream of OpenAI
//! chunks or one response. The engine thread does the computing; handlers only tokenize,
//! validate, wait for events and format them.

use super::error::ApiError;
use super::metrics::Metrics;
use super::request::{self, Endpoint, GenerationRequest, PromptInput};
use super::text::TextOutput;
use super::worker::{Event, NewRequest};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use models::{ChatMessage, Tokenizer};
use runtime::serving::{AddError, FinishReason};
use runtime::TokenLogprobs;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, oneshot};

pub struct AppState {
    pub model_name: String,
    pub tokenizer: Arc<Tokenizer>,
    pub context_length: usize,
    pub api_key: Option<String>,
    pub requests: mpsc::UnboundedSender<NewRequest>,
    pub metrics: Arc<Metrics>,
    pub next_id: AtomicU64,
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(list_models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .with_state(state)
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

async fn answer(app: Arc<AppState>, headers: HeaderMap, body: Bytes, endpoint: Endpoint) -> Response {
    let response = match start(&app, &headers, &body, endpoint).await {
        Ok(generation) if generation.stream => stream(generation).into_response(),
        Ok(generation) => complete(generation).await,
        Err(e) => e.into_response(),
    };
    app.metrics.count_request(response.status().as_u16());
    response
}

fn authorize(app: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &app.api_key else { return Ok(()) };
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        Some(g) if g == key => Ok(()),
        _ => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "a valid API key is required (Authorization: Bearer KEY)",
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
    let request = request::parse(body, endpoint)?;
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
    let prompt = tokenize(&app.tokenizer, &request.prompt)?;
    let max_tokens = check_length(app.context_length, prompt.len(), &request)?;
    let mut stop_tokens = request.stop_token_ids.clone();
    if !request.ignore_eos {
        stop_tokens.extend(&app.tokenizer.eos);
    }
    let (events_tx, events) = mpsc::unbounded_channel();
    let (admitted_tx, admitted) = oneshot::channel();
    let submitted = NewRequest {
        prompt: prompt.clone(),
        max_tokens,
        stop_tokens: stop_tokens.clone(),
        sampling: request.sampling,
        events: events_tx,
        admitted: admitted_tx,
    };
    let engine_gone = || ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the engine has stopped");
    app.requests.send(submitted).map_err(|_| engine_gone())?;
    admitted.await.map_err(|_| engine_gone())?.map_err(admission_error)?;
    app.metrics.prompt_tokens.fetch_add(prompt.len() as u64, Relaxed);
    Ok(Generation {
        app: app.clone(),
        id: format!(
            "{}-{}",
            match endpoint {
                Endpoint::Completions => "cmpl",
                Endpoint::Chat => "chatcmpl",
            },
            app.next_id.fetch_add(1, Relaxed)
        ),
        created: unix_time(),
        endpoint,
        stream: request.stream,
        include_usage: request.include_usage,
        events,
        text: TextOutput::new(request.stop),
        stop_tokens,
        prompt_tokens: prompt.len(),
        completion_tokens: 0,
        started,
        first_token_at: None,
        pending: VecDeque::new(),
        done: false,
        want_logprobs: request.sampling.logprobs.is_some(),
        logprobs: Vec::new(),
        text_offset: 0,
    })
}

fn tokenize(tokenizer: &Tokenizer, prompt: &PromptInput) -> Result<Vec<u32>, ApiError> {
    let internal = |e: models::ModelError| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string());
    let ids = match prompt {
        PromptInput::Ids(ids) => {
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= tokenizer.vocab_size()) {
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
            let messages: Vec<ChatMessage> = messages.iter().map(|(r, c)| ChatMessage::new(r, c)).collect();
            let rendered = template
                .render(&messages, true)
                .map_err(|e| ApiError::invalid("messages", format!("the chat template refused the messages: {e}")))?;
            // The template writes BOS itself when the model wants it.
            tokenizer.encode(&rendered, false).map_err(internal)?
        }
    };
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    Ok(ids)
}

/// The number of tokens to generate, or the context-length error vLLM gives.
fn check_length(context: usize, prompt: usize, request: &GenerationRequest) -> Result<usize, ApiError> {
    let param = match request.prompt {
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
    let default = match request.prompt {
        PromptInput::Chat(_) => context - prompt,
        _ => 16.min(context - prompt),
    };
    let max_tokens = request.max_tokens.unwrap_or(default);
    if prompt + max_tokens > context {
        let name = if request.max_tokens.is_some() && matches!(request.prompt, PromptInput::Chat(_)) {
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
    Ok(max_tokens)
}

fn admission_error(e: AddError) -> ApiError {
    match e {
        AddError::QueueFull(_) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        AddError::EmptyPrompt => ApiError::invalid("prompt", e.to_string()),
        AddError::TooLong { .. } => ApiError::invalid("max_tokens", e.to_string()),
        AddError::NeverFits { .. } => ApiError::invalid("max_tokens", e.to_string()),
    }
}

fn unix_time() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// What a generation produces, before it is formatted for the wire.
enum Output {
    /// A piece of text, with the log-probabilities of the tokens consumed since the last piece
    /// (empty unless asked for).
    Text(String, Vec<(u32, TokenLogprobs)>),
    Finish(&'static str),
    Error(String),
}

/// One admitted request, from its events to the text a client sees.
struct Generation {
    app: Arc<AppState>,
    id: String,
    created: u64,
    endpoint: Endpoint,
    stream: bool,
    include_usage: bool,
    /// Dropping this aborts the sequence (the engine sees the channel closed).
    events: mpsc::UnboundedReceiver<Event>,
    text: TextOutput,
    stop_tokens: Vec<u32>,
    prompt_tokens: usize,
    completion_tokens: usize,
    started: Instant,
    first_token_at: Option<Instant>,
    pending: VecDeque<Output>,
    done: bool,
    want_logprobs: bool,
    /// Log-probabilities of tokens not yet attached to a piece of text.
    logprobs: Vec<(u32, TokenLogprobs)>,
    /// Characters of token text reported so far (completions' `text_offset`).
    text_offset: usize,
}

impl Generation {
    /// The next output; `None` once finished.
    async fn next(&mut self) -> Option<Output> {
        while self.pending.is_empty() && !self.done {
            let event = self.events.recv().await;
            self.handle(event);
        }
        self.pending.pop_front()
    }

    fn handle(&mut self, event: Option<Event>) {
        match event {
            Some(Event::Token(token, logprobs)) => {
                self.completion_tokens += 1;
                self.first_token_at.get_or_insert_with(Instant::now);
                if self.stop_tokens.contains(&token) {
                    return; // Finished(Stop) follows; the stop token is not text.
                }
                self.logprobs.extend(logprobs.map(|lp| (token, lp)));
                match self.text.push(&self.app.tokenizer, token) {
                    Ok(piece) => {
                        self.push_text(piece.text);
                        if piece.stopped {
                            self.finish("stop");
                        }
                    }
                    Err(e) => self.fail(format!("detokenizing: {e}")),
                }
            }
            Some(Event::Finished(reason)) => match self.text.finish(&self.app.tokenizer) {
                Ok(rest) => {
                    self.push_text(rest);
                    self.finish(match reason {
                        FinishReason::Stop => "stop",
                        FinishReason::Length => "length",
                    });
                }
                Err(e) => self.fail(format!("detokenizing: {e}")),
            },
            Some(Event::Failed(message)) => self.fail(message),
            None => self.fail("the engine dropped the request".into()),
        }
    }

    fn push_text(&mut self, text: String) {
        if !text.is_empty() {
            let logprobs = std::mem::take(&mut self.logprobs);
            self.pending.push_back(Output::Text(text, logprobs));
        }
    }

    fn finish(&mut self, reason: &'static str) {
        if !self.logprobs.is_empty() {
            // Tokens whose text was held back (a stop string's start, a partial character).
            let logprobs = std::mem::take(&mut self.logprobs);
            self.pending.push_back(Output::Text(String::new(), logprobs));
        }
        self.pending.push_back(Output::Finish(reason));
        self.end();
        let m = &self.app.metrics;
        let now = Instant::now();
        m.e2e.observe((now - self.started).as_secs_f64());
        if let Some(first) = self.first_token_at {
            m.ttft.observe((first - self.started).as_secs_f64());
            if self.completion_tokens > 1 {
                m.tpot
                    .observe((now - first).as_secs_f64() / (self.completion_tokens - 1) as f64);
            }
        }
    }

    fn fail(&mut self, message: String) {
        self.pending.push_back(Output::Error(message));
        self.end();
    }

    /// Stop listening: the engine aborts the sequence if it is still running (a stop string).
    fn end(&mut self) {
        self.done = true;
        self.events.close();
    }

    fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        })
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Chat, false) => "chat.completion",
        }
    }

    fn chunk(&self, choices: Value) -> Value {
        json!({
            "id": self.id, "object": self.object(true), "created": self.created,
            "model": self.app.model_name, "choices": choices,
        })
    }

    /// The `logprobs` of a choice in OpenAI's per-endpoint format; null when not asked for.
    fn logprobs_json(&mut self, entries: &[(u32, TokenLogprobs)]) -> Value {
        if !self.want_logprobs {
            return Value::Null;
        }
        let tokenizer = &self.app.tokenizer;
        let text = |id: u32| tokenizer.decode(&[id]).unwrap_or_default();
        match self.endpoint {
            Endpoint::Completions => {
                let mut offsets = Vec::new();
                for &(id, _) in entries {
                    offsets.push(self.text_offset);
                    self.text_offset += text(id).chars().count();
                }
                let top: Vec<Value> = entries
                    .iter()
                    .map(|(_, lp)| Value::Object(lp.top.iter().map(|&(id, p)| (text(id), json!(p))).collect()))
                    .collect();
                json!({
                    "tokens": entries.iter().map(|&(id, _)| text(id)).collect::<Vec<_>>(),
                    "token_logprobs": entries.iter().map(|(_, lp)| lp.logprob).collect::<Vec<_>>(),
                    "top_logprobs": top,
                    "text_offset": offsets,
                })
            }
            Endpoint::Chat => {
                let entry = |id: u32, logprob: f32| {
                    let t = text(id);
                    json!({ "token": t, "logprob": logprob, "bytes": t.as_bytes() })
                };
                let content: Vec<Value> = entries
                    .iter()
                    .map(|(id, lp)| {
                        let mut e = entry(*id, lp.logprob);
                        e["top_logprobs"] = lp.top.iter().map(|&(id, p)| entry(id, p)).collect();
                        e
                    })
                    .collect();
                json!({ "content": content })
            }
        }
    }

    /// One streamed choice carrying `text` and/or a finish reason.
    fn choice(&self, text: Option<&str>, finish: Option<&str>, first: bool, logprobs: Value) -> Value {
        match self.endpoint {
            Endpoint::Completions => json!([{
                "index": 0, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish,
            }]),
            Endpoint::Chat => {
                let delta = match (text, first) {
                    (Some(t), true) => json!({ "role": "assistant", "content": t }),
                    (Some(t), false) => json!({ "content": t }),
                    (None, _) => json!({}),
                };
                json!([{ "index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish }])
            }
        }
    }
}

/// Server-sent events: a chunk per text piece, a final chunk with the finish reason, the usage
/// chunk (`choices: []`) when asked for, then `[DONE]`. A failure mid-stream is an error event.
fn stream(generation: Generation) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let state = StreamState {
        generation,
        ready: VecDeque::new(),
        sent_text: false,
        ended: false,
    };
    let events = futures_util::stream::unfold(state, |mut s| async move {
        while s.ready.is_empty() && !s.ended {
            s.advance().await;
        }
        let data = s.ready.pop_front()?;
        Some((Ok(SseEvent::default().data(data)), s))
    });
    Sse::new(events)
}

struct StreamState {
    generation: Generation,
    /// `data:` payloads ready to send.
    ready: VecDeque<String>,
    sent_text: bool,
    ended: bool,
}

impl StreamState {
    async fn advance(&mut self) {
        let g = &mut self.generation;
        match g.next().await {
            Some(Output::Text(t, logprobs)) => {
                let logprobs = g.logprobs_json(&logprobs);
                let choice = g.choice(Some(&t), None, !self.sent_text, logprobs);
                self.ready.push_back(g.chunk(choice).to_string());
                self.sent_text = true;
            }
            Some(Output::Finish(reason)) => {
                let choice = g.choice(None, Some(reason), false, Value::Null);
                self.ready.push_back(g.chunk(choice).to_string());
                if g.include_usage {
                    let mut usage = g.chunk(json!([]));
                    usage["usage"] = g.usage();
                    self.ready.push_back(usage.to_string());
                }
                self.ready.push_back("[DONE]".into());
                self.ended = true;
            }
            Some(Output::Error(message)) => {
                let error = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message).body();
                self.ready.push_back(error.to_string());
                self.ready.push_back("[DONE]".into());
                self.ended = true;
            }
            None => self.ended = true,
        }
    }
}

/// A whole (non-streamed) response.
async fn complete(mut g: Generation) -> Response {
    let mut text = String::new();
    let mut finish = "length";
    let mut logprobs = Vec::new();
    while let Some(output) = g.next().await {
        match output {
            Output::Text(t, lp) => {
                text += &t;
                logprobs.extend(lp);
            }
            Output::Finish(reason) => finish = reason,
            Output::Error(message) => return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message).into_response(),
        }
    }
    let logprobs = g.logprobs_json(&logprobs);
    let choice = match g.endpoint {
        Endpoint::Completions => json!({ "index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish }),
        Endpoint::Chat => json!({
            "index": 0, "message": { "role": "assistant", "content": text }, "logprobs": logprobs,
            "finish_reason": finish,
        }),
    };
    let body = json!({
        "id": g.id, "object": g.object(false), "created": g.created, "model": g.app.model_name,
        "choices": [choice], "usage": g.usage(),
    });
    json_response(body)
}

fn json_response(body: Value) -> Response {
    ([("content-type", "application/json")], body.to_string()).into_response()
}
