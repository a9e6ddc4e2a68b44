//! TUI state and how events change it. No terminal here: `App::update` takes
//! an [`Event`] and returns the [`Action`]s for the loop to carry out, which is
//! what the key-driven tests exercise. Keys become commands through the one
//! table in [`super::keys`].

mod live;
mod run;

pub use live::{HISTORY, Live, LogView, Progress, decoding_tok_s, prefilling_tok_s};

use super::event::{Action, Event};
use super::fields::{FIELDS, FieldCtx};
use super::keys::{self, Cmd};
use crate::estimate::{Estimate, estimate};
use crate::probe::{Hardware, ModelInfo, ModelSummary, Probe, models};
use crate::runtime::{PlanCache, RuntimeFacts};
use crate::validate::validate_with_model;
use crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers, MouseEventKind};
use krasis_common::{Capabilities, EngineStats, LaunchOptions};
use std::collections::VecDeque;
use std::time::Instant;

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
    /// Startup phases of the current runtime process, the last one current.
    pub phases: Vec<(String, String)>,
    pub progress: Option<Progress>,
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
    /// Sparkline histories and the request log, from the stats polls.
    pub live: Live,
    pub log_view: LogView,
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
            live: Live::default(),
            log_view: LogView::default(),
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
    /// The `?` overlay is open.
    pub help: bool,
    pub quit: bool,
    /// The runtime's model facts and plans; plans are remembered per
    /// (model, options) so drawing never spawns a process per frame.
    pub facts: std::sync::Arc<dyn RuntimeFacts>,
    pub plans: PlanCache,
}

impl App {
    pub fn new(probe: &dyn Probe, caps: Result<Capabilities, String>) -> Self {
        let models = probe.models();
        let facts = probe.facts();
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
            help: false,
            quit: false,
            facts,
            plans: PlanCache::default(),
        }
    }

    /// Asks the runtime again about every listed model (one `inspect`), so
    /// what changed on disk shows: a cache built by the last launch, a
    /// heatmap recorded since. Plans are kept: they do not depend on it.
    pub fn refresh_models(&mut self) {
        let found: Vec<models::FoundDir> = self
            .models
            .iter()
            .map(|m| models::FoundDir {
                path: m.path.clone(),
                name: m.name.clone(),
                root: m.root,
            })
            .collect();
        let cache_dir = self.opts.cache_dir.clone();
        self.models = models::with_facts(found, self.facts.as_ref(), cache_dir.as_deref());
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

    /// The runtime's plan for the chosen options (asked once per options).
    pub fn estimate(&self) -> Option<Estimate> {
        self.selected_model()?;
        let gpu = self
            .hardware
            .gpus
            .gpus()
            .iter()
            .find(|g| g.index == self.opts.gpu)
            .map(|g| (g.free_bytes, g.total_bytes));
        Some(estimate(
            self.facts.as_ref(),
            &self.plans,
            &self.opts,
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
        self.update_at(ev, Instant::now())
    }

    /// [`App::update`] with the event's arrival time (rates and ETAs are
    /// measured from arrival times; tests pass their own).
    pub fn update_at(&mut self, ev: Event, now: Instant) -> Vec<Action> {
        match ev {
            Event::Key(k) if k.kind != KeyEventKind::Release => self.key(k),
            Event::Key(_) | Event::Resize(..) => Vec::new(),
            Event::Mouse(m) => match m.kind {
                MouseEventKind::ScrollUp => self.key(KeyEvent::from(KeyCode::Up)),
                MouseEventKind::ScrollDown => self.key(KeyEvent::from(KeyCode::Down)),
                _ => Vec::new(),
            },
            Event::Runtime(e) => {
                self.runtime_event(e, now);
                Vec::new()
            }
            Event::Stats(s) => {
                self.stats(s);
                Vec::new()
            }
            Event::StopSignal | Event::TerminalLost => self.quit_actions(),
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

    /// The key tables that apply now, the current mode's first: what the
    /// footer shows and the overlay lists.
    pub fn key_tables(&self) -> Vec<&'static [keys::Binding]> {
        if self.help {
            vec![keys::HELP]
        } else if self.editing.is_some() {
            vec![keys::EDITING]
        } else {
            vec![keys::screen(self.screen), keys::GLOBAL]
        }
    }

    fn key(&mut self, k: KeyEvent) -> Vec<Action> {
        if k.modifiers.contains(KeyModifiers::CONTROL) && k.code == KeyCode::Char('c') {
            return self.quit_actions();
        }
        if self.help {
            if keys::lookup(keys::HELP, &k) == Some(Cmd::CloseHelp) {
                self.help = false;
            }
            return Vec::new();
        }
        if self.editing.is_some() {
            return self.edit_key(k);
        }
        match keys::command(self.screen, &k) {
            Some(cmd) => self.command(cmd),
            None => Vec::new(),
        }
    }

    fn command(&mut self, cmd: Cmd) -> Vec<Action> {
        match (self.screen, cmd) {
            (_, Cmd::Quit) => return self.quit_actions(),
            (_, Cmd::Help) => self.help = true,
            (_, Cmd::GoTo(s)) => self.goto(s),
            (Screen::Model, Cmd::Prev | Cmd::Next) => {
                let n = self.models.len().max(1);
                let step = if cmd == Cmd::Next { 1 } else { n - 1 };
                self.model_idx = (self.model_idx + step) % n;
            }
            (Screen::Model, Cmd::Forward) => self.choose_model(),
            (Screen::Hardware, Cmd::Forward) => self.goto(Screen::Options),
            (Screen::Hardware, Cmd::Back) => self.go(Screen::Model),
            (Screen::Options, _) => self.options_command(cmd),
            (Screen::Summary, Cmd::Launch) => return self.launch(),
            (Screen::Summary, Cmd::SaveProfile) => {
                self.editing = Some(String::new());
                self.message = Some("profile name, then Enter (Esc cancels)".into());
            }
            (Screen::Summary, Cmd::Back) => self.go(Screen::Options),
            (Screen::Run, _) => return self.run_command(cmd),
            _ => {}
        }
        Vec::new()
    }

    pub(super) fn go(&mut self, s: Screen) {
        if s == Screen::Model && self.screen != Screen::Model {
            self.refresh_models();
        }
        self.screen = s;
        self.message = None;
    }

    /// Why a tab cannot be shown yet, if it cannot: the flow's order, so a
    /// number key never lands on a screen with nothing valid to show.
    pub fn reachable(&self, s: Screen) -> Result<(), String> {
        match s {
            Screen::Model | Screen::Hardware => Ok(()),
            Screen::Options if self.opts.model.as_os_str().is_empty() => {
                Err("choose a model first: select one on 1 Model and press Enter".into())
            }
            Screen::Options => Ok(()),
            Screen::Summary => {
                self.reachable(Screen::Options)?;
                self.validation()
                    .map_err(|e| format!("the summary needs valid options: {e}"))
            }
            Screen::Run if self.run.launched.is_none() => {
                Err("nothing launched yet: press Enter on 4 Summary to launch".into())
            }
            Screen::Run => Ok(()),
        }
    }

    /// Goes to `s`, or says why not.
    fn goto(&mut self, s: Screen) {
        match self.reachable(s) {
            Ok(()) => self.go(s),
            Err(e) => self.message = Some(e),
        }
    }

    fn choose_model(&mut self) {
        // The facts shown from here on are today's: a cache may have been
        // built since the list was read.
        if let Some(m) = self.models.get(self.model_idx) {
            let fresh =
                models::inspect_one(self.facts.as_ref(), &m.path, self.opts.cache_dir.as_deref());
            self.models[self.model_idx].summary = fresh;
        }
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

    fn field_ctx(&self) -> Option<FieldCtx<'_>> {
        Some(FieldCtx {
            caps: self.caps.as_ref().ok()?,
            model_type: self.selected_model().map(|(_, s)| s.model_type.as_str()),
            gpus: self.hardware.gpus.gpus(),
        })
    }

    /// Why the selected field cannot be used, if it cannot.
    pub fn field_unavailable(&self, i: usize) -> Option<String> {
        FIELDS[i].unavailable(&self.opts, self.field_ctx()?)
    }

    fn options_command(&mut self, cmd: Cmd) {
        let n = FIELDS.len();
        let f = FIELDS[self.field_idx];
        match cmd {
            Cmd::Prev => self.field_idx = (self.field_idx + n - 1) % n,
            Cmd::Next => self.field_idx = (self.field_idx + 1) % n,
            Cmd::ChoicePrev | Cmd::ChoiceNext | Cmd::Edit => {
                if let Some(why) = self.field_unavailable(self.field_idx) {
                    self.message = Some(format!("{}: not available: {why}", f.label()));
                    return;
                }
                let choose = cmd != Cmd::Edit;
                match self.field_ctx() {
                    Some(cx) if choose && f.is_choice() => {
                        let mut o = self.opts.clone();
                        f.cycle(&mut o, cx, cmd == Cmd::ChoiceNext);
                        self.opts = o;
                        self.message = self.validation().err();
                    }
                    _ if choose => {
                        self.message = Some(format!("{}: press Enter to type a value", f.label()))
                    }
                    _ if f.is_choice() => {
                        self.message = Some(format!("{}: use Left/Right to choose", f.label()))
                    }
                    _ => self.editing = Some(f.text(&self.opts)),
                }
            }
            Cmd::Forward => self.goto(Screen::Summary),
            Cmd::Back => self.go(Screen::Hardware),
            _ => {}
        }
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

    fn launch(&mut self) -> Vec<Action> {
        if self.runtime_active() {
            self.message = Some("a runtime is already running: stop it on 5 Run (s) first".into());
            return Vec::new();
        }
        if let Err(e) = self.validation() {
            self.message = Some(e);
            return Vec::new();
        }
        self.run = RunState {
            status: RunStatus::Starting,
            launched: Some(self.opts.clone()),
            ..RunState::default()
        };
        self.go(Screen::Run);
        vec![Action::Launch(self.opts.clone())]
    }
}
