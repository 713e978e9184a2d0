//! Two devices in lockstep: every buffer exists on both, every launch runs on both, and after
//! each launch the ranges the kernel writes are compared (the device under test against the
//! reference) and then made equal again, copied from the reference, so each kernel's error is
//! its own and not what earlier kernels handed it. Run a plan on a `CompareDevice` of the CUDA
//! device and the emulated one, and it reports every kernel's error on the GPU
//! (`bbc gpu-check`, `src/gpu_check/kernels.rs`).

use crate::error::{Result, RuntimeError};
use crate::plan_exec::{DeviceArg, PlanDevice};
use kernels_gen::dsl::{Kernel, Param, Ty};
use kernels_gen::emulator::Array;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

/// How far one kernel's outputs were from the reference, over all its launches.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KernelError {
    pub launches: usize,
    /// Max |test − reference| over max |reference|, over every written element.
    pub relative: f64,
}

pub struct CompareDevice<T: PlanDevice, R: PlanDevice> {
    test: T,
    reference: R,
    /// Per kernel, its buffer parameters in order: element type, and whether it writes it.
    buffers: HashMap<String, Vec<(Ty, bool)>>,
    errors: BTreeMap<String, KernelError>,
}

impl<T: PlanDevice, R: PlanDevice> CompareDevice<T, R> {
    /// `kernels`: the DSL programs of every kernel that will be launched.
    pub fn new(test: T, reference: R, kernels: &[Kernel]) -> Self {
        let buffers = kernels
            .iter()
            .map(|k| {
                let params = k
                    .params
                    .iter()
                    .filter_map(|p| match p {
                        Param::Buffer { ty, writable, .. } => Some((*ty, *writable)),
                        Param::Scalar { .. } | Param::TensorMap(_) => None,
                    })
                    .collect();
                (k.name.clone(), params)
            })
            .collect();
        Self {
            test,
            reference,
            buffers,
            errors: BTreeMap::new(),
        }
    }

    /// Every kernel launched so far, by name.
    pub fn errors(&self) -> &BTreeMap<String, KernelError> {
        &self.errors
    }
}

/// Max |a − b| over max |b|, of two byte ranges read as `ty` elements (a NaN on one side only
/// is an infinite error).
fn relative_error(ty: Ty, a: &[u8], b: &[u8]) -> f64 {
    let values = |bytes: &[u8]| Array::from_le_bytes(ty, bytes).to_f32().unwrap_or_default();
    let (a, b) = (values(a), values(b));
    let scale = b
        .iter()
        .fold(0f64, |m, &v| m.max(v.abs() as f64))
        .max(f64::MIN_POSITIVE);
    let worst = a.iter().zip(&b).fold(0f64, |m, (&x, &y)| {
        let d = (x as f64 - y as f64).abs();
        match (x.to_bits() == y.to_bits(), d.is_nan()) {
            (true, _) => m,
            (false, true) => f64::INFINITY,
            (false, false) => m.max(d),
        }
    });
    worst / scale
}

/// One side of a pair of launch arguments.
fn side<'a, A, B, X>(args: &[DeviceArg<'a, (A, B)>], pick: impl Fn(&'a (A, B)) -> &'a X) -> Vec<DeviceArg<'a, X>> {
    args.iter()
        .map(|a| match a {
            DeviceArg::Buffer(b, r) => DeviceArg::Buffer(pick(b), r.clone()),
            DeviceArg::I32(v) => DeviceArg::I32(*v),
            DeviceArg::F32(v) => DeviceArg::F32(*v),
        })
        .collect()
}

impl<T: PlanDevice, R: PlanDevice> PlanDevice for CompareDevice<T, R> {
    type Buffer = (T::Buffer, R::Buffer);

    /// As the device under test does (both sides run the same launches).
    fn prefetches_weights(&self) -> bool {
        self.test.prefetches_weights()
    }

    fn alloc(&mut self, bytes: usize) -> Result<Self::Buffer> {
        Ok((self.test.alloc(bytes)?, self.reference.alloc(bytes)?))
    }

    fn upload(&mut self, bytes: &[u8]) -> Result<Self::Buffer> {
        Ok((self.test.upload(bytes)?, self.reference.upload(bytes)?))
    }

    fn write(&mut self, buffer: &Self::Buffer, at: usize, bytes: &[u8]) -> Result<()> {
        self.test.write(&buffer.0, at, bytes)?;
        self.reference.write(&buffer.1, at, bytes)
    }

    /// What the device under test holds.
    fn read(&mut self, buffer: &Self::Buffer, range: Range<usize>) -> Result<Vec<u8>> {
        self.test.read(&buffer.0, range)
    }

    fn copy(
        &mut self,
        from: &Self::Buffer,
        from_at: usize,
        to: &Self::Buffer,
        to_at: usize,
        bytes: usize,
    ) -> Result<()> {
        self.test.copy(&from.0, from_at, &to.0, to_at, bytes)?;
        self.reference.copy(&from.1, from_at, &to.1, to_at, bytes)
    }

    fn launch(&mut self, kernel: &str, grid: u32, block: u32, args: &[DeviceArg<'_, Self::Buffer>]) -> Result<()> {
        self.test.launch(kernel, grid, block, &side(args, |b| &b.0))?;
        self.reference.launch(kernel, grid, block, &side(args, |b| &b.1))?;
        let params = self
            .buffers
            .get(kernel)
            .ok_or_else(|| RuntimeError::Artifact(format!("no DSL program for kernel {kernel}")))?;
        let buffers = args.iter().filter_map(|a| match a {
            DeviceArg::Buffer(b, r) => Some((*b, r)),
            _ => None,
        });
        let mut worst = 0f64;
        for (&(ty, writable), (buffer, range)) in params.iter().zip(buffers) {
            if writable {
                let got = self.test.read(&buffer.0, range.clone())?;
                let want = self.reference.read(&buffer.1, range.clone())?;
                worst = worst.max(relative_error(ty, &got, &want));
                self.test.write(&buffer.0, range.start, &want)?;
            }
        }
        let entry = self.errors.entry(kernel.to_string()).or_default();
        entry.launches += 1;
        entry.relative = entry.relative.max(worst);
        Ok(())
    }
}
