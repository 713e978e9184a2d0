//! The 32-weight formats' products for whole tiles of 16 tokens on AMX ([`crate::cpu::quant::amx`]),
//! the rest of a step's tokens going to the AVX-512 kernel.
//!
//! Per group, [`CHUNK`] blocks at a time: their stored weights are unpacked once into the
//! weight tiles' layout (rows of four weights of each of the sixteen rows: what the AVX-512
//! kernel holds in its registers, so the same [`nibble_chunk`] makes them), as signed bytes
//! `u − bias`; then each block of a 16-token tile is one `tdpbssd`, giving each (token, row)
//! the block's exact integer sum `Σ (u − bias)·qx`, which is the AVX-512 kernel's
//! `−bias·Σqx + Σ u·qx`. From there the float work is that kernel's, operation for operation
//! and in the same order (`main = fma(isum, d_w·d_x, main)` block by block, the minimums' chain
//! on its own, `main + mins` last), so a token's products are the same bits whichever kernel
//! computed them, and a step's size still does not change a token's logits.
//!
//! Why tiles pay: a `vpdpbusd` advances one token's sums with sixteen rows by four weights, a
//! `tdpbssd` sixteen tokens' by 32, and the unpacking of a block's weights is paid once a call
//! instead of once per four tokens. What remains per token and block is the float work (a
//! load, a convert, a multiply and an FMA for sixteen rows), which the AVX-512 kernel pays as
//! well, and the tile's store and reload of its sums: on the Xeon this was written on (one
//! core, a 1536×576 Q4_1 matrix, 128 tokens) 0.40 ms against the AVX-512 kernel's 0.60–0.70,
//! and at 16 tokens no faster once a step's other work counts, hence [`tiles::MIN_TOKENS`].

use super::x86::{nibble_chunk, table_vector};
use super::{group_block_bytes, scales_at, Activations, GROUP};
use crate::cpu::quant::amx::block32::{self, BLOCK, WEIGHT_BYTES};
use crate::cpu::quant::amx::tiles::{self, Sums, WeightTiles, TOKENS};
use crate::cpu::quant::int8::Q8Row;
use crate::cpu::quant::prefetch;
use std::arch::x86_64::*;
use std::ops::Range;

/// A step's quantized activations as the tiles load them: every token's quants in one buffer
/// (a token's row of `blocks · 32` bytes after the other's), and their block scales likewise.
pub(super) struct TiledActivations {
    q: Vec<i8>,
    d: Vec<f32>,
    /// What the rows' stored weights exceed the format's integers by (the layout's `bias`):
    /// the tiles take the weights as the integers themselves.
    bias: i8,
}

impl TiledActivations {
    /// `None` where the step does not take the tiles ([`tiles::pay_for`]).
    pub(super) fn new(acts: &[Q8Row], blocks: usize, bias: i32) -> Option<Self> {
        if !tiles::pay_for(acts.len()) {
            return None;
        }
        Some(Self {
            q: tiles::rows_together(acts.iter().map(|a| &a.q[..]), blocks * BLOCK),
            d: tiles::rows_together(acts.iter().map(|a| &a.d[..]), blocks),
            bias: bias as i8,
        })
    }
}

/// Writes the group's products with the first `16·⌊tokens / 16⌋` tokens into `out` (`[token,
/// GROUP]`, as [`super::group_products`]) and returns how many tokens that is: 0 where the
/// activations were not tiled ([`TiledActivations::new`]).
pub(super) fn products<const NIBBLES: bool, const FIFTH: bool, const MINS: bool, const TABLE: u8>(
    data: &[u8],
    acts: &Activations,
    out: &mut [f32],
) -> usize {
    let Some(tiled) = &acts.tiled else {
        return 0;
    };
    let tiles = acts.tokens() / TOKENS;
    let blocks = acts.blocks;
    assert!(data.len() >= blocks * group_block_bytes(NIBBLES, FIFTH, MINS));
    assert!(out.len() >= tiles * TOKENS * GROUP);
    let tables = Tables {
        q: tiled.q.as_ptr(),
        d: tiled.d.as_ptr(),
        dsum: acts.dsum.as_ptr(),
    };
    // SAFETY: `data` holds the group's `blocks` blocks and `out` the tiles' outputs (asserted);
    // the tables hold `blocks` entries (32 quants each) for every token (`activations` built
    // them for these rows); `tiled` exists only where AMX and AVX-512 run (`amx_int8`).
    unsafe {
        tiles_avx512::<NIBBLES, FIFTH, MINS, TABLE>(data.as_ptr(), blocks, tiled.bias, tables, tiles, out.as_mut_ptr())
    };
    tiles * TOKENS
}

/// A step's per-token tables, each `blocks` entries a token (`q`: `blocks · 32` bytes).
#[derive(Clone, Copy)]
struct Tables {
    q: *const i8,
    d: *const f32,
    dsum: *const f32,
}

/// The group's products for the step's tiles of tokens: [`CHUNK`] blocks at a time, each tile
/// of tokens in turn, so the chunk's unpacked weights (8 KiB) stay in L1 for every tile, and a
/// tile's sums stay in registers over the chunk.
///
/// # Safety
/// As [`products`] checks and promises.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn tiles_avx512<const NIBBLES: bool, const FIFTH: bool, const MINS: bool, const TABLE: u8>(
    data: *const u8,
    blocks: usize,
    bias: i8,
    tables: Tables,
    tiles: usize,
    out: *mut f32,
) {
    let bytes = group_block_bytes(NIBBLES, FIFTH, MINS);
    let scales_at = scales_at(NIBBLES, FIFTH);
    let mut weights = WeightTiles::<{ CHUNK * WEIGHT_BYTES }>::unwritten();
    // SAFETY: every pointer below stays inside what the caller promised; AMX is usable.
    unsafe {
        for t in 0..tiles * TOKENS {
            _mm512_storeu_ps(out.add(t * GROUP), _mm512_setzero_ps());
        }
        block32::configure();
        for first_block in (0..blocks).step_by(CHUNK) {
            let chunk = first_block..blocks.min(first_block + CHUNK);
            unpack::<NIBBLES, FIFTH, TABLE>(data, chunk.clone(), bytes, bias, weights.as_mut_ptr());
            for tile in 0..tiles {
                let at = Tile {
                    tables,
                    blocks,
                    first: tile * TOKENS,
                };
                let main = out.add(at.first * GROUP);
                let mut sums: [__m512; TOKENS] = std::array::from_fn(|r| _mm512_loadu_ps(main.add(r * GROUP)));
                tile_main(data, bytes, scales_at, weights.as_ptr(), chunk.clone(), at, &mut sums);
                for (r, sum) in sums.into_iter().enumerate() {
                    _mm512_storeu_ps(main.add(r * GROUP), sum);
                }
            }
        }
        tiles::release();
        if MINS {
            for tile in 0..tiles {
                let first = tile * TOKENS;
                let mins = tile_mins(
                    data,
                    bytes,
                    scales_at + 2 * GROUP,
                    tables.dsum.add(first * blocks),
                    blocks,
                );
                for (r, mins) in mins.into_iter().enumerate() {
                    let main = out.add((first + r) * GROUP);
                    _mm512_storeu_ps(main, _mm512_add_ps(_mm512_loadu_ps(main), mins));
                }
            }
        }
    }
}

/// Blocks unpacked at a time: their weight tiles take 8 KiB.
const CHUNK: usize = 16;

/// The weight tiles of the group's blocks `chunk`, signed (`u − bias`; `bias` 128 turns Q8_0's
/// and IQ4_NL's stored bytes back into their values), into `to` ([`WEIGHT_BYTES`] a block).
///
/// # Safety
/// `data` holds the group's blocks of `bytes` bytes, `chunk` among them, at most [`CHUNK`];
/// `to` has room for [`CHUNK`] tiles, aligned to a line; AVX-512 F/BW are enabled.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn unpack<const NIBBLES: bool, const FIFTH: bool, const TABLE: u8>(
    data: *const u8,
    chunk: Range<usize>,
    bytes: usize,
    bias: i8,
    to: *mut u8,
) {
    let (table, bias) = (table_vector::<TABLE>(), _mm512_set1_epi8(bias));
    for (i, b) in chunk.enumerate() {
        // SAFETY: block `b` lies in `data` (the caller); its tile in `to` (`i` < CHUNK).
        unsafe {
            let (block, to) = (data.add(b * bytes), to.add(i * WEIGHT_BYTES));
            // The group's weights come from memory (or L3) once a step: ask ahead, as the
            // AVX-512 kernel does.
            prefetch::block_ahead(block, bytes, 0, 1);
            let rows: [__m512i; 8] = match NIBBLES {
                true => {
                    let chunks: [[__m512i; 2]; 4] =
                        std::array::from_fn(|c| nibble_chunk::<FIFTH, TABLE>(block, c, table));
                    std::array::from_fn(|r| chunks[r % 4][r / 4])
                }
                false => std::array::from_fn(|r| _mm512_loadu_si512(block.add(64 * r) as *const _)),
            };
            for (r, row) in rows.into_iter().enumerate() {
                _mm512_store_si512(to.add(64 * r) as *mut _, _mm512_sub_epi8(row, bias));
            }
        }
    }
}

/// One tile of tokens: `first` and the fifteen after it.
#[derive(Clone, Copy)]
struct Tile {
    tables: Tables,
    blocks: usize,
    first: usize,
}

/// Adds blocks `chunk` to the tile's tokens' `main` sums with the group's sixteen rows (a
/// register a token).
///
/// The products of a block are stored and read back before the next block's are issued: on
/// the Xeon this was written on, issuing the next block's (or eight blocks') tiles before a
/// block's float work measured no faster (one core, 128 tokens: 0.46 ms against 0.46–0.55).
///
/// # Safety
/// Tiles configured; `weights` holds the chunk's weight tiles ([`unpack`]); the group's blocks
/// (`bytes` each, scales at `scales_at`) in `data`; the tables cover the tile.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn tile_main(
    data: *const u8,
    bytes: usize,
    scales_at: usize,
    weights: *const u8,
    chunk: Range<usize>,
    tile: Tile,
    main: &mut [__m512; TOKENS],
) {
    let stride = tile.blocks * BLOCK;
    let mut sums = Sums::new();
    // SAFETY: every pointer below stays inside what the caller promised.
    unsafe {
        let acts = tile.tables.q.add(tile.first * stride);
        for (i, b) in chunk.enumerate() {
            block32::load_weights(weights.add(i * WEIGHT_BYTES));
            block32::products(acts.add(b * BLOCK), stride, sums.as_mut_ptr());
            let scales = _mm512_cvtph_ps(_mm256_loadu_si256(data.add(b * bytes + scales_at) as *const __m256i));
            for (r, main) in main.iter_mut().enumerate() {
                let at = (tile.first + r) * tile.blocks + b;
                let isum = _mm512_load_si512(sums.token(r) as *const _);
                let scale = _mm512_mul_ps(scales, _mm512_set1_ps(*tile.tables.d.add(at)));
                *main = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, *main);
            }
        }
    }
}

/// The tile's tokens' minimum terms (`Σ m·d_x·Σqx`, block by block): `dsum` the first token's
/// `d·Σqx` entries, `blocks` a token.
///
/// # Safety
/// The group's blocks (`bytes` each, minimums at `mins_at`) in `data`; `dsum` covers the tile.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn tile_mins(
    data: *const u8,
    bytes: usize,
    mins_at: usize,
    dsum: *const f32,
    blocks: usize,
) -> [__m512; TOKENS] {
    let mut mins = [_mm512_setzero_ps(); TOKENS];
    for b in 0..blocks {
        // SAFETY: as the caller promises.
        unsafe {
            let m = _mm512_cvtph_ps(_mm256_loadu_si256(data.add(b * bytes + mins_at) as *const __m256i));
            for (r, mins) in mins.iter_mut().enumerate() {
                *mins = _mm512_fmadd_ps(m, _mm512_set1_ps(*dsum.add(r * blocks + b)), *mins);
            }
        }
    }
    mins
}
