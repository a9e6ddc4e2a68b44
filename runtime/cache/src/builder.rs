//! Building the cache: one MoE layer at a time (memory stays at one layer's
//! cache bytes plus the source pages the kernel maps in), experts of a layer
//! quantized (INT4) or copied (MXFP4) in parallel, written to a temp file in the target directory,
//! fsync'ed, renamed into place and the directory fsync'ed. The temp file
//! gets its magic bytes last, so an interrupted build never leaves a file
//! that looks valid; the next build (under the lock) deletes leftovers.

use crate::error::CacheError;
use crate::format::{
    DATA_ALIGN, FORMAT_VERSION, HASH_PLACEHOLDER, Header, LayerEntry, PREAMBLE_BYTES, align_up,
    encode_preamble,
};
use crate::lock::{CacheLock, LockWait};
use crate::quant::QUANTIZER_VERSION;
use crate::source::ModelSource;
use krasis_common::events::{ByteProgress, EventSink, task};
use krasis_model::atomic::TempFile;
use rayon::prelude::*;
use std::fs::{File, OpenOptions};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Stand-in for offsets while sizing the header: as many digits as any
/// offset below 1 PB.
const PROBE_OFFSET: u64 = 999_999_999_999_999;

/// Reported after each layer is written.
#[derive(Debug, Clone, Copy)]
pub struct LayerDone {
    /// Position among MoE layers (0-based).
    pub index: usize,
    /// Decoder layer index.
    pub layer: usize,
    pub total_layers: usize,
    pub source_bytes_done: u64,
    pub source_bytes_total: u64,
}

/// Callback after each written layer; returning `Err(reason)` aborts the
/// build (used for progress events and, in tests, to inject failures).
pub type LayerHook<'a> = &'a (dyn Fn(&LayerDone) -> Result<(), String> + Sync);

/// How to build.
#[derive(Clone, Copy)]
pub struct BuildOptions<'a> {
    /// Worker threads; `None` uses rayon's global pool (all cores).
    pub threads: Option<usize>,
    /// What to do when another process is building the same cache.
    pub wait: LockWait,
    /// Draw a progress bar on stderr (only when stderr is a terminal).
    pub progress_bar: bool,
    pub on_layer: Option<LayerHook<'a>>,
    /// Where byte-progress events of the build go (source bytes quantized,
    /// throttled; see [`ByteProgress`]).
    pub progress: Option<EventSink<'a>>,
    /// Delete a format-1 cache found where this one goes and build format 2
    /// (`krasis-runtime build-cache`, the command the refusal names). Off by
    /// default: engines refuse a format-1 cache rather than replace it.
    pub replace_format_1: bool,
}

impl Default for BuildOptions<'_> {
    fn default() -> Self {
        BuildOptions {
            threads: None,
            wait: LockWait::Wait,
            progress_bar: true,
            on_layer: None,
            progress: None,
            replace_format_1: false,
        }
    }
}

/// What a build did.
#[derive(Debug, Clone)]
pub struct BuildReport {
    pub path: PathBuf,
    pub file_bytes: u64,
    /// Source bytes quantized (BF16-equivalent for synthetic sources).
    pub source_bytes: u64,
    pub elapsed: Duration,
    pub threads: usize,
}

impl BuildReport {
    /// Source throughput in GB/s (10^9 bytes).
    pub fn source_gbps(&self) -> f64 {
        self.source_bytes as f64 / self.elapsed.as_secs_f64().max(1e-9) / 1e9
    }
}

/// Takes the build lock and (re)builds the cache file at `path` from `source`.
pub fn build(
    source: &ModelSource,
    path: &Path,
    opts: &BuildOptions<'_>,
) -> Result<BuildReport, CacheError> {
    let _lock = CacheLock::acquire(path, opts.wait)?;
    build_locked(source, path, opts)
}

/// Deletes the cache file at `path` so a stale one is not kept around.
fn remove_if_exists(path: &Path) -> Result<(), CacheError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(CacheError::io(path, e)),
    }
}

/// Temp files of builds that were killed; safe to delete while holding the lock.
fn remove_leftovers(path: &Path) -> Result<(), CacheError> {
    let Some(dir) = path.parent() else {
        return Ok(());
    };
    let prefix = format!(
        "{}.tmp.",
        path.file_name().unwrap_or_default().to_string_lossy()
    );
    let entries = std::fs::read_dir(dir).map_err(|e| CacheError::io(dir, e))?;
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            tracing::info!(file = %entry.path().display(), "removing the temp file of an interrupted cache build");
            remove_if_exists(&entry.path())?;
        }
    }
    Ok(())
}

fn header_for(
    source: &ModelSource,
    data_offset: u64,
    layers: Vec<LayerEntry>,
    content: Option<String>,
) -> Header {
    let g = source.config().geometry();
    let layout = source.layout();
    let layer_bytes = (layout.expert_stride * g.num_experts) as u64;
    Header {
        format_version: FORMAT_VERSION,
        quantizer_version: QUANTIZER_VERSION,
        expert_format: layout.format,
        expert_bias: layout.has_bias,
        model_type: source.config().model_type().to_string(),
        hidden: g.hidden,
        expert_intermediate: g.expert_intermediate,
        num_experts: g.num_experts,
        num_layers: g.num_layers,
        moe_layers: source.moe_layers().to_vec(),
        expert_stride: layout.expert_stride,
        layer_bytes,
        data_offset,
        file_bytes: data_offset + layer_bytes * source.moe_layers().len() as u64,
        source: source.identity().clone(),
        source_content_blake3: content,
        writer: format!("krasis-cache {}", env!("CARGO_PKG_VERSION")),
        layers,
    }
}

/// Builds while the caller holds the lock for `path`.
pub(crate) fn build_locked(
    source: &ModelSource,
    path: &Path,
    opts: &BuildOptions<'_>,
) -> Result<BuildReport, CacheError> {
    let run = || build_inner(source, path, opts);
    match opts.threads {
        Some(n) => rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build()
            .map_err(|e| CacheError::Aborted {
                path: path.to_path_buf(),
                reason: format!("cannot start {n} worker threads: {e}"),
            })?
            .install(run),
        None => run(),
    }
}

fn build_inner(
    source: &ModelSource,
    path: &Path,
    opts: &BuildOptions<'_>,
) -> Result<BuildReport, CacheError> {
    let start = Instant::now();
    remove_leftovers(path)?;
    let layout = source.layout();
    let moe_layers = source.moe_layers();
    let num_experts = source.num_experts();
    let layer_bytes = layout.expert_stride * num_experts;

    // Size the header with placeholder hashes of the final length.
    let placeholder_layers: Vec<LayerEntry> = moe_layers
        .iter()
        .map(|&layer| LayerEntry {
            layer,
            offset: PROBE_OFFSET,
            bytes: layer_bytes as u64,
            blake3: HASH_PLACEHOLDER.into(),
        })
        .collect();
    let placeholder_content = (!source.is_synthetic()).then(|| HASH_PLACEHOLDER.to_string());
    let probe = header_for(
        source,
        PROBE_OFFSET,
        placeholder_layers,
        placeholder_content,
    );
    let probe_len = serde_json::to_vec(&probe).expect("header serializes").len() as u64;
    // The real offsets print no longer than the probe's, so the final header fits.
    let data_offset = align_up(PREAMBLE_BYTES as u64 + probe_len, DATA_ALIGN as u64);

    let tmp = TempFile::beside(path);
    let file = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(&tmp.path)
        .map_err(|e| CacheError::io(&tmp.path, e))?;
    let io = |e: std::io::Error| CacheError::io(&tmp.path, e);

    let total = source.total_source_bytes();
    let bar = progress_bar(opts.progress_bar, total, path, source.format());
    let events = opts
        .progress
        .map(|sink| ByteProgress::start(sink, task::BUILD_EXPERT_CACHE, total));
    let expert_bytes = source.expert_source_bytes();
    let mut buf = vec![0u8; layer_bytes];
    let mut entries = Vec::with_capacity(moe_layers.len());
    let mut content = blake3::Hasher::new();
    for (j, &layer) in moe_layers.iter().enumerate() {
        let hashes: Vec<Option<blake3::Hash>> = buf
            .par_chunks_mut(layout.expert_stride)
            .enumerate()
            .map(|(e, out)| {
                let hash = source.write_expert(layer, e, out);
                if let Some(p) = &events {
                    p.add(expert_bytes);
                }
                hash
            })
            .collect::<Result<_, _>>()?;
        let mut layer_content = blake3::Hasher::new();
        for h in hashes.iter().flatten() {
            layer_content.update(h.as_bytes());
        }
        content.update(layer_content.finalize().as_bytes());
        let mut hasher = blake3::Hasher::new();
        hasher.update_rayon(&buf);
        let offset = data_offset + (j * layer_bytes) as u64;
        write_all_at(&file, &buf, offset).map_err(io)?;
        entries.push(LayerEntry {
            layer,
            offset,
            bytes: layer_bytes as u64,
            blake3: hasher.finalize().to_hex().to_string(),
        });
        let done = LayerDone {
            index: j,
            layer,
            total_layers: moe_layers.len(),
            source_bytes_done: source.expert_source_bytes() * ((j + 1) * num_experts) as u64,
            source_bytes_total: total,
        };
        bar.set_position(done.source_bytes_done);
        if let Some(hook) = opts.on_layer {
            hook(&done).map_err(|reason| CacheError::Aborted {
                path: path.to_path_buf(),
                reason,
            })?;
        }
    }
    drop(buf);
    let content = (!source.is_synthetic()).then(|| content.finalize().to_hex().to_string());
    let header = header_for(source, data_offset, entries, content);
    let json = serde_json::to_vec(&header).expect("header serializes");
    assert!(
        PREAMBLE_BYTES as u64 + json.len() as u64 <= data_offset,
        "header grew past its reserved space"
    );
    let pad = vec![0u8; data_offset as usize - PREAMBLE_BYTES - json.len()];
    write_all_at(&file, &json, PREAMBLE_BYTES as u64).map_err(io)?;
    write_all_at(&file, &pad, (PREAMBLE_BYTES + json.len()) as u64).map_err(io)?;
    file.set_len(header.file_bytes).map_err(io)?;
    // Last: the magic that makes the file recognisable as a cache.
    write_all_at(
        &file,
        &encode_preamble(&json, data_offset, header.file_bytes),
        0,
    )
    .map_err(io)?;
    file.sync_all().map_err(io)?;
    drop(file);
    tmp.persist(path).map_err(|e| CacheError::io(path, e))?;
    bar.finish_and_clear();
    if let Some(p) = events {
        p.finish();
    }
    let report = BuildReport {
        path: path.to_path_buf(),
        file_bytes: header.file_bytes,
        source_bytes: total,
        elapsed: start.elapsed(),
        threads: rayon::current_num_threads(),
    };
    tracing::info!(
        path = %path.display(),
        gib = report.file_bytes as f64 / (1u64 << 30) as f64,
        seconds = report.elapsed.as_secs_f64(),
        source_gbps = report.source_gbps(),
        "expert cache built"
    );
    Ok(report)
}

fn progress_bar(
    enabled: bool,
    total: u64,
    path: &Path,
    format: crate::layout::ExpertFormat,
) -> indicatif::ProgressBar {
    if !enabled || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(total),
        indicatif::ProgressDrawTarget::stderr(),
    );
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_message(format!(
        "{} experts -> {}",
        format.precision().name().to_uppercase(),
        path.file_name().unwrap_or_default().to_string_lossy()
    ));
    bar
}

/// Positional write that works on every platform (the builder writes from one
/// thread, so seek + write on a shared `&File` is race-free).
fn write_all_at(file: &File, buf: &[u8], offset: u64) -> std::io::Result<()> {
    use std::io::{Seek, SeekFrom, Write};
    let mut f = file;
    f.seek(SeekFrom::Start(offset))?;
    f.write_all(buf)
}
