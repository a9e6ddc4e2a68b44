//! [`CudaEngine`]: the `krasis_model::Engine` implementation on one GPU.
//!
//! Requests run through the continuous-batching step interface
//! (`krasis_model::batch`, `batch.rs`): `generate` is
//! `batch::generate_one`, so one request alone and several together run
//! the same code. Prefill runs a prompt on the GPU in chunks of
//! `prefill_chunk` tokens; the request's cancel token is looked at before
//! every chunk (and every decode step), and a cancelled prefill ends with
//! `Cancelled` and no token. A decode step's only host work is writing the
//! rows' token ids, positions and KV bases (4 bytes each per row),
//! launching (one graph replay per row count, or the kernels one by one
//! when graphs are off or under HCS), launching each row's sampler, and
//! reading the sampled ids (4 bytes per row).

use crate::device::Gpu;
use crate::error::{GpuError, Result};
use crate::experts::ExpertTable;
use crate::forward::{Model, Positions};
use crate::options::{CudaEngineOptions, GEMV_MAX_TOKENS};
use crate::scratch::{KvCache, LOGIT_ROWS, Scratch};
use crate::weights::ModelWeights;
use cudarc::driver::CudaGraph;
use krasis_common::events::EventSink;
use krasis_common::status::EngineStats;
use krasis_kernels::Kernels;
use krasis_model::{
    CancelToken, Checkpoint, Engine, EngineError, EngineInfo, GenerateOutcome, GenerateRequest,
    Geometry, LiveProgress, ModelConfig, SamplingParams,
};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// What loading put on the device, for logs and bench reports.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LoadReport {
    pub model_dir: PathBuf,
    pub cache_path: Option<PathBuf>,
    pub cache_format_version: u32,
    pub weight_bytes: usize,
    /// Non-expert weights kept in mapped host memory (the input embedding).
    pub host_weight_bytes: usize,
    pub expert_bytes: usize,
    pub kv_bytes: usize,
    pub context_length: usize,
    pub prefill_chunk: usize,
    pub load_seconds: f64,
    /// What calibration measured and decided (MoE models with HCS on).
    pub hcs: Option<crate::setup::HcsReport>,
    /// The prefix cache's VRAM pool and page-locked host tier (both 0: no
    /// cache) and its block size.
    pub prefix_cache_bytes: u64,
    pub prefix_host_bytes: u64,
    pub prefix_block_tokens: usize,
    /// Most sequences one decode step runs together, and the rows of the
    /// KV arena they share (`arena.rs`).
    pub parallel: usize,
    pub kv_rows: usize,
    /// The prefill kernels chosen for this device (`prefill_kernels.rs`).
    pub prefill_kernels: String,
}

/// A captured decode step (of one row count).
pub(crate) struct DecodeGraph(pub(crate) CudaGraph);

// SAFETY: CUDA graph objects may be used from any thread provided calls on
// one graph are serialized (CUDA driver API, "Graph object thread safety").
// The graph is owned by one engine and only touched through `&mut self`, so
// calls are serialized; `launch` binds the context to the calling thread.
unsafe impl Send for DecodeGraph {}

pub struct CudaEngine {
    pub(crate) model: Model,
    pub(crate) context: usize,
    pub(crate) cuda_graphs: bool,
    /// The captured decode step of `rows` rows at `[rows - 1]`.
    pub(crate) graphs: Vec<Option<DecodeGraph>>,
    /// Whether a decode step of `rows` rows has run eagerly (`[rows - 1]`;
    /// its graph is captured after one eager step, once every kernel it
    /// launches is loaded).
    pub(crate) warmed: Vec<bool>,
    pub(crate) report: LoadReport,
    pub(crate) stats: EngineStats,
    pub(crate) min_free: Option<u64>,
    /// Ids `0..sampleable` have text; padded LM-head rows are never sampled.
    pub(crate) sampleable: usize,
    cache: Option<Arc<krasis_cache::ExpertCache>>,
    /// HCS traffic of the last request.
    pub(crate) last_hcs: Option<krasis_common::status::HcsStats>,
    /// HCS traffic summed over every collection (`stats.rs`).
    pub(crate) hcs_totals: crate::stats::HcsTotals,
    /// KV of prompt prefixes kept for reuse (`prefix.rs`).
    pub(crate) prefix: Option<crate::prefix::TieredPrefix>,
    /// The running sequences (continuous batching, `batch.rs`).
    pub(crate) batch: crate::batch::Sequences,
}

impl CudaEngine {
    /// Loads the model in `model_dir` onto the GPU: non-expert weights from
    /// the checkpoint (BF16), routed experts from the INT4 cache (opened, or
    /// built when missing/stale), KV cache and scratch preallocated.
    pub fn load(model_dir: &Path, opts: &CudaEngineOptions) -> Result<Self> {
        Self::load_reporting(model_dir, opts, None)
    }

    /// [`CudaEngine::load`] that sends the byte progress of its long steps
    /// (weights, an expert cache build, pinning the cache, uploading
    /// experts) to `progress`, as `krasis_common::events::task`s.
    pub fn load_reporting(
        model_dir: &Path,
        opts: &CudaEngineOptions,
        progress: Option<EventSink<'_>>,
    ) -> Result<Self> {
        let t0 = Instant::now();
        let config = ModelConfig::load(model_dir)?;
        let g = config.geometry();
        crate::support::check_supported(&config)?;
        let sampleable = krasis_model::tokenizer::sampleable_vocab(model_dir, g.vocab_size)?;
        let context = opts.context_length.unwrap_or(g.max_position_embeddings);
        if context == 0 || context > g.max_position_embeddings {
            return Err(GpuError::Unsupported(format!(
                "context length {context} must be in 1..={} (max_position_embeddings of {})",
                g.max_position_embeddings,
                model_dir.display()
            )));
        }
        if opts.prefill_chunk == 0 {
            return Err(GpuError::Unsupported(
                "prefill chunk must be at least 1 token".into(),
            ));
        }
        let gpu = Gpu::open_limited(opts.device, opts.vram_limit)?;
        let kernels = Kernels::new(&gpu.ctx, &opts.kernel_cache)?;
        let ckpt = Checkpoint::open(model_dir)?;
        let weights = ModelWeights::upload(&gpu, &ckpt, &config, progress)?;
        // What a prefix cache file is bound to (read only for one).
        let model_identity = match &opts.prefix_cache_file {
            Some(_) => Some(ckpt.content_identity()?),
            None => None,
        };
        drop(ckpt);
        let (experts, ffn, cache) = if g.num_moe_layers() > 0 {
            let cache = Arc::new(krasis_cache::ensure_cache_reporting(
                model_dir,
                opts.cache_root.as_deref(),
                progress,
            )?);
            let ffn = crate::expert_ffn::ExpertFfn::for_cache(&cache.layout(), &g)?;
            if cache.moe_layers() != g.moe_layers().collect::<Vec<_>>() {
                return Err(GpuError::Cache(format!(
                    "{} holds MoE layers {:?} but the model's MoE layers are {:?}",
                    cache.path().display(),
                    cache.moe_layers(),
                    g.moe_layers().collect::<Vec<_>>()
                )));
            }
            // With HCS the experts go where calibration decides (all of
            // them resident when they fit); without it all must be resident.
            let table = if opts.hcs {
                ExpertTable::unbacked(&gpu, &cache)?
            } else {
                ExpertTable::upload_all(&gpu, &cache, progress).map_err(|e| match e {
                    GpuError::OverLimit { .. } => GpuError::Unsupported(format!(
                        "every expert must be resident with HCS off, and they do not fit: {e}"
                    )),
                    e => e,
                })?
            };
            (Some(table), Some(ffn), Some(cache))
        } else {
            (None, None, None)
        };
        // Sliding layers' ring buffers hold the window of the largest chunk
        // asked for (of its pieces: `scratch::ring_rows`), one per sequence
        // that may run; the budget may then choose a smaller chunk and so
        // fewer sequences (never more).
        let want = opts.prefill_chunk.min(context);
        // Refused values fail here, before the KV is allocated; the chunk
        // the budget allows may lower the default parallelism below.
        let (most, rows) =
            crate::options::batching(opts, context, want).map_err(GpuError::Unsupported)?;
        let kv = KvCache::new(&gpu, &g, opts.kv_shape(&g, context, want, most))?;
        // Without MoE layers there is no grouped scratch, whichever path.
        let path = ffn.map_or(crate::scratch::GroupedPath::InPlace, |f| f.grouped_path());
        let cap = crate::scratch::chunk_for_budget(&gpu, &g, want, path)?;
        let (parallel, _) =
            crate::options::batching(opts, context, cap).map_err(GpuError::Unsupported)?;
        let scratch = Scratch::new(&gpu, &g, cap, GEMV_MAX_TOKENS, parallel, path)?;
        gpu.sync("loading weights")?;
        let prefill_kernels = crate::prefill_kernels::PrefillKernels::for_device(&kernels);
        let report = LoadReport {
            model_dir: model_dir.to_path_buf(),
            cache_path: cache.as_ref().map(|c| c.path().to_path_buf()),
            cache_format_version: if cache.is_some() {
                krasis_cache::FORMAT_VERSION
            } else {
                0
            },
            weight_bytes: weights.bytes,
            host_weight_bytes: weights.host_bytes,
            expert_bytes: experts.as_ref().map_or(0, |e| e.resident_bytes),
            kv_bytes: kv.bytes(),
            context_length: context,
            prefill_chunk: cap,
            load_seconds: 0.0,
            hcs: None,
            prefix_cache_bytes: 0,
            prefix_host_bytes: 0,
            prefix_block_tokens: 0,
            parallel,
            kv_rows: rows,
            prefill_kernels: prefill_kernels.to_string(),
        };
        let mut engine = CudaEngine {
            sampleable,
            model: Model {
                gpu,
                kernels,
                geometry: g,
                weights,
                experts,
                ffn,
                kv,
                scratch,
                gemv_tokens: GEMV_MAX_TOKENS,
                grouped_prefill: false,
                mxfp4_in_place: false,
                prefill_kernels,
                hcs: None,
                routes: None,
                token_routes: None,
                prefill_span: None,
                #[cfg(any(test, feature = "fault-injection"))]
                fault: crate::forward::Fault::None,
            },
            context,
            cuda_graphs: opts.cuda_graphs,
            graphs: (0..parallel).map(|_| None).collect(),
            warmed: vec![false; parallel],
            report,
            stats: EngineStats::default(),
            min_free: None,
            cache: cache.clone(),
            last_hcs: None,
            hcs_totals: Default::default(),
            prefix: None,
            batch: crate::batch::Sequences::new(parallel, rows),
        };
        if let (true, Some(cache)) = (opts.hcs, cache) {
            // Allocates the prefix cache's pool between calibration and
            // the expert placement.
            engine.setup_experts(model_dir, cache, opts, progress)?;
        } else {
            // Every expert (if any) is resident already: the pool takes
            // from what is left above the safety margin.
            let spare = engine
                .model
                .gpu
                .free_in_budget()?
                .saturating_sub(opts.safety_margin);
            engine.setup_prefix(opts, Some(spare))?;
        }
        if let (Some(path), Some(model)) = (&opts.prefix_cache_file, model_identity) {
            let l = engine.load_prefix_file(path, &model)?;
            eprintln!("prefix cache file {}: {}", path.display(), l.describe());
        }
        engine.report.load_seconds = t0.elapsed().as_secs_f64();
        tracing::info!(report = ?engine.report, device = %engine.model.gpu.info.name, "CUDA engine loaded");
        Ok(engine)
    }

    /// The opened INT4 expert cache (MoE models).
    pub fn expert_cache(&self) -> Option<&Arc<krasis_cache::ExpertCache>> {
        self.cache.as_ref()
    }

    /// Route counts `[moe layer][expert]` of prefilling `prompt` once (for
    /// heatmaps). The KV state is overwritten like by any prefill.
    pub fn record_routes(&mut self, prompt: &[u32]) -> Result<Vec<Vec<u64>>> {
        self.check_tokens(prompt)?;
        self.require_idle("recording routes")?;
        let g = &self.model.geometry;
        self.model.routes = Some(vec![vec![0; g.num_experts]; g.num_moe_layers()]);
        let r = self.prefill(prompt, |_, _, _| Ok(()));
        let counts = self.model.routes.take().unwrap_or_default();
        r.map(|_| counts)
    }

    pub fn gpu(&self) -> &Gpu {
        &self.model.gpu
    }

    /// The prefill kernels this engine chose for its device.
    pub fn prefill_kernels(&self) -> crate::prefill_kernels::PrefillKernels {
        self.model.prefill_kernels
    }

    pub(crate) fn model_mut(&mut self) -> &mut Model {
        &mut self.model
    }

    pub fn geometry(&self) -> &Geometry {
        &self.model.geometry
    }

    pub fn load_report(&self) -> &LoadReport {
        &self.report
    }

    /// Streams prompts (under HCS) through the layer groups in spans of at
    /// most `tokens` (`None`: whole prompts). Each span crosses PCIe once
    /// more; the output is bit-identical. The engine falls back to spans by
    /// itself when a prompt's hidden states do not fit; this sets them up
    /// front (checks, or bounding per-request memory).
    pub fn set_prefill_span(&mut self, tokens: Option<usize>) {
        self.model.prefill_span = tokens.map(|t| t.max(1));
    }

    /// Plants `fault` in this engine from the next request on, replacing
    /// the one planted before ([`Fault::None`](crate::forward::Fault::None)
    /// restores the correct engine exactly: the weight edits are their own
    /// inverse). Test builds only.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn set_fault(&mut self, fault: crate::forward::Fault) -> Result<()> {
        let old = self.model.fault;
        if old == fault {
            return Ok(());
        }
        self.fault_weights(old)?;
        self.fault_weights(fault)?;
        self.model.fault = fault;
        if let Some(h) = self.model.hcs.as_mut() {
            h.skip_reload = fault == crate::forward::Fault::SkipReload;
        }
        // A captured decode step holds the old launches.
        self.drop_graphs();
        self.model.gpu.sync("planting a fault")
    }

    /// Plants (or removes) the per-shape GEMM choice
    /// ([`crate::blas::Selection::PerShape`]), which the row invariance
    /// tests must catch. Test builds only.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn set_gemm_selection(&mut self, s: crate::blas::Selection) {
        self.model.gpu.blas.set_selection(s);
    }

    /// The KV cache's bit patterns of positions `0..positions`: per layer,
    /// K then V, per KV head. Tests compare prefills with it.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn kv_bits(&self, positions: usize) -> Result<Vec<u16>> {
        let m = &self.model;
        let (h, d) = (m.geometry.num_kv_heads, m.geometry.head_dim);
        let mut out = Vec::new();
        for l in 0..m.geometry.num_layers {
            let cap = m.kv.geoms[l].capacity;
            if positions > cap {
                return Err(GpuError::Unsupported(format!(
                    "kv_bits of {positions} positions in a layer of {cap}"
                )));
            }
            for buf in [&m.kv.k[l], &m.kv.v[l]] {
                let all = m.gpu.download(buf, h * cap * d, "the KV cache")?;
                for head in 0..h {
                    let base = head * cap * d;
                    out.extend(all[base..base + positions * d].iter().map(|v| v.to_bits()));
                }
            }
        }
        Ok(out)
    }

    /// Applies (or, applied twice, undoes) the weight edit of `fault`.
    #[cfg(any(test, feature = "fault-injection"))]
    fn fault_weights(&mut self, fault: crate::forward::Fault) -> Result<()> {
        use crate::forward::Fault;
        let m = &mut self.model;
        let g = &m.geometry;
        let (d, q, kvd, h) = (g.head_dim, g.q_dim(), g.kv_dim(), g.hidden);
        let s = m.gpu.stream.clone();
        let put = |host: &[half::bf16], dev: &mut cudarc::driver::CudaSlice<half::bf16>| {
            s.memcpy_htod(host, dev)
                .map_err(GpuError::driver("planting a fault in the weights"))
        };
        match fault {
            Fault::None
            | Fault::DropExpert
            | Fault::IgnoreSelectionBias
            | Fault::NoSharedExpert
            | Fault::SwapRowPositions
            | Fault::ShiftRowKv
            | Fault::SwapRowRings
            | Fault::SkipRingRestore
            | Fault::PackedBase
            | Fault::StaleTail
            | Fault::StalePrefetch
            | Fault::UnmarkedFetch
            | Fault::SkipReload
            | Fault::IgnoreMask => {}
            Fault::RopeSign => {
                for lw in &mut m.weights.layers {
                    let n = lw.qk_norm.as_mut().ok_or_else(|| {
                        GpuError::Unsupported("Fault::RopeSign needs q/k norms".into())
                    })?;
                    // The second half of the rotated dimensions (all of
                    // a head, or the leading `rotary_dim` of a partial
                    // rotary, whose pass-through dims stay as they are).
                    let r = g.rope.rotary_dim.unwrap_or(d);
                    for w in [&mut n.q, &mut n.k] {
                        let mut host = m.gpu.download(w, d, "a q/k norm")?;
                        for v in &mut host[r / 2..r] {
                            *v = -*v;
                        }
                        put(&host, w)?;
                    }
                }
            }
            Fault::SwapGqa => {
                if g.num_kv_heads < 2 {
                    return Err(GpuError::Unsupported(
                        "Fault::SwapGqa needs at least two KV heads".into(),
                    ));
                }
                // KV head 0 and 1 of k (rows from q) and of v (from q + kvd).
                let swap = |host: &mut [u16]| {
                    for first in [q, q + kvd] {
                        let (a, b) = host[first * h..(first + 2 * d) * h].split_at_mut(d * h);
                        a.swap_with_slice(b);
                    }
                };
                let rows = q + 2 * kvd;
                for lw in &mut m.weights.layers {
                    // Rows move whole, so the weight's bits do, in either format.
                    match &mut lw.qkv {
                        crate::weights::Weight16::Bf16(w) => {
                            let mut host = m.gpu.download(w, rows * h, "a QKV weight")?;
                            let mut bits: Vec<u16> = host.iter().map(|v| v.to_bits()).collect();
                            swap(&mut bits);
                            host = bits.into_iter().map(half::bf16::from_bits).collect();
                            put(&host, w)?;
                        }
                        crate::weights::Weight16::F16(w) => {
                            let host = m.gpu.download(w, rows * h, "a QKV weight")?;
                            let mut bits: Vec<u16> = host.iter().map(|v| v.to_bits()).collect();
                            swap(&mut bits);
                            let host: Vec<half::f16> =
                                bits.into_iter().map(half::f16::from_bits).collect();
                            s.memcpy_htod(&host, w)
                                .map_err(GpuError::driver("planting a fault in the weights"))?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Allocates the prefix cache's tiers by [`crate::prefix::pool_bytes`]
    /// (`spare`: the VRAM above the floor once every expert is resident;
    /// `None` when not every expert fits) and
    /// [`crate::prefix::host_bytes`], and says what it took.
    pub(crate) fn setup_prefix(
        &mut self,
        opts: &crate::options::CudaEngineOptions,
        spare: Option<u64>,
    ) -> Result<()> {
        use krasis_common::options::PrefixCacheChoice as C;
        let g = &self.model.geometry;
        let block = opts.prefix_block;
        let sized = |c| matches!(c, C::Bytes(1..));
        let explicit = sized(opts.prefix_cache) || sized(opts.prefix_cache_host);
        let off = |why: String| {
            eprintln!("prefix cache: {why}");
            Ok(())
        };
        if !opts.prefix_cache.is_on() {
            return off("off".into());
        }
        krasis_common::options::check_prefix_block(block as u32)
            .map_err(|e| GpuError::Unsupported(e.to_string()))?;
        if block > self.context {
            return Err(GpuError::Unsupported(format!(
                "--prefix-block {block} is longer than the context ({} tokens)",
                self.context
            )));
        }
        if let Some(why) = crate::prefix::unsupported(g) {
            return if explicit {
                Err(GpuError::Unsupported(why))
            } else {
                off(format!("off: {why}"))
            };
        }
        // A prompt's rows are chunk invariant only on the grouped expert
        // path, which needs chunks longer than the GEMV path's limit.
        if self.model.scratch.cap <= self.model.gemv_tokens {
            let why = format!(
                "the prefix cache needs a prefill chunk above {} tokens (this one is {})",
                self.model.gemv_tokens, self.model.scratch.cap
            );
            return if explicit {
                Err(GpuError::Unsupported(why))
            } else {
                off(format!("off: {why}"))
            };
        }
        // One context's KV (`auto`'s measure), whatever the arena holds.
        let kv = opts.context_kv_bytes(g, self.context, self.model.scratch.cap);
        let vram = crate::prefix::pool_bytes(opts.prefix_cache, g, block, kv, spare)?;
        let available = crate::prefix::host_available();
        let host = crate::prefix::host_bytes(opts.prefix_cache_host, g, block, kv, available)?;
        if vram == 0 && host == 0 {
            return off(format!(
                "off: no VRAM pool ({}) and no host tier ({:?})",
                if spare.is_some() {
                    "half the VRAM left once every expert is resident holds no block"
                } else {
                    "not every expert is resident"
                },
                opts.prefix_cache_host
            ));
        }
        let sizes = crate::prefix::Sizes {
            vram_bytes: vram,
            host_bytes: host,
            block_tokens: block,
        };
        let mut pool = crate::prefix::TieredPrefix::new(&self.model.gpu, g, &self.model.kv, sizes)
            .map_err(|e| match e {
                GpuError::OverLimit { .. } | GpuError::OutOfMemory { .. } => {
                    GpuError::Unsupported(format!(
                        "the prefix cache's VRAM pool of {vram} bytes does not fit: {e}; ask for \
                         less with --prefix-cache SIZE, or auto"
                    ))
                }
                e => e,
            })?;
        // Exactness: the prefill's rows do not depend on the chunk they
        // fall in (row-invariant GEMMs, chunk-invariant attention), so a
        // hit may resume at any block; `whole_chunk_reuse` resumes only
        // where a cold prefill starts a chunk (`options.rs`).
        let chunk = self.model.scratch.cap;
        let granule = if opts.whole_chunk_reuse {
            block / gcd(block, chunk) * chunk
        } else {
            block
        };
        pool.index.set_reuse_granule(granule);
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let blocks = |b: u64| b / crate::prefix::block_bytes(g, block).max(1);
        eprintln!(
            "prefix cache: blocks of {block} tokens, reused in multiples of {granule} ({}); VRAM {:.2} GiB ({} blocks, {:?}{}), taken \
             before the expert placement (HCS gets the rest); host tier {:.2} GiB page-locked \
             ({} blocks, {:?}; {:.1} GiB of host memory available)",
            if opts.whole_chunk_reuse {
                "whole prefill chunks"
            } else {
                "any block boundary"
            },
            gib(vram),
            blocks(vram),
            opts.prefix_cache,
            match (opts.prefix_cache, spare) {
                (C::Auto, None) => ": not every expert is resident, so none",
                (C::Auto, Some(_)) => ": one context's KV within half the spare VRAM",
                _ => "",
            },
            gib(host),
            blocks(host),
            opts.prefix_cache_host,
            gib(available),
        );
        self.report.prefix_cache_bytes = pool.vram_bytes();
        self.report.prefix_host_bytes = pool.host_bytes();
        self.report.prefix_block_tokens = block;
        self.prefix = Some(pool);
        Ok(())
    }

    /// What the cached KV depends on besides the loaded model and the
    /// block size (fixed at load): a planted fault (but one in the restore
    /// alone, which computes and stores nothing differently), the planted
    /// per-shape GEMM choice.
    #[cfg(any(test, feature = "fault-injection"))]
    pub(crate) fn prefix_binding(&self) -> u64 {
        use crate::forward::Fault;
        let per_shape = self.model.gpu.blas.selection() == crate::blas::Selection::PerShape;
        let fault = match self.model.fault {
            Fault::SkipRingRestore => Fault::None,
            f => f,
        };
        fault as u64 + 1 + (u64::from(per_shape) << 32)
    }

    #[cfg(not(any(test, feature = "fault-injection")))]
    pub(crate) fn prefix_binding(&self) -> u64 {
        0
    }

    /// Looks `prompt` up and queues the restore of the hit into the KV
    /// rows of the sequence starting at row `base`; `None` when the cache
    /// is off or the request bypasses it.
    pub(crate) fn reuse_prefix(
        &mut self,
        prompt: &[u32],
        use_cache: bool,
        kv: crate::forward::SeqKv,
    ) -> Result<Option<krasis_model::prefix_cache::Hit>> {
        let binding = self.prefix_binding();
        let Some(p) = self.prefix.as_mut() else {
            return Ok(None);
        };
        if !use_cache {
            p.index.note_bypass();
            return Ok(None);
        }
        p.index.bind(binding);
        let hit = p.lookup(prompt);
        #[cfg(any(test, feature = "fault-injection"))]
        {
            p.skip_ring_restore = self.model.fault == crate::forward::Fault::SkipRingRestore;
        }
        let at = (kv.base, kv.slot);
        p.restore(&self.model.gpu, &self.model.kernels, at, &hit)?;
        Ok(Some(hit))
    }

    /// After `prompt`'s prefill (into the sequence's KV `kv`) completed:
    /// queues the store of its new whole blocks.
    pub(crate) fn store_prefix(
        &mut self,
        prompt: &[u32],
        hit: Option<&krasis_model::prefix_cache::Hit>,
        kv: crate::forward::SeqKv,
    ) -> Result<()> {
        match (self.prefix.as_mut(), hit) {
            (Some(p), Some(hit)) => {
                let at = (kv.base, kv.slot);
                p.store(&self.model.gpu, &self.model.kernels, at, prompt, hit)
            }
            _ => Ok(()),
        }
    }

    /// The prefix cache's figures, when it is on.
    pub fn prefix_cache_stats(&self) -> Option<krasis_common::status::PrefixCacheStats> {
        self.prefix.as_ref().map(|p| p.index.stats())
    }

    /// Turns decode CUDA graphs on or off (results are identical).
    pub fn set_cuda_graphs(&mut self, on: bool) {
        self.cuda_graphs = on;
        if !on {
            self.drop_graphs();
        }
    }

    /// Most experts HCS decode prefetches per MoE layer (0: off;
    /// `hcs/tail.rs`); results are identical either way. Nothing to set
    /// without HCS (every expert resident): `false`.
    pub fn set_hcs_prefetch(&mut self, max: usize) -> bool {
        let Some(h) = self.model.hcs.as_mut() else {
            return false;
        };
        h.set_prefetch(max);
        self.drop_graphs();
        true
    }

    /// The HCS decode prefetch per MoE layer, `None` without HCS.
    pub fn hcs_prefetch(&self) -> Option<usize> {
        self.model.hcs.as_ref().map(|h| h.prefetch())
    }

    /// Forgets the captured decode steps (their launches changed).
    pub(crate) fn drop_graphs(&mut self) {
        if self.batch.has_step_ahead() {
            // A step left in flight may be replaying one of them; a driver
            // error here surfaces at the next launch.
            let _ = self.model.gpu.stream.synchronize();
        }
        self.graphs.iter_mut().for_each(|g| *g = None);
        self.warmed.iter_mut().for_each(|w| *w = false);
    }

    /// Fails while sequences are running: what follows uses the KV from
    /// row 0 and would overwrite theirs.
    pub(crate) fn require_idle(&self, what: &str) -> Result<()> {
        match self.batch.active() {
            0 => Ok(()),
            n => Err(GpuError::Unsupported(format!(
                "{what} needs an idle engine; {n} sequence(s) are running"
            ))),
        }
    }

    /// Lowest free VRAM seen by an external monitor, for the stats endpoint.
    pub fn note_min_free(&mut self, bytes: u64) {
        self.min_free = Some(self.min_free.map_or(bytes, |m| m.min(bytes)));
    }

    pub(crate) fn check_tokens(&self, tokens: &[u32]) -> Result<(), EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if tokens.len() > self.context {
            return Err(EngineError::PromptTooLong {
                prompt: tokens.len(),
                context: self.context,
            });
        }
        let vocab = self.model.geometry.vocab_size;
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= vocab) {
            return Err(EngineError::BadToken { id, vocab });
        }
        Ok(())
    }

    /// Prefills `tokens` from position 0 into KV rows from 0 on (the
    /// engine must be idle); after each chunk runs `after` with (chunk
    /// start, chunk length) while the chunk's final hidden states are in
    /// the scratch.
    pub(crate) fn prefill(
        &mut self,
        tokens: &[u32],
        after: impl FnMut(&mut Model, usize, usize) -> Result<()>,
    ) -> Result<()> {
        self.require_idle("a prefill outside a request")?;
        self.prefill_cancellable(
            tokens,
            (0, usize::MAX),
            crate::forward::SeqKv { base: 0, slot: 0 },
            &CancelToken::default(),
            &LiveProgress::default(),
            after,
        )
        .map(|_| ())
    }

    /// Whether a prompt of `n` tokens computes MXFP4 experts in place
    /// (`expert_ffn::MXFP4_IN_PLACE_MAX_TOKENS`). The choice is the
    /// prompt's length alone, so its rows are computed the same way in
    /// every chunking and beside any other prompt of the same choice (both
    /// ways are row-invariant, and a packed pass holds prompts of one way:
    /// `batch.rs`, `packable`). Never with the prefix cache: a prompt
    /// resumed after a hit reads blocks that another prompt, of another
    /// length and so perhaps the other way, computed. Other formats ignore
    /// it.
    pub(crate) fn mxfp4_in_place_for(&self, n: usize) -> bool {
        self.prefix.is_none() && n <= crate::expert_ffn::MXFP4_IN_PLACE_MAX_TOKENS
    }

    /// [`CudaEngine::prefill`] of `tokens[from..]` into the sequence's KV
    /// (`kv`: its arena rows and ring; the KV holds positions `0..from`; `from` is any
    /// position, a prefix cache block boundary on a hit, and the chunks are
    /// counted from it: the prefill is chunk invariant, so every row comes
    /// out as in a prefill from 0), at most `chunks` chunks of it (all
    /// resident: a batched step runs one; with HCS the whole prompt streams
    /// at once), looking at `cancel` before every chunk (with HCS: before
    /// every chunk of every layer group). Returns the position prefilled
    /// to, or `None` once `cancel` stopped it (`after` not run for the
    /// chunks left; with HCS the reclaimable tier is reloaded as after any
    /// prefill).
    ///
    /// `live` counts the tokens prefilled so far, after every chunk. The
    /// count is taken when a chunk's work is issued, which is within one
    /// layer of when it is done: grouped MoE prefill reads its per-expert
    /// row counts back once per MoE layer, so the host never runs ahead of
    /// the GPU by more than that.
    pub(crate) fn prefill_cancellable(
        &mut self,
        tokens: &[u32],
        (from, chunks): (usize, usize),
        kv: crate::forward::SeqKv,
        cancel: &CancelToken,
        live: &LiveProgress,
        mut after: impl FnMut(&mut Model, usize, usize) -> Result<()>,
    ) -> Result<Option<usize>> {
        // The expert path is the prompt's, not the chunk's (`moe.rs`).
        let in_place = self.mxfp4_in_place_for(tokens.len());
        let m = &mut self.model;
        m.grouped_prefill = tokens.len() > m.gemv_tokens && m.scratch.grouped.is_some();
        m.mxfp4_in_place = in_place;
        if self.model.hcs.is_some() {
            let done = self
                .model
                .prefill_streamed(tokens, from, kv, cancel, live, after)?;
            return Ok(done.then_some(tokens.len()));
        }
        let cap = self.model.scratch.cap;
        let mut at = from;
        for chunk in tokens[from..].chunks(cap).take(chunks) {
            if cancel.is_cancelled() {
                return Ok(None);
            }
            let start = at;
            let m = &mut self.model;
            m.gpu
                .stream
                .memcpy_htod(chunk, &mut m.scratch.ids.slice_mut(0..chunk.len()))
                .map_err(GpuError::driver("copying prompt tokens to the GPU"))?;
            let (base, slot) = (kv.base, kv.slot);
            m.forward_layers(chunk.len(), Positions::Prefill { start, base, slot })?;
            after(m, start, chunk.len())?;
            at = start + chunk.len();
            live.set_prefilled(at);
        }
        Ok(Some(at))
    }

    /// Greedy generation of `n` tokens that also returns the logits each
    /// token was chosen from (the first from prefill, the rest from
    /// decode), for bit-exactness checks between expert placements. The
    /// engine must be idle.
    pub fn greedy_logits(&mut self, prompt: &[u32], n: usize) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
        self.greedy_logits_cached(prompt, n, false)
            .map(|(t, l, _)| (t, l))
    }

    /// [`CudaEngine::greedy_logits`] through the prefill `generate` runs:
    /// with `use_cache`, served from the prefix cache where it can (and
    /// stored into it). Also returns the prompt tokens the cache served.
    /// What the exactness tests compare with a cold prefill. One sequence
    /// through the batching step (`batch.rs`), as `generate` runs it.
    pub fn greedy_logits_cached(
        &mut self,
        prompt: &[u32],
        n: usize,
        use_cache: bool,
    ) -> Result<(Vec<u32>, Vec<Vec<f32>>, usize)> {
        self.check_tokens(prompt)?;
        self.require_idle("greedy_logits")?;
        if n == 0 || prompt.len() + n > self.context {
            return Err(GpuError::Unsupported(format!(
                "greedy_logits of {n} tokens after {} in a context of {}",
                prompt.len(),
                self.context
            )));
        }
        let req = GenerateRequest {
            prompt: prompt.to_vec(),
            max_new_tokens: n,
            sampling: SamplingParams::greedy(),
            stop_token_ids: Vec::new(),
            cancel: CancelToken::default(),
            live: LiveProgress::default(),
            cache_prompt: use_cache,
            constraint: None,
        };
        let run = self.run_recorded(&req)?;
        Ok((run.tokens, run.logits, run.outcome.stats.cached_tokens))
    }

    fn run_prompt_logits(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>> {
        self.check_tokens(tokens)?;
        self.require_idle("prompt_logits")?;
        let v = self.model.geometry.vocab_size;
        let mut out = Vec::with_capacity(tokens.len());
        self.prefill(tokens, |m, _, len| {
            let mut host = vec![0f32; LOGIT_ROWS * v];
            let mut first = 0;
            while first < len {
                let rows = (len - first).min(LOGIT_ROWS);
                m.lm_head(first, rows)?;
                m.gpu
                    .stream
                    .memcpy_dtoh(&m.scratch.logits.slice(0..rows * v), &mut host[..rows * v])
                    .map_err(GpuError::driver("reading logits"))?;
                out.extend(host[..rows * v].chunks_exact(v).map(|r| r.to_vec()));
                first += rows;
            }
            Ok(())
        })?;
        Ok(out)
    }
}

impl Engine for CudaEngine {
    fn info(&self) -> EngineInfo {
        EngineInfo {
            backend: "cuda".into(),
            vocab_size: self.model.geometry.vocab_size,
            context_length: self.context,
        }
    }

    fn generate(
        &mut self,
        req: &GenerateRequest,
        on_token: &mut dyn FnMut(u32) -> ControlFlow<()>,
    ) -> Result<GenerateOutcome, EngineError> {
        if self.batch.active() > 0 {
            return Err(EngineError::InvalidRequest(format!(
                "generate runs one request on an idle engine; {} sequence(s) are running \
                 (use the engine's batch)",
                self.batch.active()
            )));
        }
        krasis_model::batch::generate_one(self, req, on_token)
    }

    fn prompt_logits(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>, EngineError> {
        self.run_prompt_logits(tokens).map_err(EngineError::from)
    }

    fn stats(&self) -> Option<EngineStats> {
        Some(self.engine_stats(self.last_hcs.as_ref()))
    }

    fn save_prefix_cache(
        &mut self,
    ) -> Result<Option<krasis_model::prefix_cache::persist::Saved>, EngineError> {
        if self.batch.active() > 0 {
            return Err(EngineError::InvalidRequest(format!(
                "the prefix cache is saved on an idle engine; {} sequence(s) are running",
                self.batch.active()
            )));
        }
        self.save_prefix_file().map_err(EngineError::from)
    }

    fn batch(&mut self) -> Option<&mut dyn krasis_model::batch::Batch> {
        Some(self)
    }
}

/// The sampler's output as a token: its [`krasis_kernels::SAMPLE_NONFINITE`]
/// (a logit was ±inf or NaN: an activation overflowed its 16-bit format,
/// e.g. FP16's ±65504) is [`GpuError::NonFiniteLogits`], which fails the
/// request and retires the engine (`EngineError::Backend`, fatal), never a
/// token. `step` is the generated token's index.
pub(crate) fn sampled_token(id: u32, step: u64) -> Result<u32> {
    if id == krasis_kernels::SAMPLE_NONFINITE {
        return Err(GpuError::NonFiniteLogits(format!("generated token {step}")));
    }
    Ok(id)
}

pub(crate) fn kernel_sampling(
    p: &SamplingParams,
) -> Result<krasis_kernels::SamplingParams, EngineError> {
    let k = krasis_kernels::SamplingParams {
        temperature: p.temperature.max(0.0),
        top_k: u32::try_from(p.top_k).unwrap_or(u32::MAX),
        top_p: p.top_p,
        min_p: p.min_p,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        seed: p.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        }),
    };
    // Checked before anything is launched, so a bad value (e.g. from a
    // model's generation_config.json) fails the request, not the engine.
    k.validate().map_err(EngineError::InvalidRequest)?;
    Ok(k)
}

/// Greatest common divisor (the prefix cache's reuse granule).
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sampler's non-finite marker is a fatal error naming it, never a
    /// token; every other id is the token.
    #[test]
    fn a_non_finite_sample_is_a_fatal_error_never_a_token() {
        assert_eq!(sampled_token(42, 3).unwrap(), 42);
        let e = sampled_token(krasis_kernels::SAMPLE_NONFINITE, 3).unwrap_err();
        assert!(matches!(e, GpuError::NonFiniteLogits(_)), "{e}");
        assert!(
            e.to_string()
                .contains("non-finite logits at generated token 3"),
            "{e}"
        );
        let e = EngineError::from(e);
        assert!(e.is_fatal(), "{e}");
    }
}
