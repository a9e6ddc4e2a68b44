//! The run screen as a live dashboard: engine state, rates with their
//! sparklines, memory gauges, the request log, load progress with rate and
//! ETA, startup text that does not outlive startup, and the log pane.

use super::*;
use krasis_common::{Activity, LiveRequest, RequestRecord};
use std::time::{Duration, Instant};

fn record(id: u64, reason: &str) -> RequestRecord {
    RequestRecord {
        id,
        finished_unix_ms: 1_760_000_000_000 + id * 1000,
        endpoint: "/v1/chat/completions".into(),
        client: Some(format!("127.0.0.1:5123{id}")),
        prompt_tokens: 100 + id,
        cached_tokens: 0,
        completion_tokens: 64,
        ttft_ms: Some(412.0),
        prefill_tok_s: 812.5,
        decode_tok_s: 21.25,
        finish_reason: reason.into(),
    }
}

/// A GPU engine decoding request #7, as `/v1/stats` reports it.
pub(super) fn decoding(generated: u64, decode_tok_s: f64) -> EngineStats {
    EngineStats {
        activity: Activity::Decoding,
        running: vec![LiveRequest {
            id: 7,
            activity: Activity::Decoding,
            endpoint: "/v1/chat/completions".into(),
            client: Some("127.0.0.1:51234".into()),
            prompt_tokens: 4096,
            prefilled_tokens: 4096,
            generated_tokens: generated,
            max_tokens: 512,
            elapsed_ms: 12_300.0,
            ttft_ms: Some(380.0),
            prefill_tok_s: 1650.0,
            decode_tok_s,
        }],
        active_sequences: 1,
        queue_len: 2,
        last_ttft_ms: Some(412.0),
        recent_requests: vec![record(5, "stop"), record(6, "length")],
        pinned_host_bytes: Some(17_800 << 20),
        requests_completed: 6,
        requests_cancelled: 1,
        requests_rejected: 0,
        last_prefill_tok_s: 812.5,
        last_decode_tok_s: 21.25,
        hcs: Some(HcsStats {
            resident_experts: 2000,
            total_experts: 6144,
            hit_rate: 0.625,
            cold_experts_per_token: 5.0,
            cold_bytes_per_token: 12.0 * 1048576.0,
            ..Default::default()
        }),
        vram: Some(VramStats {
            total_bytes: 24 << 30,
            limit_bytes: Some(22 << 30),
            // Free within the 22 GiB limit, as the engine reports it.
            free_bytes: 4 << 30,
            min_free_bytes: 3 << 30,
            margin_bytes: 600 << 20,
        }),
        ..Default::default()
    }
}

fn serving(gpu: bool) -> App {
    let mut a = launched(gpu);
    ready(&mut a);
    a
}

#[test]
fn decoding_request_shows_state_rates_memory_and_hcs() {
    let mut a = serving(true);
    for i in 0..30 {
        a.update(Event::Stats(Ok(decoding(100 + i, 15.0 + i as f64))));
    }
    let s = screen_text(&a, 120, 40);
    for want in [
        "decoding 129 tokens (max 512)",
        "#7 127.0.0.1:51234",
        "prefill  1650.0 tok/s",
        "decode     44.0 tok/s",
        "TTFT last 412 ms  now 380 ms  elapsed 12.3 s",
        "queue 2  active 1  done 6  cancelled 1  rejected 0",
        "18.0 GiB / 22.0 GiB limit",
        "margin 600.0 MiB  free 4.0 GiB  min free 3.0 GiB",
        "32.6% of experts resident (2000/6144)",
        "hit 62.5%  cold 5.0 experts (12.0 MiB)/step",
        "pinned host RAM 17.4 GiB",
    ] {
        assert!(s.contains(want), "missing {want:?}\n{s}");
    }
    // The VRAM gauge: in use, free, and the margin at the limit's end.
    let vram = s.lines().find(|l| l.contains("VRAM █")).expect(&s);
    assert!(vram.contains("█░") && vram.contains("░▒"), "{vram}");
    // The decode sparkline rises over the polls; prefill was idle.
    let decode = s.lines().find(|l| l.contains("decode     44.0")).unwrap();
    assert!(decode.contains("▂▂▃") && decode.contains("▇█"), "{decode}");
}

#[test]
fn prefilling_request_shows_how_far_the_prompt_is() {
    let mut a = serving(true);
    let mut st = decoding(0, 0.0);
    st.activity = Activity::Prefilling;
    let c = &mut st.running[0];
    c.activity = Activity::Prefilling;
    c.prefilled_tokens = 1024;
    c.ttft_ms = None;
    a.update(Event::Stats(Ok(st)));
    let s = screen_text(&a, 120, 40);
    assert!(
        s.contains("prefilling 1024 of 4096 prompt tokens (25%)"),
        "{s}"
    );
    // Idle again: no running request is described.
    a.update(Event::Stats(Ok(EngineStats::default())));
    let s = screen_text(&a, 120, 40);
    assert!(s.contains("idle") && !s.contains("prefilling"), "{s}");
}

/// Several requests decoding together (continuous batching): each one's
/// progress, the load against `parallel` with the KV in use, and the
/// decode rate of all of them together.
#[test]
fn several_running_requests_are_listed_with_the_load() {
    let mut a = serving(true);
    let mut st = decoding(40, 20.0);
    let mut second = st.running[0].clone();
    (second.id, second.generated_tokens, second.decode_tok_s) = (8, 3, 10.0);
    let mut third = st.running[0].clone();
    third.id = 9;
    third.activity = Activity::Prefilling;
    (
        third.prefilled_tokens,
        third.generated_tokens,
        third.ttft_ms,
    ) = (512, 0, None);
    (third.prefill_tok_s, third.decode_tok_s) = (900.0, 0.0);
    st.running.extend([second, third]);
    st.activity = Activity::Prefilling;
    (st.active_sequences, st.parallel) = (3, 4);
    st.kv = Some(krasis_common::KvStats {
        used_tokens: 13_824,
        total_tokens: 65_536,
    });
    a.update(Event::Stats(Ok(st)));
    let s = screen_text(&a, 200, 40);
    for want in [
        "prefilling 3 requests  #7 40/512 tok  #8 3/512 tok  #9 prefill 512/4096",
        "queue 2  active 3/4  KV 13824/65536 tok",
        "prefill   900.0 tok/s",
        "decode     30.0 tok/s",
    ] {
        assert!(s.contains(want), "missing {want:?}\n{s}");
    }
    let l = &a.run.live;
    assert_eq!(
        (l.prefill_tok_s.back(), l.decode_tok_s.back()),
        (Some(&900.0), Some(&30.0))
    );
}

#[test]
fn sparklines_keep_a_history_of_polls() {
    let mut a = serving(true);
    let mut st = decoding(10, 20.0);
    st.activity = Activity::Prefilling;
    st.running[0].activity = Activity::Prefilling;
    a.update(Event::Stats(Ok(st)));
    a.update(Event::Stats(Ok(decoding(11, 20.0))));
    a.update(Event::Stats(Ok(EngineStats::default())));
    let l = &a.run.live;
    assert_eq!(Vec::from(l.prefill_tok_s.clone()), vec![1650.0, 0.0, 0.0]);
    assert_eq!(Vec::from(l.decode_tok_s.clone()), vec![0.0, 20.0, 0.0]);
    for _ in 0..1000 {
        a.update(Event::Stats(Ok(EngineStats::default())));
    }
    assert_eq!(a.run.live.decode_tok_s.len(), crate::tui::app::HISTORY);
}

#[test]
fn request_log_appends_each_request_once_across_polls_and_restarts() {
    use crate::supervisor::Restart;
    let mut a = serving(true);
    let mut st = decoding(1, 20.0);
    for _ in 0..3 {
        a.update(Event::Stats(Ok(st.clone())));
    }
    st.recent_requests.push(record(7, "cancelled"));
    a.update(Event::Stats(Ok(st)));
    let ids: Vec<u64> = a.run.live.requests.iter().map(|r| r.id).collect();
    assert_eq!(ids, vec![5, 6, 7]);
    let s = screen_text(&a, 120, 40);
    assert!(s.contains("Requests (3)"), "{s}");
    let row = s.lines().find(|l| l.contains("127.0.0.1:51237")).expect(&s);
    for col in [
        "chat/completions",
        "107",
        "64",
        "412 ms",
        "812.5",
        "21.2",
        "cancelled",
    ] {
        assert!(row.contains(col), "{col} missing from {row}");
    }
    // A crashed and restarted runtime numbers its requests from 1 again;
    // they are new requests, and the old ones stay in the log.
    a.update(Event::Runtime(SupEvent::Restarting(Restart {
        reason: "engine fault, exit 70".into(),
        delay: Duration::from_secs(1),
        attempt: 1,
        max: 3,
    })));
    a.update(Event::Runtime(SupEvent::Restarted { pid: 2 }));
    ready(&mut a);
    let fresh = EngineStats {
        recent_requests: vec![record(1, "stop")],
        ..Default::default()
    };
    a.update(Event::Stats(Ok(fresh.clone())));
    a.update(Event::Stats(Ok(fresh)));
    let ids: Vec<u64> = a.run.live.requests.iter().map(|r| r.id).collect();
    assert_eq!(ids, vec![5, 6, 7, 1]);
}

#[test]
fn stats_after_the_runtime_stopped_are_not_shown() {
    let mut a = serving(true);
    a.update(Event::Runtime(SupEvent::Exited {
        success: false,
        description: "exited with code 1".into(),
    }));
    a.update(Event::Stats(Ok(decoding(5, 20.0))));
    assert_eq!(a.run.stats, None);
    assert!(a.run.live.decode_tok_s.is_empty());
}

#[test]
fn dashboard_degrades_at_80x24_and_keeps_the_essentials() {
    let mut a = serving(true);
    let mut st = decoding(129, 44.0);
    st.recent_requests = (1..=9).map(|i| record(i, "stop")).collect();
    a.update(Event::Stats(Ok(st)));
    a.update(Event::Runtime(SupEvent::Log(
        "INFO request 7 started".into(),
    )));
    let s = screen_text(&a, 80, 24);
    for want in [
        "READY at http://127.0.0.1:8080",
        "decoding 129 tokens (max 512)",
        "prefill  1650.0 tok/s",
        "decode     44.0 tok/s",
        "TTFT last 412 ms",
        "queue 2  active 1",
        "18.0 GiB / 22.0 GiB limit, margin 600.0 MiB",
        "HCS 32.6% resident  hit 62.5%",
        "pinned host RAM 17.4 GiB",
        "Requests (9)",
        "INFO request 7 started",
        "? help",
    ] {
        assert!(s.contains(want), "missing {want:?} at 80x24\n{s}");
    }
    // The newest request is the one shown when only one fits.
    assert!(s.contains("127.0.0.1:51239"), "{s}");
    // 120x40 uses the room: two columns and several request rows.
    let s = screen_text(&a, 120, 40);
    assert!(s.contains("Engine") && s.contains("Memory"), "{s}");
    assert!(
        s.contains("127.0.0.1:51235") && s.contains("127.0.0.1:51239"),
        "{s}"
    );
}

#[test]
fn cpu_engine_shows_no_vram_and_hcs_off() {
    let mut a = serving(false);
    a.update(Event::Stats(Ok(EngineStats {
        last_decode_tok_s: 2.5,
        ..Default::default()
    })));
    let s = screen_text(&a, 120, 40);
    assert!(
        s.contains("VRAM: none in use (the engine runs on the CPU)"),
        "{s}"
    );
    assert!(
        s.contains("HCS: off") && s.contains("pinned host RAM none"),
        "{s}"
    );
    assert_eq!(s.matches("HCS: off").count(), 1, "said once\n{s}");
    assert!(s.contains("decode      2.5 tok/s"), "{s}");
}

#[test]
fn load_progress_has_bytes_rate_and_eta_from_arrival_times() {
    let mut a = launched(true);
    let t0 = Instant::now();
    let ev = |done: u64| {
        Event::Runtime(SupEvent::Progress(ProgressEvent::Progress {
            task: "expert cache".into(),
            done,
            total: 4 << 30,
            unit: "bytes".into(),
        }))
    };
    a.update_at(ev(0), t0);
    let s = screen_text(&a, 120, 40);
    assert!(
        s.contains("expert cache: 0 B / 4.0 GiB (0%)  measuring rate ..."),
        "{s}"
    );
    a.update_at(ev(1 << 30), t0 + Duration::from_secs(2));
    let s = screen_text(&a, 120, 40);
    assert!(
        s.contains("expert cache: 1.0 GiB / 4.0 GiB (25%)  512.0 MiB/s  ETA 6.0 s"),
        "{s}"
    );
    // The rate follows the recent events: 1 GiB in the last second.
    a.update_at(ev(2 << 30), t0 + Duration::from_secs(8));
    a.update_at(ev(3 << 30), t0 + Duration::from_secs(9));
    let s = screen_text(&a, 120, 40);
    assert!(s.contains("(75%)  1.0 GiB/s  ETA 1.0 s"), "{s}");
    // A new phase ends the bar.
    progress(
        &mut a,
        ProgressEvent::Phase {
            phase: "calibrating".into(),
            detail: "measuring".into(),
        },
    );
    assert!(!screen_text(&a, 120, 40).contains("expert cache:"));
}

#[test]
fn startup_phase_does_not_linger_once_ready_or_after_a_crash() {
    use crate::supervisor::Restart;
    let mut a = launched(true);
    let phase = |a: &mut App, p: &str| {
        progress(
            a,
            ProgressEvent::Phase {
                phase: p.into(),
                detail: format!("{p} ..."),
            },
        )
    };
    phase(&mut a, "loading");
    phase(&mut a, "calibrating");
    let s = screen_text(&a, 120, 40);
    assert!(s.contains("phase: calibrating: calibrating ..."), "{s}");
    assert!(s.contains("done: loading"), "{s}");
    ready(&mut a);
    let s = screen_text(&a, 120, 40);
    assert!(s.contains("READY at"), "{s}");
    assert!(!s.contains("phase:") && !s.contains("done: loading"), "{s}");
    // A crash: the restart is what is shown, not the old phase.
    a.update(Event::Runtime(SupEvent::Restarting(Restart {
        reason: "engine fault, exit 70".into(),
        delay: Duration::from_secs(1),
        attempt: 1,
        max: 3,
    })));
    let s = screen_text(&a, 120, 40);
    assert!(
        s.contains("restarting in 1 s") && !s.contains("phase:"),
        "{s}"
    );
    a.update(Event::Runtime(SupEvent::Restarted { pid: 9 }));
    phase(&mut a, "loading");
    let s = screen_text(&a, 120, 40);
    assert!(
        s.contains("phase: loading: loading ...") && !s.contains("done:"),
        "{s}"
    );
    // A start that fails says in which phase.
    a.update(Event::Runtime(SupEvent::Exited {
        success: false,
        description: "exited with code 1".into(),
    }));
    let s = screen_text(&a, 120, 40);
    assert!(!s.contains("phase: loading"), "{s}");
    let mut b = launched(true);
    phase(&mut b, "loading");
    b.update(Event::Runtime(SupEvent::Exited {
        success: false,
        description: "exited with code 1".into(),
    }));
    let s = screen_text(&b, 120, 40);
    assert!(
        s.contains("failed during startup phase loading: loading ..."),
        "{s}"
    );
}

#[test]
fn long_log_lines_wrap_or_scroll_and_the_log_scrolls() {
    let mut a = launched(true);
    let long = format!("WARN start {} end", "x".repeat(150));
    a.update(Event::Runtime(SupEvent::Log(long)));
    let s = screen_text(&a, 120, 40);
    assert!(s.contains("WARN start xxx") && s.contains("xxx end"), "{s}");
    // Wrapping off: the start shows, then panning right reaches the end.
    key(&mut a, KeyCode::Char('w'));
    let s = screen_text(&a, 120, 40);
    assert!(s.contains("WARN start") && !s.contains(" end"), "{s}");
    assert!(s.contains("wrap off, column 1"), "{s}");
    for _ in 0..6 {
        key(&mut a, KeyCode::Right);
    }
    let s = screen_text(&a, 120, 40);
    assert!(s.contains("xxx end") && !s.contains("WARN start"), "{s}");
    // w wraps again (and forgets the pan).
    key(&mut a, KeyCode::Char('w'));
    assert_eq!(a.run.log_view, crate::tui::app::LogView::default());
    // Scrolling: many lines; Up shows older ones, End follows again.
    for i in 0..100 {
        a.update(Event::Runtime(SupEvent::Log(format!("line {i:03}"))));
    }
    let s = screen_text(&a, 120, 40);
    assert!(s.contains("line 099") && !s.contains("line 050"), "{s}");
    for _ in 0..5 {
        key(&mut a, KeyCode::PageUp);
    }
    let s = screen_text(&a, 120, 40);
    assert!(s.contains("line 040") && !s.contains("line 099"), "{s}");
    assert!(s.contains("50 rows below; End follows"), "{s}");
    // New lines do not move a reader who scrolled up.
    a.update(Event::Runtime(SupEvent::Log("line 100".into())));
    assert!(screen_text(&a, 120, 40).contains("line 040"));
    key(&mut a, KeyCode::End);
    let s = screen_text(&a, 120, 40);
    assert!(s.contains("line 100") && !s.contains("line 040"), "{s}");
}
