//! `out[t, r] = Σ_k x[t, k]·W[r, k]` with f32 or bf16 weights (`x` rows `x_stride` apart, so a
//! column slice of a fused output is read in place): one warp per output element,
//! lanes striding the row (coalesced 128-byte reads), a butterfly shuffle sum. Decode reads
//! each weight once, which is all a memory-bound GEMV can do; tensor-core tiles for prefill
//! and quantized weight formats are separate templates (not built yet).

use super::quant::WeightFormat;
use super::{blocks_for, warp_sum, BLOCK};
use crate::dsl::*;

pub fn gemv(name: &str, origin: &str, weight: Ty) -> Kernel {
    gemv_weights(name, origin, WeightFormat::Dense(weight))
}

/// The GEMV for any weight storage (dense, or GGUF blocks dequantized per element).
pub fn gemv_weights(name: &str, origin: &str, weight: WeightFormat) -> Kernel {
    let warps = (BLOCK / 32) as i64;
    Kernel {
        name: name.into(),
        origin: format!("{origin}: matmul x·Wᵀ, {} weights", weight.describe()),
        params: vec![
            buffer("x", Ty::F32, false),
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
            // Whole warps leave together, so the shuffles below always see 32 lanes.
            if_(
                bin(BinOp::Lt, var("item"), var("tokens") * var("n")),
                [
                    vec![
                        let_("t", Ty::I32, var("item") / var("n")),
                        let_("r", Ty::I32, bin(BinOp::Rem, var("item"), var("n"))),
                        let_("acc", Ty::F32, f(0.0)),
                        for_(
                            "i",
                            lane(),
                            var("k"),
                            int(32),
                            [
                                weight.element("wi", var("r"), var("k"), var("i")),
                                vec![assign(
                                    "acc",
                                    var("acc") + load("x", var("t") * var("x_stride") + var("i")) * var("wi"),
                                )],
                            ]
                            .concat(),
                        ),
                    ],
                    warp_sum("acc"),
                    vec![if_(
                        bin(BinOp::Eq, lane(), int(0)),
                        vec![store("out", var("t") * var("n") + var("r"), var("acc"))],
                    )],
                ]
                .concat(),
            ),
        ],
    }
}
