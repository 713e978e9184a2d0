//! Q8_0: 32 weights as int8 with one f16 scale; `x = q·d`.
//! Layout (`block_q8_0`): d: f16, qs: [i8; 32].

use super::{f16_at, BlockFormat};

pub struct Q8_0;

impl BlockFormat for Q8_0 {
    const BLOCK_ELEMS: usize = 32;
    const BLOCK_BYTES: usize = 34;

    const GROUP: usize = 32;

    #[inline(always)]
    fn unpack_groups(block: &[u8], w: &mut [i8], scale: &mut [f32], min: &mut [f32]) {
        for (o, &q) in w.iter_mut().zip(&block[2..34]) {
            *o = q as i8;
        }
        scale[0] = f16_at(block, 0);
        min[0] = 0.0;
    }

    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 0);
        for (o, &q) in out.iter_mut().zip(&block[2..34]) {
            *o = (q as i8) as f32 * d;
        }
    }
}
