//! Shared plumbing for the launch wrappers: element-type dispatch, length
//! checks and launch submission.

use std::ffi::c_void;
use std::marker::PhantomData;

use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, LaunchArgs, LaunchConfig, sys};
use half::bf16;

use crate::error::{KernelError, Result};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// Element types a kernel family is instantiated for (f32 or bf16). The
/// wrapper picks the `<name>_<SUFFIX>` entry point.
pub trait Elem: DeviceRepr + Copy + sealed::Sealed + 'static {
    const SUFFIX: &'static str;
    fn to_f32(self) -> f32;
}

impl Elem for f32 {
    const SUFFIX: &'static str = "f32";
    fn to_f32(self) -> f32 {
        self
    }
}

impl Elem for bf16 {
    const SUFFIX: &'static str = "bf16";
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// The 16-bit formats a block stores its activations in
/// (`krasis_model::arch::ActFormat`: the attention's and the MLP block's):
/// bf16, or f16 (IEEE half). The attention, RoPE-table, KV-append, GEMV,
/// SwiGLU, INT4 expert and row-gather wrappers are generic over it and pick
/// the `_f16` entry point for f16 (the kernels are one template over the
/// format, `ActBf16`/`ActF16` in `cuda/common.cuh`), or one entry point
/// where they only copy 16-bit patterns.
pub trait Act16: DeviceRepr + Copy + Default + std::fmt::Debug + sealed::Sealed + 'static {
    /// `true` for f16.
    const F16: bool;
    /// Round to nearest even, as the kernels' `cvt.rn` (out of range: ±inf).
    fn from_f32(x: f32) -> Self;
    fn from_f64(x: f64) -> Self;
    fn to_f32(self) -> f32;
    fn to_f64(self) -> f64;
}

impl Act16 for bf16 {
    const F16: bool = false;
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn from_f64(x: f64) -> Self {
        bf16::from_f64(x)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
}

impl Act16 for half::f16 {
    const F16: bool = true;
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
    fn from_f64(x: f64) -> Self {
        half::f16::from_f64(x)
    }
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    fn to_f64(self) -> f64 {
        half::f16::to_f64(self)
    }
}

/// Pick `bf16_name` or `f16_name` by activation format.
pub(crate) fn by_act<A: Act16>(bf16_name: &'static str, f16_name: &'static str) -> &'static str {
    if A::F16 { f16_name } else { bf16_name }
}

/// Pick `f32_name` or `bf16_name` by element type.
pub(crate) fn by_elem<T: Elem>(f32_name: &'static str, bf16_name: &'static str) -> &'static str {
    if T::SUFFIX == "f32" {
        f32_name
    } else {
        bf16_name
    }
}

pub(crate) fn shape_err(kernel: &'static str, message: impl Into<String>) -> KernelError {
    KernelError::Shape {
        kernel,
        message: message.into(),
    }
}

/// Fails unless `have >= need` elements.
pub(crate) fn check_len(kernel: &'static str, what: &str, have: usize, need: usize) -> Result<()> {
    if have < need {
        return Err(shape_err(
            kernel,
            format!("buffer `{what}` holds {have} elements but the dims need {need}"),
        ));
    }
    Ok(())
}

/// Fails unless `cond`, with `message`.
pub(crate) fn ensure(
    kernel: &'static str,
    cond: bool,
    message: impl FnOnce() -> String,
) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(shape_err(kernel, message()))
    }
}

/// Converts a host dimension to the u32 the kernels take.
pub(crate) fn dim_u32(kernel: &'static str, what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| shape_err(kernel, format!("{what} = {v} exceeds u32")))
}

pub(crate) fn cfg(grid: (u32, u32, u32), block: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    }
}

/// Start a launch of `f` on `stream`.
pub(crate) fn builder<'a>(stream: &'a CudaStream, f: &'a CudaFunction) -> LaunchArgs<'a> {
    stream.launch_builder(f)
}

/// Submit a launch built by [`builder`].
pub(crate) fn submit(kernel: &'static str, mut b: LaunchArgs<'_>, cfg: LaunchConfig) -> Result<()> {
    if cfg.grid_dim.0 == 0 || cfg.grid_dim.1 == 0 || cfg.grid_dim.2 == 0 {
        return Ok(());
    }
    if cfg.grid_dim.1 > 65535 || cfg.grid_dim.2 > 65535 {
        return Err(shape_err(
            kernel,
            format!("grid {:?} exceeds the y/z limit of 65535", cfg.grid_dim),
        ));
    }
    // SAFETY: every wrapper validates buffer lengths against the dims it
    // passes, and the kernels index only within those dims.
    unsafe { b.launch(cfg) }.map_err(KernelError::driver(format!("launching `{kernel}`")))?;
    Ok(())
}

/// A kernel's arguments, in parameter order, for [`submit_pdl`] (cudarc's
/// builder cannot pass a launch attribute). Each is borrowed for as long as
/// the list lives, so the pointers stay valid until the launch.
pub(crate) struct KArgs<'a> {
    ptrs: Vec<*mut c_void>,
    _borrows: PhantomData<&'a ()>,
}

impl<'a> KArgs<'a> {
    pub(crate) fn new() -> Self {
        KArgs {
            ptrs: Vec::with_capacity(16),
            _borrows: PhantomData,
        }
    }

    /// Appends `v` (a device pointer or a scalar) as the next argument.
    pub(crate) fn arg<T: DeviceRepr>(&mut self, v: &'a T) -> &mut Self {
        self.ptrs.push(v as *const T as *mut c_void);
        self
    }
}

/// Launch `f` with `args` on `stream`: with `pdl` (pass
/// [`crate::Kernels::pdl`]) as a programmatic dependent of the previous
/// kernel on the stream, else plainly. Every kernel launched this way must
/// `pdl_wait()` (`cuda/common.cuh`) before it touches memory that another
/// kernel writes.
///
/// # Safety
/// `args` must match `f`'s parameters in order and type.
pub(crate) unsafe fn submit_pdl(
    kernel: &'static str,
    stream: &CudaStream,
    f: &CudaFunction,
    config: LaunchConfig,
    mut args: KArgs<'_>,
    pdl: bool,
) -> Result<()> {
    // SAFETY: forwarded from the caller; the borrows in `args` outlive the call.
    unsafe { launch_ex(kernel, stream, f, config, &mut args.ptrs, pdl) }
}

/// Launch `f` with programmatic stream serialization (sm_90 programmatic
/// dependent launch): it may start while the previous kernel on `stream`
/// is still running and must `griddepcontrol.wait` before reading that
/// kernel's outputs. Works under stream capture (a programmatic graph edge).
///
/// # Safety
/// `args` must match `f`'s parameters in order and type and stay valid
/// for the call.
pub(crate) unsafe fn launch_dependent(
    kernel: &'static str,
    stream: &CudaStream,
    f: &CudaFunction,
    config: LaunchConfig,
    args: &mut [*mut c_void],
) -> Result<()> {
    // SAFETY: forwarded from the caller.
    unsafe { launch_ex(kernel, stream, f, config, args, true) }
}

/// `cuLaunchKernelEx`, with the programmatic-serialization attribute when
/// `programmatic`.
///
/// # Safety
/// As [`launch_dependent`].
unsafe fn launch_ex(
    kernel: &'static str,
    stream: &CudaStream,
    f: &CudaFunction,
    config: LaunchConfig,
    args: &mut [*mut c_void],
    programmatic: bool,
) -> Result<()> {
    let (gx, gy, gz) = config.grid_dim;
    if gx == 0 || gy == 0 || gz == 0 {
        return Ok(());
    }
    if gy > 65535 || gz > 65535 {
        return Err(shape_err(
            kernel,
            format!("grid {:?} exceeds the y/z limit of 65535", config.grid_dim),
        ));
    }
    // SAFETY: a plain-old-data union; zero is a valid bit pattern.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let lc = sys::CUlaunchConfig {
        gridDimX: gx,
        gridDimY: gy,
        gridDimZ: gz,
        blockDimX: config.block_dim.0,
        blockDimY: config.block_dim.1,
        blockDimZ: config.block_dim.2,
        sharedMemBytes: config.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: u32::from(programmatic),
    };
    // Make the stream's context current, as cudarc's own launches do.
    stream
        .context()
        .bind_to_thread()
        .map_err(KernelError::driver(format!(
            "binding the context for `{kernel}`"
        )))?;
    // SAFETY: the caller guarantees `args`; `lc` and `attr` live across the call.
    unsafe {
        sys::cuLaunchKernelEx(
            &lc,
            f.cu_function(),
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .map_err(KernelError::driver(format!("launching `{kernel}`")))
}

/// Opts `f` in to more than 48 KB of dynamic shared memory when needed.
impl crate::Kernels {
    /// Lets `kernel` (function `f`) launch with `bytes` of dynamic shared
    /// memory: the 48 KB default bounds static + dynamic shared memory, so
    /// a kernel past it, counting its static arrays (read at load:
    /// [`crate::Kernels::static_smem`]), needs the opt-in even with little
    /// dynamic memory (on the H200, gemv_rmsnorm with exactly 48 KB of staged
    /// rows failed to launch with CUDA_ERROR_INVALID_VALUE until this counted
    /// its static bytes). Every launch counts it: this once queried it only
    /// past 32 KB of dynamic memory, which held only while no kernel with
    /// 16 KB of static arrays took less (the grouped INT4 kernels have 32 KB
    /// of them; the decode GEMVs on branch `next/gemv-tc` 29 KB).
    pub(crate) fn allow_smem(
        &self,
        kernel: &'static str,
        f: &CudaFunction,
        bytes: u32,
    ) -> Result<()> {
        let static_bytes = self.static_smem(kernel)?;
        if bytes + static_bytes > 48 * 1024 {
            use cudarc::driver::sys::CUfunction_attribute_enum as A;
            f.set_attribute(
                A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .map_err(KernelError::driver(format!(
                "`{kernel}`: {bytes} bytes of shared memory"
            )))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_report_kernel_and_sizes() {
        let e = check_len("k", "x", 3, 4).unwrap_err().to_string();
        assert!(
            e.contains("`k`") && e.contains("`x`") && e.contains('3') && e.contains('4'),
            "{e}"
        );
        assert!(check_len("k", "x", 4, 4).is_ok());
        assert!(dim_u32("k", "n", 1 << 33).is_err());
        assert_eq!(by_elem::<f32>("a", "b"), "a");
        assert_eq!(by_elem::<half::bf16>("a", "b"), "b");
        assert_eq!(by_act::<half::bf16>("a", "b"), "a");
        assert_eq!(by_act::<half::f16>("a", "b"), "b");
    }

    #[test]
    fn kernel_args_keep_order_and_addresses() {
        let (a, b, c) = (7u64, 3u32, 1.5f32);
        let mut k = KArgs::new();
        k.arg(&a).arg(&b);
        k.arg(&c);
        let want: Vec<*mut c_void> = vec![
            &a as *const u64 as *mut c_void,
            &b as *const u32 as *mut c_void,
            &c as *const f32 as *mut c_void,
        ];
        assert_eq!(k.ptrs, want);
    }
}
