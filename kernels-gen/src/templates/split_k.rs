//! Split-K for the prefill GEMM at few rows. A batched decode step of 16 to 64 rows is one
//! 64-row tile per 128 weight rows: 48 blocks for an 8B model's QKV on a 132-SM H200, each
//! streaming its weights through a two-stage pipeline, so a fraction of the chip's loads are in
//! flight (the H200 run of 2026-11-30 measured 5–28% of copy bandwidth at batch 16). Cutting K
//! into `splits` spans multiplies the blocks; each writes its partial tile to scratch and a
//! second launch sums the partials in split order (deterministic, unlike atomics). With one
//! split the GEMM writes `out` itself and the reduction's grid is empty.

use super::gemv::NormPrologue;
use super::{blocks_for, per_element, prologue_norms, BLOCK};
use crate::dsl::*;
use ir::GluAct;

/// The most splits (the partials grow with them).
pub const MAX_SPLITS: usize = 8;

/// The most K splits a GEMM with `n` output columns and `k` inputs (tiles of
/// `tile_m`×`tile_n`, `tile_k` steps) takes, at one row tile: enough blocks for two per
/// multiprocessor, at most one split per K step and [`MAX_SPLITS`]. 1 where the weight tiles
/// alone fill the GPU (an LM head): no split, no partials, no reduction.
pub fn most_splits(n: usize, k: usize, tiles: (usize, usize, usize), multiprocessors: usize) -> usize {
    let (_, tile_n, tile_k) = tiles;
    MAX_SPLITS
        .min(k.div_ceil(tile_k))
        .min(2 * multiprocessors / n.div_ceil(tile_n))
        .max(1)
}

/// The `splits` scalar of a GEMM over `rows` rows (an expression of the plan's variables):
/// enough blocks for two per multiprocessor, and `splits × row tiles` at most
/// [`most_splits`], which bounds the partials (see [`partial_len`]).
pub fn splits_expr(rows: &str, n: usize, k: usize, tiles: (usize, usize, usize), multiprocessors: usize) -> String {
    let (tile_m, tile_n, _) = tiles;
    let most = most_splits(n, k, tiles, multiprocessors);
    let tiles_m = format!("((({rows}) + {}) / {tile_m})", tile_m - 1);
    format!(
        "max(1, min({most} / {tiles_m}, {} / ({tiles_m} * {})))",
        2 * multiprocessors,
        n.div_ceil(tile_n)
    )
}

/// f32 elements of the partials: `splits × rows` ≤ `splits × row tiles × tile_m` ≤
/// `most_splits × tile_m` rows of `n`; one element where the GEMM never splits.
pub fn partial_len(n: usize, k: usize, tiles: (usize, usize, usize), multiprocessors: usize) -> usize {
    match most_splits(n, k, tiles, multiprocessors) {
        1 => 1,
        most => most * tiles.0 * n,
    }
}

/// `out[e] = Σ_s partial[s·tokens·n + e]`, in split order, into columns `out_col..+n` of
/// `out`'s rows `out_stride` apart (`[sum | product]` rows under a residual prologue); no
/// blocks with one split, or for steps under `min_tokens` rows (those run the GEMV, which
/// writes `out` itself). With `glu`, the GEMM's columns are a joined gate/up, always in the
/// partials: `out[t, c] = act(Σ gate)·(Σ up)` for the `n/2` columns. With `norm` (a prologue
/// GEMM) and several splits, the sums are scaled by the token's `1/rms` first, from the
/// splits' sums of squares after the products (`prologue_norms`); one split scaled its own.
pub fn reduce(name: &str, origin: &str, min_tokens: usize, glu: Option<GluAct>, norm: Option<NormPrologue>) -> Kernel {
    reduction(name, origin, min_tokens, glu, norm, false)
}

/// [`reduce`] with the `act` GLU after a GEMM that gates its own products with one split
/// (Hopper's TMA GEMM): then nothing is in the partials, and it launches no blocks.
pub fn reduce_after_gating(name: &str, origin: &str, min_tokens: usize, act: GluAct) -> Kernel {
    reduction(name, origin, min_tokens, Some(act), None, true)
}

fn reduction(
    name: &str,
    origin: &str,
    min_tokens: usize,
    glu: Option<GluAct>,
    norm: Option<NormPrologue>,
    gated_by_one_split: bool,
) -> Kernel {
    let cols = super::gemv::product_cols(glu);
    let count = var("tokens") * cols.clone();
    let ran = bin(BinOp::Min, int(1), var("tokens") / int(min_tokens as i64));
    let runs = match glu.is_some() && !gated_by_one_split {
        true => ran,
        false => ran * bin(BinOp::Min, int(1), var("splits") - int(1)),
    };
    let summed = |name: &str, col: Expr| {
        for_(
            "s",
            int(0),
            var("splits"),
            int(1),
            vec![assign(
                name,
                var(name) + load("partial", (var("s") * var("tokens") + var("t")) * var("n") + col),
            )],
        )
    };
    let mut body = vec![
        let_("t", Ty::I32, var("i") / cols.clone()),
        let_("c", Ty::I32, rem(var("i"), cols.clone())),
        let_("sum", Ty::F32, f(0.0)),
        summed("sum", var("c")),
    ];
    let scaled = |name: &str| match norm {
        Some(_) => var(name) * var("scale"),
        None => var(name),
    };
    if let Some(norm) = norm {
        body.extend(row_scale(norm));
    }
    let value = match glu {
        Some(act) => {
            body.push(let_("up", Ty::F32, f(0.0)));
            body.push(summed("up", var("c") + cols));
            super::gemv::gated(act, scaled("sum"), scaled("up"))
        }
        None => scaled("sum"),
    };
    body.push(store(
        "out",
        var("t") * var("out_stride") + var("out_col") + var("c"),
        value,
    ));
    let mut epilogue = match norm {
        Some(_) => ", scaled by the rows' 1/rms".to_string(),
        None => String::new(),
    };
    if let Some(act) = glu {
        epilogue += &format!(", then the {act:?} GLU");
    }
    if gated_by_one_split {
        epilogue += " (no blocks with one split: the GEMM gated its own products)";
    }
    let mut params = vec![
        buffer("partial", Ty::F32, false),
        buffer("out", Ty::F32, true),
        scalar("tokens", Ty::I32),
        scalar("n", Ty::I32),
        scalar("splits", Ty::I32),
        scalar("out_stride", Ty::I32),
        scalar("out_col", Ty::I32),
    ];
    if norm.is_some() {
        params.push(scalar("k", Ty::I32));
    }
    Kernel {
        name: name.into(),
        origin: format!("{origin}: the split-K GEMM's partial tiles summed in split order{epilogue}"),
        params,
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(count.clone(), BLOCK as i64) * runs,
        body: per_element(count, body),
    }
}

/// `scale`, what token `t`'s sums are multiplied by: `1/rms` from the splits' sums of squares
/// (in split order) where there are several, else 1 (the one split scaled its products).
fn row_scale(norm: NormPrologue) -> Vec<Stmt> {
    let sums = for_(
        "s",
        int(0),
        var("splits"),
        int(1),
        vec![assign(
            "sq",
            var("sq") + load("partial", prologue_norms::partial_sum_at(var("s"), var("t"))),
        )],
    );
    vec![
        let_("scale", Ty::F32, f(1.0)),
        if_(
            bin(BinOp::Gt, var("splits"), int(1)),
            vec![
                let_("sq", Ty::F32, f(0.0)),
                sums,
                assign("scale", prologue_norms::inv_rms(norm, var("sq"))),
            ],
        ),
    ]
}

/// The GEMM's split-K parameters, after [`super::gemm_params`]'s.
pub fn params() -> Vec<Param> {
    vec![buffer("partial", Ty::F32, true), scalar("splits", Ty::I32)]
}

/// Statements declaring this block's K span (`k_begin..k_end`, whole `tile_k` steps; empty
/// past the end of K) for split `split`.
pub fn k_span(split: Expr, tile_k: i64) -> Vec<Stmt> {
    let steps = (var("k") + int(tile_k - 1)) / int(tile_k);
    vec![
        let_("k_steps", Ty::I32, (steps + var("splits") - int(1)) / var("splits")),
        let_("k_begin", Ty::I32, split * var("k_steps") * int(tile_k)),
        let_(
            "k_end",
            Ty::I32,
            bin(BinOp::Min, var("k"), var("k_begin") + var("k_steps") * int(tile_k)),
        ),
    ]
}

/// Store `value` at (`row`, `col`) of the result: `out[out_index]` with one split, else (or
/// always, with no `out_index`: an epilogue the reduction applies) this split's partial tile.
pub fn store_result(row: Expr, col: Expr, value: Expr, out_index: Option<Expr>) -> Stmt {
    let partial = store(
        "partial",
        (var("split") * var("tokens") + row) * var("n") + col,
        value.clone(),
    );
    match out_index {
        Some(at) => if_else(eq(var("splits"), int(1)), vec![store("out", at, value)], vec![partial]),
        None => partial,
    }
}
