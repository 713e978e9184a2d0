//! MoE prefill on tensor cores (bf16, f16 or GGUF-block experts, multiplied in bf16; half
//! experts multiplied as halves by the bf16 kernels over halves, `halves::over_halves`): each
//! expert's chosen rows gathered into tiles and multiplied by `mma.sync`, where `moe`'s
//! expert-by-expert kernels dot one row at a time in f32 on the CUDA cores (`moe_wgmma` and
//! `moe_tcgen05` run the same tiles for bf16 experts on Hopper and the B200). Four launches
//! in the steps that run them, after `bf16_rows` has made the step's rows bf16 once:
//!
//! 1. [`group_pairs`]: a block per expert lists the pairs (row t, choice p: `pair = t·k + p`)
//!    that chose it, in order, at `expert_pairs[e·tokens..]` (a row chooses an expert once, so
//!    `tokens` places hold them), and their count in `expert_counts[e]`.
//! 2. [`list_tiles`]: one block lists the experts' tiles of 64 pairs, expert after expert.
//! 3. [`gate_up`]: a block per (listed tile, 64 hidden units): the pairs' bf16 rows times the
//!    units' gate and up rows, both products in registers, `act(gate)·up` rounded to bf16 into
//!    `hidden` where `moe::gate_up` writes it in f32.
//! 4. [`down`]: a block per (listed tile, 64 output columns): the pairs' hidden units times the
//!    expert's down rows, each pair's product unweighted into `ys`, as `moe::down_by_expert`
//!    leaves it for `moe::combine`.
//!
//! The GEMMs are `gemm_mma`'s tile (its constants and warp places): 4 warps a 64×64 tile, K in
//! steps of 32, f32 accumulation, operands by `ldmatrix`. Each step's gathered rows (the
//! tile's pairs' rows, bf16 as the dense tensor-core GEMMs round activations) arrive by
//! `cp.async` a step ahead into one of two buffers, with bf16 weights; GGUF blocks decode into
//! their tile a run of 16 a thread and f16 weights a pair a thread, rounded to bf16 (as the
//! decoding dense GEMM does), while the next step's rows land. `hidden` is rounded to bf16 by
//! `gate_up` rather than by `down`'s staging (the same values, half the bytes each way). Blocks
//! of one expert's weight tile run next to each other, so its weights cross from memory once a
//! step. Requirements ([`supports`]): a hidden size and expert width that are multiples of 8
//! (rows of whole 16-byte copies), and bf16 or f16 weights or GGUF blocks (rows of whole
//! blocks).

use super::gemm_mma::{
    self, accumulator, declare_accumulators, warp_k_slice, Slice, STAGE, STAGES, TILE_K, TILE_M, TILE_N, WARPS,
    WARP_M_TILES, WARP_N_TILES,
};
use super::gemv::gated;
use super::moe::{block_prefix_sum, chunk_hits, describe, down_params, gate_up_params};
use super::quant::{self, WeightFormat};
use super::BLOCK;
use crate::dsl::*;
use ir::MoeSpec;

/// Whether the tensor-core kernels take a layer of `spec` over rows of `hidden` with weights
/// of `format` (f32 experts stay on the CUDA cores, in f32).
pub fn supports(spec: &MoeSpec, hidden: usize, format: WeightFormat) -> bool {
    let whole = |unit: usize| hidden.is_multiple_of(unit) && spec.intermediate.is_multiple_of(unit);
    whole(8)
        && match format {
            WeightFormat::Dense(ty) => matches!(ty, Ty::Bf16 | Ty::F16),
            WeightFormat::Blocks(format) => {
                quant::block_layout(format).is_some_and(|(elements, _)| whole(elements as usize))
            }
        }
}

/// List each expert's pairs: a block per expert scans the routes a block-wide chunk at a time,
/// compacting its hits in order by a prefix sum; none where `active` is 0 (an empty grid: the
/// steps that run `moe`'s row-by-row kernels).
pub fn group_pairs(name: &str, origin: &str, spec: &MoeSpec) -> Kernel {
    let k = spec.experts_per_token as i64;
    let mut chunk = chunk_hits();
    chunk.extend([
        if_(
            eq(var("hit"), int(1)),
            vec![store(
                "expert_pairs",
                var("e") * var("tokens") + var("count") + load("scan", tid()) - int(1),
                var("at"),
            )],
        ),
        assign("count", var("count") + load("scan", int(BLOCK as i64 - 1))),
        // Everyone has read the sums before the next chunk's overwrite them.
        Stmt::SyncThreads,
    ]);
    Kernel {
        name: name.into(),
        origin: format!("{origin}: MoE pairs listed expert by expert, {}", describe(spec)),
        params: vec![
            buffer("routes", Ty::I32, false),
            buffer("expert_pairs", Ty::I32, true),
            buffer("expert_counts", Ty::I32, true),
            scalar("tokens", Ty::I32),
            scalar("active", Ty::I32),
        ],
        shared: vec![scan_array()],
        block_dim: BLOCK,
        grid: int(spec.experts as i64) * var("active"),
        body: vec![
            let_("e", Ty::I32, bid()),
            let_("pairs", Ty::I32, var("tokens") * int(k)),
            let_("count", Ty::I32, int(0)),
            for_("chunk", int(0), var("pairs"), int(BLOCK as i64), chunk),
            if_(eq(tid(), int(0)), vec![store("expert_counts", var("e"), var("count"))]),
        ],
    }
}

/// The listing kernels' block-wide prefix sums (`moe`'s `block_prefix_sum`).
fn scan_array() -> SharedArray {
    SharedArray {
        name: "scan".into(),
        ty: Ty::I32,
        len: BLOCK as usize,
    }
}

/// The experts' pair tiles, listed in order by [`list_tiles`]: at most one partial tile an
/// expert beyond the `tokens·k` pairs' whole tiles. What the tensor-core kernels' grids and
/// the list's length are made of (`tokens` of the step; `rows` of a plan's scratch).
pub fn tile_bound(spec: &MoeSpec, tokens: Expr) -> Expr {
    (tokens * int(spec.experts_per_token as i64) + int(TILE_M - 1)) / int(TILE_M) + int(spec.experts as i64)
}

/// List every expert's pair tiles in order, expert by expert, for the tensor-core kernels'
/// blocks to take one each: `tiles[j] = e·row_tiles + t` for expert `e`'s tile `t` (its pairs
/// `64·t..`), −1 from the last to [`tile_bound`]. One block: each expert's tile count from
/// its listed pairs, a block-wide chunk of experts at a time, placed by a prefix sum. None
/// where `active` is 0 (the steps that run `moe`'s row-by-row kernels).
pub fn list_tiles(name: &str, origin: &str, spec: &MoeSpec) -> Kernel {
    let experts = spec.experts as i64;
    let chunk = [
        vec![
            let_("e", Ty::I32, var("chunk") + tid()),
            let_("mine", Ty::I32, int(0)),
            if_(
                lt(var("e"), int(experts)),
                vec![assign(
                    "mine",
                    (load("expert_counts", var("e")) + int(TILE_M - 1)) / int(TILE_M),
                )],
            ),
        ],
        block_prefix_sum("mine", "scan"),
        vec![
            let_("first", Ty::I32, var("listed") + load("scan", tid()) - var("mine")),
            for_(
                "t",
                int(0),
                var("mine"),
                int(1),
                vec![store(
                    "tiles",
                    var("first") + var("t"),
                    var("e") * row_tiles() + var("t"),
                )],
            ),
            assign("listed", var("listed") + load("scan", int(BLOCK as i64 - 1))),
            // Everyone has read the sums before the next chunk's overwrite them.
            Stmt::SyncThreads,
        ],
    ]
    .concat();
    Kernel {
        name: name.into(),
        origin: format!("{origin}: MoE experts' pair tiles listed in order, {}", describe(spec)),
        params: vec![
            buffer("expert_counts", Ty::I32, false),
            buffer("tiles", Ty::I32, true),
            scalar("tokens", Ty::I32),
            scalar("active", Ty::I32),
        ],
        shared: vec![scan_array()],
        block_dim: BLOCK,
        grid: var("active"),
        body: vec![
            let_("listed", Ty::I32, int(0)),
            for_("chunk", int(0), int(experts), int(BLOCK as i64), chunk),
            for_(
                "j",
                var("listed") + tid(),
                tile_bound(spec, var("tokens")),
                int(BLOCK as i64),
                vec![store("tiles", var("j"), int(-1))],
            ),
        ],
    }
}

/// A block for each of the listed pair tiles ([`tile_bound`]) of each `per_block` outputs.
fn grid(spec: &MoeSpec, outputs: i64, per_block: i64) -> Expr {
    int((outputs + per_block - 1) / per_block) * tile_bound(spec, var("tokens"))
}

fn row_tiles() -> Expr {
    (var("tokens") + int(TILE_M - 1)) / int(TILE_M)
}

/// The block's listed tile (listed tiles vary fastest: an expert's tiles are neighbours, and
/// share a weight tile), its expert `e`, first pair `m0` and the expert's `count` of pairs
/// (0 past the list: no work), and its first output `n0` (`per_block` outputs a block).
fn block_place(spec: &MoeSpec, per_block: i64) -> Vec<Stmt> {
    let bound = tile_bound(spec, var("tokens"));
    vec![
        let_("tile", Ty::I32, load("tiles", rem(bid(), bound.clone()))),
        let_("n0", Ty::I32, bid() / bound * int(per_block)),
        let_("e", Ty::I32, int(0)),
        let_("m0", Ty::I32, int(0)),
        let_("count", Ty::I32, int(0)),
        if_(
            bin(BinOp::Ge, var("tile"), int(0)),
            vec![
                assign("e", var("tile") / row_tiles()),
                assign("m0", rem(var("tile"), row_tiles()) * int(TILE_M)),
                assign("count", load("expert_counts", var("e"))),
            ],
        ),
    ]
}

/// The tile's pairs in shared `tile_pairs` ([`tile_pairs_array`]; −1 past the expert's
/// count), then a barrier.
fn tile_pairs() -> Vec<Stmt> {
    vec![
        if_(
            lt(tid(), int(TILE_M)),
            vec![
                let_("listed", Ty::I32, int(-1)),
                if_(
                    lt(var("m0") + tid(), var("count")),
                    vec![assign(
                        "listed",
                        load("expert_pairs", var("e") * var("tokens") + var("m0") + tid()),
                    )],
                ),
                store("tile_pairs", tid(), var("listed")),
            ],
        ),
        Stmt::SyncThreads,
    ]
}

/// Copy the tile's slice of gathered bf16 rows at `k0` into `xs`'s buffer `buffer` by
/// `cp.async` (`gemm_mma::copy_slice`): row r is the one `start(pair)` begins (the index of
/// a pair's first element), zero-filled past the count.
fn copy_rows(src: &'static str, start: &dyn Fn(Expr) -> Expr, k_len: i64, (buffer, k0): (Expr, Expr)) -> Stmt {
    let source = Slice {
        src,
        locate: vec![let_("pair", Ty::I32, load("tile_pairs", var("row")))],
        start: start(var("pair")),
        valid: bin(BinOp::Ge, var("pair"), int(0)),
        k: int(k_len),
    };
    gemm_mma::copy_slice(("xs", buffer * int(STAGE)), &source, k0)
}

/// A weight tile's `cp.async` copies into `dst`'s buffer `buffer` (`gemm_mma::copy_slice`):
/// 64 rows from `first_row` (those from `valid_rows` on zero-filled), 32 columns at `k0` of
/// rows `k_len` long.
fn copy_weights(dst: &str, (first_row, valid_rows): (Expr, Expr), k_len: i64, (buffer, k0): (Expr, Expr)) -> Stmt {
    let source = Slice {
        src: "w",
        locate: vec![],
        start: (first_row + var("row")) * int(k_len),
        valid: lt(var("row"), valid_rows),
        k: int(k_len),
    };
    gemm_mma::copy_slice((dst, buffer * int(STAGE)), &source, k0)
}

/// A weight tile decoded into `dst`'s buffer `s`: 64 rows from `first_row` (those from
/// `valid_rows` on zero), 32 columns at `k0` of rows `k_len` long; GGUF blocks a run a thread
/// (`gemm_mma::decode_block_runs`), half weights a pair a thread (`gemm_mma::stage_pairs`).
fn decode_weights(format: WeightFormat, dst: &str, (first_row, valid_rows): (Expr, Expr), k_len: i64) -> Stmt {
    let at = var("s") * int(STAGE);
    if let WeightFormat::Blocks(blocks) = format {
        return gemm_mma::decode_block_runs(blocks, dst, at, (first_row, valid_rows), int(k_len));
    }
    let row = first_row + var("r");
    let fetch = |col: Expr, value: &str| {
        let element = format!("{value}_w");
        [
            format.element(&element, row.clone(), int(k_len), col),
            vec![assign(value, var(&element))],
        ]
        .concat()
    };
    let valid = lt(var("r"), valid_rows);
    gemm_mma::stage_pairs(dst, at, int(k_len), (vec![], valid), &fetch)
}

/// A K step's copies into a buffer: `copy(buffer, k0)`.
type StepCopies = Box<dyn Fn(Expr, Expr) -> Vec<Stmt>>;

/// How an expert's weight tiles (`tiles`: each one's shared array, first row and rows before
/// the expert's end) reach shared memory each K step: bf16 by `cp.async` a step ahead (the
/// copies, for the pipeline to issue), others decoded in the step (statements for the step).
fn weight_tiles(format: WeightFormat, tiles: Vec<(&'static str, Expr, Expr)>, k_len: i64) -> (StepCopies, Vec<Stmt>) {
    match format {
        WeightFormat::Dense(Ty::Bf16) => (
            Box::new(move |buffer: Expr, k0: Expr| {
                tiles
                    .iter()
                    .map(|(dst, first, valid)| {
                        copy_weights(dst, (first.clone(), valid.clone()), k_len, (buffer.clone(), k0.clone()))
                    })
                    .collect()
            }),
            vec![],
        ),
        _ => (
            Box::new(|_, _| vec![]),
            tiles
                .into_iter()
                .map(|(dst, first, valid)| decode_weights(format, dst, (first, valid), k_len))
                .collect(),
        ),
    }
}

/// A K step's copies: the tile's rows of `src` gathered by [`copy_rows`] (`start` of a pair),
/// then the weight tiles' (`weights`).
fn with_rows(src: &'static str, start: impl Fn(Expr) -> Expr + 'static, k_len: i64, weights: StepCopies) -> StepCopies {
    Box::new(move |buffer: Expr, k0: Expr| {
        let mut copies = vec![copy_rows(src, &start, k_len, (buffer.clone(), k0.clone()))];
        copies.extend(weights(buffer, k0));
        copies
    })
}

/// The GEMM over the tile's pairs: K (`k_len` long) in steps, `copy(buffer, k0)` a step's
/// copies (the gathered rows, bf16 weight tiles) issued a step ahead, `decode` the weights
/// decoded in the step, `weights` the tiles multiplied; then `epilogue` for each pair of
/// neighbouring accumulators (the pair's row in the tile, the outputs' columns in the tile,
/// which of a lane's 4 the first is: 0 or 2).
fn tile_gemm(
    k_len: i64,
    copy: &dyn Fn(Expr, Expr) -> Vec<Stmt>,
    decode: Vec<Stmt>,
    weights: &[(&str, &str)],
    epilogue: &dyn Fn(usize, usize, usize) -> Vec<Stmt>,
) -> Vec<Stmt> {
    let accumulators = weights.iter().flat_map(|&(_, prefix)| declare_accumulators(prefix));
    let buffer = var("s") * int(STAGE);
    let tiles: Vec<(&str, Expr, &str)> = weights
        .iter()
        .map(|&(array, prefix)| (array, buffer.clone(), prefix))
        .collect();
    let step = [
        super::pipeline_step_head(STAGES, TILE_K, int(k_len), copy),
        decode,
        vec![super::pipeline_wait(STAGES), Stmt::SyncThreads],
        warp_k_slice(0, buffer.clone(), &tiles),
        warp_k_slice(16, buffer, &tiles),
        // Nobody restages until every warp has read this step's tiles.
        vec![Stmt::SyncThreads],
    ]
    .concat();
    let mut out: Vec<Stmt> = accumulators.collect();
    out.extend(super::pipeline_prologue(STAGES, TILE_K, (int(0), int(k_len)), copy));
    out.push(for_("k0", int(0), int(k_len), int(TILE_K), step));
    // The empty groups committed past the end.
    out.push(Stmt::CpAsyncWait(0));
    for mi in 0..WARP_M_TILES {
        for ni in 0..WARP_N_TILES {
            for i in [0, 2] {
                out.extend(epilogue(mi, ni, i));
            }
        }
    }
    out
}

/// The accumulator place's pair (`pair_at`, −1 past the count) and output (`out_column`;
/// accumulator `i + 1`'s is the next, for even `i`).
fn place(mi: usize, ni: usize, i: usize) -> Vec<Stmt> {
    let row = var("wm") + int(16 * mi as i64 + if i >= 2 { 8 } else { 0 }) + var("gr");
    vec![
        assign("pair_at", load("tile_pairs", row)),
        assign(
            "out_column",
            var("n0") + var("wn") + int(8 * ni as i64 + (i % 2) as i64) + var("t2"),
        ),
    ]
}

/// An expert tile's kernel over `outputs` outputs an expert: `work` (the tile's GEMM) where
/// the expert has pairs in the tile, the same for every thread of the block; `weights` the
/// shared arrays its weight tiles go through.
fn expert_tile_kernel(
    (name, origin): (&str, String),
    params: Vec<Param>,
    (spec, outputs): (&MoeSpec, i64),
    weights: &[&str],
    work: Vec<Stmt>,
) -> Kernel {
    let staged = |name: &str, buffers: i64| SharedArray {
        name: name.into(),
        ty: Ty::Bf16,
        len: (buffers * STAGE) as usize,
    };
    let mut shared = vec![staged("xs", STAGES)];
    shared.extend(weights.iter().map(|w| staged(w, STAGES)));
    let mut tile = gemm_mma::warp_places();
    tile.extend([let_("pair_at", Ty::I32, int(0)), let_("out_column", Ty::I32, int(0))]);
    tile.extend(work);
    let block = ((32 * WARPS) as u32, shared);
    tile_kernel((name, origin), params, (spec, outputs, TILE_N), block, tile)
}

/// The kernel of a block a listed tile of pairs by `per_block` of the expert's `outputs`
/// (this module's, `moe_wgmma`'s and `moe_tcgen05`'s): its place ([`block_place`]), then
/// where the expert has pairs in the tile (the same for every thread of the block) the
/// tile's pairs read ([`tile_pairs`]) and `work`; `threads` a block, `shared` its arrays
/// besides the pairs'.
pub(super) fn tile_kernel(
    (name, origin): (&str, String),
    params: Vec<Param>,
    (spec, outputs, per_block): (&MoeSpec, i64, i64),
    (threads, mut shared): (u32, Vec<SharedArray>),
    work: Vec<Stmt>,
) -> Kernel {
    shared.push(tile_pairs_array());
    let mut body = block_place(spec, per_block);
    body.push(if_(lt(var("m0"), var("count")), [tile_pairs(), work].concat()));
    Kernel {
        name: name.into(),
        origin,
        params,
        shared,
        block_dim: threads,
        grid: grid(spec, outputs, per_block),
        body,
    }
}

/// Shared memory for a tile's pairs ([`tile_pairs`]).
fn tile_pairs_array() -> SharedArray {
    SharedArray {
        name: "tile_pairs".into(),
        ty: Ty::I32,
        len: TILE_M as usize,
    }
}

/// How the weights reach the tiles, for a kernel's origin line.
fn staging(format: WeightFormat) -> &'static str {
    match format {
        WeightFormat::Dense(Ty::Bf16) => " through a 2-stage cp.async pipeline",
        _ => " decoded into the tile",
    }
}

/// Where the expert lists come from: [`group_pairs`]'s and [`list_tiles`]'s outputs, after
/// the kernel's own.
fn list_params() -> [Param; 3] {
    [
        buffer("expert_pairs", Ty::I32, false),
        buffer("expert_counts", Ty::I32, false),
        buffer("tiles", Ty::I32, false),
    ]
}

/// `params` with the pairs' hidden units (`hidden`) in bf16: what [`down`] rounds them to,
/// so [`gate_up`] stores them so (half the bytes each way) and [`down`] copies them as they lie.
fn bf16_hidden(params: Vec<Param>) -> Vec<Param> {
    params
        .into_iter()
        .map(|param| match param {
            Param::Buffer { name, writable, .. } if name == "hidden" => buffer(&name, Ty::Bf16, writable),
            other => other,
        })
        .collect()
}

/// The tensor-core gate/up kernels' parameters (this module's and `moe_wgmma`'s and
/// `moe_tcgen05`'s, over weights of `format`): `moe::gate_up`'s with `hidden` in bf16
/// ([`bf16_hidden`]), the lists ([`list_params`]), then `x`'s rows as bf16 (`xb`, rows
/// `xb_stride` apart: `bf16_rows`'s), which the tiles gather (`x` itself is not read).
pub(super) fn gate_up_tile_params(format: WeightFormat) -> Vec<Param> {
    [
        bf16_hidden(gate_up_params(format)),
        list_params().to_vec(),
        vec![buffer("xb", Ty::Bf16, false), scalar("xb_stride", Ty::I32)],
    ]
    .concat()
}

/// The tensor-core down kernels' parameters: `moe::down_by_expert`'s over weights of
/// `format` with `hidden` in bf16 ([`bf16_hidden`]), then the lists ([`list_params`]).
pub(super) fn down_tile_params(format: WeightFormat) -> Vec<Param> {
    [
        bf16_hidden(down_params(format)),
        vec![buffer("ys", Ty::F32, true)],
        list_params().to_vec(),
    ]
    .concat()
}

/// `moe::gate_up`'s values (`hidden[pair·I + unit] = act(gate)·up`, here rounded to bf16) on
/// tensor cores, expert tile by expert tile: the parameters of `moe::gate_up` over weights of
/// `format` ([`supports`]), then the lists, then `x`'s rows as bf16 (`xb`, rows `xb_stride`
/// apart: `bf16_rows`'s), which the tiles gather by `cp.async` (`x` itself is not read).
pub fn gate_up(name: &str, origin: &str, spec: &MoeSpec, hidden: usize, format: WeightFormat) -> Kernel {
    let (d, i, k) = (hidden as i64, spec.intermediate as i64, spec.experts_per_token as i64);
    let first = |part: i64| var("e") * int(2 * i) + int(part * i) + var("n0");
    let tiles = vec![
        ("gs", first(0), int(i) - var("n0")),
        ("us", first(1), int(i) - var("n0")),
    ];
    let (weight_copies, decoded) = weight_tiles(format, tiles, d);
    let copy = with_rows("xb", move |pair| pair / int(k) * var("xb_stride"), d, weight_copies);
    let epilogue = |mi: usize, ni: usize, j: usize| {
        let gate = |j: usize| {
            gated(
                spec.act,
                var(&accumulator("g", mi, ni, j)),
                var(&accumulator("u", mi, ni, j)),
            )
        };
        let mut out = place(mi, ni, j);
        // Both columns inside `I` or neither (`I` a multiple of 8).
        out.push(if_(
            and(bin(BinOp::Ge, var("pair_at"), int(0)), lt(var("out_column"), int(i))),
            vec![store_vec(
                "hidden",
                var("pair_at") * int(i) + var("out_column"),
                vec![gate(j), gate(j + 1)],
            )],
        ));
        out
    };
    let work = tile_gemm(d, &*copy, decoded, &[("gs", "g"), ("us", "u")], &epilogue);
    let origin = format!(
        "{origin}: MoE experts' gate/up and {:?} over rows of {hidden} on tensor cores (mma.sync m16n8k16 bf16, \
         each expert's pairs' bf16 rows gathered into {TILE_M}-row tiles by cp.async), {} weights{}, {}",
        spec.act,
        format.describe(),
        staging(format),
        describe(spec)
    );
    expert_tile_kernel(
        (name, origin),
        gate_up_tile_params(format),
        (spec, i),
        &["gs", "us"],
        work,
    )
}

/// `moe::down_by_expert`'s values (each pair's down projection unweighted, `ys[pair·d + n]`)
/// on tensor cores, expert tile by expert tile: its parameters over weights of `format`
/// ([`supports`]) with [`gate_up`]'s bf16 `hidden`, then the lists.
pub fn down(name: &str, origin: &str, spec: &MoeSpec, hidden: usize, format: WeightFormat) -> Kernel {
    let (d, i) = (hidden as i64, spec.intermediate as i64);
    let tiles = vec![("ws", var("e") * int(d) + var("n0"), int(d) - var("n0"))];
    let (weight_copies, decoded) = weight_tiles(format, tiles, i);
    let copy = with_rows("hidden", move |pair| pair * int(i), i, weight_copies);
    let epilogue = |mi: usize, ni: usize, j: usize| {
        let mut out = place(mi, ni, j);
        // Both columns inside `d` or neither (`d` a multiple of 8).
        out.push(if_(
            and(bin(BinOp::Ge, var("pair_at"), int(0)), lt(var("out_column"), int(d))),
            vec![store_vec(
                "ys",
                var("pair_at") * int(d) + var("out_column"),
                (j..j + 2).map(|j| var(&accumulator("c", mi, ni, j))).collect(),
            )],
        ));
        out
    };
    let work = tile_gemm(i, &*copy, decoded, &[("ws", "c")], &epilogue);
    let origin = format!(
        "{origin}: MoE experts' down projections to rows of {hidden} on tensor cores (mma.sync m16n8k16 bf16, \
         each expert's pairs' bf16 hidden units gathered into {TILE_M}-row tiles by cp.async), {} weights{}, {}",
        format.describe(),
        staging(format),
        describe(spec)
    );
    expert_tile_kernel((name, origin), down_tile_params(format), (spec, d), &["ws"], work)
}
