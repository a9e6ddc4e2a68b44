//! The routed-expert FFN component: the arithmetic of one expert format
//! and activation, behind the calls the MoE paths and the expert residency
//! (all resident, HCS, streamed prefill) make. Residency decides where an
//! expert's bytes are and hands the kernels a pointer table; this decides
//! what the bytes mean. So a new expert format or activation is added
//! here and never touches HCS or streaming.
//!
//! - INT4 experts (`cuda/int4.cu`) with SwiGLU (qwen3_moe).
//! - MXFP4 experts (`cuda/mxfp4.cu`, the checkpoint's own bits), SwiGLU or
//!   gpt-oss's clamped SwiGLU, with or without biases on both projections.
//!
//! The grouped prefill path (`moe::experts_grouped`) dequantizes a batch of
//! experts, runs each expert's gate/up GEMM, then [`ExpertFfn::activate`],
//! each expert's down GEMM, then [`ExpertFfn::down_bias`]; biases are per
//! expert, so a biased format activates and adds its down bias expert by
//! expert over that expert's grouped rows.

use crate::error::{GpuError, Result};
use crate::forward::Ctx;
use crate::scratch::GroupedScratch;
use cudarc::driver::{CudaSlice, DevicePtr};
use half::bf16;
use krasis_kernels::Int4Layout;
use krasis_kernels::ops::mxfp4::{ExpertActivation, Mxfp4Layout};
use krasis_model::arch::Activation;

/// How one routed expert is stored on the device and computed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExpertFfn {
    /// INT4 blocks of the expert cache, SwiGLU.
    Int4Swiglu(Int4Layout),
    /// MXFP4 blocks of the expert cache (biases when the layout has them).
    Mxfp4 {
        layout: Mxfp4Layout,
        activation: ExpertActivation,
    },
}

/// The kernels' form of a plan's expert activation.
pub fn expert_activation(a: Activation) -> ExpertActivation {
    match a {
        Activation::Swiglu => ExpertActivation::Swiglu,
        Activation::ClampedSwiglu { limit, alpha } => {
            ExpertActivation::ClampedSwiglu { limit, alpha }
        }
    }
}

impl ExpertFfn {
    /// Bytes of one expert's arrays (the part a copy must move).
    pub fn used_bytes(&self) -> usize {
        match self {
            ExpertFfn::Int4Swiglu(l) => l.used_bytes(),
            ExpertFfn::Mxfp4 { layout, .. } => layout.used_bytes(),
        }
    }

    /// Whether the experts carry gate/up and down biases.
    pub fn has_bias(&self) -> bool {
        match self {
            ExpertFfn::Int4Swiglu(_) => false,
            ExpertFfn::Mxfp4 { layout, .. } => layout.has_bias,
        }
    }

    /// Gate/up GEMV with the activation (and gate/up bias) fused, for `t`
    /// tokens' `k` pairs (`ids` index `table`), only the slots set in
    /// `mask`: `act[p]` f32 `[t*k, I]`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gate_up_act(
        &self,
        cx: &Ctx<'_>,
        x: &CudaSlice<bf16>,
        table: &impl DevicePtr<u64>,
        ids: &impl DevicePtr<u32>,
        t: usize,
        mask: u32,
        act: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (s, k) = (&cx.gpu.stream, cx.g.top_k);
        match self {
            ExpertFfn::Int4Swiglu(l) => Ok(cx
                .kn
                .int4_w13_swiglu(s, x, table, ids, t, k, l, mask, act)?),
            ExpertFfn::Mxfp4 { layout, activation } => {
                Ok(cx
                    .kn
                    .mxfp4_w13_act(s, x, table, ids, t, k, layout, mask, *activation, act)?)
            }
        }
    }

    /// Down GEMV (and down bias) of every pair and the routing-weighted
    /// combine into the f32 residual, in a fixed order.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn down_combine(
        &self,
        cx: &Ctx<'_>,
        act: &CudaSlice<f32>,
        table: &impl DevicePtr<u64>,
        ids: &impl DevicePtr<u32>,
        weights: &CudaSlice<f32>,
        t: usize,
        residual: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (s, k) = (&cx.gpu.stream, cx.g.top_k);
        match self {
            ExpertFfn::Int4Swiglu(l) => Ok(cx
                .kn
                .int4_w2_combine(s, act, table, ids, weights, t, k, l, residual)?),
            ExpertFfn::Mxfp4 { layout, .. } => Ok(cx
                .kn
                .mxfp4_w2_combine(s, act, table, ids, weights, t, k, layout, residual)?),
        }
    }

    /// Dequantizes experts `b0..b1` of the layer (`table[b0..b1]`) to BF16
    /// `gs.w13` `[n, 2I, H]` and `gs.w2` `[n, H, I]` for the grouped
    /// prefill GEMMs, and their biases to `gs.bias` (f32 `[n, 2I]`,
    /// `[n, H]`).
    pub(crate) fn dequant(
        &self,
        cx: &Ctx<'_>,
        table: &impl DevicePtr<u64>,
        (b0, b1): (usize, usize),
        gs: &mut GroupedScratch,
    ) -> Result<()> {
        let s = &cx.gpu.stream;
        let (ids, n) = (gs.iota.slice(b0..b1), b1 - b0);
        match self {
            ExpertFfn::Int4Swiglu(l) => {
                Ok(cx
                    .kn
                    .int4_dequant(s, table, &ids, n, l, &mut gs.w13, &mut gs.w2)?)
            }
            ExpertFfn::Mxfp4 { layout, .. } => {
                let biases = match (&mut gs.bias, layout.has_bias) {
                    (Some((b13, b2)), true) => Some((b13, b2)),
                    (None, false) => None,
                    _ => return Err(missing_bias_scratch()),
                };
                Ok(cx.kn.mxfp4_dequant(
                    s,
                    table,
                    &ids,
                    n,
                    layout,
                    &mut gs.w13,
                    &mut gs.w2,
                    biases,
                )?)
            }
        }
    }

    /// The activation over the gate/up GEMM rows of experts `b0..b1` of a
    /// dequantized batch starting at `b0` (`offsets`: the grouped rows of
    /// each expert; `gs.h13` `[rows, 2I]` BF16, gate half first) into
    /// `gs.hact` `[rows, I]` BF16. With biases, each expert's rows get its
    /// own gate/up bias.
    pub(crate) fn activate(
        &self,
        cx: &Ctx<'_>,
        gs: &mut GroupedScratch,
        offsets: &[u32],
        (b0, b1): (usize, usize),
    ) -> Result<()> {
        let (s, i) = (&cx.gpu.stream, cx.g.expert_intermediate);
        let (r0, r1) = (offsets[b0] as usize, offsets[b1] as usize);
        match self {
            ExpertFfn::Int4Swiglu(_) => Ok(cx.kn.swiglu(
                s,
                &gs.h13.slice(r0 * 2 * i..),
                r1 - r0,
                i,
                &mut gs.hact.slice_mut(r0 * i..),
            )?),
            ExpertFfn::Mxfp4 { layout, activation } if !layout.has_bias => {
                Ok(cx.kn.bias_act_rows::<bf16>(
                    s,
                    &gs.h13.slice(r0 * 2 * i..),
                    None,
                    r1 - r0,
                    i,
                    *activation,
                    &mut gs.hact.slice_mut(r0 * i..),
                )?)
            }
            ExpertFfn::Mxfp4 { activation, .. } => {
                let (b13, _) = gs.bias.as_ref().ok_or_else(missing_bias_scratch)?;
                for x in b0..b1 {
                    let (a, b) = (offsets[x] as usize, offsets[x + 1] as usize);
                    if b <= a {
                        continue;
                    }
                    let bias = b13.slice((x - b0) * 2 * i..(x - b0 + 1) * 2 * i);
                    cx.kn.bias_act_rows::<bf16>(
                        s,
                        &gs.h13.slice(a * 2 * i..b * 2 * i),
                        Some(&bias as &dyn DevicePtr<f32>),
                        b - a,
                        i,
                        *activation,
                        &mut gs.hact.slice_mut(a * i..b * i),
                    )?;
                }
                Ok(())
            }
        }
    }

    /// Adds each expert's down bias to its rows of `gs.y` (f32 `[rows, H]`,
    /// the down GEMM output) for experts `b0..b1` of the batch starting at
    /// `b0`, before the weighted combine. Nothing without biases.
    pub(crate) fn down_bias(
        &self,
        cx: &Ctx<'_>,
        gs: &mut GroupedScratch,
        offsets: &[u32],
        (b0, b1): (usize, usize),
    ) -> Result<()> {
        if !self.has_bias() {
            return Ok(());
        }
        let (s, h) = (&cx.gpu.stream, cx.g.hidden);
        let (_, b2) = gs.bias.as_ref().ok_or_else(missing_bias_scratch)?;
        for x in b0..b1 {
            let (a, b) = (offsets[x] as usize, offsets[x + 1] as usize);
            if b <= a {
                continue;
            }
            let bias = b2.slice((x - b0) * h..(x - b0 + 1) * h);
            cx.kn
                .add_bias_rows::<f32>(s, &mut gs.y.slice_mut(a * h..b * h), &bias, b - a, h)?;
        }
        Ok(())
    }
}

fn missing_bias_scratch() -> GpuError {
    GpuError::Unsupported(
        "internal: the expert biases and the grouped scratch's bias buffers disagree".into(),
    )
}
