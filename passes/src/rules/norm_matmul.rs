//! Norm → matmul prologue: `rms_norm(x)·Wᵀ` as one op that normalises the activation while
//! loading it for the matmul, so the normalised row is never written. Worth it where a launch
//! and a round trip through memory cost more than recomputing the row's scale per tile (GPU
//! decode); the target's cost model decides. Full-row norms only.

use super::{add_op, full_row_norm, unite, var};
use crate::analysis::{BbcGraph, TypeAnalysis};
use crate::lang::Node;
use egg::{Applier, Id, Pattern, PatternAst, Rewrite, Subst, Symbol};
use ir::Op;

pub fn norm_matmul() -> Rewrite<Node, TypeAnalysis> {
    let searcher: Pattern<Node> = "(matmul ?m (rms_norm ?r ?x ?w) ?W)".parse().expect("valid pattern");
    Rewrite::new("norm-matmul-prologue", searcher, NormMatMul).expect("valid rule")
}

struct NormMatMul;

impl Applier<Node, TypeAnalysis> for NormMatMul {
    fn apply_one(
        &self,
        egraph: &mut BbcGraph,
        eclass: Id,
        subst: &Subst,
        _: Option<&PatternAst<Node>>,
        _: Symbol,
    ) -> Vec<Id> {
        let x = var(subst, "?x");
        let Some((eps, weight_offset)) = full_row_norm(egraph, subst, "?r", x) else {
            return vec![];
        };
        let fused = add_op(
            egraph,
            &Op::RmsNormMatMul { eps, weight_offset },
            &[x, var(subst, "?w"), var(subst, "?W")],
        );
        unite(egraph, &[(eclass, fused)])
    }
}
