//! OpenAI's wire format for a generation: server-sent event chunks or one JSON response, per
//! endpoint (`text_completion` or `chat.completion[.chunk]`), with usage and log-probabilities.

use super::error::ApiError;
use super::generation::{Generation, Output};
use super::request::Endpoint;
use super::tools::{self, ToolCalling};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use runtime::TokenLogprobs;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

pub fn unix_time() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

pub fn json_response(body: Value) -> Response {
    ([("content-type", "application/json")], body.to_string()).into_response()
}

fn object(endpoint: Endpoint, chunk: bool) -> &'static str {
    match (endpoint, chunk) {
        (Endpoint::Completions, _) => "text_completion",
        (Endpoint::Chat, true) => "chat.completion.chunk",
        (Endpoint::Chat, false) => "chat.completion",
    }
}

fn usage(g: &Generation) -> Value {
    json!({
        "prompt_tokens": g.prompt_tokens(),
        "completion_tokens": g.completion_tokens(),
        "total_tokens": g.prompt_tokens() + g.completion_tokens(),
    })
}

/// A streamed chunk; with vLLM's `continuous_usage_stats`, the usage so far in it.
fn chunk(g: &Generation, choices: Value) -> Value {
    let mut chunk = json!({
        "id": g.info.id, "object": object(g.info.endpoint, true), "created": g.info.created,
        "model": g.info.app.model_name, "choices": choices,
    });
    if g.info.continuous_usage {
        chunk["usage"] = usage(g);
    }
    chunk
}

/// A token and its log-probabilities, where it has any (an echoed prompt's first has none).
pub type LogprobEntry = (u32, Option<TokenLogprobs>);

/// Generated tokens as entries.
pub fn generated_entries(logprobs: Vec<(u32, TokenLogprobs)>) -> Vec<LogprobEntry> {
    logprobs.into_iter().map(|(id, lp)| (id, Some(lp))).collect()
}

/// Choice `index`'s echoed prompt's tokens as entries: its positions' log-probabilities from
/// the second on.
fn prompt_entries(g: &Generation, index: usize, logprobs: &[TokenLogprobs]) -> Vec<LogprobEntry> {
    let scored = std::iter::once(None).chain(logprobs.iter().cloned().map(Some));
    g.info.prompt.of_choice(index).ids.iter().copied().zip(scored).collect()
}

/// A choice's `logprobs` in the endpoint's format, `logprobs` alternatives each; null when
/// not asked for. `text_offset` counts the characters of token text this choice reported
/// before.
fn logprobs_json(g: &Generation, entries: &[LogprobEntry], text_offset: &mut usize) -> Value {
    let Some(alternatives) = g.info.logprobs else {
        return Value::Null;
    };
    let text = |id: u32| token_text(g, id);
    // A prompt scored for `prompt_logprobs` may carry more alternatives than these.
    let top = |lp: &TokenLogprobs| lp.top.iter().take(alternatives).copied().collect::<Vec<_>>();
    match g.info.endpoint {
        Endpoint::Completions => {
            let mut offsets = Vec::new();
            for &(id, _) in entries {
                offsets.push(*text_offset);
                *text_offset += text(id).chars().count();
            }
            let tops: Vec<Value> = entries
                .iter()
                .map(|(_, lp)| match lp {
                    Some(lp) => Value::Object(top(lp).into_iter().map(|(id, p)| (text(id), json!(p))).collect()),
                    None => Value::Null,
                })
                .collect();
            json!({
                "tokens": entries.iter().map(|&(id, _)| text(id)).collect::<Vec<_>>(),
                "token_logprobs": entries.iter().map(|(_, lp)| lp.as_ref().map(|lp| lp.logprob)).collect::<Vec<_>>(),
                "top_logprobs": tops,
                "text_offset": offsets,
            })
        }
        Endpoint::Chat => json!({ "content": logprob_content(g, alternatives, entries) }),
    }
}

/// Chat's `logprobs.content` (the Responses API's `logprobs` too): per token its text,
/// log-probability, bytes, and `alternatives` of the same with theirs.
pub fn logprob_content(g: &Generation, alternatives: usize, entries: &[LogprobEntry]) -> Vec<Value> {
    let entry = |id: u32, logprob: Option<f32>| {
        let t = token_text(g, id);
        json!({ "token": t, "logprob": logprob, "bytes": t.as_bytes() })
    };
    entries
        .iter()
        .map(|(id, lp)| {
            let mut e = entry(*id, lp.as_ref().map(|lp| lp.logprob));
            // A prompt scored for `prompt_logprobs` may carry more alternatives than these.
            let top = lp.as_ref().map(|lp| &lp.top[..alternatives.min(lp.top.len())]);
            e["top_logprobs"] = top
                .unwrap_or_default()
                .iter()
                .map(|&(id, p)| entry(id, Some(p)))
                .collect();
            e
        })
        .collect()
}

/// How log-probabilities name token `id`: its text, or vLLM's `token_id:N` where the request
/// asks (`return_tokens_as_token_ids`: texts can collide, ids cannot).
fn token_text(g: &Generation, id: u32) -> String {
    match g.info.tokens_as_ids {
        true => format!("token_id:{id}"),
        false => g.info.app.tokenizer.decode(&[id]).unwrap_or_default(),
    }
}

/// vLLM's `prompt_logprobs` of choice `index`'s prompt: null for the first position, then for
/// each a map from token ids to their log-probability, rank and text: the prompt's token and
/// the most likely alternatives there. Null when not asked for.
fn prompt_logprobs_json(g: &Generation, index: usize, logprobs: &[TokenLogprobs]) -> Value {
    let Some(alternatives) = g.info.prompt.logprobs else {
        return Value::Null;
    };
    let text = |id: u32| token_text(g, id);
    let entry =
        |logprob: f32, rank: u32, id: u32| json!({ "logprob": logprob, "rank": rank, "decoded_token": text(id) });
    let ids = &g.info.prompt.of_choice(index).ids;
    let positions = ids.iter().skip(1).zip(logprobs).map(|(&id, lp)| {
        let mut at = serde_json::Map::new();
        at.insert(id.to_string(), entry(lp.logprob, lp.rank, id));
        for (i, &(alt, p)) in lp.top.iter().take(alternatives).enumerate() {
            at.entry(alt.to_string()).or_insert_with(|| entry(p, i as u32 + 1, alt));
        }
        Value::Object(at)
    });
    Value::Array(std::iter::once(Value::Null).chain(positions).collect())
}

/// A streamed chunk, with vLLM's `prompt_token_ids` where the request asks for token ids and
/// it is choice `index`'s first: in the choice for a completion, beside the choices for a chat
/// (whose prompt is every choice's).
fn with_prompt_ids(g: &Generation, index: usize, first: bool, mut chunk: Value) -> Value {
    if g.info.return_token_ids && first {
        let ids = json!(g.info.prompt.of_choice(index).ids);
        match g.info.endpoint {
            Endpoint::Completions => chunk["choices"][0]["prompt_token_ids"] = ids,
            Endpoint::Chat => chunk["prompt_token_ids"] = ids,
        }
    }
    chunk
}

/// vLLM's `stop_reason`: the stop string or stop token id that ended a choice, null where
/// neither did (its end, its length, the model's end token).
fn stop_reason(stop_string: Option<String>, stop_token: Option<u32>) -> Value {
    match (stop_string, stop_token) {
        (Some(s), _) => json!(s),
        (None, Some(id)) => json!(id),
        (None, None) => Value::Null,
    }
}

/// A streamed piece of text: the answer's, and the reasoning before it (chat only).
struct Piece<'a> {
    text: &'a str,
    reasoning: &'a str,
}

/// One streamed choice carrying a piece and/or a finish reason. A chat delta names only
/// what the piece holds (the first also the role): `reasoning_content`, `content`.
fn stream_choice(
    endpoint: Endpoint,
    index: usize,
    piece: Option<Piece>,
    finish: Option<&str>,
    first: bool,
    logprobs: Value,
) -> Value {
    match endpoint {
        Endpoint::Completions => json!([{
            "index": index, "text": piece.map_or("", |p| p.text), "logprobs": logprobs, "finish_reason": finish,
        }]),
        Endpoint::Chat => {
            let mut delta = serde_json::Map::new();
            if let Some(p) = piece {
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if !p.reasoning.is_empty() {
                    delta.insert("reasoning_content".into(), json!(p.reasoning));
                }
                if !p.text.is_empty() || p.reasoning.is_empty() {
                    delta.insert("content".into(), json!(p.text));
                }
            }
            json!([{ "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish }])
        }
    }
}

/// Server-sent events: a chunk per text piece, a chunk per choice with its finish reason, the
/// usage chunk (`choices: []`) when asked for, then `[DONE]`. A failure mid-stream is an error
/// event.
pub fn stream(generation: Generation) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let n = generation.choices();
    let state = StreamState {
        generation,
        ready: VecDeque::new(),
        sent_text: vec![false; n],
        text_offsets: vec![0; n],
        call_text: vec![String::new(); n],
        calls_sent: vec![0; n],
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
    /// Per choice: whether a text chunk went out (the first carries the chat role).
    sent_text: Vec<bool>,
    text_offsets: Vec<usize>,
    /// Per choice, where the answer is `required` tool calls: its text so far (the calls are
    /// known once it is whole).
    call_text: Vec<String>,
    /// Per choice, the calls in the model's own format sent so far (`tool_choice` auto).
    calls_sent: Vec<usize>,
    ended: bool,
}

impl StreamState {
    async fn advance(&mut self) {
        let g = &mut self.generation;
        match g.next().await {
            Some(Output::Prompt { index, logprobs }) => {
                // Only an echo streams (`prompt_logprobs` is not streamed): the prompt's text
                // as the choice's first piece.
                let Some(echo) = &g.info.prompt.of_choice(index).echo else {
                    return;
                };
                let entries = prompt_entries(g, index, &logprobs);
                let logprobs = logprobs_json(g, &entries, &mut self.text_offsets[index]);
                let piece = Piece {
                    text: echo,
                    reasoning: "",
                };
                let choice = stream_choice(g.info.endpoint, index, Some(piece), None, true, logprobs);
                self.ready
                    .push_back(with_prompt_ids(g, index, true, chunk(g, choice)).to_string());
                self.sent_text[index] = true;
            }
            Some(Output::Text {
                index,
                text,
                reasoning,
                logprobs,
                ids,
            }) => {
                let logprobs = logprobs_json(g, &generated_entries(logprobs), &mut self.text_offsets[index]);
                let first = !self.sent_text[index];
                let piece = Piece {
                    text: &text,
                    reasoning: &reasoning,
                };
                let mut choice = stream_choice(g.info.endpoint, index, Some(piece), None, first, logprobs);
                if g.info.return_token_ids {
                    choice[0]["token_ids"] = json!(ids);
                }
                match &g.info.tool_calling {
                    // The arguments as they come, in the call's delta.
                    Some(ToolCalling::Named(tool)) => {
                        let delta = choice[0]["delta"].as_object_mut().expect("a chat delta");
                        delta.remove("content");
                        delta.insert("tool_calls".into(), tools::named_call_delta(&tool.name, &text, first));
                    }
                    Some(ToolCalling::Required { .. }) => {
                        self.call_text[index] += &text;
                        let delta = choice[0]["delta"].as_object_mut().expect("a chat delta");
                        delta.remove("content");
                        if delta.is_empty() && choice[0]["logprobs"].is_null() {
                            return;
                        }
                    }
                    Some(ToolCalling::Auto { .. }) | None => {}
                }
                self.ready
                    .push_back(with_prompt_ids(g, index, first, chunk(g, choice)).to_string());
                self.sent_text[index] = true;
            }
            Some(Output::Calls { index, calls }) => {
                let mut delta = json!({ "tool_calls": tools::tool_calls_json(&calls, Some(self.calls_sent[index])) });
                if !self.sent_text[index] {
                    delta["role"] = json!("assistant");
                }
                let choice = json!([{ "index": index, "delta": delta, "logprobs": null, "finish_reason": null }]);
                self.ready.push_back(chunk(g, choice).to_string());
                self.sent_text[index] = true;
                self.calls_sent[index] += calls.len();
            }
            Some(Output::Finish {
                index,
                reason,
                stop_string,
                stop_token,
            }) => {
                if let Some(calling @ ToolCalling::Required { .. }) = &g.info.tool_calling {
                    let text = std::mem::take(&mut self.call_text[index]);
                    let delta = match calling.calls(&text) {
                        Some(calls) => json!({ "tool_calls": tools::tool_calls_json(&calls, Some(0)) }),
                        None => json!({ "content": text }),
                    };
                    let choice = json!([{ "index": index, "delta": delta, "logprobs": null, "finish_reason": null }]);
                    self.ready.push_back(chunk(g, choice).to_string());
                }
                let mut choice = stream_choice(g.info.endpoint, index, None, Some(reason), false, Value::Null);
                choice[0]["stop_reason"] = stop_reason(stop_string, stop_token);
                self.ready.push_back(chunk(g, choice).to_string());
            }
            Some(Output::Error(message)) => {
                let error = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message).body();
                self.ready.push_back(error.to_string());
                self.ready.push_back("[DONE]".into());
                self.ended = true;
            }
            None => {
                if g.info.include_usage {
                    let mut last = chunk(g, json!([]));
                    last["usage"] = usage(g);
                    self.ready.push_back(last.to_string());
                }
                self.ready.push_back("[DONE]".into());
                self.ended = true;
            }
        }
    }
}

/// A whole (non-streamed) response.
pub async fn complete(mut g: Generation) -> Response {
    let n = g.choices();
    let mut texts = vec![String::new(); n];
    let mut reasonings = vec![String::new(); n];
    let mut finishes = vec!["length"; n];
    let mut stop_reasons = vec![Value::Null; n];
    let mut logprobs: Vec<Vec<LogprobEntry>> = vec![Vec::new(); n];
    let mut prompt_logprobs: Vec<Vec<TokenLogprobs>> = vec![Vec::new(); n];
    let mut token_ids: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut auto_calls: Vec<Vec<tools::ToolCall>> = vec![Vec::new(); n];
    while let Some(output) = g.next().await {
        match output {
            Output::Prompt { index, logprobs: lp } => {
                if let Some(echo) = &g.info.prompt.of_choice(index).echo {
                    texts[index] += echo;
                    logprobs[index].extend(prompt_entries(&g, index, &lp));
                }
                prompt_logprobs[index] = lp;
            }
            Output::Text {
                index,
                text,
                reasoning,
                logprobs: lp,
                ids,
            } => {
                token_ids[index].extend(ids);
                texts[index] += &text;
                reasonings[index] += &reasoning;
                logprobs[index].extend(generated_entries(lp));
            }
            Output::Calls { index, calls } => auto_calls[index].extend(calls),
            Output::Finish {
                index,
                reason,
                stop_string,
                stop_token,
            } => {
                finishes[index] = reason;
                stop_reasons[index] = stop_reason(stop_string, stop_token);
            }
            Output::Error(message) => return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message).into_response(),
        }
    }
    let choices: Vec<Value> = (0..n)
        .map(|i| {
            let lp = logprobs_json(&g, &logprobs[i], &mut 0);
            match g.info.endpoint {
                Endpoint::Completions => {
                    let mut choice = json!({
                        "index": i, "text": texts[i], "logprobs": lp, "finish_reason": finishes[i],
                        "stop_reason": stop_reasons[i],
                    });
                    if g.info.prompt.logprobs.is_some() {
                        choice["prompt_logprobs"] = prompt_logprobs_json(&g, i, &prompt_logprobs[i]);
                    }
                    if g.info.return_token_ids {
                        choice["prompt_token_ids"] = json!(g.info.prompt.of_choice(i).ids);
                        choice["token_ids"] = json!(token_ids[i]);
                    }
                    choice
                }
                Endpoint::Chat => {
                    let mut message = json!({ "role": "assistant", "content": texts[i] });
                    if let Some(calls) = g.info.tool_calling.as_ref().and_then(|c| c.calls(&texts[i])) {
                        message["content"] = Value::Null;
                        message["tool_calls"] = tools::tool_calls_json(&calls, None);
                    }
                    // `auto` calls beside the text before them (null where there was none).
                    if !auto_calls[i].is_empty() {
                        if texts[i].is_empty() {
                            message["content"] = Value::Null;
                        }
                        message["tool_calls"] = tools::tool_calls_json(&auto_calls[i], None);
                    }
                    // Where the request splits reasoning off, the field is there (null for none).
                    if g.info.reasoning.is_some() {
                        let reasoning = Some(&reasonings[i]).filter(|r| !r.is_empty());
                        message["reasoning_content"] = json!(reasoning);
                    }
                    let mut choice = json!({
                        "index": i, "message": message, "logprobs": lp, "finish_reason": finishes[i],
                        "stop_reason": stop_reasons[i],
                    });
                    if g.info.return_token_ids {
                        choice["token_ids"] = json!(token_ids[i]);
                    }
                    choice
                }
            }
        })
        .collect();
    let mut response = json!({
        "id": g.info.id, "object": object(g.info.endpoint, false), "created": g.info.created, "model": g.info.app.model_name,
        "choices": choices, "usage": usage(&g),
    });
    // A chat response's prompt is every choice's: vLLM reports it once, beside the choices.
    if g.info.endpoint == Endpoint::Chat && g.info.prompt.logprobs.is_some() {
        response["prompt_logprobs"] = prompt_logprobs_json(&g, 0, &prompt_logprobs[0]);
    }
    if g.info.endpoint == Endpoint::Chat && g.info.return_token_ids {
        response["prompt_token_ids"] = json!(g.info.prompt.of_choice(0).ids);
    }
    json_response(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delta(reasoning: &str, text: &str, first: bool) -> Value {
        let piece = Piece { text, reasoning };
        stream_choice(Endpoint::Chat, 0, Some(piece), None, first, Value::Null)[0]["delta"].clone()
    }

    /// A chat chunk names what its piece holds: reasoning alone, the answer alone, or both
    /// where the piece ends the reasoning; the first also the role.
    #[test]
    fn chat_deltas_carry_reasoning_and_answer_apart() {
        assert_eq!(
            delta("hmm", "", true),
            json!({ "role": "assistant", "reasoning_content": "hmm" })
        );
        assert_eq!(delta("", "4", false), json!({ "content": "4" }));
        assert_eq!(
            delta("so", "4", false),
            json!({ "reasoning_content": "so", "content": "4" })
        );
        // A piece of log-probabilities only (text held back) still carries an empty content.
        assert_eq!(delta("", "", false), json!({ "content": "" }));
    }
}
