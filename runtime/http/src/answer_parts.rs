//! What the Responses and Messages formats share: a generation's outputs as a sequence of
//! parts (reasoning, text, tool calls), whichever way the request shapes its calls, and those
//! parts' events streamed as named server-sent events. Each format says what a part looks
//! like ([`PartSink`]) and how its stream begins, ends and fails ([`EventSink`]).

use super::completions_output;
use super::generation::{Generation, Output};
use super::tools::{ToolCall, ToolCalling};
use axum::response::sse::{Event as SseEvent, Sse};
use serde_json::Value;
use std::convert::Infallible;
use std::mem::Discriminant;

/// A part of an answer.
pub enum Part {
    Reasoning,
    Text,
    /// A call of function `name`, its arguments the part's text.
    Call {
        name: String,
    },
}

/// Where an answer's parts go, opened, filled and closed in turn by a [`PartRouter`] (which
/// keeps at most one open, and closes it before opening another).
pub trait PartSink {
    /// A new part begins.
    fn open(&mut self, part: Part);
    /// `text` onto the open part.
    fn append(&mut self, text: &str);
    /// `text` of the answer onto the open text part, with its tokens' log-probabilities
    /// (chat's `logprobs.content` entries; empty unless the request asks for them).
    fn append_answer(&mut self, text: &str, _logprobs: Vec<Value>) {
        self.append(text);
    }
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
    /// The sort of the part the sink has open.
    open: Option<Discriminant<Part>>,
}

impl PartRouter {
    pub fn new(g: &Generation) -> Self {
        Self {
            calling: g.info.tool_calling.clone(),
            required_text: String::new(),
            open: None,
        }
    }

    /// `text` onto the open part of `part`'s sort, opening one (and closing another) first.
    fn append(&mut self, sink: &mut impl PartSink, part: Part, text: &str) {
        self.open_for(sink, part);
        sink.append(text);
    }

    /// Have a part of `part`'s sort open, opening one (and closing another) where none is.
    fn open_for(&mut self, sink: &mut impl PartSink, part: Part) {
        let sort = std::mem::discriminant(&part);
        if self.open != Some(sort) {
            self.close(sink);
            sink.open(part);
            self.open = Some(sort);
        }
    }

    fn close(&mut self, sink: &mut impl PartSink) {
        if self.open.take().is_some() {
            sink.close();
        }
    }

    /// Calls known whole: a part each, its arguments at once.
    fn append_calls(&mut self, sink: &mut impl PartSink, calls: &[ToolCall]) {
        for call in calls {
            let part = Part::Call {
                name: call.name.clone(),
            };
            self.append(sink, part, &call.arguments);
            self.close(sink);
        }
    }

    /// Route one of `g`'s outputs.
    pub fn take(&mut self, sink: &mut impl PartSink, output: Output, g: &Generation) -> Result<(), String> {
        match output {
            Output::Text {
                text,
                reasoning,
                logprobs,
                ..
            } => {
                if !reasoning.is_empty() {
                    self.append(sink, Part::Reasoning, &reasoning);
                }
                if !text.is_empty() {
                    match &self.calling {
                        Some(ToolCalling::Named(tool)) => {
                            let part = Part::Call {
                                name: tool.name.clone(),
                            };
                            self.append(sink, part, &text)
                        }
                        Some(ToolCalling::Required { .. }) => self.required_text += &text,
                        Some(ToolCalling::Auto { .. }) | None => {
                            // A piece that also ends the reasoning carries the tokens of both:
                            // they go with its answer's text.
                            let logprobs = match g.info.logprobs {
                                Some(alternatives) => completions_output::logprob_content(
                                    g,
                                    alternatives,
                                    &completions_output::generated_entries(logprobs),
                                ),
                                None => Vec::new(),
                            };
                            self.open_for(sink, Part::Text);
                            sink.append_answer(&text, logprobs);
                        }
                    }
                }
            }
            Output::Calls { calls, .. } => self.append_calls(sink, &calls),
            // Neither API these parts serve echoes or scores a prompt.
            Output::Prompt { .. } => {}
            Output::Finish {
                reason, stop_string, ..
            } => {
                if let Some(required @ ToolCalling::Required { .. }) = &self.calling {
                    let text = std::mem::take(&mut self.required_text);
                    match required.calls(&text) {
                        Some(calls) => self.append_calls(sink, &calls),
                        None => self.append(sink, Part::Text, &text),
                    }
                }
                self.close(sink);
                sink.finished(reason, stop_string);
            }
            Output::Error(message) => return Err(message),
        }
        Ok(())
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
                        if let Err(message) = router.take(&mut sink, output, &g) {
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
