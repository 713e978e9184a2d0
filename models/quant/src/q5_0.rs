//! Q5_0: 32 weights as 5-bit `q` with one f16 scale; `x = (q - 16)·d`.
//! Layout (`block_q5_0`): d: f16, qh: u32 (the fifth bit of each element), qs: [u8; 16].

use super::{f16_at, BlockFormat};

pub struct Q5_0;

impl BlockFormat for Q5_0 {
    const BLOCK_ELEMS: usize = 32;
    const BLOCK_BYTES: usize = 22;

    const GROUP: usize = 32;

    #[inline(always)]
    fn unpack_groups(block: &[u8], w: &mut [i8], scale: &mut [f32], min: &mut [f32]) {
        let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
        let qs = &block[6..22];
        for j in 0..16 {
            let high_lo = (((qh >> j) << 4) & 0x10) as u8;
            let high_hi = ((qh >> (j + 12)) & 0x10) as u8;
            w[j] = ((qs[j] & 0x0F) | high_lo) as i8 - 16;
            w[j + 16] = ((qs[j] >> 4) | high_hi) as i8 - 16;
        }
        scale[0] = f16_at(block, 0);
        min[0] = 0.0;
    }

    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 0);
        let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
        let qs = &block[6..22];
        for j in 0..16 {
            let high_lo = ((qh >> j) << 4) & 0x10;
            let high_hi = (qh >> (j + 12)) & 0x10;
            out[j] = (((qs[j] & 0x0F) as u32 | high_lo) as i32 - 16) as f32 * d;
            out[j + 16] = (((qs[j] >> 4) as u32 | high_hi) as i32 - 16) as f32 * d;
        }
    }
}

/// The Q5_0 block (`out`, 22 bytes) of the weights `(q − zero) · d`: `levels` the 4-bit `q`
/// packed as Q4_0 packs them (16 bytes: low nibbles elements 0..16, high 16..32), `zero` at
/// most 16. Each `u = q − zero + 16` (0..=31) keeps its low four bits in Q4_0's nibbles, its
/// fifth as bit `e` of `qh`.
pub fn write_levels_block(d: half::f16, levels: &[u8], zero: u8, out: &mut [u8]) {
    debug_assert!(levels.len() == 16 && out.len() == Q5_0::BLOCK_BYTES && zero <= 16);
    let mut qh = 0u32;
    for (j, &byte) in levels.iter().enumerate() {
        let [low, high] = [byte & 15, byte >> 4].map(|q| q + 16 - zero);
        out[6 + j] = (low & 15) | (high & 15) << 4;
        qh |= u32::from(low >> 4) << j | u32::from(high >> 4) << (j + 16);
    }
    out[..2].copy_from_slice(&d.to_le_bytes());
    out[2..6].copy_from_slice(&qh.to_le_bytes());
}

/// Q4_0 blocks (`(q − 8) · d`) as the Q5_0 blocks of the same weights.
pub fn from_q4_0(bytes: &[u8]) -> Vec<u8> {
    const Q4_0_BYTES: usize = 18;
    let mut out = vec![0u8; bytes.len() / Q4_0_BYTES * Q5_0::BLOCK_BYTES];
    for (block, q5) in bytes
        .chunks_exact(Q4_0_BYTES)
        .zip(out.chunks_exact_mut(Q5_0::BLOCK_BYTES))
    {
        let d = half::f16::from_le_bytes([block[0], block[1]]);
        write_levels_block(d, &block[2..], 8, q5);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GgmlType;

    /// Q4_0 blocks of every level under scales of either sign (and zero) are, as Q5_0 blocks,
    /// the same weights.
    #[test]
    fn q4_0_blocks_are_the_same_weights_as_q5_0() {
        let mut q4 = Vec::new();
        for (b, d) in [0.013f32, -0.5, 0.0, 3.0e-5].into_iter().enumerate() {
            q4.extend(half::f16::from_f32(d).to_le_bytes());
            q4.extend((0..16).map(|j| ((j + b) % 16) as u8 | (((j * 3 + b) % 16) as u8) << 4));
        }
        let q5 = from_q4_0(&q4);
        assert_eq!(q5.len(), 4 * Q5_0::BLOCK_BYTES);
        let (mut want, mut got) = (vec![0f32; 128], vec![0f32; 128]);
        GgmlType::Q4_0.dequantize(&q4, &mut want);
        GgmlType::Q5_0.dequantize(&q5, &mut got);
        assert_eq!(got, want);
    }
}
