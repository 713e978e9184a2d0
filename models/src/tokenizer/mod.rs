//! Tokenizers, through the `tokenizers` crate: loaded from `tokenizer.json`, or built from a
//! GGUF file's `tokenizer.ggml.*` metadata ([`gguf`]). Chat templates are in [`chat`], the
//! decoding of a generated stream in [`stream`].

pub mod chat;
mod gguf;
mod stream;

use crate::error::{io_error, ModelError, Result};
use std::path::Path;

pub use chat::{ChatMessage, ChatTemplate};
pub use stream::StreamDecoder;

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
    /// Replaces the chat template (vLLM's `--chat-template`): one that does not render a
    /// user's turn is refused now rather than at the first chat request.
    pub fn set_chat_template(&mut self, source: &str) -> Result<()> {
        let template = match &self.chat_template {
            Some(own) => own.with_source(source),
            None => ChatTemplate::new(source, &self.inner, self.bos, self.eos.first().copied()),
        };
        template.render(&[ChatMessage::new("user", "Hello")], true)?;
        self.chat_template = Some(template);
        Ok(())
    }

    pub fn from_gguf(file: &crate::gguf::GgufFile) -> Result<Self> {
        gguf::build(file)
    }

    /// The tokenizer `path` holds: a GGUF file's (from its metadata), or an HF
    /// `tokenizer.json` read with the files beside it (see [`from_hf_dir`](Self::from_hf_dir)),
    /// or a directory holding one.
    pub fn from_file(path: &Path) -> Result<Self> {
        if path.is_dir() {
            return Self::from_hf_dir(path);
        }
        match path.extension().is_some_and(|e| e == "gguf") {
            true => Self::from_gguf(&crate::gguf::GgufFile::open(path)?),
            false => Self::from_hf_dir(path.parent().unwrap_or(Path::new("."))),
        }
    }

    /// An HF directory's `tokenizer.json`, with BOS/EOS and chat template from
    /// `tokenizer_config.json` (and `generation_config.json`'s EOS ids) when present. As
    /// transformers reads such a directory: a `chat_template.jinja` beside them is the chat
    /// template (what `save_pretrained` has written since 4.43), and without `add_bos_token`
    /// the prompt starts with BOS where `tokenizer.json`'s post-processor puts it there.
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
        let add_bos = match config
            .as_ref()
            .and_then(|c| c.get("add_bos_token"))
            .and_then(|v| v.as_bool())
        {
            Some(add) => add,
            None => post_processor_adds(&inner, bos)?,
        };
        let chat_template = chat_template_source(dir, config.as_ref())?
            .map(|t| ChatTemplate::new(&t, &inner, bos, eos.first().copied()));
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

    /// The special tokens (added tokens marked special; a GGUF file's control tokens), which
    /// servers leave out of output text by default (`skip_special_tokens`).
    pub fn special_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Tokens in the vocabulary, added ones included. Not cheap: `tokenizers` counts them over
    /// a copy of the vocabulary map, so ask once, not per token.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The tokenizer as HF's `tokenizer.json` has it (also for one built from GGUF metadata):
    /// what tools that read the vocabulary's bytes (a grammar engine) take.
    pub fn hf_json(&self) -> Result<serde_json::Value> {
        let text = self
            .inner
            .to_string(false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        serde_json::from_str(&text).map_err(|e| ModelError::Tokenizer(e.to_string()))
    }
}

/// Whether `tokenizer.json`'s post-processor starts an encoding with `bos`.
fn post_processor_adds(inner: &tokenizers::Tokenizer, bos: Option<u32>) -> Result<bool> {
    let Some(bos) = bos else {
        return Ok(false);
    };
    let enc = inner
        .encode("a", true)
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    Ok(enc.get_ids().first() == Some(&bos))
}

/// The chat template's source: `chat_template.jinja` where the directory has one, else
/// `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates, of which
/// the one named `default`).
fn chat_template_source(dir: &Path, config: Option<&serde_json::Value>) -> Result<Option<String>> {
    let file = dir.join("chat_template.jinja");
    if file.exists() {
        return std::fs::read_to_string(&file).map(Some).map_err(|e| io_error(&file, e));
    }
    let Some(template) = config.and_then(|c| c.get("chat_template")) else {
        return Ok(None);
    };
    Ok(match template {
        serde_json::Value::String(source) => Some(source.clone()),
        serde_json::Value::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template")?.as_str())
            .map(str::to_string),
        _ => None,
    })
}

pub(crate) fn read_json_if_present(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| io_error(path, e))?;
    serde_json::from_str(&text).map(Some).map_err(|e| ModelError::Config {
        path: path.to_path_buf(),
        what: format!("invalid JSON: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A word-level `tokenizer.json` whose post-processor puts `<bos>` first, as Gemma's does.
    const TOKENIZER_JSON: &str = r#"{
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [
            {"id": 1, "content": "<bos>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 2, "content": "<eos>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<bos>": {"id": "<bos>", "ids": [1], "tokens": ["<bos>"]}}
        },
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "<bos>": 1, "<eos>": 2, "hi": 3, "there": 4, "a": 5}, "unk_token": "<unk>"}
    }"#;

    fn dir_with(config: serde_json::Value, jinja: Option<&str>) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), TOKENIZER_JSON).unwrap();
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        if let Some(source) = jinja {
            std::fs::write(dir.path().join("chat_template.jinja"), source).unwrap();
        }
        dir
    }

    #[test]
    fn bos_follows_the_post_processor_unless_the_config_says() {
        let config = serde_json::json!({"bos_token": "<bos>", "eos_token": "<eos>"});
        let t = Tokenizer::from_hf_dir(dir_with(config.clone(), None).path()).unwrap();
        assert!(t.add_bos);
        assert_eq!(t.encode("hi there", true).unwrap(), [1, 3, 4]);
        assert_eq!(t.encode("hi there", false).unwrap(), [3, 4]);
        let mut said = config;
        said["add_bos_token"] = false.into();
        let t = Tokenizer::from_hf_dir(dir_with(said, None).path()).unwrap();
        assert!(!t.add_bos);
        assert_eq!(t.encode("hi there", true).unwrap(), [3, 4]);
    }

    #[test]
    fn special_tokens_are_the_added_ones_marked_special() {
        let t = Tokenizer::from_hf_dir(dir_with(serde_json::json!({}), None).path()).unwrap();
        assert_eq!(t.special_ids(), [1, 2]);
    }

    #[test]
    fn the_chat_template_comes_from_its_file_first_then_the_config() {
        let source = |config: serde_json::Value, jinja| {
            let t = Tokenizer::from_hf_dir(dir_with(config, jinja).path()).unwrap();
            t.chat_template.map(|c| c.source().to_string())
        };
        let config = serde_json::json!({"chat_template": "from config"});
        assert_eq!(source(config.clone(), Some("from file")).as_deref(), Some("from file"));
        assert_eq!(source(config, None).as_deref(), Some("from config"));
        let named = serde_json::json!({"chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "plain"}
        ]});
        assert_eq!(source(named, None).as_deref(), Some("plain"));
        assert_eq!(source(serde_json::json!({}), None), None);
    }
}
