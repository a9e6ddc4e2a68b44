//! The interactive launcher. State (`app`), events (`event`) and drawing
//! (`screens`) are separate; this module owns the terminal and the loop that
//! connects them to the keyboard, the runtime process and its stats.
//!
//! The terminal is always restored: by a guard on normal exit, by a panic
//! hook, and SIGTERM/SIGHUP end the loop like `q` does.

pub mod app;
pub mod event;
pub mod fields;
pub mod screens;

use crate::headless::{Ctx, SHUTDOWN_GRACE, serve_command};
use crate::probe::Probe;
use crate::profiles::{Profile, SCHEMA};
use crate::supervisor::{RestartPolicy, StatsClient, Supervisor};
use crate::{runtime, signals};
use app::{App, RunStatus};
use crossterm::event::{self as ct, DisableMouseCapture, EnableMouseCapture};
use crossterm::execute;
use crossterm::terminal::{
    EnterAlternateScreen, LeaveAlternateScreen, disable_raw_mode, enable_raw_mode,
};
use event::{Action, Event};
use krasis_common::EngineStats;
use ratatui::Terminal;
use ratatui::backend::CrosstermBackend;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, channel};
use std::time::Duration;

fn restore_terminal() {
    let _ = disable_raw_mode();
    let _ = execute!(std::io::stdout(), LeaveAlternateScreen, DisableMouseCapture);
}

struct TerminalGuard;

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        restore_terminal();
    }
}

/// A background poller of `/v1/stats`; stops when dropped.
struct StatsPoller {
    stop: Arc<AtomicBool>,
    rx: Receiver<Result<EngineStats, String>>,
}

impl StatsPoller {
    fn start(url: &str, api_key: Option<String>) -> Option<Self> {
        let client = StatsClient::new(url, api_key).ok()?;
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = channel();
        let s = stop.clone();
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                if tx.send(client.stats()).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_secs(1));
            }
        });
        Some(StatsPoller { stop, rx })
    }
}

impl Drop for StatsPoller {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

pub fn run(ctx: &Ctx) -> anyhow::Result<()> {
    let rt = runtime::locate(ctx.global.runtime.as_deref());
    let caps = rt
        .as_ref()
        .map_err(|e| e.to_string())
        .and_then(|p| runtime::capabilities(p).map_err(|e| e.to_string()));
    let probe = ctx.probe();
    let mut app = App::new(&probe as &dyn Probe, caps);

    signals::install();
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        restore_terminal();
        prev(info);
    }));
    enable_raw_mode()?;
    let _guard = TerminalGuard;
    execute!(std::io::stdout(), EnterAlternateScreen, EnableMouseCapture)?;
    let mut term = Terminal::new(CrosstermBackend::new(std::io::stdout()))?;

    let mut sup: Option<Supervisor> = None;
    let mut poller: Option<StatsPoller> = None;
    while !app.quit {
        term.draw(|f| screens::draw(&app, f))?;
        let mut events = Vec::new();
        if ct::poll(Duration::from_millis(100))? {
            match ct::read()? {
                ct::Event::Key(k) => events.push(Event::Key(k)),
                ct::Event::Mouse(m) => events.push(Event::Mouse(m)),
                ct::Event::Resize(w, h) => events.push(Event::Resize(w, h)),
                _ => {}
            }
        }
        if signals::stop_requested() {
            events.push(Event::StopSignal);
        }
        if let Some(s) = sup.as_mut() {
            while let Some(e) = s.next_event(Duration::ZERO) {
                events.push(Event::Runtime(e));
            }
        }
        if let Some(p) = &poller {
            while let Ok(s) = p.rx.try_recv() {
                events.push(Event::Stats(s));
            }
        }
        for ev in events {
            let was_ready = matches!(app.run.status, RunStatus::Ready { .. });
            for action in app.update(ev) {
                match action {
                    Action::Launch(o) => {
                        sup = start(&rt, &o, &mut app);
                    }
                    Action::Restart(o) => {
                        poller = None;
                        stop(&mut sup, &mut app, &mut term)?;
                        app.run.status = RunStatus::Starting;
                        sup = start(&rt, &o, &mut app);
                    }
                    Action::Stop => {
                        poller = None;
                        stop(&mut sup, &mut app, &mut term)?;
                    }
                    Action::SaveProfile { name, options } => {
                        let p = Profile {
                            schema: SCHEMA,
                            name,
                            description: None,
                            options,
                        };
                        app.message = Some(match ctx.store().save(&p) {
                            Ok(path) => format!("saved {}", path.display()),
                            Err(e) => e.to_string(),
                        });
                    }
                    Action::Quit => {}
                }
            }
            if let RunStatus::Ready { url } = &app.run.status
                && !was_ready
            {
                poller = StatsPoller::start(url, app.opts.resolved_api_key().ok().flatten());
            }
        }
        if matches!(
            app.run.status,
            RunStatus::Exited { .. } | RunStatus::Restarting { .. }
        ) {
            poller = None;
        }
    }
    if sup.is_some() {
        stop(&mut sup, &mut app, &mut term)?;
    }
    Ok(())
}

fn start(
    rt: &Result<std::path::PathBuf, runtime::RuntimeError>,
    o: &krasis_common::LaunchOptions,
    app: &mut App,
) -> Option<Supervisor> {
    let path = match rt {
        Ok(p) => p,
        Err(e) => {
            app.run.status = RunStatus::Exited {
                success: false,
                description: e.to_string(),
            };
            return None;
        }
    };
    let (args, env) = serve_command(o);
    match Supervisor::spawn(path, &args, &env, RestartPolicy::default()) {
        Ok(s) => Some(s),
        Err(e) => {
            app.run.status = RunStatus::Exited {
                success: false,
                description: e.to_string(),
            };
            None
        }
    }
}

fn stop<B: ratatui::backend::Backend>(
    sup: &mut Option<Supervisor>,
    app: &mut App,
    term: &mut Terminal<B>,
) -> anyhow::Result<()> {
    if let Some(mut s) = sup.take() {
        app.run.status = RunStatus::Stopping;
        term.draw(|f| screens::draw(app, f))
            .map_err(|e| anyhow::anyhow!("drawing: {e}"))?;
        let how = s.shutdown(SHUTDOWN_GRACE);
        while let Some(e) = s.next_event(Duration::ZERO) {
            if let crate::supervisor::SupEvent::Log(l) = e {
                app.run.log.push_back(l);
            }
        }
        app.run.status = RunStatus::Exited {
            success: true,
            description: format!("stopped: {how}"),
        };
    }
    signals::clear();
    Ok(())
}

#[cfg(test)]
mod tests;
