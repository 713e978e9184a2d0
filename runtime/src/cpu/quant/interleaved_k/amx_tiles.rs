//! Q4_K's, Q5_K's and Q6_K's products for whole tiles of 16 tokens on AMX
//! ([`crate::cpu::quant::amx`]), the rest of a step's tokens going to the AVX-512 kernel.
//!
//! The AVX-512 kernels sum each sub-block `j` exactly, multiply the sum by the sub-block's
//! integer scale `sc_j` and add: `total = Σ_j sc_j·Σ_{i∈j} u_i·qx_i`. A tile's sums cannot be
//! scaled per sub-block without storing and reloading them at every sub-block, so here the
//! scales go into the weights instead, split into parts small enough that each part times a
//! weight is a signed byte. Q4_K: `sc = 8·hi + lo` with `hi, lo < 8`, so `hi·u`, `lo·u` (at most
//! 105) are bytes; per group, every super-block's weights are unpacked once as two sets of
//! weight tiles (by the AVX-512 kernel's own [`q4k_chunk`]), a super-block of a 16-token tile is
//! four `tdpbssd` of 64 quants into each of two sums, and `total = 8·hi_sum + lo_sum` is the
//! AVX-512 kernel's integer exactly; the minimums' term and the float work are that kernel's own
//! functions ([`q4k_mins_512`], [`scale_super_512`]) over the tile's sixteen tokens. Q5_K
//! (weights up to 31) and Q6_K (signed 8-bit scales): the scales in four base-4 digits, four
//! sets and four sums, `S0 + 4·S1 + 16·S2 + 64·S3` ([`base4_digits`], [`digits_total`]). A
//! token's products are the same bits whichever kernel computed them.
//!
//! Q2_K, Q3_K and IQ4_XS keep to the AVX-512 kernels.

use super::x86::{q4k_chunk, q4k_mins_512, scale_super_512};
use super::{q4k, q6k, Format, SuperActivations, Token, GROUP, SUPER};
use crate::cpu::quant::amx::super256::{self, SPAN, WEIGHT_BYTES};
use crate::cpu::quant::amx::tiles::{self, Sums, WeightTiles, TOKENS};
use crate::cpu::quant::int8::Q8KRow;
use crate::cpu::quant::prefetch;
use std::arch::x86_64::*;

/// Quarters of a super-block: activation tiles a super-block, each with two weight tiles.
const QUARTERS: usize = SUPER / SPAN;

/// A step's quantized activations as the tiles load them: every token's quants in one buffer,
/// a token's `supers · 256` after the other's.
pub(super) struct TiledActivations {
    q: Vec<i8>,
}

impl TiledActivations {
    /// `None` where the step does not take the tiles ([`tiles::pay_for`]) or `format` has no
    /// tile kernel (Q2_K, Q3_K, IQ4_XS).
    pub(super) fn new(format: Format, acts: &[Q8KRow], supers: usize) -> Option<Self> {
        if !matches!(format, Format::Q4K | Format::Q5K | Format::Q6K) || !tiles::pay_for(acts.len()) {
            return None;
        }
        Some(Self {
            q: tiles::rows_together(acts.iter().map(|a| &a.q[..]), supers * SUPER),
        })
    }
}

/// Writes the group's products with the first `16·⌊tokens / 16⌋` tokens into `out` (`[token,
/// GROUP]`) and returns how many tokens that is: 0 where the activations were not tiled.
/// `data` is the group's super-blocks of `format`, one [`TiledActivations::new`] tiles.
pub(super) fn products(format: Format, data: &[u8], acts: &SuperActivations, out: &mut [f32]) -> usize {
    let Some(tiled) = &acts.tiled else {
        return 0;
    };
    let tiles = acts.acts.len() / TOKENS;
    let group_block = format.group_block();
    assert!(data.len() >= acts.supers * group_block);
    assert!(out.len() >= tiles * TOKENS * GROUP);
    // SAFETY: `data` holds the group's super-blocks and `out` the tiles' outputs (asserted);
    // every token's quants, scales and sums cover `supers` super-blocks (`activations` built
    // them for these rows); `tiled` exists only where AMX and AVX-512 run (`amx_int8`).
    unsafe {
        let (data, q, out) = (data.as_ptr(), tiled.q.as_ptr(), out.as_mut_ptr());
        match format {
            Format::Q4K => tiles_avx512::<false>(data, q, acts, tiles, out),
            Format::Q5K => tiles_avx512::<true>(data, q, acts, tiles, out),
            Format::Q6K => q6k_tiles_avx512(data, q, acts, tiles, out),
            _ => unreachable!("{format:?} activations are never tiled"),
        }
    };
    tiles * TOKENS
}

/// Q4_K's (Q5_K's: `FIFTH`) products for the step's tiles of tokens.
///
/// Super-block by super-block, each tile of tokens in turn: a super-block's unpacked weights
/// (8 KiB; Q5_K's 16) stay in L1 for every tile, and what moves between tiles is their
/// activations and float sums. (Tiles outermost, each re-reading the group's unpacked weights
/// from L2, was no faster than the AVX-512 kernel: the weight tiles' loads took half its time.)
///
/// Q5_K: its weights reach 31, so its scales go in as Q6_K's do, four base-4 digits (the top
/// one 0: the scales are below 64) and four sums.
///
/// # Safety
/// As [`products`] checks and promises.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn tiles_avx512<const FIFTH: bool>(
    data: *const u8,
    q: *const i8,
    acts: &SuperActivations,
    tiles: usize,
    out: *mut f32,
) {
    let supers = acts.supers;
    let stride = supers * SUPER;
    let group_block = if FIFTH { q4k::Q5_GROUP_BLOCK } else { q4k::GROUP_BLOCK };
    let mut weights = WeightTiles::<DIGITS_SUPER_TILES>::unwritten();
    let mut sums = [Sums::new(), Sums::new(), Sums::new(), Sums::new()];
    // Per tile: its tokens, and their running `main` and `low` sums.
    let mut state: Vec<([Token; TOKENS], [__m512; TOKENS], [__m512; TOKENS])> = (0..tiles)
        .map(|tile| {
            let tokens = std::array::from_fn(|r| acts.token(tile * TOKENS + r));
            (tokens, [_mm512_setzero_ps(); TOKENS], [_mm512_setzero_ps(); TOKENS])
        })
        .collect();
    // SAFETY: every pointer below stays inside what the caller promised; AMX is usable.
    unsafe {
        super256::configure();
        for s in 0..supers {
            let block = data.add(s * group_block);
            match FIFTH {
                true => unpack_q5k(block, weights.as_mut_ptr()),
                false => unpack(block, weights.as_mut_ptr()),
            }
            for (tile, (tokens, main, low)) in state.iter_mut().enumerate() {
                let acts = q.add(tile * TOKENS * stride + s * SUPER);
                super256::start();
                for quarter in 0..QUARTERS {
                    let acts = acts.add(quarter * SPAN);
                    match FIFTH {
                        true => super256::add_quarter4(acts, stride, weights.as_ptr().add(4 * quarter * WEIGHT_BYTES)),
                        false => {
                            let w = weights.as_ptr().add(2 * quarter * WEIGHT_BYTES);
                            super256::add_quarter(acts, stride, w, w.add(WEIGHT_BYTES))
                        }
                    }
                }
                let total: [__m512i; TOKENS] = match FIFTH {
                    true => {
                        super256::store4(sums.as_mut_ptr().cast());
                        std::array::from_fn(|r| digits_total(&sums, r))
                    }
                    false => {
                        let [hi, lo, ..] = &mut sums;
                        super256::store(hi.as_mut_ptr(), lo.as_mut_ptr());
                        std::array::from_fn(|r| {
                            let hi = _mm512_load_si512(hi.token(r) as *const _);
                            let lo = _mm512_load_si512(lo.token(r) as *const _);
                            _mm512_add_epi32(_mm512_slli_epi32(hi, 3), lo)
                        })
                    }
                };
                let mins = q4k_mins_512(block, tokens, s);
                let (d, dmin) = (block.add(q4k::D_AT), block.add(q4k::DMIN_AT));
                scale_super_512(d, dmin, tokens, s, (&total, &mins), (main, low));
            }
        }
        tiles::release();
        for (tile, (_, main, low)) in state.iter().enumerate() {
            for r in 0..TOKENS {
                _mm512_storeu_ps(out.add((tile * TOKENS + r) * GROUP), _mm512_sub_ps(main[r], low[r]));
            }
        }
    }
}

/// A Q4_K super-block's weight tiles (`block`, the group's) into `to`: per quarter `q`
/// (sub-blocks `2q` and `2q + 1`, quads 0..8 of each as its rows 0..16), the tile of `hi·u`
/// and then the tile of `lo·u` (`sc = 8·hi + lo`, each row's own sub-block scale).
///
/// # Safety
/// `block` holds a group's Q4_K super-block; `to` has room for two tiles a quarter, aligned to a
/// line; AVX-512 F/BW are enabled.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn unpack(block: *const u8, to: *mut u8) {
    for quarter in 0..QUARTERS {
        // SAFETY: the super-block's bytes lie in `block` (the caller); the tiles in `to`.
        unsafe {
            // Each row's scale of sub-blocks 2q and 2q + 1, in both 16-bit halves of its lane.
            let [hi_even, lo_even] = scale_halves(block, 2 * quarter);
            let [hi_odd, lo_odd] = scale_halves(block, 2 * quarter + 1);
            let (hi_tile, lo_tile) = (
                to.add(2 * quarter * WEIGHT_BYTES),
                to.add((2 * quarter + 1) * WEIGHT_BYTES),
            );
            for c in 0..8 {
                prefetch::block_ahead(block, q4k::GROUP_BLOCK, 8 * quarter + c, 32);
                let [even, odd] = q4k_chunk::<false>(block, quarter, c);
                let rows = [(c, even, hi_even, lo_even), (8 + c, odd, hi_odd, lo_odd)];
                for (row, u, hi, lo) in rows {
                    _mm512_store_si512(hi_tile.add(64 * row) as *mut _, times(u, hi));
                    _mm512_store_si512(lo_tile.add(64 * row) as *mut _, times(u, lo));
                }
            }
        }
    }
}

/// Sub-block `j`'s scales of the group's sixteen rows split as `sc = 8·hi + lo`: `[hi, lo]`, each
/// row's in both 16-bit halves of its lane (for [`times`]).
///
/// # Safety
/// `block` holds a group's Q4_K super-block; AVX-512 F/BW are enabled where this inlines.
#[inline(always)]
unsafe fn scale_halves(block: *const u8, j: usize) -> [__m512i; 2] {
    // SAFETY: the sixteen scale bytes of sub-block `j` lie in the super-block.
    let sc = unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(block.add(q4k::SCALES_AT + j * GROUP) as *const __m128i)) };
    let both = |v: __m512i| _mm512_or_si512(v, _mm512_slli_epi32(v, 16));
    [
        both(_mm512_srli_epi32(sc, 3)),
        both(_mm512_and_si512(sc, _mm512_set1_epi32(7))),
    ]
}

/// Each byte of `u` (below 16) times its lane's factor (below 8, in both 16-bit halves): the
/// products, below 106, as bytes.
///
/// # Safety
/// AVX-512 F/BW are enabled where this inlines.
#[inline(always)]
unsafe fn times(u: __m512i, factor: __m512i) -> __m512i {
    // SAFETY: as the caller promises.
    unsafe {
        let even = _mm512_mullo_epi16(_mm512_and_si512(u, _mm512_set1_epi16(0x00FF)), factor);
        let odd = _mm512_mullo_epi16(_mm512_srli_epi16(u, 8), factor);
        _mm512_or_si512(even, _mm512_slli_epi16(odd, 8))
    }
}

/// Bytes of a super-block's unpacked weights where the scales go in as four digits (Q5_K,
/// Q6_K): four tiles (one a digit) a quarter.
const DIGITS_SUPER_TILES: usize = 4 * QUARTERS * WEIGHT_BYTES;

/// Q6_K: `total = Σ_g sc_g·Σ_{i∈g} (u_i − 32)·qx_i` over the sixteen 16-weight sub-blocks
/// (`scaled_groups_avx512`'s integer), with the signed scales written in four base-4 digits,
/// `sc = d0 + 4·d1 + 16·d2 + 64·d3` (`d0..d2` in 0..4 and `d3` in −2..2: the digits of
/// `sc + 128` with 2 taken off the top one), so that each `d·(u − 32)` is a byte: four sets of
/// weight tiles, four sums, `total = S0 + 4·S1 + 16·S2 + 64·S3` exactly. Then, as that kernel,
/// `main = fma(total, d·dx, main)`.
///
/// # Safety
/// As [`products`] checks and promises.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn q6k_tiles_avx512(data: *const u8, q: *const i8, acts: &SuperActivations, tiles: usize, out: *mut f32) {
    let supers = acts.supers;
    let stride = supers * SUPER;
    let mut weights = WeightTiles::<DIGITS_SUPER_TILES>::unwritten();
    let mut sums = [Sums::new(), Sums::new(), Sums::new(), Sums::new()];
    let mut state: Vec<([Token; TOKENS], [__m512; TOKENS])> = (0..tiles)
        .map(|tile| {
            (
                std::array::from_fn(|r| acts.token(tile * TOKENS + r)),
                [_mm512_setzero_ps(); TOKENS],
            )
        })
        .collect();
    // SAFETY: every pointer below stays inside what the caller promised; AMX is usable.
    unsafe {
        super256::configure();
        for s in 0..supers {
            let block = data.add(s * q6k::GROUP_BLOCK);
            unpack_q6k(block, weights.as_mut_ptr());
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(block.add(q6k::D_AT) as *const __m256i));
            for (tile, (tokens, main)) in state.iter_mut().enumerate() {
                let acts = q.add(tile * TOKENS * stride + s * SUPER);
                super256::start();
                for quarter in 0..QUARTERS {
                    let w = weights.as_ptr().add(4 * quarter * WEIGHT_BYTES);
                    super256::add_quarter4(acts.add(quarter * SPAN), stride, w);
                }
                super256::store4(sums.as_mut_ptr().cast());
                for (r, main) in main.iter_mut().enumerate() {
                    let total = digits_total(&sums, r);
                    let dx = _mm512_set1_ps(*tokens[r].d.add(s));
                    *main = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, dx), *main);
                }
            }
        }
        tiles::release();
        for (tile, (_, main)) in state.iter().enumerate() {
            for (r, main) in main.iter().enumerate() {
                _mm512_storeu_ps(out.add((tile * TOKENS + r) * GROUP), *main);
            }
        }
    }
}

/// A Q6_K super-block's weight tiles (`block`, the group's) into `to`: per quarter `q` (quads
/// `16q..16q + 16` as rows 0..16, sub-blocks `4q..4q + 4`), one tile for each digit `d_i` of
/// the rows' scales, holding `d_i·(u − 32)`.
///
/// # Safety
/// `block` holds a group's Q6_K super-block; `to` has room for [`DIGITS_SUPER_TILES`] bytes,
/// aligned to a line; AVX-512 F/BW are enabled.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn unpack_q6k(block: *const u8, to: *mut u8) {
    for g in 0..SUPER / 16 {
        // SAFETY: the super-block's bytes lie in `block` (the caller); the tiles in `to`.
        unsafe {
            let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(block.add(q6k::SCALES_AT + g * GROUP) as *const __m128i));
            // The digits of sc + 128, 2 taken off the top one.
            let digits = base4_digits(_mm512_add_epi32(sc, _mm512_set1_epi32(128)), 2);
            let (quarter, first_row) = (g / 4, 4 * (g % 4));
            for j in 0..4 {
                prefetch::block_ahead(block, q6k::GROUP_BLOCK, 4 * g + j, 64);
                let u = _mm512_loadu_si512(block.add(64 * (4 * g + j)) as *const _);
                let w = _mm512_sub_epi8(u, _mm512_set1_epi8(32));
                for (i, digit) in digits.iter().enumerate() {
                    let tile = to.add((4 * quarter + i) * WEIGHT_BYTES);
                    _mm512_store_si512(tile.add(64 * (first_row + j)) as *mut _, times_signed(w, *digit));
                }
            }
        }
    }
}

/// Each signed byte of `w` times its lane's factor (in both 16-bit halves), the products
/// (small enough) as bytes.
///
/// # Safety
/// AVX-512 F/BW are enabled where this inlines.
#[inline(always)]
unsafe fn times_signed(w: __m512i, factor: __m512i) -> __m512i {
    // SAFETY: as the caller promises.
    unsafe {
        let even = _mm512_mullo_epi16(_mm512_srai_epi16(_mm512_slli_epi16(w, 8), 8), factor);
        let odd = _mm512_mullo_epi16(_mm512_srai_epi16(w, 8), factor);
        _mm512_or_si512(
            _mm512_and_si512(even, _mm512_set1_epi16(0x00FF)),
            _mm512_slli_epi16(odd, 8),
        )
    }
}

/// A Q5_K super-block's weight tiles (`block`, the group's) into `to`, laid out as Q4_K's
/// ([`unpack`]) but with four tiles a quarter, one for each base-4 digit of the rows' sub-block
/// scales (the top digit 0), holding `d_i·u` (at most 93).
///
/// # Safety
/// `block` holds a group's Q5_K super-block; `to` has room for [`DIGITS_SUPER_TILES`] bytes,
/// aligned to a line; AVX-512 F/BW are enabled.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn unpack_q5k(block: *const u8, to: *mut u8) {
    for quarter in 0..QUARTERS {
        // SAFETY: the super-block's bytes lie in `block` (the caller); the tiles in `to`.
        unsafe {
            let scale = |j: usize| {
                let at = block.add(q4k::SCALES_AT + j * GROUP);
                base4_digits(_mm512_cvtepu8_epi32(_mm_loadu_si128(at as *const __m128i)), 0)
            };
            let (even_digits, odd_digits) = (scale(2 * quarter), scale(2 * quarter + 1));
            for c in 0..8 {
                prefetch::block_ahead(block, q4k::Q5_GROUP_BLOCK, 8 * quarter + c, 32);
                let [even, odd] = q4k_chunk::<true>(block, quarter, c);
                for i in 0..4 {
                    let tile = to.add((4 * quarter + i) * WEIGHT_BYTES);
                    _mm512_store_si512(tile.add(64 * c) as *mut _, times(even, even_digits[i]));
                    _mm512_store_si512(tile.add(64 * (8 + c)) as *mut _, times(odd, odd_digits[i]));
                }
            }
        }
    }
}

/// The four base-4 digits of each lane's `value` (below 256), `top` taken off the last, each
/// in both 16-bit halves of its lane (for [`times`] and [`times_signed`]).
///
/// # Safety
/// AVX-512 F is enabled where this inlines.
#[inline(always)]
unsafe fn base4_digits(value: __m512i, top: i32) -> [__m512i; 4] {
    // SAFETY: as the caller promises.
    unsafe {
        std::array::from_fn(|i| {
            let d = _mm512_and_si512(
                _mm512_srlv_epi32(value, _mm512_set1_epi32(2 * i as i32)),
                _mm512_set1_epi32(3),
            );
            let d = if i == 3 {
                _mm512_sub_epi32(d, _mm512_set1_epi32(top))
            } else {
                d
            };
            _mm512_or_si512(_mm512_and_si512(d, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(d, 16))
        })
    }
}

/// Token `r`'s `S0 + 4·S1 + 16·S2 + 64·S3` from the four digit sums: the scaled integer total.
///
/// # Safety
/// AVX-512 F is enabled where this inlines.
#[inline(always)]
unsafe fn digits_total(sums: &[Sums; 4], r: usize) -> __m512i {
    // SAFETY: each sums buffer holds token `r`'s sixteen i32; AVX-512 F (the caller).
    unsafe {
        let sum = |i: usize| _mm512_load_si512(sums[i].token(r) as *const _);
        let times4_plus = |high: __m512i, low: __m512i| _mm512_add_epi32(_mm512_slli_epi32(high, 2), low);
        times4_plus(times4_plus(times4_plus(sum(3), sum(2)), sum(1)), sum(0))
    }
}
