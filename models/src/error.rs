//! Errors a user can cause by handing us a model: every one names the file and what is wrong.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a GGUF file (magic bytes {found:?}, expected \"GGUF\")")]
    BadMagic { path: PathBuf, found: [u8; 4] },
    #[error("{path}: GGUF version {version} is not supported (supported: 2 and 3)")]
    UnsupportedVersion { path: PathBuf, version: u32 },
    #[error("{path}: truncated or corrupt: {what}")]
    Corrupt { path: PathBuf, what: String },
    #[error(
        "{path}: tensor `{tensor}` has GGML type {} (type id {type_id}), which bbc does not read (it reads {})",
        crate::quant::GgmlType::other_name(*type_id).unwrap_or("unknown to ggml"),
        crate::quant::GgmlType::ALL.map(|t| t.name()).join(", ")
    )]
    UnsupportedTensorType {
        path: PathBuf,
        tensor: String,
        type_id: u32,
    },
    #[error("{path}: metadata key `{key}` {problem}")]
    Metadata {
        path: PathBuf,
        key: String,
        problem: String,
    },
    #[error("{path}: safetensors: {what}")]
    Safetensors { path: PathBuf, what: String },
    #[error("{path}: {what}")]
    Config { path: PathBuf, what: String },
    #[error("tensor `{0}` not found in the model's weights")]
    MissingTensor(String),
    #[error("tensor `{name}`: {what}")]
    TensorShape { name: String, what: String },
    #[error("quantization `{asked}`: {what}")]
    Quantization { asked: String, what: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

pub(crate) fn io_error(path: &std::path::Path, source: std::io::Error) -> ModelError {
    ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}
