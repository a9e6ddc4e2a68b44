//! The batching scheduler over the scripted engine: concurrent requests
//! decode together (both produce tokens before either finishes), at most
//! `parallel` run, a request waits in the queue for KV and then runs (FIFO:
//! a small one never overtakes a waiting big one), cancelling or stopping
//! one leaves the others untouched, a fault fails every running and queued
//! request, a shutdown cancels them all, `/v1/stats` lists every running
//! request with the KV in use, and `--parallel` is checked against the
//! engine.

mod common;

use common::*;
use futures::StreamExt;
use krasis_common::status::EngineStats;
use serde_json::{Value, json};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const TOKEN_DELAY: Duration = Duration::from_millis(10);

fn opts(parallel: usize) -> Opts {
    Opts {
        token_delay: TOKEN_DELAY,
        queue_depth: 4,
        parallel: Some(parallel),
        ..Opts::default()
    }
}

/// Replies "tick " N times, N read from the prompt ("ticks:N"), else 30.
fn ticks(prompt: &str) -> String {
    let n = prompt
        .split("ticks:")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|d| d.parse().ok())
        .unwrap_or(30);
    "tick ".repeat(n)
}

fn completion(prompt: &str, max_tokens: u64) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
}

async fn wait_for(
    h: &Harness,
    limit: Duration,
    mut done: impl FnMut(&EngineStats) -> bool,
) -> EngineStats {
    let t = Instant::now();
    loop {
        let s = h.state.engine_stats();
        if done(&s) {
            return s;
        }
        assert!(t.elapsed() < limit, "gave up waiting; last stats: {s:?}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn spawn_post(url: &str, body: Value) -> tokio::task::JoinHandle<(u16, Value)> {
    let req = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(&body);
    tokio::spawn(async move {
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap())
    })
}

fn text(v: &Value) -> &str {
    v["choices"][0]["text"].as_str().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_requests_decode_together_and_each_gets_its_own_answer() {
    let h = harness(opts(2), ticks);
    let url = serve_loopback(&h).await;
    let a = spawn_post(&url, completion("a ticks:30", 100));
    let b = spawn_post(&url, completion("b ticks:20", 100));
    // Both have produced tokens while both still run.
    let s = wait_for(&h, Duration::from_secs(10), |s| {
        s.running.len() == 2 && s.running.iter().all(|r| r.generated_tokens > 0)
    })
    .await;
    assert_eq!((s.active_sequences, s.parallel, s.queue_len), (2, 2, 0));
    assert_ne!(s.running[0].id, s.running[1].id);
    let kv = s.kv.unwrap();
    let prompts: u64 = s.running.iter().map(|r| r.prompt_tokens).sum();
    assert_eq!(
        kv.used_tokens,
        prompts + 200,
        "each reserves prompt + max_tokens"
    );
    let (sa, va) = a.await.unwrap();
    let (sb, vb) = b.await.unwrap();
    assert_eq!((sa, sb), (200, 200));
    assert_eq!(text(&va), ticks("ticks:30"));
    assert_eq!(text(&vb), ticks("ticks:20"));
    let end = h.state.engine_stats();
    assert_eq!((end.active_sequences, end.kv.unwrap().used_tokens), (0, 0));
    assert!(end.running.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_most_parallel_requests_run_and_the_rest_wait_in_order() {
    let h = harness(opts(2), ticks);
    let url = serve_loopback(&h).await;
    let jobs: Vec<_> = (0..5)
        .map(|i| spawn_post(&url, completion(&format!("p{i} ticks:15"), 100)))
        .collect();
    let mut most = 0;
    let mut queued = 0;
    let mut started = Vec::new();
    wait_for(&h, Duration::from_secs(20), |s| {
        most = most.max(s.active_sequences);
        queued = queued.max(s.queue_len);
        for r in &s.running {
            if !started.contains(&r.id) {
                started.push(r.id);
            }
        }
        s.requests_completed == 5
    })
    .await;
    assert_eq!(most, 2, "never more than --parallel");
    assert!(queued >= 2, "the others waited in the queue ({queued})");
    assert_eq!(started, [1, 2, 3, 4, 5], "admitted in arrival order");
    for j in jobs {
        let (status, v) = j.await.unwrap();
        assert_eq!((status, text(&v)), (200, ticks("ticks:15").as_str()));
    }
}

/// With KV for one request at a time, a second waits (although `parallel`
/// would let it run) and runs once the first ends; a small third one
/// that would fit beside the first does not overtake it; one that can
/// never fit is refused at once with a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_for_kv_in_order_and_one_that_never_fits_is_refused() {
    let opts = Opts {
        kv_tokens: Some(300),
        ..opts(4)
    };
    let h = harness(opts, ticks);
    let url = serve_loopback(&h).await;
    // Prompt + 400 new tokens can never fit in 300.
    let (status, v) = spawn_post(&url, completion("never", 400)).await.unwrap();
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("KV budget"),
        "{v}"
    );
    let big = |name: &str| completion(&format!("{name} ticks:40"), 200);
    let a = spawn_post(&url, big("a"));
    wait_for(&h, Duration::from_secs(10), |s| s.active_sequences == 1).await;
    let b = spawn_post(&url, big("b"));
    wait_for(&h, Duration::from_secs(10), |s| s.queue_len == 1).await;
    let c = spawn_post(&url, completion("c ticks:5", 5));
    let s = wait_for(&h, Duration::from_secs(10), |s| s.queue_len == 2).await;
    assert_eq!(s.active_sequences, 1, "b waits for KV, c waits behind b");
    // b starts only after a ended, and before c.
    let mut order = Vec::new();
    wait_for(&h, Duration::from_secs(20), |s| {
        for r in &s.running {
            if !order.contains(&r.id) {
                order.push(r.id);
            }
        }
        s.requests_completed == 3
    })
    .await;
    assert_eq!(order, [2, 3, 4]);
    for (j, want) in [(a, 40), (b, 40), (c, 5)] {
        let (status, v) = j.await.unwrap();
        assert_eq!(
            (status, text(&v).trim_end()),
            (200, "tick ".repeat(want).trim_end())
        );
    }
    assert_eq!(h.state.engine_stats().kv.unwrap().used_tokens, 0);
}

/// A streaming client that disconnects ends its own sequence only; a stop
/// string ends only the request that asked for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_or_a_stop_string_ends_only_its_own_request() {
    let h = harness(opts(3), |p| {
        if p.contains("count") {
            "one two three four five six seven eight nine ten".into()
        } else {
            ticks(p)
        }
    });
    let url = serve_loopback(&h).await;
    let client = reqwest::Client::new();
    let resp = client
        .post(format!("{url}/v1/completions"))
        .json(
            &json!({"model": MODEL, "prompt": "gone ticks:200", "max_tokens": 300, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    let keep = spawn_post(&url, completion("keep ticks:60", 100));
    let stop = spawn_post(
        &url,
        json!({"model": MODEL, "prompt": "count", "max_tokens": 50, "stop": ["five"]}),
    );
    wait_for(&h, Duration::from_secs(10), |s| s.active_sequences == 3).await;
    let mut body = resp.bytes_stream();
    let mut seen = 0;
    while seen < 3 {
        seen += String::from_utf8_lossy(&body.next().await.unwrap().unwrap())
            .matches("tick")
            .count();
    }
    drop(body);
    let (status, v) = stop.await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(text(&v), "one two three four ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let (status, v) = keep.await.unwrap();
    assert_eq!((status, text(&v)), (200, ticks("ticks:60").as_str()));
    let s = wait_for(&h, Duration::from_secs(10), |s| {
        s.recent_requests.len() == 3
    })
    .await;
    let gone = s
        .recent_requests
        .iter()
        .find(|r| r.id == 1)
        .expect("the cancelled request is logged");
    assert_eq!(gone.finish_reason, "cancelled", "{gone:?}");
    assert!(gone.completion_tokens < 200, "{gone:?}");
    assert_eq!((s.requests_cancelled, s.requests_completed), (1, 2));
    assert_eq!(s.kv.unwrap().used_tokens, 0);
}

/// A fatal engine error in a step fails every running request with it,
/// the queued ones with the fault, and ends `serve`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fault_fails_every_running_and_queued_request() {
    let opts = Opts {
        fail: Some(|p| {
            p.contains("BOOM")
                .then(|| krasis_model::EngineError::Backend("device lost".into()))
        }),
        ..opts(2)
    };
    let h = harness(opts, ticks);
    let (url, serving) = serve_loopback_until(&h, std::future::pending()).await;
    let running = spawn_post(&url, completion("slow ticks:300", 400));
    wait_for(&h, Duration::from_secs(10), |s| {
        s.running.first().is_some_and(|r| r.generated_tokens > 0)
    })
    .await;
    // BOOM is admitted beside it, and its prefill fails the step.
    let boom = spawn_post(&url, completion("BOOM", 10));
    let (s1, v1) = running.await.unwrap();
    let (s2, v2) = boom.await.unwrap();
    for (status, v) in [(s1, &v1), (s2, &v2)] {
        assert_eq!(status, 500, "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("device lost"),
            "{v}"
        );
    }
    let why = tokio::time::timeout(Duration::from_secs(3), serving)
        .await
        .expect("serve did not return after the fault")
        .unwrap()
        .unwrap();
    assert!(
        matches!(&why, krasis_server::Stopped::EngineFault(r) if r.contains("device lost")),
        "{why:?}"
    );
    let s = h.state.engine_stats();
    assert!(s.recent_requests.iter().all(|r| r.finish_reason == "error"));
    // A faulted engine's state is unknown: its prefix cache is not saved.
    assert_eq!(h.saves.load(Ordering::Relaxed), 0);
}

/// A shutdown cancels every running request at its next token and fails
/// the queued ones; `serve` returns promptly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_cancels_every_running_request() {
    let h = harness(opts(2), ticks);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (url, serving) = serve_loopback_until(&h, async {
        let _ = stopped.await;
    })
    .await;
    let jobs: Vec<_> = (0..3)
        .map(|i| spawn_post(&url, completion(&format!("p{i} ticks:500"), 600)))
        .collect();
    wait_for(&h, Duration::from_secs(10), |s| {
        s.active_sequences == 2 && s.queue_len == 1
    })
    .await;
    let t = Instant::now();
    stop.send(()).unwrap();
    serving.await.unwrap().unwrap();
    assert!(t.elapsed() < krasis_server::DRAIN, "{:?}", t.elapsed());
    for j in jobs {
        let (status, _) = j.await.unwrap();
        assert!(status == 503 || status == 200, "{status}");
    }
    let s = wait_for(&h, Duration::from_secs(5), |s| s.recent_requests.len() == 3).await;
    assert!(
        s.recent_requests
            .iter()
            .all(|r| r.finish_reason == "cancelled"),
        "{:?}",
        s.recent_requests
    );
    assert_eq!((s.active_sequences, s.kv.unwrap().used_tokens), (0, 0));
    // The engine thread stopped before `serve` returned (a `Stop` taken
    // while requests ran is not waited for again), and saved the prefix
    // cache once, after the running requests ended.
    assert_eq!(h.saves.load(Ordering::Relaxed), 1);
}

#[test]
fn parallel_is_checked_against_the_engine() {
    for (o, want) in [
        (
            Opts {
                parallel: Some(9),
                ..Opts::default()
            },
            "at most 8 sequences",
        ),
        (
            Opts {
                parallel: Some(0),
                ..Opts::default()
            },
            "--parallel 0",
        ),
        (
            Opts {
                parallel: Some(2),
                batching: false,
                ..Opts::default()
            },
            "one request at a time",
        ),
    ] {
        let err = try_harness(o, |_| String::new()).err().expect("refused");
        assert!(err.contains(want), "{err}");
    }
    // Without batching the server runs one at a time, by default.
    let h = harness(
        Opts {
            batching: false,
            ..Opts::default()
        },
        |_| "fine".into(),
    );
    assert_eq!(h.state.engine_stats().parallel, 1);
    let h = harness(Opts::default(), |_| "fine".into());
    assert_eq!(h.state.engine_stats().parallel, 8, "the engine's capacity");
}

/// The one-at-a-time path (an engine without a batch interface) still
/// serves requests.
#[tokio::test]
async fn an_engine_without_batching_serves_one_at_a_time() {
    let h = harness(
        Opts {
            batching: false,
            ..Opts::default()
        },
        |_| "fine thanks".into(),
    );
    let app = app(&h);
    let (status, v) = post_json(&app, "/v1/completions", &completion("hi", 10)).await;
    assert_eq!((status, text(&v)), (200, "fine thanks"));
    assert!(h.state.engine_stats().kv.is_none());
}
