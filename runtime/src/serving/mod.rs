//! Serving many sequences at once: the KV block manager, the continuous-batching scheduler,
//! and the loop that runs scheduled work on a backend.

pub mod block_manager;
pub mod cpu_greedy;
pub mod draft_model;
pub mod engine;
pub mod mtp;
pub mod ngram;
pub mod scheduler;
pub mod state_cache;

pub use crate::logits_processor::{AllowedTokens, BadWords, LogitBias, LogitsProcessor, MinTokens};
pub use block_manager::{BlockId, BlockManager, OutOfBlocks};
pub use cpu_greedy::CpuGreedyServing;
pub use draft_model::{DraftModel, Drafter};
pub use engine::{PagedBackend, Sampled, ServingEngine, StateSnapshotting, StepOutput};
pub use mtp::MtpDrafter;
pub use ngram::{NgramConfig, NgramIndex};
pub use scheduler::{
    AddError, DraftRequest, FinishReason, Finished, PrefixCacheStats, Schedule, Scheduler, SchedulerConfig,
    SchedulingPolicy, SeqId, Work, FORCED_DRAFTS_MOST,
};
pub use state_cache::StateCacheConfig;
