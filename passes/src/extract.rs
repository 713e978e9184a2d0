//! From a saturated e-graph back to an IR graph: the cheapest e-node of each e-class under the
//! target's cost model (ties broken by e-node order, which the deterministic egg build keeps
//! stable), assembled as a DAG in post-order so shared classes stay shared.
//!
//! The cheapest nodes are found with a worklist: a class is (re)costed when one of its inputs
//! gets a cheaper cost, so each is costed a few times. egg's `Extractor` recosts every class
//! until a whole sweep changes nothing, and classes a rule adds (a joined matmul) sit after the
//! classes reading them, so a sweep moves costs one such step: dozens of sweeps over a 64-layer
//! graph, each merging every node's DAG cost.
//!
//! Then the picks are made to agree (`agree`): where two values one fused op makes came out
//! cheapest in different ways (and both ways would be built), all the classes that can be
//! slices of that op try taking them together, kept where that lowers the whole graph's cost.

use crate::analysis::{BbcGraph, ClassData};
use crate::cost::{CostModel, DagCost, TargetCost};
use crate::lang::{add_to_graph, split, Node};
use egg::{CostFunction, Id, Language};
use ir::{Graph, GraphError, NodeId};
use std::collections::{HashMap, HashSet, VecDeque};

pub fn extract(egraph: &BbcGraph, roots: &[(String, Id)], name: &str, model: CostModel) -> Result<Graph, GraphError> {
    let mut cost = TargetCost::new(egraph, model);
    let mut best: HashMap<Id, Node> = cheapest_nodes(egraph, &mut cost)
        .into_iter()
        .map(|(class, (_, node))| (class, node))
        .collect();
    let root_classes: Vec<Id> = roots.iter().map(|(_, root)| egraph.find(*root)).collect();
    agree(egraph, &cost, &mut best, &root_classes);
    let mut graph = Graph::new(name);
    let mut built: HashMap<Id, NodeId> = HashMap::new();
    for (output, root) in roots {
        let id = build(egraph, &best, &mut graph, &mut built, egraph.find(*root))?;
        graph.set_output(output.clone(), id);
    }
    Ok(graph)
}

/// Each class's cheapest node (where one of its nodes can be costed) and its cost.
fn cheapest_nodes(egraph: &BbcGraph, cost: &mut TargetCost) -> HashMap<Id, (DagCost, Node)> {
    // Which classes read each class.
    let mut readers: HashMap<Id, Vec<Id>> = HashMap::new();
    for class in egraph.classes() {
        for node in &class.nodes {
            for &child in node.children() {
                readers.entry(egraph.find(child)).or_default().push(class.id);
            }
        }
    }
    let mut best: HashMap<Id, (DagCost, Node)> = HashMap::new();
    let mut queue: VecDeque<Id> = inputs_first(egraph, &readers).into();
    let mut queued: HashSet<Id> = queue.iter().copied().collect();
    while let Some(class) = queue.pop_front() {
        queued.remove(&class);
        let mut cheapest: Option<(DagCost, &Node)> = None;
        for node in &egraph[class].nodes {
            if !node.children().iter().all(|c| best.contains_key(&egraph.find(*c))) {
                continue;
            }
            let c = cost.cost(node, |child| best[&egraph.find(child)].0.clone());
            if cheapest.as_ref().is_none_or(|(b, _)| c.total < b.total) {
                cheapest = Some((c, node));
            }
        }
        let Some((c, node)) = cheapest else { continue };
        let improved = best.get(&class).is_none_or(|(old, _)| c.total < old.total);
        if !improved {
            continue;
        }
        best.insert(class, (c, node.clone()));
        for &reader in readers.get(&class).into_iter().flatten() {
            if queued.insert(reader) {
                queue.push_back(reader);
            }
        }
    }
    best
}

/// Most rounds of `agree`: a round tries every move, and is repeated while one was taken (one
/// or two rounds in practice).
const AGREEMENT_ROUNDS: usize = 4;

/// Make the per-class picks agree. Each class's cheapest node is chosen alone, and a class's
/// cost counts a slice's share of a fused op with a share of everything before it, so two
/// values one fused op makes can each come out cheapest another way: the sum of a layer's
/// residual from `add_rms_norm_matmul` and its product from the unfused `add_rms_norm` and
/// matmul, which computes the product twice. A move here takes, for one op whose output
/// several classes can be slices of, that slice in every one of them (one class at a time, the
/// first would pay for the whole op alone and never move); it is kept where it lowers the cost
/// of the whole graph the roots need (every op once), until no move does.
fn agree(egraph: &BbcGraph, cost: &TargetCost, best: &mut HashMap<Id, Node>, roots: &[Id]) {
    let mut own: HashMap<Node, f64> = HashMap::new();
    let mut current = graph_cost(egraph, cost, best, roots, &mut own);
    let moves = moves(egraph, best);
    for _ in 0..AGREEMENT_ROUNDS {
        let mut changed = false;
        for picks in &moves {
            if picks.iter().all(|(class, node)| best[class] == *node) {
                continue;
            }
            let previous: Vec<(Id, Node)> = picks
                .iter()
                .map(|(class, node)| (*class, best.insert(*class, node.clone()).expect("a picked class")))
                .collect();
            let total = graph_cost(egraph, cost, best, roots, &mut own);
            match total < current {
                true => {
                    current = total;
                    changed = true;
                }
                false => best.extend(previous),
            }
        }
        if !changed {
            break;
        }
    }
}

/// The moves `agree` tries: for each op (in class order) that two or more classes can be
/// slices of, those classes taking their slices of it.
fn moves(egraph: &BbcGraph, best: &HashMap<Id, Node>) -> Vec<Vec<(Id, Node)>> {
    let costable = |node: &Node| node.children().iter().all(|c| best.contains_key(&egraph.find(*c)));
    let mut slices_of: HashMap<Id, Vec<(Id, Node)>> = HashMap::new();
    let mut classes: Vec<Id> = egraph
        .classes()
        .map(|c| c.id)
        .filter(|c| best.contains_key(c))
        .collect();
    classes.sort();
    for &class in &classes {
        for node in egraph[class].nodes.iter().filter(|n| costable(n)) {
            let (Node::Slice(_), Some((_, inputs))) = (node, split(node)) else {
                continue;
            };
            let readers = slices_of.entry(egraph.find(inputs[0])).or_default();
            if readers.last().is_none_or(|(c, _)| *c != class) {
                readers.push((class, node.clone()));
            }
        }
    }
    let mut ops: Vec<Id> = slices_of.keys().copied().collect();
    ops.sort();
    ops.into_iter()
        .map(|op| slices_of.remove(&op).expect("a sliced op"))
        .filter(|group| group.len() > 1)
        .collect()
}

/// The own costs of every class the roots need through the picked nodes, each once; infinite
/// where the picks form a loop. `own` remembers each node's own cost.
fn graph_cost(
    egraph: &BbcGraph,
    cost: &TargetCost,
    best: &HashMap<Id, Node>,
    roots: &[Id],
    own: &mut HashMap<Node, f64>,
) -> f64 {
    const UNSEEN: u8 = 0;
    const OPEN: u8 = 1;
    const DONE: u8 = 2;
    // By class id: OPEN while a class's inputs are being walked, DONE once they all are.
    let mut state = vec![UNSEEN; egraph.classes().map(|c| usize::from(c.id) + 1).max().unwrap_or(0)];
    let mut stack: Vec<(Id, bool)> = roots.iter().map(|&r| (r, false)).collect();
    let mut total = 0.0;
    while let Some((class, leaving)) = stack.pop() {
        let seen = &mut state[usize::from(class)];
        match (leaving, *seen) {
            (true, _) => {
                *seen = DONE;
                continue;
            }
            (false, DONE) => continue,
            // Met again among its own inputs.
            (false, OPEN) => return f64::INFINITY,
            _ => *seen = OPEN,
        }
        let Some(node) = best.get(&class) else {
            return f64::INFINITY;
        };
        total += match own.get(node) {
            Some(&c) => c,
            None => *own.entry(node.clone()).or_insert(cost.node_own(node)),
        };
        stack.push((class, true));
        stack.extend(node.children().iter().map(|&c| (egraph.find(c), false)));
    }
    total
}

/// Every class, each after the classes its nodes read (Kahn's order), then any on a loop.
/// Costed in this order, a class's inputs have their final costs when it is costed.
fn inputs_first(egraph: &BbcGraph, readers: &HashMap<Id, Vec<Id>>) -> Vec<Id> {
    let mut waiting: HashMap<Id, usize> = egraph
        .classes()
        .map(|class| {
            let inputs: HashSet<Id> = class
                .nodes
                .iter()
                .flat_map(|n| n.children().iter().map(|&c| egraph.find(c)))
                .filter(|&c| c != class.id)
                .collect();
            (class.id, inputs.len())
        })
        .collect();
    let mut ids: Vec<Id> = egraph.classes().map(|c| c.id).collect();
    ids.sort();
    let mut order: Vec<Id> = ids.iter().copied().filter(|id| waiting[id] == 0).collect();
    let mut at = 0;
    while at < order.len() {
        let class = order[at];
        at += 1;
        let mut unique: Vec<Id> = readers.get(&class).cloned().unwrap_or_default();
        unique.sort();
        unique.dedup();
        for reader in unique.into_iter().filter(|&r| r != class) {
            let w = waiting.get_mut(&reader).expect("a class");
            *w -= 1;
            if *w == 0 {
                order.push(reader);
            }
        }
    }
    let placed: HashSet<Id> = order.iter().copied().collect();
    order.extend(ids.into_iter().filter(|id| !placed.contains(id)));
    order
}

/// Build `root` and everything it needs, children first (an explicit stack: graphs are deep).
fn build(
    egraph: &BbcGraph,
    best: &HashMap<Id, Node>,
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
        let Some(node) = best.get(&class) else {
            return Err(GraphError::Order {
                graph: format!("{} (extracting: no node of class {class} can be costed)", graph.name),
                node: usize::from(class),
                input: usize::from(class),
            });
        };
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
