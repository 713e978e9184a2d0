//! Stored formats that run as another one, rewritten exactly when read.
//!
//! Q3_K is Q6_K with narrower integers: both are sixteen 16-weight groups a super-block with one
//! f16 `d`, `x = d·s·q`; Q3_K's `s = sc − 32 ∈ [−32, 31]` is an int8 Q6_K scale and its
//! `q ∈ [−4, 3]` a 6-bit Q6_K weight `q + 32`. ggml's own Q3_K dot product sums `s·Σ q·qx` per
//! group and scales by `d·dx` per super-block, as the Q6_K kernels do (the CPU's interleaved
//! layout and every GPU template). Every weight, group scale and group integer is the same
//! after the rewrite (tested), so the model computes what it would on Q3_K, at Q6_K's size
//! (1.9× the stored bytes).

use super::q3_k;
use super::GgmlType;
use rayon::prelude::*;

/// The format a tensor stored as `stored` runs as.
pub fn runs_as(stored: GgmlType) -> GgmlType {
    match stored {
        GgmlType::Q3K => GgmlType::Q6K,
        other => other,
    }
}

/// `data` (whole blocks of `stored`) rewritten in [`runs_as`]'s format; `None` where that is
/// `stored` itself.
pub fn transcode(stored: GgmlType, data: &[u8]) -> Option<Vec<u8>> {
    let rewrite: fn(&[u8], &mut [u8]) = match stored {
        GgmlType::Q3K => q3k_as_q6k,
        _ => return None,
    };
    let (from, to) = (stored.block_layout().1, runs_as(stored).block_layout().1);
    let mut out = vec![0u8; data.len() / from * to];
    // A few thousand blocks a task: big tensors spread over the pool, small ones stay whole.
    const BLOCKS_A_TASK: usize = 4096;
    out.par_chunks_mut(to * BLOCKS_A_TASK)
        .zip(data.par_chunks(from * BLOCKS_A_TASK))
        .for_each(|(out, data)| {
            for (o, block) in out.chunks_exact_mut(to).zip(data.chunks_exact(from)) {
                rewrite(block, o);
            }
        });
    Some(out)
}

/// A Q3_K block (110 bytes) as the Q6_K block (210 bytes) of the same weights.
fn q3k_as_q6k(block: &[u8], out: &mut [u8]) {
    let mut q = [0i8; 256];
    let hmask = &block[..32];
    for g in 0..16 {
        let qs = &block[32 + 32 * (g / 8) + 16 * (g % 2)..][..16];
        let hm = &hmask[16 * (g % 2)..][..16];
        let (shift, bit) = (2 * ((g % 8) / 2), 4 * (g / 8) + (g % 8) / 2);
        for ((o, &b), &h) in q[16 * g..16 * g + 16].iter_mut().zip(qs).zip(hm) {
            *o = ((b >> shift) & 3) as i8 - if (h >> bit) & 1 == 0 { 4 } else { 0 };
        }
    }
    let scales = q3_k::scales(&block[96..108]).map(|s| s as i8 - 32);
    pack_q6k(&q, &scales, [block[108], block[109]], out);
}

/// The Q6_K block of weights `q` (each in −32..32), group scales `scales` and `d`, laid out as
/// `block_q6_K` (the inverse of its dequantization: see [`super::Q6K`]).
fn pack_q6k(q: &[i8; 256], scales: &[i8; 16], d: [u8; 2], out: &mut [u8]) {
    let u = |i: usize| (q[i] + 32) as u8;
    for half in 0..2 {
        let (at, ql_at, qh_at) = (128 * half, 64 * half, 128 + 32 * half);
        for l in 0..32 {
            let (u1, u2, u3, u4) = (u(at + l), u(at + l + 32), u(at + l + 64), u(at + l + 96));
            out[ql_at + l] = (u1 & 0x0F) | ((u3 & 0x0F) << 4);
            out[ql_at + l + 32] = (u2 & 0x0F) | ((u4 & 0x0F) << 4);
            out[qh_at + l] = (u1 >> 4) | ((u2 >> 4) << 2) | ((u3 >> 4) << 4) | ((u4 >> 4) << 6);
        }
    }
    for (o, &s) in out[192..208].iter_mut().zip(scales) {
        *o = s as u8;
    }
    out[208..210].copy_from_slice(&d);
}

#[cfg(test)]
mod tests {
    use super::super::{BlockFormat, Q3K, Q6K};
    use super::*;

    /// Blocks of random bytes whose `d` (at `d_at`) is a finite f16 between 2⁻¹⁰ and 2.
    fn random_blocks(bytes: usize, d_at: usize, count: usize) -> Vec<u8> {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut data: Vec<u8> = (0..bytes * count)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 24) as u8
            })
            .collect();
        for (i, block) in data.chunks_exact_mut(bytes).enumerate() {
            let d = half::f16::from_f32(2f32.powi(-10 + (i % 11) as i32) * (1.0 + (i % 7) as f32 / 8.0));
            block[d_at..d_at + 2].copy_from_slice(&d.to_le_bytes());
        }
        data
    }

    /// Each block of `from`, rewritten, has `to`'s same weights (bit for bit), group integers
    /// and group scales.
    fn assert_same_groups<From: BlockFormat, To: BlockFormat>(stored: GgmlType, data: &[u8]) {
        assert_eq!(From::GROUP, To::GROUP);
        let out = transcode(stored, data).expect("a rewritten format");
        let groups = From::BLOCK_ELEMS / From::GROUP;
        fn unpack<F: BlockFormat>(block: &[u8], groups: usize) -> (Vec<i8>, Vec<u32>, Vec<f32>) {
            let (mut w, mut scale, mut min) = (vec![0; F::BLOCK_ELEMS], vec![0f32; groups], vec![0f32; groups]);
            F::unpack_groups(block, &mut w, &mut scale, &mut min);
            (w, scale.iter().map(|s| s.to_bits()).collect(), min)
        }
        for (i, (a, b)) in data
            .chunks_exact(From::BLOCK_BYTES)
            .zip(out.chunks_exact(To::BLOCK_BYTES))
            .enumerate()
        {
            assert_eq!(unpack::<From>(a, groups), unpack::<To>(b, groups), "block {i}");
            let (mut x, mut y) = (vec![0f32; From::BLOCK_ELEMS], vec![0f32; From::BLOCK_ELEMS]);
            From::dequantize_block(a, &mut x);
            To::dequantize_block(b, &mut y);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&x), bits(&y), "block {i}");
        }
    }

    #[test]
    fn q3_k_runs_as_the_q6_k_of_the_same_weights() {
        assert_eq!(runs_as(GgmlType::Q3K), GgmlType::Q6K);
        // Enough blocks for several parallel tasks, and a last task of a few blocks.
        assert_same_groups::<Q3K, Q6K>(GgmlType::Q3K, &random_blocks(110, 108, 2 * 4096 + 5));
    }

    #[test]
    fn other_formats_are_not_rewritten() {
        for t in [
            GgmlType::Q4K,
            GgmlType::Q6K,
            GgmlType::Q2K,
            GgmlType::IQ4XS,
            GgmlType::F32,
        ] {
            assert_eq!(runs_as(t), t);
            assert!(transcode(t, &[]).is_none());
        }
    }
}
