//! Prefill GEMM for Hopper (sm_90a): `out[t, r] = Σ_k x[t, k]·W[r, k]` with bf16 weights
//! (activations rounded to bf16, f32 accumulation) on `wgmma`, the warpgroup-wide
//! asynchronous tensor-core instruction, fed by a three-stage `cp.async` pipeline.
//!
//! Tiling: one warpgroup (128 threads) computes a 64×128 tile of `out` (64 tokens × 128
//! weight rows) with `wgmma.m64n128k16`: 64 f32 accumulators per thread. K advances 64 at a
//! time. The weight slice of a step (128 rows × 64) travels global → shared with `cp.async`
//! (16 bytes a copy, no registers, zero-filled past `n` and `k`) into one of three buffers
//! while the tensor cores work on another, so the copies of steps i+1 and i+2 overlap the math
//! of step i (two stages, as the GPU runs until the fourth timed it, in [`Schedule`]).
//! Activations go straight to registers as `wgmma`'s A operand (f32 in global memory, rounded
//! to bf16 when packed), a step ahead (see [`ALoads`]).
//!
//! Shared layout: `wgmma` reads B through a descriptor without swizzling, as 8×8 core
//! matrices of 128 contiguous bytes (8 rows × 8 k). Core matrices of one 8-row group sit
//! next to each other along K (leading byte offset 128) and groups follow each other (stride
//! byte offset 1 KiB); each 16-wide k slice starts 2 core matrices further. A warp's copies of
//! one instruction cover 8 rows × 4 chunks: 64 contiguous bytes of each row in global memory
//! (whole 32-byte sectors) and, per 8-lane phase, one 128-byte core matrix in shared memory
//! (no bank conflicts).
//!
//! Requirements, checked by the caller: `k` a multiple of 8 (each 16-byte copy is wholly
//! inside a row and aligned). Why this shape on H200: a 64×128 tile per 128 threads keeps
//! the accumulators in registers (181–238 a thread with the next step's A fragments, no
//! spills: two blocks an SM) and 48 KiB of static shared memory (three stages, the most a
//! block may take without dynamic shared memory) fits two blocks an SM as well; a prefill
//! chunk of 512 tokens over a 4096-row weight gives 8×32 = 256 tiles for 132 SMs.

use super::gemv::{self, NormPrologue};
use super::{prologue_gemm_params, prologue_norms, split_k, PrologueLocals};
use crate::dsl::*;
use ir::GluAct;

const THREADS: i64 = 128;
/// Tokens per block tile: wgmma's M.
const TILE_M: i64 = 64;
/// Weight rows per block tile: wgmma's N.
pub(super) const TILE_N: i64 = 128;
/// K per pipeline stage.
pub(super) const TILE_K: i64 = 64;
/// Elements of one stage's weight slice.
pub(super) const STAGE: i64 = TILE_N * TILE_K;
/// bf16 elements per 16-byte copy (one core-matrix row).
pub(super) const CHUNK: i64 = 8;
/// Bytes between core matrices adjacent along K, and between 8-row groups.
const LEADING_BYTES: u32 = 128;
const STRIDE_BYTES: u32 = (TILE_K * 16) as u32;
/// 16-wide k slices per stage.
pub(super) const K_SLICES: usize = (TILE_K / 16) as usize;

/// When a step's A fragments are loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ALoads {
    /// In the step that multiplies them, while its weights land: each step then waits for a
    /// round trip to L2 before its `wgmma`. On the second H200 run every shape's steps took
    /// about 3 µs at 16 and 64 tokens (19–33% of copy bandwidth).
    InStep,
    /// In the step before, into a second set of registers (32 more a thread), so the loads'
    /// latency passes under that step's weight wait and `wgmma`.
    StepAhead,
}

/// The A fragment `i` of k slice `slice`: `a…` multiplied this step, `an…` the next step's.
pub(super) fn a_name(slice: usize, i: usize) -> String {
    format!("a{slice}_{i}")
}

pub(super) fn next_a_name(slice: usize, i: usize) -> String {
    format!("an{slice}_{i}")
}

pub(super) fn d_name(i: usize) -> String {
    format!("d{i}")
}

/// Issue the copies of the weight slice at `k0` into stage buffer `stage`: copy
/// `c = tid + 128·i` takes row `8·(c / 64) + c % 8`, k chunk `(c / 8) % 8`.
fn copy_stage(stage: Expr, k0: Expr) -> Vec<Stmt> {
    let c = var("c");
    let dst = stage * int(STAGE)
        + var("row") / int(8) * int(TILE_K * 8)
        + var("chunk") * int(64)
        + rem(var("row"), int(8)) * int(8);
    vec![for_(
        "i",
        int(0),
        int(STAGE / CHUNK / THREADS),
        int(1),
        vec![
            let_("c", Ty::I32, tid() + var("i") * int(THREADS)),
            let_("row", Ty::I32, c.clone() / int(64) * int(8) + rem(c.clone(), int(8))),
            let_("chunk", Ty::I32, rem(c / int(8), int(8))),
            let_("col", Ty::I32, k0 + var("chunk") * int(CHUNK)),
            Stmt::CpAsync(Box::new(AsyncCopy {
                dst: "ws".into(),
                dst_index: dst,
                src: "w".into(),
                src_index: (var("n0") + var("row")) * var("k") + var("col"),
                valid: and(lt(var("n0") + var("row"), var("n")), lt(var("col"), var("k"))),
            })),
        ],
    )]
}

/// Load this thread's A fragments (named by `name`) of the stage at `k0` (zero past `tokens`
/// and `k`): per k slice, rows g and g + 8 of the warp's 16, columns 2t, 2t + 1 and those + 8.
/// Under a norm prologue each x meets its norm weight `g + offset` here, its square added to
/// the row's `sq_lo` or `sq_hi` (the row's `1/rms` is applied to the result). Under a residual
/// prologue the blocks of the first weight tile also write the sums they loaded: each (row,
/// column) is one thread's of one such block.
///
/// A prologue's loads all come first, then its arithmetic (`templates::prologue_loads`): one
/// round trip to L2 a step. ptxas keeps the loaded `b` and norm weights beside the
/// accumulators and both steps' fragments without spilling (236–238 registers on sm_90a, from
/// 198: still 2 blocks an SM).
fn load_a(norm: Option<NormPrologue>, glu: Option<GluAct>, k0: Expr, name: fn(usize, usize) -> String) -> Vec<Stmt> {
    let pairs = (0..K_SLICES).flat_map(|slice| [(0, 0), (1, 0), (0, 1), (1, 1)].map(|(r, c)| (slice, r, c)));
    let mut loads = Vec::new();
    let mut arithmetic = Vec::new();
    for pair in pairs {
        let (_, row_half, _) = pair;
        let sum = ["sq_lo", "sq_hi"][row_half as usize];
        let add_square = |square: Expr| assign(sum, var(sum) + square);
        let elements = [0, 1].map(|j| fragment_element(&k0, name, pair, j));
        let mut loaded = Vec::new();
        let mut finished = Vec::new();
        for (at, locals) in &elements {
            loads.push(assign(&locals.value, f(0.0)));
            // The first row half loads the column's norm weight for both (the second is
            // inside `tokens` only where the first is).
            let with_weight = row_half == 0;
            loads.extend(locals.declare_inputs(norm, with_weight));
            loaded.extend(super::prologue_loads(norm, at.clone(), locals, with_weight));
            finished.extend(super::prologue_arithmetic(norm, glu, at.clone(), locals, &add_square));
        }
        // Both elements of a pair are inside K or neither (`k` is a multiple of 8).
        let (row, col) = &elements[0].0;
        let inside = and(lt(row.clone(), var("tokens")), lt(col.clone(), var("k")));
        loads.push(if_(inside.clone(), loaded));
        if !finished.is_empty() {
            arithmetic.push(if_(inside, finished));
        }
    }
    [loads, arithmetic].concat()
}

/// Where element j (0 or 1) of the fragment pair at (`slice`, `row_half`, `col_half`) lies:
/// its row and column of `x`, and the locals it passes through (the norm weight's shared by
/// the two row halves of a column).
fn fragment_element(
    k0: &Expr,
    name: fn(usize, usize) -> String,
    (slice, row_half, col_half): (usize, i64, i64),
    j: usize,
) -> ((Expr, Expr), PrologueLocals) {
    let row = var("m0") + var("wrow") + var("gr") + int(8 * row_half);
    let col = k0.clone() + int(16 * slice as i64 + 8 * col_half + j as i64) + var("t2");
    let value = name(slice, 2 * row_half as usize + 4 * col_half as usize + j);
    let locals = PrologueLocals {
        addend: format!("{value}_b"),
        weight: format!("g{slice}_{}", 2 * col_half as usize + j),
        value,
    };
    ((row, col), locals)
}

/// The stage's four k slices on the tensor cores (A the registers `a{slice}_{i}`, the
/// accumulators `d{i}`), waited for before returning.
pub(super) fn multiply_stage() -> Vec<Stmt> {
    let mut out = vec![Stmt::WgmmaFence];
    for slice in 0..K_SLICES {
        out.push(Stmt::Wgmma(Box::new(WgmmaOp {
            n: TILE_N as u32,
            a: WgmmaA::Registers(std::array::from_fn(|i| a_name(slice, i))),
            b: SmemMatrix {
                array: "ws".into(),
                start: var("s") * int(STAGE) + int(2 * slice as i64 * 64),
                lbo: LEADING_BYTES,
                sbo: STRIDE_BYTES,
                swizzle: Swizzle::None,
            },
            b_major: Major::K,
            d: (0..TILE_N as usize / 2).map(d_name).collect(),
        })));
    }
    out.extend([Stmt::WgmmaCommit, Stmt::WgmmaWait(0)]);
    out
}

/// Store the accumulators where they fall inside the result (layout in `WgmmaOp`): `out`, or
/// with several K splits (or a GLU epilogue, which the reduction applies) this split's partial
/// tile.
fn store_accumulators(norm: Option<NormPrologue>, glu: Option<GluAct>) -> Vec<Stmt> {
    (0..TILE_N as usize / 2)
        .map(|i| {
            let upper = i % 4 >= 2;
            let row = var("m0") + var("wrow") + var("gr") + int(if upper { 8 } else { 0 });
            let col = var("n0") + int(8 * (i / 4) as i64 + (i % 2) as i64) + var("t2");
            let value = match norm {
                Some(_) => var(&d_name(i)) * var(if upper { "scale_hi" } else { "scale_lo" }),
                None => var(&d_name(i)),
            };
            super::store_gemm_result(norm, glu, row, col, value)
        })
        .collect()
}

/// Under a norm prologue, after the main loop: `scale_lo` and `scale_hi`, what this lane's two
/// rows' products are multiplied by (`prologue_norms::row_scale`), from the squares the row's
/// quad loaded (its four lanes hold every column of its two rows between them).
fn row_scales(norm: NormPrologue) -> Vec<Stmt> {
    let mut out = Vec::new();
    for (sum, half, scale) in [("sq_lo", 0, "scale_lo"), ("sq_hi", 8, "scale_hi")] {
        out.extend([1, 2].map(|m| assign(sum, var(sum) + shfl_xor(var(sum), m))));
        let row = var("m0") + var("wrow") + var("gr") + int(half);
        out.extend(prologue_norms::row_scale(norm, sum, row, eq(var("t2"), int(0)), scale));
    }
    out
}

/// The tile sizes, for the split-K expression: (tokens, weight rows, K step).
pub const TILES: (usize, usize, usize) = (TILE_M as usize, TILE_N as usize, TILE_K as usize);

pub fn gemm_wgmma_bf16(name: &str, origin: &str) -> Kernel {
    gemm_wgmma_bf16_with(name, origin, None, None)
}

/// A step's A fragments ahead of it: the next step's loaded (where there is one in this K
/// split) after this step's are taken from the registers they were loaded into.
fn a_step_ahead(norm: Option<NormPrologue>, glu: Option<GluAct>) -> Vec<Stmt> {
    let mut out: Vec<Stmt> = (0..K_SLICES)
        .flat_map(|s| (0..8).map(move |i| assign(&a_name(s, i), var(&next_a_name(s, i)))))
        .collect();
    let next = var("k0") + int(TILE_K);
    out.push(if_(
        lt(next.clone(), var("k_end")),
        load_a(norm, glu, next, next_a_name),
    ));
    out
}

/// The GEMM with an RMSNorm of `x` before it (`g` its weight): what `rms_norm_matmul` runs for
/// steps of many rows (an LM head over a batch, a first layer's QKV).
///
/// With `glu` (the weights a joined gate/up) every product goes to the partials, even in one
/// piece, and the reduction (`split_k::reduce` with the same `glu`) applies `act(gate)·up`: a
/// gate column and its up column lie in different weight tiles.
pub fn gemm_wgmma_bf16_with(name: &str, origin: &str, norm: Option<NormPrologue>, glu: Option<GluAct>) -> Kernel {
    gemm_wgmma_bf16_scheduled(name, origin, norm, glu, Schedule::PLANS)
}

/// How a Hopper GEMM runs its K loop: when its A fragments are loaded, and how many weight
/// slices its `cp.async` pipeline holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    pub a_loads: ALoads,
    /// 2 or 3: three 16 KiB slices are all the static shared memory a block may take.
    pub stages: i64,
}

impl Schedule {
    /// What plans build. Three stages: with two, a block has one slice in flight while it
    /// multiplies another, 16 KiB, 32 KiB an SM at two blocks, where the H200's 4.3 TB/s at
    /// about a microsecond of latency wants some 33 KiB in flight an SM (the two-stage GEMMs
    /// ran at 23–43% of copy bandwidth at 16 and 64 rows). Three keep two slices in flight.
    pub const PLANS: Schedule = Schedule {
        a_loads: ALoads::StepAhead,
        stages: 3,
    };

    /// Activations loaded in their step, two weight stages (the GPU check times it beside
    /// [`Self::PLANS`]).
    pub const IN_STEP_TWO_STAGES: Schedule = Schedule {
        a_loads: ALoads::InStep,
        stages: 2,
    };

    /// Activations a step ahead, two weight stages (timed beside [`Self::PLANS`] too).
    pub const AHEAD_TWO_STAGES: Schedule = Schedule {
        a_loads: ALoads::StepAhead,
        stages: 2,
    };
}

/// [`gemm_wgmma_bf16_with`] on the given `schedule` (the GPU check times the others).
pub fn gemm_wgmma_bf16_scheduled(
    name: &str,
    origin: &str,
    norm: Option<NormPrologue>,
    glu: Option<GluAct>,
    schedule: Schedule,
) -> Kernel {
    let Schedule { a_loads, stages } = schedule;
    let tiles_m = (var("tokens") + int(TILE_M - 1)) / int(TILE_M);
    let tiles_n = (var("n") + int(TILE_N - 1)) / int(TILE_N);
    let next_a: Vec<String> = match a_loads {
        ALoads::InStep => vec![],
        ALoads::StepAhead => (0..K_SLICES)
            .flat_map(|s| (0..8).map(move |i| next_a_name(s, i)))
            .collect(),
    };
    let locals = (0..TILE_N as usize / 2)
        .map(d_name)
        .chain((0..K_SLICES).flat_map(|s| (0..8).map(move |i| a_name(s, i))))
        .chain(next_a)
        // Under a norm prologue, the sums of squares of this lane's two rows.
        .chain(norm.iter().flat_map(|_| ["sq_lo".to_string(), "sq_hi".to_string()]))
        .map(|n| let_(&n, Ty::F32, f(0.0)));
    let (first_a, step_a) = match a_loads {
        ALoads::InStep => (vec![], load_a(norm, glu, var("k0"), a_name)),
        // The first step's, ahead of the loop (a split past the end of K loads none).
        ALoads::StepAhead => (
            vec![if_(
                lt(var("k_begin"), var("k_end")),
                load_a(norm, glu, var("k_begin"), next_a_name),
            )],
            a_step_ahead(norm, glu),
        ),
    };
    let step = [
        super::pipeline_step_head(stages, TILE_K, var("k_end"), copy_stage),
        step_a,
        vec![super::pipeline_wait(stages), Stmt::FenceProxyAsync, Stmt::SyncThreads],
        multiply_stage(),
        // Nobody refills this buffer (next step) before every thread is past the wait.
        vec![Stmt::SyncThreads],
    ]
    .concat();
    let body = [
        vec![
            // Token tiles vary fastest: neighbouring blocks share a weight slice. Then the K
            // splits of one weight tile, then the weight tiles.
            let_("m0", Ty::I32, rem(bid(), tiles_m.clone()) * int(TILE_M)),
            let_("split", Ty::I32, rem(bid() / tiles_m.clone(), var("splits"))),
            let_("n0", Ty::I32, bid() / tiles_m.clone() / var("splits") * int(TILE_N)),
            let_("wrow", Ty::I32, warp() * int(16)),
            let_("gr", Ty::I32, lane() / int(4)),
            let_("t2", Ty::I32, rem(lane(), int(4)) * int(2)),
        ],
        split_k::k_span(var("split"), TILE_K),
        locals.collect(),
        super::pipeline_prologue(stages, TILE_K, (var("k_begin"), var("k_end")), copy_stage),
        first_a,
        vec![
            for_("k0", var("k_begin"), var("k_end"), int(TILE_K), step),
            // A split past the end of K ran no step: its first copies (all zero-fill) land here.
            Stmt::CpAsyncWait(0),
        ],
        norm.map(row_scales).unwrap_or_default(),
        store_accumulators(norm, glu),
    ]
    .concat();
    let shared = vec![SharedArray {
        name: "ws".into(),
        ty: Ty::Bf16,
        len: (stages * STAGE) as usize,
    }];
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: {}matmul x·Wᵀ on Hopper tensor cores (wgmma m64n{TILE_N}k16 bf16, A from registers \
             loaded {}, B through a {stages}-stage cp.async pipeline of {TILE_N}×{TILE_K} slices, K split in `splits`)",
            gemv::describe(norm),
            match a_loads {
                ALoads::InStep => "in its step",
                ALoads::StepAhead => "a step ahead",
            }
        ),
        params: [prologue_gemm_params(norm, Ty::Bf16), split_k::params()].concat(),
        shared,
        block_dim: THREADS as u32,
        grid: tiles_m * tiles_n * var("splits"),
        body,
    }
}
