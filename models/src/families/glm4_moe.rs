//! GLM-4.5 (`Glm4MoeForCausalLM`, also GLM-4.6/4.7): Llama's pre-norm decoder with biased
//! Q/K/V projections, optional per-head q/k RMSNorm before a partial RoPE (the first
//! `rotary_dim` dims of each head, rotate-half), dense SwiGLU MLPs in the first
//! `first_k_dense_replace` layers and mixture-of-experts layers after them: DeepSeek-V3's
//! sigmoid router with grouped choice and a score-correction bias, routed SwiGLU experts
//! (`Op::Moe`) plus always-on shared experts. From HF safetensors, and from llama.cpp's GGUF
//! files (`glm4moe`: experts stacked, read by `moe::experts_stacked`).

use super::moe::{mlp, SharedNames};
use super::{Builder, LayerTensor};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use ir::{NodeId, RopeLayout, RopeSpec};

pub(super) fn lower(c: &ModelConfig, b: &mut Builder) -> Result<()> {
    c.moe.as_ref().ok_or_else(|| ModelError::TensorShape {
        name: "config".into(),
        what: "a glm4_moe model needs its MoE settings".into(),
    })?;
    let (_, positions, mut x) = b.token_embeddings(c)?;
    for i in 0..c.layers {
        let h = b.rms_norm(x, &b.naming.layer(i, LayerTensor::AttnNorm), c.hidden, c.rms_eps, 0.0)?;
        let a = attention(c, b, i, h, positions)?;
        x = b.add(x, a)?;
        // HF's `post_attention_layernorm`: the norm before the MLP.
        let h = b.rms_norm(
            x,
            &b.naming.layer(i, LayerTensor::PostAttnNorm),
            c.hidden,
            c.rms_eps,
            0.0,
        )?;
        let m = mlp(c, b, i, h, SharedNames::Experts)?;
        x = b.add(x, m)?;
    }
    b.lm_head(c, x, 0.0)
}

/// Self-attention of layer `i` over the normed `h`, through the output projection.
fn attention(c: &ModelConfig, b: &mut Builder, i: usize, h: NodeId, positions: NodeId) -> Result<NodeId> {
    let (q_dim, kv_dim) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
    let mut q = b.attention_projection(c, i, LayerTensor::Q, h, q_dim, c.hidden)?;
    let mut k = b.attention_projection(c, i, LayerTensor::K, h, kv_dim, c.hidden)?;
    let v = b.attention_projection(c, i, LayerTensor::V, h, kv_dim, c.hidden)?;
    if c.qk_norm {
        q = b.rms_norm(q, &b.naming.layer(i, LayerTensor::QNorm), c.head_dim, c.rms_eps, 0.0)?;
        k = b.rms_norm(k, &b.naming.layer(i, LayerTensor::KNorm), c.head_dim, c.rms_eps, 0.0)?;
    }
    let rope = RopeSpec {
        heads: c.heads,
        head_dim: c.head_dim,
        rotary_dim: c.rotary_dim,
        theta: c.rope_theta,
        position_scale: c.rope_scale,
        layout: RopeLayout::RotateHalf,
        scaling: c.rope_scaling,
    };
    let spec = b.causal_attention(c.heads, c.kv_heads, c.head_dim, i);
    let a = b.rotary_attention([q, k, v], positions, rope, spec)?;
    let wo = b.matrix(&b.naming.layer(i, LayerTensor::O), c.hidden, q_dim)?;
    b.matmul(a, wo)
}
