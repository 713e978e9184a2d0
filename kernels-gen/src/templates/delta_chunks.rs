//! The gated delta rule over a prompt in chunks (the WY form of Yang et al.'s Gated DeltaNet,
//! as FLA's `chunk_gated_delta_rule` and HF's `torch_chunk_gated_delta_rule` compute it): a
//! sequence's rows cut into chunks of [`CHUNK`], what depends only on a chunk's own rows
//! computed for every chunk at once, and only the hand-over of the state from chunk to chunk
//! left in order. [`delta_net::delta_rule`] walks the rows one after another instead.
//!
//! Within a chunk of rows `t` (from 0) with state `S₀` before it, `Γ_t = g_0 ⋯ g_t` (as
//! `b_t = Σ ln g`, so ratios `Γ_t / Γ_i = e^{b_t − b_i}` never overflow), normalised `q̂`, `k̂`
//! and the update `δ_t` the recurrence adds (`S_t = g_t S_{t−1} + k̂_t δ_tᵀ`):
//! - `δ = U − W·S₀`, where `(I + A)·W = diag(βΓ)·K̂` and `(I + A)·U = diag(β)·V` with `A`
//!   strictly lower triangular, `A[t, i] = β_t (Γ_t / Γ_i) k̂_t·k̂_i`;
//! - `o_t = Γ_t q̂_t·S₀ + Σ_{i ≤ t} (Γ_t / Γ_i)(q̂_t·k̂_i) δ_i`;
//! - `S_t = Γ_t S₀ + Σ_{i ≤ t} (Γ_t / Γ_i) k̂_i δ_iᵀ` (the state after the chunk at its last row).
//!
//! Two launches after the convolution and window of [`delta_net`]:
//! 1. [`chunk_prepare`], a block per (chunk, value head): the scores `P[t, i] = (Γ_t / Γ_i)
//!    q̂_t·k̂_i` (`i ≤ t`, else 0), `A`, then `W` and `U` by forward substitution (each thread
//!    solving a column of its own, 16 rows at a time in registers), written to scratch with
//!    each row's decay and scales.
//! 2. [`chunk_state`], a block per (sequence, value head, tile of value columns) as the
//!    recurrent kernel's: the state's columns in registers, eight lanes a column, walking the
//!    sequence's chunks: `δ`, the outputs, states after rows a batched step keeps
//!    (checkpoints), the state after the chunk. Each is a sum over the key dimension split
//!    across a column's lanes (three shuffles) or over the chunk's rows. The rows each phase
//!    reads arrive by `cp.async` while the phase before it computes.
//!
//! Everything is f32, as the state is and as HF's chunked form computes. The sums run in
//! another order than the recurrence's, so results agree with it to f32 rounding.

use super::attention::shared_f32;
use super::cache_layout::CacheLayout;
use super::delta_net::{
    at_checkpoint, checkpoint_params, decay_rate, head_matrix, key_head, locate_sequence, sequence_params, softplus,
    spec_text, tree_sum,
};
use super::elementwise::sigmoid;
use super::flash_attention::{self, query_tiles_expr};
use crate::dsl::*;
use ir::DeltaNetSpec;

/// Rows a chunk: a batched step's `query_tiles` input cuts each sequence's rows so.
pub const CHUNK: usize = flash_attention::QUERY_TILE_ROWS;
/// Threads of a [`chunk_prepare`] block.
const PREPARE_THREADS: u32 = 256;
/// Lanes sharing a column of the state in [`chunk_state`] (neighbouring lanes).
const GROUPS: i64 = 8;
/// Value columns a [`chunk_state`] block takes (fewer where the heads are narrower).
const COLUMNS: usize = 32;
/// Per row and value head: `b_t`, `q_mult_t` (`q`'s norm scale times `Γ_t`), `k_mult_t` (`k`'s
/// norm scale) and `Γ_last / Γ_t`.
const SCALES: i64 = 4;

/// Whether the chunked form takes `spec`'s heads: key heads a multiple of [`GROUPS`] and up to
/// 128 wide (what the blocks' shared memory holds on every target), value heads a multiple of
/// 4 (rows of 16-byte copies) and up to 128.
pub fn supports(spec: &DeltaNetSpec) -> bool {
    spec.key_dim.is_multiple_of(GROUPS as usize)
        && spec.key_dim <= 128
        && spec.value_dim.is_multiple_of(4)
        && spec.value_dim <= 128
}

/// The scratch [`chunk_prepare`] writes and [`chunk_state`] reads: each buffer's name and its
/// f32 elements a step row.
pub fn scratch(spec: &DeltaNetSpec) -> [(&'static str, usize); 4] {
    let vh = spec.value_heads;
    [
        ("chunk_w", vh * spec.key_dim),
        ("chunk_u", vh * spec.value_dim),
        ("chunk_p", vh * CHUNK),
        ("chunk_scales", vh * SCALES as usize),
    ]
}

/// `body` for each `e` in `tid, tid + blockDim, …` below `count`.
fn strided(e: &str, count: Expr, body: Vec<Stmt>) -> Stmt {
    for_(e, tid(), count, bdim(), body)
}

/// `body` for each element `e` of `rows` rows of `width`, a thread an element in turn, with
/// its row `t` and its place in the row `column` declared.
fn over_rows(rows: Expr, width: i64, column: &str, body: Vec<Stmt>) -> Stmt {
    let located = vec![
        let_("t", Ty::I32, var("e") / int(width)),
        let_(column, Ty::I32, rem(var("e"), int(width))),
    ];
    strided("e", rows * int(width), [located, body].concat())
}

/// Where row `t` of the chunk starting at step row `first`, value head `h`, keeps `width`
/// elements a head in a scratch buffer.
fn scratch_row(first: Expr, t: Expr, vh: i64, width: i64) -> Expr {
    ((first + t) * int(vh) + var("h")) * int(width)
}

/// The chunk a [`chunk_prepare`] block takes: `h`, `q0` (its first step row) and `n` (its rows).
fn chunk_rows(layout: CacheLayout, vh: i64) -> Vec<Stmt> {
    let tile = bid() / int(vh);
    let mut out = vec![let_("h", Ty::I32, rem(bid(), int(vh)))];
    match layout {
        CacheLayout::Batched => out.extend([
            let_("q0", Ty::I32, load("query_tiles", tile.clone() * int(2))),
            let_("n", Ty::I32, load("query_tiles", tile * int(2) + int(1))),
        ]),
        _ => out.extend([
            let_("q0", Ty::I32, tile * int(CHUNK as i64)),
            let_(
                "n",
                Ty::I32,
                bin(BinOp::Min, int(CHUNK as i64), var("tokens") - var("q0")),
            ),
        ]),
    }
    out
}

/// For each chunk of the step's sequences and value head: its scores `P`, `W`, `U` and row
/// scales into scratch (see the module's description). `conv` holds the convolved `[q | k |
/// v]` rows; `b` and `a` rows are `b_stride` and `a_stride` apart. Grid: the step's chunks
/// (a batched step's `query_tiles`) × value heads.
pub fn chunk_prepare(name: &str, origin: &str, layout: CacheLayout, spec: &DeltaNetSpec) -> Kernel {
    assert!(
        supports(spec),
        "the chunked delta rule does not take {}",
        spec_text(spec)
    );
    let (dk, dv, vh) = (spec.key_dim as i64, spec.value_dim as i64, spec.value_heads as i64);
    let key_width = (spec.key_heads * spec.key_dim) as i64;
    let channels = spec.conv_channels() as i64;
    let chunk = CHUNK as i64;
    // Rows of `xs` and `ys` 4 elements longer than their data: 16-byte aligned, and the 16
    // bytes each of the 8 rows a warp reads together fall in different banks. `a_sh` holds `A`
    // transposed (`A[t, i]` at `i·a_pitch + t`), its rows 8 longer, so a warp's stores (4 of
    // its rows, 8 columns) fall in different banks and 16-byte reads stay aligned.
    let (xs, ys, a_pitch) = (dk + 4, dk.max(dv) + 4, chunk + 8);
    let conv_at = |offset: Expr| (var("q0") + var("t")) * int(channels) + offset;
    let row = |t: &str| var("q0") + var(t);

    let mut body = vec![
        let_("key_head", Ty::I32, key_head(spec, var("h"))),
        let_("neg_a", Ty::F32, decay_rate(spec, load("a_log", var("h")))),
        let_("bias", Ty::F32, load("dt_bias", var("h"))),
        // The chunk's q and k rows, zero past its last.
        over_rows(
            int(chunk),
            dk,
            "k",
            vec![
                let_("q_in", Ty::F32, f(0.0)),
                let_("k_in", Ty::F32, f(0.0)),
                if_(
                    lt(var("t"), var("n")),
                    vec![
                        assign("q_in", load("conv", conv_at(var("key_head") * int(dk) + var("k")))),
                        assign(
                            "k_in",
                            load("conv", conv_at(int(key_width) + var("key_head") * int(dk) + var("k"))),
                        ),
                    ],
                ),
                store("xs", var("t") * int(xs) + var("k"), var("q_in")),
                store("ys", var("t") * int(ys) + var("k"), var("k_in")),
            ],
        ),
        // Each row's β and ln g (zero past the last row).
        if_(
            lt(tid(), int(chunk)),
            vec![
                let_("t", Ty::I32, tid()),
                let_("beta", Ty::F32, f(0.0)),
                let_("log_decay", Ty::F32, f(0.0)),
                if_(
                    lt(var("t"), var("n")),
                    vec![
                        assign("beta", sigmoid(load("b", row("t") * var("b_stride") + var("h")))),
                        let_(
                            "x",
                            Ty::F32,
                            load("a", row("t") * var("a_stride") + var("h")) + var("bias"),
                        ),
                        assign("log_decay", var("neg_a") * softplus(var("x"))),
                    ],
                ),
                store("beta_sh", var("t"), var("beta")),
                store("log_decay_sh", var("t"), var("log_decay")),
            ],
        ),
        Stmt::SyncThreads,
    ];
    // The rows' norm scales, a warp a row: as FLA and HF, x / √(Σx² + 1e-6), q also by
    // key_dim^−½ (zero past the last row).
    let warps = PREPARE_THREADS as i64 / 32;
    let mut norms = vec![
        let_("t", Ty::I32, warp() + var("v") * int(warps)),
        let_("qq", Ty::F32, f(0.0)),
        let_("kk", Ty::F32, f(0.0)),
        // Warp-uniform: every lane of a warp takes the same row.
        if_(
            lt(var("t"), var("n")),
            vec![for_(
                "k",
                lane(),
                int(dk),
                int(32),
                vec![
                    let_("q_in", Ty::F32, load("xs", var("t") * int(xs) + var("k"))),
                    let_("k_in", Ty::F32, load("ys", var("t") * int(ys) + var("k"))),
                    assign("qq", var("qq") + var("q_in") * var("q_in")),
                    assign("kk", var("kk") + var("k_in") * var("k_in")),
                ],
            )],
        ),
    ];
    for mask in [16, 8, 4, 2, 1] {
        norms.push(assign("qq", var("qq") + shfl_xor(var("qq"), mask)));
        norms.push(assign("kk", var("kk") + shfl_xor(var("kk"), mask)));
    }
    let live = lt(var("t"), var("n"));
    norms.push(if_(
        eq(lane(), int(0)),
        vec![
            store(
                "q_scale_sh",
                var("t"),
                select(
                    live.clone(),
                    un(UnOp::Rsqrt, var("qq") + f(1e-6)) * f(1.0 / (spec.key_dim as f32).sqrt()),
                    f(0.0),
                ),
            ),
            store(
                "k_scale_sh",
                var("t"),
                select(live, un(UnOp::Rsqrt, var("kk") + f(1e-6)), f(0.0)),
            ),
        ],
    ));
    body.push(for_("v", int(0), int(chunk / warps), int(1), norms));
    body.extend([
        // b_t, the running sum of ln g over the chunk (constant past its last row): 64 adds.
        if_(
            eq(tid(), int(0)),
            vec![
                let_("running", Ty::F32, f(0.0)),
                for_(
                    "t",
                    int(0),
                    int(chunk),
                    int(1),
                    vec![
                        assign("running", var("running") + load("log_decay_sh", var("t"))),
                        store("b_sh", var("t"), var("running")),
                    ],
                ),
            ],
        ),
        Stmt::SyncThreads,
        // The row scales `chunk_state` applies.
        if_(
            lt(tid(), var("n")),
            vec![
                let_("t", Ty::I32, tid()),
                let_("at", Ty::I32, scratch_row(var("q0"), var("t"), vh, SCALES)),
                let_("b_t", Ty::F32, load("b_sh", var("t"))),
                store("chunk_scales", var("at"), var("b_t")),
                store(
                    "chunk_scales",
                    var("at") + int(1),
                    load("q_scale_sh", var("t")) * un(UnOp::Exp, var("b_t")),
                ),
                store("chunk_scales", var("at") + int(2), load("k_scale_sh", var("t"))),
                store(
                    "chunk_scales",
                    var("at") + int(3),
                    un(UnOp::Exp, load("b_sh", var("n") - int(1)) - var("b_t")),
                ),
            ],
        ),
    ]);
    body.extend(scores(spec, (xs, ys, a_pitch), vh));
    body.extend([
        Stmt::SyncThreads,
        // The right-hand sides: β_t Γ_t k̂_t for W (over the queries, no longer needed)…
        over_rows(
            var("n"),
            dk,
            "k",
            vec![store(
                "xs",
                var("t") * int(xs) + var("k"),
                load("beta_sh", var("t"))
                    * un(UnOp::Exp, load("b_sh", var("t")))
                    * load("k_scale_sh", var("t"))
                    * load("ys", var("t") * int(ys) + var("k")),
            )],
        ),
        Stmt::SyncThreads,
        // … and β_t v_t for U (over the keys).
        over_rows(
            var("n"),
            dv,
            "c",
            vec![store(
                "ys",
                var("t") * int(ys) + var("c"),
                load("beta_sh", var("t")) * load("conv", conv_at(int(2 * key_width) + var("h") * int(dv) + var("c"))),
            )],
        ),
        Stmt::SyncThreads,
        substitute((dk, dv), (xs, ys, a_pitch), vh),
    ]);
    let mut all = chunk_rows(layout, vh);
    // An empty tile (a batched step lists as many as its rows could make) has nothing to do.
    all.push(if_(bin(BinOp::Gt, var("n"), int(0)), body));
    let mut params = vec![
        buffer("conv", Ty::F32, false),
        buffer("b", Ty::F32, false),
        buffer("a", Ty::F32, false),
        buffer("a_log", Ty::F32, false),
        buffer("dt_bias", Ty::F32, false),
    ];
    params.extend(scratch(spec).map(|(name, _)| buffer(name, Ty::F32, true)));
    params.extend([
        scalar("tokens", Ty::I32),
        scalar("b_stride", Ty::I32),
        scalar("a_stride", Ty::I32),
    ]);
    if layout == CacheLayout::Batched {
        params.extend([buffer("query_tiles", Ty::I32, false), scalar("seqs", Ty::I32)]);
    }
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: gated delta rule, chunks of {CHUNK} rows prepared ({}), {}",
            spec_text(spec),
            layout.describe()
        ),
        params,
        shared: vec![
            shared_f32("xs", CHUNK * xs as usize),
            shared_f32("ys", CHUNK * ys as usize),
            shared_f32("a_sh", CHUNK * a_pitch as usize),
            shared_f32("beta_sh", CHUNK),
            shared_f32("log_decay_sh", CHUNK),
            shared_f32("b_sh", CHUNK),
            shared_f32("q_scale_sh", CHUNK),
            shared_f32("k_scale_sh", CHUNK),
        ],
        block_dim: PREPARE_THREADS,
        grid: query_tiles_expr(layout, CHUNK as i64) * int(vh),
        body: all,
    }
}

/// The chunk's `P` rows (to scratch) and `A` (transposed, to shared `a_sh`) from the q and k
/// rows in `xs` and `ys`: thread `tid` takes row `t = tid / 4` against rows `i = tid % 4 +
/// 4u`, the two products over the key dimension side by side (16 of each a thread), reading
/// 4 dims of each row at once.
fn scores(spec: &DeltaNetSpec, (xs, ys, a_pitch): (i64, i64, i64), vh: i64) -> Vec<Stmt> {
    let chunk = CHUNK as i64;
    let lanes_a_row = PREPARE_THREADS as i64 / chunk;
    let partners = chunk / lanes_a_row;
    let (qk, kk) = (|u: i64| format!("qk{u}"), |u: i64| format!("kk{u}"));
    let partner = |u: i64| var("first_partner") + int(lanes_a_row * u);
    let mut out = vec![
        let_("row", Ty::I32, tid() / int(lanes_a_row)),
        let_("first_partner", Ty::I32, rem(tid(), int(lanes_a_row))),
    ];
    for u in 0..partners {
        out.push(let_(&qk(u), Ty::F32, f(0.0)));
        out.push(let_(&kk(u), Ty::F32, f(0.0)));
    }
    let four = |prefix: &str| -> Vec<String> { (0..4).map(|j| format!("{prefix}{j}")).collect() };
    let (q_t, k_t) = (four("q_t"), four("k_t"));
    let mut step = vec![
        load_vec("xs", var("row") * int(xs) + var("k"), &q_t),
        load_vec("ys", var("row") * int(ys) + var("k"), &k_t),
    ];
    for u in 0..partners {
        let k_i = four(&format!("k_i{u}_"));
        step.push(load_vec("ys", partner(u) * int(ys) + var("k"), &k_i));
        for j in 0..4 {
            step.extend([
                assign(&qk(u), var(&qk(u)) + var(&q_t[j]) * var(&k_i[j])),
                assign(&kk(u), var(&kk(u)) + var(&k_t[j]) * var(&k_i[j])),
            ]);
        }
    }
    out.push(for_("k", int(0), int(spec.key_dim as i64), int(4), step));
    out.extend([
        let_("b_row", Ty::F32, load("b_sh", var("row"))),
        let_("q_scale_row", Ty::F32, load("q_scale_sh", var("row"))),
        let_("k_scale_row", Ty::F32, load("k_scale_sh", var("row"))),
        let_("beta_row", Ty::F32, load("beta_sh", var("row"))),
    ]);
    for u in 0..partners {
        let i = format!("partner{u}");
        let ratio = format!("ratio{u}");
        out.extend([
            let_(&i, Ty::I32, partner(u)),
            // Γ_t / Γ_i · k̂_i's scale; only i ≤ t is kept (past it the exponent may overflow).
            let_(
                &ratio,
                Ty::F32,
                un(UnOp::Exp, var("b_row") - load("b_sh", var(&i))) * load("k_scale_sh", var(&i)),
            ),
            if_(
                lt(var("row"), var("n")),
                vec![store(
                    "chunk_p",
                    scratch_row(var("q0"), var("row"), vh, chunk) + var(&i),
                    select(
                        bin(BinOp::Le, var(&i), var("row")),
                        var(&qk(u)) * var("q_scale_row") * var(&ratio),
                        f(0.0),
                    ),
                )],
            ),
            store(
                "a_sh",
                var(&i) * int(a_pitch) + var("row"),
                select(
                    lt(var(&i), var("row")),
                    var(&kk(u)) * var("beta_row") * var("k_scale_row") * var(&ratio),
                    f(0.0),
                ),
            ),
        ]);
    }
    out
}

/// Rows of X a thread holds in registers at once in [`substitute`].
const SOLVE_ROWS: i64 = 16;

/// `(I + A)·X = rhs` by forward substitution, a column of X a thread (W's `dk`, then U's `dv`,
/// their right-hand sides in shared `xs` and `ys`, solved in place), each solved row also
/// written to `chunk_w` or `chunk_u`. Row t needs the rows before it of its own column only,
/// so a thread takes [`SOLVE_ROWS`] rows at a time into registers: first less what each row
/// solved before them contributes (a loop over those rows, each read once), then solved among
/// themselves (unrolled). Both read `A` by columns, which `a_sh` holds as rows: every thread
/// reads the same 16 bytes at once (a broadcast). Rows past the chunk's last are zero on both
/// sides (their β is).
fn substitute((dk, dv): (i64, i64), (xs, ys, a_pitch): (i64, i64, i64), vh: i64) -> Stmt {
    let rows = SOLVE_ROWS;
    let y = |j: i64| format!("y{j}");
    // `A[first + j, i]` for the block's rows j from `from` on: 16-byte loads where 4 are
    // whole (declared `{prefix}{j}`), the rest one at a time.
    let a_column = |i: Expr, from: i64, prefix: &str| -> (Vec<Stmt>, Vec<Expr>) {
        let at = |j: i64| i.clone() * int(a_pitch) + var("first") + int(j);
        let whole = (from + 3) / 4 * 4;
        let loads = (whole..rows)
            .step_by(4)
            .map(|j| {
                load_vec(
                    "a_sh",
                    at(j),
                    &(j..j + 4).map(|j| format!("{prefix}{j}")).collect::<Vec<_>>(),
                )
            })
            .collect();
        let values = (0..rows)
            .map(|j| match j < whole {
                true => load("a_sh", at(j)),
                false => var(&format!("{prefix}{j}")),
            })
            .collect();
        (loads, values)
    };
    let solve = |array: &str, stride: i64, column: Expr, (out, width): (&str, i64)| -> Vec<Stmt> {
        let at = |row: Expr| row * int(stride) + column.clone();
        let mut block: Vec<Stmt> = (0..rows)
            .map(|j| let_(&y(j), Ty::F32, load(array, at(var("first") + int(j)))))
            .collect();
        // Less the rows solved before the block.
        let (loads, a) = a_column(var("i"), 0, "a");
        let mut earlier = vec![let_("x_i", Ty::F32, load(array, at(var("i"))))];
        earlier.extend(loads);
        for (j, a) in a.into_iter().enumerate() {
            earlier.push(assign(&y(j as i64), var(&y(j as i64)) - a * var("x_i")));
        }
        block.push(for_("i", int(0), var("first"), int(1), earlier));
        // The block's own rows, each taken from the rows after it once solved.
        for i in 0..rows - 1 {
            let (loads, a) = a_column(var("first") + int(i), i + 1, &format!("d{i}_"));
            block.extend(loads);
            for (j, a) in a.into_iter().enumerate().skip(i as usize + 1) {
                block.push(assign(&y(j as i64), var(&y(j as i64)) - a * var(&y(i))));
            }
        }
        for j in 0..rows {
            let row = var("first") + int(j);
            block.extend([
                store(array, at(row.clone()), var(&y(j))),
                if_(
                    lt(row.clone(), var("n")),
                    vec![store(
                        out,
                        scratch_row(var("q0"), row, vh, width) + column.clone(),
                        var(&y(j)),
                    )],
                ),
            ]);
        }
        vec![for_("first", int(0), var("n"), int(rows), block)]
    };
    strided(
        "column",
        int(dk + dv),
        vec![if_else(
            lt(var("column"), int(dk)),
            solve("xs", xs, var("column"), ("chunk_w", dk)),
            solve("ys", ys, var("column") - int(dk), ("chunk_u", dv)),
        )],
    )
}

/// How [`chunk_state`] splits a head: value columns a block (eight lanes each).
pub fn state_columns(spec: &DeltaNetSpec) -> usize {
    // Whole warps: at least 4 columns, idle past the head's.
    COLUMNS
        .min(spec.value_dim.next_power_of_two())
        .max(32 / GROUPS as usize)
}

/// Blocks of [`chunk_state`] per sequence.
pub fn chunk_state_blocks_per_sequence(spec: &DeltaNetSpec) -> usize {
    spec.value_heads * spec.value_dim.div_ceil(state_columns(spec))
}

/// The key-dimension indices of a [`chunk_state`] thread's state entries, from its lane group
/// `g` (0..8): four consecutive ones every 32 where the head is a multiple of 32 wide (one
/// 16-byte load of a row each, the eight groups reading 128 consecutive bytes), else every
/// eighth.
struct Entries {
    count: i64,
    vector: bool,
}

impl Entries {
    fn of(spec: &DeltaNetSpec) -> Self {
        Self {
            count: spec.key_dim as i64 / GROUPS,
            vector: spec.key_dim.is_multiple_of(32),
        }
    }

    fn key(&self, m: i64) -> Expr {
        match self.vector {
            true => int(4) * var("g") + int(32 * (m / 4) + m % 4),
            false => var("g") + int(GROUPS * m),
        }
    }

    fn names(&self, prefix: &str) -> Vec<String> {
        (0..self.count).map(|m| format!("{prefix}{m}")).collect()
    }

    /// Declares `r0, r1, …`: this thread's entries of row `row` of the rows in shared
    /// `rows_sh` from `base` on.
    fn load_row(&self, base: &str, row: Expr, dk: i64) -> Vec<Stmt> {
        let names = self.names("r");
        let at = |m: i64| var(base) + row.clone() * int(dk) + self.key(m);
        match self.vector {
            true => names
                .chunks(4)
                .enumerate()
                .map(|(p, four)| load_vec("rows_sh", at(4 * p as i64), four))
                .collect(),
            false => names
                .iter()
                .enumerate()
                .map(|(m, r)| let_(r, Ty::F32, load("rows_sh", at(m as i64))))
                .collect(),
        }
    }

    /// `Σ_m r_m · s_m` over this thread's entries.
    fn dot(&self, s: &str) -> Expr {
        tree_sum(
            self.names("r")
                .iter()
                .zip(self.names(s))
                .map(|(r, s)| var(r) * var(&s))
                .collect(),
        )
    }
}

/// Issues the `cp.async`s (4 f32 each) of `rows` rows of `width` elements (a multiple of 4):
/// for row `t` and each 4 elements from `k`, `src[src_row + k]` to `dst[dst_at + t·width +
/// k]`, or zeros where `valid` is false; `src_row` and `valid` are expressions of `t` and `k`,
/// which this declares.
fn copy_rows_async(
    (dst, dst_at): (&str, Expr),
    (src, src_row): (&str, Expr),
    rows: Expr,
    width: i64,
    valid: Expr,
) -> Stmt {
    let pieces = width / 4;
    let (t, k) = match pieces {
        1 => (var("e"), int(0)),
        _ => (var("e") / int(pieces), rem(var("e"), int(pieces)) * int(4)),
    };
    let row_at = match dst_at {
        Expr::Int(0) => var("t") * int(width),
        at => at + var("t") * int(width),
    };
    strided(
        "e",
        rows * int(pieces),
        vec![
            let_("t", Ty::I32, t),
            let_("k", Ty::I32, k),
            Stmt::CpAsync(Box::new(AsyncCopy {
                dst: dst.into(),
                dst_index: row_at + var("k"),
                src: src.into(),
                src_index: src_row + var("k"),
                valid,
            })),
        ],
    )
}

/// The state's walk over each sequence's chunks (see the module's description): per chunk `δ =
/// U − W·S`, the outputs, the states a batched step keeps after rows (`row_checkpoint`), the
/// state after the chunk; the state after the step into its slot. The chunks are `CHUNK` rows
/// of the sequence from its first row of the step, as [`chunk_prepare`] took them. Grid: `seqs`
/// × [`chunk_state_blocks_per_sequence`].
///
/// Each phase's rows come in by `cp.async` while the phase before computes, through two halves
/// of `rows_sh`: while `δ` reads W from one half the chunk's q rows land in the other; while
/// the outputs read q, its k rows land over W; while the state update reads k, the next
/// chunk's W lands over q, with its P, U and row scales (two halves too, as the update reads
/// this chunk's). q and k land as the convolution left them, their scales applied to each
/// row's sum instead.
pub fn chunk_state(name: &str, origin: &str, layout: CacheLayout, spec: &DeltaNetSpec) -> Kernel {
    assert!(
        supports(spec),
        "the chunked delta rule does not take {}",
        spec_text(spec)
    );
    let columns = state_columns(spec) as i64;
    let (dk, dv, vh) = (spec.key_dim as i64, spec.value_dim as i64, spec.value_heads as i64);
    let tiles = spec.value_dim.div_ceil(columns as usize) as i64;
    let key_width = (spec.key_heads * spec.key_dim) as i64;
    let channels = spec.conv_channels() as i64;
    let chunk = CHUNK as i64;
    // δ's rows: 4 more than its columns, so the lanes of a warp (8 rows, 4 columns) reading it
    // fall in 32 different banks.
    let ds = columns + 4;
    let entries = Entries::of(spec);
    let states = entries.names("s");
    let batched = layout == CacheLayout::Batched;
    let column_sum = |value: &str| -> Vec<Stmt> {
        [4, 2, 1]
            .map(|mask| assign(value, var(value) + shfl_xor(var(value), mask)))
            .to_vec()
    };
    let delta = |row: Expr| load("delta_sh", row * int(ds) + var("col"));
    // Row `t`'s scale `which` of this chunk (see `SCALES`).
    let scale = |t: Expr, which: i64| load("scales_sh", var("scales_here") + t * int(SCALES) + int(which));
    let rows_of = |from: Expr, width: i64| scratch_row(from, var("t"), vh, width);
    // The W, U (this block's columns), P rows and row scales of the chunk of `rows` rows from
    // step row `from`, into `rows_sh` from `rows_at` and `scales_sh` from `scales_at`.
    let prepared = |from: Expr, rows: Expr, rows_at: Expr, scales_at: Expr| {
        vec![
            copy_rows_async(
                ("rows_sh", rows_at),
                ("chunk_w", rows_of(from.clone(), dk)),
                rows.clone(),
                dk,
                Expr::Bool(true),
            ),
            copy_rows_async(
                ("u_sh", int(0)),
                ("chunk_u", rows_of(from.clone(), dv) + var("col0")),
                rows.clone(),
                columns,
                lt(var("col0") + var("k"), int(dv)),
            ),
            copy_rows_async(
                ("p_sh", int(0)),
                ("chunk_p", rows_of(from.clone(), chunk)),
                rows.clone(),
                chunk,
                Expr::Bool(true),
            ),
            copy_rows_async(
                ("scales_sh", scales_at),
                ("chunk_scales", rows_of(from, SCALES)),
                rows,
                SCALES,
                Expr::Bool(true),
            ),
        ]
    };
    // The chunk's q or k rows (`offset` into a conv row) into `rows_sh` from `rows_at`.
    let conv_rows = |offset: i64, rows_at: &str| {
        copy_rows_async(
            ("rows_sh", var(rows_at)),
            (
                "conv",
                (var("c0") + var("t")) * int(channels) + int(offset) + var("key_head") * int(dk),
            ),
            var("n"),
            dk,
            Expr::Bool(true),
        )
    };
    // Rows of the chunk from step row `from` (the sequence's last row is `last_row`).
    let rows_from = |from: Expr| bin(BinOp::Min, int(chunk), var("last_row") + int(1) - from);

    let mut body = vec![
        let_("s", Ty::I32, bid() / int(vh * tiles)),
        let_("h", Ty::I32, rem(bid() / int(tiles), int(vh))),
        let_("col", Ty::I32, tid() / int(GROUPS)),
        let_("col0", Ty::I32, rem(bid(), int(tiles)) * int(columns)),
        let_("j", Ty::I32, var("col0") + var("col")),
        let_("g", Ty::I32, rem(tid(), int(GROUPS))),
        let_("active", Ty::Bool, lt(var("j"), int(dv))),
    ];
    body.extend(locate_sequence(layout, var("s")));
    body.extend(head_matrix(spec));
    // The state's column j at this thread's keys (stored by columns, `[value_heads, value_dim,
    // key_dim]`): zero for a fresh sequence.
    for (m, s) in states.iter().enumerate() {
        body.push(let_(s, Ty::F32, f(0.0)));
        body.push(if_(
            and(var("active"), un(UnOp::Not, var("fresh"))),
            vec![assign(
                s,
                load("state", var("matrix") + var("j") * int(dk) + entries.key(m as i64)),
            )],
        ));
    }
    // The first chunk's W, U, P and scales, into the first halves.
    body.extend(prepared(var("first_row"), rows_from(var("first_row")), int(0), int(0)));
    body.push(Stmt::CpAsyncCommit);

    let mut chunk_body = vec![
        let_("n", Ty::I32, rows_from(var("c0"))),
        // This chunk's W, k and scales are in the halves `half` of `rows_sh` and `scales_sh`,
        // its q and the next chunk's W and scales in the others.
        let_(
            "half",
            Ty::I32,
            rem((var("c0") - var("first_row")) / int(chunk), int(2)),
        ),
        let_("here", Ty::I32, var("half") * int(chunk * dk)),
        let_("there", Ty::I32, (int(1) - var("half")) * int(chunk * dk)),
        let_("scales_here", Ty::I32, var("half") * int(chunk * SCALES)),
        let_("scales_there", Ty::I32, (int(1) - var("half")) * int(chunk * SCALES)),
        conv_rows(0, "there"),
        Stmt::CpAsyncCommit,
        // All but the q rows just asked for: W, U, P and the scales.
        Stmt::CpAsyncWait(1),
        Stmt::SyncThreads,
    ];
    // δ_t = U_t − W_t·S₀ (zero past the chunk's rows, which the outputs' sums read).
    let mut deltas = entries.load_row("here", var("t"), dk);
    deltas.push(let_("part", Ty::F32, entries.dot("s")));
    deltas.extend(column_sum("part"));
    deltas.push(if_(
        eq(var("g"), int(0)),
        vec![store(
            "delta_sh",
            var("t") * int(ds) + var("col"),
            load("u_sh", var("t") * int(columns) + var("col")) - var("part"),
        )],
    ));
    chunk_body.extend([
        for_("t", int(0), var("n"), int(1), deltas),
        if_(
            eq(var("g"), int(0)),
            vec![for_(
                "t",
                var("n"),
                int(chunk),
                int(1),
                vec![store("delta_sh", var("t") * int(ds) + var("col"), f(0.0))],
            )],
        ),
        Stmt::SyncThreads,
        // k over W.
        conv_rows(key_width, "here"),
        Stmt::CpAsyncCommit,
        Stmt::CpAsyncWait(1),
        Stmt::SyncThreads,
    ]);
    // o_t = Γ_t q̂_t·S₀ + Σ_{i ≤ t} P[t, i] δ_i, this lane taking the rows i ≡ g (mod 8).
    let mut outputs = entries.load_row("there", var("t"), dk);
    let earlier: Vec<Expr> = (0..chunk / GROUPS)
        .map(|u| {
            let i = var("g") + int(GROUPS * u);
            load("p_sh", var("t") * int(chunk) + i.clone()) * delta(i)
        })
        .collect();
    outputs.push(let_(
        "part",
        Ty::F32,
        scale(var("t"), 1) * entries.dot("s") + tree_sum(earlier),
    ));
    outputs.extend(column_sum("part"));
    outputs.push(if_(
        and(var("active"), eq(var("g"), int(0))),
        vec![store(
            "out",
            (var("c0") + var("t")) * int(vh * dv) + var("h") * int(dv) + var("j"),
            var("part"),
        )],
    ));
    let next = var("c0") + int(chunk);
    chunk_body.extend([
        for_("t", int(0), var("n"), int(1), outputs),
        Stmt::SyncThreads,
        // The next chunk's W (over q), U, P and scales (block-uniform; after the last chunk an
        // empty group).
        if_(
            bin(BinOp::Le, next.clone(), var("last_row")),
            prepared(next.clone(), rows_from(next), var("there"), var("scales_there")),
        ),
        Stmt::CpAsyncCommit,
        Stmt::CpAsyncWait(1),
        Stmt::SyncThreads,
    ]);
    // k̂_i's scale with the weight of δ_i in a state after the chunk's row `i`.
    let key_weight = |decay: Expr| delta(var("i")) * decay * scale(var("i"), 2);
    if batched {
        // S_t = Γ_t S₀ + Σ_{i ≤ t} (Γ_t / Γ_i) k̂_i δ_iᵀ where the step keeps the state after row t.
        let kept = entries.names("kept");
        let mut sum = entries.load_row("here", var("i"), dk);
        sum.push(let_(
            "weight",
            Ty::F32,
            key_weight(un(UnOp::Exp, var("b_t") - scale(var("i"), 0))),
        ));
        for (kept, r) in kept.iter().zip(entries.names("r")) {
            sum.push(assign(kept, var(kept) + var(&r) * var("weight")));
        }
        let mut at_row = vec![let_("b_t", Ty::F32, scale(var("t"), 0))];
        for (kept, s) in kept.iter().zip(&states) {
            at_row.push(let_(kept, Ty::F32, un(UnOp::Exp, var("b_t")) * var(s)));
        }
        at_row.push(for_("i", int(0), var("t") + int(1), int(1), sum));
        let stores = kept
            .iter()
            .enumerate()
            .map(|(m, kept)| {
                let at = var("place") * int(spec.state_len() as i64) + var("head_matrix");
                store(
                    "checkpoints",
                    at + var("j") * int(dk) + entries.key(m as i64),
                    var(kept),
                )
            })
            .collect();
        at_row.push(at_checkpoint(Some(var("active")), stores));
        chunk_body.push(for_(
            "t",
            int(0),
            var("n"),
            int(1),
            vec![
                // Block-uniform: every thread reads the same row's place.
                let_("place", Ty::I32, load("row_checkpoint", var("c0") + var("t"))),
                if_(bin(BinOp::Ge, var("place"), int(0)), at_row),
            ],
        ));
    }
    // S = Γ_last S₀ + Σ_i (Γ_last / Γ_i) k̂_i δ_iᵀ.
    chunk_body.push(let_("to_end", Ty::F32, un(UnOp::Exp, scale(var("n") - int(1), 0))));
    for s in &states {
        chunk_body.push(assign(s, var(s) * var("to_end")));
    }
    let mut update = entries.load_row("here", var("i"), dk);
    update.push(let_("weight", Ty::F32, key_weight(scale(var("i"), 3))));
    for (s, r) in states.iter().zip(entries.names("r")) {
        update.push(assign(s, var(s) + var(&r) * var("weight")));
    }
    chunk_body.extend([for_("i", int(0), var("n"), int(1), update), Stmt::SyncThreads]);
    body.push(for_(
        "c0",
        var("first_row"),
        var("last_row") + int(1),
        int(chunk),
        chunk_body,
    ));
    let keep = states
        .iter()
        .enumerate()
        .map(|(m, s)| {
            store(
                "state",
                var("matrix") + var("j") * int(dk) + entries.key(m as i64),
                var(s),
            )
        })
        .collect();
    body.push(if_(var("active"), keep));
    let mut params = vec![buffer("conv", Ty::F32, false)];
    params.extend(scratch(spec).map(|(name, _)| buffer(name, Ty::F32, false)));
    params.extend([
        buffer("state", Ty::F32, true),
        buffer("out", Ty::F32, true),
        scalar("seqs", Ty::I32),
        scalar("tokens", Ty::I32),
    ]);
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: gated delta rule over chunks of {CHUNK} rows ({}), {GROUPS} lanes a column, {columns} columns a block, {}",
            spec_text(spec),
            layout.describe()
        ),
        params: [params, sequence_params(layout), checkpoint_params(layout)].concat(),
        shared: vec![
            shared_f32("rows_sh", 2 * CHUNK * dk as usize),
            shared_f32("u_sh", CHUNK * columns as usize),
            shared_f32("p_sh", CHUNK * CHUNK),
            shared_f32("delta_sh", CHUNK * ds as usize),
            shared_f32("scales_sh", 2 * CHUNK * SCALES as usize),
        ],
        block_dim: (GROUPS * columns) as u32,
        grid: var("seqs") * int(chunk_state_blocks_per_sequence(spec) as i64),
        body,
    }
}
