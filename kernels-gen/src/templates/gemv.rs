//! GEMV: `out[t, r] = Σ_k x'[t, k]·W[r, k]`, where `x'` is `x` (rows `x_stride` apart, so a
//! column slice of a fused output is read in place) or, with the RMSNorm prologue,
//! `rsqrt(mean(x[t]²) + eps)·x[t]·(g + o)`: the norm's sum of squares and the scaled dot are
//! taken in the same pass over the row, so the normalised row is never written (what
//! `fuse_norm_matmul` buys on a GPU). Under a residual prologue (`add_rms_norm_matmul`) the row
//! is `x + b`, added as it is loaded, and `out`'s rows are `[x + b | product]`.
//!
//! One warp per weight row; the warp carries `tokens_per_pass` token rows through each pass
//! over its weight row, so a step of T tokens reads the weights ⌈T / tokens_per_pass⌉ times
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
    /// `prefetched`); 0 for none, the plain GEMV's default; a norm prologue's is
    /// [`PREFETCH_STEPS`].
    pub prefetch_steps: usize,
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

    /// The RMSNorm prologue, and with it the L2 prefetch unless one is set (see
    /// `prefetched`: the loop this prologue makes keeps one weight load in flight without).
    pub fn with_norm(self, norm: NormPrologue) -> Self {
        Self {
            norm: Some(norm),
            prefetch_steps: match self.prefetch_steps {
                0 => PREFETCH_STEPS,
                steps => steps,
            },
            ..self
        }
    }
}

fn names(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
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
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: {prologue}matmul x·Wᵀ{epilogue}, {} weights, {} token(s) per pass",
            spec.weight.describe(),
            spec.tokens_per_pass
        ),
        params,
        shared: vec![],
        block_dim: BLOCK,
        grid: super::blocks_for(product_cols(spec.glu), warps),
        body: vec![
            let_("r", Ty::I32, bid() * int(warps) + warp()),
            // Whole warps leave together, so the shuffles below always see 32 lanes.
            if_(
                bin(BinOp::Lt, var("r"), product_cols(spec.glu)),
                vec![for_(
                    "first",
                    int(0),
                    var("tokens"),
                    int(spec.tokens_per_pass as i64),
                    pass(&spec),
                )],
            ),
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

/// One pass over weight row `r` for token rows `first..first + tokens_per_pass`.
fn pass(spec: &GemvSpec) -> Vec<Stmt> {
    let tokens = spec.tokens_per_pass;
    let (t, acc, sq) = (names("row", tokens), names("acc", tokens), names("sq", tokens));
    // Under a GLU epilogue `acc` sums the gate row, `up` the up row.
    let up = names("up", tokens);
    let mut out = Vec::new();
    for (j, t_j) in t.iter().enumerate() {
        let row = var("first") + int(j as i64);
        let clamped = select(bin(BinOp::Lt, row.clone(), var("tokens")), row, var("tokens") - int(1));
        out.push(let_(t_j, Ty::I32, clamped));
    }
    for j in 0..tokens {
        out.push(let_(&acc[j], Ty::F32, f(0.0)));
        if spec.glu.is_some() {
            out.push(let_(&up[j], Ty::F32, f(0.0)));
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
        out.extend(warp_sum(&acc[j]));
        if spec.glu.is_some() {
            out.extend(warp_sum(&up[j]));
        }
        if spec.norm.is_some() {
            out.extend(warp_sum(&sq[j]));
        }
    }
    let stores = (0..tokens)
        .map(|j| {
            let row = var("first") + int(j as i64);
            let scaled = |sum: &str| match spec.norm {
                Some(norm) => var(sum) * un(UnOp::Rsqrt, var(&sq[j]) / cast(Ty::F32, var("k")) + f(norm.eps)),
                None => var(sum),
            };
            let value = match spec.glu {
                Some(act) => gated(act, scaled(&acc[j]), scaled(&up[j])),
                None => scaled(&acc[j]),
            };
            if_(
                bin(BinOp::Lt, row.clone(), var("tokens")),
                vec![store("out", out_index(spec.norm, spec.glu, row, var("r")), value)],
            )
        })
        .collect();
    out.push(if_(bin(BinOp::Eq, lane(), int(0)), stores));
    out
}

/// Whether the decode GEMV asks L2 for its weights `prefetch_steps` steps ahead: the one
/// token a pass, dense vector variants (by default those with a norm prologue, see
/// [`GemvSpec::with_norm`]). At batch 1 loads in flight, not
/// warps, are what the bandwidth needs (Little's law: 132 SMs × 48 warps × 512 B is about
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
    let mut rows = vec![var("r")];
    if spec.glu.is_some() {
        rows.push(var("r") + var("n") / int(2));
    }
    rows.into_iter()
        .map(|row| prefetch_l2("w", row * var("k") + at.clone()))
        .collect()
}

/// A pass's running sums per token row: the product (the gate's under a GLU epilogue), the up
/// row's, and the sum of squares under a norm.
struct Sums<'a> {
    acc: &'a [String],
    up: &'a [String],
    sq: &'a [String],
}

/// Elements `i..i + vector` of the row: the weights (scaled by the norm's `g + o`), then each
/// token's products.
fn k_step(spec: &GemvSpec, t: &[String], sums: &Sums) -> Vec<Stmt> {
    let (acc, sq) = (sums.acc, sums.sq);
    let v = spec.vector;
    let mut out = Vec::new();
    let w = names("w", v);
    // The up row's weights, under a GLU epilogue (dense: checked by `with_glu`).
    let w_up = names("wu", v);
    if spec.glu.is_some() {
        let row = var("r") + var("n") / int(2);
        match v {
            1 => out.extend(spec.weight.element(&w_up[0], row, var("k"), var("i"))),
            _ => out.push(load_vec("w", row * var("k") + var("i"), &w_up)),
        }
    }
    match spec.weight {
        WeightFormat::Blocks(format) if v == 32 => {
            // The block (or K-quant sub-block) holding elements i..i + 32 of row r: rows are
            // whole blocks.
            let (elements, bytes) = super::quant::block_layout(format).expect("a block format");
            let base = (var("r") * (var("k") / int(elements)) + var("i") / int(elements)) * int(bytes);
            match super::quant::decodes_sub_blocks(format) {
                true => out.extend(super::quant::k_sub_block_weights(
                    format,
                    "w",
                    base,
                    rem(var("i") / int(32), int(elements / 32)),
                )),
                false => out.extend(super::quant::block_weights(format, "w", base)),
            }
        }
        _ if v > 1 => out.push(load_vec("w", var("r") * var("k") + var("i"), &w)),
        _ => out.extend(spec.weight.element(&w[0], var("r"), var("k"), var("i"))),
    }
    // The weight each x element meets: W, or W·(g + o) under the norm.
    let (u, u_up): (Vec<String>, Vec<String>) = match spec.norm {
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
            let (u, u_up) = (names("u", v), names("uu", v));
            for e in 0..v {
                out.push(let_(&u[e], Ty::F32, var(&w[e]) * (var(&g[e]) + f(norm.offset))));
                if spec.glu.is_some() {
                    out.push(let_(&u_up[e], Ty::F32, var(&w_up[e]) * (var(&g[e]) + f(norm.offset))));
                }
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
        for (e, u_e) in u.iter().enumerate() {
            let x = &xs[e];
            match (spec.x_vector, hoisted) {
                (true, true) => {}
                (true, false) if e % 4 == 0 => out.extend(load_x(e, 4)),
                (true, false) => {}
                (false, _) => out.extend(load_x(e, 1)),
            }
            if spec.norm.is_some() {
                out.push(assign(&sq[j], var(&sq[j]) + var(x) * var(x)));
            }
            out.push(assign(&acc[j], var(&acc[j]) + var(x) * var(u_e)));
            if spec.glu.is_some() {
                out.push(assign(&sums.up[j], var(&sums.up[j]) + var(x) * var(&u_up[e])));
            }
        }
    }
    out
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
