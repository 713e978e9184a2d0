//! Q3_K: 256-weight super-blocks of sixteen 16-weight groups, each weight 3 bits (two in `qs`,
//! the third in `hmask`) offset by −4, each group a 6-bit scale offset by −32;
//! `x = d·(sc − 32)·q`.
//! Layout (`block_q3_K`): hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12] (sixteen 6-bit
//! values packed, see [`scales`]), d: f16. Group `g` keeps its low two bits in `qs` as Q2_K does
//! ([`two_bit_group`]) and its third where [`high_bit_group`] says; a clear bit subtracts 4.

use super::q2_k::two_bit_group;
use super::{f16_at, BlockFormat};

pub struct Q3K;

/// Where 16-weight group `g` keeps its third bits in `hmask`: weight `l`'s is bit `bit` of byte
/// `offset + l`.
pub fn high_bit_group(g: usize) -> (usize, usize) {
    (16 * (g % 2), 4 * (g / 8) + (g % 8) / 2)
}

/// The sixteen 6-bit group scales (before the −32) of ggml's `kmask` unpacking: the low
/// nibbles of bytes 0..8, then their high nibbles, each with two high bits from bytes 8..12.
pub fn scales(packed: &[u8]) -> [u8; 16] {
    std::array::from_fn(|j| {
        let low = if j < 8 { packed[j] & 0x0F } else { packed[j - 8] >> 4 };
        let high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
        low | (high << 4)
    })
}

/// The inverse of [`scales`]: sixteen 6-bit values packed into `packed`'s 12 bytes.
pub fn pack_scales(scales: &[u8; 16], packed: &mut [u8]) {
    packed[..12].fill(0);
    for (j, &sc) in scales.iter().enumerate() {
        packed[j % 8] |= (sc & 0x0F) << if j < 8 { 0 } else { 4 };
        packed[8 + j % 4] |= (sc >> 4) << (2 * (j / 4));
    }
}

impl BlockFormat for Q3K {
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 110;

    const GROUP: usize = 16;

    #[inline(always)]
    fn unpack_groups(block: &[u8], w: &mut [i8], scale: &mut [f32], min: &mut [f32]) {
        let d = f16_at(block, 108);
        let (hmask, sc) = (&block[..32], scales(&block[96..108]));
        for g in 0..16 {
            let ((offset, shift), (high_offset, bit)) = (two_bit_group(g), high_bit_group(g));
            let (qs, hm) = (&block[32 + offset..][..16], &hmask[high_offset..][..16]);
            for ((o, &q), &h) in w[16 * g..16 * g + 16].iter_mut().zip(qs).zip(hm) {
                let high_clear = (h >> bit) & 1 == 0;
                *o = ((q >> shift) & 3) as i8 - if high_clear { 4 } else { 0 };
            }
            scale[g] = d * (sc[g] as i32 - 32) as f32;
        }
        min.fill(0.0);
    }

    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        super::dequantize_groups::<Self>(block, out);
    }
}
