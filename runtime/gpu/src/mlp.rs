//! The BF16 SwiGLU MLP: a dense layer's MLP, and a MoE layer's shared
//! expert (glm4_moe; added to every token's routed output). One code path
//! for both, on the same scratch (`scratch::swiglu_width`).
//!
//! Prefill: gate/up GEMM (cuBLAS, BF16 out) → SwiGLU → down GEMM
//! accumulated into the f32 residual (beta = 1). Decode: the same through
//! the BF16 GEMV kernels, which stream the weights at HBM rate where
//! cuBLAS at M = 1 does not; a dense layer folds its RMSNorm into the
//! gate/up GEMV (`fold_norm`), while the shared expert reads the normed
//! row the router GEMV already wrote.

use crate::blas::OutType;
use crate::error::{GpuError, Result};
use crate::forward::Ctx;
use crate::scratch::Scratch;
use crate::weights::SwigluMlp;
use cudarc::driver::CudaSlice;
use half::bf16;

/// `residual[..t] += down(swiglu(gate_up(x)))` where `x` is
/// `scratch.normed[..t]`, or in decode (`decode`, `t == 1`) with
/// `fold_norm`, `rmsnorm(residual)` with that weight (the GEMV also writes
/// it to `scratch.normed`).
pub(crate) fn swiglu_mlp(
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    w: &SwigluMlp,
    t: usize,
    decode: bool,
    fold_norm: Option<&CudaSlice<bf16>>,
) -> Result<()> {
    let (s, kn, h, inter) = (&cx.gpu.stream, cx.kn, cx.g.hidden, w.inter);
    let ds = sc
        .dense
        .as_mut()
        .ok_or_else(|| GpuError::Unsupported("SwiGLU MLP without its scratch".into()))?;
    match (decode, fold_norm) {
        (true, Some(norm)) => cx.norm_gemv::<bf16>(
            &sc.residual,
            norm,
            &w.gate_up,
            2 * inter,
            &mut sc.normed,
            &mut ds.gate_up,
        )?,
        (true, None) => kn.gemv::<bf16, bf16>(
            s,
            &sc.normed,
            &w.gate_up,
            1,
            2 * inter,
            h,
            false,
            &mut ds.gate_up,
        )?,
        (false, _) => cx.gemm(
            (t, 2 * inter, h),
            cx.p(&sc.normed, 0),
            cx.p(&w.gate_up, 0),
            cx.p(&ds.gate_up, 0),
            OutType::Bf16,
            0.0,
            "MLP gate/up",
        )?,
    }
    kn.swiglu(s, &ds.gate_up, t, inter, &mut ds.act)?;
    if decode {
        kn.gemv::<bf16, f32>(s, &ds.act, &w.down, 1, h, inter, true, &mut sc.residual)?;
    } else {
        cx.gemm(
            (t, h, inter),
            cx.p(&ds.act, 0),
            cx.p(&w.down, 0),
            cx.p(&sc.residual, 0),
            OutType::F32,
            1.0,
            "MLP down",
        )?;
    }
    Ok(())
}
