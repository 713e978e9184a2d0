//! The INT8-bound LM head for greedy decoding: `top_k(h·Wᵀ)` becomes `int8_bound_top_k(h, W)`,
//! which scores every vocabulary row with int8 weights and a rigorous per-row error bound and
//! rescores in full precision only the rows whose upper bound reaches the k-th best lower
//! bound — the exact top-k (ties to the lowest id) at a quarter of the weight traffic. Only a
//! full-precision head (f32/bf16 weights) qualifies: a quantized head is already the cheap path.

use super::{add_op, attr_op, ty, unite, var};
use crate::analysis::{BbcGraph, TypeAnalysis};
use crate::lang::Node;
use egg::{Applier, Id, Pattern, PatternAst, Rewrite, Subst, Symbol};
use ir::{DType, Op};

pub fn int8_bound_top_k() -> Rewrite<Node, TypeAnalysis> {
    let searcher: Pattern<Node> = "(top_k ?k (matmul ?m ?h ?W))".parse().expect("valid pattern");
    Rewrite::new("int8-bound-top-k", searcher, Int8BoundTopK).expect("valid rule")
}

/// The same over soft-capped logits (Gemma's `final_logit_softcapping`): the op ranks the
/// capped values.
pub fn int8_bound_top_k_soft_capped() -> Rewrite<Node, TypeAnalysis> {
    let searcher: Pattern<Node> = "(top_k ?k (soft_cap ?c (matmul ?m ?h ?W)))"
        .parse()
        .expect("valid pattern");
    Rewrite::new("int8-bound-top-k-soft-capped", searcher, Int8BoundTopK).expect("valid rule")
}

struct Int8BoundTopK;

impl Applier<Node, TypeAnalysis> for Int8BoundTopK {
    fn apply_one(
        &self,
        egraph: &mut BbcGraph,
        eclass: Id,
        subst: &Subst,
        _: Option<&PatternAst<Node>>,
        _: Symbol,
    ) -> Vec<Id> {
        let Op::TopK { k } = attr_op(egraph, subst, "?k") else {
            return vec![];
        };
        let w = var(subst, "?W");
        let head = ty(egraph, w);
        if !head.constant || !matches!(head.dtype, DType::F32 | DType::BF16) {
            return vec![];
        }
        // `?c` is bound by the soft-capping pattern only.
        let capped = "?c".parse::<egg::Var>().ok().and_then(|c| subst.get(c)).is_some();
        let soft_cap = match capped {
            false => None,
            true => match attr_op(egraph, subst, "?c") {
                Op::SoftCap { cap } => Some(cap),
                _ => return vec![],
            },
        };
        let fused = add_op(egraph, &Op::Int8BoundTopK { k, soft_cap }, &[var(subst, "?h"), w]);
        unite(egraph, &[(eclass, fused)])
    }
}
