//! Architecture hyperparameters from an HF `config.json`, as transformers 5 reads them.

use super::*;
use crate::error::io_error;

impl ModelConfig {
    pub fn from_hf_config(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| io_error(path, e))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::Config {
            path: path.to_path_buf(),
            what: format!("invalid JSON: {e}"),
        })?;
        Self::from_hf_json(json, path)
    }

    /// A `config.json` already parsed; `path` names it in errors.
    pub fn from_hf_json(json: serde_json::Value, path: &Path) -> Result<Self> {
        let json = language_model_config(json);
        let cfg = HfConfig { json: &json, path };
        let model_type = cfg.str("model_type")?;
        let family = Family::parse(model_type).ok_or_else(|| {
            cfg.error(&format!(
                "model_type `{model_type}` is not one bbc runs (llama, gemma3, gemma4, glm4_moe, glm_moe_dsa, qwen3_5, qwen3_5_moe, qwen3_next)"
            ))
        })?;
        let hidden = cfg.usize("hidden_size")?;
        let heads = cfg.usize("num_attention_heads")?;
        let layers = cfg.usize("num_hidden_layers")?;
        let head_dim = cfg.opt_usize("head_dim")?.unwrap_or(hidden / heads.max(1));
        let rope_theta_of = |kind: &str| -> Option<f64> {
            let p = json.get("rope_parameters")?;
            p.get(kind).unwrap_or(p).get("rope_theta")?.as_f64()
        };
        let (rope_scale, rope_scaling) = cfg.rope_scaling(family)?;
        let rope_theta = rope_theta_of("full_attention")
            .or_else(|| json.get("rope_theta").and_then(|v| v.as_f64()))
            .unwrap_or(10_000.0);
        let rope_local_theta = rope_theta_of("sliding_attention")
            .or_else(|| json.get("rope_local_base_freq").and_then(|v| v.as_f64()))
            .unwrap_or(match family {
                Family::Gemma3 | Family::Gemma4 => 10_000.0,
                Family::Llama | Family::Glm4Moe | Family::GlmMoeDsa | Family::Qwen35 | Family::Qwen3Next => rope_theta,
            });
        let layer_attention = match json.get("layer_types").and_then(|v| v.as_array()) {
            Some(types) => types
                .iter()
                .map(|t| match t.as_str() {
                    Some("full_attention") => Ok(LayerAttention::Full),
                    Some("sliding_attention") => Ok(LayerAttention::Sliding),
                    Some("linear_attention") if family.has_linear_attention() => Ok(LayerAttention::Linear),
                    Some("indexed_attention") if family == Family::GlmMoeDsa => Ok(LayerAttention::Full),
                    _ => Err(cfg.error(&format!(
                        "layer_types holds {t}, expected full_attention or sliding_attention (or linear_attention for qwen3_5 and qwen3_next)"
                    ))),
                })
                .collect::<Result<Vec<_>>>()?,
            None => match family {
                Family::Llama | Family::Glm4Moe | Family::GlmMoeDsa | Family::Qwen35 | Family::Qwen3Next => {
                    vec![LayerAttention::Full; layers]
                }
                Family::Gemma3 | Family::Gemma4 => {
                    gemma3_pattern(layers, cfg.opt_usize("_sliding_window_pattern")?.unwrap_or(6))
                }
            },
        };
        let gemma4 = match family {
            Family::Gemma4 => Some(cfg.gemma4(&layer_attention, heads, head_dim)?),
            _ => None,
        };
        let config = Self {
            family,
            vocab_size: cfg.usize("vocab_size")?,
            hidden,
            layers,
            heads,
            kv_heads: cfg.opt_usize("num_key_value_heads")?.unwrap_or(heads),
            head_dim,
            intermediate: cfg.usize("intermediate_size")?,
            rms_eps: cfg.f64("rms_norm_eps")?,
            rope_theta,
            rope_local_theta,
            rope_scale,
            rope_scaling,
            context_length: cfg.opt_usize("max_position_embeddings")?.unwrap_or(2048),
            sliding_window: cfg.opt_usize("sliding_window")?,
            layer_attention,
            query_pre_attn_scalar: json.get("query_pre_attn_scalar").and_then(|v| v.as_f64()),
            tied_embeddings: json
                .get("tie_word_embeddings")
                .and_then(|v| v.as_bool())
                .unwrap_or(true),
            rotary_dim: cfg.rotary_dim(head_dim)?,
            attention_bias: cfg.opt_bool("attention_bias")?.unwrap_or(false),
            qk_norm: match family {
                Family::Gemma3 | Family::Gemma4 | Family::Qwen35 | Family::Qwen3Next => true,
                Family::Llama | Family::GlmMoeDsa => false,
                Family::Glm4Moe => cfg.opt_bool("use_qk_norm")?.unwrap_or(false),
            },
            moe: match family {
                Family::Glm4Moe | Family::GlmMoeDsa => Some(cfg.glm4_moe(layers)?),
                Family::Qwen3Next => Some(cfg.qwen3_next_moe(layers)?),
                Family::Qwen35 if json.get("num_experts").is_some() => Some(cfg.qwen3_next_moe(layers)?),
                Family::Gemma4 if cfg.opt_bool("enable_moe_block")?.unwrap_or(false) => Some(cfg.gemma4_moe(layers)?),
                Family::Llama | Family::Gemma3 | Family::Gemma4 | Family::Qwen35 => None,
            },
            linear_attention: match family.has_linear_attention() {
                true => Some(cfg.linear_attention()?),
                false => None,
            },
            gemma4,
            mla: match family {
                Family::GlmMoeDsa => Some(cfg.mla(layers, rope_scaling)?),
                _ => None,
            },
            final_logit_softcap: cfg.opt_f64("final_logit_softcapping")?.map(|cap| cap as f32),
            mtp_layers: match cfg.opt_usize("mtp_num_hidden_layers")? {
                Some(n) => n,
                None => cfg.opt_usize("num_nextn_predict_layers")?.unwrap_or(0),
            },
        };
        config.check(path)
    }
}

/// The kind of RoPE scaling `rope_parameters` (or `rope_scaling`) names.
fn rope_type(p: &serde_json::Value) -> Option<&str> {
    p.get("rope_type").or_else(|| p.get("type")).and_then(|t| t.as_str())
}

/// DeepSeek's `(mscale, mscale_all_dim)` where both are given and non-zero.
fn yarn_mscales(p: &serde_json::Value) -> Option<(f64, f64)> {
    let get = |key: &str| p.get(key).and_then(|v| v.as_f64()).filter(|&m| m != 0.0);
    Some((get("mscale")?, get("mscale_all_dim")?))
}

/// The language model's settings: a multimodal checkpoint (`…ForConditionalGeneration`)
/// nests them in `text_config`; its own top-level keys (`tie_word_embeddings`, token ids) fill
/// in what `text_config` leaves out.
fn language_model_config(json: serde_json::Value) -> serde_json::Value {
    let serde_json::Value::Object(mut top) = json else {
        return json;
    };
    let Some(serde_json::Value::Object(mut text)) = top.remove("text_config") else {
        return serde_json::Value::Object(top);
    };
    for (key, value) in top {
        if !key.ends_with("_config") {
            text.entry(key).or_insert(value);
        }
    }
    serde_json::Value::Object(text)
}

struct HfConfig<'a> {
    json: &'a serde_json::Value,
    path: &'a Path,
}

impl HfConfig<'_> {
    fn error(&self, what: &str) -> ModelError {
        ModelError::Config {
            path: self.path.to_path_buf(),
            what: what.into(),
        }
    }
    fn str(&self, key: &str) -> Result<&str> {
        self.json
            .get(key)
            .and_then(|v| v.as_str())
            .ok_or_else(|| self.error(&format!("`{key}` is missing or not a string")))
    }
    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| self.error(&format!("`{key}` is missing")))
    }
    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.json.get(key) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|v| Some(v as usize))
                .ok_or_else(|| self.error(&format!("`{key}` should be a non-negative integer, found {v}"))),
        }
    }
    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.json.get(key) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.error(&format!("`{key}` should be true or false, found {v}"))),
        }
    }

    /// `partial_rotary_factor · head_dim` (in `rope_parameters`, or at the top level as older
    /// configs have it); all of it when absent.
    fn rotary_dim(&self, head_dim: usize) -> Result<usize> {
        let factor = self
            .json
            .get("rope_parameters")
            .and_then(|p| p.get("partial_rotary_factor"))
            .or_else(|| self.json.get("partial_rotary_factor"));
        match factor {
            None | Some(serde_json::Value::Null) => Ok(head_dim),
            Some(v) => match v.as_f64() {
                Some(f) if f > 0.0 && f <= 1.0 => Ok((head_dim as f64 * f) as usize),
                _ => Err(self.error(&format!("`partial_rotary_factor` should be in (0, 1], found {v}"))),
            },
        }
    }

    /// Gemma 4's settings, refusing the features bbc does not run yet.
    fn gemma4(&self, layer_attention: &[LayerAttention], heads: usize, head_dim: usize) -> Result<Gemma4Config> {
        let unsupported = |what: &str| Err(self.error(&format!("{what}: bbc does not run that Gemma 4 feature yet")));
        let keys_as_values = self.opt_bool("attention_k_eq_v")?.unwrap_or(false);
        let kv_heads = self.opt_usize("num_key_value_heads")?.unwrap_or(heads);
        // Without `per_layer_config`, HF gives full-attention layers heads of
        // `global_head_dim` (512 unless said), and `num_global_key_value_heads` of them only
        // where keys are values.
        let (global_head_dim, global_kv_heads) = match self.json.get("per_layer_config") {
            Some(_) => (head_dim, kv_heads),
            None => (
                self.opt_usize("global_head_dim")?.unwrap_or(512),
                match keys_as_values {
                    true => self.opt_usize("num_global_key_value_heads")?.unwrap_or(kv_heads),
                    false => kv_heads,
                },
            ),
        };
        let mut layer_heads: Vec<LayerHeads> = layer_attention
            .iter()
            .map(|kind| match kind {
                LayerAttention::Full => LayerHeads {
                    heads,
                    kv_heads: global_kv_heads,
                    head_dim: global_head_dim,
                },
                _ => LayerHeads {
                    heads,
                    kv_heads,
                    head_dim,
                },
            })
            .collect();
        if let Some(per_layer) = self.json.get("per_layer_config").and_then(|v| v.as_object()) {
            for (layer, overrides) in per_layer {
                let i: usize = layer.parse().ok().filter(|&i| i < layer_heads.len()).ok_or_else(|| {
                    self.error(&format!(
                        "per_layer_config names layer {layer:?}, which the model does not have"
                    ))
                })?;
                let get = |key: &str| overrides.get(key).and_then(|v| v.as_u64()).map(|v| v as usize);
                let h = &mut layer_heads[i];
                h.head_dim = get("head_dim").unwrap_or(h.head_dim);
                h.heads = get("num_attention_heads").unwrap_or(h.heads);
                h.kv_heads = get("num_key_value_heads").unwrap_or(h.kv_heads);
            }
        }
        let full_rope = self.json.get("rope_parameters").and_then(|p| p.get("full_attention"));
        let global_rope_fraction = match full_rope.and_then(|r| r.get("rope_type")).and_then(|t| t.as_str()) {
            Some("proportional") => Some(
                full_rope
                    .and_then(|r| r.get("partial_rotary_factor"))
                    .and_then(|f| f.as_f64())
                    .unwrap_or(1.0),
            ),
            None | Some("default") => None,
            Some(other) => return unsupported(&format!("full-attention rope_type {other:?}")),
        };
        Ok(Gemma4Config {
            per_layer_input: self.opt_usize("hidden_size_per_layer_input")?.unwrap_or(0),
            layer_heads,
            global_rope_fraction,
            kv_shared_from: kv_shared_layers(self.opt_usize("num_kv_shared_layers")?.unwrap_or(0), layer_attention)
                .map_err(|problem| self.error(&problem))?,
            double_wide_mlp: self.opt_bool("use_double_wide_mlp")?.unwrap_or(false),
            keys_as_values,
        })
    }

    /// The full-attention layers' RoPE parameters: `rope_parameters` (its `full_attention`
    /// entry where layer kinds differ), or transformers 4's `rope_scaling` in older configs.
    fn rope_params(&self) -> Option<&serde_json::Value> {
        let params = ["rope_parameters", "rope_scaling"]
            .iter()
            .find_map(|k| self.json.get(*k).filter(|p| p.is_object()))?;
        Some(params.get("full_attention").unwrap_or(params))
    }

    /// `rope_parameters.{key}` as a positive number, or `default` where it is absent (or, as
    /// transformers reads YaRN's betas, null).
    fn rope_number(&self, p: &serde_json::Value, key: &str, default: Option<f64>) -> Result<f64> {
        match p.get(key).filter(|v| !v.is_null()) {
            Some(v) => v
                .as_f64()
                .filter(|v| v.is_finite() && *v > 0.0)
                .ok_or_else(|| self.error(&format!("rope_parameters.{key} is {v}, not a positive number"))),
            None => default.ok_or_else(|| self.error(&format!("this RoPE scaling needs rope_parameters.{key}"))),
        }
    }

    /// The full-attention layers' RoPE scaling, as [`rope_params`](Self::rope_params) says:
    /// "linear" as a position scale, "llama3" (Llama-family models) as
    /// `ir::RopeScaling::Llama3`, "yarn" as `ir::RopeScaling::Yarn` (not for Gemma 4, whose
    /// full-attention layers are proportional). Another kind (dynamic, longrope) is refused by
    /// name rather than computed unscaled; Gemma 4's "proportional" is read with its layers.
    fn rope_scaling(&self, family: Family) -> Result<(f64, ir::RopeScaling)> {
        let Some(p) = self.rope_params() else {
            return Ok((1.0, ir::RopeScaling::None));
        };
        let number = |key: &str, default: Option<f64>| self.rope_number(p, key, default);
        match rope_type(p) {
            None | Some("default") => Ok((1.0, ir::RopeScaling::None)),
            Some("proportional") if family == Family::Gemma4 => Ok((1.0, ir::RopeScaling::None)),
            Some("linear") => Ok((number("factor", None)?, ir::RopeScaling::None)),
            Some("llama3") if family == Family::Llama => Ok((
                1.0,
                ir::RopeScaling::Llama3 {
                    factor: number("factor", None)?,
                    low_freq_factor: number("low_freq_factor", Some(1.0))?,
                    high_freq_factor: number("high_freq_factor", Some(4.0))?,
                    original_context: number("original_max_position_embeddings", Some(8192.0))?,
                },
            )),
            Some("yarn") if family != Family::Gemma4 => Ok((1.0, self.yarn(p)?)),
            Some(other) => Err(self.error(&format!(
                "rope_type {other:?} for {}: bbc computes RoPE unscaled, linear, YaRN, or (Llama) as Llama 3.1 scales it",
                family.name()
            ))),
        }
    }

    /// YaRN's parameters as transformers 5 reads them (`_compute_yarn_parameters`): the
    /// original context from the config's own `original_max_position_embeddings`, else the
    /// parameters', else `max_position_embeddings`; the factor, else the ratio of those two;
    /// the betas 32 and 1 unless given; truncation unless `truncate` is false; the attention
    /// factor given, else `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` where both
    /// are given, else `mscale(factor)`.
    fn yarn(&self, p: &serde_json::Value) -> Result<ir::RopeScaling> {
        let longest = self.opt_f64("max_position_embeddings")?;
        let original_context = match self.opt_f64("original_max_position_embeddings")? {
            Some(context) => context,
            None => self.rope_number(p, "original_max_position_embeddings", longest)?,
        };
        let factor = match longest {
            Some(longest) => self.rope_number(p, "factor", Some(longest / original_context))?,
            None => self.rope_number(p, "factor", None)?,
        };
        let attention_factor = match p.get("attention_factor").filter(|v| !v.is_null()) {
            Some(_) => self.rope_number(p, "attention_factor", None)?,
            None => match yarn_mscales(p) {
                Some((mscale, all_dims)) => yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dims),
                None => yarn_mscale(factor, 1.0),
            },
        };
        let truncate = match self.json.get("rope_parameters").and_then(|r| r.get("truncate")) {
            None => true,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.error(&format!("rope_parameters.truncate is {v}, not true or false")))?,
        };
        Ok(ir::RopeScaling::Yarn {
            factor,
            original_context,
            beta_fast: self.rope_number(p, "beta_fast", Some(32.0))?,
            beta_slow: self.rope_number(p, "beta_slow", Some(1.0))?,
            truncate,
            attention_factor,
        })
    }

    /// What YaRN multiplies latent attention's softmax scale by (transformers'
    /// `yarn_apply_mscale`: `mscale(factor, mscale_all_dim)²` where the RoPE is scaled and
    /// `mscale_all_dim` is given), 1 otherwise.
    fn latent_softmax_mscale(&self, scaling: ir::RopeScaling) -> f64 {
        let all_dims = self
            .rope_params()
            .and_then(|p| p.get("mscale_all_dim"))
            .and_then(|v| v.as_f64())
            .filter(|&m| m != 0.0);
        match (scaling, all_dims) {
            (ir::RopeScaling::Yarn { factor, .. }, Some(all_dims)) => yarn_mscale(factor, all_dims).powi(2),
            _ => 1.0,
        }
    }

    fn mla(&self, layers: usize, scaling: ir::RopeScaling) -> Result<MlaConfig> {
        // "full": the layer's own indexer; "shared": the previous full layer's choice.
        let shared_indexer = match self.json.get("indexer_types").and_then(|v| v.as_array()) {
            None => vec![false; layers],
            Some(types) => types
                .iter()
                .map(|t| match t.as_str() {
                    Some("full") => Ok(false),
                    Some("shared") => Ok(true),
                    _ => Err(self.error(&format!(
                        "indexer_types holds {t}: a layer's indexer is \"full\" or \"shared\""
                    ))),
                })
                .collect::<Result<_>>()?,
        };
        Ok(MlaConfig {
            shared_indexer,
            q_rank: self.usize("q_lora_rank")?,
            kv_rank: self.usize("kv_lora_rank")?,
            nope_dim: self.usize("qk_nope_head_dim")?,
            rope_dim: self.usize("qk_rope_head_dim")?,
            value_dim: self.usize("v_head_dim")?,
            index_heads: self.usize("index_n_heads")?,
            index_dim: self.usize("index_head_dim")?,
            index_topk: self.usize("index_topk")?,
            softmax_mscale: self.latent_softmax_mscale(scaling),
        })
    }

    fn linear_attention(&self) -> Result<LinearAttentionConfig> {
        Ok(LinearAttentionConfig {
            key_heads: self.usize("linear_num_key_heads")?,
            value_heads: self.usize("linear_num_value_heads")?,
            key_dim: self.usize("linear_key_head_dim")?,
            value_dim: self.usize("linear_value_head_dim")?,
            conv_kernel: self.opt_usize("linear_conv_kernel_dim")?.unwrap_or(4),
        })
    }

    fn glm4_moe(&self, layers: usize) -> Result<MoeConfig> {
        let first_sparse = self.opt_usize("first_k_dense_replace")?.unwrap_or(0);
        let expert_intermediate = self.usize("moe_intermediate_size")?;
        // GLM-5 names each layer's MLP; GLM-4.5 counts its dense layers.
        let sparse_layers = match self.json.get("mlp_layer_types").and_then(|v| v.as_array()) {
            Some(types) => types
                .iter()
                .map(|t| match t.as_str() {
                    Some("dense") => Ok(false),
                    Some("sparse") => Ok(true),
                    _ => Err(self.error(&format!("mlp_layer_types holds {t}, expected dense or sparse"))),
                })
                .collect::<Result<_>>()?,
            None => (0..layers).map(|i| i >= first_sparse).collect(),
        };
        Ok(MoeConfig {
            sparse_layers,
            experts: self.usize("n_routed_experts")?,
            experts_per_token: self.usize("num_experts_per_tok")?,
            expert_intermediate,
            shared_intermediate: expert_intermediate * self.opt_usize("n_shared_experts")?.unwrap_or(0),
            shared_gate: false,
            normalize: self.opt_bool("norm_topk_prob")?.unwrap_or(true),
            router: ir::MoeRouter::GroupedSigmoid {
                groups: self.opt_usize("n_group")?.unwrap_or(1),
                top_groups: self.opt_usize("topk_group")?.unwrap_or(1),
                scaling: self.opt_f64("routed_scaling_factor")?.unwrap_or(1.0) as f32,
            },
        })
    }

    /// Gemma 4's MoE block (`enable_moe_block`), beside every layer's dense MLP.
    fn gemma4_moe(&self, layers: usize) -> Result<MoeConfig> {
        Ok(MoeConfig {
            sparse_layers: vec![true; layers],
            experts: self.usize("num_experts")?,
            experts_per_token: self.usize("top_k_experts")?,
            expert_intermediate: self.usize("moe_intermediate_size")?,
            shared_intermediate: 0,
            shared_gate: false,
            normalize: true,
            router: ir::MoeRouter::SoftmaxExpertScale,
        })
    }

    fn qwen3_next_moe(&self, layers: usize) -> Result<MoeConfig> {
        let experts = self.usize("num_experts")?;
        let step = self.opt_usize("decoder_sparse_step")?.unwrap_or(1).max(1);
        let dense: Vec<usize> = match self.json.get("mlp_only_layers") {
            None | Some(serde_json::Value::Null) => Vec::new(),
            Some(v) => v
                .as_array()
                .and_then(|a| a.iter().map(|i| i.as_u64().map(|i| i as usize)).collect())
                .ok_or_else(|| {
                    self.error(&format!(
                        "`mlp_only_layers` should be a list of layer indices, found {v}"
                    ))
                })?,
        };
        Ok(MoeConfig {
            sparse_layers: (0..layers)
                .map(|i| !dense.contains(&i) && experts > 0 && (i + 1) % step == 0)
                .collect(),
            experts,
            experts_per_token: self.usize("num_experts_per_tok")?,
            expert_intermediate: self.usize("moe_intermediate_size")?,
            shared_intermediate: self.opt_usize("shared_expert_intermediate_size")?.unwrap_or(0),
            shared_gate: true,
            normalize: self.opt_bool("norm_topk_prob")?.unwrap_or(false),
            router: ir::MoeRouter::Softmax,
        })
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.json.get(key) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.error(&format!("`{key}` should be a number, found {v}"))),
        }
    }

    fn f64(&self, key: &str) -> Result<f64> {
        self.json
            .get(key)
            .and_then(|v| v.as_f64())
            .ok_or_else(|| self.error(&format!("`{key}` is missing or not a number")))
    }
}
