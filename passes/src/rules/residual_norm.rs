//! Residual + RMSNorm: `n = rms_norm(a + b)` where `a + b` is also the residual stream becomes
//! one `add_rms_norm(a, b, w)` producing `[a + b | n]` side by side; the sum and the norm are
//! slices of it. One pass over the row instead of writing the sum and reading it back
//! (the "fused add + RMSNorm" of vLLM and TensorRT-LLM). Applies to full-row norms only.

use super::{add_op, full_row_norm, unite, var, width};
use crate::analysis::{BbcGraph, TypeAnalysis};
use crate::lang::Node;
use egg::{Applier, Id, MultiPattern, PatternAst, Rewrite, Subst, Symbol};
use ir::Op;

pub fn residual_rms_norm() -> Rewrite<Node, TypeAnalysis> {
    let searcher: MultiPattern<Node> = "?s = (add ?e ?a ?b), ?n = (rms_norm ?r ?s ?w)"
        .parse()
        .expect("valid pattern");
    Rewrite::new("residual-rms-norm", searcher, ResidualRmsNorm).expect("valid rule")
}

struct ResidualRmsNorm;

impl Applier<Node, TypeAnalysis> for ResidualRmsNorm {
    fn apply_one(
        &self,
        egraph: &mut BbcGraph,
        _: Id,
        subst: &Subst,
        _: Option<&PatternAst<Node>>,
        _: Symbol,
    ) -> Vec<Id> {
        let (s, n) = (var(subst, "?s"), var(subst, "?n"));
        let (Some((eps, weight_offset)), Some(d)) = (full_row_norm(egraph, subst, "?r", s), width(egraph, s)) else {
            return vec![];
        };
        let fused = add_op(
            egraph,
            &Op::AddRmsNorm { eps, weight_offset },
            &[var(subst, "?a"), var(subst, "?b"), var(subst, "?w")],
        );
        let sum = add_op(egraph, &Op::Slice { start: 0, len: d }, &[fused]);
        let normed = add_op(egraph, &Op::Slice { start: d, len: d }, &[fused]);
        unite(egraph, &[(s, sum), (n, normed)])
    }
}
