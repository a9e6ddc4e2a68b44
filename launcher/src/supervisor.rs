//! Runs `krasis-runtime serve` as a child process, restarts it after a crash,
//! and stops it cleanly.
//!
//! The child gets its own process group (so the terminal's Ctrl-C reaches
//! only the launcher, which then shuts the runtime down in order) and, on
//! Linux, `PR_SET_PDEATHSIG` so it dies with the launcher even if the launcher
//! is killed. Stdout lines are parsed as `ProgressEvent`s, stderr is the log.
//! Shutdown is SIGTERM to the group, a grace period, then SIGKILL.
//!
//! Restarts ([`RestartPolicy`]): once the runtime has reported `ready`, an exit
//! the launcher did not ask for (exit code [`EXIT_ENGINE_FAULT`], any other
//! non-zero code, or a signal) starts it again after a backoff that doubles
//! with each restart, at most `max_restarts` times within `window`; one more
//! crash inside the window is reported as the final exit. Not restarted: a
//! runtime that never became ready (its load failure would only repeat), a
//! clean exit 0 (someone stopped it on purpose), and anything after
//! [`Supervisor::shutdown`] (the launcher is the one stopping it). After the
//! first ready, a restart that fails while loading again counts against the
//! same bound (a crashed CUDA process can take a moment to release the GPU).

use krasis_common::options::API_KEY_ENV;
use krasis_common::status::{EXIT_ENGINE_FAULT, HealthStatus};
use krasis_common::{EngineStats, Health, ProgressEvent};
use std::collections::VecDeque;
use std::fmt;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
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
    /// The runtime exited and will not be started again; the description
    /// says how (code or signal, and whether restarts were given up).
    Exited {
        success: bool,
        description: String,
    },
    /// The runtime crashed after it had been ready; it is started again
    /// after `delay`.
    Restarting(Restart),
    /// A new runtime process was started after a crash.
    Restarted {
        pid: u32,
    },
}

/// One scheduled restart, as the front ends show it.
#[derive(Debug, Clone, PartialEq)]
pub struct Restart {
    /// How it ended, e.g. "engine fault, exit 70" or "killed by signal 9 (SIGKILL)".
    pub reason: String,
    pub delay: Duration,
    /// 1-based count of restarts within the policy's window, this one included.
    pub attempt: u32,
    pub max: u32,
}

impl fmt::Display for Restart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "runtime crashed ({}); restarting in {} (attempt {} of {})",
            self.reason,
            fmt_duration(self.delay),
            self.attempt,
            self.max
        )
    }
}

/// How often a runtime that crashed after becoming ready is started again.
#[derive(Debug, Clone, PartialEq)]
pub struct RestartPolicy {
    /// Restarts allowed within `window`; one more crash ends supervision.
    pub max_restarts: u32,
    pub window: Duration,
    /// Wait before the first restart in the window; doubles for each later one.
    pub first_backoff: Duration,
}

impl RestartPolicy {
    /// Never restart: every exit is final.
    pub const NEVER: RestartPolicy = RestartPolicy {
        max_restarts: 0,
        window: Duration::ZERO,
        first_backoff: Duration::ZERO,
    };
}

impl Default for RestartPolicy {
    /// At most 3 restarts within 10 minutes, after 1 s, 2 s and 4 s.
    fn default() -> Self {
        RestartPolicy {
            max_restarts: 3,
            window: Duration::from_secs(600),
            first_backoff: Duration::from_secs(1),
        }
    }
}

/// Why an exit counts as a crash, or `None` for a clean exit (code 0).
pub fn crash_reason(st: ExitStatus) -> Option<String> {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = st.signal() {
            return Some(format!("killed by {}", signal_name(sig)));
        }
    }
    match st.code() {
        Some(0) => None,
        Some(EXIT_ENGINE_FAULT) => Some(format!("engine fault, exit {EXIT_ENGINE_FAULT}")),
        Some(c) => Some(format!("exit {c}")),
        None => Some("exited abnormally".into()),
    }
}

/// "signal 9 (SIGKILL)" for the signals a crash usually comes from.
fn signal_name(sig: i32) -> String {
    let name = match sig {
        1 => "SIGHUP",
        2 => "SIGINT",
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        15 => "SIGTERM",
        _ => return format!("signal {sig}"),
    };
    format!("signal {sig} ({name})")
}

/// "1 s", "10 min", "250 ms".
pub fn fmt_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms >= 60_000 && ms.is_multiple_of(60_000) {
        format!("{} min", ms / 60_000)
    } else if ms >= 1000 && ms.is_multiple_of(1000) {
        format!("{} s", ms / 1000)
    } else if ms >= 1000 {
        format!("{:.1} s", d.as_secs_f64())
    } else {
        format!("{ms} ms")
    }
}

enum Line {
    Out(String),
    Err(String),
    Eof,
}

pub struct Supervisor {
    runtime: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    policy: RestartPolicy,
    child: Child,
    rx: Receiver<Line>,
    open_pipes: u8,
    pub log: VecDeque<String>,
    exited: Option<ExitStatus>,
    exit_reported: bool,
    /// Some runtime of this supervisor reported `ready`.
    ready_once: bool,
    /// When the restarts still inside the policy's window happened.
    restarts: VecDeque<Instant>,
    /// A crashed runtime is started again at this time.
    restart_at: Option<Instant>,
    /// `shutdown` was called: nothing is restarted any more.
    stopping: bool,
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
    /// Starts `runtime` with `args` (e.g. `serve` + `LaunchOptions::to_serve_args()`)
    /// and `env` added to the inherited environment (`LaunchOptions::serve_env()`:
    /// secrets go there, never into the argv that every user can read), and
    /// restarts it after crashes as `policy` allows.
    pub fn spawn(
        runtime: &Path,
        args: &[String],
        env: &[(String, String)],
        policy: RestartPolicy,
    ) -> std::io::Result<Self> {
        let (child, rx) = start_child(runtime, args, env)?;
        Ok(Supervisor {
            runtime: runtime.to_path_buf(),
            args: args.to_vec(),
            env: env.to_vec(),
            policy,
            child,
            rx,
            open_pipes: 2,
            log: VecDeque::new(),
            exited: None,
            exit_reported: false,
            ready_once: false,
            restarts: VecDeque::new(),
            restart_at: None,
            stopping: false,
        })
    }

    /// The current runtime process.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn is_running(&mut self) -> bool {
        self.check_exit();
        self.exited.is_none()
    }

    /// A crashed runtime is waiting for its restart.
    pub fn restart_pending(&self) -> bool {
        self.restart_at.is_some()
    }

    /// Waits up to `timeout` for the next event. `None` on timeout, and after
    /// the final exit has been reported.
    pub fn next_event(&mut self, timeout: Duration) -> Option<SupEvent> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(at) = self.restart_at {
                let now = Instant::now();
                if now >= at {
                    return Some(self.restart());
                }
                if now >= deadline {
                    return None;
                }
                std::thread::sleep((at.min(deadline) - now).min(Duration::from_millis(100)));
                continue;
            }
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
                    return Some(self.after_exit(st));
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

    /// What the exit of the current runtime means: a restart, or the end.
    fn after_exit(&mut self, st: ExitStatus) -> SupEvent {
        let final_exit = |description: String| SupEvent::Exited {
            success: st.success(),
            description,
        };
        let reason = match crash_reason(st) {
            Some(r) if self.ready_once && !self.stopping && self.policy.max_restarts > 0 => r,
            _ => return final_exit(describe(st)),
        };
        // Whatever the crashed runtime left in its group must not hold the port.
        self.kill_group_hard();
        let now = Instant::now();
        let window = self.policy.window;
        while self
            .restarts
            .front()
            .is_some_and(|t| now.duration_since(*t) >= window)
        {
            self.restarts.pop_front();
        }
        let done = self.restarts.len() as u32;
        if done >= self.policy.max_restarts {
            let msg = format!(
                "crashed ({reason}) again after {done} restart{} within {}; gave up",
                if done == 1 { "" } else { "s" },
                fmt_duration(window)
            );
            self.record(format!("runtime {msg}"));
            return final_exit(msg);
        }
        let r = Restart {
            reason,
            delay: self.policy.first_backoff * 2u32.saturating_pow(done),
            attempt: done + 1,
            max: self.policy.max_restarts,
        };
        self.record(r.to_string());
        self.restart_at = Some(now + r.delay);
        SupEvent::Restarting(r)
    }

    /// Starts the runtime again (its backoff is over).
    fn restart(&mut self) -> SupEvent {
        self.restart_at = None;
        self.restarts.push_back(Instant::now());
        match start_child(&self.runtime, &self.args, &self.env) {
            Ok((child, rx)) => {
                self.child = child;
                self.rx = rx;
                self.open_pipes = 2;
                self.exited = None;
                self.exit_reported = false;
                let pid = self.child.id();
                self.record(format!("runtime restarted (pid {pid})"));
                SupEvent::Restarted { pid }
            }
            Err(e) => SupEvent::Exited {
                success: false,
                description: format!("could not be restarted: {e}"),
            },
        }
    }

    fn stdout_line(&mut self, l: String) -> SupEvent {
        match ProgressEvent::parse_line(&l) {
            Some(ProgressEvent::Log { level, message }) => {
                self.record(format!("{level}: {message}"));
                SupEvent::Progress(ProgressEvent::Log { level, message })
            }
            Some(ev @ ProgressEvent::Ready { .. }) => {
                self.ready_once = true;
                SupEvent::Progress(ev)
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
    /// SIGKILL. Returns how it ended. Nothing is restarted afterwards.
    pub fn shutdown(&mut self, grace: Duration) -> String {
        self.stopping = true;
        if self.restart_at.take().is_some() {
            self.exit_reported = true;
            return "was waiting to restart after a crash; restart cancelled".into();
        }
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

fn start_child(
    runtime: &Path,
    args: &[String],
    env: &[(String, String)],
) -> std::io::Result<(Child, Receiver<Line>)> {
    let mut cmd = Command::new(runtime);
    cmd.args(args)
        // The runtime gets exactly the key the launcher chose (`env`), not
        // one the launcher happened to inherit.
        .env_remove(API_KEY_ENV)
        .envs(env.iter().map(|(k, v)| (k, v)))
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
    Ok((child, rx))
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
            return format!("killed by {}", signal_name(sig));
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

    fn send(&self, path: &str) -> Result<reqwest::blocking::Response, String> {
        let mut rq = self.http.get(format!("{}{path}", self.base));
        if let Some(k) = &self.api_key {
            rq = rq.bearer_auth(k);
        }
        rq.send().map_err(|e| format!("GET {path}: {e}"))
    }

    fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T, String> {
        let r = self.send(path)?;
        if !r.status().is_success() {
            return Err(format!("GET {path}: HTTP {}", r.status()));
        }
        r.json()
            .map_err(|e| format!("GET {path}: bad payload: {e}"))
    }

    /// The server's readiness. `/health` answers 503 while the model loads
    /// (`status: loading`) and after a fault (`status: error`); those are
    /// answers, so only a failed request or another status is an `Err`.
    pub fn health(&self) -> Result<Health, String> {
        let r = self.send("/health")?;
        let code = r.status();
        if !code.is_success() && code != reqwest::StatusCode::SERVICE_UNAVAILABLE {
            return Err(format!("GET /health: HTTP {code}"));
        }
        r.json()
            .map_err(|e| format!("GET /health: HTTP {code} without a health report: {e}"))
    }

    /// Polls `/health` until it reports `status: ok`. An `error` status ends
    /// the wait at once with the runtime's reason; a server that is not
    /// answering yet, or still `loading`, is asked again until `timeout`.
    pub fn wait_ready(&self, timeout: Duration) -> Result<Health, String> {
        let deadline = Instant::now() + timeout;
        loop {
            let last = match self.health() {
                Ok(h) if h.status == HealthStatus::Ok => return Ok(h),
                Ok(h) if h.status == HealthStatus::Error => {
                    return Err(format!(
                        "the runtime reports an error: {}",
                        h.error.as_deref().unwrap_or("(no reason given)")
                    ));
                }
                Ok(h) => format!("status {:?}, phase {:?}", h.status, h.phase),
                Err(e) => e,
            };
            if Instant::now() >= deadline {
                return Err(format!(
                    "not ready within {}; last answer: {last}",
                    fmt_duration(timeout)
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
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
        assert_eq!(s.shutdown(Duration::from_secs(10)), "exited with code 143");
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
        assert!(how.contains("restart cancelled"), "{how}");
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
        let mut s = Supervisor::spawn(&rt, &[], &[], RestartPolicy::NEVER).unwrap();
        assert_eq!(
            s.next_event(Duration::from_secs(10)),
            Some(SupEvent::Log("up".into()))
        );
        let how = s.shutdown(Duration::from_secs(10));
        assert_eq!(how, "exited normally (code 0)");
    }
}
