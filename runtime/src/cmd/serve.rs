//! `krasis-runtime serve`: bind first (so `/health` answers while the model
//! loads), load the engine, tokenizer and chat template, then serve the
//! OpenAI-compatible API until Ctrl-C / SIGTERM.

use super::engines::{EngineArgs, load_engine};
use anyhow::{Context, bail};
use krasis_common::options::HeatmapChoice;
use krasis_common::{Backend, LaunchOptions, Phase, ProgressEvent};
use krasis_model::SamplingParams;
use krasis_model::chat_template::ChatTemplate;
use krasis_model::tokenizer::Tokenizer;
use krasis_server::{AppState, ServerConfig};
use std::path::Path;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address to bind. Anything but loopback needs --api-key or --insecure-public.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer <KEY>` on every /v1 request.
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Allow a non-loopback bind without an API key (anyone who can reach
    /// the port can use the model).
    #[arg(long)]
    pub insecure_public: bool,
    /// Requests allowed to wait while one runs; more get 503 + Retry-After.
    #[arg(long, default_value_t = 16)]
    pub queue_depth: u32,
    /// Write JSON-lines progress events to stdout (logs stay on stderr).
    #[arg(long)]
    pub progress_json: bool,
    /// Model id clients use (default: the model directory's name).
    #[arg(long, value_name = "NAME")]
    pub served_model_name: Option<String>,
    /// Routed expert precision in the expert cache (cuda backend).
    #[arg(long, default_value = "int4")]
    pub expert_precision: String,
    /// Attention weight and activation precision (cuda backend).
    #[arg(long, default_value = "bf16")]
    pub attention_precision: String,
    /// KV cache element format (cuda backend).
    #[arg(long, default_value = "bf16")]
    pub kv_format: String,
    /// Expert pruning; "off" is exact (cuda backend).
    #[arg(long, default_value = "off")]
    pub pruning: String,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub gpu: u32,
}

impl Args {
    /// The launch options these flags describe, so the launcher's validation
    /// rules (public bind needs a key, ...) are applied here too.
    pub fn launch_options(&self) -> LaunchOptions {
        LaunchOptions {
            model: self.engine.model.clone(),
            backend: self.engine.backend,
            host: self.host.clone(),
            port: self.port,
            api_key: self.api_key.clone(),
            insecure_public: self.insecure_public,
            context_length: self.engine.context_length.map(|c| c as u32),
            expert_precision: self.expert_precision.clone(),
            attention_precision: self.attention_precision.clone(),
            kv_format: self.kv_format.clone(),
            vram_limit_bytes: self.engine.vram_limit,
            safety_margin_mib: self.engine.safety_margin_mib,
            hcs: self.engine.hcs == "on",
            heatmap: HeatmapChoice::parse(&self.engine.heatmap),
            pruning: self.pruning.clone(),
            cache_dir: self.engine.cache_dir.clone(),
            queue_depth: self.queue_depth,
            gpu: self.gpu,
        }
    }
}

/// GPU tuning flags set away from their defaults would be silently ignored
/// by the CPU reference engine, so they are refused instead.
fn check_backend_flags(o: &LaunchOptions) -> anyhow::Result<()> {
    if o.backend != Backend::Reference {
        return Ok(());
    }
    let d = LaunchOptions::default();
    let ignored = [
        (
            "--expert-precision",
            o.expert_precision != d.expert_precision,
        ),
        (
            "--attention-precision",
            o.attention_precision != d.attention_precision,
        ),
        ("--kv-format", o.kv_format != d.kv_format),
        (
            "--safety-margin-mib",
            o.safety_margin_mib != d.safety_margin_mib,
        ),
        // No `--hcs` entry: `off` states what the reference engine does (the
        // launcher sends it for reference launches) and `on` is the default.
        ("--heatmap", o.heatmap != d.heatmap),
        ("--pruning", o.pruning != d.pruning),
        ("--gpu", o.gpu != d.gpu),
    ];
    if let Some((flag, _)) = ignored.iter().find(|(_, set)| *set) {
        bail!(
            "{flag} applies to the cuda backend; the reference backend computes in f32 on the CPU and would ignore it"
        );
    }
    Ok(())
}

fn emit(progress: bool, ev: ProgressEvent) {
    if progress {
        println!("{}", ev.to_line());
    }
}

/// Sampling defaults from the checkpoint's `generation_config.json` (what the
/// model's authors recommend), else OpenAI's (temperature 1).
fn default_sampling(model: &Path) -> anyhow::Result<SamplingParams> {
    let mut s = SamplingParams {
        temperature: 1.0,
        ..SamplingParams::default()
    };
    let path = model.join("generation_config.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(s);
    };
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let f = |k: &str| v.get(k).and_then(serde_json::Value::as_f64);
    if let Some(t) = f("temperature") {
        s.temperature = t as f32;
    }
    if let Some(p) = f("top_p") {
        s.top_p = p as f32;
    }
    if let Some(k) = v.get("top_k").and_then(serde_json::Value::as_u64) {
        s.top_k = k as usize;
    }
    if let Some(m) = f("min_p") {
        s.min_p = m as f32;
    }
    if v.get("do_sample") == Some(&serde_json::Value::Bool(false)) {
        s.temperature = 0.0;
    }
    Ok(s)
}

fn model_id(args: &Args) -> String {
    args.served_model_name.clone().unwrap_or_else(|| {
        let p = &args.engine.model;
        p.canonicalize()
            .ok()
            .as_deref()
            .unwrap_or(p)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| p.display().to_string())
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutting down");
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let progress = args.progress_json;
    let result = start(args);
    if let Err(e) = &result {
        emit(
            progress,
            ProgressEvent::Fatal {
                message: format!("{e:#}"),
            },
        );
    }
    result
}

fn start(args: Args) -> anyhow::Result<()> {
    let opts = args.launch_options();
    opts.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
    check_backend_flags(&opts)?;
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(serve(args))
}

async fn serve(args: Args) -> anyhow::Result<()> {
    let progress = args.progress_json;
    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| {
            format!("binding {addr} (is another server using the port? pick another with --port)")
        })?;
    let local = listener.local_addr()?;
    let url = format!("http://{local}");
    let config = ServerConfig {
        model_id: model_id(&args),
        backend: args.engine.backend.as_str().to_string(),
        api_key: args.api_key.clone(),
        queue_depth: args.queue_depth as usize,
        default_sampling: default_sampling(&args.engine.model)?,
    };
    let model_name = config.model_id.clone();
    let state = AppState::new(config);
    let server = tokio::spawn(krasis_server::serve(
        listener,
        state.clone(),
        shutdown_signal(),
    ));
    tracing::info!(
        "listening on {url}; loading {}",
        args.engine.model.display()
    );
    emit(
        progress,
        ProgressEvent::Phase {
            phase: "loading".into(),
            detail: format!(
                "loading {} ({} backend)",
                args.engine.model.display(),
                args.engine.backend.as_str()
            ),
        },
    );

    let load_state = state.clone();
    let engine_args = args.engine.clone();
    let loaded = tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        let engine = load_engine(&engine_args)?;
        // What calibration decided, for the launcher's run screen.
        if let Some(h) = engine.stats().and_then(|s| s.hcs) {
            emit(
                progress,
                ProgressEvent::HcsDecision {
                    resident_experts: h.resident_experts,
                    total_experts: h.total_experts,
                    bytes: h.resident_bytes,
                    safety_margin_bytes: h.safety_margin_bytes,
                },
            );
        }
        let dir = &engine_args.model;
        let tokenizer = Tokenizer::from_dir(dir)
            .with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
        let template = ChatTemplate::from_dir(dir)
            .with_context(|| format!("loading the chat template of {}", dir.display()))?;
        if template.is_none() {
            tracing::warn!(
                "{} has no chat template: only /v1/completions will work",
                dir.display()
            );
        }
        load_state
            .install(engine, std::sync::Arc::new(tokenizer), template)
            .context("starting the engine thread")?;
        Ok(())
    })
    .await
    .context("the loading thread panicked")?;
    if let Err(e) = loaded {
        state.set_failed(format!("{e:#}"));
        server.abort();
        return Err(e);
    }
    debug_assert_eq!(state.phase(), Phase::Ready);
    tracing::info!("ready: {url}/v1 serves '{model_name}'");
    emit(
        progress,
        ProgressEvent::Ready {
            url,
            model: model_name,
        },
    );
    server
        .await
        .context("the server task panicked")?
        .context("serving HTTP")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        serve: Args,
    }

    fn parse(args: Vec<String>) -> Args {
        let mut argv = vec!["serve".to_string()];
        argv.extend(args);
        Cli::try_parse_from(argv).unwrap().serve
    }

    #[test]
    fn every_launcher_argument_is_accepted_and_round_trips() {
        let full = LaunchOptions {
            model: "/models/q".into(),
            backend: Backend::Reference,
            host: "0.0.0.0".into(),
            port: 9000,
            api_key: Some("k".into()),
            insecure_public: true,
            context_length: Some(4096),
            vram_limit_bytes: Some(8 << 30),
            cache_dir: Some("/c".into()),
            heatmap: HeatmapChoice::File("/h.json".into()),
            hcs: false,
            queue_depth: 3,
            gpu: 1,
            safety_margin_mib: 700,
            ..Default::default()
        };
        let defaults = LaunchOptions {
            model: "/m".into(),
            ..Default::default()
        };
        for o in [defaults, full] {
            let args = parse(o.to_serve_args());
            assert!(args.progress_json);
            assert_eq!(args.launch_options(), o);
        }
    }

    #[test]
    fn public_bind_without_key_is_refused_by_the_shared_rule() {
        let o = parse(vec![
            "--model".into(),
            "m".into(),
            "--host".into(),
            "0.0.0.0".into(),
        ])
        .launch_options();
        assert_eq!(o.validate().unwrap_err().option, "host");
    }

    #[test]
    fn reference_backend_refuses_gpu_only_settings() {
        let mut o = LaunchOptions {
            model: "m".into(),
            backend: Backend::Reference,
            ..Default::default()
        };
        check_backend_flags(&o).unwrap();
        o.pruning = "top4".into();
        assert!(
            check_backend_flags(&o)
                .unwrap_err()
                .to_string()
                .contains("--pruning")
        );
    }
}
