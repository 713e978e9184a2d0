//! Causal attention over a KV cache (decode: one query per sequence; prefill: many), optionally
//! windowed, grouped KV heads, in two launches (FlashDecoding's split of the keys):
//!
//! 1. `attention_split`: a block per (row, head, split). The row's keys (`lo..=pos`) are cut
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
//! when rows are few: `splits = 1 + 15 / rows` (16 at one row, 1 from 16 rows on), so the
//! partial buffer never exceeds `rows + 15` rows of partials. Softmax in f32.

use super::cache_layout::CacheLayout;
use super::{warp_sum, BLOCK};
use crate::dsl::*;

const WARPS: u32 = BLOCK / 32;

/// The most splits a step uses (at one row).
pub const MAX_SPLITS: usize = 16;

/// The `splits` scalar of a step of `rows` rows (an expression over the plan's variables).
pub fn splits_expr(rows: &str) -> String {
    format!("1+{}/({rows})", MAX_SPLITS - 1)
}

/// The splits a step of `rows` rows uses: what [`splits_expr`] evaluates to.
pub fn splits_for(rows: usize) -> usize {
    1 + (MAX_SPLITS - 1) / rows.max(1)
}

/// f32 elements of the partials of a step of at most `max_rows` rows: `rows × splits` is at
/// most `rows + MAX_SPLITS - 1`, and each (row, head, split) keeps `head_dim + 2` floats.
pub fn partial_len(max_rows: usize, heads: usize, head_dim: usize) -> usize {
    (max_rows + MAX_SPLITS - 1) * heads * (head_dim + 2)
}

/// Query dims per lane.
fn dims_per_lane(head_dim: usize) -> usize {
    assert!(
        (1..=BLOCK as usize).contains(&head_dim),
        "head_dim {head_dim} outside 1..={BLOCK}"
    );
    head_dim.div_ceil(32)
}

/// Lane's `i`-th dim, and whether it exists (only the last can fall past a head_dim that is
/// not a multiple of 32).
fn lane_dim(i: usize) -> Expr {
    lane() + int(32 * i as i64)
}

fn guarded(head_dim: usize, i: usize, body: Vec<Stmt>) -> Vec<Stmt> {
    match (i + 1) * 32 <= head_dim {
        true => body,
        false => vec![if_(lt(lane_dim(i), int(head_dim as i64)), body)],
    }
}

/// The split pass over a contiguous cache.
pub fn attention(name: &str, origin: &str, head_dim: usize) -> Kernel {
    attention_split(name, origin, CacheLayout::Contiguous, head_dim)
}

/// The split pass over a cache in `layout` (contiguous, or paged through block tables), the
/// query rows `q_stride` apart (Q is a slice of the joined ropes' output): writes
/// `partial[((row·heads + head)·splits + split)·(head_dim + 2) + …]` = accumulator, max, sum.
/// `window` ≤ 0 means none. The cache holds the new keys already.
pub fn attention_split(name: &str, origin: &str, layout: CacheLayout, head_dim: usize) -> Kernel {
    let per_lane = dims_per_lane(head_dim);
    let hd = int(head_dim as i64);
    let acc = |i: usize| format!("acc{i}");
    let qv = |i: usize| format!("q{i}");
    let cache_at = |buf: &str, i: usize| load(buf, var("base") + lane_dim(i));
    let mut body = vec![
        let_("pair", Ty::I32, bid() / var("splits")),
        let_("split", Ty::I32, bin(BinOp::Rem, bid(), var("splits"))),
        let_("t", Ty::I32, var("pair") / var("heads")),
    ];
    body.extend(layout.prologue(var("t")));
    body.extend([
        let_("h", Ty::I32, bin(BinOp::Rem, var("pair"), var("heads"))),
        let_("kvh", Ty::I32, var("h") / (var("heads") / var("kv_heads"))),
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
    // The query, pre-scaled, in registers.
    for i in 0..per_lane {
        body.push(let_(&qv(i), Ty::F32, f(0.0)));
        body.extend(guarded(
            head_dim,
            i,
            vec![assign(
                &qv(i),
                load("q", var("t") * var("q_stride") + var("h") * hd.clone() + lane_dim(i)) * var("scale"),
            )],
        ));
        body.push(let_(&acc(i), Ty::F32, f(0.0)));
    }
    body.extend([let_("m", Ty::F32, f(f32::NEG_INFINITY)), let_("l", Ty::F32, f(0.0))]);
    // One key per warp per iteration; the loop bounds are the same for the whole warp.
    let mut key = vec![
        let_(
            "base",
            Ty::I32,
            (layout.row(var("j")) * var("kv_heads") + var("kvh")) * hd.clone(),
        ),
        let_("s", Ty::F32, f(0.0)),
    ];
    for i in 0..per_lane {
        key.extend(guarded(
            head_dim,
            i,
            vec![assign("s", var("s") + var(&qv(i)) * cache_at("k", i))],
        ));
    }
    key.extend(warp_sum("s"));
    key.extend([
        let_("m_new", Ty::F32, bin(BinOp::Max, var("m"), var("s"))),
        let_("correction", Ty::F32, un(UnOp::Exp, var("m") - var("m_new"))),
        let_("p", Ty::F32, un(UnOp::Exp, var("s") - var("m_new"))),
        assign("l", var("l") * var("correction") + var("p")),
    ]);
    for i in 0..per_lane {
        key.extend(guarded(
            head_dim,
            i,
            vec![assign(
                &acc(i),
                var(&acc(i)) * var("correction") + var("p") * cache_at("v", i),
            )],
        ));
    }
    key.push(assign("m", var("m_new")));
    body.push(for_("j", var("start") + warp(), var("end"), int(WARPS as i64), key));
    body.extend(merge_warps(head_dim));
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: causal attention, split keys, online softmax, head_dim {head_dim}, {}",
            layout.describe()
        ),
        params: [
            vec![
                buffer("q", Ty::F32, false),
                buffer("k", Ty::F32, false),
                buffer("v", Ty::F32, false),
                buffer("partial", Ty::F32, true),
                scalar("tokens", Ty::I32),
                scalar("q_stride", Ty::I32),
                scalar("first", Ty::I32),
                scalar("heads", Ty::I32),
                scalar("kv_heads", Ty::I32),
                scalar("window", Ty::I32),
                scalar("scale", Ty::F32),
                scalar("splits", Ty::I32),
            ],
            layout.params(),
        ]
        .concat(),
        shared: vec![
            shared_f32("warp_m", WARPS as usize),
            shared_f32("warp_l", WARPS as usize),
            shared_f32("warp_acc", WARPS as usize * head_dim),
        ],
        block_dim: BLOCK,
        grid: var("tokens") * var("heads") * var("splits"),
        body,
    }
}

fn shared_f32(name: &str, len: usize) -> SharedArray {
    SharedArray {
        name: name.into(),
        ty: Ty::F32,
        len,
    }
}

/// The weight of a state whose max is `m` against the overall max `top`: `exp(m − top)`, and 0
/// for a state that saw no key (`m` = −∞; also when every state is empty, where the exponent
/// would be NaN).
fn weight_of(m: Expr, top: Expr) -> Expr {
    select(
        bin(BinOp::Gt, m.clone(), f(f32::NEG_INFINITY)),
        un(UnOp::Exp, m - top),
        f(0.0),
    )
}

/// The warps' (max, sum, accumulator) merged into the block's partial.
fn merge_warps(head_dim: usize) -> Vec<Stmt> {
    let hd = int(head_dim as i64);
    let mut s = vec![if_(
        eq(lane(), int(0)),
        vec![store("warp_m", warp(), var("m")), store("warp_l", warp(), var("l"))],
    )];
    for i in 0..dims_per_lane(head_dim) {
        s.extend(guarded(
            head_dim,
            i,
            vec![store(
                "warp_acc",
                warp() * hd.clone() + lane_dim(i),
                var(&format!("acc{i}")),
            )],
        ));
    }
    s.push(Stmt::SyncThreads);
    let at = (var("pair") * var("splits") + var("split")) * int(head_dim as i64 + 2);
    s.push(if_(
        lt(tid(), hd.clone()),
        vec![
            let_("top", Ty::F32, f(f32::NEG_INFINITY)),
            for_(
                "w",
                int(0),
                int(WARPS as i64),
                int(1),
                vec![assign("top", bin(BinOp::Max, var("top"), load("warp_m", var("w"))))],
            ),
            let_("sum", Ty::F32, f(0.0)),
            let_("out", Ty::F32, f(0.0)),
            for_(
                "w",
                int(0),
                int(WARPS as i64),
                int(1),
                vec![
                    let_("wt", Ty::F32, weight_of(load("warp_m", var("w")), var("top"))),
                    assign("sum", var("sum") + load("warp_l", var("w")) * var("wt")),
                    assign(
                        "out",
                        var("out") + load("warp_acc", var("w") * hd.clone() + tid()) * var("wt"),
                    ),
                ],
            ),
            let_("at", Ty::I32, at),
            store("partial", var("at") + tid(), var("out")),
            if_(
                eq(tid(), int(0)),
                vec![
                    store("partial", var("at") + hd.clone(), var("top")),
                    store("partial", var("at") + hd + int(1), var("sum")),
                ],
            ),
        ],
    ));
    s
}

/// The second pass: `out[row][head]` = the row's partials merged, divided by their sum; a
/// thread per dim.
pub fn attention_combine(name: &str, origin: &str, head_dim: usize) -> Kernel {
    let threads = dims_per_lane(head_dim) as u32 * 32;
    let stride = int(head_dim as i64 + 2);
    let hd = int(head_dim as i64);
    let at = |field: Expr| load("partial", var("first_split") + var("sp") * stride.clone() + field);
    let body = vec![if_(
        lt(tid(), hd.clone()),
        vec![
            let_("first_split", Ty::I32, bid() * var("splits") * stride.clone()),
            let_("top", Ty::F32, f(f32::NEG_INFINITY)),
            for_(
                "sp",
                int(0),
                var("splits"),
                int(1),
                vec![assign("top", bin(BinOp::Max, var("top"), at(hd.clone())))],
            ),
            let_("sum", Ty::F32, f(0.0)),
            let_("acc", Ty::F32, f(0.0)),
            for_(
                "sp",
                int(0),
                var("splits"),
                int(1),
                vec![
                    let_("wt", Ty::F32, weight_of(at(hd.clone()), var("top"))),
                    assign("sum", var("sum") + at(hd.clone() + int(1)) * var("wt")),
                    assign("acc", var("acc") + at(tid()) * var("wt")),
                ],
            ),
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
