//! A step's launches: each kernel chosen (the prefill variant for launches of many rows), its
//! arguments resolved from the plan against the step's scalars, and launched (or timed).

use super::{BufferKey, Buffers, DeviceArg, LaunchProfile, PlanDevice, PlanExecutor};
use crate::error::{Result, RuntimeError};
use codegen::gpu::expr::{self, Value};
use codegen::gpu::{LaunchArg, FEW_ROWS, PREFILL_TOKENS};
use std::collections::HashMap;

impl<D: PlanDevice> PlanExecutor<D> {
    /// The plan's launches in order, arguments resolved against `vars`.
    /// With `profile`, each launch is timed and recorded there.
    pub(super) fn launch_all(
        &self,
        device: &mut D,
        buffers: &Buffers<D::Buffer>,
        vars: &HashMap<&str, Value>,
        mut profile: Option<&mut Vec<LaunchProfile>>,
    ) -> Result<()> {
        let step_tokens = vars.get("tokens").map_or(0, |v| v.as_i64());
        for launch in &self.plan.launches {
            // The prefill variant pays for launches of many rows, the few-rows one for a small
            // batch: by the launch's own row count
            // (its `tokens` argument; a per-sequence launch has one row per sequence), else
            // the step's.
            let rows = match launch.args.iter().find_map(|a| match a {
                LaunchArg::Scalar { name, value } if name == "tokens" => Some(value),
                _ => None,
            }) {
                Some(value) => expr::eval(value, vars)
                    .map_err(|e| RuntimeError::Artifact(e.to_string()))?
                    .as_i64(),
                None => step_tokens,
            };
            let name = match (&launch.prefill_kernel, &launch.few_rows_kernel) {
                (Some(p), _) if rows >= PREFILL_TOKENS as i64 => p,
                (_, Some(f)) if rows >= FEW_ROWS as i64 => f,
                _ => &launch.kernel,
            };
            let kernel = self
                .plan
                .kernels
                .iter()
                .find(|k| &k.name == name)
                .ok_or_else(|| RuntimeError::Artifact(format!("no kernel {name}")))?;
            let mut args = Vec::with_capacity(launch.args.len());
            let mut scalars: HashMap<&str, Value> = vars.clone();
            for (arg, param) in launch.args.iter().zip(&kernel.params) {
                args.push(match arg {
                    LaunchArg::Scalar { value, .. } => {
                        let v = expr::eval(value, vars).map_err(|e| RuntimeError::Artifact(e.to_string()))?;
                        scalars.insert(param.name.as_str(), v);
                        match param.kind.as_str() {
                            "float" => DeviceArg::F32(v.as_f64() as f32),
                            _ => DeviceArg::I32(v.as_i64() as i32),
                        }
                    }
                    other => self.resolve(other, buffers, vars)?,
                });
            }
            let grid = expr::eval(&kernel.grid, &scalars)
                .map_err(|e| RuntimeError::Artifact(e.to_string()))?
                .as_i64();
            if grid <= 0 {
                continue;
            }
            match profile.as_deref_mut() {
                None => device.launch(name, grid as u32, kernel.block, &args)?,
                Some(profile) => {
                    let seconds = device.launch_timed(name, grid as u32, kernel.block, &args)?;
                    let weight_bytes = self.weight_bytes_read(launch, &args, rows.max(0) as usize);
                    profile.push(LaunchProfile {
                        kernel: name.clone(),
                        seconds,
                        weight_bytes,
                    });
                }
            }
        }
        Ok(())
    }

    /// Bytes of weights `launch` reads over `rows` rows: all it is given, except that an
    /// embedding gathers one table row per row.
    fn weight_bytes_read(
        &self,
        launch: &codegen::gpu::Launch,
        args: &[DeviceArg<'_, D::Buffer>],
        rows: usize,
    ) -> usize {
        let node = &self.graph.nodes()[launch.node];
        let given = launch
            .args
            .iter()
            .zip(args)
            .map(|(arg, device_arg)| match (arg, device_arg) {
                (LaunchArg::Weight { node }, DeviceArg::Buffer(_, r)) => (*node, r.len()),
                (LaunchArg::Derived { .. }, DeviceArg::Buffer(_, r)) => (usize::MAX, r.len()),
                _ => (usize::MAX, 0),
            });
        given
            .map(|(weight, bytes)| match (&node.op, self.graph.nodes().get(weight)) {
                (ir::Op::Embedding, Some(table)) => {
                    let table_rows = table.shape.resolve(0, 0).first().copied().unwrap_or(1).max(1);
                    bytes / table_rows * rows.min(table_rows)
                }
                _ => bytes,
            })
            .sum()
    }

    /// A buffer argument: which buffer, and the bytes of it the launch may touch.
    fn resolve<'b>(
        &self,
        arg: &LaunchArg,
        buffers: &'b Buffers<D::Buffer>,
        vars: &HashMap<&str, Value>,
    ) -> Result<DeviceArg<'b, D::Buffer>> {
        // A buffer the plan placed outside the arena, whole, or what is missing.
        let held = |key: BufferKey, what: String| {
            let (buffer, range) = buffers
                .whole(&key)
                .ok_or_else(|| RuntimeError::Artifact(format!("{what} missing")))?;
            Ok::<_, RuntimeError>(DeviceArg::Buffer(buffer, range))
        };
        Ok(match arg {
            LaunchArg::Activation { node, offset } => {
                let elems = expr::eval(offset, vars)
                    .map_err(|e| RuntimeError::Artifact(e.to_string()))?
                    .as_i64() as usize;
                let range = self.buffer(*node, None)?;
                DeviceArg::Buffer(&buffers.arena, (range.start + 4 * elems).min(range.end)..range.end)
            }
            LaunchArg::Scratch { node, name, .. } => DeviceArg::Buffer(&buffers.arena, self.buffer(*node, Some(name))?),
            LaunchArg::Weight { node } => held(BufferKey::Weight(*node), format!("weight %{node}"))?,
            LaunchArg::KvCache { slot, value } => held(BufferKey::Kv(*slot, *value), format!("KV cache {slot}"))?,
            LaunchArg::Constant { name } => held(BufferKey::Constant(name.clone()), format!("constant `{name}`"))?,
            LaunchArg::Derived { weight, tensor } => held(
                BufferKey::Derived(weight.clone(), tensor.clone()),
                format!("INT8 rows of `{weight}` (from the artifact)"),
            )?,
            LaunchArg::StepInput { name } => held(
                BufferKey::StepInput(name.clone()),
                format!("step input `{name}` (the plan is not batched)"),
            )?,
            LaunchArg::Scalar { .. } => unreachable!("scalars are resolved by the caller"),
        })
    }
}
