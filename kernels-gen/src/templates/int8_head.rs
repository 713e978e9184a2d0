//! The INT8-bound LM head on the GPU (the same bound as the runtime's CPU head; the rows come
//! from `quant::int8_rows::Int8Rows`, quantized at compile time):
//!
//! 1. `int8_quantize_h`: the hidden state in blocks of 32 → int8 `q_h`, per block the scale,
//!    `‖e_h‖` and `‖h_b‖` (one block of threads, one warp per quantization block).
//! 2. `int8_score`: a warp per vocabulary row: `A_v = Σ_b s_vb·s_hb·Σ q q` (the integer sums
//!    are exact in f32: |Σ| ≤ 32·127² < 2²⁴) and the bound `B_v` (quantization terms, the
//!    full head's own f32 rounding `γ_d·‖h‖·‖w_v‖`, this kernel's f32 rounding of `A_v`, all
//!    inflated by a margin for the f32 sums of positive terms); writes `A_v − B_v`, `A_v + B_v`.
//! 3. `max_reduce` twice: τ = the largest lower bound.
//! 4. `int8_rescore`: a warp per row: rows whose upper bound reaches τ get the full head's
//!    exact value (the same warp-strided dot and butterfly as the GEMV, so bit for bit the
//!    plain head's logit); the rest −∞. `argmax` of that row is the exact argmax, ties to the
//!    lowest id. Over soft-capped logits both sides of the test are capped, and so is the
//!    logit written (as the runtime's CPU head does it, there argued exact).

use super::quant::WeightFormat;
use super::{blocks_for, warp_row_dot, warp_sum, BLOCK};
use crate::dsl::*;

const BLOCK_ELEMS: i64 = 32;
/// Unit roundoff of f32.
const U: f32 = f32::EPSILON / 2.0;

/// (1): `h` [d] → `qh` [d] (i8), and per block `hs` (scale), `he` (‖h_b − ĥ_b‖), `hn` (‖h_b‖).
pub fn quantize_h(name: &str, origin: &str) -> Kernel {
    let warps = (BLOCK / 32) as i64;
    let i = || var("b") * int(BLOCK_ELEMS) + lane();
    let inside = || lt(i(), var("d"));
    let h = || select(inside(), load("h", bin(BinOp::Min, i(), var("d") - int(1))), f(0.0));
    let amax_steps: Vec<Stmt> = [16u32, 8, 4, 2, 1]
        .iter()
        .map(|&m| assign("amax", bin(BinOp::Max, var("amax"), shfl_xor(var("amax"), m))))
        .collect();
    let body_per_block = [
        vec![let_("x", Ty::F32, h()), let_("amax", Ty::F32, un(UnOp::Abs, var("x")))],
        amax_steps,
        vec![
            let_(
                "scale",
                Ty::F32,
                select(lt(f(0.0), var("amax")), var("amax") / f(127.0), f(1.0)),
            ),
            let_(
                "q",
                Ty::F32,
                bin(
                    BinOp::Min,
                    f(127.0),
                    bin(BinOp::Max, f(-127.0), round(var("x") / var("scale"))),
                ),
            ),
            let_("err", Ty::F32, var("x") - var("scale") * var("q")),
            let_("e2", Ty::F32, var("err") * var("err")),
            let_("x2", Ty::F32, var("x") * var("x")),
        ],
        warp_sum("e2"),
        warp_sum("x2"),
        vec![
            if_(inside(), vec![store("qh", i(), cast(Ty::I32, var("q")))]),
            if_(
                bin(BinOp::Eq, lane(), int(0)),
                vec![
                    store("hs", var("b"), var("scale")),
                    // Rounded up: norms bound errors. Each `x − scale·q` above is off by at most
                    // u·|x| from the exact error, hence the 2u·‖h_b‖ added.
                    store(
                        "he",
                        var("b"),
                        un(UnOp::Sqrt, var("e2")) * f(1.0 + 64.0 * U)
                            + f(2.0 * U) * un(UnOp::Sqrt, var("x2")) * f(1.0 + 64.0 * U),
                    ),
                    store("hn", var("b"), un(UnOp::Sqrt, var("x2")) * f(1.0 + 64.0 * U)),
                ],
            ),
        ],
    ]
    .concat();
    Kernel {
        name: name.into(),
        origin: format!("{origin}: int8 head, quantize h"),
        params: vec![
            buffer("h", Ty::F32, false),
            buffer("qh", Ty::I8, true),
            buffer("hs", Ty::F32, true),
            buffer("he", Ty::F32, true),
            buffer("hn", Ty::F32, true),
            scalar("d", Ty::I32),
        ],
        shared: vec![],
        block_dim: BLOCK,
        grid: int(1),
        body: vec![for_(
            "b",
            warp(),
            (var("d") + int(BLOCK_ELEMS - 1)) / int(BLOCK_ELEMS),
            int(warps),
            body_per_block,
        )],
    }
}

/// Round half away from zero, as the host's `f32::round`.
fn round(x: Expr) -> Expr {
    let half = select(lt(x.clone(), f(0.0)), f(-0.5), f(0.5));
    cast(Ty::F32, cast(Ty::I32, x + half))
}

/// (2): per row `v`: `lower[v] = A_v − B_v`, `upper[v] = A_v + B_v`.
pub fn score(name: &str, origin: &str) -> Kernel {
    let warps = (BLOCK / 32) as i64;
    let blocks = || (var("d") + int(BLOCK_ELEMS - 1)) / int(BLOCK_ELEMS);
    let col = || var("b") * int(BLOCK_ELEMS) + lane();
    let qq = select(
        lt(col(), var("d")),
        cast(
            Ty::F32,
            load("q", var("v") * var("d") + bin(BinOp::Min, col(), var("d") - int(1)))
                * load("qh", bin(BinOp::Min, col(), var("d") - int(1))),
        ),
        f(0.0),
    );
    let per_block = [
        vec![let_("isum", Ty::F32, qq)],
        warp_sum("isum"),
        vec![
            let_("i", Ty::I32, var("v") * blocks() + var("b")),
            let_(
                "term",
                Ty::F32,
                load("scale", var("i")) * load("hs", var("b")) * var("isum"),
            ),
            assign("a", var("a") + var("term")),
            assign("magnitude", var("magnitude") + un(UnOp::Abs, var("term"))),
            assign(
                "quant_err",
                var("quant_err")
                    + load("hn", var("b")) * load("err_norm", var("i"))
                    + load("he", var("b")) * load("quant_norm", var("i")),
            ),
            assign("h_norm2", var("h_norm2") + load("hn", var("b")) * load("hn", var("b"))),
        ],
    ]
    .concat();
    // γ_n = n·u/(1 − n·u) for the full head's dot (n = d) and for these sums (n = blocks + 3).
    let gamma = |n: Expr| cast(Ty::F32, n.clone()) * f(U) / (f(1.0) - cast(Ty::F32, n) * f(U));
    Kernel {
        name: name.into(),
        origin: format!("{origin}: int8 head, scores and bounds"),
        params: vec![
            buffer("q", Ty::I8, false),
            buffer("scale", Ty::F32, false),
            buffer("err_norm", Ty::F32, false),
            buffer("quant_norm", Ty::F32, false),
            buffer("norm", Ty::F32, false),
            buffer("qh", Ty::I8, false),
            buffer("hs", Ty::F32, false),
            buffer("he", Ty::F32, false),
            buffer("hn", Ty::F32, false),
            buffer("lower", Ty::F32, true),
            buffer("upper", Ty::F32, true),
            scalar("rows", Ty::I32),
            scalar("d", Ty::I32),
        ],
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(var("rows"), warps),
        body: vec![
            let_("v", Ty::I32, bid() * int(warps) + warp()),
            if_(
                lt(var("v"), var("rows")),
                vec![
                    let_("a", Ty::F32, f(0.0)),
                    let_("magnitude", Ty::F32, f(0.0)),
                    let_("quant_err", Ty::F32, f(0.0)),
                    let_("h_norm2", Ty::F32, f(0.0)),
                    for_("b", int(0), blocks(), int(1), per_block),
                    // Every sum above is of f32 terms: inflate by a margin covering their
                    // rounding (≤ n·u relative for positive terms), then add the rest.
                    let_(
                        "margin",
                        Ty::F32,
                        f(1.0) + f(4.0 * U) * cast(Ty::F32, blocks() + int(8)),
                    ),
                    let_(
                        "bound",
                        Ty::F32,
                        (var("quant_err")
                            + gamma(var("d")) * un(UnOp::Sqrt, var("h_norm2")) * load("norm", var("v"))
                            + gamma(blocks() + int(3)) * var("magnitude")
                            + f(U) * un(UnOp::Abs, var("a")))
                            * var("margin")
                            * var("margin"),
                    ),
                    if_(
                        bin(BinOp::Eq, lane(), int(0)),
                        vec![
                            store("lower", var("v"), var("a") - var("bound")),
                            store("upper", var("v"), var("a") + var("bound")),
                        ],
                    ),
                ],
            ),
        ],
    }
}

/// (3): `out[b] = max(x[b·BLOCK .. (b+1)·BLOCK])`: run on the lower bounds, then on the partial
/// maxima, for τ.
pub fn max_reduce(name: &str, origin: &str) -> Kernel {
    let mut body = vec![
        let_("i", Ty::I32, bid() * bdim() + tid()),
        let_("m", Ty::F32, f(f32::NEG_INFINITY)),
        if_(lt(var("i"), var("n")), vec![assign("m", load("x", var("i")))]),
    ];
    body.extend(
        [16u32, 8, 4, 2, 1]
            .iter()
            .map(|&m| assign("m", bin(BinOp::Max, var("m"), shfl_xor(var("m"), m)))),
    );
    body.push(if_(
        bin(BinOp::Eq, lane(), int(0)),
        vec![store("partial", warp(), var("m"))],
    ));
    body.push(Stmt::SyncThreads);
    body.push(for_(
        "w",
        int(0),
        int((BLOCK / 32) as i64),
        int(1),
        vec![assign("m", bin(BinOp::Max, var("m"), load("partial", var("w"))))],
    ));
    body.push(if_(bin(BinOp::Eq, tid(), int(0)), vec![store("out", bid(), var("m"))]));
    Kernel {
        name: name.into(),
        origin: format!("{origin}: block maxima"),
        params: vec![
            buffer("x", Ty::F32, false),
            buffer("out", Ty::F32, true),
            scalar("n", Ty::I32),
        ],
        shared: vec![super::warp_scratch("partial", BLOCK / 32)],
        block_dim: BLOCK,
        grid: blocks_for(var("n"), BLOCK as i64),
        body,
    }
}

/// (4): the full head's logit for rows whose upper bound reaches τ (`tau[0]`), −∞ elsewhere;
/// with `soft_cap`, capped, as are both sides of the test (`cap · tanh(x / cap)`, the fused
/// `soft_cap` expression's arithmetic).
pub fn rescore(name: &str, origin: &str, weight: WeightFormat, soft_cap: Option<f32>) -> Kernel {
    let warps = (BLOCK / 32) as i64;
    let capped = |x: Expr| match soft_cap {
        Some(cap) => f(cap) * un(UnOp::Tanh, x / f(cap)),
        None => x,
    };
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: int8 head, rescore candidates with the full head ({}{})",
            weight.describe(),
            soft_cap.map_or(String::new(), |cap| format!(", logits soft-capped at {cap}"))
        ),
        params: vec![
            buffer("h", Ty::F32, false),
            buffer("w", weight.buffer_ty(), false),
            buffer("upper", Ty::F32, false),
            buffer("tau", Ty::F32, false),
            buffer("out", Ty::F32, true),
            scalar("rows", Ty::I32),
            scalar("k", Ty::I32),
        ],
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(var("rows"), warps),
        body: vec![
            let_("r", Ty::I32, bid() * int(warps) + warp()),
            if_(
                lt(var("r"), var("rows")),
                vec![if_else(
                    bin(BinOp::Ge, capped(load("upper", var("r"))), capped(load("tau", int(0)))),
                    // Exactly the GEMV's arithmetic for this row.
                    [
                        warp_row_dot(weight, var("r"), None),
                        vec![if_(
                            bin(BinOp::Eq, lane(), int(0)),
                            vec![store("out", var("r"), capped(var("acc")))],
                        )],
                    ]
                    .concat(),
                    vec![if_(
                        bin(BinOp::Eq, lane(), int(0)),
                        vec![store("out", var("r"), f(f32::NEG_INFINITY))],
                    )],
                )],
            ),
        ],
    }
}
