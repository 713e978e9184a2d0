//! `x · Wᵀ` over dense weight rows (f32, or bf16, IEEE half, FP8 blocks or 4-bit blocks widened
//! as they are loaded): the matmul of models run at `--dtype f32`, `bf16` or `f16`, of
//! checkpoints' bf16 and half weights, of FP8 blocks for steps of few tokens, and of 4-bit
//! blocks.
//!
//! A register tile holds the products of a few weight rows with a few tokens, so each 16-float
//! chunk of a row or of a token is loaded once for the whole tile instead of once for every
//! product: a dot per (row, token) pair does two loads per FMA, a 4×4 tile half a load.
//!
//! Each product is the same bits as [`simd::dot`] of the widened row with the token: lane `i`
//! of a product's accumulator is `dot`'s `acc[i]`, fed the same FMAs over the same chunks,
//! then `dot`'s tail and its pairwise reduction. So a product does not depend on how many
//! tokens share the step or where a tile's edges fall (invariant 4), and the INT8-bound head's
//! rescoring, which calls `simd::dot` on a widened row, gives the plain head's logit.

use super::simd;
use half::{bf16, f16};
use quant::fp8_blocks::{BLOCK_BYTES, BLOCK_ELEMS};
use quant::{fp4_blocks, u4_blocks};
use std::ops::Range;

/// Weight rows of one dense kind, `cols` floats each, row after row.
#[derive(Clone, Copy)]
pub enum DenseRows<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
    /// FP8 blocks (`quant::fp8_blocks`, `cols` a multiple of 32) that all widen by halves
    /// (`fp8_rows::widens_by_halves`): each weight its code's value times its block's scale.
    Fp8(&'a [Fp8Byte]),
    /// 4-bit blocks of 32 (`quant::u4_blocks`, `cols` a multiple of 32): each weight its
    /// level times its block's scale plus its offset.
    U4B32(&'a [U4Byte<32>]),
    /// The same in blocks of 128 (`cols` a multiple of 128).
    U4B128(&'a [U4Byte<128>]),
    /// FP4 blocks (`quant::fp4_blocks`, `cols` a multiple of 32): each weight its code's value
    /// times its group's scale.
    Fp4(&'a [Fp4Byte]),
}

/// A byte of FP8 blocks (a scale's or a code's), as the tile kernels address them.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Fp8Byte(u8);

impl Fp8Byte {
    /// FP8 blocks as the tile kernels read them.
    pub fn of(blocks: &[u8]) -> &[Fp8Byte] {
        // SAFETY: `Fp8Byte` is a transparent `u8`.
        unsafe { std::slice::from_raw_parts(blocks.as_ptr().cast(), blocks.len()) }
    }
}

/// A byte of FP4 blocks (a scale's or two codes), as the tile kernels address them.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Fp4Byte(u8);

impl Fp4Byte {
    /// FP4 blocks as the tile kernels read them.
    pub fn of(blocks: &[u8]) -> &[Fp4Byte] {
        // SAFETY: `Fp4Byte` is a transparent `u8`.
        unsafe { std::slice::from_raw_parts(blocks.as_ptr().cast(), blocks.len()) }
    }
}

/// A byte of 4-bit blocks of `ELEMS` weights (a scale's, an offset's or two levels), as the
/// tile kernels address them.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct U4Byte<const ELEMS: usize>(u8);

impl<const ELEMS: usize> U4Byte<ELEMS> {
    /// 4-bit blocks as the tile kernels read them.
    pub fn of(blocks: &[u8]) -> &[U4Byte<ELEMS>] {
        // SAFETY: `U4Byte` is a transparent `u8`.
        unsafe { std::slice::from_raw_parts(blocks.as_ptr().cast(), blocks.len()) }
    }
}

/// Which tile kernel runs: both give `simd::dot`'s bits (its FMA form, which every CPU with
/// AVX2 and FMA runs); a CPU without them computes each product with `simd::dot` itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenseKernel {
    /// 256-bit registers: a product's sixteen lanes in two of them, tiles of 2 rows × 3 tokens.
    Avx2,
    /// 512-bit registers: a product's lanes in one, tiles of 4 rows × 4 tokens.
    Avx512,
}

impl DenseKernel {
    /// The fastest this CPU runs, as the attention kernels choose theirs (512-bit registers
    /// unless `BBC_AVX512=0`), or none where it lacks AVX2 and FMA.
    pub fn detected() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        {
            if simd::has_avx512() {
                return Some(Self::Avx512);
            }
            if simd::has_avx2_fma() {
                return Some(Self::Avx2);
            }
        }
        None
    }

    /// Every kernel this CPU runs, narrowest first (to check them against each other).
    #[cfg(test)]
    pub fn available() -> Vec<Self> {
        let mut kernels = Vec::new();
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            kernels.push(Self::Avx2);
            if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512vl") {
                kernels.push(Self::Avx512);
            }
        }
        kernels
    }

    /// Rows and tokens of the largest tile.
    fn tile(self) -> (usize, usize) {
        match self {
            Self::Avx2 => (2, 3),
            Self::Avx512 => (4, 4),
        }
    }
}

/// The most products in a tile.
const MAX_TILE: usize = 16;

/// The most bytes of activations a pass over a run's rows reads: that many stay in L2 while
/// every row tile of the run goes over them.
const ACTIVATION_BLOCK_BYTES: usize = 256 << 10;

/// `write(t, i, values)`: `values[j] = dot(W[run.start + i + j], x[t])`, for every token `t`
/// of `x` (`tokens` rows of `cols`) and every row of `run`, a tile's rows at a time.
pub fn products(
    kernel: DenseKernel,
    weights: DenseRows<'_>,
    cols: usize,
    run: Range<usize>,
    x: &[f32],
    tokens: usize,
    write: &mut dyn FnMut(usize, usize, &[f32]),
) {
    debug_assert_eq!(x.len(), tokens * cols);
    let (tile_rows, tile_tokens) = kernel.tile();
    let block_tokens = (ACTIVATION_BLOCK_BYTES / (cols.max(1) * 4) / tile_tokens).max(1) * tile_tokens;
    let mut values = [0f32; MAX_TILE];
    for block in (0..tokens).step_by(block_tokens) {
        let block = block..(block + block_tokens).min(tokens);
        for r0 in run.clone().step_by(tile_rows) {
            let rows = tile_rows.min(run.end - r0);
            for t0 in block.clone().step_by(tile_tokens) {
                let toks = tile_tokens.min(block.end - t0);
                let tile = Tile {
                    rows: r0..r0 + rows,
                    tokens: t0..t0 + toks,
                };
                tile.compute(kernel, weights, cols, x, &mut values);
                for (j, t) in tile.tokens.clone().enumerate() {
                    write(t, r0 - run.start, &values[j * rows..(j + 1) * rows]);
                }
            }
        }
    }
}

/// Some rows of W times some tokens: `values[j·rows + i]` is row `i`'s product with token `j`.
struct Tile {
    rows: Range<usize>,
    tokens: Range<usize>,
}

impl Tile {
    fn compute(
        &self,
        kernel: DenseKernel,
        weights: DenseRows<'_>,
        cols: usize,
        x: &[f32],
        values: &mut [f32; MAX_TILE],
    ) {
        match weights {
            DenseRows::F32(w) => self.compute_with(kernel, w, cols, x, values),
            DenseRows::Bf16(w) => self.compute_with(kernel, w, cols, x, values),
            DenseRows::F16(w) => self.compute_with(kernel, w, cols, x, values),
            DenseRows::Fp8(w) => {
                assert!(cols.is_multiple_of(BLOCK_ELEMS));
                self.compute_with(kernel, w, cols, x, values)
            }
            DenseRows::U4B32(w) => {
                assert!(cols.is_multiple_of(32));
                self.compute_with(kernel, w, cols, x, values)
            }
            DenseRows::U4B128(w) => {
                assert!(cols.is_multiple_of(128));
                self.compute_with(kernel, w, cols, x, values)
            }
            DenseRows::Fp4(w) => {
                assert!(cols.is_multiple_of(fp4_blocks::BLOCK_ELEMS));
                self.compute_with(kernel, w, cols, x, values)
            }
        }
    }

    fn compute_with<W: Widen>(
        &self,
        kernel: DenseKernel,
        w: &[W],
        cols: usize,
        x: &[f32],
        values: &mut [f32; MAX_TILE],
    ) {
        let stride = W::stride(cols);
        assert!(self.rows.end * stride <= w.len() && self.tokens.end * cols <= x.len());
        let row = |i: usize| w[(self.rows.start + i) * stride..].as_ptr();
        let token = |j: usize| x[(self.tokens.start + j) * cols..].as_ptr();
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `kernel` came from `DenseKernel::available`, so the CPU has its features; every
        // row and token pointer has `cols` elements after it (asserted above).
        unsafe {
            x86::tile(kernel, self.rows.len(), self.tokens.len(), row, token, cols, values)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("{kernel:?} is an x86 kernel");
    }
}

/// What weight rows are stored as, which the kernels widen to f32 as they load them: an
/// element a weight, or (FP8 blocks) bytes of blocks.
trait Widen: Copy {
    /// Elements of `Self` a row of `cols` weights takes.
    #[inline(always)]
    fn stride(cols: usize) -> usize {
        cols
    }
    /// Where weight `c` of a row lies, in elements of `Self` from the row's start.
    #[inline(always)]
    fn index(c: usize) -> usize {
        c
    }
    /// Weight `c` of the row at `row`.
    ///
    /// # Safety
    /// `row` has a row of at least `c + 1` weights after it.
    unsafe fn weight(row: *const Self, c: usize) -> f32;
    /// Sixteen weights from column `at` (a multiple of 16) of the row at `row`, widened, in
    /// one 512-bit register.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load512(row: *const Self, at: usize) -> std::arch::x86_64::__m512;
    /// Eight weights from column `at` (a multiple of 8), widened, in one 256-bit register.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load256(row: *const Self, at: usize) -> std::arch::x86_64::__m256;
}

impl Widen for f32 {
    unsafe fn weight(row: *const f32, c: usize) -> f32 {
        // SAFETY: as the caller promises.
        unsafe { *row.add(c) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load512(row: *const f32, at: usize) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller's kernel has AVX-512F, and the row has sixteen floats from `at`.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(row.add(at)) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load256(row: *const f32, at: usize) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's kernel has AVX, and the row has eight floats from `at`.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(row.add(at)) }
    }
}

/// A bf16 is an f32's top half: widened, each 16-bit weight goes to the top of a 32-bit lane.
/// That is `bf16::to_f32` for every number (NaNs aside, whose payload `to_f32` may quieten; a
/// NaN weight gives a NaN product either way).
impl Widen for bf16 {
    unsafe fn weight(row: *const bf16, c: usize) -> f32 {
        // SAFETY: as the caller promises.
        f32::from_bits((unsafe { *row.add(c) }.to_bits() as u32) << 16)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load512(row: *const bf16, at: usize) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's kernel has AVX-512F, and the row has sixteen bf16s from `at`.
        unsafe {
            let halves = _mm256_loadu_si256(row.add(at).cast());
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load256(row: *const bf16, at: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's kernel has AVX2, and the row has eight bf16s from `at`.
        unsafe {
            let halves = _mm_loadu_si128(row.add(at).cast());
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16))
        }
    }
}

/// An IEEE half widens exactly (`vcvtph2ps`, as `f16::to_f32`: subnormals, infinities and
/// NaNs included), half the bytes of an f32 row.
impl Widen for f16 {
    unsafe fn weight(row: *const f16, c: usize) -> f32 {
        // SAFETY: as the caller promises.
        unsafe { *row.add(c) }.to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load512(row: *const f16, at: usize) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's kernel has AVX-512F, and the row has sixteen halves from `at`.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(row.add(at).cast())) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load256(row: *const f16, at: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's kernel has F16C, and the row has eight halves from `at`.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(row.add(at).cast())) }
    }
}

/// FP8 blocks widen as `fp8_rows` widens them: a chunk's codes as halves 2⁸ times too small,
/// times 2⁸ times their block's scale (exact), so each weight is `dequantize`'s. Rows are
/// whole blocks, so a chunk of 8 or 16 weights lies in one block.
impl Widen for Fp8Byte {
    #[inline(always)]
    fn stride(cols: usize) -> usize {
        Self::block_start(cols)
    }
    #[inline(always)]
    fn index(c: usize) -> usize {
        Self::block_start(c) + 4 + c % BLOCK_ELEMS
    }
    unsafe fn weight(row: *const Fp8Byte, c: usize) -> f32 {
        // SAFETY: as the caller promises: the block holding weight `c` lies there.
        let block = unsafe { Self::block(row, c) };
        quant::fp8_blocks::code_values()[usize::from(block[4 + c % BLOCK_ELEMS])] * quant::fp8_blocks::scale(block)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load512(row: *const Fp8Byte, at: usize) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's kernel has AVX-512F and AVX2; the chunk's block lies within
        // the row.
        unsafe {
            let block = Self::block(row, at);
            let halves = super::fp8_rows::halves16(block.as_ptr().add(4 + at % BLOCK_ELEMS));
            _mm512_mul_ps(
                _mm512_cvtph_ps(halves),
                _mm512_set1_ps(super::fp8_rows::half_scale(block)),
            )
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load256(row: *const Fp8Byte, at: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's kernel has AVX2 and F16C; as above.
        unsafe {
            let block = Self::block(row, at);
            let halves = super::fp8_rows::halves8(block.as_ptr().add(4 + at % BLOCK_ELEMS));
            _mm256_mul_ps(
                _mm256_cvtph_ps(halves),
                _mm256_set1_ps(super::fp8_rows::half_scale(block)),
            )
        }
    }
}

impl Fp8Byte {
    /// Where the block holding weight `c` of a row starts, in bytes from the row's start.
    #[inline(always)]
    fn block_start(c: usize) -> usize {
        c / BLOCK_ELEMS * BLOCK_BYTES
    }

    /// The block holding weight `c` of the row at `row`.
    ///
    /// # Safety
    /// The row holds that block.
    #[inline(always)]
    unsafe fn block<'a>(row: *const Fp8Byte, c: usize) -> &'a [u8] {
        // SAFETY: as the caller promises.
        unsafe { std::slice::from_raw_parts(row.add(Self::block_start(c)).cast::<u8>(), BLOCK_BYTES) }
    }
}

/// 4-bit blocks widen each level to f32, times the block's scale, plus its offset, as
/// `u4_blocks::dequantize_block` computes them (a product and a sum, each rounded). Rows are
/// whole blocks, so a chunk of 8 or 16 weights lies in one block and one run of 32 of it: 16
/// are the low or the high nibbles of the run's 16 level bytes, 8 half of those.
impl<const ELEMS: usize> Widen for U4Byte<ELEMS> {
    #[inline(always)]
    fn stride(cols: usize) -> usize {
        Self::block_start(cols)
    }
    #[inline(always)]
    fn index(c: usize) -> usize {
        Self::block_start(c) + u4_blocks::level_at(c % ELEMS).0
    }
    unsafe fn weight(row: *const U4Byte<ELEMS>, c: usize) -> f32 {
        // SAFETY: as the caller promises: the block holding weight `c` lies there.
        let block = unsafe { Self::block(row, c) };
        let (scale, offset) = u4_blocks::scale_offset(block);
        f32::from(u4_blocks::level(block, c % ELEMS)) * scale + offset
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load512(row: *const U4Byte<ELEMS>, at: usize) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's kernel has AVX-512F; the chunk's block lies within the row.
        unsafe {
            let (block, scale, offset) = Self::scaled_block(row, at);
            let (bytes_at, high) = u4_blocks::level_at(at % ELEMS);
            let bytes = _mm_loadu_si128(block.add(bytes_at).cast());
            let wide = _mm512_cvtepu8_epi32(bytes);
            let levels = match high {
                false => _mm512_and_si512(wide, _mm512_set1_epi32(15)),
                true => _mm512_srli_epi32(wide, 4),
            };
            _mm512_add_ps(
                _mm512_mul_ps(_mm512_cvtepi32_ps(levels), _mm512_set1_ps(scale)),
                _mm512_set1_ps(offset),
            )
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load256(row: *const U4Byte<ELEMS>, at: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's kernel has AVX2; as above.
        unsafe {
            let (block, scale, offset) = Self::scaled_block(row, at);
            let (bytes_at, high) = u4_blocks::level_at(at % ELEMS);
            let bytes = _mm_loadl_epi64(block.add(bytes_at).cast());
            let wide = _mm256_cvtepu8_epi32(bytes);
            let levels = match high {
                false => _mm256_and_si256(wide, _mm256_set1_epi32(15)),
                true => _mm256_srli_epi32(wide, 4),
            };
            _mm256_add_ps(
                _mm256_mul_ps(_mm256_cvtepi32_ps(levels), _mm256_set1_ps(scale)),
                _mm256_set1_ps(offset),
            )
        }
    }
}

impl<const ELEMS: usize> U4Byte<ELEMS> {
    /// Bytes of a block.
    const BLOCK_BYTES: usize = u4_blocks::LEVELS_AT + ELEMS / 2;

    /// Where the block holding weight `c` of a row starts, in bytes from the row's start.
    #[inline(always)]
    fn block_start(c: usize) -> usize {
        c / ELEMS * Self::BLOCK_BYTES
    }

    /// The block holding weight `c` of the row at `row`.
    ///
    /// # Safety
    /// The row holds that block.
    #[inline(always)]
    unsafe fn block<'a>(row: *const U4Byte<ELEMS>, c: usize) -> &'a [u8] {
        // SAFETY: as the caller promises.
        unsafe { std::slice::from_raw_parts(row.add(Self::block_start(c)).cast::<u8>(), Self::BLOCK_BYTES) }
    }

    /// The start of the block holding weight `c` of the row at `row`, its scale and its offset,
    /// read in place (in the tiles' inner loop, where a slice's bounds checks and a call into
    /// `quant` would cost more than the widening).
    ///
    /// # Safety
    /// The row holds that block.
    #[inline(always)]
    unsafe fn scaled_block(row: *const U4Byte<ELEMS>, c: usize) -> (*const u8, f32, f32) {
        // SAFETY: as the caller promises: the block's first eight bytes are its scale and
        // offset, little-endian f32s (x86 is little-endian).
        unsafe {
            let block = row.add(Self::block_start(c)).cast::<u8>();
            let scale = block.cast::<f32>().read_unaligned();
            let offset = block.add(4).cast::<f32>().read_unaligned();
            (block, scale, offset)
        }
    }
}

/// FP4 blocks widen each code to its value (a table of the 16, signs included), times its
/// group's scale, as `fp4_blocks::dequantize_block` computes them (one product, rounded). Rows
/// are whole blocks, so a chunk of 8 or 16 weights lies in one block and one group of 16: the
/// low or the high nibbles of the block's 16 code bytes, under its first or second scale.
impl Widen for Fp4Byte {
    #[inline(always)]
    fn stride(cols: usize) -> usize {
        Self::block_start(cols)
    }
    #[inline(always)]
    fn index(c: usize) -> usize {
        Self::block_start(c) + fp4_blocks::CODES_AT + c % 16
    }
    unsafe fn weight(row: *const Fp4Byte, c: usize) -> f32 {
        // SAFETY: as the caller promises: the block holding weight `c` lies there.
        let block = unsafe { Self::block(row, c) };
        let e = c % fp4_blocks::BLOCK_ELEMS;
        fp4_blocks::CODE_VALUES[usize::from(fp4_blocks::code(block, e))] * fp4_blocks::scales(block)[e / 16]
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load512(row: *const Fp4Byte, at: usize) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's kernel has AVX-512F; the chunk's block lies within the row.
        unsafe {
            let (block, scale) = Self::scaled_group(row, at);
            let bytes = _mm_loadu_si128(block.add(fp4_blocks::CODES_AT).cast());
            let wide = _mm512_cvtepu8_epi32(bytes);
            let codes = match at % fp4_blocks::BLOCK_ELEMS {
                0 => _mm512_and_si512(wide, _mm512_set1_epi32(15)),
                _ => _mm512_srli_epi32(wide, 4),
            };
            let table = _mm512_loadu_ps(fp4_blocks::CODE_VALUES.as_ptr());
            _mm512_mul_ps(_mm512_permutexvar_ps(codes, table), _mm512_set1_ps(scale))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load256(row: *const Fp4Byte, at: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's kernel has AVX2; as above.
        unsafe {
            let (block, scale) = Self::scaled_group(row, at);
            let chunk = at % fp4_blocks::BLOCK_ELEMS;
            let bytes = _mm_loadl_epi64(block.add(fp4_blocks::CODES_AT + chunk % 16).cast());
            let wide = _mm256_cvtepu8_epi32(bytes);
            let codes = match chunk < 16 {
                true => _mm256_and_si256(wide, _mm256_set1_epi32(15)),
                false => _mm256_srli_epi32(wide, 4),
            };
            // The magnitude from the table's first eight, the sign bit (code bit 3) moved to
            // bit 31.
            let magnitudes = _mm256_loadu_ps(fp4_blocks::CODE_VALUES.as_ptr());
            let magnitude = _mm256_permutevar8x32_ps(magnitudes, codes);
            let sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(8)), 28));
            _mm256_mul_ps(_mm256_xor_ps(magnitude, sign), _mm256_set1_ps(scale))
        }
    }
}

impl Fp4Byte {
    /// Where the block holding weight `c` of a row starts, in bytes from the row's start.
    #[inline(always)]
    fn block_start(c: usize) -> usize {
        c / fp4_blocks::BLOCK_ELEMS * fp4_blocks::BLOCK_BYTES
    }

    /// The block holding weight `c` of the row at `row`.
    ///
    /// # Safety
    /// The row holds that block.
    #[inline(always)]
    unsafe fn block<'a>(row: *const Fp4Byte, c: usize) -> &'a [u8] {
        // SAFETY: as the caller promises.
        unsafe { std::slice::from_raw_parts(row.add(Self::block_start(c)).cast::<u8>(), fp4_blocks::BLOCK_BYTES) }
    }

    /// The start of the block holding weight `c` of the row at `row` and the scale of `c`'s
    /// group, read in place (as `U4Byte::scaled_block` reads its own).
    ///
    /// # Safety
    /// The row holds that block.
    #[inline(always)]
    unsafe fn scaled_group(row: *const Fp4Byte, c: usize) -> (*const u8, f32) {
        // SAFETY: as the caller promises: the block's first eight bytes are its two scales,
        // little-endian f32s (x86 is little-endian).
        unsafe {
            let block = row.add(Self::block_start(c)).cast::<u8>();
            let group = c % fp4_blocks::BLOCK_ELEMS / fp4_blocks::GROUP_ELEMS;
            (block, block.add(4 * group).cast::<f32>().read_unaligned())
        }
    }
}

/// `dot`'s tail and reduction for a tile whose chunks are summed in `lanes` (`lanes[i·T + j]`
/// for row `i` and token `j`, `T` tokens): the elements past the last whole chunk added into
/// their lanes, then the lanes reduced pairwise, into `values[j·R + i]`.
///
/// # Safety
/// Every pointer of `rows` and `tokens` has `cols` elements after it.
#[inline(never)]
unsafe fn finish_with_tails<W: Widen>(
    lanes: &[[f32; 16]; MAX_TILE],
    rows: &[*const W],
    tokens: &[*const f32],
    cols: usize,
    values: &mut [f32; MAX_TILE],
) {
    for (i, &w) in rows.iter().enumerate() {
        for (j, &x) in tokens.iter().enumerate() {
            let mut lanes = lanes[i * tokens.len() + j];
            for c in cols / 16 * 16..cols {
                // SAFETY: c < cols, and both pointers have `cols` elements after them (the
                // caller's promise).
                let (wc, xc) = unsafe { (W::weight(w, c), *x.add(c)) };
                lanes[c % 16] += wc * xc;
            }
            values[j * rows.len() + i] = simd::reduce(lanes);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{finish_with_tails, DenseKernel, Widen, MAX_TILE};
    use crate::cpu::quant::prefetch;
    use std::arch::x86_64::*;

    /// `simd::reduce` of eight lanes already summed pairwise once (`lane i + lane i+8`): the
    /// same additions in the same order, in registers.
    #[inline(always)]
    unsafe fn reduce8(v: __m256) -> f32 {
        unsafe {
            let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)))
        }
    }

    /// A tile of `rows` × `tokens` products into `values` (`values[j·rows + i]`).
    ///
    /// # Safety
    /// The CPU has `kernel`'s features; `row(i)` for `i < rows` and `token(j)` for `j < tokens`
    /// have `cols` elements after them; `rows` and `tokens` are at most `kernel.tile()`'s.
    pub(super) unsafe fn tile<W: Widen>(
        kernel: DenseKernel,
        rows: usize,
        tokens: usize,
        row: impl Fn(usize) -> *const W,
        token: impl Fn(usize) -> *const f32,
        cols: usize,
        values: &mut [f32; MAX_TILE],
    ) {
        // `$f::<W, R, T>` for the tile's `rows` and `tokens` as constants, each from 1 up.
        macro_rules! by_tokens {
            ($f:ident, $r:literal, [$($t:literal),*]) => {
                match tokens {
                    $($t => {
                        let rows: [*const W; $r] = std::array::from_fn(&row);
                        let toks: [*const f32; $t] = std::array::from_fn(&token);
                        // SAFETY: as the caller promises.
                        unsafe { $f::<W, $r, $t>(rows, toks, cols, values) }
                    })*
                    _ => unreachable!("a tile of {rows}×{tokens} for {kernel:?}"),
                }
            };
        }
        macro_rules! by_rows {
            ($f:ident, [$($r:literal),*], $tokens:tt) => {
                match rows {
                    $($r => by_tokens!($f, $r, $tokens),)*
                    _ => unreachable!("a tile of {rows}×{tokens} for {kernel:?}"),
                }
            };
        }
        match kernel {
            DenseKernel::Avx2 => by_rows!(tile256, [1, 2], [1, 2, 3]),
            DenseKernel::Avx512 => by_rows!(tile512, [1, 2, 3, 4], [1, 2, 3, 4]),
        }
    }

    /// `R` rows × `T` tokens with 512-bit registers: one accumulator a product, lane `i` being
    /// `dot`'s `acc[i]`.
    /// AVX-512VL, though no instruction here needs it, lets LLVM zero a register above the
    /// sixteenth: without it every accumulator starts from a VEX `vxorps` and so is held in
    /// the first sixteen registers, which with the weights spills one to the stack.
    #[target_feature(enable = "avx512f,avx512vl,avx2,f16c")]
    unsafe fn tile512<W: Widen, const R: usize, const T: usize>(
        rows: [*const W; R],
        tokens: [*const f32; T],
        cols: usize,
        values: &mut [f32; MAX_TILE],
    ) {
        // One flat array (`acc[i·T + j]`): LLVM kept nested arrays' registers shuffling
        // through the stack.
        let mut acc = [_mm512_setzero_ps(); MAX_TILE];
        for at in (0..cols / 16).map(|c| c * 16) {
            // SAFETY: at + 16 ≤ cols, within every row and token (the caller's promise).
            unsafe {
                // Software prefetch (`crate::cpu::quant::prefetch`): the same place `R` rows on,
                // in the tile read after this one (rows lie one after another), so its lines
                // arrive while this tile computes. bf16 rows ask for each line twice, which
                // costs less than a branch. Measured on SmolLM2 (bf16, batch 1 and 4, +42% and
                // +53%; f32 +0% and +33%) and a 1B Llama shape (bf16, +9% and +11%).
                for row in rows {
                    prefetch::line(row.wrapping_add(W::index(at) + R * W::stride(cols)).cast::<u8>());
                }
                let w: [__m512; R] = std::array::from_fn(|i| W::load512(rows[i], at));
                for (j, token) in tokens.iter().enumerate() {
                    let x = _mm512_loadu_ps(token.add(at));
                    for (i, &w) in w.iter().enumerate() {
                        acc[i * T + j] = _mm512_fmadd_ps(w, x, acc[i * T + j]);
                    }
                }
            }
        }
        // Constant indices only (LLVM keeps an array it indexes at run time in memory, and the
        // loop's accumulators with it): the tail's products go through memory instead.
        if cols.is_multiple_of(16) {
            for k in 0..R * T {
                let lo = _mm512_castps512_ps256(acc[k]);
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[k]), 1));
                // SAFETY: AVX-512F implies the AVX `reduce8` uses.
                values[k % T * R + k / T] = unsafe { reduce8(_mm256_add_ps(lo, hi)) };
            }
        } else {
            let mut lanes = [[0f32; 16]; MAX_TILE];
            for k in 0..R * T {
                // SAFETY: `lanes[k]` holds sixteen floats.
                unsafe { _mm512_storeu_ps(lanes[k].as_mut_ptr(), acc[k]) };
            }
            // SAFETY: the caller's promise.
            unsafe { finish_with_tails(&lanes, &rows, &tokens, cols, values) };
        }
    }

    /// `R` rows × `T` tokens with 256-bit registers: a product's lanes 0–7 in one accumulator
    /// and 8–15 in another. A row's two halves are loaded one after the other so that the
    /// accumulators, a half's weights and a token fit the sixteen registers.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile256<W: Widen, const R: usize, const T: usize>(
        rows: [*const W; R],
        tokens: [*const f32; T],
        cols: usize,
        values: &mut [f32; MAX_TILE],
    ) {
        // Product `k`'s lanes 0–7 in `acc[2k]`, 8–15 in `acc[2k + 1]`.
        let mut acc = [_mm256_setzero_ps(); 2 * MAX_TILE];
        for at in (0..cols / 16).map(|c| c * 16) {
            // As in `tile512`.
            for row in rows {
                prefetch::line(row.wrapping_add(W::index(at) + R * W::stride(cols)).cast::<u8>());
            }
            for half in 0..2 {
                let at = at + half * 8;
                // SAFETY: at + 8 ≤ cols, within every row and token (the caller's promise).
                unsafe {
                    let w: [__m256; R] = std::array::from_fn(|i| W::load256(rows[i], at));
                    for (j, token) in tokens.iter().enumerate() {
                        let x = _mm256_loadu_ps(token.add(at));
                        for (i, &w) in w.iter().enumerate() {
                            let k = 2 * (i * T + j) + half;
                            acc[k] = _mm256_fmadd_ps(w, x, acc[k]);
                        }
                    }
                }
            }
        }
        if cols.is_multiple_of(16) {
            for k in 0..R * T {
                let (lo, hi) = (acc[2 * k], acc[2 * k + 1]);
                // SAFETY: the CPU has AVX (implied by AVX2).
                values[k % T * R + k / T] = unsafe { reduce8(_mm256_add_ps(lo, hi)) };
            }
        } else {
            let mut lanes = [[0f32; 16]; MAX_TILE];
            for k in 0..R * T {
                // SAFETY: `lanes[k]` holds sixteen floats.
                unsafe {
                    _mm256_storeu_ps(lanes[k].as_mut_ptr(), acc[2 * k]);
                    _mm256_storeu_ps(lanes[k].as_mut_ptr().add(8), acc[2 * k + 1]);
                }
            }
            // SAFETY: the caller's promise.
            unsafe { finish_with_tails(&lanes, &rows, &tokens, cols, values) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Numbers of many magnitudes and both signs, so that rounding differs between orders.
    fn numbers(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let h = (i + seed * 7717).wrapping_mul(2654435761) >> 7;
                let mantissa = (h % 2001) as f32 / 1000.0 - 1.0;
                mantissa * [1e-3, 0.1, 1.0, 17.0][h / 2001 % 4]
            })
            .collect()
    }

    /// Every product of `run`'s rows with every token, as `products` writes them.
    fn all_products(
        kernel: DenseKernel,
        weights: DenseRows<'_>,
        cols: usize,
        run: Range<usize>,
        x: &[f32],
        tokens: usize,
    ) -> Vec<Vec<Option<f32>>> {
        let mut got = vec![vec![None; run.len()]; tokens];
        products(kernel, weights, cols, run, x, tokens, &mut |t, i, values| {
            for (j, &v) in values.iter().enumerate() {
                assert!(
                    got[t][i + j].replace(v).is_none(),
                    "product ({t}, {}) written twice",
                    i + j
                );
            }
        });
        got
    }

    fn check_against_dot(kernel: DenseKernel, weights: DenseRows<'_>, widened: &[f32], cols: usize, rows: usize) {
        for tokens in 1..=9 {
            let x = numbers(tokens * cols, tokens);
            // Whole and partial runs: tiles' row edges fall at different rows.
            for run in [0..rows, 1..rows, 3..rows - 1] {
                let got = all_products(kernel, weights, cols, run.clone(), &x, tokens);
                for (t, token) in x.chunks_exact(cols).enumerate() {
                    for (i, r) in run.clone().enumerate() {
                        let want = simd::dot(&widened[r * cols..(r + 1) * cols], token);
                        let got = got[t][i].expect("every product written");
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{kernel:?}, {cols} columns, row {r}, token {t} of {tokens}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// Each product is `simd::dot`'s bits for f32, bf16 and half rows, whatever the tile it falls
    /// in (ragged rows and tokens) and whether the width has a tail past the last whole chunk.
    #[test]
    fn products_are_simd_dots_bit_for_bit() {
        let kernels = DenseKernel::available();
        if kernels.is_empty() {
            eprintln!("skipped: this CPU runs no dense tile kernel (no AVX2 and FMA)");
        }
        let rows = 11;
        for kernel in kernels {
            for cols in [5, 16, 37, 64, 144] {
                let w = numbers(rows * cols, cols);
                check_against_dot(kernel, DenseRows::F32(&w), &w, cols, rows);
                let halves: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
                let widened: Vec<f32> = halves.iter().map(|h| h.to_f32()).collect();
                check_against_dot(kernel, DenseRows::Bf16(&halves), &widened, cols, rows);
                // Halves of every kind: subnormal, large, and values bf16 would round.
                let halves: Vec<f16> = w
                    .iter()
                    .enumerate()
                    .map(|(i, &v)| f16::from_f32(v * [1.0, 3e-5, 7e3][i % 3]))
                    .collect();
                let widened: Vec<f32> = halves.iter().map(|h| h.to_f32()).collect();
                check_against_dot(kernel, DenseRows::F16(&halves), &widened, cols, rows);
            }
        }
    }

    /// FP8 blocks widened as the tiles load them: each product is `simd::dot`'s bits over the
    /// blocks' weights (code × scale), for every code but NaN's, under scales of both signs
    /// and of magnitudes that keep products normal or make them subnormal.
    #[test]
    fn fp8_products_are_simd_dots_bit_for_bit() {
        let rows = 11;
        for kernel in DenseKernel::available() {
            for cols in [32, 96] {
                let blocks: Vec<u8> = (0..rows * cols / 32)
                    .flat_map(|b| {
                        let codes: [u8; 32] = std::array::from_fn(|i| match ((b * 32 + i) * 37 % 256) as u8 {
                            c if c & 0x7f == 0x7f => 0,
                            c => c,
                        });
                        let scale = [0.013, -2.5, 3.0e-36, 1.7e35, 1.0 / (b + 3) as f32][b % 5];
                        quant::fp8_blocks::block(scale, &codes)
                    })
                    .collect();
                assert!(crate::cpu::fp8_rows::widens_by_halves(&blocks));
                let mut widened = vec![0f32; rows * cols];
                quant::GgmlType::F8E4M3B32.dequantize(&blocks, &mut widened);
                check_against_dot(kernel, DenseRows::Fp8(Fp8Byte::of(&blocks)), &widened, cols, rows);
            }
        }
    }

    /// 4-bit blocks of either size widened as the tiles load them: each product is
    /// `simd::dot`'s bits over the blocks' weights (level × scale + offset), for every level,
    /// under scales of both signs, offsets of every zero point, and magnitudes that keep
    /// products normal or make them subnormal.
    #[test]
    fn u4_products_are_simd_dots_bit_for_bit() {
        use quant::u4_blocks::Size::{Of128, Of32};
        let rows = 11;
        for kernel in DenseKernel::available() {
            for (size, cols) in [(Of32, 32), (Of32, 96), (Of128, 128), (Of128, 384)] {
                let elems = size.elems();
                let blocks: Vec<u8> = (0..rows * cols / elems)
                    .flat_map(|b| {
                        let levels: Vec<u8> = (0..elems).map(|i| ((b * elems + i) * 7 / 3 % 16) as u8).collect();
                        let scale = [0.013, -2.5, 3.0e-38, 1.7e35, 1.0 / (b + 3) as f32][b % 5];
                        quant::u4_blocks::block(scale, -((b % 17) as f32) * scale, &levels)
                    })
                    .collect();
                let mut widened = vec![0f32; rows * cols];
                size.format().dequantize(&blocks, &mut widened);
                let weights = match size {
                    Of32 => DenseRows::U4B32(U4Byte::of(&blocks)),
                    Of128 => DenseRows::U4B128(U4Byte::of(&blocks)),
                };
                check_against_dot(kernel, weights, &widened, cols, rows);
            }
        }
    }

    /// FP4 blocks widened as the tiles load them: each product is `simd::dot`'s bits over the
    /// blocks' weights (code value × its group's scale), for every code, under scales of both
    /// signs and magnitudes that keep products normal or make them subnormal, the two groups'
    /// scales different.
    #[test]
    fn fp4_products_are_simd_dots_bit_for_bit() {
        let rows = 11;
        for kernel in DenseKernel::available() {
            for cols in [32, 96] {
                let blocks: Vec<u8> = (0..rows * cols / 32)
                    .flat_map(|b| {
                        let codes: [u8; 32] = std::array::from_fn(|i| ((b * 32 + i) * 7 / 3 % 16) as u8);
                        let scale = |k: usize| [0.013, -2.5, 3.0e-38, 1.7e35, 1.0 / (b + 3) as f32][(b + k) % 5];
                        quant::fp4_blocks::block([scale(0), scale(2)], &codes)
                    })
                    .collect();
                let mut widened = vec![0f32; rows * cols];
                quant::GgmlType::F4E2M1B32.dequantize(&blocks, &mut widened);
                check_against_dot(kernel, DenseRows::Fp4(Fp4Byte::of(&blocks)), &widened, cols, rows);
            }
        }
    }

    /// Enough tokens that `products` splits them into blocks: every product still written once.
    #[test]
    fn token_blocks_cover_every_token() {
        let cols = 4096;
        let tokens = ACTIVATION_BLOCK_BYTES / (cols * 4) * 2 + 3;
        for kernel in DenseKernel::available() {
            let w = numbers(5 * cols, 1);
            let x = numbers(tokens * cols, 2);
            let got = all_products(kernel, DenseRows::F32(&w), cols, 0..5, &x, tokens);
            for (t, token) in x.chunks_exact(cols).enumerate() {
                let want = simd::dot(&w[4 * cols..], token);
                assert_eq!(got[t][4].map(f32::to_bits), Some(want.to_bits()), "token {t}");
            }
        }
    }
}
