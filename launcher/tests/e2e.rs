//! End to end: the real `krasis` starts the real `krasis-runtime` (reference
//! backend, synthesized `tiny` checkpoint) from a saved profile, waits for
//! ready, a chat request succeeds, and Ctrl-C-style shutdown leaves no process.
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
    assert!(health.model_loaded);
    assert_eq!(health.backend, "reference");
    let r = http
        .post(format!("{url}/v1/chat/completions"))
        .json(&serde_json::json!({
            "model": health.model.clone().unwrap_or_default(),
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
    assert!(
        body["usage"]["completion_tokens"].as_u64().unwrap() >= 1,
        "{body}"
    );

    sigterm(child.id());
    let st = wait_exit(&mut child, Duration::from_secs(30));
    let rest: Vec<String> = rx.try_iter().collect();
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
