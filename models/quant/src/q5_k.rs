//! Q5_K: like Q4_K with a fifth bit per weight in `qh`; `x = d·sc·q − dmin·m`.
//! Layout (`block_q5_K`): d: f16, dmin: f16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128].
//! Chunk `c` (64 weights) takes its high bits from bits 2c and 2c+1 of `qh`.

use super::q4_k::scale_min_k4;
use super::{f16_at, BlockFormat};

pub struct Q5K;

impl BlockFormat for Q5K {
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 176;

    const GROUP: usize = 32;

    #[inline(always)]
    fn unpack_groups(block: &[u8], w: &mut [i8], scale: &mut [f32], min: &mut [f32]) {
        let d = f16_at(block, 0);
        let dmin = f16_at(block, 2);
        let scales = &block[4..16];
        let qh = &block[16..48];
        let qs = &block[48..176];
        for chunk in 0..4 {
            for sub in 0..2 {
                let (sc, m) = scale_min_k4(2 * chunk + sub, scales);
                scale[2 * chunk + sub] = d * sc as f32;
                min[2 * chunk + sub] = dmin * m as f32;
            }
            let (bit0, bit1) = (1u8 << (2 * chunk), 1u8 << (2 * chunk + 1));
            let q = &qs[32 * chunk..32 * chunk + 32];
            for l in 0..32 {
                let h0 = if qh[l] & bit0 != 0 { 16 } else { 0 };
                let h1 = if qh[l] & bit1 != 0 { 16 } else { 0 };
                w[64 * chunk + l] = ((q[l] & 0x0F) + h0) as i8;
                w[64 * chunk + 32 + l] = ((q[l] >> 4) + h1) as i8;
            }
        }
    }

    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 0);
        let dmin = f16_at(block, 2);
        let scales = &block[4..16];
        let qh = &block[16..48];
        let qs = &block[48..176];
        for chunk in 0..4 {
            let (sc0, m0) = scale_min_k4(2 * chunk, scales);
            let (sc1, m1) = scale_min_k4(2 * chunk + 1, scales);
            let (d0, min0) = (d * sc0 as f32, dmin * m0 as f32);
            let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
            let (bit0, bit1) = (1u8 << (2 * chunk), 1u8 << (2 * chunk + 1));
            let q = &qs[32 * chunk..32 * chunk + 32];
            let out = &mut out[64 * chunk..64 * chunk + 64];
            for l in 0..32 {
                let h0 = if qh[l] & bit0 != 0 { 16 } else { 0 };
                let h1 = if qh[l] & bit1 != 0 { 16 } else { 0 };
                out[l] = d0 * ((q[l] & 0x0F) + h0) as f32 - min0;
                out[l + 32] = d1 * ((q[l] >> 4) + h1) as f32 - min1;
            }
        }
    }
}
