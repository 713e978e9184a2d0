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
//! it rather than at the next `__syncthreads()`. Each role loops over its tiles, then their K
//! steps (CUTLASS's shape: with a tile's epilogue under a condition inside one flat loop,
//! `ptxas` serialises the `wgmma`s), counting the steps it has taken through the ring.
//! In a persistent schedule ([`TmaTile::persistent`]) a block for each multiprocessor takes
//! the tiles `gridDim` apart in turn: the producer fills the ring with the next tile's steps
//! while the consumers store the last tile's results, and a block initialises its barriers
//! once for all its tiles.
//!
//! K splits (`split_k`) as the other GEMMs: each block takes a span of whole steps and with
//! several splits writes its partial tile. The activations' rows are `x_stride` apart (a
//! multiple of 8, as TMA needs 16-byte row pitches), the weights' `k` (so `k` is a multiple of
//! 8).
//!
//! With a GLU epilogue (the weights a joined gate/up, `n` rows, gates first) a tile's weight
//! buffer is two boxes: `tile_n / 2` gate rows from `n0 / 2` and the same outputs' up rows
//! from `n / 2 + n0 / 2` (`tma_gemm::WeightBoxes::GateAndUp`). In `wgmma`'s accumulator layout
//! column c and column c + `tile_n / 2` are accumulators i and i + `tile_n / 4` of one thread,
//! so the thread gates its own products: `act(gate)·up` into `out` with one split, both into
//! the partials (where the joined rows put them) for the reduction with several.

use super::gemv::NormPrologue;
use super::tma_gemm::{self, barrier, swizzled_operand, TILE_K};
use crate::dsl::*;
use ir::GluAct;

/// The consumer warpgroups' threads; a warp-specialised block has a producer warp after them.
const CONSUMERS: i64 = 256;
/// Consumer warps: the arrivals each `empty` barrier's phase waits for.
const CONSUMER_WARPS: u32 = CONSUMERS as u32 / 32;
/// Tokens per block tile where they are wgmma's M: two warpgroups of M = 64.
const TILE_M: i64 = 128;
/// Weight rows per block tile where they are wgmma's M ([`TmaTile::tokens`] below 128).
const WEIGHTS_AS_M: u32 = 128;
/// 16-wide k slices per step.
const K_SLICES: i64 = TILE_K / 16;

/// The shape of one TMA GEMM: weight rows per block tile (wgmma's N), the depth of its ring
/// of buffers, and whether a step's MMAs still run while the next step begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TmaTile {
    /// 128 or 256: accumulators (`tile_n / 2` a thread) and the weight box's rows. 128 where
    /// the weights are wgmma's M (`tokens` below 128).
    pub tile_n: u32,
    /// Tokens a tile: 128, wgmma's M over the two warpgroups (64 each); or 16, 32 or 64,
    /// wgmma's N, the weights then its M (64 rows a warpgroup: the operands swapped), so a
    /// decode batch spends no tensor-core work on rows that are not there and a block's
    /// activations are one small box.
    pub tokens: u32,
    /// 2..=8 buffers, each `(128 + tile_n) × 128` bytes of shared memory.
    pub stages: u32,
    /// Whether each step waits only for the previous step's MMAs (`wgmma.wait_group 1`) and
    /// refills that step's buffer, so the tensor cores run through the barrier and the wait
    /// for the next buffer; otherwise a step waits for its own and refills its buffer.
    pub overlapped: bool,
    /// Whether a producer warp refills the buffers as the consumer warpgroups release them
    /// through `empty` mbarriers, or the block's first thread does after a `__syncthreads()`.
    pub specialised: bool,
    /// Where specialised, `Some(blocks)` launches at most `blocks` blocks (the GPU's
    /// multiprocessors), each taking the tiles `blocks` apart in turn through one ring: a
    /// persistent schedule, where a tile's copies go out while the previous tile's results
    /// are stored, and a block launches, initialises its barriers and fills its ring once.
    /// `None`: a block a tile.
    pub persistent: Option<u32>,
}

impl TmaTile {
    /// 128×128 tiles, four buffers (128 KiB of shared memory: one block an SM), MMAs
    /// overlapping the next step.
    pub const WIDE: TmaTile = TmaTile {
        tile_n: 128,
        tokens: 128,
        stages: 4,
        overlapped: true,
        specialised: false,
        persistent: None,
    };
    /// 128×256 tiles, four buffers (192 KiB), for GEMMs with tiles enough for every SM.
    pub const WIDEST: TmaTile = TmaTile {
        tile_n: 256,
        tokens: 128,
        stages: 4,
        overlapped: true,
        specialised: false,
        persistent: None,
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
    /// 128 weight rows × `tokens` (16, 32 or 64) tiles, the weights wgmma's M: six buffers
    /// (108 KiB at 64 tokens), MMAs overlapping the next step.
    pub const fn batch(tokens: u32) -> TmaTile {
        TmaTile {
            tile_n: WEIGHTS_AS_M,
            tokens,
            stages: 6,
            overlapped: true,
            specialised: false,
            persistent: None,
        }
    }

    /// `self` on `schedule`: as it is, warp-specialised, or persistent.
    pub fn scheduled(self, schedule: super::TmaSchedule) -> Self {
        use super::TmaSchedule;
        match schedule {
            TmaSchedule::BlockDriven => self,
            TmaSchedule::Specialised => Self {
                specialised: true,
                ..self
            },
            TmaSchedule::Persistent { blocks } => self.persistent(blocks),
        }
    }

    /// `self`, warp-specialised, in a persistent schedule of at most `blocks` blocks.
    pub fn persistent(self, blocks: u32) -> Self {
        Self {
            specialised: true,
            persistent: Some(blocks),
            ..self
        }
    }

    /// The tile sizes, for the split-K expression: (tokens, weight rows, K step).
    pub fn tiles(self) -> (usize, usize, usize) {
        (self.tile_m() as usize, self.tile_n as usize, TILE_K as usize)
    }

    /// Whether the weights are wgmma's M and the tokens its N.
    pub fn weights_as_m(self) -> bool {
        self.tokens < TILE_M as u32
    }

    fn tile_m(self) -> i64 {
        self.tokens as i64
    }

    /// Accumulators a thread: half of wgmma's N.
    fn accumulators(self) -> usize {
        match self.weights_as_m() {
            true => self.tokens as usize / 2,
            false => self.tile_n as usize / 2,
        }
    }

    fn x_elements(self) -> i64 {
        self.tile_m() * TILE_K
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

/// The weight boxes of a GEMM of result form `form`: a GLU's tile is half gate rows, half
/// the same outputs' up rows, so that the epilogue gates its own products.
fn weight_boxes(tile: TmaTile, form: tma_gemm::ResultForm) -> tma_gemm::WeightBoxes {
    match form.1 {
        Some(_) => tma_gemm::WeightBoxes::GateAndUp {
            group: gate_rows_a_box(tile),
        },
        None => tma_gemm::WeightBoxes::Rows,
    }
}

/// A GLU's gate rows a box (each followed by the same outputs' up rows): half the tile where
/// the weights are wgmma's N (accumulator columns c and c + `tile_n / 2` one thread's); 8
/// where they are its M (a thread's accumulator rows r and r + 8 of each 16-row slab).
fn gate_rows_a_box(tile: TmaTile) -> i64 {
    match tile.weights_as_m() {
        true => 8,
        false => tile.tile_n as i64 / 2,
    }
}

/// Thread 0's part of filling buffer `s` with step `step`.
fn fill(tile: TmaTile, form: tma_gemm::ResultForm, s: Expr, step: Expr) -> Vec<Stmt> {
    tma_gemm::fill(s, step, tile.x_elements(), tile.w_elements(), weight_boxes(tile, form))
}

/// The step's four k slices on the tensor cores, then the wait for them (or, overlapped, for
/// the previous step's).
fn multiply(tile: TmaTile) -> Vec<Stmt> {
    let swizzled = swizzled_operand;
    // wgmma's M operand (the warpgroup's 64 rows of it) and N operand: the activations and
    // the weights, or the other way round.
    let (m, n) = match tile.weights_as_m() {
        true => (("ws", tile.w_elements()), ("xs", tile.x_elements(), tile.tokens)),
        false => (("xs", tile.x_elements()), ("ws", tile.w_elements(), tile.tile_n)),
    };
    let mut out = vec![Stmt::WgmmaFence];
    for slice in 0..K_SLICES {
        out.push(Stmt::Wgmma(Box::new(WgmmaOp {
            n: n.2,
            a: WgmmaA::Shared(swizzled(
                m.0,
                var("s") * int(m.1) + var("wg") * int(64 * TILE_K) + int(16 * slice),
            )),
            b: swizzled(n.0, var("s") * int(n.1) + int(16 * slice)),
            b_major: Major::K,
            d: (0..tile.accumulators()).map(d_name).collect(),
        })));
    }
    out.extend([Stmt::WgmmaCommit, Stmt::WgmmaWait(tile.overlapped as u32)]);
    out
}

/// Store the accumulators where they fall inside the result (layout in `WgmmaOp`): `out` (its
/// rows laid out for `form`'s prologue and epilogue), or with several K splits this split's
/// partial tile. A GLU's tile holds gate columns then their up columns (`WeightBoxes`), so
/// accumulator `i` of the first half and `i` of the second are one output's gate and up, in
/// the same thread: with one split it stores `act(gate)·up`, with several both in the
/// partials where the joined rows put them, for the reduction to sum and gate.
fn store_accumulators(tile: TmaTile, form: tma_gemm::ResultForm) -> Vec<Stmt> {
    // Accumulator `i`'s row of wgmma's M (within the block's 128) and its column of N.
    let m_row = |i: usize| {
        let upper = i % 4 >= 2;
        var("wg") * int(64) + var("wrow") + var("gr") + int(if upper { 8 } else { 0 })
    };
    let n_col = |i: usize| int(8 * (i / 4) as i64 + (i % 2) as i64) + var("t2");
    // Accumulator `i`'s token, and its column from the tile's first, `first`.
    let place = |i: usize, first: Expr| match tile.weights_as_m() {
        false => (var("m0") + m_row(i), first + n_col(i)),
        true => (var("m0") + n_col(i), first + m_row(i)),
    };
    let accumulators = tile.accumulators();
    let Some(act) = form.1 else {
        return (0..accumulators)
            .map(|i| {
                let (row, col) = place(i, var("n0"));
                super::store_gemm_result(form.0, form.1, row, col, var(&d_name(i)))
            })
            .collect();
    };
    // (gate, up, token, output column): accumulators i and i + N / 4 of a thread where the
    // weights are N; where they are M, i and i + 2 (rows r and r + 8 of a 16-row slab, 8 gate
    // rows then the same outputs' 8 up rows), slab q's outputs 8q.. of the tile's.
    let pairs: Vec<(usize, usize, Expr, Expr)> = match tile.weights_as_m() {
        false => (0..accumulators / 2)
            .map(|i| {
                let (row, col) = place(i, var("n0") / int(2));
                (i, i + accumulators / 2, row, col)
            })
            .collect(),
        true => (0..accumulators)
            .filter(|i| i % 4 < 2)
            .map(|i| {
                let col = var("n0") / int(2) + (var("wg") * int(64) + var("wrow")) / int(2) + var("gr");
                (i, i + 2, var("m0") + n_col(i), col)
            })
            .collect(),
    };
    let half = var("n") / int(2);
    pairs
        .into_iter()
        .map(|(gate, up, row, col)| {
            let (gate, up) = (var(&d_name(gate)), var(&d_name(up)));
            let partial = |col: Expr, value: Expr| {
                store(
                    "partial",
                    (var("split") * var("tokens") + row.clone()) * var("n") + col,
                    value,
                )
            };
            if_(
                and(lt(row.clone(), var("tokens")), lt(col.clone(), half.clone())),
                vec![if_else(
                    eq(var("splits"), int(1)),
                    vec![store(
                        "out",
                        super::gemv::out_index(form.0, form.1, row.clone(), col.clone()),
                        super::gemv::gated(act, gate.clone(), up.clone()),
                    )],
                    vec![partial(col.clone(), gate), partial(half.clone() + col, up)],
                )],
            )
        })
        .collect()
}

/// The GEMM on bf16 `x` and `w`, its own tensor maps (`tma_gemm::params`).
pub fn gemm_tma_wgmma_bf16(name: &str, origin: &str, tile: TmaTile) -> Kernel {
    gemm(
        name,
        origin,
        tile,
        tma_gemm::params(tile.tile_m(), tile.tile_n as i64),
        (None, None),
    )
}

/// The GEMM with a GLU epilogue on bf16 `x` and a joined gate/up `w` (`n` rows, gates first),
/// its own tensor maps: `out[t, c] = act(x·gate_c)·(x·up_c)` for the `n / 2` columns with one
/// split, else the splits' products in the partials (`split_k::reduce_after_gating`).
pub fn gemm_tma_wgmma_bf16_gated(name: &str, origin: &str, tile: TmaTile, act: GluAct) -> Kernel {
    gemm(
        name,
        origin,
        tile,
        tma_gemm::params(tile.tile_m(), gate_rows_a_box(tile)),
        (None, Some(act)),
    )
}

/// The GEMM as a plan launches it in place of the GEMV of a matmul of form `(prologue, glu)`:
/// the GEMV's parameters first, then its activations as the `bf16_rows` kernel made them
/// (prologue applied), its result laid out as the GEMV's (`tma_gemm::prologued_params`); a
/// GLU epilogue its own with one split (the reduction's with several,
/// `split_k::reduce_after_gating`), the sums of several K splits the reduction's.
pub fn gemm_tma_wgmma_bf16_prologued(
    name: &str,
    origin: &str,
    tile: TmaTile,
    prologue: Option<NormPrologue>,
    glu: Option<GluAct>,
) -> Kernel {
    // A GLU's weight tile is boxes of gate rows and up rows (`WeightBoxes::GateAndUp`).
    let w_box_rows = match glu {
        Some(_) => gate_rows_a_box(tile),
        None => tile.tile_n as i64,
    };
    let params = tma_gemm::prologued_params(prologue, tile.tile_m(), w_box_rows);
    gemm(name, origin, tile, params, (prologue, glu))
}

fn gemm(name: &str, origin: &str, tile: TmaTile, params: Vec<Param>, form: tma_gemm::ResultForm) -> Kernel {
    assert!(matches!(tile.tile_n, 128 | 256), "tile_n {}", tile.tile_n);
    assert!(
        tile.tokens == TILE_M as u32 || (matches!(tile.tokens, 16 | 32 | 64) && tile.tile_n == WEIGHTS_AS_M),
        "tokens {} with tile_n {}",
        tile.tokens,
        tile.tile_n
    );
    assert!((2..=8).contains(&tile.stages), "stages {}", tile.stages);
    assert!(
        tile.specialised || tile.persistent.is_none(),
        "a persistent schedule needs a producer warp"
    );
    let stages = tile.stages as i64;
    let tile_n = tile.tile_n as i64;
    // What both forms begin with, once their tile coordinates are known or before the loop
    // taking them: each thread's place in the accumulator layout, the barriers, initialised
    // before anyone waits on them.
    let setup = |barriers: &[(&str, u32)]| {
        vec![
            let_("wg", Ty::I32, warp() / int(4)),
            let_("wrow", Ty::I32, rem(warp(), int(4)) * int(16)),
            let_("gr", Ty::I32, lane() / int(4)),
            let_("t2", Ty::I32, rem(lane(), int(4)) * int(2)),
            tma_gemm::init_barriers(barriers, stages),
            Stmt::SyncThreads,
        ]
    };
    let body = match tile.specialised {
        false => block_synchronised(tile, form, setup(&[("full", 1)])),
        true => specialised(tile, form, setup(&[("full", 1), ("empty", CONSUMER_WARPS)])),
    };
    let empty = tile.specialised.then(|| SharedArray {
        name: "empty".into(),
        ty: Ty::U32,
        len: 2 * stages as usize,
    });
    let shape = match tile.weights_as_m() {
        true => format!("wgmma m64n{}k16 bf16, the weights as M", tile.tokens),
        false => format!("wgmma m64n{tile_n}k16 bf16"),
    };
    let specialisation = match (tile.specialised, tile.persistent) {
        (true, Some(blocks)) => format!(
            ", a producer warp refilling each buffer as the consumer warps release it, at most \
             {blocks} blocks each taking tiles in turn"
        ),
        (true, None) => ", a producer warp refilling each buffer as the consumer warps release it".into(),
        (false, _) => String::new(),
    };
    let gating = match form.1 {
        Some(act) => format!(
            "; a tile's weights half gates, half their ups, the {act:?} GLU applied to its own \
             products with one split"
        ),
        None => String::new(),
    };
    let tile_m = tile.tile_m();
    let tiles = tma_gemm::grid(tile_m, tile_n);
    let grid = match tile.persistent {
        Some(blocks) => bin(BinOp::Min, tiles, int(blocks as i64)),
        None => tiles,
    };
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: matmul x·Wᵀ on Hopper tensor cores ({shape}, both operands from shared \
             memory, fed by TMA through a {stages}-buffer ring of 128-byte-swizzled \
             {tile_m}×{TILE_K} and {tile_n}×{TILE_K} boxes with mbarrier transaction counts{specialisation}, \
             K split in `splits`{gating})"
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
        grid,
        body,
    }
}

/// The block's tile on a ring its first thread refills after the block barrier that follows
/// the step retiring the MMAs reading a buffer.
fn block_synchronised(tile: TmaTile, form: tma_gemm::ResultForm, setup: Vec<Stmt>) -> Vec<Stmt> {
    let stages = tile.stages as i64;
    let consume = [
        vec![
            let_("s", Ty::I32, rem(var("step"), int(stages))),
            wait_full(var("step"), stages),
            Stmt::Comment("the tensor cores read the buffer straight from the TMA copies".into()),
        ],
        multiply(tile),
    ]
    .concat();
    // The step whose buffer every MMA reading it has retired after this step's wait: the
    // previous one (from the second step on) where the MMAs overlap the next step, else this
    // one. It is refilled with the step a ring later, where the split has one.
    let (done, refill) = match tile.overlapped {
        true => (
            var("step") - int(1),
            and(
                lt(int(0), var("step")),
                lt(var("step") - int(1) + int(stages), var("steps")),
            ),
        ),
        false => (var("step"), lt(var("step") + int(stages), var("steps"))),
    };
    let step = [
        consume,
        vec![
            Stmt::SyncThreads,
            if_(
                and(eq(tid(), int(0)), refill),
                fill(tile, form, rem(done.clone(), int(stages)), done + int(stages)),
            ),
        ],
    ]
    .concat();
    [
        tma_gemm::tile_coordinates(tile.tile_m(), tile.tile_n as i64, bid()),
        setup,
        vec![tma_gemm::fill_ring(
            0,
            stages,
            tile.x_elements(),
            tile.w_elements(),
            weight_boxes(tile, form),
        )],
        zeroed_accumulators(tile),
        vec![for_("step", int(0), var("steps"), int(1), step)],
        vec![Stmt::WgmmaWait(0)],
        store_accumulators(tile, form),
    ]
    .concat()
}

/// Warp-specialised: a producer warp and the consumer warpgroups each loop over the block's
/// tiles (its own, or with a persistent schedule those `gridDim` apart) and their K steps,
/// counting the steps they have taken (`it`) through one ring: step `it` takes buffer
/// `it % stages`, its `it / stages`-th use. The producer refills a buffer once every consumer
/// warp has released its previous use on `empty`; the consumers release it once the MMAs
/// reading it retire, and store a tile's results while the producer loads the next.
fn specialised(tile: TmaTile, form: tma_gemm::ResultForm, setup: Vec<Stmt>) -> Vec<Stmt> {
    let stages = tile.stages as i64;
    let tiles = tma_gemm::grid(tile.tile_m(), tile.tile_n as i64);
    let launched = match tile.persistent {
        Some(blocks) => bin(BinOp::Min, tiles.clone(), int(blocks as i64)),
        None => tiles.clone(),
    };
    let each_tile = |body: Vec<Stmt>| {
        vec![
            let_("it", Ty::I32, int(0)),
            for_(
                "tile",
                bid(),
                var("tiles"),
                var("launched"),
                [
                    tma_gemm::tile_coordinates(tile.tile_m(), tile.tile_n as i64, var("tile")),
                    body,
                ]
                .concat(),
            ),
        ]
    };
    let slot = |it: Expr| rem(it, int(stages));
    let advance = assign("it", var("it") + int(1));
    // The producer's first thread: a use of a buffer after the first waits for the release
    // of the use before (phase `it / stages - 1` of its `empty` barrier).
    let produce = vec![
        let_("s", Ty::I32, slot(var("it"))),
        if_(
            bin(BinOp::Ge, var("it"), int(stages)),
            vec![Stmt::Mbarrier(Box::new(Mbarrier::Wait {
                barrier: barrier("empty", var("s")),
                parity: rem(var("it") / int(stages) + int(1), int(2)),
            }))],
        ),
        Stmt::Comment("refill the buffer its consumers released".into()),
    ]
    .into_iter()
    .chain(fill(tile, form, var("s"), var("step")))
    .chain([advance.clone()])
    .collect();
    let producer = Role {
        cond: eq(warp(), int(CONSUMERS / 32)),
        body: vec![if_(
            eq(lane(), int(0)),
            each_tile(vec![for_("step", int(0), var("steps"), int(1), produce)]),
        )],
    };
    // Each consumer warp's first lane releases the use of step `it` (after its MMAs retired).
    let release = |it: Expr| {
        Stmt::Mbarrier(Box::new(Mbarrier::Arrive {
            barrier: barrier("empty", slot(it)),
        }))
    };
    // The step whose MMAs have retired after this step's wait: the previous one (from the
    // tile's second step on) where the MMAs overlap the next step, else this one.
    let (retired, any_retired) = match tile.overlapped {
        true => (var("it") - int(1), lt(int(0), var("step"))),
        false => (var("it"), Expr::Bool(true)),
    };
    let consume = [
        vec![let_("s", Ty::I32, slot(var("it"))), wait_full(var("it"), stages)],
        multiply(tile),
        vec![
            if_(and(any_retired, eq(lane(), int(0))), vec![release(retired)]),
            advance,
        ],
    ]
    .concat();
    // The tile's last MMAs, where they overlapped; then its results.
    let last_release = match tile.overlapped {
        true => vec![if_(
            and(lt(int(0), var("steps")), eq(lane(), int(0))),
            vec![release(var("it") - int(1))],
        )],
        false => vec![],
    };
    let consumers = Role {
        cond: lt(tid(), int(CONSUMERS)),
        body: each_tile(
            [
                zeroed_accumulators(tile),
                vec![for_("step", int(0), var("steps"), int(1), consume), Stmt::WgmmaWait(0)],
                last_release,
                store_accumulators(tile, form),
            ]
            .concat(),
        ),
    };
    [
        setup,
        vec![
            let_("tiles", Ty::I32, tiles),
            let_("launched", Ty::I32, launched),
            Stmt::Roles(Box::new(Roles {
                roles: vec![producer, consumers],
            })),
        ],
    ]
    .concat()
}

/// The consumers wait for the copies of step `it` to land in its buffer `s` (the `it /
/// stages`-th phase of its `full` barrier), which the tensor cores then read.
fn wait_full(it: Expr, stages: i64) -> Stmt {
    Stmt::Mbarrier(Box::new(Mbarrier::Wait {
        barrier: barrier("full", var("s")),
        parity: rem(it / int(stages), int(2)),
    }))
}

fn zeroed_accumulators(tile: TmaTile) -> Vec<Stmt> {
    (0..tile.accumulators())
        .map(|i| let_(&d_name(i), Ty::F32, f(0.0)))
        .collect()
}
