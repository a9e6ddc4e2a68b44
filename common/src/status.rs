//! `/health` and stats payloads served by the runtime and read by the launcher.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Loading,
    BuildingCache,
    Calibrating,
    Ready,
    Failed,
}

/// Readiness as probes and supervisors read it (llama.cpp's convention):
/// `/health` answers 503 with `loading` until the model serves requests,
/// 200 with `ok` while it does, and 503 with `error` after loading failed or
/// the engine faulted (the runtime then exits with [`EXIT_ENGINE_FAULT`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HealthStatus {
    Loading,
    Ok,
    Error,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Health {
    pub status: HealthStatus,
    pub phase: Phase,
    pub model_loaded: bool,
    pub model: Option<String>,
    pub backend: String,
    /// What failed, with `status: error`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Exit status of `krasis-runtime serve` after a fault inside the engine (a
/// panic or a CUDA error): the engine is never reused in an unknown state, so
/// the process reports unhealthy and exits with this code, and the launcher's
/// supervisor restarts it. (70 is `EX_SOFTWARE` of sysexits.h.)
pub const EXIT_ENGINE_FAULT: i32 = 70;

/// Live figures for the launcher's run screen (`GET /v1/stats`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineStats {
    pub requests_completed: u64,
    /// Requests whose client went away, stopped early (during prefill
    /// too); not counted as completed.
    #[serde(default)]
    pub requests_cancelled: u64,
    pub requests_rejected: u64,
    pub queue_len: u64,
    pub last_prompt_tokens: u64,
    pub last_generated_tokens: u64,
    pub last_prefill_tok_s: f64,
    pub last_decode_tok_s: f64,
    pub hcs: Option<HcsStats>,
    pub vram: Option<VramStats>,
}

/// The GPU expert cache: what calibration decided, and the last request's
/// traffic.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct HcsStats {
    /// Experts on the GPU for decode (resident tier + reclaimable prior).
    pub resident_experts: u64,
    pub total_experts: u64,
    pub resident_bytes: u64,
    /// Slots of the resident tier (survives prefill).
    pub resident_tier_slots: u64,
    /// Slots of the reclaimable tier (prior + recency tail; lent to prefill).
    pub reclaimable_slots: u64,
    pub tail_slots: u64,
    /// MoE layers per prefill staging buffer.
    pub group_layers: u64,
    pub safety_margin_bytes: u64,
    /// Measured transient VRAM of a prompt of the configured context length.
    pub transient_bytes: u64,
    pub hit_rate: f64,
    pub cold_experts_per_token: f64,
    pub cold_bytes_per_token: f64,
    /// Copy-stream time of decode misses per token (CUDA events), ms.
    pub copy_ms_per_token: f64,
    pub promotions: u64,
    pub evictions: u64,
    /// Expert bytes streamed by the last prefill.
    pub prefill_stream_bytes: u64,
    pub reload_bytes: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VramStats {
    pub total_bytes: u64,
    pub limit_bytes: Option<u64>,
    pub free_bytes: u64,
    pub min_free_bytes: u64,
}
