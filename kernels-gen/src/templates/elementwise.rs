//! Fused elementwise ops: the IR's expression tree becomes one expression of one kernel, a
//! thread per element (memory-bound; one pass over the inputs and the output). Also the
//! broadcasts: a bias vector added to every row (`add_bias`), every row scaled by its own
//! scalar or all by one (`scale_rows`).

use super::{blocks_for, per_row_element, BLOCK};
use crate::dsl::*;
use ir::Expr as IrExpr;

fn lower(e: &IrExpr) -> Expr {
    match e {
        IrExpr::Input(i) => load(&format!("in{i}"), var("t") * var(&format!("in{i}_stride")) + var("j")),
        IrExpr::Add(a, b) => lower(a) + lower(b),
        IrExpr::Mul(a, b) => lower(a) * lower(b),
        IrExpr::Scale(a, s) => lower(a) * f(*s),
        // silu(x) = x / (1 + e^-x)
        IrExpr::Silu(a) => silu(lower(a)),
        IrExpr::GeluTanh(a) => gelu_tanh(lower(a)),
        IrExpr::Sigmoid(a) => sigmoid(lower(a)),
        IrExpr::SoftCap(a, cap) => f(*cap) * un(UnOp::Tanh, lower(a) / f(*cap)),
    }
}

/// PyTorch's tanh GELU: `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
pub fn gelu_tanh(x: Expr) -> Expr {
    let inner = f(0.797_884_6) * (x.clone() + f(0.044715) * x.clone() * x.clone() * x.clone());
    f(0.5) * x * (f(1.0) + un(UnOp::Tanh, inner))
}

/// silu(x) = x / (1 + e^-x)
pub fn silu(x: Expr) -> Expr {
    x.clone() / (f(1.0) + un(UnOp::Exp, un(UnOp::Neg, x)))
}

/// sigmoid(x) = 1 / (1 + e^-x)
pub fn sigmoid(x: Expr) -> Expr {
    f(1.0) / (f(1.0) + un(UnOp::Exp, un(UnOp::Neg, x)))
}

/// `out[i] = expr(in0[i], in1[i], …)` for `i < n`, rows of `width`; input k's rows lie
/// `in{k}_stride` apart (slices are read in place).
pub fn elementwise(name: &str, origin: &str, expr: &IrExpr) -> Kernel {
    let mut params: Vec<Param> = (0..expr.arity())
        .map(|i| buffer(&format!("in{i}"), Ty::F32, false))
        .collect();
    params.push(buffer("out", Ty::F32, true));
    params.push(scalar("n", Ty::I32));
    params.push(scalar("width", Ty::I32));
    params.extend((0..expr.arity()).map(|i| scalar(&format!("in{i}_stride"), Ty::I32)));
    Kernel {
        name: name.into(),
        origin: format!("{origin}: elementwise {expr}"),
        params,
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(var("n"), BLOCK as i64),
        body: per_row_element(var("n"), vec![store("out", var("i"), lower(expr))]),
    }
}

/// `out[t, j] = x[t·x_stride + j] + bias[j]` for `n` elements in rows of `width`.
pub fn add_bias(name: &str, origin: &str) -> Kernel {
    let bias = load("bias", var("j"));
    row_broadcast(name, format!("{origin}: add a bias to every row"), "bias", None, |x| {
        x + bias
    })
}

/// `out[t, j] = x[t·x_stride + j] · s[t·s_stride]` for `n` elements in rows of `width`: each
/// row by its scalar (a `[tokens, 1]` column, rows `s_stride` apart), or all by `s[0]`
/// (`s_stride` 0).
pub fn scale_rows(name: &str, origin: &str) -> Kernel {
    let scalar_of_row = load("s", var("t") * var("s_stride"));
    let origin = format!("{origin}: scale every row by a scalar");
    row_broadcast(name, origin, "s", Some("s_stride"), |x| x * scalar_of_row)
}

/// A thread per element of `n` in rows of `width`: `out[t, j] = combine(x[t·x_stride + j])`,
/// where `combine` reads the buffer `operand` (and the scalar `operand_stride`, if any).
fn row_broadcast(
    name: &str,
    origin: String,
    operand: &str,
    operand_stride: Option<&str>,
    combine: impl FnOnce(Expr) -> Expr,
) -> Kernel {
    let mut params = vec![
        buffer("x", Ty::F32, false),
        buffer(operand, Ty::F32, false),
        buffer("out", Ty::F32, true),
        scalar("n", Ty::I32),
        scalar("width", Ty::I32),
        scalar("x_stride", Ty::I32),
    ];
    params.extend(operand_stride.map(|stride| scalar(stride, Ty::I32)));
    let x = load("x", var("t") * var("x_stride") + var("j"));
    Kernel {
        name: name.into(),
        origin,
        params,
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(var("n"), BLOCK as i64),
        body: per_row_element(var("n"), vec![store("out", var("i"), combine(x))]),
    }
}
