//! Where caches live and the open-or-build entry point engines call.

use crate::builder::{BuildOptions, BuildReport, build_locked};
use crate::cache::ExpertCache;
use crate::error::CacheError;
use crate::format::{FILE_NAME, V1_FILE_NAME, V1_MAGIC};
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

/// `<root>/experts/<source-id>/experts-v2.kcache`, with `root` the
/// platform cache directory unless `cache_root` is given. (Format 1 put
/// `experts-int4-v1.kcache` in the same directory: the source id of a
/// float checkpoint is unchanged, so [`ensure_cache_at`] finds it there.)
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

/// Opens the cache at `path` and checks that it was built from `source`
/// in the source's expert format.
pub fn open_for_source(path: &Path, source: &ModelSource) -> Result<ExpertCache, CacheError> {
    let cache = ExpertCache::open(path, source.config(), source.format())?;
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

/// Single-quotes `s` for a POSIX shell when it holds anything but safe
/// characters, so the rebuild command can be pasted as printed.
fn shell_word(s: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "/._-+=:,@".contains(c);
    if !s.is_empty() && s.chars().all(safe) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// The exact `build-cache` command that (re)builds the cache of `source` at
/// `path`: `--cache-dir` is named when `path` lies under a root other than
/// the platform default.
pub fn rebuild_command(source: &ModelSource, path: &Path) -> String {
    let mut cmd = format!(
        "krasis-runtime build-cache --model {}",
        shell_word(&source.dir().to_string_lossy())
    );
    let root = path.ancestors().nth(3);
    if let Some(root) = root
        && cache_path(source, Some(root)).ok().as_deref() == Some(path)
        && default_cache_root().ok().as_deref() != Some(root)
    {
        cmd.push_str(&format!(
            " --cache-dir {}",
            shell_word(&root.to_string_lossy())
        ));
    }
    cmd
}

/// A format-1 cache next to `path` (by name), as the error that refuses it
/// (with `command`, the rebuild command): what `inspect` reports where the
/// format-2 file is missing.
pub fn format_1_beside(path: &Path, command: &str) -> Option<CacheError> {
    let old = path.with_file_name(V1_FILE_NAME);
    if !old.exists() {
        return None;
    }
    // The name says format 1; the preamble says which version exactly when
    // it is readable.
    let mut version = 1;
    if let Ok(bytes) = std::fs::read(&old).map(|b| b.into_iter().take(12).collect::<Vec<u8>>())
        && bytes.len() == 12
        && bytes[..8] == V1_MAGIC
    {
        version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    }
    Some(CacheError::OldFormat {
        path: old,
        version,
        command: command.to_string(),
    })
}

/// Opens the valid cache of `source` at `path`, or (re)builds it when it is
/// missing, damaged or stale. A concurrent builder is waited for (or
/// refused, per `opts.wait`), and its result used when valid.
///
/// A format-1 cache (by file name next to `path`, or by magic at `path`)
/// is refused with [`CacheError::OldFormat`] and the exact rebuild command,
/// unless `opts.replace_format_1` (set by that command) says to delete it
/// and build format 2.
pub fn ensure_cache_at(
    source: &ModelSource,
    path: &Path,
    opts: &BuildOptions<'_>,
) -> Result<Ensured, CacheError> {
    let command = rebuild_command(source, path);
    if let Some(CacheError::OldFormat { path: old, .. }) = format_1_beside(path, &command) {
        if !opts.replace_format_1 {
            return Err(format_1_beside(path, &command).expect("still there"));
        }
        tracing::warn!(file = %old.display(), "removing a format-1 expert cache (replaced by format 2)");
        std::fs::remove_file(&old).map_err(|e| CacheError::io(&old, e))?;
        // Its lock file too (a format-1 builder still running keeps its
        // lock through the open descriptor).
        let mut lock = old.into_os_string();
        lock.push(".lock");
        let lock = std::path::PathBuf::from(lock);
        if let Err(e) = std::fs::remove_file(&lock)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            return Err(CacheError::io(&lock, e));
        }
    }
    match open_for_source(path, source) {
        Ok(cache) => return Ok(Ensured { cache, built: None }),
        Err(e @ CacheError::OldFormat { .. }) if !opts.replace_format_1 => {
            return Err(e.with_rebuild_command(&command));
        }
        Err(e) if e.is_rebuildable() || matches!(e, CacheError::OldFormat { .. }) => {
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
