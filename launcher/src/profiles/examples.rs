//! The example profiles shipped in the repository's `profiles/` directory,
//! built into the binary. Built in rather than looked up on disk because a
//! `krasis` binary can sit anywhere (the installer's prefix, `cargo install`,
//! a copied file, `target/debug` of a checkout): compiled in, the examples
//! are always there and always match the binary that reads them. Users edit
//! a copy (`krasis profiles copy`) in their own profiles directory.

use super::{Profile, ProfileError, Store, parse};
#[cfg(test)]
use std::path::Path;
use std::path::PathBuf;

pub struct Example {
    pub name: &'static str,
    /// The file as shipped, comments included.
    pub text: &'static str,
}

/// Every file in `profiles/` (a test checks none is left out).
pub const EXAMPLES: &[Example] = &[
    Example {
        name: "demo-cpu",
        text: include_str!("../../../profiles/demo-cpu.toml"),
    },
    Example {
        name: "qwen3-235b-a22b-lan",
        text: include_str!("../../../profiles/qwen3-235b-a22b-lan.toml"),
    },
    Example {
        name: "qwen3-30b-a3b-24gb",
        text: include_str!("../../../profiles/qwen3-30b-a3b-24gb.toml"),
    },
];

pub fn find(name: &str) -> Option<&'static Example> {
    EXAMPLES.iter().find(|e| e.name == name)
}

impl Example {
    /// How messages name it (it has no file on this machine).
    pub fn origin(&self) -> PathBuf {
        PathBuf::from(format!("shipped example '{}'", self.name))
    }

    pub fn profile(&self) -> Result<Profile, ProfileError> {
        parse(self.text, &self.origin())
    }

    /// The example's text under another profile name, comments kept: the
    /// top-level `name = ...` line is replaced.
    pub fn renamed(&self, new_name: &str) -> String {
        let mut in_table = false;
        let mut done = false;
        let mut out = String::with_capacity(self.text.len());
        for line in self.text.lines() {
            let t = line.trim_start();
            in_table |= t.starts_with('[');
            let is_name = !in_table
                && t.strip_prefix("name")
                    .is_some_and(|r| r.trim_start().starts_with('='));
            if is_name && !done {
                out.push_str(&format!("name = {new_name:?}"));
                done = true;
            } else {
                out.push_str(line);
            }
            out.push('\n');
        }
        out
    }
}

/// A profile by name: the user's own first (so a copy that was edited
/// wins), then a shipped example.
pub fn load_named(store: &Store, name: &str) -> Result<Profile, ProfileError> {
    match store.load(name) {
        Err(ProfileError::NotFound { .. }) => match find(name) {
            Some(e) => e.profile(),
            None => Err(ProfileError::NotFound {
                name: name.to_string(),
                dir: store.dir.clone(),
            }),
        },
        other => other,
    }
}

/// Copies example `from` into the store as `to` (its comments kept).
pub fn copy(store: &Store, from: &str, to: &str, force: bool) -> Result<PathBuf, ProfileError> {
    let e = find(from).ok_or_else(|| ProfileError::Rejected {
        file: PathBuf::from(from),
        reason: format!(
            "no shipped example of that name; the examples are: {}",
            EXAMPLES
                .iter()
                .map(|e| e.name)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    })?;
    let path = store.path(to)?;
    if !force && path.exists() {
        return Err(ProfileError::Rejected {
            file: path,
            reason: "a profile of that name exists; pass --force to replace it".into(),
        });
    }
    store.save_text(to, &e.renamed(to))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../profiles")
    }

    #[test]
    fn every_shipped_file_is_built_in_unchanged() {
        let mut on_disk: Vec<(String, String)> = std::fs::read_dir(source_dir())
            .unwrap()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "toml"))
            .map(|p| {
                (
                    p.file_stem().unwrap().to_string_lossy().into_owned(),
                    std::fs::read_to_string(&p).unwrap(),
                )
            })
            .collect();
        on_disk.sort();
        let built_in: Vec<(String, String)> = EXAMPLES
            .iter()
            .map(|e| (e.name.to_string(), e.text.to_string()))
            .collect();
        assert_eq!(built_in, on_disk, "add new profiles/*.toml to EXAMPLES");
    }

    #[test]
    fn renaming_keeps_comments_and_options() {
        let e = find("demo-cpu").unwrap();
        let text = e.renamed("my-demo");
        let p = parse(&text, Path::new("my-demo.toml")).unwrap();
        assert_eq!(p.name, "my-demo");
        assert_eq!(p.options, e.profile().unwrap().options);
        assert_eq!(
            text.lines().filter(|l| l.starts_with('#')).count(),
            e.text.lines().filter(|l| l.starts_with('#')).count()
        );
    }

    #[test]
    fn users_profiles_win_over_examples() {
        let t = tempfile::tempdir().unwrap();
        let s = Store::new(t.path().to_path_buf());
        assert_eq!(load_named(&s, "demo-cpu").unwrap().name, "demo-cpu");
        copy(&s, "demo-cpu", "demo-cpu", false).unwrap();
        let mut p = s.load("demo-cpu").unwrap();
        p.options.context_length = Some(1024);
        s.save(&p).unwrap();
        assert_eq!(
            load_named(&s, "demo-cpu").unwrap().options.context_length,
            Some(1024)
        );
        assert!(copy(&s, "demo-cpu", "demo-cpu", false).is_err());
        assert!(matches!(
            load_named(&s, "nope"),
            Err(ProfileError::NotFound { .. })
        ));
    }
}
