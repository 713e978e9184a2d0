//! Prefill GEMM for B200 (sm_100a): `out[t, r] = Σ_k x[t, k]·W[r, k]` with bf16 weights
//! (activations rounded to bf16, f32 accumulation) on `tcgen05.mma`, Blackwell's tensor-core
//! MMA: issued by one thread, accumulating in tensor memory (TMEM), completing through an
//! mbarrier.
//!
//! Roles: the MMA's M is 128, its N 16..256, so the weights are A (128 rows of a tile) and the
//! activations B (64 tokens): D[i][j] = out[m0 + j][n0 + i]. A tile is 128 weight rows × 64
//! tokens, its accumulator 64 TMEM columns × 128 lanes (allocated by warp 0, freed at the end).
//! K advances 32 at a time through two stages: the weights travel global → shared with
//! `cp.async` into one buffer while the tensor cores read the other, the activations are
//! rounded to bf16 into shared memory by all threads; then thread 0 issues the step's two
//! k16 MMAs and commits them to the mbarrier every thread waits on. The epilogue: each warp
//! reads its 32 TMEM lanes (`tcgen05.ld.32x32b.x8`, 8 tokens at a time), and a warp's 32 lanes
//! store 32 consecutive weight rows of one token (coalesced).
//!
//! Shared layouts are the canonical K-major ones without swizzling (as for `wgmma`): 8×8
//! core matrices of 128 contiguous bytes, 8-row groups adjacent (stride byte offset 128),
//! 16-byte K slices one whole tile height apart (leading byte offset 2 KiB for the weights,
//! 1 KiB for the activations). Copies: 8 consecutive lanes fill one core matrix (128
//! contiguous bytes in shared memory) from 8 rows, 4 lanes per row read 64 contiguous bytes.
//!
//! Requirement, checked by the caller: `k` a multiple of 8 (whole aligned 16-byte copies).
//! Why this shape: M = 128 is the single-CTA MMA's full height, N = 64 tokens keeps 16-token
//! prefill steps from wasting more than 4×, and 24 KiB of static shared memory with 64 TMEM
//! columns leaves room for several blocks per SM.
//!
//! Like the Hopper GEMM it splits K into `splits` spans at few rows (`split_k`), and takes an
//! RMSNorm prologue (perhaps after a residual add) and a GLU epilogue (`gemm_tcgen05_bf16_with`).

use super::gemv::{self, NormPrologue};
use super::{prologue_gemm_params, prologue_norms, split_k};
use crate::dsl::*;
use ir::GluAct;

pub(super) const THREADS: i64 = 128;
/// Weight rows per tile: the MMA's M.
pub(super) const TILE_ROWS: i64 = 128;
/// Tokens per tile: the MMA's N, and TMEM columns.
pub(super) const TILE_TOKENS: i64 = 64;
/// K per pipeline stage.
pub(super) const TILE_K: i64 = 32;
/// Elements of one stage's weight and activation slices.
pub(super) const W_STAGE: i64 = TILE_ROWS * TILE_K;
pub(super) const X_STAGE: i64 = TILE_TOKENS * TILE_K;
/// bf16 elements per 16-byte copy (one core-matrix row).
pub(super) const CHUNK: i64 = 8;
/// Stride byte offset (between 8-row groups) of both operands.
const STRIDE_BYTES: u32 = 128;
/// Stages of the pipeline: weight and activation slices each.
pub(super) const STAGES: i64 = 2;
/// k16 MMAs per stage.
const K_SLICES: i64 = TILE_K / 16;

/// Element (row, k) of a K-major core-matrix tile `height` rows tall.
fn core_matrix_index(row: Expr, k: Expr, height: i64) -> Expr {
    k.clone() / int(8) * int(height * 8) + row.clone() / int(8) * int(64) + rem(row, int(8)) * int(8) + rem(k, int(8))
}

/// Copy the weight slice at `k0` into stage buffer `stage`: copy `c = tid + 128·i` takes row
/// `8·(c / 32) + c % 8`, k chunk `(c / 8) % 4`.
fn copy_weights(stage: Expr, k0: Expr) -> Vec<Stmt> {
    let c = var("c");
    vec![for_(
        "i",
        int(0),
        int(W_STAGE / CHUNK / THREADS),
        int(1),
        vec![
            let_("c", Ty::I32, tid() + var("i") * int(THREADS)),
            let_("row", Ty::I32, c.clone() / int(32) * int(8) + rem(c.clone(), int(8))),
            let_("chunk", Ty::I32, rem(c / int(8), int(4)) * int(CHUNK)),
            let_("col", Ty::I32, k0 + var("chunk")),
            Stmt::CpAsync(Box::new(AsyncCopy {
                dst: "ws".into(),
                dst_index: stage * int(W_STAGE) + core_matrix_index(var("row"), var("chunk"), TILE_ROWS),
                src: "w".into(),
                src_index: (var("n0") + var("row")) * var("k") + var("col"),
                valid: and(lt(var("n0") + var("row"), var("n")), lt(var("col"), var("k"))),
            })),
        ],
    )]
}

/// Round the activation slice at `k0` to bf16 into stage buffer `s` (zero past `tokens` and
/// `k`): element `e = tid + 128·i` is token `e / 32`, k `e % 32`, so a warp reads 128
/// contiguous bytes of one token. Under a norm prologue each x meets its norm weight here
/// (the token's `1/rms` scales the result) and its loads come before any arithmetic
/// (`templates::stage_prologue_slice`); under a residual prologue the blocks of the first
/// weight tile also write the sums they load, each (token, k) once.
fn stage_activations(norm: Option<NormPrologue>, glu: Option<GluAct>) -> Vec<Stmt> {
    let place = |(token, kk): (Expr, Expr), value: &str| {
        store(
            "xs",
            var("s") * int(X_STAGE) + core_matrix_index(token, kk, TILE_TOKENS),
            var(value),
        )
    };
    if let Some(norm) = norm {
        return super::stage_prologue_slice(norm, glu, (THREADS, X_STAGE / THREADS), &place);
    }
    let e = var("e");
    vec![for_(
        "i",
        int(0),
        int(X_STAGE / THREADS),
        int(1),
        vec![
            let_("e", Ty::I32, tid() + var("i") * int(THREADS)),
            let_("token", Ty::I32, e.clone() / int(TILE_K)),
            let_("kk", Ty::I32, rem(e, int(TILE_K))),
            let_("value", Ty::F32, f(0.0)),
            if_(
                and(
                    lt(var("m0") + var("token"), var("tokens")),
                    lt(var("k0") + var("kk"), var("k")),
                ),
                vec![assign(
                    "value",
                    load(
                        "x",
                        (var("m0") + var("token")) * var("x_stride") + var("k0") + var("kk"),
                    ),
                )],
            ),
            place((var("token"), var("kk")), "value"),
        ],
    )]
}

/// A K step's products once its copies are issued: the stage's copies landed and published to
/// the tensor cores, [`multiply_stage`] (`weights`, `first`), and every thread waiting for the
/// MMAs (their buffers are refilled next step).
pub(super) fn multiply_landed_stage(weights: &[&str], first: Expr) -> Vec<Stmt> {
    vec![
        super::pipeline_wait(STAGES),
        Stmt::FenceProxyAsync,
        Stmt::SyncThreads,
        tc(Tcgen05::FenceAfterSync),
        multiply_stage(weights, first),
        Stmt::Mbarrier(Box::new(Mbarrier::Wait {
            barrier: MbarrierRef::whole("bar"),
            parity: var("phase"),
        })),
        assign("phase", int(1) - var("phase")),
        tc(Tcgen05::FenceAfterSync),
    ]
}

/// Thread 0 issues the stage's k16 MMAs and commits them to the mbarrier: weight tile t of
/// `weights` (its shared array) into the accumulator `TILE_TOKENS·t` columns on, the step at
/// `first` (the split's first) starting each sum.
fn multiply_stage(weights: &[&str], first: Expr) -> Stmt {
    let mut issue: Vec<Stmt> = weights
        .iter()
        .enumerate()
        .flat_map(|(t, &array)| (0..K_SLICES).map(move |slice| (t, array, slice)))
        .map(|(t, array, slice)| {
            Stmt::Tcgen05(Box::new(Tcgen05::Mma(Box::new(TmemMma {
                // Nothing added to the first accumulator's column.
                tmem: match t {
                    0 => var("tmem"),
                    _ => var("tmem") + int(TILE_TOKENS * t as i64),
                },
                a: SmemMatrix {
                    array: array.into(),
                    start: var("s") * int(W_STAGE) + int(2 * slice * TILE_ROWS * 8),
                    lbo: (TILE_ROWS * 16) as u32,
                    sbo: STRIDE_BYTES,
                    swizzle: Swizzle::None,
                },
                b: SmemMatrix {
                    array: "xs".into(),
                    start: var("s") * int(X_STAGE) + int(2 * slice * TILE_TOKENS * 8),
                    lbo: (TILE_TOKENS * 16) as u32,
                    sbo: STRIDE_BYTES,
                    swizzle: Swizzle::None,
                },
                b_major: Major::K,
                n: TILE_TOKENS as u32,
                // The first MMA of the split's first step starts the sum.
                accumulate: match slice {
                    0 => bin(BinOp::Gt, var("k0"), first.clone()),
                    _ => Expr::Bool(true),
                },
            }))))
        })
        .collect();
    issue.push(Stmt::Tcgen05(Box::new(Tcgen05::Commit {
        barrier: MbarrierRef::whole("bar"),
    })));
    if_(eq(tid(), int(0)), issue)
}

/// Each warp reads its 32 lanes (weight rows; this thread's is `row`) 8 tokens at a time and
/// stores them where they fall in the result (`out`, or with several K splits, or a GLU
/// epilogue, this split's partial tile), scaled by each token's `row_scales` under a norm
/// prologue.
/// A split past the end of K ran no MMA and its tensor memory holds nothing: it stores zeros.
fn epilogue(norm: Option<NormPrologue>, glu: Option<GluAct>) -> Vec<Stmt> {
    let names: Vec<String> = (0..8).map(|j| format!("acc{j}")).collect();
    let row = var("row");
    let stores = |values: Vec<Expr>| -> Vec<Stmt> {
        values
            .into_iter()
            .enumerate()
            .map(|(j, summed)| {
                let in_tile = var("c") * int(8) + int(j as i64);
                let token = var("m0") + in_tile.clone();
                let value = match norm {
                    Some(_) => summed * load("row_scales", in_tile),
                    None => summed,
                };
                super::store_gemm_result(norm, glu, token, row.clone(), value)
            })
            .collect()
    };
    let loaded = [
        vec![
            Stmt::Tcgen05(Box::new(Tcgen05::Load {
                address: var("tmem") + bin(BinOp::Shl, warp() * int(32), int(16)) + var("c") * int(8),
                names: names.clone(),
            })),
            Stmt::Tcgen05(Box::new(Tcgen05::WaitLd)),
        ],
        stores(names.iter().map(|n| var(n)).collect()),
    ]
    .concat();
    let zeros = stores(vec![f(0.0); names.len()]);
    vec![
        let_("row", Ty::I32, var("n0") + warp() * int(32) + lane()),
        for_(
            "c",
            int(0),
            int(TILE_TOKENS / 8),
            int(1),
            // The same branch for the whole block: `tcgen05.ld` is warp-wide.
            vec![if_else(lt(var("k_begin"), var("k_end")), loaded, zeros)],
        ),
    ]
}

/// Warp 0 allocates `columns` of tensor memory (its address then `tmem`, from shared
/// `tmem_slot`) and thread 0 sets up the mbarrier `bar` the MMAs commit to (its phase
/// `phase`), published to every thread.
pub(super) fn tmem_and_barrier(columns: u32) -> Vec<Stmt> {
    vec![
        if_(
            eq(warp(), int(0)),
            vec![tc(Tcgen05::Alloc {
                columns,
                slot: "tmem_slot".into(),
            })],
        ),
        if_(
            eq(tid(), int(0)),
            vec![Stmt::Mbarrier(Box::new(Mbarrier::Init {
                barrier: MbarrierRef::whole("bar"),
                count: 1,
            }))],
        ),
        tc(Tcgen05::FenceBeforeSync),
        Stmt::SyncThreads,
        tc(Tcgen05::FenceAfterSync),
        let_("tmem", Ty::I32, load("tmem_slot", int(0))),
        let_("phase", Ty::I32, int(0)),
    ]
}

/// The tile sizes, for the split-K expression: (tokens, weight rows, K step).
pub const TILES: (usize, usize, usize) = (TILE_TOKENS as usize, TILE_ROWS as usize, TILE_K as usize);

fn tc(op: Tcgen05) -> Stmt {
    Stmt::Tcgen05(Box::new(op))
}

pub fn gemm_tcgen05_bf16(name: &str, origin: &str) -> Kernel {
    gemm_tcgen05_bf16_with(name, origin, None, None)
}

/// The GEMM with an RMSNorm of `x` (perhaps after a residual add) before it and perhaps a GLU
/// after it, as `gemm_wgmma::gemm_wgmma_bf16_with` on Hopper: same parameters, same results.
/// K splits into `splits` spans (`split_k`), the partials summed by a second launch.
pub fn gemm_tcgen05_bf16_with(name: &str, origin: &str, norm: Option<NormPrologue>, glu: Option<GluAct>) -> Kernel {
    let tiles_m = (var("tokens") + int(TILE_TOKENS - 1)) / int(TILE_TOKENS);
    let tiles_n = (var("n") + int(TILE_ROWS - 1)) / int(TILE_ROWS);
    let step = [
        super::pipeline_step_head(STAGES, TILE_K, var("k_end"), copy_weights),
        stage_activations(norm, glu),
        multiply_landed_stage(&["ws"], var("k_begin")),
    ]
    .concat();
    let body = [
        vec![
            // Token tiles vary fastest: neighbouring blocks share a weight tile. Then the K
            // splits of one weight tile, then the weight tiles.
            let_("m0", Ty::I32, rem(bid(), tiles_m.clone()) * int(TILE_TOKENS)),
            let_("split", Ty::I32, rem(bid() / tiles_m.clone(), var("splits"))),
            let_("n0", Ty::I32, bid() / tiles_m.clone() / var("splits") * int(TILE_ROWS)),
        ],
        tmem_and_barrier(TILE_TOKENS as u32),
        split_k::k_span(var("split"), TILE_K),
        super::pipeline_prologue(STAGES, TILE_K, (var("k_begin"), var("k_end")), copy_weights),
        norm.map(|_| vec![prologue_norms::zero_staged_squares(X_STAGE, THREADS)])
            .unwrap_or_default(),
        vec![
            for_("k0", var("k_begin"), var("k_end"), int(TILE_K), step),
            // A split past the end of K ran no step: its first copies (all zero-fill) land here.
            Stmt::CpAsyncWait(0),
        ],
        norm.map(|n| prologue_norms::staged_row_scales(n, TILE_TOKENS, THREADS / 32))
            .unwrap_or_default(),
        epilogue(norm, glu),
        vec![
            // Every warp has read its lanes before warp 0 frees the columns.
            tc(Tcgen05::FenceBeforeSync),
            Stmt::SyncThreads,
            if_(
                eq(warp(), int(0)),
                vec![tc(Tcgen05::Dealloc {
                    columns: TILE_TOKENS as u32,
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
    let mut arrays = vec![
        shared("ws", Ty::Bf16, STAGES * W_STAGE),
        shared("xs", Ty::Bf16, STAGES * X_STAGE),
        shared("bar", Ty::U32, 2),
        shared("tmem_slot", Ty::I32, 1),
    ];
    if norm.is_some() {
        arrays.extend(prologue_norms::staged_arrays(X_STAGE, TILE_TOKENS));
    }
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: {}matmul x·Wᵀ on Blackwell tensor cores (tcgen05.mma M=128 N={TILE_TOKENS} bf16 into \
             tensor memory, weights through a 2-stage cp.async pipeline of {TILE_ROWS}×{TILE_K} slices, K split in \
             `splits`)",
            gemv::describe(norm)
        ),
        params: [prologue_gemm_params(norm, Ty::Bf16), split_k::params()].concat(),
        shared: arrays,
        block_dim: THREADS as u32,
        grid: tiles_m * tiles_n * var("splits"),
        body,
    }
}
