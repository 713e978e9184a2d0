//! From a saturated e-graph back to an IR graph: the cheapest e-node of each e-class under the
//! target's cost model (egg's extractor; ties broken by e-node order, which the deterministic
//! egg build keeps stable), assembled as a DAG in post-order so shared classes stay shared.

use crate::analysis::{BbcGraph, ClassData};
use crate::cost::{CostModel, TargetCost};
use crate::lang::{add_to_graph, split};
use egg::{Extractor, Id};
use ir::{Graph, GraphError, NodeId};
use std::collections::{HashMap, HashSet};

pub fn extract(egraph: &BbcGraph, roots: &[(String, Id)], name: &str, model: CostModel) -> Result<Graph, GraphError> {
    let extractor = Extractor::new(egraph, TargetCost::new(egraph, model));
    let mut graph = Graph::new(name);
    let mut built: HashMap<Id, NodeId> = HashMap::new();
    for (output, root) in roots {
        let id = build(egraph, &extractor, &mut graph, &mut built, egraph.find(*root))?;
        graph.set_output(output.clone(), id);
    }
    Ok(graph)
}

/// Build `root` and everything it needs, children first (an explicit stack: graphs are deep).
fn build(
    egraph: &BbcGraph,
    extractor: &Extractor<TargetCost, crate::lang::Node, crate::analysis::TypeAnalysis>,
    graph: &mut Graph,
    built: &mut HashMap<Id, NodeId>,
    root: Id,
) -> Result<NodeId, GraphError> {
    let mut stack = vec![(root, false)];
    // Classes whose inputs are being built: meeting one again among its own inputs is a loop
    // in the chosen nodes, which would otherwise grow the stack without end.
    let mut open: HashSet<Id> = HashSet::new();
    while let Some((class, children_done)) = stack.pop() {
        if built.contains_key(&class) {
            continue;
        }
        let node = extractor.find_best_node(class);
        let (attr, inputs) = split(node).expect("value classes hold op nodes");
        let inputs: Vec<Id> = inputs.iter().map(|&i| egraph.find(i)).collect();
        if !children_done {
            if let Some(&looped) = inputs.iter().find(|i| open.contains(i)) {
                return Err(GraphError::Order {
                    graph: format!("{} (extracting: the cheapest nodes form a loop)", graph.name),
                    node: usize::from(class),
                    input: usize::from(looped),
                });
            }
            open.insert(class);
            stack.push((class, true));
            stack.extend(
                inputs
                    .iter()
                    .rev()
                    .filter(|i| !built.contains_key(i))
                    .map(|&i| (i, false)),
            );
            continue;
        }
        let ClassData::Attr(op, leaf) = egraph[attr].data.clone() else {
            unreachable!("attributes are attr classes")
        };
        let args: Vec<NodeId> = inputs.iter().map(|i| built[i]).collect();
        let id = add_to_graph(graph, op, leaf, &args)?;
        built.insert(class, id);
        open.remove(&class);
    }
    Ok(built[&root])
}
