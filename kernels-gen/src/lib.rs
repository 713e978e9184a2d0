//! The kernel DSL, its CUDA C emitter and its CPU emulator.
//!
//! A kernel is built once as a DSL value (`dsl`), type-checked (`types`), and then either
//! printed as CUDA C (`cuda`) for NVRTC, or executed on the CPU (`emulator`) — blocks and
//! threads as loops, shared memory, barriers and warp shuffles — so its indexing and arithmetic
//! are tested against the IR reference without a GPU. `templates` build the kernels of the
//! fused IR's ops, parameterised by shape, dtype and target.

pub mod cuda;
pub mod dsl;
pub mod emulator;
pub mod templates;
pub mod types;
