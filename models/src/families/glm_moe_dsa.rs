//! GLM-5 (`GlmMoeDsaForCausalLM`): GLM-4.5's decoder and MoE MLPs with DeepSeek-V3.2's
//! attention, HF semantics:
//! - multi-head latent attention: queries from a normed low-rank latent (`q_a_proj`,
//!   `q_a_layernorm`, `q_b_proj`), keys and values from another (`kv_a_proj_with_mqa`,
//!   `kv_a_layernorm`, `kv_b_proj`); each head's query and key have a part without RoPE and a
//!   rotated part, the key's rotated part shared by all heads; values are narrower than keys;
//! - the sparse indexer (DSA): light queries from the query latent (`indexer.wq_b`), one key
//!   per position (`indexer.wk`, LayerNorm, RoPE on its first `qk_rope_head_dim`), per-head
//!   weights (`indexer.weights_proj`); each query attends only to the `index_topk` earlier
//!   positions they rank highest (`Op::SparseMla`). GLM-5.2's "shared" layers have no indexer:
//!   they keep the positions the previous full layer keeps.
//!
//! RoPE pairs adjacent elements (interleaved), in the attention and the indexer; the indexer
//! scores `relu(q·k)` per head. The latent norms use HF's default eps (1e-6), not
//! `rms_norm_eps`. From HF safetensors, and from llama.cpp's GGUF files (`glm-dsa`: the same
//! tensors under its names, `kv_b_proj` split by its converter into `attn_k_b`, each head's
//! `W_UK` transposed, and `attn_v_b`). Its NextN layer lowers as GLM-4.5's ([`lower_mtp`]).

use super::moe::{mlp, SharedNames};
use super::{Builder, LayerTensor, Naming, TensorNames};
use crate::config::{MlaConfig, ModelConfig};
use crate::error::{ModelError, Result};
use ir::{NodeId, Op, RopeLayout, RopeSpec, SparseMlaSpec};

const Q_A: TensorNames = ("self_attn.q_a_proj.weight", "attn_q_a.weight");
const Q_A_NORM: TensorNames = ("self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight");
const Q_B: TensorNames = ("self_attn.q_b_proj.weight", "attn_q_b.weight");
const KV_A: TensorNames = ("self_attn.kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight");
const KV_A_NORM: TensorNames = ("self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight");
const KV_B: TensorNames = ("self_attn.kv_b_proj.weight", "attn_kv_b.weight");
const O: TensorNames = ("self_attn.o_proj.weight", "attn_output.weight");
const INDEX_Q: TensorNames = ("self_attn.indexer.wq_b.weight", "indexer.attn_q_b.weight");
const INDEX_K: TensorNames = ("self_attn.indexer.wk.weight", "indexer.attn_k.weight");
const INDEX_K_NORM: TensorNames = ("self_attn.indexer.k_norm.weight", "indexer.k_norm.weight");
const INDEX_K_NORM_BIAS: TensorNames = ("self_attn.indexer.k_norm.bias", "indexer.k_norm.bias");
const INDEX_WEIGHTS: TensorNames = ("self_attn.indexer.weights_proj.weight", "indexer.proj.weight");

/// The eps of `q_a_layernorm`, `kv_a_layernorm` (HF's RMSNorm default) and the indexer's
/// LayerNorm.
const LATENT_NORM_EPS: f64 = 1e-6;

pub(super) fn lower(c: &ModelConfig, b: &mut Builder) -> Result<()> {
    let missing = |what: &str| ModelError::TensorShape {
        name: "config".into(),
        what: format!("a glm_moe_dsa model needs its {what} settings"),
    };
    let mla = c.mla.as_ref().ok_or_else(|| missing("latent attention"))?;
    c.moe.as_ref().ok_or_else(|| missing("MoE"))?;
    let (_, positions, mut x) = b.token_embeddings(c)?;
    let mut indexer = None;
    for i in 0..c.layers {
        x = decoder_layer(c, mla, b, i, x, positions, &mut indexer)?;
    }
    b.lm_head(c, x, 0.0)
}

/// The first NextN layer, as GLM-4.5's (`glm4_moe::lower_nextn`), its attention with an
/// indexer of its own.
pub(super) fn lower_mtp(c: &ModelConfig, b: &mut Builder) -> Result<()> {
    let mla = c.mla.as_ref().ok_or_else(|| ModelError::TensorShape {
        name: "config".into(),
        what: "a glm_moe_dsa model needs its latent attention settings".into(),
    })?;
    let mut indexer = None;
    super::glm4_moe::lower_nextn(c, b, &mut |b, i, x, positions| {
        decoder_layer(c, mla, b, i, x, positions, &mut indexer)
    })
}

/// Decoder layer `i` over the residual stream `x`: latent attention (ranking with `indexer`
/// where the layer shares one), then the MLP, each normed before and added back.
fn decoder_layer(
    c: &ModelConfig,
    mla: &MlaConfig,
    b: &mut Builder,
    i: usize,
    x: NodeId,
    positions: NodeId,
    indexer: &mut Option<Indexer>,
) -> Result<NodeId> {
    let h = b.rms_norm(x, &b.naming.layer(i, LayerTensor::AttnNorm), c.hidden, c.rms_eps, 0.0)?;
    let a = attention(c, mla, b, i, h, positions, indexer)?;
    let x = b.add(x, a)?;
    let h = b.rms_norm(x, &b.naming.layer(i, LayerTensor::FfnNorm), c.hidden, c.rms_eps, 0.0)?;
    let m = mlp(c, b, i, h, SharedNames::Experts)?;
    b.add(x, m)
}

/// The last full layer's indexer, which the layers sharing it rank positions with: its cache
/// slot (holding the index keys) and the step's index queries and weights.
#[derive(Clone, Copy)]
struct Indexer {
    slot: usize,
    queries: NodeId,
    weights: NodeId,
}

/// Latent attention of layer `i` over the normed `h`, through `o_proj`. A layer with its own
/// indexer makes it the one `indexer` holds; a layer sharing one ranks with that.
fn attention(
    c: &ModelConfig,
    m: &MlaConfig,
    b: &mut Builder,
    i: usize,
    h: NodeId,
    positions: NodeId,
    indexer: &mut Option<Indexer>,
) -> Result<NodeId> {
    let heads = c.heads;
    let (n, r, v) = (m.nope_dim, m.rope_dim, m.value_dim);
    // Columns `start..start + len` of each head's `group`.
    let per_head = |b: &mut Builder, x: NodeId, group: usize, start: usize, len: usize| {
        b.op(Op::GroupSlice { group, start, len }, &[x])
    };
    // Queries: the normed latent, then per head [nope | rotated].
    let q_latent = linear(b, i, h, Q_A, m.q_rank, c.hidden)?;
    let norm = b.naming.layer_named(i, Q_A_NORM);
    let q_latent = b.rms_norm(q_latent, &norm, m.q_rank, LATENT_NORM_EPS, 0.0)?;
    let q = linear(b, i, q_latent, Q_B, heads * (n + r), m.q_rank)?;
    let q_nope = per_head(b, q, n + r, 0, n)?;
    let q_pe = per_head(b, q, n + r, n, r)?;
    let q_pe = b.op(interleaved_rope(c, m, heads, r), &[q_pe, positions])?;
    // Keys and values: the normed latent (expanded per head by `kv_b_proj`), and one shared
    // rotated key part.
    let kv_latent = linear(b, i, h, KV_A, m.kv_rank + r, c.hidden)?;
    let k_pe = b.op(
        Op::Slice {
            start: m.kv_rank,
            len: r,
        },
        &[kv_latent],
    )?;
    let k_pe = b.op(interleaved_rope(c, m, 1, r), &[k_pe, positions])?;
    let kv_latent = b.op(
        Op::Slice {
            start: 0,
            len: m.kv_rank,
        },
        &[kv_latent],
    )?;
    let norm = b.naming.layer_named(i, KV_A_NORM);
    let kv_latent = b.rms_norm(kv_latent, &norm, m.kv_rank, LATENT_NORM_EPS, 0.0)?;
    let (k_b, v_b) = up_projections(b, m, heads, i)?;
    // Layers past the model's (its NextN layers) have indexers of their own.
    let shares = m.shared_indexer.get(i).copied().unwrap_or(false);
    let (ranking, own_index_key) = match (shares, *indexer) {
        (true, Some(last_full)) => (last_full, None),
        (true, None) => {
            return Err(ModelError::TensorShape {
                name: "config".into(),
                what: format!("layer {i} shares an indexer, but no earlier layer has one"),
            })
        }
        (false, _) => {
            let (own, index_key) = own_indexer(c, m, b, i, h, q_latent, positions)?;
            *indexer = Some(own);
            (own, Some(index_key))
        }
    };
    let mut inputs = vec![
        q_nope,
        q_pe,
        kv_latent,
        k_pe,
        k_b,
        v_b,
        ranking.queries,
        ranking.weights,
    ];
    inputs.extend(own_index_key);
    let spec = SparseMlaSpec {
        heads,
        nope_dim: n,
        rope_dim: r,
        value_dim: v,
        latent_dim: m.kv_rank,
        scale: m.softmax_mscale / ((n + r) as f64).sqrt(),
        index_heads: m.index_heads,
        index_dim: m.index_dim,
        index_topk: m.index_topk,
        cache_slot: i - b.first_cached_layer,
        index_slot: ranking.slot,
    };
    let a = b.op(Op::SparseMla(spec), &inputs)?;
    linear(b, i, a, O, c.hidden, heads * v)
}

/// Layer `i`'s own indexer over the normed `h` and the query latent: its queries and weights,
/// and the step's index keys (layer-normed, rotated).
fn own_indexer(
    c: &ModelConfig,
    m: &MlaConfig,
    b: &mut Builder,
    i: usize,
    h: NodeId,
    q_latent: NodeId,
    positions: NodeId,
) -> Result<(Indexer, NodeId)> {
    let (ih, id) = (m.index_heads, m.index_dim);
    let index_q = linear(b, i, q_latent, INDEX_Q, ih * id, m.q_rank)?;
    let index_q = b.op(interleaved_rope(c, m, ih, id), &[index_q, positions])?;
    let index_k = linear(b, i, h, INDEX_K, id, c.hidden)?;
    let (norm_w, norm_b) = (
        b.vector(&b.naming.layer_named(i, INDEX_K_NORM), id)?,
        b.vector(&b.naming.layer_named(i, INDEX_K_NORM_BIAS), id)?,
    );
    let index_k = b.op(Op::LayerNorm { eps: LATENT_NORM_EPS }, &[index_k, norm_w, norm_b])?;
    let index_k = b.op(interleaved_rope(c, m, 1, id), &[index_k, positions])?;
    let own = Indexer {
        slot: i - b.first_cached_layer,
        queries: index_q,
        weights: linear(b, i, h, INDEX_WEIGHTS, ih, c.hidden)?,
    };
    Ok((own, index_k))
}

/// `x · wᵀ` for layer `i`'s weight `t` (`[rows, cols]`).
fn linear(b: &mut Builder, i: usize, x: NodeId, t: TensorNames, rows: usize, cols: usize) -> Result<NodeId> {
    let w = b.matrix(&b.naming.layer_named(i, t), rows, cols)?;
    b.matmul(x, w)
}

/// Interleaved RoPE of the first `qk_rope_head_dim` of each of `heads` heads of `head_dim`
/// (`rope_interleave`, `indexer_rope_interleave`: element 2i pairs with 2i + 1), for the
/// attention and the indexer alike, as HF transformers 5.24 computes them (checked against
/// its logits; split-half fails from position 1 on).
fn interleaved_rope(c: &ModelConfig, m: &MlaConfig, heads: usize, head_dim: usize) -> Op {
    Op::Rope(RopeSpec {
        heads,
        head_dim,
        rotary_dim: m.rope_dim,
        theta: c.rope_theta,
        position_scale: c.rope_scale,
        layout: RopeLayout::AdjacentPairs,
        scaling: c.rope_scaling,
    })
}

/// Layer `i`'s up-projections of the KV latent as the attention reads them: `k_b` (`[heads·
/// latent, nope]`, each head's `W_UK` transposed) and `v_b` (`[heads·value, latent]`). As
/// llama.cpp's converter writes them (`attn_k_b`, `attn_v_b`), or picked from HF's joined
/// `kv_b_proj` (per head its `W_UK` rows, then its `W_UV` rows; also older GGUF files'
/// `attn_kv_b`).
fn up_projections(b: &mut Builder, m: &MlaConfig, heads: usize, i: usize) -> Result<(NodeId, NodeId)> {
    let (n, v, l) = (m.nope_dim, m.value_dim, m.kv_rank);
    let split = (format!("blk.{i}.attn_k_b.weight"), format!("blk.{i}.attn_v_b.weight"));
    if b.naming == Naming::Gguf && b.has_weight(&split.0) {
        return Ok((b.matrix(&split.0, heads * l, n)?, b.matrix(&split.1, heads * v, l)?));
    }
    let kv_b = b.matrix(&b.naming.layer_named(i, KV_B), heads * (n + v), l)?;
    let k_b = b.op(
        Op::TransposeRowGroups {
            group: n + v,
            start: 0,
            len: n,
        },
        &[kv_b],
    )?;
    let v_b = b.op(
        Op::RowGroupSlice {
            group: n + v,
            start: n,
            len: v,
        },
        &[kv_b],
    )?;
    Ok((k_b, v_b))
}
