//! Every model family beyond qwen3_moe through the launcher, as a user
//! meets it: `krasis probe` finds a synthesized checkpoint of the family
//! (published layout, the family's real vocabulary and chat template) and
//! shows the runtime's facts for it; `krasis serve --dry-run` prints the
//! runtime's estimate; and `krasis serve` starts the real runtime on it
//! (the reference backend: CI has no GPU), waits for ready, and a chat
//! request rendered by the family's own template is answered. The CUDA
//! estimate against what the engine then loads is checked on the H200
//! (`tools/device/glm_cuda.sh e`).
#![cfg(unix)]

mod common;

use common::*;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

/// A family's tiny preset, the vocabulary its tokens come from (fetched by
/// `tools/vocab.sh` / `tools/harmony/vocab.sh`), and what the runtime must
/// report for it.
struct Family {
    preset: &'static str,
    vocab: &'static str,
    model_type: &'static str,
    /// The routed experts' format in the published checkpoint.
    source: &'static str,
    /// The format of the expert cache the CUDA engine serves it from.
    cuda_experts: &'static str,
}

const FAMILIES: [Family; 2] = [
    Family {
        preset: "tiny-glm4-moe",
        vocab: "qwen.tiktoken",
        model_type: "glm4_moe",
        source: "bf16",
        cuda_experts: "int4",
    },
    Family {
        preset: "tiny-gpt-oss",
        vocab: "o200k_base.tiktoken",
        model_type: "gpt_oss",
        source: "mxfp4",
        cuda_experts: "mxfp4",
    },
];

/// Synthesizes the family's preset into `models/<preset>` under `tmp`.
fn synth(tmp: &Path, f: &Family) -> PathBuf {
    let vocab = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../.cache/vocab")
        .join(f.vocab);
    assert!(
        vocab.is_file(),
        "{} is missing: run tools/vocab.sh and tools/harmony/vocab.sh (tools/test.sh does)",
        vocab.display()
    );
    let dir = tmp.join("models").join(f.preset);
    let st = std::process::Command::new(runtime())
        .args(["synth", "--preset", f.preset, "--vocab"])
        .arg(&vocab)
        .arg("--out")
        .arg(&dir)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success(), "synth {} failed: {st}", f.preset);
    dir
}

#[test]
fn probe_finds_every_family_and_the_runtime_serves_it() {
    let t = tempfile::tempdir().unwrap();
    for f in &FAMILIES {
        synth(t.path(), f);
    }
    let out = run_ok(
        krasis_isolated(t.path())
            .args(["probe", "--json", "--runtime"])
            .arg(runtime()),
    );
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    for f in &FAMILIES {
        let m = v["models"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == f.preset)
            .unwrap_or_else(|| panic!("{} not found: {v:#}", f.preset));
        assert_eq!(m["status"], "ok", "{m:#}");
        assert_eq!(m["root"], "local");
        assert_eq!(m["facts"]["model_type"], f.model_type);
        assert_eq!(m["facts"]["experts_per_token"], 2);
        assert_eq!(m["facts"]["source_dtype"], f.source);
        // The runtime says it serves the family, with the expert cache's
        // format for it.
        let served = v["runtime"]["architectures"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["model_type"] == f.model_type)
            .unwrap_or_else(|| panic!("runtime does not list {}: {v:#}", f.model_type));
        assert_eq!(
            served["expert_precisions"],
            serde_json::json!([f.cuda_experts]),
            "{served:#}"
        );
        assert_eq!(served["hcs"], true, "{served:#}");
    }
}

#[test]
fn serve_estimates_starts_and_chats_with_every_family() {
    let t = tempfile::tempdir().unwrap();
    for f in &FAMILIES {
        let model = synth(t.path(), f);
        let opts = ["--backend", "reference", "--context-length", "512"];
        let dry = run_ok(
            krasis_isolated(t.path())
                .arg("--runtime")
                .arg(runtime())
                .args(["serve", "--model", f.preset, "--dry-run"])
                .args(opts),
        );
        assert!(
            dry.contains(&format!("({}, ", f.model_type)) && dry.contains("context 512 tokens"),
            "{dry}"
        );
        assert!(dry.contains("dry run: options are valid"), "{dry}");

        let port = free_port();
        let mut child = krasis_isolated(t.path())
            .arg("--runtime")
            .arg(runtime())
            .args(["serve", "--model"])
            .arg(&model)
            .args(opts)
            .args(["--port", &port.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let url = ready_url(&mut child, f.preset);
        assert_eq!(url, format!("http://127.0.0.1:{port}"));
        let http = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(120))
            .build()
            .unwrap();
        let models: Value = http
            .get(format!("{url}/v1/models"))
            .send()
            .unwrap()
            .json()
            .unwrap();
        let id = models["data"][0]["id"].as_str().unwrap().to_string();
        let r = http
            .post(format!("{url}/v1/chat/completions"))
            .json(&serde_json::json!({
                "model": id,
                "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 4,
            }))
            .send()
            .unwrap();
        let status = r.status();
        let body: Value = r.json().unwrap();
        assert!(status.is_success(), "{}: {status} {body}", f.preset);
        // Random weights say anything (text, reasoning or a call), but the
        // prompt was rendered and tokens were generated.
        assert!(
            body["usage"]["prompt_tokens"].as_u64().unwrap() > 3
                && body["usage"]["completion_tokens"].as_u64().unwrap() >= 1,
            "{}: {body}",
            f.preset
        );
        sigterm(child.id());
        let st = wait_exit(&mut child, Duration::from_secs(30));
        assert!(st.success(), "{}: launcher exit {st:?}", f.preset);
    }
}

/// The URL the launcher prints on its `READY:` line.
fn ready_url(child: &mut std::process::Child, what: &str) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                return;
            }
        }
    });
    let mut seen = Vec::new();
    loop {
        let l = rx
            .recv_timeout(Duration::from_secs(180))
            .unwrap_or_else(|_| panic!("{what}: no READY within 180 s; output so far: {seen:#?}"));
        if let Some(rest) = l.strip_prefix("READY: ") {
            return rest.split_whitespace().next().unwrap().to_string();
        }
        seen.push(l);
    }
}
