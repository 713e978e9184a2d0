//! The row norms of a prologue GEMM (`rms_norm_matmul`, `add_rms_norm_matmul` over many rows),
//! summed from the activations its main loop loads anyway.
//!
//! `rms_norm(x)·Wᵀ` is `((x·g)·Wᵀ)/rms(x)`: the main loop multiplies `x·g` and the row's `1/rms`
//! scales the result. Each thread adds the square of every `x` (or `x + b`) it loads, before
//! the norm weight, to its row's sum. Why not a pass over the rows before the main loop: every
//! block of every weight tile and K split would read its tokens' whole rows again, 460 MB from
//! L2 for the gate/up of an 8B model at 16 rows, and wait for them before its first weight
//! step. (What the Hopper prologue GEMM's speed turns on is how its A loads are issued, see
//! `super::prologue_loads`.)
//!
//! Whose sum is whole: with one K split the block has seen whole rows and scales its tile
//! itself. With several, each split's blocks of the first weight tile write their rows'
//! partial sums after the partial products (`partial_sum_at`), and the reduction
//! (`split_k::reduce`) sums them in split order, as it sums the products, and scales.

use super::gemv::NormPrologue;
use crate::dsl::*;

/// Index in `partial` of split `split`'s sum of squares of token `token`: after the
/// `splits × tokens × n` partial products.
pub fn partial_sum_at(split: Expr, token: Expr) -> Expr {
    var("splits") * var("tokens") * var("n") + split * var("tokens") + token
}

/// f32 elements a prologue GEMM's partials take with their sums of squares, from the
/// `products` elements of its partial products over `n` columns: `splits × tokens × n` fit the
/// products, so `splits × tokens` sums fit in `products / n` more.
pub fn partial_len(products: usize, n: usize) -> usize {
    products + products.div_ceil(n)
}

/// `1/rms` of a row whose sum of squares over `k` is `sum`.
pub fn inv_rms(norm: NormPrologue, sum: Expr) -> Expr {
    un(UnOp::Rsqrt, sum / cast(Ty::F32, var("k")) + f(norm.eps))
}

/// Statements declaring `scale`, what a block multiplies token `token`'s products by, from
/// `sum`, this block's sum of squares of the row: `1/rms` with one K split (the block's sum is
/// the row's), else 1, the block of the first weight tile writing `sum` into the partials
/// where `writes` holds (one thread a row) for the reduction.
pub fn row_scale(norm: NormPrologue, sum: &str, token: Expr, writes: Expr, scale: &str) -> Vec<Stmt> {
    let written = and(and(writes, eq(var("n0"), int(0))), lt(token.clone(), var("tokens")));
    vec![
        let_(scale, Ty::F32, f(1.0)),
        if_else(
            eq(var("splits"), int(1)),
            vec![assign(scale, inv_rms(norm, var(sum)))],
            vec![if_(
                written,
                vec![store("partial", partial_sum_at(var("split"), token), var(sum))],
            )],
        ),
    ]
}

/// The shared array of the GEMMs that stage their activations through shared memory
/// (`gemm_mma`, `gemm_tcgen05`): element `e` of a staged 64×32 slice is token `e / 32`, column
/// `e % 32`, thread `e % 128`'s; `row_squares[e]` sums the squares of that thread's column of
/// that token over the main loop (one owner an element: no races); after
/// [`staged_row_scales`], `row_scales[token]` is what the token's products are multiplied by.
pub fn staged_arrays(elements: i64, tokens_per_tile: i64) -> [SharedArray; 2] {
    let array = |name: &str, len: i64| SharedArray {
        name: name.into(),
        ty: Ty::F32,
        len: len as usize,
    };
    [array("row_squares", elements), array("row_scales", tokens_per_tile)]
}

/// Zero this thread's elements of `row_squares` (`elements` of them in the slice, a block of
/// `threads`), before the main loop.
pub fn zero_staged_squares(elements: i64, threads: i64) -> Stmt {
    for_(
        "i",
        int(0),
        int(elements / threads),
        int(1),
        vec![store("row_squares", tid() + var("i") * int(threads), f(0.0))],
    )
}

/// Add `square` to element `e` of `row_squares`.
pub fn add_staged_square(e: Expr, square: Expr) -> Stmt {
    store("row_squares", e.clone(), load("row_squares", e) + square)
}

/// After the main loop: each warp sums its tokens' 32 columns (tokens `warp + warps·j` of the
/// `tokens_per_tile`, as staging gave them out), writes or applies them (`row_scale`), and
/// leaves each token's scale in `row_scales[token]` for the epilogue.
pub fn staged_row_scales(norm: NormPrologue, tokens_per_tile: i64, warps: i64) -> Vec<Stmt> {
    let token = warp() + var("j") * int(warps);
    let mut per_token = vec![let_(
        "sq",
        Ty::F32,
        load("row_squares", token.clone() * int(32) + lane()),
    )];
    per_token.extend(super::warp_sum("sq"));
    per_token.extend(row_scale(
        norm,
        "sq",
        var("m0") + token.clone(),
        eq(lane(), int(0)),
        "scale",
    ));
    per_token.push(if_(eq(lane(), int(0)), vec![store("row_scales", token, var("scale"))]));
    vec![
        // Every thread's sums are in.
        Stmt::SyncThreads,
        for_("j", int(0), int(tokens_per_tile / warps), int(1), per_token),
        // Read by every warp's epilogue.
        Stmt::SyncThreads,
    ]
}
