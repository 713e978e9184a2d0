//! Multi-head latent attention with DeepSeek's sparse indexer (`ir::Op::SparseMla`, GLM-5)
//! over a cache of latents, rows `[c (latent) | k_pe (rope) | index key]`, in seven launches.
//! Keys and values (`kv_b · c` per head) are never formed: each head's query is carried into
//! the latent's space (DeepSeek's absorbed form, `q_nope · W_UK c = (W_UKᵀ q_nope) · c`), the
//! head attends over latents, and its value is `W_UV` times the latents' weighted sum.
//!
//! 1. `mla_absorb` ([`per_head_gemv`]): `q̃ = W_UKᵀ q_nope` for each row and head, a warp
//!    per latent dim dotting its row of `k_b` (`[heads·latent, nope]`).
//! 2. `mla_append`: the step's latent, rotary key and index key into the cache, a thread per
//!    element. A layer sharing another's indexer (GLM-5.2) caches no index key and skips 3 and
//!    4: it reads that layer's cut, and the position scores it left.
//! 3. `index_scores`: each query row's indexer score of every position it sees,
//!    `Σ_i w_i · relu(q_i · k)` (the weights pre-scaled by `(ih·id)^−½`), into a buffer of a
//!    row per step row and a column per context position. A block per (row, split of its
//!    positions), the row's index queries in shared memory, a warp per position, a lane per
//!    32nd dim of each index head.
//! 4. `index_select`: per row, which positions it keeps: the `topk` best under bbc's order
//!    (`ir::reference::ops::top_k`: larger first, equal scores to the earlier position, NaN
//!    last), written as a cut: the k-th best score's ordered bits `T` (`UnOp::OrderedBits`),
//!    found two bits a pass from the top by counting keys at or above each candidate, and
//!    the last position `P` whose score equals `T` that is kept (the earliest ties fill the
//!    places `T` leaves). Kept: `key > T`, or `key == T` and `p ≤ P`. A row that sees no more
//!    positions than `topk` keeps them all (`T = P = 0`: every key is above 0).
//! 5. `sparse_mla`: FlashDecoding's split pass (`templates::attention`) over the kept
//!    positions only, a block per (row, group of heads, split): a head's score is
//!    `q̃ · c + q_pe · k_pe`, its value the latent `c` itself, so a warp loads a position's
//!    row once for the group and its latent serves as key and value.
//! 6. `attention_combine`: the splits merged (`templates::attention`'s) into every head's
//!    latent-space output.
//! 7. `mla_expand` ([`per_head_gemv`]): each head's merged latent through its rows of `v_b`,
//!    a warp per output.
//!
//! Scores and softmax in f32; the cache holds f32 rows.

use super::attention::{dims_per_lane, guarded, lane_dim, merge_warps, online_softmax_step, shared_f32, WARPS};
use super::cache_layout::CacheLayout;
use super::quant::WeightFormat;
use super::{block_sum, blocks_for, per_element, warp_dot_rows, warp_scratch, warp_sum, BLOCK};
use crate::dsl::*;
use ir::SparseMlaSpec;

fn i(v: usize) -> Expr {
    int(v as i64)
}

/// The statements that locate step row `t`'s block of a split pass: `split` and the row's
/// positions `start..end` of `0..=pos` (`pair` is the block's index without its split).
fn split_span(layout: CacheLayout) -> Vec<Stmt> {
    let mut s = vec![
        let_("split", Ty::I32, rem(bid(), var("splits"))),
        let_("pair", Ty::I32, bid() / var("splits")),
    ];
    s.push(let_("t", Ty::I32, var("pair") / var("blocks_per_row")));
    s.extend(layout.prologue(var("t")));
    s.extend([
        let_("pos", Ty::I32, layout.position(var("t"))),
        let_("hi", Ty::I32, var("pos") + int(1)),
        let_("span", Ty::I32, (var("hi") + var("splits") - int(1)) / var("splits")),
        let_("start", Ty::I32, var("split") * var("span")),
        let_("end", Ty::I32, bin(BinOp::Min, var("hi"), var("start") + var("span"))),
    ]);
    s
}

/// Launches 1 and 7: `out[t, h·rows + r] = w[h·rows + r, :] · x[t, h·k..(h + 1)·k]` for each
/// of `heads` heads (a head's rows of `w` dot that head's slice of the row), a warp per
/// output. Each head's query into the latent's space (`w` = `k_b`, rows of `nope`: `q̃ =
/// W_UKᵀ q_nope`), and each head's values out of its merged latent (`w` = `v_b`, rows of
/// `latent`).
pub fn per_head_gemv(name: &str, origin: &str, heads: usize, rows: usize, k: usize, weights: WeightFormat) -> Kernel {
    let warps = BLOCK as i64 / 32;
    let width = i(heads * rows);
    let outputs = var("tokens") * width.clone();
    let mut output = vec![
        let_("t", Ty::I32, var("o") / width.clone()),
        let_("hr", Ty::I32, rem(var("o"), width.clone())),
        let_("h", Ty::I32, var("hr") / i(rows)),
        let_("sum", Ty::F32, f(0.0)),
        warp_dot_rows(weights, k, &[(var("hr"), "sum")], &|c| {
            load("x", var("t") * var("x_stride") + var("h") * i(k) + c)
        }),
    ];
    output.extend(warp_sum("sum"));
    output.push(if_(
        eq(lane(), int(0)),
        vec![store("out", var("t") * width + var("hr"), var("sum"))],
    ));
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: {heads} heads' own {rows} rows of {k} against their slices of each row, {} weights",
            weights.describe()
        ),
        params: vec![
            buffer("x", Ty::F32, false),
            buffer("w", weights.buffer_ty(), false),
            buffer("out", Ty::F32, true),
            scalar("tokens", Ty::I32),
            scalar("x_stride", Ty::I32),
        ],
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(outputs.clone(), warps),
        body: vec![
            let_("o", Ty::I32, bid() * int(warps) + warp()),
            // Uniform across the warp: every lane shuffles or none.
            if_(lt(var("o"), outputs), output),
        ],
    }
}

/// Launch 2: row `t` of each source into its position's cache row `[c | k_pe | index key]`
/// (`[c | k_pe]` where the layer shares another's indexer).
pub fn mla_append(name: &str, origin: &str, layout: CacheLayout, spec: &SparseMlaSpec) -> Kernel {
    let (l, rope) = (spec.latent_dim, spec.rope_dim);
    let width = i(spec.cache_width());
    let column = |src: &str, stride: &str, from: usize| {
        vec![store(
            "cache",
            var("row") * width.clone() + var("c"),
            load(src, var("t") * var(stride) + var("c") - i(from)),
        )]
    };
    let rest = match spec.has_own_indexer() {
        true => vec![if_else(
            lt(var("c"), i(l + rope)),
            column("k_pe", "kp_stride", l),
            column("index_k", "ik_stride", l + rope),
        )],
        false => column("k_pe", "kp_stride", l),
    };
    let body = [
        vec![
            let_("t", Ty::I32, var("i") / width.clone()),
            let_("c", Ty::I32, rem(var("i"), width.clone())),
        ],
        layout.prologue(var("t")),
        vec![
            let_("row", Ty::I32, layout.row(layout.position(var("t")))),
            if_else(lt(var("c"), i(l)), column("latent", "c_stride", 0), rest),
        ],
    ]
    .concat();
    let mut params = vec![buffer("latent", Ty::F32, false), buffer("k_pe", Ty::F32, false)];
    if spec.has_own_indexer() {
        params.push(buffer("index_k", Ty::F32, false));
    }
    params.extend([
        buffer("cache", Ty::F32, true),
        scalar("tokens", Ty::I32),
        scalar("first", Ty::I32),
        scalar("c_stride", Ty::I32),
        scalar("kp_stride", Ty::I32),
    ]);
    if spec.has_own_indexer() {
        params.push(scalar("ik_stride", Ty::I32));
    }
    let rows = match spec.has_own_indexer() {
        true => "[c | k_pe | index key]",
        false => "[c | k_pe]",
    };
    Kernel {
        name: name.into(),
        origin: format!("{origin}: append latent attention's rows {rows}, {}", layout.describe()),
        params: [params, layout.params()].concat(),
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(var("tokens") * width.clone(), BLOCK as i64),
        body: per_element(var("tokens") * width, body),
    }
}

/// Launch 3: `scores[t·context + p]` for every position `p ≤ pos` of each row `t`, with zero
/// signless (`+ 0`: a score of −0 and one of +0 tie, as the reference ranks them).
pub fn index_scores(name: &str, origin: &str, layout: CacheLayout, spec: &SparseMlaSpec) -> Kernel {
    let (ih, id) = (spec.index_heads, spec.index_dim);
    let index_key = spec.index_key_offset();
    let per_lane = dims_per_lane(id);
    let mut body = vec![let_("blocks_per_row", Ty::I32, int(1))];
    body.extend(split_span(layout));
    // The row's index queries and pre-scaled weights, for every warp of the block.
    let weight_scale = ((ih * id) as f64).powf(-0.5) as f32;
    body.extend([
        for_(
            "e",
            tid(),
            i(ih * id),
            int(BLOCK as i64),
            vec![store(
                "iq",
                var("e"),
                load("index_q", var("t") * var("iq_stride") + var("e")),
            )],
        ),
        for_(
            "e",
            tid(),
            i(ih),
            int(BLOCK as i64),
            vec![store(
                "iw",
                var("e"),
                load("index_w", var("t") * var("iw_stride") + var("e")) * f(weight_scale),
            )],
        ),
        Stmt::SyncThreads,
    ]);
    let mut position = vec![let_(
        "base",
        Ty::I32,
        layout.row(var("j")) * i(spec.cache_width()) + i(index_key),
    )];
    for d in 0..per_lane {
        position.push(let_(&format!("k{d}"), Ty::F32, f(0.0)));
        position.extend(guarded(
            id,
            d,
            vec![assign(&format!("k{d}"), load("cache", var("base") + lane_dim(d)))],
        ));
    }
    let mut head = vec![let_("dot", Ty::F32, f(0.0))];
    for d in 0..per_lane {
        head.extend(guarded(
            id,
            d,
            vec![assign(
                "dot",
                var("dot") + load("iq", var("h") * i(id) + lane_dim(d)) * var(&format!("k{d}")),
            )],
        ));
    }
    head.extend(warp_sum("dot"));
    head.push(assign(
        "score",
        var("score") + load("iw", var("h")) * bin(BinOp::Max, var("dot"), f(0.0)),
    ));
    position.extend([
        let_("score", Ty::F32, f(0.0)),
        for_("h", int(0), i(ih), int(1), head),
        if_(
            eq(lane(), int(0)),
            vec![store(
                "scores",
                var("t") * var("context") + var("j"),
                var("score") + f(0.0),
            )],
        ),
    ]);
    body.push(for_(
        "j",
        var("start") + warp(),
        var("end"),
        int(WARPS as i64),
        position,
    ));
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: sparse indexer scores, {ih} heads of {id}, {}",
            layout.describe()
        ),
        params: [
            vec![
                buffer("index_q", Ty::F32, false),
                buffer("index_w", Ty::F32, false),
                buffer("cache", Ty::F32, false),
                buffer("scores", Ty::F32, true),
                scalar("tokens", Ty::I32),
                scalar("first", Ty::I32),
                scalar("iq_stride", Ty::I32),
                scalar("iw_stride", Ty::I32),
                scalar("context", Ty::I32),
                scalar("splits", Ty::I32),
            ],
            layout.params(),
        ]
        .concat(),
        shared: vec![shared_f32("iq", ih * id), shared_f32("iw", ih)],
        block_dim: BLOCK,
        grid: var("tokens") * var("splits"),
        body,
    }
}

/// `key` (position `p`'s ordered score bits) of row `t`.
fn key_of(p: Expr) -> Expr {
    un(UnOp::OrderedBits, load("scores", var("t") * var("context") + p))
}

/// A count of the row's positions and the test of a position `p` (with key `key`) it counts.
type Count<'a> = (&'a str, &'a dyn Fn(Expr, Expr) -> Expr);

/// Each count (an f32 declared before) of the row's positions `p < n` that pass its test, in
/// one pass over the scores; every thread ends with the block's totals.
fn count_keys(counts: &[Count]) -> Vec<Stmt> {
    let mut s: Vec<Stmt> = counts.iter().map(|(name, _)| assign(name, f(0.0))).collect();
    let mut each = vec![let_("key", Ty::U32, key_of(var("p")))];
    for (name, test) in counts {
        each.push(if_(test(var("p"), var("key")), vec![assign(name, var(name) + f(1.0))]));
    }
    s.push(for_("p", tid(), var("n"), int(BLOCK as i64), each));
    for (name, _) in counts {
        s.extend(block_sum(name, "warp_count", WARPS));
    }
    s
}

/// Launch 4: each row's cut (`cut[2t]` = T, `cut[2t + 1]` = P; see the module's notes). Counts
/// are exact in f32 (below 2²⁴ positions).
pub fn index_select(name: &str, origin: &str, layout: CacheLayout, spec: &SparseMlaSpec) -> Kernel {
    let u = |v: Expr| cast(Ty::U32, v);
    let topk = f(spec.index_topk as f32);
    let mut search = vec![let_("prefix", Ty::U32, u(int(0)))];
    for count in ["at_least_1", "at_least_2", "at_least_3", "above", "ties", "count"] {
        search.push(let_(count, Ty::F32, f(0.0)));
    }
    // T: the largest value whose keys at or above it number at least topk, two bits a pass
    // from the top (a pass counts the keys at or above each of the digit's three candidates;
    // the prefix's lower bits are zero, so no candidate carries).
    let candidate = |d: i64| var("prefix") + bin(BinOp::Shl, u(int(d)), var("shift"));
    let mut digit = vec![let_("shift", Ty::U32, u(int(30) - var("b") * int(2)))];
    let at_least = |d: i64| move |_: Expr, key: Expr| bin(BinOp::Ge, key, candidate(d));
    let (one, two, three) = (at_least(1), at_least(2), at_least(3));
    digit.extend(count_keys(&[
        ("at_least_1", &one),
        ("at_least_2", &two),
        ("at_least_3", &three),
    ]));
    let enough = |count: &str| bin(BinOp::Ge, var(count), topk.clone());
    digit.push(if_else(
        enough("at_least_3"),
        vec![assign("prefix", candidate(3))],
        vec![if_else(
            enough("at_least_2"),
            vec![assign("prefix", candidate(2))],
            vec![if_(enough("at_least_1"), vec![assign("prefix", candidate(1))])],
        )],
    ));
    search.push(for_("b", int(0), int(16), int(1), digit));
    // P: the earliest tie that fills the last place (ties all kept where they fit).
    let above = |_: Expr, key: Expr| bin(BinOp::Gt, key, var("prefix"));
    let tie = |_: Expr, key: Expr| eq(key, var("prefix"));
    search.extend(count_keys(&[("above", &above), ("ties", &tie)]));
    search.extend([
        let_("need", Ty::F32, topk.clone() - var("above")),
        let_("lo", Ty::I32, int(0)),
        let_("last", Ty::I32, var("n") - int(1)),
    ]);
    let mut halve = vec![let_("mid", Ty::I32, (var("lo") + var("last")) / int(2))];
    let early_tie = |p: Expr, key: Expr| and(eq(key, var("prefix")), bin(BinOp::Le, p, var("mid")));
    halve.extend(count_keys(&[("count", &early_tie)]));
    halve.push(if_else(
        bin(BinOp::Ge, var("count"), var("need")),
        vec![assign("last", var("mid"))],
        vec![assign("lo", var("mid") + int(1))],
    ));
    // Only where more keys tie at T than places are left; else every tie is kept.
    search.push(if_(
        bin(BinOp::Gt, var("ties"), var("need")),
        vec![for_("it", int(0), int(32), int(1), halve)],
    ));
    search.push(if_(
        eq(tid(), int(0)),
        vec![
            store("cut", var("t") * int(2), var("prefix")),
            store("cut", var("t") * int(2) + int(1), u(var("last"))),
        ],
    ));
    let keep_all = vec![if_(
        eq(tid(), int(0)),
        vec![
            store("cut", var("t") * int(2), u(int(0))),
            store("cut", var("t") * int(2) + int(1), u(int(0))),
        ],
    )];
    let mut body = vec![let_("t", Ty::I32, bid())];
    body.extend(layout.prologue(var("t")));
    body.extend([
        let_("n", Ty::I32, layout.position(var("t")) + int(1)),
        // The same branch for the whole block: its counts synchronise it.
        if_else(lt(i(spec.index_topk), var("n")), search, keep_all),
    ]);
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: the sparse indexer's top {} positions per row, as a cut, {}",
            spec.index_topk,
            layout.describe()
        ),
        params: [
            vec![
                buffer("scores", Ty::F32, false),
                buffer("cut", Ty::U32, true),
                scalar("tokens", Ty::I32),
                scalar("first", Ty::I32),
                scalar("context", Ty::I32),
            ],
            layout.params(),
        ]
        .concat(),
        shared: vec![warp_scratch("warp_count", WARPS)],
        block_dim: BLOCK,
        grid: var("tokens"),
        body,
    }
}

/// Heads one block of the split pass takes: every head reads the same latent rows, so as many
/// as registers allow (`group × latent dims per lane` ≤ 32 of each of queries and
/// accumulators, `templates::attention`'s rule).
pub fn heads_per_block(spec: &SparseMlaSpec) -> usize {
    super::attention::heads_per_block(spec.heads, 1, spec.latent_dim)
}

/// Launch 5: the split pass over the kept positions, a block per (row, group of
/// [`heads_per_block`] heads, split): writes `templates::attention`'s partials (`latent + 2`
/// floats each). Query `[q̃ | q_pe]` pre-scaled; a position's latent is each head's key part
/// and value.
pub fn sparse_mla_split(name: &str, origin: &str, layout: CacheLayout, spec: &SparseMlaSpec) -> Kernel {
    let (r, l) = (spec.rope_dim, spec.latent_dim);
    let group = heads_per_block(spec);
    let (latent_dims, rope_dims) = (dims_per_lane(l), dims_per_lane(r));
    let mut body = vec![let_("blocks_per_row", Ty::I32, var("heads") / i(group))];
    body.extend(split_span(layout));
    body.extend([
        let_("h0", Ty::I32, rem(var("pair"), var("blocks_per_row")) * i(group)),
        let_("cut_key", Ty::U32, load("cut", var("t") * int(2))),
        let_(
            "cut_last",
            Ty::I32,
            cast(Ty::I32, load("cut", var("t") * int(2) + int(1))),
        ),
    ]);
    // Each head's query, a dim per lane and 32nd of each part.
    let head = |g: usize| var("h0") + i(g);
    for g in 0..group {
        for d in 0..latent_dims {
            let q = format!("q{g}_{d}");
            body.push(let_(&q, Ty::F32, f(0.0)));
            let at = var("t") * i(spec.heads * l) + head(g) * i(l) + lane_dim(d);
            body.extend(guarded(l, d, vec![assign(&q, load("absorbed", at) * var("scale"))]));
        }
        for d in 0..rope_dims {
            let q = format!("qp{g}_{d}");
            body.push(let_(&q, Ty::F32, f(0.0)));
            let at = var("t") * var("qp_stride") + head(g) * i(r) + lane_dim(d);
            body.extend(guarded(r, d, vec![assign(&q, load("q_pe", at) * var("scale"))]));
        }
        for d in 0..latent_dims {
            body.push(let_(&format!("acc{g}_{d}"), Ty::F32, f(0.0)));
        }
        body.extend([
            let_(&format!("m{g}"), Ty::F32, f(f32::NEG_INFINITY)),
            let_(&format!("l{g}"), Ty::F32, f(0.0)),
        ]);
    }
    // The position's row, loaded once: `v{d}` its latent (key part and value), `kp{d}` its
    // rotary key.
    let mut kept = vec![let_("row", Ty::I32, layout.row(var("j")) * i(spec.cache_width()))];
    for d in 0..latent_dims {
        kept.push(let_(&format!("v{d}"), Ty::F32, f(0.0)));
        kept.extend(guarded(
            l,
            d,
            vec![assign(&format!("v{d}"), load("cache", var("row") + lane_dim(d)))],
        ));
    }
    for d in 0..rope_dims {
        kept.push(let_(&format!("kp{d}"), Ty::F32, f(0.0)));
        kept.extend(guarded(
            r,
            d,
            vec![assign(
                &format!("kp{d}"),
                load("cache", var("row") + i(l) + lane_dim(d)),
            )],
        ));
    }
    for g in 0..group {
        let s = format!("s{g}");
        kept.push(let_(&s, Ty::F32, f(0.0)));
        for d in 0..latent_dims {
            kept.push(assign(&s, var(&s) + var(&format!("q{g}_{d}")) * var(&format!("v{d}"))));
        }
        for d in 0..rope_dims {
            kept.push(assign(
                &s,
                var(&s) + var(&format!("qp{g}_{d}")) * var(&format!("kp{d}")),
            ));
        }
        kept.extend(warp_sum(&s));
        kept.extend(online_softmax_step(g, latent_dims));
    }
    // The key is the same for the whole warp, so is the branch (its shuffles need every lane).
    let key = un(UnOp::OrderedBits, load("scores", var("t") * var("context") + var("j")));
    let position = vec![
        let_("key", Ty::U32, key),
        if_(
            or(
                bin(BinOp::Gt, var("key"), var("cut_key")),
                and(
                    eq(var("key"), var("cut_key")),
                    bin(BinOp::Le, var("j"), var("cut_last")),
                ),
            ),
            kept,
        ),
    ];
    body.push(for_(
        "j",
        var("start") + warp(),
        var("end"),
        int(WARPS as i64),
        position,
    ));
    body.extend(merge_warps(l, group));
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: latent attention over the indexer's positions, split keys, online softmax, latents of {l} + rope {r}, {group} heads a block, {}",
            layout.describe()
        ),
        params: [
            vec![
                buffer("absorbed", Ty::F32, false),
                buffer("q_pe", Ty::F32, false),
                buffer("scores", Ty::F32, false),
                buffer("cut", Ty::U32, false),
                buffer("cache", Ty::F32, false),
                buffer("partial", Ty::F32, true),
                scalar("tokens", Ty::I32),
                scalar("first", Ty::I32),
                scalar("qp_stride", Ty::I32),
                scalar("heads", Ty::I32),
                scalar("scale", Ty::F32),
                scalar("context", Ty::I32),
                scalar("splits", Ty::I32),
            ],
            layout.params(),
        ]
        .concat(),
        shared: vec![
            shared_f32("warp_m", WARPS as usize * group),
            shared_f32("warp_l", WARPS as usize * group),
            shared_f32("warp_acc", WARPS as usize * group * l),
        ],
        block_dim: BLOCK,
        grid: var("tokens") * (var("heads") / i(group)) * var("splits"),
        body,
    }
}
