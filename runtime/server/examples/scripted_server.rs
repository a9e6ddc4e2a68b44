//! The real server (router, queue, tokenizer, chat template, parsers) over a
//! scripted engine, for end-to-end client tests that need exact model output
//! such as a tool call. Not a product feature: `krasis-runtime serve` has no
//! way to select it.
//!
//! ```text
//! scripted_server --model DIR --replies FILE [--port N] [--template qwen3-coder]
//!                 [--token-delay-ms N] [--queue-depth N] [--parallel N]
//! ```
//! FILE is a JSON list of `{"when": "substring of the rendered prompt",
//! "reply": "model output"}` or `{"when": ..., "panic": "message"}` (the
//! engine panics: an engine fault); the first rule whose `when` occurs in the
//! prompt wins (`""` matches everything). Prints a `ready` progress event
//! with the URL on stdout once listening. Exits 0 after Ctrl-C / SIGTERM and
//! with `EXIT_ENGINE_FAULT` after an engine fault, like `krasis-runtime serve`.

use krasis_common::ProgressEvent;
use krasis_model::SamplingParams;
use krasis_model::chat_template::{ChatTemplate, QWEN3_CODER_CHAT_TEMPLATE};
use krasis_model::tokenizer::Tokenizer;
use krasis_server::testkit::ScriptedEngine;
use krasis_server::{AppState, ServerConfig};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

struct Args {
    model: PathBuf,
    replies: PathBuf,
    port: u16,
    coder_template: bool,
    token_delay_ms: u64,
    queue_depth: usize,
    /// Requests decoding together (default: the scripted engine's capacity).
    parallel: Option<usize>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        model: PathBuf::new(),
        replies: PathBuf::new(),
        port: 0,
        coder_template: false,
        token_delay_ms: 0,
        queue_depth: 4,
        parallel: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => a.model = value()?.into(),
            "--replies" => a.replies = value()?.into(),
            "--port" => a.port = value()?.parse().map_err(|e| format!("--port: {e}"))?,
            "--template" => match value()?.as_str() {
                "qwen3-coder" => a.coder_template = true,
                "model" => a.coder_template = false,
                other => return Err(format!("--template {other}: use 'model' or 'qwen3-coder'")),
            },
            "--token-delay-ms" => {
                a.token_delay_ms = value()?
                    .parse()
                    .map_err(|e| format!("--token-delay-ms: {e}"))?
            }
            "--queue-depth" => {
                a.queue_depth = value()?
                    .parse()
                    .map_err(|e| format!("--queue-depth: {e}"))?
            }
            "--parallel" => {
                a.parallel = Some(value()?.parse().map_err(|e| format!("--parallel: {e}"))?)
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if a.model.as_os_str().is_empty() || a.replies.as_os_str().is_empty() {
        return Err("--model and --replies are required".into());
    }
    Ok(a)
}

fn main() -> Result<(), String> {
    let args = parse_args()?;
    let text = std::fs::read_to_string(&args.replies)
        .map_err(|e| format!("reading {}: {e}", args.replies.display()))?;
    let rules: Vec<serde_json::Value> = serde_json::from_str(&text)
        .map_err(|e| format!("parsing {}: {e}", args.replies.display()))?;
    let rules: Vec<(String, Result<String, String>)> = rules
        .iter()
        .map(|r| {
            let s = |k: &str| r.get(k).and_then(|v| v.as_str()).map(String::from);
            let reply = s("reply").map(Ok).or_else(|| s("panic").map(Err));
            s("when")
                .zip(reply)
                .ok_or_else(|| format!("rule {r} needs string 'when' and 'reply' (or 'panic')"))
        })
        .collect::<Result<_, _>>()?;

    let tok = Arc::new(Tokenizer::from_dir(&args.model).map_err(|e| e.to_string())?);
    let template = if args.coder_template {
        Some(
            ChatTemplate::from_source(QWEN3_CODER_CHAT_TEMPLATE, None, Some("<|im_end|>".into()))
                .map_err(|e| e.to_string())?,
        )
    } else {
        ChatTemplate::from_dir(&args.model).map_err(|e| e.to_string())?
    };
    // Qwen's end of turn is appended to every reply; a harmony (gpt-oss)
    // reply ends with its own `<|return|>` or `<|call|>`.
    let im_end = tok.token_id("<|im_end|>");
    let rtok = tok.clone();
    let responder = Box::new(move |prompt: &[u32]| {
        let text = rtok.decode(prompt, false).unwrap_or_default();
        let reply = match rules.iter().find(|(when, _)| text.contains(when.as_str())) {
            Some((_, Ok(reply))) => reply.as_str(),
            Some((_, Err(message))) => panic!("{message}"),
            None => "",
        };
        let mut ids = rtok.encode(reply).unwrap_or_default();
        ids.extend(im_end);
        ids
    });
    let engine = ScriptedEngine::new(tok.vocab_size(), 4096, responder)
        .with_token_delay(Duration::from_millis(args.token_delay_ms));
    let state = AppState::new(ServerConfig {
        model_id: "scripted".into(),
        backend: "scripted".into(),
        api_key: None,
        queue_depth: args.queue_depth,
        parallel: args.parallel,
        default_sampling: SamplingParams::greedy(),
        ..ServerConfig::default()
    });
    state
        .install(Box::new(engine), tok, template)
        .map_err(|e| e.to_string())?;

    let rt = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", args.port))
            .await
            .map_err(|e| format!("binding port {}: {e}", args.port))?;
        let url = format!(
            "http://{}",
            listener.local_addr().map_err(|e| e.to_string())?
        );
        println!(
            "{}",
            ProgressEvent::Ready {
                url,
                model: "scripted".into()
            }
            .to_line()
        );
        let shutdown = async {
            #[cfg(unix)]
            {
                use tokio::signal::unix::{SignalKind, signal};
                let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            #[cfg(not(unix))]
            let _ = tokio::signal::ctrl_c().await;
        };
        match krasis_server::serve(listener, state, shutdown).await {
            Ok(krasis_server::Stopped::Shutdown) => Ok(()),
            Ok(krasis_server::Stopped::EngineFault(reason)) => {
                eprintln!("engine fault: {reason}");
                std::process::exit(krasis_common::status::EXIT_ENGINE_FAULT);
            }
            Err(e) => Err(e.to_string()),
        }
    })
}
