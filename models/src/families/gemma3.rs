//! Gemma 3: embeddings scaled by √hidden, sandwich norms (pre and post attention, pre and
//! post MLP), per-head q/k RMSNorm before RoPE, GeGLU (tanh GELU) MLP, sliding-window layers
//! with their own RoPE θ, `query_pre_attn_scalar^-0.5` attention scale. HF `Gemma3ForCausalLM`.
//!
//! Gemma's RMSNorm multiplies by `(1 + w)`. GGUF files store every norm weight already +1
//! (llama.cpp's converter adds it), HF files store `w`: the norm's `weight_offset` is 0 or 1.

use super::{Builder, ComputeDtype, LayerTensor, Naming};
use crate::config::{LayerAttention, ModelConfig};
use crate::error::Result;
use ir::{AttentionSpec, GluAct, Op, RopeLayout, RopeSpec};

pub(super) fn lower(c: &ModelConfig, b: &mut Builder) -> Result<()> {
    let offset = match b.naming {
        Naming::Gguf => 0.0,
        Naming::Hf(_) => 1.0,
    };
    let (_, positions, x) = b.token_embeddings(c)?;
    let mut x = b.op(
        Op::Scale {
            factor: embedding_scale(c.hidden, b.options.compute),
        },
        &[x],
    )?;
    let (q_dim, kv_dim) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
    let eps = c.rms_eps;
    for i in 0..c.layers {
        let naming = b.naming;
        let n = |t| naming.layer(i, t);
        let sliding = c.layer_attention[i] == LayerAttention::Sliding;
        let h = b.rms_norm(x, &n(LayerTensor::AttnNorm), c.hidden, eps, offset)?;
        let (wq, wk, wv) = (
            b.matrix(&n(LayerTensor::Q), q_dim, c.hidden)?,
            b.matrix(&n(LayerTensor::K), kv_dim, c.hidden)?,
            b.matrix(&n(LayerTensor::V), kv_dim, c.hidden)?,
        );
        let (q, k, v) = (b.matmul(h, wq)?, b.matmul(h, wk)?, b.matmul(h, wv)?);
        let q = b.rms_norm(q, &n(LayerTensor::QNorm), c.head_dim, eps, offset)?;
        let k = b.rms_norm(k, &n(LayerTensor::KNorm), c.head_dim, eps, offset)?;
        let rope = RopeSpec {
            heads: c.heads,
            head_dim: c.head_dim,
            rotary_dim: c.head_dim,
            theta: if sliding { c.rope_local_theta } else { c.rope_theta },
            position_scale: if sliding { 1.0 } else { c.rope_scale },
            layout: RopeLayout::RotateHalf,
            scaling: if sliding { ir::RopeScaling::None } else { c.rope_scaling },
        };
        let spec = AttentionSpec {
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            scale: 1.0 / c.query_pre_attn_scalar.unwrap_or(c.head_dim as f64).sqrt(),
            window: if sliding { c.sliding_window } else { None },
            cache_slot: i,
            cache_dtype: b.cache_dtype(),
        };
        let a = b.rotary_attention([q, k, v], positions, rope, spec)?;
        let wo = b.matrix(&n(LayerTensor::O), c.hidden, q_dim)?;
        let o = b.matmul(a, wo)?;
        let o = b.rms_norm(o, &n(LayerTensor::PostAttnNorm), c.hidden, eps, offset)?;
        x = b.add(x, o)?;

        let h = b.rms_norm(x, &n(LayerTensor::PreFfnNorm), c.hidden, eps, offset)?;
        let mlp = [LayerTensor::Gate, LayerTensor::Up, LayerTensor::Down].map(n);
        let d = b.gated_mlp(h, &mlp, c.hidden, c.intermediate, GluAct::GeluTanh)?;
        let d = b.rms_norm(d, &n(LayerTensor::PostFfnNorm), c.hidden, eps, offset)?;
        x = b.add(x, d)?;
    }
    b.lm_head(c, x, offset)
}

/// `√hidden` rounded to the dtype HF computes it in (the weights' dtype: √640 is 25.25 in bf16).
fn embedding_scale(hidden: usize, compute: ComputeDtype) -> f32 {
    compute.round((hidden as f32).sqrt())
}
