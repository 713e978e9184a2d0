//! Argmax per row with bbc's tie rule (the lowest index wins): threads stride the row keeping
//! their best (value, index), then a shared-memory tree halves the candidates; NaN never wins.

use super::BLOCK;
use crate::dsl::*;

/// Whether (v, i) beats (bv, bi): larger, or equal and earlier; NaN never beats anything.
fn beats(v: Expr, i: Expr, bv: Expr, bi: Expr) -> Expr {
    let larger = bin(BinOp::Gt, v.clone(), bv.clone());
    let tie_earlier = bin(BinOp::And, bin(BinOp::Eq, v, bv), bin(BinOp::Lt, i.clone(), bi.clone()));
    let best_empty = bin(BinOp::Lt, bi, int(0));
    bin(
        BinOp::Or,
        bin(BinOp::And, bin(BinOp::Ge, i, int(0)), best_empty),
        bin(BinOp::Or, larger, tie_earlier),
    )
}

pub fn argmax(name: &str, origin: &str) -> Kernel {
    let mut body = vec![
        let_("base", Ty::I32, bid() * var("v")),
        let_("best", Ty::F32, f(f32::NEG_INFINITY)),
        let_("best_i", Ty::I32, int(-1)),
        for_(
            "i",
            tid(),
            var("v"),
            bdim(),
            vec![
                let_("x", Ty::F32, load("logits", var("base") + var("i"))),
                // x == x is false for NaN.
                if_(
                    bin(
                        BinOp::And,
                        bin(BinOp::Eq, var("x"), var("x")),
                        beats(var("x"), var("i"), var("best"), var("best_i")),
                    ),
                    vec![assign("best", var("x")), assign("best_i", var("i"))],
                ),
            ],
        ),
        store("vals", tid(), var("best")),
        store("idx", tid(), var("best_i")),
        Stmt::SyncThreads,
    ];
    let mut stride = BLOCK / 2;
    while stride > 0 {
        let other = tid() + int(stride as i64);
        body.push(if_(
            bin(BinOp::Lt, tid(), int(stride as i64)),
            vec![
                let_("ov", Ty::F32, load("vals", other.clone())),
                let_("oi", Ty::I32, load("idx", other)),
                let_("mv", Ty::F32, load("vals", tid())),
                let_("mi", Ty::I32, load("idx", tid())),
                if_(
                    beats(var("ov"), var("oi"), var("mv"), var("mi")),
                    vec![store("vals", tid(), var("ov")), store("idx", tid(), var("oi"))],
                ),
            ],
        ));
        body.push(Stmt::SyncThreads);
        stride /= 2;
    }
    body.push(if_(
        bin(BinOp::Eq, tid(), int(0)),
        vec![store("out", bid(), load("idx", int(0)))],
    ));
    Kernel {
        name: name.into(),
        origin: format!("{origin}: argmax (ties to the lowest index)"),
        params: vec![
            buffer("logits", Ty::F32, false),
            buffer("out", Ty::I32, true),
            scalar("rows", Ty::I32),
            scalar("v", Ty::I32),
        ],
        shared: vec![
            SharedArray {
                name: "vals".into(),
                ty: Ty::F32,
                len: BLOCK as usize,
            },
            SharedArray {
                name: "idx".into(),
                ty: Ty::I32,
                len: BLOCK as usize,
            },
        ],
        block_dim: BLOCK,
        grid: var("rows"),
        body,
    }
}
