//! Helpers shared by the launcher's integration tests.
#![allow(dead_code)]

pub mod shape;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

pub fn krasis() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_krasis"))
}

/// krasis-runtime next to krasis in target/; the test runner must build it.
pub fn runtime() -> PathBuf {
    let p = krasis().with_file_name(if cfg!(windows) {
        "krasis-runtime.exe"
    } else {
        "krasis-runtime"
    });
    assert!(
        p.is_file(),
        "{} is missing: build it first with `cargo build -p krasis-runtime` (or run `cargo test --workspace`)",
        p.display()
    );
    p
}

/// `krasis` with config and data dirs inside `tmp`, so tests never touch
/// the real profile directory.
pub fn krasis_cmd(tmp: &Path) -> Command {
    let mut c = Command::new(krasis());
    c.arg("--config-dir")
        .arg(tmp.join("config"))
        .arg("--data-dir")
        .arg(tmp.join("data"));
    c
}

/// [`krasis_cmd`] that also sees no model roots of this machine: it runs in
/// `tmp` (so `./models` is `tmp/models`) with the Hugging Face cache at
/// `tmp/hub`.
///
/// The runtime finds the Qwen vocabulary under the working directory's
/// ancestors, so `tmp/.cache/vocab` links to the workspace's copy (its
/// fallback, the workspace it was built in, is not always this one).
pub fn krasis_isolated(tmp: &Path) -> Command {
    let vocab = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/vocab");
    let link = tmp.join(".cache/vocab");
    if vocab.is_dir() && !link.exists() {
        std::fs::create_dir_all(tmp.join(".cache")).unwrap();
        #[cfg(unix)]
        std::os::unix::fs::symlink(&vocab, &link).unwrap();
    }
    let mut c = krasis_cmd(tmp);
    c.current_dir(tmp)
        .env("HF_HUB_CACHE", tmp.join("hub"))
        .env_remove("HF_HOME");
    c
}

/// A qwen3_moe model directory `krasis-runtime inspect` accepts: config.json
/// and a safetensors file whose header names one empty BF16 tensor (inspect
/// reads headers only, so no weights are needed).
pub fn fake_model(dir: &Path) -> PathBuf {
    let m = dir.join("fake-qwen3-moe");
    std::fs::create_dir_all(&m).unwrap();
    std::fs::write(
        m.join("config.json"),
        r#"{"model_type":"qwen3_moe","vocab_size":512,"hidden_size":128,"intermediate_size":256,
"moe_intermediate_size":128,"num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,
"head_dim":32,"max_position_embeddings":8192,"num_experts":8,"num_experts_per_tok":2,
"torch_dtype":"bfloat16"}"#,
    )
    .unwrap();
    let header =
        br#"{"model.embed_tokens.weight":{"dtype":"BF16","shape":[0],"data_offsets":[0,0]}}"#;
    let mut st = (header.len() as u64).to_le_bytes().to_vec();
    st.extend_from_slice(header);
    std::fs::write(m.join("model.safetensors"), st).unwrap();
    m
}

/// Runs `c`, asserts it succeeded, returns its stdout.
pub fn run_ok(c: &mut Command) -> String {
    let out = c.output().unwrap();
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        out.status.success(),
        "failed: {c:?}\nstdout:\n{so}\nstderr:\n{se}"
    );
    so
}

/// Runs `c`, asserts it failed, returns its stderr.
pub fn run_err(c: &mut Command) -> String {
    let out = c.output().unwrap();
    assert!(!out.status.success(), "should have failed: {c:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Running, not a zombie (containers often have no init to reap orphans).
pub fn alive(pid: u32) -> bool {
    if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        let state = stat
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().next());
        return state != Some("Z");
    }
    #[cfg(unix)]
    // SAFETY: signal 0 only checks existence.
    unsafe {
        libc_kill(pid as i32, 0) == 0
    }
    #[cfg(not(unix))]
    false
}

#[cfg(unix)]
unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

#[cfg(unix)]
pub fn sigterm(pid: u32) {
    // SAFETY: signals a process this test started.
    unsafe {
        libc_kill(pid as i32, 15);
    }
}

pub fn wait_exit(child: &mut Child, timeout: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("process {} did not exit within {timeout:?}", child.id());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn wait_gone(pid: u32, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while alive(pid) {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    true
}

#[cfg(unix)]
pub fn sigkill(pid: u32) {
    // SAFETY: signals a process this test started (or its child).
    unsafe {
        libc_kill(pid as i32, 9);
    }
}

/// Live children of `pid`, from the parent field of every `/proc/N/stat`.
#[cfg(target_os = "linux")]
pub fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(n) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{n}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid ...": comm may contain spaces, so split after ')'.
        let mut rest = stat.rsplit(')').next().unwrap_or("").split_whitespace();
        let state = rest.next();
        let ppid = rest.next().and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(pid) && state != Some("Z") {
            out.push(n);
        }
    }
    out
}

/// The argv of a running process, joined with spaces.
#[cfg(target_os = "linux")]
pub fn cmdline(pid: u32) -> String {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    String::from_utf8_lossy(&raw).replace('\0', " ")
}

/// Synthesizes the `tiny` checkpoint with the real runtime.
pub fn tiny_model(rt: &Path, dir: &Path) -> PathBuf {
    let model = dir.join("tiny");
    let st = Command::new(rt)
        .args(["synth", "--preset", "tiny", "--out"])
        .arg(&model)
        .status()
        .unwrap();
    assert!(st.success(), "krasis-runtime synth failed: {st}");
    model
}
