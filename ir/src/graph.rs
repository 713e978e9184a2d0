//! The graph: nodes in topological order (every input precedes its user), named outputs.
//!
//! Invariants, checked by [`Graph::validate`]: inputs refer to earlier nodes; each node's
//! shape and dtype are what its op infers from its inputs; a `shared_kv_attention` reads a
//! cache slot an earlier attention appends to, of the same layout; outputs exist.

use crate::op::Op;
use crate::{DType, Dim, InputKind, Shape};
use petgraph::graph::DiGraph;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct NodeId(pub usize);

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<NodeId>,
    pub shape: Shape,
    pub dtype: DType,
}

#[derive(Debug, thiserror::Error)]
pub enum GraphError {
    #[error("graph `{graph}`, node %{node} ({op}): {message}")]
    Shape {
        graph: String,
        node: usize,
        op: &'static str,
        message: String,
    },
    #[error("graph `{graph}`: node %{node} reads %{input}, which does not precede it")]
    Order { graph: String, node: usize, input: usize },
    #[error("graph `{graph}`: output `{name}` refers to missing node %{node}")]
    Output { graph: String, name: String, node: usize },
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Graph {
    pub name: String,
    nodes: Vec<Node>,
    outputs: Vec<(String, NodeId)>,
}

impl Graph {
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            nodes: Vec::new(),
            outputs: Vec::new(),
        }
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.0]
    }

    pub fn outputs(&self) -> &[(String, NodeId)] {
        &self.outputs
    }

    pub fn output(&self, name: &str) -> Option<NodeId> {
        self.outputs.iter().find(|(n, _)| n == name).map(|(_, id)| *id)
    }

    pub fn set_output(&mut self, name: impl Into<String>, id: NodeId) {
        let name = name.into();
        self.outputs.retain(|(n, _)| *n != name);
        self.outputs.push((name, id));
    }

    fn push(&mut self, op: Op, inputs: Vec<NodeId>, shape: Shape, dtype: DType) -> NodeId {
        self.nodes.push(Node {
            op,
            inputs,
            shape,
            dtype,
        });
        NodeId(self.nodes.len() - 1)
    }

    pub fn input(&mut self, kind: InputKind) -> NodeId {
        self.push(Op::Input(kind), vec![], Shape::new([crate::TOKENS]), DType::I32)
    }

    /// The `HiddenStates` input: `f32[tokens, width]`.
    pub fn hidden_states_input(&mut self, width: usize) -> NodeId {
        let shape = Shape::new([crate::TOKENS, Dim::Const(width)]);
        self.push(Op::Input(InputKind::HiddenStates), vec![], shape, DType::F32)
    }

    pub fn weight(&mut self, name: impl Into<String>, shape: &[usize], dtype: DType) -> NodeId {
        let shape = Shape::new(shape.iter().map(|&d| Dim::Const(d)));
        self.push(Op::Weight { name: name.into() }, vec![], shape, dtype)
    }

    /// Append `op` applied to `inputs`, inferring its shape; an error names the node and why.
    pub fn add(&mut self, op: Op, inputs: &[NodeId]) -> Result<NodeId, GraphError> {
        let (shape, dtype) = self.infer(self.nodes.len(), &op, inputs)?;
        Ok(self.push(op, inputs.to_vec(), shape, dtype))
    }

    fn infer(&self, at: usize, op: &Op, inputs: &[NodeId]) -> Result<(Shape, DType), GraphError> {
        if let Some(bad) = inputs.iter().find(|i| i.0 >= at) {
            return Err(GraphError::Order {
                graph: self.name.clone(),
                node: at,
                input: bad.0,
            });
        }
        let ins: Vec<(&Shape, DType)> = inputs
            .iter()
            .map(|i| (&self.nodes[i.0].shape, self.nodes[i.0].dtype))
            .collect();
        op.infer(&ins).map_err(|message| GraphError::Shape {
            graph: self.name.clone(),
            node: at,
            op: op.name(),
            message,
        })
    }

    /// Check the invariants above.
    pub fn validate(&self) -> Result<(), GraphError> {
        for (at, node) in self.nodes.iter().enumerate() {
            if matches!(node.op, Op::Input(_) | Op::Weight { .. }) {
                continue;
            }
            let (shape, dtype) = self.infer(at, &node.op, &node.inputs)?;
            if shape != node.shape || dtype != node.dtype {
                return Err(GraphError::Shape {
                    graph: self.name.clone(),
                    node: at,
                    op: node.op.name(),
                    message: format!("recorded {}{} but inputs give {dtype}{shape}", node.dtype, node.shape),
                });
            }
        }
        self.validate_shared_kv()?;
        for (name, id) in &self.outputs {
            if id.0 >= self.nodes.len() {
                return Err(GraphError::Output {
                    graph: self.name.clone(),
                    name: name.clone(),
                    node: id.0,
                });
            }
        }
        Ok(())
    }

    /// Every `shared_kv_attention` reads a slot an earlier node appends to, laid out as it
    /// reads it (its heads of keys and values, their size and storage).
    fn validate_shared_kv(&self) -> Result<(), GraphError> {
        let mut appended: Vec<&crate::AttentionSpec> = Vec::new();
        for (at, node) in self.nodes.iter().enumerate() {
            if let Some(spec) = node.op.appended_attention() {
                appended.push(spec);
            }
            let Op::SharedKvAttention(spec) = &node.op else {
                continue;
            };
            let writer = appended.iter().rev().find(|w| w.cache_slot == spec.cache_slot);
            let fits = writer.is_some_and(|w| {
                (w.kv_heads, w.head_dim, w.cache_dtype) == (spec.kv_heads, spec.head_dim, spec.cache_dtype)
            });
            if !fits {
                return Err(GraphError::Shape {
                    graph: self.name.clone(),
                    node: at,
                    op: node.op.name(),
                    message: match writer {
                        None => format!("no earlier attention appends to cache slot {}", spec.cache_slot),
                        Some(w) => format!("cache slot {} holds {w:?}, read as {spec:?}", spec.cache_slot),
                    },
                });
            }
        }
        Ok(())
    }

    /// The data-flow graph as petgraph, edges from producer to consumer weighted by operand index.
    pub fn to_petgraph(&self) -> DiGraph<&Node, usize> {
        let mut g = DiGraph::with_capacity(self.nodes.len(), self.nodes.len() * 2);
        let ids: Vec<_> = self.nodes.iter().map(|n| g.add_node(n)).collect();
        for (at, node) in self.nodes.iter().enumerate() {
            for (slot, input) in node.inputs.iter().enumerate() {
                g.add_edge(ids[input.0], ids[at], slot);
            }
        }
        g
    }

    /// Remove nodes no output depends on, keeping order; returns how many were removed.
    pub fn prune_dead(&mut self) -> usize {
        let pg = self.to_petgraph();
        let mut live = vec![false; self.nodes.len()];
        for (_, out) in &self.outputs {
            let mut dfs =
                petgraph::visit::Dfs::new(petgraph::visit::Reversed(&pg), petgraph::graph::NodeIndex::new(out.0));
            while let Some(n) = dfs.next(petgraph::visit::Reversed(&pg)) {
                live[n.index()] = true;
            }
        }
        let mut remap = vec![usize::MAX; self.nodes.len()];
        let mut kept = Vec::with_capacity(self.nodes.len());
        for (i, node) in std::mem::take(&mut self.nodes).into_iter().enumerate() {
            if live[i] {
                remap[i] = kept.len();
                kept.push(node);
            }
        }
        let removed = live.len() - kept.len();
        for node in &mut kept {
            for input in &mut node.inputs {
                input.0 = remap[input.0];
            }
        }
        for (_, out) in &mut self.outputs {
            out.0 = remap[out.0];
        }
        self.nodes = kept;
        removed
    }

    /// Ops executed per step: everything but inputs, weights, compile-time weight transforms
    /// (`concat_rows`) and views (`slice`).
    pub fn op_count(&self) -> usize {
        self.nodes
            .iter()
            .filter(|n| {
                !matches!(
                    n.op,
                    Op::Input(_) | Op::Weight { .. } | Op::ConcatRows | Op::Slice { .. }
                )
            })
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TOKENS;

    #[test]
    fn shape_errors_name_the_node() {
        let mut g = Graph::new("t");
        let x = g.input(InputKind::TokenIds);
        let table = g.weight("emb", &[10, 4], DType::F32);
        let h = g.add(Op::Embedding, &[table, x]).unwrap();
        assert_eq!(g.node(h).shape, Shape::new([TOKENS, Dim::Const(4)]));
        let w = g.weight("w", &[3, 5], DType::F32);
        let err = g.add(Op::MatMul, &[h, w]).unwrap_err().to_string();
        assert!(err.contains("%4 (matmul)"), "{err}");
    }

    #[test]
    fn prune_dead_keeps_what_outputs_need() {
        let mut g = Graph::new("t");
        let x = g.input(InputKind::TokenIds);
        let table = g.weight("emb", &[10, 4], DType::F32);
        let h = g.add(Op::Embedding, &[table, x]).unwrap();
        let _unused = g.add(Op::Silu, &[h]).unwrap();
        let y = g.add(Op::Scale { factor: 2.0 }, &[h]).unwrap();
        g.set_output("y", y);
        assert_eq!(g.prune_dead(), 1);
        g.validate().unwrap();
        assert_eq!(g.nodes().len(), 4);
        assert_eq!(g.node(g.output("y").unwrap()).op, Op::Scale { factor: 2.0 });
    }

    /// Hidden states are `f32[tokens, width]`; joining columns needs the same rows, and
    /// gives both widths; the reference interpreter joins each row and refuses hidden states
    /// that do not cover the step's tokens.
    #[test]
    fn hidden_states_join_an_embedding_side_by_side() {
        use crate::reference::{Interpreter, WeightProvider};
        struct Table;
        impl WeightProvider for Table {
            fn weight_f32(&self, _: &str) -> Result<std::sync::Arc<crate::Tensor>, String> {
                Ok(std::sync::Arc::new(crate::Tensor::new(
                    vec![3, 2],
                    vec![0., 1., 10., 11., 20., 21.],
                )))
            }
        }
        let mut g = Graph::new("t");
        let ids = g.input(InputKind::TokenIds);
        let hidden = g.hidden_states_input(3);
        let table = g.weight("emb", &[3, 2], DType::F32);
        let e = g.add(Op::Embedding, &[table, ids]).unwrap();
        let joined = g.add(Op::ConcatColumns, &[e, hidden]).unwrap();
        assert_eq!(g.node(joined).shape, Shape::new([TOKENS, Dim::Const(5)]));
        let last = g.add(Op::LastToken, &[e]).unwrap();
        let err = g.add(Op::ConcatColumns, &[last, hidden]).unwrap_err().to_string();
        assert!(err.contains("concat_columns"), "{err}");
        g.set_output("joined", joined);
        let _positions = g.input(InputKind::Positions);
        let mut interp = Interpreter::new(&Table);
        let out = interp
            .step_with_hidden_states(&g, &[2, 0], &[0, 1], &[1., 2., 3., 4., 5., 6.])
            .unwrap();
        assert_eq!(out["joined"].data, [20., 21., 1., 2., 3., 0., 1., 4., 5., 6.]);
        let err = interp.step(&g, &[2, 0], &[0, 1]).unwrap_err().to_string();
        assert!(err.contains("0 hidden-state values for 2 tokens"), "{err}");
    }

    /// A matrix's columns are taken in an i32 order of as many columns: other orders are
    /// refused by name; the interpreter takes each row's columns in it and refuses an order
    /// that is no permutation.
    #[test]
    fn columns_are_taken_in_an_order() {
        use crate::reference::{Interpreter, WeightProvider};
        struct Order(Vec<f32>);
        impl WeightProvider for Order {
            fn weight_f32(&self, _: &str) -> Result<std::sync::Arc<crate::Tensor>, String> {
                Ok(std::sync::Arc::new(crate::Tensor::new(vec![3], self.0.clone())))
            }
        }
        let mut g = Graph::new("t");
        let _ids = g.input(InputKind::TokenIds);
        let hidden = g.hidden_states_input(3);
        let order = g.weight("order", &[3], DType::I32);
        let taken = g.add(Op::PermuteColumns, &[hidden, order]).unwrap();
        assert_eq!(g.node(taken).shape, Shape::new([TOKENS, Dim::Const(3)]));
        for (shape, dtype) in [(3, DType::F32), (4, DType::I32)] {
            let mut refused = g.clone();
            let other = refused.weight("other", &[shape], dtype);
            let err = refused
                .add(Op::PermuteColumns, &[hidden, other])
                .unwrap_err()
                .to_string();
            assert!(err.contains("permute_columns") && err.contains("not i32[3]"), "{err}");
        }
        g.set_output("taken", taken);
        let _positions = g.input(InputKind::Positions);
        let rows = [1., 2., 3., 4., 5., 6.];
        let out = Interpreter::new(&Order(vec![2., 0., 1.]))
            .step_with_hidden_states(&g, &[0, 0], &[0, 1], &rows)
            .unwrap();
        assert_eq!(out["taken"].data, [3., 1., 2., 6., 4., 5.]);
        let err = Interpreter::new(&Order(vec![2., 0., 2.]))
            .step_with_hidden_states(&g, &[0, 0], &[0, 1], &rows)
            .unwrap_err()
            .to_string();
        assert!(err.contains("column order"), "{err}");
    }

    /// Transposed row groups keep a float weight's type; blocks hold runs of a row, so block-
    /// quantized rows transpose into f32. Picked row groups stay as they are stored.
    #[test]
    fn transposed_blocks_are_f32() {
        let transposed = Op::TransposeRowGroups {
            group: 4,
            start: 0,
            len: 2,
        };
        let picked = Op::RowGroupSlice {
            group: 4,
            start: 0,
            len: 2,
        };
        for (stored, want) in [
            (DType::BF16, DType::BF16),
            (DType::F16, DType::F16),
            (DType::Q8_0, DType::F32),
            (DType::F8E4M3B32, DType::F32),
            (DType::U4B32, DType::F32),
            (DType::U4B128, DType::F32),
            (DType::F4E2M1B32, DType::F32),
        ] {
            let mut g = Graph::new("t");
            let w = g.weight("w", &[8, 64], stored);
            let t = g.add(transposed.clone(), &[w]).unwrap();
            assert_eq!(g.node(t).dtype, want, "{stored}");
            assert_eq!(g.node(t).shape, Shape::new([Dim::Const(128), Dim::Const(2)]));
            let p = g.add(picked.clone(), &[w]).unwrap();
            assert_eq!(g.node(p).dtype, stored);
        }
    }
}
