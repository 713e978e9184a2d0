//! A launch that runs in some steps and not others, the plan choosing by the step's shape:
//! its grid multiplied by a 0-or-1 scalar the plan computes from the step's row and sequence
//! counts. A step either launches the kernel whole or skips it (an empty grid launches
//! nothing), and a CUDA graph captured for one shape of step keeps its choice, since the
//! choice is a function of that shape. What lets a plan hold two ways to compute one value
//! (attention on the tensor cores for prompts, split over blocks for decode rows) without a
//! launch-time condition in the runtime.

use crate::dsl::*;

/// `kernel` launched only where its scalar `gate` (added last to its launch parameters,
/// before any tensor maps, which the launcher derives) is 1.
pub fn gated(mut kernel: Kernel, gate: &str) -> Kernel {
    kernel.grid = kernel.grid * var(gate);
    let maps = kernel
        .params
        .iter()
        .position(|p| matches!(p, Param::TensorMap(_)))
        .unwrap_or(kernel.params.len());
    kernel.params.insert(maps, scalar(gate, Ty::I32));
    kernel
        .origin
        .push_str(&format!("; launched in the steps whose `{gate}` is 1"));
    kernel
}
