//! Where one decode step's device time goes, measured with CUDA events
//! around its parts run on their own (bench only; the token path carries
//! no instrumentation).

use crate::attention::attention;
use crate::engine::CudaEngine;
use crate::error::{GpuError, Result};
use crate::forward::Positions;
use crate::weights::MlpWeights;
use cudarc::driver::sys::CUevent_flags;
use serde::Serialize;

/// Median device milliseconds of each part of a decode step.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DecodeBreakdown {
    /// Embedding + every layer (eager launches).
    pub layers_ms: f64,
    /// Attention block of one layer (QKV GEMM, norm+RoPE, append, attention, o_proj).
    pub attention_layer_ms: f64,
    /// Router GEMM + top-k of one MoE layer.
    pub router_layer_ms: f64,
    /// Routed experts (two expert GEMV kernels) of one MoE layer.
    pub experts_layer_ms: f64,
    /// Final norm + LM head GEMM.
    pub lm_head_ms: f64,
    /// Sampler.
    pub sample_ms: f64,
}

impl CudaEngine {
    /// Times the parts of a decode step at position `pos` (`reps` each,
    /// median). Overwrites KV entries at `pos`; call between requests.
    pub fn decode_breakdown(&mut self, pos: usize, reps: usize) -> Result<DecodeBreakdown> {
        let ctx = self.gpu().ctx.clone();
        let ev = || {
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(GpuError::driver("creating a timing event"))
        };
        let (e0, e1) = (ev()?, ev()?);
        let reps = reps.max(1);
        let time = |engine: &mut CudaEngine,
                    f: &mut dyn FnMut(&mut CudaEngine) -> Result<()>|
         -> Result<f64> {
            let mut v = Vec::with_capacity(reps);
            for _ in 0..reps {
                let s = engine.gpu().stream.clone();
                e0.record(&s)
                    .map_err(GpuError::driver("recording an event"))?;
                f(engine)?;
                e1.record(&s)
                    .map_err(GpuError::driver("recording an event"))?;
                e1.synchronize()
                    .map_err(GpuError::driver("waiting for an event"))?;
                v.push(
                    e0.elapsed_ms(&e1)
                        .map_err(GpuError::driver("reading an event"))? as f64,
                );
            }
            v.sort_by(|a, b| a.total_cmp(b));
            Ok(v[v.len() / 2])
        };
        self.require_idle("decode_breakdown")?;
        {
            // One row at `pos`, its KV from row 0.
            let m = self.model_mut();
            let (s, sc) = (&m.gpu.stream, &mut m.scratch);
            s.memcpy_htod(&[pos as u32], &mut sc.pos.slice_mut(0..1))
                .and_then(|_| s.memcpy_htod(&[0u32], &mut sc.kv_base.slice_mut(0..1)))
                .map_err(GpuError::driver("writing the decode position"))?;
        }
        let mut b = DecodeBreakdown {
            layers_ms: time(self, &mut |e| {
                e.model_mut().forward_layers(1, Positions::Decode)
            })?,
            lm_head_ms: time(self, &mut |e| e.model_mut().lm_head(0, 1))?,
            ..DecodeBreakdown::default()
        };
        b.attention_layer_ms = time(self, &mut |e| {
            let (cx, sc, kv) = e.model_mut().split();
            attention(&cx, sc, kv, 0, 1, Positions::Decode)
        })?;
        let moe = self
            .model_mut()
            .weights
            .layers
            .iter()
            .position(|l| matches!(l.mlp, MlpWeights::Moe { .. }));
        if let Some(l) = moe {
            b.router_layer_ms = time(self, &mut |e| {
                let (cx, sc, _) = e.model_mut().split();
                crate::moe::router(&cx, sc, l, 1, Positions::Decode, false)
            })?;
            b.experts_layer_ms = time(self, &mut |e| {
                let (cx, sc, _) = e.model_mut().split();
                let MlpWeights::Moe { moe_index, .. } = cx.w.layers[l].mlp else {
                    return Ok(());
                };
                crate::moe::routed_experts(&cx, sc, None, moe_index, 1, Positions::Decode)
            })?;
        }
        let params = krasis_kernels::SamplingParams::default();
        b.sample_ms = time(self, &mut |e| {
            let m = e.model_mut();
            let v = m.geometry.vocab_size;
            let sc = &mut m.scratch;
            m.kernels.sample::<f32>(
                &m.gpu.stream,
                &sc.logits.slice(0..v),
                v,
                &params,
                0,
                &mut sc.counts.slice_mut(0..v),
                &mut sc.sample_ws,
                &mut sc.ids.slice_mut(0..1),
            )?;
            Ok(())
        })?;
        Ok(b)
    }
}
