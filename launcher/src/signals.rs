//! SIGINT/SIGTERM/SIGHUP become a flag the launcher polls, so it can stop the
//! runtime (which runs in its own process group and does not see the
//! terminal's Ctrl-C) and restore the terminal before exiting.

use std::sync::atomic::{AtomicBool, Ordering};

static STOP: AtomicBool = AtomicBool::new(false);

#[cfg(unix)]
extern "C" fn on_signal(_: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    STOP.store(true, Ordering::SeqCst);
}

/// Installs the handlers (idempotent).
pub fn install() {
    #[cfg(unix)]
    // SAFETY: the handler only performs an atomic store.
    unsafe {
        let h = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::signal(libc::SIGINT, h);
        libc::signal(libc::SIGTERM, h);
        libc::signal(libc::SIGHUP, h);
    }
}

/// True once a stop signal arrived.
pub fn stop_requested() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// Forget an earlier stop request (after a handled restart).
pub fn clear() {
    STOP.store(false, Ordering::SeqCst);
}

/// Lets the TUI treat its own Ctrl-C key like the signal.
pub fn request_stop() {
    STOP.store(true, Ordering::SeqCst);
}
