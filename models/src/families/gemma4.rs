//! Gemma 4's text model (`Gemma4ForCausalLM`): Gemma 3's sandwich-normed decoder (norms before
//! and after attention and MLP, sliding-window layers with their own RoPE) with these
//! differences, HF semantics:
//! - RMSNorms multiply by `w` (not `1 + w`); values get a weightless RMSNorm before the cache,
//!   and the attention scale is 1 (q and k are normed);
//! - full-attention layers may have their own head shape (`per_layer_config`, 512-wide heads
//!   in Gemma 4) and *proportional* RoPE: the first `partial_rotary_factor` of each head's
//!   rotate-half pairs turn, at frequencies spaced over the whole head (`RopeLayout::Proportional`);
//! - per-layer inputs: a second embedding (`embed_tokens_per_layer`, `hidden_size_per_layer_input`
//!   values per layer and token) plus a normed projection of the main embedding, which each
//!   layer gates (`gelu(x · per_layer_input_gate) · input`), projects back and adds to the
//!   residual after its MLP;
//! - each layer's output is multiplied by its `layer_scalar`;
//! - the last `num_kv_shared_layers` layers project queries only and attend over the keys and
//!   values of the last earlier layer of their kind (`shared_kv_attention` on its cache slot,
//!   so they keep no cache of their own), with MLPs twice as wide where `use_double_wide_mlp`.
//!   Writing no cache, they only matter at the rows whose logits are wanted: unless every
//!   row's are, they run on those rows alone (`last_token` before them, of the residual
//!   stream, the positions and the per-layer inputs), as HF's generate does;
//! - with `attention_k_eq_v`, full-attention layers take their values from the key
//!   projection (before its norm and RoPE);
//! - logits may be soft-capped (`final_logit_softcapping`, in [`Builder::lm_head`]);
//! - with `enable_moe_block`, a mixture of experts runs beside each layer's MLP, on the
//!   residual stream before it (see [`moe_block`]).

use super::{moe, Builder, LayerTensor, LogitsFor, Naming, TensorNames};
use crate::config::{Gemma4Config, LayerAttention, ModelConfig, MoeConfig};
use crate::error::{ModelError, Result};
use ir::{AttentionSpec, GluAct, MoeSpec, NodeId, Op, RopeLayout, RopeSpec};

// Gemma 4's own tensors: HF's names and llama.cpp's (`Gemma4Model` in its converter).
const LAYER_SCALAR: TensorNames = ("layer_scalar", "layer_output_scale.weight");
const PER_LAYER_EMBEDDING: TensorNames = ("embed_tokens_per_layer.weight", "per_layer_token_embd.weight");
const PER_LAYER_PROJECTION: TensorNames = ("per_layer_model_projection.weight", "per_layer_model_proj.weight");
const PER_LAYER_PROJECTION_NORM: TensorNames = ("per_layer_projection_norm.weight", "per_layer_proj_norm.weight");
const LAYER_INPUT_GATE: TensorNames = ("per_layer_input_gate.weight", "inp_gate.weight");
const LAYER_INPUT_PROJECTION: TensorNames = ("per_layer_projection.weight", "proj.weight");
const LAYER_INPUT_NORM: TensorNames = ("post_per_layer_input_norm.weight", "post_norm.weight");
const DENSE_MLP_POST_NORM: TensorNames = ("post_feedforward_layernorm_1.weight", "post_ffw_norm_1.weight");
const ROUTER: TensorNames = ("router.proj.weight", "ffn_gate_inp.weight");
const ROUTER_SCALE: TensorNames = ("router.scale", "ffn_gate_inp.scale");
const EXPERT_SCALES: TensorNames = ("router.per_expert_scale", "ffn_down_exps.scale");
const EXPERTS_PRE_NORM: TensorNames = ("pre_feedforward_layernorm_2.weight", "pre_ffw_norm_2.weight");
const EXPERTS_POST_NORM: TensorNames = ("post_feedforward_layernorm_2.weight", "post_ffw_norm_2.weight");

pub(super) fn lower(c: &ModelConfig, b: &mut Builder) -> Result<()> {
    let g = c.gemma4.as_ref().ok_or_else(|| ModelError::TensorShape {
        name: "config".into(),
        what: "a gemma4 model needs its per-layer settings".into(),
    })?;
    let (ids, mut positions, x) = b.token_embeddings(c)?;
    // As HF holds it in the model's dtype (bf16 for a bf16 model: √640 becomes 25.25).
    let scale = b.options.compute.round((c.hidden as f32).sqrt());
    let mut x = b.op(Op::Scale { factor: scale }, &[x])?;
    let mut per_layer = match g.per_layer_input {
        0 => None,
        _ => Some(per_layer_inputs(c, g, b, ids, x)?),
    };
    let first_shared = g.kv_shared_from.iter().position(Option::is_some);
    for i in 0..c.layers {
        if Some(i) == first_shared && b.options.logits != LogitsFor::AllTokens {
            x = b.op(Op::LastToken, &[x])?;
            positions = b.op(Op::LastToken, &[positions])?;
            per_layer = per_layer.map(|p| b.op(Op::LastToken, &[p])).transpose()?;
        }
        let n = |t| b.naming.layer(i, t);
        let (attn_norm, post_attn, pre_ffn, post_ffn) = (
            n(LayerTensor::AttnNorm),
            n(LayerTensor::PostAttnNorm),
            n(LayerTensor::PreFfnNorm),
            n(LayerTensor::PostFfnNorm),
        );
        let h = b.rms_norm(x, &attn_norm, c.hidden, c.rms_eps, 0.0)?;
        let a = attention(c, g, b, i, h, positions)?;
        let a = b.rms_norm(a, &post_attn, c.hidden, c.rms_eps, 0.0)?;
        x = b.add(x, a)?;
        let h = b.rms_norm(x, &pre_ffn, c.hidden, c.rms_eps, 0.0)?;
        let mlp = [LayerTensor::Gate, LayerTensor::Up, LayerTensor::Down].map(|t| b.naming.layer(i, t));
        let mut m = b.gated_mlp(h, &mlp, c.hidden, g.intermediate(i, c.intermediate), GluAct::GeluTanh)?;
        if let Some(moe) = c.moe.as_ref().filter(|moe| moe.sparse_layers[i]) {
            let dense = b.rms_norm(
                m,
                &b.naming.layer_named(i, DENSE_MLP_POST_NORM),
                c.hidden,
                c.rms_eps,
                0.0,
            )?;
            let experts = moe_block(c, moe, b, i, x)?;
            m = b.add(dense, experts)?;
        }
        let m = b.rms_norm(m, &post_ffn, c.hidden, c.rms_eps, 0.0)?;
        x = b.add(x, m)?;
        if let Some(inputs) = per_layer {
            x = add_per_layer_input(c, g, b, i, x, inputs)?;
        }
        let scalar = b.vector(&b.naming.layer_named(i, LAYER_SCALAR), 1)?;
        x = b.op(Op::ScaleRows, &[x, scalar])?;
    }
    b.lm_head(c, x, 0.0)
}

/// Layer `i`'s experts over the residual stream `x` (as it enters the MLP), normed after:
/// the router scores `unit_rms_norm(x) · scale / √hidden` (`router.proj`), a softmax whose top
/// `top_k_experts` are renormalised and each multiplied by its expert's `per_expert_scale`; the
/// experts (GELU-gated, `experts.gate_up_proj` and `experts.down_proj` stacked as `Op::Moe`
/// reads them) take `x` through `pre_feedforward_layernorm_2`, and their sum goes through
/// `post_feedforward_layernorm_2`.
fn moe_block(c: &ModelConfig, moe: &MoeConfig, b: &mut Builder, i: usize, x: NodeId) -> Result<NodeId> {
    let (d, n, e) = (c.hidden, moe.expert_intermediate, moe.experts);
    let naming = b.naming;
    let name = |t: TensorNames| naming.layer_named(i, t);
    let routed = b.rms_norm(x, &name(ROUTER_SCALE), d, c.rms_eps, 0.0)?;
    let routed = b.op(
        Op::Scale {
            factor: (d as f32).powf(-0.5),
        },
        &[routed],
    )?;
    let router = b.matrix(&name(ROUTER), e, d)?;
    let logits = b.matmul(routed, router)?;
    let scales = b.vector(&name(EXPERT_SCALES), e)?;
    let h = b.rms_norm(x, &name(EXPERTS_PRE_NORM), d, c.rms_eps, 0.0)?;
    let (gate_up, down) = match naming {
        Naming::Hf(_) => (
            b.matrix(&naming.hf_layer(i, "experts.gate_up_proj"), e * 2 * n, d)?,
            b.matrix(&naming.hf_layer(i, "experts.down_proj"), e * d, n)?,
        ),
        Naming::Gguf => moe::experts_stacked(moe, b, i, n, d)?,
    };
    let spec = MoeSpec {
        experts: e,
        experts_per_token: moe.experts_per_token,
        normalize: moe.normalize,
        intermediate: n,
        act: GluAct::GeluTanh,
        router: moe.router,
    };
    let out = b.op(Op::Moe(spec), &[h, logits, scales, gate_up, down])?;
    b.rms_norm(out, &name(EXPERTS_POST_NORM), d, c.rms_eps, 0.0)
}

/// Every layer's input, `[t, layers · per_layer_input]`: `(rms_norm(x · Pᵀ / √hidden) +
/// E_pl[ids] · √per_layer_input) / √2`, normed per layer's share.
fn per_layer_inputs(c: &ModelConfig, g: &Gemma4Config, b: &mut Builder, ids: NodeId, x: NodeId) -> Result<NodeId> {
    let p = g.per_layer_input;
    let width = c.layers * p;
    let table = b.matrix(&b.naming.model_named(PER_LAYER_EMBEDDING), c.vocab_size, width)?;
    let tokens = b.op(Op::Embedding, &[table, ids])?;
    let scale = b.options.compute.round((p as f32).sqrt());
    let tokens = b.op(Op::Scale { factor: scale }, &[tokens])?;
    let w = b.matrix(&b.naming.model_named(PER_LAYER_PROJECTION), width, c.hidden)?;
    let projected = b.matmul(x, w)?;
    let projected = b.op(
        Op::Scale {
            factor: (c.hidden as f32).powf(-0.5),
        },
        &[projected],
    )?;
    let norm = b.naming.model_named(PER_LAYER_PROJECTION_NORM);
    let projected = b.rms_norm(projected, &norm, p, c.rms_eps, 0.0)?;
    let sum = b.add(projected, tokens)?;
    b.op(
        Op::Scale {
            factor: 2f32.powf(-0.5),
        },
        &[sum],
    )
}

/// `x + rms_norm(((gelu(x · G) · input_i) · Pᵀ))`: layer `i`'s share of the per-layer inputs.
fn add_per_layer_input(
    c: &ModelConfig,
    g: &Gemma4Config,
    b: &mut Builder,
    i: usize,
    x: NodeId,
    inputs: NodeId,
) -> Result<NodeId> {
    let p = g.per_layer_input;
    let naming = b.naming;
    let name = |t: TensorNames| naming.layer_named(i, t);
    let input = b.op(Op::Slice { start: i * p, len: p }, &[inputs])?;
    let w = b.matrix(&name(LAYER_INPUT_GATE), p, c.hidden)?;
    let gate = b.matmul(x, w)?;
    let gate = b.op(Op::GeluTanh, &[gate])?;
    let gated = b.op(Op::Mul, &[gate, input])?;
    let w = b.matrix(&name(LAYER_INPUT_PROJECTION), c.hidden, p)?;
    let projected = b.matmul(gated, w)?;
    let projected = b.rms_norm(projected, &name(LAYER_INPUT_NORM), c.hidden, c.rms_eps, 0.0)?;
    b.add(x, projected)
}

/// Self-attention of layer `i` over the normed `h`, through `o_proj`.
fn attention(
    c: &ModelConfig,
    g: &Gemma4Config,
    b: &mut Builder,
    i: usize,
    h: NodeId,
    positions: NodeId,
) -> Result<NodeId> {
    let shape = g.layer_heads[i];
    let (heads, kv_heads, hd) = (shape.heads, shape.kv_heads, shape.head_dim);
    let sliding = c.layer_attention[i] == LayerAttention::Sliding;
    let n = |t| b.naming.layer(i, t);
    let (nq, nk, nv, no, nqn, nkn) = (
        n(LayerTensor::Q),
        n(LayerTensor::K),
        n(LayerTensor::V),
        n(LayerTensor::O),
        n(LayerTensor::QNorm),
        n(LayerTensor::KNorm),
    );
    let wq = b.matrix(&nq, heads * hd, c.hidden)?;
    let q = b.matmul(h, wq)?;
    let q = b.rms_norm(q, &nqn, hd, c.rms_eps, 0.0)?;
    let rope = match (sliding, g.global_rope_fraction) {
        (false, Some(fraction)) => RopeSpec {
            heads,
            head_dim: hd,
            rotary_dim: Gemma4Config::global_rotary_dim(fraction, hd),
            theta: c.rope_theta,
            position_scale: 1.0,
            layout: RopeLayout::Proportional,
            scaling: ir::RopeScaling::None,
        },
        _ => RopeSpec {
            heads,
            head_dim: hd,
            rotary_dim: hd,
            theta: if sliding { c.rope_local_theta } else { c.rope_theta },
            position_scale: 1.0,
            layout: RopeLayout::RotateHalf,
            scaling: ir::RopeScaling::None,
        },
    };
    let spec = AttentionSpec {
        heads,
        kv_heads,
        head_dim: hd,
        scale: 1.0,
        window: if sliding { c.sliding_window } else { None },
        cache_slot: g.kv_shared_from[i].unwrap_or(i),
        cache_dtype: b.cache_dtype(),
    };
    let a = match g.kv_shared_from[i] {
        Some(_) => {
            let q = b.op(Op::Rope(rope), &[q, positions])?;
            b.op(Op::SharedKvAttention(spec), &[q])?
        }
        None => {
            let wk = b.matrix(&nk, kv_heads * hd, c.hidden)?;
            let k = b.matmul(h, wk)?;
            let v = match g.keys_as_values && !sliding {
                true => k,
                false => {
                    let wv = b.matrix(&nv, kv_heads * hd, c.hidden)?;
                    b.matmul(h, wv)?
                }
            };
            let k = b.rms_norm(k, &nkn, hd, c.rms_eps, 0.0)?;
            let v = b.op(
                Op::UnitRmsNorm {
                    eps: c.rms_eps,
                    group: hd,
                },
                &[v],
            )?;
            b.rotary_attention([q, k, v], positions, rope, spec)?
        }
    };
    let wo = b.matrix(&no, c.hidden, heads * hd)?;
    b.matmul(a, wo)
}
