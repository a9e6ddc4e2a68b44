//! `krasis-runtime serve` refuses what it does not implement, and keys on
//! its command line, before it loads anything or binds a port: the real
//! binary against a synthesized `tiny` checkpoint.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

fn runtime() -> &'static str {
    env!("CARGO_BIN_EXE_krasis-runtime")
}

/// One `tiny` checkpoint (weights and config only) for every test here.
fn tiny() -> &'static Path {
    static DIR: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &DIR.get_or_init(|| {
        let t = tempfile::tempdir().unwrap();
        let out = t.path().join("tiny");
        let st = Command::new(runtime())
            .args(["synth", "--preset", "tiny", "--no-tokenizer", "--out"])
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            st.status.success(),
            "synth failed: {}",
            String::from_utf8_lossy(&st.stderr)
        );
        (t, out)
    })
    .1
}

fn serve(extra: &[&str], env: &[(&str, &str)]) -> Output {
    // A port this test holds: a run that gets past the checks fails to bind
    // (and says "binding") instead of serving forever.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let mut c = Command::new(runtime());
    c.args(["serve", "--model"])
        .arg(tiny())
        .args(["--backend", "reference", "--port", &port, "--progress-json"])
        .args(extra)
        .env_remove("KRASIS_API_KEY");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

/// Stderr and stdout of a run that must fail before binding.
fn refused(o: &Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(!o.status.success(), "serve succeeded: {err}");
    assert!(
        !err.contains("is another server using the port"),
        "got as far as binding: {err}"
    );
    assert!(out.contains("\"fatal\""), "no fatal progress event: {out}");
    format!("{err}\n{out}")
}

#[test]
fn each_unimplemented_engine_option_is_refused_with_what_is_implemented() {
    for (flag, value, option, implemented) in [
        ("--kv-format", "fp8", "kv_format", "bf16"),
        ("--mlp-precision", "fp8", "mlp_precision", "bf16"),
        ("--expert-precision", "int8", "expert_precision", "int4"),
        (
            "--attention-precision",
            "fp8",
            "attention_precision",
            "bf16",
        ),
        ("--pruning", "top4", "pruning", "off"),
    ] {
        let text = refused(&serve(&[flag, value], &[]));
        let want = format!(
            "option '{option}': '{value}' is not implemented for 'qwen3_moe' in this runtime (choose from: {implemented})"
        );
        assert!(text.contains(&want), "{flag} {value}:\n{text}");
    }
}

#[test]
fn api_key_on_the_command_line_is_refused_without_repeating_it() {
    let text = refused(&serve(&["--api-key", "k3y-on-the-cmdline-123"], &[]));
    assert!(text.contains("--api-key-file"), "{text}");
    assert!(text.contains("KRASIS_API_KEY"), "{text}");
    assert!(!text.contains("k3y-on-the-cmdline"), "{text}");
}

#[test]
fn weak_keys_from_the_environment_are_refused_on_a_public_bind() {
    let text = refused(&serve(
        &["--host", "0.0.0.0"],
        &[("KRASIS_API_KEY", "change-me")],
    ));
    assert!(text.contains("placeholder"), "{text}");
    let help = Command::new(runtime())
        .args(["serve", "--help"])
        .env("KRASIS_API_KEY", "never-shown-in-help-123")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("--api-key-file"), "{help}");
    assert!(!help.contains("never-shown"), "{help}");
}

#[test]
fn the_reference_backend_refuses_a_gpu_ordinal() {
    let text = refused(&serve(&["--gpu", "1"], &[]));
    assert!(text.contains("--gpu"), "{text}");
}
