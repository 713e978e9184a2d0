//! What a MODEL argument names, and loading it: an artifact directory, a `model.toml`, a
//! weights path (GGUF file or HF directory), the name of a model bbc fetches, or a model's
//! shape without weights (a `config.json`, or a named shape such as `llama3-8b`), run with
//! random weights as vLLM's `--load-format dummy` runs one.

use crate::fetch;
use anyhow::{bail, ensure, Context, Result};
use codegen::Target;
use ir::Graph;
use models::{ComputeDtype, KvCacheDtype, LogitsFor, Model, ModelSpec};
use std::path::{Path, PathBuf};

pub enum ModelRef {
    Artifact(PathBuf),
    Toml(PathBuf),
    Weights(PathBuf),
    Known(&'static fetch::KnownModel),
    /// A `config.json` (a file, or a named shape's written into bbc's home): random weights.
    Shape(PathBuf),
}

/// The seed of every model run with random weights: the same shape, the same weights.
pub const RANDOM_WEIGHTS_SEED: u32 = 7;

impl ModelRef {
    pub fn parse(arg: &str) -> Result<Self> {
        let path = Path::new(arg);
        if path.join(codegen::MANIFEST_FILE).is_file() {
            return Ok(Self::Artifact(path.into()));
        }
        if path.is_file() && path.extension().is_some_and(|e| e == "toml") {
            return Ok(Self::Toml(path.into()));
        }
        if path.is_file() && path.extension().is_some_and(|e| e == "json") {
            return Ok(Self::Shape(path.into()));
        }
        if path.exists() {
            return Ok(Self::Weights(path.into()));
        }
        if let Some(model) = fetch::known(arg) {
            return Ok(Self::Known(model));
        }
        if let Some(config) = models::config::shapes::config_json(arg) {
            return Ok(Self::Shape(write_shape(arg, &config)?));
        }
        let names: Vec<&str> = fetch::MODELS.iter().map(|m| m.name).collect();
        bail!(
            "`{arg}` is not an artifact directory, a model.toml, a weights path, a config.json, a known model ({}) or a named shape ({})",
            names.join(", "),
            models::config::shapes::NAMES.join(", ")
        )
    }

    /// The model spec this names (fetching a known model first); `None` for artifacts.
    fn spec(&self, quiet: bool) -> Result<Option<ModelSpec>> {
        Ok(match self {
            Self::Artifact(_) => None,
            Self::Toml(path) => Some(ModelSpec::load(path)?),
            Self::Weights(path) => Some(ModelSpec::for_weights(path)),
            Self::Known(model) => Some(ModelSpec::for_weights(&fetch::ensure(model, quiet)?)),
            Self::Shape(config) => Some(ModelSpec {
                // Random weights hold what a bf16 checkpoint does.
                dtype: ComputeDtype::Bf16,
                random_weights: Some(RANDOM_WEIGHTS_SEED),
                ..ModelSpec::for_weights(config)
            }),
        })
    }
}

/// The named shape `name`'s `config.json`, written once into bbc's home (an artifact compiled
/// from it names the file).
fn write_shape(name: &str, config: &serde_json::Value) -> Result<PathBuf> {
    let dir = fetch::cache_dir().join("shapes").join(name);
    let path = dir.join("config.json");
    let text = serde_json::to_string_pretty(config)?;
    if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(path)
}

/// Open what `spec` names: its weights, or, for a shape, random weights from its seed (bf16
/// matrices, f32 vectors; see `runtime::random_weights`): made here where `host_weights`, else
/// left for the device to make (the model's weights are then empty).
fn open_model(spec: ModelSpec, host_weights: bool) -> Result<Model> {
    let Some(seed) = spec.random_weights else {
        return Ok(Model::open(spec)?);
    };
    let mut config = models::ModelConfig::from_hf_config(&spec.weights)?;
    if let Some(limit) = spec.context_length {
        ensure!(
            limit <= config.context_length,
            "context_length {limit} exceeds the model's {}",
            config.context_length
        );
        config.context_length = limit;
    }
    let options = models::LowerOptions {
        logits: LogitsFor::LastToken,
        compute: spec.dtype,
        kv_cache: spec.kv_cache_dtype,
    };
    let weights = match host_weights {
        true => {
            let skeleton = models::lower_without_weights(&config, options)?;
            let mut weights = runtime::random_weights::host_weights(&skeleton, seed);
            // The multi-token prediction layers' own tensors (the ones they share are the
            // same by name).
            if config.mtp_layers > 0 && config.family.lowers_mtp() {
                let head = models::lower_mtp_without_weights(&config, options)?;
                weights.extend(runtime::random_weights::host_weights(&head, seed));
            }
            weights
        }
        false => Default::default(),
    };
    let mut weights = models::WeightSource::Memory(weights);
    // Weights left for the device are made there as the artifact's plans read them.
    if let (Some(asked), true) = (&spec.quantization, host_weights) {
        weights.quantize_as(asked)?;
    }
    // A tokenizer given, else one beside the config (an HF directory without weights).
    let beside = spec.weights.with_file_name("tokenizer.json");
    let tokenizer = match (&spec.tokenizer, beside.is_file()) {
        (Some(path), _) => Some(models::Tokenizer::from_file(path)?),
        (None, true) => Some(models::Tokenizer::from_file(&beside)?),
        (None, false) => None,
    };
    if let Some(t) = &tokenizer {
        ensure!(
            t.vocab_size() <= config.vocab_size,
            "the tokenizer has {} tokens, more than the model's vocabulary of {}: its ids would fall outside the embedding (choose another with --tokenizer)",
            t.vocab_size(),
            config.vocab_size
        );
    }
    Ok(Model {
        spec,
        config,
        weights,
        tokenizer,
        generation_defaults: models::GenerationDefaults::default(),
    })
}

/// The file holding the tokenizer `arg` names: a GGUF file or `tokenizer.json`, a directory
/// holding a `tokenizer.json`, a model bbc fetches (its GGUF), or a model.toml's weights.
pub fn tokenizer_file(arg: &str) -> Result<PathBuf> {
    let path = Path::new(arg);
    if path.is_dir() && path.join("tokenizer.json").is_file() {
        return Ok(path.join("tokenizer.json"));
    }
    if path.is_file() && path.extension().is_some_and(|e| e == "toml") {
        let spec = ModelSpec::load(path)?;
        return Ok(spec.tokenizer.unwrap_or(spec.weights));
    }
    if path.is_file() {
        return Ok(path.to_path_buf());
    }
    if let Some(model) = fetch::known(arg) {
        return fetch::ensure(model, false);
    }
    bail!("--tokenizer {arg}: not a tokenizer file, a directory holding tokenizer.json, a model.toml or a known model")
}

/// A model opened and lowered (or read from its artifact), ready for a backend.
pub struct Loaded {
    pub model: Model,
    pub graph: Graph,
    /// The greedy graph (argmax only), when asked for.
    pub greedy: Option<Graph>,
    /// Weights prepared at compile time (an artifact's INT8 heads), by weight name.
    pub int8_heads: Vec<(String, quant::int8_rows::Int8Rows)>,
    /// For an artifact compiled for a GPU: its directory and plan files.
    pub gpu_plan: Option<GpuPlanFiles>,
    /// A GPU artifact of a model with random weights whose plans carry the fill kernels: the
    /// seed its plans make the weights from on the device (the model's own weights are then
    /// empty: nothing is made on the host).
    pub generated_weights: Option<u32>,
    /// A model.toml's `[speculative]` section: prompt lookup, a draft model, or the model's
    /// multi-token prediction layers.
    pub speculative: Option<models::Speculative>,
}

impl Loaded {
    /// Where a GPU plan takes the weights from: made on the device, or the model's uploaded.
    pub fn plan_weights(&self) -> runtime::plan_exec::PlanWeights<'_> {
        match self.generated_weights {
            Some(seed) => runtime::plan_exec::PlanWeights::Generated { seed },
            None => runtime::plan_exec::PlanWeights::Host(&self.model.weights),
        }
    }
}

/// Where a GPU artifact's plans are.
#[derive(Debug, Clone)]
pub struct GpuPlanFiles {
    pub dir: PathBuf,
    /// The logits graph's plan.
    pub logits: String,
    /// The greedy graph's plan (INT8-bound head), when the artifact has one.
    pub greedy: Option<String>,
    /// The batched serving plan and its graph, when the artifact has them.
    pub serving: Option<(String, Graph)>,
    /// The multi-token prediction head's batched plan and its graph, when the checkpoint
    /// carries one (the serving plan then outputs the hidden states it reads), or the EAGLE
    /// head's the artifact was compiled with.
    pub mtp: Option<(String, Graph)>,
    /// The EAGLE head whose draft step `mtp` is, if it is one.
    pub eagle_head: Option<codegen::EagleHeadFiles>,
}

impl Loaded {
    /// The weight cache to start an engine from: what the artifact prepared.
    pub fn weight_cache(&mut self) -> runtime::WeightCache {
        let mut cache = runtime::WeightCache::default();
        for (name, rows) in self.int8_heads.drain(..) {
            cache.insert_int8(name, &rows);
        }
        cache
    }
}

/// The cost model the passes optimise for on `target`.
pub fn cost_model(target: Target) -> passes::CostModel {
    match target {
        Target::Cpu => passes::CostModel::CPU,
        Target::H200 => passes::CostModel::H200,
        Target::B200 => passes::CostModel::B200,
        Target::RtxPro6000 => passes::CostModel::RTX_PRO_6000,
    }
}

/// Where a model's weights come from (vLLM's `--load-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LoadFormat {
    /// The model's own files.
    #[default]
    Auto,
    /// Random weights of the model's shape (its `config.json`), made where it runs, with its
    /// tokenizer: as a config.json or named shape runs.
    Dummy,
}

/// How to get from the model to the graph that runs.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub dtype: Option<ComputeDtype>,
    /// Random weights in place of the model's (`--load-format dummy`).
    pub load_format: LoadFormat,
    /// Overrides the KV caches' element type of anything but an artifact.
    pub kv_cache_dtype: Option<KvCacheDtype>,
    /// Caps the context (prompt and output, at most the model's own) of anything but an
    /// artifact, as vLLM's `--max-model-len` does.
    pub max_model_len: Option<usize>,
    pub logits: LogitsFor,
    /// Also build the greedy graph (whose LM head may become the INT8-bound top-k).
    pub greedy: bool,
    /// Run the pass pipeline for the CPU (artifacts are already optimised for their target).
    pub fuse: bool,
    pub quiet: bool,
    /// The tokenizer to use instead of the model's (vLLM's `--tokenizer`; see
    /// [`tokenizer_file`]): for a model whose files have none, such as a shape run with random
    /// weights.
    pub tokenizer: Option<String>,
    /// What the weights must be quantized as (vLLM's `--quantization`; checked, or done as they
    /// load: `models::WeightSource::quantize_as`).
    pub quantization: Option<String>,
}

impl Default for LoadOptions {
    /// The logits graph at the last token, fused for the CPU, in the model's own dtype,
    /// context and cache type, saying what it fetches.
    fn default() -> Self {
        Self {
            dtype: None,
            load_format: LoadFormat::Auto,
            kv_cache_dtype: None,
            max_model_len: None,
            logits: LogitsFor::LastToken,
            greedy: false,
            fuse: true,
            quiet: false,
            tokenizer: None,
            quantization: None,
        }
    }
}

/// `--chat-template arg` in place of `tokenizer`'s own chat template.
pub fn use_chat_template(tokenizer: &mut models::Tokenizer, arg: &str) -> Result<()> {
    let source = chat_template_source(arg)?;
    tokenizer
        .set_chat_template(&source)
        .with_context(|| format!("--chat-template {arg}"))?;
    Ok(())
}

/// `--chat-template`'s template: the file `arg` names or, where no such file exists and `arg`
/// holds Jinja's `{{` or `{%`, `arg` itself (as vLLM takes it).
fn chat_template_source(arg: &str) -> Result<String> {
    let path = Path::new(arg);
    if path.is_file() {
        return std::fs::read_to_string(path).with_context(|| format!("--chat-template {arg}: reading it"));
    }
    ensure!(
        arg.contains("{{") || arg.contains("{%"),
        "--chat-template {arg}: no such file, nor a Jinja template"
    );
    Ok(arg.to_string())
}

/// The tokenizer of model `arg` (a name, weights path, model.toml or artifact).
pub fn tokenizer(arg: &str) -> Result<models::Tokenizer> {
    let options = LoadOptions {
        fuse: false,
        quiet: true,
        ..LoadOptions::default()
    };
    load(arg, options)?
        .model
        .tokenizer
        .with_context(|| format!("`{arg}` has no tokenizer"))
}

/// Open `arg`; `options.dtype` overrides the compute dtype of anything but an artifact.
pub fn load(arg: &str, options: LoadOptions) -> Result<Loaded> {
    let reference = ModelRef::parse(arg)?;
    match reference.spec(options.quiet)? {
        Some(spec) => load_spec(spec, options),
        None => {
            let ModelRef::Artifact(dir) = reference else {
                unreachable!("only artifacts have no spec")
            };
            load_artifact(&dir, options)
        }
    }
}

/// Open the model `spec` names, `options` over its settings.
fn load_spec(mut spec: ModelSpec, options: LoadOptions) -> Result<Loaded> {
    if options.load_format == LoadFormat::Dummy {
        spec = with_random_weights(spec)?;
    }
    if let Some(d) = options.dtype {
        spec.dtype = d;
    }
    if let Some(k) = options.kv_cache_dtype {
        spec.kv_cache_dtype = k;
    }
    if let Some(n) = options.max_model_len {
        ensure!(n >= 1, "--max-model-len must be at least 1");
        spec.context_length = Some(n);
    }
    if let Some(arg) = &options.tokenizer {
        spec.tokenizer = Some(tokenizer_file(arg)?);
    }
    if let Some(q) = &options.quantization {
        spec.quantization = Some(q.clone());
    }
    let speculative = spec.speculative.clone();
    let model = match options.max_model_len {
        Some(n) => open_model(spec, true).with_context(|| format!("--max-model-len {n}"))?,
        None => open_model(spec, true)?,
    };
    let fuse = |graph: Graph| -> Result<Graph> {
        if !options.fuse {
            return Ok(graph);
        }
        let stages = passes::optimize(&graph, passes::CostModel::CPU, None)?;
        Ok(stages.into_iter().last().map_or(graph, |s| s.graph))
    };
    let graph = fuse(model.lower(options.logits)?)?;
    let greedy = match options.greedy {
        true => Some(fuse(model.lower(LogitsFor::GreedyToken)?)?),
        false => None,
    };
    Ok(Loaded {
        model,
        graph,
        greedy,
        int8_heads: Vec::new(),
        gpu_plan: None,
        generated_weights: None,
        speculative,
    })
}

/// `spec` with random weights of its shape (`--load-format dummy`): an HF directory's (or a
/// model.toml's) `config.json` read as a config.json is, the tokenizer beside it; a GGUF file
/// states its shape otherwise and is refused.
fn with_random_weights(spec: ModelSpec) -> Result<ModelSpec> {
    if spec.random_weights.is_some() {
        return Ok(spec);
    }
    let config = match spec.weights.is_dir() {
        true => spec.weights.join("config.json"),
        false => spec.weights.with_file_name("config.json"),
    };
    ensure!(
        config.is_file(),
        "--load-format dummy needs the model's config.json (an HF directory, or a config.json or named shape): {} has none beside it",
        spec.weights.display()
    );
    Ok(ModelSpec {
        // Random weights hold what a bf16 checkpoint does.
        dtype: ComputeDtype::Bf16,
        random_weights: Some(RANDOM_WEIGHTS_SEED),
        weights: config,
        ..spec
    })
}

/// Whether every plan of the GPU artifact in `dir` carries the fill kernels that make random
/// weights on the device (an artifact compiled before they did has them uploaded instead).
fn carries_fill_kernels(dir: &Path, manifest: &codegen::Manifest) -> bool {
    let plans = [
        Some(&manifest.plan),
        Some(&manifest.greedy_plan),
        Some(&manifest.serving_plan),
        Some(&manifest.mtp_plan),
    ];
    plans.into_iter().flatten().flatten().all(|file| {
        let Ok(text) = std::fs::read_to_string(dir.join(file)) else {
            return false;
        };
        let Ok(plan) = serde_json::from_str::<codegen::gpu::GpuPlan>(&text) else {
            return false;
        };
        runtime::random_weights::fill_kernels()
            .iter()
            .all(|fill| plan.kernels.iter().any(|k| k.name == fill.name))
    })
}

/// Open the artifact in `dir`: the options a compiled artifact fixed are refused, a
/// `--quantization` checked against what it was compiled with.
fn load_artifact(dir: &Path, options: LoadOptions) -> Result<Loaded> {
    if options.dtype.is_some() {
        bail!("--dtype does not apply to a compiled artifact: its dtype was fixed by `bbc compile`");
    }
    if options.load_format == LoadFormat::Dummy {
        bail!("--load-format dummy does not apply to a compiled artifact: its weights were fixed by `bbc compile`");
    }
    if options.kv_cache_dtype.is_some() {
        bail!("--kv-cache-dtype does not apply to a compiled artifact: its caches were fixed by `bbc compile` (model.toml's `kv_cache_dtype`)");
    }
    if options.max_model_len.is_some() {
        bail!("--max-model-len does not apply to a compiled artifact: its context was fixed by `bbc compile` (model.toml's `context_length`)");
    }
    if options.tokenizer.is_some() {
        bail!("--tokenizer does not apply to a compiled artifact: its tokenizer was fixed by `bbc compile`");
    }
    let manifest = codegen::read_manifest(dir)?;
    let spec = ModelSpec {
        weights: manifest.weights.clone(),
        architecture: Some(manifest.family),
        dtype: manifest.dtype,
        // The artifact's graphs carry their caches' element type.
        kv_cache_dtype: KvCacheDtype::Auto,
        context_length: Some(manifest.context_length),
        tokenizer: manifest.tokenizer.clone(),
        speculative: None,
        random_weights: manifest.random_weights,
        quantization: manifest.quantization.clone(),
    };
    let on_device = manifest
        .random_weights
        .filter(|_| manifest.target != Target::Cpu && carries_fill_kernels(dir, &manifest));
    let model = open_model(spec, on_device.is_none())
        .with_context(|| format!("opening the weights {} names", dir.display()))?;
    if let Some(asked) = &options.quantization {
        // Weights made on the device are not held here: the manifest says what they are.
        let held = model.weights.quantization().or(manifest.quantization.as_deref());
        ensure!(
            held.is_some_and(|h| h == models::checkpoint_quantization::method_named(asked)),
            "--quantization {asked} does not apply to this artifact: {}",
            match held {
                Some(held) => format!("its weights are quantized as `{held}`"),
                None => "its weights are not quantized (`bbc compile --quantization` quantizes them)".into(),
            }
        );
    }
    let graphs = codegen::read_graphs(dir, &manifest)?;
    Ok(Loaded {
        model,
        graph: graphs.logits,
        greedy: graphs.greedy,
        int8_heads: codegen::read_int8_heads(dir, &manifest.int8_heads)?,
        gpu_plan: manifest
            .plan
            .clone()
            .filter(|_| manifest.target != Target::Cpu)
            .map(|logits| GpuPlanFiles {
                dir: dir.to_path_buf(),
                logits,
                greedy: manifest.greedy_plan.clone(),
                serving: manifest.serving_plan.clone().zip(graphs.serving),
                mtp: manifest.mtp_plan.clone().zip(graphs.mtp),
                eagle_head: manifest.eagle_head.clone(),
            }),
        generated_weights: on_device,
        speculative: None,
    })
}
