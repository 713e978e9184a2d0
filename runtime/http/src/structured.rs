//! The server's grammar compiler ([`crate::grammar`]): built once per vocabulary on a
//! blocking thread when the server starts, and a request's spec compiled by it, a 400 naming
//! the parameter where it does not compile.

use super::error::ApiError;
use super::output_spec::Structured;
use crate::grammar::StructuredOutputs;
use llguidance::Matcher;
use models::Tokenizer;
use std::sync::Arc;

/// The grammar compiler for `tokenizer`'s vocabulary, built once on a blocking thread: a large
/// vocabulary takes seconds (Gemma 3's 262k tokens 1.9 s, SmolLM2's 49k 0.17 s on the 2-core
/// machine), so the server starts it at once and serves meanwhile; a structured request that
/// comes before it is ready waits for it.
pub struct LazyStructuredOutputs {
    tokenizer: Arc<Tokenizer>,
    compiler: tokio::sync::OnceCell<Result<StructuredOutputs, String>>,
}

impl LazyStructuredOutputs {
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Self {
            tokenizer,
            compiler: tokio::sync::OnceCell::new(),
        }
    }

    /// The compiler, or why this vocabulary cannot have one.
    pub async fn get(&self) -> Result<&StructuredOutputs, &str> {
        let build = || async {
            let tokenizer = self.tokenizer.clone();
            tokio::task::spawn_blocking(move || StructuredOutputs::new(tokenizer))
                .await
                .unwrap_or_else(|e| Err(format!("building the grammar compiler failed: {e}")))
        };
        self.compiler.get_or_init(build).await.as_ref().map_err(String::as_str)
    }

    /// A matcher for `structured`'s grammar, at the start of the output.
    pub async fn matcher(&self, structured: &Structured) -> Result<Matcher, ApiError> {
        let compiler = self.get().await.map_err(|why| {
            ApiError::invalid(
                &structured.param,
                format!("this model's vocabulary cannot take structured outputs: {why}"),
            )
        })?;
        // Compiling is lazy in llguidance (milliseconds for the grammars tried, a 100 000-fold
        // repetition included), but a grammar is the client's to choose: the runtime moves
        // other requests off this worker meanwhile.
        tokio::task::block_in_place(|| compiler.matcher(&structured.spec)).map_err(|e| {
            ApiError::invalid(
                &structured.param,
                format!("`{}` does not compile: {e}", structured.param),
            )
        })
    }
}
