//! Random weights for models that have none (a shape run as vLLM's `--load-format dummy` runs
//! one, `models::lower_without_weights`): made on the device by `fill_uniform` (the GPU
//! check's 8B-shaped decode would otherwise make 16 GB on the host and copy it), or the same
//! values on the host ([`host_values`], [`host_weights`]). Each tensor is filled with a seed of
//! its own (the run's seed and its name), so its values do not depend on how a plan stacks
//! tensors.
//!
//! Values: matrices uniform in ±1/√cols (activations keep their scale through a matmul), vectors
//! (norm gains) uniform in 1 ± 0.1.

use crate::error::{Result, RuntimeError};
use crate::plan_exec::{DeviceArg, PlanDevice};
use ir::{DType, Graph};
use kernels_gen::dsl::Ty;
use kernels_gen::templates::fill;

/// Elements one fill launch makes: keeps its grid and indices far inside `i32`.
const FILL_CHUNK: usize = 1 << 24;

/// The fill kernels a device must have loaded for weights made on it
/// ([`crate::plan_exec::PlanWeights::Generated`]); an artifact of a model with random weights
/// carries them in its plans.
pub use fill::{fill_kernel, fill_kernels};

/// How the tensor `name` of `shape` is filled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fill {
    pub seed: u32,
    pub offset: f32,
    pub scale: f32,
}

impl Fill {
    pub fn of(seed: u32, name: &str, shape: &[usize]) -> Self {
        let (offset, scale) = match shape {
            [_, cols] => (0.0, 1.0 / (*cols as f32).sqrt()),
            _ => (1.0, 0.1),
        };
        Self {
            seed: seed ^ fnv1a(name),
            offset,
            scale,
        }
    }
}

/// The values the device makes for the tensor `name` of `shape` (f32, before rounding to the
/// plan's dtype).
pub fn host_values(seed: u32, name: &str, shape: &[usize]) -> Vec<f32> {
    use rayon::prelude::*;
    let fill = Fill::of(seed, name, shape);
    let elements: usize = shape.iter().product();
    // On the pool: an 8B-shaped model's matrices hold billions.
    (0..elements as u32)
        .into_par_iter()
        .map(|i| fill::uniform(fill.seed, i, fill.offset, fill.scale))
        .collect()
}

/// Every weight `graph` declares, with its [`host_values`], in memory: matrices bf16, vectors
/// (norm gains) f32, as a bf16 checkpoint stores them. A model's random weights where it runs
/// on the host (the CPU backend, or uploaded to a device); each tensor made on the pool.
pub fn host_weights(graph: &Graph, seed: u32) -> quant::tensor::MemoryTensors {
    use rayon::prelude::*;
    declared_weights(graph)
        .into_par_iter()
        .map(|(name, shape)| (name.clone(), host_tensor(seed, name, shape)))
        .collect()
}

/// Every weight `graph` declares, once (a tied head and embedding are one tensor), with its
/// shape.
fn declared_weights(graph: &Graph) -> Vec<(&String, Vec<usize>)> {
    let mut declared: Vec<(&String, Vec<usize>)> = Vec::new();
    for node in graph.nodes() {
        if let ir::Op::Weight { name } = &node.op {
            if !declared.iter().any(|(n, _)| *n == name) {
                declared.push((name, node.shape.resolve(0, 0)));
            }
        }
    }
    declared
}

/// Tensor `name`'s [`host_values`] as a bf16 checkpoint stores them: matrices bf16, vectors
/// (norm gains) f32.
fn host_tensor(seed: u32, name: &str, shape: Vec<usize>) -> quant::tensor::MemoryTensor {
    let values = host_values(seed, name, &shape);
    let (dtype, bytes) = match shape.len() {
        2 => (
            quant::GgmlType::BF16,
            values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
        ),
        _ => (
            quant::GgmlType::F32,
            values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
    };
    quant::tensor::MemoryTensor { shape, dtype, bytes }
}

/// Every weight `graph` declares, with its [`host_values`], written as one safetensors file
/// at `path`, as [`host_weights`] holds them. For benchmarks of model shapes no file has, on
/// the CPU backend.
pub fn write_checkpoint(graph: &Graph, seed: u32, path: &std::path::Path) -> Result<()> {
    let tensors = host_weights(graph, seed);
    let views = tensors
        .iter()
        .map(|(name, t)| {
            let dtype = match t.dtype {
                quant::GgmlType::BF16 => safetensors::Dtype::BF16,
                _ => safetensors::Dtype::F32,
            };
            safetensors::tensor::TensorView::new(dtype, t.shape.clone(), &t.bytes).map(|view| (name.clone(), view))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| RuntimeError::Weight(e.to_string()))?;
    safetensors::serialize_to_file(views, None, path)
        .map_err(|e| RuntimeError::Weight(format!("{}: {e}", path.display())))
}

/// Weight `w` of the plan made on `device` from `seed`: whole tensors of f32 or bf16 filled
/// there; a weight whose parts regroup rows of its tensors (interleaved heads), or of another
/// dtype (an f16 plan's, from the bf16 values as a checkpoint would hold them; FP8 or 4-bit
/// blocks quantized from them), made on the host from the same values, regrouped as a file's
/// would be, and uploaded.
pub(crate) fn make_weight<D: PlanDevice>(
    device: &mut D,
    graph: &Graph,
    w: &gpu_plan::WeightUse,
    seed: u32,
) -> Result<(D::Buffer, usize)> {
    let shape_of = |name: &str| {
        graph
            .nodes()
            .iter()
            .find_map(|n| match &n.op {
                ir::Op::Weight { name: m } if m == name => Some(n.shape.resolve(0, 0)),
                _ => None,
            })
            .ok_or_else(|| RuntimeError::Weight(format!("`{name}` is not a weight of the graph")))
    };
    let filled = matches!(w.dtype, DType::F32 | DType::BF16);
    if !filled || !w.parts.iter().all(|p| matches!(p, gpu_plan::WeightPart::Whole(_))) {
        let mut tensors = quant::tensor::MemoryTensors::new();
        for part in &w.parts {
            let name = part.name();
            let mut tensor = host_tensor(seed, name, shape_of(name)?);
            // Blocks quantized from the bf16 values, as the host's weights are as they load.
            let view = quant::tensor::TensorView {
                shape: &tensor.shape,
                dtype: tensor.dtype,
                bytes: &tensor.bytes,
            };
            let format = quant::GgmlType::MADE_FROM_FLOATS
                .into_iter()
                .find(|&f| quant::tensor::ir_dtype(f) == w.dtype);
            if let Some(bytes) = format.and_then(|f| quant::tensor::quantize_matrix(&view, f)) {
                (tensor.bytes, tensor.dtype) = (bytes, format.expect("a format"));
            }
            tensors.insert(name.to_string(), tensor);
        }
        let bytes = crate::plan_exec::weight_bytes(w.dtype, &w.parts, &tensors)?;
        return Ok((device.upload(&bytes)?, bytes.len()));
    }
    let ty = match w.dtype {
        DType::F32 => Ty::F32,
        _ => Ty::Bf16,
    };
    let (elements, width) = (w.shape.iter().product::<usize>(), ty.bytes());
    let buffer = device.alloc(elements * width)?;
    let mut at = 0;
    for part in &w.parts {
        let name = part.name();
        let shape = shape_of(name)?;
        let len: usize = shape.iter().product();
        if at + len > elements {
            return Err(RuntimeError::Weight(format!(
                "`{name}` ({len} elements) does not fit its plan buffer"
            )));
        }
        fill_on_device(device, &buffer, at * width, len, ty, Fill::of(seed, name, &shape))?;
        at += len;
    }
    if at != elements {
        return Err(RuntimeError::Weight(format!(
            "the parts of weight %{} hold {at} of its {elements} elements",
            w.node
        )));
    }
    Ok((buffer, elements * width))
}

/// Fill `elements` elements of type `ty` (f32, bf16 or FP8) of `buffer` from byte `at` as `fill`
/// says (element `i` is [`uniform`](fill::uniform)'s value at index `i`), in launches of at
/// most [`FILL_CHUNK`] elements. The device must have loaded [`fill_kernels`] (for FP8, the
/// kernel [`fill_kernel`](fill::fill_kernel) names).
pub fn fill_on_device<D: PlanDevice>(
    device: &mut D,
    buffer: &D::Buffer,
    at: usize,
    elements: usize,
    ty: Ty,
    fill: Fill,
) -> Result<()> {
    if elements > i32::MAX as usize {
        return Err(RuntimeError::Weight(format!(
            "{elements} elements are past the fill kernel's 32-bit indices"
        )));
    }
    let width = ty.bytes();
    let block = kernels_gen::templates::BLOCK;
    for first in (0..elements).step_by(FILL_CHUNK) {
        let n = FILL_CHUNK.min(elements - first);
        let args = [
            DeviceArg::Buffer(buffer, at + first * width..at + (first + n) * width),
            DeviceArg::I32(n as i32),
            DeviceArg::I32(first as i32),
            DeviceArg::I32(fill.seed as i32),
            DeviceArg::F32(fill.offset),
            DeviceArg::F32(fill.scale),
        ];
        device.launch(fill_kernel(ty), n.div_ceil(block as usize) as u32, block, &args)?;
    }
    Ok(())
}

/// FNV-1a: a name's seed, stable across runs and machines.
fn fnv1a(name: &str) -> u32 {
    name.bytes()
        .fold(0x811C_9DC5u32, |h, b| (h ^ b as u32).wrapping_mul(0x0100_0193))
}
