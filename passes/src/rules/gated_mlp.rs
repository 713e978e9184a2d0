//! Gated MLP epilogues on the joined gate/up projection `x = [g | u]`:
//! SwiGLU `silu(g)·u` (Llama, Qwen; Shazeer 2020, "GLU Variants Improve Transformer") and
//! GeGLU `gelu_tanh(g)·u` (Gemma) become one `glu` op reading `x` once.

use super::{add_op, attr_op, unite, var, width};
use crate::analysis::{BbcGraph, TypeAnalysis};
use crate::lang::Node;
use egg::{Applier, Id, Pattern, PatternAst, Rewrite, Subst, Symbol};
use ir::{GluAct, Op};

pub fn swiglu() -> Rewrite<Node, TypeAnalysis> {
    let searcher: Pattern<Node> = "(mul ?m (silu ?f (slice ?g ?x)) (slice ?u ?x))"
        .parse()
        .expect("valid pattern");
    Rewrite::new("fuse-swiglu", searcher, Glu(GluAct::Silu)).expect("valid rule")
}

pub fn geglu() -> Rewrite<Node, TypeAnalysis> {
    let searcher: Pattern<Node> = "(mul ?m (gelu_tanh ?f (slice ?g ?x)) (slice ?u ?x))"
        .parse()
        .expect("valid pattern");
    Rewrite::new("fuse-geglu", searcher, Glu(GluAct::GeluTanh)).expect("valid rule")
}

struct Glu(GluAct);

impl Applier<Node, TypeAnalysis> for Glu {
    fn apply_one(
        &self,
        egraph: &mut BbcGraph,
        eclass: Id,
        subst: &Subst,
        _: Option<&PatternAst<Node>>,
        _: Symbol,
    ) -> Vec<Id> {
        let x = var(subst, "?x");
        let (Op::Slice { start: gs, len: gl }, Op::Slice { start: us, len: ul }) =
            (attr_op(egraph, subst, "?g"), attr_op(egraph, subst, "?u"))
        else {
            return vec![];
        };
        // The gate must be exactly the first half of x and the up projection the second.
        if gs != 0 || us != gl || ul != gl || width(egraph, x) != Some(2 * gl) {
            return vec![];
        }
        let glu = add_op(egraph, &Op::Glu { act: self.0 }, &[x]);
        unite(egraph, &[(eclass, glu)])
    }
}
