//! Mixture-of-experts layers (the IR's `moe`) as three launches in decode steps:
//!
//! 1. [`route`]: a warp per row picks the row's experts from the router's logits and weighs
//!    them, exactly as `ir::reference::ops::moe_route` (softmax router, Gemma 4's with its
//!    experts' scales, or DeepSeek-V3's grouped sigmoid with its score bias and its choice
//!    inside the best groups), writing
//!    `routes` (expert ids, ascending) and `route_weights`, `experts_per_token` of each a row.
//!    Every choice is `experts_per_token` rounds of a warp-wide argmax under bbc's order
//!    (larger first, equal values to the lower index, NaN as −∞; `top_k`), each round among the
//!    candidates ranked after the previous round's winner.
//! 2. [`gate_up`]: a warp per (row, chosen expert, hidden unit) dots the row with that unit's
//!    gate and up rows of the expert's stacked weights and writes `act(gate)·up`; dense weights
//!    are read 16 bytes a lane at a time (8 bf16), as the decode GEMV reads them.
//! 3. [`down`]: a warp per (row, output column) sums each chosen expert's down row against its
//!    hidden units, weighted, in ascending expert order as the reference adds them.
//!
//! Prefill steps run (2) and (3) expert by expert instead ([`gate_up_by_expert`],
//! [`down_by_expert`] then [`combine`], whose grid is empty in other steps): a block per expert
//! finds the rows that chose it, so its weights are read once a step rather than once per row.
//!
//! Each row's arithmetic depends on its own routes only, and is the same in either order (the
//! same dots, the same sum over a row's experts), so a row computes the same whatever shares
//! its step.

use super::gemv::gated;
use super::quant::WeightFormat;
use super::top_k::ranks_before;
use super::{warp_dot_rows, warp_sum, weight_vector, BLOCK};
use crate::dsl::*;
use ir::{MoeRouter, MoeSpec};

/// Warps a block of [`gate_up`] and [`down`] holds: one output each.
const WARPS: i64 = BLOCK as i64 / 32;

/// The NaN-safe key of `x` (NaN ranks as −∞).
fn key(x: Expr) -> Expr {
    select(eq(x.clone(), x.clone()), x, f(f32::NEG_INFINITY))
}

/// The locals every round of [`warp_round`] assigns, declared once: its best so far, a
/// neighbour lane's, and the previous round's winner (before the first, above everything).
fn round_locals() -> Vec<Stmt> {
    vec![
        let_("best", Ty::F32, f(f32::NEG_INFINITY)),
        let_("best_i", Ty::I32, int(-1)),
        let_("other", Ty::F32, f(0.0)),
        let_("other_i", Ty::I32, int(0)),
        let_("prev", Ty::F32, f(f32::INFINITY)),
        let_("prev_i", Ty::I32, int(-1)),
    ]
}

/// A round of warp-wide argmax: each lane's best (`best`, `best_i`) among candidates `e` in
/// `from..to` (lanes striding) whose key `value(e)` ranks after (`prev`, `prev_i`), then the
/// warp's best in every lane (butterfly shuffles: the order is total, so every lane agrees);
/// then the winner becomes `prev`.
fn warp_round(from: Expr, to: Expr, value: &dyn Fn(Expr) -> Expr) -> Vec<Stmt> {
    let mut round = vec![
        assign("best", f(f32::NEG_INFINITY)),
        assign("best_i", int(-1)),
        for_(
            "e",
            from + lane(),
            to,
            int(32),
            vec![
                let_("raw", Ty::F32, value(var("e"))),
                let_("v", Ty::F32, key(var("raw"))),
                if_(
                    and(
                        or(
                            bin(BinOp::Lt, var("v"), var("prev")),
                            and(eq(var("v"), var("prev")), bin(BinOp::Gt, var("e"), var("prev_i"))),
                        ),
                        ranks_before(var("v"), var("e"), var("best"), var("best_i")),
                    ),
                    vec![assign("best", var("v")), assign("best_i", var("e"))],
                ),
            ],
        ),
    ];
    for m in [16, 8, 4, 2, 1] {
        round.extend([
            assign("other", shfl_xor(var("best"), m)),
            assign("other_i", shfl_xor(var("best_i"), m)),
            if_(
                ranks_before(var("other"), var("other_i"), var("best"), var("best_i")),
                vec![assign("best", var("other")), assign("best_i", var("other_i"))],
            ),
        ]);
    }
    round.extend([assign("prev", var("best")), assign("prev_i", var("best_i"))]);
    round
}

/// The router's logit of expert `e` of this block's row.
fn logit(e: Expr) -> Expr {
    load("logits", var("row") * var("logits_stride") + e)
}

/// An expression of an expert's index.
type PerExpert = Box<dyn Fn(Expr) -> Expr>;

/// Threads of a `route` block: one warp, routing one row.
pub const ROUTE_BLOCK: u32 = 32;

/// Route every row: grid = `tokens` blocks of one warp.
pub fn route(name: &str, origin: &str, spec: &MoeSpec) -> Kernel {
    let (experts, k) = (spec.experts as i64, spec.experts_per_token);
    let mut body = vec![let_("row", Ty::I32, bid())];
    body.extend(round_locals());
    // The key experts are chosen by, and the score their weight comes from.
    let (choice, score): (PerExpert, PerExpert) = match spec.router {
        MoeRouter::Softmax | MoeRouter::SoftmaxExpertScale => {
            // Softmax is monotonic: choose on the logits; weights from exp(l − max) / Σ. A NaN
            // logit makes every score NaN (the sum is NaN), and all rank alike, as there.
            body.extend(softmax_normaliser(experts));
            (
                Box::new(|e| select(eq(var("sum"), var("sum")), logit(e), f(f32::NEG_INFINITY))),
                Box::new(|e| un(UnOp::Exp, logit(e) - var("max")) / var("sum")),
            )
        }
        MoeRouter::GroupedSigmoid { groups, top_groups, .. } => {
            body.extend(chosen_groups(experts, groups as i64, top_groups as i64));
            let per_group = experts / groups as i64;
            (
                Box::new(move |e: Expr| {
                    select(
                        eq(load("group_chosen", e.clone() / int(per_group)), int(1)),
                        biased_score(e),
                        f(0.0),
                    )
                }),
                Box::new(|e| super::elementwise::sigmoid(logit(e))),
            )
        }
    };
    body.extend([assign("prev", f(f32::INFINITY)), assign("prev_i", int(-1))]);
    body.extend(declare_choices(k));
    for p in 0..k {
        body.push(Stmt::Comment(format!("choice {p}")));
        body.extend(warp_round(int(0), int(experts), &*choice));
        body.extend(chosen(p, &*score));
    }
    body.extend(weigh_and_sort(spec));
    let mut shared = vec![];
    if let MoeRouter::GroupedSigmoid { groups, .. } = spec.router {
        shared.push(SharedArray {
            name: "group_chosen".into(),
            ty: Ty::I32,
            len: groups,
        });
        shared.push(SharedArray {
            name: "group_score".into(),
            ty: Ty::F32,
            len: groups,
        });
    }
    Kernel {
        name: name.into(),
        origin: format!("{origin}: MoE routing, {}", describe(spec)),
        params: vec![
            buffer("logits", Ty::F32, false),
            buffer(expert_vector(spec.router), Ty::F32, false),
            buffer("routes", Ty::I32, true),
            buffer("route_weights", Ty::F32, true),
            scalar("tokens", Ty::I32),
            scalar("logits_stride", Ty::I32),
        ],
        shared,
        block_dim: ROUTE_BLOCK,
        grid: var("tokens"),
        body,
    }
}

/// Where the rounds keep their winners: `c{p}` (the expert) and `w{p}` (its weight).
fn declare_choices(k: usize) -> Vec<Stmt> {
    (0..k)
        .flat_map(|p| {
            [
                let_(&format!("c{p}"), Ty::I32, int(0)),
                let_(&format!("w{p}"), Ty::F32, f(0.0)),
            ]
        })
        .collect()
}

/// Round `p`'s winner, kept by every lane: an expert is chosen each round (there are at least
/// `experts_per_token` candidates).
fn chosen(p: usize, score: &dyn Fn(Expr) -> Expr) -> Vec<Stmt> {
    vec![
        assign(&format!("c{p}"), var("prev_i")),
        assign(&format!("w{p}"), score(var("prev_i"))),
    ]
}

/// `max` and `sum` (of `exp(l − max)`) over the row's logits, in every lane.
fn softmax_normaliser(experts: i64) -> Vec<Stmt> {
    let mut out = vec![
        let_("max", Ty::F32, f(f32::NEG_INFINITY)),
        for_(
            "e",
            lane(),
            int(experts),
            int(32),
            vec![assign("max", bin(BinOp::Max, var("max"), logit(var("e"))))],
        ),
    ];
    for m in [16, 8, 4, 2, 1] {
        out.push(assign("max", bin(BinOp::Max, var("max"), shfl_xor(var("max"), m))));
    }
    out.extend([
        let_("sum", Ty::F32, f(0.0)),
        for_(
            "e",
            lane(),
            int(experts),
            int(32),
            vec![assign("sum", var("sum") + un(UnOp::Exp, logit(var("e")) - var("max")))],
        ),
    ]);
    out.extend(warp_sum("sum"));
    out
}

/// The name of the router's per-expert vector (read only by the routers that have one).
fn expert_vector(router: MoeRouter) -> &'static str {
    match router {
        MoeRouter::SoftmaxExpertScale => "expert_scale",
        MoeRouter::Softmax | MoeRouter::GroupedSigmoid { .. } => "score_bias",
    }
}

/// `sigmoid(logit) + bias`: what DeepSeek-V3's router ranks experts by.
fn biased_score(e: Expr) -> Expr {
    super::elementwise::sigmoid(logit(e.clone())) + load("score_bias", e)
}

/// DeepSeek-V3's groups: each scores the sum of its two best biased scores; the `top_groups`
/// best are chosen (`group_chosen[g]` = 1), the rest mask their experts to 0.
fn chosen_groups(experts: i64, groups: i64, top_groups: i64) -> Vec<Stmt> {
    let per_group = experts / groups;
    let mut group = vec![
        assign("prev", f(f32::INFINITY)),
        assign("prev_i", int(-1)),
        let_("two_best", Ty::F32, f(0.0)),
    ];
    for _ in 0..2 {
        let (from, to) = (var("g") * int(per_group), (var("g") + int(1)) * int(per_group));
        group.extend(warp_round(from, to, &biased_score));
        group.push(assign("two_best", var("two_best") + var("best")));
    }
    group.push(if_(
        eq(lane(), int(0)),
        vec![store("group_score", var("g"), var("two_best"))],
    ));
    vec![
        for_("g", int(0), int(groups), int(1), group),
        Stmt::SyncThreads,
        // A group is chosen when fewer than `top_groups` rank before it.
        for_(
            "g",
            lane(),
            int(groups),
            int(32),
            vec![
                let_("mine", Ty::F32, key(load("group_score", var("g")))),
                let_("ahead", Ty::I32, int(0)),
                for_(
                    "o",
                    int(0),
                    int(groups),
                    int(1),
                    vec![
                        let_("theirs", Ty::F32, key(load("group_score", var("o")))),
                        if_(
                            ranks_before(var("theirs"), var("o"), var("mine"), var("g")),
                            vec![assign("ahead", var("ahead") + int(1))],
                        ),
                    ],
                ),
                store(
                    "group_chosen",
                    var("g"),
                    select(bin(BinOp::Lt, var("ahead"), int(top_groups)), int(1), int(0)),
                ),
            ],
        ),
        Stmt::SyncThreads,
    ]
}

/// The chosen experts' weights (normalised by their sum where the spec says, then scaled: by
/// the router's constant, or by each expert's own scale), the pairs sorted by expert (a bubble
/// sort over the named registers: `k` is small), written by lane 0.
fn weigh_and_sort(spec: &MoeSpec) -> Vec<Stmt> {
    let k = spec.experts_per_token;
    let (c, w) = (|p: usize| format!("c{p}"), |p: usize| format!("w{p}"));
    let scaling = |p: usize| match spec.router {
        MoeRouter::Softmax => f(1.0),
        MoeRouter::GroupedSigmoid { scaling, .. } => f(scaling),
        MoeRouter::SoftmaxExpertScale => load("expert_scale", var(&c(p))),
    };
    let mut out = vec![let_("total", Ty::F32, f(0.0))];
    for p in 0..k {
        out.push(assign("total", var("total") + var(&w(p))));
    }
    for p in 0..k {
        let weight = match spec.normalize {
            true => var(&w(p)) / (var("total") + f(1e-20)),
            false => var(&w(p)),
        };
        out.push(assign(&w(p), weight * scaling(p)));
    }
    out.extend([let_("swap_c", Ty::I32, int(0)), let_("swap_w", Ty::F32, f(0.0))]);
    for pass in 0..k {
        for p in 0..k.saturating_sub(pass + 1) {
            out.push(if_(
                bin(BinOp::Gt, var(&c(p)), var(&c(p + 1))),
                vec![
                    assign("swap_c", var(&c(p))),
                    assign(&c(p), var(&c(p + 1))),
                    assign(&c(p + 1), var("swap_c")),
                    assign("swap_w", var(&w(p))),
                    assign(&w(p), var(&w(p + 1))),
                    assign(&w(p + 1), var("swap_w")),
                ],
            ));
        }
    }
    let writes = (0..k)
        .flat_map(|p| {
            let at = var("row") * int(k as i64) + int(p as i64);
            [
                store("routes", at.clone(), var(&c(p))),
                store("route_weights", at, var(&w(p))),
            ]
        })
        .collect();
    out.push(if_(eq(lane(), int(0)), writes));
    out
}

pub(super) fn describe(spec: &MoeSpec) -> String {
    let router = match spec.router {
        MoeRouter::Softmax => "softmax router".to_string(),
        MoeRouter::SoftmaxExpertScale => "softmax router with experts' scales".to_string(),
        MoeRouter::GroupedSigmoid {
            groups,
            top_groups,
            scaling,
        } => format!("grouped sigmoid router ({top_groups} of {groups} groups, ×{scaling})"),
    };
    format!(
        "{} of {} experts of {} hidden units, {router}",
        spec.experts_per_token, spec.experts, spec.intermediate
    )
}

/// One warp's hidden unit `unit` of pair `pair` (row `t`, expert `e`): the dots of row `t` of
/// `x` with the unit's gate row `e·2I + unit` and up row `e·2I + I + unit`, and `act(gate)·up`
/// into `hidden`. The same arithmetic whichever kernel (row-major or expert-major) runs it.
fn gate_up_unit(spec: &MoeSpec, hidden: usize, weights: WeightFormat) -> Vec<Stmt> {
    let i = spec.intermediate as i64;
    let rows = [
        (var("e") * int(2 * i) + var("unit"), "gate"),
        (var("e") * int(2 * i) + int(i) + var("unit"), "up"),
    ];
    let mut unit = vec![
        let_("gate", Ty::F32, f(0.0)),
        let_("up", Ty::F32, f(0.0)),
        warp_dot_rows(weights, hidden, &rows, &|c| load("x", var("t") * var("x_stride") + c)),
    ];
    unit.extend(warp_sum("gate"));
    unit.extend(warp_sum("up"));
    unit.push(if_(
        eq(lane(), int(0)),
        vec![store(
            "hidden",
            var("pair") * int(i) + var("unit"),
            gated(spec.act, var("gate"), var("up")),
        )],
    ));
    // Uniform across the warp: every lane shuffles or none.
    vec![if_(lt(var("unit"), int(i)), unit)]
}

/// The parameters both gate/up kernels take, in the launch's order.
pub(super) fn gate_up_params(weights: WeightFormat) -> Vec<Param> {
    vec![
        buffer("x", Ty::F32, false),
        buffer("routes", Ty::I32, false),
        buffer("w", weights.buffer_ty(), false),
        buffer("hidden", Ty::F32, true),
        scalar("tokens", Ty::I32),
        scalar("x_stride", Ty::I32),
    ]
}

/// `hidden[(t·k + p)·I + i] = act(gate)·up` for expert `routes[t·k + p]`'s hidden unit `i` (see
/// [`gate_up_unit`]), over row `t` of `x` (`x_stride` apart, `hidden` wide), row by row: a warp
/// per (row, chosen expert, unit). What decode runs: each chosen expert's weights streamed
/// once. Grid: `tokens · k · ⌈I / 8⌉` blocks of 8 warps.
pub fn gate_up(name: &str, origin: &str, spec: &MoeSpec, hidden: usize, weights: WeightFormat) -> Kernel {
    let (k, i) = (spec.experts_per_token as i64, spec.intermediate as i64);
    let tiles = (i + WARPS - 1) / WARPS;
    let mut body = vec![
        let_("pair", Ty::I32, bid() / int(tiles)),
        let_("t", Ty::I32, var("pair") / int(k)),
        let_("unit", Ty::I32, rem(bid(), int(tiles)) * int(WARPS) + warp()),
        let_("e", Ty::I32, load("routes", var("pair"))),
    ];
    body.extend(gate_up_unit(spec, hidden, weights));
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: MoE experts' gate/up and {:?} over rows of {hidden}, row by row, {} weights {} a load, {}",
            spec.act,
            weights.describe(),
            weight_vector(weights, hidden),
            describe(spec)
        ),
        params: gate_up_params(weights),
        shared: vec![],
        block_dim: BLOCK,
        grid: var("tokens") * int(k * tiles),
        body,
    }
}

/// Outputs (hidden units, or output columns) a block of the expert-by-expert kernels takes: 8
/// a warp.
const OUTPUTS_PER_EXPERT_BLOCK: i64 = 8 * WARPS;

/// The body of an expert-by-expert kernel over `outputs` outputs an expert (a block per expert
/// `e` and [`OUTPUTS_PER_EXPERT_BLOCK`] of them, `tile`): the routes are scanned a block-wide
/// chunk at a time, the pairs that chose `e` compacted in order by a prefix sum, and for each
/// (`pair`, its row `t`) every warp runs `per_output` for its outputs (`output`). Its grid is
/// [`expert_grid`].
fn for_each_pair_of_expert(spec: &MoeSpec, outputs: i64, per_output: Vec<Stmt>) -> Vec<Stmt> {
    let (k, tiles) = (spec.experts_per_token as i64, expert_tiles(outputs));
    let mut per_out = vec![let_(
        "output",
        Ty::I32,
        var("tile") * int(OUTPUTS_PER_EXPERT_BLOCK) + var("u") * int(WARPS) + warp(),
    )];
    per_out.extend(per_output);
    let per_pair = vec![
        let_("pair", Ty::I32, load("found", var("f"))),
        let_("t", Ty::I32, var("pair") / int(k)),
        for_("u", int(0), int(OUTPUTS_PER_EXPERT_BLOCK / WARPS), int(1), per_out),
    ];
    let mut chunk = chunk_hits();
    chunk.extend([
        if_(
            eq(var("hit"), int(1)),
            vec![store("found", load("scan", tid()) - int(1), var("at"))],
        ),
        Stmt::SyncThreads,
        let_("count", Ty::I32, load("scan", int(BLOCK as i64 - 1))),
        for_("f", int(0), var("count"), int(1), per_pair),
        // Everyone is done with this chunk's list before the next overwrites it.
        Stmt::SyncThreads,
    ]);
    vec![
        let_("e", Ty::I32, bid() / int(tiles)),
        let_("tile", Ty::I32, rem(bid(), int(tiles))),
        let_("pairs", Ty::I32, var("tokens") * int(k)),
        for_("chunk", int(0), var("pairs"), int(BLOCK as i64), chunk),
    ]
}

fn expert_tiles(outputs: i64) -> i64 {
    (outputs + OUTPUTS_PER_EXPERT_BLOCK - 1) / OUTPUTS_PER_EXPERT_BLOCK
}

/// An expert-by-expert kernel's blocks: every expert's tiles.
fn expert_grid(spec: &MoeSpec, outputs: i64) -> Expr {
    int(spec.experts as i64 * expert_tiles(outputs))
}

/// The shared arrays of an expert-by-expert kernel: the prefix sum and the pairs found.
fn expert_shared() -> Vec<SharedArray> {
    ["scan", "found"]
        .map(|name| SharedArray {
            name: name.into(),
            ty: Ty::I32,
            len: BLOCK as usize,
        })
        .to_vec()
}

/// [`gate_up`]'s values, expert by expert (see [`for_each_pair_of_expert`]): each expert's
/// gate/up weights are read from memory once a step and from cache for its other rows, where
/// the row-by-row kernel reads them once per row that chose it. What prefill runs (the same
/// arguments; the same arithmetic per unit, so the same values).
pub fn gate_up_by_expert(name: &str, origin: &str, spec: &MoeSpec, hidden: usize, weights: WeightFormat) -> Kernel {
    let i = spec.intermediate as i64;
    let mut per_unit = vec![let_("unit", Ty::I32, var("output"))];
    per_unit.extend(gate_up_unit(spec, hidden, weights));
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: MoE experts' gate/up and {:?} over rows of {hidden}, expert by expert, {} weights {} a load, {}",
            spec.act,
            weights.describe(),
            weight_vector(weights, hidden),
            describe(spec)
        ),
        params: gate_up_params(weights),
        shared: expert_shared(),
        block_dim: BLOCK,
        grid: expert_grid(spec, i),
        body: for_each_pair_of_expert(spec, i, per_unit),
    }
}

/// Whether the route at `chunk + tid` (`at`, counted below `pairs`) chose expert `e` (`hit`, 0
/// or 1), and `scan[tid]` the hits of threads `0..=tid` ([`block_prefix_sum`]): where each
/// hit goes when a chunk's are compacted in order.
pub(super) fn chunk_hits() -> Vec<Stmt> {
    let mut out = vec![
        let_("at", Ty::I32, var("chunk") + tid()),
        let_("hit", Ty::I32, int(0)),
        if_(
            lt(var("at"), var("pairs")),
            vec![if_(
                eq(load("routes", var("at")), var("e")),
                vec![assign("hit", int(1))],
            )],
        ),
    ];
    out.extend(block_prefix_sum("hit", "scan"));
    out
}

/// `scan[tid]` = the sum of `value` (an i32 local) over threads `0..=tid` (Hillis and Steele's
/// doubling, a barrier around each step), every thread's written before the last barrier.
pub(super) fn block_prefix_sum(value: &str, scan: &str) -> Vec<Stmt> {
    let mut out = vec![store(scan, tid(), var(value))];
    let mut offset = 1;
    while offset < BLOCK as i64 {
        let from = format!("from{offset}");
        out.extend([
            Stmt::SyncThreads,
            let_(&from, Ty::I32, int(0)),
            if_(
                bin(BinOp::Ge, tid(), int(offset)),
                vec![assign(&from, load(scan, tid() - int(offset)))],
            ),
            Stmt::SyncThreads,
            store(scan, tid(), load(scan, tid()) + var(&from)),
        ]);
        offset *= 2;
    }
    out.push(Stmt::SyncThreads);
    out
}

/// `y`, in every lane: the dot of pair `pair`'s hidden units with down row `e·d + n` of expert
/// `e`. The same arithmetic whichever kernel runs it.
fn down_dot(spec: &MoeSpec, hidden: usize, weights: WeightFormat, pair: Expr) -> Vec<Stmt> {
    let (i, d) = (spec.intermediate, hidden as i64);
    let at = pair * int(i as i64);
    let mut out = vec![
        let_("y", Ty::F32, f(0.0)),
        warp_dot_rows(weights, i, &[(var("e") * int(d) + var("n"), "y")], &|c| {
            load("hidden", at.clone() + c)
        }),
    ];
    out.extend(warp_sum("y"));
    out
}

/// The parameters both down kernels take, in the launch's order (the expert-by-expert one
/// takes `ys` after them).
pub(super) fn down_params(weights: WeightFormat) -> Vec<Param> {
    vec![
        buffer("hidden", Ty::F32, false),
        buffer("routes", Ty::I32, false),
        buffer("route_weights", Ty::F32, false),
        buffer("w", weights.buffer_ty(), false),
        buffer("out", Ty::F32, true),
        scalar("tokens", Ty::I32),
    ]
}

/// `out[t, n] = Σ_p route_weights[t·k + p] · (down row e·d + n of expert e = routes[t·k + p]) ·
/// hidden[t·k + p]`, over p in order (experts ascending), `d` = `hidden` wide: a warp per (row,
/// output column). What decode runs. Grid: `tokens · ⌈d / 8⌉` blocks of 8 warps.
pub fn down(name: &str, origin: &str, spec: &MoeSpec, hidden: usize, weights: WeightFormat) -> Kernel {
    let (k, d) = (spec.experts_per_token as i64, hidden as i64);
    let tiles = (d + WARPS - 1) / WARPS;
    let choice = var("t") * int(k) + var("p");
    let mut per_choice = vec![let_("e", Ty::I32, load("routes", choice.clone()))];
    per_choice.extend(down_dot(spec, hidden, weights, choice.clone()));
    per_choice.push(assign("acc", var("acc") + var("y") * load("route_weights", choice)));
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: MoE experts' down projections to rows of {hidden}, weighted, row by row, {} weights {} a load, {}",
            weights.describe(),
            weight_vector(weights, spec.intermediate),
            describe(spec)
        ),
        params: down_params(weights),
        shared: vec![],
        block_dim: BLOCK,
        grid: var("tokens") * int(tiles),
        body: vec![
            let_("t", Ty::I32, bid() / int(tiles)),
            let_("n", Ty::I32, rem(bid(), int(tiles)) * int(WARPS) + warp()),
            if_(
                lt(var("n"), int(d)),
                vec![
                    let_("acc", Ty::F32, f(0.0)),
                    for_("p", int(0), int(k), int(1), per_choice),
                    if_(
                        eq(lane(), int(0)),
                        vec![store("out", var("t") * int(d) + var("n"), var("acc"))],
                    ),
                ],
            ),
        ],
    }
}

/// Each pair's down projection unweighted, `ys[pair·d + n]`, expert by expert (see
/// [`for_each_pair_of_expert`]): each expert's down weights read once a step. What prefill
/// runs, [`combine`] after it; `out` is not written (the parameters are [`down`]'s, then `ys`).
pub fn down_by_expert(name: &str, origin: &str, spec: &MoeSpec, hidden: usize, weights: WeightFormat) -> Kernel {
    let d = hidden as i64;
    let mut per_column = vec![let_("n", Ty::I32, var("output"))];
    let mut column = down_dot(spec, hidden, weights, var("pair"));
    column.push(if_(
        eq(lane(), int(0)),
        vec![store("ys", var("pair") * int(d) + var("n"), var("y"))],
    ));
    // Uniform across the warp: every lane shuffles or none.
    per_column.push(if_(lt(var("n"), int(d)), column));
    let mut params = down_params(weights);
    params.push(buffer("ys", Ty::F32, true));
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: MoE experts' down projections to rows of {hidden}, expert by expert, {} weights {} a load, {}",
            weights.describe(),
            weight_vector(weights, spec.intermediate),
            describe(spec)
        ),
        params,
        shared: expert_shared(),
        block_dim: BLOCK,
        grid: expert_grid(spec, d),
        body: for_each_pair_of_expert(spec, d, per_column),
    }
}

/// `out[t, n] = Σ_p route_weights[t·k + p] · ys[(t·k + p)·d + n]` over p in order: [`down`]'s
/// sum of [`down_by_expert`]'s products, a thread per element; none where `active` is 0 (its
/// grid is then empty: steps that ran [`down`]).
pub fn combine(name: &str, origin: &str, spec: &MoeSpec, hidden: usize) -> Kernel {
    let (k, d) = (spec.experts_per_token as i64, hidden as i64);
    let choice = var("t") * int(k) + var("p");
    Kernel {
        name: name.into(),
        origin: format!("{origin}: MoE experts' outputs summed, weighted, {}", describe(spec)),
        params: vec![
            buffer("ys", Ty::F32, false),
            buffer("route_weights", Ty::F32, false),
            buffer("out", Ty::F32, true),
            scalar("tokens", Ty::I32),
            scalar("active", Ty::I32),
        ],
        shared: vec![],
        block_dim: BLOCK,
        grid: super::blocks_for(var("tokens") * int(d), BLOCK as i64) * var("active"),
        body: super::per_element(
            var("tokens") * int(d),
            vec![
                let_("t", Ty::I32, var("i") / int(d)),
                let_("n", Ty::I32, rem(var("i"), int(d))),
                let_("acc", Ty::F32, f(0.0)),
                for_(
                    "p",
                    int(0),
                    int(k),
                    int(1),
                    vec![assign(
                        "acc",
                        var("acc") + load("ys", choice.clone() * int(d) + var("n")) * load("route_weights", choice),
                    )],
                ),
                store("out", var("i"), var("acc")),
            ],
        ),
    }
}
