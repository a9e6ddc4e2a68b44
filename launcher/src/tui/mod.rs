//! The interactive launcher. State (`app`), events (`event`) and drawing
//! (`screens`) are separate; this module owns the terminal and the loop that
//! connects them to the keyboard, the runtime process and its stats
//! (`session` carries out what the app asks for).
//!
//! The loop never blocks on one source: terminal input arrives from its own
//! thread (`input`), stats from the poller's, both through one channel the
//! loop waits on for at most [`TICK`]; then it looks at the stop-signal flag,
//! the terminal's hangup state and the runtime's events. So SIGHUP, SIGTERM,
//! SIGINT and a lost terminal end the launcher (runtime stopped, within the
//! supervisor's grace period) in every screen, and an idle launcher sleeps.
//!
//! The terminal is always restored: by a guard on normal exit and by a panic
//! hook; after the terminal is lost nothing more is drawn.

pub mod app;
pub mod event;
pub mod fields;
mod input;
pub mod keys;
pub mod screens;
mod session;

use crate::headless::{Ctx, SHUTDOWN_GRACE};
use crate::probe::Probe;
use crate::{runtime, signals};
use app::App;
use crossterm::event::{DisableMouseCapture, EnableMouseCapture};
use crossterm::execute;
use crossterm::terminal::{
    EnterAlternateScreen, LeaveAlternateScreen, disable_raw_mode, enable_raw_mode,
};
use event::Event;
use ratatui::Terminal;
use ratatui::backend::CrosstermBackend;
use session::{Inbox, Session};
use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::mpsc::channel;
use std::time::Duration;

/// The longest the loop waits before it looks at signals, the terminal and
/// the runtime again (and redraws).
const TICK: Duration = Duration::from_millis(100);

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

/// Runs the TUI until the user quits, a stop signal arrives or the terminal
/// is lost. The exit status is a failure when a runtime had to be killed
/// after the grace period, or the last one did not end cleanly
/// ([`Session::problems`]); each is printed once the terminal is restored.
pub fn run(ctx: &Ctx) -> anyhow::Result<ExitCode> {
    let rt = runtime::locate(ctx.global.runtime.as_deref());
    let caps = rt
        .as_ref()
        .map_err(|e| e.to_string())
        .and_then(|p| runtime::capabilities(p).map_err(|e| e.to_string()));
    let probe = ctx.probe();
    let mut app = App::new(&probe as &dyn Probe, caps);

    signals::install();
    let tty = Arc::new(input::Tty::open()?);
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        restore_terminal();
        prev(info);
    }));
    enable_raw_mode()?;
    let guard = TerminalGuard;
    execute!(std::io::stdout(), EnterAlternateScreen, EnableMouseCapture)?;
    let mut term = Terminal::new(CrosstermBackend::new(std::io::stdout()))?;

    let (tx, inbox) = channel();
    let input_tx = tx.clone();
    input::spawn(tty.clone(), move |e| input_tx.send(Inbox::Event(e)).is_ok());
    let mut s = Session::new(rt, ctx.store(), SHUTDOWN_GRACE, tx);
    while !app.quit {
        let mut events = s.wait(&app, &mut term, &inbox, TICK, || tty.lost());
        if signals::stop_requested() {
            events.push(Event::StopSignal);
        }
        events.extend(s.runtime_events());
        for ev in events {
            s.handle(&mut app, ev, &mut term);
        }
    }
    // A runtime that already exited (or whose restart was pending) is
    // reaped here; a running one was stopped by the quit itself.
    s.stop(&mut app, &mut term);
    drop(term);
    drop(guard);
    let problems = s.problems();
    if problems.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    // The terminal may be gone: a failed write must not turn into a panic.
    let mut err = std::io::stderr();
    for how in &problems {
        let _ = writeln!(err, "error: runtime {how}");
    }
    Ok(ExitCode::FAILURE)
}

#[cfg(test)]
mod tests;
