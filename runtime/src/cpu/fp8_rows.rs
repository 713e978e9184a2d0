//! FP8 rows held as stored (`quant::fp8_blocks`: 32 E4M3 codes and their f32 scale a block)
//! widened to their f32 weights a few rows at a time, for the dense tile kernels to multiply
//! where the rows are still in cache (the tiles also widen chunks of them as they load them,
//! with the same vector steps): each weight is its code's value times its block's scale, the
//! number `GgmlType::F8E4M3B32.dequantize` gives.

use super::dense::DenseKernel;
use quant::fp8_blocks::{BLOCK_BYTES, BLOCK_ELEMS};

/// Rows widened at once: a multiple of every tile's rows; 16 rows of 8 192 weights are 512 KiB
/// of f32, which an L2 cache holds beside the activations.
pub const WIDENED_ROWS: usize = 16;

/// `blocks` (whole blocks) widened into `out` (32 weights a block), with `kernel`'s vectors;
/// `by_halves`: every block is known to widen by halves ([`widens_by_halves`]), so none is
/// checked again.
pub fn widen(kernel: DenseKernel, blocks: &[u8], out: &mut [f32], by_halves: bool) {
    debug_assert_eq!(blocks.len() / BLOCK_BYTES * BLOCK_ELEMS, out.len());
    debug_assert!(!by_halves || widens_by_halves(blocks));
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `kernel` is one this CPU runs (its features detected).
    unsafe {
        match kernel {
            DenseKernel::Avx512 => widen_avx512(blocks, out, by_halves),
            DenseKernel::Avx2 => widen_avx2(blocks, out, by_halves),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (kernel, by_halves);
        quant::GgmlType::F8E4M3B32.dequantize(blocks, out);
    }
}

/// Each code as an IEEE half 2⁸ times too small, in three vector operations: sign-extended to
/// 16 bits and shifted left by 7, its exponent and mantissa bits land in a half's (bias 15
/// against E4M3's 7), its sign in bits 14 and 15, and the mask keeps bit 15 and the magnitude.
/// Subnormal codes become subnormal halves alike. Widened to f32 and multiplied by 2⁸ times
/// the scale (exact: a power of two), each weight is the code's value times the scale, rounded
/// once, as `dequantize` computes it. A NaN code (`S.1111.111`) reads as 480, and a scale 2⁸
/// times over may overflow: blocks holding either are widened by the table
/// ([`widens_by_halves`] says which).
const HALF_FIELDS: i16 = 0xBF80u16 as i16;

/// Sixteen codes from `codes` as halves 2⁸ times too small (see [`HALF_FIELDS`]).
///
/// # Safety
/// The CPU has AVX2; `codes` has sixteen bytes after it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn halves16(codes: *const u8) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    // SAFETY: as the caller promises.
    unsafe {
        let words = _mm256_cvtepi8_epi16(_mm_loadu_si128(codes.cast()));
        _mm256_and_si256(_mm256_slli_epi16::<7>(words), _mm256_set1_epi16(HALF_FIELDS))
    }
}

/// Eight codes from `codes` as halves 2⁸ times too small.
///
/// # Safety
/// The CPU has AVX2; `codes` has eight bytes after it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn halves8(codes: *const u8) -> std::arch::x86_64::__m128i {
    use std::arch::x86_64::*;
    // SAFETY: as the caller promises.
    unsafe {
        let words = _mm_cvtepi8_epi16(_mm_loadl_epi64(codes.cast()));
        _mm_and_si128(_mm_slli_epi16::<7>(words), _mm_set1_epi16(HALF_FIELDS))
    }
}

/// A block's scale times 2⁸, which its codes read as halves are multiplied by.
#[inline(always)]
pub(super) fn half_scale(block: &[u8]) -> f32 {
    quant::fp8_blocks::scale(block) * 256.0
}

/// Whether a block widens by halves: no NaN code, and its scale finite 2⁸ times over.
fn block_widens_by_halves(block: &[u8]) -> bool {
    // A fold without an early exit, which LLVM vectorises.
    let nan = block[4..BLOCK_BYTES]
        .iter()
        .fold(false, |nan, &c| nan | (c & 0x7f == 0x7f));
    half_scale(block).is_finite() && !nan
}

/// Whether every block of `blocks` widens by halves (else the table widens some).
pub fn widens_by_halves(blocks: &[u8]) -> bool {
    blocks.chunks_exact(BLOCK_BYTES).all(block_widens_by_halves)
}

/// The block's sixteen codes at `at` (0 or 16) as halves, and its scale times 2⁸; `None`
/// where the table widens it (never where `by_halves` says every block widens by halves).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn halves_of(block: &[u8], by_halves: bool) -> Option<(impl Fn(usize) -> std::arch::x86_64::__m256i + '_, f32)> {
    if !by_halves && !block_widens_by_halves(block) {
        return None;
    }
    let codes = block[4..BLOCK_BYTES].as_ptr();
    // SAFETY: the caller's function has AVX2; `at` is 0 or 16, within the block's 32 codes.
    let halves = move |at: usize| unsafe { halves16(codes.add(at)) };
    Some((halves, half_scale(block)))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,f16c")]
unsafe fn widen_avx512(blocks: &[u8], out: &mut [f32], by_halves: bool) {
    use std::arch::x86_64::*;
    for (block, out) in blocks.chunks_exact(BLOCK_BYTES).zip(out.chunks_exact_mut(BLOCK_ELEMS)) {
        // SAFETY: this function has AVX-512F, AVX2 and F16C; `out` holds 32 floats.
        unsafe {
            let Some((halves, scale)) = halves_of(block, by_halves) else {
                quant::fp8_blocks::dequantize_block(block, out);
                continue;
            };
            for at in [0, 16] {
                let widened = _mm512_mul_ps(_mm512_cvtph_ps(halves(at)), _mm512_set1_ps(scale));
                _mm512_storeu_ps(out.as_mut_ptr().add(at), widened);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen_avx2(blocks: &[u8], out: &mut [f32], by_halves: bool) {
    use std::arch::x86_64::*;
    for (block, out) in blocks.chunks_exact(BLOCK_BYTES).zip(out.chunks_exact_mut(BLOCK_ELEMS)) {
        // SAFETY: this function has AVX2 and F16C; `out` holds 32 floats.
        unsafe {
            let Some((halves, scale)) = halves_of(block, by_halves) else {
                quant::fp8_blocks::dequantize_block(block, out);
                continue;
            };
            for at in [0, 16] {
                let words = halves(at);
                for (i, eight) in [_mm256_castsi256_si128(words), _mm256_extracti128_si256::<1>(words)]
                    .into_iter()
                    .enumerate()
                {
                    let widened = _mm256_mul_ps(_mm256_cvtph_ps(eight), _mm256_set1_ps(scale));
                    _mm256_storeu_ps(out.as_mut_ptr().add(at + 8 * i), widened);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quant::GgmlType;

    /// Every kernel gives `dequantize`'s bits for every code (NaN codes as NaN), under scales
    /// of both signs and of every magnitude a product keeps normal or makes subnormal: blocks
    /// checked one by one (some hold NaN codes or overflow 2⁸ times over, and take the table),
    /// and blocks known to widen by halves, unchecked.
    #[test]
    fn every_kernel_widens_as_dequantize_does() {
        let blocks = |known: bool| -> Vec<u8> {
            (0..16usize)
                .flat_map(|b| {
                    let codes: [u8; 32] = std::array::from_fn(|i| match (b * 32 + i) as u8 {
                        c if known && c & 0x7f == 0x7f => c ^ 1,
                        c => c,
                    });
                    let largest = if known { 1.0e30 } else { 3.0e38 };
                    let scale = [-0.75, 1.0 / (b + 1) as f32, 3.0e-36, 1.7e35, largest][b % 5];
                    quant::fp8_blocks::block(scale, &codes)
                })
                .collect()
        };
        for known in [false, true] {
            let blocks = blocks(known);
            assert_eq!(widens_by_halves(&blocks), known);
            let mut want = vec![0f32; 16 * 32];
            GgmlType::F8E4M3B32.dequantize(&blocks, &mut want);
            for kernel in DenseKernel::available() {
                let mut got = vec![0f32; want.len()];
                widen(kernel, &blocks, &mut got, known);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                        "{kernel:?}, known {known}, {i}: {g} vs {w}"
                    );
                }
            }
        }
    }
}
