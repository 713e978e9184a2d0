//! Q5_1: 32 weights as 5-bit `q` with f16 scale and minimum; `x = q·d + m`.
//! Layout (`block_q5_1`): d: f16, m: f16, qh: u32, qs: [u8; 16].

use super::{f16_at, BlockFormat};

pub struct Q5_1;

impl BlockFormat for Q5_1 {
    const BLOCK_ELEMS: usize = 32;
    const BLOCK_BYTES: usize = 24;

    const GROUP: usize = 32;

    #[inline(always)]
    fn unpack_groups(block: &[u8], w: &mut [i8], scale: &mut [f32], min: &mut [f32]) {
        let qh = u32::from_le_bytes([block[4], block[5], block[6], block[7]]);
        let qs = &block[8..24];
        for j in 0..16 {
            let high_lo = (((qh >> j) << 4) & 0x10) as u8;
            let high_hi = ((qh >> (j + 12)) & 0x10) as u8;
            w[j] = ((qs[j] & 0x0F) | high_lo) as i8;
            w[j + 16] = ((qs[j] >> 4) | high_hi) as i8;
        }
        scale[0] = f16_at(block, 0);
        min[0] = -f16_at(block, 2);
    }

    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 0);
        let m = f16_at(block, 2);
        let qh = u32::from_le_bytes([block[4], block[5], block[6], block[7]]);
        let qs = &block[8..24];
        for j in 0..16 {
            let high_lo = ((qh >> j) << 4) & 0x10;
            let high_hi = (qh >> (j + 12)) & 0x10;
            out[j] = ((qs[j] & 0x0F) as u32 | high_lo) as f32 * d + m;
            out[j + 16] = ((qs[j] >> 4) as u32 | high_hi) as f32 * d + m;
        }
    }
}
