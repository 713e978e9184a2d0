//! Joined projections: matmuls that read the same activation become one matmul over their
//! weights stacked by rows, followed by slices (Q/K/V; gate/up; the four Gated DeltaNet input
//! projections of Qwen3.5). `x·[W1; W2]ᵀ = [x·W1ᵀ | x·W2ᵀ]`, so each original matmul equals a
//! column slice of the joined one. The stacking is a compile-time weight transform
//! (`concat_rows`), allowed only between weights of one storage dtype.
//!
//! Joining is pairwise and repeats, so three projections end as one matmul once the slices of
//! slices compose (`compose-slices`). Weights stack only in increasing leaf order, which makes
//! every join order reach the same stacked weight and bounds the e-graph to the contiguous
//! groupings of each set of projections.

use super::{add_op, attr_op, find_node, ty, unite, var, width};
use crate::analysis::{BbcGraph, TypeAnalysis};
use crate::lang::{split, Node};
use egg::{Applier, Id, MultiPattern, Pattern, PatternAst, Rewrite, Subst, Symbol};
use ir::Op;

pub fn join_projections() -> Rewrite<Node, TypeAnalysis> {
    let searcher: MultiPattern<Node> = "?a = (matmul ?m1 ?x ?w1), ?b = (matmul ?m2 ?x ?w2)"
        .parse()
        .expect("valid pattern");
    Rewrite::new("join-projections", searcher, JoinProjections).expect("valid rule")
}

pub fn compose_slices() -> Rewrite<Node, TypeAnalysis> {
    let searcher: Pattern<Node> = "(slice ?outer (slice ?inner ?x))".parse().expect("valid pattern");
    Rewrite::new("compose-slices", searcher, ComposeSlices).expect("valid rule")
}

/// The weight leaves a (possibly stacked) weight class is made of.
fn stacked_parts(egraph: &BbcGraph, w: Id) -> Vec<Id> {
    match find_node(egraph, w, |op| *op == Op::ConcatRows) {
        Some((node, _)) => split(&node)
            .expect("an op node")
            .1
            .iter()
            .map(|&c| egraph.find(c))
            .collect(),
        None => vec![egraph.find(w)],
    }
}

struct JoinProjections;

impl Applier<Node, TypeAnalysis> for JoinProjections {
    fn apply_one(
        &self,
        egraph: &mut BbcGraph,
        _: Id,
        subst: &Subst,
        _: Option<&PatternAst<Node>>,
        _: Symbol,
    ) -> Vec<Id> {
        let (a, b) = (egraph.find(var(subst, "?a")), egraph.find(var(subst, "?b")));
        let (w1, w2, x) = (var(subst, "?w1"), var(subst, "?w2"), var(subst, "?x"));
        let (t1, t2) = (ty(egraph, w1), ty(egraph, w2));
        if a == b || !t1.constant || !t2.constant || t1.dtype != t2.dtype {
            return vec![];
        }
        // Stack only in increasing leaf order: every way of joining a set then ends in the same
        // stacked weight (and so the same e-class), and no weight is stacked twice.
        let (p1, p2) = (stacked_parts(egraph, w1), stacked_parts(egraph, w2));
        if p1.iter().max() >= p2.iter().min() {
            return vec![];
        }
        let (Some(n1), Some(n2)) = (width(egraph, a), width(egraph, b)) else {
            return vec![];
        };
        let parts: Vec<Id> = p1.into_iter().chain(p2).collect();
        let stacked = add_op(egraph, &Op::ConcatRows, &parts);
        let joined = add_op(egraph, &Op::MatMul, &[x, stacked]);
        let first = add_op(egraph, &Op::Slice { start: 0, len: n1 }, &[joined]);
        let second = add_op(egraph, &Op::Slice { start: n1, len: n2 }, &[joined]);
        unite(egraph, &[(a, first), (b, second)])
    }
}

struct ComposeSlices;

impl Applier<Node, TypeAnalysis> for ComposeSlices {
    fn apply_one(
        &self,
        egraph: &mut BbcGraph,
        eclass: Id,
        subst: &Subst,
        _: Option<&PatternAst<Node>>,
        _: Symbol,
    ) -> Vec<Id> {
        let (Op::Slice { start: s_out, len }, Op::Slice { start: s_in, .. }) =
            (attr_op(egraph, subst, "?outer"), attr_op(egraph, subst, "?inner"))
        else {
            return vec![];
        };
        let composed = add_op(
            egraph,
            &Op::Slice {
                start: s_in + s_out,
                len,
            },
            &[var(subst, "?x")],
        );
        unite(egraph, &[(eclass, composed)])
    }
}
