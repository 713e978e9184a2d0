//! Qwen3.5's text model (`Qwen3_5ForCausalLM`): a hybrid of Gated DeltaNet layers (linear
//! attention with an f32 recurrent state) and gated full-attention layers, each followed by a
//! SwiGLU MLP. HF semantics:
//! - RMSNorms multiply by `(1 + w)` (zero-centred weights), except the DeltaNet's output norm,
//!   which multiplies by `w` and then by `silu(z)`;
//! - a DeltaNet layer projects the normed input four ways, `in_proj_qkv` (q, k, v for the
//!   convolution and the delta rule: `Op::GatedDeltaNet`), `in_proj_z` (the output gate),
//!   `in_proj_b` (the write strength β) and `in_proj_a` (the decay); the fusion passes join
//!   the four into one matmul;
//! - an attention layer's `q_proj` yields `[q | gate]` per head; q and k get per-head norms and
//!   a partial RoPE (`partial_rotary_factor`), and the attention output is multiplied by
//!   `sigmoid(gate)` before `o_proj`.
//!
//! Qwen3-Next (`Qwen3NextForCausalLM`) is the same model with two differences: its DeltaNet
//! projections come joined and interleaved per key head (`in_proj_qkvz`: per key head its q,
//! k, then its value heads' v and z; `in_proj_ba` likewise), which compile-time weight
//! transforms (`row_group_slice`) regroup into Qwen3.5's four; and its MLPs are mixtures of
//! experts (softmax router, a shared expert gated by `sigmoid(x · shared_expert_gate)`).
//!
//! From GGUF (llama.cpp's `qwen35`, `qwen35moe`, which is Qwen3.5 with Qwen3-Next's MoE MLPs,
//! and `qwen3next`), as llama.cpp's converter writes them: every norm weight but the
//! DeltaNet's output norm stored already `+ 1`, the decay rate as `A = −exp(A_log)` (`ssm_a`),
//! each projection's experts stacked into one tensor (`moe::experts_stacked`); for Qwen3.5
//! (and its MoE), where value heads outnumber key heads, value heads tiled over the key heads
//! rather than grouped by them (`ir::ValueHeadOrder::Tiled`: the value rows of the
//! projections, the convolution's value channels, `A`, `dt_bias` and the output projection's
//! columns all reordered alike); for Qwen3-Next, `in_proj_qkvz` split into Qwen3.5's
//! `attn_qkv` and `attn_gate` (value heads left grouped) and `in_proj_ba` kept as `ssm_ba`.
//! The multi-token prediction layers (`mtp.*` in HF checkpoints) lower to a draft graph of
//! their own ([`lower_mtp`]); llama.cpp's files keep them among the blocks, unread.

use super::moe::{mlp, SharedNames};
use super::{Builder, LayerTensor, Naming};
use crate::config::{Family, LayerAttention, LinearAttentionConfig, ModelConfig};
use crate::error::{ModelError, Result};
use ir::{DecayRate, DeltaNetSpec, NodeId, Op, RopeLayout, RopeSpec, ValueHeadOrder};

/// Qwen3.5's RMSNorm multiplies by `1 + w`: HF files store `w`, GGUF files `1 + w`.
fn norm_offset(naming: Naming) -> f32 {
    match naming {
        Naming::Gguf => 0.0,
        Naming::Hf(_) => 1.0,
    }
}

pub(super) fn lower(c: &ModelConfig, b: &mut Builder) -> Result<()> {
    let offset = norm_offset(b.naming);
    let (_, positions, mut x) = b.token_embeddings(c)?;
    for i in 0..c.layers {
        x = decoder_layer(c, b, i, c.layer_attention[i], x, positions)?;
    }
    b.lm_head(c, x, offset)
}

/// The multi-token prediction layers (vLLM's `Qwen3NextMTP`): the token's embedding and the
/// target's hidden state each normed (`pre_fc_norm_embedding`, `pre_fc_norm_hidden`), joined
/// side by side and projected back to the hidden size (`fc`), then full-attention decoder
/// layers, the final norm (`mtp.norm`) and the target's head. `b` names `mtp.` tensors.
pub(super) fn lower_mtp(c: &ModelConfig, b: &mut Builder) -> Result<()> {
    let offset = norm_offset(b.naming);
    let (_, positions, embedded) = b.token_embeddings(c)?;
    let hidden = b.graph.hidden_states_input(c.hidden);
    let embedded = b.rms_norm(
        embedded,
        "mtp.pre_fc_norm_embedding.weight",
        c.hidden,
        c.rms_eps,
        offset,
    )?;
    let hidden = b.rms_norm(hidden, "mtp.pre_fc_norm_hidden.weight", c.hidden, c.rms_eps, offset)?;
    let joined = b.op(Op::ConcatColumns, &[embedded, hidden])?;
    let fc = b.matrix("mtp.fc.weight", c.hidden, 2 * c.hidden)?;
    let mut x = b.matmul(joined, fc)?;
    for i in 0..c.mtp_layers {
        x = decoder_layer(c, b, i, LayerAttention::Full, x, positions)?;
    }
    b.lm_head(c, x, offset)?;
    // Its next chained step reads the normed state, as vLLM's `Qwen3NextMTP` passes it on.
    let normed = b.graph.output("hidden").expect("the head's norm");
    b.graph.set_output(ir::multi_token::DRAFT_HIDDEN_STATE, normed);
    Ok(())
}

/// Decoder layer `i` over the residual stream `x`: its token mixer (`attention`), then its MLP,
/// each normed before and added back.
fn decoder_layer(
    c: &ModelConfig,
    b: &mut Builder,
    i: usize,
    attention: LayerAttention,
    x: NodeId,
    positions: NodeId,
) -> Result<NodeId> {
    let offset = norm_offset(b.naming);
    let norm = b.naming.layer(i, LayerTensor::AttnNorm);
    let h = b.rms_norm(x, &norm, c.hidden, c.rms_eps, offset)?;
    let mixed = match attention {
        LayerAttention::Linear => {
            let shapes = c.linear_attention.ok_or_else(|| ModelError::TensorShape {
                name: "config".into(),
                what: "linear_attention layers need their linear_* shapes".into(),
            })?;
            delta_net(c, &shapes, b, i, h)?
        }
        LayerAttention::Full | LayerAttention::Sliding => gated_attention(c, b, i, h, positions)?,
    };
    let x = b.add(x, mixed)?;
    // HF's `post_attention_layernorm`: the norm before the MLP.
    let norm = b.naming.layer(i, LayerTensor::PostAttnNorm);
    let h = b.rms_norm(x, &norm, c.hidden, c.rms_eps, offset)?;
    let m = mlp(c, b, i, h, SharedNames::Expert)?;
    b.add(x, m)
}

/// The tensors of a DeltaNet layer.
#[derive(Debug, Clone, Copy)]
enum Linear {
    Qkv,
    Z,
    B,
    A,
    /// Qwen3-Next's `b` and `a` rows interleaved per key head (see [`beta_and_decay`]).
    Ba,
    Conv,
    ALog,
    DtBias,
    Norm,
    Out,
}

/// Layer `i`'s tensor `t`: `…layers.{i}.linear_attn.*` (HF) or `blk.{i}.*` (llama.cpp).
fn linear(naming: Naming, i: usize, t: Linear) -> String {
    let (hf, gguf) = match t {
        Linear::Qkv => ("in_proj_qkv.weight", "attn_qkv.weight"),
        Linear::Z => ("in_proj_z.weight", "attn_gate.weight"),
        Linear::B => ("in_proj_b.weight", "ssm_beta.weight"),
        Linear::A => ("in_proj_a.weight", "ssm_alpha.weight"),
        Linear::Ba => ("in_proj_ba.weight", "ssm_ba.weight"),
        Linear::Conv => ("conv1d.weight", "ssm_conv1d.weight"),
        // GGUF holds `A` itself here (`DecayRate::Value`).
        Linear::ALog => ("A_log", "ssm_a"),
        Linear::DtBias => ("dt_bias", "ssm_dt.bias"),
        Linear::Norm => ("norm.weight", "ssm_norm.weight"),
        Linear::Out => ("out_proj.weight", "ssm_out.weight"),
    };
    match naming {
        Naming::Gguf => format!("blk.{i}.{gguf}"),
        Naming::Hf(_) => naming.hf_layer(i, &format!("linear_attn.{hf}")),
    }
}

/// The Gated DeltaNet token mixer of layer `i` over the normed `h`, through `out_proj`.
fn delta_net(c: &ModelConfig, l: &LinearAttentionConfig, b: &mut Builder, i: usize, h: NodeId) -> Result<NodeId> {
    let spec = DeltaNetSpec {
        key_heads: l.key_heads,
        value_heads: l.value_heads,
        key_dim: l.key_dim,
        value_dim: l.value_dim,
        conv_kernel: l.conv_kernel,
        state_slot: i,
        // llama.cpp's converter tiles Qwen3.5's value heads and stores `A` (see the module's
        // notes).
        value_head_order: match (b.naming, c.family) {
            (Naming::Gguf, Family::Qwen35) => ValueHeadOrder::Tiled,
            _ => ValueHeadOrder::Grouped,
        },
        decay_rate: match b.naming {
            Naming::Gguf => DecayRate::Value,
            Naming::Hf(_) => DecayRate::Log,
        },
    };
    let (channels, values) = (spec.conv_channels(), l.value_heads * l.value_dim);
    let weights = match (c.family, b.naming) {
        (Family::Qwen3Next, Naming::Hf(_)) => interleaved_projections(c, l, b, i)?,
        _ => {
            let weight = |b: &mut Builder, t: Linear, rows: usize| b.matrix(&linear(b.naming, i, t), rows, c.hidden);
            let (qkv, z) = (weight(b, Linear::Qkv, channels)?, weight(b, Linear::Z, values)?);
            let [beta, decay] = match c.family {
                // llama.cpp keeps Qwen3-Next's `in_proj_ba` as it is.
                Family::Qwen3Next => {
                    let ba = weight(b, Linear::Ba, 2 * l.value_heads)?;
                    beta_and_decay(l, b, ba)?
                }
                _ => [
                    weight(b, Linear::B, l.value_heads)?,
                    weight(b, Linear::A, l.value_heads)?,
                ],
            };
            [qkv, z, beta, decay]
        }
    };
    let mut projected = [h; 4];
    for (p, w) in projected.iter_mut().zip(weights) {
        *p = b.matmul(h, w)?;
    }
    let [mixed, z, beta, decay] = projected;
    let conv = b.matrix(&linear(b.naming, i, Linear::Conv), channels, l.conv_kernel)?;
    let a_log = b.vector(&linear(b.naming, i, Linear::ALog), l.value_heads)?;
    let dt_bias = b.vector(&linear(b.naming, i, Linear::DtBias), l.value_heads)?;
    let o = b.op(Op::GatedDeltaNet(spec), &[mixed, beta, decay, conv, a_log, dt_bias])?;
    let o = b.rms_norm(o, &linear(b.naming, i, Linear::Norm), l.value_dim, c.rms_eps, 0.0)?;
    let gate = b.op(Op::Silu, &[z])?;
    let o = b.op(Op::Mul, &[o, gate])?;
    let w = b.matrix(&linear(b.naming, i, Linear::Out), c.hidden, values)?;
    b.matmul(o, w)
}

/// Qwen3-Next's DeltaNet weights regrouped as Qwen3.5's `[in_proj_qkv, in_proj_z, in_proj_b,
/// in_proj_a]`: per key head, `in_proj_qkvz` holds its q (`dk` rows), k (`dk`), then the v
/// and the z of its `r = value_heads / key_heads` value heads (`r·dv` each); `in_proj_ba`
/// holds per key head the b and then the a of those value heads (`r` each).
fn interleaved_projections(
    c: &ModelConfig,
    l: &LinearAttentionConfig,
    b: &mut Builder,
    i: usize,
) -> Result<[NodeId; 4]> {
    let (dk, r) = (l.key_dim, l.value_heads / l.key_heads);
    let rv = r * l.value_dim;
    let qkvz = b.matrix(
        &b.naming.hf_layer(i, "linear_attn.in_proj_qkvz.weight"),
        l.key_heads * (2 * dk + 2 * rv),
        c.hidden,
    )?;
    let ba = b.matrix(&linear(b.naming, i, Linear::Ba), l.key_heads * 2 * r, c.hidden)?;
    let rows = |b: &mut Builder, w: NodeId, group: usize, start: usize, len: usize| {
        b.op(Op::RowGroupSlice { group, start, len }, &[w])
    };
    let group = 2 * dk + 2 * rv;
    let q = rows(b, qkvz, group, 0, dk)?;
    let k = rows(b, qkvz, group, dk, dk)?;
    let v = rows(b, qkvz, group, 2 * dk, rv)?;
    let qkv = b.op(Op::ConcatRows, &[q, k, v])?;
    let z = rows(b, qkvz, group, 2 * dk + rv, rv)?;
    let [beta, decay] = beta_and_decay(l, b, ba)?;
    Ok([qkv, z, beta, decay])
}

/// Qwen3-Next's `in_proj_ba` (llama.cpp's `ssm_ba`, unchanged): per key head the b and then the
/// a of its `r` value heads; the b rows and the a rows apart.
fn beta_and_decay(l: &LinearAttentionConfig, b: &mut Builder, ba: NodeId) -> Result<[NodeId; 2]> {
    let r = l.value_heads / l.key_heads;
    let beta = b.op(
        Op::RowGroupSlice {
            group: 2 * r,
            start: 0,
            len: r,
        },
        &[ba],
    )?;
    let decay = b.op(
        Op::RowGroupSlice {
            group: 2 * r,
            start: r,
            len: r,
        },
        &[ba],
    )?;
    Ok([beta, decay])
}

/// Gated self-attention of layer `i` over the normed `h`, through `o_proj`.
fn gated_attention(c: &ModelConfig, b: &mut Builder, i: usize, h: NodeId, positions: NodeId) -> Result<NodeId> {
    let hd = c.head_dim;
    let (q_dim, kv_dim) = (c.heads * hd, c.kv_heads * hd);
    let q_gate = b.attention_projection(c, i, LayerTensor::Q, h, 2 * q_dim, c.hidden)?;
    let q = b.op(
        Op::GroupSlice {
            group: 2 * hd,
            start: 0,
            len: hd,
        },
        &[q_gate],
    )?;
    let gate = b.op(
        Op::GroupSlice {
            group: 2 * hd,
            start: hd,
            len: hd,
        },
        &[q_gate],
    )?;
    let k = b.attention_projection(c, i, LayerTensor::K, h, kv_dim, c.hidden)?;
    let v = b.attention_projection(c, i, LayerTensor::V, h, kv_dim, c.hidden)?;
    let offset = norm_offset(b.naming);
    let q = b.rms_norm(q, &b.naming.layer(i, LayerTensor::QNorm), hd, c.rms_eps, offset)?;
    let k = b.rms_norm(k, &b.naming.layer(i, LayerTensor::KNorm), hd, c.rms_eps, offset)?;
    let rope = RopeSpec {
        heads: c.heads,
        head_dim: hd,
        rotary_dim: c.rotary_dim,
        theta: c.rope_theta,
        position_scale: c.rope_scale,
        layout: RopeLayout::RotateHalf,
        scaling: c.rope_scaling,
    };
    let spec = b.causal_attention(c.heads, c.kv_heads, hd, i);
    let a = b.rotary_attention([q, k, v], positions, rope, spec)?;
    let gate = b.op(Op::Sigmoid, &[gate])?;
    let a = b.op(Op::Mul, &[a, gate])?;
    b.attention_projection(c, i, LayerTensor::O, a, c.hidden, q_dim)
}
