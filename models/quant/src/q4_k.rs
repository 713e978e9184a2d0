//! Q4_K: 256-weight super-blocks of eight 32-weight sub-blocks, each with a 6-bit scale and a
//! 6-bit minimum (packed in 12 bytes, see [`scale_min_k4`]); `x = d·sc·q − dmin·m`.
//! Layout (`block_q4_K`): d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]. Each 64-element
//! chunk reads 32 bytes of `qs`: low nibbles first (sub-block 2i), then high nibbles (2i+1).

use super::{f16_at, BlockFormat};

pub struct Q4K;

/// ggml's `get_scale_min_k4`: sub-block `j`'s 6-bit (scale, min) from the packed 12 bytes.
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

impl BlockFormat for Q4K {
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 144;

    const GROUP: usize = 32;

    #[inline(always)]
    fn unpack_groups(block: &[u8], w: &mut [i8], scale: &mut [f32], min: &mut [f32]) {
        let d = f16_at(block, 0);
        let dmin = f16_at(block, 2);
        let scales = &block[4..16];
        let qs = &block[16..144];
        for chunk in 0..4 {
            for sub in 0..2 {
                let (sc, m) = scale_min_k4(2 * chunk + sub, scales);
                scale[2 * chunk + sub] = d * sc as f32;
                min[2 * chunk + sub] = dmin * m as f32;
            }
            let q = &qs[32 * chunk..32 * chunk + 32];
            for l in 0..32 {
                w[64 * chunk + l] = (q[l] & 0x0F) as i8;
                w[64 * chunk + 32 + l] = (q[l] >> 4) as i8;
            }
        }
    }

    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 0);
        let dmin = f16_at(block, 2);
        let scales = &block[4..16];
        let qs = &block[16..144];
        for chunk in 0..4 {
            let (sc0, m0) = scale_min_k4(2 * chunk, scales);
            let (sc1, m1) = scale_min_k4(2 * chunk + 1, scales);
            let (d0, min0) = (d * sc0 as f32, dmin * m0 as f32);
            let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
            let q = &qs[32 * chunk..32 * chunk + 32];
            let out = &mut out[64 * chunk..64 * chunk + 64];
            for l in 0..32 {
                out[l] = d0 * (q[l] & 0x0F) as f32 - min0;
                out[l + 32] = d1 * (q[l] >> 4) as f32 - min1;
            }
        }
    }
}
