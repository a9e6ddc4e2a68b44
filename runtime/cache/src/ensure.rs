//! Where caches live and the open-or-build entry point engines call.

use crate::builder::{BuildOptions, BuildReport, build_locked};
use crate::cache::ExpertCache;
use crate::error::CacheError;
use crate::format::FILE_NAME;
use crate::lock::CacheLock;
use crate::source::ModelSource;
use krasis_common::events::EventSink;
use std::path::{Path, PathBuf};

/// The platform cache root (`~/.cache/krasis` on Linux).
pub fn default_cache_root() -> Result<PathBuf, CacheError> {
    directories::ProjectDirs::from("ai", "krasis", "krasis")
        .map(|d| d.cache_dir().to_path_buf())
        .ok_or_else(|| CacheError::UnsupportedSource {
            dir: PathBuf::from("~"),
            reason: "no home directory to put the expert cache in; pass --cache-dir".into(),
        })
}

/// `<root>/experts/<source-id>/experts-int4-v1.kcache`, with `root` the
/// platform cache directory unless `cache_root` is given.
pub fn cache_path(source: &ModelSource, cache_root: Option<&Path>) -> Result<PathBuf, CacheError> {
    let root = match cache_root {
        Some(r) => r.to_path_buf(),
        None => default_cache_root()?,
    };
    Ok(root
        .join("experts")
        .join(source.identity().id())
        .join(FILE_NAME))
}

/// Opens the cache at `path` and checks that it was built from `source`.
pub fn open_for_source(path: &Path, source: &ModelSource) -> Result<ExpertCache, CacheError> {
    let cache = ExpertCache::open(path, source.config())?;
    if cache.source() != source.identity() {
        return Err(CacheError::Stale {
            path: path.to_path_buf(),
            reason: format!(
                "it was built from a different source (cache: {}, model: {})",
                serde_json::to_string(cache.source()).unwrap_or_default(),
                serde_json::to_string(source.identity()).unwrap_or_default()
            ),
        });
    }
    Ok(cache)
}

/// Result of [`ensure_cache_at`].
#[derive(Debug)]
pub struct Ensured {
    pub cache: ExpertCache,
    /// `Some` when the cache had to be (re)built.
    pub built: Option<BuildReport>,
}

/// Opens the valid cache of `source` at `path`, or (re)builds it when it is
/// missing, damaged or stale. A concurrent builder is waited for (or
/// refused, per `opts.wait`), and its result used when valid.
pub fn ensure_cache_at(
    source: &ModelSource,
    path: &Path,
    opts: &BuildOptions<'_>,
) -> Result<Ensured, CacheError> {
    match open_for_source(path, source) {
        Ok(cache) => return Ok(Ensured { cache, built: None }),
        Err(e) if e.is_rebuildable() => {
            if !matches!(e, CacheError::Missing { .. }) {
                tracing::warn!("rebuilding the expert cache: {e}");
            }
        }
        Err(e) => return Err(e),
    }
    let _lock = CacheLock::acquire(path, opts.wait)?;
    // Someone may have built it while we waited for the lock.
    if let Ok(cache) = open_for_source(path, source) {
        return Ok(Ensured { cache, built: None });
    }
    let report = build_locked(source, path, opts)?;
    let cache = open_for_source(path, source)?;
    Ok(Ensured {
        cache,
        built: Some(report),
    })
}

/// Opens the model's valid cache (under `cache_root`, or the platform cache
/// directory) or builds it when missing or stale. Engines call this on first use.
pub fn ensure_cache(
    model_dir: &Path,
    cache_root: Option<&Path>,
) -> Result<ExpertCache, CacheError> {
    ensure_cache_reporting(model_dir, cache_root, None)
}

/// [`ensure_cache`] that sends a build's byte progress to `progress`.
pub fn ensure_cache_reporting(
    model_dir: &Path,
    cache_root: Option<&Path>,
    progress: Option<EventSink<'_>>,
) -> Result<ExpertCache, CacheError> {
    let source = ModelSource::open(model_dir)?;
    let path = cache_path(&source, cache_root)?;
    let opts = BuildOptions {
        progress,
        ..BuildOptions::default()
    };
    Ok(ensure_cache_at(&source, &path, &opts)?.cache)
}
