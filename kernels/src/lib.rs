//! CUDA kernels for the Krasis GPU engine.
//!
//! The CUDA C sources in `kernels/cuda/` are compiled at run time with NVRTC
//! for the GPU actually present (compute capability >= 8.0) and cached on
//! disk ([`CacheDir`]). [`Kernels`] loads every module once per device and
//! exposes typed launch wrappers (in `ops/`) that validate all dimensions on
//! the host and return [`KernelError::Shape`] instead of launching out of
//! bounds.
//!
//! Conventions shared by all wrappers:
//! - Activations are bf16 ([`half::bf16`]); the residual stream and all
//!   accumulators are f32. Every kernel accumulates in f32. The attention
//!   path (RMSNorm output into the QKV projection, q/k/v, KV cache, P) can
//!   be f16 instead ([`Act16`]; the wrappers generic over it pick the
//!   `_f16` entry points).
//! - Buffers are passed as anything implementing cudarc's
//!   `DevicePtr`/`DevicePtrMut` (`CudaSlice`, `CudaView`, `CudaViewMut`);
//!   lengths are checked to be at least what the dims require.
//! - Nothing uses floating-point atomics: every reduction has a fixed order,
//!   so results are bit-identical run to run and process to process.
//! - [`reference`] holds plain CPU implementations with the same semantics,
//!   used by the tests as the oracle.

mod compile;
mod driver;
mod error;
mod launch;
pub mod ops;
pub mod reference;
pub mod sources;

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, sys::CUdevice_attribute};

pub use compile::{CacheDir, Compiled, compile_module, nvrtc_version};
pub use driver::{GpuTestDevice, gpu_test_device, nvidia_driver_present, open_device};
pub use error::{KernelError, Result};
pub use launch::{Act16, Elem};
pub use ops::attention::{DECODE_MAX_SPLITS, decode_workspace_len};
pub use ops::expert_tail::{
    ExpertTail, TABLE_FRESH, TAIL_COUNTERS, TAIL_MAX_PAIRS, TAIL_MAX_SLOTS, TAIL_NONE, TailMode,
};
pub use ops::gemv::{GEMV_MAX_K, GEMV_MAX_MK, GEMV_MAX_TOKENS, GemvForm, GemvOut};
pub use ops::int4::{
    INT4_DECODE_MAX_HIDDEN, INT4_DECODE_MAX_INTER, INT4_DECODE_MAX_TOPK, INT4_GROUPED_ROWS,
    INT4_GROUPS, Int4Layout, int4_grouped_supports, int4_grouped_tiles, w2_tokens_per_block,
    w13_row_tiles,
};
pub use ops::kv_blocks::{BlockCopy, KvBlockGeom};
pub use ops::moe::{ROUTER_MAX_EXPERTS, ROUTER_MAX_TOPK};
pub use ops::rope::{KvBase, KvGeom, QkNormArgs, QkvGeom, StartPos};
pub use ops::sampling::{
    SAMPLE_MAX_ROWS, SAMPLE_NONFINITE, SAMPLE_PREP_BLOCKS, SampleRow, SamplingParams,
    sample_workspace_len,
};

/// All kernels, loaded into one CUDA context. Cheap to share (`Arc`), and
/// launches may be issued from any stream of that context.
pub struct Kernels {
    ctx: Arc<CudaContext>,
    funcs: HashMap<&'static str, CudaFunction>,
    compute_capability: (i32, i32),
    sm_count: u32,
    /// Shared memory one block may opt in to (static + dynamic): 227 KB on
    /// sm_90, 163 KB on sm_80, 99 KB on sm_86/89/120.
    smem_optin: u32,
    /// Each loaded kernel's static shared memory, read once at load: the
    /// launch paths that size dynamic memory against the device's limit
    /// (`ops/mxfp4.rs`, w2) need it per launch.
    static_smem: HashMap<&'static str, u32>,
    /// Shared memory of one SM, all its blocks together (228 KB on sm_90,
    /// 164 KB on sm_80, 100 KB on sm_86/89/120).
    smem_per_sm: u32,
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernels")
            .field("compute_capability", &self.compute_capability)
            .field("sm_count", &self.sm_count)
            .field("kernels", &self.funcs.len())
            .finish()
    }
}

impl Kernels {
    /// Compile (or fetch from `cache`) and load every module for `ctx`'s
    /// device. Refuses devices older than compute capability 8.0.
    pub fn new(ctx: &Arc<CudaContext>, cache: &CacheDir) -> Result<Self> {
        let cc = ctx
            .compute_capability()
            .map_err(KernelError::driver("querying compute capability"))?;
        if cc.0 < 8 {
            return Err(KernelError::UnsupportedDevice {
                major: cc.0,
                minor: cc.1,
            });
        }
        let sm_count = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(KernelError::driver("querying SM count"))?
            .max(1) as u32;
        let smem_optin = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(KernelError::driver("querying shared memory per block"))?
            .max(0) as u32;
        let smem_per_sm = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)
            .map_err(KernelError::driver("querying shared memory per SM"))?
            .max(0) as u32;
        let cache_dir = cache.resolve();
        // Modules compile independently; NVRTC is thread-safe per program,
        // so a cold start costs the slowest module, not the sum.
        // Architecture-specific modules (sm_90a) load only where they run;
        // elsewhere their kernels are refused by `func` (WrongTarget).
        let modules: Vec<&sources::Module> = sources::MODULES
            .iter()
            .filter(|m| m.target.arch(cc).is_some())
            .collect();
        let images: Vec<Result<Vec<u8>>> = std::thread::scope(|scope| {
            let handles: Vec<_> = modules
                .iter()
                .copied()
                .map(|module| {
                    let dir = cache_dir.as_deref();
                    scope.spawn(move || compile::module_image(module, cc, dir))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(KernelError::Nvrtc {
                            module: "-",
                            message: "kernel compile thread panicked".into(),
                        })
                    })
                })
                .collect()
        });
        let mut funcs = HashMap::new();
        for (module, image) in modules.iter().zip(images) {
            let loaded = ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(image?))
                .map_err(KernelError::driver(format!(
                    "loading module `{}`",
                    module.name
                )))?;
            for &name in module.kernels {
                let f = loaded
                    .load_function(name)
                    .map_err(|_| KernelError::MissingKernel {
                        name: name.to_string(),
                    })?;
                funcs.insert(name, f);
            }
        }
        let static_smem = funcs
            .iter()
            .map(|(&name, f)| {
                f.shared_size_bytes()
                    .map(|b| (name, b.max(0) as u32))
                    .map_err(KernelError::driver(format!(
                        "`{name}`: reading its static shared memory"
                    )))
            })
            .collect::<Result<_>>()?;
        Ok(Kernels {
            ctx: ctx.clone(),
            funcs,
            compute_capability: cc,
            sm_count,
            smem_optin,
            static_smem,
            smem_per_sm,
        })
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// Whether launches may be programmatic dependents of the kernel before
    /// them on the stream (sm_90+: `launch::submit_pdl`).
    pub(crate) fn pdl(&self) -> bool {
        self.compute_capability.0 >= 9
    }

    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// Shared memory one block may opt in to, static and dynamic together.
    pub fn smem_optin(&self) -> u32 {
        self.smem_optin
    }

    /// Static shared memory of kernel `name` (read at load).
    pub(crate) fn static_smem(&self, name: &'static str) -> Result<u32> {
        self.func(name)?;
        Ok(self.static_smem.get(name).copied().unwrap_or(0))
    }

    /// Whether `blocks` blocks of kernel `name` with `dynamic` bytes of
    /// dynamic shared memory each fit one SM's shared memory (each block
    /// also holds its static arrays and the 1 KB the driver reserves).
    pub(crate) fn blocks_fit_sm(
        &self,
        name: &'static str,
        blocks: u32,
        dynamic: u32,
    ) -> Result<bool> {
        let static_bytes = self.static_smem(name)?;
        Ok(blocks * (dynamic + static_bytes + 1024) <= self.smem_per_sm)
    }

    /// Whether entry point `name` is loaded (an architecture-specific
    /// module's kernels exist only on the devices it targets).
    pub fn has(&self, name: &str) -> bool {
        self.funcs.contains_key(name)
    }

    /// Ok when entry point `kernel` is loaded, else [`Kernels::func`]'s
    /// error: wrappers of architecture-specific kernels check it before
    /// anything else, so a device that cannot run them hears so first.
    pub(crate) fn require(&self, kernel: &'static str) -> Result<()> {
        self.func(kernel).map(|_| ())
    }

    /// Entry point `name`. Not loaded: [`KernelError::WrongTarget`] when its
    /// module is architecture-specific and this device is not its target
    /// (what the device cannot run), else [`KernelError::MissingKernel`].
    pub(crate) fn func(&self, name: &'static str) -> Result<&CudaFunction> {
        if let Some(f) = self.funcs.get(name) {
            return Ok(f);
        }
        let cc = self.compute_capability;
        Err(
            match sources::MODULES.iter().find(|m| m.kernels.contains(&name)) {
                Some(m) if m.target.arch(cc).is_none() => KernelError::WrongTarget {
                    module: m.name,
                    target: m.target.name(),
                    major: cc.0,
                    minor: cc.1,
                },
                _ => KernelError::MissingKernel {
                    name: name.to_string(),
                },
            },
        )
    }
}

/// Open CUDA device `ordinal` if a driver and a device exist. `None`
/// means "no CUDA here" (no driver library, no device, or driver init
/// failure), which CPU-only machines report instead of panicking. Tests
/// use [`open_device`] (the reason) with [`nvidia_driver_present`] instead,
/// so that only a machine without a driver skips.
pub fn try_open_device(ordinal: usize) -> Option<Arc<CudaContext>> {
    open_device(ordinal).ok()
}
