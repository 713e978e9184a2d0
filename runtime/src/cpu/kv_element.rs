//! What a KV cache row's elements are stored as: f32, bf16 or IEEE half, as the graph's
//! `cache_dtype` says. Attention reads rows of any of them through the same kernels: each
//! element is widened to f32 exactly as it is loaded, so a row stored narrow gives the same
//! bits as the f32 row of its rounded values (the rounding happens once, when it is written),
//! and halving the bytes halves what attention reads from memory, which bounds decode at long
//! contexts.

use half::{bf16, f16};

/// An element type of cache rows.
pub trait KvElement: Copy + Default + Send + Sync + 'static {
    /// The stored value of `x` (rounded to nearest even).
    fn narrow(x: f32) -> Self;

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

impl KvElement for f32 {
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
impl KvElement for bf16 {
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
impl KvElement for f16 {
    #[inline(always)]
    fn narrow(x: f32) -> Self {
        f16::from_f32(x)
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
    }
}
