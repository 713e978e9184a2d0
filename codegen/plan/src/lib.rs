//! The GPU plan a compiled artifact carries (`plan.json`, `serving_plan.json`): the kernels,
//! launches in graph order with their arguments, the weights they read and how they are
//! stacked, the KV cache and recurrent-state layouts, constants, the memory plan of the
//! activations (`memory`) and the expressions launches evaluate at run time (`expr`).
//! `codegen` writes it; the runtime reads and executes it, knowing nothing of the compiler.

pub mod expr;
pub mod memory;

use ir::{Dim, Graph};
use memory::MemoryPlan;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// An argument of a launch, resolved at run time from the plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LaunchArg {
    /// An activation: the arena range of `node`, plus an element offset (an expression of
    /// `tokens`, for views into it).
    Activation {
        node: usize,
        offset: String,
    },
    /// A weight (after its transform).
    Weight {
        node: usize,
    },
    /// A weight a kernel only prefetches into L2 for a later launch that reads it
    /// (`templates::weight_prefetch`): not read here, so not counted as read.
    WeightPrefetch {
        node: usize,
    },
    /// Layer `slot`'s key or value cache.
    KvCache {
        slot: usize,
        value: bool,
    },
    /// Recurrent state `slot`'s buffer (see [`StateLayout`]).
    RecurrentState {
        slot: usize,
    },
    /// Recurrent state `slot`'s checkpoints: places laid out as its slots, where a batched
    /// step keeps the states after the rows `row_checkpoint` marks (those a verifying step
    /// may rewind to), as many as the runtime allocates for the drafts it verifies.
    StateCheckpoints {
        slot: usize,
    },
    Constant {
        name: String,
    },
    /// Working memory of one op's launches (`bytes` long), planned like an activation.
    Scratch {
        node: usize,
        name: String,
        bytes: usize,
    },
    /// An f32 per (step row, cached position) that launches ranking positions share (the
    /// sparse indexer's scores): `max_tokens` rows of `context` (a scalar: the context the
    /// runtime holds), allocated at load.
    PositionScores,
    /// A tensor derived from weight `weight` at compile time (`weights/<weight>.int8.safetensors`).
    Derived {
        weight: String,
        tensor: String,
    },
    /// A scalar: an expression of `tokens` (rows this step), `first` (cached positions),
    /// `context` (the positions a sequence may hold) and, in a batched plan, `block_size`.
    Scalar {
        name: String,
        value: String,
    },
    /// A batched plan's per-step input (`block_tables`, `row_table`, `row_pos`: see
    /// `kernels_gen::templates::cache_layout`; `last_rows`: each sequence's last row;
    /// `sampled_rows`: the rows sampled from, each sequence's last `drafts + 1`; `row_seq`:
    /// each row's sequence; `state_slots`: each sequence's recurrent state slot;
    /// `row_checkpoint`: each row's place in the state checkpoints, or −1), written by the
    /// runtime before each step.
    StepInput {
        name: String,
    },
}

/// A batched plan's KV cache: one pool of `blocks` blocks of `block_size` positions per layer,
/// shared by every sequence through block tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchedCache {
    pub blocks: usize,
    pub block_size: usize,
    /// The most sequences running at once (the scheduler's `max_running`): of a model with
    /// recurrent layers, each holds one state slot of every such layer for as long as it runs.
    #[serde(default)]
    pub sequences: usize,
}

/// A recurrent layer's state (Gated DeltaNet): `len` f32 values per sequence, in a buffer of a
/// slot per sequence (one for a one-sequence plan, [`BatchedCache::sequences`] for a batched
/// one), zeroed when the plan is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateLayout {
    pub slot: usize,
    pub len: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Launch {
    pub kernel: String,
    /// A kernel with the same arguments for steps of at least [`PREFILL_TOKENS`] tokens (the
    /// tensor-core GEMM in place of a GEMV). Each kernel binds the first of `args`, in order:
    /// a GEMM that splits K takes two more than the GEMV (its partials and split count).
    pub prefill_kernel: Option<String>,
    /// A kernel with the same arguments for steps of [`FEW_ROWS`] to [`PREFILL_TOKENS`] − 1
    /// rows (the GEMV carrying 4 rows per pass over the weights); `kernel` where absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub few_rows_kernel: Option<String>,
    /// A kernel with the same arguments for steps of [`PREFILL_TOKENS`] to [`BATCH_ROWS`] rows
    /// (a tensor-core GEMM whose tiles fit a decode batch); `prefill_kernel` where absent. It
    /// takes the split count the prefill kernel does: at those rows both have one token tile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_kernel: Option<String>,
    pub node: usize,
    pub args: Vec<LaunchArg>,
}

/// From this many tokens a step's matmuls take the tensor-core GEMM: a 16-row tile is full.
pub const PREFILL_TOKENS: usize = 16;

/// From this many rows a step's matmuls take their few-rows kernel, if any.
pub const FEW_ROWS: usize = 2;

/// Up to this many rows (from [`PREFILL_TOKENS`]) a step's matmuls take their batch kernel,
/// if any.
pub const BATCH_ROWS: usize = 64;

/// The derived tensor holding a head's Q4_0 copy (`LaunchArg::Derived`), which a drafter's
/// `shortlist_top_k` scores every vocabulary row with: made from the head where the plan
/// loads.
pub const SHORTLIST_TENSOR: &str = "q4_0";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KernelEntry {
    pub name: String,
    pub block: u32,
    pub grid: String,
    pub source: String,
    pub ptx: Option<String>,
    /// The cubin for the target's architecture, once compiled (loaded before the PTX: it needs
    /// no compiling by the driver, which refuses PTX from a newer NVRTC than itself).
    #[serde(default)]
    pub cubin: Option<String>,
    /// Registers per thread on the target (ptxas), once compiled.
    pub registers: Option<u32>,
    /// The parameters in order: what each launch argument binds to.
    pub params: Vec<KernelParam>,
    /// Bytes of dynamic shared memory each block is launched with (0: static only).
    #[serde(default)]
    pub shared_bytes: u32,
    /// The TMA tensor maps it takes after its launch parameters, in order: derived by the
    /// launcher from the arguments (a TMA GEMM's operands).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tensor_maps: Vec<TensorMapEntry>,
}

/// A 2-D TMA tensor map a kernel takes: over the launch argument `buffer` (of `element`s), its
/// `rows`, `cols` and row `stride` (elements) the launch's scalar arguments of those names,
/// copied in boxes of `box_rows` × `box_cols`, 128-byte swizzled or not.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorMapEntry {
    pub name: String,
    pub buffer: String,
    pub rows: String,
    pub cols: String,
    pub stride: String,
    pub box_rows: u32,
    pub box_cols: u32,
    pub swizzle_128b: bool,
    /// The buffer's elements: `bf16` (where not given) or `f16`.
    #[serde(default = "bf16", skip_serializing_if = "is_bf16")]
    pub element: String,
}

fn bf16() -> String {
    "bf16".into()
}

fn is_bf16(element: &str) -> bool {
    element == "bf16"
}

/// A kernel parameter as the launcher needs it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KernelParam {
    pub name: String,
    /// `buffer` (a device pointer) or the scalar's C type (`int`, `float`).
    pub kind: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightUse {
    pub node: usize,
    /// The source weights stacked by rows (one for a plain weight).
    pub parts: Vec<WeightPart>,
    pub dtype: ir::DType,
    pub shape: Vec<usize>,
}

/// One source weight of a [`WeightUse`]: whole (a plan file names it by its name alone), or
/// rows `start..start + len` of every group of `group` rows (the IR's `row_group_slice`:
/// Qwen3-Next's DeltaNet projections, regrouped at compile time), those rows with each group's
/// block transposed (`transpose_row_groups`: GLM-5's `W_UK` as latent attention reads it).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(untagged)]
pub enum WeightPart {
    Whole(String),
    // Before `RowGroups`: untagged variants are tried in order, and `RowGroups` would take
    // this one's fields too, ignoring `transposed`.
    TransposedRowGroups {
        name: String,
        group: usize,
        start: usize,
        len: usize,
        transposed: Transposed,
    },
    RowGroups {
        name: String,
        group: usize,
        start: usize,
        len: usize,
    },
}

/// The marker that tells a [`WeightPart::TransposedRowGroups`] from a
/// [`WeightPart::RowGroups`] in a plan file (`"transposed": true`; `false` is no such part,
/// so it reads as plain row groups).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Transposed(bool);

impl Transposed {
    pub const YES: Transposed = Transposed(true);
}

impl<'de> Deserialize<'de> for Transposed {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match bool::deserialize(d)? {
            true => Ok(Self::YES),
            false => Err(serde::de::Error::custom("`transposed: false` marks no transposed part")),
        }
    }
}

impl WeightPart {
    /// The source weight's name.
    pub fn name(&self) -> &str {
        match self {
            Self::Whole(name) | Self::RowGroups { name, .. } | Self::TransposedRowGroups { name, .. } => name,
        }
    }

    /// The source rows it takes, of a weight of `rows` rows, in order (before a transposition).
    pub fn rows(&self, rows: usize) -> Vec<std::ops::Range<usize>> {
        match *self {
            Self::Whole(_) => std::iter::once(0..rows).collect(),
            Self::RowGroups { group, start, len, .. } | Self::TransposedRowGroups { group, start, len, .. } => (0
                ..rows / group.max(1))
                .map(|g| g * group + start..g * group + start + len)
                .collect(),
        }
    }

    /// The source elements of a weight of `rows` rows of `cols`, in the order the part holds
    /// them; `None` where that is its rows' order ([`rows`](Self::rows) says which).
    pub fn transposed_elements(&self, rows: usize, cols: usize) -> Option<Vec<usize>> {
        let &Self::TransposedRowGroups { group, start, len, .. } = self else {
            return None;
        };
        Some(ir::reference::ops::transposed_row_groups_order(rows, cols, group, start, len).collect())
    }
}

impl std::fmt::Display for WeightPart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Whole(name) => write!(f, "{name}"),
            Self::RowGroups {
                name,
                group,
                start,
                len,
            } => {
                write!(f, "{name} (rows {start}..{} of every {group})", start + len)
            }
            Self::TransposedRowGroups {
                name,
                group,
                start,
                len,
                ..
            } => {
                write!(f, "{name} (rows {start}..{} of every {group}, transposed)", start + len)
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KvLayout {
    pub slot: usize,
    /// Elements of a cached position's key row.
    pub kv_dim: usize,
    /// Bytes of a cached position's key row, and of its value row unless
    /// `value_bytes_per_token` says otherwise.
    pub bytes_per_token: usize,
    /// Bytes of a cached position's value row where they differ from the key row's (latent
    /// attention: every head's values, wider than the shared keys).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_bytes_per_token: Option<usize>,
}

impl KvLayout {
    /// Bytes of a cached position's key row (`false`) or value row (`true`).
    pub fn row_bytes(&self, value: bool) -> usize {
        match value {
            true => self.value_bytes_per_token.unwrap_or(self.bytes_per_token),
            false => self.bytes_per_token,
        }
    }

    /// Elements of the wider of a position's key and value rows.
    pub fn widest_row(&self) -> usize {
        let element = self.bytes_per_token / self.kv_dim.max(1);
        self.row_bytes(true).max(self.bytes_per_token) / element.max(1)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuPlan {
    pub target: String,
    pub arch: String,
    /// Rows the activation buffers are sized for (the prefill chunk).
    pub max_tokens: usize,
    pub kernels: Vec<KernelEntry>,
    pub launches: Vec<Launch>,
    pub memory: MemoryPlan,
    pub token_ids: Option<usize>,
    pub positions: Option<usize>,
    /// The `HiddenStates` input of a multi-token prediction head's plan: a row per token, the
    /// host's `Segment::hidden_states`, written before each step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_states: Option<usize>,
    pub outputs: Vec<(String, usize)>,
    pub weights: Vec<WeightUse>,
    pub kv_cache: Vec<KvLayout>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recurrent_states: Vec<StateLayout>,
    pub constants: BTreeMap<String, Vec<f32>>,
    /// Whether launches rank cached positions through `LaunchArg::PositionScores`, allocated at
    /// load for `max_tokens` rows of the context.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub position_scores: bool,
    /// Set for a plan whose steps hold rows of many sequences (continuous batching); absent,
    /// a step is rows `first..first + tokens` of one sequence in a contiguous cache.
    #[serde(default)]
    pub batched: Option<BatchedCache>,
    /// What a batched plan's KV blocks must hold a multiple of, in positions: a kernel that
    /// copies a block's rows in boxes of fixed size (the TMA flash attention's 16) needs
    /// whole boxes in a block.
    #[serde(default = "one_position", skip_serializing_if = "is_one_position")]
    pub block_multiple: usize,
}

fn one_position() -> usize {
    1
}

fn is_one_position(n: &usize) -> bool {
    *n == 1
}

/// The nodes of a batched step with a row per sampled row: `last_token` (each sequence's last
/// row, or its last `drafts + 1` where it verifies drafted tokens) and every value computed
/// from it that keeps its single row in the IR (the final norm, the LM head): their row count
/// is the step's `sampled`, not the IR's 1.
pub fn per_sequence_nodes(graph: &Graph) -> BTreeSet<usize> {
    let mut per_sequence = BTreeSet::new();
    for (i, node) in graph.nodes().iter().enumerate() {
        // A row per sequence, or a position per sequence (`last_token` of the positions).
        let one_row = node.shape.rank() <= 2 && node.shape.0.first() == Some(&Dim::Const(1));
        let from_last = node.op == ir::Op::LastToken || node.inputs.iter().any(|p| per_sequence.contains(&p.0));
        if one_row && from_last {
            per_sequence.insert(i);
        }
    }
    per_sequence
}
