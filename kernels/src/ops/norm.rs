//! RMSNorm, optionally fused with the residual add (`cuda/norm.cu`).
//!
//! Precision policy: the residual stream is f32; the sum of squares, the
//! scale and the weight multiply are f32; the normalized output is rounded
//! to bf16 once (HF rounds twice: after normalizing and after the weight).

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

use crate::launch::{Elem, builder, by_elem, cfg, check_len, dim_u32, ensure, submit};
use crate::{Kernels, Result};

const THREADS: u32 = 256;

fn check_hidden(k: &'static str, hidden: usize) -> Result<()> {
    ensure(
        k,
        hidden > 0 && hidden.is_multiple_of(4) && hidden <= 65536,
        || format!("hidden = {hidden} must be a positive multiple of 4, at most 65536"),
    )
}

impl Kernels {
    /// `out[r, :] = bf16(x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w)`.
    ///
    /// - `x`: f32 (residual stream) or bf16 `[rows, hidden]`.
    /// - `weight`: bf16 `[hidden]`; `out`: bf16 `[rows, hidden]`.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm<T: Elem>(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<T>,
        weight: &impl DevicePtr<bf16>,
        rows: usize,
        hidden: usize,
        eps: f32,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        let k = by_elem::<T>("rmsnorm_f32", "rmsnorm_bf16");
        check_hidden(k, hidden)?;
        check_len(k, "x", x.len(), rows * hidden)?;
        check_len(k, "weight", weight.len(), hidden)?;
        check_len(k, "out", out.len(), rows * hidden)?;
        let (r, h) = (dim_u32(k, "rows", rows)?, dim_u32(k, "hidden", hidden)?);
        let f = self.func(k)?;
        let (xp, _g1) = x.device_ptr(stream);
        let (wp, _g2) = weight.device_ptr(stream);
        let (op, _g3) = out.device_ptr_mut(stream);
        let mut b = builder(stream, f);
        b.arg(&xp).arg(&wp).arg(&op).arg(&r).arg(&h).arg(&eps);
        submit(k, b, cfg((r, 1, 1), THREADS, 0))
    }

    /// [`Kernels::rmsnorm`] of an f32 `x` with the output rounded once to
    /// f16 (`rmsnorm_f32_to_f16`): the QKV projection input of an FP16
    /// attention block (`Act16`). The same arithmetic, so the f32 value
    /// before the rounding is bit-identical to the bf16 kernel's.
    ///
    /// - `x`: f32 `[rows, hidden]`; `weight`: bf16 `[hidden]`; `out`: f16
    ///   `[rows, hidden]`.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_f32_to_f16(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<f32>,
        weight: &impl DevicePtr<bf16>,
        rows: usize,
        hidden: usize,
        eps: f32,
        out: &mut impl DevicePtrMut<half::f16>,
    ) -> Result<()> {
        const K: &str = "rmsnorm_f32_to_f16";
        check_hidden(K, hidden)?;
        check_len(K, "x", x.len(), rows * hidden)?;
        check_len(K, "weight", weight.len(), hidden)?;
        check_len(K, "out", out.len(), rows * hidden)?;
        let (r, h) = (dim_u32(K, "rows", rows)?, dim_u32(K, "hidden", hidden)?);
        let f = self.func(K)?;
        let (xp, _g1) = x.device_ptr(stream);
        let (wp, _g2) = weight.device_ptr(stream);
        let (op, _g3) = out.device_ptr_mut(stream);
        let mut b = builder(stream, f);
        b.arg(&xp).arg(&wp).arg(&op).arg(&r).arg(&h).arg(&eps);
        submit(K, b, cfg((r, 1, 1), THREADS, 0))
    }

    /// Fused residual add + RMSNorm:
    /// `residual[r, :] += f32(delta[r, :])`, then
    /// `out[r, :] = rmsnorm(residual[r, :]) * w` as in [`Kernels::rmsnorm`].
    ///
    /// - `residual`: f32 `[rows, hidden]`, updated in place.
    /// - `delta`: bf16 or f32 `[rows, hidden]` (e.g. the o_proj output).
    #[allow(clippy::too_many_arguments)]
    pub fn add_rmsnorm<T: Elem>(
        &self,
        stream: &CudaStream,
        residual: &mut impl DevicePtrMut<f32>,
        delta: &impl DevicePtr<T>,
        weight: &impl DevicePtr<bf16>,
        rows: usize,
        hidden: usize,
        eps: f32,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        let k = by_elem::<T>("add_rmsnorm_f32", "add_rmsnorm_bf16");
        check_hidden(k, hidden)?;
        check_len(k, "residual", residual.len(), rows * hidden)?;
        check_len(k, "delta", delta.len(), rows * hidden)?;
        check_len(k, "weight", weight.len(), hidden)?;
        check_len(k, "out", out.len(), rows * hidden)?;
        let (r, h) = (dim_u32(k, "rows", rows)?, dim_u32(k, "hidden", hidden)?);
        let f = self.func(k)?;
        let (dp, _g1) = delta.device_ptr(stream);
        let (wp, _g2) = weight.device_ptr(stream);
        let (rp, _g3) = residual.device_ptr_mut(stream);
        let (op, _g4) = out.device_ptr_mut(stream);
        let mut b = builder(stream, f);
        b.arg(&rp)
            .arg(&dp)
            .arg(&wp)
            .arg(&op)
            .arg(&r)
            .arg(&h)
            .arg(&eps);
        submit(k, b, cfg((r, 1, 1), THREADS, 0))
    }
}
