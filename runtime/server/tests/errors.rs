//! Error paths, auth, CORS, loading phase and panics, through the router.

mod common;

use axum::body::Body;
use axum::http::Request;
use common::app as app_of;
use common::*;
use krasis_common::status::{EngineStats, Health, HealthStatus, Phase};
use krasis_model::EngineError;
use krasis_model::SamplingParams;
use krasis_model::chat_template::ChatTemplate;
use krasis_server::{AppState, ServerConfig};
use serde_json::{Value, json};
use std::sync::atomic::{AtomicBool, Ordering};

fn user(text: &str) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": text}]})
}

fn assert_error(v: &Value, param: Option<&str>) {
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("code").is_some() && e.get("param").is_some(), "{v}");
    if let Some(p) = param {
        assert_eq!(e["param"], p, "{v}");
    }
}

#[tokio::test]
async fn health_is_503_loading_then_200_ok_and_503_error_after_a_failed_load() {
    let state = AppState::new(ServerConfig {
        model_id: MODEL.into(),
        backend: "reference".into(),
        api_key: None,
        queue_depth: 1,
        default_sampling: SamplingParams::greedy(),
        ..ServerConfig::default()
    });
    let app = krasis_server::router(state.clone());
    let (status, _, text) = send(&app, get("/health")).await;
    assert_eq!(status, 503, "{text}");
    let health: Health = serde_json::from_str(&text).unwrap();
    assert_eq!(health.status, HealthStatus::Loading);
    assert_eq!(health.phase, Phase::Loading);
    assert!(!health.model_loaded);
    assert!(text.contains(r#""status":"loading""#), "{text}");
    let (status, headers, text) = send(&app, post("/v1/chat/completions", &user("x"))).await;
    assert_eq!(status, 503);
    assert!(headers.contains_key("retry-after"));
    assert!(text.contains("loading"), "{text}");
    state.set_failed("weights missing".into());
    let (_, _, text) = send(&app, post("/v1/chat/completions", &user("x"))).await;
    assert!(text.contains("weights missing"), "{text}");
    let (status, _, text) = send(&app, get("/health")).await;
    assert_eq!(status, 503, "{text}");
    let health: Health = serde_json::from_str(&text).unwrap();
    assert_eq!(health.status, HealthStatus::Error);
    assert!(health.error.unwrap().contains("weights missing"));

    // A loaded model: 200 and exactly `ok`, no error field.
    let h = harness(Opts::default(), |_| "ok".into());
    let (status, _, text) = send(&app_of(&h), get("/health")).await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["status"], "ok");
    assert!(v.get("error").is_none(), "{v}");
}

#[tokio::test]
async fn bad_requests_are_openai_error_objects() {
    let h = harness(Opts::default(), |_| "ok".into());
    let app = app(&h);
    let cases: Vec<(Value, u16, Option<&str>)> = vec![
        (json!({"messages": "nope"}), 400, None),
        (json!({"model": MODEL}), 400, None),
        (
            json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}),
            404,
            Some("model"),
        ),
        (
            {
                let mut b = user("x");
                b["n"] = json!(2);
                b
            },
            400,
            Some("n"),
        ),
        (
            {
                let mut b = user("x");
                b["logprobs"] = json!(true);
                b
            },
            400,
            Some("logprobs"),
        ),
        (
            {
                let mut b = user("x");
                b["response_format"] = json!({"type": "yaml"});
                b
            },
            400,
            Some("response_format"),
        ),
        (
            {
                let mut b = user("x");
                b["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "x"}});
                b
            },
            400,
            Some("response_format"),
        ),
        (
            {
                let mut b = user("x");
                b["temperature"] = json!(5);
                b
            },
            400,
            Some("temperature"),
        ),
        (
            {
                let mut b = user("x");
                b["max_tokens"] = json!(0);
                b
            },
            400,
            Some("max_tokens"),
        ),
        (
            {
                let mut b = user("x");
                b["tool_choice"] = json!("required");
                b
            },
            400,
            Some("tool_choice"),
        ),
        (
            {
                let mut b = user("x");
                b["tools"] = json!([weather_tool()]);
                b["tool_choice"] = json!({"type": "function", "function": {"name": "nope"}});
                b
            },
            400,
            Some("tool_choice"),
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}),
            400,
            Some("messages[0].content[0]"),
        ),
        (json!({"messages": []}), 400, Some("messages")),
    ];
    for (body, status, param) in cases {
        let (got, v) = post_json(&app, "/v1/chat/completions", &body).await;
        assert_eq!(got, status, "{body} -> {v}");
        assert_error(&v, param);
    }
    // Not JSON at all, and a wrong content type, still get error objects.
    let req = Request::post("/v1/chat/completions")
        .body(Body::from("{oops"))
        .unwrap();
    let (status, _, text) = send(&app, req).await;
    assert_eq!(status, 400);
    assert_error(&serde_json::from_str(&text).unwrap(), None);
    // Unknown fields are refused by name, never ignored; fields that by
    // definition change nothing are accepted.
    let mut b = user("x");
    b["user"] = json!("u1");
    b["response_format"] = json!({"type": "text"});
    assert_eq!(post_json(&app, "/v1/chat/completions", &b).await.0, 200);
    b["frobnicate"] = json!({"deep": [1]});
    let (status, v) = post_json(&app, "/v1/chat/completions", &b).await;
    assert_eq!(status, 400, "{v}");
    assert_error(&v, Some("frobnicate"));
}

#[tokio::test]
async fn unknown_routes_and_models_are_404() {
    let h = harness(Opts::default(), |_| "ok".into());
    let app = app(&h);
    let (status, _, text) = send(&app, get("/v1/nothing")).await;
    assert_eq!(status, 404);
    assert_error(&serde_json::from_str(&text).unwrap(), None);
    let (status, _, text) = send(&app, get("/v1/models/other")).await;
    assert_eq!(status, 404, "{text}");
    let (status, _, text) = send(&app, get(&format!("/v1/models/{MODEL}"))).await;
    assert_eq!(status, 200, "{text}");
    let (_, _, text) = send(&app, get("/v1/models")).await;
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["data"][0]["id"], MODEL);
    assert_eq!(v["object"], "list");
}

#[tokio::test]
async fn prompt_longer_than_context_names_both_counts() {
    let h = harness(
        Opts {
            context: 64,
            ..Opts::default()
        },
        |_| "ok".into(),
    );
    let long = "word ".repeat(200);
    let (status, v) = post_json(&app(&h), "/v1/chat/completions", &user(&long)).await;
    assert_eq!(status, 400);
    // OpenAI's shape, which OpenCode and LiteLLM recognize.
    let e = &v["error"];
    assert_eq!(e["code"], "context_length_exceeded", "{v}");
    assert_eq!(e["type"], "invalid_request_error", "{v}");
    assert_eq!(e["param"], "messages", "{v}");
    let msg = e["message"].as_str().unwrap();
    let prefix =
        "This model's maximum context length is 64 tokens. However, your messages resulted in ";
    assert!(msg.starts_with(prefix), "{msg}");
    let n: usize = msg[prefix.len()..]
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(n > 200, "{msg}");
    assert!(
        msg.ends_with(" tokens. Please reduce the length of the messages."),
        "{msg}"
    );

    // Text completions name the prompt.
    let (status, v) = post_json(
        &app(&h),
        "/v1/completions",
        &json!({"prompt": long, "max_tokens": 4}),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    assert_eq!(v["error"]["param"], "prompt", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("in the prompt, 4 in the completion"),
        "{v}"
    );
}

#[tokio::test]
async fn prompt_plus_max_tokens_over_the_context_is_refused_not_clamped() {
    let h = harness(
        Opts {
            context: 64,
            ..Opts::default()
        },
        |_| "ok".into(),
    );
    // Fits without max_tokens (the rest of the context is the budget).
    let (status, v) = post_json(&app(&h), "/v1/chat/completions", &user("hi")).await;
    assert_eq!(status, 200, "{v}");
    let p = v["usage"]["prompt_tokens"].as_u64().unwrap();
    for (field, n) in [("max_tokens", 64 - p), ("max_completion_tokens", 64 - p)] {
        let mut b = user("hi");
        b[field] = json!(n);
        assert_eq!(post_json(&app(&h), "/v1/chat/completions", &b).await.0, 200);
        b[field] = json!(n + 1);
        let (status, v) = post_json(&app(&h), "/v1/chat/completions", &b).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["code"], "context_length_exceeded");
        assert_eq!(
            v["error"]["message"],
            format!(
                "This model's maximum context length is 64 tokens. However, you requested 65 tokens ({p} in the messages, {} in the completion). Please reduce the length of the messages or completion.",
                n + 1
            )
        );
    }
}

#[tokio::test]
async fn tools_with_a_template_without_a_grammar_are_refused() {
    let template = ChatTemplate::from_source(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:",
        None,
        None,
    )
    .unwrap();
    let h = harness(
        Opts {
            template: Some(template),
            ..Opts::default()
        },
        |_| "ok".into(),
    );
    let mut b = user("x");
    b["tools"] = json!([weather_tool()]);
    let (status, v) = post_json(&app(&h), "/v1/chat/completions", &b).await;
    assert_eq!(status, 400);
    assert_error(&v, Some("tools"));
    assert!(v["error"]["message"].as_str().unwrap().contains("grammar"));
    // Without tools the same template works.
    assert_eq!(
        post_json(&app(&h), "/v1/chat/completions", &user("x"))
            .await
            .0,
        200
    );
}

#[tokio::test]
async fn api_key_is_required_on_v1_but_not_health_and_cors_allows_it() {
    let h = harness(
        Opts {
            api_key: Some("sekrit".into()),
            ..Opts::default()
        },
        |_| "ok".into(),
    );
    let app = app(&h);
    let (status, _, text) = send(&app, post("/v1/chat/completions", &user("x"))).await;
    assert_eq!(status, 401);
    assert_error(&serde_json::from_str(&text).unwrap(), None);
    let mut req = post("/v1/chat/completions", &user("x"));
    req.headers_mut()
        .insert("authorization", "Bearer wrong".parse().unwrap());
    assert_eq!(send(&app, req).await.0, 401);
    let mut req = post("/v1/chat/completions", &user("x"));
    req.headers_mut()
        .insert("authorization", "Bearer sekrit".parse().unwrap());
    assert_eq!(send(&app, req).await.0, 200);
    assert_eq!(send(&app, get("/health")).await.0, 200);
    let preflight = Request::options("/v1/chat/completions")
        .header("origin", "http://localhost:3000")
        .header("access-control-request-method", "POST")
        .header(
            "access-control-request-headers",
            "authorization,content-type",
        )
        .body(Body::empty())
        .unwrap();
    let (status, headers, _) = send(&app, preflight).await;
    assert!(status == 200 || status == 204, "{status}");
    let allowed = headers["access-control-allow-headers"]
        .to_str()
        .unwrap()
        .to_ascii_lowercase();
    assert!(allowed.contains("authorization"), "{allowed}");
    assert_eq!(
        headers["access-control-allow-origin"],
        "http://localhost:3000"
    );
}

static PANIC_STARTED: AtomicBool = AtomicBool::new(false);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_panic_fails_its_request_and_retires_the_engine() {
    let h = harness(
        Opts {
            queue_depth: 4,
            ..Opts::default()
        },
        |prompt| {
            if prompt.contains("PANIC") {
                PANIC_STARTED.store(true, Ordering::SeqCst);
                // Long enough for the next request to queue behind it.
                std::thread::sleep(std::time::Duration::from_millis(300));
                panic!("scripted engine failure");
            }
            "fine".into()
        },
    );
    let app = app(&h);
    assert_eq!(
        post_json(&app, "/v1/chat/completions", &user("hello"))
            .await
            .0,
        200
    );
    let failing = tokio::spawn({
        let app = app.clone();
        async move { post_json(&app, "/v1/chat/completions", &user("PANIC")).await }
    });
    while !PANIC_STARTED.load(Ordering::SeqCst) {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let mut b = user("queued behind the fault");
    b["stream"] = json!(true);
    let queued = tokio::spawn({
        let app = app.clone();
        async move { send(&app, post("/v1/chat/completions", &b)).await }
    });

    // The failing request gets the panic as a 500.
    let (status, v) = failing.await.unwrap();
    assert_eq!(status, 500, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("scripted engine failure"), "{msg}");
    // The queued one never reaches the engine: its stream ends with a 503-type error.
    let (status, _, text) = queued.await.unwrap();
    assert_eq!(status, 200, "{text}");
    let (events, done) = sse_events(&text);
    assert!(done, "{text}");
    let err = events
        .iter()
        .find_map(|e| e.get("error"))
        .expect("an error event");
    assert!(
        err["message"].as_str().unwrap().contains("engine failed"),
        "{err}"
    );

    // The engine is retired: health says so, and nothing more is run.
    let reason = tokio::time::timeout(std::time::Duration::from_secs(2), h.state.engine_fault())
        .await
        .expect("the fault is reported");
    assert!(reason.contains("scripted engine failure"), "{reason}");
    let (status, _, text) = send(&app, get("/health")).await;
    assert_eq!(status, 503, "{text}");
    let health: Health = serde_json::from_str(&text).unwrap();
    assert_eq!(health.status, HealthStatus::Error);
    assert!(health.error.unwrap().contains("scripted engine failure"));
    let produced = h.produced.load(Ordering::Relaxed);
    let (status, headers, text) = send(&app, post("/v1/chat/completions", &user("hello"))).await;
    assert_eq!(status, 503, "{text}");
    assert!(headers.contains_key("retry-after"));
    assert!(text.contains("engine failed"), "{text}");
    assert_eq!(h.produced.load(Ordering::Relaxed), produced);
    // Stats still answer.
    let (status, _, text) = send(&app, get("/v1/stats")).await;
    assert_eq!(status, 200);
    let stats: EngineStats = serde_json::from_str(&text).unwrap();
    assert_eq!(stats.requests_completed, 1);
    assert_eq!(stats.queue_len, 0);
}

fn engine_errors(prompt: &str) -> Option<EngineError> {
    if prompt.contains("OOM") {
        Some(EngineError::OutOfMemory(
            "16 MiB for the prompt's hidden states".into(),
        ))
    } else if prompt.contains("CUDA") {
        Some(EngineError::Backend(
            "CUDA driver call failed while decoding: an illegal memory access was encountered"
                .into(),
        ))
    } else {
        None
    }
}

#[tokio::test]
async fn only_fatal_engine_errors_retire_the_engine() {
    let h = harness(
        Opts {
            fail: Some(engine_errors),
            ..Opts::default()
        },
        |_| "fine".into(),
    );
    let app = app(&h);
    // Out of memory for one request: 503, and the engine stays in service.
    let (status, v) = post_json(&app, "/v1/chat/completions", &user("OOM")).await;
    assert_eq!(status, 503, "{v}");
    assert_eq!(send(&app, get("/health")).await.0, 200);
    assert_eq!(
        post_json(&app, "/v1/chat/completions", &user("x")).await.0,
        200
    );
    // A CUDA error leaves the engine in an unknown state: retired.
    let (status, v) = post_json(&app, "/v1/chat/completions", &user("CUDA")).await;
    assert_eq!(status, 500, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("illegal memory access")
    );
    let reason = tokio::time::timeout(std::time::Duration::from_secs(2), h.state.engine_fault())
        .await
        .expect("the fault is reported");
    assert!(reason.contains("illegal memory access"), "{reason}");
    let (status, _, text) = send(&app, get("/health")).await;
    assert_eq!(status, 503, "{text}");
    assert!(text.contains(r#""status":"error""#), "{text}");
    assert_eq!(
        post_json(&app, "/v1/chat/completions", &user("x")).await.0,
        503
    );
}

fn with_headers(mut req: Request<Body>, headers: &[(&'static str, &str)]) -> Request<Body> {
    for (k, v) in headers {
        req.headers_mut().insert(*k, v.parse().unwrap());
    }
    req
}

fn preflight(origin: &str) -> Request<Body> {
    Request::options("/v1/chat/completions")
        .header("origin", origin)
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", "content-type")
        .body(Body::empty())
        .unwrap()
}

#[tokio::test]
async fn cors_answers_loopback_and_configured_origins_only() {
    let h = harness(
        Opts {
            cors_origins: vec!["https://chat.example".into()],
            ..Opts::default()
        },
        |_| "ok".into(),
    );
    let app = app(&h);
    for origin in [
        "http://localhost:3000",
        "http://127.0.0.1:8080",
        "https://[::1]",
        "https://chat.example",
    ] {
        let (status, headers, _) = send(&app, preflight(origin)).await;
        assert!(status == 200 || status == 204, "{origin}: {status}");
        assert_eq!(headers["access-control-allow-origin"], origin);
        let req = with_headers(
            post("/v1/chat/completions", &user("x")),
            &[("origin", origin)],
        );
        let (status, headers, text) = send(&app, req).await;
        assert_eq!(status, 200, "{origin}: {text}");
        assert_eq!(headers["access-control-allow-origin"], origin);
    }
    for origin in [
        "https://evil.example",
        "http://localhost.evil.example",
        "null",
        "https://chat.example:8443",
    ] {
        let (_, headers, _) = send(&app, preflight(origin)).await;
        assert!(
            !headers.contains_key("access-control-allow-origin"),
            "{origin}: {headers:?}"
        );
        // A "simple" request (no preflight) is refused, not just left unreadable.
        let produced = h.produced.load(Ordering::Relaxed);
        let req = Request::post("/v1/chat/completions")
            .header("origin", origin)
            .header("content-type", "text/plain")
            .body(Body::from(user("x").to_string()))
            .unwrap();
        let (status, headers, text) = send(&app, req).await;
        assert_eq!(status, 403, "{origin}: {text}");
        assert!(!headers.contains_key("access-control-allow-origin"));
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_error(&v, None);
        assert_eq!(v["error"]["code"], "origin_not_allowed");
        assert_eq!(h.produced.load(Ordering::Relaxed), produced, "{origin} ran");
        let req = with_headers(get("/health"), &[("origin", origin)]);
        assert_eq!(send(&app, req).await.0, 403);
    }
    // `*` opens it to every origin, when asked for.
    let any = harness(
        Opts {
            cors_origins: vec!["*".into()],
            ..Opts::default()
        },
        |_| "ok".into(),
    );
    let (_, headers, _) = send(&common::app(&any), preflight("https://evil.example")).await;
    assert!(headers.contains_key("access-control-allow-origin"));
}

#[tokio::test]
async fn a_keyless_loopback_server_refuses_non_loopback_host_names() {
    let h = harness(Opts::default(), |_| "ok".into());
    let app = app(&h);
    for host in [
        "localhost:8080",
        "127.0.0.1:8080",
        "[::1]:8080",
        "localhost",
    ] {
        let req = with_headers(get("/health"), &[("host", host)]);
        assert_eq!(send(&app, req).await.0, 200, "{host}");
        let req = with_headers(post("/v1/chat/completions", &user("x")), &[("host", host)]);
        assert_eq!(send(&app, req).await.0, 200, "{host}");
    }
    for host in [
        "evil.example:8080",
        "evil.example",
        "192.168.1.5:8080",
        "localhost.evil.example",
    ] {
        for req in [
            get("/health"),
            get("/v1/models"),
            post("/v1/chat/completions", &user("x")),
        ] {
            let (status, _, text) = send(&app, with_headers(req, &[("host", host)])).await;
            assert_eq!(status, 403, "{host}: {text}");
            let v: Value = serde_json::from_str(&text).unwrap();
            assert_error(&v, None);
            assert_eq!(v["error"]["code"], "invalid_host", "{v}");
        }
    }
    // With a key (or a public bind) the check is off: other names reach it.
    let keyed = harness(
        Opts {
            api_key: Some("k".into()),
            check_host: false,
            ..Opts::default()
        },
        |_| "ok".into(),
    );
    let req = with_headers(get("/health"), &[("host", "llm.example:8080")]);
    assert_eq!(send(&common::app(&keyed), req).await.0, 200);
    assert!(ServerConfig::needs_host_check(
        "127.0.0.1".parse().unwrap(),
        None
    ));
    assert!(ServerConfig::needs_host_check("::1".parse().unwrap(), None));
    assert!(!ServerConfig::needs_host_check(
        "127.0.0.1".parse().unwrap(),
        Some("k")
    ));
    assert!(!ServerConfig::needs_host_check(
        "0.0.0.0".parse().unwrap(),
        None
    ));
}

#[tokio::test]
async fn an_over_limit_body_is_a_413_in_openai_shape() {
    let h = harness(Opts::default(), |_| "ok".into());
    let big = "x".repeat(krasis_server::api::BODY_LIMIT + 1);
    let (status, _, text) = send(&app(&h), post("/v1/chat/completions", &user(&big))).await;
    assert_eq!(status, 413);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_error(&v, None);
    assert_eq!(v["error"]["code"], "request_too_large");
    let (status, _, _) = send(&app(&h), post("/v1/completions", &json!({"prompt": big}))).await;
    assert_eq!(status, 413);
}

#[tokio::test]
async fn stop_sequences_are_bounded() {
    let h = harness(Opts::default(), |_| "ok".into());
    let app = app(&h);
    let long = "s".repeat(257);
    let bad = [
        json!(["a", "b", "c", "d", "e"]),
        json!([""]),
        json!(""),
        json!([long]),
    ];
    for stop in bad {
        for path in ["/v1/chat/completions", "/v1/completions"] {
            let mut b = user("x");
            b["prompt"] = json!("x");
            b["stop"] = stop.clone();
            let (status, v) = post_json(&app, path, &b).await;
            assert_eq!(status, 400, "{stop} {v}");
            assert_error(&v, Some("stop"));
        }
    }
    let mut b = user("x");
    b["stop"] = json!(["a", "b", "c", "s".repeat(256)]);
    assert_eq!(post_json(&app, "/v1/chat/completions", &b).await.0, 200);
    b["stop"] = json!([]);
    assert_eq!(post_json(&app, "/v1/chat/completions", &b).await.0, 200);
}
