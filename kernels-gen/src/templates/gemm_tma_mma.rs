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

use super::mma_operands::{b_block, lane_row, x4_names, Quad};
use super::tma_gemm::{self, barrier, TILE_K};
use crate::dsl::*;

const THREADS: i64 = 256;
/// Tokens and weight rows per block tile.
const TILE_M: i64 = 128;
const TILE_N: i64 = 128;
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

/// Thread 0's part of filling buffer `s` with step `step`.
fn fill(s: Expr, step: Expr) -> Vec<Stmt> {
    tma_gemm::fill(s, step, BOX, BOX, tma_gemm::WeightBoxes::Rows)
}

/// The warp's multiplies of buffer `s`: per 16-wide k slice, its fragments by `ldmatrix` at
/// swizzled addresses (each lane's 16-byte row stays whole under the swizzle: 4 loads of
/// A's four pairs, 2 of two row tiles' B; each lane's row and column from `a_row`,
/// `a_column`, `b_row`, `b_column`, see `mma_operands`), then 16 `mma`s.
fn multiply() -> Vec<Stmt> {
    let mut out = Vec::new();
    for slice in 0..(TILE_K / 16) as usize {
        let kk = int(16 * slice as i64);
        let a: Vec<Vec<String>> = (0..WARP_M_TILES)
            .map(|mi| x4_names("a", &format!("{slice}_{mi}")))
            .collect();
        for (mi, names) in a.iter().enumerate() {
            let row = var("a_row") + int(16 * mi as i64);
            let at = var("s") * int(BOX) + swizzled(row * int(TILE_K) + kk.clone() + var("a_column"));
            out.push(load_matrix("xs", at, names, false));
        }
        let b: Vec<Vec<String>> = (0..WARP_N_TILES / 2)
            .map(|pair| x4_names("b", &format!("{slice}_{pair}")))
            .collect();
        for (pair, names) in b.iter().enumerate() {
            let row = var("b_row") + int(16 * pair as i64);
            let at = var("s") * int(BOX) + swizzled(row * int(TILE_K) + kk.clone() + var("b_column"));
            out.push(load_matrix("ws", at, names, false));
        }
        for (mi, a) in a.iter().enumerate() {
            for ni in 0..WARP_N_TILES {
                out.push(Stmt::Mma(Box::new(MmaFragments {
                    element: MmaElement::Bf16,
                    a: MmaOperand::Pairs(a.clone()),
                    b: b_block(&b[ni / 2], ni % 2),
                    c: std::array::from_fn(|i| acc(mi, ni, i)),
                })));
            }
        }
    }
    out
}

/// The GEMM on bf16 `x` and `w`, its own tensor maps (`tma_gemm::params`).
pub fn gemm_tma_mma_bf16(name: &str, origin: &str) -> Kernel {
    gemm(name, origin, tma_gemm::params(TILE_M, TILE_N), (None, None))
}

/// The GEMM as a plan launches it in place of the GEMV of a matmul of form `(prologue, glu)`
/// (`tma_gemm::prologued_params`; see `gemm_tma_wgmma::gemm_tma_wgmma_bf16_prologued`).
pub fn gemm_tma_mma_bf16_prologued(
    name: &str,
    origin: &str,
    prologue: Option<super::gemv::NormPrologue>,
    glu: Option<ir::GluAct>,
) -> Kernel {
    gemm(
        name,
        origin,
        tma_gemm::prologued_params(prologue, TILE_M, TILE_N),
        (prologue, glu),
    )
}

fn gemm(name: &str, origin: &str, params: Vec<Param>, form: tma_gemm::ResultForm) -> Kernel {
    let first_thread = eq(tid(), int(0));
    let locals = (0..WARP_M_TILES)
        .flat_map(|mi| (0..WARP_N_TILES).flat_map(move |ni| (0..4).map(move |i| acc(mi, ni, i))))
        .map(|n| let_(&n, Ty::F32, f(0.0)));
    let step = [
        vec![
            let_("s", Ty::I32, rem(var("step"), int(STAGES))),
            Stmt::Mbarrier(Box::new(Mbarrier::Wait {
                barrier: barrier("full", var("s")),
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
                let token = var("m0") + var("wm") + int(16 * mi as i64 + if i >= 2 { 8 } else { 0 }) + var("group");
                let row = var("n0") + var("wn") + int(8 * ni as i64 + (i % 2) as i64) + var("t2");
                super::store_gemm_result(form.0, form.1, token, row, var(&acc(mi, ni, i)))
            })
        })
    });
    let body = [
        tma_gemm::tile_coordinates(TILE_M, TILE_N, bid()),
        vec![
            let_("wm", Ty::I32, warp() / int(4) * int(64)),
            let_("wn", Ty::I32, rem(warp(), int(4)) * int(32)),
            let_("group", Ty::I32, lane() / int(4)),
            let_("t2", Ty::I32, rem(lane(), int(4)) * int(2)),
            let_("a_row", Ty::I32, var("wm") + lane_row(Quad::RowsThenColumns).0),
            let_("a_column", Ty::I32, lane_row(Quad::RowsThenColumns).1),
            let_("b_row", Ty::I32, var("wn") + lane_row(Quad::ColumnsThenRows).0),
            let_("b_column", Ty::I32, lane_row(Quad::ColumnsThenRows).1),
            tma_gemm::init_barriers(&[("full", 1)], STAGES),
            // The barriers are initialised before anyone waits on them.
            Stmt::SyncThreads,
            tma_gemm::fill_ring(0, STAGES, BOX, BOX, tma_gemm::WeightBoxes::Rows),
        ],
        locals.collect(),
        vec![for_("step", int(0), var("steps"), int(1), step)],
        stores.collect(),
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
        grid: tma_gemm::grid(TILE_M, TILE_N),
        body,
    }
}
