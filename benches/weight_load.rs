//! Loading a GPU plan's weights from host tensors, as `bbc serve` loads an artifact's:
//! `PlanExecutor::new` on a device whose uploads copy the bytes into host memory (what the
//! driver's copy reads; the memory touched beforehand, as a device's is there), for a
//! Llama-shaped model of about 0.4 B parameters held as a bf16 checkpoint, an f16 GGUF file,
//! a Q4_0 one and an f32 checkpoint, into a bf16 plan; the GGUFs also converted on the device
//! (what the host does then: upload the stored bytes). Each beside a plain copy of the plan's weight bytes
//! into the same memory (the yardstick a load cannot beat: every byte read once and written
//! once). `cargo bench --bench weight_load`.

use codegen::Target;
use models::{ComputeDtype, KvCacheDtype, LogitsFor, LowerOptions, ModelConfig};
use quant::tensor::{MemoryTensor, MemoryTensors};
use quant::GgmlType;
use runtime::plan_exec::{DeviceArg, PlanDevice, PlanExecutor};
use runtime::Result;
use std::ops::Range;
use std::time::Instant;

/// Uploads are copies into `memory` (each from its start; it holds the largest), nothing
/// else runs.
struct CopyingDevice {
    memory: Vec<u8>,
    uploaded: usize,
}

impl CopyingDevice {
    fn store(&mut self, bytes: &[u8]) {
        self.memory[..bytes.len()].copy_from_slice(bytes);
        self.uploaded += bytes.len();
    }
}

impl PlanDevice for CopyingDevice {
    type Buffer = usize;

    fn alloc(&mut self, bytes: usize) -> Result<usize> {
        Ok(bytes)
    }

    fn upload(&mut self, bytes: &[u8]) -> Result<usize> {
        self.store(bytes);
        Ok(bytes.len())
    }

    fn write(&mut self, _: &usize, _: usize, bytes: &[u8]) -> Result<()> {
        self.store(bytes);
        Ok(())
    }

    fn read(&mut self, _: &usize, range: Range<usize>) -> Result<Vec<u8>> {
        Ok(vec![0; range.len()])
    }

    fn copy(&mut self, _: &usize, _: usize, _: &usize, _: usize, _: usize) -> Result<()> {
        Ok(())
    }

    fn launch(&mut self, _: &str, _: u32, _: u32, _: &[DeviceArg<'_, usize>]) -> Result<()> {
        Ok(())
    }
}

/// `tensors` with every bf16 matrix stored as `to` (f16, f32 or Q4_0 blocks) instead.
fn stored_as(tensors: &MemoryTensors, to: GgmlType) -> MemoryTensors {
    tensors
        .iter()
        .map(|(name, t)| {
            let bytes = match t.dtype {
                GgmlType::BF16 if to == GgmlType::Q4_0 => {
                    let values: Vec<f32> = t
                        .bytes
                        .chunks_exact(2)
                        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                        .collect();
                    values.chunks(t.shape[1]).flat_map(quant::q4_0::quantize_row).collect()
                }
                GgmlType::BF16 if to != GgmlType::BF16 => t
                    .bytes
                    .chunks_exact(2)
                    .flat_map(|b| {
                        let v = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
                        match to {
                            GgmlType::F16 => half::f16::from_f32(v).to_le_bytes().to_vec(),
                            _ => v.to_le_bytes().to_vec(),
                        }
                    })
                    .collect(),
                _ => t.bytes.clone(),
            };
            let dtype = if t.dtype == GgmlType::BF16 { to } else { t.dtype };
            (
                name.clone(),
                MemoryTensor {
                    shape: t.shape.clone(),
                    dtype,
                    bytes,
                },
            )
        })
        .collect()
}

fn main() {
    let config = ModelConfig {
        vocab_size: 32_000,
        hidden: 2048,
        layers: 4,
        heads: 16,
        kv_heads: 8,
        head_dim: 128,
        intermediate: 8192,
        ..ModelConfig::llama3_8b()
    };
    let options = LowerOptions {
        logits: LogitsFor::LastToken,
        compute: ComputeDtype::Bf16,
        kv_cache: KvCacheDtype::Auto,
    };
    let graph = models::lower_without_weights(&config, options).unwrap();
    let target = Target::H200;
    let graph = passes::optimized(&graph, bbc::model_ref::cost_model(target)).unwrap();
    let plan = codegen::gpu::build(&graph, target, 64).unwrap();
    let bf16 = runtime::random_weights::host_weights(&graph, 3);
    let (f16, q4_0) = (stored_as(&bf16, GgmlType::F16), stored_as(&bf16, GgmlType::Q4_0));
    // Converted on the device: the plan carries the conversion kernels, and the host only
    // uploads the stored bytes (this device's launches do nothing; a GPU converts a GB in a
    // few milliseconds).
    let sources = [
        ("bf16 checkpoint", &stored_as(&bf16, GgmlType::BF16), false),
        ("f16 GGUF", &f16, false),
        ("f16 GGUF, device", &f16, true),
        ("Q4_0 GGUF", &q4_0, false),
        ("Q4_0 GGUF, device", &q4_0, true),
        ("f32 checkpoint", &stored_as(&bf16, GgmlType::F32), false),
    ];
    println!(
        "{:>18} {:>12} {:>10} {:>10} {:>12}",
        "source", "bytes up", "load s", "GB/s", "copy / load"
    );
    let largest = plan
        .weights
        .iter()
        .map(|w| w.shape.iter().product::<usize>() * 4)
        .max()
        .unwrap_or(0);
    for (what, tensors, on_device) in sources {
        let device = CopyingDevice {
            memory: vec![1; largest],
            uploaded: 0,
        };
        let (mut plan, graph) = (plan.clone(), graph.clone());
        if on_device {
            let conversions = codegen::gpu::weight_conversions(&plan, tensors);
            plan.kernels.extend(conversions.iter().map(codegen::gpu::kernel_entry));
        }
        let started = Instant::now();
        let exec = PlanExecutor::new(device, plan, graph, tensors, &[], 256).unwrap();
        let seconds = started.elapsed().as_secs_f64();
        let bytes = exec.with_device(|d| d.uploaded).unwrap();
        // The yardstick: as many bytes copied, a largest weight's at a time, into the same
        // (touched) memory.
        let source: Vec<u8> = vec![2; largest];
        let copy = exec
            .with_device_mut(|d| {
                let started = Instant::now();
                let mut left = bytes;
                while left > 0 {
                    let n = left.min(largest);
                    d.memory[..n].copy_from_slice(&source[..n]);
                    left -= n;
                }
                started.elapsed().as_secs_f64()
            })
            .unwrap();
        println!(
            "{what:>18} {:>12} {seconds:>10.3} {:>10.2} {:>12.2}",
            bytes,
            bytes as f64 / seconds / 1e9,
            copy / seconds
        );
    }
}
