//! Where routed-expert weights come from when building the cache: a
//! safetensors checkpoint (read through its mmap) or a synthetic recipe
//! (`krasis_synth.json` of a checkpoint written with
//! `--experts-in-cache-only`), whose experts are generated one at a time and
//! never materialised as BF16.

use crate::error::CacheError;
use crate::format::SourceIdentity;
use crate::layout::ExpertLayout;
use crate::quant::{ExpertPart, GroupError, SourceMatrix, quantize_expert};
use krasis_model::{Checkpoint, DType, ModelConfig};
use std::path::{Path, PathBuf};

use krasis_model::synth::RECORD_FILE as SYNTH_RECORD_FILE;

enum Kind {
    Checkpoint(Checkpoint),
    Synthetic(Box<krasis_model::synth::SynthSpec>),
}

/// An opened model directory, ready to hand out experts for quantization.
pub struct ModelSource {
    dir: PathBuf,
    config: ModelConfig,
    layout: ExpertLayout,
    moe_layers: Vec<usize>,
    identity: SourceIdentity,
    /// Source bytes of one expert (checkpoint precision; BF16-equivalent for
    /// synthetic sources), for progress and throughput reports.
    expert_source_bytes: u64,
    kind: Kind,
}

impl std::fmt::Debug for ModelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelSource")
            .field("dir", &self.dir)
            .field("identity", &self.identity)
            .finish()
    }
}

fn hash_file(path: &Path) -> Result<(Vec<u8>, String), CacheError> {
    let bytes = std::fs::read(path)
        .map_err(|e| CacheError::Model(krasis_model::ModelError::io(path, e)))?;
    let h = blake3::hash(&bytes).to_hex().to_string();
    Ok((bytes, h))
}

/// Layout for `config`, or why the model cannot have an INT4 expert cache.
pub fn layout_for(config: &ModelConfig, dir: &Path) -> Result<ExpertLayout, CacheError> {
    let g = config.geometry();
    if g.num_moe_layers() == 0 || g.num_experts == 0 {
        return Err(CacheError::UnsupportedSource {
            dir: dir.to_path_buf(),
            reason: "the model has no routed experts, so there is nothing to cache".into(),
        });
    }
    ExpertLayout::new(g.hidden, g.expert_intermediate).ok_or_else(|| CacheError::UnsupportedSource {
        dir: dir.to_path_buf(),
        reason: format!(
            "hidden_size {} and moe_intermediate_size {} must both be multiples of {} for INT4 groups",
            g.hidden,
            g.expert_intermediate,
            crate::GROUP_SIZE
        ),
    })
}

impl ModelSource {
    /// Opens `dir` (config.json plus safetensors, or a synthetic recipe when
    /// its routed experts were omitted) and computes its identity without
    /// reading weight data.
    pub fn open(dir: &Path) -> Result<Self, CacheError> {
        let config = ModelConfig::load(dir)?;
        let layout = layout_for(&config, dir)?;
        let g = config.geometry();
        let moe_layers: Vec<usize> = g.moe_layers().collect();
        let (_, config_blake3) = hash_file(&dir.join("config.json"))?;
        let record_path = dir.join(SYNTH_RECORD_FILE);
        let synthetic_record = if record_path.exists() {
            let (bytes, spec_blake3) = hash_file(&record_path)?;
            let spec: serde_json::Value =
                serde_json::from_slice(&bytes).map_err(|e| CacheError::UnsupportedSource {
                    dir: dir.to_path_buf(),
                    reason: format!("{SYNTH_RECORD_FILE} is not valid JSON: {e}"),
                })?;
            let omitted = spec
                .get("routed_experts_omitted")
                .and_then(|v| v.as_bool())
                .unwrap_or(false);
            omitted.then_some((spec, spec_blake3))
        } else {
            None
        };
        let per_expert_elems = (3 * g.hidden * g.expert_intermediate) as u64;
        if let Some((spec_json, spec_blake3)) = synthetic_record {
            let spec = krasis_model::synth::SynthSpec::from_checkpoint_dir(dir).map_err(|e| {
                CacheError::UnsupportedSource {
                    dir: dir.to_path_buf(),
                    reason: format!("cannot regenerate the omitted experts: {e}"),
                }
            })?;
            return Ok(ModelSource {
                dir: dir.to_path_buf(),
                config,
                layout,
                moe_layers,
                identity: SourceIdentity::Synthetic {
                    config_blake3,
                    spec_blake3,
                    spec: spec_json,
                },
                expert_source_bytes: per_expert_elems * 2,
                kind: Kind::Synthetic(Box::new(spec)),
            });
        }
        let ckpt = Checkpoint::open(dir)?;
        let mut table = blake3::Hasher::new();
        let mut dtypes: Vec<String> = Vec::new();
        let mut expert_tensors = 0usize;
        let mut first_expert_bytes = None;
        let mut sample = blake3::Hasher::new();
        let (h, i) = (g.hidden, g.expert_intermediate);
        for &layer in &moe_layers {
            for e in 0..g.num_experts {
                let names = config.expert_tensor_names(layer, e);
                let shapes = [[i, h], [i, h], [h, i]];
                let mut bytes = 0u64;
                for (name, shape) in names.iter().zip(shapes) {
                    let t = ckpt.expect(name, &shape)?;
                    table.update(format!("{name} {} {:?}\n", t.dtype.name(), t.shape).as_bytes());
                    if !dtypes.iter().any(|d| d == t.dtype.name()) {
                        dtypes.push(t.dtype.name().to_string());
                    }
                    bytes += t.bytes.len() as u64;
                    expert_tensors += 1;
                }
                first_expert_bytes.get_or_insert(bytes);
            }
            let names = |e: usize| config.expert_tensor_names(layer, e);
            let n = g.num_experts;
            let first = ckpt.get(&names(0)[0])?.bytes;
            let middle = ckpt.get(&names(n / 2)[1])?.bytes;
            let last = ckpt.get(&names(n - 1)[2])?.bytes;
            const SAMPLE: usize = 4096;
            sample.update(&first[..first.len().min(SAMPLE)]);
            sample.update(&middle[middle.len() / 2..(middle.len() / 2 + SAMPLE).min(middle.len())]);
            sample.update(&last[last.len().saturating_sub(SAMPLE)..]);
        }
        Ok(ModelSource {
            dir: dir.to_path_buf(),
            config,
            layout,
            moe_layers,
            identity: SourceIdentity::Checkpoint {
                config_blake3,
                expert_tensors,
                tensor_table_blake3: table.finalize().to_hex().to_string(),
                dtypes,
                expert_sample_blake3: sample.finalize().to_hex().to_string(),
            },
            expert_source_bytes: first_expert_bytes.unwrap_or(0),
            kind: Kind::Checkpoint(ckpt),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
    pub fn layout(&self) -> ExpertLayout {
        self.layout
    }
    pub fn moe_layers(&self) -> &[usize] {
        &self.moe_layers
    }
    pub fn num_experts(&self) -> usize {
        self.config.geometry().num_experts
    }
    pub fn identity(&self) -> &SourceIdentity {
        &self.identity
    }
    pub fn is_synthetic(&self) -> bool {
        matches!(self.kind, Kind::Synthetic(_))
    }
    /// Source bytes of one expert (BF16-equivalent for synthetic sources).
    pub fn expert_source_bytes(&self) -> u64 {
        self.expert_source_bytes
    }
    /// Source bytes of all routed experts.
    pub fn total_source_bytes(&self) -> u64 {
        self.expert_source_bytes * (self.moe_layers.len() * self.num_experts()) as u64
    }

    /// Quantizes one expert into `out` (one `expert_stride` block). For
    /// checkpoints also returns the blake3 of the source bytes
    /// (gate ‖ up ‖ down as stored), which the header records.
    pub fn quantize_expert<'a>(
        &'a self,
        layer: usize,
        expert: usize,
        out: &mut [u8],
    ) -> Result<Option<blake3::Hash>, CacheError> {
        let names = self.config.expert_tensor_names(layer, expert);
        let fail = |(part, e): (ExpertPart, GroupError)| {
            let idx = match part {
                ExpertPart::Gate => 0,
                ExpertPart::Up => 1,
                ExpertPart::Down => 2,
            };
            CacheError::BadWeights {
                tensor: names[idx].clone(),
                reason: e.to_string(),
            }
        };
        match &self.kind {
            Kind::Checkpoint(ckpt) => {
                let (h, i) = (self.layout.hidden, self.layout.intermediate);
                let gate = ckpt.expect(&names[0], &[i, h])?;
                let up = ckpt.expect(&names[1], &[i, h])?;
                let down = ckpt.expect(&names[2], &[h, i])?;
                let m = |t: &krasis_model::TensorView<'a>| SourceMatrix {
                    dtype: t.dtype,
                    bytes: t.bytes,
                };
                quantize_expert(&self.layout, m(&gate), m(&up), m(&down), out).map_err(fail)?;
                let mut hasher = blake3::Hasher::new();
                hasher.update(gate.bytes);
                hasher.update(up.bytes);
                hasher.update(down.bytes);
                Ok(Some(hasher.finalize()))
            }
            Kind::Synthetic(spec) => {
                let w = krasis_model::synth::expert_weights(spec, layer, expert);
                quantize_expert(
                    &self.layout,
                    f32_matrix(&w.gate),
                    f32_matrix(&w.up),
                    f32_matrix(&w.down),
                    out,
                )
                .map_err(fail)?;
                Ok(None)
            }
        }
    }
}

fn f32_matrix(v: &[f32]) -> SourceMatrix<'_> {
    SourceMatrix {
        dtype: DType::F32,
        bytes: bytemuck::cast_slice(v),
    }
}
