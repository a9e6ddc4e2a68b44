//! The pre-flight memory plan: what `krasis-runtime plan --model DIR ... --json`
//! prints. The runtime computes it with the same size functions its engines
//! call when they place memory at load, so the launcher's estimate and the
//! engine cannot disagree about anything the engine decides by formula.
//! What the engine measures at load (the per-request transient, by
//! calibration) is estimated here from the same buffer sizes and marked
//! `estimate: true`.
//!
//! JSON shape (stable; fields are only ever added):
//!
//! ```json
//! { "protocol_version": 6, "model": "/m/a3b", "backend": "cuda", "context_length": 32768,
//!   "host": { "items": [ { "name": "INT4 expert cache (page-locked)", "bytes": 14948794368, "estimate": false } ],
//!             "total_bytes": ... },
//!   "gpu": { "device": { "status": "known", "source": "given", "free_bytes": ..., "total_bytes": ..., "budget_bytes": ... },
//!            "items": [ { "name": "non-expert weights (bf16)", "bytes": ..., "estimate": false }, ... ],
//!            "fixed_bytes": ..., "prefill_chunk": 8192,
//!            "transient": { "name": "...", "bytes": ..., "estimate": true },
//!            "safety_margin_bytes": 629145600,
//!            "experts": { "placement": "hcs", "total_experts": 6144, "expert_stride": 2433024,
//!                         "all_bytes": ..., "on_gpu_experts": 2210, "on_gpu_bytes": ... },
//!            "verdict": { "status": "fits" } },
//!   "notes": [ ... ], "warnings": [ ... ] }
//! ```
//!
//! `gpu` is `null` for the reference backend. Enums are internally tagged by
//! `status` (or `placement`), never `{"Fits": ...}`.

use crate::options::Backend;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Free VRAM the CUDA engine keeps in reserve after calibration, in MiB:
/// the default of `--safety-margin-mib`, `LaunchOptions::safety_margin_mib`
/// and the engine options. Defined once here.
pub const DEFAULT_SAFETY_MARGIN_MIB: u64 = 600;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub protocol_version: u32,
    pub model: PathBuf,
    pub backend: Backend,
    /// Positions the KV cache is sized for.
    pub context_length: u64,
    pub host: HostPlan,
    /// `None` for the reference backend (it runs on the CPU).
    pub gpu: Option<GpuPlan>,
    /// How to read the figures (what is measured at load, what is left out).
    pub notes: Vec<String>,
    /// Problems the launch will run into.
    pub warnings: Vec<String>,
}

/// One allocation class and its size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanItem {
    pub name: String,
    pub bytes: u64,
    /// True when the engine measures this at load and the plan can only
    /// estimate it.
    pub estimate: bool,
}

impl PlanItem {
    pub fn exact(name: &str, bytes: u64) -> Self {
        PlanItem {
            name: name.into(),
            bytes,
            estimate: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostPlan {
    pub items: Vec<PlanItem>,
    pub total_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuPlan {
    pub device: DeviceBudget,
    /// Allocations made at load whatever the budget (weights, KV, scratch,
    /// workspaces, HCS staging).
    pub items: Vec<PlanItem>,
    pub fixed_bytes: u64,
    /// Prompt tokens per prefill chunk (scratch is sized for it; shrunk
    /// under a tight budget).
    pub prefill_chunk: u64,
    /// Per-request VRAM beyond the fixed allocations (with HCS, measured by
    /// calibration at load; estimated here).
    pub transient: PlanItem,
    pub safety_margin_bytes: u64,
    pub experts: ExpertPlan,
    pub verdict: Verdict,
}

/// The VRAM the engine may use.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum DeviceBudget {
    Known {
        /// `driver`: asked the CUDA driver; `given`: the caller's figure
        /// (`--device-free`).
        source: String,
        free_bytes: u64,
        total_bytes: Option<u64>,
        /// Free memory capped by `--vram-limit`.
        budget_bytes: u64,
    },
    /// No device to plan against; the fixed sizes are still given.
    Unknown { reason: String },
}

impl DeviceBudget {
    pub fn budget_bytes(&self) -> Option<u64> {
        match self {
            DeviceBudget::Known { budget_bytes, .. } => Some(*budget_bytes),
            DeviceBudget::Unknown { .. } => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertPlan {
    pub placement: Placement,
    pub total_experts: u64,
    /// Bytes of one expert in the INT4 cache.
    pub expert_stride: u64,
    /// Every routed expert in VRAM.
    pub all_bytes: u64,
    /// Experts on the GPU for decode (HCS: resident tier + reclaimable prior).
    pub on_gpu_experts: u64,
    pub on_gpu_bytes: u64,
}

impl ExpertPlan {
    /// Fraction of all routed experts on the GPU for decode.
    pub fn coverage(&self) -> f64 {
        if self.total_experts == 0 {
            0.0
        } else {
            self.on_gpu_experts as f64 / self.total_experts as f64
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// Every expert resident (CUDA graphs, no copies).
    AllResident,
    /// HCS: the heatmap's top experts resident, the rest copied on demand.
    Hcs,
    /// The model has no routed experts.
    NoExperts,
    /// Not decided: no device figures.
    Unknown,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Verdict {
    Fits,
    DoesNotFit { reason: String },
    Unknown { reason: String },
}

impl Plan {
    /// Whether the plan says the launch fits (`None`: cannot tell).
    pub fn fits(&self) -> Option<bool> {
        match self.gpu.as_ref().map(|g| &g.verdict) {
            None | Some(Verdict::Fits) => Some(true),
            Some(Verdict::DoesNotFit { .. }) => Some(false),
            Some(Verdict::Unknown { .. }) => None,
        }
    }

    /// Human-readable lines, for `plan` without `--json`, the launcher's
    /// summary screen and its headless output.
    pub fn lines(&self) -> Vec<String> {
        use crate::size::format_size as b;
        let list = |items: &[PlanItem]| {
            items
                .iter()
                .map(|i| {
                    let est = if i.estimate { " (estimate)" } else { "" };
                    format!("{} {}{est}", i.name, b(i.bytes))
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut v = vec![format!(
            "host RAM for {}: {} in all",
            list(&self.host.items),
            b(self.host.total_bytes)
        )];
        match &self.gpu {
            None => v.push(format!(
                "context {} tokens; no GPU memory used ({} backend)",
                self.context_length,
                self.backend.as_str()
            )),
            Some(g) => {
                match &g.device {
                    DeviceBudget::Known {
                        budget_bytes,
                        free_bytes,
                        ..
                    } => v.push(format!(
                        "VRAM budget {} ({} free)",
                        b(*budget_bytes),
                        b(*free_bytes)
                    )),
                    DeviceBudget::Unknown { reason } => {
                        v.push(format!("VRAM budget unknown: {reason}"))
                    }
                }
                v.push(format!(
                    "VRAM fixed {}: {}; context {} tokens, prefill chunk {}",
                    b(g.fixed_bytes),
                    list(&g.items),
                    self.context_length,
                    g.prefill_chunk
                ));
                let est = if g.transient.estimate {
                    " (estimate; measured at load)"
                } else {
                    ""
                };
                v.push(format!(
                    "per-request {} {}{est}; safety margin {}",
                    g.transient.name,
                    b(g.transient.bytes),
                    b(g.safety_margin_bytes)
                ));
                let e = &g.experts;
                v.push(match e.placement {
                    Placement::AllResident => format!(
                        "experts: all {} resident ({})",
                        e.total_experts,
                        b(e.all_bytes)
                    ),
                    Placement::Hcs => format!(
                        "HCS: {}/{} experts on the GPU ({}, {:.1}% coverage)",
                        e.on_gpu_experts,
                        e.total_experts,
                        b(e.on_gpu_bytes),
                        e.coverage() * 100.0
                    ),
                    Placement::NoExperts => "experts: none (dense model)".into(),
                    Placement::Unknown => format!(
                        "experts: {} ({}) placed at load",
                        e.total_experts,
                        b(e.all_bytes)
                    ),
                });
                match &g.verdict {
                    Verdict::Fits => {}
                    Verdict::DoesNotFit { reason } => {
                        v.push(format!("WARNING: will not fit: {reason}"))
                    }
                    Verdict::Unknown { reason } => v.push(format!("fit unknown: {reason}")),
                }
            }
        }
        v.extend(self.notes.iter().map(|n| format!("note: {n}")));
        v.extend(self.warnings.iter().map(|w| format!("WARNING: {w}")));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn verdicts_and_budgets_are_tagged_not_wrapped() {
        assert_eq!(
            serde_json::to_value(Verdict::Fits).unwrap(),
            json!({"status": "fits"})
        );
        assert_eq!(
            serde_json::to_value(DeviceBudget::Unknown { reason: "x".into() }).unwrap(),
            json!({"status": "unknown", "reason": "x"})
        );
        assert_eq!(
            serde_json::to_value(Placement::AllResident).unwrap(),
            json!("all_resident")
        );
    }
}
