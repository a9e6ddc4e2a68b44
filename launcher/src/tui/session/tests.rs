//! The loop's side of the lifecycle, against stand-in runtimes (shell
//! scripts): a lost terminal or a stop signal stops the runtime without
//! drawing, a forced kill is reported for the exit status, stale stats are
//! dropped.

use super::*;
use crate::probe::fake::FakeProbe;
use crate::runtime::tests::fake_caps;
use ratatui::backend::{ClearType, TestBackend, WindowSize};
use ratatui::buffer::Cell;
use ratatui::layout::{Position, Size};
use std::path::Path;
use std::sync::mpsc::{Receiver, channel};

/// A TestBackend that counts the frames drawn on it.
struct Counting {
    inner: TestBackend,
    draws: usize,
}

impl Backend for Counting {
    fn draw<'a, I>(&mut self, content: I) -> std::io::Result<()>
    where
        I: Iterator<Item = (u16, u16, &'a Cell)>,
    {
        self.draws += 1;
        self.inner.draw(content)
    }
    fn hide_cursor(&mut self) -> std::io::Result<()> {
        self.inner.hide_cursor()
    }
    fn show_cursor(&mut self) -> std::io::Result<()> {
        self.inner.show_cursor()
    }
    fn get_cursor_position(&mut self) -> std::io::Result<Position> {
        self.inner.get_cursor_position()
    }
    fn set_cursor_position<P: Into<Position>>(&mut self, p: P) -> std::io::Result<()> {
        self.inner.set_cursor_position(p)
    }
    fn clear(&mut self) -> std::io::Result<()> {
        self.inner.clear()
    }
    fn clear_region(&mut self, t: ClearType) -> std::io::Result<()> {
        self.inner.clear_region(t)
    }
    fn size(&self) -> std::io::Result<Size> {
        self.inner.size()
    }
    fn window_size(&mut self) -> std::io::Result<WindowSize> {
        self.inner.window_size()
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn terminal() -> Terminal<Counting> {
    Terminal::new(Counting {
        inner: TestBackend::new(100, 30),
        draws: 0,
    })
    .unwrap()
}

const READY: &str = r#"echo '{"event":"ready","url":"http://127.0.0.1:1","model":"m"}'"#;

/// A stand-in runtime that counts its starts in `dir/starts` (`$n`) and
/// writes its pid to `dir/pid`, then runs `body`.
fn script(dir: &Path, body: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join("fake-runtime");
    let count = dir.join("starts");
    std::fs::write(
        &p,
        format!(
            "#!/bin/sh\nn=$(cat {c} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {c}\necho $$ > {pid}\n{body}\n",
            c = count.display(),
            pid = dir.join("pid").display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

fn pid(dir: &Path) -> i32 {
    std::fs::read_to_string(dir.join("pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Running (a zombie counts as gone).
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            stat.rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().next())
                != Some("Z")
        }
        // SAFETY: signal 0 only checks existence.
        Err(_) => unsafe { libc::kill(pid, 0) == 0 },
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    dir: PathBuf,
    app: App,
    session: Session,
    inbox: Receiver<Inbox>,
    term: Terminal<Counting>,
}

fn fixture(body: &str, grace: Duration) -> Fixture {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().to_path_buf();
    let rt = script(&dir, body);
    let (tx, inbox) = channel();
    let session = Session::new(Ok(rt), Store::new(dir.join("profiles")), grace, tx);
    Fixture {
        _dir: t,
        dir,
        app: App::new(&FakeProbe { gpu: false }, Ok(fake_caps(false))),
        session,
        inbox,
        term: terminal(),
    }
}

impl Fixture {
    fn launch(&mut self) {
        self.app.run.status = RunStatus::Starting;
        let o = LaunchOptions::default();
        self.session.launch(&mut self.app, &o);
    }

    /// Feeds runtime events to the app until `done` (10 s at most).
    fn pump_until(&mut self, done: impl Fn(&RunStatus) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done(&self.app.run.status) {
            assert!(Instant::now() < deadline, "{:?}", self.app.run.status);
            for ev in self.session.runtime_events() {
                self.session.handle(&mut self.app, ev, &mut self.term);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn ready(&mut self) {
        self.launch();
        self.pump_until(|s| matches!(s, RunStatus::Ready { .. }));
    }
}

/// Waits for SIGTERM, then exits 0 (what the real runtime does).
const GRACEFUL: &str = "trap 'exit 0' TERM\necho up\nwhile true; do sleep 0.05; done";

#[test]
fn a_lost_terminal_quits_and_stops_the_runtime_without_drawing() {
    let mut f = fixture(&format!("{READY}\n{GRACEFUL}"), Duration::from_secs(10));
    f.ready();
    let rt = pid(&f.dir);
    assert!(alive(rt));
    assert!(f.session.draw(&f.app, &mut f.term));
    let draws = f.term.backend().draws;

    let t0 = Instant::now();
    let ev = Event::TerminalLost;
    f.session.handle(&mut f.app, ev, &mut f.term);
    assert!(f.app.quit);
    assert!(!alive(rt), "the runtime outlived the terminal");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert_eq!(f.term.backend().draws, draws, "drew on a lost terminal");
    assert!(!f.session.draw(&f.app, &mut f.term));
    assert_eq!(f.term.backend().draws, draws);
    assert_eq!(
        f.app.run.status,
        RunStatus::Exited {
            success: true,
            description: "stopped: exited normally (code 0)".into()
        }
    );
    assert!(f.session.problems().is_empty());
}

#[test]
fn a_failed_draw_counts_as_a_lost_terminal() {
    struct Broken;
    impl ratatui::backend::Backend for Broken {
        fn draw<'a, I>(&mut self, _: I) -> std::io::Result<()>
        where
            I: Iterator<Item = (u16, u16, &'a Cell)>,
        {
            Err(std::io::Error::from_raw_os_error(libc::EIO))
        }
        fn hide_cursor(&mut self) -> std::io::Result<()> {
            Ok(())
        }
        fn show_cursor(&mut self) -> std::io::Result<()> {
            Ok(())
        }
        fn get_cursor_position(&mut self) -> std::io::Result<Position> {
            Ok(Position::ORIGIN)
        }
        fn set_cursor_position<P: Into<Position>>(&mut self, _: P) -> std::io::Result<()> {
            Ok(())
        }
        fn clear(&mut self) -> std::io::Result<()> {
            Ok(())
        }
        fn size(&self) -> std::io::Result<Size> {
            Ok(Size::new(80, 24))
        }
        fn window_size(&mut self) -> std::io::Result<WindowSize> {
            Err(std::io::Error::from_raw_os_error(libc::EIO))
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Err(std::io::Error::from_raw_os_error(libc::EIO))
        }
    }
    let f = fixture("exit 0", Duration::from_secs(1));
    let mut s = f.session;
    let mut term = Terminal::new(Broken).unwrap();
    // The loop neither waits nor spins: one turn says the terminal is lost.
    let t0 = Instant::now();
    let evs = s.wait(&f.app, &mut term, &f.inbox, Duration::from_secs(5), || {
        false
    });
    assert!(matches!(evs[..], [Event::TerminalLost]), "{evs:?}");
    assert!(t0.elapsed() < Duration::from_secs(1));
}

#[test]
fn a_turn_of_the_loop_returns_input_or_the_lost_terminal_after_at_most_a_tick() {
    let mut f = fixture("exit 0", Duration::from_secs(1));
    let tick = Duration::from_millis(50);
    let (tx, rx) = channel();
    let key = || {
        Event::Key(crossterm::event::KeyEvent::from(
            crossterm::event::KeyCode::Char('x'),
        ))
    };
    // Nothing arrives: back after the tick, with nothing.
    let t0 = Instant::now();
    assert!(
        f.session
            .wait(&f.app, &mut f.term, &rx, tick, || false)
            .is_empty()
    );
    assert!(t0.elapsed() >= tick && t0.elapsed() < Duration::from_secs(2));
    // Input waiting: all of it, stale stats left out.
    tx.send(Inbox::Event(key())).unwrap();
    tx.send(Inbox::Stats {
        generation: 7,
        stats: Err("old".into()),
    })
    .unwrap();
    tx.send(Inbox::Event(key())).unwrap();
    let evs = f.session.wait(&f.app, &mut f.term, &rx, tick, || false);
    assert!(matches!(evs[..], [Event::Key(_), Event::Key(_)]), "{evs:?}");
    // The terminal hung up while the reader is stuck (it sends nothing).
    let draws = f.term.backend().draws;
    let evs = f.session.wait(&f.app, &mut f.term, &rx, tick, || true);
    assert!(matches!(evs[..], [Event::TerminalLost]), "{evs:?}");
    // The reader noticed too: still one event.
    tx.send(Inbox::Event(Event::TerminalLost)).unwrap();
    let evs = f.session.wait(&f.app, &mut f.term, &rx, tick, || true);
    assert!(matches!(evs[..], [Event::TerminalLost]), "{evs:?}");
    f.session
        .handle(&mut f.app, Event::TerminalLost, &mut f.term);
    assert!(f.app.quit);
    // From now on nothing is drawn and nothing waited for.
    let t0 = Instant::now();
    let evs = f
        .session
        .wait(&f.app, &mut f.term, &rx, Duration::from_secs(5), || false);
    assert!(matches!(evs[..], [Event::TerminalLost]), "{evs:?}");
    assert!(t0.elapsed() < Duration::from_secs(1));
    assert_eq!(f.term.backend().draws, draws + 2);
}

#[test]
fn a_stop_signal_stops_the_runtime_and_a_forced_kill_fails_the_exit_status() {
    // Ignores SIGTERM: only the SIGKILL after the grace period ends it.
    let mut f = fixture(
        &format!("trap '' TERM\n{READY}\nwhile true; do sleep 0.05; done"),
        Duration::from_millis(300),
    );
    f.ready();
    let rt = pid(&f.dir);
    let t0 = Instant::now();
    f.session.handle(&mut f.app, Event::StopSignal, &mut f.term);
    assert!(f.app.quit);
    assert!(!alive(rt));
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    let killed = "did not stop within 300 ms of SIGTERM; killed with SIGKILL";
    assert_eq!(
        f.app.run.status,
        RunStatus::Exited {
            success: false,
            description: format!("stopped: {killed}")
        }
    );
    assert_eq!(f.session.problems(), vec![killed.to_string()]);
    // The final stop of the loop finds nothing left to stop.
    f.session.stop(&mut f.app, &mut f.term);
    assert_eq!(f.session.problems(), vec![killed.to_string()]);
}

#[test]
fn only_the_last_runtime_s_own_failure_is_a_problem() {
    // The first start fails by itself; the second serves and stops cleanly.
    let body = format!("if [ $n -eq 1 ]; then exit 3; fi\n{READY}\n{GRACEFUL}");
    let mut f = fixture(&body, Duration::from_secs(10));
    f.launch();
    f.pump_until(|s| matches!(s, RunStatus::Exited { .. }));
    f.ready();
    f.session.handle(&mut f.app, Event::StopSignal, &mut f.term);
    assert!(
        f.session.problems().is_empty(),
        "{:?}",
        f.session.problems()
    );

    // A runtime that failed and is still the last one when the loop ends.
    let mut f = fixture("exit 3", Duration::from_secs(10));
    f.launch();
    f.pump_until(|s| matches!(s, RunStatus::Exited { .. }));
    f.session
        .handle(&mut f.app, Event::TerminalLost, &mut f.term);
    f.session.stop(&mut f.app, &mut f.term);
    assert_eq!(f.session.problems(), vec!["exited with code 3".to_string()]);
}

#[test]
fn stats_from_a_stopped_poller_never_reach_the_app() {
    let stats = |generation| Inbox::Stats {
        generation,
        stats: Err("x".into()),
    };
    let mut f = fixture(&format!("{READY}\n{GRACEFUL}"), Duration::from_secs(10));
    assert!(f.session.accept(stats(0)).is_none(), "no poller yet");
    f.ready();
    // The poller of this runtime delivers, at the promised rate.
    let first = f.inbox.recv_timeout(Duration::from_secs(5)).unwrap();
    let t0 = Instant::now();
    let Inbox::Stats { generation, .. } = first else {
        panic!("not stats")
    };
    assert!(matches!(
        f.session.accept(stats(generation)),
        Some(Event::Stats(_))
    ));
    f.inbox.recv_timeout(Duration::from_secs(5)).unwrap();
    // Well under the old 1 s interval, with room for a loaded machine.
    assert!(
        t0.elapsed() < Duration::from_millis(600),
        "{:?}",
        t0.elapsed()
    );
    assert!(f.session.accept(stats(generation - 1)).is_none());
    f.session.stop(&mut f.app, &mut f.term);
    assert!(f.session.accept(stats(generation)).is_none(), "stopped");
    let key = Event::Key(crossterm::event::KeyEvent::from(
        crossterm::event::KeyCode::Char('x'),
    ));
    assert!(matches!(
        f.session.accept(Inbox::Event(key)),
        Some(Event::Key(_))
    ));
}
