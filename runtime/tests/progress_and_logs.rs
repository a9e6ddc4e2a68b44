//! What the real binary writes while it starts, with its output piped as
//! the launcher pipes it: `--progress-json` byte progress for building the
//! expert cache and for loading weights (throttled, never decreasing,
//! ending at the total), and logs with no ANSI escape codes.

use krasis_common::events::{PROGRESS_INTERVAL, ProgressEvent, task};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn runtime() -> &'static str {
    env!("CARGO_BIN_EXE_krasis-runtime")
}

/// A synthesized `tiny` checkpoint in `dir` (with the Qwen tokenizer when
/// `tokenizer`; serving needs one).
fn tiny(dir: &Path, tokenizer: bool) -> PathBuf {
    let out = dir.join("tiny");
    let mut c = Command::new(runtime());
    c.args(["synth", "--preset", "tiny", "--out"]).arg(&out);
    if !tokenizer {
        c.arg("--no-tokenizer");
    }
    let o = c.output().unwrap();
    assert!(
        o.status.success(),
        "synth failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

/// `(done, total)` of the byte-progress events of `task` in `stdout`.
fn byte_progress(stdout: &str, want: &str) -> Vec<(u64, u64)> {
    stdout
        .lines()
        .filter_map(ProgressEvent::parse_line)
        .filter_map(|e| match e {
            ProgressEvent::Progress {
                task,
                done,
                total,
                unit,
            } if task == want => {
                assert_eq!(unit, "bytes", "{task}");
                Some((done, total))
            }
            _ => None,
        })
        .collect()
}

/// Starts at 0, never decreases, ends at a non-zero total, and at most one
/// event per interval besides the first and the last.
fn check_progress(label: &str, events: &[(u64, u64)], elapsed: Duration) {
    let (first, last) = (events.first(), events.last());
    let total = last.map_or(0, |e| e.1);
    assert!(total > 0, "{label}: no byte progress: {events:?}");
    assert_eq!(first, Some(&(0, total)), "{label}: {events:?}");
    assert_eq!(last, Some(&(total, total)), "{label}: {events:?}");
    assert!(
        events.iter().all(|e| e.1 == total) && events.windows(2).all(|w| w[0].0 <= w[1].0),
        "{label}: {events:?}"
    );
    let most = 2.0 + elapsed.as_secs_f64() / PROGRESS_INTERVAL.as_secs_f64();
    assert!(
        events.len() as f64 <= most + 1.0,
        "{label}: {} events in {elapsed:?}",
        events.len()
    );
}

#[test]
fn build_cache_reports_byte_progress_to_the_total() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny(tmp.path(), false);
    let t = Instant::now();
    let o = Command::new(runtime())
        .args(["build-cache", "--progress-json", "--model"])
        .arg(&model)
        .arg("--cache-dir")
        .arg(tmp.path().join("cache"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let events = byte_progress(&stdout, task::BUILD_EXPERT_CACHE);
    check_progress("build-cache", &events, t.elapsed());
    assert_no_ansi("build-cache", &String::from_utf8_lossy(&o.stderr));
}

/// Runs `serve` on the reference backend with stdout and stderr piped
/// until it reports `ready` (or 120 s pass), then stops it; returns its
/// stdout, its stderr and how long it ran.
fn serve_until_ready(model: &Path) -> (String, String, Duration) {
    // A port that was free a moment ago (serve refuses port 0).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port()
        .to_string();
    let t = Instant::now();
    let mut child = Command::new(runtime())
        .args(["serve", "--backend", "reference", "--progress-json"])
        .args(["--host", "127.0.0.1", "--port", &port])
        .arg("--model")
        .arg(model)
        .env_remove("KRASIS_API_KEY")
        .env("KRASIS_LOG", "debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let ready = matches!(
                ProgressEvent::parse_line(&line),
                Some(ProgressEvent::Ready { .. } | ProgressEvent::Fatal { .. })
            );
            if tx.send(line).is_err() || ready {
                break;
            }
        }
    });
    let mut out = String::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while let Ok(line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        out.push_str(&line);
        out.push('\n');
    }
    let elapsed = t.elapsed();
    let _ = child.kill();
    let _ = child.wait();
    (out, err.join().unwrap(), elapsed)
}

#[test]
fn serve_reports_load_progress_and_logs_without_ansi_codes() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tiny(tmp.path(), true);
    let (stdout, stderr, elapsed) = serve_until_ready(&model);
    assert!(
        stdout.contains("\"event\":\"ready\""),
        "not ready: {stdout}\n{stderr}"
    );
    let events = byte_progress(&stdout, task::LOAD_WEIGHTS);
    check_progress("serve (reference) weights", &events, elapsed);
    assert!(
        stderr.contains("listening on"),
        "no log lines to check: {stderr}"
    );
    assert_no_ansi("serve", &stderr);
}

fn assert_no_ansi(label: &str, text: &str) {
    assert!(
        !text.contains("\x1b["),
        "{label}: ANSI escape codes in piped output: {text:?}"
    );
}
