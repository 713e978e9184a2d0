//! GEMM for B200 (sm_100a) on TMA and `tcgen05.mma`: `out[t, r] = Σ_k x[t, k]·W[r, k]`,
//! bf16 activations and weights, f32 accumulation in tensor memory.
//!
//! Roles as in `gemm_tcgen05`: the MMA's M (128) is weight rows (A), its N the tile's tokens
//! (B, 16 to 256: [`TcgenTile::batch`] sizes decode batches' tiles), D[i][j] = out[m0 +
//! j][n0 + i]. K advances 64 at a time through a ring of
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
//! Warp-specialised ([`TcgenTile::SPECIALISED`]), six warps split the work: a producer warp's
//! first thread issues the copies, refilling a buffer once the commit of the MMAs reading it
//! (on the buffer's `empty` barrier) completes; an MMA warp's first thread issues each step's
//! MMAs once its copies land and commits them; four epilogue warps read the accumulators out.
//! Each role loops over its tiles, then their K steps. In a persistent schedule
//! ([`TcgenTile::persistent`]) a block for each multiprocessor takes the tiles `gridDim` apart
//! in turn, with two accumulators in tensor memory: the MMAs of one tile run while the
//! epilogue reads the tile before, handed over through `acc_full` (the MMA warp's commit of a
//! tile's last MMAs) and `acc_empty` (each epilogue warp's arrival once its reads are over).
//!
//! With a GLU epilogue (the weights a joined gate/up, `n` rows, gates first) a tile's weight
//! buffer is eight boxes of 16 rows: 16 outputs' gate rows from `n0 / 2`, their up rows from
//! `n / 2 + n0 / 2`, the next 16 outputs' gates, and so on (`tma_gemm::WeightBoxes::GateAndUp`),
//! so each epilogue warp's 32 TMEM lanes hold the gate and the up of 16 outputs: lane l takes
//! lane l + 16's product by a shuffle and stores `act(gate)·up` with one split; with several
//! each lane stores its own in the partials for the reduction to sum and gate.
//!
//! Requirements, checked by the caller: `k` and `x_stride` multiples of 8 (TMA's 16-byte row
//! pitches).

use super::tma_gemm::{self, barrier, swizzled_operand, TILE_K};
use crate::dsl::*;

const THREADS: i64 = 128;
/// The warp-specialised block's warps: four reading the accumulators out (each its quarter
/// of TMEM's lanes), then the producer and the MMA issuer.
const EPILOGUE_WARPS: i64 = 4;
const PRODUCER_WARP: i64 = 4;
const MMA_WARP: i64 = 5;
/// Weight rows per tile: the MMA's M, and TMEM lanes.
const TILE_ROWS: i64 = 128;
/// 16-wide k slices per step.
const K_SLICES: i64 = TILE_K / 16;
/// A GLU's tile: its weight rows in boxes of this many, gate rows then the same outputs' up
/// rows, so each warp's 32 TMEM lanes hold both products of 16 outputs
/// (`tma_gemm::WeightBoxes::GateAndUp`).
const GLU_GROUP: i64 = 16;

/// The shape of one TMA tcgen05 GEMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcgenTile {
    /// Tokens per tile: the MMA's N and an accumulator's TMEM columns (16, 32, 64, 128 or
    /// 256).
    pub tile_tokens: u32,
    /// 2..=8 buffers of `(128 + tile_tokens) × 128` bytes.
    pub stages: u32,
    /// Whether a producer warp, an MMA warp and epilogue warps split the work, meeting at
    /// mbarriers, or one thread drives the ring and everyone reads out at the end.
    pub specialised: bool,
    /// Where specialised, `Some(blocks)`: at most `blocks` blocks (the GPU's multiprocessors),
    /// each taking tiles in turn with two accumulators in tensor memory; `None`: a block a
    /// tile.
    pub persistent: Option<u32>,
}

impl TcgenTile {
    /// 128 tokens × 128 weight rows, four buffers (128 KiB).
    pub const WIDE: TcgenTile = TcgenTile {
        tile_tokens: 128,
        stages: 4,
        specialised: false,
        persistent: None,
    };
    /// [`Self::WIDE`], warp-specialised.
    pub const SPECIALISED: TcgenTile = TcgenTile {
        specialised: true,
        ..Self::WIDE
    };

    /// 128 weight rows × `tokens` (16, 32 or 64) tiles for decode batches, the tensor cores'
    /// work sized to the step's rows: six buffers (144 KiB at 64 tokens).
    pub const fn batch(tokens: u32) -> TcgenTile {
        TcgenTile {
            tile_tokens: tokens,
            stages: 6,
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

    /// Accumulators in tensor memory: two where a block takes tiles in turn (one read out
    /// while the next one's MMAs run), else one.
    fn accumulators(self) -> i64 {
        1 + self.persistent.is_some() as i64
    }

    /// TMEM columns allocated: an accumulator is a column a token (an allocation at least 32,
    /// a power of two).
    fn columns(self) -> u32 {
        (self.tile_tokens * self.accumulators() as u32).max(32)
    }

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

/// The weight boxes of a GEMM with a GLU epilogue (`glu`) or without.
fn weight_boxes(glu: bool) -> tma_gemm::WeightBoxes {
    match glu {
        true => tma_gemm::WeightBoxes::GateAndUp { group: GLU_GROUP },
        false => tma_gemm::WeightBoxes::Rows,
    }
}

/// Thread 0's part of filling buffer `s` with step `step`.
fn fill(tile: TcgenTile, glu: bool, s: Expr, step: Expr) -> Vec<Stmt> {
    tma_gemm::fill(s, step, tile.x_elements(), tile.w_elements(), weight_boxes(glu))
}

/// Wait for the copies of the ring's step `index` into buffer `s` (the `index / stages`-th
/// phase of its `full` barrier), then issue the K step's four k16 MMAs into the accumulator
/// at `tmem`, the tile's first (`step` 0) starting its sum.
fn multiply(tile: TcgenTile, index: &str, tmem: Expr) -> Vec<Stmt> {
    let stages = tile.stages as i64;
    let swizzled = swizzled_operand;
    let mut out = vec![
        mbarrier(Mbarrier::Wait {
            barrier: barrier("full", var("s")),
            parity: rem(var(index) / int(stages), int(2)),
        }),
        tc(Tcgen05::FenceAfterSync),
    ];
    for slice in 0..K_SLICES {
        out.push(tc(Tcgen05::Mma(Box::new(TmemMma {
            tmem: tmem.clone(),
            a: swizzled("ws", var("s") * int(tile.w_elements()) + int(16 * slice)),
            b: swizzled("xs", var("s") * int(tile.x_elements()) + int(16 * slice)),
            b_major: Major::K,
            n: tile.tile_tokens,
            accumulate: match slice {
                0 => lt(int(0), var("step")),
                _ => Expr::Bool(true),
            },
        }))));
    }
    out
}

/// Thread 0's step: wait for the buffer, issue its MMAs and commit them; then refill the
/// previous step's buffer once its MMAs are done.
fn step(tile: TcgenTile, glu: bool) -> Vec<Stmt> {
    let stages = tile.stages as i64;
    let mut issue = multiply(tile, "step", var("tmem"));
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
            fill(tile, glu, rem(previous.clone(), int(stages)), previous + int(stages)),
        ]
        .concat(),
    ));
    vec![
        let_("s", Ty::I32, rem(var("step"), int(stages))),
        if_(eq(tid(), int(0)), issue),
    ]
}

/// Each warp reads its 32 lanes (weight rows; this thread's is `row`) 8 tokens at a time from
/// the accumulator at column `first_column` (the first, if none) and stores them where they
/// fall in the result; a split past the end of K (no MMA, nothing in tensor memory) stores
/// zeros. A GLU's tile (`GLU_GROUP`) puts in each warp's lanes 16 outputs' gate rows, then
/// their up rows: lane l < 16 takes its up from lane l + 16 and, with one split, stores
/// `act(gate)·up` for output `output`; with several each lane stores its own in the
/// partials, where the joined rows put it.
fn epilogue(tile: TcgenTile, form: tma_gemm::ResultForm, first_column: Option<Expr>) -> Vec<Stmt> {
    let names: Vec<String> = (0..8).map(|j| format!("acc{j}")).collect();
    let token = |j: usize| var("m0") + var("c") * int(8) + int(j as i64);
    // Each token's value of this lane, and (a GLU's) of its partner lane.
    let stores = |values: Vec<(Expr, Expr)>| -> Vec<Stmt> {
        values
            .into_iter()
            .enumerate()
            .map(|(j, (value, partner))| match form.1 {
                None => super::store_gemm_result(form.0, form.1, token(j), var("row"), value),
                Some(act) => gated_store(form, act, token(j), (value, partner)),
            })
            .collect()
    };
    let partners = |names: &[String]| -> Vec<Stmt> {
        match form.1 {
            Some(_) => names
                .iter()
                .map(|n| let_(&format!("{n}_partner"), Ty::F32, shfl_xor(var(n), GLU_GROUP as u32)))
                .collect(),
            None => vec![],
        }
    };
    let partner = |n: &String| match form.1 {
        Some(_) => var(&format!("{n}_partner")),
        None => f(0.0),
    };
    let accumulator = match first_column {
        Some(column) => var("tmem") + column,
        None => var("tmem"),
    };
    let loaded = [
        vec![
            tc(Tcgen05::Load {
                address: accumulator + bin(BinOp::Shl, warp() * int(32), int(16)) + var("c") * int(8),
                names: names.clone(),
            }),
            tc(Tcgen05::WaitLd),
        ],
        partners(&names),
        stores(names.iter().map(|n| (var(n), partner(n))).collect()),
    ]
    .concat();
    vec![
        let_("row", Ty::I32, var("n0") + warp() * int(32) + lane()),
        let_(
            "output",
            Ty::I32,
            var("n0") / int(2) + warp() * int(GLU_GROUP) + rem(lane(), int(GLU_GROUP)),
        ),
        for_(
            "c",
            int(0),
            int(tile.tile_tokens as i64 / 8),
            int(1),
            // The same branch for the whole block: `tcgen05.ld` is warp-wide.
            vec![if_else(
                lt(int(0), var("steps")),
                loaded,
                stores(vec![(f(0.0), f(0.0)); names.len()]),
            )],
        ),
    ]
}

/// A GLU's result for `token` and this lane's `output` where it lies inside the result, from
/// this lane's product and its partner's (see [`epilogue`]).
fn gated_store(form: tma_gemm::ResultForm, act: ir::GluAct, token: Expr, (value, partner): (Expr, Expr)) -> Stmt {
    let gate_lane = lt(lane(), int(GLU_GROUP));
    let half = var("n") / int(2);
    let column = select(gate_lane.clone(), var("output"), half.clone() + var("output"));
    if_(
        and(lt(token.clone(), var("tokens")), lt(var("output"), half)),
        vec![if_else(
            eq(var("splits"), int(1)),
            vec![if_(
                gate_lane,
                vec![store(
                    "out",
                    super::gemv::out_index(form.0, form.1, token.clone(), var("output")),
                    super::gemv::gated(act, value.clone(), partner),
                )],
            )],
            vec![store(
                "partial",
                (var("split") * var("tokens") + token) * var("n") + column,
                value,
            )],
        )],
    )
}

/// The GEMM on bf16 `x` and `w`, its own tensor maps (`tma_gemm::params`).
pub fn gemm_tma_tcgen05_bf16(name: &str, origin: &str, tile: TcgenTile) -> Kernel {
    let params = tma_gemm::params(tile.tile_tokens as i64, TILE_ROWS);
    gemm(name, origin, tile, params, (None, None))
}

/// The GEMM on bf16 `x` and joined gate/up weights `w` (`n` rows, gates first), gating its own
/// products with `act` into `out` `[tokens, n / 2]` with one split (`split_k::reduce_after_gating`
/// after it, launching no blocks), or leaving both to the reduction with several.
pub fn gemm_tma_tcgen05_bf16_gated(name: &str, origin: &str, tile: TcgenTile, act: ir::GluAct) -> Kernel {
    let params = tma_gemm::params(tile.tile_tokens as i64, GLU_GROUP);
    gemm(name, origin, tile, params, (None, Some(act)))
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
    let w_box_rows = match glu {
        Some(_) => GLU_GROUP,
        None => TILE_ROWS,
    };
    let params = tma_gemm::prologued_params(prologue, tile.tile_tokens as i64, w_box_rows);
    gemm(name, origin, tile, params, (prologue, glu))
}

fn gemm(name: &str, origin: &str, tile: TcgenTile, params: Vec<Param>, form: tma_gemm::ResultForm) -> Kernel {
    assert!(
        matches!(tile.tile_tokens, 16 | 32 | 64 | 128 | 256),
        "tile_tokens {}",
        tile.tile_tokens
    );
    assert!((2..=8).contains(&tile.stages), "stages {}", tile.stages);
    assert!(
        tile.specialised || tile.persistent.is_none(),
        "a persistent schedule needs its roles"
    );
    let stages = tile.stages as i64;
    let tokens_per_tile = tile.tile_tokens as i64;
    let accumulators = tile.accumulators();
    // The columns, and the barriers, before anyone uses them.
    let setup = |barriers: Vec<Stmt>| {
        [
            vec![if_(
                eq(warp(), int(0)),
                vec![tc(Tcgen05::Alloc {
                    columns: tile.columns(),
                    slot: "tmem_slot".into(),
                })],
            )],
            barriers,
            vec![
                tc(Tcgen05::FenceBeforeSync),
                Stmt::SyncThreads,
                tc(Tcgen05::FenceAfterSync),
                let_("tmem", Ty::I32, load("tmem_slot", int(0))),
            ],
        ]
        .concat()
    };
    let (body, barriers) = match tile.specialised {
        false => {
            let barriers = vec![tma_gemm::init_barriers(&[("full", 1), ("done", 1)], stages)];
            (one_thread_driven(tile, form, setup(barriers)), vec![("done", stages)])
        }
        true => {
            let barriers = vec![
                tma_gemm::init_barriers(&[("full", 1), ("empty", 1)], stages),
                tma_gemm::init_barriers(&[("acc_full", 1), ("acc_empty", EPILOGUE_WARPS as u32)], accumulators),
            ];
            let arrays = vec![
                ("empty", stages),
                ("acc_full", accumulators),
                ("acc_empty", accumulators),
            ];
            (specialised(tile, form, setup(barriers)), arrays)
        }
    };
    let body = [
        body,
        vec![
            // Every warp has read its lanes before warp 0 frees the columns.
            tc(Tcgen05::FenceBeforeSync),
            Stmt::SyncThreads,
            if_(
                eq(warp(), int(0)),
                vec![tc(Tcgen05::Dealloc {
                    columns: tile.columns(),
                    address: var("tmem"),
                })],
            ),
        ],
    ]
    .concat();
    let gating = match form.1 {
        Some(act) => format!(
            "; a tile's weights 16 outputs' gates, then their ups, over again, the {act:?} GLU applied \
             to its own products with one split"
        ),
        None => String::new(),
    };
    let shared = |name: &str, ty: Ty, len: i64| SharedArray {
        name: name.into(),
        ty,
        len: len as usize,
    };
    let specialisation = match (tile.specialised, tile.persistent) {
        (true, Some(blocks)) => format!(
            ", a producer, an MMA and four epilogue warps, at most {blocks} blocks each taking tiles in \
             turn with two accumulators"
        ),
        (true, None) => ", a producer, an MMA and four epilogue warps".into(),
        (false, _) => String::new(),
    };
    let tiles = tma_gemm::grid(tokens_per_tile, TILE_ROWS);
    let grid = match tile.persistent {
        Some(blocks) => bin(BinOp::Min, tiles, int(blocks as i64)),
        None => tiles,
    };
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: matmul x·Wᵀ on Blackwell tensor cores (tcgen05.mma M=128 N={tokens_per_tile} bf16 into \
             tensor memory, both operands fed by TMA through a {stages}-buffer ring of 128-byte-swizzled \
             {TILE_ROWS}×{TILE_K} and {tokens_per_tile}×{TILE_K} boxes{specialisation}, K split in \
             `splits`{gating})"
        ),
        params,
        shared: [
            vec![
                shared("ws", Ty::Bf16, stages * tile.w_elements()),
                shared("xs", Ty::Bf16, stages * tile.x_elements()),
                shared("full", Ty::U32, 2 * stages),
            ],
            barriers
                .into_iter()
                .map(|(name, slots)| shared(name, Ty::U32, 2 * slots))
                .collect(),
            vec![shared("tmem_slot", Ty::I32, 1)],
        ]
        .concat(),
        block_dim: match tile.specialised {
            true => 32 * (MMA_WARP + 1) as u32,
            false => THREADS as u32,
        },
        grid,
        body,
    }
}

/// The block's tile, one thread driving the ring ([`step`]), then every warp reading out.
fn one_thread_driven(tile: TcgenTile, form: tma_gemm::ResultForm, setup: Vec<Stmt>) -> Vec<Stmt> {
    let stages = tile.stages as i64;
    let last = var("steps") - int(1);
    [
        tma_gemm::tile_coordinates(tile.tile_tokens as i64, TILE_ROWS, bid()),
        setup,
        vec![
            tma_gemm::fill_ring(
                0,
                stages,
                tile.x_elements(),
                tile.w_elements(),
                weight_boxes(form.1.is_some()),
            ),
            for_("step", int(0), var("steps"), int(1), step(tile, form.1.is_some())),
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
        epilogue(tile, form, None),
    ]
    .concat()
}

/// Warp-specialised: the producer, the MMA issuer and the epilogue warps each loop over the
/// block's tiles (its own, or in a persistent schedule those `gridDim` apart) and their K
/// steps, counting steps (`it`, buffer `it % stages`, its `it / stages`-th use) and tiles
/// (`t`, accumulator `t % accumulators`, likewise) through the rings.
fn specialised(tile: TcgenTile, form: tma_gemm::ResultForm, setup: Vec<Stmt>) -> Vec<Stmt> {
    let stages = tile.stages as i64;
    let accumulators = tile.accumulators();
    let tokens_per_tile = tile.tile_tokens as i64;
    let tiles = tma_gemm::grid(tokens_per_tile, TILE_ROWS);
    let launched = match tile.persistent {
        Some(blocks) => bin(BinOp::Min, tiles.clone(), int(blocks as i64)),
        None => tiles.clone(),
    };
    let each_tile = |counters: &[&str], body: Vec<Stmt>| -> Vec<Stmt> {
        let tile_loop = for_(
            "tile",
            bid(),
            var("tiles"),
            var("launched"),
            [
                tma_gemm::tile_coordinates(tokens_per_tile, TILE_ROWS, var("tile")),
                body,
            ]
            .concat(),
        );
        counters
            .iter()
            .map(|c| let_(c, Ty::I32, int(0)))
            .chain([tile_loop])
            .collect()
    };
    let count = |counter: &str| assign(counter, var(counter) + int(1));
    // The `n`-th use of a slot of a ring of `slots` waits for the phase of `array`'s slot
    // that ended the use before (phase `n / slots - 1`), from the second round on.
    let wait_previous_use = |array: &str, n: &str, slot: &str, slots: i64| {
        if_(
            bin(BinOp::Ge, var(n), int(slots)),
            vec![mbarrier(Mbarrier::Wait {
                barrier: barrier(array, var(slot)),
                parity: rem(var(n) / int(slots) + int(1), int(2)),
            })],
        )
    };
    let on_first_lane = |body: Vec<Stmt>| vec![if_(eq(lane(), int(0)), body)];
    let produce = [
        vec![
            let_("s", Ty::I32, rem(var("it"), int(stages))),
            wait_previous_use("empty", "it", "s", stages),
        ],
        fill(tile, form.1.is_some(), var("s"), var("step")),
        vec![count("it")],
    ]
    .concat();
    let producer = Role {
        cond: eq(warp(), int(PRODUCER_WARP)),
        body: on_first_lane(each_tile(
            &["it"],
            vec![for_("step", int(0), var("steps"), int(1), produce)],
        )),
    };
    let mut issue = [
        vec![let_("s", Ty::I32, rem(var("it"), int(stages)))],
        multiply(tile, "it", var("tmem") + var("a") * int(tokens_per_tile)),
    ]
    .concat();
    issue.extend([
        // The buffer is free once these MMAs complete.
        tc(Tcgen05::Commit {
            barrier: barrier("empty", var("s")),
        }),
        count("it"),
    ]);
    let multiply = vec![
        let_("a", Ty::I32, rem(var("t"), int(accumulators))),
        wait_previous_use("acc_empty", "t", "a", accumulators),
        tc(Tcgen05::FenceAfterSync),
        for_("step", int(0), var("steps"), int(1), issue),
        // The accumulator is the epilogue's once the tile's MMAs complete (at once where a
        // split past the end of K has none).
        if_else(
            lt(int(0), var("steps")),
            vec![tc(Tcgen05::Commit {
                barrier: barrier("acc_full", var("a")),
            })],
            vec![mbarrier(Mbarrier::Arrive {
                barrier: barrier("acc_full", var("a")),
            })],
        ),
        count("t"),
    ];
    let mma = Role {
        cond: eq(warp(), int(MMA_WARP)),
        body: on_first_lane(each_tile(&["it", "t"], multiply)),
    };
    let read_out = [
        vec![
            let_("a", Ty::I32, rem(var("t"), int(accumulators))),
            mbarrier(Mbarrier::Wait {
                barrier: barrier("acc_full", var("a")),
                parity: rem(var("t") / int(accumulators), int(2)),
            }),
            tc(Tcgen05::FenceAfterSync),
        ],
        epilogue(tile, form, Some(var("a") * int(tokens_per_tile))),
        vec![tc(Tcgen05::FenceBeforeSync)],
        // Each warp hands the accumulator back once its reads are over.
        on_first_lane(vec![mbarrier(Mbarrier::Arrive {
            barrier: barrier("acc_empty", var("a")),
        })]),
        vec![count("t")],
    ]
    .concat();
    let epilogue_warps = Role {
        cond: lt(warp(), int(EPILOGUE_WARPS)),
        body: each_tile(&["t"], read_out),
    };
    [
        setup,
        vec![
            let_("tiles", Ty::I32, tiles),
            let_("launched", Ty::I32, launched),
            Stmt::Roles(Box::new(Roles {
                roles: vec![producer, mma, epilogue_warps],
            })),
        ],
    ]
    .concat()
}
