//! The artifact directory: `manifest.json`, `graph.ir` (canonical text), `graph.json` (what the
//! runtime loads), the greedy graph (`greedy.*`), a reference to the weights file(s), and for
//! GPU targets the plans with their kernels: `plan.json` (`bbc run`), `greedy_plan.json`, and
//! `serving_plan.json` with its graph `serving.*` (`bbc serve`: batched steps), and where the
//! checkpoint carries multi-token prediction layers, `mtp_plan.json` with its graph `mtp.*`
//! (their drafts for the serving plan).

use crate::target::Target;
use ir::Graph;
use models::Model;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};

pub const MANIFEST_FILE: &str = "manifest.json";
const GRAPH_TEXT: &str = "graph.ir";
const GRAPH_JSON: &str = "graph.json";
const GREEDY_GRAPH_TEXT: &str = "greedy.ir";
const GREEDY_GRAPH_JSON: &str = "greedy.json";
const SERVING_GRAPH_TEXT: &str = "serving.ir";
const SERVING_GRAPH_JSON: &str = "serving.json";
const MTP_GRAPH_TEXT: &str = "mtp.ir";
const MTP_GRAPH_JSON: &str = "mtp.json";
/// The KV pool a serving plan is written with; `bbc serve` sets its own (`--kv-blocks`,
/// `--block-size`): the kernels take the block size at run time.
const DEFAULT_SERVING_CACHE: crate::gpu::BatchedCache = crate::gpu::BatchedCache {
    blocks: 1024,
    block_size: 16,
    sequences: 64,
};
const FORMAT_VERSION: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {what}")]
    Invalid { path: PathBuf, what: String },
    #[error("target {target}: {source}")]
    Gpu {
        target: &'static str,
        #[source]
        source: crate::gpu::GpuCodegenError,
    },
    #[error("target {target}: {source}")]
    Nvrtc {
        target: &'static str,
        #[source]
        source: crate::nvrtc::NvrtcError,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ArtifactError + '_ {
    move |source| ArtifactError::Io {
        path: path.to_path_buf(),
        source,
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format_version: u32,
    pub bbc_version: String,
    pub target: Target,
    pub family: models::Family,
    /// Compute dtype of the matrices.
    pub dtype: models::ComputeDtype,
    /// The weights (a GGUF file or an HF directory), absolute; for random weights, the
    /// `config.json` of the model's shape.
    pub weights: PathBuf,
    pub weights_sha256: String,
    /// The seed of the model's random weights, where it runs without a weights file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub random_weights: Option<u32>,
    /// What the weights were asked to be quantized as (`--quantization`): checked against a
    /// quantized checkpoint, or done as they load over one of floats; the graphs read them so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<String>,
    /// Where the tokenizer comes from: the weights themselves unless a model.toml overrode it.
    pub tokenizer: Option<PathBuf>,
    pub context_length: usize,
    pub graph_text: String,
    pub graph_json: String,
    /// The greedy graph (argmax only, INT8-bound LM head where the head qualifies), if any.
    pub greedy_graph_json: Option<String>,
    /// INT8 rows of the heads the greedy graph's `int8_bound_top_k` reads, made at compile time.
    pub int8_heads: Vec<crate::derived::DerivedWeight>,
    /// GPU targets: the launch plan (`plan.json`), next to `kernels/*.cu` and `kernels/*.ptx`.
    pub plan: Option<String>,
    /// GPU targets: the greedy graph's plan (`greedy_plan.json`), when there is a greedy graph.
    pub greedy_plan: Option<String>,
    /// GPU targets: the serving graph (each sequence's last logits row), run by `serving_plan`.
    #[serde(default)]
    pub serving_graph_json: Option<String>,
    /// GPU targets: the batched plan `bbc serve` runs (`serving_plan.json`: rows of many
    /// sequences over one paged KV pool).
    #[serde(default)]
    pub serving_plan: Option<String>,
    /// GPU targets: the tensor-core GEMM the plans' bf16 matmuls prefill through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_gemm: Option<crate::gpu::PrefillGemm>,
    /// GPU targets: the tensor-core attention the plans' prompts attend with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_attention: Option<crate::gpu::PrefillAttention>,
    /// GPU targets: the split attention the plans' other steps attend with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_attention: Option<crate::gpu::DecodeAttention>,
    /// GPU targets: how the plans' prompts go through Gated DeltaNet layers' delta rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_delta_rule: Option<crate::gpu::PrefillDeltaRule>,
    /// GPU targets: how the plans' prompts run MoE layers' experts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_experts: Option<crate::gpu::PrefillExperts>,
    /// GPU targets, a model whose checkpoint carries multi-token prediction layers: their
    /// graph (`mtp.*`: a draft step, its greedy token and the hidden state the next one reads),
    /// whose batched plan (`mtp_plan.json`) drafts for the serving plan, which then also
    /// outputs its hidden state at every row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtp_graph_json: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtp_plan: Option<String>,
    /// GPU targets compiled with an EAGLE head: the `mtp.*` graph and plan are its draft step
    /// (not the checkpoint's own layers), and the serving plan outputs the states it reads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eagle_head: Option<EagleHeadFiles>,
    /// sha256 over the graph, the weights hash and every field above: the artifact's identity.
    pub hash: String,
}

/// The graphs of an artifact, as compiled.
#[derive(Debug, Clone, Copy)]
pub struct CompiledGraphs<'a> {
    /// Logits of the last row: `bbc run`.
    pub logits: &'a Graph,
    /// The argmax only (INT8-bound head where the head qualifies): greedy `bbc run`.
    pub greedy: Option<&'a Graph>,
    /// The batched serving plan's graph (GPU targets only): logits of each sequence's last row
    /// (`last_token` gathers them in a batched step), or of every row.
    pub serving: Option<&'a Graph>,
    /// The multi-token prediction head's graph (GPU targets only), drafting for `serving`.
    pub mtp: Option<&'a Graph>,
    /// Where `mtp` is an EAGLE head's draft step: the head, whose tensors it and `serving`
    /// read beside the model's.
    pub eagle: Option<EagleGraphs<'a>>,
}

/// An EAGLE head compiled into an artifact's draft plan.
#[derive(Clone, Copy)]
pub struct EagleGraphs<'a> {
    /// vLLM's name for its method (`eagle`, `eagle3`).
    pub method: &'a str,
    /// Its directory (`config.json` and safetensors).
    pub dir: &'a Path,
    /// The model's tensors and the head's beside them, as the graphs name them.
    pub weights: &'a dyn quant::tensor::Tensors,
}

impl std::fmt::Debug for EagleGraphs<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EagleGraphs")
            .field("method", &self.method)
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// The EAGLE head an artifact's draft plan is: its method, its directory (absolute) and the
/// sha256 of its safetensors, which `bbc serve` checks the head it is given against.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EagleHeadFiles {
    pub method: String,
    pub dir: PathBuf,
    pub weights_sha256: String,
}

/// Write the artifact for `graphs` of `model` into `dir`.
pub fn compile(model: &Model, graphs: CompiledGraphs, target: Target, dir: &Path) -> Result<Manifest, ArtifactError> {
    compile_with(model, graphs, target, dir, crate::gpu::PlanKernels::default())
}

/// [`compile`], the GPU plans' steps taking `kernels`.
pub fn compile_with(
    model: &Model,
    graphs: CompiledGraphs,
    target: Target,
    dir: &Path,
    kernels: crate::gpu::PlanKernels,
) -> Result<Manifest, ArtifactError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let CompiledGraphs {
        logits: graph,
        greedy,
        serving,
        mtp,
        eagle,
    } = graphs;
    let serving = serving.filter(|_| target != Target::Cpu);
    let mtp = mtp.filter(|_| serving.is_some());
    let eagle = eagle.filter(|_| mtp.is_some());
    let eagle_head = eagle
        .map(|e| -> Result<EagleHeadFiles, ArtifactError> {
            let dir = std::fs::canonicalize(e.dir).map_err(io(e.dir))?;
            Ok(EagleHeadFiles {
                method: e.method.to_string(),
                weights_sha256: hash_weights(&dir)?,
                dir,
            })
        })
        .transpose()?;
    // The tensors the plans read: the model's, and an EAGLE head's beside them.
    let tensors: &dyn quant::tensor::Tensors = match eagle {
        Some(e) => e.weights,
        None => &model.weights,
    };
    // The weights' hash reads the whole file (gigabytes): on a thread of its own, while the
    // kernels compile.
    let weights = std::fs::canonicalize(&model.spec.weights).map_err(io(&model.spec.weights))?;
    let hashing = {
        let weights = weights.clone();
        std::thread::spawn(move || hash_weights(&weights))
    };
    // A model with random weights has them made where its plans run: each plan carries the
    // fill kernels. Stored weights the device converts: the conversion kernels.
    let loading = Loading {
        fills: model.spec.random_weights.is_some(),
        weights: tensors,
        kernels,
    };
    let (plan, greedy_plan, serving_plan, mtp_plan) = match target {
        Target::Cpu => (None, None, None, None),
        gpu => (
            Some(write_gpu_program(
                graph,
                gpu,
                dir,
                ("kernels", "plan.json"),
                None,
                loading,
            )?),
            greedy
                .map(|g| write_gpu_program(g, gpu, dir, ("kernels/greedy", "greedy_plan.json"), None, loading))
                .transpose()?,
            serving
                .map(|g| {
                    let cache = Some(DEFAULT_SERVING_CACHE);
                    write_gpu_program(g, gpu, dir, ("kernels/serving", "serving_plan.json"), cache, loading)
                })
                .transpose()?,
            mtp.map(|g| {
                let cache = Some(DEFAULT_SERVING_CACHE);
                write_gpu_program(g, gpu, dir, ("kernels/mtp", "mtp_plan.json"), cache, loading)
            })
            .transpose()?,
        ),
    };
    let weights_sha256 = hashing.join().map_err(|_| ArtifactError::Invalid {
        path: weights.clone(),
        what: "hashing the weights panicked".into(),
    })??;
    let graph_json = serde_json::to_string(graph).expect("graphs serialise");
    let greedy_json = greedy.map(|g| serde_json::to_string(g).expect("graphs serialise"));
    let serving_json = serving.map(|g| serde_json::to_string(g).expect("graphs serialise"));
    let mtp_json = mtp.map(|g| serde_json::to_string(g).expect("graphs serialise"));
    // The INT8 rows of every head a greedy `int8_bound_top_k` reads, once each.
    let mut int8_heads = Vec::new();
    for g in [greedy, mtp].into_iter().flatten() {
        for head in crate::derived::write_int8_heads(g, &model.weights, dir)? {
            if !int8_heads
                .iter()
                .any(|h: &crate::derived::DerivedWeight| h.weight == head.weight)
            {
                int8_heads.push(head);
            }
        }
    }
    let mut manifest = Manifest {
        format_version: FORMAT_VERSION,
        bbc_version: env!("CARGO_PKG_VERSION").to_string(),
        target,
        family: model.config.family,
        dtype: model.spec.dtype,
        weights,
        weights_sha256,
        random_weights: model.spec.random_weights,
        quantization: model.spec.quantization.clone(),
        tokenizer: model.spec.tokenizer.clone(),
        context_length: model.config.context_length,
        graph_text: GRAPH_TEXT.into(),
        graph_json: GRAPH_JSON.into(),
        greedy_graph_json: greedy.map(|_| GREEDY_GRAPH_JSON.into()),
        plan,
        greedy_plan,
        serving_graph_json: serving.map(|_| SERVING_GRAPH_JSON.into()),
        serving_plan,
        prefill_gemm: target.cuda_arch().is_some().then_some(kernels.prefill_gemm),
        prefill_attention: target.cuda_arch().is_some().then_some(kernels.prefill_attention),
        decode_attention: target.cuda_arch().is_some().then_some(kernels.decode_attention),
        prefill_delta_rule: target.cuda_arch().is_some().then_some(kernels.prefill_delta_rule),
        prefill_experts: target.cuda_arch().is_some().then_some(kernels.prefill_experts),
        mtp_graph_json: mtp.map(|_| MTP_GRAPH_JSON.into()),
        mtp_plan,
        eagle_head,
        int8_heads,
        hash: String::new(),
    };
    manifest.hash = identity(
        &manifest,
        &graph_json,
        &[greedy_json.as_deref(), serving_json.as_deref(), mtp_json.as_deref()],
    );
    write(dir, GRAPH_TEXT, graph.to_text().as_bytes())?;
    write(dir, GRAPH_JSON, graph_json.as_bytes())?;
    if let (Some(g), Some(json)) = (greedy, &greedy_json) {
        write(dir, GREEDY_GRAPH_TEXT, g.to_text().as_bytes())?;
        write(dir, GREEDY_GRAPH_JSON, json.as_bytes())?;
    }
    if let (Some(g), Some(json)) = (serving, &serving_json) {
        write(dir, SERVING_GRAPH_TEXT, g.to_text().as_bytes())?;
        write(dir, SERVING_GRAPH_JSON, json.as_bytes())?;
    }
    if let (Some(g), Some(json)) = (mtp, &mtp_json) {
        write(dir, MTP_GRAPH_TEXT, g.to_text().as_bytes())?;
        write(dir, MTP_GRAPH_JSON, json.as_bytes())?;
    }
    write(
        dir,
        MANIFEST_FILE,
        serde_json::to_string_pretty(&manifest)
            .expect("manifests serialise")
            .as_bytes(),
    )?;
    Ok(manifest)
}

/// What a GPU plan is built with beside its graph: whether it makes random weights on the
/// device, the weights whose stored forms it may convert there, the kernels it takes where it
/// has a choice.
#[derive(Clone, Copy)]
struct Loading<'a> {
    fills: bool,
    weights: &'a dyn quant::tensor::Tensors,
    kernels: crate::gpu::PlanKernels,
}

/// Rows a step of a GPU plan takes, which its activation buffers are sized for: the serving
/// engine's default token budget on a GPU (vLLM's is 2048 to 8192), so a long prompt prefills
/// in a few large chunks.
pub const GPU_MAX_TOKENS: usize = 2048;

/// `kernels/*.cu`, `kernels/*.ptx` and `kernels/*.cubin` (NVRTC; no spills allowed on the real
/// architecture: see [`crate::spill_free`]) and the plan (`plan_file`); returns the plan's
/// file name. Each plan's kernels go to their own directory: names are unique within a plan,
/// not across plans. With `loading.fills`, the plan also carries the fill kernels that make
/// random weights on the device (`kernels_gen::templates::fill`); and it carries the kernels
/// that convert the stored forms of `loading.weights` it converts on the device
/// ([`crate::gpu::weight_conversions`]).
fn write_gpu_program(
    graph: &Graph,
    target: Target,
    dir: &Path,
    (kernel_dir, plan_file): (&str, &str),
    batched: Option<crate::gpu::BatchedCache>,
    loading: Loading,
) -> Result<String, ArtifactError> {
    let name = target.name();
    let built = crate::gpu::build_program(graph, target, GPU_MAX_TOKENS, batched, loading.kernels);
    let (mut plan, _) = built.map_err(|source| ArtifactError::Gpu { target: name, source })?;
    let weights = loading.weights;
    if loading.fills {
        let kernels = kernels_gen::templates::fill::fill_kernels();
        plan.kernels.extend(kernels.iter().map(crate::gpu::kernel_entry));
    }
    let conversions = crate::gpu::weight_conversions(&plan, weights);
    plan.kernels.extend(conversions.iter().map(crate::gpu::kernel_entry));
    let kernels = dir.join(kernel_dir);
    std::fs::create_dir_all(&kernels).map_err(io(&kernels))?;
    for k in &mut plan.kernels {
        // Written first, so that a kernel NVRTC refuses can be read where the error points.
        let cu = format!("{}.cu", k.name);
        write(&kernels, &cu, k.source.as_bytes())?;
        let invalid = |what: String| ArtifactError::Invalid {
            path: kernels.join(&cu),
            what,
        };
        let built = crate::spill_free::build(&k.name, &k.source, k.block, &plan.arch)
            .map_err(|source| ArtifactError::Nvrtc { target: name, source })?;
        // The spill check rests on ptxas's report: an artifact is not built without one.
        let Some(resources) = &built.resources else {
            return Err(invalid(format!("ptxas gave no resource report on {}", plan.arch)));
        };
        if built.spills() {
            return Err(invalid(format!(
                "spills registers on {} at every occupancy ptxas was asked for: {resources:?}",
                plan.arch
            )));
        }
        let registers = resources.registers;
        if built.source != k.source {
            // Built asking ptxas for an occupancy: the artifact keeps the source it built.
            k.source = built.source;
            write(&kernels, &cu, k.source.as_bytes())?;
        }
        write(&kernels, &format!("{}.ptx", k.name), built.ptx.as_bytes())?;
        write(&kernels, &format!("{}.cubin", k.name), &built.cubin)?;
        k.ptx = Some(format!("{kernel_dir}/{}.ptx", k.name));
        k.cubin = Some(format!("{kernel_dir}/{}.cubin", k.name));
        k.registers = Some(registers);
    }
    write(
        dir,
        plan_file,
        serde_json::to_string_pretty(&plan).expect("plans serialise").as_bytes(),
    )?;
    Ok(plan_file.into())
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), ArtifactError> {
    let path = dir.join(name);
    std::fs::write(&path, bytes).map_err(io(&path))
}

/// The hash over the manifest's fields, the logits graph and the other graphs present.
fn identity(manifest: &Manifest, graph_json: &str, others: &[Option<&str>]) -> String {
    let mut h = Sha256::new();
    let fields = serde_json::to_string(&Manifest {
        hash: String::new(),
        ..manifest.clone()
    })
    .expect("manifests serialise");
    h.update(fields.as_bytes());
    h.update(graph_json.as_bytes());
    for other in others.iter().flatten() {
        h.update(other.as_bytes());
    }
    hex(&h.finalize())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// sha256 of the weights file, or of a directory's `*.safetensors` files in name order.
pub fn hash_weights(path: &Path) -> Result<String, ArtifactError> {
    let mut files = vec![];
    if path.is_dir() {
        for entry in std::fs::read_dir(path).map_err(io(path))? {
            let p = entry.map_err(io(path))?.path();
            if p.extension().is_some_and(|e| e == "safetensors") {
                files.push(p);
            }
        }
        files.sort();
    } else {
        files.push(path.to_path_buf());
    }
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for f in files {
        let mut file = std::fs::File::open(&f).map_err(io(&f))?;
        loop {
            let n = file.read(&mut buf).map_err(io(&f))?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
    }
    Ok(hex(&h.finalize()))
}

/// Read and check an artifact's manifest.
pub fn read_manifest(dir: &Path) -> Result<Manifest, ArtifactError> {
    let path = dir.join(MANIFEST_FILE);
    let text = std::fs::read_to_string(&path).map_err(io(&path))?;
    let manifest: Manifest = serde_json::from_str(&text).map_err(|e| ArtifactError::Invalid {
        path: path.clone(),
        what: format!("not a bbc manifest: {e}"),
    })?;
    if manifest.format_version != FORMAT_VERSION {
        return Err(ArtifactError::Invalid {
            path,
            what: format!(
                "artifact format {} but this bbc reads format {FORMAT_VERSION}; recompile it",
                manifest.format_version
            ),
        });
    }
    Ok(manifest)
}

/// The graphs an artifact holds: the logits graph and, when compiled, the greedy one.
pub struct ArtifactGraphs {
    pub logits: Graph,
    pub greedy: Option<Graph>,
    /// GPU targets: the graph of the batched serving plan.
    pub serving: Option<Graph>,
    /// GPU targets: the graph of the multi-token prediction head's plan.
    pub mtp: Option<Graph>,
}

/// Read the graphs an artifact holds, checking them against the manifest hash and the IR's rules.
pub fn read_graphs(dir: &Path, manifest: &Manifest) -> Result<ArtifactGraphs, ArtifactError> {
    let read = |name: &str| -> Result<String, ArtifactError> {
        let path = dir.join(name);
        std::fs::read_to_string(&path).map_err(io(&path))
    };
    let logits_text = read(&manifest.graph_json)?;
    let greedy_text = manifest.greedy_graph_json.as_deref().map(read).transpose()?;
    let serving_text = manifest.serving_graph_json.as_deref().map(read).transpose()?;
    let mtp_text = manifest.mtp_graph_json.as_deref().map(read).transpose()?;
    if identity(
        manifest,
        &logits_text,
        &[greedy_text.as_deref(), serving_text.as_deref(), mtp_text.as_deref()],
    ) != manifest.hash
    {
        return Err(ArtifactError::Invalid {
            path: dir.to_path_buf(),
            what: "the graphs or manifest were changed after compilation (hash mismatch); recompile".into(),
        });
    }
    let parse = |text: &str, name: &str| -> Result<Graph, ArtifactError> {
        let path = dir.join(name);
        let graph: Graph = serde_json::from_str(text).map_err(|e| ArtifactError::Invalid {
            path: path.clone(),
            what: format!("not a graph: {e}"),
        })?;
        graph.validate().map_err(|e| ArtifactError::Invalid {
            path,
            what: e.to_string(),
        })?;
        Ok(graph)
    };
    Ok(ArtifactGraphs {
        logits: parse(&logits_text, &manifest.graph_json)?,
        greedy: match (&greedy_text, &manifest.greedy_graph_json) {
            (Some(text), Some(name)) => Some(parse(text, name)?),
            _ => None,
        },
        serving: match (&serving_text, &manifest.serving_graph_json) {
            (Some(text), Some(name)) => Some(parse(text, name)?),
            _ => None,
        },
        mtp: match (&mtp_text, &manifest.mtp_graph_json) {
            (Some(text), Some(name)) => Some(parse(text, name)?),
            _ => None,
        },
    })
}
