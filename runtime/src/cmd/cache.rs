//! `krasis-runtime build-cache`: build (or check) the routed-expert
//! cache of a model, optionally verify it against the source, and measure
//! the GPU host-backing modes.

use anyhow::Context;
use krasis_cache::{
    BuildOptions, ExpertPrecision, HostBacking, LockWait, ModelSource, cache_path, ensure_cache_at,
    measure_host_modes, verify_against_source,
};
use krasis_common::events::ProgressEvent;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct Args {
    /// Model directory (Hugging Face checkpoint, or a synth checkpoint
    /// written with --experts-in-cache-only).
    #[arg(long)]
    pub model: PathBuf,
    /// Cache root (default: the platform cache directory, e.g. ~/.cache/krasis);
    /// the file goes to <root>/experts/<source-id>/experts-v2.kcache
    /// (a format-1 experts-int4-v1.kcache found there is deleted and replaced).
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// Expert precision, `int4` or `mxfp4` (default: the model's own: int4
    /// for float experts, mxfp4 for MXFP4 checkpoints). A precision that
    /// cannot hold the checkpoint's experts exactly is refused.
    #[arg(long, value_parser = parse_precision)]
    pub precision: Option<ExpertPrecision>,
    /// Quantizer threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// After building or opening, quantize every expert again and compare
    /// byte for byte, and re-hash the source tensors (as slow as a build).
    #[arg(long)]
    pub verify: bool,
    /// Rebuild even when a valid cache exists.
    #[arg(long)]
    pub force: bool,
    /// Fail instead of waiting when another process is building this cache.
    #[arg(long)]
    pub no_wait: bool,
    /// Write JSON-lines progress events to stdout.
    #[arg(long)]
    pub progress_json: bool,
    /// Measure both pinned host-backing modes on the GPU (prepare time, H2D
    /// GB/s for expert-sized and 1 GiB copies). Needs a CUDA driver.
    #[arg(long)]
    pub measure_host_modes: bool,
    /// GPU ordinal for --measure-host-modes.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
}

fn parse_precision(s: &str) -> Result<ExpertPrecision, String> {
    ExpertPrecision::parse(s).ok_or_else(|| format!("unknown precision {s:?} (int4 or mxfp4)"))
}

fn emit(json: bool, e: ProgressEvent) {
    if json {
        println!("{}", e.to_line());
    }
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.threads == Some(0) {
        anyhow::bail!("--threads must be at least 1");
    }
    // Fail before a long build when the measurement cannot run anyway.
    let ctx = if a.measure_host_modes {
        Some(krasis_cache::pinned::cuda_context(a.device)?)
    } else {
        None
    };
    let source = ModelSource::open_with(&a.model, a.precision)
        .with_context(|| format!("reading the model in {}", a.model.display()))?;
    let path = cache_path(&source, a.cache_dir.as_deref())?;
    let json = a.progress_json;
    emit(
        json,
        ProgressEvent::Phase {
            phase: "building_cache".into(),
            detail: path.display().to_string(),
        },
    );
    let sink = |e: ProgressEvent| emit(json, e);
    let opts = BuildOptions {
        threads: a.threads,
        wait: if a.no_wait {
            LockWait::Fail
        } else {
            LockWait::Wait
        },
        progress_bar: !json,
        on_layer: None,
        progress: Some(&sink),
        // This is the command a format-1 refusal names: replace it.
        replace_format_1: true,
    };
    if a.force {
        krasis_cache::build(&source, &path, &opts)?;
    }
    let ensured = ensure_cache_at(&source, &path, &opts)?;
    let cache = ensured.cache;
    let gib = cache.file_bytes().len() as f64 / (1u64 << 30) as f64;
    match &ensured.built {
        Some(r) => println!(
            "built {} ({gib:.3} GiB) from {:.3} GB of source in {:.2} s on {} threads: {:.3} GB/s",
            path.display(),
            r.source_bytes as f64 / 1e9,
            r.elapsed.as_secs_f64(),
            r.threads,
            r.source_gbps()
        ),
        None => println!("valid cache {} ({gib:.3} GiB)", path.display()),
    }
    if let Some(t) = cache.checksum_time() {
        println!(
            "open: {} layer checksums verified in {:.3} s ({:.2} GB/s)",
            cache.moe_layers().len(),
            t.as_secs_f64(),
            cache.data().len() as f64 / t.as_secs_f64().max(1e-9) / 1e9
        );
    }
    if a.verify {
        let r = verify_against_source(&cache, &source)?;
        let content = if cache.header().source_content_blake3.is_some() {
            "source content hash matches"
        } else {
            "synthetic source, identified by its recipe"
        };
        println!(
            "verify: {} experts re-quantized and identical, {content} ({:.2} s)",
            r.experts,
            r.elapsed.as_secs_f64()
        );
    }
    if ctx.is_some() {
        let reports = measure_host_modes(Arc::new(cache), a.device, &HostBacking::ALL)?;
        for r in reports {
            println!(
                "{:<15} prepare {:>8.3} s | {} x {} KiB experts: {:>6.2} GB/s | {} MiB copy: {:>6.2} GB/s",
                r.mode.name(),
                r.prepare.as_secs_f64(),
                r.expert_copies,
                r.expert_bytes / 1024,
                r.expert_gbps,
                r.big_copy_bytes >> 20,
                r.big_gbps
            );
        }
    }
    emit(
        json,
        ProgressEvent::Phase {
            phase: "cache_ready".into(),
            detail: path.display().to_string(),
        },
    );
    Ok(())
}
