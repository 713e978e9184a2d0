//! GLM-4.5 (`Glm4MoeForCausalLM`, also GLM-4.6/4.7): Llama's pre-norm decoder with biased
//! Q/K/V projections, optional per-head q/k RMSNorm before a partial RoPE (the first
//! `rotary_dim` dims of each head, rotate-half), dense SwiGLU MLPs in the first
//! `first_k_dense_replace` layers and mixture-of-experts layers after them: DeepSeek-V3's
//! sigmoid router with grouped choice and a score-correction bias, routed SwiGLU experts
//! (`Op::Moe`) plus always-on shared experts. From HF safetensors, and from llama.cpp's GGUF
//! files (`glm4moe`: experts stacked, read by `moe::experts_stacked`). The NextN
//! (multi-token prediction) layer after the last lowers to a draft graph ([`lower_mtp`]).

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
        x = decoder_layer(c, b, i, x, positions)?;
    }
    b.lm_head(c, x, 0.0)
}

/// The first multi-token prediction layer (DeepSeek-V3's layout, vLLM's `Glm4MoeMTP`).
pub(super) fn lower_mtp(c: &ModelConfig, b: &mut Builder) -> Result<()> {
    lower_nextn(c, b, &mut |b, i, x, positions| decoder_layer(c, b, i, x, positions))
}

/// A NextN layer, layer `layers` of the checkpoint, its decoder layer by `layer`: the token's
/// embedding and the target's hidden state each normed (`enorm`, `hnorm`), joined side by side
/// and projected back (`eh_proj`), the decoder layer, then its own final norm
/// (`shared_head.norm`) and head (`shared_head.head`, else the model's). Its next chained step
/// reads the decoder layer's output before that norm.
pub(super) fn lower_nextn(
    c: &ModelConfig,
    b: &mut Builder,
    layer: &mut dyn FnMut(&mut Builder, usize, NodeId, NodeId) -> Result<NodeId>,
) -> Result<()> {
    let i = c.layers;
    let named = |b: &Builder, (hf, gguf): (&'static str, &'static str)| b.naming.layer_named(i, (hf, gguf));
    let (_, positions, embedded) = b.token_embeddings(c)?;
    let hidden = b.graph.hidden_states_input(c.hidden);
    let enorm = named(b, ("enorm.weight", "nextn.enorm.weight"));
    let hnorm = named(b, ("hnorm.weight", "nextn.hnorm.weight"));
    let embedded = b.rms_norm(embedded, &enorm, c.hidden, c.rms_eps, 0.0)?;
    let hidden = b.rms_norm(hidden, &hnorm, c.hidden, c.rms_eps, 0.0)?;
    let joined = b.op(ir::Op::ConcatColumns, &[embedded, hidden])?;
    let eh = b.matrix(
        &named(b, ("eh_proj.weight", "nextn.eh_proj.weight")),
        c.hidden,
        2 * c.hidden,
    )?;
    let x = b.matmul(joined, eh)?;
    b.first_cached_layer = i;
    let x = layer(b, i, x, positions)?;
    let last = match b.options.logits {
        crate::LogitsFor::AllTokens => x,
        _ => b.op(ir::Op::LastToken, &[x])?,
    };
    b.graph.set_output(ir::multi_token::DRAFT_HIDDEN_STATE, last);
    let norm = named(b, ("shared_head.norm.weight", "nextn.shared_head_norm.weight"));
    let head = named(b, ("shared_head.head.weight", "nextn.shared_head_head.weight"));
    b.lm_head_named(c, last, &norm, Some(&head), 0.0)
}

/// Decoder layer `i` over the residual stream `x`: attention, then the MLP, each normed
/// before and added back.
fn decoder_layer(c: &ModelConfig, b: &mut Builder, i: usize, x: NodeId, positions: NodeId) -> Result<NodeId> {
    let h = b.rms_norm(x, &b.naming.layer(i, LayerTensor::AttnNorm), c.hidden, c.rms_eps, 0.0)?;
    let a = attention(c, b, i, h, positions)?;
    let x = b.add(x, a)?;
    // HF's `post_attention_layernorm`: the norm before the MLP.
    let norm = b.naming.layer(i, LayerTensor::PostAttnNorm);
    let h = b.rms_norm(x, &norm, c.hidden, c.rms_eps, 0.0)?;
    let m = mlp(c, b, i, h, SharedNames::Experts)?;
    b.add(x, m)
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
