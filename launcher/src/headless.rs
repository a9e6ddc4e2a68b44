//! The headless front end: `krasis serve`, `demo`, `probe`, `profiles`,
//! `build-cache` and `bench`. Prints to the terminal; the runtime's own logs
//! stream to stderr.

mod info;

pub use info::{probe_cmd, profiles_cmd};

use crate::cli::{DemoArgs, Global, OptionFlags, ServeArgs};
use crate::estimate::estimate;
use crate::paths::Dirs;
use crate::probe::{Hardware, ModelSummary, Probe, SystemProbe, models};
use crate::profiles::{self, Profile, Store};
use crate::runtime::RuntimeFacts;
use crate::supervisor::{RestartPolicy, SupEvent, Supervisor};
use crate::units::fmt_bytes;
use crate::{runtime, signals, validate};
use anyhow::{Context, bail};
use krasis_common::{Backend, Capabilities, LaunchOptions, ProgressEvent};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Duration;

/// How long the runtime gets to stop after SIGTERM before it is killed.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

pub const DEMO_NOTICE: &str = "NOTE: this is the Krasis demo model: tiny and with RANDOM weights, so its replies are gibberish. It shows the whole pipeline working; serve a real model with `krasis serve --model DIR`.";

pub struct Ctx {
    pub global: Global,
    pub dirs: Dirs,
}

impl Ctx {
    pub fn new(global: Global) -> anyhow::Result<Self> {
        let dirs = Dirs::resolve(global.config_dir.as_deref(), global.data_dir.as_deref())
            .map_err(anyhow::Error::msg)?;
        Ok(Ctx { global, dirs })
    }
    pub fn runtime(&self) -> anyhow::Result<PathBuf> {
        Ok(runtime::locate(self.global.runtime.as_deref())?)
    }
    pub fn caps(&self) -> anyhow::Result<(PathBuf, Capabilities)> {
        let rt = self.runtime()?;
        let caps = runtime::capabilities(&rt)?;
        Ok((rt, caps))
    }
    pub fn store(&self) -> Store {
        Store::new(self.dirs.profiles())
    }
    /// The runtime's model facts and plans (`krasis-runtime inspect`/`plan`).
    pub fn facts(&self) -> std::sync::Arc<dyn RuntimeFacts> {
        self.probe().facts()
    }
    pub fn probe(&self) -> SystemProbe {
        SystemProbe::new(
            self.dirs.models(),
            &self.global.model_roots,
            self.global.runtime.as_deref(),
        )
    }
}

/// The argv and the extra environment of `krasis-runtime serve` for `opts`:
/// the one place both front ends build them. Secrets (the API key) travel in
/// the environment, never in the argv that any local user can read.
pub fn serve_command(opts: &LaunchOptions) -> (Vec<String>, Vec<(String, String)>) {
    let mut args = vec!["serve".to_string()];
    args.extend(opts.to_serve_args());
    (args, opts.serve_env())
}

/// Profile (if any) + flags + the runtime's defaults, validated once.
pub fn resolve_options(
    caps: &Capabilities,
    facts: &dyn RuntimeFacts,
    profile: Option<LaunchOptions>,
    flags: &OptionFlags,
) -> anyhow::Result<(LaunchOptions, ModelSummary)> {
    let from_profile = profile.is_some();
    // The architecture, as the runtime reads it.
    let model_type = || {
        flags
            .model
            .as_deref()
            .and_then(|d| models::inspect_one(facts, d, None).ok())
            .map(|s| s.model_type)
    };
    let mut opts = match profile {
        Some(p) => p,
        None => {
            // Recommended defaults depend on the model's architecture.
            model_type()
                .and_then(|t| caps.default_options(&t))
                .unwrap_or_default()
        }
    };
    flags.apply(&mut opts).map_err(|e| anyhow::anyhow!("{e}"))?;
    if !from_profile && flags.hcs.is_none() {
        // HCS follows the backend unless asked for explicitly.
        opts.hcs = opts.backend == Backend::Cuda
            && model_type()
                .and_then(|t| caps.architecture(&t).map(|a| a.hcs))
                .unwrap_or(false);
    }
    let summary = validate::validate(&opts, caps, facts).map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok((opts, summary))
}

fn load_profile(
    ctx: &Ctx,
    name: Option<&str>,
    file: Option<&Path>,
) -> anyhow::Result<Option<Profile>> {
    Ok(match (name, file) {
        (Some(n), _) => Some(profiles::examples::load_named(&ctx.store(), n)?),
        (None, Some(f)) => Some(profiles::load_file(f)?),
        (None, None) => None,
    })
}

pub fn serve(ctx: &Ctx, a: &ServeArgs) -> anyhow::Result<ExitCode> {
    if a.demo && a.opts.model.is_none() && a.profile.is_none() && a.profile_file.is_none() {
        return demo(
            ctx,
            &DemoArgs {
                dry_run: a.dry_run,
                opts: a.opts.clone(),
            },
        );
    }
    let (rt, caps) = ctx.caps()?;
    let profile = load_profile(ctx, a.profile.as_deref(), a.profile_file.as_deref())?;
    let mut flags = a.opts.clone();
    let mut profile = profile.map(|p| p.options);
    let model = match (&mut flags.model, &mut profile) {
        (Some(m), _) => m,
        (None, Some(p)) => &mut p.model,
        (None, None) => {
            bail!("no model given: pass --model DIR, --profile NAME, or try `krasis demo`")
        }
    };
    let demo = resolve_model_name(ctx, &rt, model)?;
    if demo {
        println!("{DEMO_NOTICE}");
    }
    let (opts, summary) = resolve_options(&caps, &*ctx.facts(), profile, &flags)?;
    run_headless(ctx, &rt, &opts, &summary, a.dry_run, demo)
}

/// A model given by name rather than as a directory is looked up in the
/// model roots (an error lists them all). The demo model's name, found
/// nowhere, is created in the data directory as `krasis demo` does, so the
/// shipped `demo-cpu` profile works on a fresh machine. Returns whether the
/// model is the demo model.
fn resolve_model_name(ctx: &Ctx, rt: &Path, model: &mut PathBuf) -> anyhow::Result<bool> {
    let demo_dir = ctx.dirs.demo_model();
    match profiles::resolve::resolve_model(model, &ctx.probe().roots) {
        Ok(found) => *model = found,
        Err(_) if demo_dir.file_name() == Some(model.as_os_str()) => {
            ensure_demo_model(rt, &demo_dir)?;
            *model = demo_dir.clone();
        }
        Err(e) => return Err(e.into()),
    }
    let canon = |p: &Path| p.canonicalize().ok();
    Ok(canon(model).is_some() && canon(model) == canon(&demo_dir))
}

pub fn demo(ctx: &Ctx, a: &DemoArgs) -> anyhow::Result<ExitCode> {
    let (rt, caps) = ctx.caps()?;
    let mut flags = a.opts.clone();
    if flags.model.is_none() {
        let dir = ctx.dirs.demo_model();
        ensure_demo_model(&rt, &dir)?;
        flags.model = Some(dir);
    }
    println!("{DEMO_NOTICE}");
    let (opts, summary) = resolve_options(&caps, &*ctx.facts(), None, &flags)?;
    run_headless(ctx, &rt, &opts, &summary, a.dry_run, true)
}

/// Synthesizes the tiny demo checkpoint with `krasis-runtime synth` unless
/// it is already there.
pub fn ensure_demo_model(rt: &Path, dir: &Path) -> anyhow::Result<()> {
    if models::is_model_dir(dir) {
        return Ok(());
    }
    println!("Creating the demo model in {} ...", dir.display());
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    let st = crate::supervisor::retry_busy(|| {
        Command::new(rt)
            .args(["synth", "--preset", "tiny", "--out"])
            .arg(dir)
            .status()
    })
    .with_context(|| format!("running {} synth", rt.display()))?;
    if !st.success() || !models::is_model_dir(dir) {
        bail!(
            "`{} synth --preset tiny --out {}` failed ({}); see its messages above",
            rt.display(),
            dir.display(),
            crate::supervisor::describe(st)
        );
    }
    Ok(())
}

fn print_plan(ctx: &Ctx, opts: &LaunchOptions, m: &ModelSummary, hw: &Hardware) {
    println!(
        "model: {} ({}, {} params, {} active per token, {} experts x {} MoE layers, top-{})",
        opts.model.display(),
        m.model_type,
        crate::units::fmt_count(m.total_params),
        crate::units::fmt_count(m.active_params),
        m.num_experts,
        m.moe_layers,
        m.top_k
    );
    println!(
        "backend: {}   experts: {}   attention: {}   KV: {}   MLP: {}   HCS: {}   pruning: {}",
        opts.backend.as_str(),
        m.experts_for(opts.backend),
        opts.attention_precision,
        opts.kv_format,
        opts.mlp_precision,
        if opts.hcs { "on" } else { "off" },
        opts.pruning
    );
    let gpu = hw
        .gpus
        .gpus()
        .iter()
        .find(|g| g.index == opts.gpu)
        .map(|g| (g.free_bytes, g.total_bytes));
    let e = estimate(
        &*ctx.facts(),
        &crate::runtime::PlanCache::default(),
        opts,
        hw.host.available_ram_bytes,
        gpu,
    );
    for l in e.lines() {
        println!("  {l}");
    }
}

pub fn run_headless(
    ctx: &Ctx,
    rt: &Path,
    opts: &LaunchOptions,
    summary: &ModelSummary,
    dry_run: bool,
    demo: bool,
) -> anyhow::Result<ExitCode> {
    let hw = ctx.probe().hardware();
    print_plan(ctx, opts, summary, &hw);
    if dry_run {
        println!("dry run: options are valid; not starting the runtime");
        return Ok(ExitCode::SUCCESS);
    }
    signals::install();
    let (args, env) = serve_command(opts);
    let mut sup = Supervisor::spawn(rt, &args, &env, RestartPolicy::default())?;
    println!("runtime started (pid {}); Ctrl-C stops it", sup.pid());
    let mut bar: Option<(String, indicatif::ProgressBar)> = None;
    loop {
        if signals::stop_requested() {
            let grace = opts.shutdown_grace(SHUTDOWN_GRACE);
            return Ok(stop_on_signal(&mut sup, grace, bar.take().map(|(_, b)| b)));
        }
        let Some(ev) = sup.next_event(Duration::from_millis(200)) else {
            continue;
        };
        if signals::stop_requested() {
            // After a hangup the terminal may be gone, and printing to it
            // would panic: stop first.
            continue;
        }
        match ev {
            SupEvent::Progress(ProgressEvent::Progress {
                task,
                done,
                total,
                unit,
            }) => {
                if bar.as_ref().is_none_or(|(t, _)| *t != task) {
                    if let Some((_, b)) = bar.take() {
                        b.finish();
                    }
                    let b = indicatif::ProgressBar::new(total);
                    b.set_style(
                        indicatif::ProgressStyle::with_template(
                            "  {msg} [{bar:30}] {pos}/{len} {prefix} ({eta})",
                        )
                        .expect("valid template")
                        .progress_chars("=> "),
                    );
                    b.set_message(task.clone());
                    b.set_prefix(unit);
                    bar = Some((task, b));
                }
                if let Some((_, b)) = &bar {
                    b.set_length(total);
                    b.set_position(done);
                    if done >= total {
                        b.finish();
                    }
                }
            }
            SupEvent::Progress(ev) => {
                if let Some((_, b)) = bar.take() {
                    b.finish();
                }
                print_event(&ev, demo);
            }
            SupEvent::Log(l) => eprintln!("  | {l}"),
            SupEvent::Restarting(r) => {
                if let Some((_, b)) = bar.take() {
                    b.abandon();
                }
                eprintln!("{r}");
            }
            SupEvent::Restarted { pid } => println!("runtime restarted (pid {pid})"),
            SupEvent::Exited {
                success,
                description,
            } => {
                if !success {
                    eprintln!("runtime {description}");
                    eprintln!("last log lines:");
                    for l in sup.tail(15) {
                        eprintln!("  | {l}");
                    }
                    return Ok(ExitCode::FAILURE);
                }
                println!("runtime {description}");
                return Ok(ExitCode::SUCCESS);
            }
        }
    }
}

/// SIGINT, SIGTERM or SIGHUP arrived: stop the runtime and say how it ended.
/// Success only when it stopped cleanly; a runtime that had to be killed
/// after `grace` ([`LaunchOptions::shutdown_grace`]), or died of another signal, fails the launcher.
/// Nothing here may panic on a terminal that hung up (hence no `println!`).
fn stop_on_signal(
    sup: &mut Supervisor,
    grace: Duration,
    bar: Option<indicatif::ProgressBar>,
) -> ExitCode {
    use std::io::Write;
    if let Some(b) = bar {
        b.abandon();
    }
    let _ = writeln!(std::io::stdout(), "stopping the runtime ...");
    let how = sup.shutdown(grace);
    if how.clean {
        let _ = writeln!(std::io::stdout(), "runtime {how}");
        ExitCode::SUCCESS
    } else {
        let _ = writeln!(std::io::stderr(), "error: runtime {how}");
        ExitCode::FAILURE
    }
}

fn print_event(ev: &ProgressEvent, demo: bool) {
    match ev {
        ProgressEvent::Phase { phase, detail } => println!("[{phase}] {detail}"),
        ProgressEvent::HcsDecision {
            resident_experts,
            total_experts,
            bytes,
            safety_margin_bytes,
        } => println!(
            "[hcs] {resident_experts}/{total_experts} experts resident in VRAM ({}), {} kept free",
            fmt_bytes(*bytes),
            fmt_bytes(*safety_margin_bytes)
        ),
        ProgressEvent::Ready { url, model } => {
            println!("READY: {url} (model \"{model}\")");
            println!("  try: {}", first_request(url, model));
            if demo {
                println!("{DEMO_NOTICE}");
            }
        }
        ProgressEvent::Log { level, message } => eprintln!("  {level}: {message}"),
        ProgressEvent::Fatal { message } => eprintln!("FATAL: {message}"),
        ProgressEvent::Progress { .. } => {}
    }
}

/// Runs a runtime tool in the foreground with the terminal attached, so its
/// own progress bars show; Ctrl-C reaches it directly.
pub fn forward(ctx: &Ctx, args: &[String]) -> anyhow::Result<ExitCode> {
    let rt = ctx.runtime()?;
    // Keep the launcher alive to report the tool's exit status.
    signals::install();
    let st = crate::supervisor::retry_busy(|| Command::new(&rt).args(args).status())
        .with_context(|| format!("running {}", rt.display()))?;
    if st.success() {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!(
            "{} {}: {}",
            rt.display(),
            args.first().map_or("", |s| s),
            crate::supervisor::describe(st)
        );
        Ok(ExitCode::from(
            st.code().map_or(1, |c| c.clamp(1, 255) as u8),
        ))
    }
}

pub fn build_cache(
    ctx: &Ctx,
    model: &Path,
    cache_dir: Option<&Path>,
    rest: &[String],
) -> anyhow::Result<ExitCode> {
    if !models::is_model_dir(model) {
        bail!(
            "{} is not a Hugging Face model directory (config.json + *.safetensors)",
            model.display()
        );
    }
    models::inspect_one(&*ctx.facts(), model, cache_dir)
        .map_err(|e| anyhow::anyhow!("{}: {e}", model.display()))?;
    let mut args = vec![
        "build-cache".to_string(),
        "--model".into(),
        model.display().to_string(),
    ];
    if let Some(d) = cache_dir {
        args.push("--cache-dir".into());
        args.push(d.display().to_string());
    }
    args.extend(rest.iter().cloned());
    forward(ctx, &args)
}

/// The first request a newcomer is shown. It sets `max_tokens`: without it a
/// random-weights demo model answers with its whole context of noise.
pub fn first_request(url: &str, model: &str) -> String {
    let body = serde_json::json!({
        "model": model,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 64,
    });
    format!("curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'")
}
