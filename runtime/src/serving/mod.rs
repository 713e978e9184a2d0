//! Serving many sequences at once: the KV block manager, the continuous-batching scheduler,
//! the loop that runs scheduled work on a backend, and what a sequence's logits go through
//! before it samples.

pub mod block_manager;
pub mod engine;
pub mod logits_processor;
pub mod ngram;
pub mod scheduler;
pub mod state_cache;

pub use block_manager::{BlockId, BlockManager, OutOfBlocks};
pub use engine::{PagedBackend, Sampled, ServingEngine, StateSnapshotting, StepOutput};
pub use logits_processor::{LogitBias, LogitsProcessor, MinTokens};
pub use ngram::NgramConfig;
pub use scheduler::{
    AddError, FinishReason, Finished, PrefixCacheStats, Schedule, Scheduler, SchedulerConfig, SeqId, Work,
};
pub use state_cache::StateCacheConfig;
