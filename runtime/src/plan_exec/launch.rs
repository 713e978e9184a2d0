//! A step's launches: each kernel chosen (the prefill variant for launches of many rows), its
//! arguments resolved from the plan against the step's scalars, and launched (or timed).
//!
//! What does not change from step to step is resolved once, when the plan is loaded
//! (`prepare`): each launch's kernels, its expressions parsed, and the arena range of each
//! activation it reads or writes. Resolving them per launch cost the host 1.5 µs a launch
//! (`cargo bench --bench plan_host`: a linear search of the planned buffers per argument and a
//! parse per expression), paid by every step not replayed from a CUDA graph: a prefill step's
//! few hundred launches.

use super::{BufferKey, Buffers, DeviceArg, LaunchProfile, PlanDevice, PlanExecutor};
use crate::error::{Result, RuntimeError};
use gpu_plan::expr::{Compiled, ExprError, Value};
use gpu_plan::{GpuPlan, LaunchArg, BATCH_ROWS, FEW_ROWS, PREFILL_TOKENS};
use std::collections::HashMap;
use std::ops::Range;

/// One launch of the plan, resolved.
pub(super) struct PreparedLaunch {
    /// Its place in the plan's launches.
    index: usize,
    /// Its own row count (its `tokens` argument; a per-sequence launch has one row per
    /// sequence), where it has one; else the step's.
    rows: Option<Compiled>,
    kernel: Variant,
    few_rows: Option<Variant>,
    prefill: Option<Variant>,
    batch: Option<Variant>,
    args: Vec<Arg>,
}

/// A kernel a launch may run: each binds the first of the launch's arguments, in order.
struct Variant {
    name: String,
    block: u32,
    grid: Compiled,
    /// Parameter names, and whether each is a float scalar.
    params: Vec<(String, bool)>,
}

enum Arg {
    Scalar(Compiled),
    /// From `offset` elements (an expression) into the arena range of an activation.
    Activation {
        range: Range<usize>,
        offset: Compiled,
    },
    Scratch(Range<usize>),
    Held(BufferKey),
}

fn artifact(e: ExprError) -> RuntimeError {
    RuntimeError::Artifact(e.to_string())
}

/// Resolve `plan`'s launches (errors name what the artifact lacks: a kernel, a planned buffer,
/// an expression that does not parse).
pub(super) fn prepare(plan: &GpuPlan) -> Result<Vec<PreparedLaunch>> {
    let variant = |name: &str| -> Result<Variant> {
        let kernel = plan
            .kernels
            .iter()
            .find(|k| k.name == name)
            .ok_or_else(|| RuntimeError::Artifact(format!("no kernel {name}")))?;
        Ok(Variant {
            name: name.into(),
            block: kernel.block,
            grid: Compiled::parse(&kernel.grid).map_err(artifact)?,
            params: kernel
                .params
                .iter()
                .map(|p| (p.name.clone(), p.kind == "float"))
                .collect(),
        })
    };
    let buffer = |node: usize, scratch: Option<&str>| super::planned_buffer(plan, node, scratch);
    let arg = |arg: &LaunchArg| -> Result<Arg> {
        Ok(match arg {
            LaunchArg::Scalar { value, .. } => Arg::Scalar(Compiled::parse(value).map_err(artifact)?),
            LaunchArg::Activation { node, offset } => Arg::Activation {
                range: buffer(*node, None)?,
                offset: Compiled::parse(offset).map_err(artifact)?,
            },
            LaunchArg::Scratch { node, name, .. } => Arg::Scratch(buffer(*node, Some(name))?),
            LaunchArg::Weight { node } | LaunchArg::WeightPrefetch { node } => Arg::Held(BufferKey::Weight(*node)),
            LaunchArg::KvCache { slot, value } => Arg::Held(BufferKey::Kv(*slot, *value)),
            LaunchArg::RecurrentState { slot } => Arg::Held(BufferKey::State(*slot)),
            LaunchArg::StateCheckpoints { slot } => Arg::Held(BufferKey::Checkpoints(*slot)),
            LaunchArg::Constant { name } => Arg::Held(BufferKey::Constant(name.clone())),
            LaunchArg::Derived { weight, tensor } => Arg::Held(BufferKey::Derived(weight.clone(), tensor.clone())),
            LaunchArg::StepInput { name } => Arg::Held(BufferKey::StepInput(name.clone())),
            LaunchArg::PositionScores => Arg::Held(BufferKey::PositionScores),
        })
    };
    plan.launches
        .iter()
        .enumerate()
        .map(|(index, launch)| {
            let rows = launch.args.iter().find_map(|a| match a {
                LaunchArg::Scalar { name, value } if name == "tokens" => Some(value),
                _ => None,
            });
            let prepared = PreparedLaunch {
                index,
                rows: rows.map(|r| Compiled::parse(r).map_err(artifact)).transpose()?,
                kernel: variant(&launch.kernel)?,
                few_rows: launch.few_rows_kernel.as_deref().map(variant).transpose()?,
                prefill: launch.prefill_kernel.as_deref().map(variant).transpose()?,
                batch: launch.batch_kernel.as_deref().map(variant).transpose()?,
                args: launch.args.iter().map(arg).collect::<Result<_>>()?,
            };
            // Each kernel binds the first of the arguments: there must be one per parameter.
            let kernels = [
                Some(&prepared.kernel),
                prepared.few_rows.as_ref(),
                prepared.prefill.as_ref(),
                prepared.batch.as_ref(),
            ];
            if let Some(short) = kernels
                .into_iter()
                .flatten()
                .find(|k| k.params.len() > prepared.args.len())
            {
                return Err(RuntimeError::Artifact(format!(
                    "a launch of {} gives {} arguments for its {} parameters",
                    short.name,
                    prepared.args.len(),
                    short.params.len()
                )));
            }
            Ok(prepared)
        })
        .collect()
}

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
        let lookup = |name: &str| vars.get(name).copied();
        for launch in &self.launches {
            let rows = match &launch.rows {
                Some(rows) => rows.eval(&lookup).map_err(artifact)?.as_i64(),
                None => step_tokens,
            };
            // The prefill variant pays for launches of many rows (the batch one, where there
            // is one, up to a decode batch's), the few-rows one for a small batch.
            let kernel = match (&launch.prefill, &launch.batch, &launch.few_rows) {
                (_, Some(b), _) if (PREFILL_TOKENS as i64..=BATCH_ROWS as i64).contains(&rows) => b,
                (Some(p), _, _) if rows >= PREFILL_TOKENS as i64 => p,
                (_, _, Some(f)) if rows >= FEW_ROWS as i64 => f,
                _ => &launch.kernel,
            };
            let mut args = Vec::with_capacity(kernel.params.len());
            // The kernel's scalars by parameter name: what its grid is an expression of.
            let mut scalars: Vec<(&str, Value)> = Vec::with_capacity(kernel.params.len());
            for (arg, (param, float)) in launch.args.iter().zip(&kernel.params) {
                args.push(match arg {
                    Arg::Scalar(value) => {
                        let v = value.eval(&lookup).map_err(artifact)?;
                        scalars.push((param, v));
                        match float {
                            true => DeviceArg::F32(v.as_f64() as f32),
                            false => DeviceArg::I32(v.as_i64() as i32),
                        }
                    }
                    Arg::Activation { range, offset } => {
                        let elems = offset.eval(&lookup).map_err(artifact)?.as_i64() as usize;
                        DeviceArg::Buffer(&buffers.arena, (range.start + 4 * elems).min(range.end)..range.end)
                    }
                    Arg::Scratch(range) => DeviceArg::Buffer(&buffers.arena, range.clone()),
                    Arg::Held(key) => held(buffers, key)?,
                });
            }
            let in_scope = |name: &str| {
                scalars
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| *v)
                    .or_else(|| lookup(name))
            };
            let grid = kernel.grid.eval(&in_scope).map_err(artifact)?.as_i64();
            if grid <= 0 {
                continue;
            }
            match profile.as_deref_mut() {
                None => device.launch(&kernel.name, grid as u32, kernel.block, &args)?,
                Some(profile) => {
                    let seconds = device.launch_timed(&kernel.name, grid as u32, kernel.block, &args)?;
                    let plan_launch = &self.plan.launches[launch.index];
                    let weight_bytes = self.weight_bytes_read(plan_launch, &args, rows.max(0) as usize);
                    profile.push(LaunchProfile {
                        kernel: kernel.name.clone(),
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
    fn weight_bytes_read(&self, launch: &gpu_plan::Launch, args: &[DeviceArg<'_, D::Buffer>], rows: usize) -> usize {
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
}

/// A buffer the plan placed outside the arena, whole, or what is missing.
fn held<'b, B>(buffers: &'b Buffers<B>, key: &BufferKey) -> Result<DeviceArg<'b, B>> {
    let (buffer, range) = buffers.whole(key).ok_or_else(|| {
        RuntimeError::Artifact(match key {
            BufferKey::Weight(node) => format!("weight %{node} missing"),
            BufferKey::Kv(slot, _) => format!("KV cache {slot} missing"),
            BufferKey::State(slot) => format!("recurrent state {slot} missing"),
            BufferKey::Snapshots(slot) => format!("snapshots of recurrent state {slot} missing"),
            BufferKey::Checkpoints(slot) => format!("checkpoints of recurrent state {slot} missing"),
            BufferKey::Constant(name) => format!("constant `{name}` missing"),
            BufferKey::Derived(weight, tensor) if tensor == gpu_plan::SHORTLIST_TENSOR => {
                format!("the 4-bit copy of `{weight}` (made from the plan's weight) missing")
            }
            BufferKey::Derived(weight, _) => format!("INT8 rows of `{weight}` (from the artifact) missing"),
            BufferKey::StepInput(name) => format!("step input `{name}` (the plan is not batched) missing"),
            BufferKey::PositionScores => "position scores (the plan does not say it ranks positions) missing".into(),
        })
    })?;
    Ok(DeviceArg::Buffer(buffer, range))
}
