//! Residual + norm → matmul prologue: the matmul reading the norm half of an
//! `add_rms_norm(a, b, w)` (what `residual-rms-norm` made of a layer's residual add and the
//! next pre-norm) becomes one `add_rms_norm_matmul(a, b, w, W)` producing `[a + b | y]`: the
//! kernel adds and normalises the row while loading it for the matmul and writes the sum once
//! beside the product, so neither the sum nor the normalised row makes a round trip and the
//! `add_rms_norm` launch is gone (TensorRT-LLM's norm-GEMM fusion, with the residual). The
//! sum stays a value of its own for the next residual add. Worth it on a GPU decode step
//! (about 2 of a Llama layer's launches); the target's cost model decides.
//!
//! `residual-norm-matmul-glu` then takes a gated MLP's `glu` of the whole product (the joined
//! gate/up) into the same op as its epilogue: the kernel computes a gate row and its up row
//! together and writes `act(g)·u`, and the `glu` launch is gone too.

use super::{add_op, attr_op, ty, unite, var, width};
use crate::analysis::{BbcGraph, TypeAnalysis};
use crate::lang::Node;
use egg::{Applier, Id, MultiPattern, PatternAst, Rewrite, Subst, Symbol};
use ir::Op;

pub fn residual_norm_matmul() -> Rewrite<Node, TypeAnalysis> {
    let searcher: MultiPattern<Node> = "?f = (add_rms_norm ?r ?a ?b ?w), ?y = (matmul ?m (slice ?sl ?f) ?W)"
        .parse()
        .expect("valid pattern");
    Rewrite::new("residual-norm-matmul-prologue", searcher, ResidualNormMatMul).expect("valid rule")
}

struct ResidualNormMatMul;

impl Applier<Node, TypeAnalysis> for ResidualNormMatMul {
    fn apply_one(
        &self,
        egraph: &mut BbcGraph,
        _: Id,
        subst: &Subst,
        _: Option<&PatternAst<Node>>,
        _: Symbol,
    ) -> Vec<Id> {
        let (f, y, a) = (var(subst, "?f"), var(subst, "?y"), var(subst, "?a"));
        let (Some(d), Some(n)) = (width(egraph, a), width(egraph, y)) else {
            return vec![];
        };
        // Only the matmul of the normalised half: the sum's half is a plain residual.
        if attr_op(egraph, subst, "?sl") != (Op::Slice { start: d, len: d }) {
            return vec![];
        }
        let Op::AddRmsNorm { eps, weight_offset } = attr_op(egraph, subst, "?r") else {
            return vec![];
        };
        let op = Op::AddRmsNormMatMul {
            eps,
            weight_offset,
            glu: None,
        };
        replace(egraph, subst, op, (f, d), (y, n))
    }
}

/// `op` (an `add_rms_norm_matmul`) over the match's `?a ?b ?w ?W` in place of the values it
/// makes: the sum, `f`'s first `d` columns (the op it was read from stays), and `y`, its
/// `product` columns after the sum.
fn replace(egraph: &mut BbcGraph, subst: &Subst, op: Op, (f, d): (Id, usize), (y, product): (Id, usize)) -> Vec<Id> {
    let inputs = ["?a", "?b", "?w", "?W"].map(|v| var(subst, v));
    let fused = add_op(egraph, &op, &inputs);
    let sum = add_op(egraph, &Op::Slice { start: 0, len: d }, &[f]);
    let fused_sum = add_op(egraph, &Op::Slice { start: 0, len: d }, &[fused]);
    let fused_product = add_op(egraph, &Op::Slice { start: d, len: product }, &[fused]);
    unite(egraph, &[(sum, fused_sum), (y, fused_product)])
}

pub fn residual_norm_matmul_glu() -> Rewrite<Node, TypeAnalysis> {
    let searcher: MultiPattern<Node> = "?f = (add_rms_norm_matmul ?r ?a ?b ?w ?W), ?y = (glu ?g (slice ?sl ?f))"
        .parse()
        .expect("valid pattern");
    Rewrite::new("residual-norm-matmul-glu", searcher, GluEpilogue).expect("valid rule")
}

struct GluEpilogue;

impl Applier<Node, TypeAnalysis> for GluEpilogue {
    fn apply_one(
        &self,
        egraph: &mut BbcGraph,
        _: Id,
        subst: &Subst,
        _: Option<&PatternAst<Node>>,
        _: Symbol,
    ) -> Vec<Id> {
        let (f, y, a, w) = (var(subst, "?f"), var(subst, "?y"), var(subst, "?a"), var(subst, "?W"));
        let Op::AddRmsNormMatMul {
            eps,
            weight_offset,
            glu: None,
        } = attr_op(egraph, subst, "?r")
        else {
            return vec![];
        };
        let Op::Glu { act } = attr_op(egraph, subst, "?g") else {
            return vec![];
        };
        let (Some(d), Some(half)) = (width(egraph, a), width(egraph, y)) else {
            return vec![];
        };
        // The glu of the whole product only (rows of W: 2·half).
        let rows = ty(egraph, w).shape.0.first().and_then(|r| r.as_const());
        if attr_op(egraph, subst, "?sl")
            != (Op::Slice {
                start: d,
                len: 2 * half,
            })
            || rows != Some(2 * half)
        {
            return vec![];
        }
        let op = Op::AddRmsNormMatMul {
            eps,
            weight_offset,
            glu: Some(act),
        };
        replace(egraph, subst, op, (f, d), (y, half))
    }
}
