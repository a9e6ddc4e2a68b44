//! Shared test harness: the real tiny checkpoint's tokenizer and chat
//! template with a scripted engine whose replies are chosen from the prompt.
#![allow(dead_code)]

use axum::Router;
use axum::body::Body;
use axum::http::{Request, Response};
use krasis_model::chat_template::ChatTemplate;
use krasis_model::testutil::tiny_checkpoint;
use krasis_model::tokenizer::Tokenizer;
use krasis_model::{EngineError, SamplingParams};
use krasis_server::testkit::ScriptedEngine;
use krasis_server::{AppState, ServerConfig};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tower::ServiceExt;

pub const MODEL: &str = "tiny-test";

pub fn model_dir() -> PathBuf {
    tiny_checkpoint("tiny")
}

/// Loaded once per test binary: building the real vocabulary takes a while.
pub fn tokenizer() -> Arc<Tokenizer> {
    static TOK: OnceLock<Arc<Tokenizer>> = OnceLock::new();
    TOK.get_or_init(|| {
        Arc::new(Tokenizer::from_dir(&model_dir()).expect("tiny checkpoint tokenizer"))
    })
    .clone()
}

pub struct Opts {
    pub template: Option<ChatTemplate>,
    pub api_key: Option<String>,
    pub queue_depth: usize,
    pub context: usize,
    pub token_delay: Duration,
    /// Simulated chunked prefill: (tokens per chunk, time per chunk).
    pub prefill: Option<(usize, Duration)>,
    /// Engine errors chosen from the prompt text.
    pub fail: Option<fn(&str) -> Option<EngineError>>,
    pub cors_origins: Vec<String>,
    pub check_host: bool,
    /// The engine reports HCS/VRAM figures (see `ScriptedEngine::with_cache_figures`).
    pub cache_figures: bool,
    /// The server's `--parallel` (default: the engine's capacity).
    pub parallel: Option<usize>,
    /// The engine's batch capacity and KV budget (`ScriptedEngine::with_*`).
    pub capacity: Option<usize>,
    pub kv_tokens: Option<usize>,
    /// The engine has a batch interface (else the server's one-at-a-time path).
    pub batching: bool,
    /// The model's tokenizer (default: the tiny checkpoint's, [`tokenizer`]).
    pub tokenizer: Option<Arc<Tokenizer>>,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            template: Some(
                ChatTemplate::from_dir(&model_dir())
                    .expect("template loads")
                    .expect("tiny checkpoint has a template"),
            ),
            api_key: None,
            queue_depth: 4,
            context: 2048,
            token_delay: Duration::ZERO,
            prefill: None,
            fail: None,
            cors_origins: Vec::new(),
            check_host: true,
            cache_figures: false,
            parallel: None,
            capacity: None,
            kv_tokens: None,
            batching: true,
            tokenizer: None,
        }
    }
}

pub struct Harness {
    pub state: Arc<AppState>,
    pub produced: Arc<AtomicUsize>,
    pub prefill_chunks: Arc<AtomicUsize>,
    /// Prefix cache saves the engine was asked for.
    pub saves: Arc<AtomicUsize>,
}

/// `reply(prompt_text) -> model output text`; the output is tokenized with
/// the real tokenizer (or `opts.tokenizer`) and ends with `<|im_end|>` (or
/// that tokenizer's first EOS when it has no `<|im_end|>`).
pub fn harness(opts: Opts, reply: impl Fn(&str) -> String + Send + 'static) -> Harness {
    try_harness(opts, reply).expect("install")
}

/// [`harness`], or why the server refused the engine (`install`'s error).
pub fn try_harness(
    opts: Opts,
    reply: impl Fn(&str) -> String + Send + 'static,
) -> Result<Harness, String> {
    let model_tok = opts.tokenizer.clone().unwrap_or_else(tokenizer);
    let tok = model_tok.clone();
    let im_end = tok
        .token_id("<|im_end|>")
        .unwrap_or_else(|| tok.eos_token_ids()[0]);
    let vocab = tok.vocab_size();
    let responder = Box::new(move |prompt: &[u32]| {
        let text = tok.decode(prompt, false).expect("decode prompt");
        let mut ids = tok.encode(&reply(&text)).expect("encode reply");
        ids.push(im_end);
        ids
    });
    let mut engine =
        ScriptedEngine::new(vocab, opts.context, responder).with_token_delay(opts.token_delay);
    if let Some((chunk, delay)) = opts.prefill {
        engine = engine.with_prefill(chunk, delay);
    }
    if opts.cache_figures {
        engine = engine.with_cache_figures();
    }
    if let Some(n) = opts.capacity {
        engine = engine.with_capacity(n);
    }
    if let Some(t) = opts.kv_tokens {
        engine = engine.with_kv_tokens(t);
    }
    if !opts.batching {
        engine = engine.without_batching();
    }
    if let Some(fail) = opts.fail {
        let tok = model_tok.clone();
        engine = engine.with_failure(Box::new(move |prompt: &[u32]| {
            fail(&tok.decode(prompt, false).expect("decode prompt"))
        }));
    }
    let produced = engine.produced.clone();
    let prefill_chunks = engine.prefill_chunks.clone();
    let saves = engine.saves.clone();
    let state = AppState::new(ServerConfig {
        model_id: MODEL.into(),
        backend: "scripted".into(),
        api_key: opts.api_key,
        queue_depth: opts.queue_depth,
        parallel: opts.parallel,
        default_sampling: SamplingParams::greedy(),
        cors_origins: opts.cors_origins,
        check_host: opts.check_host,
        ..ServerConfig::default()
    });
    state
        .install(Box::new(engine), model_tok, opts.template)
        .map_err(|e| e.to_string())?;
    Ok(Harness {
        state,
        produced,
        prefill_chunks,
        saves,
    })
}

pub fn app(h: &Harness) -> Router {
    krasis_server::router(h.state.clone())
}

pub async fn send(app: &Router, req: Request<Body>) -> (u16, axum::http::HeaderMap, String) {
    let resp: Response<Body> = app.clone().oneshot(req).await.expect("router answers");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .expect("body");
    (
        status,
        headers,
        String::from_utf8(body.to_vec()).expect("utf8"),
    )
}

pub fn post(path: &str, body: &Value) -> Request<Body> {
    Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap()
}

pub fn get(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).unwrap()
}

pub async fn post_json(app: &Router, path: &str, body: &Value) -> (u16, Value) {
    let (status, _, text) = send(app, post(path, body)).await;
    let v = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    (status, v)
}

/// The JSON payloads of an SSE body, and whether it ended with `[DONE]`.
pub fn sse_events(body: &str) -> (Vec<Value>, bool) {
    let mut events = Vec::new();
    let mut done = false;
    for line in body.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
        } else {
            events.push(serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}")));
        }
    }
    (events, done)
}

pub fn weather_tool() -> Value {
    serde_json::json!({
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"}
                },
                "required": ["city"]
            }
        }
    })
}

/// Checks a streamed `get_weather(city: Paris, days: 2)` call in `events`
/// (SSE chunks) has the OpenAI shape: the first fragment carries index 0,
/// the name and a `call_` id, the fragments' arguments join into that JSON,
/// and the finish reason is `tool_calls`. Returns the fragments.
pub fn assert_streamed_weather_call(events: &[Value]) -> Vec<&Value> {
    let frags: Vec<&Value> = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"].get("tool_calls"))
        .flat_map(|t| t.as_array().unwrap())
        .collect();
    assert_eq!(frags[0]["index"], 0);
    assert_eq!(frags[0]["function"]["name"], "get_weather");
    assert!(frags[0]["id"].as_str().unwrap().starts_with("call_"));
    let args: String = frags
        .iter()
        .map(|f| f["function"]["arguments"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&args).unwrap(),
        serde_json::json!({"city": "Paris", "days": 2})
    );
    let finish = events
        .iter()
        .find_map(|e| e["choices"][0]["finish_reason"].as_str());
    assert_eq!(finish, Some("tool_calls"));
    frags
}

/// "Weather in Paris?" with the weather tool, streamed: the SSE events
/// (after checking the stream ended with `[DONE]`) and the raw text.
pub async fn stream_weather(h: &Harness) -> (Vec<Value>, String) {
    let body = serde_json::json!({"model": MODEL, "stream": true, "tools": [weather_tool()],
        "messages": [{"role": "user", "content": "Weather in Paris?"}]});
    let (_, _, text) = send(&app(h), post("/v1/chat/completions", &body)).await;
    let (events, done) = sse_events(&text);
    assert!(done, "{text}");
    (events, text)
}

/// A named `tool_choice` of the weather tool, answered whole and then
/// streamed: both carry the call `{"city": "Paris", "days": 2}` (the
/// harness's model must write it after the server's forced opening).
pub async fn assert_named_weather_call(h: &Harness) {
    let mut body = serde_json::json!({"model": MODEL,
        "messages": [{"role": "user", "content": "Weather in Paris?"}]});
    body["tools"] = serde_json::json!([weather_tool()]);
    body["tool_choice"] =
        serde_json::json!({"type": "function", "function": {"name": "get_weather"}});
    let (status, v) = post_json(&app(h), "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let call = &v["choices"][0]["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather", "{v}");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, serde_json::json!({"city": "Paris", "days": 2}));
    body["stream"] = serde_json::json!(true);
    let (_, _, text) = send(&app(h), post("/v1/chat/completions", &body)).await;
    let (events, done) = sse_events(&text);
    assert!(done);
    assert_streamed_weather_call(&events);
}

/// Serves `h` on a loopback socket until the test ends; its base URL.
pub async fn serve_loopback(h: &Harness) -> String {
    serve_loopback_until(h, std::future::pending()).await.0
}

pub type Serving = tokio::task::JoinHandle<std::io::Result<krasis_server::Stopped>>;

/// Serves `h` on a loopback socket until `stop` resolves (or the engine
/// faults); its base URL and the serving task.
pub async fn serve_loopback_until(
    h: &Harness,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> (String, Serving) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    (
        url,
        tokio::spawn(krasis_server::serve(listener, h.state.clone(), stop)),
    )
}
