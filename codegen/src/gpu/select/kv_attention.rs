//! An attention node's launches (`templates::kv_append`, `templates::attention`,
//! `templates::flash_attention`): the step's keys and values appended to the node's cache slot
//! (rotating q and k on the way for `rope_attention`), then the attention over the cache:
//! split across blocks and merged, or, in steps of prompts over a bf16 or FP8 cache, on the
//! tensor cores, a tile of 64 query rows a block (128 on Hopper's `wgmma` and the B200's
//! `tcgen05`, over bf16; see [`FLASH_ROWS_PER_SEQUENCE`]). A
//! `shared_kv_attention` appends nothing: it attends over the slot an earlier layer filled, and
//! may do so for the sampled rows only (each sequence's last, after `last_token`): their
//! tables and positions are then the step's `sampled_row_table` and `sampled_row_pos` (a
//! batched step), or the step's last position (one sequence's).

use super::{next_matmul_weights, prefetch_bytes, scalar, Alternatives, Operands, Selected};
use crate::gpu::{DecodeAttention, FlashForm, GpuCodegenError, KvLayout, LaunchArg};
use ir::{AttentionSpec, DType, Op};
use kernels_gen::dsl::{Kernel, Ty};
use kernels_gen::templates::cache_layout::CacheLayout;
use kernels_gen::templates::flash_attention_tcgen05::Loads;
use kernels_gen::templates::flash_attention_wgmma::Schedule;
use kernels_gen::templates::{
    attention, attention_vector, flash_attention, flash_attention_tcgen05, flash_attention_wgmma, flash_tma, kv_append,
    rope, step_gate, weight_prefetch,
};

/// Steps whose sequences average this many rows or more attend on the tensor cores
/// (`templates::flash_attention`): prompts being prefilled, whose 64-row query tiles read each
/// key and value once a tile. Other steps (decode rows, drafts being verified: a few rows a
/// sequence) split each row's keys across blocks, as a tile of one row would leave the tensor
/// cores idle. Where prompts dominate a step, its short sequences take a tile each.
pub const FLASH_ROWS_PER_SEQUENCE: usize = 16;

/// The scalar gating a launch to some steps only (`templates::step_gate`).
const GATE: &str = "active";

/// The attention kernels a plan takes where it has a choice.
#[derive(Debug, Clone, Copy)]
pub(super) struct AttentionKernels {
    /// The split pass's form (the vector one where the head and cache allow).
    pub split: DecodeAttention,
    /// The flash kernel prompts attend on (for heads it takes; `mma.sync` for the others).
    pub flash: FlashForm,
}

/// Pushes the append (where the op appends) and the split attention (and the tensor-core
/// attention prompts take), of the forms `kernels` names; returns the merge of the splits
/// for the caller to push as the node's own launch.
pub(super) fn launches(
    s: &mut Selected,
    operands: &Operands,
    layout: CacheLayout,
    rows: &str,
    (max_tokens, kernels): (usize, AttentionKernels),
) -> Result<(Kernel, Vec<LaunchArg>), GpuCodegenError> {
    let node = &operands.graph.nodes()[operands.node];
    let op = &node.op;
    // After `last_token` the IR has one row (a batched step: one per sampled row).
    let sampled = node.shape.0.first() == Some(&ir::Dim::Const(1));
    let spec = op.attention().expect("called for attention ops");
    let unsupported = |what: String| GpuCodegenError::Unsupported {
        node: operands.node,
        op: op.name(),
        what,
    };
    if spec.head_dim > attention::MAX_HEAD_DIM {
        return Err(unsupported(format!(
            "head_dim {} is past the attention templates' {}",
            spec.head_dim,
            attention::MAX_HEAD_DIM
        )));
    }
    let cache_ty = match spec.cache_dtype {
        DType::F32 => Ty::F32,
        DType::BF16 => Ty::Bf16,
        DType::F16 => Ty::F16,
        DType::F8E4M3 => Ty::F8E4M3,
        other => {
            return Err(unsupported(format!(
                "a {other} KV cache: the GPU attention templates read f32, bf16, f16 or FP8 rows"
            )))
        }
    };
    if sampled && !matches!(op, Op::SharedKvAttention(_)) {
        return Err(unsupported(
            "only a layer appending nothing attends for the sampled rows alone".into(),
        ));
    }
    let layout_args = cache_layout_args(layout, sampled).map_err(unsupported)?;
    let cache = Cache {
        spec,
        ty: cache_ty,
        layout,
        layout_args,
        // One sequence's sampled row is its last: position `first + tokens − 1`.
        first: match sampled {
            true => "first+tokens-1",
            false => "first",
        },
        sampled,
    };
    let q = match op {
        Op::SharedKvAttention(_) => operands.activation(s, 0),
        _ => append(s, operands, &cache, rows, max_tokens),
    };
    Ok(attend(s, operands, &cache, q, rows, (max_tokens, kernels)))
}

/// What a cache `layout` adds to the arguments of a kernel reading it (`CacheLayout::params`):
/// a batched step's block tables and each row's table and position, those of the sampled rows
/// where the kernel runs on them alone; or why the layout has no plan.
pub(super) fn cache_layout_args(layout: CacheLayout, sampled: bool) -> Result<Vec<LaunchArg>, String> {
    let step_input = |name: &str| LaunchArg::StepInput {
        name: match sampled {
            true => format!("sampled_{name}"),
            false => name.into(),
        },
    };
    match layout {
        CacheLayout::Batched => Ok(vec![
            LaunchArg::StepInput {
                name: "block_tables".into(),
            },
            step_input("row_table"),
            step_input("row_pos"),
            scalar("block_size", "block_size"),
        ]),
        CacheLayout::Contiguous => Ok(vec![]),
        CacheLayout::Paged => Err("a one-sequence paged plan is not built".into()),
    }
}

/// The scratch a split attention pass writes its partials into (`templates::attention`):
/// `heads` heads of `value_dim` for up to `max_tokens` rows.
pub(super) fn split_partials(node: usize, heads: usize, value_dim: usize, max_tokens: usize) -> LaunchArg {
    LaunchArg::Scratch {
        node,
        name: "partial".into(),
        bytes: attention::partial_len(max_tokens, heads, value_dim) * 4,
    }
}

/// The merge of a split pass's `partial`s into `out`, `rows` rows of `heads` heads of
/// `value_dim`.
pub(super) fn merge_splits(
    operands: &Operands,
    partial: LaunchArg,
    out: LaunchArg,
    rows: &str,
    heads: usize,
    value_dim: usize,
) -> (Kernel, Vec<LaunchArg>) {
    let args = vec![
        partial,
        out,
        scalar("tokens", rows),
        scalar("heads", heads),
        scalar("splits", attention::splits_expr(rows)),
    ];
    (
        attention::attention_combine("attention_combine", operands.origin(), value_dim),
        args,
    )
}

/// The KV cache slot an attention reads, and what its layout adds to the kernels' arguments.
struct Cache<'a> {
    spec: &'a AttentionSpec,
    ty: Ty,
    layout: CacheLayout,
    layout_args: Vec<LaunchArg>,
    /// The position of the attention's first query row, past the rows of a batched step.
    first: &'static str,
    /// Whether it attends for the sampled rows alone.
    sampled: bool,
}

impl Cache<'_> {
    fn slot(&self, value: bool) -> LaunchArg {
        LaunchArg::KvCache {
            slot: self.spec.cache_slot,
            value,
        }
    }
}

/// Claims the node's cache slot and pushes the append of the step's keys and values (for
/// `rope_attention`, rotating q and k on the way); returns the queries the attention reads.
fn append(s: &mut Selected, operands: &Operands, cache: &Cache, rows: &str, max_tokens: usize) -> (LaunchArg, usize) {
    let (spec, graph) = (cache.spec, operands.graph);
    let kv_dim = spec.kv_heads * spec.head_dim;
    s.kv_cache.push(KvLayout {
        slot: spec.cache_slot,
        kv_dim,
        bytes_per_token: kv_dim * cache.ty.bytes(),
        value_bytes_per_token: None,
    });
    let ((k, k_stride), (v, v_stride)) = (operands.activation(s, 1), operands.activation(s, 2));
    let (kernel, args, q) = match &graph.nodes()[operands.node].op {
        Op::RopeAttention { rope, .. } => {
            let inv_freq = s.rope_inv_freq(rope);
            let ((q, q_stride), (positions, _)) = (operands.activation(s, 0), operands.activation(s, 3));
            let q_dim = spec.heads * spec.head_dim;
            let rotated = operands.scratch("q", q_dim, max_tokens);
            let args = vec![
                q,
                k,
                v,
                positions,
                inv_freq,
                rotated.clone(),
                cache.slot(false),
                cache.slot(true),
                scalar("tokens", rows),
                scalar("q_dim", q_dim),
                scalar("kv_dim", kv_dim),
                scalar("head_dim", spec.head_dim),
                scalar("rotary_dim", rope.rotary_dim),
                scalar("first", "first"),
                scalar("q_stride", q_stride),
                scalar("k_stride", k_stride),
                scalar("v_stride", v_stride),
            ];
            let kernel = kv_append::rope_kv_append(
                "rope_kv_append",
                &graph.name,
                cache.layout,
                cache.ty,
                rope::Rotation::of(rope),
            );
            (kernel, args, (rotated, q_dim))
        }
        _ => {
            let args = vec![
                k,
                v,
                cache.slot(false),
                cache.slot(true),
                scalar("tokens", rows),
                scalar("kv_dim", kv_dim),
                scalar("first", "first"),
                scalar("k_stride", k_stride),
                scalar("v_stride", v_stride),
            ];
            let kernel = kv_append::kv_append_with("kv_append", &graph.name, cache.layout, cache.ty);
            (kernel, args, operands.activation(s, 0))
        }
    };
    let args = [args, cache.layout_args.clone()].concat();
    s.launches.push((operands.node, kernel, Alternatives::default(), args));
    q
}

/// The split pass of `form` over `cache` (its heads grouped as the form's registers allow):
/// the vector one where asked for and the head and cache allow, else the scalar one. Both take
/// the same arguments and write the same partials.
fn split_pass(form: DecodeAttention, cache: &Cache, origin: &str) -> Kernel {
    let spec = cache.spec;
    match form == DecodeAttention::Vector && attention_vector::supports(spec.head_dim, cache.ty) {
        true => {
            let group = attention_vector::heads_per_block(spec.heads, spec.kv_heads, spec.head_dim, cache.ty);
            attention_vector::attention_split_vector(
                "attention_vector",
                origin,
                cache.layout,
                spec.head_dim,
                group,
                cache.ty,
            )
        }
        false => {
            let group = attention::heads_per_block(spec.heads, spec.kv_heads, spec.head_dim);
            attention::attention_split("attention", origin, cache.layout, spec.head_dim, group, cache.ty)
        }
    }
}

/// Pushes the attention's first pass, the keys split across blocks into partials that are
/// scratch of the node (see `templates::attention`), prefetching the output projection's
/// weights into L2 where it can; returns the merge of the splits.
fn attend(
    s: &mut Selected,
    operands: &Operands,
    cache: &Cache,
    (q, q_stride): (LaunchArg, usize),
    rows: &str,
    (max_tokens, kernels): (usize, AttentionKernels),
) -> (Kernel, Vec<LaunchArg>) {
    let (spec, graph, i) = (cache.spec, operands.graph, operands.node);
    let splits = attention::splits_expr(rows);
    let partial = split_partials(i, spec.heads, spec.head_dim, max_tokens);
    // What both attention kernels take first, writing `out`: the queries, the cache, the
    // rows and the head's shape.
    let common = |out: LaunchArg| {
        vec![
            q.clone(),
            cache.slot(false),
            cache.slot(true),
            out,
            scalar("tokens", rows),
            scalar("q_stride", q_stride),
            scalar("first", cache.first),
            scalar("heads", spec.heads),
            scalar("kv_heads", spec.kv_heads),
            scalar("window", spec.window.unwrap_or(0)),
            scalar("scale", spec.scale as f32),
        ]
    };
    let mut args = [
        common(partial.clone()),
        vec![scalar("splits", &splits)],
        cache.layout_args.clone(),
    ]
    .concat();
    let mut split = split_pass(kernels.split, cache, &graph.name);
    if let Some((weights, bytes)) = next_matmul_weights(graph, i) {
        split = weight_prefetch::prefetching_next_weights(split);
        args.extend([
            LaunchArg::WeightPrefetch { node: weights },
            scalar("prefetch_bytes", prefetch_bytes(rows, bytes)),
        ]);
    }
    let merge = merge_splits(operands, partial, operands.out(), rows, spec.heads, spec.head_dim);
    let Some(flash) = flash_step(cache, rows) else {
        s.launches.push((i, split, Alternatives::default(), args));
        return merge;
    };
    // Either the split pass and its merge run, or the flash kernel does, by the step's shape.
    let split_step = format!("1-{flash}");
    args.push(scalar(GATE, &split_step));
    s.launches
        .push((i, step_gate::gated(split, GATE), Alternatives::default(), args));
    // Heads TMA's boxes do not tile copy their tiles themselves.
    let by_tma = flash_tma::supports(spec.head_dim);
    let flash_form = match kernels.flash {
        // Over FP8 `wgmma` takes its lockstep schedule and `tcgen05` its copies (whose steps
        // widen each tile to bf16).
        FlashForm::Wgmma(_) if cache.ty == Ty::F8E4M3 => FlashForm::Wgmma(Schedule::Lockstep),
        FlashForm::Tcgen05(_) if cache.ty == Ty::F8E4M3 => FlashForm::Tcgen05(Loads::Copies),
        FlashForm::Wgmma(Schedule::Tma) if !by_tma => FlashForm::Wgmma(Schedule::Specialised),
        FlashForm::Tcgen05(Loads::Tma) if !by_tma => FlashForm::Tcgen05(Loads::Copies),
        form => form,
    };
    let (kernel, tile_rows) = match flash_form {
        FlashForm::Wgmma(schedule) if flash_attention_wgmma::supports(spec.head_dim) => (
            flash_attention_wgmma::flash_attention_wgmma_over(
                match schedule {
                    Schedule::Lockstep => "flash_attention_wgmma",
                    Schedule::Specialised => "flash_attention_wgmma_specialised",
                    Schedule::Tma => "flash_attention_wgmma_tma",
                },
                &graph.name,
                cache.layout,
                (spec.head_dim, cache.ty),
                schedule,
            ),
            flash_attention_wgmma::QUERY_TILE_ROWS,
        ),
        FlashForm::Tcgen05(loads) if flash_attention_tcgen05::supports(spec.head_dim) => (
            flash_attention_tcgen05::flash_attention_tcgen05_over(
                match loads {
                    Loads::Copies => "flash_attention_tcgen05",
                    Loads::Tma => "flash_attention_tcgen05_tma",
                },
                &graph.name,
                cache.layout,
                (spec.head_dim, cache.ty),
                loads,
            ),
            flash_attention_tcgen05::QUERY_TILE_ROWS,
        ),
        _ => (
            flash_attention::flash_attention_over(
                "flash_attention",
                &graph.name,
                cache.layout,
                (spec.head_dim, cache.ty),
                flash_attention::Masking::CutTiles,
            ),
            flash_attention::QUERY_TILE_ROWS,
        ),
    };
    let flash_args = [
        common(operands.out()),
        cache.layout_args.clone(),
        match cache.layout {
            CacheLayout::Batched => vec![
                LaunchArg::StepInput {
                    name: flash_attention::query_tiles_input(tile_rows),
                },
                scalar("seqs", "seqs"),
            ],
            _ => vec![],
        },
        cache_sizes(&kernel, cache),
        vec![scalar(GATE, &flash)],
    ]
    .concat();
    if kernel.tensor_maps().next().is_some() && cache.layout != CacheLayout::Contiguous {
        s.block_multiple = s.block_multiple.max(flash_tma::TMA_KEYS as usize);
    }
    s.launches
        .push((i, step_gate::gated(kernel, GATE), Alternatives::default(), flash_args));
    let (merge, mut merge_args) = merge;
    merge_args.push(scalar(GATE, split_step));
    (step_gate::gated(merge, GATE), merge_args)
}

/// The sizes of the cache a kernel reading it by TMA maps (its `cache_rows` and
/// `cache_width`): the pool's positions in a batched step, the context for one sequence's,
/// and the elements of a position's row.
fn cache_sizes(kernel: &Kernel, cache: &Cache) -> Vec<LaunchArg> {
    match kernel.tensor_maps().next() {
        None => vec![],
        Some(_) => vec![
            scalar(
                "cache_rows",
                match cache.layout {
                    CacheLayout::Batched => "cache_rows",
                    _ => "context",
                },
            ),
            scalar("cache_width", cache.spec.kv_heads * cache.spec.head_dim),
        ],
    }
}

/// Where the attention over `cache` can run on the tensor cores (a bf16, f16 or FP8 cache, a head the
/// flash kernel takes, every row attending rather than the sampled alone), the expression
/// that is 1 in the steps that take it and 0 in the others (see [`FLASH_ROWS_PER_SEQUENCE`]).
fn flash_step(cache: &Cache, rows: &str) -> Option<String> {
    if !flash_attention::supports_cache(cache.ty) || !flash_attention::supports(cache.spec.head_dim) || cache.sampled {
        return None;
    }
    let per_sequence = FLASH_ROWS_PER_SEQUENCE;
    Some(match cache.layout {
        CacheLayout::Batched => format!("min(1,({rows})/({per_sequence}*seqs))"),
        _ => format!("min(1,({rows})/{per_sequence})"),
    })
}
