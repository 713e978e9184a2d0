//! Tokenizers, through the `tokenizers` crate: loaded from `tokenizer.json`, or built from a
//! GGUF file's `tokenizer.ggml.*` metadata ([`gguf`]). Chat templates are in [`chat`].

pub mod chat;
mod gguf;

use crate::error::{io_error, ModelError, Result};
use std::path::Path;

pub use chat::{ChatMessage, ChatTemplate};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    pub bos: Option<u32>,
    /// Tokens that end generation (the model's EOS, plus its end-of-turn token when it has one).
    pub eos: Vec<u32>,
    /// Whether encoding a prompt prepends BOS (Gemma: yes; SmolLM2: no).
    pub add_bos: bool,
    pub chat_template: Option<ChatTemplate>,
}

impl Tokenizer {
    pub fn from_gguf(file: &crate::gguf::GgufFile) -> Result<Self> {
        gguf::build(file)
    }

    /// An HF directory's `tokenizer.json`, with BOS/EOS and chat template from
    /// `tokenizer_config.json` (and `generation_config.json`'s EOS ids) when present.
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))?;
        let config = read_json_if_present(&dir.join("tokenizer_config.json"))?;
        let token_id = |key: &str| -> Option<u32> {
            let v = config.as_ref()?.get(key)?;
            let text = v.as_str().or_else(|| v.get("content")?.as_str())?;
            inner.token_to_id(text)
        };
        let bos = token_id("bos_token");
        let mut eos: Vec<u32> = token_id("eos_token").into_iter().collect();
        if let Some(gen) = read_json_if_present(&dir.join("generation_config.json"))? {
            match gen.get("eos_token_id") {
                Some(serde_json::Value::Array(ids)) => {
                    eos.extend(ids.iter().filter_map(|v| v.as_u64()).map(|v| v as u32))
                }
                Some(v) => eos.extend(v.as_u64().map(|v| v as u32)),
                None => {}
            }
        }
        eos.sort_unstable();
        eos.dedup();
        let add_bos = config
            .as_ref()
            .and_then(|c| c.get("add_bos_token"))
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        let chat_template = config
            .as_ref()
            .and_then(|c| c.get("chat_template"))
            .and_then(|v| v.as_str())
            .map(|t| ChatTemplate::new(t, &inner, bos, eos.first().copied()));
        Ok(Self {
            inner,
            bos,
            eos,
            add_bos,
            chat_template,
        })
    }

    /// Token ids of `text`. With `add_special`, the model's BOS is prepended when it asks for one.
    /// Special-token text (e.g. `<|im_start|>`) in `text` becomes its token either way.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_special && self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Text of `ids`, special tokens included (so a chat transcript reads back whole).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}

fn read_json_if_present(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| io_error(path, e))?;
    serde_json::from_str(&text).map(Some).map_err(|e| ModelError::Config {
        path: path.to_path_buf(),
        what: format!("invalid JSON: {e}"),
    })
}

/// Decodes a growing token stream into text pieces without ever splitting a UTF-8 character:
/// text is released only once the decoded prefix is stable and does not end in a partial
/// character (shown by the decoder as U+FFFD).
pub struct StreamDecoder {
    ids: Vec<u32>,
    emitted: usize,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self {
            ids: Vec::new(),
            emitted: 0,
        }
    }

    /// Add one token; returns the new text it completes (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let text = tokenizer.decode(&self.ids)?;
        if text.ends_with('\u{FFFD}') || text.len() < self.emitted || !text.is_char_boundary(self.emitted) {
            return Ok(String::new());
        }
        let piece = text[self.emitted..].to_string();
        self.emitted = text.len();
        Ok(piece)
    }

    /// Whatever is left at the end of the stream (a trailing partial character included).
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String> {
        let text = tokenizer.decode(&self.ids)?;
        let piece = text.get(self.emitted..).unwrap_or_default().to_string();
        self.emitted = text.len();
        Ok(piece)
    }
}

impl Default for StreamDecoder {
    fn default() -> Self {
        Self::new()
    }
}
