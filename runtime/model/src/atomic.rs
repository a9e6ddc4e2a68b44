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

/// Between a target's name and the writer's pid in its temp file's name.
const TEMP_INFIX: &str = ".tmp.";

pub struct TempFile {
    pub path: PathBuf,
    keep: bool,
}

impl TempFile {
    /// The temp path for `target` (prefix `<name>.tmp.`, which interrupted
    /// cache builds are recognised by).
    pub fn beside(target: &Path) -> Self {
        TempFile {
            path: sibling(target, &format!("{TEMP_INFIX}{}", std::process::id())),
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

    /// Removes the temp files beside `target` of processes that no longer
    /// run (a write cut short by SIGKILL leaves them, gigabytes for a large
    /// file); a live process's is left alone.
    pub fn remove_dead_beside(target: &Path) {
        let name = target.file_name().unwrap_or_default().to_string_lossy();
        remove_dead_temps(
            target.parent().unwrap_or(Path::new("")),
            &format!("{name}{TEMP_INFIX}"),
        );
    }
}

/// Removes the entries of `dir` named `<prefix><pid>` or
/// `<prefix><pid>-<anything>` whose process no longer runs: what killed
/// writers left behind. Only on Linux, where /proc tells whether a process
/// runs.
pub fn remove_dead_temps(dir: &Path, prefix: &str) {
    if !cfg!(target_os = "linux") {
        return;
    }
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(prefix) else {
            continue;
        };
        let pid = rest.split('-').next().unwrap_or("");
        if pid.is_empty()
            || !pid.bytes().all(|b| b.is_ascii_digit())
            || Path::new("/proc").join(pid).exists()
        {
            continue;
        }
        let _ = match e.file_type() {
            Ok(t) if t.is_dir() => std::fs::remove_dir_all(e.path()),
            _ => std::fs::remove_file(e.path()),
        };
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}
