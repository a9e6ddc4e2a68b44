//! Where the routed experts go at load: calibrate, then either upload every
//! expert (they fit) or build HCS from the heatmap prior.

use crate::calibrate::Calibration;
use crate::engine::CudaEngine;
use crate::error::{GpuError, Result};
use crate::experts::ExpertTable;
use crate::hcs::{Hcs, HcsShape};
use crate::options::CudaEngineOptions;
use krasis_cache::{ExpertCache, PinnedExperts};
use krasis_common::events::EventSink;
use krasis_common::options::HeatmapChoice;
use krasis_common::status::HcsStats;
use std::path::Path;
use std::sync::Arc;

/// Resident slots are allocated in chunks of this size, checking free
/// memory before each. Each chunk is a `cuMemAlloc` rounded up to the
/// driver's 2 MiB granularity: at 6 GiB on the H200 the rounding of a3b's
/// 9 chunks costs ~4 of 960 experts (larger chunks would waste less; not
/// measured yet).
const RESIDENT_CHUNK_BYTES: usize = 256 << 20;

/// What calibration measured and what was decided.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct HcsReport {
    pub calibration: Calibration,
    /// `None`: every expert is resident (the all-resident path).
    pub shape: Option<HcsShape>,
    pub experts_on_gpu: usize,
    pub total_experts: usize,
    pub expert_bytes_on_gpu: u64,
    pub heatmap: String,
    pub host_backing: String,
    pub host_prepare_seconds: f64,
}

impl CudaEngine {
    pub(crate) fn setup_experts(
        &mut self,
        model_dir: &Path,
        cache: Arc<ExpertCache>,
        opts: &CudaEngineOptions,
        progress: Option<EventSink<'_>>,
    ) -> Result<()> {
        let g = self.geometry().clone();
        let moe_layers = cache.moe_layers().to_vec();
        let e = cache.num_experts();
        let stride = cache.layout().expert_stride;
        let total = moe_layers.len() * e;
        let layer_bytes = e * stride;
        let host = Arc::new(PinnedExperts::new_reporting(
            cache.clone(),
            &self.model.gpu.ctx,
            opts.host_backing,
            progress,
        )?);
        let host_prepare = host.prepare_time().as_secs_f64();
        let group = crate::plan::staging_group(layer_bytes, moe_layers.len());
        let table = self
            .model
            .experts
            .as_mut()
            .ok_or_else(|| GpuError::Hcs("HCS without an expert table".into()))?;
        // The scratch only prefill uses holds experts while decode runs.
        let sc = &self.model.scratch;
        let kept = crate::scratch::decode_rows_kept(sc.seqs, self.model.gemv_tokens);
        let lent = sc.lendable(&self.model.gpu, kept);
        if let Some(n) = opts
            .hcs_tail_slots
            .filter(|&n| n > krasis_kernels::TAIL_MAX_SLOTS)
        {
            return Err(GpuError::Hcs(format!(
                "a decode tail of {n} slots was asked for; the device lookup takes at most {} \
                 (ask for fewer)",
                krasis_kernels::TAIL_MAX_SLOTS
            )));
        }
        let mut hcs = Hcs::new(
            &self.model.gpu,
            &self.model.kernels,
            host,
            moe_layers.clone(),
            e,
            g.top_k,
            group,
            self.report.parallel,
            &[],
            table,
            &lent,
            opts.hcs_tail_slots,
        )?;
        if let Some(cap) = opts.hcs_prior_cap {
            hcs.cap_prior(cap);
        }
        hcs.set_prefetch(opts.hcs_prefetch);
        let staging = Hcs::staging_bytes(layer_bytes, group) as u64;
        self.model.hcs = Some(hcs);
        let cal = self.calibrate(model_dir, opts.safety_margin)?;
        self.trace_free("after calibration");
        // Calibration's prompts are not requests: their expert traffic (every
        // expert cold) must not show in `/v1/stats` as the last request's.
        self.last_hcs = None;
        let floor = cal.transient_at_context + opts.safety_margin;
        // The prefix cache's VRAM pool comes out of what the experts would
        // get; `auto` takes only what stays spare once every expert is
        // resident (none when they do not all fit).
        let all_bytes = (total * stride) as u64;
        let free = self.model.gpu.free_in_budget()?;
        let spare = (free + staging).checked_sub(all_bytes + floor);
        self.setup_prefix(opts, spare)?;
        let free = self.model.gpu.free_in_budget()?;
        let mut report = HcsReport {
            calibration: cal,
            shape: None,
            experts_on_gpu: total,
            total_experts: total,
            expert_bytes_on_gpu: all_bytes,
            heatmap: "not needed (every expert is resident)".into(),
            host_backing: opts.host_backing.name().into(),
            host_prepare_seconds: host_prepare,
        };
        // The rule the pre-flight plan applies too (`plan::decide`).
        match crate::plan::decide(free, staging, all_bytes, floor, stride) {
            crate::plan::Decision::AllResident => {
                // Everything fits: the all-resident path (CUDA graphs, no host
                // work per layer). The staging region goes first, after any
                // reload still filling it (or prefill's grouped scratch).
                self.model.settle_experts()?;
                self.model.hcs = None;
                self.model.gpu.sync("releasing staging")?;
                let table = ExpertTable::upload_all(&self.model.gpu, &cache, progress)?;
                self.report.expert_bytes = table.resident_bytes;
                self.model.experts = Some(table);
            }
            crate::plan::Decision::Hcs { want } => {
                let (ranked, source) = prior(model_dir, &cache, &g, &opts.heatmap, total)?;
                let hcs = self.model.hcs.as_mut().expect("set above");
                let table = self.model.experts.as_mut().expect("checked above");
                let resident = hcs.grow_resident(
                    &self.model.gpu,
                    &self.model.kernels,
                    table,
                    &ranked,
                    want.min(total),
                    RESIDENT_CHUNK_BYTES,
                    floor,
                )?;
                self.trace_free("after the resident tier");
                let hcs = self.model.hcs.as_ref().expect("set above");
                report.shape = Some(hcs.shape);
                report.experts_on_gpu = hcs.res.held();
                report.expert_bytes_on_gpu = (hcs.res.slots() * stride) as u64;
                report.heatmap = source;
                tracing::info!(
                    resident_tier = resident,
                    on_gpu = hcs.res.held(),
                    total,
                    gib = report.expert_bytes_on_gpu as f64 / (1u64 << 30) as f64,
                    margin_mib = opts.safety_margin >> 20,
                    "HCS sized"
                );
                self.report.expert_bytes = report.expert_bytes_on_gpu as usize;
            }
        }
        // Calibration's decode steps captured graphs over the HCS tail and
        // the table as they were then; the all-resident path replaces both
        // (a replayed graph would read freed memory).
        self.drop_graphs();
        self.trace_free("after dropping calibration's graphs");
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        let lr = &self.report;
        eprintln!(
            "memory: non-expert weights {:.2} GiB on the GPU + {:.2} GiB (input embedding) in mapped host memory; KV {:.2} GiB ({} positions); prefill chunk {} tokens",
            gib(lr.weight_bytes),
            gib(lr.host_weight_bytes),
            gib(lr.kv_bytes),
            lr.context_length,
            lr.prefill_chunk
        );
        eprintln!("{}", describe(&report));
        self.report.hcs = Some(report);
        Ok(())
    }

    /// Free memory in the budget at a point of the load (debug log): where
    /// the budget goes after calibration has sized the tiers.
    fn trace_free(&self, at: &str) {
        if let Ok(free) = self.model.gpu.free_in_budget() {
            tracing::debug!(free_mib = free as f64 / (1u64 << 20) as f64, "{at}");
        }
    }

    /// (expert-sized GB/s, large-copy GB/s, large copy bytes) from the host
    /// backing, when HCS is active.
    pub fn measure_copy_rates(&mut self) -> Result<Option<(f64, f64, usize)>> {
        match self.model.hcs.as_mut() {
            Some(h) => {
                let table = self
                    .model
                    .experts
                    .as_mut()
                    .ok_or_else(|| GpuError::Hcs("HCS without an expert table".into()))?;
                h.measure_copy_rates(&self.model.gpu, &self.model.kernels, table, 64)
                    .map(Some)
            }
            None => Ok(None),
        }
    }

    /// Whether experts are cached by HCS (not all resident).
    pub fn hcs_active(&self) -> bool {
        self.model.hcs.is_some()
    }

    /// HCS figures for the stats endpoint and bench: the decision, and the
    /// last request's traffic.
    pub fn hcs_stats(&self) -> Option<HcsStats> {
        self.hcs_stats_with(self.last_hcs.as_ref())
    }

    /// The decision with `traffic` as the per-token figures.
    pub(crate) fn hcs_stats_with(&self, traffic: Option<&HcsStats>) -> Option<HcsStats> {
        let r = self.report.hcs.as_ref()?;
        let mut s = traffic.cloned().unwrap_or_default();
        s.resident_experts = r.experts_on_gpu as u64;
        s.total_experts = r.total_experts as u64;
        s.resident_bytes = r.expert_bytes_on_gpu;
        s.safety_margin_bytes = r.calibration.safety_margin;
        s.transient_bytes = r.calibration.transient_at_context;
        if let Some(sh) = r.shape {
            s.resident_tier_slots = sh.resident_slots as u64;
            s.reclaimable_slots = sh.prior_slots as u64;
            s.group_layers = sh.group_layers as u64;
        } else {
            s.resident_tier_slots = r.total_experts as u64;
            s.hit_rate = 1.0;
        }
        Some(s)
    }
}

/// The initial residents, best first, and a description of their source.
fn prior(
    model_dir: &Path,
    cache: &ExpertCache,
    g: &krasis_model::Geometry,
    choice: &HeatmapChoice,
    total: usize,
) -> Result<(Vec<(usize, usize)>, String)> {
    let path = match choice {
        HeatmapChoice::Off => {
            // No prior: an equal share of every layer, by expert id.
            let (l, e) = (cache.moe_layers().len(), cache.num_experts());
            let order = (0..e)
                .flat_map(|x| (0..l).map(move |m| (m, x)))
                .collect::<Vec<_>>();
            debug_assert_eq!(order.len(), total);
            return Ok((order, "off (no prior: equal share per layer)".into()));
        }
        HeatmapChoice::Auto => krasis_cache::heatmap::default_heatmap_path(cache.path()),
        HeatmapChoice::File(p) => p.clone(),
    };
    if !path.exists() {
        return Err(GpuError::Hcs(format!(
            "not every expert fits in VRAM, and the initial residents come from a route heatmap, \
             but there is none at {}; record one with `krasis heatmap --model {}` (or \
             `krasis-runtime heatmap`; same --cache-dir and --vram-limit), or pass --heatmap off \
             to start without a prior",
            path.display(),
            model_dir.display()
        )));
    }
    // Routes depend on the attention's and the MLP block's formats (the
    // router reads the MLP block's normed input): both bind the heatmap.
    let h = krasis_cache::heatmap::Heatmap::load_for_cache(
        &path,
        cache,
        g.top_k,
        g.attention.activations.name(),
        g.mlp.activations.name(),
    )
    .map_err(|e| GpuError::Hcs(e.to_string()))?;
    Ok((
        h.ranked(),
        format!(
            "{} ({} routes over {} tokens)",
            path.display(),
            h.routes(),
            h.tokens
        ),
    ))
}

fn describe(r: &HcsReport) -> String {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let c = &r.calibration;
    let mut s = format!(
        "calibration: transient {:.2} GiB at {} tokens, {:.2} GiB at {} tokens, {:.2} GiB at the context length; margin {:.2} GiB ({:.1} s)\n",
        gib(c.short.transient_bytes),
        c.short.prompt_tokens,
        gib(c.long.transient_bytes),
        c.long.prompt_tokens,
        gib(c.transient_at_context),
        gib(c.safety_margin),
        c.seconds
    );
    match r.shape {
        None => s.push_str(&format!(
            "experts: all {} resident ({:.2} GiB)",
            r.total_experts,
            gib(r.expert_bytes_on_gpu)
        )),
        Some(sh) => s.push_str(&format!(
            "experts: {}/{} on the GPU ({:.1}%, {:.2} GiB): {} resident + {} reclaimable prior slots ({} of them in prefill's scratch, idle in decode), and a decode tail of {} slots (staging, then prefill's scratch) that the GPU fills with recently missed experts from host memory; prefill streams {} layer(s) per group; prior from {}",
            r.experts_on_gpu,
            r.total_experts,
            100.0 * r.experts_on_gpu as f64 / r.total_experts.max(1) as f64,
            gib(r.expert_bytes_on_gpu),
            sh.resident_slots,
            sh.prior_slots,
            sh.scratch_slots,
            sh.tail_slots,
            sh.group_layers,
            r.heatmap
        )),
    }
    s
}
