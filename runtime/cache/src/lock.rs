//! The per-cache build lock: an OS file lock (`flock`) on `<cache>.lock`, so
//! it is released when the holder exits or is killed, and a stale lock file
//! never blocks anyone. The lock file itself is left in place: deleting it
//! while another process waits on it would let two builders lock two
//! different inodes.

use crate::error::CacheError;
use krasis_model::atomic::sibling;
use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};

/// What to do when another process holds the lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockWait {
    /// Block until the other builder finishes.
    Wait,
    /// Return [`CacheError::Busy`] at once.
    Fail,
}

/// Held while building; released on drop.
#[derive(Debug)]
pub struct CacheLock {
    _file: File,
    path: PathBuf,
}

impl CacheLock {
    /// Locks the cache file `cache_path` (which need not exist); creates its
    /// directory.
    pub fn acquire(cache_path: &Path, wait: LockWait) -> Result<Self, CacheError> {
        if let Some(dir) = cache_path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| CacheError::io(dir, e))?;
        }
        let path = sibling(cache_path, ".lock");
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| CacheError::io(&path, e))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => match wait {
                LockWait::Fail => {
                    return Err(CacheError::Busy {
                        path: cache_path.to_path_buf(),
                        lock: path,
                    });
                }
                LockWait::Wait => {
                    tracing::info!(lock = %path.display(), "another process is building this expert cache; waiting for it");
                    file.lock().map_err(|e| CacheError::io(&path, e))?;
                }
            },
            Err(TryLockError::Error(e)) => return Err(CacheError::io(&path, e)),
        }
        Ok(CacheLock { _file: file, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}
