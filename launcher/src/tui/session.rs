//! What the TUI loop does for the app: carries out its actions (start, stop
//! and restart the runtime, save a profile), polls `/v1/stats` while the
//! server is ready, draws while there is a terminal to draw on, and keeps
//! the stops that did not end cleanly for the launcher's exit status.

use super::app::{App, RunStatus};
use super::event::{Action, Event};
use super::screens;
use crate::headless::serve_command;
use crate::profiles::{Profile, SCHEMA, Store};
use crate::runtime::RuntimeError;
use crate::supervisor::{RestartPolicy, StatsClient, Stopped, SupEvent, Supervisor};
use krasis_common::{EngineStats, LaunchOptions};
use ratatui::Terminal;
use ratatui::backend::Backend;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::time::{Duration, Instant};

/// How often the run screen's numbers are refreshed from `/v1/stats` (the
/// dashboard promises updates at least every 250 ms).
pub const STATS_INTERVAL: Duration = Duration::from_millis(200);

/// What wakes the TUI loop: terminal input and stats results.
pub enum Inbox {
    Event(Event),
    /// A `/v1/stats` answer from the poller of `generation`; answers from a
    /// poller that was stopped since are dropped, so a stopped runtime's
    /// last numbers or its "connection refused" never reach the screen.
    Stats {
        generation: u64,
        stats: Result<EngineStats, String>,
    },
}

/// A background poller of `/v1/stats`; stops when dropped.
struct StatsPoller {
    stop: Arc<AtomicBool>,
}

impl StatsPoller {
    fn start(url: &str, api_key: Option<String>, generation: u64, tx: Sender<Inbox>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let client = StatsClient::new(url, api_key);
        std::thread::spawn(move || {
            let client = match client {
                Ok(c) => c,
                Err(e) => {
                    let _ = tx.send(Inbox::Stats {
                        generation,
                        stats: Err(e),
                    });
                    return;
                }
            };
            while !s.load(Ordering::SeqCst) {
                // A fixed rate, not "interval after each answer".
                let next = Instant::now() + STATS_INTERVAL;
                let stats = client.stats();
                if tx.send(Inbox::Stats { generation, stats }).is_err() {
                    return;
                }
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
            }
        });
        StatsPoller { stop }
    }
}

impl Drop for StatsPoller {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

pub struct Session {
    runtime: Result<PathBuf, RuntimeError>,
    store: Store,
    /// Wait this long after SIGTERM before the runtime is killed.
    grace: Duration,
    /// `grace` for the running runtime's options (longer when it writes
    /// the prefix cache's file on its way out).
    run_grace: Duration,
    sup: Option<Supervisor>,
    poller: Option<StatsPoller>,
    generation: u64,
    inbox: Sender<Inbox>,
    /// False once the terminal is lost: nothing is drawn after that (a
    /// write to a hung-up tty fails, and must not delay the shutdown).
    terminal_ok: bool,
    /// Every stop that needed SIGKILL after the grace period.
    forced_kills: Vec<Stopped>,
    /// How the last runtime ended (or failed to start).
    last_end: Option<Stopped>,
}

impl Session {
    pub fn new(
        runtime: Result<PathBuf, RuntimeError>,
        store: Store,
        grace: Duration,
        inbox: Sender<Inbox>,
    ) -> Self {
        Session {
            runtime,
            store,
            grace,
            run_grace: grace,
            sup: None,
            poller: None,
            generation: 0,
            inbox,
            terminal_ok: true,
            forced_kills: Vec::new(),
            last_end: None,
        }
    }

    /// What the launcher's exit status must report, once the loop is over
    /// and the runtime stopped: every kill that was needed, and the last
    /// runtime's end unless it was clean. A runtime that crashed and was
    /// then replaced by a good one is not a problem of the session; one
    /// that had to be killed always is (a service manager or script must
    /// never take a forced kill for a clean stop).
    pub fn problems(&self) -> Vec<String> {
        let mut p: Vec<String> = self
            .forced_kills
            .iter()
            .map(|s| s.description.clone())
            .collect();
        if let Some(last) = &self.last_end
            && !last.clean
            && !self.forced_kills.contains(last)
        {
            p.push(last.description.clone());
        }
        p
    }

    /// The event an inbox message stands for, if it is still current.
    pub fn accept(&self, m: Inbox) -> Option<Event> {
        match m {
            Inbox::Event(e) => Some(e),
            Inbox::Stats { generation, stats } => (self.poller.is_some()
                && generation == self.generation)
                .then_some(Event::Stats(stats)),
        }
    }

    /// One turn of the loop: draws, waits up to `tick` for input or stats,
    /// and returns what arrived. A failed draw, or `lost()` (the terminal
    /// hung up, checked after the wait so a reader stuck in crossterm does
    /// not hide it), adds [`Event::TerminalLost`] and returns at once:
    /// nothing is waited for or drawn on a terminal that is gone.
    pub fn wait<B: Backend>(
        &mut self,
        app: &App,
        term: &mut Terminal<B>,
        inbox: &Receiver<Inbox>,
        tick: Duration,
        lost: impl Fn() -> bool,
    ) -> Vec<Event> {
        let mut events = Vec::new();
        if self.draw(app, term) {
            if let Ok(m) = inbox.recv_timeout(tick) {
                events.extend(self.accept(m));
            }
            while let Ok(m) = inbox.try_recv() {
                events.extend(self.accept(m));
            }
        }
        if !self.terminal_ok || lost() {
            events.retain(|e| !matches!(e, Event::TerminalLost));
            events.push(Event::TerminalLost);
        }
        events
    }

    /// Everything the runtime reported since the last call.
    pub fn runtime_events(&mut self) -> Vec<Event> {
        let mut evs = Vec::new();
        if let Some(s) = self.sup.as_mut() {
            while let Some(e) = s.next_event(Duration::ZERO) {
                evs.push(Event::Runtime(e));
            }
        }
        evs
    }

    /// Draws the app unless the terminal is gone. False when it is (or the
    /// draw failed, which means the same).
    pub fn draw<B: Backend>(&mut self, app: &App, term: &mut Terminal<B>) -> bool {
        if self.terminal_ok && term.draw(|f| screens::draw(app, f)).is_err() {
            self.terminal_ok = false;
        }
        self.terminal_ok
    }

    /// Hands `ev` to the app and carries out what it asks for.
    pub fn handle<B: Backend>(&mut self, app: &mut App, ev: Event, term: &mut Terminal<B>) {
        if matches!(ev, Event::TerminalLost) {
            self.terminal_ok = false;
        }
        let was_ready = matches!(app.run.status, RunStatus::Ready { .. });
        for action in app.update(ev) {
            match action {
                Action::Launch(o) => self.launch(app, &o),
                Action::Restart(o) => {
                    self.stop(app, term);
                    app.run.status = RunStatus::Starting;
                    self.launch(app, &o);
                }
                Action::Stop => self.stop(app, term),
                Action::SaveProfile { name, options } => {
                    let p = Profile {
                        schema: SCHEMA,
                        name,
                        description: None,
                        options,
                    };
                    app.message = Some(match self.store.save(&p) {
                        Ok(path) => format!("saved {}", path.display()),
                        Err(e) => e.to_string(),
                    });
                }
                Action::Quit => {}
            }
        }
        match &app.run.status {
            RunStatus::Ready { url } if !was_ready && self.sup.is_some() => {
                self.generation += 1;
                self.poller = Some(StatsPoller::start(
                    url,
                    app.opts.resolved_api_key().ok().flatten(),
                    self.generation,
                    self.inbox.clone(),
                ));
            }
            RunStatus::Ready { .. } => {}
            _ => self.poller = None,
        }
    }

    /// Starts the runtime with `o`; a failure to start shows as its exit.
    pub fn launch(&mut self, app: &mut App, o: &LaunchOptions) {
        // An earlier runtime that ended by itself is replaced, not stopped.
        self.sup = None;
        self.run_grace = o.shutdown_grace(self.grace);
        let started = match &self.runtime {
            Ok(path) => {
                let (args, env) = serve_command(o);
                Supervisor::spawn(path, &args, &env, RestartPolicy::default())
                    .map_err(|e| e.to_string())
            }
            Err(e) => Err(e.to_string()),
        };
        match started {
            Ok(s) => {
                self.sup = Some(s);
                self.last_end = None;
            }
            Err(description) => {
                self.last_end = Some(Stopped {
                    description: description.clone(),
                    clean: false,
                });
                app.run.status = RunStatus::Exited {
                    success: false,
                    description,
                };
            }
        }
    }

    /// Stops the runtime (SIGTERM, the grace period, SIGKILL) and shows how
    /// it ended.
    pub fn stop<B: Backend>(&mut self, app: &mut App, term: &mut Terminal<B>) {
        self.poller = None;
        let Some(mut s) = self.sup.take() else {
            return;
        };
        app.run.status = RunStatus::Stopping;
        self.draw(app, term);
        let how = s.shutdown(self.run_grace);
        while let Some(e) = s.next_event(Duration::ZERO) {
            if let SupEvent::Log(l) = e {
                app.update(Event::Runtime(SupEvent::Log(l)));
            }
        }
        app.run.status = RunStatus::Exited {
            success: how.clean,
            description: format!("stopped: {how}"),
        };
        if how == Stopped::killed_after(self.run_grace) {
            self.forced_kills.push(how.clone());
        }
        self.last_end = Some(how);
    }
}

#[cfg(all(test, unix))]
mod tests;
