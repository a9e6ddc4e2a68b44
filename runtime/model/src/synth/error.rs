//! Errors of checkpoint synthesis. Each names what was wrong and what to do.

use crate::error::ModelError;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("unknown synth preset '{name}'; known presets: {}", super::preset_names().join(", "))]
    UnknownPreset { name: String },
    #[error("--set {key}: {reason}")]
    BadOverride { key: String, reason: String },
    #[error("invalid synthetic model: {0}")]
    BadSpec(String),
    #[error("{path} already exists and is not empty; remove it or choose another --out")]
    OutputExists { path: PathBuf },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    BadRecord { path: PathBuf, reason: String },
    #[error(transparent)]
    Model(#[from] ModelError),
}

impl SynthError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        SynthError::Io {
            path: path.into(),
            source,
        }
    }
}
