//! A kernel's machine code without register spills.
//!
//! ptxas chooses each kernel's register budget from `__launch_bounds__(threads)` alone, and
//! that choice can spill where a budget it is told about does not: NVRTC 13.5 gave the f32
//! decode GEMV (activation read in vectors) 32 registers on sm_100a and spilled 8 bytes, and
//! the same kernel asked to fit 8 blocks an SM (the same 32 registers) spills nothing. So a
//! kernel that spills is built again asking for a number of blocks per SM, from as many as
//! the SM holds down to one (each step allows more registers a thread), and the first build
//! without spills is kept, its source with it. Artifacts refuse a kernel that still spills;
//! the GPU check times whatever the build gives.

use crate::nvrtc::{self, NvrtcError, Resources};

/// A cubin, the source it was built from and what ptxas reported.
#[derive(Debug)]
pub struct Built {
    pub source: String,
    pub cubin: Vec<u8>,
    /// `None` where ptxas's log held no report (see [`nvrtc::compile_cubin`]).
    pub resources: Option<Resources>,
    /// The blocks per SM ptxas was asked to fit, where its own choice spilled.
    pub min_blocks_per_sm: Option<u32>,
}

impl Built {
    /// Whether ptxas reported spills (a build without a report is not known to spill).
    pub fn spills(&self) -> bool {
        self.resources
            .as_ref()
            .is_some_and(|r| r.spill_stores + r.spill_loads > 0)
    }
}

/// Build `source` (as `kernels_gen::cuda::emit` wrote it, blocks of `block` threads) for the
/// real architecture `arch`: ptxas's own build unless it reports spills, else the first build
/// without spills asking for fewer and fewer blocks an SM, else ptxas's own build (which
/// [`Built::spills`]).
pub fn build(kernel: &str, source: &str, block: u32, arch: &str) -> Result<Built, NvrtcError> {
    let build_one = |source: String, min_blocks_per_sm| -> Result<Built, NvrtcError> {
        let (cubin, resources) = nvrtc::compile_cubin(kernel, &source, arch)?;
        Ok(Built {
            source,
            cubin,
            resources,
            min_blocks_per_sm,
        })
    };
    let own = build_one(source.to_string(), None)?;
    if !own.spills() {
        return Ok(own);
    }
    for min_blocks in (1..=max_threads_per_sm(arch) / block.max(1)).rev() {
        let Some(hinted) = kernels_gen::cuda::with_min_blocks_per_sm(source, block, min_blocks) else {
            break;
        };
        let built = build_one(hinted, Some(min_blocks))?;
        if built.resources.is_some() && !built.spills() {
            return Ok(built);
        }
    }
    Ok(own)
}

/// Resident threads an SM of `arch` holds: 1536 on consumer Blackwell (sm_120), 2048 on
/// Hopper and datacenter Blackwell.
fn max_threads_per_sm(arch: &str) -> u32 {
    if arch.starts_with("sm_120") || arch.starts_with("compute_120") {
        1536
    } else {
        2048
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_sm_holds_the_threads_of_its_architecture() {
        assert_eq!(max_threads_per_sm("sm_90a"), 2048);
        assert_eq!(max_threads_per_sm("sm_100a"), 2048);
        assert_eq!(max_threads_per_sm("sm_120a"), 1536);
    }
}
