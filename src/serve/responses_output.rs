//! The Responses API's wire format for a generation: a `response` object whose `output` is a
//! list of items (the reasoning, the message, each function call), or the stream of events
//! that builds it (`response.created`, then for each item `response.output_item.added`, its
//! deltas and `…done` events, `response.output_item.done`, and `response.completed`). One
//! builder turns the generation's outputs into items and events for both.

use super::error::ApiError;
use super::generation::{Generation, Output};
use super::response::{json_response, unix_time};
use super::tools::{fresh_id, ToolCall, ToolCalling};
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
}

enum OpenKind {
    Reasoning,
    Message,
    /// A named function's call, its arguments streaming as the answer.
    Call {
        call_id: String,
        name: String,
    },
}

/// Items and events from a generation's outputs.
struct Builder {
    /// The response without `output`, `status` and `usage`: its id, times and the request's
    /// settings echoed.
    head: Map<String, Value>,
    calling: Option<ToolCalling>,
    items: Vec<Value>,
    open: Option<Open>,
    /// A `required` answer's text, whose calls are known once it is whole.
    required_text: String,
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
            calling: g.info.tool_calling.clone(),
            items: Vec::new(),
            open: None,
            required_text: String::new(),
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
    fn response(&self, status: &str, usage: Option<Value>) -> Value {
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
        let created = self.response("in_progress", None);
        self.event("response.created", json!({ "response": created }));
        let progress = self.response("in_progress", None);
        self.event("response.in_progress", json!({ "response": progress }));
    }

    fn take(&mut self, output: Output) -> Result<(), String> {
        match output {
            Output::Text { text, reasoning, .. } => {
                if !reasoning.is_empty() {
                    self.append(OpenKind::Reasoning, &reasoning);
                }
                if !text.is_empty() {
                    match &self.calling {
                        Some(ToolCalling::Named(tool)) => {
                            let call = OpenKind::Call {
                                call_id: fresh_id("call_"),
                                name: tool.name.clone(),
                            };
                            self.append(call, &text);
                        }
                        Some(ToolCalling::Required { .. }) => self.required_text += &text,
                        Some(ToolCalling::Auto { .. }) | None => self.append(OpenKind::Message, &text),
                    }
                }
            }
            Output::Calls { calls, .. } => self.calls(&calls),
            Output::Finish { reason, .. } => {
                if let Some(required) = self
                    .calling
                    .clone()
                    .filter(|c| matches!(c, ToolCalling::Required { .. }))
                {
                    let text = std::mem::take(&mut self.required_text);
                    match required.calls(&text) {
                        Some(calls) => self.calls(&calls),
                        None => self.append(OpenKind::Message, &text),
                    }
                }
                self.close();
                self.incomplete = reason == "length";
            }
            Output::Error(message) => return Err(message),
        }
        Ok(())
    }

    /// `text` onto the open item of `kind`'s sort, opening one (and closing another) first.
    fn append(&mut self, kind: OpenKind, text: &str) {
        let same = matches!(
            (&self.open, &kind),
            (
                Some(Open {
                    kind: OpenKind::Reasoning,
                    ..
                }),
                OpenKind::Reasoning
            ) | (
                Some(Open {
                    kind: OpenKind::Message,
                    ..
                }),
                OpenKind::Message
            ) | (
                Some(Open {
                    kind: OpenKind::Call { .. },
                    ..
                }),
                OpenKind::Call { .. }
            )
        );
        if !same {
            self.close();
            self.open_item(kind);
        }
        let open = self.open.as_mut().expect("an open item");
        open.text += text;
        let (id, index) = (open.id.clone(), open.index);
        let (kind, fields) = match open.kind {
            OpenKind::Reasoning => (
                "response.reasoning_text.delta",
                json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text}),
            ),
            OpenKind::Message => (
                "response.output_text.delta",
                json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text, "logprobs": []}),
            ),
            OpenKind::Call { .. } => (
                "response.function_call_arguments.delta",
                json!({"item_id": id, "output_index": index, "delta": text}),
            ),
        };
        self.event(kind, fields);
    }

    fn open_item(&mut self, kind: OpenKind) {
        let index = self.items.len();
        let id = match kind {
            OpenKind::Reasoning => fresh_id("rs_"),
            OpenKind::Message => fresh_id("msg_"),
            OpenKind::Call { .. } => fresh_id("fc_"),
        };
        let open = Open {
            kind,
            id,
            index,
            text: String::new(),
        };
        let item = item(&open, "in_progress");
        self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
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
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
                );
                self.event(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "part": {"type": "output_text", "text": text, "annotations": []}}),
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

    /// Calls known whole: an item each, its arguments in one delta.
    fn calls(&mut self, calls: &[ToolCall]) {
        for call in calls {
            let kind = OpenKind::Call {
                call_id: fresh_id("call_"),
                name: call.name.clone(),
            };
            self.append(kind, &call.arguments);
            self.close();
        }
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
                json!([{"type": "output_text", "text": open.text, "annotations": [], "logprobs": []}])
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

fn final_status(b: &Builder) -> &'static str {
    match b.incomplete {
        true => "incomplete",
        false => "completed",
    }
}

/// The whole response.
pub async fn complete(mut g: Generation, echo: Map<String, Value>) -> Response {
    let mut b = Builder::new(&g, echo);
    while let Some(output) = g.next().await {
        if let Err(message) = b.take(output) {
            return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message).into_response();
        }
    }
    json_response(b.response(final_status(&b), Some(usage(&g))))
}

/// The response's events, each a server-sent event named by its type; a failure mid-stream is
/// an `error` event.
pub fn stream(
    g: Generation,
    echo: Map<String, Value>,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let mut b = Builder::new(&g, echo);
    b.start();
    let events = futures_util::stream::unfold((g, b, false), |(mut g, mut b, mut ended)| async move {
        while b.events.is_empty() && !ended {
            match g.next().await {
                Some(output) => {
                    if let Err(message) = b.take(output) {
                        b.event(
                            "error",
                            json!({"code": "server_error", "message": message, "param": null}),
                        );
                        ended = true;
                    }
                }
                None => {
                    let kind = match b.incomplete {
                        true => "response.incomplete",
                        false => "response.completed",
                    };
                    let done = b.response(final_status(&b), Some(usage(&g)));
                    b.event(kind, json!({ "response": done }));
                    ended = true;
                }
            }
        }
        let event = b.events.pop_front()?;
        let name = event["type"].as_str().unwrap_or("message").to_string();
        Some((
            Ok(SseEvent::default().event(name).data(event.to_string())),
            (g, b, ended),
        ))
    });
    Sse::new(events)
}

/// The request's settings a response echoes (OpenAI's defaults where it gave none).
pub fn echo(body: &[u8]) -> Map<String, Value> {
    let body: Map<String, Value> = serde_json::from_slice(body).unwrap_or_default();
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
