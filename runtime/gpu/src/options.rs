//! Typed options of the CUDA engine (set from CLI flags / profile fields).

use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq)]
pub struct CudaEngineOptions {
    /// CUDA device ordinal.
    pub device: usize,
    /// Positions the KV cache holds (prompt + generated). `None`: the
    /// model's `max_position_embeddings`.
    pub context_length: Option<usize>,
    /// Prompt tokens per prefill launch sequence; bounds the activation
    /// scratch (about 0.2 MB per token for a3b).
    pub prefill_chunk: usize,
    /// Replay the decode step as one captured CUDA graph (identical
    /// results; less launch overhead).
    pub cuda_graphs: bool,
    /// Where the expert cache lives (`None`: the platform cache dir).
    pub cache_root: Option<PathBuf>,
    /// Where compiled kernels are cached.
    pub kernel_cache: krasis_kernels::CacheDir,
    /// Most device bytes the engine may hold (counted from the driver's
    /// free memory after the context exists; every allocation is checked).
    pub vram_limit: Option<u64>,
    /// Keep as many experts resident as the measured budget allows and copy
    /// the others on demand (HCS). Off: every expert must be resident, and a
    /// model that does not fit is refused at load.
    pub hcs: bool,
    /// Where the initial residents come from when not every expert fits.
    pub heatmap: krasis_common::options::HeatmapChoice,
    /// Free VRAM kept in reserve after calibration.
    pub safety_margin: u64,
    /// How the host backing is made page-locked.
    pub host_backing: krasis_cache::HostBacking,
    /// The prefix cache and its VRAM pool (`crate::prefix::pool_bytes` is
    /// the rule; `Off` turns the whole cache off); off unless asked for
    /// (`serve` asks for `Auto`).
    pub prefix_cache: krasis_common::options::PrefixCacheChoice,
    /// The prefix cache's page-locked host tier
    /// (`crate::prefix::host_bytes`).
    pub prefix_cache_host: krasis_common::options::PrefixCacheChoice,
    /// Prompt tokens per prefix cache block (a multiple of 64).
    pub prefix_block: usize,
}

impl Default for CudaEngineOptions {
    fn default() -> Self {
        CudaEngineOptions {
            device: 0,
            context_length: None,
            prefill_chunk: 8192,
            cuda_graphs: true,
            cache_root: None,
            kernel_cache: krasis_kernels::CacheDir::Platform,
            vram_limit: None,
            hcs: true,
            heatmap: krasis_common::options::HeatmapChoice::Auto,
            safety_margin: krasis_common::plan::DEFAULT_SAFETY_MARGIN_MIB << 20,
            host_backing: krasis_cache::HostBacking::RegisterMmap,
            prefix_cache: krasis_common::options::PrefixCacheChoice::Off,
            prefix_cache_host: krasis_common::options::PrefixCacheChoice::Off,
            prefix_block: krasis_common::options::DEFAULT_PREFIX_BLOCK as usize,
        }
    }
}

/// The prefill of a prompt of at most this many tokens runs its routed
/// experts through the expert GEMV kernels (no host sync, no
/// dequantization); a longer prompt's chunks (all of them, also a short
/// last one, so a row is computed the same in every chunking) dequantize
/// the experts to BF16 and multiply them with cuBLASLt over the tokens
/// routed to each. The GEMV reads every selected expert once per token, so
/// it wins only while `tokens * top_k` is small against the expert count.
pub const GEMV_MAX_TOKENS: usize = 8;
