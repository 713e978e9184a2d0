//! GGUF's MXFP4 (ggml type 39, the OCP microscaling format llama.cpp's `MXFP4_MOE` files hold
//! their experts in): 32 FP4 E2M1 codes under one power-of-two scale.
//!
//! Layout (`block_mxfp4`, 17 bytes): e: u8, the scale's E8M0 exponent; qs: [u8; 16], codes in
//! Q4_1's nibble order (element `j < 16` the low nibble of byte `j`, `j + 16` its high nibble).
//! As ggml decodes it: `x = v · 2^(e − 128)` in f32, `v` the code's value doubled
//! ([`KVALUES`]: E2M1 values as integers) and the scale ggml's `GGML_E8M0_TO_FP32_HALF(e)`, so
//! every weight is exact. An exponent of 255 (E8M0's NaN, which ggml's quantizer never
//! writes) decodes as ggml decodes it: `v · 2^127`.

use super::{fp4_blocks, BlockFormat};

/// Bytes of a block.
pub const BLOCK_BYTES: usize = 17;
/// Elements of a block.
pub const BLOCK_ELEMS: usize = 32;

/// Each code's value doubled (ggml's `kvalues_mxfp4`): the E2M1 values ±0, 0.5, 1, 1.5, 2,
/// 3, 4, 6 as integers.
pub const KVALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// The doubled values + 128 (116 to 140): what a code stands for as the CPU's int8 kernels store
/// it, unsigned for `vpdpbusd` (as `iq4::STORED`).
pub const STORED: [u8; 16] = super::stored_table(&KVALUES);

/// Half the scale of exponent `e`: `2^(e − 128)` as ggml builds it from bits (subnormal for
/// `e` below 2).
pub fn half_scale(e: u8) -> f32 {
    let bits = match e {
        0 | 1 => 0x0020_0000u32 << e,
        e => u32::from(e - 1) << 23,
    };
    f32::from_bits(bits)
}

pub struct MXFP4;

impl BlockFormat for MXFP4 {
    const BLOCK_ELEMS: usize = BLOCK_ELEMS;
    const BLOCK_BYTES: usize = BLOCK_BYTES;
    const GROUP: usize = 32;

    #[inline(always)]
    fn unpack_groups(block: &[u8], w: &mut [i8], scale: &mut [f32], min: &mut [f32]) {
        for (j, &q) in block[1..BLOCK_BYTES].iter().enumerate() {
            w[j] = KVALUES[usize::from(q & 15)];
            w[j + 16] = KVALUES[usize::from(q >> 4)];
        }
        scale[0] = half_scale(block[0]);
        min[0] = 0.0;
    }

    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        super::dequantize_groups::<Self>(block, out);
    }
}

/// MXFP4 blocks (`data`, whole blocks) as the FP4 blocks bbc holds FP4 weights in
/// ([`fp4_blocks`]: the same codes in the same order, the power of two as both group scales),
/// every weight the same value; `None` where a block's exponent is 255 (its scale, 2^128, is
/// no f32).
pub fn to_fp4_blocks(data: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(data.len() / BLOCK_BYTES * fp4_blocks::BLOCK_BYTES);
    for block in data.chunks_exact(BLOCK_BYTES) {
        if block[0] == u8::MAX {
            return None;
        }
        // E2M1's values times 2^(e − 127): the doubled values times half of it, exactly.
        let scale = 2.0 * half_scale(block[0]);
        out.extend_from_slice(&scale.to_le_bytes());
        out.extend_from_slice(&scale.to_le_bytes());
        out.extend_from_slice(&block[1..]);
    }
    Some(out)
}

/// 32 weights as ggml's reference quantizer makes an MXFP4 block of them
/// (`quantize_row_mxfp4_ref`): the exponent `⌊log₂ amax⌋ − 2 + 127` (0 for a block of zeros;
/// here `⌊log₂⌋` from the float's bits, exact where `log2f` may round up just below a power
/// of two, and clamped to 0..=254), each code the first of the 16 whose doubled value times
/// the half scale is nearest the weight.
pub fn quantize_block(x: &[f32]) -> [u8; BLOCK_BYTES] {
    debug_assert_eq!(x.len(), BLOCK_ELEMS);
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let e = match amax > 0.0 && amax.is_finite() {
        true => (floor_log2(amax) - 2 + 127).clamp(0, 254) as u8,
        false => 0,
    };
    let d = half_scale(e);
    let code = |v: f32| {
        let mut best = 0;
        for (i, &k) in KVALUES.iter().enumerate() {
            if (f32::from(k) * d - v).abs() < (f32::from(KVALUES[best]) * d - v).abs() {
                best = i;
            }
        }
        best as u8
    };
    let mut out = [0u8; BLOCK_BYTES];
    out[0] = e;
    for j in 0..16 {
        out[1 + j] = code(x[j]) | (code(x[j + 16]) << 4);
    }
    out
}

/// `⌊log₂ v⌋` of a positive finite f32, from its bits.
fn floor_log2(v: f32) -> i32 {
    let bits = v.to_bits();
    match bits >> 23 {
        // Subnormal: the mantissa's leading bit sets it.
        0 => -127 - (bits.leading_zeros() as i32 - 9),
        exponent => exponent as i32 - 127,
    }
}

/// The float matrix `view` (f32, bf16 or f16, `[rows, cols]`, `cols` a multiple of 32) as
/// MXFP4 blocks ([`quantize_block`]), row by row on the pool.
pub fn quantize_matrix(view: &crate::tensor::TensorView<'_>) -> Vec<u8> {
    crate::tensor::quantize_blocks_of_32(view, quantize_block)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `⌊log₂⌋` from bits, normal and subnormal, against f64's.
    #[test]
    fn floor_log2_is_exact() {
        for v in [
            1.0f32,
            1.5,
            0.999_999_94,
            3.999_999_8,
            4.0,
            0.25,
            0.249_999_99,
            1e-40,
            f32::from_bits(1),
            3e38,
        ] {
            assert_eq!(floor_log2(v), f64::from(v).log2().floor() as i32, "{v:e}");
        }
    }

    /// Blocks quantized: every weight's code the nearest of the 16 under the block's scale,
    /// the largest weight within the top code's reach, zeros a block of exponent 0.
    #[test]
    fn quantized_blocks_hold_the_nearest_codes() {
        for b in 0..200usize {
            let x: [f32; 32] = std::array::from_fn(|i| {
                let v = (((b * 32 + i) * 2654435761usize) >> 7) % 2001;
                (v as f32 - 1000.0) * 1e-3 * 2f32.powi(b as i32 % 40 - 20)
            });
            let block = quantize_block(&x);
            let mut got = [0f32; 32];
            crate::GgmlType::MXFP4.dequantize(&block, &mut got);
            let d = half_scale(block[0]);
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(
                amax < 16.0 * d && amax >= 8.0 * d,
                "block {b}: amax {amax}, half scale {d}"
            );
            for (e, (&g, &w)) in got.iter().zip(&x).enumerate() {
                let nearest = KVALUES
                    .iter()
                    .map(|&k| (f32::from(k) * d - w).abs())
                    .fold(f32::INFINITY, f32::min);
                assert_eq!((g - w).abs(), nearest, "block {b} element {e}");
            }
        }
        assert_eq!(quantize_block(&[0.0; 32]), [0; 17]);
    }

    /// Every exponent's half scale is 2^(e − 128), the power computed in f64.
    #[test]
    fn half_scales_are_powers_of_two() {
        for e in 0..=255u8 {
            let want = 2f64.powi(i32::from(e) - 128) as f32;
            assert_eq!(half_scale(e).to_bits(), want.to_bits(), "exponent {e}");
        }
    }

    /// gguf-py's quantizer (its port of ggml's) on real weights gives the same blocks.
    #[test]
    fn quantizes_as_gguf_py_does() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf-blocks");
        let source: Vec<f32> = std::fs::read(dir.join("MXFP4.source.f32"))
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let want = std::fs::read(dir.join("MXFP4.bin")).unwrap();
        let got: Vec<u8> = source.chunks_exact(BLOCK_ELEMS).flat_map(quantize_block).collect();
        assert_eq!(got, want);
    }

    /// The doubled table is E2M1's values times two.
    #[test]
    fn kvalues_are_doubled_e2m1_values() {
        for (k, v) in KVALUES.iter().zip(fp4_blocks::CODE_VALUES) {
            assert_eq!(f32::from(*k), 2.0 * v);
        }
    }

    /// Every code under every exponent (but 255) reads the same as FP4 blocks and as MXFP4,
    /// and each is the code's E2M1 value times 2^(e − 127), bit for bit (zero's sign aside:
    /// ggml's integer table has no −0).
    #[test]
    fn fp4_blocks_hold_every_weight_exactly() {
        let mut data = Vec::new();
        for e in 0..=254u8 {
            data.push(e);
            data.extend((0..16u8).map(|j| j.wrapping_mul(3).wrapping_add(e) & 15 | (15 - j) << 4));
        }
        let held = to_fp4_blocks(&data).unwrap();
        assert_eq!(held.len() / fp4_blocks::BLOCK_BYTES, 255);
        let (mut mx, mut fp4) = (vec![0f32; 255 * 32], vec![0f32; 255 * 32]);
        crate::GgmlType::MXFP4.dequantize(&data, &mut mx);
        crate::GgmlType::F4E2M1B32.dequantize(&held, &mut fp4);
        for (i, (&a, &b)) in mx.iter().zip(&fp4).enumerate() {
            let (block, e) = (&data[i / 32 * BLOCK_BYTES..], i % 32);
            let code = match e < 16 {
                true => block[1 + e] & 15,
                false => block[1 + e - 16] >> 4,
            };
            let want = f64::from(fp4_blocks::CODE_VALUES[usize::from(code)]) * 2f64.powi(i32::from(block[0]) - 127);
            assert_eq!(a, want as f32, "weight {i}");
            assert_eq!(a, b, "weight {i}");
        }
        assert_eq!(to_fp4_blocks(&[255; 17]), None);
    }
}
