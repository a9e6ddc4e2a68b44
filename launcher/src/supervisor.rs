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
//! the launcher did not ask for (exit code
//! [`krasis_common::status::EXIT_ENGINE_FAULT`], any other
//! non-zero code, or a signal) starts it again after a backoff that doubles
//! with each restart, at most `max_restarts` times within `window`; one more
//! crash inside the window is reported as the final exit. Not restarted: a
//! runtime that never became ready (its load failure would only repeat), a
//! clean exit 0 (someone stopped it on purpose), and anything after
//! [`Supervisor::shutdown`] (the launcher is the one stopping it). After the
//! first ready, a restart that fails while loading again counts against the
//! same bound (a crashed CUDA process can take a moment to release the GPU).

use krasis_common::ProgressEvent;
use krasis_common::options::API_KEY_ENV;
use std::collections::VecDeque;
use std::fmt;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::{Duration, Instant};

mod client;
mod exit;

pub use client::StatsClient;
pub use exit::{Stopped, crash_reason, describe};

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
    /// SIGKILL. Returns how it ended, and whether that was clean (the
    /// launcher's exit status reports a forced kill). Nothing is restarted
    /// afterwards.
    pub fn shutdown(&mut self, grace: Duration) -> Stopped {
        self.stopping = true;
        if self.restart_at.take().is_some() {
            self.exit_reported = true;
            return Stopped {
                description: "was waiting to restart after a crash; restart cancelled".into(),
                clean: false,
            };
        }
        self.check_exit();
        if let Some(st) = self.exited {
            self.kill_group_hard();
            return Stopped::exited(st);
        }
        self.signal_term();
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(st)) = self.child.try_wait() {
                self.exited = Some(st);
                // Anything the runtime started in its group goes too.
                self.kill_group_hard();
                return Stopped::exited(st);
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        self.kill_group_hard();
        let _ = self.child.kill();
        match self.child.wait() {
            Ok(st) => {
                self.exited = Some(st);
                Stopped::after_kill(st, grace)
            }
            Err(e) => Stopped {
                description: format!("could not reap the runtime: {e}"),
                clean: false,
            },
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
        // Reached when a front end unwinds (a panic) without stopping the
        // runtime itself: the runtime must not outlive the launcher.
        if self.exited.is_none() {
            self.shutdown(crate::headless::SHUTDOWN_GRACE);
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

/// The runtime's own process group: the terminal's Ctrl-C and a hangup
/// reach only the launcher, which then stops the runtime in order (SIGTERM,
/// grace, SIGKILL) instead of racing it.
///
/// On Linux also `PR_SET_PDEATHSIG(SIGKILL)`: when the launcher dies without
/// stopping the runtime (SIGKILL, the OOM killer, an abort that skips every
/// destructor), the kernel kills the runtime too, so no orphan keeps the port
/// and the GPU. SIGKILL rather than SIGTERM because nobody is left to
/// escalate if a graceful shutdown hangs; the orderly path is the launcher's
/// own shutdown. The kernel sends it when the *thread* that forked the child
/// ends, not the process: a [`Supervisor`] must be created and polled (its
/// restarts fork too) on a thread that outlives it, as both front ends do on
/// their main thread.
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

#[cfg(all(test, unix))]
mod tests;
