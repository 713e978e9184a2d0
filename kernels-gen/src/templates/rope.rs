//! Rotary position embedding: a thread per element of `[tokens, heads·head_dim]`; the angle is
//! `position · inv_freq[i]` with `inv_freq` computed on the host exactly as the IR reference
//! does (HF's f32 values), rotated pairs per the layout (rotate-half or adjacent pairs),
//! dims past `rotary_dim` copied; cos and sin times YaRN's attention factor where it has one.

use super::{blocks_for, per_element, BLOCK};
use crate::dsl::*;
use ir::RopeLayout;

/// What a launch's rotation is besides its frequencies (a plan constant, `inv_freq`): the
/// pairing, the linear position scale, and the factor cos and sin are multiplied by (YaRN's
/// attention factor; at 1 nothing is multiplied).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rotation {
    pub layout: RopeLayout,
    pub position_scale: f32,
    pub attention_factor: f32,
}

impl Rotation {
    pub fn of(spec: &ir::RopeSpec) -> Self {
        Self {
            layout: spec.layout,
            position_scale: spec.position_scale as f32,
            attention_factor: spec.scaling.attention_factor(),
        }
    }

    /// Positions as they are, cos and sin as they are.
    pub fn plain(layout: RopeLayout) -> Self {
        Self {
            layout,
            position_scale: 1.0,
            attention_factor: 1.0,
        }
    }

    pub(crate) fn describe(&self) -> String {
        match self.attention_factor {
            1.0 => format!("{:?}", self.layout),
            factor => format!("{:?}, cos and sin × {factor}", self.layout),
        }
    }
}

pub fn rope(name: &str, origin: &str, rotation: Rotation) -> Kernel {
    Kernel {
        name: name.into(),
        origin: format!("{origin}: rope ({})", rotation.describe()),
        params: vec![
            buffer("x", Ty::F32, false),
            buffer("positions", Ty::I32, false),
            buffer("inv_freq", Ty::F32, false),
            buffer("out", Ty::F32, true),
            scalar("tokens", Ty::I32),
            scalar("width", Ty::I32),
            scalar("head_dim", Ty::I32),
            scalar("rotary_dim", Ty::I32),
            scalar("x_stride", Ty::I32),
        ],
        shared: vec![],
        block_dim: BLOCK,
        grid: blocks_for(var("tokens") * var("width"), BLOCK as i64),
        body: per_element(
            var("tokens") * var("width"),
            [
                vec![
                    let_("t", Ty::I32, var("i") / var("width")),
                    let_("c", Ty::I32, bin(BinOp::Rem, var("i"), var("width"))),
                ],
                // `x`'s rows are `x_stride` apart (a column slice of a fused projection is read
                // in place).
                rotated(
                    rotation,
                    Rotated {
                        src: "x",
                        row: var("t") * var("x_stride"),
                        col: var("c"),
                    },
                    |value| store("out", var("i"), value),
                ),
            ]
            .concat(),
        ),
    }
}

/// Column `col` of one activation row starting at `row` in buffer `src`: the element a
/// thread rotates.
pub(crate) struct Rotated {
    pub src: &'static str,
    pub row: Expr,
    pub col: Expr,
}

/// Statements that rotate `element` (at the position of step row `t`, a variable) and hand
/// the value to `put`. Reads `positions`, `inv_freq`, `head_dim` and `rotary_dim`.
pub(crate) fn rotated(rotation: Rotation, element: Rotated, put: impl Fn(Expr) -> Stmt) -> Vec<Stmt> {
    let Rotation {
        layout,
        position_scale,
        attention_factor,
    } = rotation;
    let scaled = |value: Expr| match attention_factor {
        1.0 => value,
        factor => value * f(factor),
    };
    let (pair_index, partner, first_of_pair) = match layout {
        RopeLayout::RotateHalf | RopeLayout::Proportional => (
            bin(BinOp::Rem, var("j"), var("half")),
            select(
                bin(BinOp::Lt, var("j"), var("half")),
                var("j") + var("half"),
                var("j") - var("half"),
            ),
            bin(BinOp::Lt, var("j"), var("half")),
        ),
        RopeLayout::AdjacentPairs => (
            var("j") / int(2),
            select(
                bin(BinOp::Eq, bin(BinOp::BitAnd, var("j"), int(1)), int(0)),
                var("j") + int(1),
                var("j") - int(1),
            ),
            bin(BinOp::Eq, bin(BinOp::BitAnd, var("j"), int(1)), int(0)),
        ),
    };
    // Proportional RoPE pairs across the whole head and turns only its first pairs.
    let (half, rotates) = match layout {
        RopeLayout::Proportional => (
            var("head_dim") / int(2),
            bin(
                BinOp::Lt,
                bin(BinOp::Rem, var("j"), var("half")),
                var("rotary_dim") / int(2),
            ),
        ),
        RopeLayout::RotateHalf | RopeLayout::AdjacentPairs => {
            (var("rotary_dim") / int(2), bin(BinOp::Lt, var("j"), var("rotary_dim")))
        }
    };
    let x = |j: Expr| load(element.src, var("head") + j);
    vec![
        // The head's first element, and this element's place in it.
        let_(
            "head",
            Ty::I32,
            element.row + element.col.clone() - bin(BinOp::Rem, element.col.clone(), var("head_dim")),
        ),
        let_("j", Ty::I32, bin(BinOp::Rem, element.col, var("head_dim"))),
        let_("half", Ty::I32, half),
        if_else(
            rotates,
            vec![
                let_(
                    "pos",
                    Ty::F32,
                    cast(Ty::F32, load("positions", var("t"))) / f(position_scale),
                ),
                let_("angle", Ty::F32, var("pos") * load("inv_freq", pair_index)),
                let_("cos", Ty::F32, scaled(un(UnOp::Cos, var("angle")))),
                let_("sin", Ty::F32, scaled(un(UnOp::Sin, var("angle")))),
                let_("sign", Ty::F32, select(first_of_pair, f(-1.0), f(1.0))),
                put(x(var("j")) * var("cos") + var("sign") * x(partner) * var("sin")),
            ],
            vec![put(x(var("j")))],
        ),
    ]
}
