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

/// What the engine (or one running request) is doing at the moment
/// `/v1/stats` answered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activity {
    #[default]
    Idle,
    /// Prefilling a prompt ([`LiveRequest::prefilled_tokens`] of
    /// [`LiveRequest::prompt_tokens`]).
    Prefilling,
    /// Decoding ([`LiveRequest::generated_tokens`] so far).
    Decoding,
}

/// A request the engine is running, as of this stats snapshot.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LiveRequest {
    /// Server-assigned, increasing; the same id appears in the request log.
    pub id: u64,
    /// Prefilling its prompt or decoding (never idle).
    pub activity: Activity,
    /// `/v1/chat/completions` or `/v1/completions`.
    pub endpoint: String,
    /// The client's socket address, e.g. `127.0.0.1:51234`.
    pub client: Option<String>,
    pub prompt_tokens: u64,
    pub prefilled_tokens: u64,
    pub generated_tokens: u64,
    /// The request's token limit for the completion.
    pub max_tokens: u64,
    /// Since the engine took the job (queue wait excluded).
    pub elapsed_ms: f64,
    /// Time to first token, once there is one: from the request's arrival
    /// at the server (its admission, before the body is read) to its first
    /// generated token, so queue wait and prompt preparation count, as they
    /// do for the client.
    pub ttft_ms: Option<f64>,
    /// Rates so far in this request (0 until measurable).
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
}

/// One finished request, for the launcher's request log.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RequestRecord {
    pub id: u64,
    /// When it ended, milliseconds since the Unix epoch.
    pub finished_unix_ms: u64,
    pub endpoint: String,
    pub client: Option<String>,
    pub prompt_tokens: u64,
    /// Prompt tokens served from the engine's prefix cache.
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    /// Time to first token as [`LiveRequest::ttft_ms`] defines it (None
    /// when none was produced).
    pub ttft_ms: Option<f64>,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// The finish reason the client received: `stop`, `length`, `tool_calls`
    /// (`function_call` for legacy function calling), `tool_call_error` (a
    /// tool call that did not parse or was cut off: its text is in the
    /// content and the choice's `error` says why); or `cancelled` (the
    /// client went away, or the server shut down) or `error` (the client got
    /// an error instead of an answer).
    pub finish_reason: String,
}

/// How many finished requests `/v1/stats` keeps in [`EngineStats::recent_requests`].
pub const REQUEST_LOG_LEN: usize = 64;

/// Live figures for the launcher's run screen (`GET /v1/stats`). The
/// launcher polls it every 200 ms; everything here is cheap to snapshot.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineStats {
    /// Idle; `prefilling` while any running request prefills (a prefill
    /// chunk is part of every engine step then); else `decoding`.
    #[serde(default)]
    pub activity: Activity,
    /// The requests the engine is running, oldest first.
    #[serde(default)]
    pub running: Vec<LiveRequest>,
    /// Sequences the engine is running now (`running.len()`); the
    /// requests waiting for it are [`EngineStats::queue_len`].
    #[serde(default)]
    pub active_sequences: u64,
    /// The most requests the engine runs together (`serve --parallel`).
    #[serde(default)]
    pub parallel: u64,
    /// The engine's KV memory, in tokens, when it batches.
    #[serde(default)]
    pub kv: Option<KvStats>,
    /// Time to first token ([`LiveRequest::ttft_ms`]) of the last finished
    /// request that produced one.
    #[serde(default)]
    pub last_ttft_ms: Option<f64>,
    /// The last [`REQUEST_LOG_LEN`] finished requests, oldest first.
    #[serde(default)]
    pub recent_requests: Vec<RequestRecord>,
    /// Page-locked host memory the engine holds (expert cache, mapped
    /// embedding, staging), when it uses any.
    #[serde(default)]
    pub pinned_host_bytes: Option<u64>,
    pub requests_completed: u64,
    /// Decode steps run since the engine loaded (one token for each of the
    /// step's sequences).
    #[serde(default)]
    pub decode_steps: u64,
    /// Of them, the steps queued on the GPU before the host had read the
    /// step before (decode ahead: the host's work on a step's tokens runs
    /// while the next step computes). The others waited for the host.
    #[serde(default)]
    pub decode_steps_ahead: u64,
    /// Requests whose client went away, stopped early (during prefill
    /// too); not counted as completed.
    #[serde(default)]
    pub requests_cancelled: u64,
    pub requests_rejected: u64,
    /// Answers whose tool call did not parse or was cut off (finish reason
    /// `tool_call_error`), since the server started.
    #[serde(default)]
    pub tool_call_errors: u64,
    /// Requests queued for the engine (prepared, not yet running).
    pub queue_len: u64,
    pub last_prompt_tokens: u64,
    pub last_generated_tokens: u64,
    pub last_prefill_tok_s: f64,
    pub last_decode_tok_s: f64,
    pub hcs: Option<HcsStats>,
    pub vram: Option<VramStats>,
    /// The engine's prefix cache (absent when it has none or it is off).
    #[serde(default)]
    pub prefix_cache: Option<PrefixCacheStats>,
}

/// KV memory of a batching engine, in tokens (one token: one position of
/// every layer's keys and values). A running request reserves its prompt +
/// `max_tokens` (within the context) when it starts; a request that does
/// not fit waits in the queue. `used_tokens` is back to 0 whenever nothing
/// runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct KvStats {
    pub used_tokens: u64,
    pub total_tokens: u64,
}

/// The prefix cache (`krasis_model::prefix_cache`): KV of prompt prefixes
/// held in whole blocks in one or two tiers and reused by later prompts
/// that start with them. Counters are totals since the engine loaded; the
/// sizes and held figures are the sums over `tiers`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PrefixCacheStats {
    /// The tiers' locations joined by `+`: `vram+host`, `host` (CUDA
    /// engine with no VRAM pool), `vram`, ... (each in `tiers`).
    pub location: String,
    /// Prompt tokens per block (`--prefix-block`).
    pub block_tokens: u64,
    pub capacity_blocks: u64,
    pub capacity_bytes: u64,
    pub blocks_held: u64,
    pub bytes_held: u64,
    /// Requests that looked for a cached prefix.
    pub lookups: u64,
    /// Lookups that reused at least one block.
    pub hits: u64,
    pub misses: u64,
    /// Requests that asked not to use the cache (`cache_prompt: false`).
    pub bypassed: u64,
    /// Prompt tokens served from the cache instead of prefilled.
    pub cached_tokens: u64,
    pub blocks_stored: u64,
    /// Blocks dropped from the cache (from any tier).
    pub evictions: u64,
    /// Blocks moved from the first tier to the second (RAM) tier.
    pub demotions: u64,
    /// Times every block was dropped because the engine's settings changed.
    pub invalidations: u64,
    /// Time spent copying cached blocks into requests' KV (all tiers),
    /// total and the last hit's (its slowest tier), ms.
    pub restore_ms: f64,
    pub last_restore_ms: f64,
    /// Time spent copying completed prefills' blocks into the pools (and
    /// the demotions they caused), ms.
    pub store_ms: f64,
    /// Per tier, first tier first (tiers of no capacity are left out).
    pub tiers: Vec<PrefixTierStats>,
}

/// One tier of the prefix cache: the CUDA engine's VRAM pool (`vram`) or
/// its page-locked host tier (`host`); the reference engine's two host
/// pools (`host`, `host-ram`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PrefixTierStats {
    pub location: String,
    pub capacity_blocks: u64,
    pub capacity_bytes: u64,
    pub blocks_held: u64,
    pub bytes_held: u64,
    /// Lookups that restored at least one block from this tier.
    pub hits: u64,
    pub blocks_restored: u64,
    pub bytes_restored: u64,
    /// Time spent restoring from this tier, total and the last hit's, ms.
    pub restore_ms: f64,
    pub last_restore_ms: f64,
    /// Blocks that entered this tier (stored, or demoted into it).
    pub blocks_in: u64,
    /// Blocks that left it (demoted out of the first tier, or dropped).
    pub evictions: u64,
}

/// The GPU expert cache: what calibration decided, and the traffic of the
/// running request (updated while it decodes), or of the last one when idle.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct HcsStats {
    /// Experts on the GPU for decode (resident tier + reclaimable prior).
    pub resident_experts: u64,
    pub total_experts: u64,
    pub resident_bytes: u64,
    /// Slots of the resident tier (survives prefill).
    pub resident_tier_slots: u64,
    /// Slots of the reclaimable tier (the heatmap's next experts; lent to
    /// prefill as staging).
    pub reclaimable_slots: u64,
    /// MoE layers per prefill staging buffer.
    pub group_layers: u64,
    pub safety_margin_bytes: u64,
    /// Measured transient VRAM of a prompt of the configured context length.
    pub transient_bytes: u64,
    /// Fraction of decode (row, expert) pairs whose expert was in VRAM.
    pub hit_rate: f64,
    /// Experts per decode step that a step needed over PCIe: copied into
    /// the recency tail, read in place from page-locked host memory (by
    /// each row that routed to it), or prefetched and then used. One row:
    /// cold experts per token.
    pub cold_experts_per_token: f64,
    /// Their bytes per decode step.
    pub cold_bytes_per_token: f64,
    /// Experts per decode step that prefetch brought over PCIe (the next
    /// layer's router applied early), of which a demand lookup then used
    /// `prefetch_used_per_token` and `prefetch_wasted_per_token` were
    /// evicted unused (bytes over PCIe for nothing). 0 with prefetch off.
    pub prefetched_experts_per_token: f64,
    pub prefetch_used_per_token: f64,
    pub prefetch_wasted_per_token: f64,
    /// Expert bytes streamed by the last prefill.
    pub prefill_stream_bytes: u64,
    pub reload_bytes: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VramStats {
    pub total_bytes: u64,
    pub limit_bytes: Option<u64>,
    /// Free memory within `limit_bytes` when a limit is set (the engine's
    /// budget), else free on the whole card.
    pub free_bytes: u64,
    pub min_free_bytes: u64,
    /// The calibrated safety margin kept free (600 MiB by default).
    #[serde(default)]
    pub margin_bytes: u64,
}
