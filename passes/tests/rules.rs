//! Every rule, on random shapes and values: the graph after the rule computes what the graph
//! before it computes (IR reference interpreter), and the rule actually fired.

use egg::Rewrite;
use ir::reference::{Interpreter, WeightProvider};
use ir::{DType, Expr, Graph, InputKind, NodeId, Op, Tensor};
use passes::analysis::TypeAnalysis;
use passes::lang::Node;
use passes::rules::*;
use passes::CostModel;
use proptest::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;

/// Weights by name, filled with deterministic pseudo-random values.
#[derive(Default)]
struct Weights {
    map: HashMap<String, Arc<Tensor>>,
    seed: u64,
}

impl Weights {
    fn next(&mut self) -> f32 {
        self.seed = self
            .seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn add(&mut self, graph: &mut Graph, name: &str, shape: &[usize]) -> NodeId {
        let n = shape.iter().product();
        let data = (0..n).map(|_| self.next()).collect();
        self.map
            .insert(name.into(), Arc::new(Tensor::new(shape.to_vec(), data)));
        graph.weight(name, shape, DType::F32)
    }
}

impl WeightProvider for Weights {
    fn weight_f32(&self, name: &str) -> Result<Arc<Tensor>, String> {
        self.map.get(name).cloned().ok_or_else(|| format!("no weight {name}"))
    }
}

/// A graph's start: token ids embedded into `[tokens, d]` activations.
fn activation(graph: &mut Graph, weights: &mut Weights, d: usize) -> NodeId {
    let ids = graph.input(InputKind::TokenIds);
    let table = weights.add(graph, "embedding", &[16, d]);
    graph.add(Op::Embedding, &[table, ids]).unwrap()
}

fn outputs(graph: &Graph, weights: &Weights) -> Vec<(String, Vec<f32>)> {
    let mut interp = Interpreter::new(weights);
    let mut all = Vec::new();
    for (ids, first) in [(&[3u32, 7, 1][..], 0), (&[5][..], 3)] {
        let positions: Vec<usize> = (first..first + ids.len()).collect();
        let out = interp.step(graph, ids, &positions).unwrap();
        let mut names: Vec<_> = out.into_iter().collect();
        names.sort_by(|a, b| a.0.cmp(&b.0));
        all.extend(names.into_iter().map(|(n, t)| (n, t.data)));
    }
    all
}

/// A residual add `s = x + x·P` (the sum live, an output) normalised into an `n`-wide matmul
/// `o`: the graph, and `(s, o)`.
fn residual_then_matmul(w: &mut Weights, d: usize, n: usize, offset: bool) -> (Graph, (NodeId, NodeId)) {
    let mut g = Graph::new("residual");
    let x = activation(&mut g, w, d);
    let wm = w.add(&mut g, "proj", &[d, d]);
    let y = g.add(Op::MatMul, &[x, wm]).unwrap();
    let s = g.add(Op::Add, &[x, y]).unwrap();
    let nw = w.add(&mut g, "norm", &[d]);
    let norm = Op::RmsNorm {
        eps: 1e-6,
        weight_offset: if offset { 1.0 } else { 0.0 },
        group: d,
    };
    let h = g.add(norm, &[s, nw]).unwrap();
    let wo = w.add(&mut g, "out", &[n, d]);
    let o = g.add(Op::MatMul, &[h, wo]).unwrap();
    g.set_output("residual", s);
    g.set_output("out", o);
    (g, (s, o))
}

/// Run `rules`; check the named rule fired, the result holds `fused_op`, and outputs agree.
fn check(
    graph: &Graph,
    weights: &Weights,
    rules: Vec<Rewrite<Node, TypeAnalysis>>,
    rule: &str,
    fused_op: &str,
    model: CostModel,
) {
    graph.validate().unwrap();
    let (after, report) = passes::run_rules(graph, "under-test", &rules, model).unwrap();
    assert!(
        report.applied.iter().any(|(r, n)| r == rule && *n > 0),
        "{rule} did not fire: {report:?}"
    );
    assert!(
        after.nodes().iter().any(|n| n.op.name() == fused_op),
        "no {fused_op} in:\n{}",
        after.to_text()
    );
    let (want, got) = (outputs(graph, weights), outputs(&after, weights));
    assert_eq!(want.len(), got.len());
    for ((name, w), (_, g)) in want.iter().zip(&got) {
        let scale = w.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        for (a, b) in w.iter().zip(g) {
            assert!(
                (a - b).abs() <= 1e-5 * scale,
                "{rule}: output {name} differs: {a} vs {b}"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn join_projections_preserves_every_projection(d in 1usize..24, widths in proptest::collection::vec(1usize..20, 2..5), seed in any::<u64>()) {
        let mut g = Graph::new("join");
        let mut w = Weights { seed, ..Default::default() };
        let x = activation(&mut g, &mut w, d);
        for (i, n) in widths.iter().enumerate() {
            let wi = w.add(&mut g, &format!("w{i}"), &[*n, d]);
            let p = g.add(Op::MatMul, &[x, wi]).unwrap();
            g.set_output(format!("p{i}"), p);
        }
        let rules = vec![joined_projections::join_projections(), joined_projections::compose_slices()];
        check(&g, &w, rules, "join-projections", "concat_rows", CostModel::CPU);
    }

    #[test]
    fn rope_into_attention_preserves_attention(
        kv_heads in 1usize..3,
        group in 1usize..3,
        half in 1usize..4,
        rotate_all in prop::bool::ANY,
        adjacent_pairs in prop::bool::ANY,
        bf16_cache in prop::bool::ANY,
        joined in prop::bool::ANY,
        seed in any::<u64>(),
    ) {
        // Q, K and V projections (slices of one joined projection, or three), Q and K roped,
        // over two steps so that the second attends to keys the first cached.
        let (heads, head_dim) = (kv_heads * group, 4 * half);
        let rope = |heads| ir::RopeSpec {
            heads,
            head_dim,
            rotary_dim: if rotate_all { head_dim } else { head_dim / 2 },
            theta: 10000.0,
            position_scale: 1.0,
            layout: if adjacent_pairs { ir::RopeLayout::AdjacentPairs } else { ir::RopeLayout::RotateHalf },
            scaling: ir::RopeScaling::None,
        };
        let attention = ir::AttentionSpec {
            heads,
            kv_heads,
            head_dim,
            scale: 0.5,
            window: None,
            cache_slot: 0,
            cache_dtype: if bf16_cache { DType::BF16 } else { DType::F32 },
        };
        let (q_len, kv_len) = (heads * head_dim, kv_heads * head_dim);
        let mut g = Graph::new("attention");
        let mut w = Weights { seed, ..Default::default() };
        let x = activation(&mut g, &mut w, 6);
        let [q, k, v] = match joined {
            true => {
                let wqkv = w.add(&mut g, "qkv", &[q_len + 2 * kv_len, 6]);
                let qkv = g.add(Op::MatMul, &[x, wqkv]).unwrap();
                [(0, q_len), (q_len, kv_len), (q_len + kv_len, kv_len)]
                    .map(|(start, len)| g.add(Op::Slice { start, len }, &[qkv]).unwrap())
            }
            false => [("q", q_len), ("k", kv_len), ("v", kv_len)].map(|(name, n)| {
                let wp = w.add(&mut g, name, &[n, 6]);
                g.add(Op::MatMul, &[x, wp]).unwrap()
            }),
        };
        let positions = g.input(InputKind::Positions);
        let rq = g.add(Op::Rope(rope(heads)), &[q, positions]).unwrap();
        let rk = g.add(Op::Rope(rope(kv_heads)), &[k, positions]).unwrap();
        let a = g.add(Op::Attention(attention), &[rq, rk, v]).unwrap();
        g.set_output("attention", a);
        let rules = vec![rope_attention::rope_into_attention()];
        check(&g, &w, rules, "rope-into-attention", "rope_attention", CostModel::CPU);
    }

    #[test]
    fn ropes_that_rotate_differently_stay_apart(theta_k in 1000.0f64..5000.0) {
        let spec = |heads, theta| ir::RopeSpec {
            heads,
            head_dim: 4,
            rotary_dim: 4,
            theta,
            position_scale: 1.0,
            layout: ir::RopeLayout::RotateHalf,
            scaling: ir::RopeScaling::None,
        };
        let attention = ir::AttentionSpec {
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
            scale: 0.5,
            window: None,
            cache_slot: 0,
            cache_dtype: DType::F32,
        };
        let mut g = Graph::new("attention");
        let mut w = Weights::default();
        let x = activation(&mut g, &mut w, 4);
        let positions = g.input(InputKind::Positions);
        let [q, k, v] = [("q", 8), ("k", 4), ("v", 4)].map(|(name, n)| {
            let wp = w.add(&mut g, name, &[n, 4]);
            g.add(Op::MatMul, &[x, wp]).unwrap()
        });
        let rq = g.add(Op::Rope(spec(2, 10000.0)), &[q, positions]).unwrap();
        let rk = g.add(Op::Rope(spec(1, theta_k)), &[k, positions]).unwrap();
        let a = g.add(Op::Attention(attention), &[rq, rk, v]).unwrap();
        g.set_output("attention", a);
        let (after, _) = passes::run_rules(&g, "under-test", &[rope_attention::rope_into_attention()], CostModel::H200).unwrap();
        prop_assert!(after.nodes().iter().all(|n| n.op.name() != "rope_attention"), "{}", after.to_text());
    }

    #[test]
    fn compose_slices_preserves_values(n in 2usize..30, a in 0usize..10, b in 0usize..10, seed in any::<u64>()) {
        let (outer_start, inner_start) = (a % n, b % n);
        let inner_len = n - inner_start;
        prop_assume!(outer_start < inner_len);
        let mut g = Graph::new("slices");
        let mut w = Weights { seed, ..Default::default() };
        let x = activation(&mut g, &mut w, n);
        let inner = g.add(Op::Slice { start: inner_start, len: inner_len }, &[x]).unwrap();
        let outer = g.add(Op::Slice { start: outer_start, len: inner_len - outer_start }, &[inner]).unwrap();
        g.set_output("y", outer);
        check(&g, &w, vec![joined_projections::compose_slices()], "compose-slices", "slice", CostModel::CPU);
    }

    #[test]
    fn residual_rms_norm_preserves_sum_and_norm(d in 1usize..32, offset in prop::bool::ANY, seed in any::<u64>()) {
        let mut w = Weights { seed, ..Default::default() };
        let (g, _) = residual_then_matmul(&mut w, d, 3, offset);
        check(&g, &w, vec![residual_norm::residual_rms_norm()], "residual-rms-norm", "add_rms_norm", CostModel::CPU);
    }

    #[test]
    fn residual_norm_matmul_preserves_sum_and_product(d in 1usize..32, n in 1usize..40, offset in prop::bool::ANY, seed in any::<u64>()) {
        let mut w = Weights { seed, ..Default::default() };
        let (mut g, (s, o)) = residual_then_matmul(&mut w, d, n, offset);
        if n == d {
            // The sum read again, as the next residual add reads it.
            let next = g.add(Op::Add, &[s, o]).unwrap();
            g.set_output("next", next);
        }
        // The rule reads what `residual-rms-norm` made, on a GPU target whose cost model takes it.
        let rules = vec![residual_norm::residual_rms_norm(), residual_norm_matmul::residual_norm_matmul()];
        check(&g, &w, rules, "residual-norm-matmul-prologue", "add_rms_norm_matmul", CostModel::H200);
    }

    #[test]
    fn residual_norm_matmul_glu_preserves_sum_and_gated_product(d in 1usize..24, n in 1usize..20, gelu in prop::bool::ANY, seed in any::<u64>()) {
        let mut w = Weights { seed, ..Default::default() };
        let (mut g, (_, product)) = residual_then_matmul(&mut w, d, 2 * n, false);
        let gate = g.add(Op::Slice { start: 0, len: n }, &[product]).unwrap();
        let up = g.add(Op::Slice { start: n, len: n }, &[product]).unwrap();
        let act = g.add(if gelu { Op::GeluTanh } else { Op::Silu }, &[gate]).unwrap();
        let y = g.add(Op::Mul, &[act, up]).unwrap();
        g.set_output("out", y);
        let rules = || vec![
            residual_norm::residual_rms_norm(),
            gated_mlp::swiglu(),
            gated_mlp::geglu(),
            residual_norm_matmul::residual_norm_matmul(),
            residual_norm_matmul::residual_norm_matmul_glu(),
        ];
        check(&g, &w, rules(), "residual-norm-matmul-glu", "add_rms_norm_matmul", CostModel::H200);
        // The glu went into the epilogue: none is left, nor the unfused residual.
        let (after, _) = passes::run_rules(&g, "under-test", &rules(), CostModel::H200).unwrap();
        let names: Vec<&str> = after.nodes().iter().map(|n| n.op.name()).collect();
        prop_assert!(!names.iter().any(|n| matches!(*n, "swiglu" | "geglu" | "add_rms_norm")), "{}", after.to_text());
    }

    #[test]
    fn gated_mlp_preserves_values(d in 1usize..24, n in 1usize..24, gelu in prop::bool::ANY, seed in any::<u64>()) {
        let mut g = Graph::new("glu");
        let mut w = Weights { seed, ..Default::default() };
        let x = activation(&mut g, &mut w, d);
        let wgu = w.add(&mut g, "gate_up", &[2 * n, d]);
        let m = g.add(Op::MatMul, &[x, wgu]).unwrap();
        let gate = g.add(Op::Slice { start: 0, len: n }, &[m]).unwrap();
        let up = g.add(Op::Slice { start: n, len: n }, &[m]).unwrap();
        let act = g.add(if gelu { Op::GeluTanh } else { Op::Silu }, &[gate]).unwrap();
        let y = g.add(Op::Mul, &[act, up]).unwrap();
        g.set_output("y", y);
        let (rule, op) = if gelu { ("fuse-geglu", "geglu") } else { ("fuse-swiglu", "swiglu") };
        check(&g, &w, vec![gated_mlp::swiglu(), gated_mlp::geglu()], rule, op, CostModel::CPU);
    }

    #[test]
    fn norm_matmul_preserves_values(d in 1usize..32, n in 1usize..40, seed in any::<u64>()) {
        let mut g = Graph::new("norm_matmul");
        let mut w = Weights { seed, ..Default::default() };
        let x = activation(&mut g, &mut w, d);
        let nw = w.add(&mut g, "norm", &[d]);
        let h = g.add(Op::RmsNorm { eps: 1e-5, weight_offset: 0.0, group: d }, &[x, nw]).unwrap();
        let wm = w.add(&mut g, "proj", &[n, d]);
        let y = g.add(Op::MatMul, &[h, wm]).unwrap();
        g.set_output("y", y);
        // A GPU target, whose cost model takes the prologue.
        check(&g, &w, vec![norm_matmul::norm_matmul()], "norm-matmul-prologue", "rms_norm_matmul", CostModel::H200);
    }

    #[test]
    fn elementwise_chains_collapse(d in 1usize..16, ops in proptest::collection::vec(0u8..7, 2..6), seed in any::<u64>()) {
        let mut g = Graph::new("chain");
        let mut w = Weights { seed, ..Default::default() };
        let x = activation(&mut g, &mut w, d);
        let wy = w.add(&mut g, "proj", &[d, d]);
        let y = g.add(Op::MatMul, &[x, wy]).unwrap();
        let mut v = x;
        for op in ops {
            v = match op {
                0 => g.add(Op::Silu, &[v]),
                1 => g.add(Op::GeluTanh, &[v]),
                2 => g.add(Op::Scale { factor: 0.5 }, &[v]),
                3 => g.add(Op::Add, &[v, y]),
                4 => g.add(Op::Sigmoid, &[v]),
                5 => g.add(Op::SoftCap { cap: 1.5 }, &[v]),
                _ => g.add(Op::Mul, &[v, y]),
            }.unwrap();
        }
        g.set_output("y", v);
        let mut rules = elementwise::lift_rules();
        rules.push(elementwise::merge_elementwise());
        check(&g, &w, rules, "merge-elementwise", "elementwise", CostModel::CPU);
    }

    #[test]
    fn int8_bound_lm_head_keeps_the_top_k(d in 1usize..24, vocab in 2usize..60, k in 1usize..5, seed in any::<u64>()) {
        let k = k.min(vocab);
        let mut g = Graph::new("head");
        let mut w = Weights { seed, ..Default::default() };
        let x = activation(&mut g, &mut w, d);
        let head = w.add(&mut g, "head", &[vocab, d]);
        let logits = g.add(Op::MatMul, &[x, head]).unwrap();
        let top = g.add(Op::TopK { k }, &[logits]).unwrap();
        g.set_output("top", top);
        check(&g, &w, vec![lm_head::int8_bound_top_k()], "int8-bound-top-k", "int8_bound_top_k", CostModel::CPU);
    }

    #[test]
    fn int8_bound_lm_head_keeps_the_top_k_of_soft_capped_logits(d in 1usize..24, vocab in 2usize..60, k in 1usize..5, cap in 0.05f32..40.0, seed in any::<u64>()) {
        let k = k.min(vocab);
        let mut g = Graph::new("capped_head");
        let mut w = Weights { seed, ..Default::default() };
        let x = activation(&mut g, &mut w, d);
        let head = w.add(&mut g, "head", &[vocab, d]);
        let logits = g.add(Op::MatMul, &[x, head]).unwrap();
        let capped = g.add(Op::SoftCap { cap }, &[logits]).unwrap();
        let top = g.add(Op::TopK { k }, &[capped]).unwrap();
        g.set_output("top", top);
        let rules = vec![lm_head::int8_bound_top_k_soft_capped()];
        check(&g, &w, rules, "int8-bound-top-k-soft-capped", "int8_bound_top_k", CostModel::CPU);
    }

    /// With fewer rows than the shortlist's candidates every row is rescored: the exact top k,
    /// over plain and soft-capped logits (capping keeps the order).
    #[test]
    fn a_shortlisted_draft_head_keeps_the_top_k(blocks in 1usize..3, vocab in 2usize..60, k in 1usize..5, capped in any::<bool>(), seed in any::<u64>()) {
        let (d, k) = (32 * blocks, k.min(vocab));
        let mut g = Graph::new("draft_head");
        let mut w = Weights { seed, ..Default::default() };
        let x = activation(&mut g, &mut w, d);
        let head = w.add(&mut g, "head", &[vocab, d]);
        let mut logits = g.add(Op::MatMul, &[x, head]).unwrap();
        if capped {
            logits = g.add(Op::SoftCap { cap: 3.0 }, &[logits]).unwrap();
        }
        let top = g.add(Op::TopK { k }, &[logits]).unwrap();
        g.set_output("top", top);
        let (rule, rules) = match capped {
            false => ("shortlist-draft-head", vec![draft_head::shortlist()]),
            true => ("shortlist-draft-head-soft-capped", vec![draft_head::shortlist_soft_capped()]),
        };
        check(&g, &w, rules, rule, "shortlist_top_k", CostModel::CPU);
    }
}

/// A head whose rows are not whole blocks of 32 is left as it is.
#[test]
fn a_draft_head_of_partial_blocks_is_not_shortlisted() {
    let mut g = Graph::new("draft_head");
    let mut w = Weights::default();
    let x = activation(&mut g, &mut w, 40);
    let head = w.add(&mut g, "head", &[50, 40]);
    let logits = g.add(Op::MatMul, &[x, head]).unwrap();
    let top = g.add(Op::TopK { k: 1 }, &[logits]).unwrap();
    g.set_output("top", top);
    let after = passes::shortlisted_draft_head(&g).unwrap();
    assert!(
        after.nodes().iter().all(|n| n.op.name() != "shortlist_top_k"),
        "{}",
        after.to_text()
    );
}

#[test]
fn elementwise_expressions_compose_in_input_order() {
    // mul(silu($0), $1) with $0 := add($0, $1) gives mul(silu(add($0, $1)), $2).
    let outer = Expr::Mul(Box::new(Expr::Silu(Box::new(Expr::Input(0)))), Box::new(Expr::Input(1)));
    let inner = Expr::Add(Box::new(Expr::Input(0)), Box::new(Expr::Input(1)));
    let composed = outer.substitute(&|j| if j == 0 { inner.clone() } else { Expr::Input(j + 1) });
    assert_eq!(composed.to_string(), "mul(silu(add($0, $1)), $2)");
}

#[test]
fn fusion_is_deterministic() {
    let build = || {
        let mut g = Graph::new("det");
        let mut w = Weights {
            seed: 9,
            ..Default::default()
        };
        let x = activation(&mut g, &mut w, 8);
        for i in 0..3 {
            let wi = w.add(&mut g, &format!("w{i}"), &[4 + i, 8]);
            let p = g.add(Op::MatMul, &[x, wi]).unwrap();
            g.set_output(format!("p{i}"), p);
        }
        g
    };
    let run = || {
        passes::optimize(&build(), CostModel::CPU, None)
            .unwrap()
            .last()
            .unwrap()
            .graph
            .to_text()
    };
    assert_eq!(run(), run());
}
