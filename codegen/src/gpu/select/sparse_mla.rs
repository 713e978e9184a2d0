//! A latent attention node's launches (`templates::sparse_mla`): each head's query carried
//! into the latent's space (into scratch), the step's latents appended to its cache slot
//! (rows `[c | k_pe | index key]`; no value rows, as `KvLayout::value_bytes_per_token` says),
//! the indexer's score of every position each row sees (into the plan's position scores),
//! each row's cut of the positions it keeps, the attention over those split across blocks,
//! the merge of the splits (into scratch), and each head's values out of its merged latent.

use super::kv_attention::{cache_layout_args, merge_splits, split_partials};
use super::{scalar, Alternatives, Operands, Selected};
use crate::gpu::{GpuCodegenError, KvLayout, LaunchArg};
use ir::{Op, SparseMlaSpec};
use kernels_gen::dsl::Kernel;
use kernels_gen::templates::cache_layout::CacheLayout;
use kernels_gen::templates::{attention, sparse_mla};

/// Pushes the absorb, append, scores, cut (the last two only where the layer has its own
/// indexer), split and merge launches; returns the expansion for the caller to push as the
/// node's own launch.
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
    let too_wide = [spec.latent_dim, spec.rope_dim, spec.index_dim]
        .into_iter()
        .any(|d| d > attention::MAX_HEAD_DIM);
    if too_wide {
        return Err(unsupported(format!(
            "heads wider than the attention templates' {}",
            attention::MAX_HEAD_DIM
        )));
    }
    let layout_args = cache_layout_args(layout, false).map_err(unsupported)?;
    // The latent row is the only row a position caches: no value rows.
    s.kv_cache.push(KvLayout {
        slot: spec.cache_slot,
        kv_dim: spec.cache_width(),
        bytes_per_token: spec.cache_width() * 4,
        value_bytes_per_token: Some(0),
    });
    s.position_scores = true;
    let cache = LaunchArg::KvCache {
        slot: spec.cache_slot,
        value: false,
    };
    let [(q_nope, qn_stride), (q_pe, qp_stride), (latent, c_stride), (k_pe, kp_stride)] =
        [0, 1, 2, 3].map(|k| operands.activation(s, k));
    let (k_b, v_b) = (operands.weight(4), operands.weight(5));
    let (k_b_format, v_b_format) = (operands.weight_format(4)?, operands.weight_format(5)?);
    let origin = operands.origin();
    let splits = attention::splits_expr(rows);
    // Each row's cut: this node's where it has its own indexer, else the cut the full layer it
    // shares computed earlier in the step (the position scores are still that layer's: no
    // full layer comes between).
    let cut_of = |node: usize| LaunchArg::Scratch {
        node,
        name: "cut".into(),
        bytes: max_tokens * 2 * 4,
    };
    let cut = match spec.has_own_indexer() {
        true => cut_of(node),
        false => cut_of(indexer_node(operands, spec).ok_or_else(|| {
            unsupported(format!(
                "it shares the indexer of cache slot {}, which no earlier latent attention has",
                spec.index_slot
            ))
        })?),
    };
    let l = spec.latent_dim;
    let per_row = spec.heads * l;
    let absorbed = operands.scratch("absorbed", per_row, max_tokens);
    let merged = operands.scratch("latent", per_row, max_tokens);
    let partial = split_partials(node, spec.heads, spec.latent_dim, max_tokens);
    let with_layout = |args: Vec<LaunchArg>| [args, layout_args.clone()].concat();
    let mut launches = vec![(
        sparse_mla::per_head_gemv("mla_absorb", origin, spec.heads, l, spec.nope_dim, k_b_format),
        vec![
            q_nope,
            k_b,
            absorbed.clone(),
            scalar("tokens", rows),
            scalar("x_stride", qn_stride),
        ],
    )];
    // The layer's own indexer: its queries, weights and keys (the keys are appended first,
    // and the scores read them from the cache).
    let index = spec
        .has_own_indexer()
        .then(|| [6, 7, 8].map(|k| operands.activation(s, k)));
    let mut append = vec![latent, k_pe];
    let mut append_scalars = vec![
        scalar("tokens", rows),
        scalar("first", "first"),
        scalar("c_stride", c_stride),
        scalar("kp_stride", kp_stride),
    ];
    if let Some([_, _, (index_k, ik_stride)]) = &index {
        append.push(index_k.clone());
        append_scalars.push(scalar("ik_stride", *ik_stride));
    }
    append.push(cache.clone());
    launches.push((
        sparse_mla::mla_append("mla_append", origin, layout, spec),
        with_layout([append, append_scalars].concat()),
    ));
    if let Some([query, weights, _]) = index {
        let ranking = Ranking {
            query,
            weights,
            cache: cache.clone(),
            cut: cut.clone(),
            splits: splits.clone(),
        };
        launches.extend(indexer_launches(ranking, spec, layout, rows, origin).map(|(k, a)| (k, with_layout(a))));
    }
    launches.extend([
        (
            sparse_mla::sparse_mla_split("sparse_mla", origin, layout, spec),
            with_layout(vec![
                absorbed,
                q_pe,
                LaunchArg::PositionScores,
                cut,
                cache,
                partial.clone(),
                scalar("tokens", rows),
                scalar("first", "first"),
                scalar("qp_stride", qp_stride),
                scalar("heads", spec.heads),
                scalar("scale", spec.scale as f32),
                scalar("context", "context"),
                scalar("splits", &splits),
            ]),
        ),
        merge_splits(operands, partial, merged.clone(), rows, spec.heads, spec.latent_dim),
    ]);
    for (kernel, args) in launches {
        s.launches.push((node, kernel, Alternatives::default(), args));
    }
    let expand = sparse_mla::per_head_gemv("mla_expand", origin, spec.heads, spec.value_dim, l, v_b_format);
    let args = vec![
        merged,
        v_b,
        operands.out(),
        scalar("tokens", rows),
        scalar("x_stride", per_row),
    ];
    Ok((expand, args))
}

/// What a layer's own indexer ranks positions with: its query and weight activations (with
/// their row strides), its cache slot (holding the index keys), the cut it writes, the splits.
struct Ranking {
    query: (LaunchArg, usize),
    weights: (LaunchArg, usize),
    cache: LaunchArg,
    cut: LaunchArg,
    splits: String,
}

/// The indexer's scores of every position each row sees (into the position scores) and each
/// row's cut of those it keeps, without the cache layout's arguments.
fn indexer_launches(
    r: Ranking,
    spec: &SparseMlaSpec,
    layout: CacheLayout,
    rows: &str,
    origin: &str,
) -> [(Kernel, Vec<LaunchArg>); 2] {
    let ((index_q, iq_stride), (index_w, iw_stride)) = (r.query, r.weights);
    [
        (
            sparse_mla::index_scores("index_scores", origin, layout, spec),
            vec![
                index_q,
                index_w,
                r.cache,
                LaunchArg::PositionScores,
                scalar("tokens", rows),
                scalar("first", "first"),
                scalar("iq_stride", iq_stride),
                scalar("iw_stride", iw_stride),
                scalar("context", "context"),
                scalar("splits", &r.splits),
            ],
        ),
        (
            sparse_mla::index_select("index_select", origin, layout, spec),
            vec![
                LaunchArg::PositionScores,
                r.cut,
                scalar("tokens", rows),
                scalar("first", "first"),
                scalar("context", "context"),
            ],
        ),
    ]
}

/// The latent attention node whose indexer `spec` shares: the one caching into its
/// `index_slot`.
fn indexer_node(operands: &Operands, spec: &SparseMlaSpec) -> Option<usize> {
    operands
        .graph
        .nodes()
        .iter()
        .position(|n| matches!(&n.op, Op::SparseMla(s) if s.cache_slot == spec.index_slot && s.has_own_indexer()))
}
