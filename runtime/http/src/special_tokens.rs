//! Which special tokens write no text in an answer (vLLM's `skip_special_tokens`, on by
//! default): all of them, but those that spell part of a reasoning or tool-call marker. bbc
//! reads reasoning and calls out of the text (vLLM's parsers read token ids), so a marker
//! that is a special token (a GGUF file's control token, say) must reach it.

use super::{reasoning, tool_parser};
use models::Tokenizer;
use std::collections::HashSet;

/// The special tokens of `tokenizer` to keep out of answers.
pub fn silent(tokenizer: &Tokenizer) -> HashSet<u32> {
    let markers = reasoning::MARKER_TEXTS.iter().chain(&tool_parser::MARKER_TEXTS);
    tokenizer
        .special_ids()
        .into_iter()
        .filter(|&id| {
            let text = tokenizer.decode(&[id]).unwrap_or_default();
            text.is_empty() || !markers.clone().any(|marker| marker.contains(text.as_str()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A word-level tokenizer whose reasoning markers are special tokens, beside its EOS.
    const TOKENIZER_JSON: &str = r#"{
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [
            {"id": 1, "content": "<eos>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 2, "content": "<think>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 3, "content": "</think>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 4, "content": "<|channel>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 5, "content": "<tool_call>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": false}
        ],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "<eos>": 1, "<think>": 2, "</think>": 3, "<|channel>": 4, "<tool_call>": 5, "hi": 6}, "unk_token": "<unk>"}
    }"#;

    #[test]
    fn special_markers_stay_in_the_text_and_other_special_tokens_go() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), TOKENIZER_JSON).unwrap();
        let tokenizer = Tokenizer::from_hf_dir(dir.path()).unwrap();
        assert_eq!(tokenizer.special_ids(), [1, 2, 3, 4]);
        assert_eq!(silent(&tokenizer), HashSet::from([1]));
    }

    /// The tiny Gemma 4 GGUF's control tokens (turn markers, BOS, EOS, padding) are silenced.
    #[test]
    fn a_gguf_files_control_tokens_are_silenced() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/gguf-tiny/gemma4_kv_shared.gguf");
        let tokenizer = Tokenizer::from_gguf(&models::gguf::GgufFile::open(&path).unwrap()).unwrap();
        let silent = silent(&tokenizer);
        for token in ["<eos>", "<bos>", "<|turn>", "<turn|>"] {
            let id = tokenizer.token_to_id(token).unwrap();
            assert!(silent.contains(&id), "{token}");
        }
        for token in ["<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>"] {
            if let Some(id) = tokenizer.token_to_id(token) {
                assert!(!silent.contains(&id), "{token} must reach the text");
            }
        }
    }
}
