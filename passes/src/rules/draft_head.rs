//! The 4-bit shortlisting head for drafters (not in the pipeline: only a drafter's graph takes
//! it, `crate::shortlisted_draft_head`): `top_k(h·Wᵀ)` becomes `shortlist_top_k(h, W)`, which
//! scores every vocabulary row with a 4-bit copy of `W` and rescores only the best
//! [`SHORTLIST_CANDIDATES`] in `W`'s own precision. Approximate (the exact top-k is missed only
//! where more than that many rows score within the 4-bit error of it), which a drafter can
//! afford: the target verifies every drafted token. Soft-capped logits keep their order, so
//! the cap is dropped. Only a head of rows of whole blocks of 32 qualifies.

use super::{add_op, attr_op, ty, unite, var, width};
use crate::analysis::{BbcGraph, TypeAnalysis};
use crate::lang::Node;
use egg::{Applier, Id, Pattern, PatternAst, Rewrite, Subst, Symbol};
use ir::Op;

/// Rows rescored in full precision per query.
pub const SHORTLIST_CANDIDATES: usize = 64;

pub fn shortlist() -> Rewrite<Node, TypeAnalysis> {
    let searcher: Pattern<Node> = "(top_k ?k (matmul ?m ?h ?W))".parse().expect("valid pattern");
    Rewrite::new("shortlist-draft-head", searcher, Shortlist).expect("valid rule")
}

pub fn shortlist_soft_capped() -> Rewrite<Node, TypeAnalysis> {
    let searcher: Pattern<Node> = "(top_k ?k (soft_cap ?c (matmul ?m ?h ?W)))"
        .parse()
        .expect("valid pattern");
    Rewrite::new("shortlist-draft-head-soft-capped", searcher, Shortlist).expect("valid rule")
}

struct Shortlist;

impl Applier<Node, TypeAnalysis> for Shortlist {
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
        if !ty(egraph, w).constant || width(egraph, w).is_none_or(|d| !d.is_multiple_of(32)) {
            return vec![];
        }
        let op = Op::ShortlistTopK {
            k,
            candidates: SHORTLIST_CANDIDATES.max(k),
        };
        let fused = add_op(egraph, &op, &[var(subst, "?h"), w]);
        unite(egraph, &[(eclass, fused)])
    }
}
