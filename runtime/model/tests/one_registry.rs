//! Guard for "one registry of architectures": no non-test source outside
//! `runtime/model/src/arch/` writes a registered `model_type` as a string
//! literal. Anything that needs a list of architectures (or one of them by
//! name) must go through `krasis_model::arch::registry` (in the runtime) or
//! the capability report (in the launcher).
//!
//! Test code is exempt: tests may name the architecture they exercise.
//! Test code is a `tests/` directory, a `tests.rs` file, a module a parent
//! declares `#[cfg(test)] mod NAME;`, an item right after `#[cfg(test)]`,
//! and everything from an inline `#[cfg(test)] mod NAME {` on (the project
//! keeps test modules last). Comments are exempt too.

use krasis_model::arch::registry;
use std::collections::HashSet;
use std::path::{Path, PathBuf};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if p.is_dir() {
            if name != "target" && !name.starts_with('.') {
                rust_files(&p, out);
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

/// Files that are modules declared `#[cfg(test)] mod NAME;` by a parent.
fn test_only_modules(files: &[PathBuf]) -> HashSet<PathBuf> {
    let mut out = HashSet::new();
    for f in files {
        let text = std::fs::read_to_string(f).unwrap();
        let stem = f.file_stem().unwrap().to_string_lossy();
        // Where this file's child modules live.
        let dir = if matches!(&*stem, "mod" | "lib" | "main") {
            f.parent().unwrap().to_path_buf()
        } else {
            f.parent().unwrap().join(&*stem)
        };
        let mut after_cfg_test = false;
        for line in text.lines().map(str::trim) {
            if after_cfg_test
                && is_mod_decl(line)
                && let Some(name) = line.split_whitespace().last().unwrap().strip_suffix(';')
            {
                out.insert(dir.join(format!("{name}.rs")));
                out.insert(dir.join(name).join("mod.rs"));
            }
            after_cfg_test = line == "#[cfg(test)]";
        }
    }
    out
}

fn is_mod_decl(line: &str) -> bool {
    line.starts_with("mod ") || line.starts_with("pub mod ") || line.starts_with("pub(crate) mod ")
}

fn is_test_path(p: &Path, root: &Path) -> bool {
    let rel = p.strip_prefix(root).unwrap();
    rel.components().any(|c| c.as_os_str() == "tests") || rel.ends_with("tests.rs")
}

/// Every line outside test code and comments that writes a registered
/// `model_type` as a string, as "path:line: text".
fn offenders(root: &Path) -> Vec<String> {
    let needles: Vec<String> = registry::model_types()
        .iter()
        .map(|t| format!("\"{t}\""))
        .collect();
    let arch_dir = root.join("runtime/model/src/arch");
    let mut files = Vec::new();
    for top in ["runtime", "common", "launcher", "kernels"] {
        let d = root.join(top);
        if d.is_dir() {
            rust_files(&d, &mut files);
        }
    }
    let test_modules = test_only_modules(&files);
    let mut out = Vec::new();
    for f in &files {
        if f.starts_with(&arch_dir) || is_test_path(f, root) || test_modules.contains(f) {
            continue;
        }
        let text = std::fs::read_to_string(f).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let t = line.trim();
            let after_cfg_test = i > 0 && lines[i - 1].trim() == "#[cfg(test)]";
            if after_cfg_test && is_mod_decl(t) && t.ends_with('{') {
                break; // an inline test module: the rest of the file is tests
            }
            if after_cfg_test || t.starts_with("//") {
                continue;
            }
            if needles.iter().any(|n| line.contains(n.as_str())) {
                let rel = f.strip_prefix(root).unwrap().display();
                out.push(format!("{rel}:{}: {t}", i + 1));
            }
        }
    }
    out
}

#[test]
fn model_types_are_written_only_in_the_registry() {
    let root = workspace_root();
    // The scan sees real sources (not an empty tree).
    assert!(root.join("runtime/model/src/arch/registry.rs").is_file());
    let bad = offenders(&root);
    assert!(
        bad.is_empty(),
        "these lines name an architecture outside runtime/model/src/arch/; derive it from \
         krasis_model::arch::registry (runtime) or the capability report (launcher):\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_guard_sees_a_restated_list() {
    // A file outside arch/ with a list of model types is reported, and its
    // test module is not.
    let dir = std::env::temp_dir().join(format!("krasis-guard-{}", std::process::id()));
    let src = dir.join("common/src");
    std::fs::create_dir_all(&src).unwrap();
    let t = registry::model_types()[0];
    std::fs::write(
        src.join("lib.rs"),
        format!(
            "#[cfg(test)]\nmod fake;\npub const SUPPORTED: &[&str] = &[\"{t}\"];\n// \"{t}\" in a comment\n#[cfg(test)]\nmod t {{ const X: &str = \"{t}\"; }}\n"
        ),
    )
    .unwrap();
    std::fs::write(src.join("fake.rs"), format!("const X: &str = \"{t}\";\n")).unwrap();
    let bad = offenders(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert!(bad[0].starts_with("common/src/lib.rs:3:"), "{bad:?}");
}
