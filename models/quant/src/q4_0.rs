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
