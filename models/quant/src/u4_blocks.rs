//! 4-bit levels in blocks of 32 with an f32 scale and an f32 offset: how bbc holds an integer
//! checkpoint's 4-bit weights (`models::int_checkpoint` repacks them: every 32 columns of a
//! row lie in one of the checkpoint's groups). Not a GGUF type; no file stores it.
//! Layout: scale: f32, offset: f32 (little-endian), levels: [u8; 16], GGUF Q4_1's nibble order
//! (low nibbles are elements 0..16, high 16..32); `x = level · scale + offset` in f32, a product
//! and a sum each rounded (blocks are made so that neither rounds: see [`exact`]).

pub const BLOCK_ELEMS: usize = 32;
pub const BLOCK_BYTES: usize = 24;
/// Where a block's levels start.
pub const LEVELS_AT: usize = 8;

/// The block's scale and offset.
pub fn scale_offset(block: &[u8]) -> (f32, f32) {
    let word = |at: usize| f32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]]);
    (word(0), word(4))
}

/// Element `e`'s level (0..16).
pub fn level(block: &[u8], e: usize) -> u8 {
    let byte = block[LEVELS_AT + e % 16];
    if e < 16 {
        byte & 15
    } else {
        byte >> 4
    }
}

/// One block's 32 weights.
pub fn dequantize_block(block: &[u8], out: &mut [f32]) {
    let (scale, offset) = scale_offset(block);
    for (e, o) in out.iter_mut().enumerate().take(BLOCK_ELEMS) {
        *o = f32::from(level(block, e)) * scale + offset;
    }
}

/// A block of 32 levels (each below 16) with their scale and offset.
pub fn block(scale: f32, offset: f32, levels: &[u8; 32]) -> [u8; BLOCK_BYTES] {
    let mut out = [0u8; BLOCK_BYTES];
    out[..4].copy_from_slice(&scale.to_le_bytes());
    out[4..8].copy_from_slice(&offset.to_le_bytes());
    for j in 0..16 {
        debug_assert!(levels[j] < 16 && levels[j + 16] < 16);
        out[LEVELS_AT + j] = levels[j] | (levels[j + 16] << 4);
    }
    out
}

/// 32 weights rounded to nearest 4-bit levels over their range, as integer checkpoints are
/// made without calibration: the scale the range over 15, rounded to f16 (so it is
/// [`exact`]), the zero point the level of 0, each level the weight over the scale plus the
/// zero point, rounded and clamped to 0…15; the offset `−zero · scale`. A block of zeros (or
/// of NaNs) is levels of 0 under the least f16 scale.
pub fn quantize_block(x: &[f32]) -> [u8; BLOCK_BYTES] {
    debug_assert_eq!(x.len(), BLOCK_ELEMS);
    let (low, high) = x.iter().fold((0f32, 0f32), |(l, h), &v| (l.min(v), h.max(v)));
    let least = half::f16::from_bits(1).to_f32();
    let scale = half::f16::from_f32(((high - low) / 15.0).clamp(least, half::f16::MAX.to_f32())).to_f32();
    let zero = (-low / scale).round().clamp(0.0, 15.0);
    let levels = std::array::from_fn(|i| (x[i] / scale + zero).round().clamp(0.0, 15.0) as u8);
    block(scale, -zero * scale, &levels)
}

/// The float matrix `view` (f32, bf16 or f16, `[rows, cols]`, `cols` a multiple of 32) as
/// 4-bit blocks ([`quantize_block`]), row by row on the pool.
pub fn quantize_matrix(view: &crate::tensor::TensorView<'_>) -> Vec<u8> {
    crate::tensor::quantize_blocks_of_32(view, quantize_block)
}

/// Whether weights `(q − z) · scale` for levels `q` below 16 and zero points `z` up to 16 are
/// exactly `q · scale + (−z · scale)` with both operations exact: the scale is finite and its
/// significand has its four lowest bits clear (so a product by at most 16 needs no rounding,
/// and the sum, whose exact value is such a product, none either). Every f16 and bf16 scale
/// is.
pub fn exact(scale: f32) -> bool {
    scale.is_finite() && scale.to_bits() & 0xF == 0 && (scale * 16.0).is_finite()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Levels and zero points of every value over short scales give `(q − z) · s` exactly,
    /// from the block's layout; f16 and bf16 scales are all short.
    #[test]
    fn blocks_hold_levels_less_zero_points_times_the_scale_exactly() {
        let short = [
            1.0f32,
            0.013_671_875,
            half::f16::from_f32(3.0e-5).to_f32(),
            -0.25,
            f32::from_bits(0x30),
        ];
        for scale in short {
            assert!(exact(scale), "{scale}");
            for zero in 0..=16u8 {
                let levels: [u8; 32] = std::array::from_fn(|e| (e as u8 * 7 + zero) % 16);
                let offset = -f32::from(zero) * scale;
                let bytes = block(scale, offset, &levels);
                let mut out = [0f32; 32];
                dequantize_block(&bytes, &mut out);
                for (e, &got) in out.iter().enumerate() {
                    assert_eq!(level(&bytes, e), levels[e]);
                    let want = ((f64::from(levels[e]) - f64::from(zero)) * f64::from(scale)) as f32;
                    // Equal as numbers: a zero weight may be either zero.
                    assert_eq!(got, want, "scale {scale} zero {zero} element {e}");
                }
            }
        }
        assert!((0..=u16::MAX).all(|b| {
            let (h, bf) = (half::f16::from_bits(b).to_f32(), half::bf16::from_bits(b).to_f32());
            (!h.is_finite() || exact(h)) && (!bf.is_finite() || bf.abs() > 1e37 || exact(bf))
        }));
        assert!(!exact(1.0 + f32::EPSILON) && !exact(f32::NAN) && !exact(f32::MAX));
    }

    /// Rounded to nearest: every weight within half a step (and the clamped ends within one)
    /// of its level's value, the scale exact, zero blocks all zero.
    #[test]
    fn quantized_blocks_are_within_half_a_step() {
        for b in 0..200usize {
            let x: [f32; 32] = std::array::from_fn(|i| {
                let v = (((b * 32 + i) * 2654435761usize) >> 7) % 2001;
                (v as f32 - 1000.0 + 300.0 * (b % 3) as f32) * 1e-3 * (1 + b % 7) as f32
            });
            let bytes = quantize_block(&x);
            let (scale, _) = scale_offset(&bytes);
            assert!(exact(scale) && scale > 0.0);
            let mut got = [0f32; 32];
            dequantize_block(&bytes, &mut got);
            for (g, w) in got.iter().zip(&x) {
                assert!(
                    (g - w).abs() <= scale * 0.5 + scale * 2e-3,
                    "block {b}: {g} for {w}, step {scale}"
                );
            }
        }
        let mut zeros = [0f32; 32];
        dequantize_block(&quantize_block(&[0.0; 32]), &mut zeros);
        assert_eq!(zeros, [0.0; 32]);
    }
}
