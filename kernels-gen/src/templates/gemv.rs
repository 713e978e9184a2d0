//! GEMV: `out[t, r] = Σ_k x'[t, k]·W[r, k]`, where `x'` is `x` (rows `x_stride` apart, so a
//! column slice of a fused output is read in place) or, with the RMSNorm prologue,
//! `rsqrt(mean(x[t]²) + eps)·x[t]·(g + o)`: the norm's sum of squares and the scaled dot are
//! taken in the same pass over the row, so the normalised row is never written (what
//! `fuse_norm_matmul` buys on a GPU). Under a residual prologue (`add_rms_norm_matmul`) the row
//! is `x + b`, added as it is loaded, and `out`'s rows are `[x + b | product]`.
//!
//! Each warp takes `rows_per_warp` consecutive weight rows (one unless the plan asks for more:
//! see [`GemvSpec::with_rows_per_warp`]) and carries `tokens_per_pass` token rows through each
//! pass over them, so a step of T tokens reads the weights ⌈T / tokens_per_pass⌉ times
//! (decode: one token, one pass; the prefill variant carries 4). Dense weights whose rows are a
//! whole number of vectors are read with 16-byte loads (8 bf16 or 4 f32 per lane, 512 bytes
//! per warp per load), which is what lets a memory-bound GEMV approach copy bandwidth; the
//! GGUF formats are decoded 32 elements per lane: a whole block of the 32-element formats (its
//! scale read once, a byte giving two nibbles), a sub-block of the K-quants (its scales
//! decoded once). Rows past `tokens` in the last pass are
//! computed on a clamped copy of the last row and not stored, so the inner loop has no branch.

use super::quant::WeightFormat;
use super::{warp_sum, BLOCK};
use crate::dsl::*;
use ir::GluAct;

/// An RMSNorm applied to `x` inside the GEMV (`g` is its weight, `offset` added to it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NormPrologue {
    pub eps: f32,
    pub offset: f32,
    /// The row normalised is `x + b` (a residual add, `add_rms_norm_matmul`): `out`'s rows are
    /// then `[x + b | product]`, `k + n` wide, the sum written by the blocks of the first
    /// weight rows.
    pub residual: bool,
}

impl NormPrologue {
    pub fn new(eps: f32, offset: f32) -> Self {
        Self {
            eps,
            offset,
            residual: false,
        }
    }

    pub fn with_residual(self) -> Self {
        Self { residual: true, ..self }
    }
}

/// Whether `norm` adds a residual in the prologue.
pub fn residual(norm: Option<NormPrologue>) -> bool {
    norm.is_some_and(|n| n.residual)
}

/// The parameters `x` and, under a residual prologue, `b` then the norm's `g`: what a GEMV or
/// GEMM with the prologue reads before its weights.
pub fn prologue_params(norm: Option<NormPrologue>) -> Vec<Param> {
    let mut params = vec![buffer("x", Ty::F32, false)];
    if residual(norm) {
        params.push(buffer("b", Ty::F32, false));
    }
    if norm.is_some() {
        params.push(buffer("g", Ty::F32, false));
    }
    params
}

/// The product's columns: `n` (the weight rows), or half of them under a GLU epilogue (a
/// gate row and its up row make one column).
pub fn product_cols(glu: Option<GluAct>) -> Expr {
    match glu {
        Some(_) => var("n") / int(2),
        None => var("n"),
    }
}

/// Elements in a row of `out`: the product's, or under a residual prologue `k` more (the sum
/// before it).
pub fn out_row_len(norm: Option<NormPrologue>, glu: Option<GluAct>) -> Expr {
    match residual(norm) {
        true => var("k") + product_cols(glu),
        false => product_cols(glu),
    }
}

/// The element of `out` for product (`row`, `col`): after the sum under a residual prologue.
pub fn out_index(norm: Option<NormPrologue>, glu: Option<GluAct>, row: Expr, col: Expr) -> Expr {
    let at = row * out_row_len(norm, glu) + col;
    match residual(norm) {
        true => at + var("k"),
        false => at,
    }
}

/// `act(gate)·up`, the GLU epilogue's value.
pub fn gated(act: GluAct, gate: Expr, up: Expr) -> Expr {
    let activated = match act {
        GluAct::Silu => super::elementwise::silu(gate),
        GluAct::GeluTanh => super::elementwise::gelu_tanh(gate),
    };
    activated * up
}

/// What to generate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemvSpec {
    pub weight: WeightFormat,
    pub norm: Option<NormPrologue>,
    /// Token rows a warp carries through one pass over its weight row.
    pub tokens_per_pass: usize,
    /// Elements per weight load: 1, a 16-byte vector of dense weights (needs `k` to be a
    /// multiple of it, so every row starts aligned), or 32: a whole GGUF block per lane.
    pub vector: usize,
    /// `x` read four floats per load rather than one (see [`with_x_vectors`](Self::with_x_vectors)).
    pub x_vector: bool,
    /// A GLU epilogue: the weights are a joined gate/up (`n` rows, gates first), each warp
    /// computes gate row `r` and up row `r + n/2` and writes `act(gate)·up`.
    pub glu: Option<GluAct>,
    /// How many steps ahead the decode GEMV prefetches its weights into L2 (see
    /// `prefetched`); 0 for none, the default.
    pub prefetch_steps: usize,
    /// Weight rows a warp computes together, each activation vector loaded once for all of
    /// them (see [`with_rows_per_warp`](Self::with_rows_per_warp)).
    pub rows_per_warp: usize,
}

impl GemvSpec {
    /// The decode GEMV for `k`-wide rows of `weight`: one token per pass, vector loads where
    /// the rows allow them.
    pub fn decode(weight: WeightFormat, k: usize) -> Self {
        let vector = match weight {
            WeightFormat::Dense(Ty::Bf16 | Ty::F16) => 8,
            WeightFormat::Dense(Ty::F32) => 4,
            WeightFormat::Blocks(format)
                if super::quant::decodes_whole_blocks(format) || super::quant::decodes_sub_blocks(format) =>
            {
                32
            }
            _ => 1,
        };
        Self {
            weight,
            norm: None,
            tokens_per_pass: 1,
            vector: if k.is_multiple_of(vector) { vector } else { 1 },
            x_vector: false,
            glu: None,
            prefetch_steps: 0,
            rows_per_warp: 1,
        }
    }

    /// Carry `rows` consecutive weight rows a warp (1 to [`MAX_ROWS_PER_WARP`]; dense weights
    /// read in vectors only, others keep one). A warp reads its whole activation row (f32:
    /// twice a bf16 weight row's bytes, four times with a residual `x + b`) for each pass over
    /// its weights; on an H200 those reads from L2, not the weights from memory, bound the
    /// GEMVs whose warps walk short rows (an 8B model's QKV reads 201 MB from L2 for 50 MB of
    /// weights at one row a warp; four tokens a pass, eight times the weights' bytes). Sharing
    /// each activation load among `rows` weight rows divides that traffic by `rows`, and puts
    /// `rows` weight loads in flight per step where one was. Each row's sum is taken in the same order as with one row a
    /// warp: the results are the same bits.
    pub fn with_rows_per_warp(self, rows: usize) -> Self {
        assert!(
            (1..=MAX_ROWS_PER_WARP).contains(&rows),
            "{rows} rows a warp (1 to {MAX_ROWS_PER_WARP})"
        );
        let shares = matches!(self.weight, WeightFormat::Dense(_)) && self.vector > 1;
        Self {
            rows_per_warp: if shares { rows } else { 1 },
            ..self
        }
    }

    /// Prefetch `steps` steps ahead (0: not at all).
    pub fn with_prefetch_steps(self, steps: usize) -> Self {
        Self {
            prefetch_steps: steps,
            ..self
        }
    }

    /// Read `x` with 16-byte loads, where the caller knows every row of it starts 16-byte
    /// aligned (`x_stride` and the view's first column multiples of 4). A lane's elements are
    /// consecutive, so scalar loads of `x` have a warp touch eight cache lines per load
    /// instruction (32 for GGUF blocks) for 32 floats: at batch 1 that, not the weights, would
    /// bound the GEMV. Only where a weight load covers a multiple of 4 elements.
    pub fn with_x_vectors(self) -> Self {
        Self {
            x_vector: self.vector.is_multiple_of(4),
            ..self
        }
    }

    /// Carrying 4 tokens per pass: the variant for prefill steps. Not 8: for 256-thread blocks
    /// sm_120a's ptxas holds a kernel to 40 registers, and 8 rows of accumulators spill there.
    pub fn prefill(self) -> Self {
        Self {
            tokens_per_pass: 4,
            // A GGUF block's 32 values for 4 tokens through vector loads push ptxas into
            // spills (sm_100a): that variant keeps scalar loads.
            x_vector: self.x_vector && self.vector <= 8,
            ..self
        }
    }

    /// The GLU epilogue (dense weights only: a block format's decoding declares its helpers
    /// once per step).
    pub fn with_glu(self, act: GluAct) -> Self {
        assert!(
            matches!(self.weight, WeightFormat::Dense(_)),
            "the GLU epilogue takes dense weights"
        );
        Self { glu: Some(act), ..self }
    }

    /// The RMSNorm prologue.
    pub fn with_norm(self, norm: NormPrologue) -> Self {
        Self {
            norm: Some(norm),
            ..self
        }
    }
}

/// The most weight rows a warp carries: four rows of four tokens are sixteen accumulators.
pub const MAX_ROWS_PER_WARP: usize = 4;

fn names(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

/// The variable holding the warp's `q`-th weight row: `r`, then `r1`, `r2`, ….
fn row_var(q: usize) -> String {
    match q {
        0 => "r".into(),
        _ => format!("r{q}"),
    }
}

/// `base` for the names of the warp's first weight row, `base` + `r{q}_` for its `q`-th: so
/// one row a warp generates what it always did.
fn of_row(base: &str, q: usize) -> String {
    match q {
        0 => base.into(),
        _ => format!("{base}r{q}_"),
    }
}

pub fn gemv(name: &str, origin: &str, spec: GemvSpec) -> Kernel {
    let warps = (BLOCK / 32) as i64;
    let mut params = prologue_params(spec.norm);
    params.extend([
        buffer("w", spec.weight.buffer_ty(), false),
        buffer("out", Ty::F32, true),
        scalar("tokens", Ty::I32),
        scalar("n", Ty::I32),
        scalar("k", Ty::I32),
        scalar("x_stride", Ty::I32),
    ]);
    if residual(spec.norm) {
        params.push(scalar("b_stride", Ty::I32));
    }
    let prologue = describe(spec.norm);
    let epilogue = match spec.glu {
        Some(act) => format!(" + {act:?} GLU epilogue"),
        None => String::new(),
    };
    let rows = spec.rows_per_warp;
    let rows_note = match rows {
        1 => String::new(),
        _ => format!(", {rows} weight rows per warp"),
    };
    let first_row = match rows {
        1 => bid() * int(warps) + warp(),
        _ => (bid() * int(warps) + warp()) * int(rows as i64),
    };
    // The warp's other rows; past the last row, a copy of it (computed, not stored), so the
    // inner loop has no branch.
    let mut in_range: Vec<Stmt> = (1..rows)
        .map(|q| {
            let row = var("r") + int(q as i64);
            let last = product_cols(spec.glu) - int(1);
            let_(
                &row_var(q),
                Ty::I32,
                select(bin(BinOp::Lt, row.clone(), product_cols(spec.glu)), row, last),
            )
        })
        .collect();
    in_range.push(for_(
        "first",
        int(0),
        var("tokens"),
        int(spec.tokens_per_pass as i64),
        pass(&spec),
    ));
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: {prologue}matmul x·Wᵀ{epilogue}, {} weights, {} token(s) per pass{rows_note}",
            spec.weight.describe(),
            spec.tokens_per_pass
        ),
        params,
        shared: vec![],
        block_dim: BLOCK,
        grid: super::blocks_for(product_cols(spec.glu), warps * rows as i64),
        body: vec![
            let_("r", Ty::I32, first_row),
            // Whole warps leave together, so the shuffles below always see 32 lanes.
            if_(bin(BinOp::Lt, var("r"), product_cols(spec.glu)), in_range),
        ],
    }
}

/// The prologue's words in a kernel's origin line.
pub fn describe(norm: Option<NormPrologue>) -> &'static str {
    match norm {
        Some(n) if n.residual => "residual add + rms_norm prologue + ",
        Some(_) => "rms_norm prologue + ",
        None => "",
    }
}

/// One pass over the warp's weight rows for token rows `first..first + tokens_per_pass`.
fn pass(spec: &GemvSpec) -> Vec<Stmt> {
    let tokens = spec.tokens_per_pass;
    let rows = spec.rows_per_warp;
    let (t, sq) = (names("row", tokens), names("sq", tokens));
    // Per weight row and token: under a GLU epilogue `acc` sums the gate row, `up` the up row.
    let acc: Vec<Vec<String>> = (0..rows).map(|q| names(&of_row("acc", q), tokens)).collect();
    let up: Vec<Vec<String>> = (0..rows).map(|q| names(&of_row("up", q), tokens)).collect();
    let mut out = Vec::new();
    for (j, t_j) in t.iter().enumerate() {
        let row = var("first") + int(j as i64);
        let clamped = select(bin(BinOp::Lt, row.clone(), var("tokens")), row, var("tokens") - int(1));
        out.push(let_(t_j, Ty::I32, clamped));
    }
    for j in 0..tokens {
        for q in 0..rows {
            out.push(let_(&acc[q][j], Ty::F32, f(0.0)));
            if spec.glu.is_some() {
                out.push(let_(&up[q][j], Ty::F32, f(0.0)));
            }
        }
        if spec.norm.is_some() {
            out.push(let_(&sq[j], Ty::F32, f(0.0)));
        }
    }
    let (start, step) = (lane() * int(spec.vector as i64), int(32 * spec.vector as i64));
    let sums = Sums {
        acc: &acc,
        up: &up,
        sq: &sq,
    };
    let mut body = Vec::new();
    if prefetched(spec) {
        // The first steps' lines ahead of the loop, then each step the line `prefetch_steps` on.
        let ahead = spec.prefetch_steps as i64;
        for first in 1..ahead {
            out.extend(prefetch_weights(spec, start.clone() + step.clone() * int(first)));
        }
        body.extend(prefetch_weights(spec, var("i") + step.clone() * int(ahead)));
    }
    body.extend(k_step(spec, &t, &sums));
    out.push(for_("i", start, var("k"), step, body));
    for j in 0..tokens {
        for q in 0..rows {
            out.extend(warp_sum(&acc[q][j]));
            if spec.glu.is_some() {
                out.extend(warp_sum(&up[q][j]));
            }
        }
        if spec.norm.is_some() {
            out.extend(warp_sum(&sq[j]));
        }
    }
    let mut stores = Vec::new();
    for j in 0..tokens {
        let token = var("first") + int(j as i64);
        let scaled = |sum: &str| match spec.norm {
            Some(norm) => var(sum) * un(UnOp::Rsqrt, var(&sq[j]) / cast(Ty::F32, var("k")) + f(norm.eps)),
            None => var(sum),
        };
        for q in 0..rows {
            let value = match spec.glu {
                Some(act) => gated(act, scaled(&acc[q][j]), scaled(&up[q][j])),
                None => scaled(&acc[q][j]),
            };
            let at = out_index(spec.norm, spec.glu, token.clone(), var(&row_var(q)));
            // A row past the last (a clamped copy) is not stored; the first row never is past.
            let stored = match q {
                0 => bin(BinOp::Lt, token.clone(), var("tokens")),
                _ => and(
                    bin(BinOp::Lt, token.clone(), var("tokens")),
                    bin(BinOp::Lt, var("r") + int(q as i64), product_cols(spec.glu)),
                ),
            };
            stores.push(if_(stored, vec![store("out", at, value)]));
        }
    }
    out.push(if_(bin(BinOp::Eq, lane(), int(0)), stores));
    out
}

/// Whether the decode GEMV asks L2 for its weights `prefetch_steps` steps ahead: the one
/// token a pass, dense vector variants, where asked (none by default: on the second H200 run
/// the norm-prologue GEMVs were 10–16% slower with it, and sharing activation loads among
/// rows, [`GemvSpec::with_rows_per_warp`], puts more loads in flight). At batch 1 loads in
/// flight, not warps, are what the bandwidth needs (Little's law: 132 SMs × 48 warps × 512 B is about
/// 3 MB, under the ≈ 3.8 MB that 4.8 TB/s × 0.8 µs asks). NVRTC unrolls the plain GEMV's loop
/// and ptxas then issues two loads together; the norm-prologue bodies are larger, stay rolled,
/// and have one load in flight per warp: on the first H200 run the LM head read its weights
/// at 99% of copy bandwidth as a plain GEMV and at 78% behind the norm. Loads into registers
/// cannot be pushed further ahead from the source (read in the SASS: a second step's load in
/// the same iteration is sunk to its use; a step's load made in the step before is carried
/// round the loop in a register whose copy waits for it), but a prefetch has no register to
/// wait on. The plain GEMV, measured at 85–99%, does not prefetch unless asked (the GPU
/// check times it both ways).
fn prefetched(spec: &GemvSpec) -> bool {
    spec.prefetch_steps > 0
        && spec.tokens_per_pass == 1
        && spec.vector > 1
        && matches!(spec.weight, WeightFormat::Dense(_))
}

/// How many steps (a warp's 512 bytes of each weight row) ahead the decode GEMV prefetches,
/// unless told otherwise: four give every warp 2 KiB in flight a row, about 10 MB over the
/// GPU at 4 blocks an SM.
pub const PREFETCH_STEPS: usize = 4;

/// Prefetches of the lane's weight vector at element `i` of its rows (the up row's too under
/// a GLU epilogue), or of the row's last vector where `i` is past it.
fn prefetch_weights(spec: &GemvSpec, i: Expr) -> Vec<Stmt> {
    let last = var("k") - int(spec.vector as i64);
    let at = select(bin(BinOp::Lt, i.clone(), last.clone()), i, last);
    weight_rows(spec)
        .into_iter()
        .flat_map(|(row, up)| std::iter::once(row).chain(up))
        .map(|row| prefetch_l2("w", row * var("k") + at.clone()))
        .collect()
}

/// The warp's weight rows: each its row, and under a GLU epilogue its up row.
fn weight_rows(spec: &GemvSpec) -> Vec<(Expr, Option<Expr>)> {
    (0..spec.rows_per_warp)
        .map(|q| {
            let row = var(&row_var(q));
            let up = spec.glu.map(|_| row.clone() + var("n") / int(2));
            (row, up)
        })
        .collect()
}

/// A pass's running sums per token row: the product (the gate's under a GLU epilogue), the up
/// row's, and the sum of squares under a norm.
/// `acc` and `up` hold a name per token for each of the warp's weight rows.
struct Sums<'a> {
    acc: &'a [Vec<String>],
    up: &'a [Vec<String>],
    sq: &'a [String],
}

/// Elements `i..i + vector` of the warp's rows: the weights of every row first (loads in
/// flight together), scaled by the norm's `g + o`, then each token's products.
fn k_step(spec: &GemvSpec, t: &[String], sums: &Sums) -> Vec<Stmt> {
    let v = spec.vector;
    let mut out = Vec::new();
    // Per weight row: its weights, and its up row's under a GLU epilogue (dense: checked by
    // `with_glu`).
    let mut w = Vec::new();
    let mut w_up = Vec::new();
    for (q, (row, up_row)) in weight_rows(spec).into_iter().enumerate() {
        let (w_q, w_up_q) = (names(&of_row("w", q), v), names(&of_row("wu", q), v));
        if let Some(up_row) = up_row {
            match v {
                1 => out.extend(spec.weight.element(&w_up_q[0], up_row, var("k"), var("i"))),
                _ => out.push(load_vec("w", up_row * var("k") + var("i"), &w_up_q)),
            }
        }
        out.extend(row_weights(spec, row, &w_q));
        w.push(w_q);
        w_up.push(w_up_q);
    }
    // The weight each x element meets: W, or W·(g + o) under the norm.
    let (u, u_up) = match spec.norm {
        None => (w, w_up),
        Some(norm) => {
            let g = names("g", v);
            for chunk in (0..v).step_by(4) {
                let width = (v - chunk).min(4);
                let index = var("i") + int(chunk as i64);
                match width {
                    1 => out.push(let_(&g[chunk], Ty::F32, load("g", index))),
                    _ => out.push(load_vec("g", index, &g[chunk..chunk + width])),
                }
            }
            let scale = |e: usize| var(&g[e]) + f(norm.offset);
            let (mut u, mut u_up) = (Vec::new(), Vec::new());
            for q in 0..spec.rows_per_warp {
                let (u_q, u_up_q) = (names(&of_row("u", q), v), names(&of_row("uu", q), v));
                for e in 0..v {
                    out.push(let_(&u_q[e], Ty::F32, var(&w[q][e]) * scale(e)));
                    if spec.glu.is_some() {
                        out.push(let_(&u_up_q[e], Ty::F32, var(&w_up[q][e]) * scale(e)));
                    }
                }
                u.push(u_q);
                u_up.push(u_up_q);
            }
            (u, u_up)
        }
    };
    for (j, t_j) in t.iter().enumerate() {
        let xs = names(&format!("x{j}_"), v);
        let load_x = |first: usize, count: usize| load_row(spec, t_j, &xs, first, count);
        // A dense vector's x loads all come first (two at most: ptxas schedules that best); for
        // a GGUF block's 32 values each load comes just before its values are used, so fewer
        // are live at once.
        let hoisted = spec.x_vector && v <= 8;
        if hoisted {
            for chunk in (0..v).step_by(4) {
                out.extend(load_x(chunk, 4));
            }
        }
        for (e, x) in xs.iter().enumerate() {
            match (spec.x_vector, hoisted) {
                (true, true) => {}
                (true, false) if e % 4 == 0 => out.extend(load_x(e, 4)),
                (true, false) => {}
                (false, _) => out.extend(load_x(e, 1)),
            }
            if spec.norm.is_some() {
                out.push(assign(&sums.sq[j], var(&sums.sq[j]) + var(x) * var(x)));
            }
            for q in 0..spec.rows_per_warp {
                let acc = &sums.acc[q][j];
                out.push(assign(acc, var(acc) + var(x) * var(&u[q][e])));
                if spec.glu.is_some() {
                    let up = &sums.up[q][j];
                    out.push(assign(up, var(up) + var(x) * var(&u_up[q][e])));
                }
            }
        }
    }
    out
}

/// Declare `w` (`vector` names): elements `i..i + vector` of weight row `row`, as the
/// weight's format stores them.
fn row_weights(spec: &GemvSpec, row: Expr, w: &[String]) -> Vec<Stmt> {
    let v = spec.vector;
    match spec.weight {
        WeightFormat::Blocks(format) if v == 32 => {
            // The block (or K-quant sub-block) holding elements i..i + 32 of the row: rows are
            // whole blocks.
            let (elements, bytes) = super::quant::block_layout(format).expect("a block format");
            let base = (row * (var("k") / int(elements)) + var("i") / int(elements)) * int(bytes);
            match super::quant::decodes_sub_blocks(format) {
                true => {
                    let sub = rem(var("i") / int(32), int(elements / 32));
                    super::quant::k_sub_block_weights(format, "w", base, sub, 0..32)
                }
                false => super::quant::block_weights(format, "w", base, 0..32),
            }
        }
        _ if v > 1 => vec![load_vec("w", row * var("k") + var("i"), w)],
        _ => spec.weight.element(&w[0], row, var("k"), var("i")),
    }
}

/// Declare `xs[first..first + count]`: elements `i + first..` of token row `t`, one 16-byte
/// load when `count` is 4. Under a residual prologue they are `x + b`, and the warp of weight
/// row 0 writes them to the sum's half of `out` (each sum once; a clamped row's again, alike).
fn load_row(spec: &GemvSpec, t: &str, xs: &[String], first: usize, count: usize) -> Vec<Stmt> {
    let at = |stride: &str, e: usize| var(t) * var(stride) + var("i") + int(e as i64);
    let names = &xs[first..first + count];
    if !residual(spec.norm) {
        return match count {
            1 => vec![let_(&names[0], Ty::F32, load("x", at("x_stride", first)))],
            _ => vec![load_vec("x", at("x_stride", first), names)],
        };
    }
    let (a, b): (Vec<String>, Vec<String>) = names.iter().map(|x| (format!("{x}a"), format!("{x}b"))).unzip();
    let mut out = match count {
        1 => vec![
            let_(&a[0], Ty::F32, load("x", at("x_stride", first))),
            let_(&b[0], Ty::F32, load("b", at("b_stride", first))),
        ],
        _ => vec![
            load_vec("x", at("x_stride", first), &a),
            load_vec("b", at("b_stride", first), &b),
        ],
    };
    out.extend((0..count).map(|e| let_(&names[e], Ty::F32, var(&a[e]) + var(&b[e]))));
    let sums = (0..count)
        .map(|e| {
            let col = var("i") + int((first + e) as i64);
            store("out", var(t) * out_row_len(spec.norm, spec.glu) + col, var(&names[e]))
        })
        .collect();
    out.push(if_(bin(BinOp::Eq, var("r"), int(0)), sums));
    out
}
