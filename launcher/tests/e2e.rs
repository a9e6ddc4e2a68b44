//! End to end: the real `krasis` starts the real `krasis-runtime` (reference
//! backend, synthesized `tiny` checkpoint) from a saved profile, waits for
//! ready, a chat request succeeds, and Ctrl-C-style shutdown leaves no process;
//! a runtime killed while serving is restarted and serves again, and the API
//! key never appears in the runtime's argv.
#![cfg(unix)]

mod common;

use common::*;
use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::Duration;

#[test]
fn profile_to_ready_to_chat_to_clean_shutdown() {
    let rt = runtime();
    let t = tempfile::tempdir().unwrap();
    let model = t.path().join("tiny");
    let st = std::process::Command::new(&rt)
        .args(["synth", "--preset", "tiny", "--out"])
        .arg(&model)
        .status()
        .unwrap();
    assert!(st.success(), "krasis-runtime synth failed: {st}");

    let port = free_port();
    let profiles = t.path().join("config/profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::write(
        profiles.join("e2e.toml"),
        format!(
            "schema = 1\nname = \"e2e\"\n\n[options]\nmodel = {:?}\nbackend = \"reference\"\nhcs = false\nport = {port}\ncontext_length = 512\n",
            model.display().to_string()
        ),
    )
    .unwrap();

    let mut child = krasis_cmd(t.path())
        .arg("--runtime")
        .arg(&rt)
        .args(["--profile", "e2e"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
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
    let (mut url, mut rt_pid) = (None, None);
    while url.is_none() {
        let l = rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| panic!("no READY within 120 s; output so far: {seen:#?}"));
        if let Some(p) = l.strip_prefix("runtime started (pid ") {
            rt_pid = p.split(')').next().and_then(|p| p.parse::<u32>().ok());
        }
        if let Some(rest) = l.strip_prefix("READY: ") {
            url = rest.split_whitespace().next().map(str::to_string);
        }
        seen.push(l);
    }
    let url = url.unwrap();
    let rt_pid = rt_pid.expect("launcher printed the runtime pid");
    assert_eq!(url, format!("http://127.0.0.1:{port}"));

    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let health: krasis_common::Health = http
        .get(format!("{url}/health"))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(health.status, krasis_common::status::HealthStatus::Ok);
    assert!(health.model_loaded);
    assert_eq!(health.backend, "reference");
    let body = chat_hello(&http, &url, &health.model.clone().unwrap_or_default());
    assert!(
        body["usage"]["completion_tokens"].as_u64().unwrap() >= 1,
        "{body}"
    );

    sigterm(child.id());
    let st = wait_exit(&mut child, Duration::from_secs(30));
    let rest = rest_of_output(&rx, |l| l);
    assert!(st.success(), "launcher exit {st:?}; output {rest:?}");
    assert!(
        rest.iter().any(|l| l.contains("runtime exited normally")),
        "{rest:?}"
    );
    assert!(
        wait_gone(rt_pid, Duration::from_secs(5)),
        "runtime {rt_pid} left behind"
    );
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "port {port} still served after shutdown"
    );
}

/// Lines of a launcher's stdout and stderr, in arrival order per stream.
struct Output {
    rx: std::sync::mpsc::Receiver<(bool, String)>,
    seen: Vec<String>,
}

impl Output {
    fn follow(child: &mut std::process::Child) -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
        let out = child.stdout.take().unwrap();
        let err = child.stderr.take().unwrap();
        let t = tx.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if t.send((false, l)).is_err() {
                    return;
                }
            }
        });
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(Result::ok) {
                if tx.send((true, l)).is_err() {
                    return;
                }
            }
        });
        Output {
            rx,
            seen: Vec::new(),
        }
    }

    /// The first line (on stderr if `stderr`, else stdout) that `want` accepts.
    fn wait_for(&mut self, stderr: bool, timeout: Duration, want: impl Fn(&str) -> bool) -> String {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let (is_err, l) = match self.rx.recv_timeout(left) {
                Ok(x) => x,
                Err(e) => panic!(
                    "no matching line on {} ({}); output so far: {:#?}",
                    if stderr { "stderr" } else { "stdout" },
                    match e {
                        std::sync::mpsc::RecvTimeoutError::Timeout => format!("waited {timeout:?}"),
                        std::sync::mpsc::RecvTimeoutError::Disconnected =>
                            "the launcher closed its output".to_string(),
                    },
                    self.seen
                ),
            };
            self.seen
                .push(format!("{}{l}", if is_err { "E " } else { "O " }));
            if is_err == stderr && want(&l) {
                return l;
            }
        }
    }
}

/// The launcher's one runtime child, found through /proc.
/// The output lines still to come once the launcher exited: its reader
/// thread may still be forwarding the last ones (seen under load), so this
/// waits for the channel to close (at most 10 s) instead of taking what
/// already arrived.
fn rest_of_output<T>(rx: &std::sync::mpsc::Receiver<T>, line: impl Fn(T) -> String) -> Vec<String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(l) => out.push(line(l)),
            Err(_) => break,
        }
    }
    out
}

fn only_runtime_child(launcher: u32, timeout: Duration) -> u32 {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let kids = children_of(launcher);
        if let [pid] = kids.as_slice()
            && cmdline(*pid).contains(" serve ")
        {
            return *pid;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "launcher {launcher} has children {kids:?}, not one runtime"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Health says ok, the key is needed and enough, and the model generates.
/// A 4-token chat answer to "Hello" from `model` at `url`, checked to be a
/// successful chat completion with text.
fn chat_hello(http: &reqwest::blocking::Client, url: &str, model: &str) -> serde_json::Value {
    let r = http
        .post(format!("{url}/v1/chat/completions"))
        .json(&serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 4,
        }))
        .send()
        .unwrap();
    assert!(r.status().is_success(), "chat failed: {}", r.status());
    let body: serde_json::Value = r.json().unwrap();
    assert!(
        body["choices"][0]["message"]["content"].is_string(),
        "{body}"
    );
    body
}

fn serves_with_key(url: &str, key: &str) {
    let health = krasis::supervisor::StatsClient::new(url, None)
        .unwrap()
        .wait_ready(Duration::from_secs(120))
        .unwrap();
    assert!(health.model_loaded);
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let r = http.get(format!("{url}/v1/models")).send().unwrap();
    assert_eq!(r.status().as_u16(), 401, "no key must be refused");
    let r = http
        .get(format!("{url}/v1/models"))
        .bearer_auth("not-the-key")
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 401, "a wrong key must be refused");
    let r = http
        .post(format!("{url}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&serde_json::json!({
            "model": health.model.clone().unwrap_or_default(),
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 2,
        }))
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "chat with the key");
}

#[cfg(target_os = "linux")]
#[test]
fn killed_runtime_is_restarted_and_the_key_stays_out_of_argv() {
    const KEY: &str = "e2e-secret-key-3f9a1c";
    let rt = runtime();
    let t = tempfile::tempdir().unwrap();
    let model = tiny_model(&rt, t.path());
    let port = free_port();
    let profiles = t.path().join("config/profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    std::fs::write(
        profiles.join("keyed.toml"),
        format!(
            "schema = 1\nname = \"keyed\"\n\n[options]\nmodel = {:?}\nbackend = \"reference\"\nhcs = false\nport = {port}\ncontext_length = 512\n",
            model.display().to_string()
        ),
    )
    .unwrap();
    // The key reaches the launcher through its environment; the supervisor
    // does not let the runtime inherit that, so the runtime can only have
    // it if the launcher passes it on (and must not do so in argv).
    let mut child = krasis_cmd(t.path())
        .env("KRASIS_API_KEY", KEY)
        .arg("--runtime")
        .arg(&rt)
        .args(["serve", "--profile", "keyed"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let launcher = child.id();
    let mut out = Output::follow(&mut child);
    let started = out.wait_for(false, Duration::from_secs(30), |l| {
        l.starts_with("runtime started (pid ")
    });
    let ready = out.wait_for(false, Duration::from_secs(120), |l| {
        l.starts_with("READY: ")
    });
    let url = format!("http://127.0.0.1:{port}");
    assert!(ready.contains(&url), "{ready}");

    let first = only_runtime_child(launcher, Duration::from_secs(5));
    assert!(started.contains(&format!("(pid {first})")), "{started}");
    let argv = cmdline(first);
    assert!(argv.contains("--port"), "{argv}");
    assert!(
        !argv.contains(KEY),
        "the API key is in the runtime's argv: {argv}"
    );
    serves_with_key(&url, KEY);

    // An injected crash: the runtime dies without the launcher asking.
    let crashed_at = std::time::Instant::now();
    sigkill(first);
    let msg = out.wait_for(true, Duration::from_secs(30), |l| {
        l.starts_with("runtime crashed")
    });
    assert_eq!(
        msg,
        "runtime crashed (killed by signal 9 (SIGKILL)); restarting in 1 s (attempt 1 of 3)"
    );
    let restarted = out.wait_for(false, Duration::from_secs(30), |l| {
        l.starts_with("runtime restarted (pid ")
    });
    let second = only_runtime_child(launcher, Duration::from_secs(5));
    assert_ne!(second, first);
    assert!(
        restarted.contains(&format!("(pid {second})")),
        "{restarted}"
    );
    assert!(!alive(first), "the crashed runtime {first} is still there");
    let argv = cmdline(second);
    assert!(
        !argv.contains(KEY),
        "the API key is in the restarted runtime's argv: {argv}"
    );
    serves_with_key(&url, KEY);
    assert!(
        crashed_at.elapsed() < Duration::from_secs(150),
        "took {:?} to serve again",
        crashed_at.elapsed()
    );

    sigterm(launcher);
    let st = wait_exit(&mut child, Duration::from_secs(30));
    let rest = rest_of_output(&out.rx, |(_, l)| l);
    assert!(st.success(), "launcher exit {st:?}; output {rest:?}");
    for pid in [first, second] {
        assert!(
            wait_gone(pid, Duration::from_secs(5)),
            "runtime {pid} left behind"
        );
    }
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "port {port} still served after shutdown"
    );
}

/// `profiles/demo-cpu.toml` exactly as shipped, on a machine that has never
/// run `krasis demo`: its model name is resolved (the demo model created in
/// the data dir), it serves a chat, and stops cleanly.
#[test]
fn the_shipped_demo_profile_serves_a_chat() {
    let rt = runtime();
    let t = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut child = krasis_isolated(t.path())
        .arg("--runtime")
        .arg(&rt)
        .args(["serve", "--profile", "demo-cpu", "--port"])
        .arg(port.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = Output::follow(&mut child);
    let ready = out.wait_for(false, Duration::from_secs(180), |l| {
        l.starts_with("READY: ")
    });
    let url = format!("http://127.0.0.1:{port}");
    assert!(ready.contains(&url), "{ready}");
    assert!(
        out.seen
            .iter()
            .any(|l| l.contains("Creating the demo model in") && l.contains("krasis-demo-tiny")),
        "{:#?}",
        out.seen
    );
    let http = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    chat_hello(&http, &url, "krasis-demo-tiny");

    sigterm(child.id());
    let st = wait_exit(&mut child, Duration::from_secs(30));
    assert!(st.success(), "launcher exit {st:?}; output {:#?}", out.seen);
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "port {port} still served after shutdown"
    );
}
