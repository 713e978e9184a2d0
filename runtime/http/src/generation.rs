//! One admitted request's progress, from the engine's events to what its client sees: per
//! choice (a request with `n` > 1 runs `n` sequences) the text pieces (a chat answer's split
//! from its reasoning where the model marks it, and its tool calls parsed out where the
//! model may make them), the log-probabilities of the tokens behind them, and how each
//! choice finished. Formatting is `completions_output`'s job.

use super::http::AppState;
use super::reasoning::{Markers, ReasoningSplit, Split};
use super::request::Endpoint;
use super::text::TextOutput;
use super::tool_parser::{CallSplit, Parsed};
use super::tools::{ToolCall, ToolCalling};
use super::worker::Event;
use futures_util::future::select_all;
use runtime::serving::FinishReason;
use runtime::TokenLogprobs;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

/// What a generation produces, in order.
pub enum Output {
    /// What choice `index` reports of its prompt, before anything else of it (where the
    /// request echoes it or scores it): the log-probabilities of its positions from the second
    /// on, where asked for.
    Prompt { index: usize, logprobs: Vec<TokenLogprobs> },
    /// A piece of choice `index`'s text (its answer where the request splits reasoning off),
    /// the reasoning before it, and the log-probabilities of the tokens consumed since its
    /// last piece (empty unless asked for).
    Text {
        index: usize,
        text: String,
        reasoning: String,
        logprobs: Vec<(u32, TokenLogprobs)>,
        /// The ids of the tokens consumed since its last piece (stop tokens included).
        ids: Vec<u32>,
    },
    /// Tool calls choice `index` made in its own format (`tool_choice` auto), after the text
    /// before them.
    Calls { index: usize, calls: Vec<ToolCall> },
    Finish {
        index: usize,
        reason: &'static str,
        /// The stop string that ended the choice, where one did.
        stop_string: Option<String>,
        /// The stop token (one of `stop_token_ids`, not the model's end) that ended it, where
        /// one did.
        stop_token: Option<u32>,
    },
    /// The engine failed: the whole request ends.
    Error(String),
}

/// One sequence of the request.
struct Choice {
    /// Dropping or closing this aborts the sequence (the engine sees the channel closed).
    events: mpsc::UnboundedReceiver<Event>,
    text: TextOutput,
    /// Where the request splits reasoning from the answer.
    split: Option<ReasoningSplit>,
    /// Where the answer may be tool calls in the model's format.
    calls: Option<CallSplit>,
    /// Log-probabilities of tokens not yet attached to a piece of text.
    logprobs: Vec<(u32, TokenLogprobs)>,
    /// Ids of tokens not yet attached to a piece of text.
    ids: Vec<u32>,
    /// Log-probabilities of its prompt's positions so far.
    prompt_logprobs: Vec<TokenLogprobs>,
    /// Whether its first token or its end came (so its prompt was reported).
    started: bool,
    /// The stop token it generated, where that was one of the request's own.
    stop_token: Option<u32>,
    done: bool,
}

/// One of a request's prompts, as its choices report it.
#[derive(Debug, Default)]
pub struct RequestPrompt {
    pub ids: Vec<u32>,
    /// `echo`: the prompt's text, before the output's.
    pub echo: Option<String>,
}

/// What a request reports of its prompts: completions' `echo`, vLLM's `prompt_logprobs`.
#[derive(Debug, Default)]
pub struct PromptReport {
    /// Each prompt; choice `i` answers prompt `i / choices_each`.
    pub prompts: Vec<RequestPrompt>,
    pub choices_each: usize,
    /// `echo` with `max_tokens: 0`: the prompt alone; the token the engine still generates
    /// is dropped.
    pub echo_only: bool,
    /// `prompt_logprobs`: the alternatives reported at each position.
    pub logprobs: Option<usize>,
}

impl PromptReport {
    /// The prompt choice `index` answers.
    pub fn of_choice(&self, index: usize) -> &RequestPrompt {
        &self.prompts[index / self.choices_each.max(1)]
    }

    /// Whether anything of the prompts is reported.
    fn is_reported(&self) -> bool {
        self.logprobs.is_some() || self.prompts.iter().any(|p| p.echo.is_some())
    }
}

/// What a request asked for, fixed at admission.
pub struct RequestInfo {
    pub app: Arc<AppState>,
    pub id: String,
    pub created: u64,
    pub endpoint: Endpoint,
    pub stream: bool,
    pub include_usage: bool,
    /// Every streamed chunk carries the usage so far (vLLM's `continuous_usage_stats`).
    pub continuous_usage: bool,
    /// vLLM's `skip_special_tokens`: special tokens write no text (but those of the markers
    /// the server reads answers by).
    pub skip_special_tokens: bool,
    /// `logprobs`: the alternatives reported with each output token, where asked for.
    pub logprobs: Option<usize>,
    /// vLLM's `return_token_ids`: the prompt's ids and each choice's generated ids reported.
    pub return_token_ids: bool,
    /// vLLM's `return_tokens_as_token_ids`: tokens in log-probabilities as `token_id:N`.
    pub tokens_as_ids: bool,
    pub prompt: PromptReport,
    pub stop_strings: Vec<String>,
    /// `include_stop_str_in_output`: the stop string that ends a choice is part of its text.
    pub include_stop_str: bool,
    /// Tokens before a stop string may end the output (`min_tokens`).
    pub min_tokens: usize,
    pub stop_tokens: Vec<u32>,
    pub prompt_tokens: usize,
    /// Chat answers: the markers their reasoning is split at, and whether the prompt left
    /// the model inside its reasoning.
    pub reasoning: Option<(Markers, bool)>,
    /// Chat answers that are or may be tool calls.
    pub tool_calling: Option<ToolCalling>,
    pub started: Instant,
}

pub struct Generation {
    pub info: RequestInfo,
    choices: Vec<Choice>,
    completion_tokens: usize,
    first_token_at: Option<Instant>,
    pending: VecDeque<Output>,
    failed: bool,
}

/// A choice's text as the request asks it written: stop strings, `min_tokens`, the stop
/// string kept or not, special tokens skipped or not.
fn text_output(info: &RequestInfo) -> TextOutput {
    let text = TextOutput::after(info.min_tokens, info.stop_strings.clone());
    let text = match info.include_stop_str {
        true => text.including_stop(),
        false => text,
    };
    match info.skip_special_tokens {
        true => text.silencing(info.app.silent_special_tokens.clone()),
        false => text,
    }
}

impl Generation {
    pub fn new(info: RequestInfo, events: Vec<mpsc::UnboundedReceiver<Event>>) -> Self {
        let choices = events
            .into_iter()
            .map(|events| Choice {
                events,
                text: text_output(&info),
                split: info
                    .reasoning
                    .map(|(markers, inside)| ReasoningSplit::new(markers, inside)),
                calls: match (&info.tool_calling, info.app.tool_calls) {
                    (Some(ToolCalling::Auto { tools, one_call }), Some(format)) => {
                        Some(CallSplit::new(format, tools.clone(), *one_call))
                    }
                    _ => None,
                },
                logprobs: Vec::new(),
                ids: Vec::new(),
                prompt_logprobs: Vec::new(),
                started: false,
                stop_token: None,
                done: false,
            })
            .collect();
        Self {
            info,
            choices,
            completion_tokens: 0,
            first_token_at: None,
            pending: VecDeque::new(),
            failed: false,
        }
    }

    pub fn choices(&self) -> usize {
        self.choices.len()
    }

    /// The next output; `None` once every choice finished.
    pub async fn next(&mut self) -> Option<Output> {
        while self.pending.is_empty() && !self.is_over() {
            let waits = self
                .choices
                .iter_mut()
                .enumerate()
                .filter(|(_, c)| !c.done)
                .map(|(i, c)| Box::pin(async move { (i, c.events.recv().await) }));
            let ((index, event), _, _) = select_all(waits).await;
            self.handle(index, event);
        }
        self.pending.pop_front()
    }

    fn is_over(&self) -> bool {
        self.failed || self.choices.iter().all(|c| c.done)
    }

    fn handle(&mut self, index: usize, event: Option<Event>) {
        // The prompt alone: the token generated after it is not the output.
        let echo_only = self.info.prompt.echo_only;
        match event {
            Some(Event::PromptLogprobs(logprobs)) => self.choices[index].prompt_logprobs.extend(logprobs),
            Some(Event::Token(..)) if echo_only => self.start(index),
            Some(Event::Finished(_)) if echo_only => {
                self.start(index);
                self.finish(index, "length", None);
            }
            Some(Event::Token(token, logprobs)) => {
                self.start(index);
                self.take_token(index, token, logprobs);
            }
            Some(Event::Finished(reason)) => {
                self.start(index);
                self.end(index, reason);
            }
            Some(Event::Failed(message)) => self.fail(message),
            None => self.fail("the engine dropped the request".into()),
        }
    }

    /// Choice `index`'s next token: its text released as far as the stop strings allow.
    fn take_token(&mut self, index: usize, token: u32, logprobs: Option<TokenLogprobs>) {
        self.completion_tokens += 1;
        self.first_token_at.get_or_insert_with(Instant::now);
        self.choices[index].ids.push(token);
        if self.info.stop_tokens.contains(&token) {
            // The model's own end is no stop token of the request's (vLLM's rule).
            if !self.info.app.tokenizer.eos.contains(&token) {
                self.choices[index].stop_token = Some(token);
            }
            return; // Finished(Stop) follows; the stop token is not text.
        }
        let choice = &mut self.choices[index];
        choice.logprobs.extend(logprobs.map(|lp| (token, lp)));
        match choice.text.push(&self.info.app.tokenizer, token) {
            Ok(piece) => {
                self.push_text(index, piece.text);
                if piece.stopped {
                    let matched = self.choices[index].text.matched().map(str::to_string);
                    self.finish(index, "stop", matched);
                }
            }
            Err(e) => self.fail(format!("detokenizing: {e}")),
        }
    }

    /// The engine ended choice `index`: what its text held back, then its finish.
    fn end(&mut self, index: usize, reason: FinishReason) {
        match self.choices[index].text.finish(&self.info.app.tokenizer) {
            Ok(rest) => {
                self.push_text(index, rest);
                let reason = match reason {
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                };
                self.finish(index, reason, None);
            }
            Err(e) => self.fail(format!("detokenizing: {e}")),
        }
    }

    /// Before choice `index`'s first token or end: its prompt, where the request reports it
    /// (every prompt position's log-probability came before).
    fn start(&mut self, index: usize) {
        let choice = &mut self.choices[index];
        if choice.started {
            return;
        }
        choice.started = true;
        if self.info.prompt.is_reported() {
            let logprobs = std::mem::take(&mut choice.prompt_logprobs);
            self.pending.push_back(Output::Prompt { index, logprobs });
        }
    }

    fn push_text(&mut self, index: usize, text: String) {
        let split = match &mut self.choices[index].split {
            Some(split) => split.push(&text),
            None => Split {
                reasoning: String::new(),
                answer: text,
            },
        };
        self.push_split(index, split);
    }

    fn push_split(&mut self, index: usize, split: Split) {
        let parsed = match &mut self.choices[index].calls {
            Some(calls) => calls.push(&split.answer),
            None => Parsed {
                content: split.answer,
                calls: Vec::new(),
            },
        };
        self.push_parsed(index, split.reasoning, parsed);
    }

    fn push_parsed(&mut self, index: usize, reasoning: String, parsed: Parsed) {
        if !parsed.content.is_empty() || !reasoning.is_empty() {
            let choice = &mut self.choices[index];
            self.pending.push_back(Output::Text {
                index,
                text: parsed.content,
                reasoning,
                logprobs: std::mem::take(&mut choice.logprobs),
                ids: std::mem::take(&mut choice.ids),
            });
        }
        if !parsed.calls.is_empty() {
            self.pending.push_back(Output::Calls {
                index,
                calls: parsed.calls,
            });
        }
    }

    fn finish(&mut self, index: usize, reason: &'static str, stop_string: Option<String>) {
        // What the splits still hold ends the text, however the choice ended (a stop string
        // may cut the output at a marker's beginning).
        if let Some(held) = self.choices[index].split.as_mut().map(ReasoningSplit::finish) {
            self.push_split(index, held);
        }
        let mut reason = reason;
        if let Some(calls) = &mut self.choices[index].calls {
            let held = calls.finish();
            // A choice that called tools and ended on its own is waiting for their results.
            if calls.called() && reason == "stop" {
                reason = "tool_calls";
            }
            self.push_parsed(index, String::new(), held);
        }
        let choice = &mut self.choices[index];
        if !choice.logprobs.is_empty() || (self.info.return_token_ids && !choice.ids.is_empty()) {
            // Tokens whose text was held back (a stop string's start, a partial character,
            // the stop token).
            self.pending.push_back(Output::Text {
                index,
                text: String::new(),
                reasoning: String::new(),
                logprobs: std::mem::take(&mut choice.logprobs),
                ids: std::mem::take(&mut choice.ids),
            });
        }
        self.pending.push_back(Output::Finish {
            index,
            reason,
            stop_string,
            stop_token: choice.stop_token,
        });
        // Stop listening: the engine aborts the sequence if it still runs (a stop string).
        choice.done = true;
        choice.events.close();
        if self.is_over() {
            self.record_latency();
        }
    }

    fn fail(&mut self, message: String) {
        self.pending.push_back(Output::Error(message));
        self.failed = true;
        for choice in &mut self.choices {
            choice.done = true;
            choice.events.close();
        }
    }

    fn record_latency(&self) {
        let m = &self.info.app.metrics;
        let now = Instant::now();
        m.e2e.observe((now - self.info.started).as_secs_f64());
        if let Some(first) = self.first_token_at {
            m.ttft.observe((first - self.info.started).as_secs_f64());
            let per_choice = self.completion_tokens / self.choices.len();
            if per_choice > 1 {
                m.tpot.observe((now - first).as_secs_f64() / (per_choice - 1) as f64);
            }
        }
    }

    pub fn prompt_tokens(&self) -> usize {
        self.info.prompt_tokens
    }

    /// Tokens generated over all choices (stop tokens included, as vLLM counts them).
    pub fn completion_tokens(&self) -> usize {
        self.completion_tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reasoning::ReasoningParser;
    use crate::tool_parser::CallFormat;
    use models::{Family, Tokenizer};
    use std::sync::atomic::AtomicU64;

    /// The tiny Gemma 4 GGUF's tokenizer (`tests/fixtures/gguf-tiny/tiny_gemma4_vocab.py`:
    /// `<|channel>` is a token of its own, the rest spelled from pieces and bytes).
    fn tokenizer() -> Tokenizer {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/gguf-tiny/gemma4_kv_shared.gguf");
        Tokenizer::from_gguf(&models::gguf::GgufFile::open(&path).unwrap()).unwrap()
    }

    /// A chat request of one choice whose engine produces `text`'s tokens one by one, then
    /// stops: its outputs.
    fn outputs(parser: ReasoningParser, inside: bool, text: &str) -> Vec<Output> {
        outputs_stopping_at(parser, inside, text, &[])
    }

    /// The same, with stop strings.
    fn outputs_stopping_at(parser: ReasoningParser, inside: bool, text: &str, stops: &[&str]) -> Vec<Output> {
        outputs_calling(parser, inside, text, stops, None)
    }

    /// The same, the answer free to call `auto`'s tools in Gemma 4's format.
    fn outputs_calling(
        parser: ReasoningParser,
        inside: bool,
        text: &str,
        stops: &[&str],
        auto: Option<ToolCalling>,
    ) -> Vec<Output> {
        let tokenizer = Arc::new(tokenizer());
        let ids = tokenizer.encode(text, false).unwrap();
        let (requests, _inbox) = mpsc::unbounded_channel();
        let app = Arc::new(AppState {
            model_name: "tiny".into(),
            tokenizer: tokenizer.clone(),
            context_length: 256,
            api_key: None,
            reasoning: parser.markers(Family::Gemma4),
            tool_calls: Some(CallFormat::Gemma4),
            structured: crate::structured::LazyStructuredOutputs::new(tokenizer.clone()),
            generation_defaults: Default::default(),
            priority_scheduling: false,
            seeds: crate::request::RequestSeeds::new(0),
            silent_special_tokens: Default::default(),
            requests,
            metrics: Default::default(),
            next_id: AtomicU64::new(0),
        });
        let info = RequestInfo {
            reasoning: app.reasoning.map(|m| (m, inside)),
            app,
            id: "chatcmpl-0".into(),
            created: 0,
            endpoint: Endpoint::Chat,
            stream: true,
            include_usage: false,
            continuous_usage: false,
            skip_special_tokens: true,
            logprobs: None,
            return_token_ids: false,
            tokens_as_ids: false,
            prompt: PromptReport::default(),
            stop_strings: stops.iter().map(|s| s.to_string()).collect(),
            include_stop_str: false,
            min_tokens: 0,
            stop_tokens: Vec::new(),
            prompt_tokens: 1,
            tool_calling: auto,
            started: Instant::now(),
        };
        let (events, receiver) = mpsc::unbounded_channel();
        for id in ids {
            events.send(Event::Token(id, None)).unwrap();
        }
        events.send(Event::Finished(FinishReason::Stop)).unwrap();
        let mut generation = Generation::new(info, vec![receiver]);
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(async {
            let mut out = Vec::new();
            while let Some(o) = generation.next().await {
                out.push(o);
            }
            out
        })
    }

    /// The reasoning and the answer the outputs carry, each whole.
    fn texts(outputs: &[Output]) -> (String, String) {
        let (mut reasoning, mut answer) = (String::new(), String::new());
        for o in outputs {
            if let Output::Text { text, reasoning: r, .. } = o {
                reasoning += r;
                answer += text;
            }
        }
        (reasoning, answer)
    }

    /// Token by token, Gemma 4's thought channel becomes reasoning and what follows it the
    /// answer, the markers in neither; without a parser, the text is the model's own.
    #[test]
    fn a_chat_answer_is_split_from_its_reasoning_token_by_token() {
        let text = "<|channel>thought\nthe cat sat\n<channel|>hello there.";
        let split = outputs(ReasoningParser::Auto, false, text);
        assert_eq!(texts(&split), ("the cat sat\n".into(), "hello there.".into()));
        assert!(split.len() > 3, "streamed in pieces");
        let whole = outputs(ReasoningParser::None, false, text);
        assert_eq!(texts(&whole), (String::new(), text.into()));
        // A prompt that opened the channel: the output starts inside it.
        let inside = outputs(ReasoningParser::Auto, true, "the mat<channel|>the end");
        assert_eq!(texts(&inside), ("the mat".into(), "the end".into()));
    }

    /// A stop string right after the start of a marker ends the output there: what the split
    /// held back is released, as the answer it turned out to be.
    #[test]
    fn a_stop_string_releases_what_the_split_held() {
        let stopped = outputs_stopping_at(ReasoningParser::Auto, false, "<|channel>thdog", &["dog"]);
        assert_eq!(texts(&stopped), (String::new(), "<|channel>th".into()));
        let stopped = outputs_stopping_at(ReasoningParser::Auto, true, "a cat<chandog", &["dog"]);
        assert_eq!(texts(&stopped), ("a cat<chan".into(), String::new()));
    }

    /// With `tool_choice` auto, a call in the model's format after its reasoning becomes a
    /// call, out of the text, and the choice finishes for its results; without it, the text is
    /// as written.
    #[test]
    fn calls_in_the_models_format_are_parsed_out_of_the_answer() {
        let auto = ToolCalling::Auto {
            tools: Vec::new(),
            one_call: false,
        };
        let text = "<|channel>thought\nask it<channel|>Checking. <|tool_call>call:weather{city:<|\"|>Oslo<|\"|>,days:2}<tool_call|>";
        let out = outputs_calling(ReasoningParser::Auto, false, text, &[], Some(auto));
        assert_eq!(texts(&out), ("ask it".into(), "Checking.".into()));
        let calls: Vec<&ToolCall> = out
            .iter()
            .flat_map(|o| match o {
                Output::Calls { calls, .. } => calls.iter().collect(),
                _ => Vec::new(),
            })
            .collect();
        assert_eq!(
            calls,
            [&ToolCall {
                name: "weather".into(),
                arguments: r#"{"city":"Oslo","days":2}"#.into()
            }]
        );
        assert!(matches!(
            out.last(),
            Some(Output::Finish {
                reason: "tool_calls",
                ..
            })
        ));
        let plain = outputs(ReasoningParser::Auto, false, text);
        assert!(texts(&plain).1.ends_with("<tool_call|>"));
        assert!(matches!(plain.last(), Some(Output::Finish { reason: "stop", .. })));
    }
}
