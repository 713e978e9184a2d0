//! Turning a request's generated tokens into the text a client sees: incremental decoding that
//! never splits a UTF-8 character (special tokens writing nothing where the request skips
//! them), and stop strings matched across token boundaries. Text that might be the start of a
//! stop string is held back until it is known not to be, so a stop string is never emitted,
//! not even in part.

use models::{StreamDecoder, Tokenizer};
use std::collections::HashSet;
use std::sync::Arc;

pub struct TextOutput {
    decoder: StreamDecoder,
    stops: Vec<String>,
    /// Decoded text not yet released (a possible stop-string prefix).
    held: String,
    stopped: bool,
    /// The stop string that ended the text, once one has.
    matched: Option<String>,
    /// Tokens still to come before stop strings count (vLLM's `min_tokens`): their text is
    /// released as it comes, and a stop string must end after them.
    unchecked: usize,
    /// Whether the stop string that ends the text is part of it (vLLM's
    /// `include_stop_str_in_output`).
    includes_stop: bool,
    /// Tokens that write no text (special tokens, under vLLM's `skip_special_tokens`).
    silent: Arc<HashSet<u32>>,
}

/// What one token released.
#[derive(Debug, Default, PartialEq)]
pub struct Piece {
    pub text: String,
    /// A stop string was completed: generation must end here.
    pub stopped: bool,
}

impl TextOutput {
    /// Text whose stop strings count only after its first `min_tokens` tokens.
    pub fn after(min_tokens: usize, stops: Vec<String>) -> Self {
        Self {
            decoder: StreamDecoder::new(),
            stops,
            held: String::new(),
            stopped: false,
            matched: None,
            unchecked: min_tokens,
            includes_stop: false,
            silent: Arc::default(),
        }
    }

    /// The same, `silent` tokens writing nothing (they still count towards `min_tokens`).
    pub fn silencing(self, silent: Arc<HashSet<u32>>) -> Self {
        Self { silent, ..self }
    }

    /// The same, the stop string that ends the text kept at its end.
    pub fn including_stop(self) -> Self {
        Self {
            includes_stop: true,
            ..self
        }
    }

    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> models::Result<Piece> {
        if self.stopped {
            return Ok(Piece::default());
        }
        let piece = match self.silent.contains(&id) {
            true => String::new(),
            false => self.decoder.push(tokenizer, id)?,
        };
        if self.unchecked > 0 {
            self.unchecked -= 1;
            return Ok(Piece {
                text: piece,
                stopped: false,
            });
        }
        Ok(self.release(&piece))
    }

    /// The stop string that ended the text, if one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// The rest at the end of generation.
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> models::Result<String> {
        if self.stopped {
            return Ok(String::new());
        }
        let rest = self.decoder.finish(tokenizer)?;
        let piece = self.release(&rest);
        Ok(if piece.stopped {
            piece.text
        } else {
            piece.text + &std::mem::take(&mut self.held)
        })
    }

    fn release(&mut self, piece: &str) -> Piece {
        self.held.push_str(piece);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|&(at, _)| at);
        if let Some((at, stop)) = first {
            self.stopped = true;
            self.matched = Some(stop.clone());
            let end = if self.includes_stop { at + stop.len() } else { at };
            let text = self.held[..end].to_string();
            self.held.clear();
            return Piece { text, stopped: true };
        }
        let keep = self
            .stops
            .iter()
            .map(|stop| partial_match_len(&self.held, stop))
            .max()
            .unwrap_or(0);
        let text = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        Piece { text, stopped: false }
    }
}

/// Length of the longest end of `text` that begins `pattern` without being all of it: what
/// must be held back while `pattern` may still complete.
pub fn partial_match_len(text: &str, pattern: &str) -> usize {
    pattern
        .char_indices()
        .skip(1)
        .map(|(len, _)| len)
        .filter(|&len| text.ends_with(&pattern[..len]))
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds text pieces straight to the stop-string logic (the decoder is tested in `models`).
    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut out = TextOutput::after(0, stops.iter().map(|s| s.to_string()).collect());
        let mut text = String::new();
        for p in pieces {
            let piece = out.release(p);
            text += &piece.text;
            if piece.stopped {
                return (text, true);
            }
        }
        text += &out.held;
        (text, false)
    }

    #[test]
    fn a_stop_string_split_across_tokens_is_never_emitted() {
        assert_eq!(run(&["STOP"], &["ab", "cS", "TO", "Pxyz"]), ("abc".into(), true));
        assert_eq!(run(&["\n\n"], &["one\n", "\ntwo"]), ("one".into(), true));
    }

    #[test]
    fn a_false_start_is_released() {
        assert_eq!(run(&["STOP"], &["aST", "x", "b"]), ("aSTxb".into(), false));
        assert_eq!(run(&["ab", "xyz"], &["x", "y", "q"]), ("xyq".into(), false));
    }

    #[test]
    fn the_earliest_stop_wins_and_characters_stay_whole() {
        assert_eq!(run(&["é!", "b"], &["aé", "!b"]), ("a".into(), true));
        let mut out = TextOutput::after(0, vec!["b".into(), "é!".into()]);
        assert!(out.release("aé!b").stopped);
        assert_eq!(out.matched(), Some("é!"), "the one that ended the text");
        assert_eq!(run(&["éa"], &["xé", "b"]), ("xéb".into(), false));
    }

    /// With `include_stop_str_in_output`, the text ends with the stop string that ended it, and
    /// nothing after it.
    #[test]
    fn an_included_stop_string_ends_the_text() {
        let mut out = TextOutput::after(0, vec!["STOP".into(), "\n".into()]).including_stop();
        let texts: Vec<String> = ["ab", "cS", "TO", "Pxyz"].iter().map(|p| out.release(p).text).collect();
        assert_eq!(texts.concat(), "abcSTOP");
        assert_eq!(out.matched(), Some("STOP"));
    }
}
