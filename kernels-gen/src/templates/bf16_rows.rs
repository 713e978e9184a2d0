//! A matmul's activation rows as the TMA GEMM reads them: bf16 (or halves, for a GEMM over
//! half weights: [`rows_of`]), rows `xb_stride` apart (a multiple of 8, as TMA wants 16-byte
//! row pitches), with the matmul's prologue applied first
//! (the RMSNorm, after the residual add whose sum it also writes to the first `k` columns of
//! `out`'s rows, as the fused GEMV does). One block a row; no blocks for steps under
//! `min_tokens` rows, which run the GEMV and its own prologue instead.

use super::gemv::{prologue_params, residual, NormPrologue};
use super::{block_sum, warp_scratch, BLOCK};
use crate::dsl::*;

const WARPS: u32 = BLOCK / 32;

/// `xb[t, c] = bf16(x'[t, c])` for the `tokens` rows and `k` columns, where `x'` is `x` (rows
/// `x_stride` apart) or, with `norm`, `rms_norm(x [+ b])·(g + offset)`; under a residual
/// prologue the sum also goes to `out[t, c]` (rows `out_stride` apart).
pub fn bf16_rows(name: &str, origin: &str, norm: Option<NormPrologue>, min_tokens: usize) -> Kernel {
    rows_of(MmaElement::Bf16, name, origin, norm, min_tokens)
}

/// [`bf16_rows`] making rows of `element`s: halves for a TMA GEMM over half weights
/// (`halves::over_halves`).
pub fn rows_of(element: MmaElement, name: &str, origin: &str, norm: Option<NormPrologue>, min_tokens: usize) -> Kernel {
    let mut params = prologue_params(norm);
    params.push(buffer("xb", element.ty(), true));
    if residual(norm) {
        params.push(buffer("out", Ty::F32, true));
    }
    params.extend([
        scalar("tokens", Ty::I32),
        scalar("k", Ty::I32),
        scalar("x_stride", Ty::I32),
        scalar("xb_stride", Ty::I32),
    ]);
    if residual(norm) {
        params.extend([scalar("b_stride", Ty::I32), scalar("out_stride", Ty::I32)]);
    }
    let t = || bid();
    let x = |i: Expr| load("x", t() * var("x_stride") + i);
    // The row's value at column i before the norm: x, or x + b.
    let value = |i: Expr| match residual(norm) {
        true => x(i.clone()) + load("b", t() * var("b_stride") + i),
        false => x(i),
    };
    let mut body = Vec::new();
    let scaled = match norm {
        Some(norm) => {
            body.push(let_("sum", Ty::F32, f(0.0)));
            body.push(for_(
                "i",
                tid(),
                var("k"),
                bdim(),
                vec![
                    let_("v", Ty::F32, value(var("i"))),
                    assign("sum", var("sum") + var("v") * var("v")),
                ],
            ));
            body.extend(block_sum("sum", "partial", WARPS));
            body.push(let_(
                "inv",
                Ty::F32,
                un(UnOp::Rsqrt, var("sum") / cast(Ty::F32, var("k")) + f(norm.eps)),
            ));
            var("v") * var("inv") * (load("g", var("i")) + f(norm.offset))
        }
        None => var("v"),
    };
    let mut each = vec![let_("v", Ty::F32, value(var("i")))];
    if residual(norm) {
        each.push(store("out", t() * var("out_stride") + var("i"), var("v")));
    }
    each.push(store("xb", t() * var("xb_stride") + var("i"), scaled));
    body.push(for_("i", tid(), var("k"), bdim(), each));
    let prologue = match norm {
        Some(n) if n.residual => "residual add + rms_norm",
        Some(_) => "rms_norm",
        None => "plain",
    };
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: a matmul's rows as {} for the TMA GEMM ({prologue})",
            element.ptx()
        ),
        params,
        shared: match norm {
            Some(_) => vec![warp_scratch("partial", WARPS)],
            None => vec![],
        },
        block_dim: BLOCK,
        // A block a row, none below `min_tokens` rows.
        grid: var("tokens") * bin(BinOp::Min, int(1), var("tokens") / int(min_tokens as i64)),
        body,
    }
}
