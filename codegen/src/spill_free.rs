//! A kernel's machine code without register spills.
//!
//! ptxas chooses each kernel's register budget from `__launch_bounds__(threads)` alone, and
//! that choice can spill where a budget it is told about does not: NVRTC 13.5 gave the f32
//! decode GEMV (activation read in vectors) 32 registers on sm_100a and spilled 8 bytes, and
//! the same kernel asked to fit 8 blocks an SM (the same 32 registers) spills nothing. So a
//! kernel that spills is built again asking for a number of blocks per SM: the most, from as
//! many as the SM holds down to one, whose build has no spills is kept, its source with it.
//! Fewer blocks allow each thread more registers, so the counts that build without spills
//! are those up to some most, which bisection finds in a handful of builds (a tensor-core
//! attention kernel fitting only 2 blocks took 15 builds counted down one by one). Artifacts
//! refuse a kernel that still spills; the GPU check times whatever the build gives.

use crate::nvrtc::{self, NvrtcError, Resources};

/// A cubin and its PTX, the source they were built from and what ptxas reported.
#[derive(Debug)]
pub struct Built {
    pub source: String,
    pub cubin: Vec<u8>,
    pub ptx: String,
    /// `None` where ptxas's log held no report (see [`nvrtc::MachineCode`]).
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
        let code = nvrtc::compile_cubin(kernel, &source, arch)?;
        Ok(Built {
            source,
            cubin: code.cubin,
            ptx: code.ptx,
            resources: code.resources,
            min_blocks_per_sm,
        })
    };
    let own = build_one(source.to_string(), None)?;
    if !own.spills() || kernels_gen::cuda::with_min_blocks_per_sm(source, block, 1).is_none() {
        return Ok(own);
    }
    let most = max_threads_per_sm(arch) / block.max(1);
    let fitting = most_that_fit(most, |min_blocks| {
        let hinted = kernels_gen::cuda::with_min_blocks_per_sm(source, block, min_blocks).expect("checked above");
        let built = build_one(hinted, Some(min_blocks))?;
        Ok((built.resources.is_some() && !built.spills()).then_some(built))
    })?;
    Ok(fitting.unwrap_or(own))
}

/// The build for the most blocks an SM in `1..=most` that `build` gives (`None`: it spills),
/// by bisection: a count that builds without spills is taken to mean every smaller one does.
fn most_that_fit<T, E>(most: u32, mut build: impl FnMut(u32) -> Result<Option<T>, E>) -> Result<Option<T>, E> {
    let (mut low, mut high, mut best) = (1, most, None);
    while low <= high {
        let middle = low + (high - low) / 2;
        match build(middle)? {
            Some(built) => {
                best = Some(built);
                low = middle + 1;
            }
            None => high = middle - 1,
        }
    }
    Ok(best)
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

    /// For every most and every threshold (the counts up to it fit), bisection finds the
    /// threshold, or none, in at most ⌊log₂ most⌋ + 1 builds.
    #[test]
    fn bisection_finds_the_most_blocks_that_fit() {
        for most in 1..=24u32 {
            for fits_up_to in 0..=most {
                let mut builds = 0;
                let found = most_that_fit(most, |m| {
                    builds += 1;
                    Ok::<_, ()>((m <= fits_up_to).then_some(m))
                })
                .unwrap();
                assert_eq!(found, (fits_up_to > 0).then_some(fits_up_to), "{most} {fits_up_to}");
                assert!(builds <= most.ilog2() + 1, "{most} {fits_up_to}: {builds} builds");
            }
        }
    }

    #[test]
    fn an_sm_holds_the_threads_of_its_architecture() {
        assert_eq!(max_threads_per_sm("sm_90a"), 2048);
        assert_eq!(max_threads_per_sm("sm_100a"), 2048);
        assert_eq!(max_threads_per_sm("sm_120a"), 1536);
    }
}
