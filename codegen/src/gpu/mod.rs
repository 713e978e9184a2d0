//! Code generation for GPU targets: a kernel per graph node from the templates (fused ops map
//! one to one), launches in graph order with their arguments, a memory plan for activations
//! (`plan`), the KV cache layout, constants (RoPE frequencies) and the weight transforms the
//! kernels expect. Written into the artifact as `kernels/*.cu`, `kernels/*.ptx` and `plan.json`.
//!
//! Covered: the ops of the fused Llama and Gemma 3 graphs with f32/bf16 weights or GGUF blocks
//! (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K, kept quantized), decode and prefill alike
//! (`tokens` is a launch-time scalar), with the INT8-bound head and a tensor-core GEMM for
//! prefill; and those of Gemma 4, Qwen3.5, Qwen3-Next and GLM-4.5 (Gated DeltaNet layers with
//! a recurrent state per sequence, MoE layers, biases, weightless norms, regrouped weight
//! rows). GLM-5's latent attention is refused by name. A plan runs one sequence over a
//! contiguous cache, or (`build_batched`) rows of many sequences over one paged KV pool.

mod select;

// The plan's types are the contract with the runtime, in a crate of their own.
pub use gpu_plan::memory as plan;
pub use gpu_plan::{
    expr, per_sequence_nodes, BatchedCache, GpuPlan, KernelEntry, KernelParam, KvLayout, Launch, LaunchArg,
    StateLayout, Transposed, WeightPart, WeightUse, BATCH_ROWS, FEW_ROWS, PREFILL_TOKENS,
};

use crate::target::Target;
use ir::{Dim, Graph, Sym};
use kernels_gen::dsl::Kernel;
use kernels_gen::templates::quant::WeightFormat;
use plan::MemoryPlan;
use std::collections::{BTreeMap, BTreeSet};

#[derive(Debug, thiserror::Error)]
pub enum GpuCodegenError {
    #[error("node %{node} ({op}): {what}")]
    Unsupported {
        node: usize,
        op: &'static str,
        what: String,
    },
}

/// Where a value lives: a base node's buffer, a column offset, a row stride and a row offset.
#[derive(Debug, Clone)]
pub(crate) struct View {
    pub base: usize,
    pub col: usize,
    pub stride: usize,
    /// Rows skipped (an expression of `tokens`), for `last_token`.
    pub row: Option<String>,
}

impl View {
    pub fn offset(&self) -> String {
        match &self.row {
            Some(r) => format!("({r})*{}+{}", self.stride, self.col),
            None => self.col.to_string(),
        }
    }
}

pub(crate) fn width(graph: &Graph, node: usize) -> usize {
    graph.nodes()[node].shape.last().and_then(Dim::as_const).unwrap_or(1)
}

/// Rows of a value: the step's tokens, or a constant.
pub(crate) fn rows(graph: &Graph, node: usize) -> String {
    match graph.nodes()[node].shape.0.first() {
        Some(Dim::Sym(Sym::Tokens)) => "tokens".into(),
        Some(Dim::Const(n)) if graph.nodes()[node].shape.rank() == 2 => n.to_string(),
        _ => "tokens".into(),
    }
}

/// Build the GPU program of `graph` for `target`, activations sized for `max_tokens` rows.
pub fn build(graph: &Graph, target: Target, max_tokens: usize) -> Result<GpuPlan, GpuCodegenError> {
    build_with_kernels(graph, target, max_tokens).map(|(plan, _)| plan)
}

/// Like [`build`], also returning the plan's kernels as DSL programs (named as in the plan), for
/// running the plan on the emulator.
pub fn build_with_kernels(
    graph: &Graph,
    target: Target,
    max_tokens: usize,
) -> Result<(GpuPlan, Vec<Kernel>), GpuCodegenError> {
    build_program(graph, target, max_tokens, None, PrefillGemm::default())
}

/// The tensor-core GEMM a plan's bf16 matmuls prefill through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrefillGemm {
    /// The target's TMA-fed GEMM (`templates::tma_prefill_gemm`), both operands through
    /// shared memory, after a launch making the rows bf16 (`templates::bf16_rows`).
    #[default]
    Tma,
    /// The TMA-fed GEMM, warp-specialised where the target has such a form (Hopper: a
    /// producer warp refilling the ring as the consumer warpgroups release it; the B200: a
    /// producer warp, an MMA warp and epilogue warps); the RTX PRO 6000's as `Tma`.
    Specialised,
    /// The warp-specialised TMA-fed GEMM in a persistent schedule where the target has one
    /// (Hopper and the B200: as many blocks as multiprocessors, each taking tiles in turn
    /// through one ring, a tile's copies going out while the one before stores its results,
    /// on the B200 from a second accumulator in tensor memory); the RTX PRO 6000's as `Tma`.
    Persistent,
    /// The GEMM with the prologue inside, its weights through a `cp.async` pipeline
    /// (`templates::prefill_gemm`: `wgmma` with activations in registers on Hopper,
    /// `tcgen05` on the B200, `mma.sync` on the RTX PRO 6000): what plans took before, kept
    /// to time beside it.
    Pipelined,
}

impl PrefillGemm {
    /// Whether it is one of the TMA-fed GEMM's forms (not `Pipelined`).
    pub fn is_tma(self) -> bool {
        matches!(self, Self::Tma | Self::Specialised | Self::Persistent)
    }
}

/// The tensor-core attention a plan's prompts attend with (steps whose sequences average 16
/// rows or more; see `select::kv_attention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrefillAttention {
    /// `templates::flash_attention`: FlashAttention-2's schedule on `mma.sync`, every target.
    #[default]
    Mma,
    /// `templates::flash_attention_wgmma`: FlashAttention-3's schedule on Hopper, for heads up
    /// to 128 dims (the others, and other targets, as `Mma`), every thread copying the tiles.
    Wgmma,
    /// The same with warp specialisation: a producer warp copies the tiles for the two
    /// consumer warpgroups through mbarriers.
    #[serde(rename = "wgmma-specialised")]
    WgmmaSpecialised,
    /// The same with the tiles loaded by TMA (FlashAttention-3's loads), for heads of 64 or
    /// 128 dims (the others as `WgmmaSpecialised`); a batched plan's KV blocks then hold a
    /// multiple of 16 positions.
    #[serde(rename = "wgmma-tma")]
    WgmmaTma,
    /// `templates::flash_attention_tcgen05`: both products on the B200's `tcgen05` into
    /// tensor memory, for heads up to 128 dims (the others, and other targets, as `Mma`).
    Tcgen05,
    /// The same with the tiles loaded by TMA, for heads of 64 or 128 dims (the others as
    /// `Tcgen05`); a batched plan's KV blocks then hold a multiple of 16 positions.
    #[serde(rename = "tcgen05-tma")]
    Tcgen05Tma,
}

/// The flash kernel a plan's prompts attend on, on its target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlashForm {
    /// `templates::flash_attention`, on `mma.sync`.
    Mma,
    /// `templates::flash_attention_wgmma`, in this schedule.
    Wgmma(kernels_gen::templates::flash_attention_wgmma::Schedule),
    /// `templates::flash_attention_tcgen05`, its tiles loaded so.
    Tcgen05(kernels_gen::templates::flash_attention_tcgen05::Loads),
}

impl PrefillAttention {
    /// The flash kernel this choice takes on `target`: each tensor-core form on the
    /// architecture that has it, `mma.sync` elsewhere.
    pub fn flash_form(self, target: Target) -> FlashForm {
        use kernels_gen::templates::flash_attention_tcgen05::Loads;
        use kernels_gen::templates::flash_attention_wgmma::Schedule;
        match (self, target.cuda_arch()) {
            (PrefillAttention::Wgmma, Some("sm_90a")) => FlashForm::Wgmma(Schedule::Lockstep),
            (PrefillAttention::WgmmaSpecialised, Some("sm_90a")) => FlashForm::Wgmma(Schedule::Specialised),
            (PrefillAttention::WgmmaTma, Some("sm_90a")) => FlashForm::Wgmma(Schedule::Tma),
            (PrefillAttention::Tcgen05, Some("sm_100a")) => FlashForm::Tcgen05(Loads::Copies),
            (PrefillAttention::Tcgen05Tma, Some("sm_100a")) => FlashForm::Tcgen05(Loads::Tma),
            _ => FlashForm::Mma,
        }
    }
}

/// The split pass a plan's other steps attend with (decode rows, drafts being verified: steps
/// whose sequences average under 16 rows, and every step where no tensor-core attention
/// applies; see `select::kv_attention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DecodeAttention {
    /// `templates::attention::attention_split`: a warp takes one key at a time, each lane an
    /// element of its rows.
    #[default]
    Scalar,
    /// `templates::attention_vector`: each lane loads 16 bytes of a row, a warp several keys
    /// at once, for heads that are a power of two of 16-byte loads (the others as `Scalar`).
    Vector,
}

/// How a plan's prompts go through a Gated DeltaNet layer's delta rule (steps whose sequences
/// average 16 rows or more; the others walk their rows, see `select::delta_net`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrefillDeltaRule {
    /// `templates::delta_chunks`: in chunks of 64 rows, what depends on a chunk's rows alone
    /// computed for every chunk at once, for key heads a multiple of 8 up to 128 wide and
    /// value heads a multiple of 4 up to 128 (others as `Recurrent`).
    #[default]
    Chunked,
    /// `templates::delta_net::delta_rule`: a row after another, as decode steps.
    Recurrent,
}

/// How a plan's prompts (steps of 16 rows or more) run MoE layers' experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PrefillExperts {
    /// Each expert's rows gathered into tiles and multiplied on the target's tensor cores:
    /// bf16 and half experts on Hopper's `wgmma` (`templates::moe_wgmma`) and the B200's
    /// `tcgen05` (`templates::moe_tcgen05`), others and elsewhere on `mma.sync`
    /// (`templates::moe_mma`: bf16, f16 and GGUF-block experts; half ones multiplied as
    /// halves), over hidden sizes and expert widths that are multiples of 8 (others as
    /// `CudaCores`).
    #[default]
    TensorCores,
    /// As `TensorCores`, on `mma.sync` on every target (what the `wgmma` and `tcgen05`
    /// kernels are timed against).
    Mma,
    /// `templates::moe`'s expert-by-expert kernels: a warp dots a row with an output's weights
    /// in f32, each expert's weights read once a step.
    CudaCores,
}

/// The kernels a plan's steps take where it has a choice: its prefill steps' tensor-core GEMM,
/// attention, delta rule and experts, and its other steps' split attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PlanKernels {
    pub prefill_gemm: PrefillGemm,
    pub prefill_attention: PrefillAttention,
    pub decode_attention: DecodeAttention,
    pub prefill_delta_rule: PrefillDeltaRule,
    pub prefill_experts: PrefillExperts,
}

impl From<PrefillGemm> for PlanKernels {
    fn from(prefill_gemm: PrefillGemm) -> Self {
        Self {
            prefill_gemm,
            ..Self::default()
        }
    }
}

/// The plan of a batched step (continuous batching: rows of many sequences over one paged KV
/// cache), and its kernels. With `LogitsFor::LastToken` (what `bbc compile` writes), the
/// graph's `last_token` gathers the rows sampled from (step input `sampled_rows`: each
/// sequence's last, or its last `drafts + 1`) and what follows runs on those (`sampled`, see
/// [`per_sequence_nodes`]); with `LogitsFor::AllTokens` every row gets logits.
pub fn build_batched(
    graph: &Graph,
    target: Target,
    max_tokens: usize,
    cache: BatchedCache,
) -> Result<(GpuPlan, Vec<Kernel>), GpuCodegenError> {
    build_program(graph, target, max_tokens, Some(cache), PrefillGemm::default())
}

/// [`build_with_kernels`] or (with `batched`) [`build_batched`], steps taking `kernels`
/// (a [`PrefillGemm`] alone: with the default attention).
pub fn build_program(
    graph: &Graph,
    target: Target,
    max_tokens: usize,
    batched: Option<BatchedCache>,
    kernels: impl Into<PlanKernels>,
) -> Result<(GpuPlan, Vec<Kernel>), GpuCodegenError> {
    let chosen = kernels.into();
    let layout = match batched {
        Some(_) => kernels_gen::templates::cache_layout::CacheLayout::Batched,
        None => kernels_gen::templates::cache_layout::CacheLayout::Contiguous,
    };
    let per_sequence = match batched {
        Some(_) => per_sequence_nodes(graph),
        None => BTreeSet::new(),
    };
    let selected = select::select(graph, layout, target, &per_sequence, max_tokens, chosen)?;
    // One file per distinct kernel source, named by its template and its source (so that a
    // kernel is named alike in every plan and model, and compiles once for all of them).
    let mut kernels: Vec<(Kernel, String)> = Vec::new();
    let mut launches = Vec::new();
    let mut intern = |kernel: Kernel| -> String {
        let source = kernels_gen::cuda::emit(&Kernel {
            name: String::new(),
            ..kernel.clone()
        });
        match kernels.iter().find(|(_, s)| *s == source) {
            Some((k, _)) => k.name.clone(),
            None => {
                let mut name = format!("{}_{}", kernel.name, source_digest(&source));
                if kernels.iter().any(|(k, _)| k.name == name) {
                    // Another source with the same digest: told apart by its place in the plan.
                    name = format!("{name}_{}", kernels.len());
                }
                kernels.push((
                    Kernel {
                        name: name.clone(),
                        ..kernel
                    },
                    source,
                ));
                name
            }
        }
    };
    for (node, kernel, alternatives, args) in selected.launches {
        let kernel = intern(kernel);
        let prefill_kernel = alternatives.prefill.map(&mut intern);
        let few_rows_kernel = alternatives.few_rows.map(&mut intern);
        let batch_kernel = alternatives.batch.map(&mut intern);
        launches.push(Launch {
            kernel,
            prefill_kernel,
            few_rows_kernel,
            batch_kernel,
            node,
            args,
        });
    }
    let memory = plan_memory(graph, &launches, &selected.views, max_tokens, &per_sequence);
    // A weight stacked into a joined one (Q/K/V, gate/up) is read through the stack alone:
    // keeping it as well would put it on the device twice.
    let read = weights_read(&launches);
    let weights: Vec<WeightUse> = selected
        .weights
        .into_iter()
        .filter(|w| read.contains(&w.node))
        .collect();
    check_index_range(graph, &weights, &launches, &memory)?;
    let programs: Vec<Kernel> = kernels.iter().map(|(k, _)| k.clone()).collect();
    let kernels = kernels.into_iter().map(|(k, _)| kernel_entry(&k)).collect();
    let plan = GpuPlan {
        target: target.name().into(),
        arch: target.cuda_arch().unwrap_or_default().into(),
        max_tokens,
        kernels,
        launches,
        memory,
        token_ids: selected.token_ids,
        positions: selected.positions,
        hidden_states: selected.hidden_states,
        outputs: graph
            .outputs()
            .iter()
            .map(|(n, id)| (n.clone(), selected.views[&id.0].base))
            .collect(),
        weights,
        kv_cache: selected.kv_cache,
        recurrent_states: selected.recurrent_states,
        constants: selected.constants,
        position_scores: selected.position_scores,
        batched,
        block_multiple: selected.block_multiple,
    };
    Ok((plan, programs))
}

/// The first 8 hex digits of the SHA-256 of a kernel's source (emitted without its name).
fn source_digest(source: &str) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(source.as_bytes())[..4]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A plan's entry for `k`: its source (compiled later, into the artifact), block, grid and
/// launch parameters.
pub fn kernel_entry(k: &Kernel) -> KernelEntry {
    KernelEntry {
        shared_bytes: match k.shared_layout() {
            layout if layout.dynamic => layout.bytes as u32,
            _ => 0,
        },
        name: k.name.clone(),
        block: k.block_dim,
        grid: kernels_gen::cuda::grid_expr(k),
        source: kernels_gen::cuda::emit(k),
        ptx: None,
        cubin: None,
        registers: None,
        params: k
            .launch_params()
            .map(|p| match p {
                kernels_gen::dsl::Param::Buffer { name, .. } => KernelParam {
                    name: name.clone(),
                    kind: "buffer".into(),
                },
                kernels_gen::dsl::Param::Scalar { name, ty } => KernelParam {
                    name: name.clone(),
                    kind: ty.to_string(),
                },
                kernels_gen::dsl::Param::TensorMap(_) => unreachable!("not a launch parameter"),
            })
            .collect(),
        tensor_maps: tensor_map_entries(k),
    }
}

/// `k`'s tensor maps as its plan entry states them. The templates put them after the launch
/// parameters and size them by scalar parameters, which the entry names.
fn tensor_map_entries(k: &Kernel) -> Vec<gpu_plan::TensorMapEntry> {
    use kernels_gen::dsl::{Expr, MmaElement, Param, Swizzle};
    let first_map = k.params.iter().position(|p| matches!(p, Param::TensorMap(_)));
    let maps = &k.params[first_map.unwrap_or(k.params.len())..];
    let scalar = |e: &Expr| match e {
        Expr::Var(name) => name.clone(),
        other => panic!("{}: a tensor map sized by {other:?}, not a scalar parameter", k.name),
    };
    maps.iter()
        .map(|p| match p {
            Param::TensorMap(map) => gpu_plan::TensorMapEntry {
                name: map.name.clone(),
                buffer: map.buffer.clone(),
                rows: scalar(&map.rows),
                cols: scalar(&map.cols),
                stride: scalar(&map.stride),
                box_rows: map.box_rows,
                box_cols: map.box_cols,
                swizzle_128b: map.swizzle == Swizzle::B128,
                element: match k.param(&map.buffer) {
                    Some(Param::Buffer { ty, .. }) => MmaElement::of(*ty),
                    _ => None,
                }
                .unwrap_or_else(|| panic!("{}: tensor map `{}` over no 16-bit buffer", k.name, map.name))
                .ptx()
                .to_string(),
            },
            _ => panic!("{}: a launch parameter after a tensor map", k.name),
        })
        .collect()
}

/// The kernels that make `plan`'s weights on the device from their stored form in `weights`
/// (`kernels_gen::templates::weight_convert`): one per stored format a weight converts from,
/// and dtype it converts to, once each. A part the host makes anyway (transposed row groups)
/// needs none.
pub fn weight_conversions(plan: &GpuPlan, weights: &dyn quant::tensor::Tensors) -> Vec<Kernel> {
    use kernels_gen::templates::weight_convert::{convert_kernel, converts};
    let mut pairs = Vec::new();
    for w in &plan.weights {
        for part in &w.parts {
            let Some(tensor) = weights.tensor(part.name()) else {
                continue;
            };
            let stored = quant::tensor::ir_dtype(tensor.dtype);
            let transposed = matches!(part, WeightPart::TransposedRowGroups { .. });
            if stored != w.dtype && converts(stored) && !transposed && !pairs.contains(&(stored, w.dtype)) {
                pairs.push((stored, w.dtype));
            }
        }
    }
    pairs
        .into_iter()
        .filter_map(|(stored, to)| convert_kernel(stored, to))
        .collect()
}

/// The weight nodes `launches` read.
pub fn weights_read(launches: &[Launch]) -> BTreeSet<usize> {
    launches
        .iter()
        .flat_map(|l| &l.args)
        .filter_map(|a| match a {
            LaunchArg::Weight { node } => Some(*node),
            _ => None,
        })
        .collect()
}

/// Kernels index with 32-bit integers: elements of dense weights and activations, bytes of
/// block-quantized weights. A buffer past `i32::MAX` of them would be read at wrapped
/// indices, so the plan is refused instead, but for a dense table only embedding lookups
/// read: they index its rows in 64 bits (Gemma 4 E2B's per-layer embeddings hold 2.3 G).
fn check_index_range(
    graph: &Graph,
    weights: &[WeightUse],
    launches: &[Launch],
    memory: &MemoryPlan,
) -> Result<(), GpuCodegenError> {
    let only_looked_up = |w: &WeightUse| {
        matches!(WeightFormat::of(w.dtype), Some(WeightFormat::Dense(_)))
            && launches
                .iter()
                .filter(|l| l.args.contains(&LaunchArg::Weight { node: w.node }))
                .all(|l| graph.nodes()[l.node].op == ir::Op::Embedding)
    };
    for w in weights {
        let elements: usize = w.shape.iter().product();
        let units = WeightFormat::of(w.dtype).map_or(elements, |format| format.buffer_len(elements));
        if units > i32::MAX as usize && !only_looked_up(w) {
            return Err(GpuCodegenError::Unsupported {
                node: w.node,
                op: "weight",
                what: format!(
                    "{} ({units} indexable units) is past the 32-bit indices kernels use",
                    w.parts.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(" + ")
                ),
            });
        }
    }
    if memory.arena_bytes / 4 > i32::MAX as usize {
        return Err(GpuCodegenError::Unsupported {
            node: 0,
            op: "arena",
            what: format!("{} bytes of activations is past 32-bit indices", memory.arena_bytes),
        });
    }
    Ok(())
}

/// Every base activation node: its size at `max_tokens` rows and the launches that touch it.
fn plan_memory(
    graph: &Graph,
    launches: &[Launch],
    views: &BTreeMap<usize, View>,
    max_tokens: usize,
    per_sequence: &BTreeSet<usize>,
) -> MemoryPlan {
    // Keyed by (node, scratch name): the node's value, or one of its launches' scratch buffers.
    type Key = (usize, Option<String>);
    fn touch(live: &mut BTreeMap<Key, (usize, usize, usize)>, key: Key, bytes: usize, at: usize) {
        let e = live.entry(key).or_insert((at, at, bytes));
        e.0 = e.0.min(at);
        e.1 = e.1.max(at);
    }
    let value_bytes = |node: usize| {
        let rows = match graph.nodes()[node].shape.0.first() {
            // A batched step has at most as many sequences as rows.
            _ if per_sequence.contains(&node) => max_tokens,
            Some(Dim::Const(n)) if graph.nodes()[node].shape.rank() == 2 => *n,
            _ => max_tokens,
        };
        rows * width(graph, node) * 4
    };
    let mut live: BTreeMap<Key, (usize, usize, usize)> = BTreeMap::new();
    for (i, l) in launches.iter().enumerate() {
        let base = views[&l.node].base;
        touch(&mut live, (base, None), value_bytes(base), i);
        for a in &l.args {
            match a {
                LaunchArg::Activation { node, .. } => touch(&mut live, (*node, None), value_bytes(*node), i),
                LaunchArg::Scratch { node, name, bytes } => touch(&mut live, (*node, Some(name.clone())), *bytes, i),
                _ => {}
            }
        }
    }
    // Values no launch produces (the step's inputs) are written before the first launch.
    let produced: std::collections::BTreeSet<usize> = launches.iter().map(|l| views[&l.node].base).collect();
    for ((node, scratch), range) in live.iter_mut() {
        if scratch.is_none() && !produced.contains(node) {
            range.0 = 0;
        }
    }
    // Outputs are read after the last launch.
    for (_, id) in graph.outputs() {
        let base = views[&id.0].base;
        touch(&mut live, (base, None), value_bytes(base), launches.len());
    }
    let mut requests: Vec<plan::Request> = live
        .into_iter()
        .map(|((node, scratch), (first, last, bytes))| plan::Request {
            node,
            scratch,
            bytes,
            first,
            last,
        })
        .collect();
    requests.sort_by(|a, b| (a.first, a.node, &a.scratch).cmp(&(b.first, b.node, &b.scratch)));
    plan::place(&requests)
}

#[cfg(test)]
mod tests {
    use super::{Transposed, WeightPart};

    /// A plan written before parts could regroup rows names its parts as strings: it still
    /// reads, and regrouped parts (transposed or not) round-trip.
    #[test]
    fn weight_parts_read_plain_names_and_round_trip_row_groups_transposed_or_not() {
        let parts: Vec<WeightPart> = serde_json::from_str(r#"["a.weight", "b.weight"]"#).unwrap();
        assert_eq!(
            parts,
            [
                WeightPart::Whole("a.weight".into()),
                WeightPart::Whole("b.weight".into())
            ]
        );
        let regrouped = WeightPart::RowGroups {
            name: "qkvz".into(),
            group: 6,
            start: 2,
            len: 3,
        };
        let json = serde_json::to_string(&regrouped).unwrap();
        assert_eq!(serde_json::from_str::<WeightPart>(&json).unwrap(), regrouped);
        assert_eq!(regrouped.rows(12), [2..5, 8..11]);
        assert_eq!(regrouped.transposed_elements(12, 2), None);
        let transposed = WeightPart::TransposedRowGroups {
            name: "kv_b".into(),
            group: 3,
            start: 1,
            len: 2,
            transposed: Transposed::YES,
        };
        let json = serde_json::to_string(&transposed).unwrap();
        assert_eq!(serde_json::from_str::<WeightPart>(&json).unwrap(), transposed);
        // Rows 1, 2 and 4, 5 of 6 rows of 2, each pair's [2, 2] block transposed.
        assert_eq!(
            transposed.transposed_elements(6, 2),
            Some(vec![2, 4, 3, 5, 8, 10, 9, 11])
        );
        let not_transposed: WeightPart =
            serde_json::from_str(r#"{"name": "kv_b", "group": 3, "start": 1, "len": 2, "transposed": false}"#).unwrap();
        assert_eq!(not_transposed.transposed_elements(6, 2), None);
        let every_row = 0..4;
        assert_eq!(parts[0].rows(4), vec![every_row]);
    }
}
