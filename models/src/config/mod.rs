//! Architecture hyperparameters, read from GGUF metadata or an HF `config.json`.

use crate::error::{io_error, ModelError, Result};
use crate::gguf::GgufFile;
use serde::Serialize;
use std::path::Path;

mod gguf_gemma4;
pub mod shapes;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Llama,
    Gemma3,
    /// GLM-4.5 / 4.6 / 4.7 (`Glm4MoeForCausalLM`).
    Glm4Moe,
    /// Qwen3.5's dense text model (`Qwen3_5ForCausalLM`): Gated DeltaNet and gated attention.
    #[serde(rename = "qwen3_5")]
    Qwen35,
    /// Qwen3-Next (`Qwen3NextForCausalLM`): Qwen3.5's layers with MoE MLPs.
    #[serde(rename = "qwen3_next")]
    Qwen3Next,
    /// Gemma 4's text model (`Gemma4ForCausalLM`).
    Gemma4,
    /// GLM-5 (`GlmMoeDsaForCausalLM`): latent attention with a sparse indexer, GLM-4.5's MoE.
    #[serde(rename = "glm_moe_dsa")]
    GlmMoeDsa,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Gemma3 => "gemma3",
            Self::Glm4Moe => "glm4_moe",
            Self::Qwen35 => "qwen3_5",
            Self::Qwen3Next => "qwen3_next",
            Self::Gemma4 => "gemma4",
            Self::GlmMoeDsa => "glm_moe_dsa",
        }
    }

    /// Whether the family has Gated DeltaNet layers.
    pub fn has_linear_attention(self) -> bool {
        matches!(self, Self::Qwen35 | Self::Qwen3Next)
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "llama" => Some(Self::Llama),
            "gemma3" | "gemma3_text" => Some(Self::Gemma3),
            // `glm4moe`: llama.cpp's name.
            "glm4_moe" | "glm4moe" => Some(Self::Glm4Moe),
            // Qwen3.5's MoE variant is Qwen3.5 with Qwen3-Next's MoE MLPs. `qwen35`, `qwen35moe`:
            // llama.cpp's names (GGUF `general.architecture`).
            "qwen3_5" | "qwen3_5_text" | "qwen3_5_moe" | "qwen3_5_moe_text" | "qwen35" | "qwen35moe" => {
                Some(Self::Qwen35)
            }
            "qwen3_next" | "qwen3next" => Some(Self::Qwen3Next),
            "gemma4" | "gemma4_text" => Some(Self::Gemma4),
            // `glm-dsa`: llama.cpp's name.
            "glm_moe_dsa" | "glm-dsa" => Some(Self::GlmMoeDsa),
            _ => None,
        }
    }
}

/// Whether a layer attends to everything before it or to a sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum LayerAttention {
    Full,
    Sliding,
    /// A Gated DeltaNet layer (linear attention with a recurrent state).
    Linear,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelConfig {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub rms_eps: f64,
    /// RoPE θ of full-attention layers.
    pub rope_theta: f64,
    /// RoPE θ of sliding-window layers (Gemma 3: 10 000).
    pub rope_local_theta: f64,
    /// Linear RoPE scaling of full-attention layers (1.0 for none).
    pub rope_scale: f64,
    /// RoPE scaling by frequency (Llama 3.1's; Llama-family models only).
    pub rope_scaling: ir::RopeScaling,
    pub context_length: usize,
    pub sliding_window: Option<usize>,
    pub layer_attention: Vec<LayerAttention>,
    /// Gemma: attention scale is `query_pre_attn_scalar^-0.5`.
    pub query_pre_attn_scalar: Option<f64>,
    pub tied_embeddings: bool,
    /// The leading dims of each head that RoPE rotates (`partial_rotary_factor · head_dim`).
    pub rotary_dim: usize,
    /// Q, K and V projections have biases (Qwen2, GLM-4.5).
    pub attention_bias: bool,
    /// Per-head RMSNorm of queries and keys before RoPE (Gemma 3, Qwen3, GLM-4.5).
    pub qk_norm: bool,
    /// Mixture-of-experts MLPs, where the family has them.
    pub moe: Option<MoeConfig>,
    /// The Gated DeltaNet layers' shapes, where the family has them.
    pub linear_attention: Option<LinearAttentionConfig>,
    /// Gemma 4's per-layer settings.
    pub gemma4: Option<Gemma4Config>,
    /// Latent attention's shapes, where the family has it.
    pub mla: Option<MlaConfig>,
    /// Logits are soft-capped, `cap · tanh(logits / cap)` (`final_logit_softcapping`).
    pub final_logit_softcap: Option<f32>,
}

/// Multi-head latent attention with DeepSeek's sparse indexer (GLM-5; HF names).
#[derive(Debug, Clone, Serialize)]
pub struct MlaConfig {
    pub q_rank: usize,      // q_lora_rank
    pub kv_rank: usize,     // kv_lora_rank
    pub nope_dim: usize,    // qk_nope_head_dim
    pub rope_dim: usize,    // qk_rope_head_dim
    pub value_dim: usize,   // v_head_dim
    pub index_heads: usize, // index_n_heads
    pub index_dim: usize,   // index_head_dim
    pub index_topk: usize,  // index_topk
    /// Per layer: whether it keeps the previous full layer's choice of positions instead of
    /// running an indexer of its own (`indexer_types` "shared", GLM-5.2).
    pub shared_indexer: Vec<bool>,
    /// What the attention's softmax scale is multiplied by: YaRN's `mscale(factor,
    /// mscale_all_dim)²` in a checkpoint that scales its RoPE so, else 1.
    pub softmax_mscale: f64,
}

/// What Gemma 4 adds to a Gemma-style config (HF `config.json` names in the comments).
#[derive(Debug, Clone, Serialize)]
pub struct Gemma4Config {
    /// Values per layer and token of the per-layer inputs (`hidden_size_per_layer_input`; 0
    /// for none).
    pub per_layer_input: usize,
    /// Per layer: its heads, after `per_layer_config` (or the older `global_head_dim` and
    /// `num_global_key_value_heads`) gave the full-attention layers their own.
    pub layer_heads: Vec<LayerHeads>,
    /// Full-attention layers' RoPE is proportional, turning this share of each head
    /// (`rope_parameters.full_attention`: `rope_type` "proportional", `partial_rotary_factor`).
    pub global_rope_fraction: Option<f64>,
    /// Per layer: the earlier layer whose keys and values it attends over instead of its own
    /// (the last `num_kv_shared_layers` layers each read the last layer of their kind before
    /// them), or `None` for a layer with its own.
    pub kv_shared_from: Vec<Option<usize>>,
    /// The KV-shared layers' MLPs are twice `intermediate_size` wide (`use_double_wide_mlp`).
    pub double_wide_mlp: bool,
    /// Full-attention layers have no value projection: their keys, before the key norm and
    /// RoPE, are their values (`attention_k_eq_v`).
    pub keys_as_values: bool,
}

impl Gemma4Config {
    /// The leading dims of a full-attention head of `head_dim` that proportional RoPE turns:
    /// HF's `int(partial_rotary_factor · head_dim // 2)` pairs.
    pub fn global_rotary_dim(fraction: f64, head_dim: usize) -> usize {
        2 * ((fraction * head_dim as f64) as usize / 2)
    }

    /// The least fraction of a head of `head_dim` whose rotated pairs are `pairs` (a GGUF file
    /// counts pairs; the config keeps HF's factor).
    pub fn fraction_rotating(pairs: usize, head_dim: usize) -> f64 {
        let fraction = (2 * pairs) as f64 / head_dim as f64;
        match Self::global_rotary_dim(fraction, head_dim) == 2 * pairs {
            true => fraction,
            false => fraction.next_up(),
        }
    }

    /// Layer `i`'s MLP width.
    pub fn intermediate(&self, i: usize, intermediate: usize) -> usize {
        match self.double_wide_mlp && self.kv_shared_from[i].is_some() {
            true => 2 * intermediate,
            false => intermediate,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LayerHeads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// The Gated DeltaNet layers of a Qwen3.5 / Qwen3-Next model (HF `config.json` names).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LinearAttentionConfig {
    pub key_heads: usize,   // linear_num_key_heads
    pub value_heads: usize, // linear_num_value_heads
    pub key_dim: usize,     // linear_key_head_dim
    pub value_dim: usize,   // linear_value_head_dim
    pub conv_kernel: usize, // linear_conv_kernel_dim
}

/// The mixture-of-experts MLPs of a model (GLM-4.5, Qwen3-Next).
#[derive(Debug, Clone, Serialize)]
pub struct MoeConfig {
    /// Per layer: whether its MLP is the MoE one (others keep a dense MLP): GLM's first
    /// `first_k_dense_replace` layers are dense; Qwen's `mlp_only_layers` and
    /// `decoder_sparse_step` say which.
    pub sparse_layers: Vec<bool>,
    pub experts: usize,             // n_routed_experts / num_experts
    pub experts_per_token: usize,   // num_experts_per_tok
    pub expert_intermediate: usize, // moe_intermediate_size
    /// The shared experts' MLP width, 0 for none: GLM's `moe_intermediate_size ·
    /// n_shared_experts`, Qwen3-Next's `shared_expert_intermediate_size`.
    pub shared_intermediate: usize,
    /// Qwen3-Next: the shared expert's output is multiplied by `sigmoid(x · shared_expert_gate)`.
    pub shared_gate: bool,
    pub normalize: bool, // norm_topk_prob
    pub router: ir::MoeRouter,
}

/// Which layers of a GGUF hybrid (llama.cpp's `qwen35`) are Gated DeltaNet layers: its
/// `attention.recurrent_layers` flags, or else all but every `full_attention_interval`-th
/// (default 4), as llama.cpp reads them.
fn gguf_recurrent_layers(file: &GgufFile, arch: &str, layers: usize) -> Result<Vec<LayerAttention>> {
    let kind = |recurrent: bool| match recurrent {
        true => LayerAttention::Linear,
        false => LayerAttention::Full,
    };
    let flags_key = format!("{arch}.attention.recurrent_layers");
    if let Some(flags) = file.get(&flags_key) {
        let bad = |problem: &str| ModelError::Metadata {
            path: file.path.clone(),
            key: flags_key.clone(),
            problem: problem.into(),
        };
        let flags = flags.as_array().ok_or_else(|| bad("should be an array of booleans"))?;
        // MTP layers, where a file has them, come after the model's own and are not recurrent.
        if flags.len() < layers {
            return Err(bad(&format!("has {} flags for {layers} layers", flags.len())));
        }
        return flags[..layers]
            .iter()
            .map(|f| f.as_bool().map(kind).ok_or_else(|| bad("should hold booleans")))
            .collect();
    }
    let every = file
        .optional_u64(&format!("{arch}.full_attention_interval"))?
        .unwrap_or(4)
        .max(1) as usize;
    Ok((0..layers).map(|i| kind(!(i + 1).is_multiple_of(every))).collect())
}

/// The Gated DeltaNet shapes of a GGUF hybrid, from llama.cpp's `ssm.*` keys: key heads
/// (`group_count`), value heads (`time_step_rank`), the key head width (`state_size`), the
/// value heads' total width (`inner_size`) and the convolution's (`conv_kernel`).
fn gguf_linear_attention(file: &GgufFile, arch: &str) -> Result<LinearAttentionConfig> {
    let u = |k: &str| file.require_u64(&format!("{arch}.ssm.{k}")).map(|v| v as usize);
    let value_heads = u("time_step_rank")?;
    let inner = u("inner_size")?;
    if value_heads == 0 || !inner.is_multiple_of(value_heads) {
        return Err(ModelError::Metadata {
            path: file.path.clone(),
            key: format!("{arch}.ssm.inner_size"),
            problem: format!("{inner} is not a whole number of widths for {value_heads} value heads"),
        });
    }
    Ok(LinearAttentionConfig {
        key_heads: u("group_count")?,
        value_heads,
        key_dim: u("state_size")?,
        value_dim: inner / value_heads,
        conv_kernel: u("conv_kernel")?,
    })
}

/// A GGUF Qwen3-Next's or Qwen3.5-MoE's experts (llama.cpp's `expert_*` keys): every layer
/// MoE, a softmax router whose chosen weights are normalised (llama.cpp's `qwen3next` and
/// `qwen35moe` always normalise, as the models' `norm_topk_prob` says), one shared expert
/// gated by `sigmoid(x · gate)`.
fn gguf_qwen_moe(file: &GgufFile, arch: &str, layers: usize) -> Result<MoeConfig> {
    let u = |k: &str| file.require_u64(&format!("{arch}.{k}")).map(|v| v as usize);
    Ok(MoeConfig {
        sparse_layers: vec![true; layers],
        experts: u("expert_count")?,
        experts_per_token: u("expert_used_count")?,
        expert_intermediate: u("expert_feed_forward_length")?,
        shared_intermediate: file
            .optional_u64(&format!("{arch}.expert_shared_feed_forward_length"))?
            .unwrap_or(0) as usize,
        shared_gate: true,
        normalize: true,
        router: ir::MoeRouter::Softmax,
    })
}

/// A GGUF GLM-4.5's experts (llama.cpp's `glm4moe` keys): the first
/// `leading_dense_block_count` layers dense, DeepSeek-V3's grouped sigmoid router (groups from
/// `expert_group_count`/`_used_count`, scaled by `expert_weights_scale`, normalised as
/// `expert_weights_norm` says), `expert_shared_count` shared experts.
fn gguf_glm_moe(file: &GgufFile, arch: &str, layers: usize) -> Result<MoeConfig> {
    let key = |k: &str| format!("{arch}.{k}");
    let u = |k: &str| file.require_u64(&key(k)).map(|v| v as usize);
    let opt = |k: &str, default: usize| file.optional_u64(&key(k)).map(|v| v.map_or(default, |v| v as usize));
    // llama.cpp's gating function ids: 1 softmax, 2 sigmoid (GLM's; its default here).
    if let Some(gating) = file.optional_u64(&key("expert_gating_func"))?.filter(|&g| g != 2) {
        return Err(ModelError::Metadata {
            path: file.path.clone(),
            key: key("expert_gating_func"),
            problem: format!("is {gating}; GLM-4.5's router is the sigmoid one (2)"),
        });
    }
    let expert_intermediate = u("expert_feed_forward_length")?;
    let dense = opt("leading_dense_block_count", 0)?;
    Ok(MoeConfig {
        sparse_layers: (0..layers).map(|i| i >= dense).collect(),
        experts: u("expert_count")?,
        experts_per_token: u("expert_used_count")?,
        expert_intermediate,
        shared_intermediate: expert_intermediate * opt("expert_shared_count", 0)?,
        shared_gate: false,
        normalize: file
            .get(&key("expert_weights_norm"))
            .and_then(|v| v.as_bool())
            .unwrap_or(true),
        router: ir::MoeRouter::GroupedSigmoid {
            groups: opt("expert_group_count", 1)?,
            top_groups: opt("expert_group_used_count", 1)?,
            scaling: file.optional_f64(&key("expert_weights_scale"))?.unwrap_or(1.0) as f32,
        },
    })
}

/// The kind of RoPE scaling `rope_parameters` (or `rope_scaling`) names.
fn rope_type(p: &serde_json::Value) -> Option<&str> {
    p.get("rope_type").or_else(|| p.get("type")).and_then(|t| t.as_str())
}

/// YaRN's `mscale`: `0.1 · mscale · ln(factor) + 1`, 1 where the factor does not stretch.
fn yarn_mscale(factor: f64, mscale: f64) -> f64 {
    match factor <= 1.0 {
        true => 1.0,
        false => 0.1 * mscale * factor.ln() + 1.0,
    }
}

/// DeepSeek's `(mscale, mscale_all_dim)` where both are given and non-zero.
fn yarn_mscales(p: &serde_json::Value) -> Option<(f64, f64)> {
    let get = |key: &str| p.get(key).and_then(|v| v.as_f64()).filter(|&m| m != 0.0);
    Some((get("mscale")?, get("mscale_all_dim")?))
}

/// Llama 3.1's RoPE scaling from a GGUF file: llama.cpp's converter writes no keys for it, only
/// `rope_freqs`, what each pair's frequency is divided by. Every Llama 3.x checkpoint scales
/// with low and high frequency factors 1 and 4 over an original context of 8192 (its factor,
/// 8 or 32, is the largest divisor); bbc takes those and checks that they give the file's
/// divisors, refusing the file, naming the tensor, where they do not.
fn gguf_llama3_rope(
    file: &GgufFile,
    info: &crate::gguf::GgufTensorInfo,
    theta: f64,
    rotary_dim: usize,
) -> Result<ir::RopeScaling> {
    let refuse = |problem: String| ModelError::TensorShape {
        name: info.name.clone(),
        what: problem,
    };
    if info.dtype != crate::quant::GgmlType::F32 || info.elements() != rotary_dim / 2 {
        return Err(refuse(format!(
            "holds {} {} values; Llama 3.1's RoPE scaling has an f32 divisor for each of the {} rotary pairs",
            info.elements(),
            info.dtype.name(),
            rotary_dim / 2
        )));
    }
    let divisors: Vec<f64> = file
        .tensor_data(info)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)
        .collect();
    let scaling = ir::RopeScaling::Llama3 {
        factor: divisors.iter().copied().fold(1.0, f64::max),
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_context: 8192.0,
    };
    // The unscaled frequencies, as the rotation makes them.
    let unscaled = ir::reference::ops::rope_inv_freq(&ir::RopeSpec {
        heads: 1,
        head_dim: rotary_dim,
        rotary_dim,
        theta,
        position_scale: 1.0,
        layout: ir::RopeLayout::RotateHalf,
        scaling: ir::RopeScaling::None,
    });
    let fits = unscaled
        .iter()
        .zip(&divisors)
        .enumerate()
        .all(|(pair, (&inv_freq, &d))| {
            let divisor = inv_freq as f64 / scaling.rescale(pair, inv_freq, rotary_dim, theta) as f64;
            (divisor - d).abs() <= 1e-5 * d
        });
    match fits {
        true => Ok(scaling),
        false => Err(refuse(
            "divides the frequencies otherwise than Llama 3.1's scaling over a context of 8192 does".into(),
        )),
    }
}

/// A GGUF file's `rope.scaling.*` keys as llama.cpp reads them: the linear position scale, and
/// YaRN where the type says so. llama.cpp's YaRN is transformers' with truncation (its
/// correction dims floored and ceiled) and the attention factor `0.1·ln(factor) + 1`; a file
/// that changes those (a `yarn_ext_factor` or `yarn_attn_factor` other than 1, a
/// `yarn_log_multiplier`) is refused naming the key, as is YaRN on latent attention (GLM-5:
/// llama.cpp's versions have scaled its softmax and rotation differently) or Gemma 4, and any
/// other type.
fn gguf_rope_scaling(file: &GgufFile, arch: &str, family: Family) -> Result<(f64, Option<ir::RopeScaling>)> {
    let key = |name: &str| format!("{arch}.{name}");
    let refuse = |name: &str, problem: String| ModelError::Metadata {
        path: file.path.clone(),
        key: key(name),
        problem,
    };
    match file.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
        None | Some("none") => Ok((1.0, None)),
        Some("linear") => Ok((file.optional_f64(&key("rope.scaling.factor"))?.unwrap_or(1.0), None)),
        Some("yarn") if family == Family::GlmMoeDsa => Err(refuse(
            "rope.scaling.type",
            "is \"yarn\" on latent attention, whose softmax and rotation scales llama.cpp's versions have set differently; bbc reads it from HF configs".into(),
        )),
        Some("yarn") if family != Family::Gemma4 => {
            for (name, unchanged) in [
                ("rope.scaling.yarn_ext_factor", 1.0),
                ("rope.scaling.yarn_attn_factor", 1.0),
                ("rope.scaling.yarn_log_multiplier", 0.0),
            ] {
                match file.optional_f64(&key(name))? {
                    Some(v) if v != unchanged && !(name.ends_with("ext_factor") && v < 0.0) => {
                        return Err(refuse(
                            name,
                            format!("is {v}; bbc computes YaRN as llama.cpp does by default (this key at {unchanged})"),
                        ))
                    }
                    _ => {}
                }
            }
            let positive = |name: &str, default: Option<f64>| -> Result<f64> {
                match file.optional_f64(&key(name))?.or(default) {
                    Some(v) if v.is_finite() && v > 0.0 => Ok(v),
                    Some(v) => Err(refuse(name, format!("is {v}, not a positive number"))),
                    None => Err(refuse(name, "is missing: YaRN needs it".into())),
                }
            };
            let factor = positive("rope.scaling.factor", None)?;
            Ok((
                1.0,
                Some(ir::RopeScaling::Yarn {
                    factor,
                    original_context: positive("rope.scaling.original_context_length", None)?,
                    beta_fast: positive("rope.scaling.yarn_beta_fast", Some(32.0))?,
                    beta_slow: positive("rope.scaling.yarn_beta_slow", Some(1.0))?,
                    truncate: true,
                    attention_factor: yarn_mscale(factor, 1.0),
                }),
            ))
        }
        Some(other) => Err(refuse(
            "rope.scaling.type",
            format!("is {other:?}; bbc computes RoPE unscaled, linear, YaRN or as Llama 3.1 scales it"),
        )),
    }
}

/// A GGUF GLM-5's latent attention (llama.cpp's `glm-dsa` keys, as its `DeepseekV2Model`
/// converter writes them): the ranks, `key_length_mla` = nope + rope and `value_length_mla`
/// per head, `rope.dimension_count` the rotated part, the indexer's heads, width and top-k.
/// `indexer.types` marks the layers with an indexer of their own (true) and those sharing the
/// previous full layer's (false; GLM-5.2). Where the key is absent llama.cpp takes every layer
/// as full below a context of 1M positions and GLM-5.2's own pattern from there on; bbc takes
/// the first and refuses the second, naming the key.
fn gguf_mla(file: &GgufFile, arch: &str, layers: usize) -> Result<MlaConfig> {
    let key = |k: &str| format!("{arch}.{k}");
    let u = |k: &str| file.require_u64(&key(k)).map(|v| v as usize);
    let refuse = |k: &str, problem: String| ModelError::Metadata {
        path: file.path.clone(),
        key: key(k),
        problem,
    };
    let shared_indexer = match file.get(&key("attention.indexer.types")).and_then(|v| v.as_array()) {
        // The model's own layers (prediction layers, where counted, come after them).
        Some(types) => types
            .iter()
            .take(layers)
            .map(|t| t.as_bool().map(|full| !full))
            .collect::<Option<Vec<bool>>>()
            .ok_or_else(|| refuse("attention.indexer.types", "holds something other than true or false".into()))?,
        None if u("context_length")? >= 1 << 20 => {
            return Err(refuse(
                "attention.indexer.types",
                "is absent at a context of 1M positions or more, where llama.cpp assumes GLM-5.2's pattern of shared indexers; write the types into the file".into(),
            ))
        }
        None => vec![false; layers],
    };
    let rope_dim = u("rope.dimension_count")?;
    let key_dim = u("attention.key_length_mla")?;
    let nope_dim = key_dim.checked_sub(rope_dim).ok_or_else(|| {
        refuse(
            "attention.key_length_mla",
            format!("is {key_dim}, less than the rotated {rope_dim}"),
        )
    })?;
    Ok(MlaConfig {
        shared_indexer,
        q_rank: u("attention.q_lora_rank")?,
        kv_rank: u("attention.kv_lora_rank")?,
        nope_dim,
        rope_dim,
        value_dim: u("attention.value_length_mla")?,
        index_heads: u("attention.indexer.head_count")?,
        index_dim: u("attention.indexer.key_length")?,
        index_topk: u("attention.indexer.top_k")?,
        // YaRN on latent attention is refused from GGUF files (`gguf_rope_scaling`).
        softmax_mscale: 1.0,
    })
}

/// HF's `kv_sharing_modes` (llama.cpp's reading alike): of `layer_attention`'s layers the last
/// `shared` each read the keys and values of the last earlier layer of their kind that has its
/// own; `None` for the layers with their own.
fn kv_shared_layers(
    shared: usize,
    layer_attention: &[LayerAttention],
) -> std::result::Result<Vec<Option<usize>>, String> {
    let first_shared = layer_attention.len().checked_sub(shared).ok_or_else(|| {
        format!(
            "{shared} KV-shared layers is more than the model's {} layers",
            layer_attention.len()
        )
    })?;
    (0..layer_attention.len())
        .map(|i| match i < first_shared {
            true => Ok(None),
            false => {
                let kind = layer_attention[i];
                let producer = (0..first_shared).rev().find(|&p| layer_attention[p] == kind);
                producer.map(Some).ok_or_else(|| {
                    format!(
                        "layer {i} shares keys and values with an earlier {kind:?} layer, but none of the first {first_shared} is one"
                    )
                })
            }
        })
        .collect()
}

/// Gemma 3's layer pattern: every sixth layer is global.
fn gemma3_pattern(layers: usize, every: usize) -> Vec<LayerAttention> {
    (0..layers)
        .map(|i| {
            if (i + 1) % every == 0 {
                LayerAttention::Full
            } else {
                LayerAttention::Sliding
            }
        })
        .collect()
}

impl ModelConfig {
    /// Llama-3-8B's shape (GQA 32/8 heads of 128, SwiGLU 14 336, 128 256-entry untied head),
    /// without its weights: for shape-only graphs (`lower_without_weights`), such as the GPU
    /// check's decode timings.
    pub fn llama3_8b() -> Self {
        let layers = 32;
        Self {
            family: Family::Llama,
            vocab_size: 128_256,
            hidden: 4096,
            layers,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            intermediate: 14_336,
            rms_eps: 1e-5,
            rope_theta: 500_000.0,
            rope_local_theta: 500_000.0,
            rope_scale: 1.0,
            rope_scaling: ir::RopeScaling::None,
            context_length: 8192,
            sliding_window: None,
            layer_attention: vec![LayerAttention::Full; layers],
            query_pre_attn_scalar: None,
            tied_embeddings: false,
            rotary_dim: 128,
            attention_bias: false,
            qk_norm: false,
            moe: None,
            linear_attention: None,
            gemma4: None,
            mla: None,
            final_logit_softcap: None,
        }
    }

    /// A 27B-class Qwen3.5's shape (hidden 5120, 64 layers with every fourth full attention,
    /// 24 query / 4 KV heads of 256, DeltaNet 16 key / 48 value heads of 128, MLP 17 408,
    /// vocabulary 248 320), without weights: for benchmarks of the compiler.
    pub fn qwen3_5_27b() -> Self {
        let layers = 64;
        Self {
            family: Family::Qwen35,
            vocab_size: 248_320,
            hidden: 5120,
            layers,
            heads: 24,
            kv_heads: 4,
            head_dim: 256,
            intermediate: 17_408,
            rms_eps: 1e-6,
            rope_theta: 10_000_000.0,
            rope_local_theta: 10_000_000.0,
            rope_scale: 1.0,
            rope_scaling: ir::RopeScaling::None,
            context_length: 262_144,
            sliding_window: None,
            layer_attention: (0..layers)
                .map(|i| match (i + 1) % 4 {
                    0 => LayerAttention::Full,
                    _ => LayerAttention::Linear,
                })
                .collect(),
            query_pre_attn_scalar: None,
            tied_embeddings: false,
            rotary_dim: 64,
            attention_bias: false,
            qk_norm: true,
            moe: None,
            linear_attention: Some(LinearAttentionConfig {
                key_heads: 16,
                value_heads: 48,
                key_dim: 128,
                value_dim: 128,
                conv_kernel: 4,
            }),
            gemma4: None,
            mla: None,
            final_logit_softcap: None,
        }
    }

    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let arch = file.require_str("general.architecture")?;
        let family = Family::parse(arch).ok_or_else(|| ModelError::Metadata {
            path: file.path.clone(),
            key: "general.architecture".into(),
            problem: format!(
                "is `{arch}`; bbc runs llama, gemma3, gemma4, glm4moe, glm-dsa, qwen35, qwen35moe and qwen3next from GGUF"
            ),
        })?;
        // Gemma 4's heads and MLP widths differ by layer: keys of its own.
        if family == Family::Gemma4 {
            return gguf_gemma4::read(file);
        }
        let key = |k: &str| format!("{arch}.{k}");
        let u = |k: &str| file.require_u64(&key(k)).map(|v| v as usize);
        let hidden = u("embedding_length")?;
        let heads = u("attention.head_count")?;
        // Multi-token-prediction layers (llama.cpp's converter keeps a checkpoint's MTP layers
        // as blocks after the model's own) are counted in `block_count`; bbc does not run them.
        let blocks = u("block_count")?;
        let mtp = file.optional_u64(&key("nextn_predict_layers"))?.unwrap_or(0) as usize;
        let layers = blocks
            .checked_sub(mtp)
            .filter(|&l| l > 0)
            .ok_or_else(|| ModelError::Metadata {
                path: file.path.clone(),
                key: key("nextn_predict_layers"),
                problem: format!("{mtp} prediction layers leave none of {blocks} blocks"),
            })?;
        let mla = match family {
            Family::GlmMoeDsa => Some(gguf_mla(file, arch, layers)?),
            _ => None,
        };
        let head_dim = match (file.optional_u64(&key("attention.key_length"))?, &mla) {
            // Latent attention's `key_length` is the latent's (llama.cpp runs it as one KV head
            // of latent + rope); the config's head is HF's, the rotated part.
            (_, Some(m)) => m.rope_dim,
            (Some(d), None) => d as usize,
            (None, None) => hidden / heads.max(1),
        };
        let vocab_size = match file.get("tokenizer.ggml.tokens").and_then(|t| t.as_array()) {
            Some(tokens) => tokens.len(),
            None => u("vocab_size")?,
        };
        let sliding_window = file.optional_u64(&key("attention.sliding_window"))?.map(|w| w as usize);
        let rope_theta = file.optional_f64(&key("rope.freq_base"))?.unwrap_or(10_000.0);
        let (layer_attention, rope_local_theta, query_pre_attn_scalar) = match family {
            Family::Llama => (vec![LayerAttention::Full; layers], rope_theta, None),
            // llama.cpp's gemma3: sliding layers use θ = 10 000; the scale is 1/√head_dim
            // (gemma-3 sets query_pre_attn_scalar = head_dim).
            Family::Gemma3 => (gemma3_pattern(layers, 6), 10_000.0, Some(head_dim as f64)),
            Family::Qwen35 | Family::Qwen3Next => (gguf_recurrent_layers(file, arch, layers)?, rope_theta, None),
            Family::Glm4Moe | Family::GlmMoeDsa => (vec![LayerAttention::Full; layers], rope_theta, None),
            Family::Gemma4 => unreachable!("read by gguf_gemma4"),
        };
        let linear_attention = match family {
            Family::Qwen35 | Family::Qwen3Next => Some(gguf_linear_attention(file, arch)?),
            _ => None,
        };
        let moe = match family {
            Family::Qwen3Next => Some(gguf_qwen_moe(file, arch, layers)?),
            Family::Qwen35 if file.get(&key("expert_count")).is_some() => Some(gguf_qwen_moe(file, arch, layers)?),
            Family::Glm4Moe | Family::GlmMoeDsa => Some(gguf_glm_moe(file, arch, layers)?),
            _ => None,
        };
        let (rope_scale, yarn) = gguf_rope_scaling(file, arch, family)?;
        let rotary_dim = match file.optional_u64(&key("rope.dimension_count"))? {
            Some(d) => d as usize,
            None => head_dim,
        };
        let rope_scaling = match (yarn, file.tensor("rope_freqs.weight")) {
            (Some(yarn), _) => yarn,
            (None, Some(info)) if family == Family::Llama => gguf_llama3_rope(file, info, rope_theta, rotary_dim)?,
            _ => ir::RopeScaling::None,
        };
        let config = Self {
            family,
            vocab_size,
            hidden,
            layers,
            heads,
            // Latent attention's one KV head is llama.cpp's way of running it; bbc's heads each
            // have their key and value.
            kv_heads: match family {
                Family::GlmMoeDsa => heads,
                _ => file
                    .optional_u64(&key("attention.head_count_kv"))?
                    .map_or(heads, |v| v as usize),
            },
            head_dim,
            intermediate: match &moe {
                // A model whose every layer is MoE may leave the dense width unsaid.
                Some(m) => file
                    .optional_u64(&key("feed_forward_length"))?
                    .map_or(m.expert_intermediate, |v| v as usize),
                None => u("feed_forward_length")?,
            },
            rms_eps: file.require_f64(&key("attention.layer_norm_rms_epsilon"))?,
            rope_theta,
            rope_local_theta,
            rope_scale,
            rope_scaling,
            context_length: u("context_length")?,
            sliding_window,
            layer_attention,
            query_pre_attn_scalar,
            tied_embeddings: file.tensor("output.weight").is_none(),
            rotary_dim,
            // GLM-4.5 has Q/K/V biases and, in some checkpoints, q/k norms: as its tensors say.
            attention_bias: family == Family::Glm4Moe && file.tensor("blk.0.attn_q.bias").is_some(),
            qk_norm: match family {
                Family::Gemma3 | Family::Qwen35 | Family::Qwen3Next => true,
                Family::Glm4Moe => file.tensor("blk.0.attn_q_norm.weight").is_some(),
                _ => false,
            },
            moe,
            linear_attention,
            gemma4: None,
            mla,
            // llama.cpp's key for Gemma 2's cap (its Gemma 3 files have none).
            final_logit_softcap: file
                .optional_f64(&key("final_logit_softcapping"))?
                .map(|cap| cap as f32),
        };
        config.check(&file.path)
    }

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
        };
        config.check(path)
    }

    /// Reject hyperparameters no model can have, so lowering never divides by zero.
    fn check(self, path: &Path) -> Result<Self> {
        let bad = |what: String| ModelError::Config {
            path: path.to_path_buf(),
            what,
        };
        if self.hidden == 0
            || self.heads == 0
            || self.kv_heads == 0
            || self.head_dim == 0
            || self.layers == 0
            || self.vocab_size == 0
        {
            return Err(bad(
                "hidden size, heads, KV heads, head_dim, layers and vocab must be positive".into(),
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(bad(format!(
                "{} heads is not a multiple of {} KV heads",
                self.heads, self.kv_heads
            )));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(bad(format!("head_dim {} must be even for RoPE", self.head_dim)));
        }
        if self.layer_attention.len() != self.layers {
            return Err(bad(format!(
                "{} layer types for {} layers",
                self.layer_attention.len(),
                self.layers
            )));
        }
        if self
            .final_logit_softcap
            .is_some_and(|cap| !(cap.is_finite() && cap > 0.0))
        {
            return Err(bad("final_logit_softcapping must be a positive number".into()));
        }
        if self.layer_attention.contains(&LayerAttention::Sliding) && self.sliding_window.is_none_or(|w| w == 0) {
            return Err(bad("sliding-window layers need a positive sliding_window".into()));
        }
        if self.rotary_dim == 0 || self.rotary_dim > self.head_dim || !self.rotary_dim.is_multiple_of(2) {
            return Err(bad(format!(
                "RoPE would rotate {} of head_dim {}: it must be even and at most head_dim",
                self.rotary_dim, self.head_dim
            )));
        }
        if let Some(m) = &self.mla {
            let dims = [
                m.q_rank,
                m.kv_rank,
                m.nope_dim,
                m.rope_dim,
                m.value_dim,
                m.index_heads,
                m.index_dim,
                m.index_topk,
            ];
            if dims.contains(&0) || !m.rope_dim.is_multiple_of(2) || m.rope_dim > m.index_dim {
                return Err(bad(format!(
                    "latent attention {m:?}: every size must be positive, the rope width even and within the index head"
                )));
            }
            if m.shared_indexer.len() != self.layers || m.shared_indexer.first() == Some(&true) {
                return Err(bad(format!(
                    "{} indexer types for {} layers, the first {}: one a layer, and a layer can share only an earlier layer's indexer",
                    m.shared_indexer.len(),
                    self.layers,
                    if m.shared_indexer.first() == Some(&true) { "shared" } else { "full" }
                )));
            }
        }
        if let Some(g) = &self.gemma4 {
            if g.layer_heads.len() != self.layers {
                return Err(bad(format!(
                    "{} layer head shapes for {} layers",
                    g.layer_heads.len(),
                    self.layers
                )));
            }
            for (i, h) in g.layer_heads.iter().enumerate() {
                if h.heads == 0
                    || h.kv_heads == 0
                    || !h.heads.is_multiple_of(h.kv_heads)
                    || !h.head_dim.is_multiple_of(2)
                {
                    return Err(bad(format!("layer {i}: {h:?} is not a valid attention shape")));
                }
            }
            if g.global_rope_fraction.is_some_and(|f| !(f > 0.0 && f <= 1.0)) {
                return Err(bad("the full-attention partial_rotary_factor must be in (0, 1]".into()));
            }
        }
        if let Some(moe) = &self.moe {
            moe.check(self.layers).map_err(bad)?;
        }
        let linear_layers = self.layer_attention.contains(&LayerAttention::Linear);
        match &self.linear_attention {
            Some(l) if l.key_heads == 0 || l.key_dim == 0 || l.value_dim == 0 || l.conv_kernel == 0 => {
                return Err(bad(
                    "linear attention heads, head dims and conv kernel must be positive".into(),
                ))
            }
            Some(l) if !l.value_heads.is_multiple_of(l.key_heads) => {
                return Err(bad(format!(
                    "{} linear value heads is not a multiple of {} key heads",
                    l.value_heads, l.key_heads
                )))
            }
            None if linear_layers => return Err(bad("linear_attention layers need their linear_* shapes".into())),
            _ => {}
        }
        if !(self.rms_eps.is_finite() && self.rms_eps >= 0.0) {
            return Err(bad(format!("rms eps {} is not a non-negative number", self.rms_eps)));
        }
        Ok(self)
    }
}

impl MoeConfig {
    fn check(&self, layers: usize) -> std::result::Result<(), String> {
        if self.sparse_layers.len() != layers {
            return Err(format!(
                "{} MoE layer flags for {layers} layers",
                self.sparse_layers.len()
            ));
        }
        let eligible = match self.router {
            ir::MoeRouter::Softmax | ir::MoeRouter::SoftmaxExpertScale => self.experts,
            ir::MoeRouter::GroupedSigmoid {
                groups,
                top_groups,
                scaling,
            } => {
                let per_group = match groups {
                    0 => 0,
                    g if self.experts.is_multiple_of(g) => self.experts / g,
                    _ => 0,
                };
                if per_group < 2 {
                    return Err(format!(
                        "{} experts do not split into n_group {groups} groups of at least two",
                        self.experts
                    ));
                }
                if !(1..=groups).contains(&top_groups) {
                    return Err(format!("topk_group {top_groups} is not in 1..={groups}"));
                }
                if !scaling.is_finite() {
                    return Err("routed_scaling_factor must be a number".into());
                }
                top_groups * per_group
            }
        };
        if !(1..=eligible).contains(&self.experts_per_token) {
            return Err(format!(
                "num_experts_per_tok {} is not in 1..={eligible} (the experts a token may choose from)",
                self.experts_per_token
            ));
        }
        if self.expert_intermediate == 0 {
            return Err("moe_intermediate_size must be positive".into());
        }
        Ok(())
    }
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
