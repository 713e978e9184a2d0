//! FP8 quantization as a model loads (vLLM's `--quantization fp8` over a 16- or 32-bit
//! checkpoint): the weights of its linear layers become FP8 blocks of 32 (`quant::fp8_blocks`:
//! a scale for every 32 columns of a row, 9 bits a weight), quantized as FP8 checkpoints are
//! made; embeddings, LM heads, norms, routers and whatever else is not a linear layer's weight
//! keep their type. Activations are not quantized: the matrices multiply as FP8 checkpoints'
//! blocks do.

use crate::quant::fp8_blocks::BLOCK_ELEMS;
use crate::quant::GgmlType;

/// A float matrix as FP8 blocks (`quant::fp8_blocks::quantize_matrix`).
pub use crate::quant::fp8_blocks::quantize_matrix as quantize;

/// The `--quantization` name of the method.
pub const METHOD: &str = "fp8";

/// Parts of names of weights that are not linear layers' (or that models keep in their own
/// type when quantized: routers choose experts, so a small error flips a choice).
const KEPT: [&str; 6] = ["embed", "lm_head", "norm", "router", "conv", "shared_expert_gate"];

/// Whether the tensor `name`, of `shape` as bbc addresses it (a vector or a matrix, experts
/// stacked as rows) and stored as `dtype`, is quantized: a float matrix whose rows are whole
/// blocks of 32, not one whose name says it is kept ([`KEPT`], and MoE routers'
/// `mlp.gate.weight`).
pub fn quantizes(name: &str, dtype: GgmlType, shape: &[usize]) -> bool {
    let float = matches!(dtype, GgmlType::F32 | GgmlType::BF16 | GgmlType::F16);
    let blocks = matches!(shape, [rows, cols] if *rows > 1 && *cols > 0 && cols % BLOCK_ELEMS == 0);
    let kept = KEPT.iter().any(|k| name.contains(k)) || name.ends_with("mlp.gate.weight");
    float && blocks && !kept
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_layers_weights_are_quantized_and_the_rest_kept() {
        let q = |name: &str, shape: &[usize]| quantizes(name, GgmlType::BF16, shape);
        assert!(q("model.layers.0.self_attn.q_proj.weight", &[128, 64]));
        assert!(q("model.layers.0.mlp.experts.3.down_proj.weight", &[64, 32]));
        assert!(q("model.layers.0.experts.gate_up_proj", &[4 * 48, 64]));
        assert!(q("model.layers.0.linear_attn.in_proj_qkvz.weight", &[192, 64]));
        for kept in [
            "model.embed_tokens.weight",
            "model.embed_tokens_per_layer.weight",
            "lm_head.weight",
            "model.layers.0.mlp.gate.weight",
            "model.layers.0.router.proj.weight",
            "model.layers.0.mlp.shared_expert_gate.weight",
            "model.layers.0.linear_attn.conv1d.weight",
            "model.layers.0.self_attn.q_a_layernorm.weight",
        ] {
            assert!(!q(kept, &[320, 64]), "{kept}");
        }
        // Rows that are not whole blocks, vectors, a single row, quantized storage.
        assert!(!q("model.layers.0.self_attn.q_b_proj.weight", &[128, 48]));
        assert!(!q("model.layers.0.self_attn.o_proj.bias", &[64]));
        assert!(!q("model.layers.0.self_attn.o_proj.weight", &[1, 64]));
        assert!(!quantizes("blk.0.attn_q.weight", GgmlType::Q8_0, &[64, 64]));
        assert!(quantizes("model.layers.0.mlp.up_proj.weight", GgmlType::F16, &[64, 64]));
        assert!(quantizes("model.layers.0.mlp.up_proj.weight", GgmlType::F32, &[64, 64]));
    }
}
