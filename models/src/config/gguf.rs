//! Architecture hyperparameters from GGUF metadata, as llama.cpp's converter writes them
//! (Gemma 4's, whose heads and MLP widths differ by layer, in `gguf_gemma4`).

use super::*;
use crate::gguf::GgufFile;

impl ModelConfig {
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let arch = file.require_str("general.architecture")?;
        let family = Family::parse(arch).ok_or_else(|| ModelError::Metadata {
            path: file.path.clone(),
            key: "general.architecture".into(),
            problem: format!(
                "is `{arch}`; bbc runs llama, gemma3, gemma4, glm4moe, glm-dsa, qwen35, qwen35moe and qwen3next from GGUF"
            ),
        })?;
        // Gemma 4's heads and MLP widths differ by layer: keys of its own.
        if family == Family::Gemma4 {
            return gguf_gemma4::read(file);
        }
        let key = |k: &str| format!("{arch}.{k}");
        let u = |k: &str| file.require_u64(&key(k)).map(|v| v as usize);
        let hidden = u("embedding_length")?;
        let heads = u("attention.head_count")?;
        // Multi-token-prediction layers (llama.cpp's converter keeps a checkpoint's MTP layers
        // as blocks after the model's own) are counted in `block_count`; they are no decoder
        // layers (`mtp_layers`, `lower_mtp`).
        let blocks = u("block_count")?;
        let mtp = file.optional_u64(&key("nextn_predict_layers"))?.unwrap_or(0) as usize;
        let layers = blocks
            .checked_sub(mtp)
            .filter(|&l| l > 0)
            .ok_or_else(|| ModelError::Metadata {
                path: file.path.clone(),
                key: key("nextn_predict_layers"),
                problem: format!("{mtp} prediction layers leave none of {blocks} blocks"),
            })?;
        let mla = match family {
            Family::GlmMoeDsa => Some(gguf_mla(file, arch, layers)?),
            _ => None,
        };
        let head_dim = match (file.optional_u64(&key("attention.key_length"))?, &mla) {
            // Latent attention's `key_length` is the latent's (llama.cpp runs it as one KV head
            // of latent + rope); the config's head is HF's, the rotated part.
            (_, Some(m)) => m.rope_dim,
            (Some(d), None) => d as usize,
            (None, None) => hidden / heads.max(1),
        };
        let vocab_size = match file.get("tokenizer.ggml.tokens").and_then(|t| t.as_array()) {
            Some(tokens) => tokens.len(),
            None => u("vocab_size")?,
        };
        let sliding_window = file.optional_u64(&key("attention.sliding_window"))?.map(|w| w as usize);
        let rope_theta = file.optional_f64(&key("rope.freq_base"))?.unwrap_or(10_000.0);
        let (layer_attention, rope_local_theta, query_pre_attn_scalar) = match family {
            Family::Llama => (vec![LayerAttention::Full; layers], rope_theta, None),
            // llama.cpp's gemma3: sliding layers use θ = 10 000; the scale is 1/√head_dim
            // (gemma-3 sets query_pre_attn_scalar = head_dim).
            Family::Gemma3 => (gemma3_pattern(layers, 6), 10_000.0, Some(head_dim as f64)),
            Family::Qwen35 | Family::Qwen3Next => (gguf_recurrent_layers(file, arch, layers)?, rope_theta, None),
            Family::Glm4Moe | Family::GlmMoeDsa => (vec![LayerAttention::Full; layers], rope_theta, None),
            Family::Gemma4 => unreachable!("read by gguf_gemma4"),
        };
        let linear_attention = match family {
            Family::Qwen35 | Family::Qwen3Next => Some(gguf_linear_attention(file, arch)?),
            _ => None,
        };
        let moe = match family {
            Family::Qwen3Next => Some(gguf_qwen_moe(file, arch, layers)?),
            Family::Qwen35 if file.get(&key("expert_count")).is_some() => Some(gguf_qwen_moe(file, arch, layers)?),
            Family::Glm4Moe | Family::GlmMoeDsa => Some(gguf_glm_moe(file, arch, layers)?),
            _ => None,
        };
        let (rope_scale, yarn) = gguf_rope_scaling(file, arch, family)?;
        let rotary_dim = match file.optional_u64(&key("rope.dimension_count"))? {
            Some(d) => d as usize,
            None => head_dim,
        };
        let rope_scaling = match (yarn, file.tensor("rope_freqs.weight")) {
            (Some(yarn), _) => yarn,
            (None, Some(info)) if family == Family::Llama => gguf_llama3_rope(file, info, rope_theta, rotary_dim)?,
            _ => ir::RopeScaling::None,
        };
        let config = Self {
            family,
            vocab_size,
            hidden,
            layers,
            heads,
            // Latent attention's one KV head is llama.cpp's way of running it; bbc's heads each
            // have their key and value.
            kv_heads: match family {
                Family::GlmMoeDsa => heads,
                _ => file
                    .optional_u64(&key("attention.head_count_kv"))?
                    .map_or(heads, |v| v as usize),
            },
            head_dim,
            intermediate: match &moe {
                // A model whose every layer is MoE may leave the dense width unsaid.
                Some(m) => file
                    .optional_u64(&key("feed_forward_length"))?
                    .map_or(m.expert_intermediate, |v| v as usize),
                None => u("feed_forward_length")?,
            },
            rms_eps: file.require_f64(&key("attention.layer_norm_rms_epsilon"))?,
            rope_theta,
            rope_local_theta,
            rope_scale,
            rope_scaling,
            context_length: u("context_length")?,
            sliding_window,
            layer_attention,
            query_pre_attn_scalar,
            tied_embeddings: file.tensor("output.weight").is_none(),
            rotary_dim,
            // GLM-4.5 has Q/K/V biases and, in some checkpoints, q/k norms: as its tensors say.
            attention_bias: family == Family::Glm4Moe && file.tensor("blk.0.attn_q.bias").is_some(),
            qk_norm: match family {
                Family::Gemma3 | Family::Qwen35 | Family::Qwen3Next => true,
                Family::Glm4Moe => file.tensor("blk.0.attn_q_norm.weight").is_some(),
                _ => false,
            },
            moe,
            linear_attention,
            gemma4: None,
            mla,
            // llama.cpp's key for Gemma 2's cap (its Gemma 3 files have none).
            final_logit_softcap: file
                .optional_f64(&key("final_logit_softcapping"))?
                .map(|cap| cap as f32),
            mtp_layers: mtp,
        };
        config.check(&file.path)
    }
}

/// Which layers of a GGUF hybrid (llama.cpp's `qwen35`) are Gated DeltaNet layers: its
/// `attention.recurrent_layers` flags, or else all but every `full_attention_interval`-th
/// (default 4), as llama.cpp reads them.
fn gguf_recurrent_layers(file: &GgufFile, arch: &str, layers: usize) -> Result<Vec<LayerAttention>> {
    let kind = |recurrent: bool| match recurrent {
        true => LayerAttention::Linear,
        false => LayerAttention::Full,
    };
    let flags_key = format!("{arch}.attention.recurrent_layers");
    if let Some(flags) = file.get(&flags_key) {
        let bad = |problem: &str| ModelError::Metadata {
            path: file.path.clone(),
            key: flags_key.clone(),
            problem: problem.into(),
        };
        let flags = flags.as_array().ok_or_else(|| bad("should be an array of booleans"))?;
        // MTP layers, where a file has them, come after the model's own and are not recurrent.
        if flags.len() < layers {
            return Err(bad(&format!("has {} flags for {layers} layers", flags.len())));
        }
        return flags[..layers]
            .iter()
            .map(|f| f.as_bool().map(kind).ok_or_else(|| bad("should hold booleans")))
            .collect();
    }
    let every = file
        .optional_u64(&format!("{arch}.full_attention_interval"))?
        .unwrap_or(4)
        .max(1) as usize;
    Ok((0..layers).map(|i| kind(!(i + 1).is_multiple_of(every))).collect())
}

/// The Gated DeltaNet shapes of a GGUF hybrid, from llama.cpp's `ssm.*` keys: key heads
/// (`group_count`), value heads (`time_step_rank`), the key head width (`state_size`), the
/// value heads' total width (`inner_size`) and the convolution's (`conv_kernel`).
fn gguf_linear_attention(file: &GgufFile, arch: &str) -> Result<LinearAttentionConfig> {
    let u = |k: &str| file.require_u64(&format!("{arch}.ssm.{k}")).map(|v| v as usize);
    let value_heads = u("time_step_rank")?;
    let inner = u("inner_size")?;
    if value_heads == 0 || !inner.is_multiple_of(value_heads) {
        return Err(ModelError::Metadata {
            path: file.path.clone(),
            key: format!("{arch}.ssm.inner_size"),
            problem: format!("{inner} is not a whole number of widths for {value_heads} value heads"),
        });
    }
    Ok(LinearAttentionConfig {
        key_heads: u("group_count")?,
        value_heads,
        key_dim: u("state_size")?,
        value_dim: inner / value_heads,
        conv_kernel: u("conv_kernel")?,
    })
}

/// A GGUF Qwen3-Next's or Qwen3.5-MoE's experts (llama.cpp's `expert_*` keys): every layer
/// MoE, a softmax router whose chosen weights are normalised (llama.cpp's `qwen3next` and
/// `qwen35moe` always normalise, as the models' `norm_topk_prob` says), one shared expert
/// gated by `sigmoid(x · gate)`.
fn gguf_qwen_moe(file: &GgufFile, arch: &str, layers: usize) -> Result<MoeConfig> {
    let u = |k: &str| file.require_u64(&format!("{arch}.{k}")).map(|v| v as usize);
    Ok(MoeConfig {
        sparse_layers: vec![true; layers],
        experts: u("expert_count")?,
        experts_per_token: u("expert_used_count")?,
        expert_intermediate: u("expert_feed_forward_length")?,
        shared_intermediate: file
            .optional_u64(&format!("{arch}.expert_shared_feed_forward_length"))?
            .unwrap_or(0) as usize,
        shared_gate: true,
        normalize: true,
        router: ir::MoeRouter::Softmax,
    })
}

/// A GGUF GLM-4.5's experts (llama.cpp's `glm4moe` keys): the first
/// `leading_dense_block_count` layers dense, DeepSeek-V3's grouped sigmoid router (groups from
/// `expert_group_count`/`_used_count`, scaled by `expert_weights_scale`, normalised as
/// `expert_weights_norm` says), `expert_shared_count` shared experts.
fn gguf_glm_moe(file: &GgufFile, arch: &str, layers: usize) -> Result<MoeConfig> {
    let key = |k: &str| format!("{arch}.{k}");
    let u = |k: &str| file.require_u64(&key(k)).map(|v| v as usize);
    let opt = |k: &str, default: usize| file.optional_u64(&key(k)).map(|v| v.map_or(default, |v| v as usize));
    // llama.cpp's gating function ids: 1 softmax, 2 sigmoid (GLM's; its default here).
    if let Some(gating) = file.optional_u64(&key("expert_gating_func"))?.filter(|&g| g != 2) {
        return Err(ModelError::Metadata {
            path: file.path.clone(),
            key: key("expert_gating_func"),
            problem: format!("is {gating}; GLM-4.5's router is the sigmoid one (2)"),
        });
    }
    let expert_intermediate = u("expert_feed_forward_length")?;
    let dense = opt("leading_dense_block_count", 0)?;
    Ok(MoeConfig {
        sparse_layers: (0..layers).map(|i| i >= dense).collect(),
        experts: u("expert_count")?,
        experts_per_token: u("expert_used_count")?,
        expert_intermediate,
        shared_intermediate: expert_intermediate * opt("expert_shared_count", 0)?,
        shared_gate: false,
        normalize: file
            .get(&key("expert_weights_norm"))
            .and_then(|v| v.as_bool())
            .unwrap_or(true),
        router: ir::MoeRouter::GroupedSigmoid {
            groups: opt("expert_group_count", 1)?,
            top_groups: opt("expert_group_used_count", 1)?,
            scaling: file.optional_f64(&key("expert_weights_scale"))?.unwrap_or(1.0) as f32,
        },
    })
}

/// Llama 3.1's RoPE scaling from a GGUF file: llama.cpp's converter writes no keys for it, only
/// `rope_freqs`, what each pair's frequency is divided by. Every Llama 3.x checkpoint scales
/// with low and high frequency factors 1 and 4 over an original context of 8192 (its factor,
/// 8 or 32, is the largest divisor); bbc takes those and checks that they give the file's
/// divisors, refusing the file, naming the tensor, where they do not.
fn gguf_llama3_rope(
    file: &GgufFile,
    info: &crate::gguf::GgufTensorInfo,
    theta: f64,
    rotary_dim: usize,
) -> Result<ir::RopeScaling> {
    let refuse = |problem: String| ModelError::TensorShape {
        name: info.name.clone(),
        what: problem,
    };
    if info.dtype != crate::quant::GgmlType::F32 || info.elements() != rotary_dim / 2 {
        return Err(refuse(format!(
            "holds {} {} values; Llama 3.1's RoPE scaling has an f32 divisor for each of the {} rotary pairs",
            info.elements(),
            info.dtype.name(),
            rotary_dim / 2
        )));
    }
    let divisors: Vec<f64> = file
        .tensor_data(info)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64)
        .collect();
    let scaling = ir::RopeScaling::Llama3 {
        factor: divisors.iter().copied().fold(1.0, f64::max),
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_context: 8192.0,
    };
    // The unscaled frequencies, as the rotation makes them.
    let unscaled = ir::reference::ops::rope_inv_freq(&ir::RopeSpec {
        heads: 1,
        head_dim: rotary_dim,
        rotary_dim,
        theta,
        position_scale: 1.0,
        layout: ir::RopeLayout::RotateHalf,
        scaling: ir::RopeScaling::None,
    });
    let fits = unscaled
        .iter()
        .zip(&divisors)
        .enumerate()
        .all(|(pair, (&inv_freq, &d))| {
            let divisor = inv_freq as f64 / scaling.rescale(pair, inv_freq, rotary_dim, theta) as f64;
            (divisor - d).abs() <= 1e-5 * d
        });
    match fits {
        true => Ok(scaling),
        false => Err(refuse(
            "divides the frequencies otherwise than Llama 3.1's scaling over a context of 8192 does".into(),
        )),
    }
}

/// A GGUF file's `rope.scaling.*` keys as llama.cpp reads them: the linear position scale, and
/// YaRN where the type says so. llama.cpp's YaRN is transformers' with truncation (its
/// correction dims floored and ceiled) and the attention factor `0.1·ln(factor) + 1`; a file
/// that changes those (a `yarn_ext_factor` or `yarn_attn_factor` other than 1, a
/// `yarn_log_multiplier`) is refused naming the key, as is YaRN on latent attention (GLM-5:
/// llama.cpp's versions have scaled its softmax and rotation differently) or Gemma 4, and any
/// other type.
fn gguf_rope_scaling(file: &GgufFile, arch: &str, family: Family) -> Result<(f64, Option<ir::RopeScaling>)> {
    let key = |name: &str| format!("{arch}.{name}");
    let refuse = |name: &str, problem: String| ModelError::Metadata {
        path: file.path.clone(),
        key: key(name),
        problem,
    };
    match file.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
        None | Some("none") => Ok((1.0, None)),
        Some("linear") => Ok((file.optional_f64(&key("rope.scaling.factor"))?.unwrap_or(1.0), None)),
        Some("yarn") if family == Family::GlmMoeDsa => Err(refuse(
            "rope.scaling.type",
            "is \"yarn\" on latent attention, whose softmax and rotation scales llama.cpp's versions have set differently; bbc reads it from HF configs".into(),
        )),
        Some("yarn") if family != Family::Gemma4 => {
            for (name, unchanged) in [
                ("rope.scaling.yarn_ext_factor", 1.0),
                ("rope.scaling.yarn_attn_factor", 1.0),
                ("rope.scaling.yarn_log_multiplier", 0.0),
            ] {
                match file.optional_f64(&key(name))? {
                    Some(v) if v != unchanged && !(name.ends_with("ext_factor") && v < 0.0) => {
                        return Err(refuse(
                            name,
                            format!("is {v}; bbc computes YaRN as llama.cpp does by default (this key at {unchanged})"),
                        ))
                    }
                    _ => {}
                }
            }
            let positive = |name: &str, default: Option<f64>| -> Result<f64> {
                match file.optional_f64(&key(name))?.or(default) {
                    Some(v) if v.is_finite() && v > 0.0 => Ok(v),
                    Some(v) => Err(refuse(name, format!("is {v}, not a positive number"))),
                    None => Err(refuse(name, "is missing: YaRN needs it".into())),
                }
            };
            let factor = positive("rope.scaling.factor", None)?;
            Ok((
                1.0,
                Some(ir::RopeScaling::Yarn {
                    factor,
                    original_context: positive("rope.scaling.original_context_length", None)?,
                    beta_fast: positive("rope.scaling.yarn_beta_fast", Some(32.0))?,
                    beta_slow: positive("rope.scaling.yarn_beta_slow", Some(1.0))?,
                    truncate: true,
                    attention_factor: yarn_mscale(factor, 1.0),
                }),
            ))
        }
        Some(other) => Err(refuse(
            "rope.scaling.type",
            format!("is {other:?}; bbc computes RoPE unscaled, linear, YaRN or as Llama 3.1 scales it"),
        )),
    }
}

/// A GGUF GLM-5's latent attention (llama.cpp's `glm-dsa` keys, as its `DeepseekV2Model`
/// converter writes them): the ranks, `key_length_mla` = nope + rope and `value_length_mla`
/// per head, `rope.dimension_count` the rotated part, the indexer's heads, width and top-k.
/// `indexer.types` marks the layers with an indexer of their own (true) and those sharing the
/// previous full layer's (false; GLM-5.2). Where the key is absent llama.cpp takes every layer
/// as full below a context of 1M positions and GLM-5.2's own pattern from there on; bbc takes
/// the first and refuses the second, naming the key.
fn gguf_mla(file: &GgufFile, arch: &str, layers: usize) -> Result<MlaConfig> {
    let key = |k: &str| format!("{arch}.{k}");
    let u = |k: &str| file.require_u64(&key(k)).map(|v| v as usize);
    let refuse = |k: &str, problem: String| ModelError::Metadata {
        path: file.path.clone(),
        key: key(k),
        problem,
    };
    let shared_indexer = match file.get(&key("attention.indexer.types")).and_then(|v| v.as_array()) {
        // The model's own layers (prediction layers, where counted, come after them).
        Some(types) => types
            .iter()
            .take(layers)
            .map(|t| t.as_bool().map(|full| !full))
            .collect::<Option<Vec<bool>>>()
            .ok_or_else(|| refuse("attention.indexer.types", "holds something other than true or false".into()))?,
        None if u("context_length")? >= 1 << 20 => {
            return Err(refuse(
                "attention.indexer.types",
                "is absent at a context of 1M positions or more, where llama.cpp assumes GLM-5.2's pattern of shared indexers; write the types into the file".into(),
            ))
        }
        None => vec![false; layers],
    };
    let rope_dim = u("rope.dimension_count")?;
    let key_dim = u("attention.key_length_mla")?;
    let nope_dim = key_dim.checked_sub(rope_dim).ok_or_else(|| {
        refuse(
            "attention.key_length_mla",
            format!("is {key_dim}, less than the rotated {rope_dim}"),
        )
    })?;
    Ok(MlaConfig {
        shared_indexer,
        q_rank: u("attention.q_lora_rank")?,
        kv_rank: u("attention.kv_lora_rank")?,
        nope_dim,
        rope_dim,
        value_dim: u("attention.value_length_mla")?,
        index_heads: u("attention.indexer.head_count")?,
        index_dim: u("attention.indexer.key_length")?,
        index_topk: u("attention.indexer.top_k")?,
        // YaRN on latent attention is refused from GGUF files (`gguf_rope_scaling`).
        softmax_mscale: 1.0,
    })
}
