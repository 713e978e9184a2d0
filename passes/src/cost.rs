//! The per-target cost model that extraction minimises: estimated microseconds of one decode
//! step (`tokens` = 1, `kv_len` = 512) as launches + bytes moved / bandwidth + flops / rate.
//!
//! A value's cost is the cost of the sub-graph it needs, each op counted once however many
//! paths reach it (a DAG cost, not a tree cost). A slice is a view: it needs its share of the
//! op it reads (`len / width`), so the parts of a joined projection or of `add_rms_norm`'s
//! `[sum | norm]` together need the joined op once, and each part alone is cheaper than its own
//! op by the launches the join saves.
//!
//! Why not a tree cost (each input's cost summed into every reader): values read twice (every
//! residual connection) then count twice, costs double with each layer (2^30 and more by a
//! 30-layer model's head), and the differences that decide a fusion (a launch, a few µs) vanish
//! in the rounding of those sums: extraction then kept a fusion in some layers and not others.

use crate::analysis::{op_of, type_of, BbcGraph};
use crate::lang::{split, Node};
use egg::{CostFunction, Id};
use ir::{DType, Dim, Op, Shape, Sym};
use std::collections::HashMap;
use std::rc::Rc;

/// Where the graph will run, as far as costs go.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Fixed cost of one kernel launch or parallel region, µs.
    pub launch_us: f64,
    /// Memory bandwidth, bytes per µs.
    pub bytes_per_us: f64,
    /// Arithmetic throughput, flops per µs.
    pub flops_per_us: f64,
    /// Weight storage types whose matmuls take a norm (and a residual add) as their prologue.
    /// A GPU loading tiles does it at no extra pass, but a fused matmul must not lose the
    /// tensor cores for prefill: only types whose prefill GEMM on the target has the prologue
    /// too (`kernels_gen::templates::prefill_gemm`), or that have no tensor-core GEMM at all
    /// (f32), qualify; over the others a fused matmul would prefill, and decode large batches,
    /// on the GEMV. On every GPU target that is every type with a GPU template. None on the
    /// CPU: its matmul reads the activation row once per weight row anyway, so it gains
    /// nothing. (A GLU epilogue needs dense weights besides: [`GLU_EPILOGUE_WEIGHTS`].)
    pub prologue_weights: &'static [DType],
}

impl CostModel {
    /// A 2-core AVX2 machine like CI's: rayon region ≈ 5 µs, ~20 GB/s, ~100 GFLOP/s.
    pub const CPU: Self = Self {
        launch_us: 5.0,
        bytes_per_us: 20e3,
        flops_per_us: 100e3,
        prologue_weights: &[],
    };
    /// H200: ~3 µs launches (graphs hide most), 4.8 TB/s HBM3e, ~900 TFLOP/s bf16 dense.
    pub const H200: Self = Self {
        launch_us: 3.0,
        bytes_per_us: 4.8e6,
        flops_per_us: 900e6,
        prologue_weights: GPU_PROLOGUE_WEIGHTS,
    };
    /// B200: 8 TB/s HBM3e, ~2.2 PFLOP/s bf16 dense.
    pub const B200: Self = Self {
        launch_us: 3.0,
        bytes_per_us: 8e6,
        flops_per_us: 2200e6,
        prologue_weights: GPU_PROLOGUE_WEIGHTS,
    };
    /// RTX PRO 6000 Blackwell: 1.8 TB/s GDDR7, ~500 TFLOP/s bf16 dense.
    pub const RTX_PRO_6000: Self = Self {
        launch_us: 3.0,
        bytes_per_us: 1.8e6,
        flops_per_us: 500e6,
        prologue_weights: GPU_PROLOGUE_WEIGHTS,
    };
}

/// Every weight type with GPU templates: each prefill GEMM (`wgmma`, `tcgen05`, `mma.sync`
/// with bf16, half or decoded GGUF weights) has the norm prologue, and f32 weights prefill on
/// the GEMV, which has it too.
const GPU_PROLOGUE_WEIGHTS: &[DType] = &[
    DType::BF16,
    DType::F16,
    DType::F32,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q4K,
    DType::Q5K,
    DType::Q6K,
    DType::Q2K,
    DType::Q3K,
    DType::IQ4NL,
    DType::IQ4XS,
    DType::MXFP4,
];

/// Weight types a matmul can take a GLU epilogue over: the decode GEMV pairs a gate row with
/// its up row of dense weights; there is no such kernel over GGUF blocks.
pub const GLU_EPILOGUE_WEIGHTS: &[DType] = &[DType::BF16, DType::F16, DType::F32];

const DECODE_TOKENS: usize = 1;
const DECODE_KV_LEN: usize = 512;

/// Bytes per element of a storage type (block formats: block bytes / block elements).
pub fn bytes_per_element(dtype: DType) -> f64 {
    match dtype {
        DType::F32 | DType::I32 => 4.0,
        DType::F16 | DType::BF16 => 2.0,
        DType::F8E4M3 => 1.0,
        DType::Q4_0 => 18.0 / 32.0,
        DType::Q4_1 => 20.0 / 32.0,
        DType::Q5_0 => 22.0 / 32.0,
        DType::Q5_1 => 24.0 / 32.0,
        DType::Q8_0 => 34.0 / 32.0,
        DType::Q4K => 144.0 / 256.0,
        DType::Q5K => 176.0 / 256.0,
        DType::Q6K => 210.0 / 256.0,
        DType::Q2K => 84.0 / 256.0,
        DType::Q3K => 110.0 / 256.0,
        DType::IQ4NL => 18.0 / 32.0,
        DType::IQ4XS => 136.0 / 256.0,
        DType::MXFP4 => 17.0 / 32.0,
        DType::F8E4M3B32 => 36.0 / 32.0,
        DType::U4B32 => 24.0 / 32.0,
        DType::U4B128 => 72.0 / 128.0,
        DType::F4E2M1B32 => 24.0 / 32.0,
    }
}

pub fn elements(shape: &Shape) -> f64 {
    shape
        .0
        .iter()
        .map(|d| match d {
            Dim::Const(n) => *n,
            Dim::Sym(Sym::Tokens) => DECODE_TOKENS,
            Dim::Sym(Sym::KvLen) => DECODE_KV_LEN,
        } as f64)
        .product()
}

/// The cost function extraction minimises (see the module's comment).
pub struct TargetCost<'a> {
    egraph: &'a BbcGraph,
    model: CostModel,
    /// The class of every e-node, which `CostFunction::cost` is not told.
    class_of: HashMap<Node, Id>,
}

/// The cost of a value: the ops its sub-graph needs, by e-class (sorted by class), each with
/// its own cost and the fraction of that op the value needs (1, or a slice's share), and their
/// weighted sum.
#[derive(Debug, Clone)]
pub struct DagCost {
    pub total: f64,
    parts: Rc<Vec<(Id, Part)>>,
}

#[derive(Debug, Clone, Copy)]
struct Part {
    own: f64,
    fraction: f64,
}

impl DagCost {
    fn free() -> Self {
        Self {
            total: 0.0,
            parts: Rc::default(),
        }
    }

    fn impossible() -> Self {
        Self {
            total: f64::INFINITY,
            parts: Rc::default(),
        }
    }

    /// `own` for `class`, plus `inputs` (each with the fraction of it needed): an op reached
    /// by several paths counts once, its fractions added up to the whole of it.
    fn of(class: Id, own: f64, inputs: &[(&DagCost, f64)]) -> Self {
        let mut parts: Vec<(Id, Part)> = match own != 0.0 {
            true => vec![(class, Part { own, fraction: 1.0 })],
            false => Vec::new(),
        };
        for (input, scale) in inputs {
            parts = merge(&parts, &input.parts, *scale);
        }
        let total = parts.iter().map(|(_, p)| p.own * p.fraction).sum();
        Self {
            total,
            parts: Rc::new(parts),
        }
    }
}

/// `a` and `b` (its fractions times `scale`) merged by class; fractions of a class in both
/// add up, to at most 1.
fn merge(a: &[(Id, Part)], b: &[(Id, Part)], scale: f64) -> Vec<(Id, Part)> {
    let scaled = |(id, p): (Id, Part)| {
        (
            id,
            Part {
                own: p.own,
                fraction: p.fraction * scale,
            },
        )
    };
    let mut out = Vec::with_capacity(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].0.cmp(&b[j].0) {
            std::cmp::Ordering::Less => {
                out.push(a[i]);
                i += 1;
            }
            std::cmp::Ordering::Greater => {
                out.push(scaled(b[j]));
                j += 1;
            }
            std::cmp::Ordering::Equal => {
                let (id, p) = a[i];
                let fraction = (p.fraction + b[j].1.fraction * scale).min(1.0);
                out.push((id, Part { own: p.own, fraction }));
                i += 1;
                j += 1;
            }
        }
    }
    out.extend_from_slice(&a[i..]);
    out.extend(b[j..].iter().copied().map(scaled));
    out
}

impl PartialEq for DagCost {
    fn eq(&self, other: &Self) -> bool {
        self.total == other.total
    }
}

impl PartialOrd for DagCost {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        self.total.partial_cmp(&other.total)
    }
}

impl<'a> TargetCost<'a> {
    pub fn new(egraph: &'a BbcGraph, model: CostModel) -> Self {
        let class_of = egraph
            .classes()
            .flat_map(|class| class.nodes.iter().map(move |n| (n.clone(), class.id)))
            .collect();
        Self {
            egraph,
            model,
            class_of,
        }
    }

    /// The op's own cost, from its inputs' types and its output's.
    fn own(&self, op: &Op, inputs: &[Id]) -> f64 {
        let m = self.model;
        let types: Vec<_> = inputs.iter().filter_map(|&i| type_of(self.egraph, i)).collect();
        let refs: Vec<_> = types.iter().map(|t| (&t.shape, t.dtype)).collect();
        let Ok((out_shape, out_dtype)) = op.infer(&refs) else {
            return f64::INFINITY;
        };
        let out_bytes = elements(&out_shape) * bytes_per_element(out_dtype);
        let in_bytes: f64 = types
            .iter()
            .map(|t| elements(&t.shape) * bytes_per_element(t.dtype))
            .sum();
        let flops = match op {
            Op::MatMul | Op::RmsNormMatMul { .. } | Op::AddRmsNormMatMul { .. } => {
                2.0 * elements(&out_shape)
                    * types
                        .last()
                        .map_or(0.0, |w| w.shape.last().and_then(Dim::as_const).unwrap_or(0) as f64)
            }
            _ if op.attention().is_some() => 4.0 * elements(&out_shape) * DECODE_KV_LEN as f64,
            Op::Elementwise { expr } => elements(&out_shape) * expr.ops() as f64,
            // The int8 pass reads a quarter of the f32 head (a full-precision head is f32, bf16
            // or f16); rescoring touches a handful of rows.
            Op::Int8BoundTopK { .. } => {
                let head = types[1].shape.0.iter().filter_map(|d| d.as_const()).product::<usize>() as f64;
                return m.launch_us + head / m.bytes_per_us + 2.0 * head / m.flops_per_us;
            }
            // The 4-bit pass reads half of that.
            Op::ShortlistTopK { .. } => {
                let head = types[1].shape.0.iter().filter_map(|d| d.as_const()).product::<usize>() as f64;
                return m.launch_us + head / (2.0 * m.bytes_per_us) + 2.0 * head / m.flops_per_us;
            }
            _ => 0.0,
        };
        let kv_bytes = match op.attention() {
            Some(s) => 2.0 * (DECODE_KV_LEN * s.kv_heads * s.head_dim) as f64 * 2.0,
            None => 0.0,
        };
        let prologue = matches!(op, Op::RmsNormMatMul { .. } | Op::AddRmsNormMatMul { .. });
        let weights = types.last().map(|w| w.dtype);
        if prologue && !weights.is_some_and(|w| m.prologue_weights.contains(&w)) {
            return f64::INFINITY;
        }
        let glu = matches!(op, Op::AddRmsNormMatMul { glu: Some(_), .. });
        if glu && !weights.is_some_and(|w| GLU_EPILOGUE_WEIGHTS.contains(&w)) {
            return f64::INFINITY;
        }
        m.launch_us + (in_bytes + out_bytes + kv_bytes) / m.bytes_per_us + flops / m.flops_per_us
    }
}

impl TargetCost<'_> {
    /// An e-node's own cost, its op alone: nothing for leaves and compile-time weight
    /// transforms, next to nothing for views; infinite where it cannot be costed.
    pub(crate) fn node_own(&self, enode: &Node) -> f64 {
        let (Some((_, inputs)), Some(op)) = (split(enode), op_of(self.egraph, enode)) else {
            return match enode {
                Node::Attr(_) => 0.0,
                _ => f64::INFINITY,
            };
        };
        match op {
            Op::Input(_) | Op::Weight { .. } => 0.0,
            // Weight transforms happen at compile time.
            _ if op.is_weight_transform() => 0.0,
            // A view: nearly free, but not quite, so that a value is not needlessly a view.
            Op::Slice { .. } => 1e-6,
            _ => self.own(&op, inputs),
        }
    }
}

impl CostFunction<Node> for TargetCost<'_> {
    type Cost = DagCost;

    fn cost<C>(&mut self, enode: &Node, mut costs: C) -> DagCost
    where
        C: FnMut(Id) -> DagCost,
    {
        let Some((_, inputs)) = split(enode) else {
            return DagCost::free();
        };
        let Some(op) = op_of(self.egraph, enode) else {
            return DagCost::impossible();
        };
        let Some(&class) = self.class_of.get(enode) else {
            return DagCost::impossible();
        };
        // A node reading its own class (a slice spanning all of its input, united with it)
        // would make the value need itself.
        if inputs.iter().any(|&i| self.egraph.find(i) == class) {
            return DagCost::impossible();
        }
        let inputs: Vec<(DagCost, f64)> = match op {
            Op::Slice { len, .. } => {
                let width = type_of(self.egraph, inputs[0])
                    .and_then(|t| t.shape.last())
                    .and_then(Dim::as_const)
                    .unwrap_or(len);
                vec![(costs(inputs[0]), len as f64 / width.max(1) as f64)]
            }
            _ => inputs.iter().map(|&i| (costs(i), 1.0)).collect(),
        };
        let own = self.node_own(enode);
        let refs: Vec<(&DagCost, f64)> = inputs.iter().map(|(c, s)| (c, *s)).collect();
        DagCost::of(class, own, &refs)
    }
}
