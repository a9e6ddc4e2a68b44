//! The canonical routed-expert cache (format 2: INT4 with group 128/64/32,
//! or the checkpoint's MXFP4 bits).
//!
//! - [`layout`]: [`ExpertFormat`], per-expert byte layouts and the exact
//!   INT4 quantization rule.
//! - [`quant`]: the INT4 quantizer and dequantizer implementing that rule.
//! - [`mxfp4`]: the bit-exact MXFP4 copy and its exact decode.
//! - [`format`]: the file container (preamble, header JSON, layer regions).
//! - [`source`]: expert weights from a checkpoint or a synthetic recipe.
//! - [`builder`]: locked, atomic, layer-at-a-time parallel builds.
//! - [`cache`]: [`ExpertCache`], the validated memory-mapped reader.
//! - [`ensure`]: cache paths and [`ensure_cache`] (open or build).
//! - [`experts`]: [`CacheExperts`], the decoding `ExpertWeights` source.
//! - [`pinned`]: page-locked host backing for GPU copies.
//! - [`heatmap`]: [`Heatmap`], versioned route counts bound to a cache (the HCS prior).

pub mod builder;
pub mod cache;
pub mod ensure;
pub mod error;
pub mod experts;
pub mod format;
pub mod heatmap;
pub mod layout;
pub mod lock;
pub mod mxfp4;
pub mod pinned;
pub mod quant;
pub mod source;
pub mod verify;

pub use builder::{BuildOptions, BuildReport, LayerDone, build};
pub use cache::{ExpertCache, Verify};
pub use ensure::{
    cache_path, default_cache_root, ensure_cache, ensure_cache_at, ensure_cache_reporting,
    format_1_beside, open_for_source, rebuild_command,
};
pub use error::CacheError;
pub use experts::CacheExperts;
pub use format::{FILE_NAME, FORMAT_VERSION, Header, SourceIdentity, V1_FILE_NAME};
pub use heatmap::{
    HEATMAP_FILE_NAME, HEATMAP_VERSION, Heatmap, HeatmapBinding, HeatmapError,
    default_heatmap_path, describe_prompt_text,
};
pub use layout::{ExpertFormat, ExpertLayout, ExpertPrecision, GROUP_SIZE};
pub use lock::LockWait;
pub use pinned::{HostBacking, HostModeReport, PinnedExperts, measure_host_modes};
pub use quant::QUANTIZER_VERSION;
pub use source::{ModelSource, model_layout};
pub use verify::{VerifyReport, verify_against_source};
