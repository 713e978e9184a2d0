//! One file per `bbc` subcommand.

pub mod compile;
pub mod perplexity;
pub mod run;
pub mod tokenize;
