//! A build killed with SIGKILL half way leaves no valid-looking file, does
//! not keep the lock, and the next build succeeds. The build runs in a child
//! process (this test binary re-executed on one ignored test) so it can be
//! killed for real.

mod common;

use krasis_cache::{
    BuildOptions, CacheError, ExpertCache, LockWait, ModelSource, build, ensure_cache_at,
};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Set only for the child process; names model dir, cache path and marker.
const CHILD_ENV: &str = "KRASIS_CACHE_TEST_KILL_CHILD";

#[test]
#[ignore = "helper process of killed_build_leaves_nothing_valid"]
fn child_build_until_killed() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let parts: Vec<PathBuf> = spec.split('\n').map(PathBuf::from).collect();
    let (model, path, marker) = (&parts[0], &parts[1], &parts[2]);
    let source = ModelSource::open(model).unwrap();
    let hook = |d: &krasis_cache::LayerDone| {
        if d.index == 1 {
            std::fs::write(marker, b"layer 1 written").unwrap();
            std::thread::sleep(Duration::from_secs(120));
        }
        Ok(())
    };
    let opts = BuildOptions {
        progress_bar: false,
        on_layer: Some(&hook),
        ..BuildOptions::default()
    };
    build(&source, path, &opts).unwrap();
}

fn temp_files(path: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().contains(".tmp."))
        .collect()
}

#[test]
fn killed_build_leaves_nothing_valid() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::small_model(tmp.path());
    let path = tmp.path().join("cache").join(krasis_cache::FILE_NAME);
    let marker = tmp.path().join("marker");
    let spec = format!(
        "{}\n{}\n{}",
        model.display(),
        path.display(),
        marker.display()
    );
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_build_until_killed",
            "--ignored",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, spec)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !marker.exists() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("child exited early: {status}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "child never reached layer 1"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();

    let source = ModelSource::open(&model).unwrap();
    assert!(!path.exists(), "nothing at the cache path");
    let partial = temp_files(&path);
    assert_eq!(partial.len(), 1, "{partial:?}");
    let e = ExpertCache::open(&partial[0], source.config(), source.format()).unwrap_err();
    assert!(matches!(e, CacheError::Invalid { .. }), "{e}");
    // The OS dropped the dead builder's lock.
    drop(krasis_cache::lock::CacheLock::acquire(&path, LockWait::Fail).unwrap());
    let opts = BuildOptions {
        progress_bar: false,
        ..BuildOptions::default()
    };
    let again = ensure_cache_at(&source, &path, &opts).unwrap();
    assert!(again.built.is_some());
    assert!(temp_files(&path).is_empty(), "leftover removed");
}
