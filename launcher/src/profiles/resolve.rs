//! A model given by name (`model = "krasis-demo-tiny"`, `--model
//! Qwen/Qwen3-30B-A3B`) rather than by directory: looked up in the model
//! roots, so a profile works wherever the model was downloaded to. A path
//! that exists is used as given; a name found nowhere is an error that lists
//! every place that was searched.

use crate::probe::ModelRoot;
use crate::probe::models::{RootKind, is_model_dir};
use crate::probe::report::RootKindName;
use std::path::{Component, Path, PathBuf};

#[derive(Debug, thiserror::Error)]
#[error(
    "model '{given}' was not found: it is not a directory here ({cwd}), and no model directory of that name is in the model roots searched:\n{searched}\nGive the model's directory, add the directory that holds it with --model-root DIR, or run `krasis probe` to see the models found"
)]
pub struct ModelNotFound {
    pub given: String,
    pub cwd: String,
    /// One line per root, indented.
    pub searched: String,
}

/// Where `given` is: itself when it exists or is absolute (an absolute path
/// is never reinterpreted; validation says what is wrong with it), else the
/// first root holding a model directory of that name.
pub fn resolve_model(given: &Path, roots: &[ModelRoot]) -> Result<PathBuf, ModelNotFound> {
    if given.is_absolute() || given.exists() {
        return Ok(given.to_path_buf());
    }
    for root in roots {
        if let Some(dir) = find_in(root, given) {
            return Ok(dir.canonicalize().unwrap_or(dir));
        }
    }
    Err(ModelNotFound {
        given: given.display().to_string(),
        cwd: std::env::current_dir()
            .map(|d| d.display().to_string())
            .unwrap_or_else(|_| "the working directory".into()),
        searched: roots
            .iter()
            .map(|r| {
                format!(
                    "  {} ({}{})",
                    r.path.display(),
                    RootKindName::from(r.kind).describe(),
                    if r.path.is_dir() {
                        ""
                    } else {
                        "; does not exist"
                    }
                )
            })
            .collect::<Vec<_>>()
            .join("\n"),
    })
}

fn find_in(root: &ModelRoot, name: &Path) -> Option<PathBuf> {
    let parts: Vec<&str> = name
        .components()
        .map(|c| match c {
            Component::Normal(s) => s.to_str(),
            _ => None,
        })
        .collect::<Option<_>>()?;
    if root.kind == RootKind::HfHub {
        // `org/name` is the hub cache's `models--org--name`, at the snapshot
        // `refs/main` names, else its only snapshot.
        let [org, repo] = parts.as_slice() else {
            return None;
        };
        let dir = root.path.join(format!("models--{org}--{repo}"));
        let snapshots = dir.join("snapshots");
        if let Ok(rev) = std::fs::read_to_string(dir.join("refs").join("main")) {
            let s = snapshots.join(rev.trim());
            if is_model_dir(&s) {
                return Some(s);
            }
        }
        let mut all: Vec<PathBuf> = std::fs::read_dir(&snapshots)
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| is_model_dir(p))
            .collect();
        return (all.len() == 1).then(|| all.remove(0));
    }
    // `root/org/name`, or `root/name` for a download saved without its org.
    let full = root.path.join(name);
    if is_model_dir(&full) {
        return Some(full);
    }
    let last = root.path.join(parts.last()?);
    is_model_dir(&last).then_some(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(dir: &Path) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("config.json"), "{}").unwrap();
        std::fs::write(dir.join("model.safetensors"), "").unwrap();
    }

    fn root(path: &Path, kind: RootKind) -> ModelRoot {
        ModelRoot {
            path: path.to_path_buf(),
            kind,
        }
    }

    #[test]
    fn names_are_found_in_the_roots_in_order() {
        let t = tempfile::tempdir().unwrap();
        let (a, b) = (t.path().join("a"), t.path().join("b"));
        model(&a.join("tiny"));
        model(&b.join("tiny"));
        model(&b.join("Qwen3-30B-A3B"));
        let roots = [root(&a, RootKind::KrasisData), root(&b, RootKind::User)];
        let got = resolve_model(Path::new("tiny"), &roots).unwrap();
        assert_eq!(got, a.join("tiny").canonicalize().unwrap());
        // An org/name finds a download saved without its org.
        let got = resolve_model(Path::new("Qwen/Qwen3-30B-A3B"), &roots).unwrap();
        assert_eq!(got, b.join("Qwen3-30B-A3B").canonicalize().unwrap());
        // Absolute paths are left alone, found or not.
        let abs = t.path().join("nowhere");
        assert_eq!(resolve_model(&abs, &roots).unwrap(), abs);
    }

    #[test]
    fn hub_cache_names_resolve_to_the_main_snapshot() {
        let t = tempfile::tempdir().unwrap();
        let repo = t.path().join("models--Qwen--Qwen3-30B-A3B");
        model(&repo.join("snapshots/old"));
        model(&repo.join("snapshots/new"));
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), "new\n").unwrap();
        let roots = [root(t.path(), RootKind::HfHub)];
        let got = resolve_model(Path::new("Qwen/Qwen3-30B-A3B"), &roots).unwrap();
        assert_eq!(got, repo.join("snapshots/new").canonicalize().unwrap());
    }

    #[test]
    fn a_missing_name_lists_every_root_searched() {
        let t = tempfile::tempdir().unwrap();
        let roots = [
            root(t.path(), RootKind::KrasisData),
            root(&t.path().join("gone"), RootKind::User),
        ];
        let e = resolve_model(Path::new("no-such-model"), &roots)
            .unwrap_err()
            .to_string();
        assert!(e.contains("model 'no-such-model' was not found"), "{e}");
        assert!(
            e.contains(&format!("  {} (Krasis data directory", t.path().display())),
            "{e}"
        );
        assert!(
            e.contains("gone (given with --model-root; does not exist)"),
            "{e}"
        );
    }
}
