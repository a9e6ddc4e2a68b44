//! The model facts report: what `krasis-runtime inspect --model DIR ... --json`
//! prints. The runtime is the one authority on what a model directory holds
//! (architecture, geometry, parameter counts, the precision each engine really
//! computes with, the expert cache and heatmap on disk); the launcher reads
//! this report instead of parsing configs or caches itself.
//!
//! JSON shape (stable; fields are only ever added):
//!
//! ```json
//! {
//!   "protocol_version": 6,
//!   "models": [
//!     { "status": "ok", "path": "/m/a3b", "model_type": "qwen3_moe",
//!       "geometry": { "hidden_size": 2048, ... },
//!       "params": { "total": 30532122624, "routed_experts": 28991029248, "active_per_token": 3353... },
//!       "formats": { "checkpoint_dtype": "bf16", "int4_expert_stride": 2433024,
//!                    "int4_expert_bytes": ..., "checkpoint_expert_bytes": ...,
//!                    "backends": [ { "backend": "cuda", "experts": "int4", "expert_source": "INT4 expert cache",
//!                                    "compute": "bf16", "kv": "bf16" }, ... ] },
//!       "cache": { "status": "valid", "path": "...", "bytes": 14948794368 },
//!       "heatmap": { "status": "missing", "path": "..." } },
//!     { "status": "error", "path": "/m/llama", "reason": "model_type 'llama' is not supported" }
//!   ]
//! }
//! ```
//!
//! Every enum is internally tagged by `status` (never `{"Ok": ...}`).

use crate::options::Backend;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// `krasis-runtime inspect --json`: one entry per `--model`, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InspectReport {
    pub protocol_version: u32,
    pub models: Vec<ModelReport>,
}

/// One model directory: its facts, or why it cannot be served. A broken or
/// unsupported directory is an entry, never a failed command, so one bad
/// directory does not hide the others.
// One report per model directory, made once and read once: boxing the
// facts would only add indirection.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum ModelReport {
    Ok(ModelFacts),
    Error { path: PathBuf, reason: String },
}

impl ModelReport {
    pub fn path(&self) -> &std::path::Path {
        match self {
            ModelReport::Ok(f) => &f.path,
            ModelReport::Error { path, .. } => path,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelFacts {
    /// The directory as given to `inspect`.
    pub path: PathBuf,
    /// Hugging Face `model_type`, e.g. `qwen3_moe`.
    pub model_type: String,
    pub geometry: GeometryFacts,
    pub params: ParamCounts,
    pub formats: Formats,
    pub cache: CacheState,
    pub heatmap: HeatmapState,
}

/// The shape of the network, in Hugging Face config terms.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GeometryFacts {
    pub vocab_size: u64,
    pub hidden_size: u64,
    pub num_layers: u64,
    /// Layers whose MLP is routed experts.
    pub moe_layers: u64,
    pub num_experts: u64,
    /// Experts each token is routed to (top-k).
    pub experts_per_token: u64,
    pub num_attention_heads: u64,
    pub num_kv_heads: u64,
    pub head_dim: u64,
    /// Width of one routed expert's FFN.
    pub moe_intermediate_size: u64,
    /// Width of a dense layer's MLP.
    pub intermediate_size: u64,
    pub max_position_embeddings: u64,
    pub tie_word_embeddings: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamCounts {
    pub total: u64,
    /// All routed experts of all MoE layers.
    pub routed_experts: u64,
    /// Parameters one token uses: everything but the routed experts, plus
    /// `experts_per_token` routed experts per MoE layer.
    pub active_per_token: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Formats {
    /// Element type of the checkpoint's routed experts (or of its weights
    /// when it has none), lower case: `bf16`, `f16`, `f32`.
    pub checkpoint_dtype: String,
    /// Bytes of one expert in the expert cache, in the format the model's
    /// cache holds: INT4, or MXFP4 for gpt_oss (the name predates MXFP4 and
    /// stays: fields are only ever added); 0 when it cannot have one.
    pub int4_expert_stride: u64,
    /// All routed experts in the expert cache, in its format (as above).
    pub int4_expert_bytes: u64,
    /// All routed experts as the checkpoint stores them.
    pub checkpoint_expert_bytes: u64,
    /// What each backend of this runtime really computes with for this model.
    pub backends: Vec<BackendFormat>,
}

impl Formats {
    pub fn backend(&self, b: Backend) -> Option<&BackendFormat> {
        self.backends.iter().find(|f| f.backend == b)
    }
}

/// The precisions one engine uses for this model, as its load logs them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendFormat {
    pub backend: Backend,
    /// Routed expert weights as the engine reads them: `int4`, `bf16`, ...
    pub experts: String,
    /// Where they come from: `INT4 expert cache`, `checkpoint`.
    pub expert_source: String,
    /// Activations and non-expert weights.
    pub compute: String,
    /// KV cache elements.
    pub kv: String,
}

impl BackendFormat {
    /// `int4 (INT4 expert cache)`, `bf16 (checkpoint)`.
    pub fn describe_experts(&self) -> String {
        format!("{} ({})", self.experts, self.expert_source)
    }
}

/// The INT4 expert cache the CUDA engine would open for this model. The
/// header and source identity are checked; per-layer checksums are verified
/// when the engine opens it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum CacheState {
    Valid {
        path: PathBuf,
        bytes: u64,
    },
    /// Not built yet: built on first launch with the cuda backend, or with
    /// `krasis build-cache`.
    Missing {
        path: PathBuf,
    },
    /// Present but unusable (stale, other format, damaged); rebuilt on launch.
    Invalid {
        path: PathBuf,
        reason: String,
    },
    /// Only a cache of an older format (1) is there: launching refuses it
    /// (it is neither used nor replaced silently) until `command` rebuilds
    /// it; `reason` is the refusal's message.
    OldFormat {
        path: PathBuf,
        reason: String,
        command: String,
    },
    /// This model has no INT4 cache (no routed experts, shapes the format
    /// cannot hold, no cache directory).
    Unavailable {
        reason: String,
    },
}

impl CacheState {
    pub fn describe(&self) -> String {
        use crate::size::format_size;
        match self {
            CacheState::Valid { path, bytes } => {
                format!("built ({}) at {}", format_size(*bytes), path.display())
            }
            CacheState::Missing { .. } => "not built yet (built on first launch)".into(),
            CacheState::Invalid { path, reason } => {
                format!("unusable ({reason}); rebuilt on launch: {}", path.display())
            }
            CacheState::OldFormat { command, .. } => {
                format!("an older format, refused at launch; rebuild it with `{command}`")
            }
            CacheState::Unavailable { reason } => format!("none: {reason}"),
        }
    }
}

/// The route heatmap next to the cache (the HCS prior).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum HeatmapState {
    Present {
        path: PathBuf,
        tokens: u64,
        routes: u64,
    },
    Missing {
        path: PathBuf,
    },
    Invalid {
        path: PathBuf,
        reason: String,
    },
    /// No valid cache, so no heatmap can be bound to it.
    Unavailable {
        reason: String,
    },
}

impl HeatmapState {
    pub fn describe(&self) -> String {
        match self {
            HeatmapState::Present { tokens, .. } => format!("recorded over {tokens} tokens"),
            HeatmapState::Missing { .. } => {
                "none recorded (`krasis heatmap` records one; needed when not every expert fits)"
                    .into()
            }
            HeatmapState::Invalid { reason, .. } => format!("unusable: {reason}"),
            HeatmapState::Unavailable { reason } => format!("none: {reason}"),
        }
    }
}

/// A count as people read parameter counts: `30.5B`, `145.2M`, `9.4K`,
/// `512` (one decimal, the largest unit it reaches; never `0.0B`).
pub fn format_count(n: u64) -> String {
    const UNITS: [(&str, f64); 4] = [("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)];
    let Some(i) = UNITS.iter().position(|&(_, d)| n as f64 >= d) else {
        return n.to_string();
    };
    let v = n as f64 / UNITS[i].1;
    // 999,960 is `1.0M`, not `1000.0K`.
    if (v * 10.0).round() >= 10_000.0 && i > 0 {
        return format!("{:.1}{}", v / 1000.0, UNITS[i - 1].0);
    }
    format!("{v:.1}{}", UNITS[i].0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn counts_get_a_sensible_unit() {
        assert_eq!(format_count(30_532_122_624), "30.5B");
        assert_eq!(format_count(145_200_000), "145.2M");
        assert_eq!(format_count(9_400), "9.4K");
        assert_eq!(format_count(512), "512");
        assert_eq!(format_count(0), "0");
        assert_eq!(format_count(999_960), "1.0M");
        assert_eq!(format_count(1_000), "1.0K");
        assert_eq!(format_count(2_400_000_000_000), "2.4T");
    }

    #[test]
    fn entries_are_tagged_by_status_not_wrapped() {
        let e = ModelReport::Error {
            path: "/m".into(),
            reason: "nope".into(),
        };
        assert_eq!(
            serde_json::to_value(&e).unwrap(),
            json!({"status": "error", "path": "/m", "reason": "nope"})
        );
        let c = CacheState::Missing { path: "/c".into() };
        assert_eq!(
            serde_json::to_value(&c).unwrap(),
            json!({"status": "missing", "path": "/c"})
        );
        let back: ModelReport = serde_json::from_value(serde_json::to_value(&e).unwrap()).unwrap();
        assert_eq!(back, e);
    }
}
