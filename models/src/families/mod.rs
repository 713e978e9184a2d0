//! Lowering of each model family to the IR: one file per family.
//!
//! A lowering reads the [`ModelConfig`] and the weights' shapes and storage types (not their
//! data) and builds the graph of one forward step. Weight names are the source's own (GGUF
//! or HF), so the graph can be run straight from the file.

mod eagle;
mod gemma3;
mod gemma4;
mod glm4_moe;
mod glm_moe_dsa;
mod llama;
mod moe;
mod mtp;
mod qwen3_5;

use crate::config::{Family, ModelConfig};
use crate::error::{ModelError, Result};
use crate::quant::GgmlType;
use crate::weights::{ir_dtype, WeightSource};
pub(crate) use eagle::lower_eagle;
use ir::{DType, Graph, NodeId, Op};
pub use mtp::{lower_mtp, lower_mtp_without_weights, with_hidden_states};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// What the graph computes logits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsFor {
    /// Only the step's last token: what generation needs.
    LastToken,
    /// Every token of the step: for teacher-forced checks and `--dump-logits`.
    AllTokens,
    /// Only the argmax of the last token (`next_token`, ties to the lowest id): greedy
    /// decoding, where the INT8-bound head can replace the full one.
    GreedyToken,
}

/// The dtype matrices are computed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ComputeDtype {
    /// Dequantize every weight to f32 (the exactness reference).
    F32,
    /// Weights as bf16, activations f32, f32 accumulation.
    Bf16,
    /// Weights as IEEE half (vLLM's `--dtype half`), activations f32, f32 accumulation: three
    /// more mantissa bits than bf16, and a range that ends at 65 504.
    F16,
    /// Keep the file's storage (quantized blocks stay quantized).
    Native,
}

impl ComputeDtype {
    const ALL: [Self; 4] = [Self::F32, Self::Bf16, Self::F16, Self::Native];

    /// A dtype by bbc's name, or by vLLM's `--dtype` spelling: `float32`/`float`, `bfloat16`,
    /// `float16`/`half`, and `auto` (the file's own storage: `native`).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "float32" | "float" => Some(Self::F32),
            "bfloat16" => Some(Self::Bf16),
            "float16" | "half" => Some(Self::F16),
            "auto" => Some(Self::Native),
            _ => Self::ALL.into_iter().find(|d| d.name() == s),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
            Self::Native => "native",
        }
    }

    /// Every name [`parse`](Self::parse) reads, for messages.
    pub fn choices() -> &'static str {
        "f32, bf16, f16, native (or vLLM's float32, float, bfloat16, float16, half, auto)"
    }

    /// `x` as a matrix of this dtype holds it (bf16 and f16 round to nearest even; f32 and a
    /// file's own storage keep it).
    pub fn round(self, x: f32) -> f32 {
        match self {
            Self::Bf16 => half::bf16::from_f32(x).to_f32(),
            Self::F16 => half::f16::from_f32(x).to_f32(),
            Self::F32 | Self::Native => x,
        }
    }
}

/// What the KV caches store a position's keys and values as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvCacheDtype {
    /// The compute dtype's: bf16 for a bf16 model (as transformers and vLLM keep it), f32 for
    /// f32 (exact); for `native`, the matrices' own float type where they are floats, and
    /// half where they are quantized blocks (as llama.cpp keeps the caches of its files).
    #[default]
    Auto,
    F32,
    Bf16,
    /// IEEE half, as llama.cpp keeps its caches by default: half the bytes of f32 with three
    /// more mantissa bits than bf16.
    F16,
    /// FP8 E4M3 (vLLM's `--kv-cache-dtype fp8`, also read as `fp8_e4m3`): a quarter of f32's
    /// bytes, so at long contexts, where decode is bound by reading the cache, attention reads
    /// half what it reads at f16; three mantissa bits (values off by up to 1/16), and values
    /// past ±448 saturate (unscaled: no calibrated scales are read).
    Fp8,
}

impl KvCacheDtype {
    const ALL: [Self; 5] = [Self::Auto, Self::F32, Self::Bf16, Self::F16, Self::Fp8];

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "fp8_e4m3" => Some(Self::Fp8),
            _ => Self::ALL.into_iter().find(|d| d.name() == s),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
            Self::Fp8 => "fp8",
        }
    }

    /// Every name [`parse`](Self::parse) reads, for messages: "auto, f32, …".
    pub fn choices() -> String {
        Self::ALL.map(Self::name).join(", ")
    }

    /// The element type of the caches of a model computed in `compute` whose matrices are
    /// mostly stored as `matrices` (`WeightSource::matrix_storage`).
    pub fn resolve(self, compute: ComputeDtype, matrices: GgmlType) -> DType {
        match (self, compute) {
            (Self::Auto, ComputeDtype::Bf16) | (Self::Bf16, _) => DType::BF16,
            (Self::Auto, ComputeDtype::F32) | (Self::F32, _) => DType::F32,
            (Self::Auto, ComputeDtype::F16) | (Self::F16, _) => DType::F16,
            (Self::Fp8, _) => DType::F8E4M3,
            (Self::Auto, ComputeDtype::Native) => match matrices {
                GgmlType::F32 => DType::F32,
                GgmlType::BF16 => DType::BF16,
                // f16 matrices, and every kind of quantized block.
                _ => DType::F16,
            },
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct LowerOptions {
    pub logits: LogitsFor,
    pub compute: ComputeDtype,
    pub kv_cache: KvCacheDtype,
}

/// Lower the model to the graph of one step.
pub fn lower(config: &ModelConfig, weights: &WeightSource, options: LowerOptions) -> Result<Graph> {
    build(config, Catalog::Source(weights), options)
}

/// Lower a model that has no weights: each has the shape `config` implies, an HF name, and
/// bf16 storage under `ComputeDtype::Native` (there is no file to keep the storage of). For
/// shape-only graphs whose weights are made where they run (the GPU check's Llama-8B-shaped
/// decode fills them on the device).
pub fn lower_without_weights(config: &ModelConfig, options: LowerOptions) -> Result<Graph> {
    build(config, Catalog::Implied { blocks: None }, options)
}

/// [`lower_without_weights`] for a model quantized as it loads (`quantization` as
/// `WeightSource::quantize_as` takes it; `None` quantizes nothing): the weights a checkpoint
/// of them would have quantized (`fp8_on_load::quantizes`) are FP8 blocks. For timing a
/// quantized model's shape with weights made where it runs.
pub fn lower_without_weights_quantized(
    config: &ModelConfig,
    options: LowerOptions,
    quantization: Option<&str>,
) -> Result<Graph> {
    let blocks = match quantization {
        None => None,
        Some(q) if q.eq_ignore_ascii_case(crate::fp8_on_load::METHOD) => Some(GgmlType::F8E4M3B32),
        Some(q) => {
            return Err(ModelError::Quantization {
                asked: q.to_string(),
                what: format!(
                    "a model without weights is quantized as `{}` only",
                    crate::fp8_on_load::METHOD
                ),
            })
        }
    };
    lower_without_weights_in_blocks(config, options, blocks)
}

/// [`lower_without_weights`] with the weights a checkpoint quantized as it loads would
/// quantize (`fp8_on_load::quantizes`) held as `blocks` whatever the compute dtype (FP8
/// blocks, the 4-bit blocks a GPTQ, AWQ or compressed-tensors checkpoint's 4-bit weights are
/// held as, the FP4 blocks an NVFP4 checkpoint's are, or GGUF's MXFP4): for timing a quantized
/// model's shape with weights made where it runs.
pub fn lower_without_weights_in_blocks(
    config: &ModelConfig,
    options: LowerOptions,
    blocks: Option<GgmlType>,
) -> Result<Graph> {
    if let Some(other) = blocks.filter(|b| !GgmlType::MADE_FROM_FLOATS.contains(b)) {
        return Err(ModelError::Quantization {
            asked: other.name().to_string(),
            what: "a model without weights is held in FP8, 4-bit, FP4, MXFP4 or Q8_0 blocks only".into(),
        });
    }
    build(config, Catalog::Implied { blocks }, options)
}

fn build(config: &ModelConfig, weights: Catalog<'_>, options: LowerOptions) -> Result<Graph> {
    let naming = match weights {
        Catalog::Source(source) => Naming::detect(source),
        Catalog::WithEagleHead(w) => Naming::detect(w.target),
        Catalog::Implied { .. } => Naming::Hf(HfPrefix::Text),
    };
    let mut b = Builder::new(config.family.name(), weights, naming, options);
    match config.family {
        Family::Llama => llama::lower(config, &mut b)?,
        Family::Gemma3 => gemma3::lower(config, &mut b)?,
        Family::Glm4Moe => glm4_moe::lower(config, &mut b)?,
        Family::Qwen35 | Family::Qwen3Next => qwen3_5::lower(config, &mut b)?,
        Family::Gemma4 => gemma4::lower(config, &mut b)?,
        Family::GlmMoeDsa => glm_moe_dsa::lower(config, &mut b)?,
    }
    b.finish()
}

/// `graph` (with a `logits` output) that also outputs `next_token`, the argmax of each logits
/// row: what serving on a GPU reads back when every request of a step decodes greedily, ids
/// instead of vocabulary-wide rows.
pub fn with_greedy_token(graph: &Graph) -> Result<Graph> {
    let mut g = graph.clone();
    let logits = g.output("logits").ok_or_else(|| ModelError::TensorShape {
        name: "graph".into(),
        what: "has no `logits` output".into(),
    })?;
    let next = g.add(Op::TopK { k: 1 }, &[logits]).map_err(graph_error)?;
    g.set_output("next_token", next);
    g.validate().map_err(graph_error)?;
    Ok(g)
}

/// What a matrix stored as `storage` is computed as under `compute`: FP8, 4-bit and FP4 blocks
/// stay as they are (a source holds them only where the model runs such weights: quantized as
/// it loads, or an FP8, integer or NVFP4 checkpoint not read into another type).
pub(crate) fn matrix_dtype(compute: ComputeDtype, storage: GgmlType) -> DType {
    match compute {
        _ if storage.is_checkpoint_blocks() => ir_dtype(storage),
        ComputeDtype::F32 => DType::F32,
        ComputeDtype::Bf16 => DType::BF16,
        ComputeDtype::F16 => DType::F16,
        ComputeDtype::Native => ir_dtype(storage),
    }
}

fn graph_error(e: ir::GraphError) -> ModelError {
    ModelError::TensorShape {
        name: "graph".into(),
        what: e.to_string(),
    }
}

/// Which naming scheme the weights use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Naming {
    Gguf,
    Hf(HfPrefix),
}

/// Where an HF checkpoint keeps its language model: at `model.` (a text model), or inside a
/// multimodal one (`…ForConditionalGeneration`: `model.language_model.` since transformers
/// 4.52, `language_model.model.` before), whose other towers bbc leaves unread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HfPrefix {
    Text,
    LanguageModel,
    LegacyLanguageModel,
    /// The multi-token prediction layers (`mtp.`) beside a language model at the given
    /// prefix, whose embedding and head they share.
    Mtp(TextPrefix),
}

/// Where a checkpoint keeps its language model (an [`HfPrefix`] other than `Mtp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TextPrefix {
    Text,
    LanguageModel,
    LegacyLanguageModel,
}

impl HfPrefix {
    fn model(self) -> &'static str {
        match self {
            Self::Text => "model.",
            Self::LanguageModel => "model.language_model.",
            Self::LegacyLanguageModel => "language_model.model.",
            Self::Mtp(_) => "mtp.",
        }
    }

    fn head(self) -> &'static str {
        match self {
            Self::Text | Self::LanguageModel => "lm_head.weight",
            Self::LegacyLanguageModel => "language_model.lm_head.weight",
            Self::Mtp(target) => Self::from(target).head(),
        }
    }

    /// The language model's own prefix (for `Mtp`, the one it shares tensors with).
    fn text(self) -> TextPrefix {
        match self {
            Self::Text => TextPrefix::Text,
            Self::LanguageModel => TextPrefix::LanguageModel,
            Self::LegacyLanguageModel => TextPrefix::LegacyLanguageModel,
            Self::Mtp(target) => target,
        }
    }
}

impl From<TextPrefix> for HfPrefix {
    fn from(p: TextPrefix) -> Self {
        match p {
            TextPrefix::Text => Self::Text,
            TextPrefix::LanguageModel => Self::LanguageModel,
            TextPrefix::LegacyLanguageModel => Self::LegacyLanguageModel,
        }
    }
}

/// A tensor's HF name and llama.cpp's, for the tensors of one family.
pub(crate) type TensorNames = (&'static str, &'static str);

/// Tensors of a decoder layer, named once here for both schemes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum LayerTensor {
    AttnNorm,
    Q,
    K,
    V,
    O,
    QNorm,
    KNorm,
    PostAttnNorm,
    FfnNorm,
    /// Gemma's norm before the MLP (Llama's is `FfnNorm`, named post-attention in HF).
    PreFfnNorm,
    Gate,
    Up,
    Down,
    PostFfnNorm,
    /// An MoE layer's router (`[experts, hidden]`).
    Router,
}

/// The projections of one routed expert.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ExpertTensor {
    Gate,
    Up,
    Down,
}

impl Naming {
    pub(crate) fn detect(weights: &WeightSource) -> Self {
        if weights.contains("token_embd.weight") {
            return Self::Gguf;
        }
        let prefix = [HfPrefix::LanguageModel, HfPrefix::LegacyLanguageModel]
            .into_iter()
            .find(|p| weights.contains(&format!("{}embed_tokens.weight", p.model())))
            .unwrap_or(HfPrefix::Text);
        Self::Hf(prefix)
    }

    /// The token embedding (the language model's, for its multi-token prediction layers).
    pub(crate) fn embedding(self) -> String {
        match self {
            Self::Hf(p) => format!("{}embed_tokens.weight", HfPrefix::from(p.text()).model()),
            Self::Gguf => "token_embd.weight".into(),
        }
    }

    pub(crate) fn output_norm(self) -> String {
        self.model_tensor("norm.weight", "output_norm.weight")
    }

    pub(crate) fn lm_head(self) -> String {
        match self {
            Self::Gguf => "output.weight".into(),
            Self::Hf(p) => p.head().into(),
        }
    }

    /// A model-level tensor: `rest` under the HF model prefix, or the GGUF name.
    fn model_tensor(self, rest: &str, gguf: &str) -> String {
        match self {
            Self::Gguf => gguf.into(),
            Self::Hf(p) => format!("{}{rest}", p.model()),
        }
    }

    /// A model-level tensor a family names its own way: `names` is its HF name (under the
    /// model prefix) and llama.cpp's.
    pub(crate) fn model_named(self, (hf, gguf): TensorNames) -> String {
        self.model_tensor(hf, gguf)
    }

    /// Layer `i`'s tensor a family names its own way: `names` is its HF name (under the
    /// layer's prefix) and llama.cpp's (under `blk.{i}.`).
    pub(crate) fn layer_named(self, i: usize, (hf, gguf): TensorNames) -> String {
        match self {
            Self::Gguf => format!("blk.{i}.{gguf}"),
            Self::Hf(_) => self.hf_layer(i, hf),
        }
    }

    /// An HF-only tensor of layer `i` (`{prefix}layers.{i}.{rest}`).
    pub(crate) fn hf_layer(self, i: usize, rest: &str) -> String {
        match self {
            Self::Gguf => format!("blk.{i}.{rest}"),
            Self::Hf(p) => format!("{}layers.{i}.{rest}", p.model()),
        }
    }

    pub(crate) fn layer(self, i: usize, t: LayerTensor) -> String {
        use LayerTensor::*;
        let (gguf, hf) = match t {
            AttnNorm => ("attn_norm", "input_layernorm"),
            Q => ("attn_q", "self_attn.q_proj"),
            K => ("attn_k", "self_attn.k_proj"),
            V => ("attn_v", "self_attn.v_proj"),
            O => ("attn_output", "self_attn.o_proj"),
            QNorm => ("attn_q_norm", "self_attn.q_norm"),
            KNorm => ("attn_k_norm", "self_attn.k_norm"),
            PostAttnNorm => ("post_attention_norm", "post_attention_layernorm"),
            FfnNorm => ("ffn_norm", "post_attention_layernorm"),
            PreFfnNorm => ("ffn_norm", "pre_feedforward_layernorm"),
            Gate => ("ffn_gate", "mlp.gate_proj"),
            Up => ("ffn_up", "mlp.up_proj"),
            Down => ("ffn_down", "mlp.down_proj"),
            PostFfnNorm => ("post_ffw_norm", "post_feedforward_layernorm"),
            Router => ("ffn_gate_inp", "mlp.gate"),
        };
        match self {
            Self::Gguf => format!("blk.{i}.{gguf}.weight"),
            Self::Hf(_) => self.hf_layer(i, &format!("{hf}.weight")),
        }
    }

    /// The bias of a linear layer `t` (its weight's name with `bias` for `weight`).
    pub(crate) fn layer_bias(self, i: usize, t: LayerTensor) -> String {
        let weight = self.layer(i, t);
        format!("{}bias", weight.strip_suffix("weight").unwrap_or(&weight))
    }

    /// The per-expert bias an MoE router adds to its scores when it chooses experts.
    pub(crate) fn router_score_bias(self, i: usize) -> String {
        match self {
            Self::Gguf => format!("blk.{i}.exp_probs_b.bias"),
            Self::Hf(_) => self.hf_layer(i, "mlp.gate.e_score_correction_bias"),
        }
    }

    /// Expert `e`'s projection `t` in layer `i`, where experts are stored one by one (HF; GGUF
    /// stacks each projection's experts into one tensor: `moe::experts_stacked`).
    pub(crate) fn expert(self, i: usize, e: usize, t: ExpertTensor) -> String {
        let name = match t {
            ExpertTensor::Gate => "gate_proj",
            ExpertTensor::Up => "up_proj",
            ExpertTensor::Down => "down_proj",
        };
        self.hf_layer(i, &format!("mlp.experts.{e}.{name}.weight"))
    }
}

/// Where lowering learns each weight's shape and storage type.
#[derive(Clone, Copy)]
enum Catalog<'w> {
    /// A file's or directory's tensors, named as it names them.
    Source(&'w WeightSource),
    /// A target's tensors and an EAGLE head's beside them (`eagle::HEAD_PREFIX`).
    WithEagleHead(crate::eagle::HeadWeights<'w>),
    /// No weights: see [`lower_without_weights`]; with `blocks`, those a checkpoint quantized
    /// as it loads would quantize are held as such blocks ([`lower_without_weights_in_blocks`];
    /// 4-bit blocks of either size as wide as each matrix's rows allow).
    Implied { blocks: Option<GgmlType> },
}

impl Catalog<'_> {
    /// `name`'s storage type, after checking that it exists with `shape`.
    fn storage(&self, name: &str, shape: &[usize]) -> Result<GgmlType> {
        match self {
            Self::Source(_) | Self::WithEagleHead(_) => {
                let (dtype, stored) = self
                    .describe(name)
                    .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
                if stored != shape {
                    return Err(ModelError::TensorShape {
                        name: name.into(),
                        what: format!("has shape {stored:?}, the config implies {shape:?}"),
                    });
                }
                Ok(dtype)
            }
            Self::Implied { blocks: Some(blocks) }
                if crate::fp8_on_load::quantizes(name, Self::IMPLIED_STORAGE, shape) =>
            {
                // 4-bit blocks as wide as the rows allow, as random weights quantized as they
                // load are held (`WeightSource::quantize_as`).
                Ok(match quant::u4_blocks::Size::of(*blocks) {
                    Some(_) => quant::u4_blocks::Size::widest(shape[shape.len() - 1], None)
                        .map_or(*blocks, |size| size.format()),
                    None => *blocks,
                })
            }
            Self::Implied { .. } => Ok(Self::IMPLIED_STORAGE),
        }
    }

    /// A tensor as its source reads it (`None` without a source).
    fn tensor(&self, name: &str) -> Option<crate::TensorView<'_>> {
        match self {
            Self::Source(weights) => weights.get(name),
            Self::WithEagleHead(weights) => quant::tensor::Tensors::tensor(weights, name),
            Self::Implied { .. } => None,
        }
    }

    /// A tensor's type and shape in a source of weights (`None` without one).
    fn describe(&self, name: &str) -> Option<(GgmlType, &[usize])> {
        match self {
            Self::Source(weights) => weights.describe(name),
            Self::WithEagleHead(weights) => weights.describe(name),
            Self::Implied { .. } => None,
        }
    }

    /// Whether matrix `name`, stored as `storage`, stays in its blocks whatever the compute
    /// dtype: blocks a checkpoint's weights are held as, and implied blocks (what the weights
    /// are made as).
    fn keeps_blocks(&self, name: &str, storage: GgmlType) -> bool {
        match self {
            Self::Source(source) => source.holds_checkpoint_blocks(storage),
            Self::WithEagleHead(weights) => weights.holds_checkpoint_blocks(name, storage),
            Self::Implied { blocks } => *blocks == Some(storage),
        }
    }

    /// Whether a source holds `name`; implied weights hold every tensor the config names.
    fn contains(&self, name: &str) -> bool {
        match self {
            Self::Implied { .. } => true,
            _ => self.describe(name).is_some(),
        }
    }

    /// How [`lower_without_weights`]'s weights are stored.
    const IMPLIED_STORAGE: GgmlType = GgmlType::BF16;
}

/// Graph under construction plus what lowering needs to add weight nodes.
pub(crate) struct Builder<'w> {
    pub graph: Graph,
    weights: Catalog<'w>,
    pub naming: Naming,
    pub options: LowerOptions,
    /// What the KV caches store (`LowerOptions::kv_cache` resolved for these weights).
    cache_dtype: DType,
    /// The first layer whose attention has a cache slot (slot 0): a multi-token prediction
    /// graph of layers numbered after the model's keeps its caches from slot 0.
    pub first_cached_layer: usize,
    /// Matrices whose columns are held in an order (`crate::input_order_name`), with the
    /// weight of that order: one node for each distinct order, by its bytes (a layer's q, k
    /// and v projections share theirs, so they still join).
    ordered: BTreeMap<NodeId, NodeId>,
    input_orders: Vec<(Vec<u8>, NodeId)>,
    /// Each activation taken in each order once.
    permuted: BTreeMap<(NodeId, NodeId), NodeId>,
}

impl<'w> Builder<'w> {
    fn new(name: &str, weights: Catalog<'w>, naming: Naming, options: LowerOptions) -> Self {
        let matrices = match weights {
            Catalog::Source(source) => source.matrix_storage().unwrap_or(GgmlType::F32),
            // A head's caches are kept as its own weights are.
            Catalog::WithEagleHead(w) => w.head.matrix_storage().unwrap_or(GgmlType::F32),
            Catalog::Implied { .. } => Catalog::IMPLIED_STORAGE,
        };
        Self {
            graph: Graph::new(name),
            weights,
            naming,
            cache_dtype: options.kv_cache.resolve(options.compute, matrices),
            options,
            first_cached_layer: 0,
            ordered: BTreeMap::new(),
            input_orders: Vec::new(),
            permuted: BTreeMap::new(),
        }
    }

    /// The graph, checked: valid, and every matrix held in an order multiplied by inputs taken
    /// in it.
    pub fn finish(self) -> Result<Graph> {
        self.graph.validate().map_err(graph_error)?;
        for (&w, &order) in &self.ordered {
            if !self.read_in_order(w, order) {
                let Op::Weight { name } = &self.graph.node(w).op else {
                    unreachable!("ordered nodes are weights")
                };
                return Err(ModelError::TensorShape {
                    name: name.clone(),
                    what: "holds its columns by group (a GPTQ act-order checkpoint's), which bbc multiplies in \
                           linear layers only, and this model reads it elsewhere; read the checkpoint into a float \
                           type instead (`--dtype bfloat16` or `float32`)"
                        .into(),
                });
            }
        }
        Ok(self.graph)
    }

    /// Whether every use of `node` (a matrix or rows of one) multiplies an input taken in
    /// `order`.
    fn read_in_order(&self, node: NodeId, order: NodeId) -> bool {
        let nodes = self.graph.nodes();
        nodes.iter().enumerate().all(|(user, n)| {
            n.inputs
                .iter()
                .enumerate()
                .filter(|&(_, &i)| i == node)
                .all(|(k, _)| match n.op {
                    Op::MatMul => {
                        let x = self.graph.node(n.inputs[0]);
                        k == 1 && matches!(x.op, Op::PermuteColumns) && x.inputs[1] == order
                    }
                    Op::RowGroupSlice { .. } | Op::ConcatRows => self.read_in_order(NodeId(user), order),
                    _ => false,
                })
        })
    }

    /// The order node of matrix `name`'s held column order, one per distinct order; `None`
    /// where its columns are as stored.
    fn input_order(&mut self, name: &str) -> Option<NodeId> {
        let order_name = crate::input_order_name(name);
        let (bytes, cols) = {
            let view = self.weights.tensor(&order_name)?;
            (view.bytes.to_vec(), view.shape[0])
        };
        if let Some((_, node)) = self.input_orders.iter().find(|(b, _)| *b == bytes) {
            return Some(*node);
        }
        let node = self.graph.weight(order_name, &[cols], DType::I32);
        self.input_orders.push((bytes, node));
        Some(node)
    }

    /// The order the columns of matrix `w` are held in: its own, its rows' (`row_group_slice`)
    /// or its parts' where they share one (`concat_rows`).
    fn order_of(&self, w: NodeId) -> Option<NodeId> {
        let node = self.graph.node(w);
        match node.op {
            Op::RowGroupSlice { .. } => self.order_of(node.inputs[0]),
            Op::ConcatRows => {
                let orders: Vec<Option<NodeId>> = node.inputs.iter().map(|&p| self.order_of(p)).collect();
                orders.iter().all(|o| *o == orders[0]).then_some(orders[0]).flatten()
            }
            _ => self.ordered.get(&w).copied(),
        }
    }

    /// A matrix weight `[rows, cols]`, typed as the compute dtype asks; FP8, 4-bit and FP4
    /// blocks, and a directory's Q8_0 blocks, stay as they are (a source holds them only where
    /// the model runs such weights: quantized as it loads, or an FP8, FP4 or integer checkpoint
    /// not read into another type).
    pub fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<NodeId> {
        let storage = self.weights.storage(name, &[rows, cols])?;
        let dtype = match self.weights.keeps_blocks(name, storage) {
            true => ir_dtype(storage),
            false => matrix_dtype(self.options.compute, storage),
        };
        let w = self.graph.weight(name, &[rows, cols], dtype);
        if let Some(order) = self.input_order(name) {
            self.ordered.insert(w, order);
        }
        Ok(w)
    }

    /// Whether the weights hold a tensor `name` (never, lowering without weights).
    pub fn has_weight(&self, name: &str) -> bool {
        match self.weights {
            Catalog::Implied { .. } => false,
            weights => weights.contains(name),
        }
    }

    /// What the KV caches store (`LowerOptions::kv_cache`).
    pub fn cache_dtype(&self) -> DType {
        self.cache_dtype
    }

    /// A vector weight (norms), always computed in f32.
    pub fn vector(&mut self, name: &str, len: usize) -> Result<NodeId> {
        self.weights.storage(name, &[len])?;
        Ok(self.graph.weight(name, &[len], DType::F32))
    }

    /// Whether `x` holds the sampled rows only (a family may take them before the head: Gemma
    /// 4's KV-shared layers run on those rows alone).
    pub fn is_last_rows(&self, x: NodeId) -> bool {
        self.graph.node(x).shape.0.first() == Some(&ir::Dim::Const(1))
    }

    pub fn op(&mut self, op: Op, inputs: &[NodeId]) -> Result<NodeId> {
        self.graph.add(op, inputs).map_err(graph_error)
    }

    /// `x · wᵀ`; where `w`'s columns are held in an order, `x`'s taken in it.
    pub fn matmul(&mut self, x: NodeId, w: NodeId) -> Result<NodeId> {
        let x = match self.order_of(w) {
            Some(order) => match self.permuted.get(&(x, order)) {
                Some(&taken) => taken,
                None => {
                    let taken = self.op(Op::PermuteColumns, &[x, order])?;
                    self.permuted.insert((x, order), taken);
                    taken
                }
            },
            None => x,
        };
        self.op(Op::MatMul, &[x, w])
    }

    pub fn add(&mut self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.op(Op::Add, &[a, b])
    }

    pub fn rms_norm(&mut self, x: NodeId, weight: &str, len: usize, eps: f64, weight_offset: f32) -> Result<NodeId> {
        let w = self.vector(weight, len)?;
        self.op(
            Op::RmsNorm {
                eps,
                weight_offset,
                group: len,
            },
            &[x, w],
        )
    }

    /// The step's inputs (token ids, positions) and the ids' rows of the embedding table: how
    /// every family's graph begins.
    pub fn token_embeddings(&mut self, config: &ModelConfig) -> Result<(NodeId, NodeId, NodeId)> {
        let ids = self.graph.input(ir::InputKind::TokenIds);
        let positions = self.graph.input(ir::InputKind::Positions);
        let table = self.matrix(&self.naming.embedding(), config.vocab_size, config.hidden)?;
        let x = self.op(Op::Embedding, &[table, ids])?;
        Ok((ids, positions, x))
    }

    /// `x · Wᵀ` for attention projection `t` of layer `i` (`[rows, cols]`), plus its bias
    /// where the model has attention biases.
    pub fn attention_projection(
        &mut self,
        config: &ModelConfig,
        i: usize,
        t: LayerTensor,
        x: NodeId,
        rows: usize,
        cols: usize,
    ) -> Result<NodeId> {
        let w = self.matrix(&self.naming.layer(i, t), rows, cols)?;
        let y = self.matmul(x, w)?;
        if !config.attention_bias {
            return Ok(y);
        }
        let bias = self.vector(&self.naming.layer_bias(i, t), rows)?;
        self.op(Op::AddBias, &[y, bias])
    }

    /// Causal attention over everything cached, scaled by `head_dim^−½`, in layer `layer`'s
    /// cache (of the model's cache dtype).
    pub fn causal_attention(&self, heads: usize, kv_heads: usize, head_dim: usize, layer: usize) -> ir::AttentionSpec {
        ir::AttentionSpec {
            heads,
            kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f64).sqrt(),
            window: None,
            cache_slot: layer - self.first_cached_layer,
            cache_dtype: self.cache_dtype(),
        }
    }

    /// `attention(rope(q), rope(k), v)` in `spec`'s cache: `rope` (whose own `heads` is not
    /// read) rotates every query head and every key head.
    pub fn rotary_attention(
        &mut self,
        [q, k, v]: [NodeId; 3],
        positions: NodeId,
        rope: ir::RopeSpec,
        spec: ir::AttentionSpec,
    ) -> Result<NodeId> {
        let q = self.op(
            Op::Rope(ir::RopeSpec {
                heads: spec.heads,
                ..rope
            }),
            &[q, positions],
        )?;
        let k = self.op(
            Op::Rope(ir::RopeSpec {
                heads: spec.kv_heads,
                ..rope
            }),
            &[k, positions],
        )?;
        self.op(Op::Attention(spec), &[q, k, v])
    }

    /// `down(act(gate(h)) · up(h))`, the weights named `[gate, up, down]`.
    pub fn gated_mlp(
        &mut self,
        h: NodeId,
        names: &[String; 3],
        hidden: usize,
        intermediate: usize,
        act: ir::GluAct,
    ) -> Result<NodeId> {
        let wg = self.matrix(&names[0], intermediate, hidden)?;
        let wu = self.matrix(&names[1], intermediate, hidden)?;
        let (g, u) = (self.matmul(h, wg)?, self.matmul(h, wu)?);
        let g = match act {
            ir::GluAct::Silu => self.op(Op::Silu, &[g])?,
            ir::GluAct::GeluTanh => self.op(Op::GeluTanh, &[g])?,
        };
        let m = self.op(Op::Mul, &[g, u])?;
        let wd = self.matrix(&names[2], hidden, intermediate)?;
        self.matmul(m, wd)
    }

    /// Final norm, optional last-token selection, and the (possibly tied) LM head. Outputs
    /// `hidden` (the normed state the head reads) and `logits`, or `next_token` for greedy.
    pub fn lm_head(&mut self, config: &ModelConfig, x: NodeId, norm_offset: f32) -> Result<()> {
        let norm = self.naming.output_norm();
        self.lm_head_named(config, x, &norm, None, norm_offset)
    }

    /// [`lm_head`](Self::lm_head) through the final norm `norm` and the head `head` where
    /// given and present (a multi-token prediction layer's own), else the model's.
    pub fn lm_head_named(
        &mut self,
        config: &ModelConfig,
        x: NodeId,
        norm: &str,
        head: Option<&str>,
        norm_offset: f32,
    ) -> Result<()> {
        let mut x = x;
        if self.options.logits != LogitsFor::AllTokens && !self.is_last_rows(x) {
            x = self.op(Op::LastToken, &[x])?;
        }
        let x = self.rms_norm(x, norm, config.hidden, config.rms_eps, norm_offset)?;
        // A file may leave the head out and mean the embedding; implied weights have every
        // tensor the config names.
        let head = match head.filter(|h| self.weights.contains(h)) {
            Some(own) => own.to_string(),
            None if config.tied_embeddings || !self.weights.contains(&self.naming.lm_head()) => self.naming.embedding(),
            None => self.naming.lm_head(),
        };
        self.vocabulary_head(x, &head, [config.vocab_size, config.hidden], config.final_logit_softcap)
    }

    /// The head `head` (`[vocab, hidden]`) over the rows `x` it reads (output as `hidden`):
    /// `logits`, soft-capped by `softcap` where given, or `next_token` for greedy.
    pub fn vocabulary_head(
        &mut self,
        x: NodeId,
        head: &str,
        [vocab, hidden]: [usize; 2],
        softcap: Option<f32>,
    ) -> Result<()> {
        let w = self.matrix(head, vocab, hidden)?;
        self.graph.set_output("hidden", x);
        let mut logits = self.matmul(x, w)?;
        if let Some(cap) = softcap {
            logits = self.op(Op::SoftCap { cap }, &[logits])?;
        }
        match self.options.logits {
            LogitsFor::GreedyToken => {
                let next = self.op(Op::TopK { k: 1 }, &[logits])?;
                self.graph.set_output("next_token", next);
            }
            LogitsFor::LastToken | LogitsFor::AllTokens => self.graph.set_output("logits", logits),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::ComputeDtype;

    /// Values as a matrix of each dtype holds them: Gemma's embedding scale √640 is 25.25 in
    /// bf16 and 25.296875 in half (HF computes it in the model's dtype), itself elsewhere.
    #[test]
    fn dtypes_round_as_they_store() {
        let s = 640f32.sqrt();
        assert_eq!(ComputeDtype::Bf16.round(s), 25.25);
        assert_eq!(ComputeDtype::F16.round(s), 25.296875);
        assert_eq!(ComputeDtype::F32.round(s), s);
        assert_eq!(ComputeDtype::Native.round(s), s);
    }

    /// Matrices whose columns are held in an order multiply their input taken in it: one
    /// order weight and one `permute_columns` for matrices of the same order over the same
    /// input, another for another order, none for a matrix as stored; a graph reading such a
    /// matrix any other way is refused, naming it.
    #[test]
    fn matrices_held_in_an_order_multiply_inputs_taken_in_it() {
        use super::*;
        use quant::tensor::{MemoryTensor, MemoryTensors};
        let matrix = |rows: usize| MemoryTensor {
            shape: vec![rows, 8],
            dtype: GgmlType::F32,
            bytes: vec![0; rows * 8 * 4],
        };
        let order = |order: [i32; 8]| MemoryTensor {
            shape: vec![8],
            dtype: GgmlType::I32,
            bytes: order.iter().flat_map(|c| c.to_le_bytes()).collect(),
        };
        let mut tensors = MemoryTensors::new();
        for (name, rows) in [("k", 4), ("v", 4), ("o", 8), ("plain", 2)] {
            tensors.insert(name.into(), matrix(rows));
        }
        let reversed = [7, 6, 5, 4, 3, 2, 1, 0];
        tensors.insert(crate::input_order_name("k"), order(reversed));
        tensors.insert(crate::input_order_name("v"), order(reversed));
        tensors.insert(crate::input_order_name("o"), order([1, 0, 3, 2, 5, 4, 7, 6]));
        let source = WeightSource::Memory(tensors);
        let options = LowerOptions {
            logits: LogitsFor::LastToken,
            compute: ComputeDtype::F32,
            kv_cache: KvCacheDtype::default(),
        };
        let builder = || Builder::new("ordered", Catalog::Source(&source), Naming::Hf(HfPrefix::Text), options);
        let mut b = builder();
        let x = b.graph.hidden_states_input(8);
        for name in ["k", "v", "o", "plain"] {
            let rows = source.describe(name).unwrap().1[0];
            let w = b.matrix(name, rows, 8).unwrap();
            let y = b.matmul(x, w).unwrap();
            b.graph.set_output(name, y);
        }
        let graph = b.finish().unwrap();
        let text = graph.to_text();
        assert_eq!(text.matches("permute_columns(").count(), 2, "{text}");
        assert_eq!(text.matches(".input_order\" : i32[8]").count(), 2, "{text}");
        let taken = |name: &str| graph.node(graph.node(graph.output(name).unwrap()).inputs[0]).op.clone();
        assert_eq!(taken("k"), Op::PermuteColumns);
        assert_eq!(
            graph.node(graph.output("k").unwrap()).inputs[0],
            graph.node(graph.output("v").unwrap()).inputs[0]
        );
        assert_ne!(
            graph.node(graph.output("k").unwrap()).inputs[0],
            graph.node(graph.output("o").unwrap()).inputs[0]
        );
        assert_eq!(taken("plain"), Op::Input(ir::InputKind::HiddenStates));
        // An ordered matrix read as a table, not multiplied.
        let mut b = builder();
        let ids = b.graph.input(ir::InputKind::TokenIds);
        let table = b.matrix("o", 8, 8).unwrap();
        let rows = b.op(Op::Embedding, &[table, ids]).unwrap();
        b.graph.set_output("rows", rows);
        let err = b.finish().unwrap_err().to_string();
        assert!(err.contains("tensor `o`") && err.contains("act-order"), "{err}");
    }
}
