//! The rewrite rules, one file per fusion. Every rule has a name (`Rewrite::name`), a comment
//! citing what it implements, and a property test (in `tests/`) that runs the graph before and
//! after it in the IR interpreter on random shapes and values.

pub mod draft_head;
pub mod elementwise;
pub mod gated_mlp;
pub mod joined_projections;
pub mod lm_head;
pub mod norm_matmul;
pub mod residual_norm;
pub mod residual_norm_matmul;
pub mod rope_attention;

use crate::analysis::{op_of, type_of, BbcGraph, ClassData, Type};
use crate::lang::{attr_symbol, make_node, Node};
use egg::{Id, Subst, Var};
use ir::{DType, Op};

/// Add `op` over `inputs` (value classes) to the e-graph.
pub(crate) fn add_op(egraph: &mut BbcGraph, op: &Op, inputs: &[Id]) -> Id {
    // Non-leaf attributes ignore the type arguments.
    let attr = egraph.add(Node::Attr(attr_symbol(op, &ir::Shape(vec![]), DType::F32)));
    egraph.add(make_node(op, attr, inputs))
}

/// The op held by the attribute class bound to `var`.
pub(crate) fn attr_op(egraph: &BbcGraph, subst: &Subst, var: &str) -> Op {
    let id = subst[var.parse::<Var>().expect("a pattern variable")];
    match &egraph[id].data {
        ClassData::Attr(op, _) => op.clone(),
        ClassData::Value(_) => panic!("{var} is bound to a value, not an attribute"),
    }
}

pub(crate) fn var(subst: &Subst, name: &str) -> Id {
    subst[name.parse::<Var>().expect("a pattern variable")]
}

pub(crate) fn ty(egraph: &BbcGraph, id: Id) -> Type {
    type_of(egraph, id).cloned().expect("a value class")
}

/// Width (last dim) of a value class, when constant.
pub(crate) fn width(egraph: &BbcGraph, id: Id) -> Option<usize> {
    ty(egraph, id).shape.last()?.as_const()
}

/// `(eps, weight_offset)` of the `rms_norm` bound to `norm` when it normalises whole rows of
/// `x` (one group as wide as the row): the only norms the fused ops take.
pub(crate) fn full_row_norm(egraph: &BbcGraph, subst: &Subst, norm: &str, x: Id) -> Option<(f64, f32)> {
    match attr_op(egraph, subst, norm) {
        Op::RmsNorm {
            eps,
            weight_offset,
            group,
        } if width(egraph, x) == Some(group) => Some((eps, weight_offset)),
        _ => None,
    }
}

/// The first e-node of `class` whose op satisfies `pick`, with its op.
pub(crate) fn find_node(egraph: &BbcGraph, class: Id, pick: impl Fn(&Op) -> bool) -> Option<(Node, Op)> {
    egraph[class]
        .nodes
        .iter()
        .find_map(|n| op_of(egraph, n).filter(|op| pick(op)).map(|op| (n.clone(), op)))
}

/// Union each pair; the classes that changed (what an applier reports, so that a rule whose
/// unions are all known already counts as not applied and the runner can saturate).
pub(crate) fn unite(egraph: &mut BbcGraph, pairs: &[(Id, Id)]) -> Vec<Id> {
    pairs
        .iter()
        .filter(|(a, b)| egraph.union(*a, *b))
        .map(|(a, _)| *a)
        .collect()
}
