//! Crash-safe replacement of a file, shared by the expert cache builder,
//! heatmaps and the prefix cache's file: write `<name>.tmp.<pid>` beside the
//! target, fsync it, rename it over the target, fsync the directory. A
//! process killed at any point leaves either the old file or the new one,
//! never a partial one under the real name; the temp file is removed unless
//! it was renamed into place.

use std::fs::File;
use std::path::{Path, PathBuf};

/// `path` with `suffix` appended to its file name (`cache.bin` ->
/// `cache.bin.lock`).
pub fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    path.with_file_name(name)
}

pub struct TempFile {
    pub path: PathBuf,
    keep: bool,
}

impl TempFile {
    /// The temp path for `target` (prefix `<name>.tmp.`, which interrupted
    /// cache builds are recognised by).
    pub fn beside(target: &Path) -> Self {
        TempFile {
            path: sibling(target, &format!(".tmp.{}", std::process::id())),
            keep: false,
        }
    }

    /// Renames the (already synced and closed) temp file over `target` and
    /// syncs the directory so the rename itself survives a crash.
    pub fn persist(mut self, target: &Path) -> std::io::Result<()> {
        std::fs::rename(&self.path, target)?;
        self.keep = true;
        match target.parent() {
            Some(d) if !d.as_os_str().is_empty() => File::open(d)?.sync_all(),
            _ => File::open(".")?.sync_all(),
        }
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
