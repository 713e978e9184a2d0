//! Gated DeltaNet layers (Qwen3.5, Qwen3-Next): the IR's `gated_delta_net` as three launches
//! over each sequence's f32 state (`ir::DeltaNetSpec::state_len`: the convolution's window of
//! the last `K − 1` inputs per channel, then the delta rule's `[value_heads, key_dim,
//! value_dim]` matrix), one state per slot in a buffer of `[slots, state_len]`:
//!
//! 1. [`conv`]: the depthwise causal convolution and its SiLU, a thread per (row, channel):
//!    each tap reads an earlier row of the step where the sequence has one, else the window.
//! 2. [`conv_window`]: a thread per (sequence, channel) shifts the window past the step's rows.
//!    A launch of its own because (1) reads the window that this overwrites.
//! 3. [`delta_rule`]: the recurrence, a block per (sequence, value head, tile of value
//!    columns) walking the sequence's rows in order. Each thread holds `key_dim / R` entries
//!    of one column of the state in registers (rows `rg, rg + R, …` for its row group `rg`),
//!    the `R` row groups of a column being neighbouring lanes, so every sum over the key
//!    dimension (the query and key norms, `kᵀS`, `qᵀS`) is a few shuffles and no barrier.
//!
//! The delta rule's matrix is kept transposed on the device (`[value_heads, value_dim,
//! key_dim]`: a column's entries side by side, which the lanes sharing it read together); the
//! window is as the reference keeps it.
//!
//! A step's rows of one sequence are consecutive. Where they are depends on the plan: one
//! sequence (`Contiguous`: rows `0..tokens` at positions `first…`, state slot 0), or a batched
//! step (`Batched`: sequence `s` holds rows `last_rows[s − 1] + 1 ..= last_rows[s]`, its state
//! in slot `state_slots[s]`, row `r` belongs to sequence `row_seq[r]`). A sequence whose first
//! row is position 0 starts from a zero state, whatever its slot held before.
//!
//! A batched step that verifies drafted tokens also keeps the state as it stood after rows
//! other than a sequence's last: row `r`'s in place `row_checkpoint[r]` of the layer's
//! `checkpoints` buffer (`[places, state_len]`, laid out as a slot; −1: not kept), the window
//! by (1) (a row's window is the inputs of its last `K − 1` taps) and the matrix by (3).
//! Where the drafts after a row are refused, the runtime copies that place back into the
//! sequence's slot, as if the refused rows had never run.
//!
//! (3) walks a step's rows one after another, each row's inputs loaded during the row before
//! (they do not depend on the state), so the walk waits on the recurrence's arithmetic rather
//! than on memory. Over prompts, plans take the chunked form instead ([`super::delta_chunks`]),
//! which reads the same convolved rows and states.

use super::cache_layout::CacheLayout;
use super::elementwise::silu;
use super::quant::WeightFormat;
use super::{blocks_for, per_element, BLOCK};
use crate::dsl::*;
use ir::{DecayRate, DeltaNetSpec, ValueHeadOrder};

/// Value columns a block of [`delta_rule`] takes (fewer where the heads are narrower).
const COLUMNS: usize = 32;

/// The layout's parameters: what locates a sequence's rows and state.
pub(super) fn sequence_params(layout: CacheLayout) -> Vec<Param> {
    match layout {
        CacheLayout::Batched => vec![
            buffer("last_rows", Ty::I32, false),
            buffer("row_pos", Ty::I32, false),
            buffer("row_seq", Ty::I32, false),
            buffer("state_slots", Ty::I32, false),
        ],
        _ => vec![scalar("first", Ty::I32)],
    }
}

/// The batched layout's checkpoint parameters (see the module's description): where states
/// after rows other than a sequence's last are kept.
pub(super) fn checkpoint_params(layout: CacheLayout) -> Vec<Param> {
    match layout {
        CacheLayout::Batched => vec![
            buffer("checkpoints", Ty::F32, true),
            buffer("row_checkpoint", Ty::I32, false),
        ],
        _ => vec![],
    }
}

/// `stores` (which write `checkpoints` at `place`) where `place` is one, and `also` holds.
pub(super) fn at_checkpoint(also: Option<Expr>, stores: Vec<Stmt>) -> Stmt {
    let kept = bin(BinOp::Ge, var("place"), int(0));
    if_(also.map_or(kept.clone(), |also| and(also, kept)), stores)
}

/// Statements declaring, for sequence `s` of the step: `first_row`, `last_row` (its rows),
/// `fresh` (whether its first row is position 0) and `slot` (its state's).
pub(super) fn locate_sequence(layout: CacheLayout, s: Expr) -> Vec<Stmt> {
    match layout {
        CacheLayout::Batched => vec![
            let_("first_row", Ty::I32, int(0)),
            // Not a select: the emulator (rightly) reads both arms, and `last_rows[-1]` is
            // outside the buffer.
            if_(
                bin(BinOp::Gt, s.clone(), int(0)),
                vec![assign("first_row", load("last_rows", s.clone() - int(1)) + int(1))],
            ),
            let_("last_row", Ty::I32, load("last_rows", s.clone())),
            let_("fresh", Ty::Bool, eq(load("row_pos", var("first_row")), int(0))),
            let_("slot", Ty::I32, load("state_slots", s)),
        ],
        _ => vec![
            let_("first_row", Ty::I32, int(0)),
            let_("last_row", Ty::I32, var("tokens") - int(1)),
            let_("fresh", Ty::Bool, eq(var("first"), int(0))),
            let_("slot", Ty::I32, int(0)),
        ],
    }
}

/// The sequence of step row `r`.
fn sequence_of_row(layout: CacheLayout, r: Expr) -> Expr {
    match layout {
        CacheLayout::Batched => load("row_seq", r),
        _ => int(0),
    }
}

/// Statements declaring the f32 local `value`: channel `c`'s input at `src`, counted from the
/// sequence's first row of the step: that row of `x` from 0 on, before it window row
/// `kept + src` of the sequence's state, or zero for a fresh sequence.
fn input_at(value: &str, src: Expr, kept: i64, channels: i64) -> Vec<Stmt> {
    vec![
        let_(value, Ty::F32, f(0.0)),
        if_else(
            bin(BinOp::Ge, src.clone(), int(0)),
            vec![assign(
                value,
                load("x", (var("first_row") + src.clone()) * var("x_stride") + var("c")),
            )],
            vec![if_(
                un(UnOp::Not, var("fresh")),
                vec![assign(
                    value,
                    load("state", var("window") + (int(kept) + src) * int(channels) + var("c")),
                )],
            )],
        ),
    ]
}

/// `terms` summed pairwise (a balanced tree): the recurrence waits on the sums over a
/// thread's state entries once a row, and a tree is `log2` additions deep where a running sum
/// is one per entry (floating-point addition is not reassociated by the compiler).
pub(super) fn tree_sum(mut terms: Vec<Expr>) -> Expr {
    while terms.len() > 1 {
        let mut pairs = Vec::with_capacity(terms.len().div_ceil(2));
        let mut rest = terms.into_iter();
        while let Some(a) = rest.next() {
            pairs.push(match rest.next() {
                Some(b) => a + b,
                None => a,
            });
        }
        terms = pairs;
    }
    terms.pop().unwrap_or_else(|| f(0.0))
}

/// Statements declaring, for value head `h` of the sequence whose state is in `slot`:
/// `key_head` (the key head it reads) and where its delta-rule matrix is, `head_matrix` within
/// a state and `matrix` within the buffer of states.
pub(super) fn head_matrix(spec: &DeltaNetSpec) -> Vec<Stmt> {
    let channels = spec.conv_channels() as i64;
    vec![
        let_("key_head", Ty::I32, key_head(spec, var("h"))),
        let_(
            "head_matrix",
            Ty::I32,
            int((spec.conv_kernel as i64 - 1) * channels) + var("h") * int((spec.key_dim * spec.value_dim) as i64),
        ),
        let_(
            "matrix",
            Ty::I32,
            var("slot") * int(spec.state_len() as i64) + var("head_matrix"),
        ),
    ]
}

/// The key head value head `h` reads ([`DeltaNetSpec::key_head`]).
pub(super) fn key_head(spec: &DeltaNetSpec, h: Expr) -> Expr {
    match spec.value_head_order {
        ValueHeadOrder::Grouped => h / int((spec.value_heads / spec.key_heads) as i64),
        ValueHeadOrder::Tiled => rem(h, int(spec.key_heads as i64)),
    }
}

/// softplus as PyTorch's: `ln(1 + eˣ)`, linear past 20.
pub(super) fn softplus(x: Expr) -> Expr {
    select(
        bin(BinOp::Gt, x.clone(), f(20.0)),
        x.clone(),
        un(UnOp::Log1p, un(UnOp::Exp, x)),
    )
}

/// The decay rate `A < 0` from what the spec's decay input holds.
pub(super) fn decay_rate(spec: &DeltaNetSpec, stored: Expr) -> Expr {
    match spec.decay_rate {
        DecayRate::Log => un(UnOp::Neg, un(UnOp::Exp, stored)),
        DecayRate::Value => stored,
    }
}

pub(super) fn spec_text(spec: &DeltaNetSpec) -> String {
    format!(
        "{} key heads × {}, {} value heads × {}, convolution of {}",
        spec.key_heads, spec.key_dim, spec.value_heads, spec.value_dim, spec.conv_kernel
    )
}

/// `out[r, c] = silu(Σ_j w[c, j]·in(r − K + 1 + j, c))` for the step's `tokens` rows of the
/// joined projection `x` (rows `x_stride` apart) and its `channels`, `in` reaching back past
/// the sequence's first row of the step into the window of its state (zeros for a fresh
/// sequence). `w` is `[channels, K]` in `weights`' format.
pub fn conv(name: &str, origin: &str, layout: CacheLayout, spec: &DeltaNetSpec, weights: WeightFormat) -> Kernel {
    let (channels, taps) = (spec.conv_channels() as i64, spec.conv_kernel as i64);
    let mut body = vec![
        let_("r", Ty::I32, var("i") / int(channels)),
        let_("c", Ty::I32, rem(var("i"), int(channels))),
    ];
    body.extend(locate_sequence(layout, sequence_of_row(layout, var("r"))));
    body.extend([
        // The row's index among its sequence's rows of the step.
        let_("rel", Ty::I32, var("r") - var("first_row")),
        let_("window", Ty::I32, var("slot") * int(spec.state_len() as i64)),
        let_("acc", Ty::F32, f(0.0)),
    ]);
    for j in 0..taps {
        let (tap, w) = (format!("in{j}"), format!("w{j}"));
        body.extend(input_at(&tap, var("rel") - int(taps - 1 - j), taps - 1, channels));
        body.extend(weights.element(&w, var("c"), int(taps), int(j)));
        body.push(assign("acc", var("acc") + var(&w) * var(&tap)));
    }
    body.push(store("out", var("i"), silu(var("acc"))));
    if layout == CacheLayout::Batched {
        // The window after this row is its last K − 1 taps' inputs, read before (2) shifts
        // the state's window.
        let window = (1..taps).map(|j| {
            let at = var("place") * int(spec.state_len() as i64) + int((j - 1) * channels) + var("c");
            store("checkpoints", at, var(&format!("in{j}")))
        });
        body.extend([
            let_("place", Ty::I32, load("row_checkpoint", var("r"))),
            at_checkpoint(None, window.collect()),
        ]);
    }
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: gated DeltaNet convolution and SiLU ({}), {} weights, {}",
            spec_text(spec),
            weights.describe(),
            layout.describe()
        ),
        params: [
            vec![
                buffer("x", Ty::F32, false),
                buffer("w", weights.buffer_ty(), false),
                buffer("state", Ty::F32, false),
                buffer("out", Ty::F32, true),
                scalar("tokens", Ty::I32),
                scalar("x_stride", Ty::I32),
            ],
            sequence_params(layout),
            checkpoint_params(layout),
        ]
        .concat(),
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(var("tokens") * int(channels), BLOCK as i64),
        body: per_element(var("tokens") * int(channels), body),
    }
}

/// Each sequence's window after the step: its last `K − 1` inputs per channel, from the step's
/// rows where it has that many, else shifted along from the window (zeros for a fresh
/// sequence). A thread per (sequence, channel), which writes window rows in ascending order,
/// each from a later row than itself, so nothing is overwritten before it is read.
pub fn conv_window(name: &str, origin: &str, layout: CacheLayout, spec: &DeltaNetSpec) -> Kernel {
    let (channels, kept) = (spec.conv_channels() as i64, spec.conv_kernel as i64 - 1);
    let mut body = vec![
        let_("s", Ty::I32, var("i") / int(channels)),
        let_("c", Ty::I32, rem(var("i"), int(channels))),
    ];
    body.extend(locate_sequence(layout, var("s")));
    body.extend([
        let_("rows", Ty::I32, var("last_row") - var("first_row") + int(1)),
        let_("window", Ty::I32, var("slot") * int(spec.state_len() as i64)),
    ]);
    for w in 0..kept {
        let value = format!("v{w}");
        // The input that becomes window row w.
        body.extend(input_at(&value, var("rows") - int(kept) + int(w), kept, channels));
        body.push(store(
            "state",
            var("window") + int(w) * int(channels) + var("c"),
            var(&value),
        ));
    }
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: gated DeltaNet convolution window ({}), {}",
            spec_text(spec),
            layout.describe()
        ),
        params: [
            vec![
                buffer("x", Ty::F32, false),
                buffer("state", Ty::F32, true),
                scalar("seqs", Ty::I32),
                scalar("tokens", Ty::I32),
                scalar("x_stride", Ty::I32),
            ],
            sequence_params(layout),
        ]
        .concat(),
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(var("seqs") * int(channels), BLOCK as i64),
        body: per_element(var("seqs") * int(channels), body),
    }
}

/// How [`delta_rule`] splits a head: `(row groups R, value columns per block)`. R lanes share a
/// column; the more of them, the fewer state registers a thread holds (`key_dim / R`).
pub fn delta_rule_shape(spec: &DeltaNetSpec) -> (usize, usize) {
    let groups = [8, 4, 2, 1]
        .into_iter()
        .find(|&g| spec.key_dim.is_multiple_of(g) && spec.key_dim / g >= 8)
        .unwrap_or(1);
    // Whole warps: at least 32 / R columns, idle past the head's.
    let columns = COLUMNS.min(spec.value_dim.next_power_of_two()).max(32 / groups);
    (groups, columns)
}

/// Blocks of [`delta_rule`] per sequence.
pub fn delta_rule_blocks_per_sequence(spec: &DeltaNetSpec) -> usize {
    spec.value_heads * spec.value_dim.div_ceil(delta_rule_shape(spec).1)
}

/// The gated delta rule over the convolved `[q | k | v]` rows of `conv` (`channels` wide):
/// per row and value head, `S ← g·S`, `S ← S + k·β(v − kᵀS)ᵀ`, `out = qᵀS`, with q and k
/// L2-normalised (q also scaled by `key_dim^−½`), `g = exp(A·softplus(a + dt_bias))` (`A`
/// from the `a_log` input as the spec's `decay_rate` says: `−exp(A_log)` or itself) and
/// `β = sigmoid(b)`; value head `h` reads the key head the spec's `value_head_order` gives it;
/// `b` and `a` rows are `b_stride` and `a_stride` apart. Grid: `seqs`
/// × [`delta_rule_blocks_per_sequence`].
pub fn delta_rule(name: &str, origin: &str, layout: CacheLayout, spec: &DeltaNetSpec) -> Kernel {
    let (groups, columns) = delta_rule_shape(spec);
    let per_thread = (spec.key_dim / groups) as i64;
    let (groups_i, columns_i) = (groups as i64, columns as i64);
    let (dk, dv) = (spec.key_dim as i64, spec.value_dim as i64);
    let (vh, key_width) = (spec.value_heads as i64, (spec.key_heads * spec.key_dim) as i64);
    let tiles = spec.value_dim.div_ceil(columns) as i64;
    let channels = spec.conv_channels() as i64;
    let batched = layout == CacheLayout::Batched;
    let names = |prefix: &'static str| (0..per_thread).map(move |m| format!("{prefix}{m}"));
    // The key-dimension index of a thread's m-th state entry.
    let key_index = |m: i64| var("rg") + int(groups_i * m);
    // Sum `value` over the R lanes of a column.
    let column_sum = |value: &str| -> Vec<Stmt> {
        (0..groups.trailing_zeros())
            .rev()
            .map(|b| assign(value, var(value) + shfl_xor(var(value), 1 << b)))
            .collect()
    };
    let mut body = vec![
        let_("s", Ty::I32, bid() / int(vh * tiles)),
        let_("h", Ty::I32, rem(bid() / int(tiles), int(vh))),
        let_(
            "j",
            Ty::I32,
            rem(bid(), int(tiles)) * int(columns_i) + tid() / int(groups_i),
        ),
        let_("rg", Ty::I32, rem(tid(), int(groups_i))),
        let_("active", Ty::Bool, lt(var("j"), int(dv))),
    ];
    body.extend(locate_sequence(layout, var("s")));
    body.extend(head_matrix(spec));
    // The state's column j, rows rg + R·m: zero for a fresh sequence. Stored by columns
    // (`[value_heads, value_dim, key_dim]`), so a warp's lanes read whole sectors.
    for (m, s) in names("s").enumerate() {
        body.push(let_(&s, Ty::F32, f(0.0)));
        body.push(if_(
            and(var("active"), un(UnOp::Not, var("fresh"))),
            vec![assign(
                &s,
                load("state", var("matrix") + var("j") * int(dk) + key_index(m as i64)),
            )],
        ));
    }
    body.extend([
        let_("neg_a", Ty::F32, decay_rate(spec, load("a_log", var("h")))),
        let_("bias", Ty::F32, load("dt_bias", var("h"))),
    ]);
    // Row `r + 1`'s inputs are loaded while row `r` is computed (`next_*`): none of them
    // depends on the state, so the loop waits for memory once, not once a row.
    let next = |name: &str| format!("next_{name}");
    let load_row = |row: Expr| -> Vec<Stmt> {
        let at = row.clone() * int(channels);
        let mut loads: Vec<Stmt> = names("q")
            .zip(names("k"))
            .enumerate()
            .flat_map(|(m, (q, k))| {
                let key = at.clone() + var("key_head") * int(dk) + key_index(m as i64);
                [
                    assign(&next(&q), load("conv", key.clone())),
                    assign(&next(&k), load("conv", key + int(key_width))),
                ]
            })
            .collect();
        if batched {
            loads.push(assign(&next("place"), load("row_checkpoint", row.clone())));
        }
        loads.extend([
            assign(&next("a_in"), load("a", row.clone() * var("a_stride") + var("h"))),
            assign(&next("b_in"), load("b", row * var("b_stride") + var("h"))),
            if_(
                var("active"),
                vec![assign(
                    &next("v"),
                    load("conv", at + int(2 * key_width) + var("h") * int(dv) + var("j")),
                )],
            ),
        ]);
        loads
    };
    for name in names("q")
        .chain(names("k"))
        .chain(["a_in", "b_in", "v"].map(String::from))
    {
        body.push(let_(&next(&name), Ty::F32, f(0.0)));
    }
    if batched {
        // Where the state after the row is kept (see the module's description).
        body.push(let_(&next("place"), Ty::I32, int(-1)));
    }
    body.extend(load_row(var("first_row")));
    let mut step: Vec<Stmt> = names("q")
        .chain(names("k"))
        .chain(["a_in", "b_in", "v"].map(String::from))
        .map(|name| let_(&name, Ty::F32, var(&next(&name))))
        .collect();
    if batched {
        step.push(let_("place", Ty::I32, var(&next("place"))));
    }
    step.push(if_(
        bin(BinOp::Le, var("r") + int(1), var("last_row")),
        load_row(var("r") + int(1)),
    ));
    let dot =
        |a: &'static str, b: &'static str| tree_sum(names(a).zip(names(b)).map(|(x, y)| var(&x) * var(&y)).collect());
    step.extend([let_("qq", Ty::F32, dot("q", "q")), let_("kk", Ty::F32, dot("k", "k"))]);
    step.extend(column_sum("qq"));
    step.extend(column_sum("kk"));
    step.extend([
        // As FLA and HF: x / √(Σx² + 1e-6), the query also by key_dim^−½.
        let_(
            "q_scale",
            Ty::F32,
            un(UnOp::Rsqrt, var("qq") + f(1e-6)) * f(1.0 / (spec.key_dim as f32).sqrt()),
        ),
        let_("k_scale", Ty::F32, un(UnOp::Rsqrt, var("kk") + f(1e-6))),
        let_("x", Ty::F32, var("a_in") + var("bias")),
        let_("softplus", Ty::F32, softplus(var("x"))),
        let_("decay", Ty::F32, un(UnOp::Exp, var("neg_a") * var("softplus"))),
        let_("beta", Ty::F32, super::elementwise::sigmoid(var("b_in"))),
    ]);
    for s in names("s") {
        step.push(assign(&s, var(&s) * var("decay")));
    }
    step.push(let_("ks", Ty::F32, dot("s", "k")));
    step.extend(column_sum("ks"));
    step.extend([
        // k is normalised: kᵀS = k_scale · Σ k·S, and the update adds k_scale·k·δ.
        let_(
            "delta",
            Ty::F32,
            (var("v") - var("ks") * var("k_scale")) * var("beta") * var("k_scale"),
        ),
    ]);
    for (s, k) in names("s").zip(names("k")) {
        step.push(assign(&s, var(&s) + var(&k) * var("delta")));
    }
    let checkpoint = names("s")
        .enumerate()
        .map(|(m, s)| {
            let at = var("place") * int(spec.state_len() as i64) + var("head_matrix");
            store("checkpoints", at + var("j") * int(dk) + key_index(m as i64), var(&s))
        })
        .collect();
    if batched {
        step.push(at_checkpoint(Some(var("active")), checkpoint));
    }
    step.push(let_("o", Ty::F32, dot("s", "q")));
    step.extend(column_sum("o"));
    step.push(if_(
        and(var("active"), eq(var("rg"), int(0))),
        vec![store(
            "out",
            var("r") * int(vh * dv) + var("h") * int(dv) + var("j"),
            var("o") * var("q_scale"),
        )],
    ));
    body.push(for_("r", var("first_row"), var("last_row") + int(1), int(1), step));
    let keep: Vec<Stmt> = names("s")
        .enumerate()
        .map(|(m, s)| {
            store(
                "state",
                var("matrix") + var("j") * int(dk) + key_index(m as i64),
                var(&s),
            )
        })
        .collect();
    body.push(if_(var("active"), keep));
    Kernel {
        name: name.into(),
        origin: format!(
            "{origin}: gated delta rule ({}), {groups} lanes a column, {columns} columns a block, {}",
            spec_text(spec),
            layout.describe()
        ),
        params: [
            vec![
                buffer("conv", Ty::F32, false),
                buffer("b", Ty::F32, false),
                buffer("a", Ty::F32, false),
                buffer("a_log", Ty::F32, false),
                buffer("dt_bias", Ty::F32, false),
                buffer("state", Ty::F32, true),
                buffer("out", Ty::F32, true),
                scalar("seqs", Ty::I32),
                scalar("tokens", Ty::I32),
                scalar("b_stride", Ty::I32),
                scalar("a_stride", Ty::I32),
            ],
            sequence_params(layout),
            checkpoint_params(layout),
        ]
        .concat(),
        shared: vec![],
        block_dim: (groups * columns) as u32,
        grid: var("seqs") * int(delta_rule_blocks_per_sequence(spec) as i64),
        body,
    }
}
