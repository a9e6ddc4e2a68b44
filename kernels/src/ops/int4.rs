//! INT4 expert kernels over the expert-cache layout (`cuda/int4.cu`):
//! batched decode GEMVs through a device-side expert pointer table, and
//! dequantization to bf16 for prefill GEMMs.
//!
//! Expert format (see `runtime/cache/src/layout.rs`, format version 1):
//! `w13_q` `[2I, H]` and `w2_q` `[H, I]` nibble-packed row-major (element
//! `k` of a row in byte `k/2`, low nibble for even `k`), f16 scales
//! `w13_s` `[2I, H/128]` and `w2_s` `[H, I/128]`, value `(q - 8) * s`.
//!
//! The pointer table is a u64 `[n_table]` device array of expert-block base
//! addresses (e.g. one entry per expert of a layer, pointing into the cache
//! or a staging buffer); kernels read `table[ids[p]]`, so moving experts
//! only rewrites table entries, never the launch. Bases must be 16-byte
//! aligned (the cache aligns them to 4096). An id `>= n_table` or a
//! misaligned base makes that pair's output NaN rather than reading
//! arbitrary memory.

use std::ffi::c_void;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

use crate::launch::{
    builder, cfg, check_len, dim_u32, ensure, launch_dependent, shape_err, submit,
};
use crate::{Kernels, Result};

const GROUP: usize = 128;

/// Largest hidden size of the INT4 decode GEMVs.
pub const INT4_DECODE_MAX_HIDDEN: usize = 4096;
/// Largest expert FFN width of the INT4 decode GEMVs.
pub const INT4_DECODE_MAX_INTER: usize = 2048;
/// Largest top-k of [`Kernels::int4_w2_combine`].
pub const INT4_DECODE_MAX_TOPK: usize = 16;

/// Byte offsets of the four arrays inside one expert block, plus the
/// matrix dims. Mirrors `krasis_cache::layout::ExpertLayout` (format v1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Int4Layout {
    pub hidden: usize,
    pub intermediate: usize,
    pub w13_q: usize,
    pub w13_s: usize,
    pub w2_q: usize,
    pub w2_s: usize,
}

impl Int4Layout {
    /// The format-v1 layout: arrays back to back, each 256-byte aligned.
    /// `None` unless both dims are positive multiples of 128.
    pub fn new(hidden: usize, intermediate: usize) -> Option<Self> {
        let (h, i) = (hidden, intermediate);
        if h == 0 || i == 0 || h % GROUP != 0 || i % GROUP != 0 {
            return None;
        }
        let align = |x: usize| x.div_ceil(256) * 256;
        let w13_q = 0;
        let w13_s = align(w13_q + i * h);
        let w2_q = align(w13_s + 2 * i * (h / GROUP) * 2);
        let w2_s = align(w2_q + h * i / 2);
        Some(Int4Layout {
            hidden: h,
            intermediate: i,
            w13_q,
            w13_s,
            w2_q,
            w2_s,
        })
    }

    /// Bytes the four arrays span from the block start.
    pub fn used_bytes(&self) -> usize {
        self.w2_s + self.hidden * (self.intermediate / GROUP) * 2
    }

    fn validate(&self, k: &'static str) -> Result<()> {
        let (h, i) = (self.hidden, self.intermediate);
        ensure(
            k,
            h > 0 && i > 0 && h % GROUP == 0 && i % GROUP == 0,
            || format!("hidden = {h} and intermediate = {i} must be positive multiples of 128"),
        )?;
        for (name, off) in [
            ("w13_q", self.w13_q),
            ("w13_s", self.w13_s),
            ("w2_q", self.w2_q),
            ("w2_s", self.w2_s),
        ] {
            if off % 16 != 0 {
                return Err(shape_err(
                    k,
                    format!("offset {name} = {off} is not 16-byte aligned"),
                ));
            }
        }
        if self.w13_s < self.w13_q + i * h
            || self.w2_q < self.w13_s + 2 * i * (h / GROUP) * 2
            || self.w2_s < self.w2_q + h * i / 2
        {
            return Err(shape_err(k, format!("arrays of {self:?} overlap")));
        }
        Ok(())
    }
}

impl Kernels {
    /// Decode gate/up GEMV with SwiGLU fused:
    /// for pair `p = t*top_k + j`, expert `e = table[ids[p]]`,
    /// `act[p, i] = silu(g) * u` with `g = W13_e[i, :] · x[t, :]`,
    /// `u = W13_e[I + i, :] · x[t, :]`, all f32.
    ///
    /// - `x`: bf16 `[n_tokens, H]` (normalized hidden state).
    /// - `table`: u64 `[n_table]`; `ids`: u32 `[n_tokens*top_k]`.
    /// - `slot_mask`: pair `p` is computed only if bit `j = p % top_k` is
    ///   set. A masked-out pair reads neither `ids[p]` nor its table entry
    ///   (which may be null or garbage) and leaves its `act` row untouched.
    ///   `u32::MAX` computes every pair.
    /// - `act`: f32 `[n_tokens*top_k, I]`.
    ///
    /// `H <= 4096` (Qwen3-30B-A3B: 2048, Qwen3-235B-A22B: 4096),
    /// `top_k <= 16`.
    #[allow(clippy::too_many_arguments)]
    pub fn int4_w13_swiglu(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<bf16>,
        table: &impl DevicePtr<u64>,
        ids: &impl DevicePtr<u32>,
        n_tokens: usize,
        top_k: usize,
        layout: &Int4Layout,
        slot_mask: u32,
        act: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        const NAMES: [&str; 4] = [
            "int4_w13_swiglu_1",
            "int4_w13_swiglu_2",
            "int4_w13_swiglu_3",
            "int4_w13_swiglu_4",
        ];
        let k0 = NAMES[0];
        layout.validate(k0)?;
        let (h, i) = (layout.hidden, layout.intermediate);
        ensure(k0, h <= INT4_DECODE_MAX_HIDDEN, || {
            format!(
                "hidden = {h} exceeds the 4096 the INT4 decode GEMV supports (dequantize + GEMM instead)"
            )
        })?;
        ensure(k0, (1..=INT4_DECODE_MAX_TOPK).contains(&top_k), || {
            format!("top_k = {top_k} must be in 1..=16")
        })?;
        // NCL = 128-groups of K per warp; <= 8 warps split K.
        let ncl = h.div_ceil(1024);
        let k = NAMES[ncl - 1];
        let warps = (h / GROUP).div_ceil(ncl) as u32;
        let n_pairs = n_tokens * top_k;
        check_len(k, "x", x.len(), n_tokens * h)?;
        check_len(k, "ids", ids.len(), n_pairs)?;
        check_len(k, "act", act.len(), n_pairs * i)?;
        let n_table = dim_u32(k, "n_table", table.len())?;
        let (np, kk, hh, ii) = (
            dim_u32(k, "n_pairs", n_pairs)?,
            top_k as u32,
            h as u32,
            i as u32,
        );
        let (oq, os) = (layout.w13_q as u64, layout.w13_s as u64);
        let (xp, _g1) = x.device_ptr(stream);
        let (tp, _g2) = table.device_ptr(stream);
        let (ip, _g3) = ids.device_ptr(stream);
        let (ap, _g4) = act.device_ptr_mut(stream);
        let f = self.func(k)?;
        let mut b = builder(stream, f);
        b.arg(&xp).arg(&tp).arg(&n_table).arg(&ip).arg(&np).arg(&kk);
        b.arg(&hh)
            .arg(&ii)
            .arg(&oq)
            .arg(&os)
            .arg(&slot_mask)
            .arg(&ap);
        // 16 gate + 16 up rows per block, K split over the warps; y = pair.
        submit(k, b, cfg((ii / 16, np, 1), 32 * warps, 0))
    }

    /// Decode down GEMV fused with the weighted combine:
    /// `residual[t, n] += sum_j weights[p] * (W2_e[n, :] · act[p, :])`,
    /// `p = t*top_k + j`, `e = table[ids[p]]`; the sum over `j` is taken in
    /// f32 in `j` order and added once (deterministic).
    ///
    /// - `act`: f32 `[n_tokens*top_k, I]` (from [`Kernels::int4_w13_swiglu`]).
    /// - `weights`: f32 `[n_tokens*top_k]` router weights.
    /// - `residual`: f32 `[n_tokens, H]`.
    ///
    /// `I <= 2048`, `top_k <= 16`. The block stages the token's `act` rows
    /// in `top_k * I * 4.5` bytes of shared memory (27 KB for top-8, I 768);
    /// past 44 KB it opts in to more (fine on sm_80/sm_90, up to 147 KB).
    ///
    /// On sm_90+ this launches as a programmatic dependent of the previous
    /// kernel on `stream` (normally [`Kernels::int4_w13_swiglu`]): it may
    /// start while that kernel still runs and reads `ids`, `table`,
    /// `weights` and the expert weights at once, but `act` and `residual`
    /// only after that kernel has completed. So `ids`, `table`, `weights`
    /// and the experts must not be written by the kernel launched right
    /// before this one (a copy in between is fine: PDL applies only to a
    /// kernel directly after a kernel).
    #[allow(clippy::too_many_arguments)]
    pub fn int4_w2_combine(
        &self,
        stream: &CudaStream,
        act: &impl DevicePtr<f32>,
        table: &impl DevicePtr<u64>,
        ids: &impl DevicePtr<u32>,
        weights: &impl DevicePtr<f32>,
        n_tokens: usize,
        top_k: usize,
        layout: &Int4Layout,
        residual: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        const NAMES: [&str; 2] = ["int4_w2_combine_1", "int4_w2_combine_2"];
        // Groups per work item and most warps per block of each entry point.
        const GPW: [usize; 2] = [2, 4];
        const MAX_WARPS: [usize; 2] = [24, 16];
        let k0 = NAMES[0];
        layout.validate(k0)?;
        let (h, i) = (layout.hidden, layout.intermediate);
        ensure(k0, i <= INT4_DECODE_MAX_INTER, || {
            format!(
                "intermediate = {i} exceeds the 2048 the INT4 decode GEMV supports (dequantize + GEMM instead)"
            )
        })?;
        ensure(k0, (1..=INT4_DECODE_MAX_TOPK).contains(&top_k), || {
            format!("top_k = {top_k} must be in 1..=16")
        })?;
        let v = i.div_ceil(1024) - 1;
        let k = NAMES[v];
        let items = top_k * (i / GROUP).div_ceil(GPW[v]);
        let warps = items.min(MAX_WARPS[v]) as u32;
        let smem = top_k * (i / GROUP) * 4 * 36 * 4;
        let n_pairs = n_tokens * top_k;
        check_len(k, "act", act.len(), n_pairs * i)?;
        check_len(k, "ids", ids.len(), n_pairs)?;
        check_len(k, "weights", weights.len(), n_pairs)?;
        check_len(k, "residual", residual.len(), n_tokens * h)?;
        let n_table = dim_u32(k, "n_table", table.len())?;
        let (t, kk, hh, ii) = (
            dim_u32(k, "n_tokens", n_tokens)?,
            top_k as u32,
            h as u32,
            i as u32,
        );
        let (oq, os) = (layout.w2_q as u64, layout.w2_s as u64);
        let f = self.func(k)?;
        if smem > 44 * 1024 {
            use cudarc::driver::sys::CUfunction_attribute_enum as A;
            f.set_attribute(
                A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(crate::KernelError::driver(format!(
                "`{k}`: {smem} bytes of shared memory"
            )))?;
        }
        let (ap, _g1) = act.device_ptr(stream);
        let (tp, _g2) = table.device_ptr(stream);
        let (ip, _g3) = ids.device_ptr(stream);
        let (wp, _g4) = weights.device_ptr(stream);
        let (rp, _g5) = residual.device_ptr_mut(stream);
        // 16 output rows x all top_k experts per block; y = token.
        let config = cfg((hh / 16, t, 1), 32 * warps, smem as u32);
        if self.compute_capability().0 >= 9 {
            let mut args: [*mut c_void; 12] = [
                &ap as *const u64 as *mut c_void,
                &tp as *const u64 as *mut c_void,
                &n_table as *const u32 as *mut c_void,
                &ip as *const u64 as *mut c_void,
                &wp as *const u64 as *mut c_void,
                &t as *const u32 as *mut c_void,
                &kk as *const u32 as *mut c_void,
                &hh as *const u32 as *mut c_void,
                &ii as *const u32 as *mut c_void,
                &oq as *const u64 as *mut c_void,
                &os as *const u64 as *mut c_void,
                &rp as *const u64 as *mut c_void,
            ];
            // SAFETY: the arguments match the kernel's parameter list in
            // order and type, point to locals that outlive the call, and
            // the buffer lengths were checked against the dims above.
            return unsafe { launch_dependent(k, stream, f, config, &mut args) };
        }
        let mut b = builder(stream, f);
        b.arg(&ap)
            .arg(&tp)
            .arg(&n_table)
            .arg(&ip)
            .arg(&wp)
            .arg(&t)
            .arg(&kk);
        b.arg(&hh).arg(&ii).arg(&oq).arg(&os).arg(&rp);
        submit(k, b, config)
    }

    /// Dequantize `n` experts (`table[ids[x]]`, `x < n`) to bf16:
    /// `w13_out[x]` = `[2I, H]`, `w2_out[x]` = `[H, I]`, both row-major
    /// (`(q - 8) * s` is exact in f32 and rounded once to bf16).
    ///
    /// - `ids`: u32 `[n]`; `w13_out`: bf16 `[n, 2I, H]`; `w2_out`: bf16 `[n, H, I]`.
    #[allow(clippy::too_many_arguments)]
    pub fn int4_dequant(
        &self,
        stream: &CudaStream,
        table: &impl DevicePtr<u64>,
        ids: &impl DevicePtr<u32>,
        n: usize,
        layout: &Int4Layout,
        w13_out: &mut impl DevicePtrMut<bf16>,
        w2_out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        const K: &str = "int4_dequant_bf16";
        layout.validate(K)?;
        let (h, i) = (layout.hidden, layout.intermediate);
        check_len(K, "ids", ids.len(), n)?;
        check_len(K, "w13_out", w13_out.len(), n * 2 * i * h)?;
        check_len(K, "w2_out", w2_out.len(), n * h * i)?;
        ensure(K, n <= 65535, || {
            format!("n = {n} experts exceeds 65535 per launch")
        })?;
        let n_table = dim_u32(K, "n_table", table.len())?;
        let chunks = 3 * i * h / 32;
        let (hh, ii, nn) = (h as u32, i as u32, n as u32);
        let offs = [
            layout.w13_q as u64,
            layout.w13_s as u64,
            layout.w2_q as u64,
            layout.w2_s as u64,
        ];
        let (tp, _g1) = table.device_ptr(stream);
        let (ip, _g2) = ids.device_ptr(stream);
        let (ap, _g3) = w13_out.device_ptr_mut(stream);
        let (bp, _g4) = w2_out.device_ptr_mut(stream);
        let f = self.func(K)?;
        let mut b = builder(stream, f);
        b.arg(&tp).arg(&n_table).arg(&ip).arg(&nn).arg(&hh).arg(&ii);
        b.arg(&offs[0])
            .arg(&offs[1])
            .arg(&offs[2])
            .arg(&offs[3])
            .arg(&ap)
            .arg(&bp);
        submit(
            K,
            b,
            cfg((dim_u32(K, "blocks", chunks.div_ceil(256))?, nn, 1), 256, 0),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_validation_refuses_bad_offsets() {
        let l = Int4Layout::new(2048, 768).unwrap();
        assert!(l.validate("t").is_ok());
        assert!(
            Int4Layout {
                w2_q: l.w2_q + 8,
                ..l
            }
            .validate("t")
            .is_err(),
            "misaligned"
        );
        assert!(
            Int4Layout { w13_s: 16, ..l }.validate("t").is_err(),
            "overlap"
        );
        assert!(
            Int4Layout { hidden: 2000, ..l }.validate("t").is_err(),
            "not a multiple of 128"
        );
    }
}
