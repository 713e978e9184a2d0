//! What the Responses and Messages formats share: a generation's outputs as a sequence of
//! parts (reasoning, text, tool calls), whichever way the request shapes its calls, and those
//! parts' events streamed as named server-sent events. Each format says what a part looks
//! like ([`PartSink`]) and how its stream begins, ends and fails ([`EventSink`]).

use super::generation::{Generation, Output};
use super::tools::{ToolCall, ToolCalling};
use axum::response::sse::{Event as SseEvent, Sse};
use serde_json::Value;
use std::convert::Infallible;

/// A part of an answer.
pub enum Part {
    Reasoning,
    Text,
    /// A call of function `name`, its arguments the part's text.
    Call {
        name: String,
    },
}

impl Part {
    /// Whether `self` continues a part of `other`'s sort.
    pub fn same_sort(&self, other: &Part) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}

/// Where an answer's parts go.
pub trait PartSink {
    /// `text` onto the open part of `part`'s sort, opening one (and closing another) first.
    fn append(&mut self, part: Part, text: &str);
    /// The open part done.
    fn close(&mut self);
    /// The answer ended (`Output::Finish`'s reason and stop string), every part closed.
    fn finished(&mut self, reason: &'static str, stop_string: Option<String>);
}

/// A format's stream of events.
pub trait EventSink: PartSink + Send + 'static {
    /// The next event ready to send (its `type` names it).
    fn next_event(&mut self) -> Option<Value>;
    /// The generation is over: the closing events.
    fn ended(&mut self, g: &Generation);
    /// The engine failed: the error event.
    fn failed(&mut self, message: String);
}

/// Routes a generation's outputs into parts: reasoning, then the answer as text or, where the
/// request names a function, as that call's arguments; `required` calls once the answer is
/// whole (text where it is not a call); `auto` calls as the parser found them.
pub struct PartRouter {
    calling: Option<ToolCalling>,
    required_text: String,
}

impl PartRouter {
    pub fn new(g: &Generation) -> Self {
        Self {
            calling: g.info.tool_calling.clone(),
            required_text: String::new(),
        }
    }

    pub fn take(&mut self, sink: &mut impl PartSink, output: Output) -> Result<(), String> {
        match output {
            Output::Text { text, reasoning, .. } => {
                if !reasoning.is_empty() {
                    sink.append(Part::Reasoning, &reasoning);
                }
                if !text.is_empty() {
                    match &self.calling {
                        Some(ToolCalling::Named(tool)) => sink.append(
                            Part::Call {
                                name: tool.name.clone(),
                            },
                            &text,
                        ),
                        Some(ToolCalling::Required { .. }) => self.required_text += &text,
                        Some(ToolCalling::Auto { .. }) | None => sink.append(Part::Text, &text),
                    }
                }
            }
            Output::Calls { calls, .. } => append_calls(sink, &calls),
            Output::Finish {
                reason, stop_string, ..
            } => {
                if let Some(required @ ToolCalling::Required { .. }) = &self.calling {
                    let text = std::mem::take(&mut self.required_text);
                    match required.calls(&text) {
                        Some(calls) => append_calls(sink, &calls),
                        None => sink.append(Part::Text, &text),
                    }
                }
                sink.close();
                sink.finished(reason, stop_string);
            }
            Output::Error(message) => return Err(message),
        }
        Ok(())
    }
}

/// Calls known whole: a part each, its arguments at once.
fn append_calls(sink: &mut impl PartSink, calls: &[ToolCall]) {
    for call in calls {
        sink.append(
            Part::Call {
                name: call.name.clone(),
            },
            &call.arguments,
        );
        sink.close();
    }
}

/// `g`'s events as `sink` writes them, each a server-sent event named by its `type`.
pub fn stream<S: EventSink>(
    g: Generation,
    sink: S,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let router = PartRouter::new(&g);
    let events = futures_util::stream::unfold(
        (g, router, sink, false),
        |(mut g, mut router, mut sink, mut ended)| async move {
            loop {
                if let Some(event) = sink.next_event() {
                    let name = event["type"].as_str().unwrap_or("message").to_string();
                    let sse = SseEvent::default().event(name).data(event.to_string());
                    return Some((Ok(sse), (g, router, sink, ended)));
                }
                if ended {
                    return None;
                }
                match g.next().await {
                    Some(output) => {
                        if let Err(message) = router.take(&mut sink, output) {
                            sink.failed(message);
                            ended = true;
                        }
                    }
                    None => {
                        sink.ended(&g);
                        ended = true;
                    }
                }
            }
        },
    );
    Sse::new(events)
}
