//! Errors of model loading. Every variant names what was wrong, where, and
//! (in its message) what the user can do about it.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: file not found ({what}); is this a Hugging Face model directory?")]
    MissingFile { path: PathBuf, what: String },
    #[error("{path}: invalid config: {reason}")]
    BadConfig { path: PathBuf, reason: String },
    #[error(
        "{path}: model_type '{model_type}' is not supported; supported: {}",
        crate::arch::registry::model_types().join(", ")
    )]
    UnsupportedModelType { model_type: String, path: PathBuf },
    #[error("{path}: bad safetensors file: {reason}")]
    BadSafetensors { path: PathBuf, reason: String },
    #[error(
        "{path}: truncated: tensor '{tensor}' needs bytes up to {needed} but the file has {actual}; re-download this shard"
    )]
    Truncated {
        path: PathBuf,
        tensor: String,
        needed: u64,
        actual: u64,
    },
    #[error("tensor '{tensor}' is missing from the checkpoint in {dir}")]
    MissingTensor { tensor: String, dir: PathBuf },
    #[error(
        "checkpoint in {dir} has tensors this architecture does not use: {} (first of {count}); wrong model_type or a modified checkpoint?",
        names.join(", ")
    )]
    UnexpectedTensors {
        dir: PathBuf,
        names: Vec<String>,
        count: usize,
    },
    #[error("tensor '{tensor}' in {file}: expected shape {expected:?}, found {found:?}")]
    WrongShape {
        tensor: String,
        file: PathBuf,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error(
        "tensor '{tensor}' in {file}: dtype {found} is not supported (expected BF16, F16 or F32)"
    )]
    WrongDtype {
        tensor: String,
        file: PathBuf,
        found: String,
    },
    #[error("{path}: tokenizer: {reason}")]
    Tokenizer { path: PathBuf, reason: String },
    #[error("chat template: {0}")]
    Template(String),
    #[error("{0}")]
    Other(String),
}

impl ModelError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        if source.kind() == std::io::ErrorKind::NotFound {
            ModelError::MissingFile {
                path: path.to_path_buf(),
                what: source.to_string(),
            }
        } else {
            ModelError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    }
}
