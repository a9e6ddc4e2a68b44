//! BF16 weight GEMV for decode, optionally with the RMSNorm fused in front
//! (`cuda/gemv.cu`): the M = 1..8 token projections that cuBLAS runs at
//! ~2x the weight-streaming time.
//!
//! Row-major throughout: `W` is an `nn.Linear` weight `[n, k]` bf16, `x` is
//! `[m, k]` bf16, `y` is `[m, n]`. Accumulation is f32 in a fixed order
//! (bit-reproducible, no atomics); a bf16 `y` is rounded once (RNE).
//!
//! On sm_90+ both wrappers launch as programmatic dependents (PDL) of the
//! previous kernel on the stream: the kernel may start while that kernel
//! still runs and reads **only the weight `w`** before waiting for it to
//! complete; everything else (`x`, `residual`, `norm_w`, `y`) is touched
//! after. So `w` must not be written by the kernel launched right before
//! (weights never are; a copy in between is fine, as PDL applies only to a
//! kernel directly after a kernel).

use std::ffi::c_void;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::{bf16, f16};

use crate::launch::{
    Act16, Elem, allow_smem, builder, cfg, check_len, dim_u32, ensure, launch_dependent, submit,
};
use crate::{Kernels, Result};

/// Most tokens (rows of `x`) per GEMV launch.
pub const GEMV_MAX_TOKENS: usize = 8;
/// Largest `k` (input features) of the GEMVs.
pub const GEMV_MAX_K: usize = 16384;
/// Largest `m * k`: the block stages `x` as bf16 in `2 * m * k` bytes of
/// shared memory (64 KB).
pub const GEMV_MAX_MK: usize = 32768;

const THREADS: u32 = 256;
/// Resident blocks per SM the kernels are built for (`__launch_bounds__`).
const BLOCKS_PER_SM: u32 = 2;
/// Largest `k` of the 2-rows-per-warp entry points (`_r2_`).
const R2_MAX_K: usize = 2048;

const PLAIN: [[&str; 4]; 2] = [
    [
        "gemv_bf16_r2_m1",
        "gemv_bf16_r2_m2",
        "gemv_bf16_r2_m4",
        "gemv_bf16_r2_m8",
    ],
    [
        "gemv_bf16_r1_m1",
        "gemv_bf16_r1_m2",
        "gemv_bf16_r1_m4",
        "gemv_bf16_r1_m8",
    ],
];
const NORM_F16: [[&str; 4]; 2] = [
    [
        "gemv_rmsnorm_f16_r2_m1",
        "gemv_rmsnorm_f16_r2_m2",
        "gemv_rmsnorm_f16_r2_m4",
        "gemv_rmsnorm_f16_r2_m8",
    ],
    [
        "gemv_rmsnorm_f16_r1_m1",
        "gemv_rmsnorm_f16_r1_m2",
        "gemv_rmsnorm_f16_r1_m4",
        "gemv_rmsnorm_f16_r1_m8",
    ],
];
const NORM: [[&str; 4]; 2] = [
    [
        "gemv_rmsnorm_bf16_r2_m1",
        "gemv_rmsnorm_bf16_r2_m2",
        "gemv_rmsnorm_bf16_r2_m4",
        "gemv_rmsnorm_bf16_r2_m8",
    ],
    [
        "gemv_rmsnorm_bf16_r1_m1",
        "gemv_rmsnorm_bf16_r1_m2",
        "gemv_rmsnorm_bf16_r1_m4",
        "gemv_rmsnorm_bf16_r1_m8",
    ],
];

/// Entry point for (`k`, `m`): row shape by `k`, token bucket 1/2/4/8 by `m`.
fn entry(names: &[[&'static str; 4]; 2], m: usize, k: usize) -> &'static str {
    let shape = usize::from(k > R2_MAX_K);
    let bucket = match m {
        0 | 1 => 0,
        2 => 1,
        3 | 4 => 2,
        _ => 3,
    };
    names[shape][bucket]
}

/// Checks the dims shared by both GEMVs; `Ok(false)` means nothing to do.
fn check_dims<O: Elem>(
    kernel: &'static str,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) -> Result<bool> {
    ensure(kernel, m <= GEMV_MAX_TOKENS, || {
        format!("m = {m} tokens exceeds the {GEMV_MAX_TOKENS} the GEMV supports (use a GEMM)")
    })?;
    ensure(
        kernel,
        k > 0 && k.is_multiple_of(8) && k <= GEMV_MAX_K,
        || format!("k = {k} must be a positive multiple of 8, at most {GEMV_MAX_K}"),
    )?;
    ensure(kernel, m * k <= GEMV_MAX_MK, || {
        format!(
            "m * k = {m} * {k} = {} exceeds {GEMV_MAX_MK} (x is staged in 64 KB of shared memory)",
            m * k
        )
    })?;
    ensure(kernel, !(accumulate && O::SUFFIX == "bf16"), || {
        "accumulate needs an f32 output (a bf16 y would be rounded twice)".to_string()
    })?;
    dim_u32(kernel, "n", n)?;
    Ok(m > 0 && n > 0)
}

/// Fails unless the device address `ptr` of `what` is 16-byte aligned.
fn check_align(kernel: &'static str, what: &str, ptr: u64) -> Result<()> {
    ensure(kernel, ptr.is_multiple_of(16), || {
        format!(
            "buffer `{what}` starts at {ptr:#x}, not 16-byte aligned (it is read/written as 16-byte vectors; \
             a view must start at a multiple of 8 bf16 / 4 f32 elements of an aligned allocation)"
        )
    })
}

/// Fails if the byte ranges `[a, a + a_len)` and `[b, b + b_len)` overlap
/// (the output would be written while other blocks still read the input).
fn check_disjoint(
    kernel: &'static str,
    (an, a, a_len): (&str, u64, usize),
    (bn, b, b_len): (&str, u64, usize),
) -> Result<()> {
    let overlap = a < b + b_len as u64 && b < a + a_len as u64;
    ensure(kernel, !overlap, || {
        format!("buffers `{an}` and `{bn}` overlap; the output must not alias an input")
    })
}

/// Grid: `min(n, 2 * SMs)` blocks, each owning an even share of the rows.
fn launch_cfg(kernels: &Kernels, n: usize, m: usize, k: usize) -> LaunchConfig {
    let blocks = (n as u64).min(u64::from(kernels.sm_count() * BLOCKS_PER_SM)) as u32;
    cfg((blocks, 1, 1), THREADS, (2 * m * k) as u32)
}

/// Output mode argument of the kernels: 0 bf16, 1 f32, 2 f32 accumulate.
fn mode<O: Elem>(accumulate: bool) -> u32 {
    match (O::SUFFIX == "f32", accumulate) {
        (false, _) => 0,
        (true, false) => 1,
        (true, true) => 2,
    }
}

impl Kernels {
    /// `y[t, j] = (accumulate ? y[t, j] : 0) + sum_i x[t, i] * w[j, i]`
    /// for `t < m`, `j < n`, f32 accumulation, rounded once to `O`.
    ///
    /// - `x`: bf16 `[m, k]`; `w`: bf16 `[n, k]` (an `nn.Linear` weight).
    /// - `y`: bf16 or f32 `[m, n]`; `accumulate` (add into `y`, e.g. o_proj
    ///   into the f32 residual) needs `O = f32`. `y` must not overlap `x`.
    ///
    /// `m <= 8` ([`GEMV_MAX_TOKENS`]); `k` a positive multiple of 8,
    /// `<= 16384`, with `m * k <= 32768` ([`GEMV_MAX_MK`]); any `n`
    /// (`m == 0` or `n == 0` launches nothing). `x` and `w` must start
    /// 16-byte aligned. Buffers may be longer than the dims need.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_bf16<O: Elem>(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<bf16>,
        w: &impl DevicePtr<bf16>,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
        y: &mut impl DevicePtrMut<O>,
    ) -> Result<()> {
        let kn = entry(&PLAIN, m, k);
        if !check_dims::<O>(kn, m, n, k, accumulate)? {
            return Ok(());
        }
        check_len(kn, "x", x.len(), m * k)?;
        check_len(kn, "w", w.len(), n * k)?;
        check_len(kn, "y", y.len(), m * n)?;
        let f = self.func(kn)?;
        let (xp, _g1) = x.device_ptr(stream);
        let (wp, _g2) = w.device_ptr(stream);
        let (yp, _g3) = y.device_ptr_mut(stream);
        check_align(kn, "x", xp)?;
        check_align(kn, "w", wp)?;
        let osz = std::mem::size_of::<O>();
        check_disjoint(kn, ("y", yp, m * n * osz), ("x", xp, m * k * 2))?;
        let config = launch_cfg(self, n, m, k);
        allow_smem(kn, f, config.shared_mem_bytes)?;
        let (mm, nn, kk, md) = (m as u32, n as u32, k as u32, mode::<O>(accumulate));
        if self.compute_capability().0 >= 9 {
            let mut args: [*mut c_void; 7] = [
                &xp as *const u64 as *mut c_void,
                &wp as *const u64 as *mut c_void,
                &mm as *const u32 as *mut c_void,
                &nn as *const u32 as *mut c_void,
                &kk as *const u32 as *mut c_void,
                &md as *const u32 as *mut c_void,
                &yp as *const u64 as *mut c_void,
            ];
            // SAFETY: the arguments match the kernel's parameter list in
            // order and type, point to locals that outlive the call, and the
            // buffer lengths and alignments were checked against the dims.
            return unsafe { launch_dependent(kn, stream, f, config, &mut args) };
        }
        let mut b = builder(stream, f);
        b.arg(&xp)
            .arg(&wp)
            .arg(&mm)
            .arg(&nn)
            .arg(&kk)
            .arg(&md)
            .arg(&yp);
        submit(kn, b, config)
    }

    /// RMSNorm fused in front of [`Kernels::gemv_bf16`]:
    /// `normed[t, :] = bf16(residual[t, :] * rsqrt(mean(residual[t, :]^2) + eps) * norm_w)`,
    /// computed exactly as [`Kernels::rmsnorm`] computes it for an f32 input
    /// (bit-identical), written to `normed`, and
    /// `y[t, j] = (accumulate ? y[t, j] : 0) + sum_i normed[t, i] * w[j, i]`.
    ///
    /// - `residual`: f32 `[m, k]`; `norm_w`: bf16 `[k]`; `w`: bf16 `[n, k]`.
    /// - `normed`: bf16 `[m, k]`; `y`: bf16 or f32 `[m, n]`, neither
    ///   overlapping `residual` or each other.
    ///
    /// Limits and alignment as [`Kernels::gemv_bf16`] (`residual`, `norm_w`,
    /// `w` and `normed` 16-byte aligned).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_rmsnorm_bf16<O: Elem>(
        &self,
        stream: &CudaStream,
        residual: &impl DevicePtr<f32>,
        norm_w: &impl DevicePtr<bf16>,
        eps: f32,
        w: &impl DevicePtr<bf16>,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
        normed: &mut impl DevicePtrMut<bf16>,
        y: &mut impl DevicePtrMut<O>,
    ) -> Result<()> {
        let kn = entry(&NORM, m, k);
        self.gemv_rmsnorm(
            kn, stream, residual, norm_w, eps, w, m, n, k, accumulate, normed, y,
        )
    }

    /// [`Kernels::gemv_rmsnorm_bf16`] with an f16 weight, the normed row
    /// rounded to f16 (bit-identical to [`Kernels::rmsnorm_f32_to_f16`]'s
    /// output) and an f32 `y` (`gemv_rmsnorm_f16_*`): the decode QKV
    /// projection of an FP16 attention block (`Act16`), matching the
    /// prefill path's f16 x f16 GEMM with f32 accumulation.
    ///
    /// - `w`: f16 `[n, k]`; `normed`: f16 `[m, k]`; `y`: f32 `[m, n]`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_rmsnorm_f16(
        &self,
        stream: &CudaStream,
        residual: &impl DevicePtr<f32>,
        norm_w: &impl DevicePtr<bf16>,
        eps: f32,
        w: &impl DevicePtr<f16>,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
        normed: &mut impl DevicePtrMut<f16>,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let kn = entry(&NORM_F16, m, k);
        self.gemv_rmsnorm(
            kn, stream, residual, norm_w, eps, w, m, n, k, accumulate, normed, y,
        )
    }

    /// The launch of both norm GEMVs: `A` is the format of `w` and `normed`.
    #[allow(clippy::too_many_arguments)]
    fn gemv_rmsnorm<A: Act16, O: Elem>(
        &self,
        kn: &'static str,
        stream: &CudaStream,
        residual: &impl DevicePtr<f32>,
        norm_w: &impl DevicePtr<bf16>,
        eps: f32,
        w: &impl DevicePtr<A>,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
        normed: &mut impl DevicePtrMut<A>,
        y: &mut impl DevicePtrMut<O>,
    ) -> Result<()> {
        if !check_dims::<O>(kn, m, n, k, accumulate)? {
            return Ok(());
        }
        check_len(kn, "residual", residual.len(), m * k)?;
        check_len(kn, "norm_w", norm_w.len(), k)?;
        check_len(kn, "w", w.len(), n * k)?;
        check_len(kn, "normed", normed.len(), m * k)?;
        check_len(kn, "y", y.len(), m * n)?;
        let f = self.func(kn)?;
        let (rp, _g1) = residual.device_ptr(stream);
        let (gp, _g2) = norm_w.device_ptr(stream);
        let (wp, _g3) = w.device_ptr(stream);
        let (np, _g4) = normed.device_ptr_mut(stream);
        let (yp, _g5) = y.device_ptr_mut(stream);
        check_align(kn, "residual", rp)?;
        check_align(kn, "norm_w", gp)?;
        check_align(kn, "w", wp)?;
        check_align(kn, "normed", np)?;
        let ybytes = m * n * std::mem::size_of::<O>();
        check_disjoint(kn, ("y", yp, ybytes), ("residual", rp, m * k * 4))?;
        check_disjoint(kn, ("normed", np, m * k * 2), ("residual", rp, m * k * 4))?;
        check_disjoint(kn, ("y", yp, ybytes), ("normed", np, m * k * 2))?;
        let config = launch_cfg(self, n, m, k);
        allow_smem(kn, f, config.shared_mem_bytes)?;
        let (mm, nn, kk, md) = (m as u32, n as u32, k as u32, mode::<O>(accumulate));
        if self.compute_capability().0 >= 9 {
            let mut args: [*mut c_void; 10] = [
                &rp as *const u64 as *mut c_void,
                &gp as *const u64 as *mut c_void,
                &eps as *const f32 as *mut c_void,
                &wp as *const u64 as *mut c_void,
                &mm as *const u32 as *mut c_void,
                &nn as *const u32 as *mut c_void,
                &kk as *const u32 as *mut c_void,
                &md as *const u32 as *mut c_void,
                &np as *const u64 as *mut c_void,
                &yp as *const u64 as *mut c_void,
            ];
            // SAFETY: as in `gemv_bf16`.
            return unsafe { launch_dependent(kn, stream, f, config, &mut args) };
        }
        let mut b = builder(stream, f);
        b.arg(&rp)
            .arg(&gp)
            .arg(&eps)
            .arg(&wp)
            .arg(&mm)
            .arg(&nn)
            .arg(&kk)
            .arg(&md)
            .arg(&np)
            .arg(&yp);
        submit(kn, b, config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_points_by_shape_and_tokens() {
        assert_eq!(entry(&PLAIN, 1, 2048), "gemv_bf16_r2_m1");
        assert_eq!(entry(&PLAIN, 3, 8), "gemv_bf16_r2_m4");
        assert_eq!(entry(&PLAIN, 5, 2056), "gemv_bf16_r1_m8");
        assert_eq!(entry(&NORM, 2, 4096), "gemv_rmsnorm_bf16_r1_m2");
        assert_eq!(entry(&NORM_F16, 1, 2880), "gemv_rmsnorm_f16_r1_m1");
        for names in [PLAIN, NORM, NORM_F16] {
            for row in names {
                for name in row {
                    assert!(
                        crate::sources::MODULES
                            .iter()
                            .any(|m| m.kernels.contains(&name)),
                        "{name} not in sources"
                    );
                }
            }
        }
    }

    #[test]
    fn dim_checks() {
        assert!(check_dims::<f32>("k", 1, 5120, 2048, true).unwrap());
        assert!(!check_dims::<f32>("k", 0, 5120, 2048, false).unwrap());
        assert!(!check_dims::<f32>("k", 1, 0, 2048, false).unwrap());
        assert!(check_dims::<f32>("k", 9, 16, 8, false).is_err());
        assert!(check_dims::<f32>("k", 1, 16, 12, false).is_err());
        assert!(check_dims::<f32>("k", 1, 16, 0, false).is_err());
        assert!(check_dims::<f32>("k", 1, 16, 16392, false).is_err());
        assert!(check_dims::<f32>("k", 2, 16, 16384, false).is_ok());
        assert!(check_dims::<f32>("k", 3, 16, 16384, false).is_err());
        assert!(check_dims::<f32>("k", 8, 16, 4096, false).is_ok());
        assert!(check_dims::<bf16>("k", 1, 16, 8, true).is_err());
        assert!(check_align("k", "x", 0x1000).is_ok());
        assert!(check_align("k", "x", 0x1002).is_err());
        assert!(check_disjoint("k", ("a", 0, 16), ("b", 16, 16)).is_ok());
        assert!(check_disjoint("k", ("a", 0, 17), ("b", 16, 16)).is_err());
        assert!(check_disjoint("k", ("a", 20, 4), ("b", 16, 16)).is_err());
    }
}
