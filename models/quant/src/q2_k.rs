//! Q2_K: 256-weight super-blocks of sixteen 16-weight groups, each weight 2 bits, each group a
//! 4-bit scale and a 4-bit minimum; `x = d·sc·q − dmin·m`.
//! Layout (`block_q2_K`): scales: [u8; 16] (low nibble the scale, high nibble the minimum),
//! qs: [u8; 64], d: f16, dmin: f16. Group `g` (weights `16g..16g + 16`) lies in `qs` where
//! [`two_bit_group`] says.

use super::{f16_at, BlockFormat};

pub struct Q2K;

/// Where 16-weight group `g` of a Q2_K or Q3_K super-block keeps its 2-bit weights in `qs`:
/// weight `l` is bits `shift..shift + 2` of byte `offset + l`. ggml fills each 32-byte half of
/// `qs` four shifts deep, alternating its two 16-byte quarters between consecutive groups.
pub fn two_bit_group(g: usize) -> (usize, usize) {
    (32 * (g / 8) + 16 * (g % 2), 2 * ((g % 8) / 2))
}

impl BlockFormat for Q2K {
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 84;

    const GROUP: usize = 16;

    #[inline(always)]
    fn unpack_groups(block: &[u8], w: &mut [i8], scale: &mut [f32], min: &mut [f32]) {
        let (d, dmin) = (f16_at(block, 80), f16_at(block, 82));
        for g in 0..16 {
            let (offset, shift) = two_bit_group(g);
            let qs = &block[16 + offset..][..16];
            for (o, &q) in w[16 * g..16 * g + 16].iter_mut().zip(qs) {
                *o = ((q >> shift) & 3) as i8;
            }
            let sc = block[g];
            scale[g] = d * (sc & 0x0F) as f32;
            min[g] = dmin * (sc >> 4) as f32;
        }
    }

    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        super::dequantize_groups::<Self>(block, out);
    }
}
