//! Llama (SmolLM2): pre-norm decoder, GQA attention with RoPE, SwiGLU MLP, tied or separate
//! LM head. HF `LlamaForCausalLM` semantics.
//!
//! llama.cpp's converter permutes the rows of `attn_q`/`attn_k` in GGUF files so that rotary
//! pairs are adjacent; with GGUF weights we rotate adjacent pairs instead of undoing the
//! permutation, which is the same function.

use super::{Builder, LayerTensor, Naming};
use crate::config::ModelConfig;
use crate::error::Result;
use ir::{GluAct, RopeLayout, RopeSpec};

/// RoPE over every dim of each head, at the config's θ and scaling, in `layout`.
pub(super) fn rope(c: &ModelConfig, layout: RopeLayout) -> RopeSpec {
    RopeSpec {
        heads: c.heads,
        head_dim: c.head_dim,
        rotary_dim: c.head_dim,
        theta: c.rope_theta,
        position_scale: c.rope_scale,
        layout,
        scaling: c.rope_scaling,
    }
}

pub(super) fn lower(c: &ModelConfig, b: &mut Builder) -> Result<()> {
    let (_, positions, mut x) = b.token_embeddings(c)?;
    let layout = match b.naming {
        Naming::Gguf => RopeLayout::AdjacentPairs,
        Naming::Hf(_) => RopeLayout::RotateHalf,
    };
    let (q_dim, kv_dim) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
    for i in 0..c.layers {
        let naming = b.naming;
        let name = |t| naming.layer(i, t);
        let (n_attn, n_q, n_k, n_v, n_o) = (
            name(LayerTensor::AttnNorm),
            name(LayerTensor::Q),
            name(LayerTensor::K),
            name(LayerTensor::V),
            name(LayerTensor::O),
        );
        let (n_ffn, n_gate, n_up, n_down) = (
            name(LayerTensor::FfnNorm),
            name(LayerTensor::Gate),
            name(LayerTensor::Up),
            name(LayerTensor::Down),
        );
        let h = b.rms_norm(x, &n_attn, c.hidden, c.rms_eps, 0.0)?;
        let (wq, wk, wv) = (
            b.matrix(&n_q, q_dim, c.hidden)?,
            b.matrix(&n_k, kv_dim, c.hidden)?,
            b.matrix(&n_v, kv_dim, c.hidden)?,
        );
        let (q, k, v) = (b.matmul(h, wq)?, b.matmul(h, wk)?, b.matmul(h, wv)?);
        let rope = rope(c, layout);
        let spec = b.causal_attention(c.heads, c.kv_heads, c.head_dim, i);
        let a = b.rotary_attention([q, k, v], positions, rope, spec)?;
        let wo = b.matrix(&n_o, c.hidden, q_dim)?;
        let o = b.matmul(a, wo)?;
        x = b.add(x, o)?;

        let h = b.rms_norm(x, &n_ffn, c.hidden, c.rms_eps, 0.0)?;
        let d = b.gated_mlp(h, &[n_gate, n_up, n_down], c.hidden, c.intermediate, GluAct::Silu)?;
        x = b.add(x, d)?;
    }
    b.lm_head(c, x, 0.0)
}
