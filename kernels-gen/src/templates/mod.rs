//! Templates: DSL kernels for the fused IR's ops, parameterised by shape and dtype. Each file
//! holds one op family with its launch shape and the reasoning behind it.

pub mod attention;
pub mod attention_vector;
pub mod bf16_rows;
pub mod cache_layout;
pub mod delta_chunks;
pub mod delta_net;
pub mod elementwise;
pub mod embedding;
pub mod fill;
pub mod flash_attention;
pub mod flash_attention_tcgen05;
pub mod flash_attention_wgmma;
pub mod flash_tma;
pub mod gather;
pub mod gemm_mma;
pub mod gemm_tcgen05;
pub mod gemm_tma_mma;
pub mod gemm_tma_tcgen05;
pub mod gemm_tma_wgmma;
pub mod gemm_wgmma;
pub mod gemv;
pub mod glu;
pub mod halves;
pub mod int8_head;
pub mod kv_append;
pub mod mma_operands;
pub mod moe;
pub mod moe_mma;
pub mod moe_tcgen05;
pub mod moe_wgmma;
pub mod prologue_norms;
pub mod quant;
pub mod rms_norm;
pub mod rope;
pub mod sample;
pub mod shortlist;
pub mod sparse_mla;
pub mod split_k;
pub mod step_gate;
pub mod tma_gemm;
pub mod top_k;
pub mod top_k_sort;
pub mod weight_convert;
pub mod weight_prefetch;

use crate::dsl::*;

/// The prefill GEMM for CUDA architecture `arch`, weights stored as `weights`, reduction
/// width `k`; `None` for f32 weights, which keep the f32 GEMV (tensor cores would round them).
/// IEEE half weights take `mma.sync` through registers, rounded to bf16 in the tile.
///
/// bf16 weights, what each target gets, and why:
/// - **sm_90a (H100/H200)**: `wgmma` fed by a `cp.async` pipeline (`gemm_wgmma`). `mma.sync`
///   reaches only part of Hopper's tensor-core peak; `wgmma` is the instruction that reaches
///   it, reading B straight from shared memory. It needs `k` to be a multiple of 8 (16-byte
///   copies inside one row), as every model dimension is; other shapes keep `mma.sync`.
/// - **sm_100a (B200)**: `tcgen05.mma` (`gemm_tcgen05`), under the same condition on `k`.
///   Blackwell dropped `wgmma`; `tcgen05` is where its tensor-core throughput is (128-row
///   MMAs issued by one thread, accumulators in tensor memory, registers free for the
///   epilogue), so it pays for every prefill GEMM. Decode stays a GEMV: one token a step
///   reads each weight once whatever the instruction, and memory bandwidth bounds it.
/// - **sm_120a (RTX PRO 6000)**: `mma.sync` (`gemm_mma`): consumer Blackwell has neither
///   `wgmma` nor `tcgen05`; `mma.sync` is its tensor-core instruction. Its weights come
///   through the `cp.async` pipeline when `k` allows, through registers otherwise (as on the
///   other targets when `k` is not a multiple of 8).
///
/// GGUF blocks, every target: `mma.sync` with the blocks decoded into its shared-memory tile
/// (`WeightStaging::Dequantize`); each weight is decoded once per 64 tokens instead of once
/// per 4 as in the prefill GEMV. The wgmma/tcgen05 kernels take their weights by `cp.async`,
/// which copies bytes and cannot decode. (Plans prefilling through the TMA GEMMs take its
/// form over rows made bf16 before it, `gemm_mma::gemm_mma_after_rows`, which also takes a
/// GLU over blocks, for steps of up to a decode batch's rows and for matrices too large to
/// copy; larger steps decode the blocks into a bf16 copy for the TMA GEMM:
/// `weight_convert::to_bf16_for_prefill`, `tma_gemm::over_converted_weights`.)
///
/// Every one of them takes an RMSNorm prologue (`rms_norm_matmul`, `add_rms_norm_matmul`) and
/// a GLU epilogue over dense weights, and splits K at few rows (`split_k`). A GLU epilogue over
/// GGUF blocks with the prologue inside has no kernel here (the decode GEMV's pairs a gate row
/// and an up row of dense weights): `None`.
pub fn prefill_gemm(
    arch: &str,
    weights: quant::WeightFormat,
    k: usize,
    norm: Option<gemv::NormPrologue>,
    glu: Option<ir::GluAct>,
    name: &str,
    origin: &str,
) -> Option<PrefillGemm> {
    use gemm_mma::WeightStaging;
    use quant::WeightFormat;
    let mma = |staging| {
        (
            gemm_mma::gemm_mma_with(name, origin, staging, norm, glu),
            gemm_mma::TILES,
        )
    };
    let (kernel, tiles) = match (weights, arch) {
        (WeightFormat::Dense(Ty::Bf16), "sm_90a") if k.is_multiple_of(8) => (
            gemm_wgmma::gemm_wgmma_bf16_with(name, origin, norm, glu),
            gemm_wgmma::TILES,
        ),
        (WeightFormat::Dense(Ty::Bf16), "sm_100a") if k.is_multiple_of(8) => (
            gemm_tcgen05::gemm_tcgen05_bf16_with(name, origin, norm, glu),
            gemm_tcgen05::TILES,
        ),
        (WeightFormat::Dense(Ty::Bf16), _) if k.is_multiple_of(8) => mma(WeightStaging::CpAsync),
        (WeightFormat::Dense(Ty::Bf16), _) => mma(WeightStaging::Registers),
        // `cp.async` copies bytes: it cannot convert half weights.
        (WeightFormat::Dense(Ty::F16), _) => mma(WeightStaging::HalfWeights),
        (WeightFormat::Blocks(format), _) if glu.is_none() => mma(WeightStaging::Dequantize(format)),
        _ => return None,
    };
    Some(PrefillGemm {
        kernel,
        tiles,
        gates: false,
    })
}

/// Whether architecture `arch` has a TMA-fed GEMM ([`tma_prefill_gemm`]).
pub fn has_tma_gemm(arch: &str) -> bool {
    matches!(arch, "sm_90a" | "sm_100a" | "sm_120a")
}

/// The target's TMA-fed GEMM as a plan launches it for a bf16 matmul of form `(norm, glu)`,
/// after the `bf16_rows` launch making its rows (`tma_gemm::prologued_params`), with its
/// tiles: Hopper's `wgmma` and the B200's `tcgen05` on `schedule`, the RTX PRO 6000's
/// `mma.sync` (which has one); none on other architectures.
pub fn tma_prefill_gemm(
    arch: &str,
    (norm, glu): (Option<gemv::NormPrologue>, Option<ir::GluAct>),
    schedule: TmaSchedule,
    name: &str,
    origin: &str,
) -> Option<PrefillGemm> {
    let (kernel, tiles) = match arch {
        "sm_90a" => {
            let tile = gemm_tma_wgmma::TmaTile::WIDE.scheduled(schedule);
            let kernel = gemm_tma_wgmma::gemm_tma_wgmma_bf16_prologued(name, origin, tile, norm, glu);
            (kernel, tile.tiles())
        }
        "sm_100a" => {
            let tile = gemm_tma_tcgen05::TcgenTile::WIDE.scheduled(schedule);
            let kernel = gemm_tma_tcgen05::gemm_tma_tcgen05_bf16_prologued(name, origin, tile, norm, glu);
            (kernel, tile.tiles())
        }
        "sm_120a" => (
            gemm_tma_mma::gemm_tma_mma_bf16_prologued(name, origin, norm, glu),
            gemm_tma_mma::TILES,
        ),
        _ => return None,
    };
    // Hopper's and the B200's gate a GLU's products themselves (a tile's weights half gates,
    // half the same outputs' ups).
    let gates = matches!(arch, "sm_90a" | "sm_100a") && glu.is_some();
    Some(PrefillGemm { kernel, tiles, gates })
}

/// The TMA GEMM for a decode batch of up to `tokens` rows (16, 32 or 64), a plan's
/// alternative to [`tma_prefill_gemm`]'s for such steps, on `schedule`, the same result form
/// and weight tiles (so the same K splits at those rows: one token tile either way): on Hopper
/// the weights as `wgmma`'s M and the tokens its N, on the B200 `tcgen05` tiles of `tokens`
/// (its weights are M already). None on the RTX PRO 6000, whose TMA GEMM takes few rows as it
/// is.
pub fn tma_batch_gemm(
    arch: &str,
    (norm, glu): (Option<gemv::NormPrologue>, Option<ir::GluAct>),
    schedule: TmaSchedule,
    tokens: u32,
    (name, origin): (&str, &str),
) -> Option<Kernel> {
    match arch {
        "sm_90a" => {
            let tile = gemm_tma_wgmma::TmaTile::batch(tokens).scheduled(schedule);
            Some(gemm_tma_wgmma::gemm_tma_wgmma_bf16_prologued(
                name, origin, tile, norm, glu,
            ))
        }
        "sm_100a" => {
            let tile = gemm_tma_tcgen05::TcgenTile::batch(tokens).scheduled(schedule);
            Some(gemm_tma_tcgen05::gemm_tma_tcgen05_bf16_prologued(
                name, origin, tile, norm, glu,
            ))
        }
        _ => None,
    }
}

/// How a TMA GEMM's warps share its work, where the target's GEMM has the forms (Hopper's and
/// the B200's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TmaSchedule {
    /// A block a tile, its ring refilled by one thread (after a block barrier on Hopper).
    BlockDriven,
    /// A block a tile, warp-specialised: a producer warp refills the ring as the tensor cores
    /// release it.
    Specialised,
    /// Warp-specialised, at most `blocks` blocks (the GPU's multiprocessors) each taking tiles
    /// in turn.
    Persistent { blocks: u32 },
}

impl TmaSchedule {
    /// Whether `arch`'s TMA GEMM takes this schedule as asked, rather than its one form.
    pub fn has_forms(arch: &str) -> bool {
        matches!(arch, "sm_90a" | "sm_100a")
    }
}

/// A prefill GEMM and its tiles (tokens, weight rows, K step), which its K splits are
/// counted in (`split_k::splits_expr`).
#[derive(Debug, Clone)]
pub struct PrefillGemm {
    pub kernel: Kernel,
    pub tiles: (usize, usize, usize),
    /// Whether, with one K split, it applies its GLU epilogue itself (the reduction after it
    /// then `split_k::reduce_after_gating`, launching no blocks), rather than leaving every
    /// product to the reduction in the partials.
    pub gates: bool,
}

/// The parameters of every prefill GEMM, in the order of the plain GEMV's (whose launch
/// arguments a GEMM takes over for prefill steps): activations `x` (rows `x_stride` apart),
/// weights `w` stored as `weights`, the f32 output, and the shape.
pub fn gemm_params(weights: Ty) -> Vec<Param> {
    vec![
        buffer("x", Ty::F32, false),
        buffer("w", weights, false),
        buffer("out", Ty::F32, true),
        scalar("tokens", Ty::I32),
        scalar("n", Ty::I32),
        scalar("k", Ty::I32),
        scalar("x_stride", Ty::I32),
    ]
}

/// A prefill GEMM's parameters under a norm prologue (`norm`; none: [`gemm_params`]'s):
/// [`gemm_params`]'s with the prologue's `b` and `g` after `x` and `b_stride` last (the order
/// of the prologue GEMV's, whose arguments the GEMM takes over).
pub fn prologue_gemm_params(norm: Option<gemv::NormPrologue>, weights: Ty) -> Vec<Param> {
    let mut params = gemm_params(weights);
    params.splice(0..1, gemv::prologue_params(norm));
    if gemv::residual(norm) {
        params.push(scalar("b_stride", Ty::I32));
    }
    params
}

/// The f32 locals element (`row`, `col`) of a prologue GEMM's multiplicand passes through
/// before its bf16 rounding ([`prologue_loads`], then [`prologue_arithmetic`]): `x` into
/// `value`, where the element ends (`x`, or under a norm prologue `x` (+ `b`) times the norm
/// weight); `b` into `addend` under a residual prologue; the norm weight into `weight` under a
/// norm prologue.
pub struct PrologueLocals {
    pub value: String,
    pub addend: String,
    pub weight: String,
}

impl PrologueLocals {
    /// The declarations of the locals [`prologue_loads`] fills besides `value` (which the
    /// caller keeps where it likes): `addend` under a residual prologue, `weight` under a norm
    /// prologue where `with_weight`.
    pub fn declare_inputs(&self, norm: Option<gemv::NormPrologue>, with_weight: bool) -> Vec<Stmt> {
        let mut out = Vec::new();
        if gemv::residual(norm) {
            out.push(let_(&self.addend, Ty::F32, f(0.0)));
        }
        if norm.is_some() && with_weight {
            out.push(let_(&self.weight, Ty::F32, f(0.0)));
        }
        out
    }
}

/// The loads of a prologue element alone, into its `locals` (the norm weight's where
/// `with_weight`: elements of one column may share it). Kept apart from the arithmetic so that
/// a thread issues a step's loads together before it waits on any: with the arithmetic and the
/// residual's store between them, Hopper's GEMM took 9.7 µs a K step at 16 rows on the fourth
/// H200 run, the plain one 2.25 (as if each element's loads waited for the previous element's
/// store: some 32 round trips to L2), 3.4–4.3 times the plain GEMM's time.
pub fn prologue_loads(
    norm: Option<gemv::NormPrologue>,
    (row, col): (Expr, Expr),
    locals: &PrologueLocals,
    with_weight: bool,
) -> Vec<Stmt> {
    let mut out = vec![assign(
        &locals.value,
        load("x", row.clone() * var("x_stride") + col.clone()),
    )];
    if gemv::residual(norm) {
        out.push(assign(&locals.addend, load("b", row * var("b_stride") + col.clone())));
    }
    if norm.is_some() && with_weight {
        out.push(assign(&locals.weight, load("g", col)));
    }
    out
}

/// The arithmetic of a prologue element on what [`prologue_loads`] loaded: the residual's sum
/// (which the blocks of the first weight tile also write to `out`, `[sum | product]` rows, each
/// element once), its square handed to `add_square` (the statement that adds it to the row's
/// sum: the row's `1/rms` scales the result, `prologue_norms`), then the norm weight.
pub fn prologue_arithmetic(
    norm: Option<gemv::NormPrologue>,
    glu: Option<ir::GluAct>,
    (row, col): (Expr, Expr),
    locals: &PrologueLocals,
    add_square: &dyn Fn(Expr) -> Stmt,
) -> Vec<Stmt> {
    let value = locals.value.as_str();
    let mut out = Vec::new();
    if gemv::residual(norm) {
        out.push(assign(value, var(value) + var(&locals.addend)));
        let sum_at = row * gemv::out_row_len(norm, glu) + col;
        out.push(if_(eq(var("n0"), int(0)), vec![store("out", sum_at, var(value))]));
    }
    if let Some(n) = norm {
        out.push(add_square(var(value) * var(value)));
        out.push(assign(value, var(value) * (var(&locals.weight) + f(n.offset))));
    }
    out
}

/// A prologue GEMM's 64×32 activation slice at `k0` staged by `threads` threads, `passes`
/// elements each (element `e = tid + threads·i` is token `m0 + e / 32`, column `k0 + e % 32`;
/// zero past `tokens` and `k`), [`PASSES_LOADED_TOGETHER`] passes at a time: their elements'
/// loads first (the norm weight once, in the first pass: a thread's elements share their
/// column, and its first token is inside `tokens` where any is), then their arithmetic, each
/// element's square added to `row_squares[e]` (`prologue_norms::staged_arrays`), and
/// `place((e / 32, e % 32), value)` putting it into the tile at its token and column. What
/// `gemm_mma` and `gemm_tcgen05` stage under a norm prologue: a loop of one element a pass
/// waits for each element's loads in turn (see [`prologue_loads`]).
pub fn stage_prologue_slice(
    norm: gemv::NormPrologue,
    glu: Option<ir::GluAct>,
    (threads, passes): (i64, i64),
    place: &dyn Fn((Expr, Expr), &str) -> Stmt,
) -> Vec<Stmt> {
    let element = |i: i64| tid() + int(threads * i);
    let in_tile = |i: i64| (element(i) / int(32), rem(element(i), int(32)));
    let at = |i: i64| {
        let (token, column) = in_tile(i);
        (var("m0") + token, var("k0") + column)
    };
    let valid = |i: i64| {
        let (row, col) = at(i);
        and(lt(row, var("tokens")), lt(col, var("k")))
    };
    let locals = |i: i64| PrologueLocals {
        value: format!("x{i}"),
        addend: format!("x{i}_b"),
        weight: "x_g".into(),
    };
    let mut out = Vec::new();
    for first in (0..passes).step_by(PASSES_LOADED_TOGETHER as usize) {
        let mut finished = Vec::new();
        for i in first..passes.min(first + PASSES_LOADED_TOGETHER) {
            let l = locals(i);
            out.push(let_(&l.value, Ty::F32, f(0.0)));
            out.extend(l.declare_inputs(Some(norm), i == 0));
            out.push(if_(valid(i), prologue_loads(Some(norm), at(i), &l, i == 0)));
            let add_square = |square: Expr| prologue_norms::add_staged_square(element(i), square);
            finished.push(if_(
                valid(i),
                prologue_arithmetic(Some(norm), glu, at(i), &l, &add_square),
            ));
            finished.push(place(in_tile(i), &l.value));
        }
        out.extend(finished);
    }
    out
}

/// Passes of [`stage_prologue_slice`] whose loads go out together: two round trips to L2 a
/// 16-pass slice where there were 16. ptxas gives the same registers for 4 or 8 (119–126 on
/// sm_100a and sm_120a, from 76–112; `mma.sync`'s GLU form on sm_90a 222, where only shapes
/// `wgmma` cannot take run it).
const PASSES_LOADED_TOGETHER: i64 = 8;

/// A prefill GEMM's result element (`token`, weight row `row`) where it lies inside the result
/// (`token < tokens`, `row < n`): into `out` (after the sum under a residual prologue), or with
/// several K splits, or a GLU epilogue (which the reduction applies), into this split's partial
/// tile (`split_k::store_result`).
pub fn store_gemm_result(
    norm: Option<gemv::NormPrologue>,
    glu: Option<ir::GluAct>,
    token: Expr,
    row: Expr,
    value: Expr,
) -> Stmt {
    if_(
        and(lt(token.clone(), var("tokens")), lt(row.clone(), var("n"))),
        vec![split_k::store_result(
            token.clone(),
            row.clone(),
            value,
            glu.is_none().then(|| gemv::out_index(norm, glu, token, row)),
        )],
    )
}

/// The copies of a `stages`-buffer `cp.async` pipeline over K (steps `tile_k` wide from
/// `begin`, up to `end`) before its first step: those of the first `stages - 1` steps
/// (`copy(buffer, k0)`), each committed as a group (an empty one past the end), the first
/// always (a K split past the end of K zero-fills it).
pub fn pipeline_prologue(
    stages: i64,
    tile_k: i64,
    (begin, end): (Expr, Expr),
    copy: impl Fn(Expr, Expr) -> Vec<Stmt>,
) -> Vec<Stmt> {
    let mut out = copy(rem(begin.clone() / int(tile_k), int(stages)), begin.clone());
    out.push(Stmt::CpAsyncCommit);
    for j in 1..stages - 1 {
        let k0 = begin.clone() + int(j * tile_k);
        out.push(if_(
            lt(k0.clone(), end.clone()),
            copy(rem(k0.clone() / int(tile_k), int(stages)), k0),
        ));
        out.push(Stmt::CpAsyncCommit);
    }
    out
}

/// The head of one step of a `stages`-buffer `cp.async` pipeline over K (steps `tile_k` wide
/// at `k0`, up to `end`; [`pipeline_prologue`] issued the first): `s`, the buffer this step
/// reads, and the copies of the step `stages - 1` ahead (`copy(buffer, k0)`) issued into the
/// buffer the step before read, committed as one group — an empty group past the end, so that
/// waiting for all groups but the `stages - 1` newest always means waiting for this step's
/// copies. The buffer refilled here was last read by the previous step: each step ends at a
/// barrier.
pub fn pipeline_step_head(stages: i64, tile_k: i64, end: Expr, copy: impl Fn(Expr, Expr) -> Vec<Stmt>) -> Vec<Stmt> {
    let ahead = var("k0") + int((stages - 1) * tile_k);
    vec![
        let_("s", Ty::I32, rem(var("k0") / int(tile_k), int(stages))),
        if_(
            lt(ahead.clone(), end),
            copy(rem(ahead.clone() / int(tile_k), int(stages)), ahead),
        ),
        Stmt::CpAsyncCommit,
    ]
}

/// The wait a step of a `stages`-buffer pipeline makes before it reads its buffer: every copy
/// group but the `stages - 1` newest landed ([`pipeline_step_head`] commits one a step).
pub fn pipeline_wait(stages: i64) -> Stmt {
    Stmt::CpAsyncWait((stages - 1) as u32)
}

/// Threads per block for the row-parallel kernels: 8 warps.
pub const BLOCK: u32 = 256;

/// `ceil(n / d)` as a grid expression over a scalar parameter.
pub fn blocks_for(n: Expr, per_block: i64) -> Expr {
    (n + int(per_block - 1)) / int(per_block)
}

/// A loop of `index` from `start` while below `end`, `count` elements a step `stride` apart
/// (the `u`-th at `index + u·stride`): each step loads every element below `end` before it
/// merges any (`loads(u, at)`: f32 locals and their values, declared 0 past `end`), then runs
/// `merge(u, at)` for each of them in order, so the elements meet the merge in a plain loop's
/// order. What keeps several loads in flight a thread where a loop of one load a step waits on
/// each in turn (a top-k row, attention's partials).
pub fn loads_in_flight(
    index: &str,
    (start, end): (Expr, Expr),
    stride: Expr,
    count: i64,
    loads: &dyn Fn(i64, Expr) -> Vec<(String, Expr)>,
    merge: &dyn Fn(i64, Expr) -> Vec<Stmt>,
) -> Stmt {
    let at = |u: i64| match (u, &stride) {
        (0, _) => var(index),
        (_, Expr::Int(s)) => var(index) + int(s * u),
        (_, stride) => var(index) + stride.clone() * int(u),
    };
    // The loop's bound keeps the first element below `end`.
    let below_end = |u: i64, body: Vec<Stmt>| match u {
        0 => body,
        _ => vec![if_(lt(at(u), end.clone()), body)],
    };
    let mut step = Vec::new();
    for u in 0..count {
        let values = loads(u, at(u));
        if u == 0 {
            step.extend(values.into_iter().map(|(name, value)| let_(&name, Ty::F32, value)));
            continue;
        }
        step.extend(values.iter().map(|(name, _)| let_(name, Ty::F32, f(0.0))));
        let assigned = values.into_iter().map(|(name, value)| assign(&name, value)).collect();
        step.extend(below_end(u, assigned));
    }
    // The first merge in the step's scope, each later one in its own: locals a merge declares
    // are named by `u` (the type checker refuses shadowing).
    for u in 0..count {
        step.extend(below_end(u, merge(u, at(u))));
    }
    let step_size = match &stride {
        Expr::Int(s) => int(s * count),
        stride => stride.clone() * int(count),
    };
    for_(index, start, end, step_size, step)
}

/// A thread per element: `i` is the thread's index in the grid, and `body` runs where
/// `i < count` (the grid is `blocks_for(count, BLOCK)`).
pub fn per_element(count: Expr, body: Vec<Stmt>) -> Vec<Stmt> {
    vec![
        let_("i", Ty::I32, bid() * bdim() + tid()),
        if_(lt(var("i"), count), body),
    ]
}

/// A thread per element of `count` in rows of the scalar parameter `width`: `i` is the
/// element, `t` its row and `j` its column (see [`per_element`]).
pub fn per_row_element(count: Expr, body: Vec<Stmt>) -> Vec<Stmt> {
    let mut located = vec![
        let_("t", Ty::I32, var("i") / var("width")),
        let_("j", Ty::I32, rem(var("i"), var("width"))),
    ];
    located.extend(body);
    per_element(count, located)
}

/// Weights a lane reads at once along a row of `k`: 16 bytes of dense weights where every row
/// starts 16-byte aligned (`k` a multiple of the vector), else one (GGUF blocks dequantized
/// element by element, or ragged rows).
pub fn weight_vector(weights: quant::WeightFormat, k: usize) -> usize {
    match weights {
        quant::WeightFormat::Dense(ty) if k.is_multiple_of(16 / ty.bytes()) => 16 / ty.bytes(),
        _ => 1,
    }
}

/// A warp's dot products of `x(c)` with each of `rows` (weight rows of `k`, in buffer `w`) into
/// the named sums, lanes striding along the rows `vector` elements at a time, each weight
/// vector one load.
pub fn warp_dot_rows(weights: quant::WeightFormat, k: usize, rows: &[(Expr, &str)], x: &dyn Fn(Expr) -> Expr) -> Stmt {
    let v = weight_vector(weights, k);
    let mut body = Vec::new();
    let xs: Vec<String> = (0..v).map(|j| format!("x{j}")).collect();
    for (j, name) in xs.iter().enumerate() {
        body.push(let_(name, Ty::F32, x(var("c") + int(j as i64))));
    }
    for (r, (row, sum)) in rows.iter().enumerate() {
        let w: Vec<String> = (0..v).map(|j| format!("w{r}_{j}")).collect();
        match v {
            1 => body.extend(weights.element(&w[0], row.clone(), int(k as i64), var("c"))),
            _ => body.push(load_vec("w", row.clone() * int(k as i64) + var("c"), &w)),
        }
        for (wj, xj) in w.iter().zip(&xs) {
            body.push(assign(sum, var(sum) + var(xj) * var(wj)));
        }
    }
    let v = v as i64;
    for_("c", lane() * int(v), int(k as i64), int(32 * v), body)
}

/// Sum `value` (an f32 local) across a warp with butterfly shuffles; every lane ends with it.
pub fn warp_sum(value: &str) -> Vec<Stmt> {
    [16, 8, 4, 2, 1]
        .iter()
        .map(|&m| assign(value, var(value) + shfl_xor(var(value), m)))
        .collect()
}

/// A warp's dot product of activations `h` (from element `x` on, where given) with row `r` of
/// the `k`-wide matrix `w` stored as `weight`: `acc` declared, lanes striding along the row,
/// then summed across the warp, as the GEMV sums a row (every lane ends with it).
pub fn warp_row_dot(weight: quant::WeightFormat, r: Expr, x: Option<Expr>) -> Vec<Stmt> {
    let h = |i: Expr| match &x {
        Some(x) => load("h", x.clone() + i),
        None => load("h", i),
    };
    [
        vec![let_("acc", Ty::F32, f(0.0))],
        vec![for_(
            "i",
            lane(),
            var("k"),
            int(32),
            [
                weight.element("wi", r, var("k"), var("i")),
                vec![assign("acc", var("acc") + h(var("i")) * var("wi"))],
            ]
            .concat(),
        )],
        warp_sum("acc"),
    ]
    .concat()
}

/// Sum `value` across the whole block: per-warp sums through `scratch` (one slot per warp),
/// then the first warp sums those; every thread ends with the total in `value`.
pub fn block_sum(value: &str, scratch: &str, warps: u32) -> Vec<Stmt> {
    let mut s = warp_sum(value);
    s.push(if_(
        bin(BinOp::Eq, lane(), int(0)),
        vec![store(scratch, warp(), var(value))],
    ));
    s.push(Stmt::SyncThreads);
    s.push(assign(value, f(0.0)));
    s.push(for_(
        "other",
        int(0),
        int(warps as i64),
        int(1),
        vec![assign(value, var(value) + load(scratch, var("other")))],
    ));
    s.push(Stmt::SyncThreads);
    s
}

/// Shared scratch of one f32 per warp.
pub fn warp_scratch(name: &str, warps: u32) -> SharedArray {
    SharedArray {
        name: name.into(),
        ty: Ty::F32,
        len: warps as usize,
    }
}

/// The block formats the GPU templates read: GGUF's, and the blocks FP8, integer and FP4
/// checkpoints' weights are held in.
pub const QUANT_FORMATS: [ir::DType; 17] = [
    ir::DType::Q4_0,
    ir::DType::Q4_1,
    ir::DType::Q5_0,
    ir::DType::Q5_1,
    ir::DType::Q8_0,
    ir::DType::Q2K,
    ir::DType::Q3K,
    ir::DType::Q4K,
    ir::DType::Q5K,
    ir::DType::Q6K,
    ir::DType::IQ4NL,
    ir::DType::IQ4XS,
    ir::DType::MXFP4,
    ir::DType::F8E4M3B32,
    ir::DType::U4B32,
    ir::DType::U4B128,
    ir::DType::F4E2M1B32,
];

/// Qwen3.5-27B's Gated DeltaNet layers (16 key heads, 48 value heads, heads of 128).
const QWEN3_5_DELTA_NET: ir::DeltaNetSpec = ir::DeltaNetSpec {
    key_heads: 16,
    value_heads: 48,
    key_dim: 128,
    value_dim: 128,
    conv_kernel: 4,
    state_slot: 0,
    value_head_order: ir::ValueHeadOrder::Grouped,
    decay_rate: ir::DecayRate::Log,
};

/// GLM-4.5-Air's MoE layers.
const GLM_4_5_AIR_MOE: ir::MoeSpec = ir::MoeSpec {
    experts: 128,
    experts_per_token: 8,
    normalize: true,
    intermediate: 1408,
    act: ir::GluAct::Silu,
    router: ir::MoeRouter::GroupedSigmoid {
        groups: 1,
        top_groups: 1,
        scaling: 1.0,
    },
};

/// GLM-5's latent attention: 64 heads of 192 + 64 (values 256) from latents of 512, an indexer
/// of 32 heads of 128 keeping 2048 positions.
const GLM5_MLA: ir::SparseMlaSpec = ir::SparseMlaSpec {
    heads: 64,
    nope_dim: 192,
    rope_dim: 64,
    value_dim: 256,
    latent_dim: 512,
    scale: 0.0625,
    index_heads: 32,
    index_dim: 128,
    index_topk: 2048,
    cache_slot: 0,
    index_slot: 0,
};

/// One instance of every template, as the code generator would emit them: what snapshot tests,
/// NVRTC checks and the kernel report cover.
pub fn catalog() -> Vec<Kernel> {
    use gemv::GemvSpec;
    use ir::{Expr as E, GluAct, RopeLayout};
    use quant::WeightFormat::{Blocks, Dense};
    let swiglu_expr = E::Mul(Box::new(E::Silu(Box::new(E::Input(0)))), Box::new(E::Input(1)));
    vec![
        elementwise::elementwise("elementwise_silu_mul", "catalog", &swiglu_expr),
        rms_norm::rms_norm("rms_norm", "catalog", 1e-5, 0.0),
        rms_norm::add_rms_norm("add_rms_norm", "catalog", 1e-6, 1.0),
        gemv::gemv("gemv_f32", "catalog", GemvSpec::decode(Dense(Ty::F32), 4096)),
        gemv::gemv("gemv_bf16", "catalog", GemvSpec::decode(Dense(Ty::Bf16), 4096)),
        gemv::gemv(
            "gemv_bf16_prefill",
            "catalog",
            GemvSpec::decode(Dense(Ty::Bf16), 4096).prefill(),
        ),
        gemv::gemv("gemv_bf16_ragged", "catalog", GemvSpec::decode(Dense(Ty::Bf16), 4095)),
        // What plans use where the activation's rows are 16-byte aligned (nearly always).
        gemv::gemv(
            "gemv_bf16_x_vectors",
            "catalog",
            GemvSpec::decode(Dense(Ty::Bf16), 4096).with_x_vectors(),
        ),
        // An f32 model's decode GEMV: ptxas spills it on sm_100a unless asked for an occupancy.
        gemv::gemv(
            "gemv_f32_x_vectors",
            "catalog",
            GemvSpec::decode(Dense(Ty::F32), 4096).with_x_vectors(),
        ),
        gemv::gemv(
            "gemv_bf16_x_vectors_prefill",
            "catalog",
            GemvSpec::decode(Dense(Ty::Bf16), 4096).with_x_vectors().prefill(),
        ),
        // Weight rows sharing each activation load: two in decode, four at four tokens a pass.
        gemv::gemv(
            "gemv_bf16_x_vectors_rows2",
            "catalog",
            GemvSpec::decode(Dense(Ty::Bf16), 4096)
                .with_x_vectors()
                .with_rows_per_warp(2),
        ),
        gemv::gemv(
            "gemv_bf16_x_vectors_prefill_rows4",
            "catalog",
            GemvSpec::decode(Dense(Ty::Bf16), 4096)
                .with_x_vectors()
                .prefill()
                .with_rows_per_warp(4),
        ),
        gemv::gemv(
            "gemv_q4_k_x_vectors",
            "catalog",
            GemvSpec::decode(Blocks(ir::DType::Q4K), 4096).with_x_vectors(),
        ),
        glu::glu("swiglu", "catalog", GluAct::Silu),
        glu::glu("geglu", "catalog", GluAct::GeluTanh),
        rope::rope(
            "rope_rotate_half",
            "catalog",
            rope::Rotation::plain(RopeLayout::RotateHalf),
        ),
        rope::rope(
            "rope_adjacent_pairs",
            "catalog",
            rope::Rotation::plain(RopeLayout::AdjacentPairs),
        ),
        embedding::embedding("embedding_bf16", "catalog", Dense(Ty::Bf16)),
        top_k::top_k("top_k", "catalog"),
        top_k_sort::chunks("top_k_chunks", "catalog", top_k_sort::CHUNK),
        top_k_sort::merge("top_k_merge", "catalog", top_k_sort::MERGE),
        gather::gather_rows("gather_rows", "catalog"),
        fill::fill_uniform("fill_uniform_bf16", "catalog", Ty::Bf16),
        fill::fill_uniform("fill_uniform_fp8", "catalog", Ty::F8E4M3),
        sample::sample("sample", "catalog"),
        int8_head::quantize_h("int8_quantize_h", "catalog"),
        int8_head::score("int8_score", "catalog"),
        int8_head::max_reduce("max_reduce", "catalog"),
        int8_head::rescore(
            "int8_rescore_bf16",
            "catalog",
            quant::WeightFormat::Dense(Ty::Bf16),
            None,
        ),
        // Gemma's: the logits soft-capped at 30.
        int8_head::rescore(
            "int8_rescore_bf16_soft_capped",
            "catalog",
            quant::WeightFormat::Dense(Ty::Bf16),
            Some(30.0),
        ),
        // Gemma 3's shape: the most registers a block of grouped heads takes (4 × 8 per lane).
        attention::attention_split(
            "attention",
            "catalog",
            cache_layout::CacheLayout::Contiguous,
            256,
            4,
            Ty::F32,
        ),
        attention::attention_combine("attention_combine", "catalog", 128),
        // Gemma 4's global layers: heads of 512, one a block.
        attention::attention_split(
            "attention_batched_512",
            "catalog",
            cache_layout::CacheLayout::Batched,
            512,
            1,
            Ty::Bf16,
        ),
        attention::attention_combine("attention_combine_512", "catalog", 512),
        // GLM-5's latent attention and sparse indexer, as serving runs them.
        sparse_mla::per_head_gemv("mla_absorb", "catalog", 64, 512, 192, Dense(Ty::Bf16)),
        sparse_mla::mla_append("mla_append", "catalog", cache_layout::CacheLayout::Batched, &GLM5_MLA),
        sparse_mla::index_scores("index_scores", "catalog", cache_layout::CacheLayout::Batched, &GLM5_MLA),
        sparse_mla::index_select("index_select", "catalog", cache_layout::CacheLayout::Batched, &GLM5_MLA),
        sparse_mla::sparse_mla_split("sparse_mla", "catalog", cache_layout::CacheLayout::Batched, &GLM5_MLA),
        sparse_mla::per_head_gemv("mla_expand", "catalog", 64, 256, 512, Dense(Ty::Bf16)),
        rms_norm::unit_rms_norm("unit_rms_norm", "catalog", 1e-6),
        rms_norm::layer_norm("layer_norm", "catalog", 1e-6),
        kv_append::kv_append("kv_append", "catalog"),
        attention::attention_split(
            "attention_paged",
            "catalog",
            cache_layout::CacheLayout::Paged,
            64,
            3,
            Ty::F32,
        ),
        kv_append::kv_append_with("kv_append_paged", "catalog", cache_layout::CacheLayout::Paged, Ty::F32),
        // A bf16 model's serving plan: its cache holds bf16.
        attention::attention_split(
            "attention_batched",
            "catalog",
            cache_layout::CacheLayout::Batched,
            80,
            2,
            Ty::Bf16,
        ),
        // As a serving plan's few-row steps run it: prefetching the output projection's
        // weights into L2.
        weight_prefetch::prefetching_next_weights(attention::attention_split(
            "attention_batched_prefetching",
            "catalog",
            cache_layout::CacheLayout::Batched,
            128,
            4,
            Ty::Bf16,
        )),
        // The same with 16-byte loads, several keys a warp (Llama 3 8B's heads).
        weight_prefetch::prefetching_next_weights(attention_vector::attention_split_vector(
            "attention_vector_batched_prefetching",
            "catalog",
            cache_layout::CacheLayout::Batched,
            128,
            4,
            Ty::Bf16,
        )),
        // Gemma 4's global heads of 512: two 16-byte loads a lane per row, a key a lane.
        attention_vector::attention_split_vector(
            "attention_vector_batched_512",
            "catalog",
            cache_layout::CacheLayout::Batched,
            512,
            2,
            Ty::Bf16,
        ),
        // An f32 cache (an f32 model's plan), Gemma 3's heads of 256.
        attention_vector::attention_split_vector(
            "attention_vector_256",
            "catalog",
            cache_layout::CacheLayout::Contiguous,
            256,
            4,
            Ty::F32,
        ),
        kv_append::kv_append_with(
            "kv_append_batched",
            "catalog",
            cache_layout::CacheLayout::Batched,
            Ty::Bf16,
        ),
        kv_append::rope_kv_append(
            "rope_kv_append_batched",
            "catalog",
            cache_layout::CacheLayout::Batched,
            Ty::Bf16,
            rope::Rotation::plain(RopeLayout::RotateHalf),
        ),
        // An FP8 cache (`--kv-cache-dtype fp8`): 16 codes a load, a row of 128 across 8 lanes,
        // and its appends rounding to FP8.
        attention_vector::attention_split_vector(
            "attention_vector_batched_fp8",
            "catalog",
            cache_layout::CacheLayout::Batched,
            128,
            2,
            Ty::F8E4M3,
        ),
        kv_append::rope_kv_append(
            "rope_kv_append_batched_fp8",
            "catalog",
            cache_layout::CacheLayout::Batched,
            Ty::F8E4M3,
            rope::Rotation::plain(RopeLayout::RotateHalf),
        ),
        gather::gather_column_groups("gather_column_groups", "catalog"),
        gather::concat_columns("concat_columns", "catalog"),
        gather::gather_columns("gather_columns", "catalog"),
        // A drafter's 4-bit shortlist rescored against a bf16 head.
        shortlist::rescore(
            "shortlist_rescore_bf16",
            "catalog",
            quant::WeightFormat::Dense(Ty::Bf16),
        ),
        shortlist::best("shortlist_best", "catalog"),
        // Qwen3.5-27B's linear-attention layers in a bf16 serving plan.
        delta_net::conv(
            "delta_net_conv_batched",
            "catalog",
            cache_layout::CacheLayout::Batched,
            &QWEN3_5_DELTA_NET,
            Dense(Ty::Bf16),
        ),
        delta_net::conv_window(
            "delta_net_window_batched",
            "catalog",
            cache_layout::CacheLayout::Batched,
            &QWEN3_5_DELTA_NET,
        ),
        delta_net::delta_rule(
            "delta_rule_batched",
            "catalog",
            cache_layout::CacheLayout::Batched,
            &QWEN3_5_DELTA_NET,
        ),
        // The same over a prompt, in chunks.
        delta_chunks::chunk_prepare(
            "delta_chunk_prepare_batched",
            "catalog",
            cache_layout::CacheLayout::Batched,
            &QWEN3_5_DELTA_NET,
        ),
        delta_chunks::chunk_state(
            "delta_chunk_state_batched",
            "catalog",
            cache_layout::CacheLayout::Batched,
            &QWEN3_5_DELTA_NET,
        ),
        elementwise::add_bias("add_bias", "catalog"),
        elementwise::scale_rows("scale_rows", "catalog"),
        // GLM-4.5-Air's MoE layers (128 experts, 8 a token, 1408 hidden units) in bf16.
        moe::route("moe_route_grouped_sigmoid", "catalog", &GLM_4_5_AIR_MOE),
        moe::route(
            "moe_route_softmax",
            "catalog",
            &ir::MoeSpec {
                router: ir::MoeRouter::Softmax,
                ..GLM_4_5_AIR_MOE
            },
        ),
        moe::gate_up("moe_gate_up_bf16", "catalog", &GLM_4_5_AIR_MOE, 4096, Dense(Ty::Bf16)),
        moe::gate_up_by_expert(
            "moe_gate_up_by_expert_bf16",
            "catalog",
            &GLM_4_5_AIR_MOE,
            4096,
            Dense(Ty::Bf16),
        ),
        moe::down("moe_down_bf16", "catalog", &GLM_4_5_AIR_MOE, 4096, Dense(Ty::Bf16)),
        moe::down_by_expert(
            "moe_down_by_expert_bf16",
            "catalog",
            &GLM_4_5_AIR_MOE,
            4096,
            Dense(Ty::Bf16),
        ),
        moe::combine("moe_combine", "catalog", &GLM_4_5_AIR_MOE, 4096),
        // The same experts in prefill on tensor cores.
        moe_mma::group_pairs("moe_group_pairs", "catalog", &GLM_4_5_AIR_MOE),
        moe_mma::list_tiles("moe_list_tiles", "catalog", &GLM_4_5_AIR_MOE),
        moe_mma::gate_up(
            "moe_gate_up_mma_bf16",
            "catalog",
            &GLM_4_5_AIR_MOE,
            4096,
            Dense(Ty::Bf16),
        ),
        moe_mma::down("moe_down_mma_bf16", "catalog", &GLM_4_5_AIR_MOE, 4096, Dense(Ty::Bf16)),
        moe_mma::gate_up(
            "moe_gate_up_mma_q4_k",
            "catalog",
            &GLM_4_5_AIR_MOE,
            4096,
            Blocks(ir::DType::Q4K),
        ),
        // Hopper's, bf16 experts on `wgmma`.
        moe_wgmma::gate_up("moe_gate_up_wgmma_bf16", "catalog", &GLM_4_5_AIR_MOE, 4096),
        moe_wgmma::down("moe_down_wgmma_bf16", "catalog", &GLM_4_5_AIR_MOE, 4096),
        // The B200's, on `tcgen05`.
        moe_tcgen05::gate_up("moe_gate_up_tcgen05_bf16", "catalog", &GLM_4_5_AIR_MOE, 4096),
        moe_tcgen05::down("moe_down_tcgen05_bf16", "catalog", &GLM_4_5_AIR_MOE, 4096),
        // Half experts multiplied as stored, on each target's tensor cores.
        halves::over_halves(
            moe_mma::gate_up("", "catalog", &GLM_4_5_AIR_MOE, 4096, Dense(Ty::Bf16)),
            "moe_gate_up_mma_f16",
        ),
        halves::over_halves(
            moe_wgmma::gate_up("", "catalog", &GLM_4_5_AIR_MOE, 4096),
            "moe_gate_up_wgmma_f16",
        ),
        halves::over_halves(
            moe_tcgen05::down("", "catalog", &GLM_4_5_AIR_MOE, 4096),
            "moe_down_tcgen05_f16",
        ),
        split_k::reduce("split_k_reduce", "catalog", 16, None, None),
        split_k::reduce("split_k_reduce_swiglu", "catalog", 16, Some(GluAct::Silu), None),
        // After a residual-norm GEMM with the GLU (`add_rms_norm_swiglu_gemm`): each token's
        // 1/rms from the splits' sums of squares, then the gate.
        split_k::reduce(
            "split_k_reduce_norm_swiglu",
            "catalog",
            16,
            Some(GluAct::Silu),
            Some(gemv::NormPrologue::new(1e-6, 0.0).with_residual()),
        ),
        gemm_mma::gemm_mma("gemm_mma_bf16", "catalog", gemm_mma::WeightStaging::Registers),
        gemm_mma::gemm_mma("gemm_mma_bf16_pipelined", "catalog", gemm_mma::WeightStaging::CpAsync),
        // The heaviest decode: Q6_K's split 6-bit values and per-16 scales.
        gemm_mma::gemm_mma(
            "gemm_mma_q6_k",
            "catalog",
            gemm_mma::WeightStaging::Dequantize(ir::DType::Q6K),
        ),
        gemm_mma::gemm_mma(
            "gemm_mma_q4_1",
            "catalog",
            gemm_mma::WeightStaging::Dequantize(ir::DType::Q4_1),
        ),
        gemm_wgmma::gemm_wgmma_bf16("gemm_wgmma_bf16", "catalog"),
        gemm_tcgen05::gemm_tcgen05_bf16("gemm_tcgen05_bf16", "catalog"),
        gemm_tma_wgmma::gemm_tma_wgmma_bf16("gemm_tma_wgmma_bf16", "catalog", gemm_tma_wgmma::TmaTile::WIDE),
        gemm_tma_wgmma::gemm_tma_wgmma_bf16("gemm_tma_wgmma_n256_bf16", "catalog", gemm_tma_wgmma::TmaTile::WIDEST),
        gemm_tma_wgmma::gemm_tma_wgmma_bf16(
            "gemm_tma_wgmma_specialised_n256_bf16",
            "catalog",
            gemm_tma_wgmma::TmaTile::SPECIALISED_WIDEST,
        ),
        gemm_tma_wgmma::gemm_tma_wgmma_bf16(
            "gemm_tma_wgmma_persistent_n256_bf16",
            "catalog",
            gemm_tma_wgmma::TmaTile::SPECIALISED_WIDEST.persistent(132),
        ),
        // As plans launch it: the residual add and norm done by the rows' kernel, the GLU by
        // the GEMM with one split (by the reduction with several), the result laid out as the
        // GEMV's.
        gemm_tma_wgmma::gemm_tma_wgmma_bf16_prologued(
            "add_rms_norm_swiglu_gemm_tma",
            "catalog",
            gemm_tma_wgmma::TmaTile::WIDE,
            Some(gemv::NormPrologue::new(1e-5, 0.0).with_residual()),
            Some(ir::GluAct::Silu),
        ),
        // Over a bf16 copy of GGUF blocks made for the step, the rows normed before it.
        tma_gemm::over_converted_weights(
            gemm_tma_wgmma::gemm_tma_wgmma_bf16_prologued(
                "",
                "catalog",
                gemm_tma_wgmma::TmaTile::WIDE,
                Some(gemv::NormPrologue::new(1e-5, 0.0)),
                None,
            ),
            "rms_norm_gemm_tma_converted",
        ),
        // The same for a decode batch, the weights as wgmma's M and 16 tokens its N.
        gemm_tma_wgmma::gemm_tma_wgmma_bf16_prologued(
            "add_rms_norm_swiglu_gemm_tma_batch",
            "catalog",
            gemm_tma_wgmma::TmaTile::batch(16),
            Some(gemv::NormPrologue::new(1e-5, 0.0).with_residual()),
            Some(ir::GluAct::Silu),
        ),
        gemm_tma_wgmma::gemm_tma_wgmma_bf16(
            "gemm_tma_wgmma_batch_64_bf16",
            "catalog",
            gemm_tma_wgmma::TmaTile::batch(64),
        ),
        gemm_tma_tcgen05::gemm_tma_tcgen05_bf16_prologued(
            "add_rms_norm_swiglu_gemm_tma_tcgen05",
            "catalog",
            gemm_tma_tcgen05::TcgenTile::WIDE.persistent(148),
            Some(gemv::NormPrologue::new(1e-5, 0.0).with_residual()),
            Some(ir::GluAct::Silu),
        ),
        gemm_tma_tcgen05::gemm_tma_tcgen05_bf16(
            "gemm_tma_tcgen05_persistent_bf16",
            "catalog",
            gemm_tma_tcgen05::TcgenTile::WIDE.persistent(148),
        ),
        gemm_tma_tcgen05::gemm_tma_tcgen05_bf16_prologued(
            "rms_norm_gemm_tma_tcgen05",
            "catalog",
            gemm_tma_tcgen05::TcgenTile::WIDE,
            Some(gemv::NormPrologue::new(1e-5, 0.0)),
            None,
        ),
        gemm_tma_mma::gemm_tma_mma_bf16_prologued(
            "add_rms_norm_gemm_tma_mma",
            "catalog",
            Some(gemv::NormPrologue::new(1e-5, 0.0).with_residual()),
            None,
        ),
        bf16_rows::bf16_rows("bf16_rows", "catalog", None, 16),
        bf16_rows::bf16_rows(
            "add_rms_norm_bf16_rows",
            "catalog",
            Some(gemv::NormPrologue::new(1e-6, 1.0).with_residual()),
            16,
        ),
        gemm_tma_tcgen05::gemm_tma_tcgen05_bf16("gemm_tma_tcgen05_bf16", "catalog", gemm_tma_tcgen05::TcgenTile::WIDE),
        // Over half weights, multiplied as stored.
        bf16_rows::rows_of(
            MmaElement::F16,
            "add_rms_norm_f16_rows",
            "catalog",
            Some(gemv::NormPrologue::new(1e-6, 1.0).with_residual()),
            16,
        ),
        halves::over_halves(
            gemm_tma_wgmma::gemm_tma_wgmma_bf16_prologued(
                "",
                "catalog",
                gemm_tma_wgmma::TmaTile::SPECIALISED,
                None,
                Some(GluAct::Silu),
            ),
            "swiglu_gemm_tma_wgmma_f16",
        ),
        halves::over_halves(
            gemm_tma_tcgen05::gemm_tma_tcgen05_bf16("", "catalog", gemm_tma_tcgen05::TcgenTile::WIDE),
            "gemm_tma_tcgen05_f16",
        ),
        halves::over_halves(gemm_tma_mma::gemm_tma_mma_bf16("", "catalog"), "gemm_tma_mma_f16"),
        gemm_tma_mma::gemm_tma_mma_bf16("gemm_tma_mma_bf16", "catalog"),
        flash_attention::flash_attention(
            "flash_attention_d128",
            "catalog",
            cache_layout::CacheLayout::Batched,
            128,
            flash_attention::Masking::EveryTile,
        ),
        // Over an FP8 pool: its codes copied 16 at a time, each tile widened to bf16 once.
        flash_attention::flash_attention_over(
            "flash_attention_fp8_d128",
            "catalog",
            cache_layout::CacheLayout::Batched,
            (128, Ty::F8E4M3),
            flash_attention::Masking::CutTiles,
        ),
        flash_attention_wgmma::flash_attention_wgmma(
            "flash_attention_wgmma_d128",
            "catalog",
            cache_layout::CacheLayout::Batched,
            128,
            flash_attention_wgmma::Schedule::Lockstep,
        ),
        flash_attention_wgmma::flash_attention_wgmma_over(
            "flash_attention_wgmma_fp8_d128",
            "catalog",
            cache_layout::CacheLayout::Batched,
            (128, Ty::F8E4M3),
            flash_attention_wgmma::Schedule::Lockstep,
        ),
        // Over a half pool: its tiles multiplied as halves.
        flash_attention::flash_attention_over(
            "flash_attention_f16_d128",
            "catalog",
            cache_layout::CacheLayout::Batched,
            (128, Ty::F16),
            flash_attention::Masking::CutTiles,
        ),
        flash_attention_wgmma::flash_attention_wgmma_over(
            "flash_attention_wgmma_tma_f16_d128",
            "catalog",
            cache_layout::CacheLayout::Batched,
            (128, Ty::F16),
            flash_attention_wgmma::Schedule::Tma,
        ),
        flash_attention_tcgen05::flash_attention_tcgen05_over(
            "flash_attention_tcgen05_tma_f16_d128",
            "catalog",
            cache_layout::CacheLayout::Batched,
            (128, Ty::F16),
            flash_attention_tcgen05::Loads::Tma,
        ),
        flash_attention_wgmma::flash_attention_wgmma(
            "flash_attention_wgmma_specialised_d128",
            "catalog",
            cache_layout::CacheLayout::Batched,
            128,
            flash_attention_wgmma::Schedule::Specialised,
        ),
        flash_attention_wgmma::flash_attention_wgmma(
            "flash_attention_wgmma_tma_d128",
            "catalog",
            cache_layout::CacheLayout::Batched,
            128,
            flash_attention_wgmma::Schedule::Tma,
        ),
        flash_attention_tcgen05::flash_attention_tcgen05(
            "flash_attention_tcgen05_d128",
            "catalog",
            cache_layout::CacheLayout::Batched,
            128,
            flash_attention_tcgen05::Loads::Copies,
        ),
        flash_attention_tcgen05::flash_attention_tcgen05(
            "flash_attention_tcgen05_tma_d128",
            "catalog",
            cache_layout::CacheLayout::Batched,
            128,
            flash_attention_tcgen05::Loads::Tma,
        ),
        flash_attention_tcgen05::flash_attention_tcgen05_over(
            "flash_attention_tcgen05_fp8_d128",
            "catalog",
            cache_layout::CacheLayout::Batched,
            (128, Ty::F8E4M3),
            flash_attention_tcgen05::Loads::Copies,
        ),
        flash_attention::flash_attention(
            "flash_attention_d256",
            "catalog",
            cache_layout::CacheLayout::Contiguous,
            256,
            flash_attention::Masking::CutTiles,
        ),
        gemv::gemv(
            "rms_norm_gemv_bf16",
            "catalog",
            GemvSpec::decode(Dense(Ty::Bf16), 4096).with_norm(gemv::NormPrologue::new(1e-6, 0.0)),
        ),
        gemv::gemv(
            "rms_norm_gemv_bf16_prefill",
            "catalog",
            GemvSpec::decode(Dense(Ty::Bf16), 4096)
                .with_norm(gemv::NormPrologue::new(1e-6, 0.0))
                .prefill(),
        ),
        // The heaviest K-quant GEMV: Q5_K sub-blocks (scales, mins and high bits), the norm
        // prologue, 4 tokens a pass; then, as plans build them, GEMVs with vector activation
        // loads (the GGUF ones in decode: their prefill variants keep scalar loads).
        gemv::gemv(
            "rms_norm_gemv_q5_k_prefill",
            "catalog",
            GemvSpec::decode(Blocks(ir::DType::Q5K), 4096)
                .with_norm(gemv::NormPrologue::new(1e-6, 1.0))
                .prefill(),
        ),
        gemv::gemv(
            "rms_norm_gemv_q5_k_x_vectors",
            "catalog",
            GemvSpec::decode(Blocks(ir::DType::Q5K), 4096)
                .with_norm(gemv::NormPrologue::new(1e-6, 1.0))
                .with_x_vectors(),
        ),
        gemv::gemv(
            "rms_norm_gemv_q4_1_x_vectors",
            "catalog",
            GemvSpec::decode(Blocks(ir::DType::Q4_1), 4096)
                .with_norm(gemv::NormPrologue::new(1e-6, 1.0))
                .with_x_vectors(),
        ),
        gemv::gemv(
            "rms_norm_gemv_bf16_x_vectors_prefill",
            "catalog",
            GemvSpec::decode(Dense(Ty::Bf16), 4096)
                .with_norm(gemv::NormPrologue::new(1e-6, 0.0))
                .with_x_vectors()
                .prefill(),
        ),
        // A layer's residual add and pre-norm before its projection (`add_rms_norm_matmul`):
        // decode, a few rows, and Hopper's GEMM for many.
        gemv::gemv(
            "add_rms_norm_gemv_bf16_x_vectors",
            "catalog",
            GemvSpec::decode(Dense(Ty::Bf16), 4096)
                .with_norm(gemv::NormPrologue::new(1e-6, 0.0).with_residual())
                .with_x_vectors(),
        ),
        gemv::gemv(
            "add_rms_norm_gemv_bf16_x_vectors_rows4",
            "catalog",
            GemvSpec::decode(Dense(Ty::Bf16), 4096)
                .with_norm(gemv::NormPrologue::new(1e-6, 0.0).with_residual())
                .with_x_vectors()
                .with_rows_per_warp(4),
        ),
        gemv::gemv(
            "add_rms_norm_gemv_bf16_x_vectors_prefill",
            "catalog",
            GemvSpec::decode(Dense(Ty::Bf16), 4096)
                .with_norm(gemv::NormPrologue::new(1e-6, 1.0).with_residual())
                .with_x_vectors()
                .prefill(),
        ),
        gemm_wgmma::gemm_wgmma_bf16_with(
            "add_rms_norm_gemm_wgmma_bf16",
            "catalog",
            Some(gemv::NormPrologue::new(1e-6, 0.0).with_residual()),
            None,
        ),
        // And the gate/up projection with the gated MLP's GLU as its epilogue.
        gemv::gemv(
            "add_rms_norm_geglu_gemv_bf16_x_vectors",
            "catalog",
            GemvSpec::decode(Dense(Ty::Bf16), 4096)
                .with_norm(gemv::NormPrologue::new(1e-6, 1.0).with_residual())
                .with_glu(GluAct::GeluTanh)
                .with_x_vectors(),
        ),
        gemv::gemv(
            "add_rms_norm_swiglu_gemv_bf16_x_vectors_prefill",
            "catalog",
            GemvSpec::decode(Dense(Ty::Bf16), 4096)
                .with_norm(gemv::NormPrologue::new(1e-6, 0.0).with_residual())
                .with_glu(GluAct::Silu)
                .with_x_vectors()
                .prefill(),
        ),
        // The most accumulators a GEMV holds: 4 tokens × 4 rows × a gate and an up sum.
        gemv::gemv(
            "add_rms_norm_swiglu_gemv_bf16_x_vectors_prefill_rows4",
            "catalog",
            GemvSpec::decode(Dense(Ty::Bf16), 4096)
                .with_norm(gemv::NormPrologue::new(1e-6, 0.0).with_residual())
                .with_glu(GluAct::Silu)
                .with_x_vectors()
                .prefill()
                .with_rows_per_warp(4),
        ),
        gemm_wgmma::gemm_wgmma_bf16_with(
            "add_rms_norm_swiglu_gemm_wgmma_bf16",
            "catalog",
            Some(gemv::NormPrologue::new(1e-6, 0.0).with_residual()),
            Some(GluAct::Silu),
        ),
        // mma.sync's (the RTX PRO 6000's, and GGUF weights' everywhere), likewise.
        gemm_mma::gemm_mma_with(
            "add_rms_norm_swiglu_gemm_mma_bf16",
            "catalog",
            gemm_mma::WeightStaging::CpAsync,
            Some(gemv::NormPrologue::new(1e-6, 0.0).with_residual()),
            Some(GluAct::Silu),
        ),
        gemm_mma::gemm_mma_with(
            "add_rms_norm_gemm_mma_q6_k",
            "catalog",
            gemm_mma::WeightStaging::Dequantize(ir::DType::Q6K),
            Some(gemv::NormPrologue::new(1e-6, 1.0).with_residual()),
            None,
        ),
        // As plans take it for batches over blocks: the rows normed before it.
        gemm_mma::gemm_mma_after_rows(
            "add_rms_norm_gemm_mma_q4_k_after_rows",
            "catalog",
            gemm_mma::WeightStaging::Dequantize(ir::DType::Q4K),
            (Some(gemv::NormPrologue::new(1e-6, 1.0).with_residual()), None),
        ),
        // GGUF blocks with the gated MLP's GLU (the reduction gates): a batch's gate/up, and
        // every step's where the pair is too large to copy.
        gemm_mma::gemm_mma_after_rows(
            "add_rms_norm_swiglu_gemm_mma_q4_k_after_rows",
            "catalog",
            gemm_mma::WeightStaging::Dequantize(ir::DType::Q4K),
            (
                Some(gemv::NormPrologue::new(1e-6, 1.0).with_residual()),
                Some(GluAct::Silu),
            ),
        ),
        // Half weights with the gated MLP's GLU (the reduction gates).
        gemm_mma::gemm_mma_after_rows(
            "add_rms_norm_swiglu_gemm_mma_f16_after_rows",
            "catalog",
            gemm_mma::WeightStaging::HalfWeights,
            (
                Some(gemv::NormPrologue::new(1e-6, 1.0).with_residual()),
                Some(GluAct::Silu),
            ),
        ),
        // IEEE half weights (f16 GGUF and safetensors models): the decode GEMV, and the GEMM
        // converting them to bf16 in its tile.
        gemv::gemv(
            "gemv_f16_x_vectors",
            "catalog",
            GemvSpec::decode(Dense(Ty::F16), 4096).with_x_vectors(),
        ),
        gemm_mma::gemm_mma_with(
            "add_rms_norm_gemm_mma_f16",
            "catalog",
            gemm_mma::WeightStaging::HalfWeights,
            Some(gemv::NormPrologue::new(1e-6, 1.0).with_residual()),
            None,
        ),
        // Blackwell's, with the same prologues and epilogue.
        gemm_tcgen05::gemm_tcgen05_bf16_with(
            "rms_norm_gemm_tcgen05_bf16",
            "catalog",
            Some(gemv::NormPrologue::new(1e-6, 1.0)),
            None,
        ),
        gemm_tcgen05::gemm_tcgen05_bf16_with(
            "add_rms_norm_swiglu_gemm_tcgen05_bf16",
            "catalog",
            Some(gemv::NormPrologue::new(1e-6, 0.0).with_residual()),
            Some(GluAct::Silu),
        ),
        // The heaviest block-per-lane GEMV: five-bit values, the norm prologue, 4 tokens a pass.
        gemv::gemv(
            "rms_norm_gemv_q5_0_prefill",
            "catalog",
            GemvSpec::decode(Blocks(ir::DType::Q5_0), 4096)
                .with_norm(gemv::NormPrologue::new(1e-6, 1.0))
                .prefill(),
        ),
    ]
    .into_iter()
    .chain(QUANT_FORMATS.iter().flat_map(|&f| {
        let name = f.name();
        [
            gemv::gemv(&format!("gemv_{name}"), "catalog", GemvSpec::decode(Blocks(f), 4096)),
            embedding::embedding(&format!("embedding_{name}"), "catalog", Blocks(f)),
        ]
    }))
    // Every stored format a weight is converted from on the device, to bf16; and one to f32.
    .chain(
        [ir::DType::F16, ir::DType::BF16]
            .into_iter()
            .chain(QUANT_FORMATS)
            .filter_map(|f| weight_convert::convert_kernel(f, ir::DType::BF16)),
    )
    .chain(weight_convert::convert_kernel(ir::DType::Q4K, ir::DType::F32))
    // Every block format converted to bf16 for a prefill step's TMA GEMM.
    .chain(
        QUANT_FORMATS
            .into_iter()
            .filter_map(|f| weight_convert::to_bf16_for_prefill(f, 65, "catalog")),
    )
    .collect()
}
