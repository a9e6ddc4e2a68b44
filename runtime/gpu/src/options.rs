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
    /// Reuse cached prefixes only at multiples of the prefill chunk
    /// (`true`) instead of at any block boundary (`false`, the default).
    /// Any boundary is exact because every prefill GEMM's rows are
    /// invariant to the row count and the first row (`blas.rs`: one fixed
    /// split-K-free algorithm per site), shown on the H200 for the a3b and
    /// GLM-4.5-Air shapes up to a full 8192-row chunk at odd starts
    /// (`runtime/gpu/tests/row_invariance.rs`). Whole chunks are exact by
    /// construction whatever the GEMMs do (a resumed prefill runs exactly
    /// a cold prefill's chunks); no CLI option, the GPU tests use it.
    pub whole_chunk_reuse: bool,
    /// The prefix cache's file (`serve --prefix-cache-file`): loaded at
    /// load, written at [`krasis_model::Engine::save_prefix_cache`]
    /// (`prefix/file.rs`). Needs the cache on.
    pub prefix_cache_file: Option<std::path::PathBuf>,
    /// Caps the HCS reclaimable prior at this many slots (`None`: the whole
    /// prior); the rest stays empty, so more decode lookups miss into the
    /// recency tail. No CLI option: the GPU tests use it to exercise the
    /// tail on models whose experts would all fit in the prior.
    pub hcs_prior_cap: Option<usize>,
    /// Slots of the HCS decode recency tail (`None`: `Hcs::split`'s
    /// default, the whole reclaimable tier with prefill's lent scratch);
    /// the rest of the tier holds the heatmap prior. At least one step's
    /// experts. No CLI option: `bench --hcs-tail` measures other splits.
    pub hcs_tail_slots: Option<usize>,
    /// Most experts HCS decode prefetches into the recency tail per MoE
    /// layer, predicted by the next layer's router (`hcs/tail.rs`; results
    /// are identical either way); 0, the default: off. Measured on the
    /// H200 it loses at every setting (a3b-24l at 6 GiB, decode 16/128:
    /// 431.9/341.2 tok/s off, 384.9/315.8 at 8 per layer, 390.6/330.9 at 1;
    /// `benchmarks/results/2026-12-03-issue16-prefetch.md`). No CLI option:
    /// `bench --hcs-prefetch` measures it, the GPU tests exercise it.
    pub hcs_prefetch: usize,
    /// Most sequences one decode step runs together (continuous batching,
    /// `Batch::capacity`), at most [`MAX_PARALLEL`]. `None`: the default
    /// ([`default_parallel`]).
    pub parallel: Option<usize>,
    /// Rows of every full-attention layer's KV arena, shared by the running
    /// sequences (each reserves its prompt + `max_new_tokens` rows, within
    /// the context; `arena.rs`). At least the context length. `None`: the
    /// context length (one context's KV, as before batching).
    pub kv_rows: Option<usize>,
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
            whole_chunk_reuse: false,
            prefix_cache_file: None,
            hcs_prior_cap: None,
            hcs_tail_slots: None,
            hcs_prefetch: 0,
            parallel: None,
            kv_rows: None,
        }
    }
}

impl CudaEngineOptions {
    /// What a sliding layer's ring is rounded up to (`scratch::KvShape`):
    /// the prefix cache's block when the cache may be on, so every block
    /// lies contiguous in a ring (`prefix.rs`), else 1.
    pub fn ring_block(&self) -> usize {
        if self.prefix_cache.is_on() {
            self.prefix_block.max(1)
        } else {
            1
        }
    }

    /// The KV cache a load of `context` positions with prefill chunks of
    /// at most `max_chunk` tokens and `seqs` sequences at once allocates.
    pub fn kv_shape(
        &self,
        g: &krasis_model::Geometry,
        context: usize,
        max_chunk: usize,
        seqs: usize,
    ) -> crate::scratch::KvShape {
        let rows = self.kv_rows.unwrap_or(context);
        crate::scratch::KvShape::new(g, rows, max_chunk, seqs, self.ring_block())
    }

    /// One context's KV (one sequence's: `context` rows and one ring),
    /// what the prefix cache's `auto` sizes are measured in
    /// (`prefix::pool_bytes`, `prefix::host_bytes`).
    pub fn context_kv_bytes(
        &self,
        g: &krasis_model::Geometry,
        context: usize,
        max_chunk: usize,
    ) -> u64 {
        let one = crate::scratch::KvShape {
            rows: context,
            ..self.kv_shape(g, context, max_chunk, 1)
        };
        one.bytes(g) as u64
    }
}

/// The prefill of a prompt of at most this many tokens runs its routed
/// experts through the expert GEMV kernels (no host sync, no
/// dequantization); a longer prompt's chunks (all of them, also a short
/// last one, so a row is computed the same in every chunking) group their
/// rows by expert and run the grouped expert path (`moe.rs`: the grouped
/// INT4 GEMMs, or dequantization + cuBLASLt for other formats). The GEMV
/// reads every selected expert once per token, so it wins only while
/// `tokens * top_k` is small against the expert count.
pub const GEMV_MAX_TOKENS: usize = 8;

/// Most sequences one decode step can run together: the decode kernels
/// take at most this many rows (`GEMV_MAX_TOKENS`).
pub const MAX_PARALLEL: usize = GEMV_MAX_TOKENS;
// A decode step's rows are sampled in one launch.
const _: () = assert!(MAX_PARALLEL <= krasis_kernels::SAMPLE_MAX_ROWS);

/// KV rows per sequence the default parallelism plans for: an arena of
/// `rows` rows runs `rows / DEFAULT_ROWS_PER_SEQUENCE` sequences at once by
/// default (an agent's turn is a prompt of a few thousand tokens or less
/// plus a few hundred new ones; longer requests simply wait for rows).
pub const DEFAULT_ROWS_PER_SEQUENCE: usize = 512;

/// The default of [`CudaEngineOptions::parallel`]: `rows /
/// DEFAULT_ROWS_PER_SEQUENCE` sequences, at least 1, at most
/// [`MAX_PARALLEL`] and at most the prefill chunk (a decode step's rows
/// share the chunk's scratch). Sliding-window layers keep a ring per
/// sequence (`scratch::KvCache`), so every family batches.
pub fn default_parallel(rows: usize, chunk: usize) -> usize {
    (rows / DEFAULT_ROWS_PER_SEQUENCE).clamp(1, MAX_PARALLEL.min(chunk.max(1)))
}

/// The parallelism and arena rows a load gets from `opts` for a
/// `context`-position context and `chunk`-token prefill
/// chunks, or why they are refused (fail closed: a value the engine cannot
/// run is an error naming it, never lowered quietly).
pub fn batching(
    opts: &CudaEngineOptions,
    context: usize,
    chunk: usize,
) -> Result<(usize, usize), String> {
    let rows = opts.kv_rows.unwrap_or(context);
    if rows < context {
        return Err(format!(
            "kv rows {rows} are fewer than the context length {context}: every request that fits \
             the context must fit an idle engine"
        ));
    }
    let parallel = match opts.parallel {
        None => default_parallel(rows, chunk),
        Some(0) => return Err("parallel must be at least 1".into()),
        Some(p) if p > MAX_PARALLEL => {
            return Err(format!(
                "parallel {p} exceeds {MAX_PARALLEL}, the most rows the decode kernels take"
            ));
        }
        Some(p) if p > chunk => {
            return Err(format!(
                "parallel {p} needs a prefill chunk of at least {p} tokens (a decode step's rows \
                 share the chunk's scratch); the chunk is {chunk}"
            ));
        }
        Some(p) => p,
    };
    Ok((parallel, rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_runs_a_sequence_per_512_rows_up_to_eight() {
        let opts = CudaEngineOptions::default();
        assert_eq!(batching(&opts, 8016, 4008), Ok((8, 8016)));
        assert_eq!(batching(&opts, 2048, 2048), Ok((4, 2048)));
        assert_eq!(batching(&opts, 300, 300), Ok((1, 300)));
        // Never more rows than the chunk's scratch holds.
        assert_eq!(batching(&opts, 8192, 4), Ok((4, 8192)));
        // More arena rows, more sequences (still at most 8).
        let more = CudaEngineOptions {
            kv_rows: Some(3000),
            ..opts.clone()
        };
        assert_eq!(batching(&more, 1024, 1024), Ok((5, 3000)));
    }

    #[test]
    fn values_the_engine_cannot_run_are_refused_by_name() {
        let with = |parallel, kv_rows| CudaEngineOptions {
            parallel,
            kv_rows,
            ..CudaEngineOptions::default()
        };
        let err = |o: CudaEngineOptions, chunk| batching(&o, 4096, chunk).unwrap_err();
        assert!(err(with(Some(0), None), 512).contains("at least 1"));
        assert!(err(with(Some(9), None), 512).contains("exceeds 8"));
        assert!(err(with(Some(4), None), 2).contains("prefill chunk"));
        assert!(err(with(None, Some(4095)), 512).contains("fewer than the context"));
        assert_eq!(batching(&with(Some(3), None), 4096, 512), Ok((3, 4096)));
    }
}
