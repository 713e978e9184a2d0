//! MoE prefill on Hopper's `wgmma` (sm_90a, bf16 experts, and half ones over halves:
//! `halves::over_halves`): `moe_mma`'s launches, lists and
//! results, each listed tile's GEMM as `gemm_wgmma` runs a dense one. A block of one
//! warpgroup takes a tile of 64 pairs (wgmma's M) of one expert:
//!
//! - [`gate_up`]: 64 of the expert's hidden units, their gate and up rows in one 128-row
//!   weight tile (`wgmma.m64n128k16`), 8 units' gate rows then their up rows, so a thread's
//!   accumulators hold a unit's gate product and its up product 4 registers apart and it
//!   writes `act(gate)·up`, rounded to bf16, as `moe_mma::gate_up` does;
//! - [`down`]: 128 of the output columns, each pair's product unweighted into `ys`.
//!
//! K advances 64 a step: the weight slice (128 rows × 64) by `cp.async` into a three-stage
//! ring in core-matrix layout (as `gemm_wgmma` copies it, each thread's rows' places worked
//! out once: see [`CopyRows`]), the tile's gathered bf16 rows (`bf16_rows`'s copy of the
//! step's rows for gate/up, `hidden` for down) straight into registers as A a step ahead, two
//! elements a load, each lane's two rows' pairs looked up once. Requirements ([`supports`]):
//! bf16 experts over a hidden size and expert width that are multiples of 8.

use super::gemm_wgmma::{a_name, d_name, multiply_stage, next_a_name, CHUNK, K_SLICES, STAGE, TILE_K, TILE_N};
use super::gemv::gated;
use super::moe::describe;
use super::moe_mma::{self, down_tile_params, gate_up_tile_params};
use super::quant::WeightFormat;
use crate::dsl::*;
use ir::MoeSpec;

/// One warpgroup a block.
const THREADS: i64 = 128;
/// Weight slices in flight: as the dense GEMM's plans.
const STAGES: i64 = 3;
/// Hidden units a gate/up block takes: half its 128-row weight tile.
const UNITS: i64 = TILE_N / 2;

/// Whether the kernels take a layer of `spec` over rows of `hidden` with weights of `format`.
pub fn supports(spec: &MoeSpec, hidden: usize, format: WeightFormat) -> bool {
    format == WeightFormat::Dense(Ty::Bf16) && moe_mma::supports(spec, hidden, format)
}

/// This lane's two rows of the tile (g and g + 8 of its warp's 16): their pairs (−1 past the
/// expert's count), read once from `tile_pairs`.
fn lane_pairs() -> Vec<Stmt> {
    vec![
        let_("wrow", Ty::I32, warp() * int(16)),
        let_("gr", Ty::I32, lane() / int(4)),
        let_("t2", Ty::I32, rem(lane(), int(4)) * int(2)),
        let_("pair_lo", Ty::I32, load("tile_pairs", var("wrow") + var("gr"))),
        let_("pair_hi", Ty::I32, load("tile_pairs", var("wrow") + var("gr") + int(8))),
    ]
}

/// This lane's row half `half`'s pair.
fn pair(half: usize) -> Expr {
    var(["pair_lo", "pair_hi"][half])
}

/// Load this lane's A fragments (named by `name`) of the step at `k0`: per k slice, its two
/// rows' columns 2t, 2t + 1 and those + 8, a pair of bf16 a load from `src` where row `pair`
/// starts at `start(pair)`, zero past the count and `k_len` (a multiple of 8: a pair is
/// inside it or not).
fn load_rows(
    src: &str,
    start: &dyn Fn(Expr) -> Expr,
    k_len: i64,
    k0: Expr,
    name: fn(usize, usize) -> String,
) -> Vec<Stmt> {
    let mut out = Vec::new();
    for slice in 0..K_SLICES {
        for (half, col_half) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
            let first = 2 * half + 4 * col_half;
            let names = [0, 1].map(|j| name(slice, first + j));
            let col = k0.clone() + int(16 * slice as i64 + 8 * col_half as i64) + var("t2");
            let loaded: Vec<String> = names.iter().map(|n| format!("{n}_loaded")).collect();
            out.extend(names.iter().map(|n| assign(n, f(0.0))));
            out.push(if_(
                and(bin(BinOp::Ge, pair(half), int(0)), lt(col.clone(), int(k_len))),
                [
                    vec![load_vec(src, start(pair(half)) + col, &loaded)],
                    names.iter().zip(&loaded).map(|(n, l)| assign(n, var(l))).collect(),
                ]
                .concat(),
            ));
        }
    }
    out
}

/// A thread's 8 copies of a stage's weight slice, as `gemm_wgmma` lays them out (copy
/// `c = tid + 128·i` is tile row `8·(c / 64) + c % 8`, k chunk `(c / 8) % 8`): tile rows
/// `row0 + 16·i` for `row0 = 8·(tid / 64) + tid % 8`, one k chunk, so each copy's place is
/// the first's plus constants. The first copy's row starts at element `start` of `w` and the
/// i-th `step·i` further on; it is inside the expert where `index + index_step·i < bound`.
/// Worked out once a block: worked out for each copy in a loop, its signed divisions cost
/// some 40 instructions a copy (ptxas neither unrolls that loop nor hoists them).
struct CopyRows {
    start: Expr,
    step: i64,
    index: Expr,
    index_step: i64,
    bound: i64,
}

/// Copies a thread makes of a stage.
const COPIES: i64 = STAGE / CHUNK / THREADS;

/// This thread's first copy's tile row (`copy_row`), its k chunk (`copy_chunk`), and where
/// the first copy goes in a stage (`copy_at`, core-matrix layout).
fn copy_places() -> Vec<Stmt> {
    vec![
        let_("copy_row", Ty::I32, tid() / int(64) * int(8) + rem(tid(), int(8))),
        let_("copy_chunk", Ty::I32, rem(tid() / int(8), int(8))),
        let_(
            "copy_at",
            Ty::I32,
            var("copy_row") / int(8) * int(TILE_K * 8)
                + var("copy_chunk") * int(64)
                + rem(var("copy_row"), int(8)) * int(8),
        ),
    ]
}

/// The copies of the weight slice at `k0` into stage buffer `stage` (rows `k_len` long, a
/// multiple of 8: zero-filled past it, and outside the expert).
fn copy_stage(rows: &CopyRows, k_len: i64, (stage, k0): (Expr, Expr)) -> Vec<Stmt> {
    let col = k0 + var("copy_chunk") * int(CHUNK);
    (0..COPIES)
        .map(|i| {
            // Copy i's row: 16 tile rows, 2 of the 8-row groups, after the first's.
            Stmt::CpAsync(Box::new(AsyncCopy {
                dst: "ws".into(),
                dst_index: stage.clone() * int(STAGE) + var("copy_at") + int(2 * TILE_K * 8 * i),
                src: "w".into(),
                src_index: var("copy_start") + int(rows.step * i) + col.clone(),
                valid: and(
                    lt(var("copy_index") + int(rows.index_step * i), int(rows.bound)),
                    lt(col.clone(), int(k_len)),
                ),
            }))
        })
        .collect()
}

/// The tile's GEMM over K (`k_len` long): the weight slices' copies (`rows`), the gathered
/// rows of `src` as A (`start`, see [`load_rows`]), the accumulators `d0..d63` left for the
/// epilogue.
fn tile_gemm(k_len: i64, rows: CopyRows, (src, start): (&str, &dyn Fn(Expr) -> Expr)) -> Vec<Stmt> {
    let copy = |stage: Expr, k0: Expr| copy_stage(&rows, k_len, (stage, k0));
    let registers = (0..TILE_N as usize / 2)
        .map(d_name)
        .chain((0..K_SLICES).flat_map(|s| (0..8).flat_map(move |i| [a_name(s, i), next_a_name(s, i)])));
    let taken = (0..K_SLICES).flat_map(|s| (0..8).map(move |i| assign(&a_name(s, i), var(&next_a_name(s, i)))));
    let next = var("k0") + int(TILE_K);
    let step = [
        super::pipeline_step_head(STAGES, TILE_K, int(k_len), copy),
        taken.collect(),
        vec![if_(
            lt(next.clone(), int(k_len)),
            load_rows(src, start, k_len, next, next_a_name),
        )],
        vec![super::pipeline_wait(STAGES), Stmt::FenceProxyAsync, Stmt::SyncThreads],
        multiply_stage(),
        // Nobody refills this buffer (next step) before every thread is past the wait.
        vec![Stmt::SyncThreads],
    ]
    .concat();
    [
        copy_places(),
        vec![
            let_("copy_start", Ty::I32, rows.start.clone()),
            let_("copy_index", Ty::I32, rows.index.clone()),
        ],
        registers.map(|n| let_(&n, Ty::F32, f(0.0))).collect(),
        super::pipeline_prologue(STAGES, TILE_K, (int(0), int(k_len)), copy),
        load_rows(src, start, k_len, int(0), next_a_name),
        vec![
            for_("k0", int(0), int(k_len), int(TILE_K), step),
            // The empty groups committed past the end.
            Stmt::CpAsyncWait(0),
        ],
    ]
    .concat()
}

/// Accumulator `i`'s row half (0 or 1) and its column in the tile (layout in `WgmmaOp`); `i`
/// and `i + 1` (even `i`) are neighbouring columns of one row.
fn place(i: usize) -> (usize, Expr) {
    (
        usize::from(i % 4 >= 2),
        int(8 * (i / 4) as i64 + (i % 2) as i64) + var("t2"),
    )
}

/// A block's kernel ([`moe_mma::tile_kernel`]): this lane's pairs, then the expert tile's
/// `work`; `per_block` outputs a block.
fn expert_tile_kernel(
    (name, origin): (&str, String),
    params: Vec<Param>,
    (spec, outputs, per_block): (&MoeSpec, i64, i64),
    work: Vec<Stmt>,
) -> Kernel {
    let ring = SharedArray {
        name: "ws".into(),
        ty: Ty::Bf16,
        len: (STAGES * STAGE) as usize,
    };
    let block = (THREADS as u32, vec![ring]);
    let tile = [lane_pairs(), work].concat();
    moe_mma::tile_kernel((name, origin), params, (spec, outputs, per_block), block, tile)
}

/// `moe_mma::gate_up` on `wgmma`: its parameters and values.
pub fn gate_up(name: &str, origin: &str, spec: &MoeSpec, hidden: usize) -> Kernel {
    let (d, i, k) = (hidden as i64, spec.intermediate as i64, spec.experts_per_token as i64);
    // Tile rows in groups of 8, alternately 8 units' gate rows and the same units' up rows
    // (group 2j: units 8j..8j+8's gate rows, group 2j + 1 their up rows). A thread's copies
    // are of rows in groups of its first one's parity, `tid / 64`: all gate rows or all up
    // rows, of units `n0 + tid % 8 + 8·i`.
    let unit = var("n0") + rem(tid(), int(8));
    let rows = CopyRows {
        start: (var("e") * int(2 * i) + tid() / int(64) * int(i) + unit.clone()) * int(d),
        step: 8 * d,
        index: unit,
        index_step: 8,
        bound: i,
    };
    let start = |pair: Expr| pair / int(k) * var("xb_stride");
    let mut work = tile_gemm(d, rows, ("xb", &start));
    // A unit's up product sits 8 columns, 4 accumulators, after its gate product: the
    // accumulators of even 8-column blocks are gates.
    for at in (0..TILE_N as usize / 2).step_by(2).filter(|at| at / 4 % 2 == 0) {
        let (half, _) = place(at);
        let unit = var("n0") + int(8 * (at / 8) as i64) + var("t2");
        let gate = |j: usize| gated(spec.act, var(&d_name(at + j)), var(&d_name(at + j + 4)));
        // Both units inside `I` or neither (`I` a multiple of 8).
        work.push(if_(
            and(bin(BinOp::Ge, pair(half), int(0)), lt(unit.clone(), int(i))),
            vec![store_vec("hidden", pair(half) * int(i) + unit, vec![gate(0), gate(1)])],
        ));
    }
    let origin = format!(
        "{origin}: MoE experts' gate/up and {:?} over rows of {hidden} on Hopper tensor cores (wgmma m64n{TILE_N}k16 \
         bf16: {UNITS} units' gate and up rows a tile, each expert's pairs' bf16 rows gathered into registers a step \
         ahead, weights through a {STAGES}-stage cp.async pipeline), {}",
        spec.act,
        describe(spec)
    );
    let params = gate_up_tile_params(WeightFormat::Dense(Ty::Bf16));
    expert_tile_kernel((name, origin), params, (spec, i, UNITS), work)
}

/// `moe_mma::down` on `wgmma`: its parameters and values.
pub fn down(name: &str, origin: &str, spec: &MoeSpec, hidden: usize) -> Kernel {
    let (d, i) = (hidden as i64, spec.intermediate as i64);
    // Copy i of a thread is of output row `n0 + copy_row + 16·i`.
    let output = var("n0") + var("copy_row");
    let rows = CopyRows {
        start: (var("e") * int(d) + output.clone()) * int(i),
        step: 16 * i,
        index: output,
        index_step: 16,
        bound: d,
    };
    let start = |pair: Expr| pair * int(i);
    let mut work = tile_gemm(i, rows, ("hidden", &start));
    for at in (0..TILE_N as usize / 2).step_by(2) {
        let (half, column) = place(at);
        let output = var("n0") + column;
        // Both columns inside `d` or neither (`d` a multiple of 8).
        work.push(if_(
            and(bin(BinOp::Ge, pair(half), int(0)), lt(output.clone(), int(d))),
            vec![store_vec(
                "ys",
                pair(half) * int(d) + output,
                vec![var(&d_name(at)), var(&d_name(at + 1))],
            )],
        ));
    }
    let origin = format!(
        "{origin}: MoE experts' down projections to rows of {hidden} on Hopper tensor cores (wgmma m64n{TILE_N}k16 \
         bf16, each expert's pairs' bf16 hidden units gathered into registers a step ahead, weights through a \
         {STAGES}-stage cp.async pipeline), {}",
        describe(spec)
    );
    let params = down_tile_params(WeightFormat::Dense(Ty::Bf16));
    expert_tile_kernel((name, origin), params, (spec, d, TILE_N), work)
}
