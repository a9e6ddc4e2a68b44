//! Screen snapshots (text in a TestBackend buffer) and key-driven state
//! transitions, with fake hardware, models and capabilities. The flow
//! through the screens is here; the run screen's dashboard, the keys and
//! the options a backend cannot use have their own modules.

mod dashboard;
mod facts;
mod h200;
mod options_gating;
mod tabs_and_help;

use super::app::{App, RunStatus, Screen};
use super::event::{Action, Event};
use super::fields::Field;
use super::screens;
use crate::probe::fake::FakeProbe;
use crate::runtime::tests::fake_caps;
use crate::supervisor::SupEvent;
use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use krasis_common::options::HeatmapChoice;
use krasis_common::status::{HcsStats, VramStats};
use krasis_common::{Backend, EngineStats, ProgressEvent};
use ratatui::Terminal;
use ratatui::backend::TestBackend;

/// Selects field `f` of the options form.
fn at(a: &mut App, f: Field) {
    a.field_idx = super::fields::FIELDS.iter().position(|x| *x == f).unwrap();
}

fn app(gpu: bool) -> App {
    App::new(&FakeProbe { gpu }, Ok(fake_caps(gpu)))
}

fn key(a: &mut App, code: KeyCode) -> Vec<Action> {
    a.update(Event::Key(KeyEvent::from(code)))
}

fn keys(a: &mut App, codes: &[KeyCode]) {
    for c in codes {
        key(a, *c);
    }
}

fn typed(a: &mut App, s: &str) {
    for c in s.chars() {
        key(a, KeyCode::Char(c));
    }
}

fn screen_text(a: &App, w: u16, h: u16) -> String {
    let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
    t.draw(|f| screens::draw(a, f)).unwrap();
    let buf = t.backend().buffer().clone();
    let mut s = String::new();
    for y in 0..buf.area.height {
        for x in 0..buf.area.width {
            s.push_str(buf[(x, y)].symbol());
        }
        s.push('\n');
    }
    s
}

/// Model chosen, defaults taken, launched: the run screen, starting.
fn launched(gpu: bool) -> App {
    let mut a = app(gpu);
    keys(
        &mut a,
        &[KeyCode::Enter, KeyCode::Enter, KeyCode::Tab, KeyCode::Enter],
    );
    assert_eq!(a.screen, Screen::Run);
    a
}

fn progress(a: &mut App, e: ProgressEvent) {
    a.update(Event::Runtime(SupEvent::Progress(e)));
}

fn ready(a: &mut App) {
    progress(
        a,
        ProgressEvent::Ready {
            url: "http://127.0.0.1:8080".into(),
            model: "m".into(),
        },
    );
}

#[test]
fn model_screen_lists_models_and_explains_unusable_ones() {
    let mut a = app(true);
    let s = screen_text(&a, 100, 30);
    assert!(s.contains("Qwen/Qwen3-30B-A3B"), "{s}");
    assert!(s.contains("qwen3_moe"));
    assert!(s.contains("llama-3  [unusable]"));
    assert!(s.contains("not built yet"));
    key(&mut a, KeyCode::Down);
    key(&mut a, KeyCode::Enter);
    assert_eq!(a.screen, Screen::Model);
    let s = screen_text(&a, 100, 30);
    assert!(s.contains("not supported"), "{s}");
}

#[test]
fn hardware_screen_with_and_without_gpu() {
    let mut a = app(true);
    key(&mut a, KeyCode::Enter);
    assert_eq!(a.screen, Screen::Hardware);
    let s = screen_text(&a, 110, 20);
    assert!(s.contains("Fake RTX 4090"), "{s}");
    assert!(s.contains("compute 8.9"));
    assert!(s.contains("gen4 x16"));
    assert!(s.contains("backend cuda: available"));
    let mut a = app(false);
    key(&mut a, KeyCode::Enter);
    let s = screen_text(&a, 110, 20);
    assert!(
        s.contains("GPU: none usable: no NVIDIA driver found"),
        "{s}"
    );
    assert!(s.contains("backend cuda: unavailable"));
}

#[test]
fn defaults_follow_capabilities() {
    let mut a = app(false);
    key(&mut a, KeyCode::Enter);
    assert_eq!(a.opts.backend, Backend::Reference);
    assert!(!a.opts.hcs);
    let mut a = app(true);
    key(&mut a, KeyCode::Enter);
    assert_eq!(a.opts.backend, Backend::Cuda);
    assert!(a.opts.hcs);
    assert_eq!(
        a.opts.model,
        std::path::PathBuf::from("/models/Qwen3-30B-A3B")
    );
}

#[test]
fn options_offer_only_what_the_runtime_implements() {
    let mut a = app(false);
    keys(&mut a, &[KeyCode::Enter, KeyCode::Enter]);
    assert_eq!(a.screen, Screen::Options);
    // Backend: only reference is available without a GPU.
    key(&mut a, KeyCode::Right);
    assert_eq!(a.opts.backend, Backend::Reference);
    // KV format: bf16 only.
    at(&mut a, Field::KvFormat);
    key(&mut a, KeyCode::Right);
    assert_eq!(a.opts.kv_format, "bf16");
    // HCS is offered by the architecture but refused for the reference
    // backend: the field does not change and says why.
    at(&mut a, Field::Hcs);
    key(&mut a, KeyCode::Right);
    assert!(!a.opts.hcs);
    assert!(
        a.message.as_deref().unwrap().contains("cuda backend"),
        "{:?}",
        a.message
    );
    // Invalid options (here a context beyond the model's) do not reach the
    // summary.
    at(&mut a, Field::ContextLength);
    key(&mut a, KeyCode::Enter);
    typed(&mut a, "999999");
    key(&mut a, KeyCode::Enter);
    key(&mut a, KeyCode::Tab);
    assert_eq!(
        a.screen,
        Screen::Options,
        "invalid options must not reach the summary"
    );
    assert!(
        a.message
            .as_deref()
            .unwrap()
            .contains("max_position_embeddings")
    );
    key(&mut a, KeyCode::Enter);
    for _ in 0..6 {
        key(&mut a, KeyCode::Backspace);
    }
    key(&mut a, KeyCode::Enter);
    assert_eq!(a.message, None);
    let s = screen_text(&a, 100, 24);
    assert!(s.contains("KV cache format") && s.contains("bf16"), "{s}");
    assert!(s.contains("off (exact)"));
}

#[test]
fn typed_fields_parse_and_report_errors() {
    let mut a = app(true);
    keys(&mut a, &[KeyCode::Enter, KeyCode::Enter]);
    at(&mut a, Field::ContextLength);
    key(&mut a, KeyCode::Enter);
    typed(&mut a, "32768");
    key(&mut a, KeyCode::Enter);
    assert_eq!(a.opts.context_length, Some(32768));
    at(&mut a, Field::VramLimit);
    key(&mut a, KeyCode::Enter);
    typed(&mut a, "20GiB");
    key(&mut a, KeyCode::Enter);
    assert_eq!(a.opts.vram_limit_bytes, Some(20 << 30));
    at(&mut a, Field::Port);
    key(&mut a, KeyCode::Enter);
    key(&mut a, KeyCode::Backspace);
    typed(&mut a, "x");
    key(&mut a, KeyCode::Enter);
    assert!(a.editing.is_some(), "a bad value stays in the editor");
    assert!(a.message.as_deref().unwrap().contains("not a whole number"));
    key(&mut a, KeyCode::Esc);
    assert_eq!(a.opts.port, 8080);
    at(&mut a, Field::Heatmap);
    key(&mut a, KeyCode::Enter);
    for _ in 0..4 {
        key(&mut a, KeyCode::Backspace);
    }
    typed(&mut a, "off");
    key(&mut a, KeyCode::Enter);
    assert_eq!(a.opts.heatmap, HeatmapChoice::Off);
    // Context beyond the model's maximum is caught by the shared validation.
    at(&mut a, Field::ContextLength);
    key(&mut a, KeyCode::Enter);
    typed(&mut a, "0");
    key(&mut a, KeyCode::Enter);
    assert!(
        a.message
            .as_deref()
            .unwrap()
            .contains("max_position_embeddings")
    );
}

#[test]
fn summary_shows_estimate_and_launches() {
    let mut a = app(true);
    keys(&mut a, &[KeyCode::Enter, KeyCode::Enter, KeyCode::Tab]);
    assert_eq!(a.screen, Screen::Summary);
    // 38 rows: the form's 23 fields, the model's lines and the estimate.
    let s = screen_text(&a, 160, 38);
    assert!(s.contains("host RAM for the INT4 expert cache"), "{s}");
    assert!(s.contains("HCS:") && s.contains("coverage"), "{s}");
    assert!(s.contains("Valid. Press Enter to launch."), "{s}");
    // Too short for the options too: they give way to the estimate.
    assert!(s.contains("23 options: the Options tab lists them"), "{s}");
    let tall = screen_text(&a, 160, 48);
    assert!(
        tall.contains("Parallel requests") && tall.contains("Valid."),
        "{tall}"
    );
    assert!(!tall.contains("the Options tab lists them"), "{tall}");
    let acts = key(&mut a, KeyCode::Enter);
    assert_eq!(acts, vec![Action::Launch(a.opts.clone())]);
    assert_eq!(a.screen, Screen::Run);
    assert_eq!(a.run.status, RunStatus::Starting);
}

#[test]
fn summary_warns_when_it_will_not_fit() {
    let mut a = app(true);
    keys(&mut a, &[KeyCode::Enter, KeyCode::Enter]);
    at(&mut a, Field::VramLimit);
    key(&mut a, KeyCode::Enter);
    typed(&mut a, "1GiB");
    key(&mut a, KeyCode::Enter);
    key(&mut a, KeyCode::Tab);
    let s = screen_text(&a, 200, 36);
    assert!(s.contains("WARNING: will not fit"), "{s}");
}

#[test]
fn run_screen_follows_the_runtime_and_offers_restart() {
    let mut a = app(true);
    keys(
        &mut a,
        &[KeyCode::Enter, KeyCode::Enter, KeyCode::Tab, KeyCode::Enter],
    );
    let ev = |e| Event::Runtime(SupEvent::Progress(e));
    a.update(ev(ProgressEvent::Phase {
        phase: "building_cache".into(),
        detail: "quantizing experts".into(),
    }));
    a.update(ev(ProgressEvent::Progress {
        task: "experts".into(),
        done: 3072,
        total: 6144,
        unit: "experts".into(),
    }));
    a.update(Event::Runtime(SupEvent::Log("INFO loaded shard 1".into())));
    let s = screen_text(&a, 120, 30);
    assert!(
        s.contains("phase: building_cache: quantizing experts"),
        "{s}"
    );
    assert!(s.contains("experts: 3072/6144"), "{s}");
    assert!(s.contains("INFO loaded shard 1"));
    a.update(ev(ProgressEvent::HcsDecision {
        resident_experts: 2000,
        total_experts: 6144,
        bytes: 5 << 30,
        safety_margin_bytes: 600 << 20,
    }));
    a.update(ev(ProgressEvent::Ready {
        url: "http://127.0.0.1:8080".into(),
        model: "m".into(),
    }));
    a.update(Event::Stats(Ok(EngineStats {
        last_prefill_tok_s: 812.5,
        last_decode_tok_s: 21.25,
        hcs: Some(HcsStats {
            hit_rate: 0.625,
            resident_experts: 2000,
            total_experts: 6144,
            ..Default::default()
        }),
        vram: Some(VramStats {
            total_bytes: 24 << 30,
            free_bytes: 1 << 30,
            ..Default::default()
        }),
        ..Default::default()
    })));
    let s = screen_text(&a, 120, 30);
    assert!(s.contains("READY at http://127.0.0.1:8080"), "{s}");
    assert!(s.contains("HCS: 2000/6144 experts resident"));
    assert!(s.contains("prefill   812.5 tok/s"), "{s}");
    assert!(s.contains("decode     21.2 tok/s"), "{s}");
    assert!(s.contains("hit 62.5%"), "{s}");
    assert!(s.contains("23.0 GiB / 24.0 GiB GPU"), "{s}");
    // The runtime dies: the launcher stays, shows why, offers restart.
    a.update(Event::Runtime(SupEvent::Exited {
        success: false,
        description: "exited with code 101".into(),
    }));
    let s = screen_text(&a, 120, 30);
    assert!(s.contains("runtime FAILED: exited with code 101"), "{s}");
    assert!(!a.quit);
    let acts = key(&mut a, KeyCode::Char('r'));
    assert!(matches!(acts.as_slice(), [Action::Launch(_)]));
    assert_eq!(a.run.status, RunStatus::Starting);
    assert!(a.run.log.is_empty());
    // While running, r restarts and s stops.
    assert!(matches!(
        key(&mut a, KeyCode::Char('r')).as_slice(),
        [Action::Restart(_)]
    ));
    assert_eq!(key(&mut a, KeyCode::Char('s')), vec![Action::Stop]);
}

#[test]
fn quit_stops_a_running_runtime_first() {
    let mut a = app(true);
    keys(
        &mut a,
        &[KeyCode::Enter, KeyCode::Enter, KeyCode::Tab, KeyCode::Enter],
    );
    let acts = a.update(Event::Key(KeyEvent::new(
        KeyCode::Char('c'),
        KeyModifiers::CONTROL,
    )));
    assert_eq!(acts, vec![Action::Stop, Action::Quit]);
    assert!(a.quit);
    let mut a = app(true);
    assert_eq!(a.update(Event::StopSignal), vec![Action::Quit]);
}

#[test]
fn save_profile_from_summary() {
    let mut a = app(true);
    keys(
        &mut a,
        &[
            KeyCode::Enter,
            KeyCode::Enter,
            KeyCode::Tab,
            KeyCode::Char('p'),
        ],
    );
    typed(&mut a, "../evil");
    assert!(key(&mut a, KeyCode::Enter).is_empty());
    assert!(
        a.message
            .as_deref()
            .unwrap()
            .contains("not a valid profile name")
    );
    key(&mut a, KeyCode::Esc);
    key(&mut a, KeyCode::Char('p'));
    typed(&mut a, "mine");
    let acts = key(&mut a, KeyCode::Enter);
    assert!(matches!(acts.as_slice(), [Action::SaveProfile { name, .. }] if name == "mine"));
}

#[test]
fn every_screen_draws_at_tiny_and_large_sizes() {
    let mut a = app(true);
    for s in [
        Screen::Model,
        Screen::Hardware,
        Screen::Options,
        Screen::Summary,
        Screen::Run,
    ] {
        a.screen = s;
        for (w, h) in [(20, 6), (80, 24), (250, 70)] {
            screen_text(&a, w, h);
        }
    }
    let mut none = App::new(
        &FakeProbe { gpu: false },
        Err("krasis-runtime was not found".into()),
    );
    none.models.clear();
    let s = screen_text(&none, 100, 20);
    assert!(s.contains("No models found"), "{s}");
    key(&mut none, KeyCode::Enter);
    assert!(none.message.is_some());
}

#[test]
fn run_screen_shows_a_crash_restart_and_its_history() {
    use crate::supervisor::Restart;
    use std::time::Duration;
    let mut a = app(true);
    keys(
        &mut a,
        &[KeyCode::Enter, KeyCode::Enter, KeyCode::Tab, KeyCode::Enter],
    );
    let ready = || {
        Event::Runtime(SupEvent::Progress(ProgressEvent::Ready {
            url: "http://127.0.0.1:8080".into(),
            model: "m".into(),
        }))
    };
    a.update(ready());
    a.update(Event::Runtime(SupEvent::Restarting(Restart {
        reason: "engine fault, exit 70".into(),
        delay: Duration::from_secs(2),
        attempt: 2,
        max: 3,
    })));
    let s = screen_text(&a, 160, 30);
    assert!(
        s.contains("runtime crashed (engine fault, exit 70); restarting in 2 s (attempt 2 of 3)"),
        "{s}"
    );
    assert!(a.runtime_active(), "s stops and q quits through Stop");
    assert_eq!(key(&mut a, KeyCode::Char('s')), vec![Action::Stop]);

    a.update(Event::Runtime(SupEvent::Restarted { pid: 4242 }));
    assert_eq!(a.run.status, RunStatus::Starting);
    a.update(ready());
    let s = screen_text(&a, 160, 30);
    assert!(s.contains("READY at http://127.0.0.1:8080"), "{s}");
    // Back up, but the crash stays visible.
    assert!(
        s.contains("restarted after a crash 1 time; last: runtime crashed (engine fault"),
        "{s}"
    );
    assert!(s.contains("runtime restarted (pid 4242)"), "{s}");

    // Retries exhausted: a final failure.
    a.update(Event::Runtime(SupEvent::Exited {
        success: false,
        description:
            "crashed (engine fault, exit 70) again after 3 restarts within 10 min; gave up".into(),
    }));
    let s = screen_text(&a, 200, 30);
    assert!(s.contains("runtime FAILED: crashed (engine fault, exit 70) again after 3 restarts within 10 min; gave up"), "{s}");
    assert!(!a.runtime_active());
}
