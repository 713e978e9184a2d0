//! Decoding a growing token stream into text pieces, as a server streams an answer.
//!
//! Each token decodes a short window, not the whole answer: the tokens released last (their
//! text is known) and those after them. The new piece is what the window's text adds to the
//! text of its first part. Decoding the whole answer each token costs time in its length (at
//! 4096 tokens about 0.25 ms a token for SmolLM2 and 0.44 for Gemma 3, `benches/detokenize.rs`);
//! a window costs the same at every length. The window starts a token boundary back, not at
//! the new token, because a token's text depends on what is before it: a SentencePiece word's
//! leading space is dropped at the start of a text, and bytes of one character may come in
//! several tokens. Text is released only once it does not end in a partial character (shown
//! by the decoder as U+FFFD); `finish` releases the rest.

use super::Tokenizer;
use crate::error::Result;

pub struct StreamDecoder {
    /// The window: the tokens whose text was released last (context), then those not yet
    /// released.
    window: Vec<u32>,
    /// How many of `window`'s tokens are context.
    context: usize,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self {
            window: Vec::new(),
            context: 0,
        }
    }

    /// Add one token; returns the new text it completes (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        self.window.push(id);
        let text = tokenizer.decode(&self.window)?;
        if text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let Some(piece) = self.new_text(tokenizer, &text)? else {
            return Ok(String::new());
        };
        // The tokens just released become the next window's context.
        self.window.drain(..self.context);
        self.context = self.window.len();
        Ok(piece)
    }

    /// Whatever is left at the end of the stream (a trailing partial character included).
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String> {
        let text = tokenizer.decode(&self.window)?;
        let piece = self.new_text(tokenizer, &text)?.unwrap_or_default();
        self.window.clear();
        self.context = 0;
        Ok(piece)
    }

    /// What `text` (the window's) adds to the context's text; `None` where it does not extend
    /// it at a character boundary (a decoder that rewrites text before a new token: nothing is
    /// released until the window's text extends the context's again).
    fn new_text(&self, tokenizer: &Tokenizer, text: &str) -> Result<Option<String>> {
        let context = tokenizer.decode(&self.window[..self.context])?;
        Ok(text
            .strip_prefix(context.as_str())
            .or_else(|| text.get(context.len()..))
            .map(str::to_string))
    }
}

impl Default for StreamDecoder {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tokenizer whose decoder drops the space of a text's first `▁` (SentencePiece's
    /// Metaspace, as Llama 2's `tokenizer.json` has it), or with no decoder at all (tokens
    /// joined by spaces).
    fn tokenizer(decoder: &str) -> Tokenizer {
        let json = format!(
            r#"{{
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {decoder},
            "model": {{"type": "WordLevel", "vocab": {{"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}}, "unk_token": "<unk>"}}
        }}"#
        );
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), json).unwrap();
        Tokenizer::from_hf_dir(dir.path()).unwrap()
    }

    fn streamed(tokenizer: &Tokenizer, ids: &[u32]) -> Vec<String> {
        let mut decoder = StreamDecoder::new();
        let mut pieces: Vec<String> = ids.iter().map(|&id| decoder.push(tokenizer, id).unwrap()).collect();
        pieces.push(decoder.finish(tokenizer).unwrap());
        pieces
    }

    /// Each token is read after the one before it: its text is what it adds there, not what it
    /// decodes to alone (`▁world` alone is "world").
    #[test]
    fn a_token_decodes_after_the_tokens_before_it() {
        let metaspace =
            tokenizer(r#"{"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true}"#);
        assert_eq!(metaspace.decode(&[2]).unwrap(), "world");
        assert_eq!(
            streamed(&metaspace, &[1, 2, 2, 3]),
            ["Hello", " world", " world", "!", ""]
        );
        let joined = tokenizer("null");
        assert_eq!(streamed(&joined, &[1, 2, 3]), ["▁Hello", " ▁world", " !", ""]);
    }

    /// The window stays short however long the answer: released tokens leave it.
    #[test]
    fn released_tokens_leave_the_window() {
        let metaspace =
            tokenizer(r#"{"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true}"#);
        let mut decoder = StreamDecoder::new();
        for _ in 0..100 {
            decoder.push(&metaspace, 2).unwrap();
        }
        assert_eq!((decoder.window.len(), decoder.context), (1, 1));
    }
}
