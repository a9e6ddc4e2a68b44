//! The canonical INT4 routed-expert cache.
//!
//! - [`layout`]: per-expert byte layout and the exact quantization rule.
//! - [`quant`]: the quantizer and dequantizer implementing that rule.
//! - [`format`]: the file container (preamble, header JSON, layer regions).
//! - [`source`]: expert weights from a checkpoint or a synthetic recipe.
//! - [`builder`]: locked, atomic, layer-at-a-time parallel builds.
//! - [`cache`]: [`ExpertCache`], the validated memory-mapped reader.
//! - [`ensure`]: cache paths and [`ensure_cache`] (open or build).
//! - [`int4`]: [`Int4Experts`], the dequantizing `ExpertWeights` source.
//! - [`pinned`]: page-locked host backing for GPU copies.
//! - [`heatmap`]: [`Heatmap`], versioned route counts bound to a cache (the HCS prior).

mod atomic;
pub mod builder;
pub mod cache;
pub mod ensure;
pub mod error;
pub mod format;
pub mod heatmap;
pub mod int4;
pub mod layout;
pub mod lock;
pub mod pinned;
pub mod quant;
pub mod source;
pub mod verify;

pub use builder::{BuildOptions, BuildReport, LayerDone, build};
pub use cache::{ExpertCache, Verify};
pub use ensure::{
    cache_path, default_cache_root, ensure_cache, ensure_cache_at, ensure_cache_reporting,
    open_for_source,
};
pub use error::CacheError;
pub use format::{FILE_NAME, FORMAT_VERSION, Header, SourceIdentity};
pub use heatmap::{
    HEATMAP_FILE_NAME, HEATMAP_VERSION, Heatmap, HeatmapBinding, HeatmapError,
    default_heatmap_path, describe_prompt_text,
};
pub use int4::Int4Experts;
pub use layout::{ExpertLayout, GROUP_SIZE};
pub use lock::LockWait;
pub use pinned::{HostBacking, HostModeReport, PinnedExperts, measure_host_modes};
pub use quant::QUANTIZER_VERSION;
pub use source::ModelSource;
pub use verify::{VerifyReport, verify_against_source};
