//! SwiGLU / GeGLU on a joined gate/up row `[g | u]`: `out[t, j] = act(x[t, j])·x[t, n + j]`,
//! a thread per output element.

use super::elementwise::{gelu_tanh, silu};
use super::{blocks_for, per_element, BLOCK};
use crate::dsl::*;
use ir::GluAct;

pub fn glu(name: &str, origin: &str, act: GluAct) -> Kernel {
    let gate = load("x", var("t") * var("x_stride") + var("j"));
    let up = load("x", var("t") * var("x_stride") + var("n") + var("j"));
    let activated = match act {
        GluAct::Silu => silu(gate),
        GluAct::GeluTanh => gelu_tanh(gate),
    };
    Kernel {
        name: name.into(),
        origin: format!("{origin}: {act:?} gated linear unit"),
        params: vec![
            buffer("x", Ty::F32, false),
            buffer("out", Ty::F32, true),
            scalar("tokens", Ty::I32),
            scalar("n", Ty::I32),
            scalar("x_stride", Ty::I32),
        ],
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(var("tokens") * var("n"), BLOCK as i64),
        body: per_element(
            var("tokens") * var("n"),
            vec![
                let_("t", Ty::I32, var("i") / var("n")),
                let_("j", Ty::I32, bin(BinOp::Rem, var("i"), var("n"))),
                store("out", var("i"), activated * up),
            ],
        ),
    }
}
