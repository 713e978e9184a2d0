//! Qwen3.5 (hybrid Gated DeltaNet + gated attention): the projection structure only.
//!
//! The full lowering (causal conv, the fp32 delta-rule recurrence, gated RMSNorm) comes with the
//! family; what exists now is the part fusion acts on: per linear-attention layer the four
//! input projections `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` reading one normed
//! activation (joined into one GEMM by `fuse_joined_projections`), per gated-attention layer
//! `q_proj` (queries and gate, `[q | gate]` per head), `k_proj`, `v_proj` with per-head q/k norms
//! and partial RoPE, and the SwiGLU MLP. Where the DeltaNet recurrence belongs, the skeleton
//! gates the value channels with `silu(z)` and exports `b` and `a` as outputs, so every
//! projection stays live; it computes no model. It has no weights: the names and shapes are
//! HF's, for benchmarks and IR snapshots.

use ir::{AttentionSpec, DType, Graph, GraphError, InputKind, NodeId, Op, RopeLayout, RopeSpec};

/// The shapes of a Qwen3.5 model (HF `config.json` names in the comments).
#[derive(Debug, Clone, Copy)]
pub struct Qwen35Shape {
    pub hidden: usize,       // hidden_size
    pub layers: usize,       // num_hidden_layers
    pub intermediate: usize, // intermediate_size
    pub vocab: usize,        // vocab_size
    pub heads: usize,        // num_attention_heads
    pub kv_heads: usize,     // num_key_value_heads
    pub head_dim: usize,     // head_dim
    pub key_heads: usize,    // linear_num_key_heads
    pub value_heads: usize,  // linear_num_value_heads
    pub key_dim: usize,      // linear_key_head_dim
    pub value_dim: usize,    // linear_value_head_dim
}

impl Qwen35Shape {
    /// `../hf-tiny/qwen3_5/config.json`.
    pub const TINY: Self = Self {
        hidden: 64,
        layers: 4,
        intermediate: 160,
        vocab: 320,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        key_heads: 2,
        value_heads: 4,
        key_dim: 16,
        value_dim: 16,
    };

    /// A 27B-class Qwen3.5: hidden 5120, 64 layers (every fourth full attention), 24 query /
    /// 4 KV heads of 256, DeltaNet 16 key / 48 value heads of 128, MLP 17408, vocab 248320.
    pub const LARGE_27B: Self = Self {
        hidden: 5120,
        layers: 64,
        intermediate: 17408,
        vocab: 248_320,
        heads: 24,
        kv_heads: 4,
        head_dim: 256,
        key_heads: 16,
        value_heads: 48,
        key_dim: 128,
        value_dim: 128,
    };
}

struct Skeleton {
    graph: Graph,
}

impl Skeleton {
    fn weight(&mut self, name: String, shape: &[usize]) -> NodeId {
        self.graph.weight(name, shape, DType::BF16)
    }

    fn norm(&mut self, x: NodeId, name: String, len: usize) -> Result<NodeId, GraphError> {
        let w = self.graph.weight(name, &[len], DType::F32);
        self.graph.add(
            Op::RmsNorm {
                eps: 1e-6,
                weight_offset: 1.0,
                group: len,
            },
            &[x, w],
        )
    }

    fn linear(&mut self, x: NodeId, name: String, out: usize, inp: usize) -> Result<NodeId, GraphError> {
        let w = self.weight(name, &[out, inp]);
        self.graph.add(Op::MatMul, &[x, w])
    }
}

/// The projection skeleton of a Qwen3.5 model with shape `s` (see the module doc).
pub fn projection_skeleton(s: &Qwen35Shape) -> Result<Graph, GraphError> {
    let mut k = Skeleton {
        graph: Graph::new("qwen3_5_projections"),
    };
    let ids = k.graph.input(InputKind::TokenIds);
    let positions = k.graph.input(InputKind::Positions);
    let table = k.weight("model.embed_tokens.weight".into(), &[s.vocab, s.hidden]);
    let mut x = k.graph.add(Op::Embedding, &[table, ids])?;
    let layer = |i: usize, t: &str| format!("model.layers.{i}.{t}.weight");
    for i in 0..s.layers {
        let h = k.norm(x, layer(i, "input_layernorm"), s.hidden)?;
        let mixed = if (i + 1) % 4 == 0 {
            let (q_dim, kv_dim) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
            let qg = k.linear(h, layer(i, "self_attn.q_proj"), 2 * q_dim, s.hidden)?;
            let kk = k.linear(h, layer(i, "self_attn.k_proj"), kv_dim, s.hidden)?;
            let v = k.linear(h, layer(i, "self_attn.v_proj"), kv_dim, s.hidden)?;
            let q = k.graph.add(Op::Slice { start: 0, len: q_dim }, &[qg])?;
            let gate = k.graph.add(
                Op::Slice {
                    start: q_dim,
                    len: q_dim,
                },
                &[qg],
            )?;
            let q = k.norm(q, layer(i, "self_attn.q_norm"), s.head_dim)?;
            let kk = k.norm(kk, layer(i, "self_attn.k_norm"), s.head_dim)?;
            let rope = |heads| RopeSpec {
                heads,
                head_dim: s.head_dim,
                rotary_dim: s.head_dim / 4,
                theta: 10_000_000.0,
                position_scale: 1.0,
                layout: RopeLayout::RotateHalf,
            };
            let q = k.graph.add(Op::Rope(rope(s.heads)), &[q, positions])?;
            let kk = k.graph.add(Op::Rope(rope(s.kv_heads)), &[kk, positions])?;
            let spec = AttentionSpec {
                heads: s.heads,
                kv_heads: s.kv_heads,
                head_dim: s.head_dim,
                scale: 1.0 / (s.head_dim as f64).sqrt(),
                window: None,
                cache_slot: i,
                // A bf16 model's cache, as its weights.
                cache_dtype: DType::BF16,
            };
            let a = k.graph.add(Op::Attention(spec), &[q, kk, v])?;
            let a = k.graph.add(Op::Mul, &[a, gate])?;
            k.linear(a, layer(i, "self_attn.o_proj"), s.hidden, q_dim)?
        } else {
            let (key_dim, value_dim) = (s.key_heads * s.key_dim, s.value_heads * s.value_dim);
            let qkv = k.linear(
                h,
                layer(i, "linear_attn.in_proj_qkv"),
                2 * key_dim + value_dim,
                s.hidden,
            )?;
            let z = k.linear(h, layer(i, "linear_attn.in_proj_z"), value_dim, s.hidden)?;
            let b = k.linear(h, layer(i, "linear_attn.in_proj_b"), s.value_heads, s.hidden)?;
            let a = k.linear(h, layer(i, "linear_attn.in_proj_a"), s.value_heads, s.hidden)?;
            k.graph.set_output(format!("delta_net.{i}.b"), b);
            k.graph.set_output(format!("delta_net.{i}.a"), a);
            let v = k.graph.add(
                Op::Slice {
                    start: 2 * key_dim,
                    len: value_dim,
                },
                &[qkv],
            )?;
            let gate = k.graph.add(Op::Silu, &[z])?;
            let o = k.graph.add(Op::Mul, &[v, gate])?;
            k.linear(o, layer(i, "linear_attn.out_proj"), s.hidden, value_dim)?
        };
        x = k.graph.add(Op::Add, &[x, mixed])?;
        let h = k.norm(x, layer(i, "post_attention_layernorm"), s.hidden)?;
        let g = k.linear(h, layer(i, "mlp.gate_proj"), s.intermediate, s.hidden)?;
        let u = k.linear(h, layer(i, "mlp.up_proj"), s.intermediate, s.hidden)?;
        let g = k.graph.add(Op::Silu, &[g])?;
        let m = k.graph.add(Op::Mul, &[g, u])?;
        let d = k.linear(m, layer(i, "mlp.down_proj"), s.hidden, s.intermediate)?;
        x = k.graph.add(Op::Add, &[x, d])?;
    }
    let x = k.graph.add(Op::LastToken, &[x])?;
    let x = k.norm(x, "model.norm.weight".into(), s.hidden)?;
    let logits = k.linear(x, "lm_head.weight".into(), s.vocab, s.hidden)?;
    k.graph.set_output("logits", logits);
    k.graph.validate()?;
    Ok(k.graph)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skeletons_type_check() {
        let tiny = projection_skeleton(&Qwen35Shape::TINY).unwrap();
        let attention = tiny.nodes().iter().filter(|n| matches!(n.op, Op::Attention(_))).count();
        assert_eq!(attention, 1, "one full-attention layer in four");
        assert!(projection_skeleton(&Qwen35Shape::LARGE_27B).unwrap().op_count() > 64 * 10);
    }
}
