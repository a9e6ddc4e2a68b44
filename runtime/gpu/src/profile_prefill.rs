//! Where an all-resident prefill's device time goes, measured with CUDA
//! events around its parts run on their own, as `profile.rs` does for a
//! decode step (bench only; the token path carries no instrumentation).
//!
//! Per chunk of the prompt (the chunks `prefill` runs), after a real
//! prefill filled the KV: the whole chunk (embedding and every layer), then
//! one layer's attention block at that chunk's positions, every MoE layer's
//! router, and its routed experts over the routes its router just wrote.
//! Attention is timed at the first layer and counted once per layer (every
//! layer of a family has the same attention shape and reads the same
//! number of keys); the router and experts are timed at every MoE layer, as
//! their work follows each layer's routes. What the parts leave of the
//! chunk's total is the rest: norms, the dense and shared-expert MLPs,
//! residual adds and the launches between. The LM head (one row in
//! prefill) is not in it.

use crate::attention::{attention, input_norm};
use crate::engine::CudaEngine;
use crate::error::{GpuError, Result};
use crate::forward::Positions;
use crate::mlp::post_attention_norm;
use crate::profile::EventTimer;
use crate::weights::MlpWeights;
use serde::Serialize;

/// Device milliseconds of a prefill of `tokens` tokens (medians of each
/// part's repetitions, summed over the chunks).
#[derive(Debug, Clone, Default, Serialize)]
pub struct PrefillBreakdown {
    pub tokens: usize,
    /// Chunks the prompt ran in (the engine's prefill chunk).
    pub chunks: usize,
    /// Embedding + every layer of every chunk (eager launches).
    pub total_ms: f64,
    /// Input norm, QKV GEMM, norm + RoPE, KV append, attention and o_proj,
    /// times the layers.
    pub attention_ms: f64,
    /// Post-attention norm, router GEMM and top-k of every MoE layer.
    pub router_ms: f64,
    /// Routed experts of every MoE layer (grouped GEMMs or GEMVs, with
    /// their sort and scatter).
    pub experts_ms: f64,
    /// `total_ms` minus the parts (never below 0).
    pub rest_ms: f64,
}

impl CudaEngine {
    /// Prefills `tokens` (all resident only), then times each chunk's parts
    /// (`reps` each, median; module docs). Overwrites the KV of the prompt's
    /// positions; call between requests.
    pub fn prefill_breakdown(&mut self, tokens: &[u32], reps: usize) -> Result<PrefillBreakdown> {
        if self.model.hcs.is_some() {
            return Err(GpuError::Unsupported(
                "a prefill breakdown with HCS (streamed prefill's parts overlap its copies; \
                 measure all resident)"
                    .into(),
            ));
        }
        self.check_tokens(tokens)?;
        self.prefill(tokens, |_, _, _| Ok(()))?;
        let timer = EventTimer::new(self, reps)?;
        let layers = self.model.geometry.num_layers;
        let moe: Vec<(usize, usize)> = self
            .model
            .weights
            .layers
            .iter()
            .enumerate()
            .filter_map(|(l, w)| match w.mlp {
                MlpWeights::Moe { moe_index, .. } => Some((l, moe_index)),
                MlpWeights::Dense(_) => None,
            })
            .collect();
        let cap = self.model.scratch.cap;
        let mut b = PrefillBreakdown {
            tokens: tokens.len(),
            ..PrefillBreakdown::default()
        };
        for (c, chunk) in tokens.chunks(cap).enumerate() {
            let (t, at) = (
                chunk.len(),
                Positions::Prefill {
                    start: c * cap,
                    base: 0,
                    slot: 0,
                },
            );
            let m = self.model_mut();
            m.gpu
                .stream
                .memcpy_htod(chunk, &mut m.scratch.ids.slice_mut(0..t))
                .map_err(GpuError::driver("copying prompt tokens to the GPU"))?;
            b.chunks += 1;
            b.total_ms += timer.median_ms(self, &mut |e| e.model_mut().forward_layers(t, at))?;
            b.attention_ms += layers as f64
                * timer.median_ms(self, &mut |e| {
                    let (cx, sc, kv) = e.model_mut().split();
                    input_norm(&cx, sc, 0, t)?;
                    attention(&cx, sc, kv, 0, t, at)
                })?;
            for &(l, moe_index) in &moe {
                b.router_ms += timer.median_ms(self, &mut |e| {
                    let (cx, sc, _) = e.model_mut().split();
                    post_attention_norm(&cx, sc, l, t)?;
                    crate::moe::router(&cx, sc, l, t, at, false)
                })?;
                b.experts_ms += timer.median_ms(self, &mut |e| {
                    let (cx, sc, _) = e.model_mut().split();
                    crate::moe::routed_experts(&cx, sc, moe_index, t, at)
                })?;
            }
        }
        b.rest_ms = (b.total_ms - b.attention_ms - b.router_ms - b.experts_ms).max(0.0);
        Ok(b)
    }
}
