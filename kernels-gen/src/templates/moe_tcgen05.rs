//! MoE prefill on Blackwell's `tcgen05` (sm_100a, bf16 experts, and half ones over halves:
//! `halves::over_halves`): `moe_mma`'s launches, lists
//! and results, each listed tile's GEMM as `gemm_tcgen05` runs a dense one. `tcgen05.mma`'s M
//! (128) is the weights' rows and its N (64) the tile's pairs: D[row][pair], tensor memory
//! lane `row` read by thread `row` of the block's four warps.
//!
//! - [`gate_up`]: 128 of the expert's hidden units, their gate rows and their up rows as two
//!   128-row weight tiles multiplied into two accumulators (tensor memory columns 0..64 and
//!   64..128), so thread u holds unit u's gate and up products for every pair of the tile and
//!   writes `act(gate)·up`, rounded to bf16, as `moe_mma::gate_up` does;
//! - [`down`]: 128 of the output columns, each pair's product unweighted into `ys`.
//!
//! K advances 32 a step through two stages: the weight tiles and the tile's gathered bf16 rows
//! (`bf16_rows`'s copy of the step's rows for gate/up, `hidden` for down) by `cp.async` into
//! K-major core-matrix layouts, a step ahead, each thread's copies' places worked out once
//! (see [`copy_places`]); thread 0 issues the step's MMAs and commits them to the mbarrier
//! every thread waits on before the buffers are refilled. Requirements ([`supports`]): bf16
//! experts over a hidden size and expert width that are multiples of 8.

use super::gemm_tcgen05::{
    multiply_landed_stage, tmem_and_barrier, CHUNK, STAGES, THREADS, TILE_K, TILE_ROWS as ROWS, TILE_TOKENS as PAIRS,
    W_STAGE, X_STAGE,
};
use super::gemv::gated;
use super::moe::describe;
use super::moe_mma::{self, down_tile_params, gate_up_tile_params};
use super::quant::WeightFormat;
use crate::dsl::*;
use ir::MoeSpec;

/// A thread's copies of a weight tile and of the gathered rows a stage.
const WEIGHT_COPIES: i64 = W_STAGE / CHUNK / THREADS;
const ROW_COPIES: i64 = X_STAGE / CHUNK / THREADS;
// The MMA's N is the listed tiles' pairs.
const _: () = assert!(PAIRS == super::gemm_mma::TILE_M);

/// Whether the kernels take a layer of `spec` over rows of `hidden` with weights of `format`.
pub fn supports(spec: &MoeSpec, hidden: usize, format: WeightFormat) -> bool {
    format == WeightFormat::Dense(Ty::Bf16) && moe_mma::supports(spec, hidden, format)
}

/// This thread's copies as `gemm_tcgen05` lays them out (copy `c = tid + 128·i` is tile row
/// `8·(c / 32) + c % 8`, k chunk `(c / 8) % 4`): rows `copy_row + 32·i`, one chunk
/// (`copy_chunk`), so copy i lands `256·i` elements after the first ([`place`]) in a K-major
/// tile; and the pairs of its rows of the gathered tile (`copy_pair{i}`, −1 past the
/// expert's count).
fn copy_places() -> Vec<Stmt> {
    let mut out = vec![
        let_("copy_row", Ty::I32, tid() / int(32) * int(8) + rem(tid(), int(8))),
        let_("copy_chunk", Ty::I32, rem(tid() / int(8), int(4))),
    ];
    out.extend((0..ROW_COPIES).map(|i| {
        let_(
            &format!("copy_pair{i}"),
            Ty::I32,
            load("tile_pairs", var("copy_row") + int(32 * i)),
        )
    }));
    out
}

/// Where this thread's first copy lands in a K-major core-matrix tile `height` rows tall:
/// its chunk's 8 k a whole tile height apart, its row's group 64 elements apart.
fn place(height: i64) -> Expr {
    var("copy_chunk") * int(height * 8) + var("copy_row") / int(8) * int(64) + rem(var("copy_row"), int(8)) * int(8)
}

/// A weight tile's copies into `dst`'s stage `stage` at `k0`: the first copy's row of `w`
/// starts at element `start` (a local), each next one 32 rows on (`row_step` elements); a
/// copy is inside the expert where `index + 32·i < bound` (`index` a local).
fn copy_weights(
    dst: &str,
    (start, index): (&str, &str),
    (row_step, bound): (i64, i64),
    k_len: i64,
    (stage, k0): (Expr, Expr),
) -> Vec<Stmt> {
    let col = k0 + var("copy_chunk") * int(CHUNK);
    (0..WEIGHT_COPIES)
        .map(|i| {
            Stmt::CpAsync(Box::new(AsyncCopy {
                dst: dst.into(),
                dst_index: stage.clone() * int(W_STAGE) + place(ROWS) + int(256 * i),
                src: "w".into(),
                src_index: var(start) + int(row_step * i) + col.clone(),
                valid: and(lt(var(index) + int(32 * i), int(bound)), lt(col.clone(), int(k_len))),
            }))
        })
        .collect()
}

/// The tile's gathered rows' copies into stage `stage` of `xs` at `k0`: row `copy_row + 32·i`
/// is pair `copy_pair{i}`'s, starting at element `start(pair)` of `src`.
fn copy_rows(src: &str, start: &dyn Fn(Expr) -> Expr, k_len: i64, (stage, k0): (Expr, Expr)) -> Vec<Stmt> {
    let col = k0 + var("copy_chunk") * int(CHUNK);
    (0..ROW_COPIES)
        .map(|i| {
            let pair = var(&format!("copy_pair{i}"));
            Stmt::CpAsync(Box::new(AsyncCopy {
                dst: "xs".into(),
                dst_index: stage.clone() * int(X_STAGE) + place(PAIRS) + int(256 * i),
                src: src.into(),
                src_index: start(pair.clone()) + col.clone(),
                valid: and(bin(BinOp::Ge, pair, int(0)), lt(col.clone(), int(k_len))),
            }))
        })
        .collect()
}

fn tc(op: Tcgen05) -> Stmt {
    Stmt::Tcgen05(Box::new(op))
}

/// The tile's GEMM over K (`k_len` long): after this thread's copy places ([`copy_places`])
/// the `starts` its weight copies read, each step's copies `copy(stage, k0)`, `weights` the
/// weight tiles (shared arrays) multiplied into accumulators 64 columns apart; then
/// `epilogue(c)` for each 8 pairs `8c..8c + 8` of the tile, whose products this thread reads
/// itself. Tensor memory allocated by warp 0 (`columns`) and freed after.
fn tile_gemm(
    k_len: i64,
    (starts, copy): (Vec<Stmt>, &dyn Fn(Expr, Expr) -> Vec<Stmt>),
    weights: &[&str],
    epilogue: &dyn Fn(Expr) -> Vec<Stmt>,
) -> Vec<Stmt> {
    let columns = (PAIRS * weights.len() as i64) as u32;
    let step = [
        super::pipeline_step_head(STAGES, TILE_K, int(k_len), copy),
        multiply_landed_stage(weights, int(0)),
    ]
    .concat();
    [
        copy_places(),
        starts,
        tmem_and_barrier(columns),
        super::pipeline_prologue(STAGES, TILE_K, (int(0), int(k_len)), copy),
        vec![
            for_("k0", int(0), int(k_len), int(TILE_K), step),
            // The empty groups committed past the end.
            Stmt::CpAsyncWait(0),
            for_("c", int(0), int(PAIRS / 8), int(1), epilogue(var("c"))),
            // Every warp has read its lanes before warp 0 frees the columns.
            tc(Tcgen05::FenceBeforeSync),
            Stmt::SyncThreads,
            if_(
                eq(warp(), int(0)),
                vec![tc(Tcgen05::Dealloc {
                    columns,
                    address: var("tmem"),
                })],
            ),
        ],
    ]
    .concat()
}

/// This thread's 8 products of pairs `8c..` from the accumulator at column `64·t` into
/// locals `{prefix}0..8`, waited for.
fn load_products(prefix: &str, t: i64, c: Expr) -> Vec<Stmt> {
    let names: Vec<String> = (0..8).map(|j| format!("{prefix}{j}")).collect();
    vec![
        tc(Tcgen05::Load {
            address: var("tmem") + bin(BinOp::Shl, warp() * int(32), int(16)) + int(PAIRS * t) + c * int(8),
            names,
        }),
        tc(Tcgen05::WaitLd),
    ]
}

/// For each of the 8 pairs `8c + j` (`pair{j}`, −1 past the expert's count): `write(pair, j)`.
fn per_pair(c: Expr, write: &dyn Fn(Expr, usize) -> Vec<Stmt>) -> Vec<Stmt> {
    (0..8)
        .flat_map(|j| {
            let pair = format!("pair{j}");
            [
                vec![let_(
                    &pair,
                    Ty::I32,
                    load("tile_pairs", c.clone() * int(8) + int(j as i64)),
                )],
                write(var(&pair), j),
            ]
            .concat()
        })
        .collect()
}

/// A block's kernel ([`moe_mma::tile_kernel`]): the expert tile's `work`; `weights` its weight
/// tiles' shared arrays.
fn expert_tile_kernel(
    (name, origin): (&str, String),
    params: Vec<Param>,
    (spec, outputs): (&MoeSpec, i64),
    weights: &[&str],
    work: Vec<Stmt>,
) -> Kernel {
    let shared = |name: &str, ty: Ty, len: i64| SharedArray {
        name: name.into(),
        ty,
        len: len as usize,
    };
    let mut arrays: Vec<SharedArray> = weights.iter().map(|w| shared(w, Ty::Bf16, STAGES * W_STAGE)).collect();
    arrays.extend([
        shared("xs", Ty::Bf16, STAGES * X_STAGE),
        shared("bar", Ty::U32, 2),
        shared("tmem_slot", Ty::I32, 1),
    ]);
    let block = (THREADS as u32, arrays);
    moe_mma::tile_kernel((name, origin), params, (spec, outputs, ROWS), block, work)
}

/// `moe_mma::gate_up` on `tcgen05`: its parameters and values.
pub fn gate_up(name: &str, origin: &str, spec: &MoeSpec, hidden: usize) -> Kernel {
    let (d, i, k) = (hidden as i64, spec.intermediate as i64, spec.experts_per_token as i64);
    // The units' gate rows into `gs`, their up rows (I rows on) into `us`.
    let copy = move |stage: Expr, k0: Expr| {
        [
            copy_rows(
                "xb",
                &|pair| pair / int(k) * var("xb_stride"),
                d,
                (stage.clone(), k0.clone()),
            ),
            copy_weights(
                "gs",
                ("copy_gate", "copy_unit"),
                (32 * d, i),
                d,
                (stage.clone(), k0.clone()),
            ),
            copy_weights("us", ("copy_up", "copy_unit"), (32 * d, i), d, (stage, k0)),
        ]
        .concat()
    };
    let unit = || var("n0") + warp() * int(32) + lane();
    let epilogue = |c: Expr| {
        let write = |pair: Expr, j: usize| {
            vec![if_(
                and(bin(BinOp::Ge, pair.clone(), int(0)), lt(unit(), int(i))),
                vec![store(
                    "hidden",
                    pair * int(i) + unit(),
                    gated(spec.act, var(&format!("g{j}")), var(&format!("u{j}"))),
                )],
            )]
        };
        [
            load_products("g", 0, c.clone()),
            load_products("u", 1, c.clone()),
            per_pair(c, &write),
        ]
        .concat()
    };
    // This thread's copies are of units `copy_unit + 32·i`: their gate rows, and their up
    // rows `I` rows on.
    let first_unit = var("n0") + var("copy_row");
    let starts = vec![
        let_("copy_unit", Ty::I32, first_unit.clone()),
        let_(
            "copy_gate",
            Ty::I32,
            (var("e") * int(2 * i) + first_unit.clone()) * int(d),
        ),
        let_(
            "copy_up",
            Ty::I32,
            (var("e") * int(2 * i) + int(i) + first_unit) * int(d),
        ),
    ];
    let work = tile_gemm(d, (starts, &copy), &["gs", "us"], &epilogue);
    let origin = format!(
        "{origin}: MoE experts' gate/up and {:?} over rows of {hidden} on Blackwell tensor cores (tcgen05.mma \
         M={ROWS} N={PAIRS} bf16 into tensor memory: {ROWS} units' gate rows and their up rows, each expert's pairs' \
         bf16 rows gathered by cp.async, a 2-stage pipeline), {}",
        spec.act,
        describe(spec)
    );
    let params = gate_up_tile_params(WeightFormat::Dense(Ty::Bf16));
    expert_tile_kernel((name, origin), params, (spec, i), &["gs", "us"], work)
}

/// `moe_mma::down` on `tcgen05`: its parameters and values.
pub fn down(name: &str, origin: &str, spec: &MoeSpec, hidden: usize) -> Kernel {
    let (d, i) = (hidden as i64, spec.intermediate as i64);
    let copy = move |stage: Expr, k0: Expr| {
        [
            copy_rows("hidden", &|pair| pair * int(i), i, (stage.clone(), k0.clone())),
            copy_weights("ws", ("copy_start", "copy_output"), (32 * i, d), i, (stage, k0)),
        ]
        .concat()
    };
    let output = || var("n0") + warp() * int(32) + lane();
    let epilogue = |c: Expr| {
        let write = |pair: Expr, j: usize| {
            vec![if_(
                and(bin(BinOp::Ge, pair.clone(), int(0)), lt(output(), int(d))),
                vec![store("ys", pair * int(d) + output(), var(&format!("y{j}")))],
            )]
        };
        [load_products("y", 0, c.clone()), per_pair(c, &write)].concat()
    };
    // This thread's copies are of output rows `copy_output + 32·i`.
    let first_output = var("n0") + var("copy_row");
    let starts = vec![
        let_("copy_output", Ty::I32, first_output.clone()),
        let_("copy_start", Ty::I32, (var("e") * int(d) + first_output) * int(i)),
    ];
    let work = tile_gemm(i, (starts, &copy), &["ws"], &epilogue);
    let origin = format!(
        "{origin}: MoE experts' down projections to rows of {hidden} on Blackwell tensor cores (tcgen05.mma \
         M={ROWS} N={PAIRS} bf16 into tensor memory, each expert's pairs' bf16 hidden units gathered by cp.async, a \
         2-stage pipeline), {}",
        describe(spec)
    );
    let params = down_tile_params(WeightFormat::Dense(Ty::Bf16));
    expert_tile_kernel((name, origin), params, (spec, d), &["ws"], work)
}
