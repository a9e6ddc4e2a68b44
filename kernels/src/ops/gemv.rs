//! 16-bit weight GEMV for decode, optionally with the RMSNorm fused in
//! front (`cuda/gemv.cu`): the M = 1..8 token projections that cuBLAS runs
//! at ~2x the weight-streaming time.
//!
//! Row-major throughout: `W` is an `nn.Linear` weight `[n, k]`, `x` is
//! `[m, k]`, both in one 16-bit format `A` (`Act16`: bf16, or f16 for an
//! FP16 attention or MLP block, the `_f16` entry points), `y` is `[m, n]`
//! f32 or `A`. Accumulation is f32 in a fixed order (bit-reproducible, no
//! atomics); a 16-bit `y` is rounded once (RNE).
//!
//! On sm_90+ both wrappers launch as programmatic dependents (PDL) of the
//! previous kernel on the stream: the kernel may start while that kernel
//! still runs and reads **only the weight `w`** before waiting for it to
//! complete; everything else (`x`, `residual`, `norm_w`, `y`) is touched
//! after. So `w` must not be written by the kernel launched right before
//! (weights never are; a copy in between is fine, as PDL applies only to a
//! kernel directly after a kernel).

use std::ffi::c_void;

use cudarc::driver::{
    CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use half::bf16;

use crate::launch::{Act16, builder, cfg, check_len, dim_u32, ensure, launch_dependent, submit};

/// The output element types of a GEMV whose weight and input are in `A`:
/// f32, or `A` itself (rounded once).
pub trait GemvOut<A: Act16>: DeviceRepr + Copy + 'static {
    /// f32 (the kernels' modes 1 and 2), else 16-bit (mode 0).
    const WIDE: bool;
}

impl<A: Act16> GemvOut<A> for f32 {
    const WIDE: bool = true;
}
impl<A: Act16> GemvOut<A> for A {
    const WIDE: bool = false;
}
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
const PLAIN_F16: [[&str; 4]; 2] = [
    [
        "gemv_f16_r2_m1",
        "gemv_f16_r2_m2",
        "gemv_f16_r2_m4",
        "gemv_f16_r2_m8",
    ],
    [
        "gemv_f16_r1_m1",
        "gemv_f16_r1_m2",
        "gemv_f16_r1_m4",
        "gemv_f16_r1_m8",
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

/// The tensor-core form's entry points (`cuda/gemv_tc.cu`), by token bucket.
const NORM_TC: [&str; 4] = [
    "gemv_tc_rmsnorm_bf16_m1",
    "gemv_tc_rmsnorm_bf16_m2",
    "gemv_tc_rmsnorm_bf16_m4",
    "gemv_tc_rmsnorm_bf16_m8",
];
/// Padding of a staged `x` row in the tensor-core form, in bytes.
const TC_ROW_PAD_BYTES: usize = 64;

/// Token bucket 1/2/4/8 of `m` rows.
fn bucket(m: usize) -> usize {
    match m {
        0 | 1 => 0,
        2 => 1,
        3 | 4 => 2,
        _ => 3,
    }
}

/// Entry point for (`k`, `m`): row shape by `k`, token bucket 1/2/4/8 by `m`.
fn entry(names: &[[&'static str; 4]; 2], m: usize, k: usize) -> &'static str {
    names[usize::from(k > R2_MAX_K)][bucket(m)]
}

/// How a GEMV computes its dot products. Both forms are row invariant (a
/// row's bits do not depend on which rows run beside it), but they round
/// differently, so a call site keeps one form for every row count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemvForm {
    /// `cuda/gemv.cu`: FMAs on the CUDA cores. Fastest at one row; its
    /// work per weight byte grows with the rows.
    CudaCores,
    /// `cuda/gemv_tc.cu`: `mma.sync` over all 8 row slots at once, the same
    /// work for 1 and 8 rows; ~1 us slower at one row, so only for long
    /// weight streams (the LM head). BF16, with the RMSNorm fused, only.
    TensorCores,
}

/// Checks the dims shared by both GEMVs (`wide`: an f32 output);
/// `Ok(false)` means nothing to do.
fn check_dims(
    kernel: &'static str,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
    wide: bool,
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
    ensure(kernel, !accumulate || wide, || {
        "accumulate needs an f32 output (a 16-bit y would be rounded twice)".to_string()
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

/// Grid: `min(n, 2 * SMs)` blocks, each owning an even share of the rows;
/// `smem` bytes of staged `x`.
fn launch_cfg(kernels: &Kernels, n: usize, smem: usize) -> LaunchConfig {
    let blocks = (n as u64).min(u64::from(kernels.sm_count() * BLOCKS_PER_SM)) as u32;
    cfg((blocks, 1, 1), THREADS, smem as u32)
}

/// Output mode argument of the kernels: 0 16-bit, 1 f32, 2 f32 accumulate.
fn mode(wide: bool, accumulate: bool) -> u32 {
    match (wide, accumulate) {
        (false, _) => 0,
        (true, false) => 1,
        (true, true) => 2,
    }
}

impl Kernels {
    /// `y[t, j] = (accumulate ? y[t, j] : 0) + sum_i x[t, i] * w[j, i]`
    /// for `t < m`, `j < n`, f32 accumulation, rounded once to `O`
    /// (`gemv_bf16_*`, or `gemv_f16_*` for `A = f16`).
    ///
    /// - `x`: `A` `[m, k]`; `w`: `A` `[n, k]` (an `nn.Linear` weight).
    /// - `y`: f32 or `A` `[m, n]`; `accumulate` (add into `y`, e.g. o_proj
    ///   into the f32 residual) needs `O = f32`. `y` must not overlap `x`.
    ///
    /// `m <= 8` ([`GEMV_MAX_TOKENS`]); `k` a positive multiple of 8,
    /// `<= 16384`, with `m * k <= 32768` ([`GEMV_MAX_MK`]); any `n`
    /// (`m == 0` or `n == 0` launches nothing). `x` and `w` must start
    /// 16-byte aligned. Buffers may be longer than the dims need.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv<A: Act16, O: GemvOut<A>>(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<A>,
        w: &impl DevicePtr<A>,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
        y: &mut impl DevicePtrMut<O>,
    ) -> Result<()> {
        let kn = entry(if A::F16 { &PLAIN_F16 } else { &PLAIN }, m, k);
        if !check_dims(kn, m, n, k, accumulate, O::WIDE)? {
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
        let config = launch_cfg(self, n, 2 * m * k);
        self.allow_smem(kn, f, config.shared_mem_bytes)?;
        let (mm, nn, kk, md) = (m as u32, n as u32, k as u32, mode(O::WIDE, accumulate));
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

    /// RMSNorm fused in front of [`Kernels::gemv`]:
    /// `normed[t, :] = A(residual[t, :] * rsqrt(mean(residual[t, :]^2) + eps) * norm_w)`,
    /// computed exactly as [`Kernels::rmsnorm`] (bf16) and
    /// [`Kernels::rmsnorm_f32_to_f16`] (f16) compute it for an f32 input
    /// (bit-identical), written to `normed`, and
    /// `y[t, j] = (accumulate ? y[t, j] : 0) + sum_i normed[t, i] * w[j, i]`
    /// (`gemv_rmsnorm_bf16_*`, or `gemv_rmsnorm_f16_*` for `A = f16`: the
    /// decode QKV projection of an FP16 attention block, the router and
    /// dense gate/up of an FP16 MLP block, matching their prefill paths'
    /// norm + f16 GEMM with f32 accumulation).
    ///
    /// - `residual`: f32 `[m, k]`; `norm_w`: bf16 `[k]`; `w`: `A` `[n, k]`.
    /// - `normed`: `A` `[m, k]`; `y`: f32 or `A` `[m, n]`, neither
    ///   overlapping `residual` or each other.
    ///
    /// Limits and alignment as [`Kernels::gemv`] (`residual`, `norm_w`,
    /// `w` and `normed` 16-byte aligned).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_rmsnorm<A: Act16, O: GemvOut<A>>(
        &self,
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
        self.gemv_rmsnorm_form(
            stream,
            residual,
            norm_w,
            eps,
            w,
            m,
            n,
            k,
            accumulate,
            GemvForm::CudaCores,
            normed,
            y,
        )
    }

    /// [`Kernels::gemv_rmsnorm`] in the given [`GemvForm`]. The same
    /// `normed` bits either way; `y` rounds differently between the forms
    /// (each row invariant), so a call site keeps one form. The tensor-core
    /// form takes bf16 only.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_rmsnorm_form<A: Act16, O: GemvOut<A>>(
        &self,
        stream: &CudaStream,
        residual: &impl DevicePtr<f32>,
        norm_w: &impl DevicePtr<bf16>,
        eps: f32,
        w: &impl DevicePtr<A>,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
        form: GemvForm,
        normed: &mut impl DevicePtrMut<A>,
        y: &mut impl DevicePtrMut<O>,
    ) -> Result<()> {
        let (kn, smem) = match form {
            GemvForm::CudaCores => (
                entry(if A::F16 { &NORM_F16 } else { &NORM }, m, k),
                2 * m * k,
            ),
            GemvForm::TensorCores => {
                let kn = NORM_TC[bucket(m)];
                ensure(kn, !A::F16, || {
                    "the tensor-core GEMV has bf16 entry points only; use GemvForm::CudaCores for f16"
                        .to_string()
                })?;
                (kn, m * (2 * k + TC_ROW_PAD_BYTES))
            }
        };
        if !check_dims(kn, m, n, k, accumulate, O::WIDE)? {
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
        let config = launch_cfg(self, n, smem);
        self.allow_smem(kn, f, config.shared_mem_bytes)?;
        let (mm, nn, kk, md) = (m as u32, n as u32, k as u32, mode(O::WIDE, accumulate));
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
            // SAFETY: as in `gemv`.
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
        assert_eq!(entry(&PLAIN_F16, 1, 1408), "gemv_f16_r2_m1");
        assert_eq!(NORM_TC[bucket(1)], "gemv_tc_rmsnorm_bf16_m1");
        assert_eq!(NORM_TC[bucket(3)], "gemv_tc_rmsnorm_bf16_m4");
        assert_eq!(NORM_TC[bucket(8)], "gemv_tc_rmsnorm_bf16_m8");
        for names in [PLAIN, NORM, NORM_F16, PLAIN_F16, [NORM_TC, NORM_TC]] {
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
        assert!(check_dims("k", 1, 5120, 2048, true, true).unwrap());
        assert!(!check_dims("k", 0, 5120, 2048, false, true).unwrap());
        assert!(!check_dims("k", 1, 0, 2048, false, true).unwrap());
        assert!(check_dims("k", 9, 16, 8, false, true).is_err());
        assert!(check_dims("k", 1, 16, 12, false, true).is_err());
        assert!(check_dims("k", 1, 16, 0, false, true).is_err());
        assert!(check_dims("k", 1, 16, 16392, false, true).is_err());
        assert!(check_dims("k", 2, 16, 16384, false, true).is_ok());
        assert!(check_dims("k", 3, 16, 16384, false, true).is_err());
        assert!(check_dims("k", 8, 16, 4096, false, true).is_ok());
        assert!(check_dims("k", 1, 16, 8, true, false).is_err());
        assert!(check_align("k", "x", 0x1000).is_ok());
        assert!(check_align("k", "x", 0x1002).is_err());
        assert!(check_disjoint("k", ("a", 0, 16), ("b", 16, 16)).is_ok());
        assert!(check_disjoint("k", ("a", 0, 17), ("b", 16, 16)).is_err());
        assert!(check_disjoint("k", ("a", 20, 4), ("b", 16, 16)).is_err());
    }
}
