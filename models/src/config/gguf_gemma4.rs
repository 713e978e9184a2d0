//! A Gemma 4 GGUF's settings, as llama.cpp's converter writes them (`Gemma4Model` in its
//! `conversion/gemma.py`) and its `gemma4` model reads them: the full-attention layers' heads
//! in `attention.key_length` and the sliding ones' in `attention.key_length_swa`, which layers
//! slide in `attention.sliding_window_pattern` (a flag per layer), the KV-shared layers'
//! count in `attention.shared_kv_layers`, KV heads and MLP widths as a number or a list per
//! layer (a list where full-attention layers have their own KV heads, or the KV-shared
//! layers' MLPs are double-wide), and the full-attention layers' proportional RoPE as the
//! `rope_freqs` tensor's frequency factors: 1 for each rotated pair, 1e30 (no rotation) for
//! the rest. A layer with an MoE block is one with a router (`ffn_gate_inp`).

use super::{kv_shared_layers, Family, Gemma4Config, LayerAttention, LayerHeads, ModelConfig, MoeConfig};
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

/// Factors at least this large turn a pair by less than any f32 angle resolves: llama.cpp's
/// converter writes 1e30 for the pairs proportional RoPE leaves unrotated.
const UNROTATED_FACTOR: f32 = 1e29;

pub(super) fn read(file: &GgufFile) -> Result<ModelConfig> {
    let meta = Meta { file, arch: "gemma4" };
    let layers = meta.usize("block_count")?;
    let sliding = meta.sliding_pattern(layers)?;
    let layer_attention: Vec<LayerAttention> = sliding
        .iter()
        .map(|&s| match s {
            true => LayerAttention::Sliding,
            false => LayerAttention::Full,
        })
        .collect();
    let heads = meta.per_layer("attention.head_count", layers)?;
    let kv_heads = meta.per_layer("attention.head_count_kv", layers)?;
    let (full_dim, sliding_dim) = (meta.head_dim("")?, meta.head_dim("_swa")?);
    let layer_heads: Vec<LayerHeads> = (0..layers)
        .map(|i| LayerHeads {
            heads: heads[i],
            kv_heads: kv_heads[i],
            head_dim: if sliding[i] { sliding_dim } else { full_dim },
        })
        .collect();
    meta.check_rotation(full_dim, sliding_dim)?;
    let shared = meta
        .file
        .optional_u64(&meta.key("attention.shared_kv_layers"))?
        .unwrap_or(0) as usize;
    let kv_shared_from = kv_shared_layers(shared, &layer_attention)
        .map_err(|problem| meta.error("attention.shared_kv_layers", problem))?;
    let widths = meta.per_layer("feed_forward_length", layers)?;
    let intermediate = widths[0];
    let gemma4 = Gemma4Config {
        per_layer_input: meta
            .file
            .optional_u64(&meta.key("embedding_length_per_layer_input"))?
            .unwrap_or(0) as usize,
        layer_heads,
        global_rope_fraction: meta.proportional_rope(full_dim)?,
        kv_shared_from,
        // Checked below: only the KV-shared layers may differ, each twice as wide.
        double_wide_mlp: widths.iter().any(|&w| w != intermediate),
        keys_as_values: meta.keys_as_values(&sliding, shared)?,
    };
    if let Some(i) = (0..layers).find(|&i| widths[i] != gemma4.intermediate(i, intermediate)) {
        return Err(meta.error(
            "feed_forward_length",
            format!(
                "layer {i}'s width {} is neither the others' nor, in a KV-shared layer, twice theirs ({widths:?})",
                widths[i]
            ),
        ));
    }
    let rope_theta = file.optional_f64(&meta.key("rope.freq_base"))?.unwrap_or(10_000.0);
    let config = ModelConfig {
        family: Family::Gemma4,
        vocab_size: match file.get("tokenizer.ggml.tokens").and_then(|t| t.as_array()) {
            Some(tokens) => tokens.len(),
            None => meta.usize("vocab_size")?,
        },
        hidden: meta.usize("embedding_length")?,
        layers,
        // The sliding layers' shape stands for the model's (HF's `head_dim`).
        heads: heads[0],
        kv_heads: sliding.iter().position(|&s| s).map_or(kv_heads[0], |i| kv_heads[i]),
        head_dim: sliding_dim,
        intermediate,
        rms_eps: file.require_f64(&meta.key("attention.layer_norm_rms_epsilon"))?,
        rope_theta,
        // llama.cpp: the sliding layers' base is the full ones' unless the file says.
        rope_local_theta: file
            .optional_f64(&meta.key("rope.freq_base_swa"))?
            .unwrap_or(rope_theta),
        rope_scale: 1.0,
        rope_scaling: ir::RopeScaling::None,
        context_length: meta.usize("context_length")?,
        sliding_window: file
            .optional_u64(&meta.key("attention.sliding_window"))?
            .map(|w| w as usize),
        layer_attention,
        query_pre_attn_scalar: None,
        tied_embeddings: file.tensor("output.weight").is_none(),
        rotary_dim: sliding_dim,
        attention_bias: false,
        qk_norm: true,
        moe: meta.moe(layers)?,
        linear_attention: None,
        gemma4: Some(gemma4),
        mla: None,
        final_logit_softcap: file
            .optional_f64(&meta.key("final_logit_softcapping"))?
            .map(|cap| cap as f32),
        mtp_layers: 0,
    };
    config.check(&file.path)
}

/// The file's `gemma4.*` keys.
struct Meta<'f> {
    file: &'f GgufFile,
    arch: &'static str,
}

impl Meta<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    fn error(&self, k: &str, problem: String) -> ModelError {
        ModelError::Metadata {
            path: self.file.path.clone(),
            key: self.key(k),
            problem,
        }
    }

    fn usize(&self, k: &str) -> Result<usize> {
        self.file.require_u64(&self.key(k)).map(|v| v as usize)
    }

    /// A setting llama.cpp takes as one number for every layer or a list of one per layer.
    fn per_layer(&self, k: &str, layers: usize) -> Result<Vec<usize>> {
        let value = self
            .file
            .get(&self.key(k))
            .ok_or_else(|| self.error(k, "is missing".into()))?;
        let values = match value.as_array() {
            Some(list) => list.iter().map(|v| v.as_u64()).collect::<Option<Vec<_>>>(),
            None => value.as_u64().map(|v| vec![v; layers]),
        };
        match values {
            Some(v) if v.len() == layers => Ok(v.into_iter().map(|v| v as usize).collect()),
            _ => Err(self.error(k, format!("should be a number or a list of {layers}, one per layer"))),
        }
    }

    /// Which layers slide: llama.cpp's flags, as many as the layers.
    fn sliding_pattern(&self, layers: usize) -> Result<Vec<bool>> {
        let k = "attention.sliding_window_pattern";
        let flags: Option<Vec<bool>> = (self.file.get(&self.key(k)))
            .and_then(|v| v.as_array())
            .and_then(|f| f.iter().map(|v| v.as_bool()).collect());
        match flags {
            Some(f) if f.len() == layers => Ok(f),
            _ => Err(self.error(
                k,
                format!("should be a list of {layers} flags, true for a sliding layer"),
            )),
        }
    }

    /// The heads of the full-attention layers (`suffix` "") or of the sliding ones ("_swa"),
    /// whose keys and values llama.cpp requires to be as wide.
    fn head_dim(&self, suffix: &str) -> Result<usize> {
        let (k, v) = (
            format!("attention.key_length{suffix}"),
            format!("attention.value_length{suffix}"),
        );
        let key = self.usize(&k)?;
        match self.file.optional_u64(&self.key(&v))? {
            Some(value) if value as usize != key => Err(self.error(
                &v,
                format!("is {value}; Gemma 4's values are as wide as its keys ({key})"),
            )),
            _ => Ok(key),
        }
    }

    /// bbc turns every dim of a head (the full layers' partial rotation is in `rope_freqs`).
    fn check_rotation(&self, full_dim: usize, sliding_dim: usize) -> Result<()> {
        for (k, dim) in [
            ("rope.dimension_count", full_dim),
            ("rope.dimension_count_swa", sliding_dim),
        ] {
            if let Some(n) = self.file.optional_u64(&self.key(k))?.filter(|&n| n as usize != dim) {
                return Err(self.error(
                    k,
                    format!("is {n}: bbc runs Gemma 4 layers whose RoPE spans the whole head ({dim})"),
                ));
            }
        }
        Ok(())
    }

    /// The full layers' proportional RoPE from `rope_freqs` (the share of each head whose
    /// pairs turn), or `None` where the file has no factors (every pair turns).
    fn proportional_rope(&self, full_dim: usize) -> Result<Option<f64>> {
        let Some(info) = self.file.tensor("rope_freqs.weight") else {
            return Ok(None);
        };
        let bad = |problem: String| ModelError::TensorShape {
            name: "rope_freqs.weight".into(),
            what: problem,
        };
        if info.elements() != full_dim / 2 {
            return Err(bad(format!("has {} factors for heads of {full_dim}", info.elements())));
        }
        let mut factors = vec![0f32; info.elements()];
        info.dtype.dequantize(self.file.tensor_data(info), &mut factors);
        let rotated = factors.iter().take_while(|&&f| f == 1.0).count();
        if rotated == 0 || factors[rotated..].iter().any(|&f| f.is_nan() || f < UNROTATED_FACTOR) {
            return Err(bad(
                "holds factors other than 1 for the leading pairs and 1e30 for the rest (Gemma 4's proportional RoPE)"
                    .into(),
            ));
        }
        Ok(Some(Gemma4Config::fraction_rotating(rotated, full_dim)))
    }

    /// Whether full-attention layers take their values from their keys: llama.cpp's reading
    /// where their value projection is absent (every full layer with its own cache alike).
    fn keys_as_values(&self, sliding: &[bool], shared: usize) -> Result<bool> {
        let own_cache = sliding.len().saturating_sub(shared);
        let full: Vec<usize> = (0..own_cache).filter(|&i| !sliding[i]).collect();
        let without_v: Vec<bool> = full
            .iter()
            .map(|i| self.file.tensor(&format!("blk.{i}.attn_v.weight")).is_none())
            .collect();
        match without_v
            .iter()
            .all(|&w| w == without_v.first().copied().unwrap_or(false))
        {
            true => Ok(without_v.first().copied().unwrap_or(false)),
            false => Err(ModelError::TensorShape {
                name: "attn_v.weight".into(),
                what: "some full-attention layers have a value projection and some do not".into(),
            }),
        }
    }

    /// The MoE blocks beside the MLPs, in the layers with a router: softmax top-k,
    /// renormalised, each weight times its expert's scale (`ffn_down_exps.scale`).
    fn moe(&self, layers: usize) -> Result<Option<MoeConfig>> {
        let sparse_layers: Vec<bool> = (0..layers)
            .map(|i| self.file.tensor(&format!("blk.{i}.ffn_gate_inp.weight")).is_some())
            .collect();
        if !sparse_layers.contains(&true) {
            return Ok(None);
        }
        Ok(Some(MoeConfig {
            sparse_layers,
            experts: self.usize("expert_count")?,
            experts_per_token: self.usize("expert_used_count")?,
            expert_intermediate: self.usize("expert_feed_forward_length")?,
            shared_intermediate: 0,
            shared_gate: false,
            normalize: true,
            router: ir::MoeRouter::SoftmaxExpertScale,
        }))
    }
}
