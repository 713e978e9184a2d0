//! A stored weight converted to the plan's dtype on the device: `out[i] = value(w, i)` for the
//! `n` elements of a run of whole rows, `w` holding them as the checkpoint stores them (f16 or
//! bf16 values, or GGUF blocks, which are contiguous across rows because rows are whole blocks)
//! and `out` taking them as f32 or bf16 (rounded to nearest even). A thread per element.
//!
//! Loading a GGUF into a bf16 plan uploads the stored bytes (a quarter of the bf16 bytes for
//! 4-bit blocks) and decodes them here, instead of on the host's cores. The values are the
//! host's (`quant`'s dequantization, then the same rounding): every block format's value is
//! a product of a half scale and small integers, exact in f32, and at most one rounded
//! addition, so contracting it into an FMA changes nothing either.

use super::quant::{block_layout, dequant};
use super::{blocks_for, per_element, BLOCK};
use crate::dsl::*;
use ir::DType;

/// Whether weights stored as `from` are converted on the device.
pub fn converts(from: DType) -> bool {
    matches!(from, DType::F16 | DType::BF16) || block_layout(from).is_some()
}

/// The dtypes a converted weight is held in.
pub const CONVERTED_TO: [DType; 2] = [DType::F32, DType::BF16];

/// The name of the kernel converting `from` to `to` (one of [`CONVERTED_TO`]).
pub fn convert_kernel_name(from: DType, to: DType) -> String {
    format!("convert_{}_to_{}", from.name(), to.name())
}

/// The kernel converting weights stored as `from` to `to`, where `from` is one the device
/// converts ([`converts`]) and `to` one of [`CONVERTED_TO`]. Parameters: `w` (the stored bytes
/// of the run, from its first row), `out`, `n` (elements).
pub fn convert_kernel(from: DType, to: DType) -> Option<Kernel> {
    let (source, value) = match from {
        DType::F16 | DType::BF16 => {
            let ty = if from == DType::F16 { Ty::F16 } else { Ty::Bf16 };
            (ty, vec![let_("v", Ty::F32, load("w", var("i")))])
        }
        format if block_layout(format).is_some() => (Ty::U8, dequant(format, "v", int(0), var("i"))),
        _ => return None,
    };
    let out = match to {
        DType::BF16 => Ty::Bf16,
        DType::F32 => Ty::F32,
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
        grid: blocks_for(var("n"), BLOCK as i64),
        body: per_element(var("n"), [value, vec![store("out", var("i"), var("v"))]].concat()),
    })
}
