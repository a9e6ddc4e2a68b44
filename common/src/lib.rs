//! The contract between the `krasis` launcher and the `krasis-runtime` binary.
//!
//! Everything both sides must agree on lives here exactly once: the typed launch
//! options (and how they become runtime command-line arguments), the capability
//! report the runtime prints with `capabilities --json`, the JSON-lines progress
//! events the runtime writes to stdout while it starts, and the `/health` and
//! stats payloads. The launcher validates against these types; the runtime
//! produces them. Nothing here depends on CUDA, HTTP or the model code.

pub mod capabilities;
pub mod events;
pub mod inspect;
pub mod options;
pub mod plan;
pub mod size;
pub mod status;

pub use capabilities::{ArchitectureCaps, ArchitectureDefaults, BackendCaps, Capabilities};
pub use events::ProgressEvent;
pub use inspect::{InspectReport, ModelFacts, ModelReport};
pub use options::{API_KEY_ENV, Backend, LaunchOptions, OptionError};
pub use plan::{DEFAULT_SAFETY_MARGIN_MIB, Plan};
pub use size::{SizeError, format_size, parse_size};
pub use status::{
    Activity, EXIT_ENGINE_FAULT, EngineStats, Health, HealthStatus, KvStats, LiveRequest, Phase,
    REQUEST_LOG_LEN, RequestRecord,
};

/// Version of the launcher <-> runtime contract. Bumped on any incompatible
/// change so a launcher refuses a runtime it does not understand. 2: the
/// `inspect` and `plan` reports, architectures with `display_name` and
/// `backends`, the live `/v1/stats` fields. 3: the `mlp_precision` option
/// (`--mlp-precision`), architectures with `mlp_precisions`. 4: the
/// `prefix_cache` option (`--prefix-cache`), `/v1/stats` `prefix_cache`
/// and `cached_tokens` in the request log. 5: continuous batching: the
/// `parallel` and `kv_tokens` options (`--parallel`, `--kv-tokens`),
/// `/v1/stats` `running` (a list, replacing `current`) with each request's
/// `activity`, `parallel` and `kv`.
/// 6: the prefix cache's RAM tier
/// and block size (`prefix_cache_host`, `prefix_block`: `--prefix-cache-host`,
/// `--prefix-block`; `0` is a size, not `off`), `/v1/stats` `prefix_cache`
/// with `tiers` and `demotions`. 7: the prefix cache's file
/// (`prefix_cache_file`: `--prefix-cache-file`).
pub const PROTOCOL_VERSION: u32 = 7;
