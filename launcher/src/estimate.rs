//! The pre-flight estimate shown before launch: the runtime's own plan
//! (`krasis-runtime plan`, computed by the size functions the engine's load
//! path uses, so the two cannot disagree) plus the one check only the
//! launcher can make, the host RAM its probe sees. Nothing here re-derives
//! the runtime's memory placement.

use crate::runtime::{PlanCache, RuntimeFacts, plan_args};
use crate::units::fmt_bytes;
use krasis_common::{LaunchOptions, Plan};

#[derive(Debug, Clone, PartialEq)]
pub struct Estimate {
    /// The runtime's plan, or why it could not make one.
    pub plan: Result<Plan, String>,
    pub host_available_bytes: u64,
}

/// The estimate for `opts` on the device (free, total) the probe measured.
pub fn estimate(
    facts: &dyn RuntimeFacts,
    cache: &PlanCache,
    opts: &LaunchOptions,
    host_available: u64,
    device: Option<(u64, u64)>,
) -> Estimate {
    Estimate {
        plan: cache.get(facts, plan_args(opts, device)),
        host_available_bytes: host_available,
    }
}

impl Estimate {
    /// Warnings beyond the plan's own: host RAM short of what the plan needs.
    pub fn warnings(&self) -> Vec<String> {
        let Ok(p) = &self.plan else {
            return Vec::new();
        };
        let need = p.host.total_bytes;
        if need > self.host_available_bytes {
            vec![format!(
                "the runtime needs {} of host RAM but only {} is available; it will page from disk and be slow or fail",
                fmt_bytes(need),
                fmt_bytes(self.host_available_bytes)
            )]
        } else {
            Vec::new()
        }
    }

    /// Human-readable lines for the summary screen and headless output.
    pub fn lines(&self) -> Vec<String> {
        match &self.plan {
            Err(e) => vec![format!("no estimate: {e}")],
            Ok(p) => {
                let mut v = p.lines();
                v.push(format!(
                    "host RAM available: {}",
                    fmt_bytes(self.host_available_bytes)
                ));
                v.extend(self.warnings().iter().map(|w| format!("WARNING: {w}")));
                v
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::fake::{A3B_PATH, FakeFacts};
    use std::sync::atomic::Ordering;

    fn opts() -> LaunchOptions {
        LaunchOptions {
            model: A3B_PATH.into(),
            context_length: Some(32768),
            ..Default::default()
        }
    }

    #[test]
    fn the_estimate_is_the_runtimes_plan_asked_once_per_options() {
        let f = FakeFacts::default();
        let cache = PlanCache::default();
        let device = Some((15 << 30, 16 << 30));
        let e = estimate(&f, &cache, &opts(), 64 << 30, device);
        let p = e.plan.as_ref().unwrap();
        assert_eq!(p.context_length, 32768);
        assert!(
            e.lines().iter().any(|l| l.contains("coverage")),
            "{:?}",
            e.lines()
        );
        for _ in 0..10 {
            estimate(&f, &cache, &opts(), 64 << 30, device);
        }
        assert_eq!(
            f.plans.load(Ordering::SeqCst),
            1,
            "one plan per (model, options)"
        );
        let mut o = opts();
        o.vram_limit_bytes = Some(2 << 30);
        let e = estimate(&f, &cache, &o, 64 << 30, device);
        assert_eq!(f.plans.load(Ordering::SeqCst), 2);
        assert!(
            e.lines().iter().any(|l| l.contains("will not fit")),
            "{:?}",
            e.lines()
        );
    }

    #[test]
    fn short_host_ram_is_a_warning() {
        let f = FakeFacts::default();
        let e = estimate(&f, &PlanCache::default(), &opts(), 1 << 30, None);
        assert_eq!(e.warnings().len(), 1);
        assert!(
            e.lines()
                .iter()
                .any(|l| l.starts_with("WARNING: the runtime needs"))
        );
    }
}
