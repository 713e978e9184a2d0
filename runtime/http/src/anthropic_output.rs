//! Anthropic's Messages API wire format for a generation: a `message` whose `content` is a list
//! of blocks (`thinking`, `text`, a `tool_use` per call) with its `stop_reason`, or the events
//! that build it (`message_start`, per block `content_block_start`, its deltas and
//! `content_block_stop`, then `message_delta` with the stop reason and `message_stop`), both
//! from the answer's parts (`answer_parts`); and errors in Anthropic's shape.

use super::answer_parts::{self, EventSink, Part, PartRouter, PartSink};
use super::completions_output::json_response;
use super::error::ApiError;
use super::generation::Generation;
use super::tools::fresh_id;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;

/// The block being streamed.
struct Open {
    kind: BlockKind,
    text: String,
}

enum BlockKind {
    Thinking,
    Text,
    ToolUse { id: String, name: String },
}

/// Content blocks and events from a generation's parts.
struct Builder {
    id: String,
    model: String,
    blocks: Vec<Value>,
    open: Option<Open>,
    events: VecDeque<Value>,
    stop_reason: &'static str,
    stop_sequence: Option<String>,
}

impl Builder {
    fn new(g: &Generation) -> Self {
        Self {
            id: fresh_id("msg_"),
            model: g.info.app.model_name.clone(),
            blocks: Vec::new(),
            open: None,
            events: VecDeque::new(),
            stop_reason: "end_turn",
            stop_sequence: None,
        }
    }

    fn event(&mut self, kind: &str, mut fields: Value) {
        fields["type"] = json!(kind);
        self.events.push_back(fields);
    }

    fn message(&self, content: Value, stop_reason: Value, usage: Value) -> Value {
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": self.stop_sequence,
            "usage": usage,
        })
    }

    fn start(&mut self, input_tokens: usize) {
        let usage = json!({"input_tokens": input_tokens, "output_tokens": 0});
        let start = self.message(json!([]), Value::Null, usage);
        self.event("message_start", json!({ "message": start }));
    }
}

impl PartSink for Builder {
    fn open(&mut self, part: Part) {
        let kind = match part {
            Part::Reasoning => BlockKind::Thinking,
            Part::Text => BlockKind::Text,
            Part::Call { name } => BlockKind::ToolUse {
                id: fresh_id("toolu_"),
                name,
            },
        };
        let start = match &kind {
            BlockKind::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
            BlockKind::Text => json!({"type": "text", "text": ""}),
            BlockKind::ToolUse { id, name } => json!({"type": "tool_use", "id": id, "name": name, "input": {}}),
        };
        let index = self.blocks.len();
        self.event("content_block_start", json!({"index": index, "content_block": start}));
        self.open = Some(Open {
            kind,
            text: String::new(),
        });
    }

    fn append(&mut self, text: &str) {
        let open = self.open.as_mut().expect("an open block");
        open.text += text;
        let delta = match open.kind {
            BlockKind::Thinking => json!({"type": "thinking_delta", "thinking": text}),
            BlockKind::Text => json!({"type": "text_delta", "text": text}),
            BlockKind::ToolUse { .. } => json!({"type": "input_json_delta", "partial_json": text}),
        };
        let index = self.blocks.len();
        self.event("content_block_delta", json!({"index": index, "delta": delta}));
    }

    /// The open block done: kept, and its stop event.
    fn close(&mut self) {
        let Some(open) = self.open.take() else { return };
        let block = match open.kind {
            BlockKind::Thinking => json!({"type": "thinking", "thinking": open.text, "signature": ""}),
            BlockKind::Text => json!({"type": "text", "text": open.text}),
            BlockKind::ToolUse { id, name } => {
                // Arguments cut short (`max_tokens`) stay their text, as a string.
                let input = serde_json::from_str::<Value>(&open.text).unwrap_or(Value::String(open.text));
                json!({"type": "tool_use", "id": id, "name": name, "input": input})
            }
        };
        let index = self.blocks.len();
        self.blocks.push(block);
        self.event("content_block_stop", json!({ "index": index }));
    }

    fn finished(&mut self, reason: &'static str, stop_string: Option<String>) {
        let called = self.blocks.iter().any(|b| b["type"] == "tool_use");
        self.stop_reason = match (reason, &stop_string) {
            ("length", _) => "max_tokens",
            (_, Some(_)) => "stop_sequence",
            _ if called => "tool_use",
            _ => "end_turn",
        };
        self.stop_sequence = stop_string;
    }
}

impl EventSink for Builder {
    fn next_event(&mut self) -> Option<Value> {
        self.events.pop_front()
    }

    fn ended(&mut self, g: &Generation) {
        let delta = json!({"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence});
        let usage = json!({"output_tokens": g.completion_tokens()});
        self.event("message_delta", json!({"delta": delta, "usage": usage}));
        self.event("message_stop", json!({}));
    }

    fn failed(&mut self, message: String) {
        let error = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message);
        self.event("error", anthropic_body(&error));
    }
}

/// The whole message.
pub async fn complete(mut g: Generation) -> Response {
    let (mut router, mut b) = (PartRouter::new(&g), Builder::new(&g));
    while let Some(output) = g.next().await {
        if let Err(message) = router.take(&mut b, output, &g) {
            return error_response(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message));
        }
    }
    let usage = json!({"input_tokens": g.prompt_tokens(), "output_tokens": g.completion_tokens()});
    json_response(b.message(json!(b.blocks), json!(b.stop_reason), usage))
}

/// The message's events (`message_start` first); a failure mid-stream is an `error` event.
pub fn stream(g: Generation) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let mut b = Builder::new(&g);
    b.start(g.prompt_tokens());
    answer_parts::stream(g, b)
}

/// An error as Anthropic's API sends it: `{"type": "error", "error": {"type", "message"}}`.
fn anthropic_body(e: &ApiError) -> Value {
    let kind = match e.status {
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        s if s.is_server_error() => "api_error",
        _ => "invalid_request_error",
    };
    let message = match &e.param {
        Some(param) => format!("{param}: {}", e.message),
        None => e.message.clone(),
    };
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

pub fn error_response(e: ApiError) -> Response {
    (
        e.status,
        [("content-type", "application/json")],
        anthropic_body(&e).to_string(),
    )
        .into_response()
}
