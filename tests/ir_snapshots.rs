//! Snapshots of the IR each family lowers to (the tiny HF models: small enough to read).
//! Review a diff here like code: it is the compiler's input changing.

mod common;

use models::{ComputeDtype, LogitsFor, Model, ModelSpec};

fn graph_text(family: &str, logits: LogitsFor) -> String {
    let mut spec = ModelSpec::for_weights(&common::fixture(&format!("hf-tiny/{family}")));
    spec.dtype = ComputeDtype::F32;
    Model::open(spec).unwrap().lower(logits).unwrap().to_text()
}

#[test]
fn llama_graph() {
    insta::assert_snapshot!(graph_text("llama", LogitsFor::LastToken));
}

#[test]
fn gemma3_graph() {
    insta::assert_snapshot!(graph_text("gemma3", LogitsFor::LastToken));
}

#[test]
fn glm4_moe_graph() {
    insta::assert_snapshot!(graph_text("glm4_moe", LogitsFor::LastToken));
}

/// The CPU's fusion of GLM-4.5: Q/K/V joined ahead of their biases, the router joined with the
/// shared experts' gate/up (one activation read for all three), the routed experts one `moe`.
#[test]
fn glm4_moe_fused_graph() {
    let mut spec = ModelSpec::for_weights(&common::fixture("hf-tiny/glm4_moe"));
    spec.dtype = ComputeDtype::F32;
    let graph = Model::open(spec).unwrap().lower(LogitsFor::LastToken).unwrap();
    insta::assert_snapshot!(fused_text(&graph, passes::CostModel::CPU));
}

/// Gemma 4: per-layer inputs, weightless value norms, the full-attention layer's 512-wide
/// heads and proportional RoPE, layer scalars.
#[test]
fn gemma4_graph() {
    insta::assert_snapshot!(graph_text("gemma4", LogitsFor::LastToken));
}

/// KV-shared layers (`shared_kv_attention` on an earlier layer's slot), double-wide MLPs and
/// soft-capped logits, here under a greedy head (`top_k` over the capped logits); the
/// shared layers run on the last row (`last_token` of the residual stream, the positions and
/// the per-layer inputs before them).
#[test]
fn gemma4_kv_shared_graph() {
    insta::assert_snapshot!(graph_text("gemma4_kv_shared", LogitsFor::GreedyToken));
}

/// GLM-5: latent attention and its sparse indexer.
#[test]
fn glm_moe_dsa_graph() {
    insta::assert_snapshot!(graph_text("glm_moe_dsa", LogitsFor::LastToken));
}

/// GLM-5.2's shared indexers: layers 1 and 3 take layers 0's and 2's index queries and weights
/// and rank by their caches' index keys (`index_cache`), with no indexer of their own.
#[test]
fn glm_moe_dsa_shared_graph() {
    insta::assert_snapshot!(graph_text("glm_moe_dsa_shared", LogitsFor::LastToken));
}

#[test]
fn lowering_is_deterministic() {
    assert_eq!(
        graph_text("gemma3", LogitsFor::AllTokens),
        graph_text("gemma3", LogitsFor::AllTokens)
    );
}

fn fused_text(graph: &ir::Graph, model: passes::CostModel) -> String {
    passes::optimized(graph, model).unwrap().to_text()
}

fn real_graph(name: &str) -> ir::Graph {
    Model::open(ModelSpec::for_weights(&common::real_model(name)))
        .unwrap()
        .lower(LogitsFor::LastToken)
        .unwrap()
}

#[test]
fn smollm2_fused_graph() {
    insta::assert_snapshot!(fused_text(&real_graph("smollm2"), passes::CostModel::CPU));
}

#[test]
fn gemma3_fused_graph() {
    insta::assert_snapshot!(fused_text(&real_graph("gemma3-270m"), passes::CostModel::CPU));
}

/// YaRN in the IR: each rotation names its scaling (factor, original context, betas,
/// truncation, attention factor), and GLM-5's latent attention carries the softmax scale
/// YaRN's `mscale` changed.
#[test]
fn glm_moe_dsa_rope_yarn_graph() {
    insta::assert_snapshot!(graph_text("glm_moe_dsa_rope_yarn", LogitsFor::LastToken));
}

#[test]
fn qwen3_5_graph() {
    insta::assert_snapshot!(graph_text("qwen3_5", LogitsFor::LastToken));
}

/// Qwen3-Next's interleaved DeltaNet projections regrouped by `row_group_slice`, and its MoE
/// MLPs with the gated shared expert.
#[test]
fn qwen3_next_graph() {
    insta::assert_snapshot!(graph_text("qwen3_next", LogitsFor::LastToken));
}

/// Hopper's fusion of the tiny Qwen3.5 in bf16: each DeltaNet layer's four input projections
/// (`in_proj_qkv`, `_z`, `_b`, `_a`) join into one matmul, and so do the gated attention's
/// `q_proj` (with its gate), `k_proj` and `v_proj`.
#[test]
fn qwen3_5_fused_graph() {
    let mut spec = ModelSpec::for_weights(&common::fixture("hf-tiny/qwen3_5"));
    spec.dtype = ComputeDtype::Bf16;
    let graph = Model::open(spec).unwrap().lower(LogitsFor::LastToken).unwrap();
    let fused = fused_text(&graph, passes::CostModel::H200);
    // 2·2·16 + 4·16 (q, k, v) + 64 (z) + 4 (b) + 4 (a) rows of 64.
    assert_eq!(fused.matches(": bf16[200, 64]").count(), 3, "{fused}");
    // 2·4·32 (q and gate) + 2·64 (k, v).
    assert_eq!(fused.matches(": bf16[384, 64]").count(), 1, "{fused}");
    insta::assert_snapshot!(fused);
}
