//! Expression trees of fused elementwise ops: what `Op::Elementwise` computes per element.
//! The text form (`mul(silu($0), $1)`) appears in IR dumps and is what a kernel generator
//! turns into one expression of a generated kernel.

use std::fmt;

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Expr {
    /// The i-th input of the fused op.
    Input(usize),
    Add(Box<Expr>, Box<Expr>),
    Mul(Box<Expr>, Box<Expr>),
    Scale(Box<Expr>, f32),
    Silu(Box<Expr>),
    GeluTanh(Box<Expr>),
    Sigmoid(Box<Expr>),
    /// `cap · tanh(x / cap)`.
    SoftCap(Box<Expr>, f32),
}

impl Expr {
    pub fn eval(&self, inputs: &[f32]) -> f32 {
        match self {
            Expr::Input(i) => inputs[*i],
            Expr::Add(a, b) => a.eval(inputs) + b.eval(inputs),
            Expr::Mul(a, b) => a.eval(inputs) * b.eval(inputs),
            Expr::Scale(a, f) => a.eval(inputs) * f,
            Expr::Silu(a) => crate::reference::ops::silu(a.eval(inputs)),
            Expr::GeluTanh(a) => crate::reference::ops::gelu_tanh(a.eval(inputs)),
            Expr::Sigmoid(a) => crate::reference::ops::sigmoid(a.eval(inputs)),
            Expr::SoftCap(a, cap) => crate::reference::ops::soft_cap(a.eval(inputs), *cap),
        }
    }

    /// The largest input index used, plus one.
    pub fn arity(&self) -> usize {
        match self {
            Expr::Input(i) => i + 1,
            Expr::Add(a, b) | Expr::Mul(a, b) => a.arity().max(b.arity()),
            Expr::Scale(a, _) | Expr::Silu(a) | Expr::GeluTanh(a) | Expr::Sigmoid(a) | Expr::SoftCap(a, _) => a.arity(),
        }
    }

    /// Replace input `i` by `f(i)`: how fused expressions are composed.
    pub fn substitute(&self, f: &impl Fn(usize) -> Expr) -> Expr {
        match self {
            Expr::Input(i) => f(*i),
            Expr::Add(a, b) => Expr::Add(Box::new(a.substitute(f)), Box::new(b.substitute(f))),
            Expr::Mul(a, b) => Expr::Mul(Box::new(a.substitute(f)), Box::new(b.substitute(f))),
            Expr::Scale(a, s) => Expr::Scale(Box::new(a.substitute(f)), *s),
            Expr::Silu(a) => Expr::Silu(Box::new(a.substitute(f))),
            Expr::GeluTanh(a) => Expr::GeluTanh(Box::new(a.substitute(f))),
            Expr::Sigmoid(a) => Expr::Sigmoid(Box::new(a.substitute(f))),
            Expr::SoftCap(a, cap) => Expr::SoftCap(Box::new(a.substitute(f)), *cap),
        }
    }

    /// Operations per element (for cost models).
    pub fn ops(&self) -> usize {
        match self {
            Expr::Input(_) => 0,
            Expr::Add(a, b) | Expr::Mul(a, b) => 1 + a.ops() + b.ops(),
            Expr::Scale(a, _) => 1 + a.ops(),
            Expr::Silu(a) | Expr::GeluTanh(a) | Expr::Sigmoid(a) | Expr::SoftCap(a, _) => 8 + a.ops(),
        }
    }
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expr::Input(i) => write!(f, "${i}"),
            Expr::Add(a, b) => write!(f, "add({a}, {b})"),
            Expr::Mul(a, b) => write!(f, "mul({a}, {b})"),
            Expr::Scale(a, s) => write!(f, "scale({a}, {s})"),
            Expr::Silu(a) => write!(f, "silu({a})"),
            Expr::GeluTanh(a) => write!(f, "gelu_tanh({a})"),
            Expr::Sigmoid(a) => write!(f, "sigmoid({a})"),
            Expr::SoftCap(a, cap) => write!(f, "soft_cap({a}, {cap})"),
        }
    }
}
