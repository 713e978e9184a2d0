//! The e-graph's type analysis: every e-class knows its shape and dtype (inferred by the IR's
//! own rules from its children), and whether it is a constant (weights and their transforms).
//! Rules read it for their conditions; the cost model reads it for bytes and flops.

use crate::lang::{parse_attr, split, Node};
use egg::{Analysis, DidMerge, EGraph, Id};
use ir::{DType, Op, Shape};
use std::collections::HashMap;

#[derive(Debug, Clone, PartialEq)]
pub struct Type {
    pub shape: Shape,
    pub dtype: DType,
    /// Known at compile time (weights, stacked weights).
    pub constant: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ClassData {
    /// An attribute leaf: the op it describes.
    Attr(Op, Option<(Shape, DType)>),
    Value(Type),
}

#[derive(Default)]
pub struct TypeAnalysis {
    attrs: HashMap<egg::Symbol, (Op, Option<(Shape, DType)>)>,
}

pub type BbcGraph = EGraph<Node, TypeAnalysis>;

impl TypeAnalysis {
    fn attr(&mut self, symbol: egg::Symbol) -> (Op, Option<(Shape, DType)>) {
        self.attrs.entry(symbol).or_insert_with(|| parse_attr(symbol)).clone()
    }
}

/// The op an e-node stands for.
pub fn op_of(egraph: &BbcGraph, node: &Node) -> Option<Op> {
    let (attr, _) = split(node)?;
    match &egraph[attr].data {
        ClassData::Attr(op, _) => Some(op.clone()),
        ClassData::Value(_) => None,
    }
}

/// The type of a value class (`None` for attribute leaves).
pub fn type_of(egraph: &BbcGraph, id: Id) -> Option<&Type> {
    match &egraph[id].data {
        ClassData::Value(t) => Some(t),
        ClassData::Attr(..) => None,
    }
}

impl Analysis<Node> for TypeAnalysis {
    type Data = ClassData;

    fn make(egraph: &mut BbcGraph, enode: &Node, _id: Id) -> ClassData {
        if let Node::Attr(symbol) = enode {
            let (op, leaf) = egraph.analysis.attr(*symbol);
            return ClassData::Attr(op, leaf);
        }
        let (attr, inputs) = split(enode).expect("op nodes have an attribute");
        let ClassData::Attr(op, leaf) = egraph[attr].data.clone() else {
            panic!("the first child of an op node is its attribute");
        };
        if let Some((shape, dtype)) = leaf {
            return ClassData::Value(Type {
                shape,
                dtype,
                constant: matches!(op, Op::Weight { .. }),
            });
        }
        let types: Vec<Type> = inputs
            .iter()
            .map(|&i| type_of(egraph, i).cloned().expect("op inputs are values"))
            .collect();
        let refs: Vec<(&Shape, DType)> = types.iter().map(|t| (&t.shape, t.dtype)).collect();
        let (shape, dtype) = op
            .infer(&refs)
            .unwrap_or_else(|e| panic!("a rewrite built an ill-typed {}: {e}", op.name()));
        ClassData::Value(Type {
            shape,
            dtype,
            constant: op.is_weight_transform() && types.iter().all(|t| t.constant),
        })
    }

    fn merge(&mut self, a: &mut ClassData, b: ClassData) -> DidMerge {
        // Rewrites preserve types: two merged classes must agree.
        match (&*a, &b) {
            (ClassData::Value(x), ClassData::Value(y)) => {
                assert_eq!(
                    (&x.shape, x.dtype),
                    (&y.shape, y.dtype),
                    "a rewrite changed a value's type"
                );
                let constant = x.constant || y.constant;
                let changed = constant != x.constant;
                if let ClassData::Value(x) = a {
                    x.constant = constant;
                }
                DidMerge(changed, constant != y.constant)
            }
            _ => DidMerge(false, false),
        }
    }
}
