//! Elementwise chains collapse into one `elementwise` op carrying an expression tree, which the
//! kernel generator turns into a single kernel (XLA's loop fusion). Two rules: `lift-*` turns
//! each elementwise op into a one-op expression; `merge-elementwise` inlines an elementwise
//! input into its consumer. A producer with other consumers is recomputed in each: cheap
//! arithmetic is worth a launch and a round trip, and the cost model has the final word.
//! Merged expressions are capped (inputs, ops) so saturation stays bounded.

use super::{add_op, attr_op, find_node, unite, var};
use crate::analysis::{op_of, BbcGraph, TypeAnalysis};
use crate::lang::{split, Node};
use egg::{Applier, Id, Pattern, PatternAst, Rewrite, SearchMatches, Searcher, Subst, Symbol, Var};
use ir::{Expr, Op};

const MAX_INPUTS: usize = 6;
const MAX_OPS: usize = 32;

pub fn lift_rules() -> Vec<Rewrite<Node, TypeAnalysis>> {
    [
        ("lift-silu", "(silu ?a ?x)"),
        ("lift-gelu-tanh", "(gelu_tanh ?a ?x)"),
        ("lift-sigmoid", "(sigmoid ?a ?x)"),
        ("lift-soft-cap", "(soft_cap ?a ?x)"),
        ("lift-scale", "(scale ?a ?x)"),
        ("lift-add", "(add ?a ?x ?y)"),
        ("lift-mul", "(mul ?a ?x ?y)"),
    ]
    .into_iter()
    .map(|(name, pattern)| {
        let searcher: Pattern<Node> = pattern.parse().expect("valid pattern");
        Rewrite::new(name, searcher, Lift).expect("valid rule")
    })
    .collect()
}

pub fn merge_elementwise() -> Rewrite<Node, TypeAnalysis> {
    Rewrite::new("merge-elementwise", HasElementwiseInput, Merge).expect("valid rule")
}

/// The one-op expression of an elementwise op over `$0` (and `$1`).
fn single_op_expr(op: &Op) -> Option<Expr> {
    let x = || Box::new(Expr::Input(0));
    let y = || Box::new(Expr::Input(1));
    Some(match op {
        Op::Silu => Expr::Silu(x()),
        Op::GeluTanh => Expr::GeluTanh(x()),
        Op::Sigmoid => Expr::Sigmoid(x()),
        Op::SoftCap { cap } => Expr::SoftCap(x(), *cap),
        Op::Scale { factor } => Expr::Scale(x(), *factor),
        Op::Add => Expr::Add(x(), y()),
        Op::Mul => Expr::Mul(x(), y()),
        _ => return None,
    })
}

struct Lift;

impl Applier<Node, TypeAnalysis> for Lift {
    fn apply_one(
        &self,
        egraph: &mut BbcGraph,
        eclass: Id,
        subst: &Subst,
        _: Option<&PatternAst<Node>>,
        _: Symbol,
    ) -> Vec<Id> {
        let Some(expr) = single_op_expr(&attr_op(egraph, subst, "?a")) else {
            return vec![];
        };
        let mut inputs = vec![var(subst, "?x")];
        if expr.arity() == 2 {
            inputs.push(var(subst, "?y"));
        }
        let lifted = add_op(egraph, &Op::Elementwise { expr }, &inputs);
        unite(egraph, &[(eclass, lifted)])
    }
}

/// Matches e-classes holding an `elementwise` node with an input class that holds one too.
struct HasElementwiseInput;

fn is_elementwise(op: &Op) -> bool {
    matches!(op, Op::Elementwise { .. })
}

impl Searcher<Node, TypeAnalysis> for HasElementwiseInput {
    fn search_eclass_with_limit(&self, egraph: &BbcGraph, eclass: Id, limit: usize) -> Option<SearchMatches<'_, Node>> {
        let found = egraph[eclass].nodes.iter().any(|n| {
            op_of(egraph, n).is_some_and(|op| is_elementwise(&op))
                && split(n)
                    .is_some_and(|(_, inputs)| inputs.iter().any(|&i| find_node(egraph, i, is_elementwise).is_some()))
        });
        (found && limit > 0).then(|| SearchMatches {
            eclass,
            substs: vec![Subst::default()],
            ast: None,
        })
    }

    fn vars(&self) -> Vec<Var> {
        vec![]
    }
}

struct Merge;

impl Applier<Node, TypeAnalysis> for Merge {
    fn apply_one(
        &self,
        egraph: &mut BbcGraph,
        eclass: Id,
        _: &Subst,
        _: Option<&PatternAst<Node>>,
        _: Symbol,
    ) -> Vec<Id> {
        let mut merged = Vec::new();
        let consumers: Vec<(Node, Op)> = egraph[eclass]
            .nodes
            .iter()
            .filter_map(|n| op_of(egraph, n).filter(is_elementwise).map(|op| (n.clone(), op)))
            .collect();
        for (node, op) in consumers {
            let Op::Elementwise { expr } = op else { continue };
            let inputs: Vec<Id> = split(&node).expect("an op node").1.to_vec();
            for (i, &input) in inputs.iter().enumerate() {
                let Some((inner_node, Op::Elementwise { expr: inner })) = find_node(egraph, input, is_elementwise)
                else {
                    continue;
                };
                let inner_inputs = split(&inner_node).expect("an op node").1.to_vec();
                // New inputs: the consumer's before i, the producer's, the consumer's after i.
                let mut all: Vec<Id> = inputs[..i].to_vec();
                all.extend(&inner_inputs);
                all.extend(&inputs[i + 1..]);
                let shift = inner_inputs.len();
                let combined = expr.substitute(&|j| match j.cmp(&i) {
                    std::cmp::Ordering::Less => Expr::Input(j),
                    std::cmp::Ordering::Equal => inner.substitute(&|k| Expr::Input(i + k)),
                    std::cmp::Ordering::Greater => Expr::Input(j - 1 + shift),
                });
                if all.len() > MAX_INPUTS || combined.ops() > MAX_OPS {
                    continue;
                }
                let fused = add_op(egraph, &Op::Elementwise { expr: combined }, &all);
                merged.push(fused);
            }
        }
        let pairs: Vec<(Id, Id)> = merged.into_iter().map(|m| (eclass, m)).collect();
        unite(egraph, &pairs)
    }
}
