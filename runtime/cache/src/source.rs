//! Where routed-expert weights come from when building the cache: a
//! safetensors checkpoint (read through its mmap) or a synthetic recipe
//! (`krasis_synth.json` of a checkpoint written with
//! `--experts-in-cache-only`), whose experts are generated one at a time and
//! never materialised as BF16.

use crate::error::CacheError;
use crate::format::SourceIdentity;
use crate::layout::{ExpertFormat, ExpertLayout, ExpertPrecision};
use crate::mxfp4::{FusedLayer, fused_tensors};
use crate::quant::{ExpertPart, GroupError, SourceMatrix, quantize_expert};
use krasis_model::{Checkpoint, DType, ExpertStorage, FusedMxfp4Names, ModelConfig};
use std::path::{Path, PathBuf};

use krasis_model::synth::RECORD_FILE as SYNTH_RECORD_FILE;

mod plan;
pub use plan::model_layout;
use plan::{Storage, plan_layout};

enum Kind {
    Checkpoint(Checkpoint),
    Synthetic(Box<krasis_model::synth::SynthSpec>),
}

/// An opened model directory, ready to hand out experts for the cache.
pub struct ModelSource {
    dir: PathBuf,
    config: ModelConfig,
    layout: ExpertLayout,
    moe_layers: Vec<usize>,
    storage: Storage,
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

impl ModelSource {
    /// Opens `dir` (config.json plus safetensors, or a synthetic recipe when
    /// its routed experts were omitted) in the model's own expert precision
    /// and computes its identity without reading weight data.
    pub fn open(dir: &Path) -> Result<Self, CacheError> {
        Self::open_with(dir, None)
    }

    /// [`Self::open`] with an explicit precision; a precision the checkpoint
    /// cannot be cached in exactly (int4 for MXFP4 experts, mxfp4 for float
    /// experts) is refused with [`CacheError::Precision`].
    pub fn open_with(dir: &Path, precision: Option<ExpertPrecision>) -> Result<Self, CacheError> {
        let config = ModelConfig::load(dir)?;
        let storage = |l: usize| config.expert_storage(l);
        Self::open_described(dir, precision, &storage)
    }

    /// [`Self::open_with`] with the expert storage given by `storage` (MoE
    /// layer -> how its experts are stored) instead of read from the
    /// architecture description: for a family whose description does not
    /// yet say, and for tests that pair a small config with hand-written
    /// MXFP4 tensors.
    pub fn open_described(
        dir: &Path,
        precision: Option<ExpertPrecision>,
        storage: &dyn Fn(usize) -> ExpertStorage,
    ) -> Result<Self, CacheError> {
        let config = ModelConfig::load(dir)?;
        let g = config.geometry();
        let moe_layers: Vec<usize> = g.moe_layers().collect();
        let (plan, layout) = plan_layout(&config, &moe_layers, precision, storage, dir)?;
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
            if !matches!(plan, Storage::PerExpert) {
                return Err(CacheError::UnsupportedSource {
                    dir: dir.to_path_buf(),
                    reason: "synthetic recipes generate float experts, but the architecture stores MXFP4 experts".into(),
                });
            }
            return Ok(ModelSource {
                dir: dir.to_path_buf(),
                config,
                layout,
                moe_layers,
                storage: plan,
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
        let ident = match &plan {
            Storage::PerExpert => per_expert_identity(&ckpt, &config, &moe_layers)?,
            Storage::FusedMxfp4(names) => fused_identity(&ckpt, names, g.num_experts, &layout)?,
        };
        Ok(ModelSource {
            dir: dir.to_path_buf(),
            config,
            layout,
            moe_layers,
            storage: plan,
            identity: SourceIdentity::Checkpoint {
                config_blake3,
                expert_tensors: ident.tensors,
                tensor_table_blake3: ident.table.finalize().to_hex().to_string(),
                dtypes: ident.dtypes,
                expert_sample_blake3: ident.sample.finalize().to_hex().to_string(),
            },
            expert_source_bytes: ident.expert_bytes,
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
    /// Precision and group of the cache this source builds.
    pub fn format(&self) -> ExpertFormat {
        self.layout.format
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

    /// Writes one expert into `out` (one `expert_stride` block): INT4
    /// quantized from floats, or MXFP4 copied bit for bit. For checkpoints
    /// also returns the blake3 of the source bytes as stored (gate ‖ up ‖
    /// down, or the fused tensors' slices of this expert), which the header
    /// records.
    pub fn write_expert<'a>(
        &'a self,
        layer: usize,
        expert: usize,
        out: &mut [u8],
    ) -> Result<Option<blake3::Hash>, CacheError> {
        if let (Storage::FusedMxfp4(names), Kind::Checkpoint(ckpt)) = (&self.storage, &self.kind) {
            let j = self
                .moe_layers
                .iter()
                .position(|&l| l == layer)
                .ok_or_else(|| {
                    CacheError::OutOfRange(format!("decoder layer {layer} has no routed experts"))
                })?;
            let fused = FusedLayer::open(ckpt, &names[j], self.num_experts(), &self.layout)?;
            return fused.copy_expert(expert, &self.layout, out).map(Some);
        }
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

/// What [`SourceIdentity::Checkpoint`] records, accumulated.
struct Ident {
    tensors: usize,
    table: blake3::Hasher,
    dtypes: Vec<String>,
    sample: blake3::Hasher,
    expert_bytes: u64,
}

impl Ident {
    fn new() -> Self {
        Ident {
            tensors: 0,
            table: blake3::Hasher::new(),
            dtypes: Vec::new(),
            sample: blake3::Hasher::new(),
            expert_bytes: 0,
        }
    }
    fn add(&mut self, name: &str, dtype: &str, shape: &[usize]) {
        self.table
            .update(format!("{name} {dtype} {shape:?}\n").as_bytes());
        if !self.dtypes.iter().any(|d| d == dtype) {
            self.dtypes.push(dtype.to_string());
        }
        self.tensors += 1;
    }
}

const SAMPLE: usize = 4096;

fn sample_start(h: &mut blake3::Hasher, b: &[u8]) {
    h.update(&b[..b.len().min(SAMPLE)]);
}
fn sample_middle(h: &mut blake3::Hasher, b: &[u8]) {
    h.update(&b[b.len() / 2..(b.len() / 2 + SAMPLE).min(b.len())]);
}
fn sample_end(h: &mut blake3::Hasher, b: &[u8]) {
    h.update(&b[b.len().saturating_sub(SAMPLE)..]);
}

/// Identity of per-expert float tensors (unchanged from format 1, so a
/// format-1 cache of the same checkpoint sits in the same directory and is
/// found and refused with the rebuild command).
fn per_expert_identity(
    ckpt: &Checkpoint,
    config: &ModelConfig,
    moe_layers: &[usize],
) -> Result<Ident, CacheError> {
    let g = config.geometry();
    let (h, i) = (g.hidden, g.expert_intermediate);
    let mut id = Ident::new();
    let mut first_expert_bytes = None;
    for &layer in moe_layers {
        for e in 0..g.num_experts {
            let names = config.expert_tensor_names(layer, e);
            let shapes = [[i, h], [i, h], [h, i]];
            let mut bytes = 0u64;
            for (name, shape) in names.iter().zip(shapes) {
                let t = ckpt.expect(name, &shape)?;
                id.add(name, t.dtype.name(), t.shape);
                bytes += t.bytes.len() as u64;
            }
            first_expert_bytes.get_or_insert(bytes);
        }
        let names = |e: usize| config.expert_tensor_names(layer, e);
        let n = g.num_experts;
        sample_start(&mut id.sample, ckpt.get(&names(0)[0])?.bytes);
        sample_middle(&mut id.sample, ckpt.get(&names(n / 2)[1])?.bytes);
        sample_end(&mut id.sample, ckpt.get(&names(n - 1)[2])?.bytes);
    }
    id.expert_bytes = first_expert_bytes.unwrap_or(0);
    Ok(id)
}

/// Identity of fused MXFP4 tensors: every tensor's name, dtype and shape,
/// and samples of the gate_up blocks, down blocks and down scales.
fn fused_identity(
    ckpt: &Checkpoint,
    names: &[FusedMxfp4Names],
    experts: usize,
    layout: &ExpertLayout,
) -> Result<Ident, CacheError> {
    let mut id = Ident::new();
    for n in names {
        for (name, dtype, shape) in fused_tensors(n, experts, layout) {
            let t = crate::mxfp4::expect_tensor(ckpt, &name, dtype, &shape)?;
            id.add(&name, dtype.name(), t.shape);
        }
        sample_start(&mut id.sample, ckpt.raw(&n.gate_up_blocks)?.bytes);
        sample_middle(&mut id.sample, ckpt.raw(&n.down_blocks)?.bytes);
        sample_end(&mut id.sample, ckpt.raw(&n.down_scales)?.bytes);
    }
    id.expert_bytes = FusedLayer::expert_bytes(layout);
    Ok(id)
}

fn f32_matrix(v: &[f32]) -> SourceMatrix<'_> {
    SourceMatrix {
        dtype: DType::F32,
        bytes: bytemuck::cast_slice(v),
    }
}
