//! GEMM for B200 (sm_100a) on TMA and `tcgen05.mma`: `out[t, r] = Σ_k x[t, k]·W[r, k]`,
//! bf16 activations and weights, f32 accumulation in tensor memory.
//!
//! Roles as in `gemm_tcgen05`: the MMA's M (128) is weight rows (A), its N the tile's tokens
//! (B, 64 to 256), D[i][j] = out[m0 + j][n0 + i]. K advances 64 at a time through a ring of
//! `stages` buffers in dynamic shared memory, each holding the step's weight box (128 × 64)
//! and activation box (`tile_tokens` × 64) as TMA writes them under the 128-byte swizzle,
//! which the MMAs' descriptors read (stride byte offset 1 KiB, each 16-wide k slice 32 bytes
//! along the row).
//!
//! One thread drives the pipeline: it announces and issues each buffer's two copies on the
//! buffer's `full` barrier, waits for them, issues the step's four k16 MMAs and commits them
//! to the buffer's `done` barrier; before refilling the previous step's buffer it waits for
//! that step's commit, so the tensor cores are never short of a step's MMAs while a buffer
//! is refilled. The other threads wait only for the last step's commit, then each warp reads
//! its 32 TMEM lanes (weight rows) 8 tokens at a time and stores them (`out`, or with several
//! K splits the split's partial tile).
//!
//! Requirements, checked by the caller: `k` and `x_stride` multiples of 8 (TMA's 16-byte row
//! pitches).

use super::tma_gemm::{self, barrier, swizzled_operand, TILE_K};
use crate::dsl::*;

const THREADS: i64 = 128;
/// Weight rows per tile: the MMA's M, and TMEM lanes.
const TILE_ROWS: i64 = 128;
/// 16-wide k slices per step.
const K_SLICES: i64 = TILE_K / 16;

/// The shape of one TMA tcgen05 GEMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcgenTile {
    /// Tokens per tile: the MMA's N and the TMEM columns allocated (64, 128 or 256).
    pub tile_tokens: u32,
    /// 2..=8 buffers of `(128 + tile_tokens) × 128` bytes.
    pub stages: u32,
}

impl TcgenTile {
    /// 128 tokens × 128 weight rows, four buffers (128 KiB).
    pub const WIDE: TcgenTile = TcgenTile {
        tile_tokens: 128,
        stages: 4,
    };

    /// The tile sizes, for the split-K expression: (tokens, weight rows, K step).
    pub fn tiles(self) -> (usize, usize, usize) {
        (self.tile_tokens as usize, TILE_ROWS as usize, TILE_K as usize)
    }

    fn w_elements(self) -> i64 {
        TILE_ROWS * TILE_K
    }

    fn x_elements(self) -> i64 {
        self.tile_tokens as i64 * TILE_K
    }
}

fn mbarrier(op: Mbarrier) -> Stmt {
    Stmt::Mbarrier(Box::new(op))
}

fn tc(op: Tcgen05) -> Stmt {
    Stmt::Tcgen05(Box::new(op))
}

/// Thread 0's part of filling buffer `s` with step `step`.
fn fill(tile: TcgenTile, s: Expr, step: Expr) -> Vec<Stmt> {
    tma_gemm::fill(s, step, tile.x_elements(), tile.w_elements())
}

/// Thread 0's step: wait for the buffer, issue its MMAs and commit them; then refill the
/// previous step's buffer once its MMAs are done.
fn step(tile: TcgenTile) -> Vec<Stmt> {
    let stages = tile.stages as i64;
    let swizzled = swizzled_operand;
    let mut issue = vec![
        mbarrier(Mbarrier::Wait {
            barrier: barrier("full", var("s")),
            parity: rem(var("step") / int(stages), int(2)),
        }),
        tc(Tcgen05::FenceAfterSync),
    ];
    for slice in 0..K_SLICES {
        issue.push(tc(Tcgen05::Mma(Box::new(TmemMma {
            tmem: var("tmem"),
            a: swizzled("ws", var("s") * int(tile.w_elements()) + int(16 * slice)),
            b: swizzled("xs", var("s") * int(tile.x_elements()) + int(16 * slice)),
            n: tile.tile_tokens,
            // The first MMA of the split starts the sum.
            accumulate: match slice {
                0 => lt(int(0), var("step")),
                _ => Expr::Bool(true),
            },
        }))));
    }
    issue.push(tc(Tcgen05::Commit {
        barrier: barrier("done", var("s")),
    }));
    let previous = var("step") - int(1);
    issue.push(if_(
        and(
            lt(int(0), var("step")),
            lt(previous.clone() + int(stages), var("steps")),
        ),
        [
            vec![mbarrier(Mbarrier::Wait {
                barrier: barrier("done", rem(previous.clone(), int(stages))),
                parity: rem(previous.clone() / int(stages), int(2)),
            })],
            fill(tile, rem(previous.clone(), int(stages)), previous + int(stages)),
        ]
        .concat(),
    ));
    vec![
        let_("s", Ty::I32, rem(var("step"), int(stages))),
        if_(eq(tid(), int(0)), issue),
    ]
}

/// Each warp reads its 32 lanes (weight rows; this thread's is `row`) 8 tokens at a time and
/// stores them where they fall in the result; a split past the end of K (no MMA, nothing in
/// tensor memory) stores zeros.
fn epilogue(tile: TcgenTile, form: tma_gemm::ResultForm) -> Vec<Stmt> {
    let names: Vec<String> = (0..8).map(|j| format!("acc{j}")).collect();
    let stores = |values: Vec<Expr>| -> Vec<Stmt> {
        values
            .into_iter()
            .enumerate()
            .map(|(j, value)| {
                let token = var("m0") + var("c") * int(8) + int(j as i64);
                super::store_gemm_result(form.0, form.1, token, var("row"), value)
            })
            .collect()
    };
    let loaded = [
        vec![
            tc(Tcgen05::Load {
                address: var("tmem") + bin(BinOp::Shl, warp() * int(32), int(16)) + var("c") * int(8),
                names: names.clone(),
            }),
            tc(Tcgen05::WaitLd),
        ],
        stores(names.iter().map(|n| var(n)).collect()),
    ]
    .concat();
    vec![
        let_("row", Ty::I32, var("n0") + warp() * int(32) + lane()),
        for_(
            "c",
            int(0),
            int(tile.tile_tokens as i64 / 8),
            int(1),
            // The same branch for the whole block: `tcgen05.ld` is warp-wide.
            vec![if_else(
                lt(int(0), var("steps")),
                loaded,
                stores(vec![f(0.0); names.len()]),
            )],
        ),
    ]
}

/// The GEMM on bf16 `x` and `w`, its own tensor maps (`tma_gemm::params`).
pub fn gemm_tma_tcgen05_bf16(name: &str, origin: &str, tile: TcgenTile) -> Kernel {
    let params = tma_gemm::params(tile.tile_tokens as i64, TILE_ROWS);
    gemm(name, origin, tile, params, (None, None))
}

/// The GEMM as a plan launches it in place of the GEMV of a matmul of form `(prologue, glu)`
/// (`tma_gemm::prologued_params`; see `gemm_tma_wgmma::gemm_tma_wgmma_bf16_prologued`).
pub fn gemm_tma_tcgen05_bf16_prologued(
    name: &str,
    origin: &str,
    tile: TcgenTile,
    prologue: Option<super::gemv::NormPrologue>,
    glu: Option<ir::GluAct>,
) -> Kernel {
    let params = tma_gemm::prologued_params(prologue, tile.tile_tokens as i64, TILE_ROWS);
    gemm(name, origin, tile, params, (prologue, glu))
}

fn gemm(name: &str, origin: &str, tile: TcgenTile, params: Vec<Param>, form: tma_gemm::ResultForm) -> Kernel {
    assert!(
        matches!(tile.tile_tokens, 64 | 128 | 256),
        "tile_tokens {}",
        tile.tile_tokens
    );
    assert!((2..=8).contains(&tile.stages), "stages {}", tile.stages);
    let stages = tile.stages as i64;
    let tokens_per_tile = tile.tile_tokens as i64;
    let last = var("steps") - int(1);
    let body = [
        tma_gemm::tile_coordinates(tokens_per_tile, TILE_ROWS, bid()),
        vec![
            if_(
                eq(warp(), int(0)),
                vec![tc(Tcgen05::Alloc {
                    columns: tile.tile_tokens,
                    slot: "tmem_slot".into(),
                })],
            ),
            tma_gemm::init_barriers(&[("full", 1), ("done", 1)], stages),
            tc(Tcgen05::FenceBeforeSync),
            Stmt::SyncThreads,
            tc(Tcgen05::FenceAfterSync),
            let_("tmem", Ty::I32, load("tmem_slot", int(0))),
            tma_gemm::fill_ring(0, stages, tile.x_elements(), tile.w_elements()),
            for_("step", int(0), var("steps"), int(1), step(tile)),
            // Everyone waits for the last step's MMAs before reading tensor memory.
            if_(
                lt(int(0), var("steps")),
                vec![mbarrier(Mbarrier::Wait {
                    barrier: barrier("done", rem(last.clone(), int(stages))),
                    parity: rem(last / int(stages), int(2)),
                })],
            ),
            tc(Tcgen05::FenceAfterSync),
        ],
        epilogue(tile, form),
        vec![
            // Every warp has read its lanes before warp 0 frees the columns.
            tc(Tcgen05::FenceBeforeSync),
            Stmt::SyncThreads,
            if_(
                eq(warp(), int(0)),
                vec![tc(Tcgen05::Dealloc {
                    columns: tile.tile_tokens,
                    address: var("tmem"),
                })],
            ),
        ],
    ]
    .concat();
    let shared = |name: &str, ty: Ty, len: i64| SharedArray {
        name: name.into(),
        ty,
        len: len as usize,
    };
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: matmul x·Wᵀ on Blackwell tensor cores (tcgen05.mma M=128 N={tokens_per_tile} bf16 into \
             tensor memory, both operands fed by TMA through a {stages}-buffer ring of 128-byte-swizzled \
             {TILE_ROWS}×{TILE_K} and {tokens_per_tile}×{TILE_K} boxes, K split in `splits`)"
        ),
        params,
        shared: vec![
            shared("ws", Ty::Bf16, stages * tile.w_elements()),
            shared("xs", Ty::Bf16, stages * tile.x_elements()),
            shared("full", Ty::U32, 2 * stages),
            shared("done", Ty::U32, 2 * stages),
            shared("tmem_slot", Ty::I32, 1),
        ],
        block_dim: THREADS as u32,
        grid: tma_gemm::grid(tokens_per_tile, TILE_ROWS),
        body,
    }
}
