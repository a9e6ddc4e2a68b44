//! Over a real loopback socket with reqwest: client disconnects cancel
//! generation (prefill included), a full queue answers 503 before any work,
//! oversized prompts are refused without stalling anyone, shutdown and engine
//! faults end `serve` promptly, and a bounded load test.

mod common;

use common::*;
use futures::StreamExt;
use serde_json::{Value, json};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Serves until the returned sender fires (or the engine faults).
async fn start_stoppable(h: &Harness) -> (String, tokio::sync::oneshot::Sender<()>, Serving) {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let (url, serving) = serve_loopback_until(h, async {
        let _ = rx.await;
    })
    .await;
    (url, tx, serving)
}

fn chat(text: &str, stream: bool) -> Value {
    json!({"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": text}]})
}

/// Waits until the engine has produced nothing new for `quiet`.
async fn settle(h: &Harness, quiet: Duration) -> usize {
    let mut last = h.produced.load(Ordering::Relaxed);
    loop {
        tokio::time::sleep(quiet).await;
        let now = h.produced.load(Ordering::Relaxed);
        if now == last {
            return now;
        }
        last = now;
    }
}

const LONG_TOKENS: usize = 400;

/// One request runs at a time (`parallel` 1), one more may wait.
fn slow_long() -> Harness {
    let opts = Opts {
        token_delay: Duration::from_millis(10),
        queue_depth: 1,
        parallel: Some(1),
        ..Opts::default()
    };
    harness(opts, |_| "tick ".repeat(LONG_TOKENS))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_client_disconnect_cancels_generation() {
    let h = slow_long();
    let url = serve_loopback(&h).await;
    let client = reqwest::Client::new();
    let resp = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat("go", true))
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    let mut seen = 0;
    while seen < 5 {
        let chunk = body.next().await.unwrap().unwrap();
        seen += String::from_utf8_lossy(&chunk).matches("tick").count();
    }
    let at_drop = h.produced.load(Ordering::Relaxed);
    drop(body);
    let stopped_at = settle(&h, Duration::from_millis(150)).await;
    assert!(
        stopped_at < at_drop + 10 && stopped_at < LONG_TOKENS,
        "generation continued after disconnect: {at_drop} -> {stopped_at}"
    );
    // The engine is free again.
    let v: Value = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streaming_client_disconnect_cancels_generation() {
    let h = slow_long();
    let url = serve_loopback(&h).await;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let r = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat("go", false))
        .send()
        .await;
    assert!(r.is_err(), "the request should have timed out");
    let stopped_at = settle(&h, Duration::from_millis(150)).await;
    assert!(
        stopped_at < LONG_TOKENS / 2,
        "generation ran on after the client left: {stopped_at} tokens"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_answers_503_with_retry_after() {
    let h = slow_long();
    let url = serve_loopback(&h).await;
    let client = reqwest::Client::new();
    let running = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat("a", true))
        .send()
        .await
        .unwrap();
    while h.produced.load(Ordering::Relaxed) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let waiting = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat("b", true))
        .send()
        .await
        .unwrap();
    let refused = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat("c", false))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 503);
    assert_eq!(refused.headers()["retry-after"], "1");
    let v: Value = refused.json().await.unwrap();
    assert_eq!(v["error"]["code"], "overloaded");
    let stats: Value = client
        .get(format!("{url}/v1/stats"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stats["requests_rejected"], 1);
    assert_eq!(stats["queue_len"], 1);
    drop((running, waiting));
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

#[derive(Default, Debug)]
struct Tally {
    ok: usize,
    busy: usize,
    disconnected: usize,
    other: Vec<String>,
}

async fn one_request(
    client: &reqwest::Client,
    url: &str,
    i: usize,
) -> Result<&'static str, String> {
    let mut body = chat(&format!("request {i}"), i.is_multiple_of(2));
    if i % 4 == 1 {
        body["tools"] = json!([weather_tool()]);
    }
    let resp = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    match resp.status().as_u16() {
        503 => return Ok("busy"),
        200 => {}
        s => {
            return Err(format!(
                "status {s}: {}",
                resp.text().await.unwrap_or_default()
            ));
        }
    }
    if i % 4 == 2 {
        // Read one chunk and walk away.
        let mut s = resp.bytes_stream();
        let _ = s.next().await;
        return Ok("disconnected");
    }
    let text = resp.text().await.map_err(|e| e.to_string())?;
    let complete = if i.is_multiple_of(2) {
        text.trim_end().ends_with("data: [DONE]")
    } else {
        let v: Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
        v["choices"][0]["finish_reason"].is_string()
    };
    if complete {
        Ok("ok")
    } else {
        Err(format!("incomplete: {text}"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_16_clients_20_requests_each_complete_or_503_without_growth() {
    const CLIENTS: usize = 16;
    const PER_CLIENT: usize = 20;
    let opts = Opts {
        queue_depth: 8,
        token_delay: Duration::from_micros(200),
        ..Opts::default()
    };
    let h = harness(opts, |prompt| {
        if prompt.contains("get_weather") {
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>".into()
        } else {
            "<think>\nshort\n</think>\n\nA reply of a dozen or so tokens for the load test.".into()
        }
    });
    let url = serve_loopback(&h).await;

    let run_round = |url: String| async move {
        let mut tasks = Vec::new();
        for c in 0..CLIENTS {
            let url = url.clone();
            tasks.push(tokio::spawn(async move {
                let client = reqwest::Client::new();
                let mut t = Tally::default();
                for r in 0..PER_CLIENT {
                    match one_request(&client, &url, c * PER_CLIENT + r).await {
                        Ok("ok") => t.ok += 1,
                        Ok("busy") => {
                            t.busy += 1;
                            // What a client honouring Retry-After does, scaled down.
                            tokio::time::sleep(Duration::from_millis(25)).await;
                        }
                        Ok(_) => t.disconnected += 1,
                        Err(e) => t.other.push(e),
                    }
                }
                t
            }));
        }
        let mut total = Tally::default();
        for t in tasks {
            let t = t.await.unwrap();
            total.ok += t.ok;
            total.busy += t.busy;
            total.disconnected += t.disconnected;
            total.other.extend(t.other);
        }
        total
    };

    // A warm-up round, so allocator pools and connection state exist before RSS is measured.
    let warm = tokio::time::timeout(Duration::from_secs(60), run_round(url.clone()))
        .await
        .expect("warm-up round hung");
    assert!(warm.other.is_empty(), "{:?}", warm.other);
    let rss_before = rss_kib();

    let health_url = url.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop_poll = stop.clone();
    let poller = tokio::spawn(async move {
        let client = reqwest::Client::new();
        let mut worst = Duration::ZERO;
        let mut polls = 0;
        while !stop_poll.load(Ordering::Relaxed) {
            let t = Instant::now();
            let r = client
                .get(format!("{health_url}/health"))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            worst = worst.max(t.elapsed());
            polls += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        (worst, polls)
    });
    let started = Instant::now();
    let tally = tokio::time::timeout(Duration::from_secs(60), run_round(url.clone()))
        .await
        .expect("load round hung");
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let (worst_health, polls) = poller.await.unwrap();
    settle(&h, Duration::from_millis(100)).await;
    let rss_after = rss_kib();
    eprintln!(
        "load: {} requests in {:.2}s: {} ok, {} busy (503), {} disconnected; /health worst {:?} over {polls} polls; RSS {} -> {} KiB",
        CLIENTS * PER_CLIENT,
        elapsed.as_secs_f64(),
        tally.ok,
        tally.busy,
        tally.disconnected,
        worst_health,
        rss_before,
        rss_after
    );
    assert!(
        tally.other.is_empty(),
        "unexpected outcomes: {:?}",
        tally.other
    );
    assert_eq!(
        tally.ok + tally.busy + tally.disconnected,
        CLIENTS * PER_CLIENT
    );
    assert!(tally.ok > 0);
    assert!(
        worst_health < Duration::from_millis(500),
        "/health took {worst_health:?}"
    );
    assert!(
        rss_after < rss_before + 32 * 1024,
        "RSS grew from {rss_before} KiB to {rss_after} KiB"
    );
    let stats: Value = reqwest::get(format!("{url}/v1/stats"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stats["queue_len"], 0, "{stats}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_503_before_reading_the_body() {
    let h = slow_long();
    let url = serve_loopback(&h).await;
    let client = reqwest::Client::new();
    let running = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat("a", true))
        .send()
        .await
        .unwrap();
    while h.produced.load(Ordering::Relaxed) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let waiting = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat("b", true))
        .send()
        .await
        .unwrap();
    // Not even parsed: a malformed body gets the 503, not a 400.
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let r = client
            .post(format!("{url}{path}"))
            .header("content-type", "application/json")
            .body("{not json")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 503, "{path}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "overloaded");
    }
    drop((running, waiting));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_prompt_is_refused_fast_while_others_are_served() {
    let h = harness(Opts::default(), |_| "fine".into());
    let url = serve_loopback(&h).await;
    let big = "All work and no play makes Jack a dull boy. ".repeat(200_000);
    assert!(big.len() > 7 << 20 && big.len() < krasis_server::api::BODY_LIMIT);

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let poll = {
        let (url, stop) = (url.clone(), stop.clone());
        tokio::spawn(async move {
            let client = reqwest::Client::new();
            let mut worst = Duration::ZERO;
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                let r = client.get(format!("{url}/health")).send().await.unwrap();
                assert_eq!(r.status(), 200);
                let small = client
                    .post(format!("{url}/v1/chat/completions"))
                    .json(&chat("hi", false))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(small.status(), 200);
                worst = worst.max(t.elapsed());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            worst
        })
    };
    let client = reqwest::Client::new();
    for (path, body) in [
        ("/v1/chat/completions", chat(&big, false)),
        ("/v1/completions", json!({"prompt": big})),
    ] {
        let t = Instant::now();
        let r = client
            .post(format!("{url}{path}"))
            .json(&body)
            .send()
            .await
            .unwrap();
        let took = t.elapsed();
        assert_eq!(r.status(), 400, "{path}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(
            msg.starts_with("This model's maximum context length is 2048 tokens. However, your ")
                && msg.contains("resulted in at least "),
            "{msg}"
        );
        assert!(took < Duration::from_secs(2), "{path} took {took:?}");
    }
    stop.store(true, Ordering::Relaxed);
    let worst = poll.await.unwrap();
    assert!(
        worst < Duration::from_millis(1000),
        "/health + a small chat took {worst:?} while the big prompts were handled"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnect_during_prefill_stops_it_at_the_next_chunk() {
    const CHUNK: usize = 4;
    let opts = Opts {
        prefill: Some((CHUNK, Duration::from_millis(50))),
        queue_depth: 2,
        ..Opts::default()
    };
    let h = harness(opts, |_| "done".into());
    let url = serve_loopback(&h).await;
    // About 200 prompt tokens: 50 chunks, 2.5 s of prefill.
    let long = "word ".repeat(200);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(400))
        .build()
        .unwrap();
    let r = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat(&long, false))
        .send()
        .await;
    assert!(r.is_err(), "the request should have timed out");
    let left_at = h.prefill_chunks.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stopped_at = h.prefill_chunks.load(Ordering::Relaxed);
    assert!(
        stopped_at <= left_at + 2,
        "prefill went on after the client left: {left_at} -> {stopped_at} chunks"
    );
    assert!(stopped_at < 200 / CHUNK, "{stopped_at}");
    // The engine is free at once for the next request.
    let t = Instant::now();
    let v: Value = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat("x", false))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "done", "{v}");
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    let stats = h.state.engine_stats();
    assert_eq!((stats.requests_cancelled, stats.requests_completed), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_cancels_running_and_queued_requests_and_returns_within_two_seconds() {
    let opts = Opts {
        token_delay: Duration::from_millis(20),
        queue_depth: 2,
        parallel: Some(1),
        ..Opts::default()
    };
    // 400 tokens at 20 ms: 8 s per request if nothing is cancelled.
    let h = harness(opts, |_| "tick ".repeat(LONG_TOKENS));
    let (url, shutdown, serving) = start_stoppable(&h).await;
    let client = reqwest::Client::new();
    let streaming = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat("a", true))
        .send()
        .await
        .unwrap();
    while h.produced.load(Ordering::Relaxed) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let queued = tokio::spawn({
        let (client, url) = (client.clone(), url.clone());
        async move {
            client
                .post(format!("{url}/v1/chat/completions"))
                .json(&chat("b", false))
                .send()
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(h.state.engine_stats().queue_len, 1);

    let t = Instant::now();
    shutdown.send(()).unwrap();
    let why = tokio::time::timeout(Duration::from_secs(3), serving)
        .await
        .expect("serve did not return within 3 s")
        .unwrap()
        .unwrap();
    assert_eq!(why, krasis_server::Stopped::Shutdown);
    let took = t.elapsed();
    assert!(took < Duration::from_secs(2), "serve took {took:?} to stop");

    // The stream was finished (an error event, then [DONE]), not cut.
    let text = streaming.text().await.unwrap();
    let (events, done) = sse_events(&text);
    assert!(done, "{text}");
    let err = events
        .iter()
        .find_map(|e| e.get("error"))
        .expect("error event");
    assert!(
        err["message"].as_str().unwrap().contains("shutting down"),
        "{err}"
    );
    // The queued request got its answer: 503.
    let r = queued.await.unwrap().unwrap();
    assert_eq!(r.status(), 503);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("shutting down"),
        "{v}"
    );
    assert!(h.produced.load(Ordering::Relaxed) < LONG_TOKENS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_fault_ends_serve_after_the_failing_response_is_sent() {
    let h = harness(Opts::default(), |prompt| {
        if prompt.contains("PANIC") {
            std::thread::sleep(Duration::from_millis(100));
            panic!("scripted engine failure");
        }
        "fine".into()
    });
    let (url, _shutdown, serving) = start_stoppable(&h).await;
    let client = reqwest::Client::new();
    let ok = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat("hello", false))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    let r = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat("PANIC", false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 500);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("scripted engine failure"),
        "{v}"
    );
    let why = tokio::time::timeout(Duration::from_secs(3), serving)
        .await
        .expect("serve did not return after the fault")
        .unwrap()
        .unwrap();
    match why {
        krasis_server::Stopped::EngineFault(reason) => {
            assert!(reason.contains("scripted engine failure"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}
