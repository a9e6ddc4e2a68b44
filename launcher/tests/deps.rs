//! The launcher depends on `krasis-common` alone among the workspace's
//! crates: model facts and memory plans come from `krasis-runtime inspect`
//! and `plan`, so the launcher never links the model code, the expert cache
//! or CUDA. This reads Cargo.toml and Cargo.lock (no network, no cargo run)
//! and fails if any of them comes back, directly or through another crate.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

/// Crates whose presence would mean the launcher re-derives what the
/// runtime decides, or links CUDA.
const FORBIDDEN: &[&str] = &[
    "krasis-model",
    "krasis-cache",
    "krasis-gpu",
    "krasis-kernels",
    "krasis-server",
    "krasis-runtime",
    "cudarc",
];

fn read(rel: &str) -> toml::Table {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    text.parse()
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Every package `root` reaches through Cargo.lock (all dependency kinds).
fn closure(lock: &toml::Table, root: &str) -> BTreeSet<String> {
    let mut deps: HashMap<String, Vec<String>> = HashMap::new();
    for p in lock["package"].as_array().expect("[[package]]") {
        let name = p["name"].as_str().unwrap().to_string();
        let list = p
            .get("dependencies")
            .and_then(|d| d.as_array())
            .map(|d| {
                d.iter()
                    .map(|s| s.as_str().unwrap().split(' ').next().unwrap().to_string())
                    .collect()
            })
            .unwrap_or_default();
        deps.entry(name).or_default().extend::<Vec<String>>(list);
    }
    assert!(deps.contains_key(root), "{root} is not in Cargo.lock");
    let mut seen = BTreeSet::new();
    let mut todo = vec![root.to_string()];
    while let Some(n) = todo.pop() {
        if seen.insert(n.clone()) {
            todo.extend(deps.get(&n).cloned().unwrap_or_default());
        }
    }
    seen
}

#[test]
fn the_launcher_links_no_model_cache_or_cuda_crate() {
    let manifest = read("Cargo.toml");
    for section in ["dependencies", "dev-dependencies", "build-dependencies"] {
        if let Some(t) = manifest.get(section).and_then(|t| t.as_table()) {
            for f in FORBIDDEN {
                assert!(
                    !t.contains_key(*f),
                    "launcher/Cargo.toml [{section}] lists {f}; ask krasis-runtime (inspect, plan) instead"
                );
            }
        }
    }
    let reached = closure(&read("../Cargo.lock"), "krasis");
    assert!(reached.contains("krasis-common"), "{reached:?}");
    let bad: Vec<&&str> = FORBIDDEN.iter().filter(|f| reached.contains(**f)).collect();
    assert!(
        bad.is_empty(),
        "the launcher reaches {bad:?} through Cargo.lock; it must depend on krasis-common only"
    );
}

#[test]
fn the_check_sees_a_forbidden_crate_reached_indirectly() {
    // The closure follows dependencies of dependencies, so a crate that
    // pulled krasis-model in would be caught.
    let lock: toml::Table = r#"
        [[package]]
        name = "krasis"
        dependencies = ["krasis-common", "helper 1.0.0"]
        [[package]]
        name = "helper"
        version = "1.0.0"
        dependencies = ["krasis-model"]
        [[package]]
        name = "krasis-common"
        [[package]]
        name = "krasis-model"
        dependencies = ["cudarc"]
        [[package]]
        name = "cudarc"
    "#
    .parse()
    .unwrap();
    let reached = closure(&lock, "krasis");
    assert!(reached.contains("krasis-model") && reached.contains("cudarc"));
}
