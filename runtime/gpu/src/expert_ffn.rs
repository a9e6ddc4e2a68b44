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
//! The grouped prefill path (`moe::experts_grouped`) computes a chunk's
//! rows, grouped by expert, in place (two grouped GEMMs reading the expert
//! blocks where they are: INT4 group 128, `cuda/int4_gemm.cu`; MXFP4 for
//! short prompts, `cuda/mxfp4_gemm.cu`, biases and activation fused) or
//! dequantized: a batch of experts dequantized, each expert's gate/up GEMM,
//! then [`ExpertFfn::activate`], each expert's down GEMM, then
//! [`ExpertFfn::down_bias`]; biases are per expert, so a biased format
//! activates and adds its down bias expert by expert over that expert's
//! grouped rows.
//!
//! MXFP4 takes both, chosen per prompt ([`MXFP4_IN_PLACE_MAX_TOKENS`]): the
//! grouped MXFP4 GEMMs beat dequantize + cuBLAS only on short prompts (on
//! the H200 with gpt-oss-20b's experts, 2.33x at 512 tokens, 1.45x at 1K,
//! 0.88x at 2K, 0.43x at 8K: `kbench --grouped`,
//! `benchmarks/results/2026-12-04-session17.md`).
//!
//! The 16-bit values (the GEMV input `x`, the dequantized weights, the
//! gate/up rows and the activation of the grouped path) are in the MLP
//! block's format (`MlpSpec::activations`): BF16, or FP16 for INT4 experts
//! (the `_f16` kernels); MXFP4 experts have BF16 kernels only, and an FP16
//! MLP block with them is refused (`support.rs`, [`ExpertFfn::for_cache`]).

use crate::act::{view, view_mut};
use crate::error::{GpuError, Result};
use crate::forward::Ctx;
use crate::scratch::{GroupedPath, GroupedScratch, no_dequant_scratch};
use cudarc::driver::{CudaSlice, DevicePtr};
use half::{bf16, f16};
use krasis_kernels::Int4Layout;
use krasis_kernels::ops::mxfp4::{ExpertActivation, Mxfp4Layout, mxfp4_grouped_tiles};
use krasis_model::Geometry;
use krasis_model::arch::{ActFormat, Activation};

/// Prompts of at most this many tokens compute MXFP4 experts in place
/// (every chunk of the prompt), longer ones dequantize: the measured
/// crossover of the two on the H200 lies between 1K (in place 1.45x) and
/// 2K tokens (0.88x), ~1.7K by interpolation. The choice is the prompt's,
/// never the chunk's, so a prompt's rows are computed the same way however
/// it is chunked or packed (`CudaEngine::mxfp4_in_place_for`: not with the
/// prefix cache; a packed pass holds prompts of one choice).
pub const MXFP4_IN_PLACE_MAX_TOKENS: usize = 1536;

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
    /// `mask`: `act[p]` f32 `[t*k, I]`. `x` (the normed rows) holds the MLP
    /// block's format. `after_tail_fetch`: launched right after the decode
    /// tail's fetch, whose copies it overlaps (the kernels' contract).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gate_up_act(
        &self,
        cx: &Ctx<'_>,
        x: &CudaSlice<bf16>,
        table: &impl DevicePtr<u64>,
        ids: &impl DevicePtr<u32>,
        t: usize,
        mask: u32,
        after_tail_fetch: bool,
        act: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (s, k, f) = (&cx.gpu.stream, cx.g.top_k, after_tail_fetch);
        match (self, cx.g.mlp.activations) {
            (ExpertFfn::Int4Swiglu(l), ActFormat::Bf16) => Ok(cx
                .kn
                .int4_w13_swiglu(s, x, table, ids, t, k, l, mask, f, act)?),
            (ExpertFfn::Int4Swiglu(l), ActFormat::F16) => {
                Ok(cx
                    .kn
                    .int4_w13_swiglu(s, &view::<f16>(x), table, ids, t, k, l, mask, f, act)?)
            }
            (ExpertFfn::Mxfp4 { layout, activation }, ActFormat::Bf16) => Ok(cx.kn.mxfp4_w13_act(
                s,
                x,
                table,
                ids,
                t,
                k,
                layout,
                mask,
                f,
                *activation,
                act,
            )?),
            (ExpertFfn::Mxfp4 { .. }, ActFormat::F16) => Err(mxfp4_f16()),
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

    /// How the grouped prefill path computes these experts, and so which
    /// scratch it needs: in place where the grouped INT4 kernels implement
    /// the format (group 128), else dequantized. The choice is the
    /// format's, never the chunk's, so every chunk of every prompt computes
    /// a row the same way. MXFP4 is `Dequantize` here because its long
    /// prompts dequantize; its short ones read in place over the same
    /// scratch (`cx.mxfp4_in_place`, [`Self::grouped_gemms`]).
    pub fn grouped_path(&self) -> GroupedPath {
        match self {
            ExpertFfn::Int4Swiglu(l) if krasis_kernels::int4_grouped_supports(l) => {
                GroupedPath::InPlace
            }
            _ => GroupedPath::Dequantize,
        }
    }

    /// Both grouped GEMMs of a chunk's rows in one launch each, reading the
    /// expert blocks in place: `gs.xg` (grouped by `gs.offsets`, whose host
    /// copy is `offsets`) -> activation rows `gs.hact` -> down rows `gs.y`
    /// (INT4 group 128: `cuda/int4_gemm.cu`, SwiGLU; MXFP4 when the prompt
    /// takes it, `cx.mxfp4_in_place`: `cuda/mxfp4_gemm.cu`, the biases and
    /// the activation fused). Returns false, launching nothing, on the
    /// dequantizing path, which then runs [`Self::dequant`] and per-expert
    /// GEMMs.
    pub(crate) fn grouped_gemms(
        &self,
        cx: &Ctx<'_>,
        table: &impl DevicePtr<u64>,
        gs: &mut GroupedScratch,
        offsets: &[u32],
    ) -> Result<bool> {
        let in_place = match self {
            ExpertFfn::Int4Swiglu(_) => self.grouped_path() == GroupedPath::InPlace,
            ExpertFfn::Mxfp4 { .. } => cx.mxfp4_in_place,
        };
        if !in_place {
            return Ok(false);
        }
        let rows = offsets.last().map_or(0, |&r| r as usize);
        let GroupedScratch {
            xg,
            hact,
            y,
            offsets: d_off,
            ..
        } = gs;
        match (self, cx.g.mlp.activations) {
            (ExpertFfn::Int4Swiglu(l), ActFormat::Bf16) => {
                let tiles = krasis_kernels::int4_grouped_tiles(offsets);
                grouped_int4(cx, l, table, (d_off, rows, tiles), xg, hact, y)
            }
            (ExpertFfn::Int4Swiglu(l), ActFormat::F16) => {
                let tiles = krasis_kernels::int4_grouped_tiles(offsets);
                grouped_int4(
                    cx,
                    l,
                    table,
                    (d_off, rows, tiles),
                    &view::<f16>(xg),
                    &mut view_mut::<f16>(hact),
                    y,
                )
            }
            (ExpertFfn::Mxfp4 { layout, activation }, ActFormat::Bf16) => {
                let tiles = mxfp4_grouped_tiles(offsets);
                let (s, kn, e) = (&cx.gpu.stream, cx.kn, cx.g.num_experts);
                let a = *activation;
                kn.mxfp4_grouped_w13_act(s, xg, rows, d_off, e, tiles, table, layout, a, hact)?;
                kn.mxfp4_grouped_w2(s, hact, rows, d_off, e, tiles, table, layout, y)?;
                Ok(())
            }
            (ExpertFfn::Mxfp4 { .. }, ActFormat::F16) => Err(mxfp4_f16()),
        }?;
        Ok(true)
    }

    /// Dequantizes experts `b0..b1` of the layer (`table[b0..b1]`) to the
    /// MLP block's format, `gs.w13` `[n, 2I, H]` and `gs.w2` `[n, H, I]`,
    /// for the grouped prefill GEMMs, and their biases to `gs.bias` (f32
    /// `[n, 2I]`, `[n, H]`).
    pub(crate) fn dequant(
        &self,
        cx: &Ctx<'_>,
        table: &impl DevicePtr<u64>,
        (b0, b1): (usize, usize),
        gs: &mut GroupedScratch,
    ) -> Result<()> {
        let s = &cx.gpu.stream;
        let gs = gs.dequant.as_mut().ok_or_else(no_dequant_scratch)?;
        let (ids, n) = (gs.iota.slice(b0..b1), b1 - b0);
        match (self, cx.g.mlp.activations) {
            (ExpertFfn::Int4Swiglu(l), ActFormat::Bf16) => {
                Ok(cx
                    .kn
                    .int4_dequant(s, table, &ids, n, l, &mut gs.w13, &mut gs.w2)?)
            }
            (ExpertFfn::Int4Swiglu(l), ActFormat::F16) => Ok(cx.kn.int4_dequant(
                s,
                table,
                &ids,
                n,
                l,
                &mut view_mut::<f16>(&mut gs.w13),
                &mut view_mut::<f16>(&mut gs.w2),
            )?),
            (ExpertFfn::Mxfp4 { .. }, ActFormat::F16) => Err(mxfp4_f16()),
            (ExpertFfn::Mxfp4 { layout, .. }, ActFormat::Bf16) => {
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
    /// each expert; `gs.h13` `[rows, 2I]`, gate half first) into `gs.hact`
    /// `[rows, I]`, both in the MLP block's format. With biases, each
    /// expert's rows get its own gate/up bias.
    pub(crate) fn activate(
        &self,
        cx: &Ctx<'_>,
        gs: &mut GroupedScratch,
        offsets: &[u32],
        (b0, b1): (usize, usize),
    ) -> Result<()> {
        let (s, i) = (&cx.gpu.stream, cx.g.expert_intermediate);
        let (r0, r1) = (offsets[b0] as usize, offsets[b1] as usize);
        let GroupedScratch { hact, dequant, .. } = gs;
        let dq = dequant.as_ref().ok_or_else(no_dequant_scratch)?;
        match (self, cx.g.mlp.activations) {
            (ExpertFfn::Int4Swiglu(_), ActFormat::Bf16) => Ok(cx.kn.swiglu(
                s,
                &dq.h13.slice(r0 * 2 * i..),
                r1 - r0,
                i,
                &mut hact.slice_mut(r0 * i..),
            )?),
            (ExpertFfn::Int4Swiglu(_), ActFormat::F16) => Ok(cx.kn.swiglu(
                s,
                &view::<f16>(&dq.h13).slice(r0 * 2 * i..),
                r1 - r0,
                i,
                &mut view_mut::<f16>(hact).slice_mut(r0 * i..),
            )?),
            (ExpertFfn::Mxfp4 { .. }, ActFormat::F16) => Err(mxfp4_f16()),
            (ExpertFfn::Mxfp4 { layout, activation }, _) if !layout.has_bias => {
                Ok(cx.kn.bias_act_rows::<bf16>(
                    s,
                    &dq.h13.slice(r0 * 2 * i..),
                    None,
                    r1 - r0,
                    i,
                    *activation,
                    &mut hact.slice_mut(r0 * i..),
                )?)
            }
            (ExpertFfn::Mxfp4 { activation, .. }, _) => {
                let (b13, _) = dq.bias.as_ref().ok_or_else(missing_bias_scratch)?;
                for x in b0..b1 {
                    let (a, b) = (offsets[x] as usize, offsets[x + 1] as usize);
                    if b <= a {
                        continue;
                    }
                    let bias = b13.slice((x - b0) * 2 * i..(x - b0 + 1) * 2 * i);
                    cx.kn.bias_act_rows::<bf16>(
                        s,
                        &dq.h13.slice(a * 2 * i..b * 2 * i),
                        Some(&bias as &dyn DevicePtr<f32>),
                        b - a,
                        i,
                        *activation,
                        &mut hact.slice_mut(a * i..b * i),
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
        let GroupedScratch { y, dequant, .. } = gs;
        let dq = dequant.as_ref().ok_or_else(no_dequant_scratch)?;
        let (_, b2) = dq.bias.as_ref().ok_or_else(missing_bias_scratch)?;
        for x in b0..b1 {
            let (a, b) = (offsets[x] as usize, offsets[x + 1] as usize);
            if b <= a {
                continue;
            }
            let bias = b2.slice((x - b0) * h..(x - b0 + 1) * h);
            cx.kn
                .add_bias_rows::<f32>(s, &mut y.slice_mut(a * h..b * h), &bias, b - a, h)?;
        }
        Ok(())
    }
}

impl ExpertFfn {
    /// The expert arithmetic of a cache whose experts are laid out as `l`,
    /// for a model of geometry `g`: the format the cache records (INT4 with its
    /// group, or MXFP4 with the model's biases) and the plan's activation. A
    /// layout the kernels do not implement is refused, not misread.
    pub(crate) fn for_cache(l: &krasis_cache::ExpertLayout, g: &Geometry) -> Result<ExpertFfn> {
        if l.hidden != g.hidden || l.intermediate != g.expert_intermediate {
            return Err(GpuError::Cache(format!(
                "cache experts are {}x{} but the model's are {}x{}",
                l.hidden, l.intermediate, g.hidden, g.expert_intermediate
            )));
        }
        if l.has_bias != g.experts.bias {
            return Err(GpuError::Cache(format!(
                "cache experts {} biases but the model's experts {}",
                if l.has_bias { "carry" } else { "lack" },
                if g.experts.bias {
                    "have them"
                } else {
                    "do not"
                }
            )));
        }
        match l.format {
            krasis_cache::ExpertFormat::Int4 { group } => {
                if g.experts.activation != Activation::Swiglu {
                    return Err(GpuError::Unsupported(format!(
                        "INT4 experts with {:?} (the INT4 kernels implement SwiGLU)",
                        g.experts.activation
                    )));
                }
                let mine = Int4Layout {
                    hidden: l.hidden,
                    intermediate: l.intermediate,
                    group,
                    w13_q: l.w13_q,
                    w13_s: l.w13_s,
                    w2_q: l.w2_q,
                    w2_s: l.w2_s,
                };
                // The kernels hard-code the format-2 INT4 layout; a cache whose
                // offsets differ from what they expect is refused.
                if Int4Layout::new(l.hidden, l.intermediate, group) != Some(mine) {
                    return Err(GpuError::Cache(format!(
                        "cache expert layout {l:?} differs from the format-2 INT4 layout the kernels implement"
                    )));
                }
                Ok(ExpertFfn::Int4Swiglu(mine))
            }
            krasis_cache::ExpertFormat::Mxfp4 if g.mlp.activations == ActFormat::F16 => {
                Err(mxfp4_f16())
            }
            krasis_cache::ExpertFormat::Mxfp4 => {
                let mine = Mxfp4Layout {
                    hidden: l.hidden,
                    intermediate: l.intermediate,
                    has_bias: l.has_bias,
                    w13_q: l.w13_q,
                    w13_s: l.w13_s,
                    w13_b: l.w13_b,
                    w2_q: l.w2_q,
                    w2_s: l.w2_s,
                    w2_b: l.w2_b,
                };
                if Mxfp4Layout::new(l.hidden, l.intermediate, l.has_bias) != Some(mine)
                    || mine.used_bytes() != l.used_bytes
                {
                    return Err(GpuError::Cache(format!(
                        "cache expert layout {l:?} differs from the format-2 MXFP4 layout the kernels implement"
                    )));
                }
                Ok(ExpertFfn::Mxfp4 {
                    layout: mine,
                    activation: expert_activation(g.experts.activation),
                })
            }
        }
    }
}

/// MXFP4 experts under an FP16 MLP block: no kernels (refused at load).
fn mxfp4_f16() -> GpuError {
    GpuError::Unsupported(
        "MXFP4 experts with an FP16 MLP block (their kernels are BF16 only)".into(),
    )
}

/// The grouped INT4 gate/up + SwiGLU and down GEMMs over `x` (the grouped
/// rows, in the MLP block's format `A`), through `hact` into `y`.
fn grouped_int4<A: krasis_kernels::Act16>(
    cx: &Ctx<'_>,
    l: &Int4Layout,
    table: &impl DevicePtr<u64>,
    (offsets, rows, tiles): (&CudaSlice<u32>, usize, usize),
    x: &impl DevicePtr<A>,
    hact: &mut (impl DevicePtr<A> + cudarc::driver::DevicePtrMut<A>),
    y: &mut CudaSlice<f32>,
) -> Result<()> {
    let (s, kn, e) = (&cx.gpu.stream, cx.kn, cx.g.num_experts);
    kn.int4_grouped_w13_swiglu(s, x, rows, offsets, e, tiles, table, l, hact)?;
    kn.int4_grouped_w2(s, hact, rows, offsets, e, tiles, table, l, y)?;
    Ok(())
}

fn missing_bias_scratch() -> GpuError {
    GpuError::Unsupported(
        "internal: the expert biases and the grouped scratch's bias buffers disagree".into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use krasis_cache::{ExpertFormat, ExpertLayout};

    fn geometry(h: usize, i: usize) -> Geometry {
        let mut g = krasis_model::synth::preset_geometry("tiny").expect("tiny preset");
        g.hidden = h;
        g.expert_intermediate = i;
        g
    }

    #[test]
    fn int4_layout_takes_the_cache_group() {
        // A 2880-wide model's cache has group 32; the kernels get it.
        let l = ExpertLayout::int4(2880, 1440).unwrap();
        let Ok(ExpertFfn::Int4Swiglu(k)) = ExpertFfn::for_cache(&l, &geometry(2880, 1440)) else {
            panic!("INT4 cache not read as INT4");
        };
        assert_eq!(k.group, 32);
        assert_eq!(Some(k), Int4Layout::new(2880, 1440, 32));
        let l = ExpertLayout::int4(2048, 768).unwrap();
        let Ok(ExpertFfn::Int4Swiglu(k)) = ExpertFfn::for_cache(&l, &geometry(2048, 768)) else {
            panic!("INT4 cache not read as INT4");
        };
        assert_eq!(k.group, 128);
        // Dims that disagree with the model are refused.
        assert!(matches!(
            ExpertFfn::for_cache(&l, &geometry(2048, 1024)),
            Err(GpuError::Cache(_))
        ));
    }

    #[test]
    fn an_mxfp4_cache_is_run_as_mxfp4_with_the_plans_activation() {
        let mut g = geometry(2880, 2880);
        g.experts = krasis_model::arch::ExpertSpec {
            activation: Activation::ClampedSwiglu {
                limit: 7.0,
                alpha: 1.702,
            },
            bias: true,
        };
        let l = ExpertLayout::new(ExpertFormat::Mxfp4, 2880, 2880, true).unwrap();
        match ExpertFfn::for_cache(&l, &g).unwrap() {
            ExpertFfn::Mxfp4 { layout, activation } => {
                assert_eq!(Some(layout), Mxfp4Layout::new(2880, 2880, true));
                assert_eq!(layout.used_bytes(), l.used_bytes);
                assert_eq!(
                    activation,
                    krasis_kernels::ops::mxfp4::ExpertActivation::ClampedSwiglu {
                        limit: 7.0,
                        alpha: 1.702
                    }
                );
            }
            other => panic!("expected MXFP4, got {other:?}"),
        }
        // A cache without the model's biases, or with moved offsets, is
        // refused rather than misread.
        let plain = ExpertLayout::new(ExpertFormat::Mxfp4, 2880, 2880, false).unwrap();
        assert!(matches!(
            ExpertFfn::for_cache(&plain, &g),
            Err(GpuError::Cache(_))
        ));
        let moved = ExpertLayout {
            w2_q: l.w2_q + 256,
            ..l
        };
        assert!(matches!(
            ExpertFfn::for_cache(&moved, &g),
            Err(GpuError::Cache(_))
        ));
        // An FP16 MLP block has no MXFP4 kernels.
        let mut f16 = g.clone();
        f16.mlp.activations = ActFormat::F16;
        let e = ExpertFfn::for_cache(&l, &f16).unwrap_err().to_string();
        assert!(e.contains("MXFP4 experts with an FP16 MLP block"), "{e}");
        // INT4 experts with the clamped activation have no kernel.
        g.experts.bias = false;
        let int4 = ExpertLayout::int4(2880, 2880).unwrap();
        assert!(matches!(
            ExpertFfn::for_cache(&int4, &g),
            Err(GpuError::Unsupported(_))
        ));
    }

    /// The layout the cache builds for tiny-gpt-oss (from its checkpoint)
    /// is the one the MXFP4 kernels read, with the plan's biases and
    /// clamped activation.
    #[test]
    fn tiny_gpt_oss_cache_layout_is_run_as_mxfp4() {
        let dir = krasis_model::testutil::tiny_gpt_oss_checkpoint();
        let config = krasis_model::ModelConfig::load(&dir).unwrap();
        let l = krasis_cache::model_layout(&config, &dir).unwrap();
        let g = config.geometry();
        match ExpertFfn::for_cache(&l, &g).unwrap() {
            ExpertFfn::Mxfp4 { layout, activation } => {
                assert!(layout.has_bias);
                assert_eq!(
                    activation,
                    crate::expert_ffn::expert_activation(g.experts.activation)
                );
                assert!(matches!(
                    activation,
                    krasis_kernels::ops::mxfp4::ExpertActivation::ClampedSwiglu { .. }
                ));
            }
            other => panic!("expected MXFP4, got {other:?}"),
        }
    }
}
