//! `bench --decode-rows 1,2,4,8`: aggregate decode speed of M sequences
//! decoding together through the engine's continuous batching (the path
//! `serve --parallel` runs), beside where one step's device time goes and
//! the bytes a step of M rows must read.
//!
//! Why its own measurement: the server's figures (`benchmarks/agent_load.py
//! parallel`) mix prefill, HTTP and streaming with decode; this isolates
//! the decode step of M rows, which is what batching is meant to make
//! cheaper per token. Each run admits M greedy requests with different
//! prompts (consecutive slices of the bench text), steps until every one
//! has its first token, then times the steps until all end: M x D tokens
//! over that wall time (host included: the step's launches, sampling
//! readback and bookkeeping are part of what a client sees).

use super::stats::RunStats;
use anyhow::Context;
use krasis_gpu::CudaEngine;
use krasis_gpu::bounds;
use krasis_model::batch::{Admission, Batch, SeqEvent};
use serde::Serialize;
use std::time::Instant;

/// The figures of one row count.
#[derive(Debug, Clone, Serialize)]
pub struct BatchedResult {
    pub rows: usize,
    /// Tokens each sequence decodes in the timed part.
    pub decode_tokens: usize,
    pub prompt_tokens: usize,
    /// Aggregate decode tok/s (all rows together).
    pub stats: RunStats,
    /// Aggregate over one row's median: how much batching gives.
    pub speedup_over_one_row: Option<f64>,
    /// Median device time of a decode step of M rows (CUDA events around
    /// the step, graph replay), from an extra run after the timed ones.
    pub step_device_ms: f64,
    /// Bytes one step must read (`bounds::decode_bytes_per_step` with the
    /// expected distinct experts), and the aggregate tok/s HBM allows.
    pub step_bytes: f64,
    pub expected_distinct_experts: f64,
    pub bound_tok_s: f64,
    /// Where one step's device time goes (parts run on their own).
    pub breakdown: krasis_gpu::profile::DecodeBreakdown,
    /// Under HCS: the expert traffic of every step of the step-timed run
    /// (its `cold_experts_per_token` is per step: steps of M rows, and the
    /// few of fewer rows while the sequences start and end), which is what
    /// bounds M rows at a VRAM limit.
    pub hcs: Option<krasis_common::status::HcsStats>,
}

/// Tokens each sequence decodes in the timed part: the first of
/// `--decode-tokens` (the engine's KV arena is sized from the same value).
pub(super) fn decode_tokens(a: &super::Args) -> usize {
    a.decode_tokens.first().copied().unwrap_or(64)
}

/// One run: M sequences of `prompt` tokens (slice r of `text` for row r)
/// decoding `d` timed tokens each. Returns the aggregate tok/s and the
/// device ms of each decode step (when step timing is on).
fn run_once(
    e: &mut CudaEngine,
    text: &[u32],
    rows: usize,
    prompt: usize,
    d: usize,
) -> anyhow::Result<(f64, Vec<f64>)> {
    let mut ids = Vec::new();
    for r in 0..rows {
        let p = &text[r * prompt..(r + 1) * prompt];
        // +1: the first token comes from prefill and is not timed.
        match e
            .admit(super::speed::greedy_request(p, d + 1))
            .context("admitting a bench sequence")?
        {
            Admission::Admitted(s) => ids.push(s),
            Admission::Wait => anyhow::bail!(
                "the engine could not admit {rows} sequences of {} tokens together (its KV arena or \
                 batch places are too few)",
                prompt + d + 1
            ),
        }
    }
    let mut events = Vec::new();
    let mut first = vec![false; rows];
    let mut done = 0usize;
    let mut tokens = vec![0usize; rows];
    let mut start: Option<Instant> = None;
    let mut step_ms = Vec::new();
    while done < rows {
        events.clear();
        e.step(&mut events).context("a batched decode step")?;
        if start.is_some()
            && let Some(t) = e.last_step_timing()
            && t.decode_rows == rows
        {
            step_ms.push(t.decode_ms);
        }
        for ev in events.drain(..) {
            match ev {
                SeqEvent::Token { seq, .. } => {
                    let r = ids.iter().position(|&s| s == seq).expect("own sequence");
                    first[r] = true;
                    tokens[r] += 1;
                }
                SeqEvent::Done { seq, result } => {
                    result.with_context(|| format!("bench sequence {seq:?}"))?;
                    done += 1;
                }
            }
        }
        if start.is_none() && first.iter().all(|&f| f) {
            start = Some(Instant::now());
        }
    }
    let secs = start
        .expect("every sequence started")
        .elapsed()
        .as_secs_f64();
    anyhow::ensure!(
        tokens.iter().all(|&t| t == d + 1),
        "every sequence should have made {} tokens, got {tokens:?}",
        d + 1
    );
    Ok(((rows * d) as f64 / secs, step_ms))
}

/// Measures every row count of `rows_list` the engine can run together.
pub fn measure(
    e: &mut CudaEngine,
    text: &[u32],
    rows_list: &[usize],
    prompt: usize,
    d: usize,
    repeats: usize,
    expert_bytes: usize,
) -> anyhow::Result<Vec<BatchedResult>> {
    let g = e.geometry().clone();
    let cap = e.capacity();
    let mut out: Vec<BatchedResult> = Vec::new();
    for &m in rows_list {
        anyhow::ensure!(
            (1..=cap).contains(&m),
            "--decode-rows {m}: the engine runs 1..={cap} sequences together (--parallel)"
        );
        anyhow::ensure!(
            text.len() >= m * prompt,
            "--decode-rows {m} needs {} prompt tokens of text, have {}",
            m * prompt,
            text.len()
        );
        let stats = RunStats::measure(repeats, || Ok(run_once(e, text, m, prompt, d)?.0))?;
        // The traffic of every step of the step-timed run (the engine's
        // per-request figures would give only the steps after the
        // second-to-last sequence ended).
        let before = e.hcs_totals();
        e.set_step_timing(true)?;
        let (_, step_ms) = run_once(e, text, m, prompt, d)?;
        e.set_step_timing(false)?;
        let run_steps = e.hcs_totals().steps() - before.steps();
        let hcs = e
            .hcs_stats_since(&before)
            .filter(|_| e.hcs_active() && run_steps > 0);
        let step_device_ms = super::stats::median(&step_ms);
        let breakdown = e
            .decode_breakdown(prompt + d / 2, m, 20)
            .context("timing the parts of a decode step")?;
        let distinct = bounds::expected_distinct_experts(&g, m);
        let step_bytes =
            bounds::decode_bytes_per_step(&g, expert_bytes, prompt + d / 2, m, distinct);
        let bound_tok_s = m as f64 * bounds::H200_HBM_BYTES_PER_S / step_bytes;
        let speedup_over_one_row = out
            .iter()
            .find(|r| r.rows == 1)
            .map(|one| stats.median_tok_s / one.stats.median_tok_s);
        eprintln!(
            "decode {m} rows x {d} tokens: {} tok/s aggregate{} (bound {:.0} tok/s: {:.2} GB/step, {:.1} distinct experts/layer expected, {} in the timed layer); step {:.3} ms on the device; parts (ms): layers {:.3} (per layer: attention {:.4}, router {:.4}, experts {:.4}), LM head {:.3}, sample {:.3}",
            stats.display(1),
            speedup_over_one_row.map_or(String::new(), |s| format!(" ({s:.2}x one row)")),
            bound_tok_s,
            step_bytes / 1e9,
            distinct,
            breakdown.distinct_experts,
            step_device_ms,
            breakdown.layers_ms,
            breakdown.attention_layer_ms,
            breakdown.router_layer_ms,
            breakdown.experts_layer_ms,
            breakdown.lm_head_ms,
            breakdown.sample_ms
        );
        if let Some(h) = &hcs {
            eprintln!(
                "  HCS: hit rate {:.3}, {:.1} cold experts ({:.1} MB) per step over PCIe ({run_steps} \
                 steps of up to {m} rows)",
                h.hit_rate,
                h.cold_experts_per_token,
                h.cold_bytes_per_token / 1e6
            );
        }
        out.push(BatchedResult {
            rows: m,
            decode_tokens: d,
            prompt_tokens: prompt,
            stats,
            speedup_over_one_row,
            step_device_ms,
            step_bytes,
            expected_distinct_experts: distinct,
            bound_tok_s,
            breakdown,
            hcs,
        });
    }
    Ok(out)
}
