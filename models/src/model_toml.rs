//! `model.toml`: what to compile.
//!
//! ```toml
//! [model]
//! weights = "SmolLM2-135M-Instruct.Q4_1.gguf"  # a GGUF file or an HF directory; relative
//!                                              # paths are relative to this file
//! architecture = "llama"                       # optional: llama | gemma3 (detected when omitted)
//! dtype = "native"                             # optional: f32 | bf16 | native (default native)
//! context_length = 4096                        # optional: at most the model's own
//! tokenizer = "tokenizer.json"                 # optional: overrides the weights' tokenizer
//! ```
//!
//! Later sections (speculative decoding, serving limits) are added with the features that read
//! them; until then an unknown section or key is an error, so a typo never passes silently.

use crate::config::Family;
use crate::error::{io_error, ModelError, Result};
use crate::families::ComputeDtype;
use serde::Deserialize;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelToml {
    pub model: ModelSection,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    pub weights: PathBuf,
    pub architecture: Option<String>,
    pub dtype: Option<String>,
    pub context_length: Option<usize>,
    pub tokenizer: Option<PathBuf>,
}

/// A checked `model.toml` with paths resolved.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    pub weights: PathBuf,
    pub architecture: Option<Family>,
    pub dtype: ComputeDtype,
    pub context_length: Option<usize>,
    pub tokenizer: Option<PathBuf>,
}

impl ModelSpec {
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| io_error(path, e))?;
        Self::parse(&text, path)
    }

    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let bad = |what: String| ModelError::Config {
            path: path.to_path_buf(),
            what,
        };
        let parsed: ModelToml = toml::from_str(text).map_err(|e| bad(e.to_string().trim_end().to_string()))?;
        let m = parsed.model;
        let base = path.parent().unwrap_or(Path::new("."));
        let architecture = m
            .architecture
            .map(|a| {
                Family::parse(&a).ok_or_else(|| {
                    bad(format!(
                        "model.architecture `{a}` is not one of: llama, gemma3, gemma4, glm4_moe, glm_moe_dsa, qwen3_5, qwen3_next"
                    ))
                })
            })
            .transpose()?;
        let dtype = match m.dtype.as_deref() {
            None => ComputeDtype::Native,
            Some(d) => ComputeDtype::parse(d)
                .ok_or_else(|| bad(format!("model.dtype `{d}` is not one of: f32, bf16, native")))?,
        };
        if m.context_length == Some(0) {
            return Err(bad("model.context_length must be at least 1".into()));
        }
        Ok(Self {
            weights: base.join(m.weights),
            architecture,
            dtype,
            context_length: m.context_length,
            tokenizer: m.tokenizer.map(|t| base.join(t)),
        })
    }

    /// The spec for a weights path given directly (no model.toml).
    pub fn for_weights(weights: &Path) -> Self {
        Self {
            weights: weights.to_path_buf(),
            architecture: None,
            dtype: ComputeDtype::Native,
            context_length: None,
            tokenizer: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ModelSpec> {
        ModelSpec::parse(text, Path::new("/m/model.toml"))
    }

    #[test]
    fn paths_resolve_relative_to_the_file() {
        let spec = parse("[model]\nweights = \"w.gguf\"\ndtype = \"f32\"\n").unwrap();
        assert_eq!(spec.weights, Path::new("/m/w.gguf"));
        assert_eq!(spec.dtype, ComputeDtype::F32);
        assert_eq!(spec.architecture, None);
    }

    #[test]
    fn unknown_keys_are_errors_naming_the_key() {
        let err = parse("[model]\nweights = \"w.gguf\"\nweigths = 1\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("weigths") && err.contains("model.toml"), "{err}");
        let err = parse("[model]\nweights = \"w.gguf\"\n[serving]\nport = 1\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("serving"), "{err}");
    }

    #[test]
    fn bad_values_are_errors() {
        let err = parse("[model]\nweights = \"w\"\ndtype = \"f8\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("f8"), "{err}");
        let err = parse("[model]\nweights = \"w\"\narchitecture = \"gpt9\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("gpt9"), "{err}");
        assert!(parse("[model]\nweights = \"w\"\ncontext_length = 0\n").is_err());
        assert!(parse("[model]\nweights = 3\n").is_err());
        assert!(parse("").is_err());
    }
}
