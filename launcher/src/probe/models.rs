//! Finds Hugging Face model directories (a `config.json` next to
//! `*.safetensors`) under the standard roots and reads their real geometry.

use krasis_cache::ExpertLayout;
use krasis_model::{Geometry, ModelConfig};
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

/// The model's INT4 expert cache as the runtime would find it. The header
/// and the source identity are checked here; the per-layer checksums are
/// verified by the runtime when it opens the cache.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum CacheStatus {
    Valid {
        path: PathBuf,
        bytes: u64,
    },
    /// Present but unusable (stale, other format, damaged); rebuilt on launch.
    Invalid {
        path: PathBuf,
        reason: String,
    },
    /// Not built yet; built on first launch or with `krasis build-cache`.
    Missing {
        path: PathBuf,
    },
    /// The checkpoint could not be opened as a cache source.
    Unknown {
        reason: String,
    },
}

impl CacheStatus {
    pub fn describe(&self) -> String {
        use crate::units::fmt_bytes;
        match self {
            CacheStatus::Valid { path, bytes } => {
                format!("built ({}) at {}", fmt_bytes(*bytes), path.display())
            }
            CacheStatus::Invalid { path, reason } => {
                format!("unusable ({reason}); rebuilt on launch: {}", path.display())
            }
            CacheStatus::Missing { .. } => "not built yet (built on first launch)".into(),
            CacheStatus::Unknown { reason } => format!("cannot tell: {reason}"),
        }
    }
}

/// The `model_type` in `DIR/config.json`, if it parses.
pub fn model_type(dir: &Path) -> Option<String> {
    ModelConfig::load(dir)
        .ok()
        .map(|c| c.model_type().to_string())
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelSummary {
    pub model_type: String,
    pub total_params: u64,
    pub routed_expert_params: u64,
    pub num_layers: usize,
    pub moe_layers: usize,
    pub num_experts: usize,
    pub top_k: usize,
    pub max_position_embeddings: usize,
    /// Bytes of one expert in the INT4 cache (layout stride).
    pub int4_expert_stride: u64,
    /// All routed experts in the INT4 cache.
    pub int4_expert_bytes: u64,
    /// All routed experts in the checkpoint's own precision.
    pub source_expert_bytes: u64,
    pub source_dtype: String,
    pub cache: CacheStatus,
    #[serde(skip)]
    pub geometry: Geometry,
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

pub fn discover(roots: &[ModelRoot], cache_root: Option<&Path>) -> Vec<ModelInfo> {
    let mut found: Vec<ModelInfo> = Vec::new();
    for root in roots {
        for dir in candidate_dirs(root) {
            let canon = dir.canonicalize().unwrap_or(dir.clone());
            if found.iter().any(|m| m.path == canon) {
                continue;
            }
            let name = display_name(root.kind, &dir);
            found.push(ModelInfo {
                summary: summarize(&canon, cache_root),
                path: canon,
                name,
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

/// Reads the model's config and computes its sizes; the error says why the
/// directory cannot be served.
pub fn summarize(dir: &Path, cache_root: Option<&Path>) -> Result<ModelSummary, String> {
    let cfg = ModelConfig::load(dir).map_err(|e| e.to_string())?;
    let g = cfg.geometry();
    let layout = ExpertLayout::new(g.hidden, g.expert_intermediate).ok_or_else(|| {
        format!(
            "expert shape hidden={} intermediate={} is not a multiple of 128; the INT4 cache cannot hold it",
            g.hidden, g.expert_intermediate
        )
    })?;
    let (source_dtype, source_bytes_per_param) = source_dtype(dir);
    let moe_layers = g.num_moe_layers();
    let experts_total = (moe_layers * g.num_experts) as u64;
    Ok(ModelSummary {
        model_type: cfg.model_type().to_string(),
        total_params: g.total_params(),
        routed_expert_params: g.routed_expert_params(),
        num_layers: g.num_layers,
        moe_layers,
        num_experts: g.num_experts,
        top_k: g.top_k,
        max_position_embeddings: g.max_position_embeddings,
        int4_expert_stride: layout.expert_stride as u64,
        int4_expert_bytes: layout.expert_stride as u64 * experts_total,
        source_expert_bytes: g.routed_expert_params() * source_bytes_per_param,
        source_dtype,
        cache: cache_status(dir, cache_root),
        geometry: g,
    })
}

/// `torch_dtype` (or `dtype`) from config.json; BF16 when absent, which is
/// what Qwen3-MoE checkpoints ship.
fn source_dtype(dir: &Path) -> (String, u64) {
    let v: Option<serde_json::Value> = std::fs::read_to_string(dir.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    let d = v
        .as_ref()
        .and_then(|v| v.get("torch_dtype").or_else(|| v.get("dtype")))
        .and_then(|d| d.as_str())
        .unwrap_or("bfloat16")
        .to_string();
    let bytes = match d.as_str() {
        "float32" => 4,
        "float8_e4m3fn" | "int8" => 1,
        _ => 2,
    };
    (d, bytes)
}

/// Where the runtime looks for the cache (`krasis_cache::cache_path`), and
/// whether what is there was built from this checkpoint.
pub fn cache_status(dir: &Path, cache_root: Option<&Path>) -> CacheStatus {
    let source = match krasis_cache::ModelSource::open(dir) {
        Ok(s) => s,
        Err(e) => {
            return CacheStatus::Unknown {
                reason: e.to_string(),
            };
        }
    };
    let path = match krasis_cache::cache_path(&source, cache_root) {
        Ok(p) => p,
        Err(e) => {
            return CacheStatus::Unknown {
                reason: e.to_string(),
            };
        }
    };
    let Ok(meta) = std::fs::metadata(&path) else {
        return CacheStatus::Missing { path };
    };
    match krasis_cache::ExpertCache::open_with(
        &path,
        source.config(),
        krasis_cache::Verify::HeaderOnly,
    ) {
        Ok(c) if c.source() == source.identity() => CacheStatus::Valid {
            path,
            bytes: meta.len(),
        },
        Ok(_) => CacheStatus::Invalid {
            path,
            reason: "built from a different checkpoint".into(),
        },
        Err(e) => CacheStatus::Invalid {
            path,
            reason: e.to_string(),
        },
    }
}
