//! From a (fused) graph to an artifact directory.
//!
//! Today the CPU target: the artifact holds the manifest, the graph (text for people, JSON for
//! the runtime) and a reference to the weights, which the CPU backend reads in place. GPU
//! targets (kernels, plan, transformed weights) come with the CUDA code generator.

mod artifact;
mod derived;
pub mod gpu;
pub mod home;
pub mod nvrtc;
pub mod spill_free;
mod target;

pub use artifact::{
    compile, compile_with, hash_weights, read_graphs, read_manifest, ArtifactError, ArtifactGraphs, CompiledGraphs,
    EagleGraphs, EagleHeadFiles, Manifest, MANIFEST_FILE,
};
pub use derived::{int8_heads, read_int8_heads, DerivedWeight};
pub use target::Target;
