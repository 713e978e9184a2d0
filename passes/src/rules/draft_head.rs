//! The 4-bit shortlisting head for drafters (not in the pipeline: only a drafter's graph takes
//! it, `crate::shortlisted_draft_head`): `top_k(h·Wᵀ)` becomes `shortlist_top_k(h, W)`, which
//! scores every vocabulary row with a 4-bit copy of `W` and rescores only the best
//! [`SHORTLIST_CANDIDATES`] in `W`'s own precision. Approximate (the exact top-k is missed only
//! where more than that many rows score within the 4-bit error of it), which a drafter can
//! afford: the target verifies every drafted token. Soft-capped logits keep their order, so
//! the cap is dropped. Only a head of rows of whole blocks of 32 qualifies.

use super::lm_head::{capped_head_top_k, head_top_k, HeadTopK};
use super::{ty, width};
use crate::analysis::{BbcGraph, TypeAnalysis};
use crate::lang::Node;
use egg::{Id, Rewrite};
use ir::Op;

/// Rows rescored in full precision per query.
pub const SHORTLIST_CANDIDATES: usize = 64;

pub fn shortlist() -> Rewrite<Node, TypeAnalysis> {
    Rewrite::new("shortlist-draft-head", head_top_k(), HeadTopK(shortlisted)).expect("valid rule")
}

pub fn shortlist_soft_capped() -> Rewrite<Node, TypeAnalysis> {
    Rewrite::new(
        "shortlist-draft-head-soft-capped",
        capped_head_top_k(),
        HeadTopK(shortlisted),
    )
    .expect("valid rule")
}

/// The shortlist of a head `w` of whole blocks of 32; the cap, which keeps the order, dropped.
fn shortlisted(egraph: &BbcGraph, w: Id, k: usize, _soft_cap: Option<f32>) -> Option<Op> {
    let blocks = width(egraph, w).is_some_and(|d| d.is_multiple_of(32));
    (ty(egraph, w).constant && blocks).then_some(Op::ShortlistTopK {
        k,
        candidates: SHORTLIST_CANDIDATES.max(k),
    })
}
