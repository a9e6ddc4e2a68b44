//! What a runtime's exit status means: a crash to restart after, a plain
//! description for the front ends, and whether a stop the launcher asked for
//! ended cleanly (which decides the launcher's own exit status).

use krasis_common::status::EXIT_ENGINE_FAULT;
use std::process::ExitStatus;
use std::time::Duration;

/// How a runtime ended after [`super::Supervisor::shutdown`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stopped {
    /// E.g. "exited normally (code 0)" or "did not stop within 10 s of
    /// SIGTERM; killed with SIGKILL".
    pub description: String,
    /// It ended as asked: exit code 0, or death by the SIGTERM the launcher
    /// sent (a runtime stopped before it installs its handler). Anything else
    /// (SIGKILL after the grace period, another signal, a non-zero code, a
    /// crash it was waiting to be restarted from) is not clean, and the
    /// launcher's exit status says so: a script or service manager must not
    /// take a forced kill for a clean stop.
    pub clean: bool,
}

impl Stopped {
    /// A runtime that exited with `st` (by itself or after SIGTERM).
    pub fn exited(st: ExitStatus) -> Self {
        Stopped {
            description: describe(st),
            clean: st.success() || signal_of(st) == Some(SIGTERM),
        }
    }

    /// A runtime that outlived `grace` after SIGTERM and was SIGKILLed.
    pub fn killed_after(grace: Duration) -> Self {
        Stopped {
            description: format!(
                "did not stop within {} of SIGTERM; killed with SIGKILL",
                super::fmt_duration(grace)
            ),
            clean: false,
        }
    }
}

impl Stopped {
    /// A runtime that was SIGKILLed after `grace` and then reaped with `st`.
    pub fn after_kill(st: ExitStatus, grace: Duration) -> Self {
        match signal_of(st) {
            Some(SIGKILL) => Stopped::killed_after(grace),
            // It ended on its own just as the grace period ran out.
            Some(_) => Stopped::exited(st),
            None if cfg!(unix) => Stopped::exited(st),
            // Elsewhere the kill leaves an exit code, not a signal.
            None => Stopped::killed_after(grace),
        }
    }
}

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.description)
    }
}

/// The signal the launcher stops the runtime with, and the one after the grace.
#[cfg(unix)]
const SIGTERM: i32 = libc::SIGTERM;
#[cfg(unix)]
const SIGKILL: i32 = libc::SIGKILL;
#[cfg(not(unix))]
const SIGTERM: i32 = 15;
#[cfg(not(unix))]
const SIGKILL: i32 = 9;

fn signal_of(st: ExitStatus) -> Option<i32> {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        st.signal()
    }
    #[cfg(not(unix))]
    {
        let _ = st;
        None
    }
}

/// Why an exit counts as a crash, or `None` for a clean exit (code 0).
pub fn crash_reason(st: ExitStatus) -> Option<String> {
    if let Some(sig) = signal_of(st) {
        return Some(format!("killed by {}", signal_name(sig)));
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

/// "exited normally (code 0)", "exited with code 3", "killed by signal 9 (SIGKILL)".
pub fn describe(st: ExitStatus) -> String {
    if let Some(sig) = signal_of(st) {
        return format!("killed by {}", signal_name(sig));
    }
    match st.code() {
        Some(0) => "exited normally (code 0)".into(),
        Some(c) => format!("exited with code {c}"),
        None => "exited".into(),
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    fn code(c: i32) -> ExitStatus {
        ExitStatus::from_raw(c << 8)
    }
    fn signal(s: i32) -> ExitStatus {
        ExitStatus::from_raw(s)
    }

    #[test]
    fn only_code_zero_and_the_requested_sigterm_are_clean_stops() {
        let clean = |st| Stopped::exited(st).clean;
        assert!(clean(code(0)));
        assert!(clean(signal(libc::SIGTERM)));
        assert!(!clean(signal(libc::SIGKILL)));
        assert!(!clean(signal(libc::SIGSEGV)));
        assert!(!clean(code(1)));
        assert!(!clean(code(EXIT_ENGINE_FAULT)));
        assert_eq!(
            Stopped::exited(signal(libc::SIGKILL)).to_string(),
            "killed by signal 9 (SIGKILL)"
        );
        assert_eq!(
            Stopped::exited(code(0)).to_string(),
            "exited normally (code 0)"
        );
    }

    #[test]
    fn a_kill_after_the_grace_period_is_never_clean_and_says_so() {
        let s = Stopped::killed_after(Duration::from_secs(10));
        assert!(!s.clean);
        assert_eq!(
            s.description,
            "did not stop within 10 s of SIGTERM; killed with SIGKILL"
        );
    }

    #[test]
    fn a_runtime_that_exits_as_the_grace_period_ends_is_not_called_killed() {
        let g = Duration::from_secs(10);
        assert_eq!(
            Stopped::after_kill(signal(libc::SIGKILL), g),
            Stopped::killed_after(g)
        );
        assert_eq!(Stopped::after_kill(code(0), g), Stopped::exited(code(0)));
        assert!(Stopped::after_kill(code(0), g).clean);
    }

    #[test]
    fn crashes_are_named() {
        assert_eq!(crash_reason(code(0)), None);
        assert_eq!(
            crash_reason(code(EXIT_ENGINE_FAULT)).unwrap(),
            format!("engine fault, exit {EXIT_ENGINE_FAULT}")
        );
        assert_eq!(crash_reason(code(3)).unwrap(), "exit 3");
        assert_eq!(
            crash_reason(signal(11)).unwrap(),
            "killed by signal 11 (SIGSEGV)"
        );
        assert_eq!(describe(signal(64)), "killed by signal 64");
    }
}
