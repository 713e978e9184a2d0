//! Prefill GEMM on tensor cores: `out[t, r] = Σ_k x[t, k]·W[r, k]` with bf16 weights
//! (activations rounded to bf16, f32 accumulation), through `mma.sync.m16n8k16`.
//!
//! Tiling: a block of 4 warps computes a 64×64 tile of `out` (64 tokens × 64 weight rows),
//! walking K in steps of 32. Each step the block stages the 64×32 slices of `x` and `W` in
//! shared memory (bf16, each thread loading 16 elements of each, a warp reading 32 consecutive
//! elements of one row, so global loads coalesce; zero-filled past every edge, so any shape
//! works), then each warp multiplies its 32×32 quarter from shared memory: 2×4 `mma` tiles per
//! 16-wide k slice, 32 accumulators per lane in registers. Staging cuts global traffic by the
//! tile's reuse: every element of `x` and `W` is read from global memory once per 64-wide tile
//! of the other operand instead of once per 16×8 `mma` tile. Blocks run along the token tiles
//! first, so consecutive blocks read the same weight tile (it stays in L2).
//!
//! Weights, three ways (`WeightStaging`): bf16 through registers like the activations, which
//! works for any `k`; bf16, where `k` is a multiple of 8, with `cp.async` (16 bytes a copy
//! straight into shared memory) into two buffers, so step i+1's weights arrive while step i
//! multiplies; or GGUF blocks decoded into the tile (rounded to bf16 there, as the
//! activations are).
//!
//! Per target (see `prefill_gemm`): `mma.sync` is the warp-level tensor-core instruction
//! sm_90a, sm_100a and sm_120a all run; it serves sm_120a, and sm_90a/sm_100a where `k` is not
//! a multiple of 8 (they otherwise get `gemm_wgmma`/`gemm_tcgen05`). One tile shape serves:
//! 10 KiB of shared memory and 128 threads fit several blocks per SM on each (sm_120a allows
//! 99 KiB a block, B200 227 KiB), and prefill chunks of up to 512 tokens over 576..4096-row
//! weights give enough tiles to fill 132-170 SMs.
//!
//! Like the Hopper and Blackwell GEMMs it splits K into `splits` spans at few rows (`split_k`)
//! and takes an RMSNorm prologue (each x times its norm weight as it is staged, after the
//! residual add under `add_rms_norm_matmul`, whose sums the first weight tile's blocks write;
//! each token's `1/rms` summed from the squares staged and applied to the result,
//! `prologue_norms`)
//! and, over bf16 or f16 weights, a GLU epilogue (products through the partials; the reduction
//! gates).

use super::gemv::{self, NormPrologue};
use super::mma_operands::{b_block, lane_offset, x4_names, Quad};
use super::{prologue_norms, quant, split_k};
use crate::dsl::*;
use ir::GluAct;

pub(super) const WARPS: i64 = 4;
/// Tokens per block tile.
pub(super) const TILE_M: i64 = 64;
/// Weight rows per block tile.
pub(super) const TILE_N: i64 = 64;
/// K per shared-memory stage.
pub(super) const TILE_K: i64 = 32;
/// Row stride of the staged slices: 8 bf16 of padding shift successive rows across banks
/// (`ldmatrix`'s 8 rows a matrix on 8 distinct 4-bank groups).
pub(super) const STAGE_STRIDE: i64 = TILE_K + 8;
/// Elements of one staged slice.
pub(super) const STAGE: i64 = TILE_M * STAGE_STRIDE;
/// Weight slices of the `cp.async` pipeline (`WeightStaging::CpAsync`).
pub(super) const STAGES: i64 = 2;
/// Each warp's quarter: 2 `mma` tiles of 16 tokens by 4 of 8 rows.
pub(super) const WARP_M_TILES: usize = 2;
pub(super) const WARP_N_TILES: usize = 4;

/// Stage a 64×32 slice (rows `row0..`, columns `k0..`) into shared `dst` ([`stage_pairs`]):
/// element (row, col) is what `fetch(row, col, value)` sets the f32 local `value` to, zero
/// past `rows` and `k`.
fn stage(dst: &str, row0: &str, rows: &str, fetch: impl Fn(Expr, Expr, &str) -> Vec<Stmt>) -> Vec<Stmt> {
    let row = var(row0) + var("r");
    let valid = lt(row.clone(), var(rows));
    vec![stage_pairs(dst, int(0), var("k"), (vec![], valid), &|col, value| {
        fetch(row.clone(), col, value)
    })]
}

/// A 64×32 slice staged into shared `dst` from element `at` (rows `STAGE_STRIDE` apart), a
/// bf16 pair a thread: thread (warp w, lane l) takes columns `c = 2·(l mod 16)` and the next
/// of slice rows `r = w + 4·(l / 16) + 8·i` (locals `r` and `c`), storing the two as one pair
/// (one conversion instruction). A half-warp reads 32 consecutive elements of a row, and the
/// two halves' stores land 4 rows (320 bytes, half the banks) apart: one wavefront a warp.
/// `row` declares what the pair reads of row `r`; where `valid` holds, `fetch(col, value)`
/// sets the f32 local `value` to the element at column `col` (`k0 + c` and the next, each
/// below `k`); elsewhere it is zero.
pub(super) fn stage_pairs(
    dst: &str,
    at: Expr,
    k: Expr,
    (row, valid): (Vec<Stmt>, Expr),
    fetch: &dyn Fn(Expr, &str) -> Vec<Stmt>,
) -> Stmt {
    const HALF: i64 = 16;
    assert_eq!(TILE_K, 2 * HALF, "a half-warp's pairs span a row");
    let rows_a_pass = 2 * WARPS;
    let place = var("r") * int(STAGE_STRIDE) + var("c");
    // Nothing added to a start of 0.
    let place = match at {
        Expr::Int(0) => place,
        at => at + place,
    };
    let mut body = vec![
        let_(
            "r",
            Ty::I32,
            warp() + lane() / int(HALF) * int(WARPS) + var("i") * int(rows_a_pass),
        ),
        let_("c", Ty::I32, rem(lane(), int(HALF)) * int(2)),
    ];
    body.extend(row);
    let values: Vec<String> = (0..2).map(|j| format!("{dst}_v{j}")).collect();
    for (j, value) in values.iter().enumerate() {
        let col = var("k0") + var("c") + int(j as i64);
        body.push(let_(value, Ty::F32, f(0.0)));
        body.push(if_(and(valid.clone(), lt(col.clone(), k.clone())), fetch(col, value)));
    }
    body.push(store_vec(dst, place, values.iter().map(|v| var(v)).collect()));
    for_("i", int(0), int(TILE_M / rows_a_pass), int(1), body)
}

/// A row-major array's element (row, col), rows `row_stride` apart.
fn element_of(src: &'static str, row_stride: Expr) -> impl Fn(Expr, Expr, &str) -> Vec<Stmt> {
    move |row, col, value| vec![assign(value, load(src, row * row_stride.clone() + col))]
}

/// How the weight slices reach shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightStaging {
    /// bf16 weights loaded and stored by each thread, one buffer: any `k`.
    Registers,
    /// IEEE half weights, as `Registers`, rounded to bf16 on their way into the tile (as
    /// decoded GGUF blocks are).
    HalfWeights,
    /// bf16 weights by `cp.async` into two buffers, the next step's copy overlapping this
    /// step's MMAs: `k` a multiple of 8 (each 16-byte copy wholly inside one aligned row).
    CpAsync,
    /// GGUF blocks (raw bytes) decoded a run of 16 a thread ([`decode_block_runs`]) and
    /// rounded to bf16 on their way into shared memory: each weight is decoded once per
    /// 64-token tile, where the prefill GEMV decodes it once per 4 tokens.
    Dequantize(ir::DType),
}

/// Stage the 64×32 weight slice of GGUF-block weights ([`decode_block_runs`]).
fn stage_blocks(format: ir::DType) -> Vec<Stmt> {
    let valid_rows = var("n") - var("n0");
    vec![decode_block_runs(
        format,
        "ws",
        int(0),
        (var("n0"), valid_rows),
        var("k"),
    )]
}

/// A 64×32 slice of weights stored as GGUF blocks, decoded into shared `dst` from element
/// `at` (rows `STAGE_STRIDE` apart, rounded to bf16): slice row r is weight row
/// `first_row + r` (zeros from `valid_rows` on), its 32 columns at `k0` one run of the blocks
/// (a 32-element block or a K-quant's sub-block: `k`, the rows' length, is whole blocks).
/// Warps 0 and 1 decode the first 16 of each row's run, a lane a row, warps 2 and 3 the last
/// 16 (`quant::run_weights`: the run's scales decoded once, not once an element); each lane
/// stores its 16 as two 16-byte vectors (rows 80 bytes apart: 8 lanes cover the 32 banks).
pub(super) fn decode_block_runs(
    format: ir::DType,
    dst: &str,
    at: Expr,
    (first_row, valid_rows): (Expr, Expr),
    k: Expr,
) -> Stmt {
    assert_eq!(WARPS * 32, 2 * TILE_N, "a thread for each half of each row");
    assert_eq!(TILE_K, 32, "a K step is one run of 32");
    let place = |first: i64| {
        let place = var("run_row") * int(STAGE_STRIDE) + int(first);
        // Nothing added to a start of 0.
        match &at {
            Expr::Int(0) => place,
            at => at.clone() + place,
        }
    };
    let half = |elements: std::ops::Range<usize>| {
        let first = elements.start as i64;
        let value = |e: i64| var(&format!("wr{e}"));
        let decoded = [
            vec![let_(
                "run",
                Ty::I32,
                (first_row.clone() + var("run_row")) * (k.clone() / int(TILE_K)) + var("k0") / int(TILE_K),
            )],
            quant::run_weights(format, "wr", var("run"), elements),
            vec![
                store_vec(dst, place(first), (first..first + 8).map(value).collect()),
                store_vec(dst, place(first + 8), (first + 8..first + 16).map(value).collect()),
            ],
        ]
        .concat();
        let zeros = vec![
            store_vec(dst, place(first), vec![f(0.0); 8]),
            store_vec(dst, place(first + 8), vec![f(0.0); 8]),
        ];
        vec![
            let_("run_row", Ty::I32, rem(tid(), int(TILE_N))),
            if_else(lt(var("run_row"), valid_rows.clone()), decoded, zeros),
        ]
    };
    // Warp-uniform: each warp takes one half.
    if_else(lt(tid(), int(TILE_N)), half(0..16), half(16..32))
}

/// Copy the 64×32 weight slice at `k0` into buffer `buffer` with `cp.async` ([`copy_slice`]).
fn copy_weights(buffer: Expr, k0: Expr) -> Vec<Stmt> {
    let source = Slice::rows("w", ("n0", "n"), var("k"), var("k"));
    vec![copy_slice(("ws", buffer * int(STAGE)), &source, k0)]
}

/// Where a slice is copied from: row `row` (a local) of the tile at element `start` of `src`
/// (`locate` declaring what `start` and `valid` read), copied where `valid` holds and
/// zero-filled elsewhere; the rows `k` long (columns past it zero-filled).
pub(super) struct Slice {
    pub src: &'static str,
    pub locate: Vec<Stmt>,
    pub start: Expr,
    pub valid: Expr,
    pub k: Expr,
}

impl Slice {
    /// `src`'s rows `rows.0..rows.1` (scalars or locals) in order, `stride` apart.
    pub fn rows(src: &'static str, (first, end): (&str, &str), stride: Expr, k: Expr) -> Slice {
        let row = var(first) + var("row");
        Slice {
            src,
            locate: vec![],
            start: row.clone() * stride,
            valid: lt(row, var(end)),
            k,
        }
    }
}

/// Copy the 64×32 slice of `source` at column `k0` into shared `dst` from element `dst_at`
/// with `cp.async`: copy `c = tid + 128·i` is row `c / 4`, 8-element chunk `c % 4` (a warp
/// reads 8 whole 64-byte row slices), zero-filled past the rows and `k` (a multiple of 8, as
/// each row's start).
pub(super) fn copy_slice((dst, dst_at): (&str, Expr), source: &Slice, k0: Expr) -> Stmt {
    let chunk = rem(var("c"), int(TILE_K / 8)) * int(8);
    // Nothing added to a start of 0.
    let place = var("row") * int(STAGE_STRIDE) + chunk.clone();
    let place = match dst_at {
        Expr::Int(0) => place,
        at => at + place,
    };
    let mut body = vec![
        let_("c", Ty::I32, tid() + var("i") * int(32 * WARPS)),
        let_("row", Ty::I32, var("c") / int(TILE_K / 8)),
        let_("col", Ty::I32, k0 + chunk),
    ];
    body.extend(source.locate.iter().cloned());
    body.push(Stmt::CpAsync(Box::new(AsyncCopy {
        dst: dst.into(),
        dst_index: place,
        src: source.src.into(),
        src_index: source.start.clone() + var("col"),
        valid: and(source.valid.clone(), lt(var("col"), source.k.clone())),
    })));
    for_("i", int(0), int(TILE_M * TILE_K / 8 / (32 * WARPS)), int(1), body)
}

/// Each warp's quarter of the tile (`wm` its first row, `wn` its first weight row), each
/// lane's place in the fragments (`gr`, `t2`), and the rows its `ldmatrix` loads name in the
/// staged slices (`a_row`, `b_row`: see `mma_operands`).
pub(super) fn warp_places() -> Vec<Stmt> {
    vec![
        let_("wm", Ty::I32, (warp() / int(2)) * int(16 * WARP_M_TILES as i64)),
        let_("wn", Ty::I32, rem(warp(), int(2)) * int(8 * WARP_N_TILES as i64)),
        let_("gr", Ty::I32, lane() / int(4)),
        let_("t2", Ty::I32, rem(lane(), int(4)) * int(2)),
        let_(
            "a_row",
            Ty::I32,
            var("wm") * int(STAGE_STRIDE) + lane_offset(Quad::RowsThenColumns, STAGE_STRIDE),
        ),
        let_(
            "b_row",
            Ty::I32,
            var("wn") * int(STAGE_STRIDE) + lane_offset(Quad::ColumnsThenRows, STAGE_STRIDE),
        ),
    ]
}

/// The accumulator `i` (of a lane's 4) of the warp's `mma` tile (`mi`, `ni`) for the weight
/// tile whose accumulators are named `prefix`.
pub(super) fn accumulator(prefix: &str, mi: usize, ni: usize, i: usize) -> String {
    format!("{prefix}{mi}_{ni}_{i}")
}

/// A weight tile's accumulators (named `prefix`, see [`accumulator`]) declared zero.
pub(super) fn declare_accumulators(prefix: &str) -> Vec<Stmt> {
    (0..WARP_M_TILES)
        .flat_map(|mi| (0..WARP_N_TILES).flat_map(move |ni| (0..4).map(move |i| (mi, ni, i))))
        .map(|(mi, ni, i)| let_(&accumulator(prefix, mi, ni, i), Ty::F32, f(0.0)))
        .collect()
}

/// One 16-wide k slice of the warp's quarter at `kk`: its fragments by `ldmatrix` from shared
/// memory (an activation tile's four pairs a load, from `xs`'s buffer starting at element
/// `rows`; two weight tiles' a load), then
/// for each weight tile (`weights`: its shared array, the element its buffer starts at, and
/// its accumulators' prefix) the 2×4 `mma`s (fragment layout in `Stmt::Mma`). Each
/// thread's rows: `a_row`, `b_row` (see `mma_operands`).
pub(super) fn warp_k_slice(kk: i64, rows: Expr, weights: &[(&str, Expr, &str)]) -> Vec<Stmt> {
    let mut out = Vec::new();
    let a: Vec<Vec<String>> = (0..WARP_M_TILES)
        .map(|mi| x4_names("a", &format!("{kk}_{mi}")))
        .collect();
    for (mi, names) in a.iter().enumerate() {
        let at = var("a_row") + int(16 * mi as i64 * STAGE_STRIDE + kk);
        // Nothing added to a start of 0.
        let at = match rows {
            Expr::Int(0) => at,
            ref rows => rows.clone() + at,
        };
        out.push(load_matrix("xs", at, names, false));
    }
    for (array, buffer, prefix) in weights {
        let b: Vec<Vec<String>> = (0..WARP_N_TILES / 2)
            .map(|pair| x4_names(&format!("{prefix}b"), &format!("{kk}_{pair}")))
            .collect();
        for (pair, names) in b.iter().enumerate() {
            let at = buffer.clone() + var("b_row") + int(16 * pair as i64 * STAGE_STRIDE + kk);
            out.push(load_matrix(array, at, names, false));
        }
        for (mi, a) in a.iter().enumerate() {
            for ni in 0..WARP_N_TILES {
                out.push(Stmt::Mma(Box::new(MmaFragments {
                    element: MmaElement::Bf16,
                    a: MmaOperand::Pairs(a.clone()),
                    b: b_block(&b[ni / 2], ni % 2),
                    c: std::array::from_fn(|i| accumulator(prefix, mi, ni, i)),
                })));
            }
        }
    }
    out
}

/// Store the warp's accumulators where they fall in the result (`out`, or with several K
/// splits, or a GLU epilogue, which the reduction applies, this split's partial tile), scaled
/// by each token's `1/rms` where the GEMM applied a norm prologue itself (`scaled`). A split
/// past the end of K stores zeros.
fn store_accumulators(norm: Option<NormPrologue>, glu: Option<GluAct>, scaled: bool) -> Vec<Stmt> {
    let mut out = Vec::new();
    for mi in 0..WARP_M_TILES {
        for ni in 0..WARP_N_TILES {
            for i in 0..4 {
                let in_tile = var("wm") + int(16 * mi as i64) + var("gr") + int(if i >= 2 { 8 } else { 0 });
                let row = var("m0") + in_tile.clone();
                let col = var("n0") + var("wn") + int(8 * ni as i64) + var("t2") + int((i % 2) as i64);
                let summed = var(&accumulator("c", mi, ni, i));
                let value = match scaled {
                    true => summed * load("row_scales", in_tile),
                    false => summed,
                };
                out.push(super::store_gemm_result(norm, glu, row, col, value));
            }
        }
    }
    out
}

/// The tile sizes, for the split-K expression: (tokens, weight rows, K step).
pub const TILES: (usize, usize, usize) = (TILE_M as usize, TILE_N as usize, TILE_K as usize);

pub fn gemm_mma(name_: &str, origin: &str, staging: WeightStaging) -> Kernel {
    gemm_mma_with(name_, origin, staging, None, None)
}

/// The GEMM with an RMSNorm of `x` (perhaps after a residual add) before it and perhaps a GLU
/// after it, as `gemm_wgmma::gemm_wgmma_bf16_with` on Hopper: the same parameters and
/// results. K splits into `splits` spans (`split_k`), the partials summed by a second launch.
pub fn gemm_mma_with(
    name_: &str,
    origin: &str,
    staging: WeightStaging,
    norm: Option<NormPrologue>,
    glu: Option<GluAct>,
) -> Kernel {
    build(name_, origin, staging, Activations::Staged(norm), glu)
}

/// The GEMM as a plan launches it after the `bf16_rows` launch made its activation rows
/// (`xb`, `xb_stride` apart, the prologue `norm` applied there once for all its blocks, where
/// each block of [`gemm_mma_with`] applies it to the slices it stages): the parameters of
/// [`gemm_mma_with`]'s form then `xb` and `xb_stride` (as the TMA GEMMs', which it stands in
/// for at fewer rows), its rows' slices copied by `cp.async` while the weights are staged
/// (`k` a multiple of 8), the result laid out for `norm`'s form (after the sum under a
/// residual prologue) and not scaled, a GLU's products through the partials (the reduction
/// gates them). Weights staged in the step (not `CpAsync`).
pub fn gemm_mma_after_rows(
    name_: &str,
    origin: &str,
    staging: WeightStaging,
    (norm, glu): (Option<NormPrologue>, Option<GluAct>),
) -> Kernel {
    assert!(
        staging != WeightStaging::CpAsync,
        "the rows' copies are the step's one cp.async group"
    );
    build(name_, origin, staging, Activations::Rows(norm), glu)
}

/// Where a GEMM's activations come from, and the prologue of the matmul it computes.
#[derive(Debug, Clone, Copy)]
enum Activations {
    /// `x` in f32, the prologue applied to each slice as it is staged (each token's `1/rms`
    /// then scales the result).
    Staged(Option<NormPrologue>),
    /// `xb`, bf16 rows with the prologue applied.
    Rows(Option<NormPrologue>),
}

/// The 64×32 slice of the bf16 rows `xb` at `k0` copied into `xs` by `cp.async`
/// ([`copy_slice`]).
fn copy_rows() -> Vec<Stmt> {
    let source = Slice::rows("xb", ("m0", "tokens"), var("xb_stride"), var("k"));
    vec![copy_slice(("xs", int(0)), &source, var("k0"))]
}

/// The GEMM over activations from `source` (see [`gemm_mma_with`], [`gemm_mma_after_rows`]).
fn build(name_: &str, origin: &str, staging: WeightStaging, source: Activations, glu: Option<GluAct>) -> Kernel {
    let (norm, scaled) = match source {
        Activations::Staged(norm) => (norm, norm.is_some()),
        Activations::Rows(norm) => (norm, false),
    };
    let activations = match source {
        Activations::Staged(Some(norm)) => {
            let place = |(token, column): (Expr, Expr), value: &str| {
                store("xs", token * int(STAGE_STRIDE) + column, var(value))
            };
            let threads = 32 * WARPS;
            super::stage_prologue_slice(norm, glu, (threads, TILE_M * TILE_K / threads), &place)
        }
        Activations::Staged(None) => stage("xs", "m0", "tokens", element_of("x", var("x_stride"))),
        // Committed as their own group, landing while the weights are staged.
        Activations::Rows(_) => [copy_rows(), vec![Stmt::CpAsyncCommit]].concat(),
    };
    let rows_landed = match source {
        Activations::Rows(_) => vec![Stmt::CpAsyncWait(0)],
        Activations::Staged(_) => vec![],
    };
    let tiles_m = (var("tokens") + int(TILE_M - 1)) / int(TILE_M);
    let tiles_n = (var("n") + int(TILE_N - 1)) / int(TILE_N);
    let accumulators = declare_accumulators("c");
    let multiply = |weights: Expr| {
        let tiles = [("ws", weights, "c")];
        [
            warp_k_slice(0, int(0), &tiles),
            warp_k_slice(16, int(0), &tiles),
            // Nobody restages until every warp has read this stage.
            vec![Stmt::SyncThreads],
        ]
        .concat()
    };
    let (prologue, k_step, buffers) = match staging {
        WeightStaging::Registers | WeightStaging::HalfWeights | WeightStaging::Dequantize(_) => (
            vec![],
            [
                activations.clone(),
                match staging {
                    WeightStaging::Dequantize(format) => stage_blocks(format),
                    _ => stage("ws", "n0", "n", element_of("w", var("k"))),
                },
                rows_landed,
                vec![Stmt::SyncThreads],
                multiply(int(0)),
            ]
            .concat(),
            1,
        ),
        WeightStaging::CpAsync => (
            super::pipeline_prologue(STAGES, TILE_K, (var("k_begin"), var("k_end")), copy_weights),
            [
                super::pipeline_step_head(STAGES, TILE_K, var("k_end"), copy_weights),
                activations,
                vec![super::pipeline_wait(STAGES), Stmt::SyncThreads],
                multiply(var("s") * int(STAGE)),
            ]
            .concat(),
            STAGES,
        ),
    };
    let body = [
        vec![
            // Token tiles vary fastest: neighbouring blocks share a weight tile. Then the K
            // splits of one weight tile, then the weight tiles.
            let_("m0", Ty::I32, rem(bid(), tiles_m.clone()) * int(TILE_M)),
            let_("split", Ty::I32, rem(bid() / tiles_m.clone(), var("splits"))),
            let_("n0", Ty::I32, bid() / tiles_m.clone() / var("splits") * int(TILE_N)),
        ],
        warp_places(),
        split_k::k_span(var("split"), TILE_K),
        accumulators,
        prologue,
        match scaled {
            true => vec![prologue_norms::zero_staged_squares(TILE_M * TILE_K, 32 * WARPS)],
            false => vec![],
        },
        vec![for_("k0", var("k_begin"), var("k_end"), int(TILE_K), k_step)],
        match staging {
            // A split past the end of K ran no step: its first copies (all zero-fill) land here.
            WeightStaging::CpAsync => vec![Stmt::CpAsyncWait(0)],
            _ => vec![],
        },
        match norm.filter(|_| scaled) {
            Some(n) => prologue_norms::staged_row_scales(n, TILE_M, WARPS),
            None => vec![],
        },
        store_accumulators(norm, glu, scaled),
    ]
    .concat();
    let staged = |name: &str, buffers: i64| SharedArray {
        name: name.into(),
        ty: Ty::Bf16,
        len: (buffers * STAGE) as usize,
    };
    let (weights, weight_ty) = match staging {
        WeightStaging::Registers => (String::new(), Ty::Bf16),
        WeightStaging::HalfWeights => (", f16 weights rounded to bf16 into the tile".into(), Ty::F16),
        WeightStaging::CpAsync => (", weights through a 2-stage cp.async pipeline".into(), Ty::Bf16),
        WeightStaging::Dequantize(format) => (format!(", {format} weights decoded into the tile"), Ty::U8),
    };
    let mut shared = vec![staged("xs", 1), staged("ws", buffers)];
    if scaled {
        shared.extend(prologue_norms::staged_arrays(TILE_M * TILE_K, TILE_M));
    }
    let (rows, rows_params) = match source {
        Activations::Rows(_) => (
            " over bf16 rows made before it",
            vec![buffer("xb", Ty::Bf16, false), scalar("xb_stride", Ty::I32)],
        ),
        Activations::Staged(_) => ("", vec![]),
    };
    Kernel {
        name: name_.into(),
        origin: format!(
            "{origin}: {}matmul x·Wᵀ{rows} on tensor cores (mma.sync m16n8k16 bf16, {TILE_M}×{TILE_N}×{TILE_K} \
             shared-memory tiles{weights}, K split in `splits`)",
            gemv::describe(norm)
        ),
        params: [
            super::prologue_gemm_params(norm, weight_ty),
            split_k::params(),
            rows_params,
        ]
        .concat(),
        shared,
        block_dim: (32 * WARPS) as u32,
        grid: tiles_m * tiles_n * var("splits"),
        body,
    }
}
