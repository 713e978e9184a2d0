//! The Responses API's wire format for a generation: a `response` object whose `output` is a
//! list of items (the reasoning, the message, each function call), or the stream of events
//! that builds it (`response.created`, then for each item `response.output_item.added`, its
//! deltas and `…done` events, `response.output_item.done`, and `response.completed`). One
//! builder turns the answer's parts (`answer_parts`) into items and events for both.

use super::answer_parts::{self, EventSink, Part, PartRouter, PartSink};
use super::completions_output::{json_response, unix_time};
use super::error::ApiError;
use super::generation::Generation;
use super::tools::fresh_id;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use std::collections::VecDeque;
use std::convert::Infallible;

/// The item being streamed.
struct Open {
    kind: OpenKind,
    id: String,
    index: usize,
    text: String,
    /// A message's tokens' log-probabilities (where the request asks for them).
    logprobs: Vec<Value>,
}

enum OpenKind {
    Reasoning,
    Message,
    Call { call_id: String, name: String },
}

/// Items and events from a generation's parts.
struct Builder {
    /// The response without `output`, `status` and `usage`: its id, times and the request's
    /// settings echoed.
    head: Map<String, Value>,
    items: Vec<Value>,
    open: Option<Open>,
    events: VecDeque<Value>,
    sequence: u64,
    incomplete: bool,
}

impl Builder {
    fn new(g: &Generation, echo: Map<String, Value>) -> Self {
        let mut head = Map::new();
        head.insert("id".into(), json!(fresh_id("resp_")));
        head.insert("object".into(), json!("response"));
        head.insert("created_at".into(), json!(unix_time()));
        head.insert("model".into(), json!(g.info.app.model_name));
        head.insert("error".into(), Value::Null);
        head.extend(echo);
        Self {
            head,
            items: Vec::new(),
            open: None,
            events: VecDeque::new(),
            sequence: 0,
            incomplete: false,
        }
    }

    fn event(&mut self, kind: &str, mut fields: Value) {
        fields["type"] = json!(kind);
        fields["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        self.events.push_back(fields);
    }

    /// The response as it stands (`usage` once known).
    fn response(&self, usage: Option<Value>) -> Value {
        let status = match (&usage, self.incomplete) {
            (None, _) => "in_progress",
            (Some(_), true) => "incomplete",
            (Some(_), false) => "completed",
        };
        let mut r = Value::Object(self.head.clone());
        r["status"] = json!(status);
        r["output"] = json!(self.items);
        r["incomplete_details"] = match self.incomplete {
            true => json!({"reason": "max_output_tokens"}),
            false => Value::Null,
        };
        r["usage"] = usage.unwrap_or(Value::Null);
        r
    }

    fn start(&mut self) {
        let created = self.response(None);
        self.event("response.created", json!({ "response": created }));
        self.event("response.in_progress", json!({ "response": created }));
    }
}

impl PartSink for Builder {
    fn open(&mut self, part: Part) {
        let index = self.items.len();
        let (kind, id) = match part {
            Part::Reasoning => (OpenKind::Reasoning, fresh_id("rs_")),
            Part::Text => (OpenKind::Message, fresh_id("msg_")),
            Part::Call { name } => (
                OpenKind::Call {
                    call_id: fresh_id("call_"),
                    name,
                },
                fresh_id("fc_"),
            ),
        };
        let open = Open {
            kind,
            id,
            index,
            text: String::new(),
            logprobs: Vec::new(),
        };
        self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": item(&open, "in_progress")}),
        );
        if let OpenKind::Message = open.kind {
            self.event(
                "response.content_part.added",
                json!({"item_id": open.id, "output_index": index, "content_index": 0,
                       "part": {"type": "output_text", "text": "", "annotations": []}}),
            );
        }
        self.open = Some(open);
    }

    fn append(&mut self, text: &str) {
        self.append_answer(text, Vec::new());
    }

    fn append_answer(&mut self, text: &str, logprobs: Vec<Value>) {
        let open = self.open.as_mut().expect("an open item");
        open.text += text;
        open.logprobs.extend(logprobs.iter().cloned());
        let (id, index) = (open.id.clone(), open.index);
        let (kind, fields) = match open.kind {
            OpenKind::Reasoning => (
                "response.reasoning_text.delta",
                json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text}),
            ),
            OpenKind::Message => (
                "response.output_text.delta",
                json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text, "logprobs": logprobs}),
            ),
            OpenKind::Call { .. } => (
                "response.function_call_arguments.delta",
                json!({"item_id": id, "output_index": index, "delta": text}),
            ),
        };
        self.event(kind, fields);
    }

    /// The open item done: its closing events, then the item kept.
    fn close(&mut self) {
        let Some(open) = self.open.take() else { return };
        let (id, index, text) = (&open.id, open.index, &open.text);
        match &open.kind {
            OpenKind::Reasoning => self.event(
                "response.reasoning_text.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
            ),
            OpenKind::Message => {
                self.event(
                    "response.output_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": open.logprobs}),
                );
                self.event(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "part": {"type": "output_text", "text": text, "annotations": [], "logprobs": open.logprobs}}),
                );
            }
            OpenKind::Call { name, .. } => self.event(
                "response.function_call_arguments.done",
                json!({"item_id": id, "output_index": index, "name": name, "arguments": text}),
            ),
        }
        let done = item(&open, "completed");
        self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": done}),
        );
        self.items.push(done);
    }

    fn finished(&mut self, reason: &'static str, _stop_string: Option<String>) {
        self.incomplete = reason == "length";
    }
}

impl EventSink for Builder {
    fn next_event(&mut self) -> Option<Value> {
        self.events.pop_front()
    }

    fn ended(&mut self, g: &Generation) {
        let kind = match self.incomplete {
            true => "response.incomplete",
            false => "response.completed",
        };
        let done = self.response(Some(usage(g)));
        self.event(kind, json!({ "response": done }));
    }

    fn failed(&mut self, message: String) {
        self.event(
            "error",
            json!({"code": "server_error", "message": message, "param": null}),
        );
    }
}

/// An output item in the API's shape.
fn item(open: &Open, status: &str) -> Value {
    let done = status == "completed";
    match &open.kind {
        OpenKind::Reasoning => json!({
            "id": open.id, "type": "reasoning", "summary": [], "status": status,
            "content": if done { json!([{"type": "reasoning_text", "text": open.text}]) } else { json!([]) },
        }),
        OpenKind::Message => json!({
            "id": open.id, "type": "message", "role": "assistant", "status": status,
            "content": if done {
                json!([{"type": "output_text", "text": open.text, "annotations": [], "logprobs": open.logprobs}])
            } else {
                json!([])
            },
        }),
        OpenKind::Call { call_id, name } => json!({
            "id": open.id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": if done { open.text.as_str() } else { "" }, "status": status,
        }),
    }
}

fn usage(g: &Generation) -> Value {
    json!({
        "input_tokens": g.prompt_tokens(),
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": g.completion_tokens(),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": g.prompt_tokens() + g.completion_tokens(),
    })
}

/// The whole response.
pub async fn complete(mut g: Generation, echo: Map<String, Value>) -> Response {
    let (mut router, mut b) = (PartRouter::new(&g), Builder::new(&g, echo));
    while let Some(output) = g.next().await {
        if let Err(message) = router.take(&mut b, output, &g) {
            return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message).into_response();
        }
    }
    json_response(b.response(Some(usage(&g))))
}

/// The response's events (`response.created` first); a failure mid-stream is an `error`
/// event.
pub fn stream(
    g: Generation,
    echo: Map<String, Value>,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let mut b = Builder::new(&g, echo);
    b.start();
    answer_parts::stream(g, b)
}

/// The request's settings a response echoes (OpenAI's defaults where it gave none).
pub fn echo(body: &Map<String, Value>) -> Map<String, Value> {
    let mut echo = Map::new();
    for (key, default) in [
        ("instructions", Value::Null),
        ("max_output_tokens", Value::Null),
        ("metadata", json!({})),
        ("parallel_tool_calls", json!(true)),
        ("temperature", json!(1.0)),
        ("top_p", json!(1.0)),
        ("tool_choice", json!("auto")),
        ("tools", json!([])),
        ("text", json!({"format": {"type": "text"}})),
    ] {
        let value = body.get(key).filter(|v| !v.is_null()).cloned().unwrap_or(default);
        echo.insert(key.into(), value);
    }
    echo
}
