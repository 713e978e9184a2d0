//! What a request asks of its sequences' logits before each token is chosen, beyond sampling
//! settings: its structured output's grammar (compiled once, a copy per sequence),
//! `logit_bias`, `min_tokens`, `allowed_token_ids` and `bad_words`, checked against the model
//! here and handed to the engine as logits processors.

use super::error::ApiError;
use super::reasoning::Markers;
use super::request::GenerationRequest;
use super::structured::LazyStructuredOutputs;
use crate::grammar::{GrammarConstraint, Reasoning};
use axum::http::StatusCode;
use llguidance::Matcher;
use models::Tokenizer;
use runtime::serving::{AllowedTokens, BadWords, LogitBias, LogitsProcessor, MinTokens};

/// A request's logits processing, ready to be copied to each of its sequences.
pub struct Processing {
    grammar: Option<Grammar>,
    logit_bias: Vec<(u32, f32)>,
    min_tokens: usize,
    stop_tokens: Vec<u32>,
    allowed_token_ids: Option<Vec<u32>>,
    /// The bad words as the token sequences that spell them.
    bad_words: Vec<Vec<u32>>,
}

/// A compiled grammar at the start of the output.
struct Grammar {
    matcher: Matcher,
    /// What may follow a complete output: the request's stop tokens and the model's EOS.
    ends: Vec<u32>,
    /// Where the output stands to the model's reasoning at its start.
    reasoning: Reasoning,
}

impl Processing {
    /// `request`'s processing, its stop tokens `stop_tokens`; `reasoning`: the model's
    /// reasoning markers and whether the prompt opened its reasoning.
    pub async fn of(
        request: &GenerationRequest,
        tokenizer: &Tokenizer,
        structured: &LazyStructuredOutputs,
        stop_tokens: &[u32],
        reasoning: Option<(Markers, bool)>,
    ) -> Result<Self, ApiError> {
        // Only where asked, and once: the tokenizer counts its vocabulary over a copy of it.
        let vocab = match request.logit_bias.is_empty() && request.allowed_token_ids.is_none() {
            true => 0,
            false => tokenizer.vocab_size(),
        };
        if let Some((id, _)) = request.logit_bias.iter().find(|(id, _)| *id as usize >= vocab) {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("token id {id} in `logit_bias` is outside the vocabulary"),
            ));
        }
        let allowed = request.allowed_token_ids.iter().flatten();
        if let Some(id) = allowed.clone().find(|&&id| id as usize >= vocab) {
            return Err(ApiError::invalid(
                "allowed_token_ids",
                format!("token id {id} in `allowed_token_ids` is outside the vocabulary"),
            ));
        }
        let grammar = match &request.structured {
            Some(spec) => {
                // The grammar shapes the answer after the reasoning: from the end marker where
                // the prompt opened the reasoning, and where it did not, the model may open it
                // itself with the start marker first.
                let encode = |text: &str| {
                    tokenizer
                        .encode(text, false)
                        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
                };
                let reasoning = match reasoning {
                    None => Reasoning::None,
                    Some((markers, true)) => Reasoning::inside(encode(markers.end)?),
                    Some((markers, false)) => Reasoning::MayOpen {
                        start: encode(markers.start)?,
                        end: encode(markers.end)?,
                    },
                };
                let matcher = structured.matcher(spec).await?;
                Some(Grammar {
                    matcher,
                    ends: stop_tokens.iter().chain(&tokenizer.eos).copied().collect(),
                    reasoning,
                })
            }
            None => None,
        };
        Ok(Self {
            grammar,
            logit_bias: request.logit_bias.clone(),
            min_tokens: request.min_tokens,
            stop_tokens: stop_tokens.to_vec(),
            allowed_token_ids: request.allowed_token_ids.clone(),
            bad_words: bad_word_tokens(&request.bad_words, tokenizer)?,
        })
    }

    /// The processors of one sequence, each at the start of its output.
    pub fn for_sequence(&self) -> Vec<Box<dyn LogitsProcessor>> {
        let mut processors: Vec<Box<dyn LogitsProcessor>> = Vec::new();
        if let Some(g) = &self.grammar {
            let (matcher, ends) = (g.matcher.deep_clone(), g.ends.clone());
            processors.push(Box::new(GrammarConstraint::new(matcher, ends, g.reasoning.clone())));
        }
        if !self.logit_bias.is_empty() {
            processors.push(Box::new(LogitBias(self.logit_bias.clone())));
        }
        if self.min_tokens > 0 {
            processors.push(Box::new(MinTokens::new(self.min_tokens, self.stop_tokens.clone())));
        }
        if let Some(ids) = &self.allowed_token_ids {
            processors.push(Box::new(AllowedTokens::new(ids.clone())));
        }
        if !self.bad_words.is_empty() {
            processors.push(Box::new(BadWords::new(self.bad_words.clone())));
        }
        processors
    }
}

/// Each bad word's tokens as vLLM finds them: the word (leading whitespace dropped) as it
/// tokenizes alone, and with a space before it where that gives a different first token and
/// as many tokens (the word in the middle of text, for tokenizers that fold the space into
/// the word's first token).
fn bad_word_tokens(words: &[String], tokenizer: &Tokenizer) -> Result<Vec<Vec<u32>>, ApiError> {
    let encode = |text: &str| {
        tokenizer
            .encode(text, false)
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
    };
    let mut sequences = Vec::new();
    for word in words {
        let alone = encode(word.trim_start())?;
        let spaced = encode(&format!(" {}", word.trim_start()))?;
        if spaced.len() == alone.len() && spaced.first() != alone.first() {
            sequences.push(spaced);
        }
        sequences.push(alone);
    }
    Ok(sequences)
}
