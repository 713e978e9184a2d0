//! GLM-4.5 (`Glm4MoeForCausalLM`, also GLM-4.6/4.7): Llama's pre-norm decoder with biased
//! Q/K/V projections, optional per-head q/k RMSNorm before a partial RoPE (the first
//! `rotary_dim` dims of each head, rotate-half), dense SwiGLU MLPs in the first
//! `first_k_dense_replace` layers and mixture-of-experts layers after them: DeepSeek-V3's
//! sigmoid router with grouped choice and a score-correction bias, routed SwiGLU experts
//! (`Op::Moe`) plus always-on shared experts. HF safetensors only (GGUF stacks its experts,
//! which bbc does not read yet).

use super::moe::{mlp, SharedNames};
use super::{Builder, LayerTensor};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use ir::{AttentionSpec, NodeId, Op, RopeLayout, RopeSpec};

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
        let h = b.rms_norm(x, &b.naming.layer(i, LayerTensor::FfnNorm), c.hidden, c.rms_eps, 0.0)?;
        let m = mlp(c, b, i, h, SharedNames::Experts)?;
        x = b.add(x, m)?;
    }
    b.lm_head(c, x, 0.0)
}

/// Self-attention of layer `i` over the normed `h`, through the output projection.
fn attention(c: &ModelConfig, b: &mut Builder, i: usize, h: NodeId, positions: NodeId) -> Result<NodeId> {
    let (q_dim, kv_dim) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
    let mut qkv = Vec::with_capacity(3);
    for (t, rows) in [
        (LayerTensor::Q, q_dim),
        (LayerTensor::K, kv_dim),
        (LayerTensor::V, kv_dim),
    ] {
        let w = b.matrix(&b.naming.layer(i, t), rows, c.hidden)?;
        let mut y = b.matmul(h, w)?;
        if c.attention_bias {
            let bias = b.vector(&b.naming.layer_bias(i, t), rows)?;
            y = b.op(Op::AddBias, &[y, bias])?;
        }
        qkv.push(y);
    }
    let (mut q, mut k, v) = (qkv[0], qkv[1], qkv[2]);
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
    };
    let spec = AttentionSpec {
        heads: c.heads,
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        scale: 1.0 / (c.head_dim as f64).sqrt(),
        window: None,
        cache_slot: i,
        cache_dtype: b.cache_dtype(),
    };
    let a = b.rotary_attention([q, k, v], positions, rope, spec)?;
    let wo = b.matrix(&b.naming.layer(i, LayerTensor::O), c.hidden, q_dim)?;
    b.matmul(a, wo)
}
