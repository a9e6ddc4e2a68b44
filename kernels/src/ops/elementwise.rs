//! Embedding gather, residual adds, per-column bias adds, casts and SwiGLU
//! (`cuda/elementwise.cu`).

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

use crate::launch::{
    Act16, Elem, builder, by_act, by_elem, cfg, check_len, dim_u32, ensure, submit,
};
use crate::{Kernels, Result};

const THREADS: u32 = 256;

fn blocks(n: usize, per_block: usize) -> u32 {
    n.div_ceil(per_block).clamp(1, 1 << 20) as u32
}

impl Kernels {
    /// `out[t, :] = f32(table[ids[t], :])` for `t < n_tokens`.
    ///
    /// - `table`: bf16 `[vocab, hidden]` row-major; `hidden % 8 == 0`.
    /// - `ids`: u32 `[n_tokens]`. An id `>= vocab` cannot be checked on the
    ///   host (it lives on the device): its row is written as NaN so the
    ///   error is visible instead of reading out of bounds.
    /// - `out`: f32 `[n_tokens, hidden]` (the residual stream).
    #[allow(clippy::too_many_arguments)]
    pub fn embed(
        &self,
        stream: &CudaStream,
        table: &impl DevicePtr<bf16>,
        vocab: usize,
        hidden: usize,
        ids: &impl DevicePtr<u32>,
        n_tokens: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        const K: &str = "embed_gather_bf16";
        ensure(K, hidden > 0 && hidden.is_multiple_of(8), || {
            format!("hidden = {hidden} must be a positive multiple of 8")
        })?;
        check_len(K, "table", table.len(), vocab * hidden)?;
        check_len(K, "ids", ids.len(), n_tokens)?;
        check_len(K, "out", out.len(), n_tokens * hidden)?;
        let (n, h, v) = (
            dim_u32(K, "n_tokens", n_tokens)?,
            dim_u32(K, "hidden", hidden)?,
            dim_u32(K, "vocab", vocab)?,
        );
        let f = self.func(K)?;
        let (tp, _g1) = table.device_ptr(stream);
        let (ip, _g2) = ids.device_ptr(stream);
        let (op, _g3) = out.device_ptr_mut(stream);
        let mut b = builder(stream, f);
        b.arg(&tp).arg(&ip).arg(&op).arg(&n).arg(&h).arg(&v);
        submit(K, b, cfg((n, 1, 1), THREADS, 0))
    }

    /// `acc[i] += f32(x[i])` for `i < n` (residual add; `x` bf16 or f32).
    pub fn add_into_f32<T: Elem>(
        &self,
        stream: &CudaStream,
        acc: &mut impl DevicePtrMut<f32>,
        x: &impl DevicePtr<T>,
        n: usize,
    ) -> Result<()> {
        let k = by_elem::<T>("add_f32_into_f32", "add_bf16_into_f32");
        check_len(k, "acc", acc.len(), n)?;
        check_len(k, "x", x.len(), n)?;
        let nn = dim_u32(k, "n", n)?;
        let f = self.func(k)?;
        let (xp, _g1) = x.device_ptr(stream);
        let (ap, _g2) = acc.device_ptr_mut(stream);
        let mut b = builder(stream, f);
        b.arg(&ap).arg(&xp).arg(&nn);
        submit(
            k,
            b,
            cfg((blocks(n, THREADS as usize * 4), 1, 1), THREADS, 0),
        )
    }

    /// `y[r, c] += bias[c]` in place for `r < rows`, `c < cols` (f32 sum,
    /// rounded once for bf16 `y`): e.g. an expert's down bias on its
    /// grouped prefill GEMM output before the combine.
    ///
    /// - `y`: `[rows, cols]` f32 or bf16; `bias`: f32 `[cols]`.
    pub fn add_bias_rows<T: Elem>(
        &self,
        stream: &CudaStream,
        y: &mut impl DevicePtrMut<T>,
        bias: &impl DevicePtr<f32>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        let k = by_elem::<T>("add_bias_rows_f32", "add_bias_rows_bf16");
        check_len(k, "y", y.len(), rows * cols)?;
        check_len(k, "bias", bias.len(), cols)?;
        let (r, c) = (dim_u32(k, "rows", rows)?, dim_u32(k, "cols", cols)?);
        let f = self.func(k)?;
        let (bp, _g1) = bias.device_ptr(stream);
        let (yp, _g2) = y.device_ptr_mut(stream);
        let mut b = builder(stream, f);
        b.arg(&yp).arg(&bp).arg(&r).arg(&c);
        submit(
            k,
            b,
            cfg(
                (blocks(rows * cols, THREADS as usize * 4), 1, 1),
                THREADS,
                0,
            ),
        )
    }

    /// `out[i] = bf16(x[i])` (round to nearest even) for `i < n`.
    pub fn cast_f32_to_bf16(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<bf16>,
        n: usize,
    ) -> Result<()> {
        const K: &str = "cast_f32_to_bf16";
        check_len(K, "x", x.len(), n)?;
        check_len(K, "out", out.len(), n)?;
        let nn = dim_u32(K, "n", n)?;
        let f = self.func(K)?;
        let (xp, _g1) = x.device_ptr(stream);
        let (op, _g2) = out.device_ptr_mut(stream);
        let mut b = builder(stream, f);
        b.arg(&xp).arg(&op).arg(&nn);
        submit(
            K,
            b,
            cfg((blocks(n, THREADS as usize * 4), 1, 1), THREADS, 0),
        )
    }

    /// `out[r, c] = bf16(x[r, c] + bias[c])` (f32 sum, one rounding) for
    /// `r < rows`, `c < cols`: a biased projection computed into f32 (e.g.
    /// the fused q/k/v GEMM of a family with attention biases) brought to
    /// bf16 at exactly the reference's rounding point. [`Kernels::add_bias_rows`]
    /// on the GEMM's bf16 output instead rounds twice (<= 1 bf16 ulp apart).
    ///
    /// - `x`: f32 `[rows, cols]`; `bias`: f32 `[cols]` (a bf16 checkpoint
    ///   bias widened exactly); `out`: bf16 `[rows, cols]`.
    pub fn bias_cast_f32_to_bf16(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<f32>,
        bias: &impl DevicePtr<f32>,
        rows: usize,
        cols: usize,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        self.bias_cast(stream, x, bias, rows, cols, out)
    }

    /// [`Kernels::bias_cast_f32_to_bf16`] rounding to f16
    /// (`bias_cast_f32_to_f16`): the biased q/k/v of an FP16 attention
    /// block. `out`: f16 `[rows, cols]`.
    pub fn bias_cast_f32_to_f16(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<f32>,
        bias: &impl DevicePtr<f32>,
        rows: usize,
        cols: usize,
        out: &mut impl DevicePtrMut<half::f16>,
    ) -> Result<()> {
        self.bias_cast(stream, x, bias, rows, cols, out)
    }

    fn bias_cast<A: Act16>(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<f32>,
        bias: &impl DevicePtr<f32>,
        rows: usize,
        cols: usize,
        out: &mut impl DevicePtrMut<A>,
    ) -> Result<()> {
        let kn = by_act::<A>("bias_cast_f32_to_bf16", "bias_cast_f32_to_f16");
        check_len(kn, "x", x.len(), rows * cols)?;
        check_len(kn, "bias", bias.len(), cols)?;
        check_len(kn, "out", out.len(), rows * cols)?;
        let (r, c) = (dim_u32(kn, "rows", rows)?, dim_u32(kn, "cols", cols)?);
        dim_u32(kn, "rows * cols", rows * cols)?;
        let f = self.func(kn)?;
        let (xp, _g1) = x.device_ptr(stream);
        let (bp, _g2) = bias.device_ptr(stream);
        let (op, _g3) = out.device_ptr_mut(stream);
        let mut b = builder(stream, f);
        b.arg(&xp).arg(&bp).arg(&op).arg(&r).arg(&c);
        // x: column blocks of a row; y: rows (strided past 65535).
        let gx = cols.div_ceil(THREADS as usize).clamp(1, 64) as u32;
        submit(kn, b, cfg((gx, r.clamp(1, 65535), 1), THREADS, 0))
    }

    /// SwiGLU over a fused gate/up GEMM output:
    /// `out[r, i] = A(silu(g) * u)` with `g = gate_up[r, i]`,
    /// `u = gate_up[r, inter + i]`, computed in f32 and rounded once to the
    /// MLP block's format `A` (`swiglu_bf16`, or `swiglu_f16`; past ±65504
    /// an f16 result is infinite).
    ///
    /// - `gate_up`: `A` `[rows, 2*inter]`; `out`: `A` `[rows, inter]`.
    pub fn swiglu<A: Act16>(
        &self,
        stream: &CudaStream,
        gate_up: &impl DevicePtr<A>,
        rows: usize,
        inter: usize,
        out: &mut impl DevicePtrMut<A>,
    ) -> Result<()> {
        let k = by_act::<A>("swiglu_bf16", "swiglu_f16");
        check_len(k, "gate_up", gate_up.len(), rows * 2 * inter)?;
        check_len(k, "out", out.len(), rows * inter)?;
        let (r, i) = (dim_u32(k, "rows", rows)?, dim_u32(k, "inter", inter)?);
        dim_u32(k, "rows * inter", rows * inter)?;
        let f = self.func(k)?;
        let (gp, _g1) = gate_up.device_ptr(stream);
        let (op, _g2) = out.device_ptr_mut(stream);
        let mut b = builder(stream, f);
        b.arg(&gp).arg(&op).arg(&r).arg(&i);
        submit(
            k,
            b,
            cfg(
                (blocks(rows * inter, THREADS as usize * 4), 1, 1),
                THREADS,
                0,
            ),
        )
    }
}
