//! Models: `model.toml`, weight sources (GGUF with its quant blocks, safetensors), tokenizers,
//! and one lowering per architecture family.

pub mod checkpoint_quantization;
pub mod config;
pub mod eagle;
pub mod error;
pub mod families;
pub mod fp4_checkpoint;
pub mod fp8_checkpoint;
pub mod fp8_on_load;
pub mod generation_defaults;
pub mod gguf;
pub mod int_checkpoint;
pub mod model_toml;
pub use ::quant;
pub mod safetensors_dir;
pub mod tokenizer;
pub mod weights;

pub use config::{
    Family, Gemma4Config, LayerAttention, LayerHeads, LinearAttentionConfig, MlaConfig, ModelConfig, MoeConfig,
};
pub use error::{ModelError, Result};
pub use families::{
    lower, lower_mtp, lower_mtp_without_weights, lower_without_weights, lower_without_weights_in_blocks,
    lower_without_weights_quantized, with_greedy_token, with_hidden_states, ComputeDtype, KvCacheDtype, LogitsFor,
    LowerOptions,
};
pub use generation_defaults::GenerationDefaults;
pub use model_toml::{DraftModelSpec, ModelSpec, NgramSpec, Speculative};
pub use tokenizer::{ChatMessage, ChatTemplate, StreamDecoder, Tokenizer};
pub use weights::{input_order_name, MemoryTensor, TensorView, WeightSource};

use std::path::{Path, PathBuf};

/// A model ready to lower and run: its config, weights and (when it has one) tokenizer.
pub struct Model {
    pub spec: ModelSpec,
    pub config: ModelConfig,
    pub weights: WeightSource,
    pub tokenizer: Option<Tokenizer>,
    /// The sampling settings its makers recommend, where the weights carry them.
    pub generation_defaults: GenerationDefaults,
}

impl Model {
    /// Open what `spec` names: a `.gguf` file or an HF directory.
    pub fn open(spec: ModelSpec) -> Result<Self> {
        let path = spec.weights.clone();
        let (mut config, weights, tokenizer, generation_defaults) = if path.is_dir() {
            let config = ModelConfig::from_hf_config(&path.join("config.json"))?;
            // Quantized weights asked for: an FP8 checkpoint's held as FP8 whatever the
            // compute dtype (it then types the rest, as vLLM's `--dtype` does).
            let fp8_as = match spec.quantization {
                Some(_) => ComputeDtype::Native,
                None => spec.dtype,
            };
            let mut weights = WeightSource::open_safetensors_computing(&path, fp8_as)?;
            if let Some(asked) = &spec.quantization {
                weights.quantize_as(asked)?;
            }
            let tokenizer = if path.join("tokenizer.json").exists() {
                Some(Tokenizer::from_hf_dir(&path)?)
            } else {
                None
            };
            (config, weights, tokenizer, GenerationDefaults::from_hf_dir(&path)?)
        } else {
            let file = gguf::GgufFile::open(&path)?;
            let config = ModelConfig::from_gguf(&file)?;
            let tokenizer = match file.get("tokenizer.ggml.tokens") {
                Some(_) => Some(Tokenizer::from_gguf(&file)?),
                None => None,
            };
            let generation_defaults = GenerationDefaults::from_gguf(&file)?;
            let mut weights = WeightSource::from_gguf(file);
            if let Some(asked) = &spec.quantization {
                weights.quantize_as(asked)?;
            }
            (config, weights, tokenizer, generation_defaults)
        };
        if let Some(family) = spec.architecture {
            if family != config.family {
                return Err(ModelError::Config {
                    path: path.clone(),
                    what: format!(
                        "model.toml says {} but the weights are {}",
                        family.name(),
                        config.family.name()
                    ),
                });
            }
        }
        if let Some(limit) = spec.context_length {
            if limit > config.context_length {
                return Err(ModelError::Config {
                    path,
                    what: format!("context_length {limit} exceeds the model's {}", config.context_length),
                });
            }
            config.context_length = limit;
        }
        let tokenizer = match &spec.tokenizer {
            Some(t) => Some(Tokenizer::from_file(t)?),
            None => tokenizer,
        };
        Ok(Self {
            spec,
            config,
            weights,
            tokenizer,
            generation_defaults,
        })
    }

    pub fn open_path(path: &Path) -> Result<Self> {
        if path.extension().is_some_and(|e| e == "toml") {
            Self::open(ModelSpec::load(path)?)
        } else {
            Self::open(ModelSpec::for_weights(path))
        }
    }

    /// Lower to the graph of one step.
    pub fn lower(&self, logits: LogitsFor) -> Result<ir::Graph> {
        lower(&self.config, &self.weights, self.lower_options(logits))
    }

    /// How this model's graphs are lowered: in its compute and cache types, with `logits`.
    pub fn lower_options(&self, logits: LogitsFor) -> LowerOptions {
        LowerOptions {
            logits,
            compute: self.spec.dtype,
            kv_cache: self.spec.kv_cache_dtype,
        }
    }

    pub fn weights_path(&self) -> PathBuf {
        self.spec.weights.clone()
    }
}
