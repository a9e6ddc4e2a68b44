//! The model facts the screens show come from the runtime (`inspect`,
//! `plan`) and say what the engine will really do: the expert precision of
//! the chosen backend, parameters with a unit, the cache as it is now.

use super::*;
use crate::probe::fake::{A3B_STRIDE, FakeFacts};
use krasis_common::inspect::CacheState;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// Model chosen with the defaults, on the summary screen.
fn at_summary(gpu: bool) -> App {
    let mut a = app(gpu);
    keys(&mut a, &[KeyCode::Enter, KeyCode::Enter, KeyCode::Tab]);
    assert_eq!(a.screen, Screen::Summary, "{:?}", a.message);
    a
}

#[test]
fn summary_shows_the_precision_the_chosen_backends_engine_uses() {
    let a = at_summary(true);
    let s = screen_text(&a, 160, 40);
    assert!(
        s.contains("experts as the cuda engine runs them: int4 (INT4 expert cache)"),
        "{s}"
    );
    // Without a GPU the reference engine is chosen, which reads the
    // checkpoint's BF16 experts (what its load logs), not the INT4 cache.
    let a = at_summary(false);
    assert_eq!(a.opts.backend, Backend::Reference);
    let s = screen_text(&a, 160, 40);
    assert!(
        s.contains("experts as the reference engine runs them: bf16 (checkpoint)"),
        "{s}"
    );
    assert!(!s.contains("int4 (INT4"), "{s}");
}

#[test]
fn parameters_are_shown_with_a_unit() {
    let a = app(true);
    let s = screen_text(&a, 120, 30);
    assert!(s.contains("qwen3_moe  30.5B params"), "{s}");
    assert!(s.contains("3.4B active per token"), "{s}");
    let a = at_summary(true);
    let s = screen_text(&a, 160, 40);
    assert!(s.contains("30.5B parameters, 3.4B active per token"), "{s}");
    assert!(!s.contains("0.0B"), "{s}");
    // A small model (the demo has 1.5M parameters) is not `0.0B`.
    let mut a = app(true);
    if let Ok(m) = a.models[0].summary.as_mut() {
        m.total_params = 1_548_800;
        m.active_params = 577_600;
    }
    let s = screen_text(&a, 120, 30);
    assert!(s.contains("qwen3_moe  1.5M params"), "{s}");
    assert!(s.contains("577.6K active per token"), "{s}");
    assert!(!s.contains("0.0B"), "{s}");
}

fn built() -> CacheState {
    CacheState::Valid {
        path: "/cache/experts/x/experts-int4-v1.kcache".into(),
        bytes: A3B_STRIDE * 48 * 128,
    }
}

#[test]
fn the_cache_state_is_re_read_when_the_runtime_becomes_ready() {
    let facts = Arc::new(FakeFacts::default());
    let mut a = app(true);
    a.facts = facts.clone();
    let s = screen_text(&a, 120, 30);
    assert!(s.contains("not built yet (built on first launch)"), "{s}");
    keys(
        &mut a,
        &[KeyCode::Enter, KeyCode::Enter, KeyCode::Tab, KeyCode::Enter],
    );
    assert_eq!(a.screen, Screen::Run);
    // Loading builds the cache, then the runtime says it is ready.
    *facts.cache.lock().unwrap() = built();
    a.update(Event::Runtime(SupEvent::Progress(ProgressEvent::Ready {
        url: "http://127.0.0.1:8080".into(),
        model: "a3b".into(),
    })));
    a.screen = Screen::Model;
    let s = screen_text(&a, 120, 30);
    assert!(s.contains("expert cache: built (13.9 GiB)"), "{s}");
    assert!(!s.contains("built on first launch"), "{s}");
}

#[test]
fn returning_to_the_model_screen_re_reads_the_facts() {
    let facts = Arc::new(FakeFacts::default());
    let mut a = app(true);
    a.facts = facts.clone();
    key(&mut a, KeyCode::Enter);
    assert_eq!(a.screen, Screen::Hardware);
    // Built meanwhile (`krasis build-cache` in another terminal).
    *facts.cache.lock().unwrap() = built();
    key(&mut a, KeyCode::Esc);
    assert_eq!(a.screen, Screen::Model);
    let s = screen_text(&a, 120, 30);
    assert!(s.contains("expert cache: built (13.9 GiB)"), "{s}");
    // The summary shows it too.
    keys(&mut a, &[KeyCode::Enter, KeyCode::Enter, KeyCode::Tab]);
    let s = screen_text(&a, 160, 40);
    assert!(s.contains("expert cache: built"), "{s}");
}

#[test]
fn the_summary_asks_the_runtime_for_a_plan_once_per_options() {
    let facts = Arc::new(FakeFacts::default());
    let mut a = app(true);
    a.facts = facts.clone();
    keys(&mut a, &[KeyCode::Enter, KeyCode::Enter, KeyCode::Tab]);
    for _ in 0..5 {
        let s = screen_text(&a, 160, 40);
        assert!(s.contains("coverage"), "{s}");
    }
    assert_eq!(facts.plans.load(Ordering::SeqCst), 1);
}

#[test]
fn hardware_screen_says_what_each_backend_needs_of_this_machine() {
    let mut a = app(true);
    key(&mut a, KeyCode::Enter);
    let s = screen_text(&a, 120, 30);
    assert!(
        s.contains("cuda backend: experts int4 (INT4 expert cache), 13.9 GiB in host RAM"),
        "{s}"
    );
    assert!(
        s.contains("reference backend: experts bf16 (checkpoint), 54.0 GiB mapped"),
        "{s}"
    );
}
