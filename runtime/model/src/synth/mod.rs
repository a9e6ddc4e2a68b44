//! Deterministic synthetic Hugging Face checkpoints (`krasis-runtime synth`).
//!
//! A checkpoint is fully described by a [`SynthSpec`] (preset, `--set`
//! overrides, seed, dtype, router skew). Every tensor's values derive only
//! from (seed, tensor name) through a seekable counter-based stream (see
//! `values.rs`), so shards are generated in parallel and streamed to disk, and
//! any single expert can be regenerated on its own with [`expert_weights`];
//! the INT4 cache builder uses that to fill a cache without a BF16 checkpoint.
//! Output goes to a hidden temp dir renamed into place at the end, so a killed
//! run never leaves something that looks like a valid checkpoint.

mod error;
mod files;
mod mxfp4;
mod presets;
mod record;
mod shards;
mod spec;
mod values;
mod write;

#[cfg(test)]
mod probe;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_gpt_oss;

pub use error::SynthError;
pub use files::{ChatTemplateKind, TokenizerSource, generation_config};
pub use mxfp4::{ExpertMxfp4, MXFP4_RULE, expert_mxfp4};
pub use presets::{preset_config, preset_geometry, preset_names};
pub use record::{GENERATOR_VERSION, RECORD_FILE, SynthRecord};
pub use spec::{
    Mxfp4Part, Storage, SynthDtype, SynthSpec, TensorDesc, expert_weights, parse_override,
};
pub use values::{Init, router_scales};

use crate::error::ModelError;
use crate::experts::{ExpertF32, ExpertWeights};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Default `--shard-size`: Qwen3 releases use ~4 GB shards.
pub const DEFAULT_SHARD_BYTES: u64 = 4_000_000_000;

/// Everything `synthesize` needs.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    pub spec: SynthSpec,
    /// Maximum bytes of tensor data per shard file.
    pub shard_bytes: u64,
    pub tokenizer: TokenizerSource,
    pub chat_template: ChatTemplateKind,
    /// Write everything except routed expert tensors (`--experts-in-cache-only`):
    /// the INT4 cache is then built straight from [`expert_weights`].
    pub skip_routed_experts: bool,
    /// Progress bar on stderr (hidden anyway when stderr is not a terminal).
    pub progress: bool,
}

impl SynthOptions {
    /// Defaults: the family's own tokenizer (vocabulary found in
    /// `.cache/vocab/`) and chat template, 4 GB shards.
    pub fn new(spec: SynthSpec) -> Self {
        SynthOptions {
            tokenizer: TokenizerSource::for_family(spec.config(), None),
            chat_template: ChatTemplateKind::for_family(spec.config()),
            spec,
            shard_bytes: DEFAULT_SHARD_BYTES,
            skip_routed_experts: false,
            progress: false,
        }
    }
}

/// What a finished synthesis wrote.
#[derive(Debug, Clone)]
pub struct SynthSummary {
    pub dir: PathBuf,
    pub shard_files: Vec<String>,
    pub tensors: usize,
    pub tensor_bytes: u64,
    pub seconds: f64,
}

impl SynthSummary {
    pub fn bytes_per_second(&self) -> f64 {
        self.tensor_bytes as f64 / self.seconds.max(1e-9)
    }
}

fn check_out_dir(out: &Path) -> Result<(), SynthError> {
    match std::fs::read_dir(out) {
        Ok(mut entries) => {
            if entries.next().is_some() {
                return Err(SynthError::OutputExists {
                    path: out.to_path_buf(),
                });
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(SynthError::io(out, e)),
    }
}

fn temp_dir_for(out: &Path) -> Result<PathBuf, SynthError> {
    let name = out
        .file_name()
        .ok_or_else(|| SynthError::BadSpec(format!("--out {} has no final name", out.display())))?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|e| SynthError::io(&parent, e))?;
    let unique = format!(
        ".{}.synth-tmp-{}-{:?}",
        name.to_string_lossy(),
        std::process::id(),
        std::thread::current().id()
    )
    .replace(['(', ')'], "");
    Ok(parent.join(unique))
}

/// Removes temp dirs of earlier runs for the same `out` whose process is
/// gone (a killed synth), so they do not pile up.
fn remove_stale_temp_dirs(out: &Path) {
    let name = out.file_name().unwrap_or_default().to_string_lossy();
    crate::atomic::remove_dead_temps(
        out.parent().unwrap_or(Path::new("")),
        &format!(".{name}.synth-tmp-"),
    );
}

/// Writes the checkpoint described by `opts` to `out` (which must not exist
/// or be empty).
pub fn synthesize(opts: &SynthOptions, out: &Path) -> Result<SynthSummary, SynthError> {
    let started = Instant::now();
    check_out_dir(out)?;
    remove_stale_temp_dirs(out);
    let tmp = temp_dir_for(out)?;
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| SynthError::io(&tmp, e))?;
    }
    std::fs::create_dir(&tmp).map_err(|e| SynthError::io(&tmp, e))?;
    let result = write_all(opts, &tmp);
    let summary = match result {
        Ok(s) => s,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    if out.exists() {
        // Empty (checked above); replace it. A racing writer that filled it in
        // the meantime makes remove_dir fail, which we report as such.
        if let Err(e) = std::fs::remove_dir(out) {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(if e.kind() == std::io::ErrorKind::DirectoryNotEmpty {
                SynthError::OutputExists {
                    path: out.to_path_buf(),
                }
            } else {
                SynthError::io(out, e)
            });
        }
    }
    if let Err(e) = std::fs::rename(&tmp, out) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(
            if matches!(
                e.kind(),
                std::io::ErrorKind::DirectoryNotEmpty | std::io::ErrorKind::AlreadyExists
            ) {
                SynthError::OutputExists {
                    path: out.to_path_buf(),
                }
            } else {
                SynthError::io(out, e)
            },
        );
    }
    Ok(SynthSummary {
        dir: out.to_path_buf(),
        seconds: started.elapsed().as_secs_f64(),
        ..summary
    })
}

fn write_all(opts: &SynthOptions, dir: &Path) -> Result<SynthSummary, SynthError> {
    let spec = &opts.spec;
    if opts.shard_bytes == 0 {
        return Err(SynthError::BadSpec("--shard-size must be > 0".into()));
    }
    if opts.skip_routed_experts
        && spec
            .tensors()
            .iter()
            .any(|t| matches!(t.storage, Storage::Mxfp4 { .. }))
    {
        // The cache's synthetic source regenerates float experts for the
        // INT4 cache; MXFP4 experts are cached natively from checkpoint
        // bytes, so a checkpoint without them could not be cached.
        return Err(SynthError::BadSpec(format!(
            "--experts-in-cache-only is not supported for '{}': its experts are MXFP4, which \
             the expert cache copies from the checkpoint; synthesize the full checkpoint",
            spec.preset
        )));
    }
    // Tokenizer first: a missing vocabulary should fail before minutes of writing.
    let template = files::write_tokenizer_files(opts, dir)?;
    let tensors: Vec<TensorDesc> = spec
        .tensors()
        .into_iter()
        .filter(|t| !(opts.skip_routed_experts && t.routed_expert))
        .collect();
    let count = tensors.len();
    let plan = shards::plan_shards(tensors, spec.dtype, opts.shard_bytes);
    let tensor_bytes: u64 = plan.iter().map(|s| s.data_bytes(spec.dtype)).sum();
    write::write_shards(&plan, dir, spec.seed, spec.dtype, opts.progress)?;
    if plan.len() > 1 {
        files::write_json(
            &dir.join("model.safetensors.index.json"),
            &shards::index_json(&plan, spec.dtype),
        )?;
    }
    files::write_json(&dir.join("config.json"), &files::sorted(spec.config_json()))?;
    files::write_json(
        &dir.join("generation_config.json"),
        &files::generation_config(spec.config()),
    )?;
    let record = SynthRecord::new(spec, opts.skip_routed_experts, template, tensor_bytes);
    // Serialized directly (not through `Value`) so f32 fields keep their
    // shortest form (1.2, not 1.2000000476837158).
    let mut text = serde_json::to_string_pretty(&record).expect("record serializes");
    text.push('\n');
    let path = dir.join(RECORD_FILE);
    std::fs::write(&path, text).map_err(|e| SynthError::io(&path, e))?;
    Ok(SynthSummary {
        dir: dir.to_path_buf(),
        shard_files: plan.iter().map(|s| s.file.clone()).collect(),
        tensors: count,
        tensor_bytes,
        seconds: 0.0,
    })
}

/// Routed experts generated on demand from a spec: lets the reference engine
/// and the cache builder use a synthetic model's experts without reading (or
/// even writing) them from shards.
#[derive(Debug, Clone)]
pub struct SynthExperts {
    spec: SynthSpec,
}

impl SynthExperts {
    pub fn new(spec: SynthSpec) -> Self {
        SynthExperts { spec }
    }
    pub fn spec(&self) -> &SynthSpec {
        &self.spec
    }
}

impl ExpertWeights for SynthExperts {
    fn describe(&self) -> String {
        format!(
            "synthetic {} (seed {}, {}, generator v{GENERATOR_VERSION})",
            self.spec.preset,
            self.spec.seed,
            self.spec.dtype.name()
        )
    }
    fn expert_f32(&self, layer: usize, expert: usize) -> Result<ExpertF32, ModelError> {
        if !self.spec.has_expert(layer, expert) {
            return Err(ModelError::Other(format!(
                "synthetic model has no routed expert {expert} in layer {layer}"
            )));
        }
        Ok(expert_weights(&self.spec, layer, expert))
    }
}
