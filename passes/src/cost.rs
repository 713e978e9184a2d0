//! The per-target cost model that extraction minimises: estimated microseconds of one decode
//! step (`tokens` = 1, `kv_len` = 512) as launches + bytes moved / bandwidth + flops / rate.
//!
//! A slice is a view: it costs its share of the op it reads (`len / width`), so the parts of a
//! joined projection together cost the joined op once, and each part alone is cheaper than its
//! own matmul by the launches the join saves.

use crate::analysis::{op_of, type_of, BbcGraph};
use crate::lang::{split, Node};
use egg::{CostFunction, Id, Language};
use ir::{DType, Dim, Op, Shape, Sym};

/// Where the graph will run, as far as costs go.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Fixed cost of one kernel launch or parallel region, µs.
    pub launch_us: f64,
    /// Memory bandwidth, bytes per µs.
    pub bytes_per_us: f64,
    /// Arithmetic throughput, flops per µs.
    pub flops_per_us: f64,
    /// Whether a norm can be a matmul's prologue at no extra pass (a GPU loading tiles can; our
    /// CPU matmul reads the activation row once per weight row anyway, so it gains nothing).
    pub prologue_fusion: bool,
}

impl CostModel {
    /// A 2-core AVX2 machine like CI's: rayon region ≈ 5 µs, ~20 GB/s, ~100 GFLOP/s.
    pub const CPU: Self = Self {
        launch_us: 5.0,
        bytes_per_us: 20e3,
        flops_per_us: 100e3,
        prologue_fusion: false,
    };
    /// H200: ~3 µs launches (graphs hide most), 4.8 TB/s HBM3e, ~900 TFLOP/s bf16 dense.
    pub const H200: Self = Self {
        launch_us: 3.0,
        bytes_per_us: 4.8e6,
        flops_per_us: 900e6,
        prologue_fusion: true,
    };
    /// B200: 8 TB/s HBM3e, ~2.2 PFLOP/s bf16 dense.
    pub const B200: Self = Self {
        launch_us: 3.0,
        bytes_per_us: 8e6,
        flops_per_us: 2200e6,
        prologue_fusion: true,
    };
    /// RTX PRO 6000 Blackwell: 1.8 TB/s GDDR7, ~500 TFLOP/s bf16 dense.
    pub const RTX_PRO_6000: Self = Self {
        launch_us: 3.0,
        bytes_per_us: 1.8e6,
        flops_per_us: 500e6,
        prologue_fusion: true,
    };
}

const DECODE_TOKENS: usize = 1;
const DECODE_KV_LEN: usize = 512;

/// Bytes per element of a storage type (block formats: block bytes / block elements).
pub fn bytes_per_element(dtype: DType) -> f64 {
    match dtype {
        DType::F32 | DType::I32 => 4.0,
        DType::F16 | DType::BF16 => 2.0,
        DType::Q4_0 => 18.0 / 32.0,
        DType::Q4_1 => 20.0 / 32.0,
        DType::Q5_0 => 22.0 / 32.0,
        DType::Q5_1 => 24.0 / 32.0,
        DType::Q8_0 => 34.0 / 32.0,
        DType::Q4K => 144.0 / 256.0,
        DType::Q5K => 176.0 / 256.0,
        DType::Q6K => 210.0 / 256.0,
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

pub struct TargetCost<'a> {
    pub egraph: &'a BbcGraph,
    pub model: CostModel,
}

impl TargetCost<'_> {
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
            Op::MatMul | Op::RmsNormMatMul { .. } => {
                2.0 * elements(&out_shape)
                    * types
                        .last()
                        .map_or(0.0, |w| w.shape.last().and_then(Dim::as_const).unwrap_or(0) as f64)
            }
            Op::Attention(_) => 4.0 * elements(&out_shape) * DECODE_KV_LEN as f64,
            Op::Elementwise { expr } => elements(&out_shape) * expr.ops() as f64,
            // The int8 pass reads a quarter of the f32 head (a full-precision head is f32 or
            // bf16); rescoring touches a handful of rows.
            Op::Int8BoundTopK { .. } => {
                let head = types[1].shape.0.iter().filter_map(|d| d.as_const()).product::<usize>() as f64;
                return m.launch_us + head / m.bytes_per_us + 2.0 * head / m.flops_per_us;
            }
            _ => 0.0,
        };
        let kv_bytes = match op {
            Op::Attention(s) => 2.0 * (DECODE_KV_LEN * s.kv_heads * s.head_dim) as f64 * 2.0,
            _ => 0.0,
        };
        let mut cost = m.launch_us + (in_bytes + out_bytes + kv_bytes) / m.bytes_per_us + flops / m.flops_per_us;
        if matches!(op, Op::RmsNormMatMul { .. }) && !m.prologue_fusion {
            // Without prologue fusion the norm is its own pass: no launch saved, extra work.
            cost += m.launch_us + 2.0 * in_bytes / m.bytes_per_us;
        }
        cost
    }
}

impl CostFunction<Node> for TargetCost<'_> {
    type Cost = f64;

    fn cost<C>(&mut self, enode: &Node, mut costs: C) -> f64
    where
        C: FnMut(Id) -> f64,
    {
        let Some((_, inputs)) = split(enode) else { return 0.0 };
        let Some(op) = op_of(self.egraph, enode) else {
            return f64::INFINITY;
        };
        match op {
            Op::Input(_) | Op::Weight { .. } => 0.0,
            // Weight transforms happen at compile time.
            Op::ConcatRows => inputs.iter().map(|&i| costs(i)).sum(),
            Op::Slice { len, .. } => {
                let width = type_of(self.egraph, inputs[0])
                    .and_then(|t| t.shape.last())
                    .and_then(Dim::as_const)
                    .unwrap_or(len);
                costs(inputs[0]) * len as f64 / width.max(1) as f64 + 1e-6
            }
            _ => self.own(&op, inputs) + enode.children().iter().skip(1).map(|&c| costs(c)).sum::<f64>(),
        }
    }
}
