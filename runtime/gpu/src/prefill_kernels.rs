//! Which prefill kernels a model's engine runs, chosen once at load from the
//! device ([`PrefillKernels::for_device`]) and then used for every chunk.
//!
//! On Hopper (compute capability 9.0) the warpgroup-MMA attention
//! (`cuda/attention_prefill_sm90.cu`) replaces the portable mma.sync kernel
//! for the shape it serves (bf16, head_dim 128): on the H200 it runs 1.45x
//! as fast at 8K tokens and 1.48x at 32K (`kbench --prefill`,
//! `benchmarks/results/2026-12-04-session17.md`). Its bits differ from the
//! portable kernel's (128-key tiles against 64), so the choice is never made
//! per chunk: chunked prefill, prefix reuse, packed prefill and streaming
//! all stay bit-identical to the whole all-resident prefill of the same
//! engine. Decode kernels are the same on every device.
//!
//! The Hopper grouped INT4 GEMMs (`cuda/int4_gemm_sm90.cu`) are not chosen:
//! on the H200 they measured 0.95-1.01x the mma.sync kernels on a3b's
//! experts and 1.03-1.07x on GLM-4.5-Air's (`kbench --grouped`, same
//! results file), too little to carry a second expert path whose bits
//! differ.

use krasis_kernels::{Act16, Kernels};
use std::fmt;

/// The kernel family of one prefill stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// mma.sync tensor cores, every supported device.
    Portable,
    /// Warpgroup MMA, compute capability 9.0 only.
    Hopper,
}

/// The prefill kernels of one engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillKernels {
    /// Causal attention over the linear KV cache (bf16, head_dim 128 on
    /// Hopper; every other shape, and the ring cache, stays portable).
    pub attention: Family,
}

impl PrefillKernels {
    /// The fastest kernels `kn`'s device runs.
    pub fn for_device(kn: &Kernels) -> Self {
        PrefillKernels {
            attention: if kn.has_prefill_wgmma() {
                Family::Hopper
            } else {
                Family::Portable
            },
        }
    }

    /// Whether attention in `A` with `head_dim` runs the Hopper kernel.
    pub(crate) fn hopper_attention<A: Act16>(&self, head_dim: usize) -> bool {
        self.attention == Family::Hopper && Kernels::prefill_wgmma_serves::<A>(head_dim)
    }
}

impl fmt::Display for PrefillKernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.attention {
            Family::Portable => "attention mma.sync",
            Family::Hopper => "attention wgmma at bf16 head_dim 128, else mma.sync",
        })
    }
}
