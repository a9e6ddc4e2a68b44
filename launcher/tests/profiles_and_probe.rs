//! The real `krasis` binary: `krasis probe` (its JSON against
//! docs/probe-json.md, its text), the shipped example profiles, and models
//! given by name. The machine's own model roots are kept out
//! ([`krasis_isolated`]).

mod common;

use common::shape::Spec;
use common::*;
use std::collections::BTreeSet;
use std::path::Path;

fn doc_spec() -> Spec {
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/probe-json.md"),
    )
    .unwrap();
    Spec::from_doc(&doc)
}

/// A model directory the launcher finds but cannot serve.
fn unusable_model(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), r#"{"model_type":"llama"}"#).unwrap();
    std::fs::write(dir.join("model.safetensors"), b"").unwrap();
}

fn probe_json(t: &Path, runtime: &Path) -> serde_json::Value {
    let out = run_ok(
        krasis_isolated(t)
            .args(["probe", "--json", "--runtime"])
            .arg(runtime)
            .arg("--model-root")
            .arg(t.join("not-there")),
    );
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

/// Every key and type of real output is in the document's table, every
/// documented key is present, and nothing is wrapped (`{"Ok": ...}`). Run
/// with a working runtime, a missing one and one that fails, and with a
/// usable and an unusable model, so every documented key but those of a
/// GPU is reached (the unit tests in probe/report.rs cover a found GPU).
#[test]
fn probe_json_matches_the_documented_shape() {
    let t = tempfile::tempdir().unwrap();
    let models = t.path().join("models");
    fake_model(&models);
    unusable_model(&models.join("llama"));
    let spec = doc_spec();
    let mut seen = BTreeSet::new();

    let v = probe_json(t.path(), &runtime());
    seen.extend(spec.check(&v).unwrap_or_else(|e| panic!("{e}\n{v:#}")));
    assert_eq!(v["schema"], 1);
    assert_eq!(v["runtime"]["status"], "ok");
    let by_name = |name: &str| {
        v["models"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == name)
            .unwrap_or_else(|| panic!("{name} not in {v:#}"))
            .clone()
    };
    let ok = by_name("fake-qwen3-moe");
    assert_eq!(ok["status"], "ok");
    assert_eq!(ok["root"], "local");
    assert_eq!(ok["facts"]["experts_per_token"], 2);
    let bad = by_name("llama");
    assert_eq!(bad["status"], "unusable");
    assert!(bad["reason"].as_str().unwrap().contains("llama"), "{bad:#}");
    let kinds: Vec<&str> = v["model_roots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["local", "hf_hub", "krasis_data", "user"]);

    let v = probe_json(t.path(), Path::new("/nonexistent/krasis-runtime"));
    seen.extend(spec.check(&v).unwrap_or_else(|e| panic!("{e}\n{v:#}")));
    assert_eq!(v["runtime"]["status"], "error");
    assert!(v["runtime"]["path"].is_null());
    assert!(
        v["runtime"]["reason"]
            .as_str()
            .unwrap()
            .contains("/nonexistent/krasis-runtime"),
        "{v:#}"
    );

    // Found, but not a runtime: it cannot answer `capabilities --json`.
    let v = probe_json(t.path(), &models.join("llama/config.json"));
    seen.extend(spec.check(&v).unwrap_or_else(|e| panic!("{e}\n{v:#}")));
    assert_eq!(v["runtime"]["status"], "error");

    let unreached: Vec<String> = spec
        .paths()
        .difference(&seen)
        .filter(|p| !p.starts_with("gpus.devices[]."))
        .cloned()
        .collect();
    assert!(unreached.is_empty(), "never checked: {unreached:?}");
}

#[test]
fn probe_text_reads_naturally() {
    let t = tempfile::tempdir().unwrap();
    let models = t.path().join("models");
    fake_model(&models);
    unusable_model(&models.join("llama"));
    let text = run_ok(
        krasis_isolated(t.path())
            .arg("probe")
            .arg("--runtime")
            .arg(runtime()),
    );
    assert!(text.starts_with("GPUs: "), "{text}");
    assert!(text.contains("\nHost:\n  RAM  "), "{text}");
    assert!(text.contains("Models: 2 found, 1 usable."), "{text}");
    let row = text
        .lines()
        .find(|l| l.trim_start().starts_with("fake-qwen3-moe"))
        .unwrap_or_else(|| panic!("no row for the model:\n{text}"));
    // Counts and sizes carry units; columns are aligned with the header.
    assert!(row.contains("  qwen3_moe  "), "{row}");
    assert!(row.contains("3 x 8, top 2"), "{row}");
    assert!(row.contains(" KiB"), "{row}");
    let header = text.lines().find(|l| l.contains("NAME")).unwrap();
    assert_eq!(
        header.find("TYPE"),
        row.find("qwen3_moe"),
        "\n{header}\n{row}"
    );
    assert!(text.contains("unusable: "), "{text}");
    assert!(
        text.contains("(Hugging Face cache; does not exist)"),
        "{text}"
    );
    assert!(text.contains("\nRuntime: krasis-runtime "), "{text}");
    // No Debug output: Rust enum and Option names, or braces.
    for bad in [
        "Some(",
        "None",
        "Ok(",
        "Err(",
        "HfHub",
        "KrasisData",
        "{",
        "0.00B",
    ] {
        assert!(!text.contains(bad), "{bad:?} in:\n{text}");
    }
}

#[test]
fn profiles_list_shows_the_shipped_examples_and_copies_them() {
    let t = tempfile::tempdir().unwrap();
    let out = run_ok(krasis_isolated(t.path()).args(["profiles", "list"]));
    let (mine, shipped) = out
        .split_once("Shipped examples")
        .unwrap_or_else(|| panic!("no examples section:\n{out}"));
    assert!(mine.starts_with("Your profiles, in "), "{out}");
    assert!(mine.contains("none yet"), "{out}");
    assert!(
        shipped.contains("\n  demo-cpu  ") && shipped.contains("[reference]"),
        "{out}"
    );
    assert!(shipped.contains("qwen3-30b-a3b-24gb"), "{out}");
    assert!(
        out.contains("krasis profiles copy EXAMPLE [NEW-NAME]"),
        "{out}"
    );
    // An example can be read as shipped, comments included.
    let text = run_ok(krasis_isolated(t.path()).args(["profiles", "show", "demo-cpu"]));
    assert!(
        text.starts_with('#') && text.contains("name = \"demo-cpu\""),
        "{text}"
    );
    // Copied, renamed, with its comments, and then listed as the user's.
    let out = run_ok(krasis_isolated(t.path()).args(["profiles", "copy", "demo-cpu", "my-demo"]));
    assert!(out.contains("copied example 'demo-cpu'"), "{out}");
    let copy = std::fs::read_to_string(t.path().join("config/profiles/my-demo.toml")).unwrap();
    assert!(copy.contains("name = \"my-demo\""), "{copy}");
    assert!(
        copy.contains("# The random-weights tiny demo model"),
        "{copy}"
    );
    let out = run_ok(krasis_isolated(t.path()).args(["profiles", "list"]));
    let (mine, _) = out.split_once("Shipped examples").unwrap();
    assert!(mine.contains("\n  my-demo  "), "{out}");
    let err = run_err(krasis_isolated(t.path()).args(["profiles", "copy", "demo-cpu", "my-demo"]));
    assert!(err.contains("--force"), "{err}");
    let err = run_err(krasis_isolated(t.path()).args(["profiles", "copy", "nope"]));
    assert!(err.contains("demo-cpu"), "{err}");
}

/// `profiles/demo-cpu.toml` as shipped, on a machine that has never run
/// `krasis demo`: the model name is found in (or created in) the data dir.
#[test]
fn the_shipped_demo_profile_works_as_shipped() {
    let t = tempfile::tempdir().unwrap();
    let serve = || {
        let mut c = krasis_isolated(t.path());
        c.args(["serve", "--profile", "demo-cpu", "--dry-run", "--runtime"])
            .arg(runtime());
        c
    };
    let out = run_ok(&mut serve());
    assert!(out.contains("Creating the demo model"), "{out}");
    assert!(out.contains("RANDOM weights"), "{out}");
    assert!(out.contains("dry run: options are valid"), "{out}");
    let demo = t.path().join("data/models/krasis-demo-tiny");
    assert!(demo.join("config.json").is_file());
    // The second time it is found by name, not created again.
    let out = run_ok(&mut serve());
    assert!(!out.contains("Creating the demo model"), "{out}");
    assert!(
        out.contains(&format!(
            "model: {}",
            demo.canonicalize().unwrap().display()
        )),
        "{out}"
    );
}

#[test]
fn a_missing_model_names_every_root_searched() {
    let t = tempfile::tempdir().unwrap();
    let profiles = t.path().join("config/profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::write(
        profiles.join("gone.toml"),
        "schema = 1\nname = \"gone\"\n[options]\nmodel = \"Qwen/No-Such-Model\"\nbackend = \"reference\"\nhcs = false\n",
    )
    .unwrap();
    let extra = t.path().join("extra");
    std::fs::create_dir_all(&extra).unwrap();
    let by_profile = run_err(
        krasis_isolated(t.path())
            .args(["serve", "--profile", "gone", "--dry-run", "--runtime"])
            .arg(runtime())
            .arg("--model-root")
            .arg(&extra),
    );
    let by_flag = run_err(
        krasis_isolated(t.path())
            .args([
                "serve",
                "--model",
                "Qwen/No-Such-Model",
                "--dry-run",
                "--runtime",
            ])
            .arg(runtime())
            .arg("--model-root")
            .arg(&extra),
    );
    for err in [by_profile, by_flag] {
        assert!(
            err.contains("model 'Qwen/No-Such-Model' was not found"),
            "{err}"
        );
        for line in [
            "  models (under the working directory; does not exist)".to_string(),
            format!(
                "  {} (Hugging Face cache; does not exist)",
                t.path().join("hub").display()
            ),
            format!(
                "  {} (Krasis data directory",
                t.path().join("data/models").display()
            ),
            format!("  {} (given with --model-root)", extra.display()),
        ] {
            assert!(err.contains(&line), "missing {line:?} in:\n{err}");
        }
        assert!(err.contains("--model-root DIR"), "{err}");
    }
}
