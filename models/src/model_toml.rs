//! `model.toml`: what to compile.
//!
//! ```toml
//! [model]
//! weights = "SmolLM2-135M-Instruct.Q4_1.gguf"  # a GGUF file or an HF directory; relative
//!                                              # paths are relative to this file
//! architecture = "llama"                       # optional: llama | gemma3 (detected when omitted)
//! dtype = "native"                             # optional: f32 | bf16 | f16 | native (default)
//! kv_cache_dtype = "auto"                      # optional: auto | f32 | bf16 | f16 | fp8 (auto: the
//!                                              # dtype's; native: f16 for quantized blocks)
//! context_length = 4096                        # optional: at most the model's own
//! tokenizer = "tokenizer.json"                 # optional: overrides the weights' tokenizer
//! quantization = "fp8"                         # optional: what the weights must be quantized
//!                                              # as; a checkpoint of floats is quantized as it
//!                                              # loads (fp8 only; vLLM's `--quantization`)
//!
//! [speculative]                                # optional: speculative decoding in `bbc serve`
//! method = "ngram"                             # prompt lookup, "draft_model", "mtp" (the
//!                                              # checkpoint's multi-token prediction layers),
//!                                              # or "eagle" / "eagle3" (an EAGLE head)
//! num_speculative_tokens = 4                   # drafted tokens a step at most
//! prompt_lookup_min = 2                        # optional (ngram): shortest match (default 2)
//! prompt_lookup_max = 4                        # optional (ngram): longest match (default 4)
//! # model = "draft.gguf"                       # draft_model: weights (relative to this file),
//!                                              # a model.toml or a model name, sharing the
//!                                              # tokenizer; eagle, eagle3: the head's directory
//! ```
//!
//! An unknown section or key is an error, so a typo never passes silently.

use crate::config::Family;
use crate::error::{io_error, ModelError, Result};
use crate::families::{ComputeDtype, KvCacheDtype};
use serde::Deserialize;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelToml {
    pub model: ModelSection,
    pub speculative: Option<SpeculativeSection>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpeculativeSection {
    pub method: String,
    pub num_speculative_tokens: usize,
    pub prompt_lookup_min: Option<usize>,
    pub prompt_lookup_max: Option<usize>,
    pub model: Option<String>,
}

/// How `[speculative]` asks `bbc serve` to draft.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Speculative {
    /// Prompt lookup.
    Ngram(NgramSpec),
    /// A draft model.
    DraftModel(DraftModelSpec),
    /// The model's own multi-token prediction layers, `tokens` a step.
    Mtp { tokens: usize },
    /// An EAGLE head in a directory of its own, `tokens` a step.
    Eagle {
        method: crate::eagle::EagleMethod,
        dir: PathBuf,
        tokens: usize,
    },
}

/// Drafting with a draft model, as `[speculative]` asks for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraftModelSpec {
    /// A weights path (resolved against the model.toml's directory where it names a file or
    /// directory there), a model.toml, or a model name.
    pub model: String,
    pub tokens: usize,
}

/// Match lengths prompt lookup tries by default: single-token matches draft too often on free
/// text (SmolLM2 writing a story, 4 drafts a step at most: 30% of drafts accepted with
/// matches from 1 token, 57% from 2).
pub const DEFAULT_LOOKUP_MIN: usize = 2;
pub const DEFAULT_LOOKUP_MAX: usize = 4;

/// Prompt-lookup drafting, as `[speculative]` asks for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramSpec {
    pub tokens: usize,
    pub min: usize,
    pub max: usize,
}

impl NgramSpec {
    /// Checked: a match length of at least 1, `min ≤ max`.
    pub fn new(tokens: usize, min: usize, max: usize) -> std::result::Result<Self, String> {
        if min == 0 || min > max {
            return Err(format!(
                "prompt lookup needs 1 ≤ prompt_lookup_min ≤ prompt_lookup_max, got {min} and {max}"
            ));
        }
        Ok(Self { tokens, min, max })
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    pub weights: PathBuf,
    pub architecture: Option<String>,
    pub dtype: Option<String>,
    pub kv_cache_dtype: Option<String>,
    pub context_length: Option<usize>,
    pub tokenizer: Option<PathBuf>,
    pub quantization: Option<String>,
}

/// A checked `model.toml` with paths resolved.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    pub weights: PathBuf,
    pub architecture: Option<Family>,
    pub dtype: ComputeDtype,
    pub kv_cache_dtype: KvCacheDtype,
    pub context_length: Option<usize>,
    pub tokenizer: Option<PathBuf>,
    /// What the weights must be quantized as (vLLM's `--quantization`, checked or done as they
    /// load: `WeightSource::quantize_as`).
    pub quantization: Option<String>,
    /// `[speculative]`, where the file has it.
    pub speculative: Option<Speculative>,
    /// Where `weights` is a `config.json`: the model runs with random weights made from this
    /// seed (vLLM's `--load-format dummy`), not read from a file.
    pub random_weights: Option<u32>,
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
                .ok_or_else(|| bad(format!("model.dtype `{d}` is not one of: {}", ComputeDtype::choices())))?,
        };
        let kv_cache_dtype = match m.kv_cache_dtype.as_deref() {
            None => KvCacheDtype::Auto,
            Some(d) => KvCacheDtype::parse(d).ok_or_else(|| {
                bad(format!(
                    "model.kv_cache_dtype `{d}` is not one of: {}",
                    KvCacheDtype::choices()
                ))
            })?,
        };
        if m.context_length == Some(0) {
            return Err(bad("model.context_length must be at least 1".into()));
        }
        let speculative = match parsed.speculative {
            None => None,
            Some(s) if s.method == "ngram" => {
                if s.model.is_some() {
                    return Err(bad("speculative.model is the draft_model method's, not ngram's".into()));
                }
                let spec = NgramSpec::new(
                    s.num_speculative_tokens,
                    s.prompt_lookup_min.unwrap_or(DEFAULT_LOOKUP_MIN),
                    s.prompt_lookup_max.unwrap_or(DEFAULT_LOOKUP_MAX),
                );
                Some(Speculative::Ngram(spec.map_err(|e| bad(format!("speculative: {e}")))?))
            }
            Some(s) if s.method == "draft_model" => {
                if s.prompt_lookup_min.is_some() || s.prompt_lookup_max.is_some() {
                    return Err(bad(
                        "speculative.prompt_lookup_min/max are the ngram method's, not draft_model's".into(),
                    ));
                }
                let model = s
                    .model
                    .ok_or_else(|| bad("speculative.method `draft_model` needs speculative.model".into()))?;
                if s.num_speculative_tokens == 0 {
                    return Err(bad("speculative.num_speculative_tokens must be at least 1".into()));
                }
                let local = base.join(&model);
                Some(Speculative::DraftModel(DraftModelSpec {
                    model: match local.exists() {
                        true => local.to_string_lossy().into_owned(),
                        false => model,
                    },
                    tokens: s.num_speculative_tokens,
                }))
            }
            Some(s) if s.method == "mtp" => {
                if s.model.is_some() || s.prompt_lookup_min.is_some() || s.prompt_lookup_max.is_some() {
                    return Err(bad(
                        "speculative.method `mtp` drafts with the model's own layers: it takes no model or prompt_lookup_min/max".into(),
                    ));
                }
                if s.num_speculative_tokens == 0 {
                    return Err(bad("speculative.num_speculative_tokens must be at least 1".into()));
                }
                Some(Speculative::Mtp {
                    tokens: s.num_speculative_tokens,
                })
            }
            Some(s) if crate::eagle::EagleMethod::parse(&s.method).is_some() => {
                let method = crate::eagle::EagleMethod::parse(&s.method).expect("an EAGLE method");
                if s.prompt_lookup_min.is_some() || s.prompt_lookup_max.is_some() {
                    return Err(bad(format!(
                        "speculative.prompt_lookup_min/max are the ngram method's, not {}'s",
                        s.method
                    )));
                }
                let model = s.model.ok_or_else(|| {
                    bad(format!(
                        "speculative.method `{}` needs speculative.model, the head's directory",
                        s.method
                    ))
                })?;
                if s.num_speculative_tokens == 0 {
                    return Err(bad("speculative.num_speculative_tokens must be at least 1".into()));
                }
                Some(Speculative::Eagle {
                    method,
                    dir: base.join(model),
                    tokens: s.num_speculative_tokens,
                })
            }
            Some(s) => {
                return Err(bad(format!(
                    "speculative.method `{}` is not one of: ngram, draft_model, mtp, eagle, eagle3",
                    s.method
                )))
            }
        };
        Ok(Self {
            weights: base.join(m.weights),
            architecture,
            dtype,
            kv_cache_dtype,
            context_length: m.context_length,
            tokenizer: m.tokenizer.map(|t| base.join(t)),
            quantization: m.quantization,
            speculative,
            random_weights: None,
        })
    }

    /// The spec for a weights path given directly (no model.toml).
    pub fn for_weights(weights: &Path) -> Self {
        Self {
            weights: weights.to_path_buf(),
            architecture: None,
            dtype: ComputeDtype::Native,
            kv_cache_dtype: KvCacheDtype::Auto,
            context_length: None,
            tokenizer: None,
            quantization: None,
            speculative: None,
            random_weights: None,
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
        assert_eq!(spec.kv_cache_dtype, KvCacheDtype::Auto);
        let half = parse("[model]\nweights = \"w.gguf\"\nkv_cache_dtype = \"f16\"\n").unwrap();
        assert_eq!(half.kv_cache_dtype, KvCacheDtype::F16);
    }

    /// Each compute dtype by bbc's name and by vLLM's `--dtype` spellings; anything else
    /// refused with the choices.
    #[test]
    fn dtypes_are_read_by_either_name() {
        for (name, want) in [
            ("f32", ComputeDtype::F32),
            ("float32", ComputeDtype::F32),
            ("float", ComputeDtype::F32),
            ("bf16", ComputeDtype::Bf16),
            ("bfloat16", ComputeDtype::Bf16),
            ("f16", ComputeDtype::F16),
            ("float16", ComputeDtype::F16),
            ("half", ComputeDtype::F16),
            ("native", ComputeDtype::Native),
            ("auto", ComputeDtype::Native),
        ] {
            let spec = parse(&format!("[model]\nweights = \"w.gguf\"\ndtype = \"{name}\"\n")).unwrap();
            assert_eq!(spec.dtype, want, "{name}");
            assert_eq!(ComputeDtype::parse(want.name()), Some(want));
        }
        let err = parse("[model]\nweights = \"w.gguf\"\ndtype = \"fp8\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("`fp8`") && err.contains(ComputeDtype::choices()), "{err}");
    }

    #[test]
    fn the_speculative_section_is_read_and_checked() {
        let base = "[model]\nweights = \"w.gguf\"\n[speculative]\nmethod = \"ngram\"\nnum_speculative_tokens = 4\n";
        assert_eq!(
            parse(base).unwrap().speculative,
            Some(Speculative::Ngram(NgramSpec {
                tokens: 4,
                min: 2,
                max: 4
            }))
        );
        let ranged = format!("{base}prompt_lookup_min = 2\nprompt_lookup_max = 5\n");
        assert_eq!(
            parse(&ranged).unwrap().speculative,
            Some(Speculative::Ngram(NgramSpec {
                tokens: 4,
                min: 2,
                max: 5
            }))
        );
        for (text, needle) in [
            (base.replace("ngram", "eagle"), "eagle"),
            (
                format!("{base}prompt_lookup_min = 4\nprompt_lookup_max = 2\n"),
                "prompt_lookup_min",
            ),
            (format!("{base}lookahead = 2\n"), "lookahead"),
        ] {
            let err = parse(&text).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        }
        assert_eq!(parse("[model]\nweights = \"w.gguf\"\n").unwrap().speculative, None);
    }

    #[test]
    fn mtp_is_read_and_checked() {
        let base = "[model]\nweights = \"w\"\n[speculative]\nmethod = \"mtp\"\nnum_speculative_tokens = 3\n";
        assert_eq!(parse(base).unwrap().speculative, Some(Speculative::Mtp { tokens: 3 }));
        for (text, needle) in [
            (format!("{base}model = \"d\"\n"), "takes no model"),
            (format!("{base}prompt_lookup_max = 3\n"), "takes no model"),
            (base.replace("= 3", "= 0"), "at least 1"),
        ] {
            let err = parse(&text).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        }
    }

    #[test]
    fn an_eagle_head_is_read_and_checked() {
        use crate::eagle::EagleMethod;
        for (name, method) in [("eagle", EagleMethod::Eagle), ("eagle3", EagleMethod::Eagle3)] {
            let base =
                format!("[model]\nweights = \"w\"\n[speculative]\nmethod = \"{name}\"\nnum_speculative_tokens = 3\n");
            assert_eq!(
                parse(&format!("{base}model = \"heads/e3\"\n")).unwrap().speculative,
                Some(Speculative::Eagle {
                    method,
                    dir: PathBuf::from("/m/heads/e3"),
                    tokens: 3
                })
            );
            for (text, needle) in [
                (base.clone(), "needs speculative.model, the head's directory"),
                (
                    format!("{base}model = \"e\"\nprompt_lookup_min = 2\n"),
                    "the ngram method's",
                ),
                (format!("{}model = \"e\"\n", base.replace("= 3", "= 0")), "at least 1"),
            ] {
                let err = parse(&text).unwrap_err().to_string();
                assert!(err.contains(needle), "{name}: {err}");
            }
        }
    }

    #[test]
    fn a_draft_model_is_read_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("draft.gguf"), b"").unwrap();
        let toml = dir.path().join("model.toml");
        let base =
            "[model]\nweights = \"w.gguf\"\n[speculative]\nmethod = \"draft_model\"\nnum_speculative_tokens = 3\n";
        let parse_here = |text: &str| ModelSpec::parse(text, &toml);
        let local = parse_here(&format!("{base}model = \"draft.gguf\"\n")).unwrap();
        assert_eq!(
            local.speculative,
            Some(Speculative::DraftModel(DraftModelSpec {
                model: dir.path().join("draft.gguf").to_string_lossy().into_owned(),
                tokens: 3
            }))
        );
        let named = parse_here(&format!("{base}model = \"smollm2\"\n")).unwrap();
        let Some(Speculative::DraftModel(named)) = named.speculative else {
            panic!("a draft model")
        };
        assert_eq!(named.model, "smollm2", "a name, not a file here");
        for (text, needle) in [
            (base.to_string(), "needs speculative.model"),
            (
                format!("{base}model = \"d\"\nprompt_lookup_min = 2\n"),
                "ngram method's",
            ),
            (format!("{}model = \"d\"\n", base.replace("= 3", "= 0")), "at least 1"),
            (
                format!("{}model = \"d\"\n", base.replace("draft_model", "ngram")),
                "draft_model method's",
            ),
        ] {
            let err = parse_here(&text).unwrap_err().to_string();
            assert!(err.contains(needle), "{err}");
        }
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
        let err = parse("[model]\nweights = \"w\"\nkv_cache_dtype = \"fp4\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("kv_cache_dtype `fp4` is not one of: auto, f32, bf16, f16, fp8"),
            "{err}"
        );
        let fp8 = parse("[model]\nweights = \"w\"\nkv_cache_dtype = \"fp8_e4m3\"\n").unwrap();
        assert_eq!(fp8.kv_cache_dtype, KvCacheDtype::Fp8);
        let err = parse("[model]\nweights = \"w\"\narchitecture = \"gpt9\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("gpt9"), "{err}");
        assert!(parse("[model]\nweights = \"w\"\ncontext_length = 0\n").is_err());
        assert!(parse("[model]\nweights = 3\n").is_err());
        assert!(parse("").is_err());
    }
}
