//! Causal attention over a KV cache (decode: one query per sequence; prefill: many), optionally
//! windowed, grouped KV heads, in two launches (FlashDecoding's split of the keys):
//!
//! 1. `attention_split`: a block per (row, head group, split). The row's keys (`lo..=pos`) are cut
//!    into `splits` equal spans and each block takes one. Each of its 8 warps walks every 8th key
//!    of the span: lane `l` holds dims `l, l + 32, …` of the query (so a warp reads a key or
//!    value row as whole 128-byte lines), the score is a warp sum, and the warp keeps its own
//!    running max, sum and accumulator (online softmax, FlashAttention's recurrence) with no
//!    barrier per key. The warps' states are merged through shared memory at the end and the
//!    block writes one partial: the accumulator, the max and the sum, unnormalised.
//! 2. `attention_combine`: a block per (row, head) merges its row's partials and divides.
//!
//! Why split: a batch-1 decode step has one row, so a block per (row, head) alone gives 32
//! blocks to a 132-SM GPU, each walking the whole cache serially (the H200 run of 2026-11-30
//! measured 330 µs per layer at 512 positions, 60% of the 8B-shaped step). Splits are many
//! when rows are few: `splits = 1 + 31 / rows` (32 at one row, 1 from 32 rows on), so the
//! partial buffer never exceeds `rows + 31` rows of partials. Softmax in f32.
//!
//! Why groups: the query heads of one KV head read the same key and value rows, so a block
//! takes them together (as many as registers allow) and reads each row once for all. A block
//! per head read Llama 3 8B's cache 4 times, from DRAM once a batch's cache outgrows the L2
//! (64 sequences of 512 positions: 268 MB a layer in f32, 134 MB in the bf16 cache a bf16
//! model keeps).

use super::cache_layout::CacheLayout;
use super::{warp_sum, BLOCK};
use crate::dsl::*;

pub(crate) const WARPS: u32 = BLOCK / 32;

/// The most splits a step uses (at one row).
pub const MAX_SPLITS: usize = 32;

/// The `splits` scalar of a step of `rows` rows (an expression over the plan's variables).
pub fn splits_expr(rows: &str) -> String {
    format!("1+{}/({rows})", MAX_SPLITS - 1)
}

/// The splits a step of `rows` rows uses: what [`splits_expr`] evaluates to.
pub fn splits_for(rows: usize) -> usize {
    1 + (MAX_SPLITS - 1) / rows.max(1)
}

/// What every attention over a cache takes first: the queries `q` (rows `q_stride` apart), the
/// cache's keys and values (`cache` elements), the f32 result `out`, the rows (`tokens` of
/// them from position `first`), the head's shape, the window (≤ 0: none) and the scale of
/// q·k.
pub(crate) fn rows_and_cache_params(cache: Ty, out: &str) -> Vec<Param> {
    vec![
        buffer("q", Ty::F32, false),
        buffer("k", cache, false),
        buffer("v", cache, false),
        buffer(out, Ty::F32, true),
        scalar("tokens", Ty::I32),
        scalar("q_stride", Ty::I32),
        scalar("first", Ty::I32),
        scalar("heads", Ty::I32),
        scalar("kv_heads", Ty::I32),
        scalar("window", Ty::I32),
        scalar("scale", Ty::F32),
    ]
}

/// f32 elements of the partials of a step of at most `max_rows` rows: `rows × splits` is at
/// most `rows + MAX_SPLITS - 1`, and each (row, head, split) keeps `head_dim + 2` floats.
pub fn partial_len(max_rows: usize, heads: usize, head_dim: usize) -> usize {
    (max_rows + MAX_SPLITS - 1) * heads * (head_dim + 2)
}

/// The largest head the templates take (Gemma 4's global layers' 512): a dim per thread of
/// the combine pass's block, and `head_dim / 32` of each of query, accumulator, key and value
/// per lane of the split pass (16 at 512, a block of one head).
pub const MAX_HEAD_DIM: usize = 512;

/// Query dims per lane (callers check `head_dim` against [`MAX_HEAD_DIM`] first).
pub(crate) fn dims_per_lane(head_dim: usize) -> usize {
    assert!(
        (1..=MAX_HEAD_DIM).contains(&head_dim),
        "head_dim {head_dim} outside 1..={MAX_HEAD_DIM}"
    );
    head_dim.div_ceil(32)
}

/// This lane's `i`-th dim of a head.
pub(crate) fn lane_dim(i: usize) -> Expr {
    lane() + int(32 * i as i64)
}

/// `body` for the lane's `i`-th dim, under a bounds check where that dim can fall past
/// `head_dim` (only the last, when `head_dim` is not a multiple of 32).
pub(crate) fn guarded(head_dim: usize, i: usize, body: Vec<Stmt>) -> Vec<Stmt> {
    match (i + 1) * 32 <= head_dim {
        true => body,
        false => vec![if_(lt(lane_dim(i), int(head_dim as i64)), body)],
    }
}

/// Query heads one block takes: those of one KV head share each key and value row a warp
/// loads, so a block takes as many of them as registers allow (`heads_per_block × dims per
/// lane` ≤ 32 of each of queries and accumulators).
pub fn heads_per_block(heads: usize, kv_heads: usize, head_dim: usize) -> usize {
    largest_group(heads, kv_heads, dims_per_lane(head_dim))
}

/// The most query heads of one KV head (a divisor of their number) whose queries and
/// accumulators, `per_lane` dims each, fit 32 registers of each a lane.
pub(crate) fn largest_group(heads: usize, kv_heads: usize, per_lane: usize) -> usize {
    let group = heads / kv_heads.max(1);
    (1..=group)
        .rev()
        .find(|g| group.is_multiple_of(*g) && g * per_lane <= 32)
        .unwrap_or(1)
}

/// The split pass over a cache in `layout` (contiguous, or paged through block tables), the
/// query rows `q_stride` apart (the rotated rows `rope_kv_append` wrote, or Q read in place
/// from a wider output), `group` query heads of one KV head per block (see
/// [`heads_per_block`]; it divides `heads / kv_heads`): writes
/// `partial[((row·heads + head)·splits + split)·(head_dim + 2) + …]` = accumulator, max, sum.
/// `window` ≤ 0 means none. The cache holds the new keys already, as `cache` elements (f32, or
/// bf16 widened as loaded).
pub fn attention_split(
    name: &str,
    origin: &str,
    layout: CacheLayout,
    head_dim: usize,
    group: usize,
    cache: Ty,
) -> Kernel {
    let per_lane = dims_per_lane(head_dim);
    assert!(group >= 1, "a block takes at least one head");
    let hd = int(head_dim as i64);
    let acc = |g: usize, i: usize| format!("acc{g}_{i}");
    let qv = |g: usize, i: usize| format!("q{g}_{i}");
    let (m, l, sc) = (
        |g: usize| format!("m{g}"),
        |g: usize| format!("l{g}"),
        |g: usize| format!("s{g}"),
    );
    let mut body = split_keys(layout, group);
    // The queries, pre-scaled, in registers.
    for g in 0..group {
        for i in 0..per_lane {
            let at = var("t") * var("q_stride") + (var("h0") + int(g as i64)) * hd.clone() + lane_dim(i);
            body.push(let_(&qv(g, i), Ty::F32, f(0.0)));
            body.extend(guarded(
                head_dim,
                i,
                vec![assign(&qv(g, i), load("q", at) * var("scale"))],
            ));
            body.push(let_(&acc(g, i), Ty::F32, f(0.0)));
        }
        body.extend([let_(&m(g), Ty::F32, f(f32::NEG_INFINITY)), let_(&l(g), Ty::F32, f(0.0))]);
    }
    // One key per warp per iteration; the loop bounds are the same for the whole warp. The
    // key and value rows are read once for the group.
    let mut key = vec![let_(
        "base",
        Ty::I32,
        (layout.row(var("j")) * var("kv_heads") + var("kvh")) * hd.clone(),
    )];
    for i in 0..per_lane {
        key.push(let_(&format!("k{i}"), Ty::F32, f(0.0)));
        key.push(let_(&format!("v{i}"), Ty::F32, f(0.0)));
        key.extend(guarded(
            head_dim,
            i,
            vec![
                assign(&format!("k{i}"), load("k", var("base") + lane_dim(i))),
                assign(&format!("v{i}"), load("v", var("base") + lane_dim(i))),
            ],
        ));
    }
    for g in 0..group {
        let dot = (0..per_lane)
            .map(|i| var(&qv(g, i)) * var(&format!("k{i}")))
            .reduce(|a, b| a + b)
            .expect("a dim per lane");
        key.push(let_(&sc(g), Ty::F32, dot));
        key.extend(warp_sum(&sc(g)));
    }
    for g in 0..group {
        key.extend(online_softmax_step(g, per_lane));
    }
    body.push(for_("j", var("start") + warp(), var("end"), int(WARPS as i64), key));
    body.extend(merge_warps(head_dim, group));
    split_pass_kernel((name, origin, ""), (layout, head_dim, group, cache), body)
}

/// A split pass's kernel (either form's): `body`, its parameters, the warps' states in shared
/// memory, and a block per (row, head group, split); `form` ends its description.
pub(crate) fn split_pass_kernel(
    (name, origin, form): (&str, &str, &str),
    (layout, head_dim, group, cache): (CacheLayout, usize, usize, Ty),
    body: Vec<Stmt>,
) -> Kernel {
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: causal attention, split keys, online softmax, head_dim {head_dim}, {group} heads a block, {} cache, {}{form}",
            format!("{cache:?}").to_lowercase(),
            layout.describe()
        ),
        params: [
            rows_and_cache_params(cache, "partial"),
            vec![scalar("splits", Ty::I32)],
            layout.params(),
        ]
        .concat(),
        shared: vec![
            shared_f32("warp_m", WARPS as usize * group),
            shared_f32("warp_l", WARPS as usize * group),
            shared_f32("warp_acc", WARPS as usize * group * head_dim),
        ],
        block_dim: BLOCK,
        grid: var("tokens") * (var("heads") / int(group as i64)) * var("splits"),
        body,
    }
}

/// The block's share of the keys: it takes row `t` (declaring the layout's prologue), query
/// heads `h0..h0 + group` of KV head `kvh`, and keys `start..end` of the row's `lo..hi`
/// (the window's keys up to the row's position `pos`), the span of split `split` of
/// `splits`.
pub(crate) fn split_keys(layout: CacheLayout, group: usize) -> Vec<Stmt> {
    let mut body = vec![
        let_("pair", Ty::I32, bid() / var("splits")),
        let_("split", Ty::I32, bin(BinOp::Rem, bid(), var("splits"))),
        let_("blocks_per_row", Ty::I32, var("heads") / int(group as i64)),
        let_("t", Ty::I32, var("pair") / var("blocks_per_row")),
    ];
    body.extend(layout.prologue(var("t")));
    body.extend([
        let_(
            "h0",
            Ty::I32,
            bin(BinOp::Rem, var("pair"), var("blocks_per_row")) * int(group as i64),
        ),
        let_("kvh", Ty::I32, var("h0") / (var("heads") / var("kv_heads"))),
        let_("pos", Ty::I32, layout.position(var("t"))),
        let_("hi", Ty::I32, var("pos") + int(1)),
        let_(
            "lo",
            Ty::I32,
            select(
                bin(BinOp::Gt, var("window"), int(0)),
                bin(BinOp::Max, int(0), var("hi") - var("window")),
                int(0),
            ),
        ),
        let_(
            "span",
            Ty::I32,
            (var("hi") - var("lo") + var("splits") - int(1)) / var("splits"),
        ),
        let_("start", Ty::I32, var("lo") + var("split") * var("span")),
        let_("end", Ty::I32, bin(BinOp::Min, var("hi"), var("start") + var("span"))),
    ]);
    body
}

/// Head `g`'s online softmax (FlashAttention's recurrence) over one more key, whose score is
/// `s{g}` and whose value row this lane holds in `v0..v{value_dims}`: the running max `m{g}`
/// and sum `l{g}` updated, the accumulators `acc{g}_i` rescaled and the value added with the
/// key's weight.
pub(crate) fn online_softmax_step(g: usize, value_dims: usize) -> Vec<Stmt> {
    let (m, l, s) = (format!("m{g}"), format!("l{g}"), format!("s{g}"));
    let (m_new, c, p) = (format!("m_new{g}"), format!("c{g}"), format!("p{g}"));
    let mut step = vec![
        let_(&m_new, Ty::F32, bin(BinOp::Max, var(&m), var(&s))),
        let_(&c, Ty::F32, un(UnOp::Exp, var(&m) - var(&m_new))),
        let_(&p, Ty::F32, un(UnOp::Exp, var(&s) - var(&m_new))),
        assign(&l, var(&l) * var(&c) + var(&p)),
    ];
    for i in 0..value_dims {
        let acc = format!("acc{g}_{i}");
        step.push(assign(&acc, var(&acc) * var(&c) + var(&p) * var(&format!("v{i}"))));
    }
    step.push(assign(&m, var(&m_new)));
    step
}

pub(crate) fn shared_f32(name: &str, len: usize) -> SharedArray {
    SharedArray {
        name: name.into(),
        ty: Ty::F32,
        len,
    }
}

/// The weight of a state whose max is `m` against the overall max `top`: `exp(m − top)`, and 0
/// for a state that saw no key (`m` = −∞; also when every state is empty, where the exponent
/// would be NaN).
pub(crate) fn weight_of(m: Expr, top: Expr) -> Expr {
    select(
        bin(BinOp::Gt, m.clone(), f(f32::NEG_INFINITY)),
        un(UnOp::Exp, m - top),
        f(0.0),
    )
}

/// The warps' (max, sum, accumulator) of each of the block's `group` heads merged into the
/// heads' partials, lane `l` holding dims `l, l + 32, …` of each accumulator.
pub(crate) fn merge_warps(head_dim: usize, group: usize) -> Vec<Stmt> {
    let hd = int(head_dim as i64);
    let slot = |g: usize| warp_slot(g, group);
    let mut s = Vec::new();
    for g in 0..group {
        s.push(store_max_and_sum(g, group));
        for i in 0..dims_per_lane(head_dim) {
            s.extend(guarded(
                head_dim,
                i,
                vec![store(
                    "warp_acc",
                    slot(g) * hd.clone() + lane_dim(i),
                    var(&format!("acc{g}_{i}")),
                )],
            ));
        }
    }
    s.extend(merge_warp_states(head_dim, group));
    s
}

/// This warp's slot for head `g` of the block's `group` in the shared states.
pub(crate) fn warp_slot(g: usize, group: usize) -> Expr {
    warp() * int(group as i64) + int(g as i64)
}

/// Lane 0 stores this warp's max `m{g}` and sum `l{g}` of head `g` into its slot.
pub(crate) fn store_max_and_sum(g: usize, group: usize) -> Stmt {
    if_(
        eq(lane(), int(0)),
        vec![
            store("warp_m", warp_slot(g, group), var(&format!("m{g}"))),
            store("warp_l", warp_slot(g, group), var(&format!("l{g}"))),
        ],
    )
}

/// What follows each warp's storing its state of each head `g` (max in `warp_m`, sum in
/// `warp_l`, accumulator in `warp_acc`, at slot `warp · group + g`): the warps' states merged
/// into the heads' partials, a thread per (head, dim) pair, the block striding over them.
pub(crate) fn merge_warp_states(head_dim: usize, group: usize) -> Vec<Stmt> {
    let hd = int(head_dim as i64);
    let at_w = |w: Expr| w * int(group as i64) + var("g");
    vec![
        Stmt::SyncThreads,
        for_(
            "e",
            tid(),
            int((group * head_dim) as i64),
            int(BLOCK as i64),
            vec![
                let_("g", Ty::I32, var("e") / hd.clone()),
                let_("d", Ty::I32, rem(var("e"), hd.clone())),
                let_("top", Ty::F32, f(f32::NEG_INFINITY)),
                for_(
                    "w",
                    int(0),
                    int(WARPS as i64),
                    int(1),
                    vec![assign(
                        "top",
                        bin(BinOp::Max, var("top"), load("warp_m", at_w(var("w")))),
                    )],
                ),
                let_("sum", Ty::F32, f(0.0)),
                let_("out", Ty::F32, f(0.0)),
                for_(
                    "w",
                    int(0),
                    int(WARPS as i64),
                    int(1),
                    vec![
                        let_("wt", Ty::F32, weight_of(load("warp_m", at_w(var("w"))), var("top"))),
                        assign("sum", var("sum") + load("warp_l", at_w(var("w"))) * var("wt")),
                        assign(
                            "out",
                            var("out") + load("warp_acc", at_w(var("w")) * hd.clone() + var("d")) * var("wt"),
                        ),
                    ],
                ),
                let_(
                    "at",
                    Ty::I32,
                    ((var("t") * var("heads") + var("h0") + var("g")) * var("splits") + var("split"))
                        * int(head_dim as i64 + 2),
                ),
                store("partial", var("at") + var("d"), var("out")),
                if_(
                    eq(var("d"), int(0)),
                    vec![
                        store("partial", var("at") + hd.clone(), var("top")),
                        store("partial", var("at") + hd + int(1), var("sum")),
                    ],
                ),
            ],
        ),
    ]
}

/// Partials the combine pass loads before it merges them: a batch-1 step splits each row's
/// keys 32 ways, and the loops over the splits, a load at a time, made the pass about 5 µs a
/// layer on the H200.
const SPLITS_IN_FLIGHT: i64 = 8;

/// The second pass: `out[row][head]` = the row's partials merged, divided by their sum; a
/// thread per dim. Both walks over the splits load [`SPLITS_IN_FLIGHT`] of them at a time
/// and merge them in split order, as one at a time would.
pub fn attention_combine(name: &str, origin: &str, head_dim: usize) -> Kernel {
    let threads = dims_per_lane(head_dim) as u32 * 32;
    let stride = int(head_dim as i64 + 2);
    let hd = int(head_dim as i64);
    let at = |split: Expr, field: Expr| load("partial", var("first_split") + split * stride.clone() + field);
    let named = |name: &str, u: i64| format!("{name}{u}");
    let walk_splits = |loads: &dyn Fn(i64, Expr) -> Vec<(String, Expr)>, merge: &dyn Fn(i64, Expr) -> Vec<Stmt>| {
        super::loads_in_flight("sp", (int(0), var("splits")), int(1), SPLITS_IN_FLIGHT, loads, merge)
    };
    let top = walk_splits(&|u, sp| vec![(named("m", u), at(sp, hd.clone()))], &|u, _| {
        vec![assign("top", bin(BinOp::Max, var("top"), var(&named("m", u))))]
    });
    let merged = walk_splits(
        &|u, sp| {
            vec![
                (named("m", u), at(sp.clone(), hd.clone())),
                (named("l", u), at(sp.clone(), hd.clone() + int(1))),
                (named("a", u), at(sp, tid())),
            ]
        },
        &|u, _| {
            let wt = named("wt", u);
            vec![
                let_(&wt, Ty::F32, weight_of(var(&named("m", u)), var("top"))),
                assign("sum", var("sum") + var(&named("l", u)) * var(&wt)),
                assign("acc", var("acc") + var(&named("a", u)) * var(&wt)),
            ]
        },
    );
    let body = vec![if_(
        lt(tid(), hd.clone()),
        vec![
            let_("first_split", Ty::I32, bid() * var("splits") * stride.clone()),
            let_("top", Ty::F32, f(f32::NEG_INFINITY)),
            top,
            let_("sum", Ty::F32, f(0.0)),
            let_("acc", Ty::F32, f(0.0)),
            merged,
            store("out", bid() * hd + tid(), var("acc") / var("sum")),
        ],
    )];
    Kernel {
        name: name.into(),
        origin: format!("{origin}: attention's split partials merged, head_dim {head_dim}"),
        params: vec![
            buffer("partial", Ty::F32, false),
            buffer("out", Ty::F32, true),
            scalar("tokens", Ty::I32),
            scalar("heads", Ty::I32),
            scalar("splits", Ty::I32),
        ],
        shared: vec![],
        block_dim: threads,
        grid: var("tokens") * var("heads"),
        body,
    }
}
