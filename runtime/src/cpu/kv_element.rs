//! What a KV cache row's elements are stored as: f32, bf16, IEEE half or FP8 E4M3, as the graph's
//! `cache_dtype` says. Attention reads rows of any of them through the same kernels: each
//! element is widened to f32 exactly as it is loaded, so a row stored narrow gives the same
//! bits as the f32 row of its rounded values (the rounding happens once, when it is written),
//! and halving the bytes halves what attention reads from memory, which bounds decode at long
//! contexts.

use half::{bf16, f16};
use ir::F8E4M3;

/// An element type of cache rows.
///
/// # Safety
/// Every bit pattern of the type's size is one of its values, and all-zero bits are its
/// `default()`: cache pools are allocated as zeroed bytes and read as elements
/// (`line_aligned`).
pub unsafe trait KvElement: Copy + Default + Send + Sync + 'static {
    /// Whether widening costs enough beside the multiply-adds that attention should widen
    /// each cache row once for all the query heads of its KV head even where that takes more
    /// passes over the step (see `attention`'s split form); a load-and-convert instruction
    /// does not.
    const COSTLY_WIDENING: bool = false;

    /// The stored value of `x` (rounded to nearest even).
    fn narrow(x: f32) -> Self;

    /// `values` narrowed into `out` (as long), each as [`narrow`](Self::narrow) does it.
    fn narrow_into(values: &[f32], out: &mut [Self]) {
        for (o, &x) in out.iter_mut().zip(values) {
            *o = Self::narrow(x);
        }
    }

    /// The value, exactly.
    fn widen(self) -> f32;

    /// Eight elements at `p`, widened.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C; `p .. p + 8` is readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;

    /// Sixteen elements at `p`, widened.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `p .. p + 16` is readable.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

// SAFETY: plain bits, every pattern a value; zero bits are +0.
unsafe impl KvElement for f32 {
    #[inline(always)]
    fn narrow(x: f32) -> Self {
        x
    }

    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        // SAFETY: as the caller promises.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        // SAFETY: as the caller promises.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }
}

/// bf16 is the top half of an f32: widening shifts it into place.
// SAFETY: plain bits, every pattern a value; zero bits are +0.
unsafe impl KvElement for bf16 {
    #[inline(always)]
    fn narrow(x: f32) -> Self {
        bf16::from_f32(x)
    }

    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: as the caller promises (`bf16` is a `u16`).
        unsafe {
            let halves = _mm_loadu_si128(p.cast());
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(halves)))
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: as the caller promises.
        unsafe {
            let halves = _mm256_loadu_si256(p.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves)))
        }
    }
}

/// IEEE half: one conversion instruction, subnormals, infinities and NaN included.
// SAFETY: plain bits, every pattern a value; zero bits are +0.
unsafe impl KvElement for f16 {
    #[inline(always)]
    fn narrow(x: f32) -> Self {
        f16::from_f32(x)
    }

    /// Eight at a time through the same instruction (`half`'s slice conversion): a prefill's
    /// keys and values, converted one by one on the step's thread alone, were 1.8% of that
    /// thread's `perf` samples in a 128-token step.
    fn narrow_into(values: &[f32], out: &mut [Self]) {
        use half::slice::HalfFloatSliceExt;
        out.convert_from_f32_slice(values);
    }

    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: as the caller promises (`f16` is a `u16`).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: as the caller promises.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
}

/// FP8 E4M3 has no conversion instruction on these CPUs. Each code is sign-extended to 32
/// bits and shifted so its exponent and mantissa land in an f32's, the sign bit kept and the
/// rest masked off: a float 2¹²⁰ times too small with the right sign (a subnormal f32 for a
/// subnormal code), which one exact multiplication by 2¹²⁰ makes the value; then NaN for
/// `S.1111.111`: seven vector operations for sixteen codes, where one widens sixteen halves,
/// which makes attention over an FP8 cache slower than over a half one wherever the cache's
/// bytes are not the limit (`docs/cpu-backend.md`).
// SAFETY: plain bits, every pattern a value; zero bits are +0.
unsafe impl KvElement for F8E4M3 {
    const COSTLY_WIDENING: bool = true;

    #[inline(always)]
    fn narrow(x: f32) -> Self {
        F8E4M3::from_f32(x)
    }

    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: as the caller promises (`F8E4M3` is a `u8`).
        unsafe {
            let codes = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()));
            let bits = _mm256_and_si256(_mm256_slli_epi32::<20>(codes), _mm256_set1_epi32(F8_FIELDS));
            let value = _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(F8_SCALE));
            let magnitude_bits = _mm256_and_si256(bits, _mm256_set1_epi32(i32::MAX));
            let nan = _mm256_cmpeq_epi32(magnitude_bits, _mm256_set1_epi32(F8_NAN_FIELDS));
            let signed_nan = _mm256_xor_si256(bits, _mm256_set1_epi32(F8_NAN_FIELDS_TO_NAN));
            _mm256_blendv_ps(value, _mm256_castsi256_ps(signed_nan), _mm256_castsi256_ps(nan))
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: as the caller promises.
        unsafe {
            let codes = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()));
            let bits = _mm512_and_si512(_mm512_slli_epi32::<20>(codes), _mm512_set1_epi32(F8_FIELDS));
            let value = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(F8_SCALE));
            let nan = _mm512_cmpeq_epi32_mask(
                _mm512_and_si512(bits, _mm512_set1_epi32(i32::MAX)),
                _mm512_set1_epi32(F8_NAN_FIELDS),
            );
            let signed_nan = _mm512_mask_xor_epi32(
                _mm512_castps_si512(value),
                nan,
                bits,
                _mm512_set1_epi32(F8_NAN_FIELDS_TO_NAN),
            );
            _mm512_castsi512_ps(signed_nan)
        }
    }
}

/// 2¹²⁰: an E4M3 exponent (bias 7) read in an f32's exponent field (bias 127) is 120 short.
#[cfg(target_arch = "x86_64")]
const F8_SCALE: f32 = f32::from_bits((127 + 120) << 23);

/// The f32 bits a sign-extended code shifted left by 20 keeps: the sign, and the seven
/// magnitude bits as the low exponent bits and the top mantissa bits.
#[cfg(target_arch = "x86_64")]
const F8_FIELDS: i32 = 0x87F0_0000u32 as i32;

/// Those magnitude bits for the NaN code.
#[cfg(target_arch = "x86_64")]
const F8_NAN_FIELDS: i32 = 0x7F << 20;

/// What turns the NaN code's fields into f32's quiet NaN of the same sign, as `widen` gives.
#[cfg(target_arch = "x86_64")]
const F8_NAN_FIELDS_TO_NAN: i32 = F8_NAN_FIELDS ^ f32::NAN.to_bits() as i32;

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector loads widen every element as `widen` does, bit for bit, specials included.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_loads_widen_as_one_element_does() {
        fn check<T: KvElement>() {
            let values: Vec<T> = [
                0.0,
                -0.0,
                1.0,
                -2.5,
                65504.0,
                1e-7,
                3.1e-5,
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::NAN,
                1e30,
                -123.456,
                0.1,
                7.0,
                -1e-3,
                42.0,
            ]
            .iter()
            .map(|&x| T::narrow(x))
            .collect();
            let want: Vec<u32> = values.iter().map(|v| v.widen().to_bits()).collect();
            let mut got = [0f32; 16];
            if super::super::simd::has_avx2_fma() {
                // SAFETY: AVX2 and F16C checked; 16 elements readable.
                unsafe {
                    let lo = T::load8(values.as_ptr());
                    let hi = T::load8(values.as_ptr().add(8));
                    std::arch::x86_64::_mm256_storeu_ps(got.as_mut_ptr(), lo);
                    std::arch::x86_64::_mm256_storeu_ps(got.as_mut_ptr().add(8), hi);
                }
                assert_eq!(got.map(f32::to_bits).to_vec(), want, "load8");
            }
            if super::super::simd::has_avx512() {
                // SAFETY: AVX-512F checked; 16 elements readable.
                unsafe { std::arch::x86_64::_mm512_storeu_ps(got.as_mut_ptr(), T::load16(values.as_ptr())) };
                assert_eq!(got.map(f32::to_bits).to_vec(), want, "load16");
            }
        }
        check::<f32>();
        check::<bf16>();
        check::<f16>();
        check::<F8E4M3>();
    }

    /// A row narrowed at once is the row narrowed element by element, bit for bit: specials,
    /// ties, subnormals and values past the largest half, over a length no vector divides.
    #[test]
    fn a_row_narrows_as_its_elements_do() {
        fn check<T: KvElement + PartialEq + std::fmt::Debug>(values: &[f32]) {
            let mut row = vec![T::default(); values.len()];
            T::narrow_into(values, &mut row);
            let one_by_one: Vec<T> = values.iter().map(|&x| T::narrow(x)).collect();
            let bytes = |v: &[T]| {
                // SAFETY: plain bits of `size_of_val(v)` bytes (`KvElement`'s promise).
                unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }.to_vec()
            };
            assert_eq!(bytes(&row), bytes(&one_by_one), "{}", std::any::type_name::<T>());
        }
        let mut values = vec![
            0.0,
            -0.0,
            1.0 + f32::EPSILON,
            1.000_488_3,
            65504.0,
            65520.0,
            1e6,
            5.96e-8,
            2.98e-8,
            1e-7,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
        ];
        values.extend((0..37).map(|i| (i as f32 - 18.0) * 0.377));
        check::<f32>(&values);
        check::<bf16>(&values);
        check::<f16>(&values);
        check::<F8E4M3>(&values);
    }

    /// Every FP8 code, through both vector loads, widens as `widen` does.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_fp8_code_widens_alike() {
        let codes: Vec<F8E4M3> = (0..=255u8).map(F8E4M3).collect();
        let want: Vec<u32> = codes.iter().map(|c| c.widen().to_bits()).collect();
        let mut got = vec![0f32; 256];
        for (i, out) in got.chunks_exact_mut(16).enumerate() {
            if super::super::simd::has_avx512() {
                // SAFETY: AVX-512F checked; codes `16i..16i + 16` are readable.
                unsafe {
                    std::arch::x86_64::_mm512_storeu_ps(out.as_mut_ptr(), F8E4M3::load16(codes.as_ptr().add(16 * i)))
                };
                assert_eq!(
                    out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    want[16 * i..16 * i + 16],
                    "load16"
                );
            }
            if super::super::simd::has_avx2_fma() {
                for half in 0..2 {
                    let at = 16 * i + 8 * half;
                    // SAFETY: AVX2 checked; codes `at..at + 8` are readable.
                    unsafe {
                        std::arch::x86_64::_mm256_storeu_ps(
                            out.as_mut_ptr().add(8 * half),
                            F8E4M3::load8(codes.as_ptr().add(at)),
                        )
                    };
                }
                assert_eq!(
                    out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    want[16 * i..16 * i + 16],
                    "load8"
                );
            }
        }
    }
}
