//! GEMM for Hopper (sm_90a) on TMA and `wgmma` with both operands in shared memory:
//! `out[t, r] = Σ_k x[t, k]·W[r, k]`, bf16 activations and weights, f32 accumulation.
//!
//! Tiling: a block of two warpgroups (256 threads) computes a 128×`tile_n` tile of `out`,
//! warpgroup w its rows 64w..64w+64 with `wgmma.m64n{tile_n}k16` (`tile_n / 2` f32
//! accumulators a thread). K advances 64 at a time through a ring of `stages` buffers in
//! dynamic shared memory, each holding the step's activation box (128 × 64) and weight box
//! (`tile_n` × 64), both as TMA writes them under the 128-byte swizzle: one 128-byte row per
//! token or weight row, 8-row atoms of 1 KiB, which the `wgmma` descriptors read back
//! (stride byte offset 1 KiB, each 16-wide k slice 32 bytes further along the row) without
//! bank conflicts. Rows past `tokens` or `n` and columns past `k` arrive as zeros.
//!
//! Each buffer has an mbarrier. Thread 0 announces a step's bytes on its buffer's barrier
//! (`mbarrier.arrive.expect_tx`) and issues its two TMA copies; every thread waits for the
//! barrier's phase before the tensor cores read the buffer, and the refill of a buffer is
//! issued after the `__syncthreads()` that follows the wait retiring the last `wgmma` reading
//! it. Overlapped ([`TmaTile::overlapped`]), a step waits only for the previous step's MMAs and
//! refills the previous step's buffer, so the tensor cores keep working through the barrier
//! and the next wait. So `stages - 1` or `stages - 2` steps' copies are in flight while the
//! tensor cores work, and no thread spends registers or instructions on moving operands: a
//! copy is one instruction for 16–48 KiB.
//!
//! Warp-specialised ([`TmaTile::specialised`]), a ninth warp produces: its first thread
//! issues every copy, and the two consumer warpgroups never meet at a block barrier. Each
//! buffer has a second mbarrier, `empty`, on which each consumer warp arrives once its MMAs
//! reading the buffer have retired; the producer waits for a buffer's `empty` phase before
//! refilling it. A warpgroup slowed (by a late copy, or the other's memory traffic) no longer
//! stalls the other, and the refill of a buffer goes out as soon as both have finished with
//! it rather than at the next `__syncthreads()`.
//!
//! K splits (`split_k`) as the other GEMMs: each block takes a span of whole steps and with
//! several splits writes its partial tile. The activations' rows are `x_stride` apart (a
//! multiple of 8, as TMA needs 16-byte row pitches), the weights' `k` (so `k` is a multiple of
//! 8).

use super::gemv::NormPrologue;
use super::tma_gemm::{self, barrier, swizzled_operand, TILE_K};
use crate::dsl::*;
use ir::GluAct;

/// The consumer warpgroups' threads; a warp-specialised block has a producer warp after them.
const CONSUMERS: i64 = 256;
/// Consumer warps: the arrivals each `empty` barrier's phase waits for.
const CONSUMER_WARPS: u32 = CONSUMERS as u32 / 32;
/// Tokens per block tile: two warpgroups of wgmma's M = 64.
const TILE_M: i64 = 128;
/// 16-wide k slices per step.
const K_SLICES: i64 = TILE_K / 16;

/// The shape of one TMA GEMM: weight rows per block tile (wgmma's N), the depth of its ring
/// of buffers, and whether a step's MMAs still run while the next step begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TmaTile {
    /// 128 or 256: accumulators (`tile_n / 2` a thread) and the weight box's rows.
    pub tile_n: u32,
    /// 2..=8 buffers, each `(128 + tile_n) × 128` bytes of shared memory.
    pub stages: u32,
    /// Whether each step waits only for the previous step's MMAs (`wgmma.wait_group 1`) and
    /// refills that step's buffer, so the tensor cores run through the barrier and the wait
    /// for the next buffer; otherwise a step waits for its own and refills its buffer.
    pub overlapped: bool,
    /// Whether a producer warp refills the buffers as the consumer warpgroups release them
    /// through `empty` mbarriers, or the block's first thread does after a `__syncthreads()`.
    pub specialised: bool,
}

impl TmaTile {
    /// 128×128 tiles, four buffers (128 KiB of shared memory: one block an SM), MMAs
    /// overlapping the next step.
    pub const WIDE: TmaTile = TmaTile {
        tile_n: 128,
        stages: 4,
        overlapped: true,
        specialised: false,
    };
    /// 128×256 tiles, four buffers (192 KiB), for GEMMs with tiles enough for every SM.
    pub const WIDEST: TmaTile = TmaTile {
        tile_n: 256,
        stages: 4,
        overlapped: true,
        specialised: false,
    };
    /// [`Self::WIDE`] with a producer warp (warp specialisation).
    pub const SPECIALISED: TmaTile = TmaTile {
        specialised: true,
        ..Self::WIDE
    };
    /// [`Self::WIDEST`] with a producer warp.
    pub const SPECIALISED_WIDEST: TmaTile = TmaTile {
        specialised: true,
        ..Self::WIDEST
    };

    /// The tile sizes, for the split-K expression: (tokens, weight rows, K step).
    pub fn tiles(self) -> (usize, usize, usize) {
        (TILE_M as usize, self.tile_n as usize, TILE_K as usize)
    }

    fn x_elements(self) -> i64 {
        TILE_M * TILE_K
    }

    fn w_elements(self) -> i64 {
        self.tile_n as i64 * TILE_K
    }

    /// Threads a block: the consumers, and a producer warp where specialised.
    fn threads(self) -> i64 {
        CONSUMERS + 32 * self.specialised as i64
    }
}

fn d_name(i: usize) -> String {
    format!("d{i}")
}

/// Thread 0's part of filling buffer `s` with step `step`.
fn fill(tile: TmaTile, s: Expr, step: Expr) -> Vec<Stmt> {
    tma_gemm::fill(s, step, tile.x_elements(), tile.w_elements())
}

/// The step's four k slices on the tensor cores, then the wait for them (or, overlapped, for
/// the previous step's).
fn multiply(tile: TmaTile) -> Vec<Stmt> {
    let swizzled = swizzled_operand;
    let mut out = vec![Stmt::WgmmaFence];
    for slice in 0..K_SLICES {
        out.push(Stmt::Wgmma(Box::new(WgmmaOp {
            n: tile.tile_n,
            a: WgmmaA::Shared(swizzled(
                "xs",
                var("s") * int(tile.x_elements()) + var("wg") * int(64 * TILE_K) + int(16 * slice),
            )),
            b: swizzled("ws", var("s") * int(tile.w_elements()) + int(16 * slice)),
            d: (0..tile.tile_n as usize / 2).map(d_name).collect(),
        })));
    }
    out.extend([Stmt::WgmmaCommit, Stmt::WgmmaWait(tile.overlapped as u32)]);
    out
}

/// Store the accumulators where they fall inside the result (layout in `WgmmaOp`): `out` (its
/// rows laid out for `form`'s prologue and epilogue), or with several K splits, or a GLU
/// epilogue, this split's partial tile.
fn store_accumulators(tile: TmaTile, form: tma_gemm::ResultForm) -> Vec<Stmt> {
    (0..tile.tile_n as usize / 2)
        .map(|i| {
            let upper = i % 4 >= 2;
            let row = var("m0") + var("wg") * int(64) + var("wrow") + var("gr") + int(if upper { 8 } else { 0 });
            let col = var("n0") + int(8 * (i / 4) as i64 + (i % 2) as i64) + var("t2");
            super::store_gemm_result(form.0, form.1, row, col, var(&d_name(i)))
        })
        .collect()
}

/// The GEMM on bf16 `x` and `w`, its own tensor maps (`tma_gemm::params`).
pub fn gemm_tma_wgmma_bf16(name: &str, origin: &str, tile: TmaTile) -> Kernel {
    gemm(
        name,
        origin,
        tile,
        tma_gemm::params(TILE_M, tile.tile_n as i64),
        (None, None),
    )
}

/// The GEMM as a plan launches it in place of the GEMV of a matmul of form `(prologue, glu)`:
/// the GEMV's parameters first, then its activations as the `bf16_rows` kernel made them
/// (prologue applied), its result laid out as the GEMV's (`tma_gemm::prologued_params`); a
/// GLU epilogue (and the sums of several K splits) left to the `split_k` reduction.
pub fn gemm_tma_wgmma_bf16_prologued(
    name: &str,
    origin: &str,
    tile: TmaTile,
    prologue: Option<NormPrologue>,
    glu: Option<GluAct>,
) -> Kernel {
    let params = tma_gemm::prologued_params(prologue, TILE_M, tile.tile_n as i64);
    gemm(name, origin, tile, params, (prologue, glu))
}

fn gemm(name: &str, origin: &str, tile: TmaTile, params: Vec<Param>, form: tma_gemm::ResultForm) -> Kernel {
    assert!(matches!(tile.tile_n, 128 | 256), "tile_n {}", tile.tile_n);
    assert!((2..=8).contains(&tile.stages), "stages {}", tile.stages);
    let stages = tile.stages as i64;
    let tile_n = tile.tile_n as i64;
    // The thread issuing the copies: the producer warp's first where specialised.
    let producer = CONSUMERS * tile.specialised as i64;
    let consume = vec![
        let_("s", Ty::I32, rem(var("step"), int(stages))),
        Stmt::Mbarrier(Box::new(Mbarrier::Wait {
            barrier: barrier("full", var("s")),
            parity: rem(var("step") / int(stages), int(2)),
        })),
        Stmt::Comment("the tensor cores read the buffer straight from the TMA copies".into()),
    ]
    .into_iter()
    .chain(multiply(tile));
    // The step whose buffer every MMA reading it has retired after this step's wait: the
    // previous one (from the second step on) where the MMAs overlap the next step, else this
    // one. It is refilled with the step a ring later, where the split has one.
    let (done, done_exists) = match tile.overlapped {
        true => (var("step") - int(1), Some(lt(int(0), var("step")))),
        false => (var("step"), None),
    };
    let once_done = |cond: Expr| match &done_exists {
        Some(exists) => and(exists.clone(), cond),
        None => cond,
    };
    let refill = once_done(lt(done.clone() + int(stages), var("steps")));
    let refill_done = fill(tile, rem(done.clone(), int(stages)), done.clone() + int(stages));
    let accumulators: Vec<Stmt> = (0..tile.tile_n as usize / 2)
        .map(|i| let_(&d_name(i), Ty::F32, f(0.0)))
        .collect();
    // The last step's MMAs, where they overlapped; then the results, by the consumers.
    let finish = [vec![Stmt::WgmmaWait(0)], store_accumulators(tile, form)].concat();
    let main_loop = match tile.specialised {
        // Every warpgroup is done with the buffer once past the block barrier.
        false => {
            let step = consume
                .chain([
                    Stmt::SyncThreads,
                    if_(and(eq(tid(), int(producer)), refill), refill_done),
                ])
                .collect();
            [
                accumulators,
                vec![for_("step", int(0), var("steps"), int(1), step)],
                finish,
            ]
            .concat()
        }
        // Each consumer warp releases the buffer; the producer waits for all eight. The
        // roles loop apart, the accumulators the consumers' own.
        true => {
            let release = Stmt::Mbarrier(Box::new(Mbarrier::Arrive {
                barrier: barrier("empty", rem(done.clone(), int(stages))),
            }));
            let wait_released = Stmt::Mbarrier(Box::new(Mbarrier::Wait {
                barrier: barrier("empty", rem(done.clone(), int(stages))),
                parity: rem(done / int(stages), int(2)),
            }));
            let consumers = Role {
                cond: lt(tid(), int(CONSUMERS)),
                setup: accumulators,
                body: consume
                    .chain([if_(once_done(eq(lane(), int(0))), vec![release])])
                    .collect(),
                finish,
            };
            let producer = Role {
                cond: eq(warp(), int(CONSUMERS / 32)),
                setup: vec![],
                body: vec![if_(
                    and(eq(tid(), int(producer)), refill),
                    [vec![wait_released], refill_done].concat(),
                )],
                finish: vec![],
            };
            vec![Stmt::Roles(Box::new(Roles {
                var: "step".into(),
                start: int(0),
                end: var("steps"),
                roles: vec![consumers, producer],
            }))]
        }
    };
    let barriers: &[(&str, u32)] = match tile.specialised {
        true => &[("full", 1), ("empty", CONSUMER_WARPS)],
        false => &[("full", 1)],
    };
    let body = [
        tma_gemm::tile_coordinates(TILE_M, tile_n),
        vec![
            let_("wg", Ty::I32, warp() / int(4)),
            let_("wrow", Ty::I32, rem(warp(), int(4)) * int(16)),
            let_("gr", Ty::I32, lane() / int(4)),
            let_("t2", Ty::I32, rem(lane(), int(4)) * int(2)),
            tma_gemm::init_barriers(barriers, stages),
            // The barriers are initialised before anyone waits on them.
            Stmt::SyncThreads,
            tma_gemm::fill_ring(producer, stages, tile.x_elements(), tile.w_elements()),
        ],
        main_loop,
    ]
    .concat();
    let empty = tile.specialised.then(|| SharedArray {
        name: "empty".into(),
        ty: Ty::U32,
        len: 2 * stages as usize,
    });
    let specialisation = match tile.specialised {
        true => ", a producer warp refilling each buffer as the consumer warps release it",
        false => "",
    };
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: matmul x·Wᵀ on Hopper tensor cores (wgmma m64n{tile_n}k16 bf16, both operands \
             from shared memory, fed by TMA through a {stages}-buffer ring of 128-byte-swizzled \
             {TILE_M}×{TILE_K} and {tile_n}×{TILE_K} boxes with mbarrier transaction counts{specialisation}, \
             K split in `splits`)"
        ),
        params,
        shared: vec![
            SharedArray {
                name: "xs".into(),
                ty: Ty::Bf16,
                len: (stages * tile.x_elements()) as usize,
            },
            SharedArray {
                name: "ws".into(),
                ty: Ty::Bf16,
                len: (stages * tile.w_elements()) as usize,
            },
            SharedArray {
                name: "full".into(),
                ty: Ty::U32,
                len: 2 * stages as usize,
            },
        ]
        .into_iter()
        .chain(empty)
        .collect(),
        block_dim: tile.threads() as u32,
        grid: tma_gemm::grid(TILE_M, tile_n),
        body,
    }
}
