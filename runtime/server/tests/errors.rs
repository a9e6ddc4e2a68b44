//! Error paths, auth, CORS, loading phase and panics, through the router.

mod common;

use axum::body::Body;
use axum::http::Request;
use common::*;
use krasis_common::status::{EngineStats, Health, Phase};
use krasis_model::SamplingParams;
use krasis_model::chat_template::ChatTemplate;
use krasis_server::{AppState, ServerConfig};
use serde_json::{Value, json};

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
async fn health_answers_while_loading_and_api_says_not_ready() {
    let state = AppState::new(ServerConfig {
        model_id: MODEL.into(),
        backend: "reference".into(),
        api_key: None,
        queue_depth: 1,
        default_sampling: SamplingParams::greedy(),
    });
    let app = krasis_server::router(state.clone());
    let (status, _, text) = send(&app, get("/health")).await;
    assert_eq!(status, 200);
    let health: Health = serde_json::from_str(&text).unwrap();
    assert_eq!(health.phase, Phase::Loading);
    assert!(!health.model_loaded);
    let (status, headers, text) = send(&app, post("/v1/chat/completions", &user("x"))).await;
    assert_eq!(status, 503);
    assert!(headers.contains_key("retry-after"));
    assert!(text.contains("loading"), "{text}");
    state.set_failed("weights missing".into());
    let (_, _, text) = send(&app, post("/v1/chat/completions", &user("x"))).await;
    assert!(text.contains("weights missing"), "{text}");
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
                b["response_format"] = json!({"type": "json_object"});
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
    // Unknown fields are ignored.
    let mut b = user("x");
    b["frobnicate"] = json!({"deep": [1]});
    b["user"] = json!("u1");
    b["response_format"] = json!({"type": "text"});
    assert_eq!(post_json(&app, "/v1/chat/completions", &b).await.0, 200);
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
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("64") && msg.contains("tokens"), "{msg}");
    let n: String = msg
        .chars()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(|c| c.is_ascii_digit())
        .collect();
    assert!(n.parse::<usize>().unwrap() > 64, "{msg}");
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

#[tokio::test]
async fn an_engine_panic_is_a_500_and_the_server_keeps_serving() {
    let h = harness(Opts::default(), |prompt| {
        if prompt.contains("PANIC") {
            panic!("scripted engine failure");
        }
        "fine".into()
    });
    let app = app(&h);
    let (status, v) = post_json(&app, "/v1/chat/completions", &user("PANIC")).await;
    assert_eq!(status, 500);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("scripted engine failure")
    );
    let mut b = user("PANIC");
    b["stream"] = json!(true);
    let (_, _, text) = send(&app, post("/v1/chat/completions", &b)).await;
    let (events, done) = sse_events(&text);
    assert!(done);
    assert!(events.iter().any(|e| e.get("error").is_some()), "{text}");
    let (status, v) = post_json(&app, "/v1/chat/completions", &user("hello")).await;
    assert_eq!(status, 200);
    assert_eq!(v["choices"][0]["message"]["content"], "fine");
    let (_, _, text) = send(&app, get("/v1/stats")).await;
    let stats: EngineStats = serde_json::from_str(&text).unwrap();
    assert_eq!(stats.requests_completed, 1);
    assert!(stats.last_generated_tokens > 0);
}
