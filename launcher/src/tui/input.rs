//! Terminal input, read on its own thread, and the check for a lost terminal.
//!
//! Why not crossterm's `event::poll`/`read` in the main loop: crossterm 0.28
//! (`event/source/unix/mio.rs`, `try_read`) reads the tty in a loop until
//! the read would block. Once the terminal is gone (tmux kill-session, a
//! closed ssh connection) the tty reads 0 bytes (EOF) or fails with EIO
//! forever, neither ends that loop, and `poll` never returns: the launcher
//! spun at 100% CPU inside it and never reached its signal check, so it
//! ignored SIGHUP/SIGTERM/SIGINT and its runtime kept serving.
//!
//! So this thread waits on the tty itself (`poll(2)`) and calls crossterm
//! only when bytes are waiting. A hangup (`POLLHUP`/`POLLERR`/`POLLNVAL`),
//! a failing `FIONREAD`, or "readable" with nothing to read (EOF) becomes
//! [`Event::TerminalLost`] and ends the thread. If the hangup lands between
//! that check and crossterm's read, crossterm spins on this thread; the main
//! loop also checks [`Tty::lost`] on every tick, so it still stops the
//! runtime and exits, and the process exit ends this thread.

use super::event::Event;
use crossterm::event as ct;
use std::time::Duration;

/// The terminal the TUI reads from: stdin when it is a tty, else
/// `/dev/tty` (the same choice crossterm makes, so both watch one device).
pub struct Tty {
    #[cfg(unix)]
    fd: std::os::fd::RawFd,
    /// Keeps `/dev/tty` open when it was opened here.
    #[cfg(unix)]
    _owned: Option<std::fs::File>,
}

/// What the terminal has for the reader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ready {
    Input,
    /// Nothing within the timeout (or the wait was interrupted).
    Nothing,
    Lost,
}

impl Tty {
    #[cfg(unix)]
    pub fn open() -> std::io::Result<Self> {
        use std::io::IsTerminal;
        use std::os::fd::AsRawFd;
        if std::io::stdin().is_terminal() {
            return Ok(Tty {
                fd: libc::STDIN_FILENO,
                _owned: None,
            });
        }
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/tty")?;
        Ok(Tty {
            fd: f.as_raw_fd(),
            _owned: Some(f),
        })
    }

    /// Waits up to `timeout` for input or a hangup.
    #[cfg(unix)]
    pub fn wait(&self, timeout: Duration) -> Ready {
        readiness(self.fd, libc::POLLIN, timeout)
    }

    /// The terminal has hung up (checked without reading or waiting).
    #[cfg(unix)]
    pub fn lost(&self) -> bool {
        // Asking for no events still reports POLLHUP/POLLERR/POLLNVAL.
        readiness(self.fd, 0, Duration::ZERO) == Ready::Lost
    }

    #[cfg(not(unix))]
    pub fn open() -> std::io::Result<Self> {
        Ok(Tty {})
    }
    /// Elsewhere crossterm's own poll is used; a lost console ends the
    /// process with it.
    #[cfg(not(unix))]
    pub fn wait(&self, timeout: Duration) -> Ready {
        match ct::poll(timeout) {
            Ok(true) => Ready::Input,
            Ok(false) => Ready::Nothing,
            Err(_) => Ready::Lost,
        }
    }
    #[cfg(not(unix))]
    pub fn lost(&self) -> bool {
        false
    }
}

/// `poll(2)` on one descriptor, and `FIONREAD` to tell input from EOF.
#[cfg(unix)]
fn readiness(fd: std::os::fd::RawFd, events: libc::c_short, timeout: Duration) -> Ready {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    // SAFETY: one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    if n < 0 {
        return match std::io::Error::last_os_error().kind() {
            std::io::ErrorKind::Interrupted => Ready::Nothing,
            _ => Ready::Lost,
        };
    }
    if n == 0 {
        return Ready::Nothing;
    }
    if p.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
        return Ready::Lost;
    }
    if p.revents & libc::POLLIN == 0 {
        return Ready::Nothing;
    }
    let mut pending: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int.
    let r = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut pending) };
    if r != 0 || pending == 0 {
        // A failing tty, or readable with nothing to read: end of file.
        Ready::Lost
    } else {
        Ready::Input
    }
}

/// Reads terminal events on a thread of its own and hands them to `send`
/// (which returns false once the loop is gone). Ends after a lost terminal
/// or a crossterm read error, which it reports as [`Event::TerminalLost`].
pub fn spawn(tty: std::sync::Arc<Tty>, send: impl Fn(Event) -> bool + Send + 'static) {
    std::thread::Builder::new()
        .name("tui-input".into())
        .spawn(move || {
            loop {
                match tty.wait(Duration::from_secs(1)) {
                    Ready::Nothing => continue,
                    Ready::Lost => {
                        send(Event::TerminalLost);
                        return;
                    }
                    Ready::Input => {}
                }
                // Bytes are waiting: let crossterm parse every event they
                // hold (a partial escape sequence waits for the next bytes).
                loop {
                    let ev = match ct::poll(Duration::ZERO).and_then(|ready| {
                        if ready {
                            ct::read().map(Some)
                        } else {
                            Ok(None)
                        }
                    }) {
                        Ok(Some(ev)) => ev,
                        Ok(None) => break,
                        Err(_) => {
                            send(Event::TerminalLost);
                            return;
                        }
                    };
                    let ev = match ev {
                        ct::Event::Key(k) => Event::Key(k),
                        ct::Event::Mouse(m) => Event::Mouse(m),
                        ct::Event::Resize(w, h) => Event::Resize(w, h),
                        _ => continue,
                    };
                    if !send(ev) {
                        return;
                    }
                }
            }
        })
        .expect("spawning the terminal input thread");
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    /// A pseudo-terminal pair; the slave end is what the TUI would read.
    fn pty() -> (std::os::fd::OwnedFd, std::os::fd::OwnedFd) {
        use std::os::fd::FromRawFd;
        let (mut master, mut slave) = (0, 0);
        // SAFETY: openpty writes two descriptors we then own.
        let r = unsafe {
            libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        assert_eq!(r, 0, "openpty: {}", std::io::Error::last_os_error());
        // SAFETY: both were just opened and are owned by nobody else.
        unsafe {
            (
                std::os::fd::OwnedFd::from_raw_fd(master),
                std::os::fd::OwnedFd::from_raw_fd(slave),
            )
        }
    }

    #[test]
    fn input_waiting_nothing_and_a_closed_terminal_are_told_apart() {
        use std::io::Write;
        use std::os::fd::AsRawFd;
        let (master, slave) = pty();
        let fd = slave.as_raw_fd();
        let t0 = std::time::Instant::now();
        assert_eq!(
            readiness(fd, libc::POLLIN, Duration::from_millis(50)),
            Ready::Nothing
        );
        assert!(t0.elapsed() >= Duration::from_millis(40), "it waited");
        let mut m = std::fs::File::from(master);
        // A line: the pty is in canonical mode (the TUI reads in raw mode).
        m.write_all(b"q\n").unwrap();
        assert_eq!(
            readiness(fd, libc::POLLIN, Duration::from_secs(5)),
            Ready::Input
        );
        assert_ne!(readiness(fd, 0, Duration::ZERO), Ready::Lost);
        // The terminal goes away (what tmux kill-session does to the pane):
        // both the reader's wait and the main loop's check see it at once.
        drop(m);
        let t0 = std::time::Instant::now();
        assert_eq!(
            readiness(fd, libc::POLLIN, Duration::from_secs(5)),
            Ready::Lost
        );
        assert!(t0.elapsed() < Duration::from_secs(1));
        assert_eq!(readiness(fd, 0, Duration::ZERO), Ready::Lost);
    }
}
