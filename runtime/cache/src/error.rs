//! Errors of the expert cache. Every message names what was wrong, where
//! (file, layer, tensor), and what to do about it.

use crate::layout::ExpertFormat;
use std::path::{Path, PathBuf};

/// The build command when the model directory is not known.
pub const GENERIC_REBUILD: &str = "krasis-runtime build-cache --model <DIR>";

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
        "{path}: this is a format-{version} expert cache from an older krasis build; this build reads format {} only and neither uses nor replaces it on its own. Rebuild it with `{command}` (that removes the old file)",
        crate::format::FORMAT_VERSION
    )]
    OldFormat {
        path: PathBuf,
        version: u32,
        /// The exact command that rebuilds it.
        command: String,
    },
    #[error(
        "{path}: the cache holds {cached} experts but the model needs {wanted}; rebuild it with `krasis-runtime build-cache --model <DIR>`"
    )]
    FormatMismatch {
        path: PathBuf,
        cached: ExpertFormat,
        wanted: ExpertFormat,
    },
    #[error("{dir}: {reason}")]
    Precision { dir: PathBuf, reason: String },
    #[error(transparent)]
    Mxfp4(#[from] krasis_model::formats::mxfp4::Mxfp4Error),
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
    /// A format-1 file at `path` (`version` as its preamble says), with the
    /// generic rebuild command; [`Self::with_rebuild_command`] names the real one.
    pub(crate) fn old_format(path: &Path, version: u32) -> Self {
        CacheError::OldFormat {
            path: path.to_path_buf(),
            version,
            command: GENERIC_REBUILD.to_string(),
        }
    }
    /// Puts the exact rebuild command into an [`CacheError::OldFormat`].
    pub fn with_rebuild_command(self, cmd: &str) -> Self {
        match self {
            CacheError::OldFormat { path, version, .. } => CacheError::OldFormat {
                path,
                version,
                command: cmd.to_string(),
            },
            e => e,
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
    /// bad source weights, a concurrent builder, or a format-1 cache (which
    /// only an explicit `build-cache` replaces: fail closed).
    pub fn is_rebuildable(&self) -> bool {
        matches!(
            self,
            CacheError::Missing { .. }
                | CacheError::Invalid { .. }
                | CacheError::Mismatch { .. }
                | CacheError::Stale { .. }
                | CacheError::Checksum { .. }
                | CacheError::FormatMismatch { .. }
        )
    }
}
