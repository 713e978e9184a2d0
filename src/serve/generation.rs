//! One admitted request's progress, from the engine's events to what its client sees: per
//! choice (a request with `n` > 1 runs `n` sequences) the text pieces, the log-probabilities of
//! the tokens behind them, and how each choice finished. Formatting is `response`'s job.

use super::http::AppState;
use super::request::Endpoint;
use super::text::TextOutput;
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
    /// A piece of choice `index`'s text, with the log-probabilities of the tokens consumed since
    /// its last piece (empty unless asked for).
    Text {
        index: usize,
        text: String,
        logprobs: Vec<(u32, TokenLogprobs)>,
    },
    Finish {
        index: usize,
        reason: &'static str,
    },
    /// The engine failed: the whole request ends.
    Error(String),
}

/// One sequence of the request.
struct Choice {
    /// Dropping or closing this aborts the sequence (the engine sees the channel closed).
    events: mpsc::UnboundedReceiver<Event>,
    text: TextOutput,
    /// Log-probabilities of tokens not yet attached to a piece of text.
    logprobs: Vec<(u32, TokenLogprobs)>,
    done: bool,
}

/// What a request asked for, fixed at admission.
pub struct RequestInfo {
    pub app: Arc<AppState>,
    pub id: String,
    pub created: u64,
    pub endpoint: Endpoint,
    pub stream: bool,
    pub include_usage: bool,
    pub want_logprobs: bool,
    pub stop_strings: Vec<String>,
    pub stop_tokens: Vec<u32>,
    pub prompt_tokens: usize,
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

impl Generation {
    pub fn new(info: RequestInfo, events: Vec<mpsc::UnboundedReceiver<Event>>) -> Self {
        let choices = events
            .into_iter()
            .map(|events| Choice {
                events,
                text: TextOutput::new(info.stop_strings.clone()),
                logprobs: Vec::new(),
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
        match event {
            Some(Event::Token(token, logprobs)) => {
                self.completion_tokens += 1;
                self.first_token_at.get_or_insert_with(Instant::now);
                if self.info.stop_tokens.contains(&token) {
                    return; // Finished(Stop) follows; the stop token is not text.
                }
                let choice = &mut self.choices[index];
                choice.logprobs.extend(logprobs.map(|lp| (token, lp)));
                match choice.text.push(&self.info.app.tokenizer, token) {
                    Ok(piece) => {
                        self.push_text(index, piece.text);
                        if piece.stopped {
                            self.finish(index, "stop");
                        }
                    }
                    Err(e) => self.fail(format!("detokenizing: {e}")),
                }
            }
            Some(Event::Finished(reason)) => match self.choices[index].text.finish(&self.info.app.tokenizer) {
                Ok(rest) => {
                    self.push_text(index, rest);
                    let reason = match reason {
                        FinishReason::Stop => "stop",
                        FinishReason::Length => "length",
                    };
                    self.finish(index, reason);
                }
                Err(e) => self.fail(format!("detokenizing: {e}")),
            },
            Some(Event::Failed(message)) => self.fail(message),
            None => self.fail("the engine dropped the request".into()),
        }
    }

    fn push_text(&mut self, index: usize, text: String) {
        if !text.is_empty() {
            let logprobs = std::mem::take(&mut self.choices[index].logprobs);
            self.pending.push_back(Output::Text { index, text, logprobs });
        }
    }

    fn finish(&mut self, index: usize, reason: &'static str) {
        let choice = &mut self.choices[index];
        if !choice.logprobs.is_empty() {
            // Tokens whose text was held back (a stop string's start, a partial character).
            let logprobs = std::mem::take(&mut choice.logprobs);
            self.pending.push_back(Output::Text {
                index,
                text: String::new(),
                logprobs,
            });
        }
        self.pending.push_back(Output::Finish { index, reason });
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
