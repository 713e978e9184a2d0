//! GEMM for the RTX PRO 6000 (sm_120a, which has TMA but neither `wgmma` nor `tcgen05`) on
//! TMA and `mma.sync`: `out[t, r] = Σ_k x[t, k]·W[r, k]`, bf16 activations and weights, f32
//! accumulation in registers.
//!
//! Tiling: a block of 8 warps computes a 128×128 tile (128 tokens × 128 weight rows), warp w
//! its 64 tokens `64·(w / 4)..` by 32 rows `32·(w % 4)..`: 4 × 4 `mma.m16n8k16` tiles, 64
//! accumulators a lane. K advances 64 at a time through a ring of 3 buffers in dynamic shared
//! memory (96 KiB, within sm_120a's 99 KiB a block), each holding the step's activation and
//! weight boxes (128 × 64 each) as TMA writes them under the 128-byte swizzle; the warps read
//! their fragments from them at swizzled addresses (element `i` of a box at
//! `i ^ ((i >> 6) & 7) << 3`), so the 8 rows a fragment load touches fall in 8 different
//! bank groups. Thread 0 announces each buffer's bytes on its mbarrier and issues the copies;
//! every thread waits for the phase before reading, and the buffer is refilled after the
//! `__syncthreads()` that follows the step, so two steps' copies are in flight while the
//! tensor cores work on one.
//!
//! K splits as the other GEMMs (`split_k`). Requirements, checked by the caller: `k` and
//! `x_stride` multiples of 8 (TMA's 16-byte row pitches).

use super::split_k;
use crate::dsl::*;

const THREADS: i64 = 256;
/// Tokens and weight rows per block tile.
const TILE_M: i64 = 128;
const TILE_N: i64 = 128;
/// K per pipeline step: one 128-byte swizzled row of bf16.
const TILE_K: i64 = 64;
/// Buffers in the ring.
const STAGES: i64 = 3;
/// Elements of one box.
const BOX: i64 = TILE_M * TILE_K;
/// Each warp's 64 tokens × 32 weight rows: `mma` tiles of 16 tokens and of 8 rows.
const WARP_M_TILES: usize = 4;
const WARP_N_TILES: usize = 4;

/// The tile sizes, for the split-K expression: (tokens, weight rows, K step).
pub const TILES: (usize, usize, usize) = (TILE_M as usize, TILE_N as usize, TILE_K as usize);

/// The element of a 128-byte-swizzled box holding logical element `index` (from a 1 KiB
/// aligned start): `Swizzle::B128` as an expression.
fn swizzled(index: Expr) -> Expr {
    bin(
        BinOp::BitXor,
        index.clone(),
        bin(
            BinOp::Shl,
            bin(BinOp::BitAnd, bin(BinOp::Shr, index, int(6)), int(7)),
            int(3),
        ),
    )
}

fn acc(mi: usize, ni: usize, i: usize) -> String {
    format!("c{mi}_{ni}_{i}")
}

/// Thread 0's part of filling buffer `s` with step `step` (relative to `k_begin`).
fn fill(s: Expr, step: Expr) -> Vec<Stmt> {
    let k0 = var("k_begin") + step * int(TILE_K);
    let barrier = MbarrierRef {
        array: "full".into(),
        slot: s.clone(),
    };
    let copy = |map: &str, dst: &str, row: Expr| {
        Stmt::TmaLoad(Box::new(TmaLoad {
            map: map.into(),
            dst: dst.into(),
            dst_index: s.clone() * int(BOX),
            row,
            col: k0.clone(),
            barrier: barrier.clone(),
        }))
    };
    vec![
        Stmt::Mbarrier(Box::new(Mbarrier::ArriveExpectTx {
            barrier: barrier.clone(),
            bytes: 2 * 2 * BOX as u32,
        })),
        copy("x_map", "xs", var("m0")),
        copy("w_map", "ws", var("n0")),
    ]
}

/// The warp's multiplies of buffer `s`: per 16-wide k slice, its A fragments (4 token tiles)
/// and B fragments (4 row tiles) read at swizzled addresses, then 16 `mma`s.
fn multiply() -> Vec<Stmt> {
    let mut out = Vec::new();
    for slice in 0..(TILE_K / 16) as usize {
        for mi in 0..WARP_M_TILES {
            for i in 0..8 {
                let row = var("wm") + int(16 * mi as i64 + if i % 4 >= 2 { 8 } else { 0 }) + var("g");
                let kk = int(16 * slice as i64 + (i % 2) as i64 + if i >= 4 { 8 } else { 0 }) + var("t2");
                let at = var("s") * int(BOX) + swizzled(row * int(TILE_K) + kk);
                out.push(assign(&format!("a{mi}_{i}"), load("xs", at)));
            }
        }
        for ni in 0..WARP_N_TILES {
            for i in 0..4 {
                let row = var("wn") + int(8 * ni as i64) + var("g");
                let kk = int(16 * slice as i64 + (i % 2) as i64 + if i >= 2 { 8 } else { 0 }) + var("t2");
                let at = var("s") * int(BOX) + swizzled(row * int(TILE_K) + kk);
                out.push(assign(&format!("b{ni}_{i}"), load("ws", at)));
            }
        }
        for mi in 0..WARP_M_TILES {
            for ni in 0..WARP_N_TILES {
                out.push(Stmt::MmaBf16(Box::new(MmaFragments {
                    a: std::array::from_fn(|i| format!("a{mi}_{i}")),
                    b: std::array::from_fn(|i| format!("b{ni}_{i}")),
                    c: std::array::from_fn(|i| acc(mi, ni, i)),
                })));
            }
        }
    }
    out
}

pub fn gemm_tma_mma_bf16(name: &str, origin: &str) -> Kernel {
    let tiles_m = (var("tokens") + int(TILE_M - 1)) / int(TILE_M);
    let tiles_n = (var("n") + int(TILE_N - 1)) / int(TILE_N);
    let first_thread = eq(tid(), int(0));
    let locals = (0..WARP_M_TILES)
        .flat_map(|mi| (0..WARP_N_TILES).flat_map(move |ni| (0..4).map(move |i| acc(mi, ni, i))))
        .chain((0..WARP_M_TILES).flat_map(|mi| (0..8).map(move |i| format!("a{mi}_{i}"))))
        .chain((0..WARP_N_TILES).flat_map(|ni| (0..4).map(move |i| format!("b{ni}_{i}"))))
        .map(|n| let_(&n, Ty::F32, f(0.0)));
    let step = [
        vec![
            let_("s", Ty::I32, rem(var("step"), int(STAGES))),
            Stmt::Mbarrier(Box::new(Mbarrier::Wait {
                barrier: MbarrierRef {
                    array: "full".into(),
                    slot: var("s"),
                },
                parity: rem(var("step") / int(STAGES), int(2)),
            })),
        ],
        multiply(),
        vec![
            // Every warp is done with buffer s: refill it.
            Stmt::SyncThreads,
            if_(
                and(first_thread.clone(), lt(var("step") + int(STAGES), var("steps"))),
                fill(var("s"), var("step") + int(STAGES)),
            ),
        ],
    ]
    .concat();
    let stores = (0..WARP_M_TILES).flat_map(|mi| {
        (0..WARP_N_TILES).flat_map(move |ni| {
            (0..4).map(move |i| {
                let token = var("m0") + var("wm") + int(16 * mi as i64 + if i >= 2 { 8 } else { 0 }) + var("g");
                let row = var("n0") + var("wn") + int(8 * ni as i64 + (i % 2) as i64) + var("t2");
                super::store_gemm_result(None, None, token, row, var(&acc(mi, ni, i)))
            })
        })
    });
    let body = [
        vec![
            // Token tiles vary fastest: neighbouring blocks share a weight tile. Then the K
            // splits of one weight tile, then the weight tiles.
            let_("m0", Ty::I32, rem(bid(), tiles_m.clone()) * int(TILE_M)),
            let_("split", Ty::I32, rem(bid() / tiles_m.clone(), var("splits"))),
            let_("n0", Ty::I32, bid() / tiles_m.clone() / var("splits") * int(TILE_N)),
            let_("wm", Ty::I32, warp() / int(4) * int(64)),
            let_("wn", Ty::I32, rem(warp(), int(4)) * int(32)),
            let_("g", Ty::I32, lane() / int(4)),
            let_("t2", Ty::I32, rem(lane(), int(4)) * int(2)),
        ],
        split_k::k_span(var("split"), TILE_K),
        vec![
            let_(
                "steps",
                Ty::I32,
                bin(
                    BinOp::Max,
                    int(0),
                    (var("k_end") - var("k_begin") + int(TILE_K - 1)) / int(TILE_K),
                ),
            ),
            if_(
                first_thread.clone(),
                (0..STAGES)
                    .map(|s| {
                        Stmt::Mbarrier(Box::new(Mbarrier::Init {
                            barrier: MbarrierRef {
                                array: "full".into(),
                                slot: int(s),
                            },
                            count: 1,
                        }))
                    })
                    .collect(),
            ),
            // The barriers are initialised before anyone waits on them.
            Stmt::SyncThreads,
            if_(
                first_thread,
                (0..STAGES)
                    .map(|s| if_(lt(int(s), var("steps")), fill(int(s), int(s))))
                    .collect(),
            ),
        ],
        locals.collect(),
        vec![for_("step", int(0), var("steps"), int(1), step)],
        stores.collect(),
    ]
    .concat();
    let map = |name: &str, buffer: &str, rows: &str, stride: &str, box_rows: i64| {
        Param::TensorMap(Box::new(TensorMap {
            name: name.into(),
            buffer: buffer.into(),
            rows: var(rows),
            cols: var("k"),
            stride: var(stride),
            box_rows: box_rows as u32,
            box_cols: TILE_K as u32,
            swizzle: Swizzle::B128,
        }))
    };
    let params = [
        vec![
            buffer("x", Ty::Bf16, false),
            buffer("w", Ty::Bf16, false),
            buffer("out", Ty::F32, true),
            scalar("tokens", Ty::I32),
            scalar("n", Ty::I32),
            scalar("k", Ty::I32),
            scalar("x_stride", Ty::I32),
        ],
        split_k::params(),
        vec![
            map("x_map", "x", "tokens", "x_stride", TILE_M),
            map("w_map", "w", "n", "k", TILE_N),
        ],
    ]
    .concat();
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: matmul x·Wᵀ on tensor cores (mma.sync m16n8k16 bf16, {TILE_M}×{TILE_N} tiles of 8 warps, \
             fed by TMA through a {STAGES}-buffer ring of 128-byte-swizzled {TILE_M}×{TILE_K} boxes, K split in `splits`)"
        ),
        params,
        shared: vec![
            SharedArray {
                name: "xs".into(),
                ty: Ty::Bf16,
                len: (STAGES * BOX) as usize,
            },
            SharedArray {
                name: "ws".into(),
                ty: Ty::Bf16,
                len: (STAGES * BOX) as usize,
            },
            SharedArray {
                name: "full".into(),
                ty: Ty::U32,
                len: 2 * STAGES as usize,
            },
        ],
        block_dim: THREADS as u32,
        grid: tiles_m * tiles_n * var("splits"),
        body,
    }
}
