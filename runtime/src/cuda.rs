//! The CUDA backend: runs a GPU artifact's `plan.json` with cudarc (the driver is loaded at run
//! time, so this builds and links everywhere). Loads every kernel's PTX, uploads the weights
//! in the layout the kernels expect (row-stacked, bf16 or GGUF blocks as the plan says, the
//! INT8 heads from the artifact), allocates the activation arena and the KV cache, and runs a
//! step as the plan's launches in order on one stream.
//!
//! Without an NVIDIA driver, [`CudaBackend::new`] returns [`RuntimeError::NoCudaDriver`]: never
//! a panic. Not yet: CUDA graphs for decode, several sequences at once. Nothing here has run on
//! a GPU yet: `scripts/gpu-check.sh` is the check to run where one is lent.

use crate::error::{Result, RuntimeError};
use codegen::gpu::expr::{self, Value};
use codegen::gpu::{GpuPlan, LaunchArg, PREFILL_TOKENS};
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use half::bf16;
use ir::{DType, Graph, Tensor};
use models::WeightSource;
use passes::weight_transforms::Int8Rows;
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Whether an NVIDIA driver can be loaded here.
pub fn driver_present() -> bool {
    // SAFETY: probing for the library has no side effect beyond loading it.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

struct Device {
    stream: Arc<CudaStream>,
    functions: HashMap<String, CudaFunction>,
    arena: CudaSlice<u8>,
    weights: HashMap<usize, CudaSlice<u8>>,
    derived: HashMap<(String, String), CudaSlice<u8>>,
    constants: HashMap<String, CudaSlice<u8>>,
    kv: HashMap<(usize, bool), CudaSlice<u8>>,
}

pub struct CudaBackend {
    plan: GpuPlan,
    graph: Graph,
    context_length: usize,
    device: Mutex<Device>,
}

/// A sequence's state on the device is the backend's KV cache; this is its length.
#[derive(Debug, Default, Clone)]
pub struct CudaSequence {
    pub len: usize,
}

fn driver(e: cudarc::driver::DriverError) -> RuntimeError {
    RuntimeError::Cuda(format!("{e:?}"))
}

enum Arg {
    Ptr(u64),
    I32(i32),
    F32(f32),
}

impl CudaBackend {
    /// Load `plan_file` of the artifact in `dir` for `graph`, with the model's weights.
    pub fn new(
        dir: &Path,
        plan_file: &str,
        graph: Graph,
        weights: &WeightSource,
        int8: &[(String, Int8Rows)],
        context_length: usize,
    ) -> Result<Self> {
        if !driver_present() {
            return Err(RuntimeError::NoCudaDriver);
        }
        let text = std::fs::read_to_string(dir.join(plan_file))
            .map_err(|e| RuntimeError::Artifact(format!("{plan_file}: {e}")))?;
        let plan: GpuPlan =
            serde_json::from_str(&text).map_err(|e| RuntimeError::Artifact(format!("{plan_file}: {e}")))?;
        let ctx = CudaContext::new(0).map_err(driver)?;
        let stream = ctx.default_stream();
        let mut functions = HashMap::new();
        for k in &plan.kernels {
            let ptx_path = k
                .ptx
                .as_ref()
                .ok_or_else(|| RuntimeError::Artifact(format!("kernel {} has no PTX", k.name)))?;
            let ptx = std::fs::read_to_string(dir.join(ptx_path))
                .map_err(|e| RuntimeError::Artifact(format!("{ptx_path}: {e}")))?;
            let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)).map_err(driver)?;
            functions.insert(k.name.clone(), module.load_function(&k.name).map_err(driver)?);
        }
        let upload = |bytes: &[u8]| stream.clone_htod(bytes).map_err(driver);
        let mut device_weights = HashMap::new();
        for w in &plan.weights {
            device_weights.insert(w.node, upload(&weight_bytes(w.dtype, &w.parts, weights)?)?);
        }
        let mut derived = HashMap::new();
        for (name, rows) in int8 {
            let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
            let tensors: [(&str, Vec<u8>); 5] = [
                ("q", rows.q.iter().map(|&q| q as u8).collect()),
                ("scale", f32s(&rows.scale)),
                ("err_norm", f32s(&rows.err_norm)),
                ("quant_norm", f32s(&rows.quant_norm)),
                ("norm", f32s(&rows.norm)),
            ];
            for (tensor, bytes) in tensors {
                derived.insert((name.clone(), tensor.to_string()), upload(&bytes)?);
            }
        }
        let mut constants = HashMap::new();
        for (name, values) in &plan.constants {
            constants.insert(
                name.clone(),
                upload(&values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?,
            );
        }
        let mut kv = HashMap::new();
        for layout in &plan.kv_cache {
            for value in [false, true] {
                kv.insert(
                    (layout.slot, value),
                    stream
                        .alloc_zeros::<u8>(context_length * layout.bytes_per_token)
                        .map_err(driver)?,
                );
            }
        }
        let arena = stream
            .alloc_zeros::<u8>(plan.memory.arena_bytes.max(1))
            .map_err(driver)?;
        let device = Device {
            stream,
            functions,
            arena,
            weights: device_weights,
            derived,
            constants,
            kv,
        };
        Ok(Self {
            plan,
            graph,
            context_length,
            device: Mutex::new(device),
        })
    }

    pub fn context_length(&self) -> usize {
        self.context_length
    }

    pub fn new_sequence(&self) -> CudaSequence {
        CudaSequence::default()
    }

    /// Process `ids` as the next tokens of `seq` (the one sequence the KV cache holds).
    pub fn step(&self, seq: &mut CudaSequence, ids: &[u32]) -> Result<HashMap<String, Tensor>> {
        let tokens = ids.len();
        if tokens == 0 || tokens > self.plan.max_tokens {
            return Err(RuntimeError::Input(format!(
                "a GPU step takes 1 to {} tokens, got {tokens}",
                self.plan.max_tokens
            )));
        }
        if seq.len + tokens > self.context_length {
            return Err(RuntimeError::ContextOverflow {
                needed: seq.len + tokens,
                limit: self.context_length,
            });
        }
        let mut d = self
            .device
            .lock()
            .map_err(|_| RuntimeError::Cuda("device state poisoned".into()))?;
        let offset_of = |node: usize, scratch: Option<&str>| -> Result<usize> {
            self.plan
                .memory
                .buffers
                .iter()
                .find(|b| b.node == node && b.scratch.as_deref() == scratch)
                .map(|b| b.offset)
                .ok_or_else(|| RuntimeError::Artifact(format!("no planned buffer for %{node} {scratch:?}")))
        };
        // Inputs: token ids and positions as i32 at their planned offsets.
        let positions: Vec<i32> = (seq.len..seq.len + tokens).map(|p| p as i32).collect();
        let id_values: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        for (node, values) in [(self.plan.token_ids, &id_values), (self.plan.positions, &positions)] {
            if let Some(node) = node {
                let at = offset_of(node, None)?;
                let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                let Device { stream, arena, .. } = &mut *d;
                stream
                    .memcpy_htod(&bytes, &mut arena.slice_mut(at..at + bytes.len()))
                    .map_err(driver)?;
            }
        }
        let vars: HashMap<&str, Value> = HashMap::from([
            ("tokens", Value::Int(tokens as i64)),
            ("first", Value::Int(seq.len as i64)),
        ]);
        for launch in &self.plan.launches {
            let name = match &launch.prefill_kernel {
                Some(p) if tokens >= PREFILL_TOKENS => p,
                _ => &launch.kernel,
            };
            let kernel = self
                .plan
                .kernels
                .iter()
                .find(|k| &k.name == name)
                .ok_or_else(|| RuntimeError::Artifact(format!("no kernel {name}")))?;
            let ptr = |slice: &CudaSlice<u8>, stream: &CudaStream| slice.device_ptr(stream).0;
            let mut args = Vec::with_capacity(launch.args.len());
            let mut scalars: HashMap<&str, Value> = vars.clone();
            for (arg, param) in launch.args.iter().zip(&kernel.params) {
                let dev = &*d;
                args.push(match arg {
                    LaunchArg::Activation { node, offset } => {
                        let elems = expr::eval(offset, &vars)
                            .map_err(|e| RuntimeError::Artifact(e.to_string()))?
                            .as_i64() as u64;
                        Arg::Ptr(ptr(&dev.arena, &dev.stream) + offset_of(*node, None)? as u64 + 4 * elems)
                    }
                    LaunchArg::Scratch { node, name, .. } => {
                        Arg::Ptr(ptr(&dev.arena, &dev.stream) + offset_of(*node, Some(name))? as u64)
                    }
                    LaunchArg::Weight { node } => Arg::Ptr(ptr(
                        dev.weights
                            .get(node)
                            .ok_or_else(|| RuntimeError::Artifact(format!("weight %{node} missing")))?,
                        &dev.stream,
                    )),
                    LaunchArg::KvCache { slot, value } => Arg::Ptr(ptr(&dev.kv[&(*slot, *value)], &dev.stream)),
                    LaunchArg::Constant { name } => Arg::Ptr(ptr(&dev.constants[name], &dev.stream)),
                    LaunchArg::Derived { weight, tensor } => Arg::Ptr(ptr(
                        dev.derived.get(&(weight.clone(), tensor.clone())).ok_or_else(|| {
                            RuntimeError::Artifact(format!("INT8 rows of `{weight}` missing from the artifact"))
                        })?,
                        &dev.stream,
                    )),
                    LaunchArg::Scalar { value, .. } => {
                        let v = expr::eval(value, &vars).map_err(|e| RuntimeError::Artifact(e.to_string()))?;
                        scalars.insert(param.name.as_str(), v);
                        match param.kind.as_str() {
                            "float" => Arg::F32(v.as_f64() as f32),
                            _ => Arg::I32(v.as_i64() as i32),
                        }
                    }
                });
            }
            let grid = expr::eval(&kernel.grid, &scalars)
                .map_err(|e| RuntimeError::Artifact(e.to_string()))?
                .as_i64();
            if grid <= 0 {
                continue;
            }
            let config = LaunchConfig {
                grid_dim: (grid as u32, 1, 1),
                block_dim: (kernel.block, 1, 1),
                shared_mem_bytes: 0,
            };
            let dev = &*d;
            let mut builder = dev.stream.launch_builder(&dev.functions[name]);
            for a in &args {
                match a {
                    Arg::Ptr(p) => builder.arg(p),
                    Arg::I32(v) => builder.arg(v),
                    Arg::F32(v) => builder.arg(v),
                };
            }
            // SAFETY: the arguments bind one for one to the kernel's parameters (the plan is
            // checked for it), pointers lie inside buffers sized by the plan.
            unsafe { builder.launch(config) }.map_err(driver)?;
        }
        seq.len += tokens;
        let mut outputs = HashMap::new();
        for (name, node) in &self.plan.outputs {
            let shape = self.graph.nodes()[*node].shape.resolve(tokens, seq.len);
            let at = offset_of(*node, None)?;
            let len = shape.iter().product::<usize>();
            let bytes = d.stream.clone_dtoh(&d.arena.slice(at..at + 4 * len)).map_err(driver)?;
            let data: Vec<f32> = match self.graph.nodes()[*node].dtype {
                DType::I32 => bytes
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32)
                    .collect(),
                _ => bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            };
            outputs.insert(name.clone(), Tensor::new(shape, data));
        }
        Ok(outputs)
    }
}

/// A weight as the kernels read it: the parts stacked by rows, converted to `dtype` (f32, bf16)
/// or kept as GGUF blocks.
fn weight_bytes(dtype: DType, parts: &[String], source: &WeightSource) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    for name in parts {
        let view = source
            .get(name)
            .ok_or_else(|| RuntimeError::Weight(format!("`{name}` is not in the weights")))?;
        match dtype {
            DType::F32 => out.extend(view.to_f32().data.iter().flat_map(|v| v.to_le_bytes())),
            DType::BF16 => out.extend(view.to_f32().data.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes())),
            quant if models::weights::ir_dtype(view.dtype) == quant => out.extend_from_slice(view.bytes),
            other => {
                return Err(RuntimeError::Weight(format!(
                    "`{name}` is {} but the plan wants {other}",
                    view.dtype.name()
                )))
            }
        }
    }
    Ok(out)
}
