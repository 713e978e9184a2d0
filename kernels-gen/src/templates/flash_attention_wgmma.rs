//! Prefill attention on Hopper's `wgmma` (sm_90a), FlashAttention-3's schedule within a
//! block: the same rows, parameters and results as `flash_attention`, heads up to 128 dims.
//!
//! A block of two warpgroups takes 128 query rows of one head, warpgroup w rows 64w..64w+64,
//! so each key and value tile crosses from L2 once for 128 rows: a block of 64 rows (as
//! `mma.sync`'s) would ask twice the L2 bandwidth, about all the GPU has at
//! FlashAttention-3's speed. The queries, rounded to bf16, sit in shared memory in 8×8 core
//! matrices; each 128-key tile's scores are m64n128k16 `wgmma`s with both operands in shared
//! memory, and `P·V` is m64n{head_dim}k16 with P's fragments as A from registers (the scores'
//! accumulator layout is A's) and the value tile as an MN-major B. The tiles land by 16-byte
//! `cp.async` copies in a ring of three buffers (224 KiB of shared memory with the queries at
//! 128 dims), the next tile's copies in flight while the warpgroups work on this one.
//!
//! Each warpgroup overlaps its softmax with the tensor cores (FlashAttention-3's
//! intra-warpgroup pipelining): for tile j it issues the scores `S_j = Q·K_j` and then the
//! previous tile's `O += P_{j−1}·V_{j−1}`, waits for the scores alone, runs the online
//! softmax of `S_j` while `P·V` still runs, and waits for that before rescaling `O`. So a
//! tile's probabilities wait a tile in registers (`p…`) for their product with the values;
//! the last tile's get it after the loop.
//!
//! Three schedules ([`Schedule`]): every thread copying, a `__syncthreads()` a tile; or
//! FlashAttention-3's warp specialisation, a producer warpgroup filling the ring through
//! mbarriers while the two consumer warpgroups ping-pong, each issuing its products only once
//! the other has issued its own, so one's softmax runs under the other's products; and the
//! same with the tiles loaded by TMA, as FlashAttention-3 loads them (`flash_tma`), the `full`
//! barrier counting their bytes. As FlashAttention-3's, the producer gives up its registers
//! (`setmaxnreg`, `Schedule::registers`) for the consumers to claim: as launched, a block of
//! twelve warps (or nine) leaves each thread 168, too few for a 128-key tile's registers.
//!
//! Requirements, checked by the caller: `head_dim` a multiple of 16 up to 128 ([`supports`]),
//! 64 or 128 for TMA (`flash_tma::supports`, whose paged caches also need blocks of a
//! multiple of `flash_tma::TMA_KEYS` positions); the cache bf16 or f16 (multiplied as halves,
//! every schedule), or FP8 in the lockstep schedule (`flash_attention_wgmma_over`: each
//! tile's codes land in a slot of their own and are widened to bf16 once, into a ring of two
//! the tensor cores read).

use super::cache_layout::CacheLayout;
use super::flash_attention::{
    self as flash, block_rows, copy_tile, guarded_by_rows, o_name, online_softmax, query_tiles_expr, row_state, s_name,
    store_outputs, Masking, TileOrder,
};
use super::{flash_tma, tma_gemm};
use crate::dsl::*;

/// A warpgroup's threads.
const WARPGROUP: i64 = 128;
/// The two consumer warpgroups' threads.
const CONSUMERS: i64 = 2 * WARPGROUP;
/// Query rows per block: a warpgroup's 64 rows (wgmma's M) each.
const TILE_Q: i64 = 128;
/// Query rows per block, as batched steps' `query_tiles` cut them.
pub const QUERY_TILE_ROWS: usize = TILE_Q as usize;
/// Keys a tile: FlashAttention-3's 128 for causal heads up to 128 dims (half the hand-overs,
/// waits and softmax reductions of 64, and the scores one m64n128k16 a slice).
const KEYS: i64 = 128;
/// Key and value tiles in the ring: tile j + 1 lands while tile j's scores and tile j − 1's
/// values are read.
const BUFFERS: i64 = 3;
/// The bf16 ring over an FP8 cache: tile i is widened into its slot once tile i − 2's values
/// are multiplied, while tile i − 1's still are; its codes land in a slot of their own.
const FP8_BUFFERS: i64 = 2;
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

/// The scores' and probabilities' registers: 16 blocks of 8 keys, 4 a lane each.
fn tile_registers(name: fn(usize, usize) -> String) -> Vec<String> {
    (0..(KEYS / 8) as usize)
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
/// a run of 8 dims of one row, stored as one 16-byte core-matrix row (8 lanes fill 128 bytes
/// at once), 8 rows of the same dims a warp's neighbours; the block's `threads` share them.
pub(super) fn load_queries(head_dim: usize, threads: i64) -> Vec<Stmt> {
    let hd = head_dim as i64;
    let names: Vec<String> = (0..8).map(|e| format!("query_dim{e}")).collect();
    let at = |e: i64| (var("q0") + var("row")) * var("q_stride") + var("h") * int(hd) + var("dim") + int(e);
    vec![for_(
        "c",
        tid(),
        int(TILE_Q * hd / 8),
        int(threads),
        [
            vec![
                let_("row", Ty::I32, var("c") / int(hd) * int(8) + rem(var("c"), int(8))),
                let_("dim", Ty::I32, rem(var("c") / int(8), int(hd / 8)) * int(8)),
            ],
            names.iter().map(|n| let_(n, Ty::F32, f(0.0))).collect(),
            vec![
                if_(
                    lt(var("q0") + var("row"), var("rows_end")),
                    names
                        .iter()
                        .enumerate()
                        .map(|(e, n)| assign(n, load("q", at(e as i64))))
                        .collect(),
                ),
                store_vec("qs", var("c") * int(8), names.iter().map(|n| var(n)).collect()),
            ],
        ]
        .concat(),
    )]
}

/// Issue this warpgroup's 64×64 scores of the key tile at `kv0`: A its rows of `qs` in core
/// matrices, B the key tile read K-major, one m64n64k16 a 16-dim slice; one group. The key
/// tile is in core matrices too, or with `swizzled` as TMA lands it (`flash_tma`).
fn issue_scores(head_dim: usize, swizzled: bool) -> Vec<Stmt> {
    let hd = head_dim as u32;
    let mut out: Vec<Stmt> = tile_registers(s_name).iter().map(|s| assign(s, f(0.0))).collect();
    out.push(Stmt::WgmmaFence);
    for step in 0..head_dim as i64 / 16 {
        let slice = int(2 * CORE * step);
        let b = match swizzled {
            false => SmemMatrix {
                array: "ks".into(),
                start: var("kv0") + slice.clone(),
                lbo: CORE_BYTES,
                sbo: 16 * hd,
                swizzle: Swizzle::None,
            },
            true => flash_tma::key_slice(var("kv0"), KEYS, step),
        };
        out.push(Stmt::Wgmma(Box::new(WgmmaOp {
            n: KEYS as u32,
            a: WgmmaA::Shared(SmemMatrix {
                array: "qs".into(),
                start: warp() / int(4) * int(64 * head_dim as i64) + slice,
                lbo: CORE_BYTES,
                sbo: 16 * hd,
                swizzle: Swizzle::None,
            }),
            b,
            b_major: Major::K,
            d: tile_registers(s_name),
        })));
    }
    out.push(Stmt::WgmmaCommit);
    out
}

/// Issue `O += P·V` for the value tile at `v0`: the keys in 4 slices of 16, A the
/// probabilities' fragments (blocks 2u and 2u + 1), B the value tile read MN-major,
/// uncommitted. In core matrices, one is 8 keys of 8 dims: the next 8 keys `8 × head_dim`
/// elements on, the next 8 dims a core matrix on; or with `swizzled` as TMA lands it
/// (`flash_tma`).
fn issue_values(head_dim: usize, swizzled: bool) -> Vec<Stmt> {
    let mut out = vec![Stmt::WgmmaFence];
    for u in 0..KEYS / 16 {
        let b = match swizzled {
            false => SmemMatrix {
                array: "vs".into(),
                start: var("v0") + int(16 * head_dim as i64 * u),
                lbo: 16 * head_dim as u32,
                sbo: CORE_BYTES,
                swizzle: Swizzle::None,
            },
            true => flash_tma::value_slice(var("v0"), KEYS, u),
        };
        let u = u as usize;
        out.push(Stmt::Wgmma(Box::new(WgmmaOp {
            n: head_dim as u32,
            a: WgmmaA::Registers(std::array::from_fn(|i| p_name(2 * u + i / 4, i % 4))),
            b,
            b_major: Major::MN,
            d: output_registers(head_dim),
        })));
    }
    out
}

/// How a block's warps share the work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// Every thread copies the tiles, and the warpgroups meet at a `__syncthreads()` a tile.
    Lockstep,
    /// Warp specialisation (FlashAttention-3's): a producer warpgroup copies the tiles into the
    /// ring, handing each to the consumer warpgroups through an mbarrier (`full`) and taking
    /// its buffer back through another (`empty`) once both are done with it, so no warpgroup
    /// spends issue slots on copies; the warpgroups take turns issuing their products
    /// ([`take_turn`]).
    Specialised,
    /// As `Specialised`, the producer warpgroup's first thread loading each tile by TMA
    /// (`tma_producer`): 128-byte swizzled boxes, their bytes counted by `full`, no copy
    /// instructions of the block's own. Heads `flash_tma::supports` takes.
    Tma,
}

impl Schedule {
    /// Where specialised: the registers a thread of the producer warpgroup keeps
    /// (`setmaxnreg`), and what each consumer thread then claims, out of the 168 each holds as
    /// launched (a block of 384 threads, 64 512 registers): a tile's scores, the previous
    /// tile's probabilities and the outputs (64 registers each at 128 dims) need more. A TMA
    /// producer, one thread issuing boxes, keeps 24 (FlashAttention-3's), leaving the
    /// consumers 240; copying producers, 16 copies a tile a thread at 128 dims, keep 40 (at
    /// 24 ptxas spills), leaving 232.
    fn registers(self) -> (u32, u32) {
        match self {
            Schedule::Tma => (24, 240),
            Schedule::Specialised | Schedule::Lockstep => (40, 232),
        }
    }

    /// The block's threads: two warpgroups, and a producer warpgroup where specialised.
    fn threads(self) -> i64 {
        match self {
            Schedule::Lockstep => CONSUMERS,
            Schedule::Specialised | Schedule::Tma => CONSUMERS + WARPGROUP,
        }
    }

    /// Whether the tiles land by TMA, 128-byte swizzled.
    fn tma(self) -> bool {
        self == Schedule::Tma
    }
}

/// The buffer of tile `i` in the ring, as its first element.
fn ring_buffer(head_dim: usize, i: Expr) -> Expr {
    ring_slot((head_dim, KEYS), i, BUFFERS)
}

/// The buffer of tile `i` in a ring of `buffers` key (or value) tiles of `keys` keys, as its
/// first element.
pub(super) fn ring_slot((head_dim, keys): (usize, i64), i: Expr, buffers: i64) -> Expr {
    rem(i, int(buffers)) * int(keys * head_dim as i64)
}

/// The start of step `i` over the key tiles when all of a block's `threads` copy them into a
/// ring of `buffers`: `j0` (the tile's first key) and `kv0` (its buffer); the tile landed (its
/// copies the only group in flight) and fenced for the tensor cores (the queries' stores too,
/// the first time); a barrier, past which every thread is done with the step before, so with
/// the tile `buffers − 1` back; then the next tile's copies into that one's buffer.
fn lockstep_tile_head((layout, cache): (CacheLayout, Ty), head_dim: usize, threads: i64, buffers: i64) -> Vec<Stmt> {
    let next = var("j0") + int(KEYS);
    vec![
        let_("j0", Ty::I32, var("first_tile") + var("i") * int(KEYS)),
        let_("kv0", Ty::I32, ring_slot((head_dim, KEYS), var("i"), buffers)),
        Stmt::CpAsyncWait(0),
        Stmt::FenceProxyAsync,
        Stmt::SyncThreads,
        if_(
            lt(next.clone(), var("hi")),
            copy_tile(
                cache,
                layout,
                (head_dim, KEYS, TileOrder::CoreMatrices),
                (tid(), threads),
                next,
                ring_slot((head_dim, KEYS), var("i") + int(1), buffers),
            ),
        ),
    ]
}

/// The key tile at `j0` in `kv0`: its products and softmax, and the previous tile's values
/// from `v0` multiplied. Issues the scores and then the values' product, waits for the scores
/// alone (the older group) and runs the softmax while `P·V` runs, then waits for that and
/// rescales the outputs; the probabilities wait in `p…` for the next tile's step, and `v0`
/// becomes this tile's buffer. The first tile multiplies zero probabilities (`p…` start at
/// zero) by its own values, adding nothing: a `wgmma` under a branch would be serialised by
/// ptxas. With `turns`, the warpgroups issue in turn (see [`take_turn`]).
fn tile_products(head_dim: usize, schedule: Schedule) -> (Vec<Stmt>, Vec<Stmt>) {
    let (take, pass) = match schedule {
        Schedule::Lockstep => (vec![], vec![]),
        Schedule::Specialised | Schedule::Tma => take_turn(),
    };
    let swizzled = schedule.tma();
    let mut products = [take, issue_scores(head_dim, swizzled), issue_values(head_dim, swizzled)].concat();
    products.push(Stmt::WgmmaCommit);
    products.extend(pass);
    products.push(Stmt::WgmmaWait(1));
    products.extend(online_softmax(KEYS, Masking::CutTiles));
    products.push(Stmt::WgmmaWait(0));
    for v in 0..head_dim / 8 {
        for i in 0..4 {
            let c = if i >= 2 { "c_hi" } else { "c_lo" };
            products.push(assign(&o_name(v, i), var(&o_name(v, i)) * var(c)));
        }
    }
    let hand_on = tile_registers(p_name)
        .iter()
        .zip(tile_registers(s_name))
        .map(|(p, s)| assign(p, var(&s)))
        .chain([assign("v0", var("kv0"))])
        .collect();
    (products, hand_on)
}

/// FlashAttention-3's ping-pong of the two consumer warpgroups (warpgroup `wg`): each issues
/// a tile's products only once the other has issued its previous ones (`turn[wg]`), and
/// passes the turn on (`turn[1 − wg]`, every thread arriving) once issued, so while one
/// warpgroup's softmax runs on the CUDA cores the tensor cores run the other's products.
/// Warpgroup 0 goes first: its tile i waits for warpgroup 1's tile i − 1 (phase i − 1 of
/// `turn[0]`), warpgroup 1's tile i for warpgroup 0's tile i (phase i of `turn[1]`).
fn take_turn() -> (Vec<Stmt>, Vec<Stmt>) {
    let take = if_(
        lt(int(0), var("i") + var("wg")),
        vec![Stmt::Mbarrier(Box::new(Mbarrier::Wait {
            barrier: tma_gemm::barrier("turn", var("wg")),
            parity: rem(var("i") + int(1) + var("wg"), int(2)),
        }))],
    );
    let pass = Stmt::Mbarrier(Box::new(Mbarrier::Arrive {
        barrier: tma_gemm::barrier("turn", int(1) - var("wg")),
    }));
    (vec![take], vec![pass])
}

/// [`lockstep_tile_head`] over an FP8 cache: tile i's codes landed in `ks8`/`vs8` (one slot),
/// a barrier, widened into its slot of a ring of [`FP8_BUFFERS`] bf16 tiles in core matrices
/// (the slot of tile i − 2, whose values' product the step before waited for), fenced for the
/// tensor cores, a barrier, then the next tile's codes copied into `ks8`/`vs8`.
fn fp8_lockstep_tile_head(layout: CacheLayout, head_dim: usize) -> Vec<Stmt> {
    let next = var("j0") + int(KEYS);
    [
        vec![
            let_("j0", Ty::I32, var("first_tile") + var("i") * int(KEYS)),
            let_("kv0", Ty::I32, ring_slot((head_dim, KEYS), var("i"), FP8_BUFFERS)),
            Stmt::CpAsyncWait(0),
            Stmt::SyncThreads,
        ],
        flash::widen_tile(
            (head_dim, KEYS, TileOrder::CoreMatrices),
            CONSUMERS,
            (int(0), var("kv0")),
        ),
        vec![
            Stmt::FenceProxyAsync,
            Stmt::SyncThreads,
            if_(lt(next.clone(), var("hi")), fp8_copies(layout, head_dim, next)),
        ],
    ]
    .concat()
}

/// The copies of the FP8 tile at `j0` into `ks8`/`vs8`, as stored (row-major).
fn fp8_copies(layout: CacheLayout, head_dim: usize, j0: Expr) -> Vec<Stmt> {
    flash::copy_tile(
        Ty::F8E4M3,
        layout,
        (head_dim, KEYS, TileOrder::RowMajor),
        (tid(), CONSUMERS),
        j0,
        int(0),
    )
}

/// The key tile at index `i` of the block's (at `j0`), every thread of the block copying:
/// this tile landed (its copies the only group in flight), a barrier, then the next tile's
/// copies issued into the ring before the products.
fn lockstep_step(layout: CacheLayout, (head_dim, cache): (usize, Ty)) -> Vec<Stmt> {
    let (products, hand_on) = tile_products(head_dim, Schedule::Lockstep);
    // The tile two back had its values multiplied in the step before the barrier: the next
    // tile takes its buffer (or, over FP8, this tile is widened into it).
    let head = match cache {
        Ty::F8E4M3 => fp8_lockstep_tile_head(layout, head_dim),
        _ => lockstep_tile_head((layout, cache), head_dim, CONSUMERS, BUFFERS),
    };
    [head, products, hand_on].concat()
}

/// The producer warpgroup's loop: tile i's copies go into its buffer once the consumers gave it
/// back (from the fourth tile on: `empty`'s phase for tile i − 3), then tile i − 1's, issued a
/// step before, are waited for and handed over (`full`), so two tiles' copies are in flight
/// while the consumers work. Each thread arrives for its own copies.
fn producer((layout, cache): (CacheLayout, Ty), head_dim: usize) -> Vec<Stmt> {
    let hand_over = |i: Expr, pending: u32| {
        vec![
            Stmt::CpAsyncWait(pending),
            // The consumers' tensor cores read the copies: the async proxy.
            Stmt::FenceProxyAsync,
            Stmt::Mbarrier(Box::new(Mbarrier::Arrive {
                barrier: tma_gemm::barrier("full", rem(i, int(BUFFERS))),
            })),
        ]
    };
    let step = [
        vec![wait_for_buffer()],
        copy_tile(
            cache,
            layout,
            (head_dim, KEYS, TileOrder::CoreMatrices),
            (tid() - int(CONSUMERS), WARPGROUP),
            var("first_tile") + var("i") * int(KEYS),
            ring_buffer(head_dim, var("i")),
        ),
        vec![if_(bin(BinOp::Gt, var("i"), int(0)), hand_over(var("i") - int(1), 1))],
    ]
    .concat();
    [
        vec![for_("i", int(0), var("tiles"), int(1), step)],
        hand_over(var("tiles") - int(1), 0),
    ]
    .concat()
}

/// The producer's wait before filling tile i's buffer: from the fourth tile on, for the
/// consumers to give it back (`empty`'s phase for tile i − 3).
fn wait_for_buffer() -> Stmt {
    if_(
        bin(BinOp::Ge, var("i"), int(BUFFERS)),
        vec![Stmt::Mbarrier(Box::new(Mbarrier::Wait {
            barrier: tma_gemm::barrier("empty", rem(var("i"), int(BUFFERS))),
            parity: rem(var("i") / int(BUFFERS) + int(1), int(2)),
        }))],
    )
}

/// The producer warpgroup's loop when tiles land by TMA: tile i's buffer given back as in
/// [`producer`], then its first thread announces the tile's bytes on `full` and issues its
/// boxes (`flash_tma::load_tile`).
fn tma_producer(layout: CacheLayout, head_dim: usize) -> Vec<Stmt> {
    let step = vec![
        wait_for_buffer(),
        if_(
            eq(tid(), int(CONSUMERS)),
            flash_tma::load_tile(
                layout,
                (head_dim, KEYS),
                (
                    var("first_tile") + var("i") * int(KEYS),
                    ring_buffer(head_dim, var("i")),
                ),
                tma_gemm::barrier("full", rem(var("i"), int(BUFFERS))),
            ),
        ),
    ];
    vec![flash_tma::last_box(), for_("i", int(0), var("tiles"), int(1), step)]
}

/// A consumer warpgroup's step for tile i: its buffer handed over (`full`), the products,
/// and the previous tile's buffer given back (`empty`) once its values' product is done.
fn consumer_step(head_dim: usize, schedule: Schedule) -> Vec<Stmt> {
    let (products, hand_on) = tile_products(head_dim, schedule);
    [
        vec![
            let_("j0", Ty::I32, var("first_tile") + var("i") * int(KEYS)),
            let_("kv0", Ty::I32, ring_buffer(head_dim, var("i"))),
            Stmt::Mbarrier(Box::new(Mbarrier::Wait {
                barrier: tma_gemm::barrier("full", rem(var("i"), int(BUFFERS))),
                parity: rem(var("i") / int(BUFFERS), int(2)),
            })),
        ],
        products,
        vec![if_(
            bin(BinOp::Gt, var("i"), int(0)),
            vec![Stmt::Mbarrier(Box::new(Mbarrier::Arrive {
                barrier: tma_gemm::barrier("empty", rem(var("i") + int(BUFFERS - 1), int(BUFFERS))),
            }))],
        )],
        hand_on,
    ]
    .concat()
}

/// [`flash::flash_attention`] on `wgmma`, heads up to 128 dims ([`supports`]), its warps
/// working to `schedule`: the same parameters, rows and results, a batched step's
/// `query_tiles` cut in tiles of [`QUERY_TILE_ROWS`].
pub fn flash_attention_wgmma(
    name: &str,
    origin: &str,
    layout: CacheLayout,
    head_dim: usize,
    schedule: Schedule,
) -> Kernel {
    flash_attention_wgmma_over(name, origin, layout, (head_dim, Ty::Bf16), schedule)
}

/// [`flash_attention_wgmma`] over a cache of `cache` elements: bf16, f16 (its tiles, queries
/// and probabilities halves: `flash::tile_element`), or FP8 codes in the lockstep schedule
/// (copied as stored into a slot of their own, each tile widened to bf16 once into a ring of
/// [`FP8_BUFFERS`]; 196 KiB of shared memory at 128 dims), as `flash::flash_attention_over`
/// widens them for `mma.sync`.
pub fn flash_attention_wgmma_over(
    name: &str,
    origin: &str,
    layout: CacheLayout,
    (head_dim, cache): (usize, Ty),
    schedule: Schedule,
) -> Kernel {
    assert!(supports(head_dim), "head_dim {head_dim}");
    assert!(
        match cache {
            Ty::Bf16 | Ty::F16 => true,
            Ty::F8E4M3 => schedule == Schedule::Lockstep,
            _ => false,
        },
        "a {cache:?} cache in the {schedule:?} schedule"
    );
    let element = flash::tile_element(cache).ty();
    assert!(
        !schedule.tma() || flash_tma::supports(head_dim),
        "head_dim {head_dim} by TMA"
    );
    let threads = schedule.threads();
    let locals = output_registers(head_dim)
        .into_iter()
        .chain(tile_registers(s_name))
        .chain(tile_registers(p_name))
        .map(|n| let_(&n, Ty::F32, f(0.0)));
    // The last tile's probabilities by its values, and the outputs stored.
    let finish = [
        issue_values(head_dim, schedule.tma()),
        vec![Stmt::WgmmaCommit, Stmt::WgmmaWait(0)],
        store_outputs(head_dim),
    ]
    .concat();
    let prologue = [
        row_state(TILE_Q),
        vec![let_(
            "tiles",
            Ty::I32,
            (var("hi") - var("first_tile") + int(KEYS - 1)) / int(KEYS),
        )],
        load_queries(head_dim, threads),
        locals.collect(),
        // The first tile's step multiplies its own values by the zero probabilities.
        vec![let_("v0", Ty::I32, int(0))],
    ]
    .concat();
    let work = match schedule {
        Schedule::Lockstep => [
            match cache {
                Ty::F8E4M3 => fp8_copies(layout, head_dim, var("first_tile")),
                _ => copy_tile(
                    cache,
                    layout,
                    (head_dim, KEYS, TileOrder::CoreMatrices),
                    (tid(), CONSUMERS),
                    var("first_tile"),
                    int(0),
                ),
            },
            vec![for_(
                "i",
                int(0),
                var("tiles"),
                int(1),
                lockstep_step(layout, (head_dim, cache)),
            )],
            finish,
        ]
        .concat(),
        Schedule::Specialised | Schedule::Tma => vec![
            // The producer's lanes arrive for their copies, or its first lane for the boxes.
            tma_gemm::init_barriers(
                &[
                    ("full", if schedule.tma() { 1 } else { WARPGROUP as u32 }),
                    ("empty", CONSUMERS as u32),
                ],
                BUFFERS,
            ),
            tma_gemm::init_barriers(&[("turn", WARPGROUP as u32)], 2),
            // The queries' stores, for the tensor cores; the barriers, for every warp.
            Stmt::FenceProxyAsync,
            Stmt::SyncThreads,
            Stmt::Roles(Box::new(Roles {
                roles: vec![
                    Role {
                        cond: lt(tid(), int(CONSUMERS)),
                        body: [
                            vec![
                                Stmt::SetMaxRegisters {
                                    change: RegisterChange::Claim,
                                    count: schedule.registers().1,
                                },
                                let_("wg", Ty::I32, warp() / int(WARPGROUP / 32)),
                                for_("i", int(0), var("tiles"), int(1), consumer_step(head_dim, schedule)),
                            ],
                            finish,
                        ]
                        .concat(),
                    },
                    Role {
                        cond: bin(BinOp::Ge, tid(), int(CONSUMERS)),
                        body: [
                            vec![Stmt::SetMaxRegisters {
                                change: RegisterChange::Release,
                                count: schedule.registers().0,
                            }],
                            match schedule {
                                Schedule::Tma => tma_producer(layout, head_dim),
                                _ => producer((layout, cache), head_dim),
                            },
                        ]
                        .concat(),
                    },
                ],
            })),
        ],
    };
    let ring = match cache {
        Ty::F8E4M3 => FP8_BUFFERS,
        _ => BUFFERS,
    };
    let tile_elements = (ring * KEYS) as usize * head_dim;
    // Over FP8, the slot the codes land in.
    let landing = (cache == Ty::F8E4M3).then(|| {
        let len = KEYS as usize * flash::row_pitch(head_dim, Ty::F8E4M3) as usize;
        ["ks", "vs"].map(|n| SharedArray {
            name: flash::staged(n, cache),
            ty: cache,
            len,
        })
    });
    let shared = |name: &str, ty: Ty, len: usize| SharedArray {
        name: name.into(),
        ty,
        len,
    };
    let barriers = match schedule {
        Schedule::Lockstep => vec![],
        Schedule::Specialised | Schedule::Tma => vec![
            shared("full", Ty::U32, 2 * BUFFERS as usize),
            shared("empty", Ty::U32, 2 * BUFFERS as usize),
            shared("turn", Ty::U32, 4),
        ],
    };
    let warps = match schedule {
        Schedule::Lockstep => "two warpgroups copying and computing",
        Schedule::Specialised => "two consumer warpgroups taking turns and a producer warpgroup",
        Schedule::Tma => "two consumer warpgroups taking turns and a producer warpgroup issuing TMA",
    };
    let params = match schedule {
        Schedule::Tma => [flash::params_over(layout, cache), flash_tma::params()].concat(),
        _ => flash::params_over(layout, cache),
    };
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: causal prefill attention on wgmma (m64n{KEYS}k16 scores from shared memory, m64n{head_dim}k16 \
             P·V from registers, FlashAttention-3's intra-warpgroup overlap: {TILE_Q} query rows a block of \
             {warps}, {KEYS}-key tiles through a ring of {ring}, online softmax in f32), head_dim \
             {head_dim}, {} {}",
            flash::describe_cache(cache),
            layout.describe()
        ),
        params,
        shared: [
            vec![
                shared("qs", element, TILE_Q as usize * head_dim),
                shared("ks", element, tile_elements),
                shared("vs", element, tile_elements),
            ],
            landing.into_iter().flatten().collect(),
            barriers,
        ]
        .concat(),
        block_dim: threads as u32,
        grid: var("heads") * query_tiles_expr(layout, TILE_Q),
        body: guarded_by_rows(
            layout,
            block_rows(layout, (head_dim, 1), TILE_Q),
            [prologue, work].concat(),
        ),
    }
}
