//! Startup VRAM calibration (white paper §8).
//!
//! After the model, KV cache, scratch and the reclaimable tier exist and
//! every native path has run once, real short and long prompts run with no
//! resident experts while a monitor thread records the driver-visible
//! low-water. Each phase's need is kept as a *transient delta* (free before
//! − low-water), never as an absolute free value (which allocator state
//! after calibration would make stale, §8.3). The resident tier is then
//! sized as current free − transient(configured context) − safety margin,
//! and loaded in chunks with a live free-memory guard.

use crate::engine::CudaEngine;
use crate::error::{GpuError, Result};
use crate::monitor::VramMonitor;
use krasis_model::{Engine, GenerateRequest, SamplingParams};
use std::ops::ControlFlow;
use std::time::{Duration, Instant};

/// Real English text (public domain, see assets/text/PROVENANCE.md). Only
/// memory is measured, so the words do not matter, only that the prompt is
/// what a user's prompt is: tokenized text.
const TEXT: &str = include_str!("../../../assets/text/kjv-genesis-exodus.txt");

/// One measured phase.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Phase {
    pub prompt_tokens: usize,
    pub transient_bytes: u64,
}

/// What calibration measured and decided.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Calibration {
    pub short: Phase,
    pub long: Phase,
    /// Transient at the configured context length (linear in prompt
    /// tokens through the two phases; never below the larger measurement).
    pub transient_at_context: u64,
    pub safety_margin: u64,
    pub free_after: u64,
    pub seconds: f64,
}

impl Calibration {
    pub fn transient_at(&self, tokens: usize) -> u64 {
        let (a, b) = (self.short, self.long);
        let span = b.prompt_tokens.saturating_sub(a.prompt_tokens).max(1) as f64;
        let slope = (b.transient_bytes as f64 - a.transient_bytes as f64).max(0.0) / span;
        let at = b.transient_bytes as f64 + slope * (tokens as f64 - b.prompt_tokens as f64);
        (at.max(a.transient_bytes.max(b.transient_bytes) as f64)) as u64
    }
}

impl CudaEngine {
    /// Runs the calibration prompts; the resident tier must be empty.
    pub(crate) fn calibrate(
        &mut self,
        model_dir: &std::path::Path,
        margin: u64,
    ) -> Result<Calibration> {
        let t0 = Instant::now();
        let text = match krasis_model::tokenizer::Tokenizer::from_dir(model_dir) {
            Ok(tok) => tok.encode(TEXT)?,
            // Memory does not depend on which ids a prompt holds, so a model
            // directory without a tokenizer (bare test checkpoints) is
            // calibrated with spread-out ids instead of text.
            Err(e) => {
                tracing::info!("calibrating with synthetic token ids: {e}");
                let v = self.sampleable.max(1) as u64;
                (0..8192u64).map(|i| ((i * 7919 + 13) % v) as u32).collect()
            }
        };
        let context = self.info().context_length;
        // Leave room for the decode steps of each phase.
        let long_len = context.saturating_sub(8).clamp(2, 8192);
        let short_len = (long_len / 8).clamp(1, 512);
        let prompt = |n: usize| -> Vec<u32> { text.iter().copied().cycle().take(n).collect() };
        // Warm-up: loads every kernel module and cuBLAS heuristic so the
        // measured phases see steady-state memory.
        self.calibration_run(&prompt(short_len.min(64)))?;
        let phase = |engine: &mut CudaEngine, n: usize| -> Result<Phase> {
            engine.model.gpu.sync("calibration")?;
            let base = engine.model.gpu.mem_info()?.0 as u64;
            let mon = VramMonitor::start(engine.model.gpu.ctx.clone(), Duration::from_micros(500));
            engine.calibration_run(&prompt(n))?;
            engine.model.gpu.sync("calibration")?;
            let low = mon
                .min_free()
                .unwrap_or(base)
                .min(engine.model.gpu.mem_info()?.0 as u64);
            drop(mon);
            Ok(Phase {
                prompt_tokens: n,
                transient_bytes: base.saturating_sub(low),
            })
        };
        let short = phase(self, short_len)?;
        let long = phase(self, long_len)?;
        let mut c = Calibration {
            short,
            long,
            transient_at_context: 0,
            safety_margin: margin,
            free_after: self.model.gpu.free_in_budget()?,
            seconds: 0.0,
        };
        c.transient_at_context = c.transient_at(context);
        c.seconds = t0.elapsed().as_secs_f64();
        Ok(c)
    }

    fn calibration_run(&mut self, prompt: &[u32]) -> Result<()> {
        let req = GenerateRequest {
            prompt: prompt.to_vec(),
            max_new_tokens: 4,
            sampling: SamplingParams {
                temperature: 0.0,
                ..SamplingParams::default()
            },
            stop_token_ids: Vec::new(),
            cancel: Default::default(),
            live: Default::default(),
            cache_prompt: false,
            constraint: None,
        };
        self.generate(&req, &mut |_| ControlFlow::Continue(()))
            .map_err(|e| {
                GpuError::Hcs(format!(
                    "calibration prompt of {} tokens failed: {e}",
                    prompt.len()
                ))
            })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cal(short: (usize, u64), long: (usize, u64)) -> Calibration {
        Calibration {
            short: Phase {
                prompt_tokens: short.0,
                transient_bytes: short.1,
            },
            long: Phase {
                prompt_tokens: long.0,
                transient_bytes: long.1,
            },
            transient_at_context: 0,
            safety_margin: 600 << 20,
            free_after: 0,
            seconds: 0.0,
        }
    }

    #[test]
    fn transient_extrapolates_linearly_and_never_below_a_measurement() {
        let c = cal((512, 100), (8192, 7780));
        // slope 1 byte/token through both points.
        assert_eq!(c.transient_at(8192), 7780);
        assert_eq!(c.transient_at(32768), 7780 + 32768 - 8192);
        // Shorter prompts never get less than the larger measurement.
        assert_eq!(c.transient_at(100), 7780);
        // A long phase that measured less than the short one (allocator
        // noise) gives a flat model at the larger value.
        let c = cal((512, 5000), (8192, 4000));
        assert_eq!(c.transient_at(65536), 5000);
    }
}
