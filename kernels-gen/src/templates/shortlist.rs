//! A drafter's 4-bit shortlisting head on the GPU (the IR's `shortlist_top_k`, one token a
//! row), after a GEMV scores every vocabulary row with a Q4_0 copy of the head and `top_k`
//! keeps the best `c` of each row as candidates:
//!
//! 1. `shortlist_rescore`: a warp per candidate: its logit from the full head (the same
//!    warp-strided dot and butterfly as the GEMV, so bit for bit the plain head's logit).
//! 2. `shortlist_best`: a thread per row: the candidate of the highest logit, ties to the
//!    lowest id (the reference's order: by exact score, then by id).
//!
//! The token is the head's exact argmax wherever that is among the candidates; a drafter's
//! guesses are verified by its target, so a miss costs a refused draft, never a token.

use super::quant::WeightFormat;
use super::{blocks_for, warp_row_dot, BLOCK};
use crate::dsl::*;

/// (1): `out[t] = h[t / c] · w[candidates[t]]` for the `items` (rows × `c`) candidates, `h`'s
/// rows `h_stride` apart, the head's rows `k` wide.
pub fn rescore(name: &str, origin: &str, weight: WeightFormat) -> Kernel {
    let warps = (BLOCK / 32) as i64;
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: shortlist, rescore candidates with the full head ({})",
            weight.describe()
        ),
        params: vec![
            buffer("h", Ty::F32, false),
            buffer("w", weight.buffer_ty(), false),
            buffer("candidates", Ty::I32, false),
            buffer("out", Ty::F32, true),
            scalar("items", Ty::I32),
            scalar("c", Ty::I32),
            scalar("k", Ty::I32),
            scalar("h_stride", Ty::I32),
        ],
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(var("items"), warps),
        body: vec![
            let_("t", Ty::I32, bid() * int(warps) + warp()),
            // Whole warps leave together, so the shuffles below always see 32 lanes.
            if_(
                lt(var("t"), var("items")),
                [
                    vec![
                        let_("r", Ty::I32, load("candidates", var("t"))),
                        let_("x", Ty::I32, var("t") / var("c") * var("h_stride")),
                    ],
                    warp_row_dot(weight, var("r"), Some(var("x"))),
                    vec![if_(
                        bin(BinOp::Eq, lane(), int(0)),
                        vec![store("out", var("t"), var("acc"))],
                    )],
                ]
                .concat(),
            ),
        ],
    }
}

/// (2): `out[r]` = the candidate of row `r` (of `rows`, `c` each) with the highest score, ties
/// to the lowest id.
pub fn best(name: &str, origin: &str) -> Kernel {
    Kernel {
        name: name.into(),
        origin: format!("{origin}: shortlist, the best candidate of each row"),
        params: vec![
            buffer("scores", Ty::F32, false),
            buffer("candidates", Ty::I32, false),
            buffer("out", Ty::I32, true),
            scalar("rows", Ty::I32),
            scalar("c", Ty::I32),
        ],
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(var("rows"), BLOCK as i64),
        body: vec![
            let_("r", Ty::I32, bid() * int(BLOCK as i64) + tid()),
            if_(
                lt(var("r"), var("rows")),
                vec![
                    let_("first", Ty::I32, var("r") * var("c")),
                    let_("best", Ty::F32, load("scores", var("first"))),
                    let_("best_id", Ty::I32, load("candidates", var("first"))),
                    for_(
                        "j",
                        int(1),
                        var("c"),
                        int(1),
                        vec![
                            let_("s", Ty::F32, load("scores", var("first") + var("j"))),
                            let_("id", Ty::I32, load("candidates", var("first") + var("j"))),
                            if_(
                                bin(
                                    BinOp::Or,
                                    bin(BinOp::Gt, var("s"), var("best")),
                                    bin(
                                        BinOp::And,
                                        bin(BinOp::Eq, var("s"), var("best")),
                                        lt(var("id"), var("best_id")),
                                    ),
                                ),
                                vec![assign("best", var("s")), assign("best_id", var("id"))],
                            ),
                        ],
                    ),
                    store("out", var("r"), var("best_id")),
                ],
            ),
        ],
    }
}
