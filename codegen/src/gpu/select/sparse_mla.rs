//! A latent attention node's launches (`templates::sparse_mla`): the step's keys and values
//! appended to its cache slot (key rows `[k_nope | k_pe | index key]`, value rows of every
//! head's values: wider than the keys, as `KvLayout::value_bytes_per_token` says), the
//! indexer's score of every position each row sees (into the plan's position scores), each
//! row's cut of the positions it keeps, the attention over those split across blocks, and
//! the merge of the splits.

use super::kv_attention::{cache_layout_args, merge_splits, split_partials};
use super::{scalar, Alternatives, Operands, Selected};
use crate::gpu::{GpuCodegenError, KvLayout, LaunchArg};
use ir::SparseMlaSpec;
use kernels_gen::dsl::Kernel;
use kernels_gen::templates::cache_layout::CacheLayout;
use kernels_gen::templates::{attention, sparse_mla};

/// Pushes the append, scores, cut and split launches; returns the merge of the splits for the
/// caller to push as the node's own launch.
pub(super) fn launches(
    s: &mut Selected,
    operands: &Operands,
    spec: &SparseMlaSpec,
    layout: CacheLayout,
    rows: &str,
    max_tokens: usize,
) -> Result<(Kernel, Vec<LaunchArg>), GpuCodegenError> {
    let node = operands.node;
    let unsupported = |what: String| GpuCodegenError::Unsupported {
        node,
        op: "sparse_mla",
        what,
    };
    let too_wide = [spec.nope_dim + spec.rope_dim, spec.value_dim, spec.index_dim]
        .into_iter()
        .any(|d| d > attention::MAX_HEAD_DIM);
    if too_wide {
        return Err(unsupported(format!(
            "heads wider than the attention templates' {}",
            attention::MAX_HEAD_DIM
        )));
    }
    let layout_args = cache_layout_args(layout, false).map_err(unsupported)?;
    let (kw, vw) = (spec.key_width(), spec.value_width());
    s.kv_cache.push(KvLayout {
        slot: spec.cache_slot,
        kv_dim: kw,
        bytes_per_token: kw * 4,
        value_bytes_per_token: Some(vw * 4),
    });
    s.position_scores = true;
    let cache = |value: bool| LaunchArg::KvCache {
        slot: spec.cache_slot,
        value,
    };
    let [(q_nope, qn_stride), (q_pe, qp_stride), (k_nope, kn_stride), (k_pe, kp_stride), (v, v_stride), (index_q, iq_stride), (index_k, ik_stride), (index_w, iw_stride)] =
        [0, 1, 2, 3, 4, 5, 6, 7].map(|k| operands.activation(s, k));
    let origin = operands.origin();
    let splits = attention::splits_expr(rows);
    let cut = LaunchArg::Scratch {
        node,
        name: "cut".into(),
        bytes: max_tokens * 2 * 4,
    };
    let partial = split_partials(node, spec.heads, spec.value_dim, max_tokens);
    let launches = [
        (
            sparse_mla::mla_append("mla_append", origin, layout, spec),
            vec![
                k_nope,
                k_pe,
                index_k,
                v,
                cache(false),
                cache(true),
                scalar("tokens", rows),
                scalar("first", "first"),
                scalar("kn_stride", kn_stride),
                scalar("kp_stride", kp_stride),
                scalar("ik_stride", ik_stride),
                scalar("v_stride", v_stride),
            ],
        ),
        (
            sparse_mla::index_scores("index_scores", origin, layout, spec),
            vec![
                index_q,
                index_w,
                cache(false),
                LaunchArg::PositionScores,
                scalar("tokens", rows),
                scalar("first", "first"),
                scalar("iq_stride", iq_stride),
                scalar("iw_stride", iw_stride),
                scalar("context", "context"),
                scalar("splits", &splits),
            ],
        ),
        (
            sparse_mla::index_select("index_select", origin, layout, spec),
            vec![
                LaunchArg::PositionScores,
                cut.clone(),
                scalar("tokens", rows),
                scalar("first", "first"),
                scalar("context", "context"),
            ],
        ),
        (
            sparse_mla::sparse_mla_split("sparse_mla", origin, layout, spec),
            vec![
                q_nope,
                q_pe,
                LaunchArg::PositionScores,
                cut,
                cache(false),
                cache(true),
                partial.clone(),
                scalar("tokens", rows),
                scalar("first", "first"),
                scalar("qn_stride", qn_stride),
                scalar("qp_stride", qp_stride),
                scalar("heads", spec.heads),
                scalar("scale", spec.scale as f32),
                scalar("context", "context"),
                scalar("splits", &splits),
            ],
        ),
    ];
    for (kernel, args) in launches {
        let args = [args, layout_args.clone()].concat();
        s.launches.push((node, kernel, Alternatives::default(), args));
    }
    Ok(merge_splits(operands, partial, rows, spec.heads, spec.value_dim))
}
