//! Weights made on the device from their stored bytes: a GGUF's blocks or a half checkpoint
//! loaded into a bf16 (or f32, or the other half type's) plan goes up as the file holds it (a 4-bit block is a quarter of
//! the bf16 bytes) and is decoded there by the plan's conversion kernels
//! (`kernels_gen::templates::weight_convert`, which `bbc compile` adds for the formats the
//! weights have), into the values the host would have made. Runs the plan keeps as stored
//! are copied into place on the device: a weight stacked from several tensors (a joined
//! projection) is uploaded a tensor at a time, never first written out on the host.

use super::weight_bytes::StoredRun;
use super::{DeviceArg, PlanDevice};
use crate::{Result, RuntimeError};
use ir::DType;
use kernels_gen::templates::weight_convert::convert_kernel_name;
use kernels_gen::templates::BLOCK;

/// Elements one conversion launch makes at most (whole rows; a longer row is a launch of its
/// own): keeps the staging upload a few tens of MB and the kernel's indices inside `i32`.
pub(super) const CONVERT_CHUNK: usize = 1 << 24;

/// The weight of `dtype` that `runs` make, in order, on `device`: each run's rows uploaded
/// `chunk` elements at a time, then converted (to f32, bf16 or f16) or copied into place.
pub(super) fn make_on_device<D: PlanDevice>(
    device: &mut D,
    dtype: DType,
    runs: &[StoredRun<'_>],
    chunk: usize,
) -> Result<(D::Buffer, usize)> {
    // Bytes of a converted element (runs kept as stored need none: a stack of GGUF blocks).
    let width = match dtype {
        DType::F32 => 4,
        DType::BF16 | DType::F16 => 2,
        other if runs.iter().any(|r| r.converted) => {
            return Err(RuntimeError::Weight(format!(
                "weights converted on the device are f32, bf16 or f16, not {other}"
            )))
        }
        _ => 0,
    };
    let out_bytes = |run: &StoredRun<'_>, rows: usize| match run.converted {
        true => rows * run.row_elements * width,
        false => rows * run.row_bytes,
    };
    let total = runs.iter().map(|run| out_bytes(run, run.rows)).sum();
    let buffer = device.alloc(total)?;
    let mut at = 0;
    for run in runs {
        let rows_a_launch = (chunk / run.row_elements.max(1)).max(1);
        for first in (0..run.rows).step_by(rows_a_launch) {
            let rows = rows_a_launch.min(run.rows - first);
            let stored = &run.bytes[first * run.row_bytes..(first + rows) * run.row_bytes];
            let made = out_bytes(run, rows);
            let staging = device.upload(stored)?;
            if run.converted {
                let n = rows * run.row_elements;
                let n = i32::try_from(n).map_err(|_| {
                    RuntimeError::Weight(format!("a row of {n} elements is past the conversion's 32-bit indices"))
                })?;
                let args = [
                    DeviceArg::Buffer(&staging, 0..stored.len()),
                    DeviceArg::Buffer(&buffer, at..at + made),
                    DeviceArg::I32(n),
                ];
                let kernel = convert_kernel_name(run.stored, dtype);
                device.launch(&kernel, (n as u32).div_ceil(BLOCK), BLOCK, &args)?;
            } else {
                device.copy(&staging, 0, &buffer, at, made)?;
            }
            device.release(staging);
            at += made;
        }
    }
    Ok((buffer, total))
}

#[cfg(test)]
mod tests {
    use super::super::weight_bytes::tests::spread_values;
    use super::super::weight_bytes::{stored_runs, weight_bytes};
    use super::*;
    use crate::emulator_device::EmulatorDevice;
    use gpu_plan::{Transposed, WeightPart};
    use kernels_gen::templates::weight_convert::{convert_kernel, converts};
    use proptest::prelude::*;
    use quant::tensor::{MemoryTensor, MemoryTensors};
    use quant::GgmlType;

    /// A `rows` × 64 tensor stored as `dtype`, of values spread over ±2 (NaN, infinity and
    /// signed zeros among them where it holds floats).
    fn tensor(dtype: GgmlType, rows: usize, seed: u32) -> MemoryTensor {
        let mut values = spread_values(seed, rows * 64);
        if matches!(dtype, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            values[..4].copy_from_slice(&[f32::NAN, f32::INFINITY, -0.0, 0.0]);
        }
        super::super::weight_bytes::tests::tensor(dtype, rows, 64, &values)
    }

    /// A device with every conversion kernel to `to` (none where `to` is no converted form).
    fn converting_device(to: DType) -> EmulatorDevice {
        let formats = [DType::F16, DType::BF16, DType::Q4_0, DType::Q8_0];
        EmulatorDevice::new(formats.iter().filter_map(|&f| convert_kernel(f, to)).collect())
    }

    proptest! {
        /// Two parts (whole, or row groups), each stored in any form the device converts or
        /// the plan keeps, into an f32, bf16 or f16 plan (or Q4_0 parts into a plan of their
        /// own form), in launches of one to three rows: the device makes the bytes the host
        /// makes, converting and stacking them in place.
        #[test]
        fn the_device_makes_what_the_host_makes(
            stored in (0usize..4, 0usize..4),
            plan in prop::sample::select(vec![DType::F32, DType::BF16, DType::F16, DType::Q4_0]),
            grouped in (any::<bool>(), any::<bool>()),
            chunk_rows in 1usize..4,
            seed in any::<u32>(),
        ) {
            let dtypes = [GgmlType::F16, GgmlType::BF16, GgmlType::Q4_0, GgmlType::Q8_0];
            // A plan of Q4_0 blocks takes only its own form, stacked.
            let kept = |s: usize| quant::tensor::ir_dtype(dtypes[s]) == plan;
            prop_assume!(matches!(plan, DType::F32 | DType::BF16 | DType::F16) || (kept(stored.0) && kept(stored.1)));
            let source: MemoryTensors = [
                ("a".to_string(), tensor(dtypes[stored.0], 12, seed)),
                ("b".to_string(), tensor(dtypes[stored.1], 8, seed ^ 1)),
            ]
            .into();
            let part = |name: &str, grouped: bool| match grouped {
                true => WeightPart::RowGroups { name: name.into(), group: 4, start: 1, len: 1 },
                false => WeightPart::Whole(name.into()),
            };
            let parts = [part("a", grouped.0), part("b", grouped.1)];
            // Two parts: stacked on the device, converted or not.
            let runs = stored_runs(plan, &parts, &source, &converts).unwrap().unwrap();
            let mut device = converting_device(plan);
            let (buffer, bytes) = make_on_device(&mut device, plan, &runs, chunk_rows * 64).unwrap();
            let want = weight_bytes(plan, &parts, &source).unwrap();
            prop_assert_eq!(bytes, want.len());
            prop_assert!(device.read(&buffer, 0..bytes).unwrap() == want.as_ref());
        }
    }

    /// What the device cannot make, the host makes: transposed row groups, or a stored form
    /// it has no kernel for; and one run already in the plan's form goes up as it lies. Runs
    /// to stack or convert, the device makes.
    #[test]
    fn the_host_makes_what_the_device_cannot() {
        let source: MemoryTensors = [
            ("h".to_string(), tensor(GgmlType::F16, 8, 3)),
            ("f".to_string(), tensor(GgmlType::F32, 8, 4)),
            ("q".to_string(), tensor(GgmlType::Q4_0, 8, 5)),
        ]
        .into();
        let host = |dtype, parts: &[WeightPart]| stored_runs(dtype, parts, &source, &converts).unwrap().is_none();
        let transposed = WeightPart::TransposedRowGroups {
            name: "h".into(),
            group: 4,
            start: 0,
            len: 1,
            transposed: Transposed::YES,
        };
        assert!(host(DType::BF16, &[WeightPart::Whole("q".into()), transposed]));
        assert!(host(
            DType::BF16,
            &[WeightPart::Whole("h".into()), WeightPart::Whole("f".into())]
        ));
        assert!(host(DType::Q4_0, &[WeightPart::Whole("q".into())]));
        assert!(host(DType::F32, &[WeightPart::Whole("f".into())]));
        // A device without the kernel for a part's form.
        let no_q4 = |d: DType| d != DType::Q4_0;
        assert!(
            stored_runs(DType::BF16, &[WeightPart::Whole("q".into())], &source, &no_q4)
                .unwrap()
                .is_none()
        );
        assert!(!host(
            DType::BF16,
            &[WeightPart::Whole("q".into()), WeightPart::Whole("h".into())]
        ));
        assert!(host(DType::F16, &[WeightPart::Whole("h".into())]));
        let groups = |name: &str| WeightPart::RowGroups {
            name: name.into(),
            group: 4,
            start: 1,
            len: 2,
        };
        // Two groups of f16 rows, kept as f16: two runs, stacked on the device.
        assert!(!host(DType::F16, &[groups("h")]));
        assert!(!host(
            DType::F32,
            &[WeightPart::Whole("f".into()), WeightPart::Whole("f".into())]
        ));
    }
}
