//! The egg language of the IR: one e-node per op (fused ops included), attributes as a leaf.
//!
//! Every op node's first child is an `Attr` leaf holding the op itself (its JSON form, which
//! round-trips exactly), so rules match on structure with pattern variables and read or build
//! attributes in Rust; inputs and weights carry their kind, name, shape and dtype there.

use egg::{define_language, Id, Symbol};
use ir::{DType, Graph, NodeId, Op, Shape};
use serde_json::json;

define_language! {
    pub enum Node {
        "input" = Input([Id; 1]),
        "weight" = Weight([Id; 1]),
        "embedding" = Embedding([Id; 3]),
        "matmul" = MatMul([Id; 3]),
        "rms_norm" = RmsNorm([Id; 3]),
        "rope" = Rope([Id; 3]),
        "attention" = Attention([Id; 4]),
        "rope_attention" = RopeAttention([Id; 5]),
        "shared_kv_attention" = SharedKvAttention([Id; 2]),
        "add" = Add([Id; 3]),
        "mul" = Mul([Id; 3]),
        "scale" = Scale([Id; 2]),
        "silu" = Silu([Id; 2]),
        "gelu_tanh" = GeluTanh([Id; 2]),
        "last_token" = LastToken([Id; 2]),
        "add_bias" = AddBias([Id; 3]),
        "permute_columns" = PermuteColumns([Id; 3]),
        "sigmoid" = Sigmoid([Id; 2]),
        "soft_cap" = SoftCap([Id; 2]),
        "scale_rows" = ScaleRows([Id; 3]),
        "unit_rms_norm" = UnitRmsNorm([Id; 2]),
        "layer_norm" = LayerNorm([Id; 4]),
        "sparse_mla" = SparseMla(Box<[Id]>),
        "group_slice" = GroupSlice([Id; 2]),
        "gated_delta_net" = GatedDeltaNet([Id; 7]),
        "moe" = Moe(Box<[Id]>),
        "slice" = Slice([Id; 2]),
        "concat_rows" = ConcatRows(Box<[Id]>),
        "concat_columns" = ConcatColumns([Id; 3]),
        "row_group_slice" = RowGroupSlice([Id; 2]),
        "transpose_row_groups" = TransposeRowGroups([Id; 2]),
        "add_rms_norm" = AddRmsNorm([Id; 4]),
        "rms_norm_matmul" = RmsNormMatMul([Id; 4]),
        "add_rms_norm_matmul" = AddRmsNormMatMul([Id; 5]),
        "glu" = Glu([Id; 2]),
        "elementwise" = Elementwise(Box<[Id]>),
        "top_k" = TopK([Id; 2]),
        "int8_bound_top_k" = Int8BoundTopK([Id; 3]),
        "shortlist_top_k" = ShortlistTopK([Id; 3]),
        Attr(Symbol),
    }
}

/// What an `input`/`weight` leaf's attribute holds.
#[derive(Debug, Clone, PartialEq)]
pub struct Leaf {
    pub op: Op,
    pub shape: Shape,
    pub dtype: DType,
}

/// The attribute symbol of an op (and, for leaves, its type).
pub fn attr_symbol(op: &Op, shape: &Shape, dtype: DType) -> Symbol {
    let text = match op {
        Op::Input(_) | Op::Weight { .. } => json!({ "op": op, "shape": shape, "dtype": dtype }).to_string(),
        _ => serde_json::to_string(op).expect("ops serialise"),
    };
    Symbol::from(text)
}

/// The op an attribute symbol holds, with the leaf type for inputs and weights.
pub fn parse_attr(symbol: Symbol) -> (Op, Option<(Shape, DType)>) {
    let text = symbol.as_str();
    let value: serde_json::Value = serde_json::from_str(text).expect("attributes are JSON written by attr_symbol");
    if let Some(op) = value.get("op") {
        let op: Op = serde_json::from_value(op.clone()).expect("a leaf op");
        let shape: Shape = serde_json::from_value(value["shape"].clone()).expect("a leaf shape");
        let dtype: DType = serde_json::from_value(value["dtype"].clone()).expect("a leaf dtype");
        return (op, Some((shape, dtype)));
    }
    (serde_json::from_value(value).expect("an op"), None)
}

/// The e-node for `op` over `attr` and `children`.
pub fn make_node(op: &Op, attr: Id, children: &[Id]) -> Node {
    let with = |n: usize| -> Vec<Id> {
        let mut v = vec![attr];
        v.extend_from_slice(&children[..n.min(children.len())]);
        v
    };
    let arr2 = |v: Vec<Id>| -> [Id; 2] { [v[0], v[1]] };
    let arr3 = |v: Vec<Id>| -> [Id; 3] { [v[0], v[1], v[2]] };
    let arr4 = |v: Vec<Id>| -> [Id; 4] { [v[0], v[1], v[2], v[3]] };
    let arr5 = |v: Vec<Id>| -> [Id; 5] { [v[0], v[1], v[2], v[3], v[4]] };
    match op {
        Op::Input(_) => Node::Input([attr]),
        Op::Weight { .. } => Node::Weight([attr]),
        Op::Embedding => Node::Embedding(arr3(with(2))),
        Op::MatMul => Node::MatMul(arr3(with(2))),
        Op::RmsNorm { .. } => Node::RmsNorm(arr3(with(2))),
        Op::Rope(_) => Node::Rope(arr3(with(2))),
        Op::Attention(_) => Node::Attention(arr4(with(3))),
        Op::RopeAttention { .. } => Node::RopeAttention(arr5(with(4))),
        Op::SharedKvAttention(_) => Node::SharedKvAttention(arr2(with(1))),
        Op::Add => Node::Add(arr3(with(2))),
        Op::Mul => Node::Mul(arr3(with(2))),
        Op::Scale { .. } => Node::Scale(arr2(with(1))),
        Op::Silu => Node::Silu(arr2(with(1))),
        Op::GeluTanh => Node::GeluTanh(arr2(with(1))),
        Op::LastToken => Node::LastToken(arr2(with(1))),
        Op::AddBias => Node::AddBias(arr3(with(2))),
        Op::PermuteColumns => Node::PermuteColumns(arr3(with(2))),
        Op::Sigmoid => Node::Sigmoid(arr2(with(1))),
        Op::SoftCap { .. } => Node::SoftCap(arr2(with(1))),
        Op::ScaleRows => Node::ScaleRows(arr3(with(2))),
        Op::UnitRmsNorm { .. } => Node::UnitRmsNorm(arr2(with(1))),
        Op::LayerNorm { .. } => Node::LayerNorm(arr4(with(3))),
        Op::SparseMla(_) => Node::SparseMla(with(children.len()).into_boxed_slice()),
        Op::GroupSlice { .. } => Node::GroupSlice(arr2(with(1))),
        Op::GatedDeltaNet(_) => {
            let v = with(6);
            Node::GatedDeltaNet([v[0], v[1], v[2], v[3], v[4], v[5], v[6]])
        }
        Op::Moe(_) => Node::Moe(with(children.len()).into_boxed_slice()),
        Op::Slice { .. } => Node::Slice(arr2(with(1))),
        Op::ConcatRows => Node::ConcatRows(with(children.len()).into_boxed_slice()),
        Op::ConcatColumns => Node::ConcatColumns(arr3(with(2))),
        Op::RowGroupSlice { .. } => Node::RowGroupSlice(arr2(with(1))),
        Op::TransposeRowGroups { .. } => Node::TransposeRowGroups(arr2(with(1))),
        Op::AddRmsNorm { .. } => Node::AddRmsNorm(arr4(with(3))),
        Op::RmsNormMatMul { .. } => Node::RmsNormMatMul(arr4(with(3))),
        Op::AddRmsNormMatMul { .. } => Node::AddRmsNormMatMul(arr5(with(4))),
        Op::Glu { .. } => Node::Glu(arr2(with(1))),
        Op::Elementwise { .. } => Node::Elementwise(with(children.len()).into_boxed_slice()),
        Op::TopK { .. } => Node::TopK(arr2(with(1))),
        Op::Int8BoundTopK { .. } => Node::Int8BoundTopK(arr3(with(2))),
        Op::ShortlistTopK { .. } => Node::ShortlistTopK(arr3(with(2))),
    }
}

/// An e-node's attribute child and inputs (everything after the attribute).
pub fn split(node: &Node) -> Option<(Id, &[Id])> {
    match node {
        Node::Attr(_) => None,
        other => {
            let children = egg::Language::children(other);
            Some((children[0], &children[1..]))
        }
    }
}

/// The graph in a fresh e-graph; returns it and each graph node's e-class.
pub fn to_egraph(graph: &Graph) -> (crate::analysis::BbcGraph, Vec<Id>) {
    let mut egraph = crate::analysis::BbcGraph::default();
    let mut classes = Vec::with_capacity(graph.nodes().len());
    for node in graph.nodes() {
        let attr = egraph.add(Node::Attr(attr_symbol(&node.op, &node.shape, node.dtype)));
        let children: Vec<Id> = node.inputs.iter().map(|i| classes[i.0]).collect();
        classes.push(egraph.add(make_node(&node.op, attr, &children)));
    }
    (egraph, classes)
}

/// Rebuild a graph node from a chosen e-node: the op from its attribute, inputs already built.
pub fn add_to_graph(
    graph: &mut Graph,
    op: Op,
    leaf: Option<(Shape, DType)>,
    inputs: &[NodeId],
) -> Result<NodeId, ir::GraphError> {
    match (&op, leaf) {
        (Op::Input(ir::InputKind::HiddenStates), Some((shape, _))) => {
            let width = shape
                .0
                .get(1)
                .and_then(|d| d.as_const())
                .expect("hidden states have a constant width");
            Ok(graph.hidden_states_input(width))
        }
        (Op::Input(kind), _) => Ok(graph.input(*kind)),
        (Op::Weight { name }, Some((shape, dtype))) => {
            let dims: Vec<usize> = shape
                .0
                .iter()
                .map(|d| d.as_const().expect("weights have constant shapes"))
                .collect();
            Ok(graph.weight(name.clone(), &dims, dtype))
        }
        _ => graph.add(op, inputs),
    }
}
