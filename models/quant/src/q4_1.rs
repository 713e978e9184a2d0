//! Q4_1: 32 weights as 4-bit `q` with f16 scale `d` and minimum `m`; `x = q·d + m`.
//! Layout (`block_q4_1`): d: f16, m: f16, qs: [u8; 16]; low nibbles 0..16, high 16..32.

use super::{f16_at, BlockFormat};

pub struct Q4_1;

impl BlockFormat for Q4_1 {
    const BLOCK_ELEMS: usize = 32;
    const BLOCK_BYTES: usize = 20;

    const GROUP: usize = 32;

    #[inline(always)]
    fn unpack_groups(block: &[u8], w: &mut [i8], scale: &mut [f32], min: &mut [f32]) {
        let qs = &block[4..20];
        for j in 0..16 {
            w[j] = (qs[j] & 0x0F) as i8;
            w[j + 16] = (qs[j] >> 4) as i8;
        }
        scale[0] = f16_at(block, 0);
        min[0] = -f16_at(block, 2);
    }

    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 0);
        let m = f16_at(block, 2);
        let qs = &block[4..20];
        for j in 0..16 {
            out[j] = (qs[j] & 0x0F) as f32 * d + m;
            out[j + 16] = (qs[j] >> 4) as f32 * d + m;
        }
    }
}
