//! Prefill attention on Hopper's `wgmma` (sm_90a), FlashAttention-3's schedule within a
//! block: the same rows, parameters and results as `flash_attention`, heads up to 128 dims.
//!
//! A block of two warpgroups takes 128 query rows of one head, warpgroup w rows 64w..64w+64,
//! so each key and value tile crosses from L2 once for 128 rows: a block of 64 rows (as
//! `mma.sync`'s) would ask twice the L2 bandwidth, about all the GPU has at
//! FlashAttention-3's speed. The queries, rounded to bf16, sit in shared memory in 8×8 core
//! matrices; each key tile's scores are m64n64k16 `wgmma`s with both operands in shared
//! memory, and `P·V` is m64n{head_dim}k16 with P's fragments as A from registers (the scores'
//! accumulator layout is A's) and the value tile as an MN-major B. The tiles land by 16-byte
//! `cp.async` copies in a ring of three buffers, the next tile's copies in flight while the
//! warpgroups work on this one.
//!
//! Each warpgroup overlaps its softmax with the tensor cores (FlashAttention-3's
//! intra-warpgroup pipelining): for tile j it issues the scores `S_j = Q·K_j` and then the
//! previous tile's `O += P_{j−1}·V_{j−1}`, waits for the scores alone, runs the online
//! softmax of `S_j` while `P·V` still runs, and waits for that before rescaling `O`. So a
//! tile's probabilities wait a tile in registers (`p…`) for their product with the values;
//! the last tile's get it after the loop.
//!
//! Requirements, checked by the caller: `head_dim` a multiple of 16 up to 128 ([`supports`]);
//! the cache bf16.

use super::cache_layout::CacheLayout;
use super::flash_attention::{
    self as flash, block_rows, copy_tile, guarded_by_rows, o_name, online_softmax, query_tiles_expr, row_state, s_name,
    store_outputs, TileOrder, TILE_KEYS,
};
use crate::dsl::*;

/// Two warpgroups.
const THREADS: i64 = 256;
/// Query rows per block: a warpgroup's 64 rows (wgmma's M) each.
const TILE_Q: i64 = 128;
/// Query rows per block, as batched steps' `query_tiles` cut them.
pub const QUERY_TILE_ROWS: usize = TILE_Q as usize;
/// Key and value tiles in the ring: tile j + 1 lands while tile j's scores and tile j − 1's
/// values are read.
const BUFFERS: i64 = 3;
/// Elements of one 8×8 core matrix of bf16: the unit `wgmma` reads from shared memory, 8 rows
/// of 16 bytes.
const CORE: i64 = 64;
/// Its bytes.
const CORE_BYTES: u32 = 128;

/// Whether the kernel takes a head of `head_dim`: its output accumulators and two tiles'
/// scores in registers.
pub fn supports(head_dim: usize) -> bool {
    flash::supports(head_dim) && head_dim <= flash::QUERIES_IN_REGISTERS
}

fn p_name(j: usize, i: usize) -> String {
    format!("p{j}_{i}")
}

/// The scores' and probabilities' registers: 8 blocks of 8 keys, 4 a lane each.
fn tile_registers(name: fn(usize, usize) -> String) -> Vec<String> {
    (0..(TILE_KEYS / 8) as usize)
        .flat_map(|j| (0..4).map(move |i| (j, i)))
        .map(|(j, i)| name(j, i))
        .collect()
}

/// The output accumulators: `head_dim / 8` blocks of 8 dims, 4 a lane each.
fn output_registers(head_dim: usize) -> Vec<String> {
    (0..head_dim / 8)
        .flat_map(|v| (0..4).map(move |i| o_name(v, i)))
        .collect()
}

/// The block's queries, zero past `rows_end`, rounded to bf16 into `qs` in core matrices
/// (row `r`, dim `d` at `r / 8 · 8·head_dim + d / 8 · 64 + r % 8 · 8 + d % 8`): each thread
/// a run of 8 dims of one row, 8 rows of the same dims a warp's neighbours.
fn load_queries(head_dim: usize) -> Vec<Stmt> {
    let hd = head_dim as i64;
    vec![for_(
        "c",
        tid(),
        int(TILE_Q * hd / 8),
        int(THREADS),
        vec![
            let_("row", Ty::I32, var("c") / int(hd) * int(8) + rem(var("c"), int(8))),
            let_("dim", Ty::I32, rem(var("c") / int(8), int(hd / 8)) * int(8)),
            let_("inside", Ty::Bool, lt(var("q0") + var("row"), var("rows_end"))),
            for_(
                "e",
                int(0),
                int(8),
                int(1),
                vec![
                    let_("value", Ty::F32, f(0.0)),
                    if_(
                        var("inside"),
                        vec![assign(
                            "value",
                            load(
                                "q",
                                (var("q0") + var("row")) * var("q_stride") + var("h") * int(hd) + var("dim") + var("e"),
                            ),
                        )],
                    ),
                    store("qs", var("c") * int(8) + var("e"), var("value")),
                ],
            ),
        ],
    )]
}

/// Issue this warpgroup's 64×64 scores of the key tile at `kv0`: A its rows of `qs`, B the
/// key tile, both in core matrices read K-major, one m64n64k16 a 16-dim slice; one group.
fn issue_scores(head_dim: usize) -> Vec<Stmt> {
    let hd = head_dim as u32;
    let mut out: Vec<Stmt> = tile_registers(s_name).iter().map(|s| assign(s, f(0.0))).collect();
    out.push(Stmt::WgmmaFence);
    for step in 0..head_dim as i64 / 16 {
        let slice = int(2 * CORE * step);
        out.push(Stmt::Wgmma(Box::new(WgmmaOp {
            n: TILE_KEYS as u32,
            a: WgmmaA::Shared(SmemMatrix {
                array: "qs".into(),
                start: warp() / int(4) * int(64 * head_dim as i64) + slice.clone(),
                lbo: CORE_BYTES,
                sbo: 16 * hd,
                swizzle: Swizzle::None,
            }),
            b: SmemMatrix {
                array: "ks".into(),
                start: var("kv0") + slice,
                lbo: CORE_BYTES,
                sbo: 16 * hd,
                swizzle: Swizzle::None,
            },
            b_major: Major::K,
            d: tile_registers(s_name),
        })));
    }
    out.push(Stmt::WgmmaCommit);
    out
}

/// Issue `O += P·V` for the value tile at `v0`: the keys in 4 slices of 16, A the
/// probabilities' fragments (blocks 2u and 2u + 1), B the value tile read MN-major (a core
/// matrix 8 keys of 8 dims: the next 8 keys `8 × head_dim` elements on, the next 8 dims a core
/// matrix on), uncommitted.
fn issue_values(head_dim: usize) -> Vec<Stmt> {
    let mut out = vec![Stmt::WgmmaFence];
    for u in 0..(TILE_KEYS / 16) as usize {
        out.push(Stmt::Wgmma(Box::new(WgmmaOp {
            n: head_dim as u32,
            a: WgmmaA::Registers(std::array::from_fn(|i| p_name(2 * u + i / 4, i % 4))),
            b: SmemMatrix {
                array: "vs".into(),
                start: var("v0") + int(16 * (head_dim * u) as i64),
                lbo: 16 * head_dim as u32,
                sbo: CORE_BYTES,
                swizzle: Swizzle::None,
            },
            b_major: Major::MN,
            d: output_registers(head_dim),
        })));
    }
    out
}

/// One key tile's step (the tile at `j0`, in buffer `kv0`; the previous one's values at `v0`).
fn tile_step(layout: CacheLayout, head_dim: usize) -> Vec<Stmt> {
    let tile = TILE_KEYS * head_dim as i64;
    let next = var("j0") + int(TILE_KEYS);
    let mut out = vec![
        let_(
            "buf",
            Ty::I32,
            rem((var("j0") - var("first_tile")) / int(TILE_KEYS), int(BUFFERS)),
        ),
        let_("kv0", Ty::I32, var("buf") * int(tile)),
        // This tile's copies (the only group in flight) landed and are every thread's; the
        // queries' stores too, the first time. The tensor cores read them: the async proxy.
        Stmt::CpAsyncWait(0),
        Stmt::FenceProxyAsync,
        // Past it every warpgroup is done with the previous step, so with the tile two back
        // (its values were multiplied there): the next tile takes its buffer.
        Stmt::SyncThreads,
        if_(
            lt(next.clone(), var("hi")),
            copy_tile(
                layout,
                (head_dim, TileOrder::CoreMatrices),
                THREADS,
                next,
                rem(var("buf") + int(1), int(BUFFERS)) * int(tile),
            ),
        ),
    ];
    out.extend(issue_scores(head_dim));
    out.push(if_(
        bin(BinOp::Gt, var("j0"), var("first_tile")),
        issue_values(head_dim),
    ));
    // A group even where the first tile has no values to multiply: the wait below counts
    // groups.
    out.push(Stmt::WgmmaCommit);
    // The scores are the older group: they are done while `P·V` runs on.
    out.push(Stmt::WgmmaWait(1));
    out.extend(online_softmax());
    out.push(Stmt::WgmmaWait(0));
    for v in 0..head_dim / 8 {
        for i in 0..4 {
            let c = if i >= 2 { "c_hi" } else { "c_lo" };
            out.push(assign(&o_name(v, i), var(&o_name(v, i)) * var(c)));
        }
    }
    out.extend(
        tile_registers(p_name)
            .iter()
            .zip(tile_registers(s_name))
            .map(|(p, s)| assign(p, var(&s))),
    );
    out.push(assign("v0", var("kv0")));
    out
}

/// [`flash::flash_attention`] on `wgmma`, heads up to 128 dims ([`supports`]): the same
/// parameters, rows and results, a batched step's `query_tiles` cut in tiles of
/// [`QUERY_TILE_ROWS`].
pub fn flash_attention_wgmma(name: &str, origin: &str, layout: CacheLayout, head_dim: usize) -> Kernel {
    assert!(supports(head_dim), "head_dim {head_dim}");
    let locals = output_registers(head_dim)
        .into_iter()
        .chain(tile_registers(s_name))
        .chain(tile_registers(p_name))
        .map(|n| let_(&n, Ty::F32, f(0.0)));
    let rows = [
        row_state(TILE_Q),
        load_queries(head_dim),
        locals.collect(),
        vec![let_("v0", Ty::I32, int(0))],
        copy_tile(
            layout,
            (head_dim, TileOrder::CoreMatrices),
            THREADS,
            var("first_tile"),
            int(0),
        ),
        vec![for_(
            "j0",
            var("first_tile"),
            var("hi"),
            int(TILE_KEYS),
            tile_step(layout, head_dim),
        )],
        // The last tile's probabilities by its values.
        issue_values(head_dim),
        vec![Stmt::WgmmaCommit, Stmt::WgmmaWait(0)],
        store_outputs(head_dim),
    ]
    .concat();
    let tile_elements = (BUFFERS * TILE_KEYS) as usize * head_dim;
    let shared = |name: &str, len: usize| SharedArray {
        name: name.into(),
        ty: Ty::Bf16,
        len,
    };
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: causal prefill attention on wgmma (m64n64k16 scores from shared memory, m64n{head_dim}k16 \
             P·V from registers, FlashAttention-3's intra-warpgroup overlap: {TILE_Q} query rows a block of two \
             warpgroups, {TILE_KEYS}-key tiles through a ring of {BUFFERS}, online softmax in f32), head_dim \
             {head_dim}, bf16 {}",
            layout.describe()
        ),
        params: flash::params(layout),
        shared: vec![
            shared("qs", TILE_Q as usize * head_dim),
            shared("ks", tile_elements),
            shared("vs", tile_elements),
        ],
        block_dim: THREADS as u32,
        grid: var("heads") * query_tiles_expr(layout, TILE_Q),
        body: guarded_by_rows(layout, block_rows(layout, (head_dim, 1), TILE_Q), rows),
    }
}
