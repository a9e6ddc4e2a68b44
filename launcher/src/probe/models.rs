//! Finds Hugging Face model directories (a `config.json` next to
//! `*.safetensors`) under the standard roots. What a directory holds comes
//! from the runtime (`krasis-runtime inspect`), never from reading its
//! config here.

use crate::runtime::RuntimeFacts;
use krasis_common::{Backend, ModelFacts, ModelReport};
use serde::Serialize;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RootKind {
    /// `./models` under the working directory.
    Local,
    /// The Hugging Face hub cache (`models--*/snapshots/*`).
    HfHub,
    /// The Krasis data directory (the demo model lives here).
    KrasisData,
    /// Given with `--model-root`.
    User,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelRoot {
    pub path: PathBuf,
    pub kind: RootKind,
}

/// The model's INT4 expert cache as the runtime found it
/// (`krasis-runtime inspect`).
pub use krasis_common::inspect::{BackendFormat, CacheState as CacheStatus, HeatmapState};

/// What the launcher shows of a model: the runtime's facts
/// (`krasis_common::inspect::ModelFacts`) in the launcher's terms.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelSummary {
    pub model_type: String,
    pub total_params: u64,
    pub routed_expert_params: u64,
    /// Parameters one token uses (non-expert + top-k experts per MoE layer).
    pub active_params: u64,
    pub num_layers: usize,
    pub moe_layers: usize,
    pub num_experts: usize,
    pub top_k: usize,
    pub max_position_embeddings: usize,
    /// Bytes of one expert in the expert cache (its layout stride, in the
    /// cache's format: INT4, or MXFP4 for gpt_oss).
    pub int4_expert_stride: u64,
    /// All routed experts in the expert cache.
    pub int4_expert_bytes: u64,
    /// All routed experts in the checkpoint's own precision.
    pub source_expert_bytes: u64,
    pub source_dtype: String,
    /// What each backend really computes with for this model.
    pub backends: Vec<BackendFormat>,
    pub cache: CacheStatus,
    pub heatmap: HeatmapState,
}

impl ModelSummary {
    pub fn from_facts(f: ModelFacts) -> Self {
        let g = &f.geometry;
        ModelSummary {
            model_type: f.model_type,
            total_params: f.params.total,
            routed_expert_params: f.params.routed_experts,
            active_params: f.params.active_per_token,
            num_layers: g.num_layers as usize,
            moe_layers: g.moe_layers as usize,
            num_experts: g.num_experts as usize,
            top_k: g.experts_per_token as usize,
            max_position_embeddings: g.max_position_embeddings as usize,
            int4_expert_stride: f.formats.int4_expert_stride,
            int4_expert_bytes: f.formats.int4_expert_bytes,
            source_expert_bytes: f.formats.checkpoint_expert_bytes,
            source_dtype: f.formats.checkpoint_dtype,
            backends: f.formats.backends,
            cache: f.cache,
            heatmap: f.heatmap,
        }
    }

    /// The engine's expert precision for `backend`, as its load logs it:
    /// `int4 (INT4 expert cache)` on cuda, `bf16 (checkpoint)` on the
    /// reference engine.
    pub fn experts_for(&self, backend: Backend) -> String {
        self.backends
            .iter()
            .find(|b| b.backend == backend)
            .map_or_else(|| "unknown".into(), BackendFormat::describe_experts)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelInfo {
    pub path: PathBuf,
    pub name: String,
    pub root: RootKind,
    /// The model's facts, or why it cannot be used.
    pub summary: Result<ModelSummary, String>,
}

impl ModelInfo {
    pub fn model_type(&self) -> Option<&str> {
        self.summary.as_ref().ok().map(|s| s.model_type.as_str())
    }
}

/// A model directory found on disk (before the runtime is asked about it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoundDir {
    pub path: PathBuf,
    pub name: String,
    pub root: RootKind,
}

/// Asks the runtime about every directory in one `inspect`; each gets its
/// facts or the reason it cannot be served (all the same reason when the
/// runtime itself cannot answer).
pub fn with_facts(
    found: Vec<FoundDir>,
    facts: &dyn RuntimeFacts,
    cache_root: Option<&Path>,
) -> Vec<ModelInfo> {
    let dirs: Vec<PathBuf> = found.iter().map(|d| d.path.clone()).collect();
    let answers = facts.inspect(&dirs, cache_root);
    found
        .into_iter()
        .enumerate()
        .map(|(i, d)| ModelInfo {
            summary: match &answers {
                Ok(reports) => summary_of(reports[i].clone()),
                Err(e) => Err(format!("cannot inspect: {e}")),
            },
            path: d.path,
            name: d.name,
            root: d.root,
        })
        .collect()
}

/// The runtime's facts about one directory (one `inspect`).
pub fn inspect_one(
    facts: &dyn RuntimeFacts,
    dir: &Path,
    cache_root: Option<&Path>,
) -> Result<ModelSummary, String> {
    let mut r = facts.inspect(&[dir.to_path_buf()], cache_root)?;
    summary_of(r.pop().ok_or("the runtime gave no answer")?)
}

/// The launcher's view of one `inspect` entry.
pub fn summary_of(r: ModelReport) -> Result<ModelSummary, String> {
    match r {
        ModelReport::Ok(f) => Ok(ModelSummary::from_facts(f)),
        ModelReport::Error { reason, .. } => Err(reason),
    }
}

/// ./models, the HF hub cache (HF_HUB_CACHE, else HF_HOME/hub, else
/// ~/.cache/huggingface/hub), the Krasis data dir, then the user's roots.
pub fn default_roots(data_models: PathBuf, extra: &[PathBuf]) -> Vec<ModelRoot> {
    let mut roots = vec![ModelRoot {
        path: PathBuf::from("models"),
        kind: RootKind::Local,
    }];
    let hub = std::env::var_os("HF_HUB_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HF_HOME").map(|h| PathBuf::from(h).join("hub")))
        .or_else(|| {
            directories::BaseDirs::new()
                .map(|b| b.home_dir().join(".cache").join("huggingface").join("hub"))
        });
    if let Some(h) = hub {
        roots.push(ModelRoot {
            path: h,
            kind: RootKind::HfHub,
        });
    }
    roots.push(ModelRoot {
        path: data_models,
        kind: RootKind::KrasisData,
    });
    roots.extend(extra.iter().map(|p| ModelRoot {
        path: p.clone(),
        kind: RootKind::User,
    }));
    roots
}

/// Model directories under `roots` (filesystem only: a `config.json` next
/// to `*.safetensors`), each once.
pub fn discover(roots: &[ModelRoot]) -> Vec<FoundDir> {
    let mut found: Vec<FoundDir> = Vec::new();
    for root in roots {
        for dir in candidate_dirs(root) {
            let canon = dir.canonicalize().unwrap_or(dir.clone());
            if found.iter().any(|m| m.path == canon) {
                continue;
            }
            found.push(FoundDir {
                name: display_name(root.kind, &dir),
                path: canon,
                root: root.kind,
            });
        }
    }
    found
}

fn candidate_dirs(root: &ModelRoot) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if root.kind == RootKind::HfHub {
        for repo in subdirs(&root.path) {
            let is_model = repo
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("models--"));
            if is_model {
                out.extend(
                    subdirs(&repo.join("snapshots"))
                        .into_iter()
                        .filter(|d| is_model_dir(d)),
                );
            }
        }
        return out;
    }
    if is_model_dir(&root.path) {
        out.push(root.path.clone());
    }
    // Two levels, for both `models/NAME` and `models/ORG/NAME`.
    for d in subdirs(&root.path) {
        if is_model_dir(&d) {
            out.push(d);
        } else {
            out.extend(subdirs(&d).into_iter().filter(|d| is_model_dir(d)));
        }
    }
    out
}

fn subdirs(p: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(p) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    v.sort();
    v
}

pub fn is_model_dir(p: &Path) -> bool {
    p.join("config.json").is_file() && has_safetensors(p)
}

fn has_safetensors(p: &Path) -> bool {
    std::fs::read_dir(p).is_ok_and(|rd| {
        rd.filter_map(|e| e.ok())
            .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
    })
}

fn display_name(kind: RootKind, dir: &Path) -> String {
    let base = |p: &Path| {
        p.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| p.display().to_string())
    };
    if kind == RootKind::HfHub {
        // .../models--Qwen--Qwen3-30B-A3B/snapshots/<hash>
        if let Some(repo) = dir.parent().and_then(Path::parent) {
            let r = base(repo);
            if let Some(n) = r.strip_prefix("models--") {
                return n.replace("--", "/");
            }
        }
    }
    base(dir)
}
