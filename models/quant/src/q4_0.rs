//! Q4_0: 32 weights as 4-bit `q` with one f16 scale `d`; `x = (q - 8)·d`.
//! Layout (`block_q4_0`): d: f16, qs: [u8; 16]; low nibbles are elements 0..16, high 16..32.

use super::{f16_at, BlockFormat};

pub struct Q4_0;

impl BlockFormat for Q4_0 {
    const BLOCK_ELEMS: usize = 32;
    const BLOCK_BYTES: usize = 18;

    const GROUP: usize = 32;

    #[inline(always)]
    fn unpack_groups(block: &[u8], w: &mut [i8], scale: &mut [f32], min: &mut [f32]) {
        let d = f16_at(block, 0);
        let qs = &block[2..18];
        for j in 0..16 {
            w[j] = (qs[j] & 0x0F) as i8 - 8;
            w[j + 16] = (qs[j] >> 4) as i8 - 8;
        }
        scale[0] = d;
        min[0] = 0.0;
    }

    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 0);
        let qs = &block[2..18];
        for j in 0..16 {
            out[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
            out[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

/// `row` (whole blocks of 32) as Q4_0 blocks, as `ir::reference::ops::four_bit_row` rounds
/// it: per block the value of largest magnitude `m` sets `d = m / −8` (stored as f16), and
/// each value becomes `q = ⌊x/d + 8.5⌋` within 0..=15.
pub fn quantize_row(row: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(row.len() / Q4_0::BLOCK_ELEMS * Q4_0::BLOCK_BYTES);
    for block in row.chunks(Q4_0::BLOCK_ELEMS) {
        let m = block.iter().fold(0f32, |m, &x| if x.abs() > m.abs() { x } else { m });
        let d = half::f16::from_f32(m / -8.0);
        let inverse = if d.to_f32() != 0.0 { 1.0 / d.to_f32() } else { 0.0 };
        let q = |x: f32| ((x * inverse + 8.5) as i32).clamp(0, 15) as u8;
        out.extend(d.to_le_bytes());
        out.extend((0..16).map(|j| q(block[j]) | (q(block[j + 16]) << 4)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks dequantize to within half a step of what they quantized, but for values of the
    /// other sign than the block's largest beyond 7 steps (4 bits reach −8..=7 steps: they are
    /// clamped, within a step; the f16 scale adds its rounding); a zero block to zeros.
    #[test]
    fn quantized_rows_dequantize_to_within_half_a_step() {
        let row: Vec<f32> = (0..64).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.13).collect();
        let bytes = quantize_row(&row);
        assert_eq!(bytes.len(), 2 * Q4_0::BLOCK_BYTES);
        let mut back = vec![0f32; 64];
        for (block, out) in bytes.chunks(Q4_0::BLOCK_BYTES).zip(back.chunks_mut(32)) {
            Q4_0::dequantize_block(block, out);
        }
        for (block, got) in row.chunks(32).zip(back.chunks(32)) {
            let m = block.iter().fold(0f32, |m, &x| if x.abs() > m.abs() { x } else { m });
            let d = m / -8.0;
            for (x, y) in block.iter().zip(got) {
                let limit = match x / d > 7.0 {
                    true => d.abs(),
                    false => d.abs() / 2.0,
                };
                assert!((x - y).abs() <= limit * 1.01, "{x} → {y}");
            }
        }
        let zeros = quantize_row(&[0.0; 32]);
        let mut out = [1f32; 32];
        Q4_0::dequantize_block(&zeros, &mut out);
        assert_eq!(out, [0.0; 32]);
    }
}
