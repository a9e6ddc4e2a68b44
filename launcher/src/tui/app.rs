//! TUI state and how events change it. No terminal here: `App::update` takes
//! an [`Event`] and returns the [`Action`]s for the loop to carry out, which is
//! what the key-driven tests exercise.

use super::event::{Action, Event};
use super::fields::FIELDS;
use crate::estimate::{Estimate, estimate};
use crate::probe::{Hardware, ModelInfo, ModelSummary, Probe};
use crate::supervisor::SupEvent;
use crate::validate::validate_with_model;
use crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers, MouseEventKind};
use krasis_common::{Capabilities, EngineStats, LaunchOptions, ProgressEvent};
use std::collections::VecDeque;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Screen {
    Model,
    Hardware,
    Options,
    Summary,
    Run,
}

impl Screen {
    pub const ALL: [Screen; 5] = [
        Screen::Model,
        Screen::Hardware,
        Screen::Options,
        Screen::Summary,
        Screen::Run,
    ];
    pub fn title(self) -> &'static str {
        match self {
            Screen::Model => "1 Model",
            Screen::Hardware => "2 Hardware",
            Screen::Options => "3 Options",
            Screen::Summary => "4 Summary",
            Screen::Run => "5 Run",
        }
    }
}

/// Where the runtime is. `Restarting`: it crashed after it had been ready
/// and the supervisor starts it again after a backoff; the message says why,
/// when and which attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum RunStatus {
    Idle,
    Starting,
    Ready { url: String },
    Restarting { message: String },
    Stopping,
    Exited { success: bool, description: String },
}

#[derive(Debug, Clone, PartialEq)]
pub struct RunState {
    pub status: RunStatus,
    pub phases: Vec<(String, String)>,
    pub progress: Option<(String, u64, u64, String)>,
    pub hcs: Option<String>,
    pub fatal: Option<String>,
    pub log: VecDeque<String>,
    pub stats: Option<EngineStats>,
    pub stats_error: Option<String>,
    /// The options the runtime was started with (for restart).
    pub launched: Option<LaunchOptions>,
    /// Automatic restarts after crashes since launch, and the latest one.
    pub crashes: u32,
    pub last_crash: Option<String>,
}

impl Default for RunState {
    fn default() -> Self {
        RunState {
            status: RunStatus::Idle,
            phases: Vec::new(),
            progress: None,
            hcs: None,
            fatal: None,
            log: VecDeque::new(),
            stats: None,
            stats_error: None,
            launched: None,
            crashes: 0,
            last_crash: None,
        }
    }
}

pub const LOG_LINES: usize = 200;

pub struct App {
    pub screen: Screen,
    pub hardware: Hardware,
    pub models: Vec<ModelInfo>,
    pub model_idx: usize,
    pub caps: Result<Capabilities, String>,
    pub opts: LaunchOptions,
    pub field_idx: usize,
    /// Text being typed into a field (or a profile name on the summary).
    pub editing: Option<String>,
    /// A validation error or notice for the footer.
    pub message: Option<String>,
    pub run: RunState,
    pub quit: bool,
}

impl App {
    pub fn new(probe: &dyn Probe, caps: Result<Capabilities, String>) -> Self {
        let models = probe.models();
        let model_idx = models.iter().position(|m| m.summary.is_ok()).unwrap_or(0);
        App {
            screen: Screen::Model,
            hardware: probe.hardware(),
            models,
            model_idx,
            caps,
            opts: LaunchOptions::default(),
            field_idx: 0,
            editing: None,
            message: None,
            run: RunState::default(),
            quit: false,
        }
    }

    pub fn selected_model(&self) -> Option<(&ModelInfo, &ModelSummary)> {
        let m = self.models.get(self.model_idx)?;
        Some((m, m.summary.as_ref().ok()?))
    }

    /// The one validation (shared with the CLI and profiles).
    pub fn validation(&self) -> Result<(), String> {
        let caps = self.caps.as_ref().map_err(|e| e.clone())?;
        let (_, s) = self.selected_model().ok_or("no usable model selected")?;
        validate_with_model(&self.opts, caps, s).map_err(|e| e.to_string())
    }

    pub fn estimate(&self) -> Option<Estimate> {
        let (_, s) = self.selected_model()?;
        let gpu = self
            .hardware
            .gpus
            .gpus()
            .iter()
            .find(|g| g.index == self.opts.gpu)
            .map(|g| (g.total_bytes, g.free_bytes));
        Some(estimate(
            &self.opts,
            s,
            self.hardware.host.available_ram_bytes,
            gpu,
        ))
    }

    pub fn runtime_active(&self) -> bool {
        matches!(
            self.run.status,
            RunStatus::Starting
                | RunStatus::Ready { .. }
                | RunStatus::Restarting { .. }
                | RunStatus::Stopping
        )
    }

    pub fn update(&mut self, ev: Event) -> Vec<Action> {
        match ev {
            Event::Key(k) if k.kind != KeyEventKind::Release => self.key(k),
            Event::Key(_) | Event::Resize(..) => Vec::new(),
            Event::Mouse(m) => match m.kind {
                MouseEventKind::ScrollUp => self.key(KeyEvent::from(KeyCode::Up)),
                MouseEventKind::ScrollDown => self.key(KeyEvent::from(KeyCode::Down)),
                _ => Vec::new(),
            },
            Event::Runtime(e) => {
                self.runtime_event(e);
                Vec::new()
            }
            Event::Stats(Ok(s)) => {
                self.run.stats = Some(s);
                self.run.stats_error = None;
                Vec::new()
            }
            Event::Stats(Err(e)) => {
                self.run.stats_error = Some(e);
                Vec::new()
            }
            Event::StopSignal => self.quit_actions(),
        }
    }

    fn quit_actions(&mut self) -> Vec<Action> {
        self.quit = true;
        if self.runtime_active() {
            self.run.status = RunStatus::Stopping;
            vec![Action::Stop, Action::Quit]
        } else {
            vec![Action::Quit]
        }
    }

    fn key(&mut self, k: KeyEvent) -> Vec<Action> {
        if k.modifiers.contains(KeyModifiers::CONTROL) && k.code == KeyCode::Char('c') {
            return self.quit_actions();
        }
        if self.editing.is_some() {
            return self.edit_key(k);
        }
        if k.code == KeyCode::Char('q') {
            return self.quit_actions();
        }
        match self.screen {
            Screen::Model => self.model_key(k),
            Screen::Hardware => self.nav_key(k, Screen::Model, Screen::Options),
            Screen::Options => self.options_key(k),
            Screen::Summary => self.summary_key(k),
            Screen::Run => self.run_key(k),
        }
    }

    fn go(&mut self, s: Screen) {
        self.screen = s;
        self.message = None;
    }

    fn nav_key(&mut self, k: KeyEvent, back: Screen, next: Screen) -> Vec<Action> {
        match k.code {
            KeyCode::Enter | KeyCode::Tab | KeyCode::Right => self.go(next),
            KeyCode::Esc | KeyCode::BackTab | KeyCode::Left => self.go(back),
            _ => {}
        }
        Vec::new()
    }

    fn model_key(&mut self, k: KeyEvent) -> Vec<Action> {
        let n = self.models.len();
        match k.code {
            KeyCode::Up | KeyCode::Char('k') if n > 0 => {
                self.model_idx = (self.model_idx + n - 1) % n;
            }
            KeyCode::Down | KeyCode::Char('j') if n > 0 => {
                self.model_idx = (self.model_idx + 1) % n
            }
            KeyCode::Enter | KeyCode::Tab | KeyCode::Right => self.choose_model(),
            _ => {}
        }
        Vec::new()
    }

    fn choose_model(&mut self) {
        let Some(m) = self.models.get(self.model_idx) else {
            self.message =
                Some("no models found; add one under ./models or pass --model-root DIR".into());
            return;
        };
        let s = match &m.summary {
            Ok(s) => s,
            Err(e) => {
                self.message = Some(format!("{} cannot be served: {e}", m.name));
                return;
            }
        };
        let caps = match &self.caps {
            Ok(c) => c,
            Err(e) => {
                self.message = Some(e.clone());
                return;
            }
        };
        let Some(mut o) = caps.default_options(&s.model_type) else {
            self.message = Some(format!(
                "architecture '{}' is not supported by this runtime",
                s.model_type
            ));
            return;
        };
        // Keep where and how it is served across model changes.
        o.host = self.opts.host.clone();
        o.port = self.opts.port;
        o.api_key = self.opts.api_key.clone();
        o.api_key_file = self.opts.api_key_file.clone();
        o.cors_origins = self.opts.cors_origins.clone();
        o.model = m.path.clone();
        self.opts = o;
        self.go(Screen::Hardware);
    }

    fn options_key(&mut self, k: KeyEvent) -> Vec<Action> {
        let n = FIELDS.len();
        match k.code {
            KeyCode::Up | KeyCode::Char('k') => self.field_idx = (self.field_idx + n - 1) % n,
            KeyCode::Down | KeyCode::Char('j') => self.field_idx = (self.field_idx + 1) % n,
            KeyCode::Left | KeyCode::Right | KeyCode::Char(' ') => {
                let f = FIELDS[self.field_idx];
                let forward = k.code != KeyCode::Left;
                match self.caps.as_ref() {
                    Ok(caps) if f.is_choice() => {
                        let mt = self.selected_model().map(|(_, s)| s.model_type.clone());
                        f.cycle(&mut self.opts, caps, mt.as_deref(), forward);
                        self.message = self.validation().err();
                    }
                    _ => self.message = Some(format!("{}: press Enter to type a value", f.label())),
                }
            }
            KeyCode::Enter => {
                let f = FIELDS[self.field_idx];
                if f.is_choice() {
                    self.message = Some(format!("{}: use Left/Right to choose", f.label()));
                } else {
                    self.editing = Some(f.text(&self.opts));
                }
            }
            KeyCode::Tab => match self.validation() {
                Ok(()) => self.go(Screen::Summary),
                Err(e) => self.message = Some(e),
            },
            KeyCode::Esc | KeyCode::BackTab => self.go(Screen::Hardware),
            _ => {}
        }
        Vec::new()
    }

    fn edit_key(&mut self, k: KeyEvent) -> Vec<Action> {
        let Some(buf) = self.editing.as_mut() else {
            return Vec::new();
        };
        match k.code {
            KeyCode::Char(c) => buf.push(c),
            KeyCode::Backspace => {
                buf.pop();
            }
            KeyCode::Esc => {
                self.editing = None;
                self.message = None;
            }
            KeyCode::Enter => {
                let text = self.editing.take().unwrap_or_default();
                if self.screen == Screen::Summary {
                    return self.save_profile(text);
                }
                let f = FIELDS[self.field_idx];
                match f.set_text(&mut self.opts, &text) {
                    Ok(()) => self.message = self.validation().err(),
                    Err(e) => {
                        self.message = Some(e);
                        self.editing = Some(text);
                    }
                }
            }
            _ => {}
        }
        Vec::new()
    }

    fn save_profile(&mut self, name: String) -> Vec<Action> {
        if let Err(e) = crate::profiles::check_name(&name) {
            self.message = Some(e.to_string());
            self.editing = Some(name);
            return Vec::new();
        }
        vec![Action::SaveProfile {
            name,
            options: self.opts.clone(),
        }]
    }

    fn summary_key(&mut self, k: KeyEvent) -> Vec<Action> {
        match k.code {
            KeyCode::Enter => match self.validation() {
                Ok(()) => {
                    self.run = RunState {
                        status: RunStatus::Starting,
                        launched: Some(self.opts.clone()),
                        ..RunState::default()
                    };
                    self.go(Screen::Run);
                    return vec![Action::Launch(self.opts.clone())];
                }
                Err(e) => self.message = Some(e),
            },
            KeyCode::Char('p') => {
                self.editing = Some(String::new());
                self.message = Some("profile name, then Enter (Esc cancels)".into());
            }
            KeyCode::Esc | KeyCode::BackTab | KeyCode::Left => self.go(Screen::Options),
            _ => {}
        }
        Vec::new()
    }

    fn run_key(&mut self, k: KeyEvent) -> Vec<Action> {
        match k.code {
            KeyCode::Char('s') if self.runtime_active() => {
                self.run.status = RunStatus::Stopping;
                vec![Action::Stop]
            }
            KeyCode::Char('r') => {
                let Some(o) = self.run.launched.clone() else {
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
            KeyCode::Esc | KeyCode::Char('b') if !self.runtime_active() => {
                self.go(Screen::Summary);
                Vec::new()
            }
            _ => Vec::new(),
        }
    }

    fn push_log(&mut self, l: String) {
        if self.run.log.len() == LOG_LINES {
            self.run.log.pop_front();
        }
        self.run.log.push_back(l);
    }

    fn runtime_event(&mut self, e: SupEvent) {
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
                self.run.status = RunStatus::Starting;
            }
            SupEvent::Exited {
                success,
                description,
            } => {
                self.run.status = RunStatus::Exited {
                    success,
                    description,
                };
            }
            SupEvent::Progress(p) => match p {
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
                    self.run.progress = Some((task, done, total, unit));
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
                }
                ProgressEvent::Log { level, message } => {
                    self.push_log(format!("{level}: {message}"))
                }
                ProgressEvent::Fatal { message } => {
                    self.push_log(format!("FATAL: {message}"));
                    self.run.fatal = Some(message);
                }
            },
        }
    }
}
