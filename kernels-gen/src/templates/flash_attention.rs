//! Prefill attention on tensor cores (FlashAttention-2's schedule): the rows of one sequence
//! (a prompt chunk at positions `first..first + tokens`) against its bf16 KV cache, causal,
//! optionally windowed, grouped KV heads, the cache contiguous or paged.
//!
//! A block of 4 warps takes 64 query rows of one head, warp w rows 16w..16w+16. The keys go
//! by in tiles of 64: the block copies a tile's keys and values into shared memory
//! (`cp.async`, 16 bytes a copy; the next tile's copies in flight while the warps work on
//! this one, where two tiles fit), then each warp computes its 16×64 scores with
//! `mma.sync.m16n8k16` (queries rounded to bf16 in registers as A, keys as B by `ldmatrix`,
//! values too, transposed), masks them,
//! updates each row's running max and sum (online softmax, in f32), rescales its output
//! accumulators and adds `P·V` on the tensor cores: the scores' accumulator layout is the A
//! operand's layout, so P (rounded to bf16) never leaves registers. Each lane keeps partial
//! row sums, summed over its quad at the end, and the output is divided once.
//!
//! Where the split attention (`attention`) walks each row's keys one at a time on the CUDA
//! cores, reading the cache once per query row, this reads each key and value tile once per
//! 64 rows and does the arithmetic on the tensor cores: what long prompts need.
//!
//! A head past 128 dims keeps the block's queries in shared memory and splits the output's dims
//! between two blocks, each computing the scores itself: what keeps the registers of a thread
//! within 255 without spilling.
//!
//! The rows are one sequence's (contiguous or paged cache), or a batched step's rows of many
//! sequences (the serving plans' paged pool): each block then takes a tile of one sequence's
//! rows from the step's `query_tiles`, so no tile mixes sequences.
//!
//! Hopper's kernel (`flash_attention_wgmma`) shares this one's copies, masks, online softmax
//! and stores, and does the products on `wgmma`, two warpgroups a block; the B200's
//! (`flash_attention_tcgen05`) shares its copies and the block's keys.
//!
//! Requirements, checked by the caller: `head_dim` a multiple of 16 up to 256; the cache bf16,
//! f16 or FP8 ([`flash_attention_over`]: FP8 codes copied as stored, each tile widened to bf16
//! exactly, once, into a tile the warps share; a half cache's tiles multiplied as halves, the
//! queries and probabilities rounded to half, as llama.cpp's kernels over its f16 caches).

use super::cache_layout::CacheLayout;
use super::mma_operands::{b_block, lane_offset, x4_names, Quad};
use crate::dsl::*;

const THREADS: i64 = 128;
/// Query rows per block: 4 warps of mma's M = 16.
const TILE_Q: i64 = 64;
/// Query rows per block, as batched steps' `query_tiles` cut them.
pub const QUERY_TILE_ROWS: usize = TILE_Q as usize;
/// Keys per tile.
pub(super) const TILE_KEYS: i64 = 64;
/// Elements of `ty` per 16-byte copy: 8 bf16 or f16, 16 FP8 codes.
fn chunk(ty: Ty) -> i64 {
    16 / ty.bytes() as i64
}

/// The largest head it takes (registers: the output accumulators grow with it).
pub const MAX_HEAD_DIM: usize = 256;
/// The largest head whose query fragments stay in registers all along, and whose output a
/// block accumulates whole. Larger heads keep the block's queries in shared memory and split
/// the output's dims between two blocks, each computing the scores itself (at 256 the
/// fragments and the accumulators would take 256 registers a thread, and spill).
pub(super) const QUERIES_IN_REGISTERS: usize = 128;

/// Blocks sharing one tile of query rows, each accumulating a part of the output's dims.
fn parts(head_dim: usize) -> usize {
    head_dim.div_ceil(QUERIES_IN_REGISTERS)
}

pub(super) fn s_name(j: usize, i: usize) -> String {
    format!("s{j}_{i}")
}

pub(super) fn o_name(v: usize, i: usize) -> String {
    format!("o{v}_{i}")
}

fn q_name(step: usize, i: usize) -> String {
    format!("q{step}_{i}")
}

/// Whether the flash kernel takes a head of `head_dim` (over any layout).
pub fn supports(head_dim: usize) -> bool {
    head_dim.is_multiple_of(16) && head_dim <= MAX_HEAD_DIM
}

/// How a key or value tile lies in shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TileOrder {
    /// A key's dims in turn (`mma.sync` loads its fragments itself), keys [`row_pitch`]
    /// elements apart.
    RowMajor,
    /// 8×8 core matrices (`wgmma`'s unit): key `k`, dim `d` at element
    /// `k / 8 · 8·head_dim + d / 8 · 64 + k % 8 · 8 + d % 8`.
    CoreMatrices,
}

/// Elements of `ty` between keys of a row-major tile ([`TileOrder::RowMajor`]), and between
/// the rows of the queries a large head keeps in shared memory: the head, and 16 bytes more
/// (32 where that leaves a row a multiple of 32 bytes: FP8 heads of 16, 48, …). A fragment
/// load reads a dim pair of 8 keys or rows (or a dim of 4 keys' pairs) at once; with rows of
/// 128 to 512 bytes those would all fall in one bank, a row of 4 words past a multiple of 8
/// puts each 4 banks on from the one before, and the loads keep constant offsets from one
/// address a lane (a permutation of the chunks would not).
pub(super) fn row_pitch(head_dim: usize, ty: Ty) -> i64 {
    let bytes = head_dim * ty.bytes() + 16;
    let bytes = match bytes / 4 % 8 {
        4 => bytes,
        _ => bytes + 16,
    };
    (bytes / ty.bytes()) as i64
}

/// Key and value tiles a block keeps: two (the next tile's copies in flight while the warps
/// work on one) where the head fits, one for heads past 128 dims (whose queries take shared
/// memory too: 99 KiB in all at 256 dims, the RTX PRO 6000's most a block).
fn tile_buffers(head_dim: usize) -> i64 {
    match head_dim > QUERIES_IN_REGISTERS {
        true => 1,
        false => 2,
    }
}

/// The shared array a tile of `cache` elements lands in: `ks`/`vs` for bf16 and f16, which
/// the fragments read; `ks8`/`vs8` for FP8 codes, widened from there into `ks`/`vs`.
pub(super) fn staged(name: &str, cache: Ty) -> String {
    match cache {
        Ty::F8E4M3 => format!("{name}8"),
        _ => name.to_string(),
    }
}

/// The cooperative copy of the key tile at `j0` into `ks` and the value tile into `vs` from
/// element `at` on (zeros past `hi`), `keys` keys of a cache of `cache` elements (bf16 or f16;
/// FP8 codes go into `ks8`/`vs8`, row-major: [`staged`]): 16-byte chunks, `threads` copying,
/// each from chunk `first` (its index among them) on; committed as one group. Copy `c` writes
/// the tile's `c`-th 16 bytes of keys and values. Row-major, a key's chunks go in turn, keys
/// [`row_pitch`] apart. In core matrices a chunk is a core matrix's row (8 dims of one key),
/// the 8-key groups `16 · head_dim` bytes apart and a group's core matrices adjacent along
/// the dims, which `wgmma` reads K-major for the keys and MN-major for the values; copy `c`
/// takes key `c % 8` of its group, so a warp's copies fill 512 contiguous bytes (no bank
/// conflicts) from 8 keys' 64-byte runs.
pub(super) fn copy_tile(
    cache: Ty,
    layout: CacheLayout,
    (head_dim, keys, order): (usize, i64, TileOrder),
    (first, threads): (Expr, i64),
    j0: Expr,
    at: Expr,
) -> Vec<Stmt> {
    let chunk_len = chunk(cache);
    let chunks_per_row = head_dim as i64 / chunk_len;
    let (key, chunk) = match order {
        TileOrder::RowMajor => (var("c") / int(chunks_per_row), rem(var("c"), int(chunks_per_row))),
        TileOrder::CoreMatrices => (
            var("c") / int(head_dim as i64) * int(8) + rem(var("c"), int(8)),
            rem(var("c") / int(8), int(chunks_per_row)),
        ),
    };
    let dst_index = match order {
        TileOrder::RowMajor => {
            at.clone()
                + var("c") / int(chunks_per_row) * int(row_pitch(head_dim, cache))
                + var("chunk") * int(chunk_len)
        }
        TileOrder::CoreMatrices => at.clone() + var("c") * int(chunk_len),
    };
    let copy = |dst: String, src: &str| {
        Stmt::CpAsync(Box::new(AsyncCopy {
            dst,
            dst_index: dst_index.clone(),
            src: src.into(),
            src_index: var("base") + var("chunk") * int(chunk_len),
            valid: lt(var("key"), var("hi")),
        }))
    };
    vec![
        for_(
            "c",
            first,
            int(keys * chunks_per_row),
            int(threads),
            vec![
                let_("key", Ty::I32, j0 + key),
                let_("chunk", Ty::I32, chunk),
                // Clamped inside the cache where the key is past the end (its copy reads nothing).
                let_(
                    "base",
                    Ty::I32,
                    (layout.row(bin(BinOp::Min, var("key"), var("hi") - int(1))) * var("kv_heads") + var("kvh"))
                        * int(head_dim as i64),
                ),
                copy(staged("ks", cache), "k"),
                copy(staged("vs", cache), "v"),
            ],
        ),
        Stmt::CpAsyncCommit,
    ]
}

/// The start of a key tile's loop step: its tile in shared memory, landed and published
/// (`kv0`: its buffer's first element). With two buffers the next tile's copies are issued
/// first (the first tile's went before the loop) and stay in flight. An FP8 tile is then
/// widened into the bf16 tile the fragments read ([`widen_tile`]), or, with one buffer, loaded
/// widened straight from the cache ([`load_widened`]); the fragments read the bf16 tile from
/// the element [`tile_start`] says.
fn tile_head(layout: CacheLayout, head_dim: usize, cache: Ty) -> Vec<Stmt> {
    let tile = TILE_KEYS * row_pitch(head_dim, cache);
    let mut out = vec![let_(
        "buf",
        Ty::I32,
        rem(
            (var("j0") - var("first_tile")) / int(TILE_KEYS),
            int(tile_buffers(head_dim)),
        ),
    )];
    match (tile_buffers(head_dim), cache) {
        (1, Ty::F8E4M3) => out.extend(load_widened(layout, head_dim)),
        (1, _) => {
            out.extend(copy_tile(
                cache,
                layout,
                (head_dim, TILE_KEYS, TileOrder::RowMajor),
                (tid(), THREADS),
                var("j0"),
                int(0),
            ));
            out.push(Stmt::CpAsyncWait(0));
        }
        _ => {
            let next = var("j0") + int(TILE_KEYS);
            out.push(if_(
                lt(next.clone(), var("hi")),
                copy_tile(
                    cache,
                    layout,
                    (head_dim, TILE_KEYS, TileOrder::RowMajor),
                    (tid(), THREADS),
                    next,
                    (int(1) - var("buf")) * int(tile),
                ),
            ));
            // An empty group past the last tile keeps the count the wait below relies on.
            out.push(Stmt::CpAsyncCommit);
            out.push(Stmt::CpAsyncWait(1));
        }
    }
    out.push(Stmt::SyncThreads);
    out.push(let_("kv0", Ty::I32, var("buf") * int(tile)));
    if cache == Ty::F8E4M3 && tile_buffers(head_dim) > 1 {
        out.extend(widen_tile(
            (head_dim, TILE_KEYS, TileOrder::RowMajor),
            THREADS,
            (var("kv0"), int(0)),
        ));
        out.push(Stmt::SyncThreads);
    }
    out
}

/// Where the fragments find the tile: its buffer's start over a bf16 cache, the one widened
/// tile's over FP8.
fn tile_start(cache: Ty) -> Expr {
    match cache {
        Ty::F8E4M3 => int(0),
        _ => var("kv0"),
    }
}

/// Slot `c` of a tile's 8-element chunks as (key, first dim): a phase's 8 lanes take 8 keys'
/// same dims, so their 16-byte bf16 stores (and 8-byte FP8 loads, two chunks a phase) fall on
/// distinct banks at rows 4 words past a multiple of 8 apart, whatever the head.
fn chunk_slot(head_dim: usize) -> [Stmt; 3] {
    let chunks = head_dim as i64 / 8;
    [
        let_("group", Ty::I32, var("c") / int(8)),
        let_(
            "key",
            Ty::I32,
            var("group") / int(chunks) * int(8) + rem(var("c"), int(8)),
        ),
        let_("dim", Ty::I32, rem(var("group"), int(chunks)) * int(8)),
    ]
}

fn codes(prefix: &str) -> Vec<String> {
    (0..8).map(|i| format!("{prefix}{i}")).collect()
}

/// The FP8 tile of `keys` keys at element `from` of `ks8`/`vs8` (row-major, as copied)
/// widened (exactly) into the bf16 `ks`/`vs` from element `to`, laid out as `order` says, 8
/// codes a thread of the block's `threads` a step ([`chunk_slot`]: a phase's 16-byte stores fill
/// 8 rows of a row-major tile, or 128 contiguous bytes of one core matrix).
pub(super) fn widen_tile(
    (head_dim, keys, order): (usize, i64, TileOrder),
    threads: i64,
    (from, to): (Expr, Expr),
) -> Vec<Stmt> {
    let (pitch8, pitch16) = (row_pitch(head_dim, Ty::F8E4M3), row_pitch(head_dim, Ty::Bf16));
    let place = match order {
        TileOrder::RowMajor => var("key") * int(pitch16) + var("dim"),
        TileOrder::CoreMatrices => {
            var("key") / int(8) * int(8 * head_dim as i64) + var("dim") * int(8) + rem(var("key"), int(8)) * int(8)
        }
    };
    // The tile's elements from `start` on (nothing added to a start of 0).
    let at = |start: &Expr, e: Expr| match start {
        Expr::Int(0) => e,
        start => start.clone() + e,
    };
    let mut body = chunk_slot(head_dim).to_vec();
    for (src, dst, names) in [("ks8", "ks", codes("kc")), ("vs8", "vs", codes("vc"))] {
        body.push(load_vec(src, at(&from, var("key") * int(pitch8) + var("dim")), &names));
        body.push(store_vec(
            dst,
            at(&to, place.clone()),
            names.iter().map(|n| var(n)).collect(),
        ));
    }
    vec![for_("c", tid(), int(keys * head_dim as i64 / 8), int(threads), body)]
}

/// The FP8 tile at `j0` loaded from the cache and widened into the bf16 `ks`/`vs` on the way
/// (one buffer: nothing to overlap), 8 codes a thread a step ([`chunk_slot`]), zeros past
/// `hi`; the barrier after it is the caller's.
fn load_widened(layout: CacheLayout, head_dim: usize) -> Vec<Stmt> {
    let to = row_pitch(head_dim, Ty::Bf16);
    let mut body = chunk_slot(head_dim).to_vec();
    body.extend([
        let_("pos", Ty::I32, var("j0") + var("key")),
        // Clamped inside the cache where the key is past the end (its values are zeroed).
        let_(
            "base",
            Ty::I32,
            (layout.row(bin(BinOp::Min, var("pos"), var("hi") - int(1))) * var("kv_heads") + var("kvh"))
                * int(head_dim as i64),
        ),
    ]);
    for (src, dst, names) in [("k", "ks", codes("kc")), ("v", "vs", codes("vc"))] {
        body.push(load_vec(src, var("base") + var("dim"), &names));
        body.push(store_vec(
            dst,
            var("key") * int(to) + var("dim"),
            names
                .iter()
                .map(|n| select(lt(var("pos"), var("hi")), var(n), f(0.0)))
                .collect(),
        ));
    }
    vec![for_(
        "c",
        tid(),
        int(TILE_KEYS * head_dim as i64 / 8),
        int(THREADS),
        body,
    )]
}

/// The query element this lane holds at fragment `i` of 16-wide step `step` (rows g and g + 8
/// of the warp's 16, dims 2t, 2t + 1 and those + 8): its row of the chunk and its dim.
fn query_element(head_dim: usize, step: usize, i: usize) -> (Expr, Expr) {
    let row = var("r0") + int(if i % 4 >= 2 { 8 } else { 0 });
    let dim = int(16 * step as i64 + (i % 2) as i64 + if i >= 4 { 8 } else { 0 }) + var("t2");
    debug_assert!(16 * step < head_dim);
    (row, dim)
}

/// The queries, zero past `tokens`: this lane's fragments in registers, or for large heads
/// the block's 64 rows in shared memory (`qs`, rounded to the tiles' type as the fragments
/// would be).
fn load_queries(head_dim: usize) -> Vec<Stmt> {
    let at = |row: Expr, dim: Expr| row * var("q_stride") + var("h") * int(head_dim as i64) + dim;
    if head_dim > QUERIES_IN_REGISTERS {
        let hd = int(head_dim as i64);
        return vec![
            for_(
                "e",
                tid(),
                int(TILE_Q * head_dim as i64),
                int(THREADS),
                vec![
                    let_("row", Ty::I32, var("q0") + var("e") / hd.clone()),
                    let_("value", Ty::F32, f(0.0)),
                    if_(
                        lt(var("row"), var("rows_end")),
                        vec![assign("value", load("q", at(var("row"), rem(var("e"), hd.clone()))))],
                    ),
                    store(
                        "qs",
                        var("e") / hd.clone() * int(row_pitch(head_dim, Ty::Bf16)) + rem(var("e"), hd.clone()),
                        var("value"),
                    ),
                ],
            ),
            Stmt::SyncThreads,
        ];
    }
    let mut out = Vec::new();
    for step in 0..head_dim / 16 {
        for i in 0..8 {
            let (row, dim) = query_element(head_dim, step, i);
            out.push(let_(&q_name(step, i), Ty::F32, f(0.0)));
            out.push(if_(
                lt(row.clone(), var("rows_end")),
                vec![assign(&q_name(step, i), load("q", at(row, dim)))],
            ));
        }
    }
    out
}

/// The lane offsets of the `ldmatrix` rows (see `mma_operands`): `key_row` over a key tile
/// (a key's dims are B's column), `value_row` over a value tile (a key is a row of B,
/// transposed) and `query_row` over a large head's `qs` (A).
fn matrix_rows(head_dim: usize) -> Vec<Stmt> {
    let pitch = row_pitch(head_dim, Ty::Bf16);
    let mut out = vec![
        let_("key_row", Ty::I32, lane_offset(Quad::ColumnsThenRows, pitch)),
        let_("value_row", Ty::I32, lane_offset(Quad::RowsThenColumns, pitch)),
    ];
    if head_dim > QUERIES_IN_REGISTERS {
        out.push(let_(
            "query_row",
            Ty::I32,
            warp() * int(16 * pitch) + lane_offset(Quad::RowsThenColumns, pitch),
        ));
    }
    out
}

/// The warp's 16×64 scores: the head in 16-wide steps (a large head's query fragments of the
/// step read from `qs` once), each over 8 blocks of 8 keys, their fragments two blocks at a
/// time by `ldmatrix` from the tile at `tile0` (a key's dims are B's columns), `element`s.
fn scores((head_dim, element): (usize, MmaElement), tile0: Expr) -> Vec<Stmt> {
    let blocks = (TILE_KEYS / 8) as usize;
    let pitch = row_pitch(head_dim, Ty::Bf16);
    let mut out: Vec<Stmt> = (0..blocks)
        .flat_map(|j| (0..4).map(move |i| assign(&s_name(j, i), f(0.0))))
        .collect();
    for step in 0..head_dim / 16 {
        let a = match head_dim > QUERIES_IN_REGISTERS {
            true => {
                let names = x4_names("qf", &step.to_string());
                out.push(load_matrix(
                    "qs",
                    var("query_row") + int(16 * step as i64),
                    &names,
                    false,
                ));
                MmaOperand::Pairs(names)
            }
            false => MmaOperand::F32((0..8).map(|i| q_name(step, i)).collect()),
        };
        for j in 0..blocks {
            let names = x4_names("kf", &format!("{step}_{}", j / 2));
            if j % 2 == 0 {
                let at = tile0.clone() + var("key_row") + int(8 * j as i64 * pitch + 16 * step as i64);
                out.push(load_matrix("ks", at, &names, false));
            }
            out.push(Stmt::Mma(Box::new(MmaFragments {
                element,
                a: a.clone(),
                b: b_block(&names, j % 2),
                c: std::array::from_fn(|i| s_name(j, i)),
            })));
        }
    }
    out
}

/// Which key tiles' scores the causal and window mask goes over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Masking {
    /// Every tile's.
    EveryTile,
    /// Only those of tiles some row of the block does not see whole: a tile before the
    /// block's first row and inside its last row's window (all but the last tile or two of a
    /// long prompt's) skips the mask, whose compares and selects are as many instructions as
    /// the rest of the softmax.
    CutTiles,
}

/// Scale and mask (as `masking` says) the scores of the tile of `keys` keys at `j0`, and
/// update the running max `m_lo`/`m_hi` of the lane's two rows; `c_lo`/`c_hi` what the
/// earlier accumulators and sums are rescaled by; the scores become `exp(s − max)` (P), their
/// sums added to `l_lo`/`l_hi`.
pub(super) fn online_softmax(keys: i64, masking: Masking) -> Vec<Stmt> {
    let scores = || (0..(keys / 8) as usize).flat_map(|j| (0..4).map(move |i| (j, i)));
    let (mut scaled, mut masked) = (Vec::new(), Vec::new());
    for (j, i) in scores() {
        let row_offset = if i >= 2 { 8 } else { 0 };
        let key = var("j0") + int(8 * j as i64 + (i % 2) as i64) + var("t2");
        let query = var("pos0") + var("r0") + int(row_offset);
        let visible = and(
            and(lt(key.clone(), var("hi")), bin(BinOp::Le, key.clone(), query.clone())),
            or(
                bin(BinOp::Le, var("window"), int(0)),
                bin(BinOp::Gt, key, query - var("window")),
            ),
        );
        let s = s_name(j, i);
        scaled.push(assign(&s, var(&s) * var("scale")));
        masked.push(assign(
            &s,
            select(visible, var(&s) * var("scale"), f(f32::NEG_INFINITY)),
        ));
    }
    let tile_visible = and(
        bin(BinOp::Le, var("j0") + int(keys - 1), var("pos0") + var("q0")),
        or(
            bin(BinOp::Le, var("window"), int(0)),
            bin(BinOp::Gt, var("j0"), var("hi") - int(1) - var("window")),
        ),
    );
    let tile_max = |(j, i): (usize, usize)| {
        let max = format!("tile_max_{}", if i >= 2 { "hi" } else { "lo" });
        assign(&max, bin(BinOp::Max, var(&max), var(&s_name(j, i))))
    };
    let maxima = ["lo", "hi"].map(|half| let_(&format!("tile_max_{half}"), Ty::F32, f(f32::NEG_INFINITY)));
    let mut out = match masking {
        Masking::CutTiles => [
            vec![if_else(tile_visible, scaled, masked)],
            maxima.to_vec(),
            scores().map(tile_max).collect(),
        ]
        .concat(),
        // Each score's max taken as it is masked.
        Masking::EveryTile => maxima
            .into_iter()
            .chain(masked.into_iter().zip(scores()).flat_map(|(s, at)| [s, tile_max(at)]))
            .collect(),
    };
    for half in ["lo", "hi"] {
        let (max, m, m_use, c) = (
            format!("tile_max_{half}"),
            format!("m_{half}"),
            format!("m_use_{half}"),
            format!("c_{half}"),
        );
        // The row's max is spread over its quad's four lanes.
        for mask in [1, 2] {
            out.push(assign(&max, bin(BinOp::Max, var(&max), shfl_xor(var(&max), mask))));
        }
        out.push(let_(
            &format!("m_new_{half}"),
            Ty::F32,
            bin(BinOp::Max, var(&m), var(&max)),
        ));
        // A row with no visible key yet keeps max −∞: exponents against 0 give zeros, not NaN.
        out.push(let_(
            &m_use,
            Ty::F32,
            select(
                eq(var(&format!("m_new_{half}")), f(f32::NEG_INFINITY)),
                f(0.0),
                var(&format!("m_new_{half}")),
            ),
        ));
        out.push(let_(&c, Ty::F32, un(UnOp::Exp, var(&m) - var(&m_use))));
        out.push(assign(&m, var(&format!("m_new_{half}"))));
        out.push(assign(&format!("l_{half}"), var(&format!("l_{half}")) * var(&c)));
    }
    for j in 0..(keys / 8) as usize {
        for i in 0..4 {
            let half = if i >= 2 { "hi" } else { "lo" };
            let s = s_name(j, i);
            out.push(assign(&s, un(UnOp::Exp, var(&s) - var(&format!("m_use_{half}")))));
            let l = format!("l_{half}");
            out.push(assign(&l, var(&l) + var(&s)));
        }
    }
    out
}

/// Rescale the output accumulators by `c_lo`/`c_hi`, then add P·V: the keys in 4 steps of 16,
/// P's fragments the scores' accumulators (blocks 2u and 2u + 1), V's two blocks of dims at a
/// time by `ldmatrix`, transposed (a key is a row of B), from the tile at `tile0`, `element`s.
fn accumulate((head_dim, element): (usize, MmaElement), tile0: Expr) -> Vec<Stmt> {
    let part_dims = head_dim / parts(head_dim);
    let pitch = row_pitch(head_dim, Ty::Bf16);
    let mut out = Vec::new();
    for v in 0..part_dims / 8 {
        for i in 0..4 {
            let c = if i >= 2 { "c_hi" } else { "c_lo" };
            out.push(assign(&o_name(v, i), var(&o_name(v, i)) * var(c)));
        }
    }
    for u in 0..(TILE_KEYS / 16) as usize {
        // A = P[g or g + 8][16u + 2t, +1, +8, +9]: the accumulators of blocks 2u, 2u + 1.
        let a = MmaOperand::F32((0..8).map(|i| s_name(2 * u + i / 4, i % 4)).collect());
        for v in 0..part_dims / 8 {
            // B[k][n] = V[key 16u + k][dim 8v + n] (of the block's part).
            let names = x4_names("vf", &format!("{u}_{}", v / 2));
            if v % 2 == 0 {
                let at = tile0.clone() + var("value_row") + var("d0") + int(16 * u as i64 * pitch + 8 * v as i64);
                out.push(load_matrix("vs", at, &names, true));
            }
            out.push(Stmt::Mma(Box::new(MmaFragments {
                element,
                a: a.clone(),
                b: b_block(&names, v % 2),
                c: std::array::from_fn(|i| o_name(v, i)),
            })));
        }
    }
    out
}

/// The rows' sums over their quads, and the outputs divided by them where the row is inside.
pub(super) fn store_outputs(head_dim: usize) -> Vec<Stmt> {
    let mut out = Vec::new();
    for half in ["lo", "hi"] {
        let l = format!("l_{half}");
        for mask in [1, 2] {
            out.push(assign(&l, var(&l) + shfl_xor(var(&l), mask)));
        }
    }
    for v in 0..head_dim / parts(head_dim) / 8 {
        for i in 0..4 {
            let (half, row_offset) = if i >= 2 { ("hi", 8) } else { ("lo", 0) };
            let row = var("r0") + int(row_offset);
            let dim = var("d0") + int(8 * v as i64 + (i % 2) as i64) + var("t2");
            let at = (row.clone() * var("heads") + var("h")) * int(head_dim as i64) + dim;
            out.push(if_(
                lt(row, var("rows_end")),
                vec![store("out", at, var(&o_name(v, i)) / var(&format!("l_{half}")))],
            ));
        }
    }
    out
}

/// Which rows a block takes and where they sit: `q0` (its first step row), `rows_end` (past
/// its last row of the chunk), `pos0` (the position of step row 0 of that sequence: row `r`
/// is at `pos0 + r`), `h` and `d0`. One sequence's chunk (contiguous or paged cache) is cut
/// into tiles of `tile_rows`; a batched step's tiles come from its `query_tiles`.
pub(super) fn block_rows(layout: CacheLayout, (head_dim, parts): (usize, i64), tile_rows: i64) -> Vec<Stmt> {
    let tiles = query_tiles_expr(layout, tile_rows);
    let tile = rem(bid() / int(parts), tiles.clone());
    let mut out = vec![
        // Parts of one tile of rows vary fastest (they read the same keys), then the tiles,
        // then the heads.
        let_("d0", Ty::I32, rem(bid(), int(parts)) * int(head_dim as i64 / parts)),
        let_("h", Ty::I32, bid() / int(parts) / tiles),
    ];
    match layout {
        CacheLayout::Batched => {
            out.extend([
                let_("tile", Ty::I32, tile),
                let_("q0", Ty::I32, load("query_tiles", var("tile") * int(2))),
                let_(
                    "rows_end",
                    Ty::I32,
                    var("q0") + load("query_tiles", var("tile") * int(2) + int(1)),
                ),
            ]);
            out.extend(layout.prologue(var("q0")));
            out.push(let_("pos0", Ty::I32, layout.position(var("q0")) - var("q0")));
        }
        _ => out.extend([
            let_("q0", Ty::I32, tile * int(tile_rows)),
            let_("rows_end", Ty::I32, var("tokens")),
            let_("pos0", Ty::I32, var("first")),
        ]),
    }
    out
}

/// What each thread knows of its block's rows before the key tiles: its KV head and the keys
/// the block's rows see ([`block_keys`]), its lane's place in the fragments (`g`, `t2`), its
/// first row `r0` (warp w's rows are 16w..16w + 16 of the block's) and its rows' running max
/// and sum.
pub(super) fn row_state(tile_rows: i64) -> Vec<Stmt> {
    let mut out = block_keys(tile_rows);
    out.extend([
        let_("g", Ty::I32, lane() / int(4)),
        let_("t2", Ty::I32, rem(lane(), int(4)) * int(2)),
        let_("r0", Ty::I32, var("q0") + warp() * int(16) + var("g")),
        let_("m_lo", Ty::F32, f(f32::NEG_INFINITY)),
        let_("m_hi", Ty::F32, f(f32::NEG_INFINITY)),
        let_("l_lo", Ty::F32, f(0.0)),
        let_("l_hi", Ty::F32, f(0.0)),
    ]);
    out
}

/// The block's KV head `kvh` and the keys its rows see: `lo..hi`, up to its last row's
/// position, from its first row's window on, the tiles from `first_tile` (`lo` rounded down
/// to a tile).
pub(super) fn block_keys(tile_rows: i64) -> Vec<Stmt> {
    vec![
        let_("kvh", Ty::I32, var("h") / (var("heads") / var("kv_heads"))),
        let_(
            "hi",
            Ty::I32,
            var("pos0") + bin(BinOp::Min, var("rows_end"), var("q0") + int(tile_rows)),
        ),
        let_(
            "lo",
            Ty::I32,
            select(
                bin(BinOp::Gt, var("window"), int(0)),
                bin(BinOp::Max, int(0), var("pos0") + var("q0") - var("window") + int(1)),
                int(0),
            ),
        ),
        let_("first_tile", Ty::I32, var("lo") / int(TILE_KEYS) * int(TILE_KEYS)),
    ]
}

/// The blocks' tiles of query rows: the chunk's tiles, or for a batched step the most its
/// sequences' rows can make ([`max_query_tiles`]).
pub(super) fn query_tiles_expr(layout: CacheLayout, tile_rows: i64) -> Expr {
    match layout {
        CacheLayout::Batched => var("tokens") / int(tile_rows) + var("seqs"),
        _ => (var("tokens") + int(tile_rows - 1)) / int(tile_rows),
    }
}

/// The most tiles of `tile_rows` query rows a batched step of `rows` rows of `seqs` sequences
/// makes: each sequence's rows in tiles, the last one partial.
pub fn max_query_tiles(rows: usize, seqs: usize, tile_rows: usize) -> usize {
    rows / tile_rows + seqs
}

/// A batched step's `query_tiles` input for sequences of `segment_rows` rows each (in the
/// step's row order): each tile's first row and row count, a sequence's rows cut into tiles of
/// `tile_rows`, then empty tiles (count 0) up to [`max_query_tiles`], which the kernel's grid
/// covers.
pub fn query_tiles(segment_rows: &[usize], tile_rows: usize) -> Vec<i32> {
    let rows: usize = segment_rows.iter().sum();
    let count = max_query_tiles(rows, segment_rows.len(), tile_rows);
    let mut tiles = Vec::with_capacity(2 * count);
    let mut first = 0;
    for &len in segment_rows {
        for start in (0..len).step_by(tile_rows) {
            tiles.extend([(first + start) as i32, (len - start).min(tile_rows) as i32]);
        }
        first += len;
    }
    tiles.resize(2 * count, 0);
    tiles
}

/// The name of a batched plan's step input listing query tiles of `tile_rows` rows (the
/// `query_tiles` argument of the flash kernels taking such tiles).
pub fn query_tiles_input(tile_rows: usize) -> String {
    match tile_rows {
        QUERY_TILE_ROWS => "query_tiles".into(),
        rows => format!("query_tiles_{rows}"),
    }
}

/// The rows of a tile of the step input `name`, where it lists query tiles
/// ([`query_tiles_input`]'s inverse).
pub fn query_tile_rows(name: &str) -> Option<usize> {
    match name.strip_prefix("query_tiles")? {
        "" => Some(QUERY_TILE_ROWS),
        rows => rows.strip_prefix('_')?.parse().ok().filter(|&r| r > 0),
    }
}

/// The parameters every flash kernel over `layout` takes: `out` `[tokens, heads·head_dim]`
/// from `q` (rows `q_stride` apart) and the cache `k`/`v` of `cache` elements, the rows and
/// the head's shape, the cache's layout, and a batched step's `query_tiles` and `seqs`.
pub(super) fn params_over(layout: CacheLayout, cache: Ty) -> Vec<Param> {
    let tiles_input = match layout {
        CacheLayout::Batched => vec![buffer("query_tiles", Ty::I32, false), scalar("seqs", Ty::I32)],
        _ => vec![],
    };
    [
        super::attention::rows_and_cache_params(cache, "out"),
        layout.params(),
        tiles_input,
    ]
    .concat()
}

/// A block's rows (`block_rows`), then its work where it has rows: a batched step's spare
/// tiles (past its sequences') hold none, and the whole block skips them.
pub(super) fn guarded_by_rows(layout: CacheLayout, block_rows: Vec<Stmt>, work: Vec<Stmt>) -> Vec<Stmt> {
    [
        block_rows,
        match layout {
            CacheLayout::Batched => vec![if_(lt(var("q0"), var("rows_end")), work)],
            _ => work,
        },
    ]
    .concat()
}

/// The kernel over a cache in `layout`: `out` `[tokens, heads·head_dim]` from `q` (rows
/// `q_stride` apart) and the bf16 cache `k`/`v` (`[position][kv head][dim]` rows), which holds
/// the step's keys already. Contiguous or paged (one block table), the rows are one
/// sequence's, at positions `first..`; batched (the serving plans' paged pool), the rows of
/// `seqs` sequences, each sequence's consecutive, cut into the tiles `query_tiles` lists (see
/// [`query_tiles`], tiles of [`QUERY_TILE_ROWS`]), each row's table and position from
/// `row_table`/`row_pos`. `window` ≤ 0 means none; `scale` multiplies q·k. The mask goes
/// over the tiles `masking` says.
pub fn flash_attention(name: &str, origin: &str, layout: CacheLayout, head_dim: usize, masking: Masking) -> Kernel {
    flash_attention_over(name, origin, layout, (head_dim, Ty::Bf16), masking)
}

/// Whether [`flash_attention_over`] reads a cache of `cache` elements: bf16, f16, or FP8
/// codes, which widen exactly to bf16.
pub fn supports_cache(cache: Ty) -> bool {
    matches!(cache, Ty::Bf16 | Ty::F16 | Ty::F8E4M3)
}

/// The type the tensor cores take a cache of `cache` elements as: a half cache's own (an
/// IEEE half does not widen to bf16 exactly; the queries and probabilities round to half
/// too, keeping three more bits than bf16), bf16 for bf16 and FP8 ones.
pub(super) fn tile_element(cache: Ty) -> MmaElement {
    match cache {
        Ty::F16 => MmaElement::F16,
        _ => MmaElement::Bf16,
    }
}

/// How the kernels' origins name a cache of `cache` elements.
pub(super) fn describe_cache(cache: Ty) -> &'static str {
    match cache {
        Ty::F8E4M3 => "FP8 E4M3 (each tile widened to bf16 once in shared memory)",
        Ty::F16 => "f16 (multiplied as halves)",
        _ => "bf16",
    }
}

/// [`flash_attention`] over a cache of `cache` elements ([`supports_cache`]): FP8 tiles copied
/// as stored (half a bf16 tile's bytes) and widened once into a bf16 tile the warps share;
/// half tiles multiplied as halves ([`tile_element`]).
pub fn flash_attention_over(
    name: &str,
    origin: &str,
    layout: CacheLayout,
    (head_dim, cache): (usize, Ty),
    masking: Masking,
) -> Kernel {
    assert!(supports(head_dim), "head_dim {head_dim}");
    assert!(supports_cache(cache), "a {cache:?} cache");
    let parts = parts(head_dim) as i64;
    let element = tile_element(cache);
    let locals = (0..head_dim / parts as usize / 8)
        .flat_map(|v| (0..4).map(move |i| o_name(v, i)))
        .chain((0..(TILE_KEYS / 8) as usize).flat_map(|j| (0..4).map(move |i| s_name(j, i))))
        .map(|n| let_(&n, Ty::F32, f(0.0)));
    let tile = [
        tile_head(layout, head_dim, cache),
        // A warp whose 16 rows all lie past the tile's (a short sequence's tile, a chunk's
        // last) only helps copy the keys and values.
        vec![if_(
            lt(var("q0") + warp() * int(16), var("rows_end")),
            [
                scores((head_dim, element), tile_start(cache)),
                online_softmax(TILE_KEYS, masking),
                accumulate((head_dim, element), tile_start(cache)),
            ]
            .concat(),
        )],
        // Nobody refills the tiles before every warp is done with them.
        vec![Stmt::SyncThreads],
    ]
    .concat();
    let rows = [
        row_state(TILE_Q),
        load_queries(head_dim),
        locals.collect(),
        matrix_rows(head_dim),
        match tile_buffers(head_dim) {
            1 => vec![],
            _ => copy_tile(
                cache,
                layout,
                (head_dim, TILE_KEYS, TileOrder::RowMajor),
                (tid(), THREADS),
                var("first_tile"),
                int(0),
            ),
        },
        vec![for_("j0", var("first_tile"), var("hi"), int(TILE_KEYS), tile)],
        store_outputs(head_dim),
    ]
    .concat();
    // The tiles as copied (bf16 ones as the fragments read them); over FP8, the one widened
    // bf16 tile the fragments read beside them.
    let copied = match (cache, tile_buffers(head_dim)) {
        (Ty::F8E4M3, 1) => vec![],
        _ => vec![(cache, tile_buffers(head_dim))],
    };
    let widened = match cache {
        Ty::F8E4M3 => vec![(Ty::Bf16, 1)],
        _ => vec![],
    };
    let tiles = copied.into_iter().chain(widened).flat_map(|(ty, buffers)| {
        let len = (TILE_KEYS * row_pitch(head_dim, ty) * buffers) as usize;
        ["ks", "vs"].map(|n| SharedArray {
            name: staged(n, ty),
            ty,
            len,
        })
    });
    let queries = (head_dim > QUERIES_IN_REGISTERS).then(|| SharedArray {
        name: "qs".into(),
        ty: element.ty(),
        len: (TILE_Q * row_pitch(head_dim, Ty::Bf16)) as usize,
    });
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: causal prefill attention on tensor cores (mma.sync m16n8k16 {}, FlashAttention-2's schedule: \
             {TILE_Q} query rows a block, {TILE_KEYS}-key tiles through shared memory, online softmax in f32{}), \
             head_dim {head_dim}, {} {}",
            element.ptx(),
            match masking {
                Masking::EveryTile => "",
                Masking::CutTiles => ", the mask on tiles the block's rows do not see whole",
            },
            describe_cache(cache),
            layout.describe()
        ),
        params: params_over(layout, cache),
        shared: tiles.chain(queries).collect(),
        block_dim: THREADS as u32,
        grid: var("heads") * query_tiles_expr(layout, TILE_Q) * int(parts),
        body: guarded_by_rows(layout, block_rows(layout, (head_dim, parts), TILE_Q), rows),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A query-tiles step input's name gives back the rows it was named for; other step
    /// inputs are not query tiles.
    #[test]
    fn query_tile_inputs_are_named_by_their_rows() {
        for rows in [QUERY_TILE_ROWS, 128, 256] {
            assert_eq!(query_tile_rows(&query_tiles_input(rows)), Some(rows));
        }
        for other in [
            "row_table",
            "query_tiles_",
            "query_tiles_0",
            "query_tiles_x",
            "query_tiles128",
        ] {
            assert_eq!(query_tile_rows(other), None, "{other}");
        }
    }

    proptest! {
        /// Every row of the step lies in exactly one tile, of its own sequence's rows, at most
        /// a tile's rows long; the tiles fill the grid's count, spare ones empty.
        #[test]
        fn query_tiles_cover_each_sequences_rows_once(
            segments in prop::collection::vec(1usize..300, 1..12),
            tile_rows in prop::sample::select(vec![QUERY_TILE_ROWS, 128]),
        ) {
            let tiles = query_tiles(&segments, tile_rows);
            let rows: usize = segments.iter().sum();
            prop_assert_eq!(tiles.len(), 2 * max_query_tiles(rows, segments.len(), tile_rows));
            let sequence_of: Vec<usize> = segments
                .iter()
                .enumerate()
                .flat_map(|(s, &len)| std::iter::repeat_n(s, len))
                .collect();
            let mut covered = vec![0; rows];
            for tile in tiles.chunks(2) {
                let (first, count) = (tile[0] as usize, tile[1] as usize);
                prop_assert!(count <= tile_rows);
                for row in first..first + count {
                    covered[row] += 1;
                    prop_assert_eq!(sequence_of[row], sequence_of[first]);
                }
            }
            prop_assert!(covered.iter().all(|&c| c == 1));
        }
    }
}
