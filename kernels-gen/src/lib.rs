//! The kernel DSL, its CUDA C emitter and its CPU emulator (issue [3]). Nothing here yet: the
//! crate exists so the workspace has the shape of the architecture from the start.
