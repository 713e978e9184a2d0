//! Named model shapes: HF `config.json`s of released checkpoints' sizes, for models run with
//! random weights (`bbc serve llama3-8b`, vLLM's `--load-format dummy`) so every family can be
//! measured at full size without downloading it.

use serde_json::{json, Value};

/// The names bbc knows, in the order it lists them.
pub const NAMES: [&str; 5] = [
    "llama3-8b",
    "qwen3.5-27b",
    "glm-4.5-air",
    "gemma4-e2b",
    "gemma4-26b-a4b",
];

/// The `config.json` of the shape `name`, if bbc knows it.
pub fn config_json(name: &str) -> Option<Value> {
    Some(match name {
        // Meta-Llama-3-8B(-Instruct).
        "llama3-8b" => json!({
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
            "tie_word_embeddings": false,
            "vocab_size": 128256,
        }),
        // A 27B-class Qwen3.5: three Gated DeltaNet layers to one of gated attention.
        "qwen3.5-27b" => json!({
            "model_type": "qwen3_5_text",
            "architectures": ["Qwen3_5ForCausalLM"],
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_attention_heads": 24,
            "num_hidden_layers": 64,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "layer_types": (0..64)
                .map(|i| if (i + 1) % 4 == 0 { "full_attention" } else { "linear_attention" })
                .collect::<Vec<_>>(),
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "linear_value_head_dim": 128,
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
            "tie_word_embeddings": false,
            "vocab_size": 248320,
        }),
        // GLM-4.5-Air: 106B parameters, 12B active (128 experts of 1408, 8 a token, one
        // shared; the first layer dense).
        "glm-4.5-air" => json!({
            "model_type": "glm4_moe",
            "architectures": ["Glm4MoeForCausalLM"],
            "hidden_size": 4096,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1408,
            "num_attention_heads": 96,
            "num_hidden_layers": 46,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "attention_bias": true,
            "partial_rotary_factor": 0.5,
            "first_k_dense_replace": 1,
            "n_routed_experts": 128,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": true,
            "routed_scaling_factor": 1.0,
            "use_qk_norm": false,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": false,
            "vocab_size": 151552,
        }),
        "gemma4-e2b" => gemma4(false),
        "gemma4-26b-a4b" => gemma4(true),
        _ => return None,
    })
}

/// Gemma 4's released shapes: E2B (35 layers, the last 20 KV-shared with double-wide MLPs,
/// heads of 256 and 512 over one KV head, per-layer inputs) or 26B-A4B (30 layers, 128
/// experts of 704 beside each MLP, 8 a token; full-attention layers with keys as values over 2
/// KV heads of 512).
fn gemma4(moe: bool) -> Value {
    let (layers, every) = if moe { (30, 6) } else { (35, 5) };
    let layer_types: Vec<&str> = (0..layers)
        .map(|i| match (i + 1) % every {
            0 => "full_attention",
            _ => "sliding_attention",
        })
        .collect();
    let mut config = json!({
        "model_type": "gemma4_text",
        "architectures": ["Gemma4ForCausalLM"],
        "layer_types": layer_types,
        "num_hidden_layers": layers,
        "head_dim": 256,
        "global_head_dim": 512,
        "vocab_size": 262144,
        "vocab_size_per_layer_input": 262144,
        "sliding_window": 512,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": true,
    });
    let shape = match moe {
        false => json!({
            "hidden_size": 1536, "intermediate_size": 6144, "num_attention_heads": 8,
            "num_key_value_heads": 1, "num_kv_shared_layers": 20, "use_double_wide_mlp": true,
            "hidden_size_per_layer_input": 256,
        }),
        true => json!({
            "hidden_size": 2816, "intermediate_size": 2112, "num_attention_heads": 16,
            "num_key_value_heads": 8, "num_global_key_value_heads": 2, "attention_k_eq_v": true,
            "hidden_size_per_layer_input": 0, "enable_moe_block": true, "num_experts": 128,
            "top_k_experts": 8, "moe_intermediate_size": 704,
        }),
    };
    for (key, value) in shape.as_object().expect("an object") {
        config[key] = value.clone();
    }
    config
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::Family;
    use std::path::Path;

    fn parsed(name: &str) -> ModelConfig {
        let json = config_json(name).unwrap();
        ModelConfig::from_hf_json(json, Path::new(name)).unwrap()
    }

    /// The two shapes bbc also states in code (the GPU check's and the compiler benchmark's)
    /// are what their configs say, field for field.
    #[test]
    fn named_configs_read_as_the_shapes_stated_in_code() {
        let value = |c: &ModelConfig| serde_json::to_value(c).unwrap();
        assert_eq!(value(&parsed("llama3-8b")), value(&ModelConfig::llama3_8b()));
        assert_eq!(value(&parsed("qwen3.5-27b")), value(&ModelConfig::qwen3_5_27b()));
    }

    #[test]
    fn every_name_reads_as_its_family() {
        let families: Vec<Family> = NAMES.iter().map(|n| parsed(n).family).collect();
        assert_eq!(
            families,
            [
                Family::Llama,
                Family::Qwen35,
                Family::Glm4Moe,
                Family::Gemma4,
                Family::Gemma4
            ]
        );
        let air = parsed("glm-4.5-air");
        let moe = air.moe.as_ref().unwrap();
        assert_eq!((air.layers, air.heads, air.vocab_size), (46, 96, 151_552));
        assert_eq!((moe.experts, moe.experts_per_token), (128, 8));
        assert!(config_json("llama3-70b").is_none());
    }
}
