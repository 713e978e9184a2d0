//! What a MODEL argument names, and loading it: an artifact directory, a `model.toml`, a
//! weights path (GGUF file or HF directory), or the name of a model bbc fetches.

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
}

impl ModelRef {
    pub fn parse(arg: &str) -> Result<Self> {
        let path = Path::new(arg);
        if path.join(codegen::MANIFEST_FILE).is_file() {
            return Ok(Self::Artifact(path.into()));
        }
        if path.is_file() && path.extension().is_some_and(|e| e == "toml") {
            return Ok(Self::Toml(path.into()));
        }
        if path.exists() {
            return Ok(Self::Weights(path.into()));
        }
        if let Some(model) = fetch::known(arg) {
            return Ok(Self::Known(model));
        }
        let names: Vec<&str> = fetch::MODELS.iter().map(|m| m.name).collect();
        bail!(
            "`{arg}` is not an artifact directory, a model.toml, a weights path, or a known model ({})",
            names.join(", ")
        )
    }

    /// The model spec this names (fetching a known model first); `None` for artifacts.
    fn spec(&self, quiet: bool) -> Result<Option<ModelSpec>> {
        Ok(match self {
            Self::Artifact(_) => None,
            Self::Toml(path) => Some(ModelSpec::load(path)?),
            Self::Weights(path) => Some(ModelSpec::for_weights(path)),
            Self::Known(model) => Some(ModelSpec::for_weights(&fetch::ensure(model, quiet)?)),
        })
    }
}

/// A model opened and lowered (or read from its artifact), ready for a backend.
pub struct Loaded {
    pub model: Model,
    pub graph: Graph,
    /// The greedy graph (argmax only), when asked for.
    pub greedy: Option<Graph>,
    /// Weights prepared at compile time (an artifact's INT8 heads), by weight name.
    pub int8_heads: Vec<(String, passes::weight_transforms::Int8Rows)>,
    /// For an artifact compiled for a GPU: its directory and plan files.
    pub gpu_plan: Option<GpuPlanFiles>,
    /// A model.toml's `[speculative]` section: prompt lookup, or a draft model.
    pub speculative: Option<models::NgramSpec>,
    pub draft_model: Option<models::DraftModelSpec>,
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

/// How to get from the model to the graph that runs.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    pub dtype: Option<ComputeDtype>,
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
}

impl Default for LoadOptions {
    /// The logits graph at the last token, fused for the CPU, in the model's own dtype,
    /// context and cache type, saying what it fetches.
    fn default() -> Self {
        Self {
            dtype: None,
            kv_cache_dtype: None,
            max_model_len: None,
            logits: LogitsFor::LastToken,
            greedy: false,
            fuse: true,
            quiet: false,
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
        Some(mut spec) => {
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
            let (speculative, draft_model) = (spec.speculative, spec.draft_model.clone());
            let model = match options.max_model_len {
                Some(n) => Model::open(spec).with_context(|| format!("--max-model-len {n}"))?,
                None => Model::open(spec)?,
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
                speculative,
                draft_model,
            })
        }
        None => {
            let ModelRef::Artifact(dir) = reference else {
                unreachable!("only artifacts have no spec")
            };
            if options.dtype.is_some() {
                bail!("--dtype does not apply to a compiled artifact: its dtype was fixed by `bbc compile`");
            }
            if options.kv_cache_dtype.is_some() {
                bail!("--kv-cache-dtype does not apply to a compiled artifact: its caches were fixed by `bbc compile` (model.toml's `kv_cache_dtype`)");
            }
            if options.max_model_len.is_some() {
                bail!("--max-model-len does not apply to a compiled artifact: its context was fixed by `bbc compile` (model.toml's `context_length`)");
            }
            load_artifact(&dir)
        }
    }
}

fn load_artifact(dir: &Path) -> Result<Loaded> {
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
        draft_model: None,
    };
    let model = Model::open(spec).with_context(|| format!("opening the weights {} names", dir.display()))?;
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
            }),
        speculative: None,
        draft_model: None,
    })
}
