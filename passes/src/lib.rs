//! Named rewrite passes over the IR.
//!
//! Each pass is a small set of named egg rules: the graph goes into an e-graph, the rules run
//! to saturation within fixed bounds (iterations, e-nodes, time), and the cheapest equivalent
//! graph under the target's cost model comes back out, type-checked. The pipeline is a fixed
//! sequence of passes (tinygrad's habit), so `bbc compile --emit-after NAME` can show the graph
//! after any of them. Same input, same output: egg runs deterministically, extraction breaks
//! ties by e-node order.

pub mod analysis;
pub mod cost;
mod extract;
pub mod lang;
pub mod rules;

pub use cost::CostModel;

use analysis::TypeAnalysis;
use egg::{Rewrite, Runner, StopReason};
use ir::Graph;
use lang::Node;
use std::time::Duration;

/// Bounds on one pass's saturation. Fusion rules reach a fixpoint in a few iterations; the
/// bounds only stop a pathological input, and are generous for a 64-layer model.
pub const ITERATION_LIMIT: usize = 12;
pub const NODE_LIMIT: usize = 400_000;
pub const TIME_LIMIT: Duration = Duration::from_secs(20);

pub struct Pass {
    pub name: &'static str,
    pub rules: fn() -> Vec<Rewrite<Node, TypeAnalysis>>,
}

/// The pipeline, in order.
pub const PIPELINE: &[Pass] = &[
    Pass {
        name: "fuse_rope_attention",
        rules: || vec![rules::rope_attention::rope_into_attention()],
    },
    Pass {
        name: "fuse_joined_projections",
        rules: || {
            vec![
                rules::joined_projections::join_projections(),
                rules::joined_projections::compose_slices(),
            ]
        },
    },
    Pass {
        name: "fuse_residual_norm",
        rules: || vec![rules::residual_norm::residual_rms_norm()],
    },
    Pass {
        name: "fuse_gated_mlp",
        rules: || vec![rules::gated_mlp::swiglu(), rules::gated_mlp::geglu()],
    },
    Pass {
        name: "int8_bound_lm_head",
        rules: || {
            vec![
                rules::lm_head::int8_bound_top_k(),
                rules::lm_head::int8_bound_top_k_soft_capped(),
            ]
        },
    },
    Pass {
        name: "fuse_norm_matmul",
        rules: || {
            vec![
                rules::norm_matmul::norm_matmul(),
                rules::residual_norm_matmul::residual_norm_matmul(),
                rules::residual_norm_matmul::residual_norm_matmul_glu(),
            ]
        },
    },
    Pass {
        name: "fuse_elementwise",
        rules: || {
            let mut r = rules::elementwise::lift_rules();
            r.push(rules::elementwise::merge_elementwise());
            r
        },
    },
];

/// A drafter's head, outside the pipeline (drafters' graphs only): see
/// [`rules::draft_head`]. Run before [`optimized`], which would take the same `top_k` into
/// the exact INT8-bound head.
pub const SHORTLIST_DRAFT_HEAD: Pass = Pass {
    name: "shortlist_draft_head",
    rules: || {
        vec![
            rules::draft_head::shortlist(),
            rules::draft_head::shortlist_soft_capped(),
        ]
    },
};

/// `graph` with its greedy head shortlisted in 4 bits ([`SHORTLIST_DRAFT_HEAD`]), where it
/// has a head that qualifies; unchanged elsewhere.
pub fn shortlisted_draft_head(graph: &Graph) -> Result<Graph, PassError> {
    Ok(run_pass(graph, &SHORTLIST_DRAFT_HEAD, CostModel::CPU)?.0)
}

pub fn pass(name: &str) -> Option<&'static Pass> {
    PIPELINE.iter().find(|p| p.name == name)
}

#[derive(Debug, thiserror::Error)]
pub enum PassError {
    #[error("pass {pass} produced an invalid graph: {source}")]
    Invalid {
        pass: &'static str,
        #[source]
        source: ir::GraphError,
    },
    #[error("unknown pass `{0}`; the pipeline is: {1}")]
    UnknownPass(String, String),
}

/// What a pass did.
#[derive(Debug, Clone)]
pub struct PassReport {
    pub pass: &'static str,
    pub iterations: usize,
    pub egraph_nodes: usize,
    pub stop: String,
    /// How often each rule fired.
    pub applied: Vec<(String, usize)>,
    pub ops_before: usize,
    pub ops_after: usize,
}

/// Run one pass on `graph` for the target `model`.
pub fn run_pass(graph: &Graph, pass: &Pass, model: CostModel) -> Result<(Graph, PassReport), PassError> {
    run_rules(graph, pass.name, &(pass.rules)(), model)
}

/// Run `rules` to saturation (within the bounds) and extract the cheapest graph for `model`.
pub fn run_rules(
    graph: &Graph,
    name: &'static str,
    rules: &[Rewrite<Node, TypeAnalysis>],
    model: CostModel,
) -> Result<(Graph, PassReport), PassError> {
    let (egraph, classes) = lang::to_egraph(graph);
    let roots: Vec<(String, egg::Id)> = graph
        .outputs()
        .iter()
        .map(|(n, id)| (n.clone(), classes[id.0]))
        .collect();
    let runner = Runner::default()
        .with_egraph(egraph)
        .with_iter_limit(ITERATION_LIMIT)
        .with_node_limit(NODE_LIMIT)
        .with_time_limit(TIME_LIMIT)
        .run(rules);
    let mut applied: std::collections::BTreeMap<String, usize> = Default::default();
    for iteration in &runner.iterations {
        for (rule, n) in &iteration.applied {
            *applied.entry(rule.to_string()).or_default() += n;
        }
    }
    let stop = match &runner.stop_reason {
        Some(StopReason::Saturated) => "saturated".to_string(),
        Some(other) => format!("{other:?}"),
        None => "unknown".to_string(),
    };
    let mut out = extract::extract(&runner.egraph, &roots, &graph.name, model)
        .map_err(|source| PassError::Invalid { pass: name, source })?;
    out.prune_dead();
    out.validate()
        .map_err(|source| PassError::Invalid { pass: name, source })?;
    let report = PassReport {
        pass: name,
        iterations: runner.iterations.len(),
        egraph_nodes: runner.egraph.total_number_of_nodes(),
        stop,
        applied: applied.into_iter().collect(),
        ops_before: graph.op_count(),
        ops_after: out.op_count(),
    };
    Ok((out, report))
}

/// A graph after each pass of the pipeline.
pub struct Stage {
    pub graph: Graph,
    pub report: PassReport,
}

/// The graph after the whole pipeline (what compiling and running use; `optimize` keeps every
/// stage for reports and `--emit-after`).
pub fn optimized(graph: &Graph, model: CostModel) -> Result<Graph, PassError> {
    Ok(optimize(graph, model, None)?
        .pop()
        .map_or_else(|| graph.clone(), |s| s.graph))
}

/// Run the pipeline (up to and including `until`, when given).
pub fn optimize(graph: &Graph, model: CostModel, until: Option<&str>) -> Result<Vec<Stage>, PassError> {
    if let Some(name) = until {
        if pass(name).is_none() {
            let names: Vec<&str> = PIPELINE.iter().map(|p| p.name).collect();
            return Err(PassError::UnknownPass(name.into(), names.join(", ")));
        }
    }
    let mut stages: Vec<Stage> = Vec::new();
    for p in PIPELINE {
        let input = stages.last().map_or(graph, |s| &s.graph);
        let (graph, report) = run_pass(input, p, model)?;
        stages.push(Stage { graph, report });
        if until == Some(p.name) {
            break;
        }
    }
    Ok(stages)
}
