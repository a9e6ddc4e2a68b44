//! Errors of the INT4 expert cache. Every message names what was wrong, where
//! (file, layer, tensor), and what to do about it.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{path}: no expert cache here; build it with `krasis-runtime build-cache --model <DIR>`"
    )]
    Missing { path: PathBuf },
    #[error(
        "{path}: not a usable expert cache: {reason}; delete it and rebuild with `krasis-runtime build-cache --model <DIR>`"
    )]
    Invalid { path: PathBuf, reason: String },
    #[error(
        "{path}: the cache was written for a different model ({reason}); rebuild it with `krasis-runtime build-cache --model <DIR>`"
    )]
    Mismatch { path: PathBuf, reason: String },
    #[error(
        "{path}: the cache is stale: {reason}; it is rebuilt automatically when the source model is available (`krasis-runtime build-cache --model <DIR>`)"
    )]
    Stale { path: PathBuf, reason: String },
    #[error(
        "{path}: checksum mismatch in decoder layer {layer} (bytes {offset}..{end}): the file is corrupt; delete it and rebuild with `krasis-runtime build-cache --model <DIR>`"
    )]
    Checksum {
        path: PathBuf,
        layer: usize,
        offset: u64,
        end: u64,
    },
    #[error(transparent)]
    Model(#[from] krasis_model::ModelError),
    #[error("{dir}: unsupported source: {reason}")]
    UnsupportedSource { dir: PathBuf, reason: String },
    #[error(
        "tensor '{tensor}': {reason}; the checkpoint cannot be quantized to INT4 (fix or re-download the checkpoint)"
    )]
    BadWeights { tensor: String, reason: String },
    #[error(
        "{path}: another process is building this cache (lock held on {lock}); wait for it to finish or remove the lock file if that process is gone"
    )]
    Busy { path: PathBuf, lock: PathBuf },
    #[error(
        "{path}: cache build aborted: {reason}; the partial output was removed, run the build again"
    )]
    Aborted { path: PathBuf, reason: String },
    #[error(
        "no CUDA driver: {0}; pinned host memory needs an NVIDIA GPU with its driver installed (libcuda)"
    )]
    NoCudaDriver(String),
    #[error("CUDA {call} failed: {error}")]
    Cuda { call: &'static str, error: String },
    #[error("expert cache: {0}")]
    OutOfRange(String),
}

impl CacheError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        if source.kind() == std::io::ErrorKind::NotFound {
            CacheError::Missing {
                path: path.to_path_buf(),
            }
        } else {
            CacheError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    }
    pub(crate) fn invalid(path: &Path, reason: impl Into<String>) -> Self {
        CacheError::Invalid {
            path: path.to_path_buf(),
            reason: reason.into(),
        }
    }
    /// True when rebuilding from the source fixes this error (the file is
    /// missing, damaged, stale or for another model), false for I/O trouble,
    /// bad source weights, or a concurrent builder.
    pub fn is_rebuildable(&self) -> bool {
        matches!(
            self,
            CacheError::Missing { .. }
                | CacheError::Invalid { .. }
                | CacheError::Mismatch { .. }
                | CacheError::Stale { .. }
                | CacheError::Checksum { .. }
        )
    }
}
