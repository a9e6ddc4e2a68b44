//! The SwiGLU MLP: a dense layer's MLP, and a MoE layer's shared expert
//! (glm4_moe; added to every token's routed output). One code path for
//! both, on the same scratch (`scratch::swiglu_width`). Also the
//! post-attention RMSNorm, the input of every MLP block.
//!
//! **Activation format** (`MlpSpec::activations`, the one place it is
//! decided; the CPU reference's emulation reads the same field): BF16, or
//! FP16 (glm4_moe). Every 16-bit value of the block is in it: the normed
//! input (also the router's and the routed experts', `moe.rs`,
//! `expert_ffn.rs`), the weights (converted at upload,
//! `weights::Weight16`), the gate/up output and the SwiGLU product; the
//! down projection accumulates into the f32 residual. The code is one
//! generic path over the format (`A`), so the BF16 path launches what it
//! launched before FP16 existed, with the same arguments.
//!
//! Prefill: gate/up GEMM (cuBLAS, 16-bit out) → SwiGLU → down GEMM
//! accumulated into the f32 residual (beta = 1). Decode: the same through
//! the GEMV kernels, which stream the weights at HBM rate where cuBLAS at
//! M = 1 does not; a dense layer folds its RMSNorm into the gate/up GEMV
//! (`fold_norm`), while the shared expert reads the normed row the router
//! GEMV already wrote.

use crate::act::{in_type, out16, view, view_mut};
use crate::blas::OutType;
use crate::error::{GpuError, Result};
use crate::forward::Ctx;
use crate::scratch::Scratch;
use crate::weights::SwigluMlp;
use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use krasis_kernels::Act16;
use krasis_model::arch::ActFormat;

/// The post-attention RMSNorm of layer `l`'s prefill into
/// `scratch.normed`, rounded to the MLP block's format (decode folds it
/// into the router or dense gate/up GEMV).
pub(crate) fn post_attention_norm(
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    l: usize,
    t: usize,
) -> Result<()> {
    let (g, s, kn) = (cx.g, &cx.gpu.stream, cx.kn);
    let (h, eps) = (g.hidden, g.rms_norm_eps);
    let w = &cx.w.layers[l].post_attention_norm;
    match g.mlp.activations {
        ActFormat::Bf16 => kn.rmsnorm::<f32>(s, &sc.residual, w, t, h, eps, &mut sc.normed)?,
        ActFormat::F16 => kn.rmsnorm_f32_to_f16(
            s,
            &sc.residual,
            w,
            t,
            h,
            eps,
            &mut view_mut::<f16>(&mut sc.normed),
        )?,
    }
    Ok(())
}

/// `residual[..t] += down(swiglu(gate_up(x)))` where `x` is
/// `scratch.normed[..t]`, or in decode (`decode`, `t` rows) with
/// `fold_norm`, `rmsnorm(residual)` with that weight (the GEMV also writes
/// it to `scratch.normed`); in the MLP block's format.
pub(crate) fn swiglu_mlp(
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    w: &SwigluMlp,
    t: usize,
    decode: bool,
    fold_norm: Option<&CudaSlice<bf16>>,
) -> Result<()> {
    match cx.g.mlp.activations {
        ActFormat::Bf16 => swiglu_mlp_as::<bf16>(cx, sc, w, t, decode, fold_norm),
        ActFormat::F16 => swiglu_mlp_as::<f16>(cx, sc, w, t, decode, fold_norm),
    }
}

fn swiglu_mlp_as<A: Act16>(
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    w: &SwigluMlp,
    t: usize,
    decode: bool,
    fold_norm: Option<&CudaSlice<bf16>>,
) -> Result<()> {
    let (s, kn, h, inter) = (&cx.gpu.stream, cx.kn, cx.g.hidden, w.inter);
    let gate_up = w.gate_up.get::<A>("the MLP gate/up weight")?;
    let down = w.down.get::<A>("the MLP down weight")?;
    let ds = sc
        .dense
        .as_mut()
        .ok_or_else(|| GpuError::Unsupported("SwiGLU MLP without its scratch".into()))?;
    match (decode, fold_norm) {
        (true, Some(norm)) => cx.norm_gemv::<A, A>(
            &sc.residual,
            norm,
            &gate_up,
            t,
            2 * inter,
            &mut view_mut::<A>(&mut sc.normed),
            &mut view_mut::<A>(&mut ds.gate_up),
        )?,
        (true, None) => cx.gemv::<A, A>(
            &view::<A>(&sc.normed),
            &gate_up,
            t,
            2 * inter,
            h,
            false,
            &mut view_mut::<A>(&mut ds.gate_up),
        )?,
        (false, _) => cx.gemm_as(
            in_type::<A>(),
            (t, 2 * inter, h),
            cx.p(&sc.normed, 0),
            w.gate_up.ptr(cx.gpu, 0),
            cx.p(&ds.gate_up, 0),
            out16::<A>(),
            0.0,
            "MLP gate/up",
        )?,
    }
    kn.swiglu::<A>(
        s,
        &view::<A>(&ds.gate_up),
        t,
        inter,
        &mut view_mut::<A>(&mut ds.act),
    )?;
    if decode {
        cx.gemv::<A, f32>(
            &view::<A>(&ds.act),
            &down,
            t,
            h,
            inter,
            true,
            &mut sc.residual.slice_mut(..),
        )?;
    } else {
        cx.gemm_as(
            in_type::<A>(),
            (t, h, inter),
            cx.p(&ds.act, 0),
            w.down.ptr(cx.gpu, 0),
            cx.p(&sc.residual, 0),
            OutType::F32,
            1.0,
            "MLP down",
        )?;
    }
    Ok(())
}
