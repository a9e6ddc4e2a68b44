//! Pre-flight memory estimate from the model's real geometry and the probe,
//! shown before launch so a configuration that cannot fit is caught early.
//!
//! - Host RAM: the whole INT4 expert cache is kept in (pinned) host memory.
//! - VRAM, permanent: every non-routed-expert weight (attention, router,
//!   norms, dense MLPs, LM head; the input embedding only when tied to the LM
//!   head) in BF16.
//! - Host RAM, mapped: an untied input embedding, which the runtime keeps in
//!   page-locked host memory and gathers from over PCIe.
//! - VRAM, KV: BF16, `2 (K and V) x layers x kv_dim x context`.
//! - VRAM, workspace: a fixed allowance for activations, cuBLAS workspace and
//!   the cold-expert staging buffers ([`WORKSPACE_ALLOWANCE`]).
//! - What is left after the safety margin holds HCS-resident experts.

use crate::probe::ModelSummary;
use krasis_common::{Backend, LaunchOptions};
use serde::Serialize;

/// Activations, GEMM workspace and staging buffers for cold experts.
pub const WORKSPACE_ALLOWANCE: u64 = 512 << 20;
const BF16: u64 = 2;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Estimate {
    pub context: u64,
    /// What the host RAM figure is for.
    pub host_label: String,
    pub host_cache_bytes: u64,
    pub host_available_bytes: u64,
    /// None for the reference backend (no GPU involved).
    pub gpu: Option<GpuEstimate>,
    pub warnings: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuEstimate {
    pub budget_bytes: u64,
    pub permanent_bytes: u64,
    pub kv_bytes: u64,
    pub workspace_bytes: u64,
    pub safety_margin_bytes: u64,
    /// VRAM left for resident experts (0 when it does not fit).
    pub hcs_bytes: u64,
    pub hcs_experts: u64,
    pub total_experts: u64,
    /// Fraction of all routed experts that fit in VRAM.
    pub hcs_coverage: f64,
    pub fits: bool,
}

/// Bytes of the input embedding the runtime keeps in mapped host memory
/// (untied embeddings; a tied one is the LM head and stays in VRAM).
fn host_embedding_bytes(g: &krasis_model::Geometry) -> u64 {
    if g.tie_word_embeddings {
        0
    } else {
        g.vocab_size as u64 * g.hidden as u64 * BF16
    }
}

/// `gpu_total`/`gpu_free` are the chosen device's figures (None without a GPU).
pub fn estimate(
    opts: &LaunchOptions,
    m: &ModelSummary,
    host_available: u64,
    gpu_total_free: Option<(u64, u64)>,
) -> Estimate {
    let g = &m.geometry;
    let context = opts
        .context_length
        .map(u64::from)
        .unwrap_or(m.max_position_embeddings as u64);
    let mut warnings = Vec::new();
    // The reference engine reads routed experts from the checkpoint itself;
    // the GPU engine keeps the INT4 cache in host memory.
    let (host_label, host_bytes) = match opts.backend {
        Backend::Reference => (
            format!("routed experts from the checkpoint ({})", m.source_dtype),
            m.source_expert_bytes,
        ),
        Backend::Cuda => (
            "the INT4 expert cache and the input embedding".to_string(),
            m.int4_expert_bytes + host_embedding_bytes(g),
        ),
    };
    if host_bytes > host_available {
        warnings.push(format!(
            "{host_label} needs {} of host RAM but only {} is available; the runtime will page from disk and be slow or fail",
            crate::units::fmt_bytes(host_bytes),
            crate::units::fmt_bytes(host_available)
        ));
    }
    let gpu = match (opts.backend, gpu_total_free) {
        (Backend::Reference, _) => None,
        (Backend::Cuda, None) => {
            warnings.push("the cuda backend is selected but no GPU was found".into());
            None
        }
        (Backend::Cuda, Some((total, free))) => {
            let budget = opts.vram_limit_bytes.map_or(free, |l| l.min(free));
            let permanent =
                (g.total_params() - g.routed_expert_params()) * BF16 - host_embedding_bytes(g);
            let kv = 2 * g.num_layers as u64 * g.kv_dim() as u64 * context * BF16;
            let margin = opts.safety_margin_mib << 20;
            let fixed = permanent + kv + WORKSPACE_ALLOWANCE + margin;
            let fits = fixed <= budget;
            let hcs_bytes = if opts.hcs {
                budget.saturating_sub(fixed)
            } else {
                0
            };
            let total_experts = (m.moe_layers * m.num_experts) as u64;
            let hcs_experts = (hcs_bytes / m.int4_expert_stride.max(1)).min(total_experts);
            if !fits {
                warnings.push(format!(
                    "will not fit: permanent weights {} + KV {} ({} tokens) + workspace {} + margin {} = {} exceeds the {} VRAM budget ({} free of {}); lower the context or raise the VRAM limit",
                    crate::units::fmt_bytes(permanent),
                    crate::units::fmt_bytes(kv),
                    context,
                    crate::units::fmt_bytes(WORKSPACE_ALLOWANCE),
                    crate::units::fmt_bytes(margin),
                    crate::units::fmt_bytes(fixed),
                    crate::units::fmt_bytes(budget),
                    crate::units::fmt_bytes(free),
                    crate::units::fmt_bytes(total),
                ));
            }
            Some(GpuEstimate {
                budget_bytes: budget,
                permanent_bytes: permanent,
                kv_bytes: kv,
                workspace_bytes: WORKSPACE_ALLOWANCE,
                safety_margin_bytes: margin,
                hcs_bytes,
                hcs_experts,
                total_experts,
                hcs_coverage: if total_experts == 0 {
                    0.0
                } else {
                    hcs_experts as f64 / total_experts as f64
                },
                fits,
            })
        }
    };
    Estimate {
        context,
        host_label,
        host_cache_bytes: host_bytes,
        host_available_bytes: host_available,
        gpu,
        warnings,
    }
}

impl Estimate {
    /// Human-readable lines for the summary screen and headless output.
    pub fn lines(&self) -> Vec<String> {
        use crate::units::fmt_bytes as b;
        let mut v = vec![format!(
            "host RAM for {}: {} ({} available)",
            self.host_label,
            b(self.host_cache_bytes),
            b(self.host_available_bytes)
        )];
        match &self.gpu {
            None => v.push(format!(
                "context {} tokens; no GPU memory used",
                self.context
            )),
            Some(g) => {
                v.push(format!(
                    "VRAM budget {}: permanent weights {}, KV {} ({} tokens), workspace {}, safety margin {}",
                    b(g.budget_bytes),
                    b(g.permanent_bytes),
                    b(g.kv_bytes),
                    self.context,
                    b(g.workspace_bytes),
                    b(g.safety_margin_bytes)
                ));
                v.push(format!(
                    "HCS: {} for resident experts = {} of {} experts ({:.1}% coverage)",
                    b(g.hcs_bytes),
                    g.hcs_experts,
                    g.total_experts,
                    g.hcs_coverage * 100.0
                ));
            }
        }
        v.extend(self.warnings.iter().map(|w| format!("WARNING: {w}")));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::fake::a3b;

    #[test]
    fn a3b_on_a_16gib_card() {
        let m = a3b();
        let o = LaunchOptions {
            context_length: Some(32768),
            ..Default::default()
        };
        let e = estimate(&o, &m, 64 << 30, Some((16 << 30, 15 << 30)));
        let g = e.gpu.clone().unwrap();
        // KV: 2 * 48 layers * 512 * 32768 * 2 bytes = 3 GiB exactly.
        assert_eq!(g.kv_bytes, 3 << 30);
        // ~30.5B params of which ~29.0B are routed experts; of the ~1.5B
        // left the untied input embedding (151,936 x 2048) stays in host
        // memory: ~1.23B BF16 in VRAM.
        assert!(g.permanent_bytes > 2_300_000_000 && g.permanent_bytes < 2_600_000_000);
        assert!(g.fits);
        assert!(
            g.hcs_coverage > 0.3 && g.hcs_coverage < 1.0,
            "{}",
            g.hcs_coverage
        );
        // INT4 cache: 2,433,024 bytes per expert (4-bit + f16 scales per 128),
        // 6144 experts, 13.9 GiB; plus the 622 MB mapped input embedding.
        assert_eq!(e.host_cache_bytes, 2_433_024 * 6144 + 151_936 * 2048 * 2);
        assert!(e.warnings.is_empty(), "{:?}", e.warnings);
    }

    #[test]
    fn too_small_a_limit_warns_before_launch() {
        let m = a3b();
        let o = LaunchOptions {
            vram_limit_bytes: Some(2 << 30),
            ..Default::default()
        };
        let e = estimate(&o, &m, 8 << 30, Some((24 << 30, 23 << 30)));
        assert!(!e.gpu.as_ref().unwrap().fits);
        assert_eq!(e.gpu.as_ref().unwrap().hcs_experts, 0);
        assert_eq!(e.warnings.len(), 2, "{:?}", e.warnings);
        assert!(e.lines().iter().any(|l| l.contains("will not fit")));
    }
}
