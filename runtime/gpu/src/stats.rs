//! The engine's figures for the stats endpoint: per-request HCS traffic,
//! VRAM, pinned host memory, and the live copy of them that decode
//! publishes while a request runs.
//!
//! Live publishing is throttled to one snapshot per [`PUBLISH_PERIOD`] and
//! costs the decode loop no device synchronisation: the due check is one
//! `Instant::now()` per token (tens of nanoseconds); a due publish reads
//! the host-side HCS counters as they are (no CUDA event is waited on or
//! read), asks the driver for free memory (`cuMemGetInfo`, which does not
//! synchronise; a few microseconds), and copies a small struct under an
//! uncontended mutex. At ~10 per second that is well under 0.1% of decode
//! time, and none of it touches what the GPU computes.

use crate::engine::CudaEngine;
use crate::hcs::{CopyStats, Counters};
use krasis_common::status::{EngineStats, HcsStats, VramStats};
use krasis_model::LiveProgress;
use std::time::{Duration, Instant};

/// How often decode publishes its figures so far (the launcher polls the
/// stats endpoint every 200 ms).
pub const PUBLISH_PERIOD: Duration = Duration::from_millis(100);

/// Decides when the next live snapshot is due.
pub(crate) struct LivePublisher {
    next: Instant,
}

impl LivePublisher {
    /// The first snapshot is due one period after `now`.
    pub(crate) fn new() -> Self {
        LivePublisher {
            next: Instant::now() + PUBLISH_PERIOD,
        }
    }

    /// True at most once per period.
    pub(crate) fn due(&mut self) -> bool {
        let now = Instant::now();
        if now < self.next {
            return false;
        }
        self.next = now + PUBLISH_PERIOD;
        true
    }
}

/// HCS traffic per decode step over the steps tallied so far (the first
/// generated token comes from prefill and reads no expert in place).
fn traffic(c: &Counters, copies: &CopyStats) -> HcsStats {
    let steps = c.steps.max(1) as f64;
    HcsStats {
        hit_rate: c.hit_rate(),
        cold_experts_per_token: copies.decode_cold_reads as f64 / steps,
        cold_bytes_per_token: copies.decode_bytes as f64 / steps,
        prefetched_experts_per_token: copies.prefetched as f64 / steps,
        prefetch_used_per_token: copies.prefetch_used as f64 / steps,
        prefetch_wasted_per_token: copies.prefetch_wasted as f64 / steps,
        prefill_stream_bytes: copies.prefill_bytes,
        reload_bytes: copies.reload_bytes,
        ..Default::default()
    }
}

/// HCS decode traffic summed over every collection since the engine
/// loaded. Why: with several sequences decoding together, a collection
/// covers only the steps since the previous sequence ended (the last
/// sequence of a batched run collects its last few, mostly single-row,
/// steps), so `bench --decode-rows` takes these totals before and after a
/// run and reports the difference: the traffic of every step of the run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HcsTotals {
    counters: Counters,
    copies: CopyStats,
}

impl HcsTotals {
    /// Field by field `f(a, b)` of two tallies (`+` adds a collection,
    /// `-` takes a span): one list of the fields, which the struct
    /// literals keep complete.
    fn zip(a: &HcsTotals, c: &Counters, k: &CopyStats, f: fn(u64, u64) -> u64) -> HcsTotals {
        let (ac, ak) = (&a.counters, &a.copies);
        HcsTotals {
            counters: Counters {
                lookups: f(ac.lookups, c.lookups),
                hits: f(ac.hits, c.hits),
                steps: f(ac.steps, c.steps),
            },
            copies: CopyStats {
                decode_cold_reads: f(ak.decode_cold_reads, k.decode_cold_reads),
                decode_bytes: f(ak.decode_bytes, k.decode_bytes),
                decode_promotions: f(ak.decode_promotions, k.decode_promotions),
                prefetched: f(ak.prefetched, k.prefetched),
                prefetch_used: f(ak.prefetch_used, k.prefetch_used),
                prefetch_wasted: f(ak.prefetch_wasted, k.prefetch_wasted),
                prefill_bytes: f(ak.prefill_bytes, k.prefill_bytes),
                reload_bytes: f(ak.reload_bytes, k.reload_bytes),
                decode_tokens: f(ak.decode_tokens, k.decode_tokens),
            },
        }
    }

    fn add(&mut self, c: &Counters, copies: &CopyStats) {
        *self = Self::zip(self, c, copies, |a, b| a + b);
    }

    /// Decode steps tallied in these totals.
    pub fn steps(&self) -> u64 {
        self.counters.steps
    }

    /// The traffic since `before` (totals taken earlier from the same
    /// engine), per decode step.
    pub fn since(&self, before: &HcsTotals) -> HcsStats {
        let d = Self::zip(self, &before.counters, &before.copies, |a, b| a - b);
        traffic(&d.counters, &d.copies)
    }
}

impl CudaEngine {
    /// HCS decode traffic since load (every collection so far), for a
    /// caller that measures a span of several requests
    /// ([`HcsTotals::since`]).
    pub fn hcs_totals(&self) -> HcsTotals {
        self.hcs_totals.clone()
    }

    /// The HCS decision with the traffic since `before` as its per-step
    /// figures; `None` when HCS is off.
    pub fn hcs_stats_since(&self, before: &HcsTotals) -> Option<HcsStats> {
        self.hcs_stats_with(Some(&self.hcs_totals.since(before)))
    }

    /// Turns the HCS counters since the last collection (the request just
    /// finished, and the steps it shared with others) into per-step figures
    /// for the stats endpoint and bench, and resets them.
    ///
    /// Sequences that end in the same step: the first takes the steps'
    /// traffic, and the others, finding no step and no transfer since,
    /// keep those figures (a step-less collection would report a hit rate
    /// of 1 and no cold expert: `bench --decode-rows` at 6 GiB did).
    pub(crate) fn collect_hcs(&mut self) {
        if let Some(h) = self.model.hcs.as_mut() {
            let (c, copies) = h.take_stats();
            self.hcs_totals.add(&c, &copies);
            let idle = c.steps == 0 && copies.prefill_bytes == 0 && copies.reload_bytes == 0;
            if idle && self.last_hcs.is_some() {
                return;
            }
            self.last_hcs = Some(traffic(&c, &copies));
        }
    }

    /// Publishes the figures of the running request after `decode_steps`
    /// steps to `live` (see the module comment for what it costs).
    pub(crate) fn publish_live(&self, live: &LiveProgress) {
        let now = self
            .model
            .hcs
            .as_ref()
            .map(|h| {
                let (c, copies) = h.peek_stats();
                traffic(c, copies)
            })
            .or_else(|| self.last_hcs.clone());
        live.publish_engine(self.engine_stats(now.as_ref()));
    }

    /// What [`krasis_model::Engine::stats`] reports, with `traffic` as the
    /// HCS traffic (the running request's, or the last one's when idle).
    pub(crate) fn engine_stats(&self, traffic: Option<&HcsStats>) -> EngineStats {
        let mut s = self.stats.clone();
        if let Ok((free, total)) = self.model.gpu.mem_info() {
            let b = self.model.gpu.budget;
            let free = b.free(free as u64);
            s.vram = Some(VramStats {
                total_bytes: total as u64,
                limit_bytes: b.limit,
                free_bytes: free,
                min_free_bytes: self.min_free.unwrap_or(free).min(free),
                margin_bytes: 0,
            });
        }
        s.hcs = self.hcs_stats_with(traffic);
        if let (Some(v), Some(h)) = (s.vram.as_mut(), s.hcs.as_ref()) {
            v.margin_bytes = h.safety_margin_bytes;
        }
        s.pinned_host_bytes = Some(self.pinned_host_bytes());
        s.prefix_cache = self.prefix_cache_stats();
        s
    }

    /// Page-locked host memory the engine holds: the mapped input
    /// embedding, the prefix cache's host tier and, under HCS, the expert
    /// backing and the decode routes buffer (with every expert resident the
    /// backing is released after loading, so it does not count).
    pub fn pinned_host_bytes(&self) -> u64 {
        self.model.weights.host_bytes as u64
            + self.model.hcs.as_ref().map_or(0, |h| h.pinned_bytes())
            + self.prefix.as_ref().map_or(0, |p| p.host_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publishing_is_throttled_to_the_period() {
        let mut p = LivePublisher::new();
        assert!(!p.due(), "due before a period has passed");
        p.next = Instant::now();
        assert!(p.due());
        assert!(!p.due(), "due twice in one period");
    }

    #[test]
    fn traffic_is_per_decode_step() {
        let mut c = Counters {
            lookups: 10,
            hits: 8,
            steps: 2,
        };
        let copies = CopyStats {
            decode_cold_reads: 4,
            decode_bytes: 400,
            prefetched: 6,
            prefetch_used: 4,
            prefetch_wasted: 2,
            ..Default::default()
        };
        let t = traffic(&c, &copies);
        assert_eq!(t.hit_rate, 0.8);
        assert_eq!(
            (t.cold_experts_per_token, t.cold_bytes_per_token),
            (2.0, 200.0)
        );
        assert_eq!(
            (
                t.prefetched_experts_per_token,
                t.prefetch_used_per_token,
                t.prefetch_wasted_per_token
            ),
            (3.0, 2.0, 1.0)
        );
        // No decode step yet: no division by zero.
        c.steps = 0;
        assert_eq!(traffic(&c, &copies).cold_bytes_per_token, 400.0);
    }

    /// A batched run's collections (one per sequence that ended) summed,
    /// then the span between two snapshots: every step of the span, not
    /// only the last collection's.
    #[test]
    fn totals_cover_every_collection_of_a_span() {
        let col = |lookups, hits, steps, cold| {
            (
                Counters {
                    lookups,
                    hits,
                    steps,
                },
                CopyStats {
                    decode_cold_reads: cold,
                    decode_bytes: cold * 100,
                    ..Default::default()
                },
            )
        };
        let mut t = HcsTotals::default();
        let (c, k) = col(16, 16, 2, 0); // an earlier request
        t.add(&c, &k);
        let before = t.clone();
        // Four rows: the first sequence to end collects 126 steps of four
        // rows, the others the few steps after it.
        for (c, k) in [
            col(4032, 3500, 126, 12_000),
            col(32, 30, 2, 4),
            col(0, 0, 0, 0),
        ] {
            t.add(&c, &k);
        }
        let s = t.since(&before);
        assert_eq!(t.steps() - before.steps(), 128);
        assert_eq!(s.hit_rate, 3530.0 / 4064.0);
        assert_eq!(s.cold_experts_per_token, 12_004.0 / 128.0);
        assert_eq!(s.cold_bytes_per_token, 1_200_400.0 / 128.0);
        // Nothing since: no step, no traffic.
        assert_eq!(t.since(&t).cold_experts_per_token, 0.0);
    }
}
