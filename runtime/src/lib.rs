//! The runtime: executes a model's graph on a backend, with a KV cache per sequence, and the
//! generation loop (prefill, decode, sampling) on top.

pub mod compare;
pub mod cpu;
pub mod decode_timing;
pub mod emulator_device;
pub mod error;
pub mod generate;
pub mod kv;
pub mod kv_sizing;
pub mod logits_processor;
pub mod logprobs;
pub mod plan_exec;
pub mod random_weights;
pub mod sampling;
pub mod serving;

pub use cpu::{CpuBackend, CpuSequence, KvPages, WeightCache};
pub use error::{Result, RuntimeError};
pub use generate::{generate, generate_processed, Backend, Engine, GenerateOptions, StepEvent};
pub use logits_processor::{AllowedTokens, BadWords, LogitBias, LogitsProcessor, MinTokens};
pub use sampling::{Sampler, SamplingParams, TokenLogprobs};
