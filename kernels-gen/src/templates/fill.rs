//! Uniform pseudo-random fill: `out[i] = offset + scale·(2u − 1)` with `u` in [0, 1) from a
//! 32-bit hash of the seed and the element's index `base + i`. It makes the weights of a
//! shape-only model on the device (the GPU check's Llama-8B-shaped decode: 16 GB that would
//! otherwise be made on the host and copied); [`uniform`] is the same function on the host, so
//! a test can hold the very weights the device made. A thread per element.

use super::{blocks_for, per_element, BLOCK};
use crate::dsl::*;

/// The golden-ratio multiplier that spreads consecutive seeds over the hash's input.
const SEED_SPREAD: u32 = 0x9E37_79B9;
/// The multipliers of the `lowbias32` integer hash (Chris Wellons' hash-prospector).
const MIX: [u32; 2] = [0x7FEB_352D, 0x846C_A68B];

/// The fill kernels a device making weights loads: one for f32 tensors, one for bf16.
pub fn fill_kernels() -> Vec<Kernel> {
    [Ty::F32, Ty::Bf16]
        .into_iter()
        .map(|ty| fill_uniform(fill_kernel(ty), "generated weights", ty))
        .collect()
}

/// The fill kernel's name for elements of `ty` (an FP8 or half cache's, `fill_uniform_fp8` and
/// `fill_uniform_f16`, are built where a device fills one: the GPU check's attention timings).
pub fn fill_kernel(ty: Ty) -> &'static str {
    match ty {
        Ty::Bf16 => "fill_uniform_bf16",
        Ty::F16 => "fill_uniform_f16",
        Ty::F8E4M3 => "fill_uniform_fp8",
        _ => "fill_uniform_f32",
    }
}

/// `out[i]` for `i` in `0..n` (`ty` is f32, bf16, f16 or FP8; the narrower ones round the f32
/// value to nearest).
pub fn fill_uniform(name: &str, origin: &str, ty: Ty) -> Kernel {
    let u32_of = |v: u32| cast(Ty::U32, int(v as i64));
    let h = || var("h");
    let xor_shift = |by: i64| {
        assign(
            "h",
            bin(BinOp::BitXor, h(), bin(BinOp::Shr, h(), cast(Ty::U32, int(by)))),
        )
    };
    Kernel {
        name: name.into(),
        origin: format!("{origin}: uniform pseudo-random fill"),
        params: vec![
            buffer("out", ty, true),
            scalar("n", Ty::I32),
            scalar("base", Ty::I32),
            scalar("seed", Ty::I32),
            scalar("offset", Ty::F32),
            scalar("scale", Ty::F32),
        ],
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(var("n"), BLOCK as i64),
        body: per_element(
            var("n"),
            vec![
                let_(
                    "h",
                    Ty::U32,
                    bin(
                        BinOp::BitXor,
                        cast(Ty::U32, var("base") + var("i")),
                        cast(Ty::U32, var("seed")) * u32_of(SEED_SPREAD),
                    ),
                ),
                xor_shift(16),
                assign("h", h() * u32_of(MIX[0])),
                xor_shift(15),
                assign("h", h() * u32_of(MIX[1])),
                xor_shift(16),
                // The top 24 bits: exact in f32.
                let_(
                    "u",
                    Ty::F32,
                    cast(Ty::F32, cast(Ty::I32, bin(BinOp::Shr, h(), cast(Ty::U32, int(8))))) * f(1.0 / 16_777_216.0),
                ),
                store(
                    "out",
                    var("i"),
                    var("offset") + var("scale") * (var("u") * f(2.0) - f(1.0)),
                ),
            ],
        ),
    }
}

/// What [`fill_uniform`] stores at `index` (before rounding to the buffer's type).
pub fn uniform(seed: u32, index: u32, offset: f32, scale: f32) -> f32 {
    let mut h = index ^ seed.wrapping_mul(SEED_SPREAD);
    h ^= h >> 16;
    h = h.wrapping_mul(MIX[0]);
    h ^= h >> 15;
    h = h.wrapping_mul(MIX[1]);
    h ^= h >> 16;
    let u = (h >> 8) as f32 * (1.0 / 16_777_216.0);
    offset + scale * (u * 2.0 - 1.0)
}
