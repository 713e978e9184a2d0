//! Rope into attention: `attention(rope(q), rope(k), v)`, q and k rotated alike at the same
//! positions, becomes one `rope_attention(q, k, v, positions)`. The keys are rotated where
//! they are appended to the cache, and the queries in the same pass (vLLM's fused
//! `rotary_embedding` + `reshape_and_cache` does the same): on a GPU one launch a layer where
//! there were two, and the rotated q and k are never written out and read back whole.

use super::{add_op, attr_op, unite, var};
use crate::analysis::{BbcGraph, TypeAnalysis};
use crate::lang::Node;
use egg::{Applier, Id, Pattern, PatternAst, Rewrite, Subst, Symbol};
use ir::{Op, RopeSpec};

pub fn rope_into_attention() -> Rewrite<Node, TypeAnalysis> {
    let searcher: Pattern<Node> = "(attention ?a (rope ?rq ?q ?pos) (rope ?rk ?k ?pos) ?v)"
        .parse()
        .expect("valid pattern");
    Rewrite::new("rope-into-attention", searcher, RopeIntoAttention).expect("valid rule")
}

/// One rotation for every head of `[q | k]` when `q`'s and `k`'s rotate alike.
fn rotation(q: &RopeSpec, k: &RopeSpec) -> Option<RopeSpec> {
    let alike = RopeSpec { heads: q.heads, ..*k } == *q;
    alike.then_some(RopeSpec {
        heads: q.heads + k.heads,
        ..*q
    })
}

struct RopeIntoAttention;

impl Applier<Node, TypeAnalysis> for RopeIntoAttention {
    fn apply_one(
        &self,
        egraph: &mut BbcGraph,
        class: Id,
        subst: &Subst,
        _: Option<&PatternAst<Node>>,
        _: Symbol,
    ) -> Vec<Id> {
        let (Op::Attention(attention), Op::Rope(rq), Op::Rope(rk)) = (
            attr_op(egraph, subst, "?a"),
            attr_op(egraph, subst, "?rq"),
            attr_op(egraph, subst, "?rk"),
        ) else {
            return vec![];
        };
        let Some(rope) = rotation(&rq, &rk) else {
            return vec![];
        };
        // The ropes' heads are the attention's (the op's shape rule checks the rest).
        if (rq.heads, rk.heads, rq.head_dim) != (attention.heads, attention.kv_heads, attention.head_dim) {
            return vec![];
        }
        let inputs = ["?q", "?k", "?v", "?pos"].map(|name| var(subst, name));
        let fused = add_op(egraph, &Op::RopeAttention { rope, attention }, &inputs);
        unite(egraph, &[(class, fused)])
    }
}
