//! Errors of running a model.

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("the graph is invalid: {0}")]
    Graph(String),
    #[error("weights: {0}")]
    Weight(String),
    #[error("{0}")]
    Input(String),
    #[error("the sequence needs {needed} tokens but the context length is {limit}; shorten the prompt or lower --max-tokens")]
    ContextOverflow { needed: usize, limit: usize },
    #[error("{0}")]
    Artifact(String),
    #[error("no CUDA driver on this machine (libcuda could not be loaded): run a GPU artifact where an NVIDIA GPU is, or compile with --target cpu")]
    NoCudaDriver,
    #[error("CUDA: {0}")]
    Cuda(String),
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
