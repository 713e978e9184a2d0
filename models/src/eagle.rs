//! EAGLE draft heads (vLLM's `eagle` and `eagle3` methods): one decoder layer, trained to
//! draft for one target model from the target's own hidden states, in a checkpoint of its own
//! (an HF directory: `config.json` and safetensors).
//!
//! - **EAGLE** (EAGLE-1 and -2): `fc` joins a token's embedding and the target's normed hidden
//!   state at the position before it (`[h, 2h]`, with a bias where the file has one); one Llama
//!   decoder layer without its input norm; the target's LM head over the layer's un-normed
//!   output, which the next chained step reads as its hidden state.
//! - **EAGLE-3**: the target's residual stream entering three of its layers
//!   (`eagle_aux_hidden_state_layer_ids`, by default 2, L/2 and L − 3 of its L) side by side, projected by `fc` (`[h, 3h]`). The projection is computed
//!   in the target's own step ([`EagleHead::target_graph`]), so every hidden state the head
//!   reads is `h` wide, the target's and its own alike. The layer norms the embedding
//!   (`input_layernorm`) and the hidden state (`hidden_norm`) and attends over both side by
//!   side (`q/k/v` of `2h` columns), the hidden state (normed with `norm_before_residual`) its
//!   residual; then a final norm and its own head over a draft vocabulary
//!   (`draft_vocab_size` rows, `d2t`: each draft id's offset to the target's id). Its next
//!   chained step reads the state before the final norm.
//!
//! Both layouts EAGLE-3 heads are published in are read: the EAGLE authors' (`midlayer.*`,
//! a Llama `config.json`) and the speculators library's (`layers.0.*`, the layer's config
//! under `transformer_layer_config`). The embedding is the head's own where its file has one,
//! else the target's.

use crate::config::{Family, ModelConfig};
use crate::error::{ModelError, Result};
use crate::families::{lower_eagle, Naming};
use crate::quant::GgmlType;
use crate::safetensors_dir::SafetensorsDir;
use crate::weights::{MemoryTensor, TensorView, Tensors, WeightSource};
use crate::LowerOptions;
use ir::{Graph, Op};
use std::path::{Path, PathBuf};

/// The prefix under which a head's own tensors are named in the graphs that read them (beside
/// the target's, whose names they may share: both have an `lm_head.weight`).
pub const HEAD_PREFIX: &str = "eagle.";

/// Which EAGLE a head is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EagleMethod {
    /// EAGLE-1 and -2: the target's normed last hidden state, the target's head.
    Eagle,
    /// EAGLE-3: three of the target's layers' states, a head of its own.
    Eagle3,
}

impl EagleMethod {
    /// vLLM's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Eagle => "eagle",
            Self::Eagle3 => "eagle3",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "eagle" => Some(Self::Eagle),
            "eagle3" => Some(Self::Eagle3),
            _ => None,
        }
    }
}

/// An EAGLE head read from its directory, checked against the target it drafts for.
pub struct EagleHead {
    pub method: EagleMethod,
    pub dir: PathBuf,
    /// Its decoder layer's shapes (a one-layer Llama).
    pub config: ModelConfig,
    pub weights: WeightSource,
    /// Its decoder layer's prefix in the files (`midlayer.`, `layers.0.`).
    layer: String,
    /// Its tensors' prefix in the files (`model.` in some EAGLE-1 conversions, else none).
    prefix: String,
    /// EAGLE-3: the target layers whose incoming residual streams `fc` reads, in order.
    pub aux_layers: Vec<usize>,
    /// The target's hidden size.
    target_hidden: usize,
    /// EAGLE-3: the hidden state, not the state before its norm, is the layer's residual.
    pub norm_before_residual: bool,
    /// Rows of its vocabulary projection: the target's vocabulary for EAGLE, the draft
    /// vocabulary for EAGLE-3.
    pub draft_vocab: usize,
    /// EAGLE-3: the target's id of each draft id (`id + d2t[id]`).
    pub token_map: Option<Vec<u32>>,
}

impl EagleHead {
    /// The head in `dir`, as `method` reads it, drafting for `target`.
    pub fn open(dir: &Path, method: EagleMethod, target: &ModelConfig) -> Result<Self> {
        let config_path = dir.join("config.json");
        let bad = |what: String| ModelError::Config {
            path: config_path.clone(),
            what: format!("EAGLE head: {what}"),
        };
        if target.family != Family::Llama {
            return Err(bad(format!(
                "EAGLE heads draft for llama targets here, not {} (whose checkpoints draft with method `mtp`)",
                target.family.name()
            )));
        }
        let text = std::fs::read_to_string(&config_path).map_err(|e| crate::error::io_error(&config_path, e))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        let top = json.as_object().ok_or_else(|| bad("not a JSON object".into()))?;
        for (key, what) in UNREAD_OPTIONS {
            if top.get(*key).and_then(|v| v.as_bool()) == Some(true) {
                return Err(bad(format!("`{key}` ({what}) is not an option bbc reads")));
            }
        }
        // The speculators library nests the layer's config; the EAGLE authors' is the file.
        let mut layer_json = top
            .get("transformer_layer_config")
            .cloned()
            .unwrap_or_else(|| json.clone());
        if let Some(layer) = layer_json.as_object_mut() {
            match layer.get("model_type").and_then(|t| t.as_str()) {
                None => {
                    layer.insert("model_type".into(), "llama".into());
                }
                Some("llama") => {}
                Some(other) => return Err(bad(format!("its layer is a `{other}` layer; bbc reads llama layers"))),
            }
        }
        let mut config = ModelConfig::from_hf_json(layer_json, &config_path)?;
        if config.layers != 1 {
            return Err(bad(format!(
                "it has {} decoder layers; bbc reads heads of one",
                config.layers
            )));
        }
        let indices = ["d2t", "t2d"];
        let weights = WeightSource::Safetensors(SafetensorsDir::open_with_indices(dir, None, &indices)?);
        let prefix = match weights.contains("fc.weight") || !weights.contains("model.fc.weight") {
            true => String::new(),
            false => "model.".to_string(),
        };
        let layer = ["midlayer.", "layers.0."]
            .into_iter()
            .map(|l| format!("{prefix}{l}"))
            .find(|l| weights.contains(&format!("{l}self_attn.q_proj.weight")))
            .ok_or_else(|| {
                bad("its files have no `midlayer.self_attn.q_proj.weight` or `layers.0.self_attn.q_proj.weight`".into())
            })?;
        let target_hidden = match top.get("target_hidden_size") {
            None | Some(serde_json::Value::Null) => target.hidden,
            Some(v) => v
                .as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| bad(format!("`target_hidden_size` is {v}")))?,
        };
        if target_hidden != target.hidden {
            return Err(bad(format!(
                "it was trained for a target of hidden size {target_hidden}; this one's is {}",
                target.hidden
            )));
        }
        let own_embedding = weights.contains(&format!("{prefix}embed_tokens.weight"));
        if !own_embedding && config.hidden != target.hidden {
            return Err(bad(format!(
                "its hidden size {} is not the target's {} and it has no embedding of its own",
                config.hidden, target.hidden
            )));
        }
        config.vocab_size = target.vocab_size;
        config.context_length = target.context_length;
        let mut head = Self {
            method,
            dir: dir.to_path_buf(),
            config,
            weights,
            layer,
            prefix,
            aux_layers: Vec::new(),
            target_hidden: target.hidden,
            norm_before_residual: top.get("norm_before_residual").and_then(|v| v.as_bool()) == Some(true),
            draft_vocab: target.vocab_size,
            token_map: None,
        };
        if method == EagleMethod::Eagle3 {
            head.aux_layers = aux_layers(top, target.layers).map_err(bad)?;
        }
        // A head of the other method says so before anything else it lacks.
        head.check_fc_width().map_err(bad)?;
        if method == EagleMethod::Eagle3 {
            head.read_token_map(target.vocab_size).map_err(bad)?;
        }
        head.check_shapes(target).map_err(bad)?;
        Ok(head)
    }

    /// A tensor of the head as its graphs name it.
    pub fn tensor_name(&self, name: &str) -> String {
        format!("{HEAD_PREFIX}{}{name}", self.prefix)
    }

    /// A tensor of its decoder layer as its graphs name it.
    pub fn layer_tensor(&self, name: &str) -> String {
        format!("{HEAD_PREFIX}{}{name}", self.layer)
    }

    /// The head's own embedding, where its file has one.
    pub fn own_embedding(&self) -> Option<String> {
        let name = format!("{}embed_tokens.weight", self.prefix);
        self.weights.contains(&name).then(|| format!("{HEAD_PREFIX}{name}"))
    }

    /// Whether `fc` has a bias (some EAGLE-1 heads).
    pub fn fc_bias(&self) -> Option<String> {
        let name = format!("{}fc.bias", self.prefix);
        self.weights.contains(&name).then(|| format!("{HEAD_PREFIX}{name}"))
    }

    /// The width `fc` reads.
    pub fn fc_input(&self) -> usize {
        match self.method {
            EagleMethod::Eagle => 2 * self.config.hidden,
            EagleMethod::Eagle3 => self.aux_layers.len() * self.target_hidden,
        }
    }

    fn fc_input_from_file(&self) -> Option<usize> {
        let (_, shape) = self.weights.describe(&format!("{}fc.weight", self.prefix))?;
        shape.get(1).copied()
    }

    /// The tensors the head's and the target's graphs read: the target's, and the head's under
    /// [`HEAD_PREFIX`].
    pub fn weights_beside<'a>(&'a self, target: &'a WeightSource) -> HeadWeights<'a> {
        HeadWeights {
            target,
            head: &self.weights,
        }
    }

    /// The graph of one draft step: from each token's id and the hidden state at the position
    /// before it (the `HiddenStates` input, `h` wide), the logits (or greedy token) of the
    /// token after it over the head's vocabulary, and the state its next chained step reads
    /// (`ir::multi_token::DRAFT_HIDDEN_STATE`). Its attention keeps its cache in slot 0.
    pub fn lower(&self, target: &ModelConfig, target_weights: &WeightSource, options: LowerOptions) -> Result<Graph> {
        lower_eagle(self, target, self.weights_beside(target_weights), options)
    }

    /// The target's `graph` (before fusion) also outputting, at every row, the hidden state the
    /// head reads (`ir::multi_token::TARGET_HIDDEN_STATES`): its normed last state for EAGLE,
    /// `fc` over the residual streams entering the aux layers for EAGLE-3. `target_weights`
    /// name its tensors; `options` are the target's.
    pub fn target_graph(&self, graph: &Graph, target_weights: &WeightSource, options: LowerOptions) -> Result<Graph> {
        match self.method {
            EagleMethod::Eagle => crate::families::with_hidden_states(graph),
            EagleMethod::Eagle3 => {
                let naming = Naming::detect(target_weights);
                let fc = self.tensor_name("fc.weight");
                let storage = self
                    .weights_beside(target_weights)
                    .describe(&fc)
                    .map(|(dtype, _)| dtype)
                    .ok_or_else(|| ModelError::MissingTensor(fc.clone()))?;
                let fc = FcWeight {
                    name: &fc,
                    shape: [self.config.hidden, self.fc_input()],
                    dtype: crate::families::matrix_dtype(options.compute, storage),
                };
                with_aux_states(graph, naming, &self.aux_layers, fc)
            }
        }
    }

    /// EAGLE-3's `d2t`: each draft id's offset to the target's id; `t2d` is not read.
    fn read_token_map(&mut self, target_vocab: usize) -> std::result::Result<(), String> {
        let WeightSource::Safetensors(dir) = &self.weights else {
            unreachable!("opened from a directory")
        };
        let (offsets, shape) = dir
            .index_tensor(&format!("{}d2t", self.prefix))
            .ok_or("its files have no `d2t` (each draft id's offset to the target's)")?;
        if shape.len() != 1 {
            return Err(format!("its `d2t` has shape {shape:?}, not one dimension"));
        }
        let map = offsets
            .iter()
            .enumerate()
            .map(|(d, &offset)| {
                let id = (d as i64)
                    .checked_add(offset)
                    .filter(|id| (0..target_vocab as i64).contains(id));
                id.map(|id| id as u32)
                    .ok_or_else(|| format!("its `d2t` maps draft id {d} past the target's {target_vocab} ids"))
            })
            .collect::<std::result::Result<Vec<u32>, String>>()?;
        self.draft_vocab = map.len();
        self.token_map = Some(map);
        Ok(())
    }

    /// `fc` reads as many columns as the method does over this target.
    fn check_fc_width(&self) -> std::result::Result<(), String> {
        if let Some(cols) = self.fc_input_from_file() {
            if cols != self.fc_input() {
                return Err(format!(
                    "its `fc.weight` reads {cols} columns; as method `{}` over this target it would read {}{}",
                    self.method.name(),
                    self.fc_input(),
                    match self.method {
                        EagleMethod::Eagle => " (an EAGLE-3 head is method `eagle3`)",
                        EagleMethod::Eagle3 => " (an EAGLE-1 head is method `eagle`)",
                    }
                ));
            }
        }
        Ok(())
    }

    /// Every tensor the head's graphs read, with the shapes its config and the target's imply.
    fn check_shapes(&self, target: &ModelConfig) -> std::result::Result<(), String> {
        let c = &self.config;
        let attention_input = match self.method {
            EagleMethod::Eagle => c.hidden,
            EagleMethod::Eagle3 => 2 * c.hidden,
        };
        let (q, kv) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let mut expected: Vec<(String, Vec<usize>)> = vec![
            (self.tensor_name("fc.weight"), vec![c.hidden, self.fc_input()]),
            (self.layer_tensor("self_attn.q_proj.weight"), vec![q, attention_input]),
            (self.layer_tensor("self_attn.k_proj.weight"), vec![kv, attention_input]),
            (self.layer_tensor("self_attn.v_proj.weight"), vec![kv, attention_input]),
            (self.layer_tensor("self_attn.o_proj.weight"), vec![c.hidden, q]),
            (self.layer_tensor("post_attention_layernorm.weight"), vec![c.hidden]),
            (
                self.layer_tensor("mlp.gate_proj.weight"),
                vec![c.intermediate, c.hidden],
            ),
            (self.layer_tensor("mlp.up_proj.weight"), vec![c.intermediate, c.hidden]),
            (
                self.layer_tensor("mlp.down_proj.weight"),
                vec![c.hidden, c.intermediate],
            ),
        ];
        if self.method == EagleMethod::Eagle3 {
            expected.extend([
                (self.layer_tensor("input_layernorm.weight"), vec![c.hidden]),
                (self.layer_tensor("hidden_norm.weight"), vec![c.hidden]),
                (self.tensor_name("norm.weight"), vec![c.hidden]),
                (self.tensor_name("lm_head.weight"), vec![self.draft_vocab, c.hidden]),
            ]);
        }
        if let Some(embedding) = self.own_embedding() {
            expected.push((embedding, vec![target.vocab_size, c.hidden]));
        }
        match (self.method, self.fc_bias()) {
            (EagleMethod::Eagle, Some(bias)) => expected.push((bias, vec![c.hidden])),
            (EagleMethod::Eagle3, Some(_)) => return Err("its `fc` has a bias, which EAGLE-3's has not".into()),
            (_, None) => {}
        }
        // Every tensor of the files is one the graphs read: else it is part of a head they would
        // compute otherwise (attention biases, a second layer, …). EAGLE-1 files keep the input
        // norm their first layer skips.
        let WeightSource::Safetensors(dir) = &self.weights else {
            unreachable!("opened from a directory")
        };
        let skipped = match self.method {
            EagleMethod::Eagle => Some(format!("{}input_layernorm.weight", self.layer)),
            EagleMethod::Eagle3 => None,
        };
        let read = |name: &str| {
            skipped.as_deref() == Some(name) || expected.iter().any(|(e, _)| &e[HEAD_PREFIX.len()..] == name)
        };
        if let Some((name, _, _)) = dir.listing().find(|(name, _, _)| !read(name)) {
            return Err(format!(
                "its `{name}` is no tensor of the {} head bbc computes (attention biases, more layers and \
                 other variants are not read)",
                self.method.name()
            ));
        }
        for (name, shape) in expected {
            let file_name = &name[HEAD_PREFIX.len()..];
            match self.weights.describe(file_name) {
                None => return Err(format!("its files have no `{file_name}`")),
                Some((_, stored)) if stored != shape => {
                    return Err(format!(
                        "its `{file_name}` has shape {stored:?}; its config implies {shape:?}"
                    ))
                }
                Some(_) => {}
            }
        }
        if self.method == EagleMethod::Eagle && self.config.hidden != target.hidden {
            return Err(format!(
                "its hidden size {} is not the target's {}: an EAGLE head reads the target's head",
                self.config.hidden, target.hidden
            ));
        }
        Ok(())
    }
}

/// Options of the speculators library's EAGLE-3 configs that change what the head computes,
/// and what each does; bbc refuses a head that turns one on.
const UNREAD_OPTIONS: &[(&str, &str)] = &[
    ("norm_before_fc", "a norm over the joined states before `fc`"),
    ("fc_norm", "a norm over each state before `fc`"),
    ("norm_output", "the normed state passed to the next step"),
];

/// EAGLE-3's aux layers: the config's (`eagle_aux_hidden_state_layer_ids`, at the top or in
/// `eagle_config`), else vLLM's default for a target of `layers` layers.
fn aux_layers(
    top: &serde_json::Map<String, serde_json::Value>,
    layers: usize,
) -> std::result::Result<Vec<usize>, String> {
    const KEY: &str = "eagle_aux_hidden_state_layer_ids";
    let given = top
        .get(KEY)
        .or_else(|| top.get("eagle_config").and_then(|c| c.get(KEY)))
        .filter(|v| !v.is_null());
    let ids: Vec<usize> = match given {
        Some(v) => v
            .as_array()
            .and_then(|ids| ids.iter().map(|id| id.as_u64().map(|id| id as usize)).collect())
            .ok_or_else(|| format!("`{KEY}` is {v}, not a list of layer numbers"))?,
        None if layers < 3 => {
            return Err(format!(
                "the target has {layers} layers, too few for the default `{KEY}` (2, L/2, L − 3): give them"
            ))
        }
        None => vec![2, layers / 2, layers - 3],
    };
    let mut seen = ids.clone();
    seen.sort_unstable();
    seen.dedup();
    // A layer's id is the stream entering it, as vLLM reads them: the stream after the last
    // layer is none of them.
    if ids.is_empty() || seen.len() != ids.len() || ids.iter().any(|&id| id >= layers) {
        return Err(format!(
            "`{KEY}` {ids:?} must be distinct layers of the target's 0..{layers}"
        ));
    }
    Ok(ids)
}

/// The weight node EAGLE-3 adds to the target's graph.
struct FcWeight<'a> {
    name: &'a str,
    shape: [usize; 2],
    dtype: ir::DType,
}

/// `graph` also outputting `fc` over its residual streams entering `layers` (the input of each
/// one's attention norm), side by side, at every row.
fn with_aux_states(graph: &Graph, naming: Naming, layers: &[usize], fc: FcWeight<'_>) -> Result<Graph> {
    let mut g = graph.clone();
    let err = |what: String| ModelError::TensorShape {
        name: "graph".into(),
        what,
    };
    let streams = layers
        .iter()
        .map(|&layer| {
            stream_entering(&g, naming, layer)
                .ok_or_else(|| err(format!("has no residual stream entering layer {layer}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut joined = streams[0];
    for &stream in &streams[1..] {
        joined = g
            .add(Op::ConcatColumns, &[joined, stream])
            .map_err(|e| err(e.to_string()))?;
    }
    let w = g.weight(fc.name, &fc.shape, fc.dtype);
    let states = g.add(Op::MatMul, &[joined, w]).map_err(|e| err(e.to_string()))?;
    g.set_output(ir::multi_token::TARGET_HIDDEN_STATES, states);
    g.validate().map_err(|e| err(e.to_string()))?;
    Ok(g)
}

/// The residual stream entering decoder layer `layer` of a graph lowered with `naming`: what
/// its attention norm reads, at every row.
fn stream_entering(g: &Graph, naming: Naming, layer: usize) -> Option<ir::NodeId> {
    let norm_name = naming.layer(layer, crate::families::LayerTensor::AttnNorm);
    let norm = g.nodes().iter().find(|n| {
        matches!(n.op, Op::RmsNorm { .. })
            && matches!(&g.node(n.inputs[1]).op, Op::Weight { name } if *name == norm_name)
    })?;
    Some(norm.inputs[0])
}

/// A target's tensors and an EAGLE head's (named under [`HEAD_PREFIX`]) as one source.
#[derive(Clone, Copy)]
pub struct HeadWeights<'a> {
    pub target: &'a WeightSource,
    pub head: &'a WeightSource,
}

impl<'a> HeadWeights<'a> {
    fn source<'n>(&self, name: &'n str) -> (&'a WeightSource, &'n str) {
        match name.strip_prefix(HEAD_PREFIX) {
            Some(own) => (self.head, own),
            None => (self.target, name),
        }
    }

    pub fn describe(&self, name: &str) -> Option<(GgmlType, &'a [usize])> {
        let (source, name) = self.source(name);
        source.describe(name)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.describe(name).is_some()
    }

    /// Whether `name`, stored as `dtype`, is in blocks its source holds a checkpoint's weights
    /// in (`WeightSource::holds_checkpoint_blocks`).
    pub fn holds_checkpoint_blocks(&self, name: &str, dtype: GgmlType) -> bool {
        self.source(name).0.holds_checkpoint_blocks(dtype)
    }
}

impl Tensors for HeadWeights<'_> {
    fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        let (source, name) = self.source(name);
        source.get(name)
    }

    fn made_afresh(&self, name: &str) -> Option<MemoryTensor> {
        let (source, name) = self.source(name);
        source.made_afresh(name)
    }

    fn made_as_read(&self, name: &str) -> bool {
        let (source, name) = self.source(name);
        source.made_as_read(name)
    }
}
