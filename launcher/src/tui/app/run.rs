//! The run screen's half of [`App`]: the runtime's events, the stats polls
//! and the run screen's keys.

use super::live::{PAGE, PAN, Progress};
use super::{App, LOG_LINES, RunState, RunStatus, Screen};
use crate::supervisor::SupEvent;
use crate::tui::event::Action;
use crate::tui::keys::Cmd;
use krasis_common::{EngineStats, ProgressEvent};
use std::time::Instant;

impl App {
    pub(super) fn run_command(&mut self, cmd: Cmd) -> Vec<Action> {
        let active = self.runtime_active();
        let lines = self.run.log.len();
        let v = &mut self.run.log_view;
        match cmd {
            Cmd::Stop if active => {
                self.run.status = RunStatus::Stopping;
                return vec![Action::Stop];
            }
            Cmd::Stop => self.message = Some("the runtime is not running".into()),
            Cmd::Restart => return self.restart(),
            Cmd::Back if active => {
                self.message =
                    Some("the runtime is running: s stops it; the other tabs are on 1-4".into())
            }
            Cmd::Back => self.go(Screen::Summary),
            // Scrolling past the top is clamped when drawn; the cap here
            // keeps a long press from needing as long a press back.
            Cmd::LogUp => v.up = (v.up + 1).min(lines),
            Cmd::LogPageUp => v.up = (v.up + PAGE).min(lines),
            Cmd::LogDown => v.up = v.up.saturating_sub(1),
            Cmd::LogPageDown => v.up = v.up.saturating_sub(PAGE),
            Cmd::LogFollow => v.up = 0,
            Cmd::LogLeft => v.right = v.right.saturating_sub(PAN),
            Cmd::LogRight if v.wrap => {
                self.message = Some("the log wraps long lines; w turns wrapping off".into())
            }
            Cmd::LogRight => v.right += PAN,
            Cmd::LogWrap => {
                v.wrap = !v.wrap;
                v.right = 0;
            }
            _ => {}
        }
        Vec::new()
    }

    fn restart(&mut self) -> Vec<Action> {
        let Some(o) = self.run.launched.clone() else {
            self.message = Some("nothing to restart: launch from 4 Summary".into());
            return Vec::new();
        };
        let was_active = self.runtime_active();
        self.run = RunState {
            status: RunStatus::Starting,
            launched: Some(o.clone()),
            ..RunState::default()
        };
        if was_active {
            vec![Action::Restart(o)]
        } else {
            vec![Action::Launch(o)]
        }
    }

    fn push_log(&mut self, l: String) {
        if self.run.log.len() == LOG_LINES {
            self.run.log.pop_front();
        }
        self.run.log.push_back(l);
        // A reader scrolled up keeps looking at the same lines.
        let lines = self.run.log.len();
        let v = &mut self.run.log_view;
        if v.up > 0 {
            v.up = (v.up + 1).min(lines);
        }
    }

    pub(super) fn stats(&mut self, s: Result<EngineStats, String>) {
        // A poll answered after the runtime stopped or crashed describes a
        // process that is gone.
        if !matches!(self.run.status, RunStatus::Ready { .. }) {
            return;
        }
        match s {
            Ok(s) => {
                self.run.live.observe(&s);
                self.run.stats = Some(s);
                self.run.stats_error = None;
            }
            Err(e) => self.run.stats_error = Some(e),
        }
    }

    pub(super) fn runtime_event(&mut self, e: SupEvent, now: Instant) {
        match e {
            SupEvent::Log(l) => self.push_log(l),
            SupEvent::Restarting(r) => {
                let message = r.to_string();
                self.push_log(message.clone());
                self.run.crashes += 1;
                self.run.last_crash = Some(message.clone());
                self.run.progress = None;
                self.run.stats = None;
                self.run.stats_error = None;
                self.run.status = RunStatus::Restarting { message };
            }
            SupEvent::Restarted { pid } => {
                self.push_log(format!("runtime restarted (pid {pid})"));
                self.run.phases.clear();
                self.run.hcs = None;
                self.run.fatal = None;
                self.run.live.new_process();
                self.run.status = RunStatus::Starting;
            }
            SupEvent::Exited {
                success,
                description,
            } => {
                self.run.progress = None;
                self.run.status = RunStatus::Exited {
                    success,
                    description,
                };
            }
            SupEvent::Progress(p) => self.progress_event(p, now),
        }
    }

    fn progress_event(&mut self, p: ProgressEvent, now: Instant) {
        match p {
            ProgressEvent::Phase { phase, detail } => {
                self.run.progress = None;
                self.run.phases.push((phase, detail));
            }
            ProgressEvent::Progress {
                task,
                done,
                total,
                unit,
            } => {
                let prev = self.run.progress.take();
                self.run.progress = Some(Progress::next(prev, task, done, total, unit, now));
            }
            ProgressEvent::HcsDecision {
                resident_experts,
                total_experts,
                bytes,
                safety_margin_bytes,
            } => {
                self.run.hcs = Some(format!(
                    "{resident_experts}/{total_experts} experts resident ({}), {} kept free",
                    crate::units::fmt_bytes(bytes),
                    crate::units::fmt_bytes(safety_margin_bytes)
                ));
            }
            ProgressEvent::Ready { url, .. } => {
                self.run.progress = None;
                self.run.status = RunStatus::Ready { url };
                // Loading may have built the expert cache.
                self.refresh_models();
            }
            ProgressEvent::Log { level, message } => self.push_log(format!("{level}: {message}")),
            ProgressEvent::Fatal { message } => {
                self.push_log(format!("FATAL: {message}"));
                self.run.fatal = Some(message);
            }
        }
    }
}
