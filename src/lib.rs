//! The `bbc` binary's library half: model fetching and the command implementations, so that
//! integration tests drive the same code the CLI runs.

pub mod bench;
pub mod commands;
pub mod fetch;
pub mod gpu_check;
pub mod model_ref;
pub mod report;
pub mod serve;
pub mod verify;
