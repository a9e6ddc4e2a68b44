//! Runs `krasis-runtime serve` as a child process and stops it cleanly.
//!
//! The child gets its own process group (so the terminal's Ctrl-C reaches
//! only the launcher, which then shuts the runtime down in order) and, on
//! Linux, `PR_SET_PDEATHSIG` so it dies with the launcher even if the launcher
//! is killed. Stdout lines are parsed as `ProgressEvent`s, stderr is the log.
//! Shutdown is SIGTERM to the group, a grace period, then SIGKILL.

use krasis_common::{EngineStats, Health, ProgressEvent};
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::{Duration, Instant};

/// Log lines kept for the run screen and for the "it died" report.
pub const LOG_TAIL: usize = 200;

#[derive(Debug, Clone, PartialEq)]
pub enum SupEvent {
    Progress(ProgressEvent),
    /// A stdout line that is not an event, or a stderr line.
    Log(String),
    /// The runtime exited; the description says how (code or signal).
    Exited {
        success: bool,
        description: String,
    },
}

enum Line {
    Out(String),
    Err(String),
    Eof,
}

pub struct Supervisor {
    child: Child,
    rx: Receiver<Line>,
    open_pipes: u8,
    pub log: VecDeque<String>,
    exited: Option<ExitStatus>,
    exit_reported: bool,
}

/// A binary that was just written (installer, rebuild, a test's script) can
/// still be open for writing in a child that another thread forked before it
/// exec'd; the kernel then refuses to exec it (ETXTBSY) until that child
/// execs. The window is microseconds, so a short bounded retry is correct and
/// anything longer is a real error.
pub(crate) fn retry_busy<T>(mut start: impl FnMut() -> std::io::Result<T>) -> std::io::Result<T> {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match start() {
            Err(e)
                if e.kind() == std::io::ErrorKind::ExecutableFileBusy
                    && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

impl Supervisor {
    /// Starts `runtime` with `args` (e.g. `serve` + `LaunchOptions::to_serve_args()`).
    pub fn spawn(runtime: &Path, args: &[String]) -> std::io::Result<Self> {
        let mut cmd = Command::new(runtime);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        isolate(&mut cmd);
        let mut child = retry_busy(|| cmd.spawn()).map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("could not start {}: {e}", runtime.display()),
            )
        })?;
        let (tx, rx) = channel();
        pump(child.stdout.take().expect("piped"), tx.clone(), Line::Out);
        pump(child.stderr.take().expect("piped"), tx, Line::Err);
        Ok(Supervisor {
            child,
            rx,
            open_pipes: 2,
            log: VecDeque::new(),
            exited: None,
            exit_reported: false,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn is_running(&mut self) -> bool {
        self.check_exit();
        self.exited.is_none()
    }

    /// Waits up to `timeout` for the next event. `None` on timeout, and after
    /// the exit has been reported.
    pub fn next_event(&mut self, timeout: Duration) -> Option<SupEvent> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            // Once the child is gone, wait only briefly for the pipes to drain.
            let wait = if self.exited.is_some() {
                left.min(Duration::from_millis(50))
            } else {
                left.min(Duration::from_millis(100))
            };
            match self.rx.recv_timeout(wait) {
                Ok(Line::Out(l)) => return Some(self.stdout_line(l)),
                Ok(Line::Err(l)) => return Some(self.record(l)),
                Ok(Line::Eof) => self.open_pipes = self.open_pipes.saturating_sub(1),
                Err(_) => {}
            }
            self.check_exit();
            if let Some(st) = self.exited {
                // Report the exit after the last output line, or after a short
                // wait if something else holds the pipes open.
                if !self.exit_reported && (self.open_pipes == 0 || Instant::now() >= deadline) {
                    self.exit_reported = true;
                    return Some(SupEvent::Exited {
                        success: st.success(),
                        description: describe(st),
                    });
                }
            }
            if self.exit_reported && self.open_pipes == 0 {
                return None;
            }
            if Instant::now() >= deadline {
                return None;
            }
        }
    }

    fn stdout_line(&mut self, l: String) -> SupEvent {
        match ProgressEvent::parse_line(&l) {
            Some(ProgressEvent::Log { level, message }) => {
                self.record(format!("{level}: {message}"));
                SupEvent::Progress(ProgressEvent::Log { level, message })
            }
            Some(ev) => SupEvent::Progress(ev),
            None => self.record(l),
        }
    }

    fn record(&mut self, l: String) -> SupEvent {
        let l = strip_ansi(&l);
        if self.log.len() == LOG_TAIL {
            self.log.pop_front();
        }
        self.log.push_back(l.clone());
        SupEvent::Log(l)
    }

    fn check_exit(&mut self) {
        if self.exited.is_none()
            && let Ok(Some(st)) = self.child.try_wait()
        {
            self.exited = Some(st);
        }
    }

    /// The last `n` log lines.
    pub fn tail(&self, n: usize) -> Vec<String> {
        self.log
            .iter()
            .skip(self.log.len().saturating_sub(n))
            .cloned()
            .collect()
    }

    /// SIGTERM to the runtime's process group, wait up to `grace`, then
    /// SIGKILL. Returns how it ended.
    pub fn shutdown(&mut self, grace: Duration) -> String {
        self.check_exit();
        if let Some(st) = self.exited {
            self.kill_group_hard();
            return describe(st);
        }
        self.signal_term();
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(st)) = self.child.try_wait() {
                self.exited = Some(st);
                // Anything the runtime started in its group goes too.
                self.kill_group_hard();
                return describe(st);
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        self.kill_group_hard();
        let _ = self.child.kill();
        match self.child.wait() {
            Ok(st) => {
                self.exited = Some(st);
                format!(
                    "{} (did not stop within {:.0}s of SIGTERM; killed)",
                    describe(st),
                    grace.as_secs_f64()
                )
            }
            Err(e) => format!("could not reap the runtime: {e}"),
        }
    }

    #[cfg(unix)]
    fn signal_term(&mut self) {
        // SAFETY: signals our own child's process group (pgid == child pid).
        unsafe {
            libc::kill(-(self.child.id() as libc::pid_t), libc::SIGTERM);
        }
    }
    #[cfg(not(unix))]
    fn signal_term(&mut self) {
        let _ = self.child.kill();
    }

    #[cfg(unix)]
    fn kill_group_hard(&self) {
        // SAFETY: as above; ESRCH when the group is already empty is fine.
        unsafe {
            libc::kill(-(self.child.id() as libc::pid_t), libc::SIGKILL);
        }
    }
    #[cfg(not(unix))]
    fn kill_group_hard(&self) {}
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        if self.exited.is_none() {
            self.shutdown(Duration::from_secs(5));
        }
    }
}

fn pump<R: Read + Send + 'static>(r: R, tx: Sender<Line>, wrap: fn(String) -> Line) {
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines() {
            match line {
                Ok(l) => {
                    if tx.send(wrap(l)).is_err() {
                        return;
                    }
                }
                Err(_) => break,
            }
        }
        let _ = tx.send(Line::Eof);
    });
}

#[cfg(unix)]
fn isolate(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    #[cfg(target_os = "linux")]
    // SAFETY: getpid is async-signal-safe; read before fork.
    let parent = unsafe { libc::getpid() };
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            #[cfg(target_os = "linux")]
            {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The launcher may have died between fork and prctl.
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
            }
            Ok(())
        });
    }
}

#[cfg(windows)]
fn isolate(cmd: &mut Command) {
    use std::os::windows::process::CommandExt;
    const CREATE_NEW_PROCESS_GROUP: u32 = 0x0000_0200;
    cmd.creation_flags(CREATE_NEW_PROCESS_GROUP);
}

#[cfg(not(any(unix, windows)))]
fn isolate(_cmd: &mut Command) {}

/// Removes terminal colour sequences (`ESC [ ... letter`) so log lines read
/// cleanly in the run screen whatever the runtime's logger decided.
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                for n in chars.by_ref() {
                    if n.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

pub fn describe(st: ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = st.signal() {
            return format!("killed by signal {sig}");
        }
    }
    match st.code() {
        Some(0) => "exited normally (code 0)".into(),
        Some(c) => format!("exited with code {c}"),
        None => "exited".into(),
    }
}

/// `GET /health` and `GET /v1/stats` of a running server.
pub struct StatsClient {
    base: String,
    api_key: Option<String>,
    http: reqwest::blocking::Client,
}

impl StatsClient {
    pub fn new(base_url: &str, api_key: Option<String>) -> Result<Self, String> {
        let http = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| format!("HTTP client: {e}"))?;
        Ok(StatsClient {
            base: base_url.trim_end_matches('/').to_string(),
            api_key,
            http,
        })
    }

    fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T, String> {
        let mut rq = self.http.get(format!("{}{path}", self.base));
        if let Some(k) = &self.api_key {
            rq = rq.bearer_auth(k);
        }
        let r = rq.send().map_err(|e| format!("GET {path}: {e}"))?;
        if !r.status().is_success() {
            return Err(format!("GET {path}: HTTP {}", r.status()));
        }
        r.json()
            .map_err(|e| format!("GET {path}: bad payload: {e}"))
    }

    pub fn health(&self) -> Result<Health, String> {
        self.get("/health")
    }

    pub fn stats(&self) -> Result<EngineStats, String> {
        self.get("/v1/stats")
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

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
        let mut s = Supervisor::spawn(&rt, &[]).unwrap();
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
        let mut s = Supervisor::spawn(&rt, &[]).unwrap();
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
        assert!(how.contains("killed"), "{how}");
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
        let mut s = Supervisor::spawn(&rt, &[]).unwrap();
        assert_eq!(
            s.next_event(Duration::from_secs(10)),
            Some(SupEvent::Log("up".into()))
        );
        let how = s.shutdown(Duration::from_secs(10));
        assert_eq!(how, "exited normally (code 0)");
    }
}
