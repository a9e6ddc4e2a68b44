//! The real `krasis` binary: probe, profiles, validation and headless
//! supervision against a stand-in runtime script (the real runtime is
//! exercised in e2e.rs).

mod common;

use common::*;
use std::process::Stdio;
#[cfg(unix)]
use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    time::Duration,
};

#[test]
fn probe_without_gpu_is_a_statement_not_a_crash() {
    let t = tempfile::tempdir().unwrap();
    let model = fake_model(t.path());
    let out = run_ok(
        krasis_cmd(t.path())
            .args(["probe", "--json", "--runtime"])
            .arg(runtime())
            .arg("--model-root")
            .arg(t.path()),
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(v["host"]["total_ram_bytes"].as_u64().unwrap() > 0);
    let gpus = &v["gpus"];
    if gpus["status"] == "unavailable" {
        assert!(
            gpus["reason"].as_str().unwrap().contains("NVIDIA"),
            "{gpus}"
        );
    }
    let models = v["models"].as_array().unwrap();
    let m = models
        .iter()
        .find(|m| m["path"] == serde_json::json!(model.canonicalize().unwrap()))
        .unwrap_or_else(|| panic!("fake model not found in {models:?}"));
    assert_eq!(m["status"], "ok");
    assert_eq!(m["facts"]["model_type"], "qwen3_moe");
    assert_eq!(m["facts"]["num_experts"], 8);
    assert_eq!(v["runtime"]["architectures"][0]["model_type"], "qwen3_moe");
    let text = run_ok(
        krasis_cmd(t.path())
            .arg("probe")
            .arg("--runtime")
            .arg(runtime()),
    );
    assert!(text.contains("\nHost:\n  RAM  "), "{text}");
}

#[test]
fn profiles_save_list_show_delete() {
    let t = tempfile::tempdir().unwrap();
    let model = fake_model(t.path());
    let rt = runtime();
    let out = run_ok(
        krasis_cmd(t.path())
            .args([
                "profiles",
                "save",
                "tiny",
                "--backend",
                "reference",
                "--context-length",
                "1024",
                "--runtime",
            ])
            .arg(&rt)
            .arg("--model")
            .arg(&model),
    );
    assert!(out.contains("saved"), "{out}");
    let file = t.path().join("config/profiles/tiny.toml");
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.starts_with("schema = 1"), "{text}");
    let out = run_ok(krasis_cmd(t.path()).args(["profiles", "list"]));
    assert!(out.contains("tiny") && out.contains("[reference]"), "{out}");
    let out = run_ok(krasis_cmd(t.path()).args(["profiles", "show", "tiny"]));
    assert!(out.contains("context_length = 1024"), "{out}");
    // Saving again needs --force.
    let err = run_err(
        krasis_cmd(t.path())
            .args(["profiles", "save", "tiny", "--runtime"])
            .arg(&rt)
            .arg("--model")
            .arg(&model),
    );
    assert!(err.contains("--force"), "{err}");
    // A hand-broken profile is reported with file, line and key.
    std::fs::write(&file, text.replace("context_length", "context_lenght")).unwrap();
    let out = run_ok(krasis_cmd(t.path()).args(["profiles", "list"]));
    assert!(
        out.contains("INVALID") && out.contains("context_lenght"),
        "{out}"
    );
    let err = run_err(
        krasis_cmd(t.path())
            .args(["--profile", "tiny", "--runtime"])
            .arg(&rt),
    );
    assert!(
        err.contains("tiny.toml:") && err.contains("unknown field"),
        "{err}"
    );
    run_ok(krasis_cmd(t.path()).args(["profiles", "delete", "tiny"]));
    let err = run_err(krasis_cmd(t.path()).args(["profiles", "show", "tiny"]));
    assert!(err.contains("no profile named 'tiny'"), "{err}");
}

#[test]
fn unsupported_combinations_are_refused_before_anything_loads() {
    let t = tempfile::tempdir().unwrap();
    let model = fake_model(t.path());
    let rt = runtime();
    let serve = |extra: &[&str]| {
        let mut c = krasis_cmd(t.path());
        c.args(["serve", "--dry-run", "--runtime"])
            .arg(&rt)
            .arg("--model")
            .arg(&model);
        c.args(extra);
        c
    };
    let err = run_err(&mut serve(&[
        "--backend",
        "reference",
        "--kv-format",
        "fp8",
    ]));
    assert!(
        err.contains("kv_format") && err.contains("choose from: bf16"),
        "{err}"
    );
    let err = run_err(&mut serve(&["--backend", "reference", "--hcs", "on"]));
    assert!(err.contains("needs the cuda backend"), "{err}");
    let err = run_err(&mut serve(&[
        "--backend",
        "reference",
        "--context-length",
        "100000",
    ]));
    assert!(err.contains("8192"), "{err}");
    let err = run_err(&mut serve(&["--backend", "reference", "--host", "0.0.0.0"]));
    assert!(err.contains("API key"), "{err}");
    let out = run_ok(&mut serve(&["--backend", "reference"]));
    assert!(
        out.contains("host RAM for routed experts from the checkpoint (bf16, memory-mapped)"),
        "{out}"
    );
    assert!(out.contains("dry run: options are valid"), "{out}");
    let err = run_err(krasis_cmd(t.path()).args(["serve", "--runtime"]).arg(&rt));
    assert!(err.contains("krasis demo"), "{err}");
    let err = run_err(krasis_cmd(t.path()).args([
        "serve",
        "--model",
        "/x",
        "--runtime",
        "/nonexistent/rt",
    ]));
    assert!(err.contains("--runtime /nonexistent/rt"), "{err}");
}

/// A stand-in runtime: reports the real capabilities, asks the real runtime
/// for model facts and plans (`inspect`, `plan`), then serves by printing
/// events and waiting for SIGTERM; records its pid.
#[cfg(unix)]
fn fake_runtime(dir: &Path, on_serve: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let caps = std::process::Command::new(runtime())
        .args(["capabilities", "--json"])
        .output()
        .unwrap();
    std::fs::write(dir.join("caps.json"), caps.stdout).unwrap();
    let p = dir.join("fake-runtime");
    std::fs::write(
        &p,
        format!(
            "#!/bin/sh\nif [ \"$1\" = capabilities ]; then cat {caps}; exit 0; fi\nif [ \"$1\" = inspect ] || [ \"$1\" = plan ]; then exec {real} \"$@\"; fi\necho $$ > {pid}\necho \"$@\" > {args}\n{on_serve}\n",
            caps = dir.join("caps.json").display(),
            real = runtime().display(),
            pid = dir.join("rt.pid").display(),
            args = dir.join("rt.args").display(),
        ),
    )
    .unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

#[cfg(unix)]
#[test]
fn headless_serve_forwards_sigterm_and_leaves_no_process() {
    let t = tempfile::tempdir().unwrap();
    let model = fake_model(t.path());
    let rt = fake_runtime(
        t.path(),
        r#"trap 'echo "stopping" >&2; exit 0' TERM
echo '{"event":"phase","phase":"loading","detail":"reading weights"}'
echo '{"event":"ready","url":"http://127.0.0.1:9","model":"fake"}'
while true; do sleep 0.05; done"#,
    );
    let mut child = krasis_cmd(t.path())
        .args(["serve", "--backend", "reference", "--runtime"])
        .arg(&rt)
        .arg("--model")
        .arg(&model)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    for l in lines.by_ref() {
        let l = l.unwrap();
        seen.push(l.clone());
        if l.starts_with("READY: ") {
            break;
        }
    }
    assert!(
        seen.iter().any(|l| l == "[loading] reading weights"),
        "{seen:?}"
    );
    assert!(
        seen.last().unwrap().contains("http://127.0.0.1:9"),
        "{seen:?}"
    );
    let args = std::fs::read_to_string(t.path().join("rt.args")).unwrap();
    assert!(
        args.starts_with("serve --model") && args.contains("--progress-json"),
        "{args}"
    );
    let rt_pid: u32 = std::fs::read_to_string(t.path().join("rt.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    sigterm(child.id());
    let st = wait_exit(&mut child, Duration::from_secs(20));
    let rest: Vec<String> = lines.map(|l| l.unwrap()).collect();
    assert!(st.success(), "{st:?} {rest:?}");
    assert!(
        rest.iter().any(|l| l.contains("exited normally")),
        "{rest:?}"
    );
    assert!(
        wait_gone(rt_pid, Duration::from_secs(5)),
        "runtime {rt_pid} outlived the launcher"
    );
}

#[cfg(unix)]
#[test]
fn headless_serve_reports_a_dying_runtime() {
    let t = tempfile::tempdir().unwrap();
    let model = fake_model(t.path());
    let rt = fake_runtime(
        t.path(),
        "echo 'loading shard 1' >&2\necho '{\"event\":\"fatal\",\"message\":\"out of memory\"}'\nexit 7",
    );
    let out = krasis_cmd(t.path())
        .args(["serve", "--backend", "reference", "--runtime"])
        .arg(&rt)
        .arg("--model")
        .arg(&model)
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    let se = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{so}\n{se}");
    assert!(se.contains("runtime exited with code 7"), "{se}");
    assert!(
        se.contains("FATAL: out of memory") && se.contains("last log lines"),
        "{se}"
    );
    assert!(se.contains("loading shard 1"), "{se}");
}

/// A runtime that serves, then faults, every time: `krasis serve` restarts
/// it three times (1 s, 2 s, 4 s apart), saying so on stderr, then gives up
/// with a non-zero exit.
#[cfg(unix)]
#[test]
fn headless_serve_restarts_a_crashed_runtime_then_gives_up() {
    let t = tempfile::tempdir().unwrap();
    let model = fake_model(t.path());
    let starts = t.path().join("starts");
    let rt = fake_runtime(
        t.path(),
        &format!(
            r#"echo x >> {}
echo '{{"event":"ready","url":"http://127.0.0.1:9","model":"fake"}}'
echo 'engine thread panicked' >&2
exit 70"#,
            starts.display()
        ),
    );
    let began = std::time::Instant::now();
    let out = krasis_cmd(t.path())
        .args(["serve", "--backend", "reference", "--runtime"])
        .arg(&rt)
        .arg("--model")
        .arg(&model)
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    let se = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{so}\n{se}");
    let n = std::fs::read_to_string(&starts).unwrap().lines().count();
    assert_eq!(n, 4, "one start and three restarts\n{se}");
    for (attempt, delay) in [(1, 1), (2, 2), (3, 4)] {
        let line = format!(
            "runtime crashed (engine fault, exit 70); restarting in {delay} s (attempt {attempt} of 3)"
        );
        assert!(se.lines().any(|l| l == line), "missing {line:?}\n{se}");
    }
    assert_eq!(so.matches("runtime restarted (pid ").count(), 3, "{so}");
    assert_eq!(so.matches("READY: ").count(), 4, "{so}");
    assert!(
        se.contains(
            "runtime crashed (engine fault, exit 70) again after 3 restarts within 10 min; gave up"
        ),
        "{se}"
    );
    assert!(se.contains("engine thread panicked"), "{se}");
    // The backoff was waited for (1 + 2 + 4 s).
    assert!(
        began.elapsed() >= Duration::from_secs(7),
        "{:?}",
        began.elapsed()
    );
}

#[test]
fn build_cache_forwards_and_probe_sees_the_cache() {
    let t = tempfile::tempdir().unwrap();
    let rt = runtime();
    let model = t.path().join("tiny");
    let st = std::process::Command::new(&rt)
        .args(["synth", "--preset", "tiny", "--out"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(
        st.status.success(),
        "synth: {}",
        String::from_utf8_lossy(&st.stderr)
    );
    let cache = t.path().join("cache");
    let probe = || {
        let out = run_ok(
            krasis_cmd(t.path())
                .args(["probe", "--json", "--runtime"])
                .arg(&rt)
                .arg("--model-root")
                .arg(t.path())
                .arg("--cache-dir")
                .arg(&cache),
        );
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        let m = v["models"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == "tiny")
            .cloned()
            .unwrap_or_else(|| panic!("tiny not found: {v}"));
        m["cache"].clone()
    };
    assert_eq!(probe()["status"], "missing");
    run_ok(
        krasis_cmd(t.path())
            .args(["build-cache", "--runtime"])
            .arg(&rt)
            .arg("--model")
            .arg(&model)
            .arg("--cache-dir")
            .arg(&cache),
    );
    let c = probe();
    assert_eq!(c["status"], "valid", "{c}");
    assert!(
        c["path"]
            .as_str()
            .unwrap()
            .starts_with(cache.to_str().unwrap())
    );
    // A damaged cache is reported, not trusted.
    let path = std::path::PathBuf::from(c["path"].as_str().unwrap());
    std::fs::write(&path, b"not a cache").unwrap();
    assert_eq!(probe()["status"], "invalid");
    let err = run_err(
        krasis_cmd(t.path())
            .args(["build-cache", "--model", "/nonexistent", "--runtime"])
            .arg(&rt),
    );
    assert!(err.contains("not a Hugging Face model directory"), "{err}");
}

#[test]
fn no_terminal_no_command_prints_help() {
    let t = tempfile::tempdir().unwrap();
    let out = krasis_cmd(t.path()).stdin(Stdio::null()).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a terminal"));
}
