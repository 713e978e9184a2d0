//! A stored weight converted to the plan's dtype on the device: `out[i] = value(w, i)` for the
//! `n` elements of a run of whole rows, `w` holding them as the checkpoint stores them (f16 or
//! bf16 values, or GGUF blocks, which are contiguous across rows because rows are whole blocks)
//! and `out` taking them as f32, bf16 or f16 (rounded to nearest even). A thread per element of
//! f16 and bf16 values; a thread per 32 elements of blocks (a block, or a K-quant
//! super-block's sub-block: its scales decoded once, the 32 stored in 16-byte runs).
//!
//! Loading a GGUF into a bf16 (or f16) plan uploads the stored bytes (a quarter of the bf16
//! bytes for 4-bit blocks) and decodes them here, instead of on the host's cores. The values are the
//! host's (`quant`'s dequantization, then the same rounding): every block format's value is
//! a product of a half scale and small integers, exact in f32, and at most one rounded
//! addition, so contracting it into an FMA changes nothing either.
//!
//! A plan that keeps a matrix in its blocks (or in IEEE half) converts it again for each step
//! of many rows ([`to_bf16_for_prefill`]): into a bf16 copy in scratch that the target's TMA
//! GEMM reads as it reads bf16 weights.

use super::quant::{block_layout, run_weights};
use super::{blocks_for, per_element, BLOCK};
use crate::dsl::*;
use ir::DType;

/// Whether weights stored as `from` are converted on the device.
pub fn converts(from: DType) -> bool {
    matches!(from, DType::F16 | DType::BF16) || block_layout(from).is_some()
}

/// The dtypes a converted weight is held in.
pub const CONVERTED_TO: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// The name of the kernel converting `from` to `to` (one of [`CONVERTED_TO`]).
pub fn convert_kernel_name(from: DType, to: DType) -> String {
    format!("convert_{}_to_{}", from.name(), to.name())
}

/// The kernel converting weights stored as `from` to `to`, where `from` is one the device
/// converts ([`converts`]) and `to` another, one of [`CONVERTED_TO`]. Parameters: `w` (the
/// stored bytes of the run, from its first row), `out`, `n` (elements).
pub fn convert_kernel(from: DType, to: DType) -> Option<Kernel> {
    let out = match to {
        _ if to == from => return None,
        DType::BF16 => Ty::Bf16,
        DType::F16 => Ty::F16,
        DType::F32 => Ty::F32,
        _ => return None,
    };
    let (source, grid, body) = match from {
        DType::F16 | DType::BF16 => {
            let ty = if from == DType::F16 { Ty::F16 } else { Ty::Bf16 };
            let value = let_("v", Ty::F32, load("w", var("i")));
            let body = per_element(var("n"), vec![value, store("out", var("i"), var("v"))]);
            (ty, blocks_for(var("n"), BLOCK as i64), body)
        }
        format if block_layout(format).is_some() => {
            let runs = var("n") / int(RUN);
            (
                Ty::U8,
                blocks_for(runs.clone(), BLOCK as i64),
                decode_runs(format, runs, "out", out),
            )
        }
        _ => return None,
    };
    Some(Kernel {
        name: convert_kernel_name(from, to),
        origin: format!("weight loading: {from} weights converted to {to}"),
        params: vec![
            buffer("w", source, false),
            buffer("out", out, true),
            scalar("n", Ty::I32),
        ],
        shared: vec![],
        block_dim: BLOCK,
        grid,
        body,
    })
}

/// Elements a thread of a block format's conversion decodes.
const RUN: i64 = 32;

/// A thread per run of 32 elements (`i`, of `runs`): decoded from `w`'s blocks, stored to
/// `out` (of `ty`) as 16-byte vectors.
fn decode_runs(format: DType, runs: Expr, out: &str, ty: Ty) -> Vec<Stmt> {
    let per_store = match ty {
        Ty::F32 => 4,
        _ => 8,
    };
    let mut body = run_weights(format, "v", var("i"), 0..RUN as usize);
    for first in (0..RUN).step_by(per_store) {
        let values = (first..first + per_store as i64)
            .map(|e| var(&format!("v{e}")))
            .collect();
        body.push(store_vec(out, var("i") * int(RUN) + int(first), values));
    }
    per_element(runs, body)
}

/// The name of the kernel converting a matrix of `from` to bf16 for a step's GEMM.
fn prefill_kernel_name(from: DType) -> String {
    format!("convert_{}_to_bf16_for_prefill", from.name())
}

/// A matrix of GGUF blocks (`w`, `n` rows of `k`) converted into the bf16 copy `wb` that a
/// step of `min_tokens` rows or more multiplies by on the target's TMA GEMM, as the plan's
/// conversion at loading converts them (the same values, the same rounding), a run of 32 a
/// thread; no blocks for steps of fewer rows (`tokens`), whose GEMMs take the stored form
/// themselves. None for other formats (half values need no copy: the TMA GEMMs take them as
/// stored, `halves::over_halves`).
pub fn to_bf16_for_prefill(from: DType, min_tokens: usize, origin: &str) -> Option<Kernel> {
    block_layout(from)?;
    let gate = bin(BinOp::Min, int(1), var("tokens") / int(min_tokens as i64));
    let runs = var("n") * var("k") / int(RUN);
    Some(Kernel {
        name: prefill_kernel_name(from),
        origin: format!("{origin}: {from} weights converted to bf16 for a step's GEMM, a run of 32 a thread"),
        params: vec![
            buffer("w", Ty::U8, false),
            buffer("wb", Ty::Bf16, true),
            scalar("n", Ty::I32),
            scalar("k", Ty::I32),
            scalar("tokens", Ty::I32),
        ],
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(runs.clone(), BLOCK as i64) * gate,
        body: decode_runs(from, runs, "wb", Ty::Bf16),
    })
}
