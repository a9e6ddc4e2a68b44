//! `krasis-runtime serve`: bind first (so `/health` answers while the model
//! loads), load the engine, tokenizer and chat template, then serve the
//! OpenAI-compatible API until Ctrl-C / SIGTERM.

use super::engines::{EngineArgs, load_engine_reporting};
use anyhow::{Context, bail};
use krasis_common::events::EventSink;
use krasis_common::options::{API_KEY_ARGV_REFUSED, HeatmapChoice, read_api_key_file};
use krasis_common::status::EXIT_ENGINE_FAULT;
use krasis_common::{API_KEY_ENV, Backend, Capabilities, LaunchOptions, Phase, ProgressEvent};
use krasis_model::SamplingParams;
use krasis_model::chat_template::ChatTemplate;
use krasis_model::tokenizer::Tokenizer;
use krasis_server::{AppState, ServerConfig};
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address to bind. Anything but loopback needs an API key
    /// (--api-key-file or KRASIS_API_KEY) or --insecure-public.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer <KEY>` on every /v1 request, the key
    /// being this file's contents (one line; the file must not be readable by
    /// group or others). The KRASIS_API_KEY environment variable is the other
    /// way to give a key; this flag wins over it.
    #[arg(long, value_name = "PATH")]
    pub api_key_file: Option<PathBuf>,
    /// Refused: other users can read a process's arguments. Use
    /// --api-key-file or KRASIS_API_KEY.
    #[arg(long = "api-key", value_name = "KEY", hide = true)]
    pub api_key_argv: Option<String>,
    /// The API key in force, from --api-key-file or KRASIS_API_KEY (set by
    /// the serve path before the server starts; never a flag).
    #[arg(skip)]
    pub api_key: Option<String>,
    /// Allow browser pages from this origin (scheme://host[:port], or `*` for
    /// any) to call the API; repeatable. Default: loopback origins only.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    pub cors_origins: Vec<String>,
    /// Allow a non-loopback bind without an API key (anyone who can reach
    /// the port can use the model).
    #[arg(long)]
    pub insecure_public: bool,
    /// Requests allowed to wait while `--parallel` run; more get 503 +
    /// Retry-After.
    #[arg(long, default_value_t = 16)]
    pub queue_depth: u32,
    /// The most requests decoding together (continuous batching), 1 to 8
    /// (default: the engine's capacity: 8 for the reference engine; cuda:
    /// one per 512 KV arena rows, at most 8, 1 for gpt_oss). The cuda
    /// engine sizes its per-sequence state for it; more than the engine
    /// can run is refused.
    #[arg(long, value_name = "N")]
    pub parallel: Option<u32>,
    /// Keep the prefix cache across restarts: write its blocks to this file
    /// at a graceful shutdown (SIGINT/SIGTERM; atomically, within two
    /// minutes) and load them at startup. A file written by another model,
    /// setting, block size, GPU, driver or build is refused (remove it to
    /// start empty); so is a damaged one.
    #[arg(long, value_name = "PATH")]
    pub prefix_cache_file: Option<PathBuf>,
    /// Write JSON-lines progress events to stdout (logs stay on stderr).
    #[arg(long)]
    pub progress_json: bool,
    /// Model id clients use (default: the model directory's name).
    #[arg(long, value_name = "NAME")]
    pub served_model_name: Option<String>,
    /// Routed expert precision in the expert cache (cuda backend; default:
    /// the architecture's, e.g. int4 for qwen3_moe, mxfp4 for gpt_oss).
    #[arg(long)]
    pub expert_precision: Option<String>,
    /// Attention weight and activation precision (cuda backend; default:
    /// the architecture's).
    #[arg(long)]
    pub attention_precision: Option<String>,
    /// KV cache element format (cuda backend; default: the architecture's).
    #[arg(long)]
    pub kv_format: Option<String>,
    /// MLP block activation and weight precision (cuda backend; default:
    /// the architecture's, e.g. fp16 for glm4_moe).
    #[arg(long)]
    pub mlp_precision: Option<String>,
    /// Expert pruning; "off" is exact (cuda backend; default: the
    /// architecture's).
    #[arg(long)]
    pub pruning: Option<String>,
}

impl Args {
    /// The launch options these flags describe, so the launcher's validation
    /// rules (public bind needs a key, ...) are applied here too. `api_key`
    /// is the key in force once [`resolve_api_key`] has run.
    pub fn launch_options(&self) -> LaunchOptions {
        let d = LaunchOptions::default();
        LaunchOptions {
            model: self.engine.model.clone(),
            backend: self.engine.backend,
            host: self.host.clone(),
            port: self.port,
            api_key: self.api_key.clone(),
            api_key_file: self.api_key_file.clone(),
            insecure_public: self.insecure_public,
            context_length: self.engine.context_length.map(|c| c as u32),
            expert_precision: self.expert_precision.clone().unwrap_or(d.expert_precision),
            attention_precision: self
                .attention_precision
                .clone()
                .unwrap_or(d.attention_precision),
            kv_format: self.kv_format.clone().unwrap_or(d.kv_format),
            mlp_precision: self.mlp_precision.clone().unwrap_or(d.mlp_precision),
            vram_limit_bytes: self.engine.vram_limit,
            safety_margin_mib: self.engine.safety_margin_mib,
            hcs: self.engine.hcs_enabled(),
            heatmap: HeatmapChoice::parse(&self.engine.heatmap),
            pruning: self.pruning.clone().unwrap_or(d.pruning),
            cache_dir: self.engine.cache_dir.clone(),
            queue_depth: self.queue_depth,
            parallel: self.parallel,
            kv_tokens: self.engine.kv_tokens,
            gpu: self.engine.gpu,
            prefix_cache: self.engine.prefix_cache.unwrap_or_default(),
            prefix_cache_host: self.engine.prefix_cache_host.unwrap_or_default(),
            prefix_block: self
                .engine
                .prefix_block
                .unwrap_or(krasis_common::options::DEFAULT_PREFIX_BLOCK),
            prefix_cache_file: self.prefix_cache_file.clone(),
            cors_origins: self.cors_origins.clone(),
        }
    }
}

/// [`Args::launch_options`] with every engine flag not given taken from the
/// defaults `caps` states for the model's architecture (an MXFP4 gpt_oss
/// model runs its native MXFP4 experts without `--expert-precision`). An
/// architecture `caps` does not know keeps the generic defaults; the
/// capability check then names it.
fn resolved_options(args: &Args, caps: &Capabilities) -> LaunchOptions {
    let mut o = args.launch_options();
    let arch = model_type(&args.engine.model)
        .ok()
        .and_then(|t| caps.architecture(&t).cloned());
    if let Some(a) = arch {
        let d = &a.defaults;
        for (given, field, default) in [
            (
                &args.expert_precision,
                &mut o.expert_precision,
                &d.expert_precision,
            ),
            (
                &args.attention_precision,
                &mut o.attention_precision,
                &d.attention_precision,
            ),
            (&args.kv_format, &mut o.kv_format, &d.kv_format),
            (&args.mlp_precision, &mut o.mlp_precision, &d.mlp_precision),
            (&args.pruning, &mut o.pruning, &d.pruning),
        ] {
            if given.is_none() {
                *field = default.clone();
            }
        }
    }
    o
}

/// The API key the server requires: `--api-key-file`'s contents, else
/// `env_key` (`KRASIS_API_KEY`), else none. `--api-key KEY` is refused
/// without echoing the key.
fn resolve_api_key(args: &Args, env_key: Option<String>) -> anyhow::Result<Option<String>> {
    if args.api_key_argv.is_some() {
        bail!("{API_KEY_ARGV_REFUSED}");
    }
    match &args.api_key_file {
        Some(p) => {
            if env_key.is_some() {
                tracing::info!("{API_KEY_ENV} is set but --api-key-file is given; using the file");
            }
            Ok(Some(
                read_api_key_file(p).map_err(|e| anyhow::anyhow!("{e}"))?,
            ))
        }
        None => Ok(env_key),
    }
}

/// The `model_type` in the model directory's config.json (read as text, so
/// an architecture this build does not know is reported by the capability
/// check, with the list of those it does).
fn model_type(model: &Path) -> anyhow::Result<String> {
    let path = model.join("config.json");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "reading {} (give a Hugging Face model directory)",
            path.display()
        )
    })?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    v.get("model_type")
        .and_then(serde_json::Value::as_str)
        .map(str::to_string)
        .with_context(|| format!("{} has no \"model_type\"", path.display()))
}

/// Every check made before binding, in the launcher's words: the option
/// rules ([`LaunchOptions::validate`]), then what this runtime implements for
/// the model's architecture (`caps.check_options`, the very function the
/// launcher calls), then flags the chosen backend would ignore.
fn check_options(opts: &LaunchOptions, caps: &Capabilities) -> anyhow::Result<()> {
    opts.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
    let model_type = model_type(&opts.model)?;
    caps.check_options(opts, &model_type)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let arch_defaults = caps.default_options(&model_type).unwrap_or_default();
    check_backend_flags(opts, &arch_defaults)
}

/// GPU tuning flags set away from their defaults (the architecture's
/// `arch` for the precisions, formats and pruning) would be silently ignored
/// by the CPU reference engine, so they are refused instead.
fn check_backend_flags(o: &LaunchOptions, arch: &LaunchOptions) -> anyhow::Result<()> {
    if o.backend != Backend::Reference {
        return Ok(());
    }
    let d = LaunchOptions::default();
    let ignored = [
        (
            "--expert-precision",
            o.expert_precision != arch.expert_precision,
        ),
        (
            "--attention-precision",
            o.attention_precision != arch.attention_precision,
        ),
        ("--kv-format", o.kv_format != arch.kv_format),
        ("--mlp-precision", o.mlp_precision != arch.mlp_precision),
        (
            "--safety-margin-mib",
            o.safety_margin_mib != d.safety_margin_mib,
        ),
        // No `--hcs` entry: `off` states what the reference engine does (the
        // launcher sends it for reference launches), and `on` is refused by
        // the capability check (HCS needs the cuda backend).
        ("--heatmap", o.heatmap != d.heatmap),
        ("--pruning", o.pruning != arch.pruning),
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

/// `serve` ended because the engine faulted (a panic or a CUDA error): the
/// engine is never reused, so the process exits with [`EXIT_ENGINE_FAULT`]
/// for the launcher's supervisor to restart it.
#[derive(Debug)]
struct EngineFault(String);

impl std::fmt::Display for EngineFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "engine fault: {}", self.0)
    }
}

impl std::error::Error for EngineFault {}

/// The exit status `run` ends the process with itself, when the generic
/// failure status (1) would hide what happened.
fn special_exit(result: &anyhow::Result<()>) -> Option<i32> {
    let e = result.as_ref().err()?;
    e.downcast_ref::<EngineFault>().map(|_| EXIT_ENGINE_FAULT)
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
    if let (Some(code), Err(e)) = (special_exit(&result), &result) {
        eprintln!("error: {e:#}");
        std::process::exit(code);
    }
    result
}

fn start(mut args: Args) -> anyhow::Result<()> {
    args.api_key = resolve_api_key(&args, std::env::var(API_KEY_ENV).ok())?;
    // A server keeps prompt prefixes unless told not to.
    args.engine
        .prefix_cache
        .get_or_insert(krasis_common::options::PrefixCacheChoice::Auto);
    args.engine
        .prefix_cache_host
        .get_or_insert(krasis_common::options::PrefixCacheChoice::Auto);
    // The key is in force now; its file was read (and is checked again below
    // through the key itself).
    let caps = super::capabilities::report();
    let opts = LaunchOptions {
        api_key_file: None,
        ..resolved_options(&args, &caps)
    };
    check_options(&opts, &caps)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let result = rt.block_on(serve(args));
    // Blocking work still running (a prompt being tokenized, a load cut
    // short by a shutdown) is not waited for: the process is exiting.
    rt.shutdown_timeout(std::time::Duration::from_millis(100));
    result
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
        parallel: args.parallel.map(|n| n as usize),
        default_sampling: default_sampling(&args.engine.model)?,
        cors_origins: args.cors_origins.clone(),
        check_host: ServerConfig::needs_host_check(local.ip(), args.api_key.as_deref()),
        stop_limit: match args.prefix_cache_file {
            Some(_) => krasis_common::options::PREFIX_FILE_SAVE_LIMIT,
            None => krasis_server::DRAIN,
        },
    };
    let model_name = config.model_id.clone();
    let state = AppState::new(config);
    let mut server = tokio::spawn(krasis_server::serve(
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
    let mut engine_args = args.engine.clone();
    engine_args.parallel = args.parallel;
    engine_args.prefix_cache_file = args.prefix_cache_file.clone();
    let loading = tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        // Byte progress of the load's long steps, for the launcher's bar.
        let sink = |e: ProgressEvent| emit(progress, e);
        let sink: EventSink<'_> = &sink;
        let engine = load_engine_reporting(&engine_args, progress.then_some(sink))?;
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
    });
    // A shutdown while loading ends the process without waiting for the load.
    let loaded = tokio::select! {
        loaded = loading => loaded.context("the loading thread panicked")?,
        ended = &mut server => return stopped(ended),
    };
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
    stopped(server.await)
}

/// What `serve` returns once the HTTP server has stopped.
fn stopped(
    ended: Result<std::io::Result<krasis_server::Stopped>, tokio::task::JoinError>,
) -> anyhow::Result<()> {
    match ended
        .context("the server task panicked")?
        .context("serving HTTP")?
    {
        krasis_server::Stopped::Shutdown => Ok(()),
        krasis_server::Stopped::EngineFault(reason) => Err(EngineFault(reason).into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn an_engine_fault_exits_with_its_own_status() {
        let fault: anyhow::Result<()> =
            Err(anyhow::Error::from(EngineFault("boom".into())).context("serving"));
        assert_eq!(special_exit(&fault), Some(EXIT_ENGINE_FAULT));
        assert_eq!(
            stopped(Ok(Ok(krasis_server::Stopped::EngineFault("x".into()))))
                .map_err(|e| special_exit(&Err(e))),
            Err(Some(EXIT_ENGINE_FAULT))
        );
        assert!(stopped(Ok(Ok(krasis_server::Stopped::Shutdown))).is_ok());
        assert_eq!(special_exit(&Err(anyhow::anyhow!("load failed"))), None);
        assert_eq!(special_exit(&Ok(())), None);
    }

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
            api_key_file: Some("/run/krasis/key".into()),
            insecure_public: true,
            context_length: Some(4096),
            vram_limit_bytes: Some(8 << 30),
            cache_dir: Some("/c".into()),
            heatmap: HeatmapChoice::File("/h.json".into()),
            hcs: false,
            queue_depth: 3,
            parallel: Some(4),
            kv_tokens: Some(65_536),
            gpu: 1,
            safety_margin_mib: 700,
            prefix_cache_file: Some("/var/cache/krasis/prefix.krspc".into()),
            cors_origins: vec![
                "https://chat.example".into(),
                "http://localhost:3000".into(),
            ],
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
        // A key held in memory goes through the environment, never argv.
        let keyed = LaunchOptions {
            model: "/m".into(),
            api_key: Some("in-memory-key-0123456789".into()),
            ..Default::default()
        };
        let argv = keyed.to_serve_args();
        assert!(
            !argv.iter().any(|a| a.contains("in-memory-key")),
            "{argv:?}"
        );
        let args = parse(argv);
        assert_eq!(args.api_key_argv, None);
        let env = keyed.serve_env();
        assert_eq!(env[0].0, API_KEY_ENV);
        let key = resolve_api_key(&args, Some(env[0].1.clone())).unwrap();
        assert_eq!(key, keyed.api_key);
    }

    fn model_dir(model_type: &str) -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        std::fs::write(
            t.path().join("config.json"),
            format!("{{\"model_type\": \"{model_type}\"}}"),
        )
        .unwrap();
        t
    }

    #[test]
    fn unimplemented_engine_options_are_refused_before_loading() {
        let dir = model_dir("qwen3_moe");
        for cuda in [false, true] {
            let caps = crate::cmd::capabilities::of_this_build(
                "test",
                if cuda { Ok(()) } else { Err("no GPU".into()) },
            );
            let mut argv = vec!["--model".to_string(), dir.path().display().to_string()];
            if !cuda {
                argv.extend(["--backend".into(), "reference".into()]);
            }
            check_options(&parse(argv.clone()).launch_options(), &caps).unwrap();
            for (flag, value, option, implemented) in [
                ("--kv-format", "fp8", "kv_format", "bf16"),
                ("--mlp-precision", "fp8", "mlp_precision", "bf16"),
                ("--expert-precision", "int8", "expert_precision", "int4"),
                (
                    "--attention-precision",
                    "fp8",
                    "attention_precision",
                    "bf16",
                ),
                ("--pruning", "top4", "pruning", "off"),
            ] {
                let mut a = argv.clone();
                a.extend([flag.to_string(), value.to_string()]);
                let e = check_options(&parse(a).launch_options(), &caps)
                    .unwrap_err()
                    .to_string();
                assert_eq!(
                    e,
                    format!(
                        "option '{option}': '{value}' is not implemented for 'qwen3_moe' in this runtime (choose from: {implemented})"
                    )
                );
            }
        }
        // An architecture this build does not have, and HCS without a GPU engine.
        let caps = crate::cmd::capabilities::of_this_build("test", Err("no GPU".into()));
        let llama = model_dir("llama");
        let a = vec![
            "--model".to_string(),
            llama.path().display().to_string(),
            "--backend".into(),
            "reference".into(),
        ];
        let e = check_options(&parse(a).launch_options(), &caps)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("'llama' is not supported") && e.contains("qwen3_moe"),
            "{e}"
        );
        let a = vec![
            "--model".to_string(),
            dir.path().display().to_string(),
            "--backend".into(),
            "reference".into(),
            "--hcs".into(),
            "on".into(),
        ];
        let e = check_options(&parse(a).launch_options(), &caps)
            .unwrap_err()
            .to_string();
        assert!(e.contains("option 'hcs'"), "{e}");
        // The cuda backend where it cannot run is refused before binding.
        let a = vec!["--model".to_string(), dir.path().display().to_string()];
        let e = check_options(&parse(a).launch_options(), &caps)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no GPU"), "{e}");
    }

    #[test]
    fn api_key_comes_from_a_file_or_the_environment_never_argv() {
        let m = || vec!["--model".to_string(), "m".to_string()];
        // On the command line: refused, and the key is not repeated.
        let mut a = m();
        a.extend(["--api-key".into(), "k3y-0f-sixteen-chars".into()]);
        let e = resolve_api_key(&parse(a), None).unwrap_err().to_string();
        assert!(
            e.contains("--api-key-file") && e.contains("KRASIS_API_KEY"),
            "{e}"
        );
        assert!(e.contains("ps"), "{e}");
        assert!(!e.contains("k3y-0f"), "{e}");
        // From the environment.
        let key = resolve_api_key(&parse(m()), Some("from-env-0123456789".into())).unwrap();
        assert_eq!(key.as_deref(), Some("from-env-0123456789"));
        assert_eq!(resolve_api_key(&parse(m()), None).unwrap(), None);
        // From a file, which wins over the environment.
        let t = tempfile::tempdir().unwrap();
        let f = t.path().join("key");
        std::fs::write(&f, "from-file-0123456789\n").unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        let mut a = m();
        a.extend(["--api-key-file".into(), f.display().to_string()]);
        let args = parse(a);
        let key = resolve_api_key(&args, Some("from-env-0123456789".into())).unwrap();
        assert_eq!(key.as_deref(), Some("from-file-0123456789"));
        // An empty file is refused.
        std::fs::write(&f, "\n").unwrap();
        let e = resolve_api_key(&args, None).unwrap_err().to_string();
        assert!(e.contains("empty"), "{e}");
    }

    #[test]
    fn placeholder_key_is_refused_on_a_public_bind() {
        let dir = model_dir("qwen3_moe");
        let caps = crate::cmd::capabilities::of_this_build("test", Err("no GPU".into()));
        let mut args = parse(vec![
            "--model".to_string(),
            dir.path().display().to_string(),
            "--backend".into(),
            "reference".into(),
            "--host".into(),
            "0.0.0.0".into(),
        ]);
        args.api_key = resolve_api_key(&args, Some("change-me".into())).unwrap();
        let e = check_options(&args.launch_options(), &caps)
            .unwrap_err()
            .to_string();
        assert!(e.contains("placeholder"), "{e}");
    }

    #[test]
    fn cors_origins_repeat_and_are_validated() {
        let a = parse(vec![
            "--model".into(),
            "m".into(),
            "--cors-origin".into(),
            "https://a.example".into(),
            "--cors-origin".into(),
            "*".into(),
        ]);
        assert_eq!(a.cors_origins, vec!["https://a.example", "*"]);
        assert_eq!(
            a.launch_options().validate().unwrap_err().option,
            "cors_origins"
        );
        let a = parse(vec![
            "--model".into(),
            "m".into(),
            "--cors-origin".into(),
            "*".into(),
        ]);
        a.launch_options().validate().unwrap();
        let a = parse(vec!["--model".into(), "m".into()]);
        assert!(a.cors_origins.is_empty());
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
        let d = LaunchOptions::default();
        check_backend_flags(&o, &d).unwrap();
        o.pruning = "top4".into();
        assert!(
            check_backend_flags(&o, &d)
                .unwrap_err()
                .to_string()
                .contains("--pruning")
        );
    }

    /// An MXFP4 gpt_oss model serves without `--expert-precision`: the flags
    /// not given take the architecture's defaults (before, the generic int4
    /// default was refused for gpt_oss on every backend).
    #[test]
    fn engine_flags_not_given_take_the_architectures_defaults() {
        let caps = crate::cmd::capabilities::of_this_build("test", Ok(()));
        let gpt = model_dir("gpt_oss");
        let m = gpt.path().display().to_string();
        for backend in ["reference", "cuda"] {
            let args = parse(vec![
                "--model".into(),
                m.clone(),
                "--backend".into(),
                backend.into(),
            ]);
            let o = resolved_options(&args, &caps);
            assert_eq!(o.expert_precision, "mxfp4");
            check_options(&o, &caps).unwrap_or_else(|e| panic!("{backend}: {e}"));
            // The generic default, given explicitly, is still refused.
            let args = parse(vec![
                "--model".into(),
                m.clone(),
                "--backend".into(),
                backend.into(),
                "--expert-precision".into(),
                "int4".into(),
            ]);
            assert!(check_options(&resolved_options(&args, &caps), &caps).is_err());
        }
        let qwen = model_dir("qwen3_moe");
        let args = parse(vec!["--model".into(), qwen.path().display().to_string()]);
        assert_eq!(resolved_options(&args, &caps).expert_precision, "int4");
    }
}
