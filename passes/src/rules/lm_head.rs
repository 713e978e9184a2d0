//! The INT8-bound LM head for greedy decoding: `top_k(h·Wᵀ)` becomes `int8_bound_top_k(h, W)`,
//! which scores every vocabulary row with int8 weights and a rigorous per-row error bound and
//! rescores in full precision only the rows whose upper bound reaches the k-th best lower
//! bound — the exact top-k (ties to the lowest id) at a quarter of the weight traffic. Only a
//! full-precision head (f32, bf16 or f16 weights) qualifies: a quantized head is already the
//! cheap path.

use super::{add_op, attr_op, ty, unite, var};
use crate::analysis::{BbcGraph, TypeAnalysis};
use crate::lang::Node;
use egg::{Applier, Id, Pattern, PatternAst, Rewrite, Subst, Symbol};
use ir::{DType, Op};

pub fn int8_bound_top_k() -> Rewrite<Node, TypeAnalysis> {
    Rewrite::new("int8-bound-top-k", head_top_k(), HeadTopK(int8_bound)).expect("valid rule")
}

/// The same over soft-capped logits (Gemma's `final_logit_softcapping`): the op ranks the
/// capped values.
pub fn int8_bound_top_k_soft_capped() -> Rewrite<Node, TypeAnalysis> {
    Rewrite::new(
        "int8-bound-top-k-soft-capped",
        capped_head_top_k(),
        HeadTopK(int8_bound),
    )
    .expect("valid rule")
}

/// The INT8-bound head for a full-precision head `w`.
fn int8_bound(egraph: &BbcGraph, w: Id, k: usize, soft_cap: Option<f32>) -> Option<Op> {
    let head = ty(egraph, w);
    (head.constant && matches!(head.dtype, DType::F32 | DType::BF16 | DType::F16))
        .then_some(Op::Int8BoundTopK { k, soft_cap })
}

/// `top_k(h·Wᵀ)`, binding `?k`, `?h` and `?W`.
pub(crate) fn head_top_k() -> Pattern<Node> {
    "(top_k ?k (matmul ?m ?h ?W))".parse().expect("valid pattern")
}

/// `top_k(soft_cap(h·Wᵀ))`, binding `?c` besides.
pub(crate) fn capped_head_top_k() -> Pattern<Node> {
    "(top_k ?k (soft_cap ?c (matmul ?m ?h ?W)))"
        .parse()
        .expect("valid pattern")
}

/// A head's top k (matched by [`head_top_k`] or [`capped_head_top_k`]) as one op over `(h, W)`:
/// the op the function makes of the head `W`, `k` and the soft cap where the logits are capped;
/// none where the head does not qualify.
pub(crate) struct HeadTopK(pub fn(&BbcGraph, Id, usize, Option<f32>) -> Option<Op>);

impl Applier<Node, TypeAnalysis> for HeadTopK {
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
        // `?c` is bound by the soft-capping pattern only.
        let capped = "?c".parse::<egg::Var>().ok().and_then(|c| subst.get(c)).is_some();
        let soft_cap = match capped {
            false => None,
            true => match attr_op(egraph, subst, "?c") {
                Op::SoftCap { cap } => Some(cap),
                _ => return vec![],
            },
        };
        let w = var(subst, "?W");
        let Some(op) = (self.0)(egraph, w, k, soft_cap) else {
            return vec![];
        };
        let fused = add_op(egraph, &op, &[var(subst, "?h"), w]);
        unite(egraph, &[(eclass, fused)])
    }
}
