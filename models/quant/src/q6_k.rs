//! Q6_K: 256 weights as 6-bit values (4 low bits in `ql`, 2 high bits in `qh`) minus 32, with
//! sixteen int8 sub-block scales; `x = d·sc·(q − 32)`.
//! Layout (`block_q6_K`): ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16.

use super::{f16_at, BlockFormat};

pub struct Q6K;

impl BlockFormat for Q6K {
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 210;

    const GROUP: usize = 16;

    #[inline(always)]
    fn unpack_groups(block: &[u8], w: &mut [i8], scale: &mut [f32], min: &mut [f32]) {
        let d = f16_at(block, 208);
        for half in 0..2 {
            let ql = &block[64 * half..64 * half + 64];
            let qh = &block[128 + 32 * half..128 + 32 * half + 32];
            let w = &mut w[128 * half..128 * half + 128];
            for l in 0..32 {
                w[l] = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i8 - 32;
                w[l + 32] = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                w[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                w[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
            }
        }
        // Group g covers elements 16g..16g+16 and uses scale byte g (ggml's `is` indexing).
        for (g, s) in scale.iter_mut().enumerate() {
            *s = d * (block[192 + g] as i8) as f32;
        }
        min.fill(0.0);
    }

    fn dequantize_block(block: &[u8], out: &mut [f32]) {
        let d = f16_at(block, 208);
        for half in 0..2 {
            let ql = &block[64 * half..64 * half + 64];
            let qh = &block[128 + 32 * half..128 + 32 * half + 32];
            let sc = &block[192 + 8 * half..192 + 8 * half + 8];
            let out = &mut out[128 * half..128 * half + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                out[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                out[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                out[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                out[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
            }
        }
    }
}
