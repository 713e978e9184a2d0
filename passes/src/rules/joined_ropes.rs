//! Joined ropes: two rotary embeddings of adjacent column slices of one activation (Q and K
//! of a joined QKV projection), at the same positions and with the same rotation, become one
//! rope over both slices followed by slices. Rope rotates each head by itself, so a rope over
//! `[q | k]` as `heads_q + heads_k` heads is `[rope(q) | rope(k)]`. On a GPU it is one launch
//! where there were two (one per layer of a decode step, where launches are what costs).

use super::{add_op, attr_op, unite, var, width};
use crate::analysis::{BbcGraph, TypeAnalysis};
use crate::lang::Node;
use egg::{Applier, Id, MultiPattern, PatternAst, Rewrite, Subst, Symbol};
use ir::{Op, RopeSpec};

pub fn join_ropes() -> Rewrite<Node, TypeAnalysis> {
    let searcher: MultiPattern<Node> = "?a = (rope ?r1 (slice ?s1 ?x) ?pos), ?b = (rope ?r2 (slice ?s2 ?x) ?pos)"
        .parse()
        .expect("valid pattern");
    Rewrite::new("join-ropes", searcher, JoinRopes).expect("valid rule")
}

/// `first` and `second` as one rope over both heads, when they rotate alike.
fn joined_spec(first: &RopeSpec, second: &RopeSpec) -> Option<RopeSpec> {
    let alike = RopeSpec {
        heads: first.heads,
        ..*second
    } == *first;
    alike.then_some(RopeSpec {
        heads: first.heads + second.heads,
        ..*first
    })
}

struct JoinRopes;

impl Applier<Node, TypeAnalysis> for JoinRopes {
    fn apply_one(
        &self,
        egraph: &mut BbcGraph,
        _: Id,
        subst: &Subst,
        _: Option<&PatternAst<Node>>,
        _: Symbol,
    ) -> Vec<Id> {
        let (a, b) = (egraph.find(var(subst, "?a")), egraph.find(var(subst, "?b")));
        let (Op::Rope(r1), Op::Rope(r2)) = (attr_op(egraph, subst, "?r1"), attr_op(egraph, subst, "?r2")) else {
            return vec![];
        };
        let (Op::Slice { start: s1, len: l1 }, Op::Slice { start: s2, len: l2 }) =
            (attr_op(egraph, subst, "?s1"), attr_op(egraph, subst, "?s2"))
        else {
            return vec![];
        };
        // The first slice ends where the second starts (which also keeps a rope from joining
        // itself); the joined slice is then one contiguous run of columns.
        if a == b || s1 + l1 != s2 {
            return vec![];
        }
        let Some(spec) = joined_spec(&r1, &r2) else {
            return vec![];
        };
        let (x, pos) = (var(subst, "?x"), var(subst, "?pos"));
        // Slices spanning all of `x` are `x` itself: a slice node equal to its own input would
        // put a loop in the e-graph (`x` is itself the joined slice once the slices compose).
        let both = match s1 == 0 && width(egraph, x) == Some(l1 + l2) {
            true => x,
            false => add_op(
                egraph,
                &Op::Slice {
                    start: s1,
                    len: l1 + l2,
                },
                &[x],
            ),
        };
        let joined = add_op(egraph, &Op::Rope(spec), &[both, pos]);
        let first = add_op(egraph, &Op::Slice { start: 0, len: l1 }, &[joined]);
        let second = add_op(egraph, &Op::Slice { start: l1, len: l2 }, &[joined]);
        unite(egraph, &[(a, first), (b, second)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::RopeLayout;

    #[test]
    fn only_ropes_that_rotate_alike_join() {
        let q = RopeSpec {
            heads: 4,
            head_dim: 64,
            rotary_dim: 64,
            theta: 10000.0,
            position_scale: 1.0,
            layout: RopeLayout::RotateHalf,
        };
        let k = RopeSpec { heads: 2, ..q };
        assert_eq!(joined_spec(&q, &k), Some(RopeSpec { heads: 6, ..q }));
        for other in [
            RopeSpec { theta: 500000.0, ..k },
            RopeSpec { rotary_dim: 32, ..k },
            RopeSpec {
                layout: RopeLayout::AdjacentPairs,
                ..k
            },
            RopeSpec {
                position_scale: 8.0,
                ..k
            },
        ] {
            assert_eq!(joined_spec(&q, &other), None, "{other:?}");
        }
    }
}
