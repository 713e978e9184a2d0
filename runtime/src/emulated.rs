//! The emulated device: a GPU plan's kernels run by the kernels-gen emulator on the CPU, with
//! device memory as byte vectors. Slow, and meant for tiny models: it checks everything a GPU
//! run depends on above the kernels themselves (buffer offsets and sizes, views, scalars, the
//! choice of prefill kernels, the KV cache, the order of launches) against the CPU backend,
//! on machines without a GPU, and each kernel's indexing against the bytes the plan gives it
//! (a launch that touches anything outside its argument's range is an error).

use crate::error::{Result, RuntimeError};
use crate::plan_exec::{DeviceArg, PlanDevice, PlanExecutor};
use codegen::gpu::GpuPlan;
use ir::Graph;
use kernels_gen::dsl::{Kernel, Param};
use kernels_gen::emulator::{self, Array, Scalar};
use models::WeightSource;
use passes::weight_transforms::Int8Rows;
use std::collections::HashMap;
use std::ops::Range;

/// Device memory and the plan's kernels as DSL programs.
pub struct EmulatedDevice {
    kernels: HashMap<String, Kernel>,
    memory: Vec<Vec<u8>>,
}

impl EmulatedDevice {
    /// `kernels` are the DSL programs of the plan's kernels (same names).
    pub fn new(kernels: Vec<Kernel>) -> Self {
        Self {
            kernels: kernels.into_iter().map(|k| (k.name.clone(), k)).collect(),
            memory: Vec::new(),
        }
    }
}

fn fault(e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Cuda(format!("emulated launch: {e}"))
}

impl PlanDevice for EmulatedDevice {
    /// An index into the device's memory.
    type Buffer = usize;

    fn alloc(&mut self, bytes: usize) -> Result<usize> {
        self.memory.push(vec![0; bytes]);
        Ok(self.memory.len() - 1)
    }

    fn upload(&mut self, bytes: &[u8]) -> Result<usize> {
        self.memory.push(bytes.to_vec());
        Ok(self.memory.len() - 1)
    }

    fn write(&mut self, buffer: &usize, at: usize, bytes: &[u8]) -> Result<()> {
        self.memory[*buffer][at..at + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    fn read(&mut self, buffer: &usize, range: Range<usize>) -> Result<Vec<u8>> {
        Ok(self.memory[*buffer][range].to_vec())
    }

    fn launch(&mut self, kernel: &str, grid: u32, block: u32, args: &[DeviceArg<'_, usize>]) -> Result<()> {
        let k = self
            .kernels
            .get(kernel)
            .ok_or_else(|| fault(format!("no kernel {kernel}")))?;
        if block != k.block_dim {
            return Err(fault(format!(
                "{kernel}: launched with {block} threads, built for {}",
                k.block_dim
            )));
        }
        let mut arrays = HashMap::new();
        let mut scalars = HashMap::new();
        let mut written = Vec::new();
        for (param, arg) in k.params.iter().zip(args) {
            match (param, arg) {
                (Param::Buffer { name, ty, writable }, DeviceArg::Buffer(&buffer, range)) => {
                    arrays.insert(
                        name.clone(),
                        Array::from_le_bytes(*ty, &self.memory[buffer][range.clone()]),
                    );
                    if *writable {
                        written.push((name.clone(), buffer, range.clone()));
                    }
                }
                (Param::Scalar { name, .. }, DeviceArg::I32(v)) => {
                    scalars.insert(name.clone(), Scalar::Int(*v as i64));
                }
                (Param::Scalar { name, .. }, DeviceArg::F32(v)) => {
                    scalars.insert(name.clone(), Scalar::F32(*v));
                }
                (p, _) => {
                    return Err(fault(format!(
                        "{kernel}: argument for `{}` of the wrong kind",
                        p.name()
                    )))
                }
            }
        }
        check_no_aliased_writes(kernel, k, args)?;
        let _ = grid; // the emulator evaluates the kernel's own grid expression from the scalars
        emulator::run(k, &mut arrays, &scalars).map_err(fault)?;
        for (name, buffer, range) in written {
            let bytes = arrays[&name].to_le_bytes();
            self.memory[buffer][range.start..range.start + bytes.len()].copy_from_slice(&bytes);
        }
        Ok(())
    }
}

/// Each buffer argument is emulated as its own array, so a launch whose written range overlaps
/// another argument's range would not see its own writes there: refuse it rather than emulate
/// it wrongly.
fn check_no_aliased_writes(kernel: &str, k: &Kernel, args: &[DeviceArg<'_, usize>]) -> Result<()> {
    let buffers: Vec<(&Param, usize, &Range<usize>)> = k
        .params
        .iter()
        .zip(args)
        .filter_map(|(p, a)| match a {
            DeviceArg::Buffer(&b, r) => Some((p, b, r)),
            _ => None,
        })
        .collect();
    for (i, (p, b, r)) in buffers.iter().enumerate() {
        for (q, c, s) in &buffers[i + 1..] {
            let writes =
                matches!(p, Param::Buffer { writable: true, .. }) || matches!(q, Param::Buffer { writable: true, .. });
            if b == c && writes && r.start < s.end && s.start < r.end {
                return Err(fault(format!("{kernel}: `{}` and `{}` overlap", p.name(), q.name())));
            }
        }
    }
    Ok(())
}

/// A GPU plan run by the emulator.
pub type EmulatedBackend = PlanExecutor<EmulatedDevice>;

impl EmulatedBackend {
    /// `plan` and its DSL `kernels` (from `codegen::gpu::build_with_kernels`) for `graph`.
    pub fn emulated(
        plan: GpuPlan,
        kernels: Vec<Kernel>,
        graph: Graph,
        weights: &WeightSource,
        int8: &[(String, Int8Rows)],
        context_length: usize,
    ) -> Result<Self> {
        PlanExecutor::new(EmulatedDevice::new(kernels), plan, graph, weights, int8, context_length)
    }
}
