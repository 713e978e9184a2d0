//! Prefill attention on Blackwell's `tcgen05` (sm_100a): the rows, parameters and results of
//! `flash_attention`, heads up to 128 dims.
//!
//! A block of two warpgroups takes 128 query rows of one head, tcgen05.mma's M: row r of the
//! block is lane r of tensor memory, which warps w and w + 4 read (warp w reads lanes
//! 32·(w % 4)..+32), so each row has a thread in each warpgroup. The queries, rounded to
//! bf16, sit in shared memory in 8×8 core matrices; the key and value tiles land there by
//! 16-byte `cp.async` copies in a ring of two. For each 64-key tile i:
//!
//! 1. every thread runs the online softmax over its row's 64 scores (both of a row's threads
//!    alike), reading them from TMEM 8 at a time (tile i's columns, 64·(i % 2)..), and stores
//!    its half of the row's probabilities, bf16, into shared memory as `P·V`'s A;
//! 2. past a barrier (the probabilities stored, tile i + 1's copies landed) thread 0 issues
//!    `P·V` (m128n{head_dim}, the value tile MN-major) into a fresh accumulator at columns
//!    128.. and commits it (`values`), then tile i + 1's scores `S = Q·K` (m128n64, a
//!    `tcgen05.mma` a 16-dim slice, both operands K-major) into the other scores columns,
//!    committed (`scores`), so they run while the block goes on;
//! 3. every thread loads its half of its row's dims of `P·V` and folds them into its output
//!    registers, the earlier ones rescaled by the softmax's correction;
//! 4. tile i's buffer, its products done, takes tile i + 2's copies, which land during the
//!    next softmax; every thread arrives on `free`, which thread 0 waits on before the next
//!    `P·V` and scores overwrite what it read.
//!
//! The output accumulates in registers, tensor memory holding one tile's products: rescaling
//! an accumulator kept there would need `tcgen05.st`, which the DSL does not have.
//!
//! The tiles may instead load by TMA ([`Loads::Tma`], `flash_tma`): thread 0 issues tile
//! i + 2's boxes once tile i's `P·V` is done, announcing their bytes on the buffer's `landed`
//! mbarrier, and waits on it before it issues the tile's scores; no other thread copies.
//!
//! Requirements, checked by the caller: `head_dim` a multiple of 16 up to 128 ([`supports`]),
//! 64 or 128 by TMA (`flash_tma::supports`, whose paged caches also need blocks of a multiple
//! of `flash_tma::TMA_KEYS` positions); the cache bf16 or f16 (multiplied as halves, copied or
//! by TMA), or FP8 where the tiles are copied ([`flash_attention_tcgen05_over`]: each tile's
//! codes land in a slot of their own and are widened into the ring the step before its
//! scores).

use super::cache_layout::CacheLayout;
use super::flash_attention::{
    self as flash, block_keys, block_rows, copy_tile, guarded_by_rows, query_tiles_expr, TileOrder, TILE_KEYS,
};
use super::flash_attention_wgmma::{load_queries, ring_slot};
use super::{flash_tma, tma_gemm};
use crate::dsl::*;

/// Two warpgroups: a thread of each for every row.
const THREADS: i64 = 256;
/// Query rows per block: tcgen05.mma's M.
const TILE_Q: i64 = 128;
/// Query rows per block, as batched steps' `query_tiles` cut them.
pub const QUERY_TILE_ROWS: usize = TILE_Q as usize;
/// Key and value tiles in the ring.
const BUFFERS: i64 = 2;
/// Elements of one 8×8 core matrix of bf16 (8 rows of 16 bytes) and its bytes.
const CORE: i64 = 64;
const CORE_BYTES: u32 = 128;
/// TMEM columns allocated: two tiles' scores, 64 each, then a tile's `P·V` (up to 128).
const TMEM_COLUMNS: u32 = 256;
/// Where a tile's `P·V` sits in the block's TMEM columns (tile i's scores at 64·(i % 2)).
const VALUES_COLUMN: i64 = 2 * TILE_KEYS;
/// TMEM columns a `tcgen05.ld` takes at once.
const LOAD_COLUMNS: usize = 8;

/// Whether the kernel takes a head of `head_dim`: half its dims in each thread's registers.
pub fn supports(head_dim: usize) -> bool {
    flash::supports(head_dim) && head_dim <= flash::QUERIES_IN_REGISTERS
}

/// How the key and value tiles reach shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loads {
    /// Every thread's 16-byte `cp.async` copies, in core matrices.
    Copies,
    /// Thread 0's TMA boxes, 128-byte swizzled (`flash_tma`; heads it takes).
    Tma,
}

/// The mbarrier tile `tile`'s boxes land on (its buffer's), and the parity of its phase.
fn landed(tile: Expr) -> (MbarrierRef, Expr) {
    (
        tma_gemm::barrier("landed", rem(tile.clone(), int(BUFFERS))),
        rem(tile / int(BUFFERS), int(2)),
    )
}

/// Thread 0's wait for tile `tile`'s boxes.
fn wait_landed(tile: Expr) -> Stmt {
    let (barrier, parity) = landed(tile);
    Stmt::Mbarrier(Box::new(Mbarrier::Wait { barrier, parity }))
}

/// Tile `tile`'s keys and values (from key `first_key`) into the ring's buffer at `buffer`:
/// every thread's copies, or thread 0's boxes (for thread 0 alone). Over FP8 the copies are
/// of the codes, into the one slot they land in (`ks8`/`vs8`, row-major), whatever `buffer`:
/// [`widen`] takes them on into the ring.
fn load_tile(
    layout: CacheLayout,
    (head_dim, cache): (usize, Ty),
    loads: Loads,
    tile: Expr,
    (first_key, buffer): (Expr, Expr),
) -> Vec<Stmt> {
    match (loads, cache) {
        (Loads::Copies, Ty::F8E4M3) => copy_tile(
            cache,
            layout,
            (head_dim, TILE_KEYS, TileOrder::RowMajor),
            (tid(), THREADS),
            first_key,
            int(0),
        ),
        (Loads::Copies, _) => copy_tile(
            cache,
            layout,
            (head_dim, TILE_KEYS, TileOrder::CoreMatrices),
            (tid(), THREADS),
            first_key,
            buffer,
        ),
        (Loads::Tma, _) => flash_tma::load_tile(layout, (head_dim, TILE_KEYS), (first_key, buffer), landed(tile).0),
    }
}

/// Over FP8: the codes landed (every thread's copies waited for, then a barrier) widened by
/// the block into the ring's buffer at `buffer`, in core matrices (`flash::widen_tile`).
fn widen(head_dim: usize, buffer: Expr) -> Vec<Stmt> {
    [
        vec![Stmt::CpAsyncWait(0), Stmt::SyncThreads],
        flash::widen_tile(
            (head_dim, TILE_KEYS, TileOrder::CoreMatrices),
            THREADS,
            (int(0), buffer),
        ),
    ]
    .concat()
}

fn score(k: usize) -> String {
    format!("s{k}")
}

fn output(d: usize) -> String {
    format!("o{d}")
}

fn tc(op: Tcgen05) -> Stmt {
    Stmt::Tcgen05(Box::new(op))
}

/// This thread's row's TMEM cells from column `column` on, `names.len()` of them, 8 a load,
/// all issued before one wait.
fn load_row(column: Expr, names: &[String]) -> Vec<Stmt> {
    let mut out: Vec<Stmt> = names
        .chunks(LOAD_COLUMNS)
        .enumerate()
        .map(|(c, chunk)| {
            tc(Tcgen05::Load {
                address: var("tmem")
                    + bin(BinOp::Shl, rem(warp(), int(4)) * int(32), int(16))
                    + column.clone()
                    + int((c * LOAD_COLUMNS) as i64),
                names: chunk.to_vec(),
            })
        })
        .collect();
    out.push(tc(Tcgen05::WaitLd));
    out
}

/// The scores of key tile `tile` (its keys in the ring's buffer for it, as `loads` lays them)
/// into that tile's scores columns (`64 · (tile % 2)`), committed: for thread 0.
fn issue_scores(head_dim: usize, loads: Loads, tile: Expr) -> Vec<Stmt> {
    let hd = head_dim as u32;
    let mut issue = Vec::new();
    for step in 0..head_dim as i64 / 16 {
        let slice = int(2 * CORE * step);
        let operand = |array: &str, start: Expr| SmemMatrix {
            array: array.into(),
            start,
            lbo: CORE_BYTES,
            sbo: 16 * hd,
            swizzle: Swizzle::None,
        };
        let buffer = ring_slot((head_dim, TILE_KEYS), tile.clone(), BUFFERS);
        let keys = match loads {
            Loads::Copies => operand("ks", buffer + slice.clone()),
            Loads::Tma => flash_tma::key_slice(buffer, TILE_KEYS, step),
        };
        issue.push(tc(Tcgen05::Mma(Box::new(TmemMma {
            tmem: var("tmem") + scores_column(tile.clone()),
            a: operand("qs", slice.clone()),
            b: keys,
            b_major: Major::K,
            n: TILE_KEYS as u32,
            accumulate: Expr::Bool(step > 0),
        }))));
    }
    issue.push(tc(Tcgen05::Commit {
        barrier: tma_gemm::barrier("scores", int(0)),
    }));
    issue
}

/// The first of key tile `tile`'s scores columns: the tiles alternate between two.
fn scores_column(tile: Expr) -> Expr {
    rem(tile, int(2)) * int(TILE_KEYS)
}

/// `P·V` for the value tile at `kv0` into the values' columns, the keys in 4 slices of 16: A
/// the probabilities in `ps` (K-major, 8-row groups 1 KiB apart), B the value tile MN-major
/// (copied, a core matrix 8 keys of 8 dims: the next 8 keys `8 × head_dim` elements on, the
/// next 8 dims a core matrix on; or as TMA lands it); committed: for thread 0.
fn issue_values(head_dim: usize, loads: Loads) -> Vec<Stmt> {
    let mut issue = Vec::new();
    for u in 0..TILE_KEYS / 16 {
        let values = match loads {
            Loads::Copies => SmemMatrix {
                array: "vs".into(),
                start: var("kv0") + int(16 * head_dim as i64 * u),
                lbo: 16 * head_dim as u32,
                sbo: CORE_BYTES,
                swizzle: Swizzle::None,
            },
            Loads::Tma => flash_tma::value_slice(var("kv0"), TILE_KEYS, u),
        };
        issue.push(tc(Tcgen05::Mma(Box::new(TmemMma {
            tmem: var("tmem") + int(VALUES_COLUMN),
            a: SmemMatrix {
                array: "ps".into(),
                start: int(2 * CORE * u),
                lbo: CORE_BYTES,
                sbo: (2 * 8 * TILE_KEYS) as u32,
                swizzle: Swizzle::None,
            },
            b: values,
            b_major: Major::MN,
            n: head_dim as u32,
            accumulate: Expr::Bool(u > 0),
        }))));
    }
    issue.push(tc(Tcgen05::Commit {
        barrier: tma_gemm::barrier("values", int(0)),
    }));
    issue
}

/// The scores of key group `group` of the tile (keys `j0 + 8·group + e`) of this thread's
/// row, loaded from TMEM into `s0`..`s7`, scaled and masked: −∞ past the block's keys, after the
/// row's position or before its window.
fn group_scores(group: Expr) -> Vec<Stmt> {
    let names: Vec<String> = (0..LOAD_COLUMNS).map(score).collect();
    let mut out = load_row(
        scores_column(var("i")) + group.clone() * int(LOAD_COLUMNS as i64),
        &names,
    );
    let query = var("pos0") + var("query_row");
    for (e, s) in names.iter().enumerate() {
        let key = var("j0") + group.clone() * int(LOAD_COLUMNS as i64) + int(e as i64);
        let visible = and(
            and(lt(key.clone(), var("hi")), bin(BinOp::Le, key.clone(), query.clone())),
            or(
                bin(BinOp::Le, var("window"), int(0)),
                bin(BinOp::Gt, key, query.clone() - var("window")),
            ),
        );
        out.push(assign(s, select(visible, var(s) * var("scale"), f(f32::NEG_INFINITY))));
    }
    out
}

/// The online softmax of this thread's row over the tile, as `flash_attention`'s: its running
/// max `m` updated (`correction`: what the earlier sum and outputs are rescaled by), the
/// probabilities `exp(s − max)` summed into `l`, and this thread's half of them (keys
/// `32·half..+32`) stored, bf16, into `ps` (row r, key k at `r / 8 · 512 + k / 8 · 64 +
/// r % 8 · 8 + k % 8`). Two passes over the scores in TMEM, 8 at a time (the max, then the
/// probabilities), so a thread holds 8 scores, not 64: what leaves the registers for two
/// blocks an SM.
fn online_softmax() -> Vec<Stmt> {
    let groups = TILE_KEYS / LOAD_COLUMNS as i64;
    let names: Vec<String> = (0..LOAD_COLUMNS).map(score).collect();
    let group_max = names
        .iter()
        .fold(var("tile_max"), |max, s| bin(BinOp::Max, max, var(s)));
    let mut probabilities = group_scores(var("group"));
    for s in &names {
        probabilities.push(assign(s, un(UnOp::Exp, var(s) - var("m_use"))));
        probabilities.push(assign("l", var("l") + var(s)));
    }
    let row_group = var("row_in_tile") / int(8) * int(8 * TILE_KEYS) + rem(var("row_in_tile"), int(8)) * int(8);
    // A core matrix's row: 16 bytes in one store, so 8 lanes (rows) fill 128 bytes at once.
    probabilities.push(if_(
        eq(var("group") / int(groups / 2), var("half")),
        vec![store_vec(
            "ps",
            row_group + var("group") * int(CORE),
            names.iter().map(|s| var(s)).collect(),
        )],
    ));
    vec![
        let_("tile_max", Ty::F32, f(f32::NEG_INFINITY)),
        for_(
            "group",
            int(0),
            int(groups),
            int(1),
            [group_scores(var("group")), vec![assign("tile_max", group_max)]].concat(),
        ),
        let_("m_new", Ty::F32, bin(BinOp::Max, var("m"), var("tile_max"))),
        // A row with no visible key yet keeps max −∞: exponents against 0 give zeros, not NaN.
        let_(
            "m_use",
            Ty::F32,
            select(eq(var("m_new"), f(f32::NEG_INFINITY)), f(0.0), var("m_new")),
        ),
        let_("correction", Ty::F32, un(UnOp::Exp, var("m") - var("m_use"))),
        assign("m", var("m_new")),
        assign("l", var("l") * var("correction")),
        for_("group", int(0), int(groups), int(1), probabilities),
    ]
}

/// This thread's half of its row's dims of the tile's `P·V`, 16 columns at a time, folded into
/// its outputs: `o = o · correction + P·V`.
fn fold_values(head_dims: usize) -> Vec<Stmt> {
    let mut out = Vec::new();
    for first in (0..head_dims).step_by(2 * LOAD_COLUMNS) {
        let columns: Vec<usize> = (first..(first + 2 * LOAD_COLUMNS).min(head_dims)).collect();
        let names: Vec<String> = columns.iter().map(|d| format!("pv{d}")).collect();
        out.extend(load_row(
            int(VALUES_COLUMN) + var("half") * int(head_dims as i64) + int(first as i64),
            &names,
        ));
        for (d, pv) in columns.iter().zip(&names) {
            out.push(assign(&output(*d), var(&output(*d)) * var("correction") + var(pv)));
        }
    }
    out
}

/// Step `i` over the key tiles (tile i at `j0`, in the ring's buffer `kv0`), its scores
/// issued by the step before (or before the loop): the softmax; past a barrier (the
/// probabilities stored, tile i + 1's copies landed) thread 0 issues tile i's `P·V`, then tile
/// i + 1's scores (by TMA: once its boxes landed), which run while the block folds `P·V` into
/// its outputs; then tile i's buffer, its products done, takes tile i + 2's copies (by TMA:
/// thread 0's boxes, as soon as `P·V` is done), which land during the next softmax. Thread 0
/// overwrites the `P·V` columns and tile i + 1's scores columns once every warp has read them
/// (the last step's `free`).
fn tile_step(layout: CacheLayout, (head_dim, cache): (usize, Ty), loads: Loads) -> Vec<Stmt> {
    let parity = rem(var("i"), int(2));
    let wait = |barrier: &str| {
        vec![
            Stmt::Mbarrier(Box::new(Mbarrier::Wait {
                barrier: tma_gemm::barrier(barrier, int(0)),
                parity: parity.clone(),
            })),
            tc(Tcgen05::FenceAfterSync),
        ]
    };
    let ahead = |tiles: i64| var("j0") + int(tiles * TILE_KEYS);
    let products = [
        vec![
            tc(Tcgen05::FenceAfterSync),
            if_(
                bin(BinOp::Gt, var("i"), int(0)),
                vec![Stmt::Mbarrier(Box::new(Mbarrier::Wait {
                    barrier: tma_gemm::barrier("free", int(0)),
                    parity: rem(var("i") + int(1), int(2)),
                }))],
            ),
            tc(Tcgen05::FenceAfterSync),
        ],
        issue_values(head_dim, loads),
        vec![if_(
            lt(ahead(1), var("hi")),
            [
                match loads {
                    Loads::Copies => vec![],
                    Loads::Tma => vec![wait_landed(var("i") + int(1))],
                },
                issue_scores(head_dim, loads, var("i") + int(1)),
            ]
            .concat(),
        )],
    ]
    .concat();
    let next_copies = if_(
        lt(ahead(2), var("hi")),
        load_tile(
            layout,
            (head_dim, cache),
            loads,
            var("i") + int(2),
            (ahead(2), var("kv0")),
        ),
    );
    // Over FP8, tile i + 1's codes (copied a step ago) widened into its buffer, which tile
    // i − 1's products are done with; the barrier after it keeps the next copies from
    // overwriting codes a thread is still widening.
    let landed_copies = match cache {
        Ty::F8E4M3 => vec![if_(
            lt(ahead(1), var("hi")),
            widen(head_dim, ring_slot((head_dim, TILE_KEYS), var("i") + int(1), BUFFERS)),
        )],
        _ => vec![Stmt::CpAsyncWait(0)],
    };
    // By TMA thread 0 loads the tile after next as soon as `P·V` has read this buffer; copies
    // go out after the outputs are folded, each thread's registers free again.
    let (boxes, copies) = match loads {
        Loads::Copies => (vec![], vec![next_copies]),
        Loads::Tma => (vec![if_(eq(tid(), int(0)), vec![next_copies])], vec![]),
    };
    [
        vec![
            let_("j0", Ty::I32, var("first_tile") + var("i") * int(TILE_KEYS)),
            let_("kv0", Ty::I32, ring_slot((head_dim, TILE_KEYS), var("i"), BUFFERS)),
        ],
        wait("scores"),
        online_softmax(),
        match loads {
            Loads::Copies => landed_copies,
            Loads::Tma => vec![],
        },
        vec![
            // The probabilities (and the landed copies), for the tensor cores; every thread's,
            // for thread 0.
            Stmt::FenceProxyAsync,
            tc(Tcgen05::FenceBeforeSync),
            Stmt::SyncThreads,
            if_(eq(tid(), int(0)), products),
        ],
        wait("values"),
        boxes,
        fold_values(head_dim / 2),
        copies,
        vec![
            tc(Tcgen05::FenceBeforeSync),
            Stmt::Mbarrier(Box::new(Mbarrier::Arrive {
                barrier: tma_gemm::barrier("free", int(0)),
            })),
        ],
    ]
    .concat()
}

/// [`flash::flash_attention`] on `tcgen05`, heads up to 128 dims ([`supports`]), its tiles
/// loaded as `loads` says: the same parameters (by TMA, also `flash_tma`'s), rows and results,
/// a batched step's `query_tiles` cut in tiles of [`QUERY_TILE_ROWS`].
pub fn flash_attention_tcgen05(name: &str, origin: &str, layout: CacheLayout, head_dim: usize, loads: Loads) -> Kernel {
    flash_attention_tcgen05_over(name, origin, layout, (head_dim, Ty::Bf16), loads)
}

/// [`flash_attention_tcgen05`] over a cache of `cache` elements: bf16, f16 (multiplied as
/// halves: `flash::tile_element`), or FP8 codes copied ([`Loads::Copies`]) as stored into a
/// slot of their own, each tile widened to bf16 once into the ring, the step before its scores
/// (as `flash::flash_attention_over` widens them for `mma.sync`).
pub fn flash_attention_tcgen05_over(
    name: &str,
    origin: &str,
    layout: CacheLayout,
    (head_dim, cache): (usize, Ty),
    loads: Loads,
) -> Kernel {
    assert!(supports(head_dim), "head_dim {head_dim}");
    assert!(
        loads == Loads::Copies || flash_tma::supports(head_dim),
        "head_dim {head_dim} by TMA"
    );
    assert!(
        matches!(cache, Ty::Bf16 | Ty::F16) || (cache == Ty::F8E4M3 && loads == Loads::Copies),
        "a {cache:?} cache loaded by {loads:?}"
    );
    let element = flash::tile_element(cache).ty();
    let dims = head_dim / 2;
    let landed_init = match loads {
        Loads::Copies => vec![],
        Loads::Tma => vec![tma_gemm::init_barriers(&[("landed", 1)], BUFFERS)],
    };
    let setup = [
        landed_init,
        vec![
            if_(
                eq(warp(), int(0)),
                vec![tc(Tcgen05::Alloc {
                    columns: TMEM_COLUMNS,
                    slot: "tmem_slot".into(),
                })],
            ),
            tma_gemm::init_barriers(&[("scores", 1), ("values", 1), ("free", THREADS as u32)], 1),
            tc(Tcgen05::FenceBeforeSync),
            Stmt::SyncThreads,
            tc(Tcgen05::FenceAfterSync),
            let_("tmem", Ty::I32, load("tmem_slot", int(0))),
        ],
    ]
    .concat();
    let rows = vec![
        let_("half", Ty::I32, warp() / int(4)),
        let_("row_in_tile", Ty::I32, rem(warp(), int(4)) * int(32) + lane()),
        let_("query_row", Ty::I32, var("q0") + var("row_in_tile")),
        let_("m", Ty::F32, f(f32::NEG_INFINITY)),
        let_("l", Ty::F32, f(0.0)),
        let_(
            "tiles",
            Ty::I32,
            (var("hi") - var("first_tile") + int(TILE_KEYS - 1)) / int(TILE_KEYS),
        ),
    ];
    let locals = (0..dims).map(|d| let_(&output(d), Ty::F32, f(0.0))).collect();
    let store_outputs = vec![if_(
        lt(var("query_row"), var("rows_end")),
        (0..dims)
            .map(|d| {
                let dim = var("half") * int(dims as i64) + int(d as i64);
                let at = (var("query_row") * var("heads") + var("h")) * int(head_dim as i64) + dim;
                store("out", at, var(&output(d)) / var("l"))
            })
            .collect(),
    )];
    let teardown = vec![
        tc(Tcgen05::FenceBeforeSync),
        Stmt::SyncThreads,
        if_(
            eq(warp(), int(0)),
            vec![
                tc(Tcgen05::FenceAfterSync),
                tc(Tcgen05::Dealloc {
                    columns: TMEM_COLUMNS,
                    address: var("tmem"),
                }),
            ],
        ),
    ];
    // The first two tiles, into the ring's two buffers (over FP8 the first widened into its
    // buffer, the second's codes left in flight for the first step to widen).
    let first = load_tile(layout, (head_dim, cache), loads, int(0), (var("first_tile"), int(0)));
    let second = vec![if_(
        lt(var("first_tile") + int(TILE_KEYS), var("hi")),
        load_tile(
            layout,
            (head_dim, cache),
            loads,
            int(1),
            (
                var("first_tile") + int(TILE_KEYS),
                ring_slot((head_dim, TILE_KEYS), int(1), BUFFERS),
            ),
        ),
    )];
    let first_tiles = match (loads, cache) {
        // Every thread done widening the first tile's codes before the second's land there.
        (Loads::Copies, Ty::F8E4M3) => [first, widen(head_dim, int(0)), vec![Stmt::SyncThreads], second].concat(),
        (Loads::Copies, _) => [first, second, vec![Stmt::CpAsyncWait(0)]].concat(),
        (Loads::Tma, _) => vec![flash_tma::last_box(), if_(eq(tid(), int(0)), [first, second].concat())],
    };
    let work = [
        block_keys(TILE_Q),
        rows,
        setup,
        load_queries(head_dim, THREADS),
        locals,
        first_tiles,
        vec![
            // The first tiles and the queries, for the tensor cores: the first tile's scores.
            Stmt::FenceProxyAsync,
            Stmt::SyncThreads,
            if_(
                eq(tid(), int(0)),
                [
                    vec![tc(Tcgen05::FenceAfterSync)],
                    match loads {
                        Loads::Copies => vec![],
                        Loads::Tma => vec![wait_landed(int(0))],
                    },
                    issue_scores(head_dim, loads, int(0)),
                ]
                .concat(),
            ),
            for_(
                "i",
                int(0),
                var("tiles"),
                int(1),
                tile_step(layout, (head_dim, cache), loads),
            ),
        ],
        store_outputs,
        teardown,
    ]
    .concat();
    let tile_elements = (BUFFERS * TILE_KEYS) as usize * head_dim;
    let shared = |name: &str, ty: Ty, len: usize| SharedArray {
        name: name.into(),
        ty,
        len,
    };
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: causal prefill attention on tcgen05 (m128n64 scores and m128n{head_dim} P·V into tensor \
             memory, both operands from shared memory; {TILE_Q} query rows a block of two warpgroups, a thread of \
             each a row; {TILE_KEYS}-key tiles through a ring of {BUFFERS}; online softmax in f32, the output in \
             registers{}), head_dim {head_dim}, {} {}",
            match loads {
                Loads::Copies => "",
                Loads::Tma => "; the tiles loaded by TMA",
            },
            flash::describe_cache(cache),
            layout.describe()
        ),
        params: match loads {
            Loads::Copies => flash::params_over(layout, cache),
            Loads::Tma => [flash::params_over(layout, cache), flash_tma::params()].concat(),
        },
        shared: [
            vec![
                shared("qs", element, TILE_Q as usize * head_dim),
                shared("ks", element, tile_elements),
                shared("vs", element, tile_elements),
                shared("ps", element, (TILE_Q * TILE_KEYS) as usize),
                shared("scores", Ty::U32, 2),
                shared("values", Ty::U32, 2),
                shared("free", Ty::U32, 2),
                shared("tmem_slot", Ty::I32, 1),
            ],
            match loads {
                Loads::Copies => vec![],
                Loads::Tma => vec![shared("landed", Ty::U32, 2 * BUFFERS as usize)],
            },
            // Over FP8, the slot the codes land in.
            match cache {
                Ty::F8E4M3 => ["ks", "vs"]
                    .map(|n| {
                        let len = TILE_KEYS as usize * flash::row_pitch(head_dim, cache) as usize;
                        shared(&flash::staged(n, cache), cache, len)
                    })
                    .to_vec(),
                _ => vec![],
            },
        ]
        .concat(),
        block_dim: THREADS as u32,
        grid: var("heads") * query_tiles_expr(layout, TILE_Q),
        body: guarded_by_rows(layout, block_rows(layout, (head_dim, 1), TILE_Q), work),
    }
}
