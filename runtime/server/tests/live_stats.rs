//! `/v1/stats` while requests run, as the launcher's run screen polls it:
//! prefill and decode progress of the running request, queue and active
//! sequences, the engine's live cache figures, and the request log with the
//! finish reason each client received.

mod common;

use common::*;
use futures::StreamExt;
use krasis_common::status::{Activity, EngineStats, LiveRequest, REQUEST_LOG_LEN, RequestRecord};
use krasis_server::testkit::{LAST_HIT_RATE, LIVE_FREE_BYTES, LIVE_HIT_RATE, PINNED_BYTES};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

fn chat(text: &str, stream: bool, max_tokens: u64) -> Value {
    json!({
        "model": MODEL,
        "stream": stream,
        "stream_options": {"include_usage": true},
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": text}],
    })
}

/// Polls `state` until `done` holds, or panics after `limit`.
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
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn assert_local_client(client: Option<&str>) {
    let client = client.expect("the client's address is recorded");
    let (ip, port) = client.rsplit_once(':').expect("ip:port");
    assert_eq!(ip, "127.0.0.1", "{client}");
    assert!(port.parse::<u16>().is_ok_and(|p| p > 0), "{client}");
}

const CHUNK: usize = 4;
const CHUNK_DELAY: Duration = Duration::from_millis(40);
const TOKEN_DELAY: Duration = Duration::from_millis(30);
const REPLY_TOKENS: usize = 20;

/// A slow engine running one request at a time (`parallel` 1), so a
/// second one waits in the queue.
fn slow(queue_depth: usize) -> Harness {
    let opts = Opts {
        prefill: Some((CHUNK, CHUNK_DELAY)),
        token_delay: TOKEN_DELAY,
        queue_depth,
        cache_figures: true,
        parallel: Some(1),
        ..Opts::default()
    };
    harness(opts, |_| "tick ".repeat(REPLY_TOKENS))
}

/// The first running request.
fn cur(s: &EngineStats) -> Option<&LiveRequest> {
    s.running.first()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_follow_a_streaming_request_from_prefill_to_the_log() {
    let h = slow(4);
    let url = serve_loopback(&h).await;
    let client = reqwest::Client::new();
    let body = chat(&"word ".repeat(40), true, 50);
    let req = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&body);
    let answer = tokio::spawn(async move { req.send().await.unwrap().text().await.unwrap() });

    // Poll the endpoint as the launcher does, until the request is logged.
    let mut seen: Vec<EngineStats> = Vec::new();
    let t = Instant::now();
    loop {
        let s: EngineStats = client
            .get(format!("{url}/v1/stats"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let logged = !s.recent_requests.is_empty();
        seen.push(s);
        if logged {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the request never ended"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (events, done) = sse_events(&answer.await.unwrap());
    assert!(done);
    let usage = &events.last().unwrap()["usage"];
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();

    let live: Vec<_> = seen.iter().filter(|s| cur(s).is_some()).collect();
    let prefill: Vec<_> = live
        .iter()
        .filter(|s| s.activity == Activity::Prefilling)
        .collect();
    let decode: Vec<_> = live
        .iter()
        .filter(|s| s.activity == Activity::Decoding)
        .collect();
    assert_eq!(prefill.len() + decode.len(), live.len());
    // Prefill comes first, and its progress grows chunk by chunk.
    let first_decode = live.iter().position(|s| s.activity == Activity::Decoding);
    assert!(
        first_decode.is_some_and(|i| live[i..].iter().all(|s| s.activity == Activity::Decoding))
    );
    let prefilled: Vec<u64> = prefill
        .iter()
        .map(|s| cur(s).unwrap().prefilled_tokens)
        .collect();
    assert!(prefilled.windows(2).all(|w| w[0] <= w[1]), "{prefilled:?}");
    let mut partial: Vec<u64> = prefilled
        .iter()
        .copied()
        .filter(|&p| p > 0 && p < prompt_tokens)
        .collect();
    partial.dedup();
    assert!(
        partial.len() >= 2,
        "prefill progress not seen growing: {prefilled:?} of {prompt_tokens}"
    );
    for s in &prefill {
        let c = cur(s).unwrap();
        assert_eq!((c.generated_tokens, c.ttft_ms), (0, None), "{c:?}");
        assert_eq!(c.prompt_tokens, prompt_tokens);
    }
    assert!(prefill.iter().any(|s| cur(s).unwrap().prefill_tok_s > 0.0));
    // Then decode, with a growing token count and a fixed TTFT.
    let generated: Vec<u64> = decode
        .iter()
        .map(|s| cur(s).unwrap().generated_tokens)
        .collect();
    assert!(generated.windows(2).all(|w| w[0] <= w[1]), "{generated:?}");
    let mut distinct = generated.clone();
    distinct.dedup();
    assert!(
        distinct.len() >= 2,
        "decode progress not seen growing: {generated:?}"
    );
    let ttft = cur(decode[0])
        .unwrap()
        .ttft_ms
        .expect("a TTFT once decoding");
    for s in &decode {
        let c = cur(s).unwrap();
        assert_eq!(c.ttft_ms, Some(ttft));
        assert_eq!(c.prefilled_tokens, prompt_tokens);
        // The engine's figures so far in this request, over the last ones.
        let hcs = s.hcs.as_ref().unwrap();
        assert_eq!(hcs.hit_rate, LIVE_HIT_RATE);
        assert_eq!(s.vram.as_ref().unwrap().free_bytes, LIVE_FREE_BYTES);
        assert_eq!(s.pinned_host_bytes, Some(PINNED_BYTES));
    }
    assert!(decode.iter().any(|s| cur(s).unwrap().decode_tok_s > 0.0));
    // TTFT counts the whole prefill (and everything before it).
    let chunks = prompt_tokens.div_ceil(CHUNK as u64) as u32;
    assert!(
        ttft >= (CHUNK_DELAY * chunks).as_secs_f64() * 1e3,
        "{ttft} ms"
    );
    for s in &live {
        let c = cur(s).unwrap();
        assert_eq!((s.active_sequences, s.queue_len, c.id), (1, 0, 1));
        assert_eq!((c.activity, s.parallel), (s.activity, 1));
        let kv = s.kv.expect("a batching engine reports its KV");
        assert_eq!(kv.used_tokens, prompt_tokens + 50, "prompt + max_tokens");
        assert_eq!(
            (c.endpoint.as_str(), c.max_tokens),
            ("/v1/chat/completions", 50)
        );
        assert_local_client(c.client.as_deref());
    }

    // Ended: idle, the last figures, and one record of what the client got.
    let end = seen.last().unwrap();
    assert_eq!((end.activity, end.active_sequences), (Activity::Idle, 0));
    assert!(end.running.is_empty());
    assert_eq!(end.hcs.as_ref().unwrap().hit_rate, LAST_HIT_RATE);
    let r = &end.recent_requests[0];
    assert_eq!(end.recent_requests.len(), 1);
    assert_eq!((r.id, r.endpoint.as_str()), (1, "/v1/chat/completions"));
    assert_eq!(r.client, cur(live[0]).unwrap().client);
    assert_eq!(r.prompt_tokens, prompt_tokens);
    assert_eq!(
        r.completion_tokens,
        usage["completion_tokens"].as_u64().unwrap()
    );
    assert_eq!(r.finish_reason, "stop");
    assert_eq!(r.ttft_ms, Some(ttft));
    assert_eq!(end.last_ttft_ms, Some(ttft));
    assert!(r.prefill_tok_s > 0.0 && r.decode_tok_s > 0.0, "{r:?}");
    assert!(r.finished_unix_ms > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_is_queued_and_its_ttft_counts_the_wait() {
    let h = slow(2);
    let url = serve_loopback(&h).await;
    let client = reqwest::Client::new();
    let send = |text: &str| {
        let req = client
            .post(format!("{url}/v1/completions"))
            .json(&json!({"prompt": text, "max_tokens": 12}));
        tokio::spawn(async move { req.send().await.unwrap().json::<Value>().await.unwrap() })
    };
    let first = send("one");
    wait_for(&h, Duration::from_secs(10), |s| cur(s).is_some()).await;
    let second = send("two");
    let queued = wait_for(&h, Duration::from_secs(10), |s| s.queue_len == 1).await;
    let seen_queued = Instant::now();
    assert_eq!(queued.active_sequences, 1);
    assert_eq!(cur(&queued).map(|c| c.id), Some(1));
    // The last moment the first request was seen running.
    let mut first_running = seen_queued;
    let both = wait_for(&h, Duration::from_secs(20), |s| {
        if cur(s).is_some_and(|c| c.id == 1) {
            first_running = Instant::now();
        }
        s.recent_requests.len() == 2
    })
    .await;
    for a in [first.await.unwrap(), second.await.unwrap()] {
        assert_eq!(a["choices"][0]["finish_reason"], "length", "{a}");
    }
    let [one, two] = &both.recent_requests[..] else {
        panic!("{:?}", both.recent_requests)
    };
    assert_eq!((one.id, two.id), (1, 2));
    assert_eq!(two.endpoint, "/v1/completions");
    assert_eq!(
        (two.completion_tokens, two.finish_reason.as_str()),
        (12, "length")
    );
    // The second arrived before the queue showed it and got its first token
    // after the first request ended.
    let waited = first_running.duration_since(seen_queued).as_secs_f64() * 1e3;
    assert!(two.ttft_ms.unwrap() >= waited, "{two:?} waited {waited} ms");
    assert!(
        waited > 100.0,
        "the first request ran on for only {waited} ms"
    );
    assert_eq!((both.queue_len, both.active_sequences), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_is_logged_as_cancelled() {
    let h = slow(2);
    let url = serve_loopback(&h).await;
    let resp = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat("go", true, 200))
        .send()
        .await
        .unwrap();
    let mut body = resp.bytes_stream();
    let mut ticks = 0;
    while ticks < 3 {
        ticks += String::from_utf8_lossy(&body.next().await.unwrap().unwrap())
            .matches("tick")
            .count();
    }
    drop(body);
    let s = wait_for(&h, Duration::from_secs(10), |s| {
        !s.recent_requests.is_empty()
    })
    .await;
    let r = &s.recent_requests[0];
    assert_eq!(r.finish_reason, "cancelled", "{r:?}");
    assert!(
        r.completion_tokens >= 3 && r.completion_tokens < REPLY_TOKENS as u64,
        "{r:?}"
    );
    assert!(r.ttft_ms.is_some());
    assert_local_client(r.client.as_deref());
    assert_eq!((s.requests_cancelled, s.requests_completed), (1, 0));
    assert_eq!(s.activity, Activity::Idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_logs_the_running_and_the_queued_request_as_cancelled() {
    let h = slow(2);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (url, serving) = serve_loopback_until(&h, async {
        let _ = stopped.await;
    })
    .await;
    let client = reqwest::Client::new();
    for text in ["one", "two"] {
        let req = client
            .post(format!("{url}/v1/completions"))
            .json(&json!({"prompt": text, "max_tokens": 200}));
        tokio::spawn(async move { req.send().await.map(|r| r.status()) });
    }
    wait_for(&h, Duration::from_secs(10), |s| {
        s.queue_len == 1 && cur(s).is_some()
    })
    .await;
    stop.send(()).unwrap();
    serving.await.unwrap().unwrap();
    let s = wait_for(&h, Duration::from_secs(5), |s| s.recent_requests.len() == 2).await;
    let reasons: Vec<(u64, &str)> = s
        .recent_requests
        .iter()
        .map(|r| (r.id, r.finish_reason.as_str()))
        .collect();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(
        reasons.iter().all(|(_, r)| *r == "cancelled"),
        "{reasons:?}"
    );
    assert_eq!(s.activity, Activity::Idle);
}

const HERMES_CALL: &str =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

fn records(h: &Harness) -> Vec<RequestRecord> {
    h.state.engine_stats().recent_requests
}

#[tokio::test]
async fn the_log_records_the_finish_reason_the_client_received() {
    let h = harness(Opts::default(), |_| format!("Let me check.\n{HERMES_CALL}"));
    let app = app(&h);
    let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}]});
    body["tools"] = json!([weather_tool()]);
    let (status, v) = post_json(&app, "/v1/chat/completions", &body).await;
    assert_eq!(
        (status, &v["choices"][0]["finish_reason"]),
        (200, &json!("tool_calls"))
    );
    body["stream"] = json!(true);
    let (status, _, text) = send(&app, post("/v1/chat/completions", &body)).await;
    assert_eq!(status, 200);
    assert!(text.contains("\"finish_reason\":\"tool_calls\""), "{text}");
    // Legacy function calling answers `function_call`.
    let legacy = json!({"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}],
        "functions": [weather_tool()["function"]]});
    let (status, v) = post_json(&app, "/v1/chat/completions", &legacy).await;
    assert_eq!(
        (status, &v["choices"][0]["finish_reason"]),
        (200, &json!("function_call"))
    );
    // A cut after the allowed number of calls is still `tool_calls`.
    body["stream"] = json!(false);
    body["parallel_tool_calls"] = json!(false);
    let (status, _) = post_json(&app, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200);

    let got: Vec<String> = records(&h).into_iter().map(|r| r.finish_reason).collect();
    assert_eq!(
        got,
        ["tool_calls", "tool_calls", "function_call", "tool_calls"]
    );
    // Driven without a socket: no client address to show.
    assert!(records(&h).iter().all(|r| r.client.is_none()));
}

#[tokio::test]
async fn an_engine_error_is_logged_as_error() {
    let opts = Opts {
        fail: Some(|p| {
            p.contains("refuse")
                .then(|| krasis_model::EngineError::InvalidRequest("no".into()))
        }),
        ..Opts::default()
    };
    let h = harness(opts, |_| "fine".into());
    let app = app(&h);
    let (status, _) = post_json(&app, "/v1/completions", &json!({"prompt": "refuse"})).await;
    assert_eq!(status, 400);
    let r = &records(&h)[0];
    assert_eq!(
        (r.finish_reason.as_str(), r.completion_tokens, r.ttft_ms),
        ("error", 0, None)
    );
    assert_eq!(
        (r.endpoint.as_str(), r.prompt_tokens > 0),
        ("/v1/completions", true)
    );
}

#[tokio::test]
async fn the_log_keeps_the_last_requests_only() {
    let h = harness(Opts::default(), |_| "a b c".into());
    let app = app(&h);
    let n = REQUEST_LOG_LEN as u64 + 3;
    for i in 0..n {
        let (status, _) = post_json(
            &app,
            "/v1/completions",
            &json!({"prompt": format!("p{i}"), "max_tokens": 1}),
        )
        .await;
        assert_eq!(status, 200);
    }
    let s = h.state.engine_stats();
    let ids: Vec<u64> = s.recent_requests.iter().map(|r| r.id).collect();
    assert_eq!(ids, (4..=n).collect::<Vec<_>>());
    assert!(
        s.recent_requests
            .iter()
            .all(|r| r.finish_reason == "length")
    );
    assert_eq!(s.requests_completed, n);
}
