//! Weights made on the device, for models that have none (`models::lower_without_weights`):
//! the GPU check's Llama-8B-shaped decode would otherwise make 16 GB on the host and copy it.
//! Each tensor is filled by `fill_uniform` with a seed of its own (the run's seed and its
//! name), so its values do not depend on how the plan stacks tensors; [`host_values`] gives
//! the same values on the host, for tests that hold the weights the device made.
//!
//! Values: matrices uniform in ±1/√cols (activations keep their scale through a matmul), vectors
//! (norm gains) uniform in 1 ± 0.1.

use kernels_gen::dsl::{Kernel, Ty};
use kernels_gen::templates::fill;

/// The fill kernels a device must have loaded for `PlanExecutor::with_generated_weights`.
pub fn fill_kernels() -> Vec<Kernel> {
    [Ty::F32, Ty::Bf16]
        .into_iter()
        .map(|ty| fill::fill_uniform(fill_kernel(ty), "generated weights", ty))
        .collect()
}

/// The fill kernel's name for elements of `ty`.
pub fn fill_kernel(ty: Ty) -> &'static str {
    match ty {
        Ty::Bf16 => "fill_uniform_bf16",
        _ => "fill_uniform_f32",
    }
}

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
    let fill = Fill::of(seed, name, shape);
    let elements: usize = shape.iter().product();
    (0..elements as u32)
        .map(|i| fill::uniform(fill.seed, i, fill.offset, fill.scale))
        .collect()
}

/// FNV-1a: a name's seed, stable across runs and machines.
fn fnv1a(name: &str) -> u32 {
    name.bytes()
        .fold(0x811C_9DC5u32, |h, b| (h ^ b as u32).wrapping_mul(0x0100_0193))
}
