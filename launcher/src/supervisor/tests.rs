//! The supervisor against stand-in runtimes (shell scripts) and a scripted
//! HTTP server.

use super::*;
use krasis_common::status::HealthStatus;

/// A stand-in runtime: a shell script that prints events and logs, and
/// either exits, or waits for SIGTERM (or ignores it).
fn script(dir: &Path, body: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join("fake-runtime");
    std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

/// Running (a zombie whose parent is gone counts as dead: containers
/// often have no init that reaps it).
fn alive(pid: u32) -> bool {
    if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        let state = stat
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().next());
        return state != Some("Z");
    }
    // SAFETY: signal 0 only checks existence.
    unsafe { libc::kill(pid as libc::pid_t, 0) == 0 }
}

/// A fast policy for tests: 3 restarts within a minute, 10 ms backoff.
fn quick() -> RestartPolicy {
    RestartPolicy {
        max_restarts: 3,
        window: Duration::from_secs(60),
        first_backoff: Duration::from_millis(10),
    }
}

/// A fake runtime that counts its starts in `dir/starts` (so `$n` is
/// this start's number) before running `body`.
fn counting_script(dir: &Path, body: &str) -> std::path::PathBuf {
    let count = dir.join("starts");
    script(
        dir,
        &format!(
            "n=$(cat {c} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {c}\n{body}",
            c = count.display()
        ),
    )
}

fn starts(dir: &Path) -> u32 {
    std::fs::read_to_string(dir.join("starts"))
        .map(|s| s.trim().parse().unwrap())
        .unwrap_or(0)
}

const READY: &str = r#"echo '{"event":"ready","url":"http://127.0.0.1:1","model":"m"}'"#;

/// Every event until the final exit (or `limit`).
fn all_events(s: &mut Supervisor, limit: Duration) -> Vec<SupEvent> {
    let deadline = Instant::now() + limit;
    let mut evs = Vec::new();
    while Instant::now() < deadline {
        match s.next_event(Duration::from_millis(200)) {
            Some(e) => {
                let last = matches!(e, SupEvent::Exited { .. });
                evs.push(e);
                if last {
                    break;
                }
            }
            None if s.exit_reported && !s.restart_pending() && s.open_pipes == 0 => break,
            None => {}
        }
    }
    evs
}

fn restarts_of(evs: &[SupEvent]) -> Vec<&Restart> {
    evs.iter()
        .filter_map(|e| match e {
            SupEvent::Restarting(r) => Some(r),
            _ => None,
        })
        .collect()
}

#[test]
fn engine_fault_after_ready_is_restarted_with_backoff_until_the_bound() {
    let t = tempfile::tempdir().unwrap();
    // Ready, then the engine faults; every time.
    let rt = counting_script(t.path(), &format!("{READY}\necho \"start $n\"\nexit 70"));
    let mut s = Supervisor::spawn(&rt, &[], &[], quick()).unwrap();
    let first = s.pid();
    let evs = all_events(&mut s, Duration::from_secs(30));
    let r = restarts_of(&evs);
    assert_eq!(r.len(), 3, "{evs:#?}");
    for (i, r) in r.iter().enumerate() {
        assert_eq!(r.reason, "engine fault, exit 70");
        assert_eq!((r.attempt, r.max), (i as u32 + 1, 3));
        assert_eq!(r.delay, Duration::from_millis(10 << i));
    }
    assert_eq!(
        r[1].to_string(),
        "runtime crashed (engine fault, exit 70); restarting in 20 ms (attempt 2 of 3)"
    );
    let pids: Vec<u32> = evs
        .iter()
        .filter_map(|e| match e {
            SupEvent::Restarted { pid } => Some(*pid),
            _ => None,
        })
        .collect();
    assert_eq!(pids.len(), 3);
    assert!(!pids.contains(&first));
    // Output of every start reaches the front end.
    for n in 1..=4 {
        assert!(
            evs.contains(&SupEvent::Log(format!("start {n}"))),
            "{evs:#?}"
        );
    }
    match evs.last().unwrap() {
        SupEvent::Exited {
            success: false,
            description,
        } => assert_eq!(
            description,
            "crashed (engine fault, exit 70) again after 3 restarts within 1 min; gave up"
        ),
        other => panic!("not a final exit: {other:?}"),
    }
    assert_eq!(starts(t.path()), 4, "one start and three restarts");
    assert!(s.next_event(Duration::from_millis(300)).is_none());
    assert_eq!(starts(t.path()), 4);
    assert!(s.tail(20).iter().any(|l| l.contains("gave up")));
}

#[test]
fn a_restarted_runtime_that_serves_again_is_not_counted_forever() {
    let t = tempfile::tempdir().unwrap();
    // Crashes well after each restart's window is over; the 5th start
    // exits cleanly. Every restart is therefore "attempt 1".
    let rt = counting_script(
        t.path(),
        &format!("{READY}\nif [ $n -ge 5 ]; then exit 0; fi\nsleep 0.3\nexit 1"),
    );
    let policy = RestartPolicy {
        window: Duration::from_millis(100),
        ..quick()
    };
    let mut s = Supervisor::spawn(&rt, &[], &[], policy).unwrap();
    let evs = all_events(&mut s, Duration::from_secs(30));
    let r = restarts_of(&evs);
    assert_eq!(r.len(), 4, "{evs:#?}");
    assert!(r.iter().all(|r| r.attempt == 1 && r.reason == "exit 1"));
    assert_eq!(
        evs.last().unwrap(),
        &SupEvent::Exited {
            success: true,
            description: "exited normally (code 0)".into()
        }
    );
    assert_eq!(starts(t.path()), 5);
}

#[test]
fn a_signal_the_launcher_did_not_send_is_a_crash() {
    let t = tempfile::tempdir().unwrap();
    let rt = counting_script(
        t.path(),
        &format!("{READY}\nif [ $n -ge 2 ]; then exit 0; fi\nkill -9 $$"),
    );
    let mut s = Supervisor::spawn(&rt, &[], &[], quick()).unwrap();
    let evs = all_events(&mut s, Duration::from_secs(30));
    let r = restarts_of(&evs);
    assert_eq!(r.len(), 1, "{evs:#?}");
    assert_eq!(r[0].reason, "killed by signal 9 (SIGKILL)");
    assert_eq!(starts(t.path()), 2);
}

#[test]
fn load_failures_and_clean_exits_are_not_restarted() {
    for (body, description) in [
        // Fails before ever being ready: a load failure would repeat.
        ("exit 70".to_string(), "exited with code 70"),
        ("kill -9 $$".to_string(), "killed by signal 9 (SIGKILL)"),
        // Ready, then a clean exit: someone stopped it on purpose.
        (format!("{READY}\nexit 0"), "exited normally (code 0)"),
    ] {
        let t = tempfile::tempdir().unwrap();
        let rt = counting_script(t.path(), &body);
        let mut s = Supervisor::spawn(&rt, &[], &[], quick()).unwrap();
        let evs = all_events(&mut s, Duration::from_secs(10));
        assert!(restarts_of(&evs).is_empty(), "{body}: {evs:#?}");
        assert!(
            matches!(evs.last(), Some(SupEvent::Exited { description: d, .. }) if d == description),
            "{body}: {evs:#?}"
        );
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(starts(t.path()), 1, "{body}");
    }
}

#[test]
fn shutdown_is_never_followed_by_a_restart() {
    let t = tempfile::tempdir().unwrap();
    // Ready and running: SIGTERM from the launcher ends it with a
    // non-zero code, which must not count as a crash.
    let rt = counting_script(
        t.path(),
        &format!("trap 'exit 143' TERM\n{READY}\nwhile true; do sleep 0.05; done"),
    );
    let mut s = Supervisor::spawn(&rt, &[], &[], quick()).unwrap();
    assert!(matches!(
        s.next_event(Duration::from_secs(10)),
        Some(SupEvent::Progress(ProgressEvent::Ready { .. }))
    ));
    let how = s.shutdown(Duration::from_secs(10));
    assert_eq!(how.description, "exited with code 143");
    assert!(!how.clean, "only code 0 is a clean stop");
    let evs = all_events(&mut s, Duration::from_secs(1));
    assert!(restarts_of(&evs).is_empty(), "{evs:#?}");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(starts(t.path()), 1);

    // Stopped while waiting for the backoff: the restart is cancelled.
    let t = tempfile::tempdir().unwrap();
    let rt = counting_script(t.path(), &format!("{READY}\nexit 70"));
    let policy = RestartPolicy {
        first_backoff: Duration::from_secs(30),
        ..quick()
    };
    let mut s = Supervisor::spawn(&rt, &[], &[], policy).unwrap();
    let evs = all_events(&mut s, Duration::from_secs(2));
    assert_eq!(restarts_of(&evs).len(), 1, "{evs:#?}");
    assert!(s.restart_pending());
    let how = s.shutdown(Duration::from_secs(1));
    assert!(how.description.contains("restart cancelled"), "{how}");
    assert!(!how.clean, "its last runtime crashed");
    assert!(!s.restart_pending());
    assert_eq!(s.next_event(Duration::from_millis(200)), None);
    assert_eq!(starts(t.path()), 1);
}

#[test]
fn environment_reaches_every_start_and_stays_out_of_argv() {
    let t = tempfile::tempdir().unwrap();
    let rt = counting_script(
        t.path(),
        &format!(
            "echo \"key=$KRASIS_TEST_SECRET args=$*\"\n{READY}\nif [ $n -ge 2 ]; then exit 0; fi\nexit 70"
        ),
    );
    let env = [("KRASIS_TEST_SECRET".to_string(), "s3cret".to_string())];
    let mut s = Supervisor::spawn(&rt, &["serve".into()], &env, quick()).unwrap();
    let evs = all_events(&mut s, Duration::from_secs(10));
    let seen: Vec<&SupEvent> = evs
        .iter()
        .filter(|e| **e == SupEvent::Log("key=s3cret args=serve".into()))
        .collect();
    assert_eq!(seen.len(), 2, "{evs:#?}");
}

#[test]
fn health_reads_loading_and_error_from_a_503() {
    use std::io::Write;
    // A one-connection-at-a-time HTTP server answering from a script.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let answers = [
        (
            503,
            r#"{"status":"loading","phase":"loading","model_loaded":false,"model":"m","backend":"reference"}"#,
        ),
        (
            503,
            r#"{"status":"loading","phase":"calibrating","model_loaded":false,"model":"m","backend":"cuda"}"#,
        ),
        (
            200,
            r#"{"status":"ok","phase":"ready","model_loaded":true,"model":"m","backend":"cuda"}"#,
        ),
        (
            503,
            r#"{"status":"error","phase":"failed","model_loaded":false,"model":"m","backend":"cuda","error":"CUDA error 700"}"#,
        ),
        (
            500,
            r#"{"status":"ok","phase":"ready","model_loaded":true,"model":"m","backend":"cuda"}"#,
        ),
        (503, "<html>proxy says no</html>"),
    ];
    let server = std::thread::spawn(move || {
        for (code, body) in answers {
            let (mut c, _) = listener.accept().unwrap();
            let mut buf = [0u8; 4096];
            let _ = std::io::Read::read(&mut c, &mut buf);
            let reason = if code == 200 { "OK" } else { "Nope" };
            write!(
                c,
                "HTTP/1.1 {code} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
        }
    });
    let client = StatsClient::new(&url, None).unwrap();
    let h = client.health().unwrap();
    assert_eq!(
        (h.status, h.phase),
        (HealthStatus::Loading, krasis_common::Phase::Loading)
    );
    // wait_ready keeps asking through `loading` and stops at `ok`.
    let h = client.wait_ready(Duration::from_secs(20)).unwrap();
    assert_eq!(h.status, HealthStatus::Ok);
    let e = client.wait_ready(Duration::from_secs(20)).unwrap_err();
    assert!(e.contains("CUDA error 700"), "{e}");
    // Other statuses, and a 503 that is not a health report, are errors.
    let e = client.health().unwrap_err();
    assert!(e.contains("HTTP 500"), "{e}");
    let e = client.health().unwrap_err();
    assert!(e.contains("503") && e.contains("health report"), "{e}");
    server.join().unwrap();
}

#[test]
fn events_logs_and_exit_status_are_reported() {
    let t = tempfile::tempdir().unwrap();
    let rt = script(
        t.path(),
        r#"echo '{"event":"phase","phase":"loading","detail":"x"}'
echo 'plain stdout'
echo 'on stderr' >&2
echo '{"event":"ready","url":"http://127.0.0.1:1","model":"m"}'
exit 3"#,
    );
    let mut s = Supervisor::spawn(&rt, &[], &[], RestartPolicy::NEVER).unwrap();
    let mut evs = Vec::new();
    while let Some(e) = s.next_event(Duration::from_secs(10)) {
        evs.push(e);
    }
    assert!(evs.iter().any(|e| matches!(e, SupEvent::Progress(ProgressEvent::Phase { phase, .. }) if phase == "loading")));
    assert!(
        evs.iter()
            .any(|e| matches!(e, SupEvent::Progress(ProgressEvent::Ready { .. })))
    );
    assert!(evs.contains(&SupEvent::Log("on stderr".into())));
    assert!(evs.contains(&SupEvent::Log("plain stdout".into())));
    assert_eq!(
        evs.last().unwrap(),
        &SupEvent::Exited {
            success: false,
            description: "exited with code 3".into()
        }
    );
    assert_eq!(s.tail(5).len(), 2);
}

#[test]
fn shutdown_terms_then_kills_the_whole_group() {
    let t = tempfile::tempdir().unwrap();
    // Ignores SIGTERM and has a child of its own: both must be gone.
    let pidfile = t.path().join("grandchild");
    let rt = script(
        t.path(),
        &format!(
            "trap '' TERM\nsleep 60 &\necho $! > {}\necho started\nwhile true; do sleep 0.1; done",
            pidfile.display()
        ),
    );
    let mut s = Supervisor::spawn(&rt, &[], &[], RestartPolicy::NEVER).unwrap();
    assert_eq!(
        s.next_event(Duration::from_secs(10)),
        Some(SupEvent::Log("started".into()))
    );
    let grandchild: u32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let pid = s.pid();
    let how = s.shutdown(Duration::from_millis(300));
    assert_eq!(
        how,
        Stopped {
            description: "did not stop within 300 ms of SIGTERM; killed with SIGKILL".into(),
            clean: false
        }
    );
    assert!(!alive(pid));
    let deadline = Instant::now() + Duration::from_secs(5);
    while alive(grandchild) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!alive(grandchild), "grandchild {grandchild} survived");
}

#[test]
fn colour_codes_are_stripped() {
    assert_eq!(
        strip_ansi("\u{1b}[2mtime\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m ready"),
        "time  INFO ready"
    );
}

#[test]
fn graceful_runtime_stops_on_sigterm() {
    let t = tempfile::tempdir().unwrap();
    let rt = script(
        t.path(),
        "trap 'echo bye; exit 0' TERM\necho up\nwhile true; do sleep 0.05; done",
    );
    let mut s = Supervisor::spawn(&rt, &[], &[], RestartPolicy::NEVER).unwrap();
    assert_eq!(
        s.next_event(Duration::from_secs(10)),
        Some(SupEvent::Log("up".into()))
    );
    let how = s.shutdown(Duration::from_secs(10));
    assert_eq!(how.description, "exited normally (code 0)");
    assert!(how.clean);
}
