//! Where one decode step's device time goes, measured with CUDA events
//! around its parts run on their own (bench only; the token path carries
//! no instrumentation).

use crate::attention::attention;
use crate::engine::CudaEngine;
use crate::error::{GpuError, Result};
use crate::forward::Positions;
use crate::weights::MlpWeights;
use cudarc::driver::CudaEvent;
use cudarc::driver::sys::CUevent_flags;
use serde::Serialize;

/// Device milliseconds of work issued on the engine's stream, between two
/// CUDA events: the median of `reps` runs (at least one). Shared by the
/// decode and prefill breakdowns (`profile_prefill.rs`).
pub(crate) struct EventTimer {
    start: CudaEvent,
    end: CudaEvent,
    reps: usize,
}

impl EventTimer {
    pub(crate) fn new(engine: &CudaEngine, reps: usize) -> Result<Self> {
        let ctx = &engine.gpu().ctx;
        let ev = || {
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(GpuError::driver("creating a timing event"))
        };
        Ok(EventTimer {
            start: ev()?,
            end: ev()?,
            reps: reps.max(1),
        })
    }

    /// The median time of `f`'s launches over `reps` runs.
    pub(crate) fn median_ms(
        &self,
        engine: &mut CudaEngine,
        f: &mut dyn FnMut(&mut CudaEngine) -> Result<()>,
    ) -> Result<f64> {
        let mut v = Vec::with_capacity(self.reps);
        for _ in 0..self.reps {
            let s = engine.gpu().stream.clone();
            self.start
                .record(&s)
                .map_err(GpuError::driver("recording an event"))?;
            f(engine)?;
            self.end
                .record(&s)
                .map_err(GpuError::driver("recording an event"))?;
            self.end
                .synchronize()
                .map_err(GpuError::driver("waiting for an event"))?;
            v.push(
                self.start
                    .elapsed_ms(&self.end)
                    .map_err(GpuError::driver("reading an event"))? as f64,
            );
        }
        v.sort_by(|a, b| a.total_cmp(b));
        Ok(v[v.len() / 2])
    }
}

/// Median device milliseconds of each part of a decode step of `rows`
/// rows (sequences).
#[derive(Debug, Clone, Default, Serialize)]
pub struct DecodeBreakdown {
    /// Rows of the step (1: one sequence).
    pub rows: usize,
    /// Distinct experts the rows routed to in the timed MoE layer (the
    /// step's last, with the routes the step gave it: the union a step
    /// reads there; `top_k` for one row).
    pub distinct_experts: usize,
    /// Embedding + every layer (eager launches).
    pub layers_ms: f64,
    /// Attention block of one layer (QKV GEMM, norm+RoPE, append, attention, o_proj).
    pub attention_layer_ms: f64,
    /// Router GEMM + top-k of one MoE layer.
    pub router_layer_ms: f64,
    /// Routed experts (two expert GEMV kernels) of one MoE layer.
    pub experts_layer_ms: f64,
    /// Final norm + LM head over the step's rows, as the decode step runs
    /// it (the GEMV over M rows).
    pub lm_head_ms: f64,
    /// Sampler (one launch per row).
    pub sample_ms: f64,
}

impl CudaEngine {
    /// Times the parts of a decode step of `rows` rows at position `pos`
    /// (`reps` each, median): the rows feed distinct tokens, so they route
    /// like sequences with different text do, and share KV rows (what
    /// attention reads is the same work). Overwrites KV entries at `pos`;
    /// call between requests.
    pub fn decode_breakdown(
        &mut self,
        pos: usize,
        rows: usize,
        reps: usize,
    ) -> Result<DecodeBreakdown> {
        let timer = EventTimer::new(self, reps)?;
        self.require_idle("decode_breakdown")?;
        self.model_mut().settle_experts()?;
        let m = rows.max(1);
        {
            // `m` rows at `pos`, their KV from row 0 (sliding layers: the
            // first ring), distinct tokens.
            let model = self.model_mut();
            if m > model.scratch.seqs {
                return Err(GpuError::Unsupported(format!(
                    "a decode breakdown of {m} rows (the engine runs at most {} together)",
                    model.scratch.seqs
                )));
            }
            let v = model.geometry.vocab_size as u64;
            let ids: Vec<u32> = (0..m as u64)
                .map(|r| ((1000 + 7919 * r) % v) as u32)
                .collect();
            let (s, sc) = (&model.gpu.stream, &mut model.scratch);
            s.memcpy_htod(&vec![pos as u32; m], &mut sc.pos.slice_mut(0..m))
                .and_then(|_| s.memcpy_htod(&vec![0u32; m], &mut sc.kv_base.slice_mut(0..m)))
                .and_then(|_| s.memcpy_htod(&vec![0u32; m], &mut sc.ring_base.slice_mut(0..m)))
                .and_then(|_| s.memcpy_htod(&ids, &mut sc.ids.slice_mut(0..m)))
                .map_err(GpuError::driver("writing the decode rows"))?;
        }
        let mut b = DecodeBreakdown {
            rows: m,
            layers_ms: timer.median_ms(self, &mut |e| {
                e.model_mut().forward_layers(m, Positions::Decode)
            })?,
            // The decode step's LM head (`lm_head_rows`, the GEMV), not
            // prefill's (`lm_head`: rmsnorm + a cuBLAS GEMM for several
            // rows), which this timed until session 18 (0.28 ms at 2-8 rows).
            lm_head_ms: timer.median_ms(self, &mut |e| e.model_mut().lm_head_rows(m))?,
            ..DecodeBreakdown::default()
        };
        b.attention_layer_ms = timer.median_ms(self, &mut |e| {
            let (cx, sc, kv) = e.model_mut().split();
            attention(&cx, sc, kv, 0, m, Positions::Decode)
        })?;
        // The last MoE layer, with the routes the timed layers just gave it
        // (the router leaves them in the scratch): the experts this step's
        // rows really share. Routing the first MoE layer again over the
        // step's final hidden rows, as this did until session 24, gave 4
        // rows 10-12 distinct experts, which the step's own layers do not
        // share (a w13 that computed shared experts once gained 6 us here
        // and nothing in the step).
        let moe = self
            .model_mut()
            .weights
            .layers
            .iter()
            .rposition(|l| matches!(l.mlp, MlpWeights::Moe { .. }));
        if let Some(l) = moe {
            let model = self.model_mut();
            let k = model.geometry.top_k;
            let ids = model
                .gpu
                .download(&model.scratch.topk_ids, m * k, "top-k ids")?;
            let mut distinct = ids;
            distinct.sort_unstable();
            distinct.dedup();
            b.distinct_experts = distinct.len();
            b.experts_layer_ms = timer.median_ms(self, &mut |e| {
                let (cx, sc, _) = e.model_mut().split();
                let MlpWeights::Moe { moe_index, .. } = cx.w.layers[l].mlp else {
                    return Ok(());
                };
                crate::moe::routed_experts(&cx, sc, moe_index, m, Positions::Decode)
            })?;
            // Last: it routes the final hidden rows, which rewrites the ids
            // (its own work does not depend on them).
            b.router_layer_ms = timer.median_ms(self, &mut |e| {
                let (cx, sc, _) = e.model_mut().split();
                crate::moe::router(&cx, sc, l, m, Positions::Decode, false)
            })?;
        }
        // One more eager step of the `m` rows (layers and LM head) between
        // cuProfilerStart and cuProfilerStop: a profiler started with its
        // collection off (`ncu --profile-from-start off`) sees exactly one
        // step's kernels, each timed on its own. Without a profiler both
        // calls do nothing; their status is not an error of the bench.
        // SAFETY: plain driver calls on the current context, no arguments.
        let _ = unsafe { cudarc::driver::sys::cuProfilerStart() };
        self.model_mut().forward_layers(m, Positions::Decode)?;
        self.model_mut().lm_head_rows(m)?;
        self.gpu().sync("the profiled decode step")?;
        // SAFETY: as above.
        let _ = unsafe { cudarc::driver::sys::cuProfilerStop() };
        // The step's rows sampled as decode samples them: one launch pair,
        // each row with its own counts slot (greedy).
        let rows: Vec<krasis_kernels::SampleRow> = (0..m)
            .map(|r| krasis_kernels::SampleRow {
                params: krasis_kernels::SamplingParams::default(),
                step: 0,
                slot: r,
                masked: false,
            })
            .collect();
        b.sample_ms = timer.median_ms(self, &mut |e| {
            let model = e.model_mut();
            let v = model.geometry.vocab_size;
            let sc = &mut model.scratch;
            model.kernels.sample_rows::<f32>(
                &model.gpu.stream,
                &sc.logits.slice(0..m * v),
                v,
                v,
                &rows,
                &mut sc.counts,
                v,
                None,
                &mut sc.sample_ws,
                &mut sc.ids.slice_mut(0..m),
            )?;
            Ok(())
        })?;
        // The timed steps' tail lookups are no request's traffic.
        let model = self.model_mut();
        if let Some(h) = model.hcs.as_mut() {
            let set = h.read_counters(&model.gpu)?;
            model.gpu.sync("reading the decode tail counters")?;
            h.tally_step(set);
            h.take_stats();
        }
        Ok(b)
    }
}
