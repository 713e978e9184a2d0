//! Architecture hyperparameters: what a model's lowering needs to know, read from an HF
//! `config.json` (`hf`) or GGUF metadata (`gguf`, `gguf_gemma4`), or stated for named shapes
//! (`shapes`).

use crate::error::{ModelError, Result};
use serde::Serialize;
use std::path::Path;

mod gguf;
mod gguf_gemma4;
mod hf;
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
    /// Multi-token prediction layers the checkpoint carries after its decoder layers
    /// (`mtp_num_hidden_layers`, `num_nextn_predict_layers`): a draft head that predicts the
    /// token after next from a token and the model's hidden state before it.
    pub mtp_layers: usize,
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

/// YaRN's `mscale`: `0.1 · mscale · ln(factor) + 1`, 1 where the factor does not stretch.
fn yarn_mscale(factor: f64, mscale: f64) -> f64 {
    match factor <= 1.0 {
        true => 1.0,
        false => 0.1 * mscale * factor.ln() + 1.0,
    }
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
            mtp_layers: 0,
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
            mtp_layers: 0,
        }
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
