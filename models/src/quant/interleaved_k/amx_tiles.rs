//! Q4_K's products for whole tiles of 16 tokens on AMX ([`crate::quant::amx`]), the rest of a
//! step's tokens going to the AVX-512 kernel.
//!
//! The AVX-512 kernel sums each 32-weight sub-block `j` exactly, multiplies the sum by the
//! sub-block's 6-bit scale `sc_j` and adds: `total = Σ_j sc_j·Σ_{i∈j} u_i·qx_i`. A tile's sums
//! cannot be scaled per sub-block without storing and reloading them eight times a super-block,
//! so here the scales go into the weights instead: `sc = 8·hi + lo` with `hi, lo < 8`, and
//! `hi·u`, `lo·u` (at most 105) are signed bytes. Per group, every super-block's weights are
//! unpacked once as two sets of weight tiles (`hi·u` and `lo·u`, by the AVX-512 kernel's own
//! [`q4k_chunk`]); per super-block of a 16-token tile, four `tdpbssd` of 64 quants into each of
//! two sums give `Σ_i hi_i·u_i·qx_i` and `Σ_i lo_i·u_i·qx_i`, and `total = 8·hi_sum + lo_sum`
//! is the AVX-512 kernel's integer exactly. The minimums' term and the float work are that
//! kernel's own functions ([`q4k_mins_512`], [`scale_super_512`]) over the tile's sixteen
//! tokens, so a token's products are the same bits whichever kernel computed them.
//!
//! Q5_K (whose `hi·u` would reach 217, past a signed byte) keeps to the AVX-512 kernel.

use super::x86::{q4k_chunk, q4k_mins_512, scale_super_512};
use super::{q4k, SuperActivations, Token, GROUP, SUPER};
use crate::quant::amx::super256::{self, SPAN, WEIGHT_BYTES};
use crate::quant::amx::tiles::{self, Sums, TOKENS};
use crate::quant::int8::Q8KRow;
use crate::quant::prefetch;
use std::arch::x86_64::*;

/// Quarters of a super-block: activation tiles a super-block, each with two weight tiles.
const QUARTERS: usize = SUPER / SPAN;
/// Bytes of a super-block's unpacked weights: a `hi` and a `lo` tile a quarter.
const SUPER_TILES: usize = 2 * QUARTERS * WEIGHT_BYTES;

/// A step's quantized activations as the tiles load them: every token's quants in one buffer,
/// a token's `supers · 256` after the other's.
pub(super) struct TiledActivations {
    q: Vec<i8>,
}

impl TiledActivations {
    /// `None` where the step does not take the tiles ([`tiles::pay_for`]).
    pub(super) fn new(acts: &[Q8KRow], supers: usize) -> Option<Self> {
        if !tiles::pay_for(acts.len()) {
            return None;
        }
        Some(Self {
            q: tiles::rows_together(acts.iter().map(|a| &a.q[..]), supers * SUPER),
        })
    }
}

/// Writes the group's products with the first `16·⌊tokens / 16⌋` tokens into `out` (`[token,
/// GROUP]`) and returns how many tokens that is: 0 where the activations were not tiled.
/// `data` is the group's Q4_K super-blocks.
pub(super) fn products(data: &[u8], acts: &SuperActivations, out: &mut [f32]) -> usize {
    let Some(tiled) = &acts.tiled else {
        return 0;
    };
    let tiles = acts.acts.len() / TOKENS;
    assert!(data.len() >= acts.supers * q4k::GROUP_BLOCK);
    assert!(out.len() >= tiles * TOKENS * GROUP);
    // SAFETY: `data` holds the group's super-blocks and `out` the tiles' outputs (asserted);
    // every token's quants, scales and sums cover `supers` super-blocks (`activations` built
    // them for these rows); `tiled` exists only where AMX and AVX-512 run (`amx_int8`).
    unsafe { tiles_avx512(data.as_ptr(), tiled.q.as_ptr(), acts, tiles, out.as_mut_ptr()) };
    tiles * TOKENS
}

/// # Safety
/// As [`products`] checks and promises.
///
/// Super-block by super-block, each tile of tokens in turn: a super-block's unpacked weights
/// (8 KiB) stay in L1 for every tile, and what moves between tiles is their activations and
/// float sums. (Tiles outermost, each re-reading the group's unpacked weights from L2, was no
/// faster than the AVX-512 kernel: the weight tiles' loads took half its time.)
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn tiles_avx512(data: *const u8, q: *const i8, acts: &SuperActivations, tiles: usize, out: *mut f32) {
    let supers = acts.supers;
    let stride = supers * SUPER;
    let mut weights = Aligned([0u8; SUPER_TILES]);
    let (mut hi, mut lo) = (Sums::new(), Sums::new());
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
            let block = data.add(s * q4k::GROUP_BLOCK);
            unpack(block, &mut weights.0);
            for (tile, (tokens, main, low)) in state.iter_mut().enumerate() {
                let acts = q.add(tile * TOKENS * stride + s * SUPER);
                super256::start();
                for quarter in 0..QUARTERS {
                    let w = weights.0.as_ptr().add(2 * quarter * WEIGHT_BYTES);
                    super256::add_quarter(acts.add(quarter * SPAN), stride, w, w.add(WEIGHT_BYTES));
                }
                super256::store(hi.as_mut_ptr(), lo.as_mut_ptr());
                let total: [__m512i; TOKENS] = std::array::from_fn(|r| {
                    let hi = _mm512_load_si512(hi.token(r) as *const _);
                    let lo = _mm512_load_si512(lo.token(r) as *const _);
                    _mm512_add_epi32(_mm512_slli_epi32(hi, 3), lo)
                });
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

/// A super-block's unpacked weights, aligned for the tile loads.
#[repr(C, align(64))]
struct Aligned<T>(T);

/// A Q4_K super-block's weight tiles (`block`, the group's) into `to`: per quarter `q`
/// (sub-blocks `2q` and `2q + 1`, quads 0..8 of each as its rows 0..16), the tile of `hi·u`
/// and then the tile of `lo·u` (`sc = 8·hi + lo`, each row's own sub-block scale).
///
/// # Safety
/// `block` holds a group's Q4_K super-block; AVX-512 F/BW are enabled.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn unpack(block: *const u8, to: &mut [u8; SUPER_TILES]) {
    let to = to.as_mut_ptr();
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
