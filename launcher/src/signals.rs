//! SIGINT/SIGTERM/SIGHUP become a flag the launcher polls, so it can stop the
//! runtime (which runs in its own process group and does not see the
//! terminal's Ctrl-C or hangup) and restore the terminal before exiting.
//! Every loop that runs while a runtime is up wakes at least every few
//! hundred milliseconds to look at the flag; none of them may block on
//! anything else (the TUI reads the terminal on its own thread for this).
//!
//! The flag is never cleared: every stop signal ends the launcher.

use std::sync::atomic::{AtomicBool, Ordering};

static STOP: AtomicBool = AtomicBool::new(false);

#[cfg(unix)]
extern "C" fn on_signal(_: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    STOP.store(true, Ordering::SeqCst);
}

/// Installs the handlers (idempotent).
///
/// A SIGHUP that was already ignored when the launcher started stays
/// ignored: that is how `nohup krasis serve ...` asks to outlive its
/// terminal. (The TUI notices a lost terminal by itself, so it still ends.)
/// SIGINT and SIGTERM are always caught.
pub fn install() {
    #[cfg(unix)]
    // SAFETY: sigaction with a handler that only performs an atomic store;
    // the structs are zero-initialised as the C API expects.
    unsafe {
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            let mut old: libc::sigaction = std::mem::zeroed();
            if sig == libc::SIGHUP
                && libc::sigaction(sig, std::ptr::null(), &mut old) == 0
                && old.sa_sigaction == libc::SIG_IGN
            {
                continue;
            }
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            // Restart interrupted reads (pipes from the runtime, HTTP) rather
            // than surface EINTR in threads that do not care about signals.
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// True once a stop signal arrived.
pub fn stop_requested() -> bool {
    STOP.load(Ordering::SeqCst)
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    fn disposition(sig: libc::c_int) -> libc::sighandler_t {
        // SAFETY: queries only.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            assert_eq!(libc::sigaction(sig, std::ptr::null(), &mut old), 0);
            old.sa_sigaction
        }
    }

    /// The only test in this binary that touches signal dispositions or the
    /// flag (they are process-wide).
    #[test]
    fn stop_signals_set_the_flag_and_an_inherited_sighup_ignore_is_kept() {
        let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        // SAFETY: plain signal calls on this process.
        unsafe {
            libc::signal(libc::SIGHUP, libc::SIG_IGN);
        }
        install();
        assert_eq!(
            disposition(libc::SIGHUP),
            libc::SIG_IGN,
            "nohup is honoured"
        );
        assert_eq!(disposition(libc::SIGTERM), handler);
        assert_eq!(disposition(libc::SIGINT), handler);
        assert!(!stop_requested());
        // SAFETY: the handler is installed, so this only sets the flag.
        unsafe {
            libc::raise(libc::SIGTERM);
        }
        assert!(stop_requested());

        // Without nohup, SIGHUP is caught like the others.
        // SAFETY: as above.
        unsafe {
            libc::signal(libc::SIGHUP, libc::SIG_DFL);
        }
        install();
        assert_eq!(disposition(libc::SIGHUP), handler);
    }
}
