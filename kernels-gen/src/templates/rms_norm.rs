//! RMSNorm over groups of `group` elements (a whole row, or one head for q/k norms), and the
//! fused residual form `[a + b | rms_norm(a + b)]`; LayerNorm of rows (GLM-5's indexer keys). One block per group: threads stride the
//! group accumulating Σx², a block reduction, then every thread scales its elements. The
//! reduction is in f32 (the IR reference accumulates in f64; tests compare within f32 error).

use super::{block_sum, warp_scratch, BLOCK};
use crate::dsl::*;

const WARPS: u32 = BLOCK / 32;

/// `out = x·rsqrt(mean(x²) + eps)·(w + offset)` per group; grid = number of groups.
pub fn rms_norm(name: &str, origin: &str, eps: f32, weight_offset: f32) -> Kernel {
    rms_norm_with(name, origin, eps, Some(weight_offset))
}

/// `out = x·rsqrt(mean(x²) + eps)` per group, no weight (the IR's `unit_rms_norm`: Gemma 4's
/// value norm); grid = number of groups.
pub fn unit_rms_norm(name: &str, origin: &str, eps: f32) -> Kernel {
    rms_norm_with(name, origin, eps, None)
}

/// The norm, times `w + offset` where it has a weight.
fn rms_norm_with(name: &str, origin: &str, eps: f32, weight_offset: Option<f32>) -> Kernel {
    let x = |i: Expr| load("x", var("base") + i);
    let scaled = |i: Expr| match weight_offset {
        Some(offset) => x(i.clone()) * var("inv") * (load("w", i) + f(offset)),
        None => x(i) * var("inv"),
    };
    let mut params = vec![
        buffer("x", Ty::F32, false),
        buffer("w", Ty::F32, false),
        buffer("out", Ty::F32, true),
        scalar("groups", Ty::I32),
        scalar("group", Ty::I32),
        scalar("width", Ty::I32),
        scalar("x_stride", Ty::I32),
    ];
    if weight_offset.is_none() {
        params.remove(1);
    }
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: {}",
            if weight_offset.is_some() {
                "rms_norm"
            } else {
                "unit_rms_norm"
            }
        ),
        params,
        shared: vec![warp_scratch("partial", WARPS)],
        block_dim: BLOCK,
        grid: var("groups"),
        body: [
            vec![
                // Group g starts at element g·group of the (row-major, `width`-wide) output;
                // the input row may be a slice, `x_stride` apart.
                let_("start", Ty::I32, bid() * var("group")),
                let_(
                    "base",
                    Ty::I32,
                    var("start") / var("width") * var("x_stride") + bin(BinOp::Rem, var("start"), var("width")),
                ),
                let_("sum", Ty::F32, f(0.0)),
                for_(
                    "i",
                    tid(),
                    var("group"),
                    bdim(),
                    vec![assign("sum", var("sum") + x(var("i")) * x(var("i")))],
                ),
            ],
            block_sum("sum", "partial", WARPS),
            vec![
                let_(
                    "inv",
                    Ty::F32,
                    un(UnOp::Rsqrt, var("sum") / cast(Ty::F32, var("group")) + f(eps)),
                ),
                for_(
                    "i",
                    tid(),
                    var("group"),
                    bdim(),
                    vec![store("out", var("start") + var("i"), scaled(var("i")))],
                ),
            ],
        ]
        .concat(),
    }
}

/// `out[r] = [a + b | rms_norm(a + b)]` per row of `d`; grid = rows.
pub fn add_rms_norm(name: &str, origin: &str, eps: f32, weight_offset: f32) -> Kernel {
    let sum_at = |i: Expr| load("a", bid() * var("a_stride") + i.clone()) + load("b", bid() * var("b_stride") + i);
    Kernel {
        name: name.into(),
        origin: format!("{origin}: add_rms_norm"),
        params: vec![
            buffer("a", Ty::F32, false),
            buffer("b", Ty::F32, false),
            buffer("w", Ty::F32, false),
            buffer("out", Ty::F32, true),
            scalar("rows", Ty::I32),
            scalar("d", Ty::I32),
            scalar("a_stride", Ty::I32),
            scalar("b_stride", Ty::I32),
        ],
        shared: vec![warp_scratch("partial", WARPS)],
        block_dim: BLOCK,
        grid: var("rows"),
        body: [
            vec![
                let_("out_base", Ty::I32, bid() * var("d") * int(2)),
                let_("sum", Ty::F32, f(0.0)),
                for_(
                    "i",
                    tid(),
                    var("d"),
                    bdim(),
                    vec![
                        let_("s", Ty::F32, sum_at(var("i"))),
                        store("out", var("out_base") + var("i"), var("s")),
                        assign("sum", var("sum") + var("s") * var("s")),
                    ],
                ),
            ],
            block_sum("sum", "partial", WARPS),
            vec![
                let_(
                    "inv",
                    Ty::F32,
                    un(UnOp::Rsqrt, var("sum") / cast(Ty::F32, var("d")) + f(eps)),
                ),
                for_(
                    "i",
                    tid(),
                    var("d"),
                    bdim(),
                    vec![store(
                        "out",
                        var("out_base") + var("d") + var("i"),
                        sum_at(var("i")) * var("inv") * (load("w", var("i")) + f(weight_offset)),
                    )],
                ),
            ],
        ]
        .concat(),
    }
}

/// `out[r] = (x − mean)·rsqrt(var + eps)·w + bias` per row of `d` (rows of `x` `x_stride`
/// apart), the mean first, then the variance as the mean of squared deviations (the
/// reference's two passes); grid = rows.
pub fn layer_norm(name: &str, origin: &str, eps: f32) -> Kernel {
    let x = |i: Expr| load("x", bid() * var("x_stride") + i);
    let over_row = |body: Vec<Stmt>| for_("i", tid(), var("d"), bdim(), body);
    Kernel {
        name: name.into(),
        origin: format!("{origin}: layer_norm"),
        params: vec![
            buffer("x", Ty::F32, false),
            buffer("w", Ty::F32, false),
            buffer("bias", Ty::F32, false),
            buffer("out", Ty::F32, true),
            scalar("rows", Ty::I32),
            scalar("d", Ty::I32),
            scalar("x_stride", Ty::I32),
        ],
        shared: vec![warp_scratch("partial", WARPS)],
        block_dim: BLOCK,
        grid: var("rows"),
        body: [
            vec![
                let_("sum", Ty::F32, f(0.0)),
                over_row(vec![assign("sum", var("sum") + x(var("i")))]),
            ],
            block_sum("sum", "partial", WARPS),
            vec![
                let_("mean", Ty::F32, var("sum") / cast(Ty::F32, var("d"))),
                let_("dev", Ty::F32, f(0.0)),
                over_row(vec![
                    let_("centred", Ty::F32, x(var("i")) - var("mean")),
                    assign("dev", var("dev") + var("centred") * var("centred")),
                ]),
            ],
            block_sum("dev", "partial", WARPS),
            vec![
                let_(
                    "inv",
                    Ty::F32,
                    un(UnOp::Rsqrt, var("dev") / cast(Ty::F32, var("d")) + f(eps)),
                ),
                over_row(vec![store(
                    "out",
                    bid() * var("d") + var("i"),
                    (x(var("i")) - var("mean")) * var("inv") * load("w", var("i")) + load("bias", var("i")),
                )]),
            ],
        ]
        .concat(),
    }
}
