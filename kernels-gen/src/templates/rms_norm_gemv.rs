//! RMSNorm as a GEMV prologue: `out[t, r] = rsqrt(mean(x[t]²) + eps) · Σ_k x[t, k]·(g[k] + o)·W[r, k]`.
//! One warp per output element sums `x²` and the scaled dot in the same pass over the row (the
//! row stays in cache across the warps of a block), so the normalised row is never written:
//! what `fuse_norm_matmul` buys on a GPU.

use super::quant::WeightFormat;
use super::{blocks_for, warp_sum, BLOCK};
use crate::dsl::*;

pub fn rms_norm_gemv(name: &str, origin: &str, weight: WeightFormat, eps: f32, weight_offset: f32) -> Kernel {
    let warps = (BLOCK / 32) as i64;
    let x = load("x", var("t") * var("x_stride") + var("i"));
    Kernel {
        name: name.into(),
        origin: format!("{origin}: rms_norm prologue + matmul, {} weights", weight.describe()),
        params: vec![
            buffer("x", Ty::F32, false),
            buffer("g", Ty::F32, false),
            buffer("w", weight.buffer_ty(), false),
            buffer("out", Ty::F32, true),
            scalar("tokens", Ty::I32),
            scalar("n", Ty::I32),
            scalar("k", Ty::I32),
            scalar("x_stride", Ty::I32),
        ],
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(var("tokens") * var("n"), warps),
        body: vec![
            let_("item", Ty::I32, bid() * int(warps) + warp()),
            if_(
                bin(BinOp::Lt, var("item"), var("tokens") * var("n")),
                [
                    vec![
                        let_("t", Ty::I32, var("item") / var("n")),
                        let_("r", Ty::I32, bin(BinOp::Rem, var("item"), var("n"))),
                        let_("sq", Ty::F32, f(0.0)),
                        let_("acc", Ty::F32, f(0.0)),
                        for_(
                            "i",
                            lane(),
                            var("k"),
                            int(32),
                            [
                                vec![let_("xi", Ty::F32, x), assign("sq", var("sq") + var("xi") * var("xi"))],
                                weight.element("wi", var("r"), var("k"), var("i")),
                                vec![assign(
                                    "acc",
                                    var("acc") + var("xi") * (load("g", var("i")) + f(weight_offset)) * var("wi"),
                                )],
                            ]
                            .concat(),
                        ),
                    ],
                    super::warp_sum("sq"),
                    warp_sum("acc"),
                    vec![if_(
                        bin(BinOp::Eq, lane(), int(0)),
                        vec![store(
                            "out",
                            var("t") * var("n") + var("r"),
                            var("acc") * un(UnOp::Rsqrt, var("sq") / cast(Ty::F32, var("k")) + f(eps)),
                        )],
                    )],
                ]
                .concat(),
            ),
        ],
    }
}
