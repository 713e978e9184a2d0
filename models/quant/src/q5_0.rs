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
