//! `krasis-runtime inspect` and `plan` as the launcher calls them: the JSON
//! shapes documented in `krasis_common::inspect` and `krasis_common::plan`
//! (internally tagged `status`, never `{"Ok": ...}`), a broken directory as
//! an entry rather than a failed command, and the launcher's own plan
//! arguments accepted by the runtime.

mod common;

use common::{runtime, tiny_model};
use krasis_common::{Backend, InspectReport, LaunchOptions, Plan};
use serde_json::Value;
use std::process::Command;

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(runtime()).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn keys(v: &Value) -> Vec<&str> {
    let mut k: Vec<&str> = v.as_object().unwrap().keys().map(|s| s.as_str()).collect();
    k.sort();
    k
}

#[test]
fn inspect_reports_many_dirs_in_one_call_with_per_model_errors() {
    let t = tempfile::tempdir().unwrap();
    let model = tiny_model(&runtime(), t.path());
    let bad = t.path().join("not-a-model");
    std::fs::create_dir(&bad).unwrap();
    let cache = t.path().join("cache");
    let (ok, out, err) = run(&[
        "inspect",
        "--model",
        model.to_str().unwrap(),
        "--model",
        bad.to_str().unwrap(),
        "--cache-dir",
        cache.to_str().unwrap(),
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(keys(&v), ["models", "protocol_version"]);
    let m = &v["models"][0];
    assert_eq!(
        keys(m),
        [
            "cache",
            "formats",
            "geometry",
            "heatmap",
            "model_type",
            "params",
            "path",
            "status"
        ]
    );
    assert_eq!(m["status"], "ok");
    assert_eq!(m["model_type"], "qwen3_moe");
    assert_eq!(
        keys(&m["params"]),
        ["active_per_token", "routed_experts", "total"]
    );
    assert!(
        m["params"]["total"].as_u64().unwrap() > m["params"]["active_per_token"].as_u64().unwrap()
    );
    assert_eq!(m["cache"]["status"], "missing");
    assert!(m["heatmap"]["status"].is_string());
    let backends = m["formats"]["backends"].as_array().unwrap();
    let experts = |b: &str| {
        backends.iter().find(|x| x["backend"] == b).unwrap()["experts"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(experts("cuda"), "int4");
    assert_eq!(
        experts("reference"),
        m["formats"]["checkpoint_dtype"].as_str().unwrap()
    );
    let e = &v["models"][1];
    assert_eq!(keys(e), ["path", "reason", "status"]);
    assert_eq!(e["status"], "error");
    // The same text parses as the one shared definition.
    let r: InspectReport = serde_json::from_str(&out).unwrap();
    assert_eq!(r.models.len(), 2);
    // And reads naturally without --json.
    let (ok, text, _) = run(&[
        "inspect",
        "--model",
        model.to_str().unwrap(),
        "--model",
        bad.to_str().unwrap(),
    ]);
    assert!(ok);
    assert!(
        text.contains("parameters (") && text.contains("active per token"),
        "{text}"
    );
    assert!(text.contains("reference backend: experts"), "{text}");
    assert!(text.contains("cannot be served"), "{text}");
}

#[test]
fn plan_json_has_the_documented_shape_and_takes_the_launchers_arguments() {
    let t = tempfile::tempdir().unwrap();
    let model = tiny_model(&runtime(), t.path());
    let opts = LaunchOptions {
        model: model.clone(),
        context_length: Some(256),
        vram_limit_bytes: Some(4 << 30),
        cache_dir: Some(t.path().join("cache")),
        parallel: Some(2),
        ..LaunchOptions::default()
    };
    let args = krasis::runtime::plan_args(&opts, Some((8 << 30, 16 << 30)));
    let mut argv: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    argv.push("--json");
    let (ok, out, err) = run(&argv);
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        keys(&v),
        [
            "backend",
            "context_length",
            "gpu",
            "host",
            "model",
            "notes",
            "protocol_version",
            "warnings"
        ]
    );
    let g = &v["gpu"];
    assert_eq!(
        keys(g),
        [
            "device",
            "experts",
            "fixed_bytes",
            "items",
            "prefill_chunk",
            "safety_margin_bytes",
            "transient",
            "verdict"
        ]
    );
    assert_eq!(g["device"]["status"], "known");
    assert_eq!(g["device"]["budget_bytes"], 4u64 << 30);
    assert_eq!(g["verdict"]["status"], "fits");
    assert_eq!(g["transient"]["estimate"], true);
    assert_eq!(g["safety_margin_bytes"], 600u64 << 20);
    assert!(g["experts"]["placement"].is_string());
    // The plan is for the parallelism the launcher asks for.
    assert!(
        g["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|i| i["name"] == "per-sequence decode state (2 sequence(s) per step)"),
        "{g}"
    );
    let p: Plan = serde_json::from_str(&out).unwrap();
    assert_eq!(p.context_length, 256);
    // The reference backend plans host memory only.
    let opts = LaunchOptions {
        backend: Backend::Reference,
        hcs: false,
        ..opts
    };
    let args = krasis::runtime::plan_args(&opts, None);
    let mut argv: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    argv.push("--json");
    let (ok, out, err) = run(&argv);
    assert!(ok, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert!(v["gpu"].is_null());
    assert!(
        v["host"]["items"][0]["name"]
            .as_str()
            .unwrap()
            .contains("checkpoint")
    );
    // Text form.
    let (ok, text, _) = run(&[
        "plan",
        "--model",
        model.to_str().unwrap(),
        "--device-free",
        "8GiB",
    ]);
    assert!(ok);
    assert!(
        text.contains("VRAM budget 8.0 GiB") && text.contains("safety margin 600.0 MiB"),
        "{text}"
    );
}
