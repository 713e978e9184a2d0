//! The CPU backend's integer kernels over GGML's block formats (the formats themselves are the
//! `quant` crate's, re-exported here for the kernels): activations quantized to int8 blocks
//! (`int8`), weights regrouped sixteen rows to a register at load (`interleaved`,
//! `interleaved_k`), Intel AMX tiles for prefill (`amx`), and the software prefetch every
//! weight-streaming loop asks for (`prefetch`).

pub mod amx;
pub mod int8;
pub mod interleaved;
pub mod interleaved_k;
#[cfg(target_arch = "x86_64")]
pub mod prefetch;

pub use ::quant::*;
