//! The CUDA context, the one compute stream, the GEMM handles, and
//! allocation that reports out-of-memory with the size and purpose.

use crate::error::{GpuError, Result};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DeviceRepr, DriverError, sys};
use std::sync::Arc;

/// Bytes of cuBLAS workspace. Set explicitly so cuBLAS never allocates while a
/// CUDA graph is being captured.
pub const BLAS_WORKSPACE_BYTES: usize = 64 << 20;

/// Facts about the device, for reports and the bench identity.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_bytes: usize,
    pub driver_version: i32,
    pub multiprocessors: i32,
}

/// Checks that a CUDA driver and at least one device exist, without creating
/// a context. `Err(GpuError::NoDevice)` on CPU-only machines.
pub fn probe() -> Result<usize> {
    // SAFETY: only checks whether the shared library can be loaded.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(GpuError::NoDevice(
            "the CUDA driver library (libcuda.so) is not installed".into(),
        ));
    }
    let n = CudaContext::device_count()
        .map_err(|e| GpuError::NoDevice(format!("the CUDA driver failed to start: {e}")))?;
    if n <= 0 {
        return Err(GpuError::NoDevice(
            "the CUDA driver reports no devices".into(),
        ));
    }
    Ok(n as usize)
}

/// Checks that device `ordinal` is among the GPUs `found` (their names, by
/// ordinal); otherwise the error lists them, so `--gpu N` with a wrong N says
/// which N exist.
pub fn check_ordinal(ordinal: usize, found: &[String]) -> Result<()> {
    if ordinal < found.len() {
        return Ok(());
    }
    let list = found
        .iter()
        .enumerate()
        .map(|(i, name)| format!("{i}: {name}"))
        .collect::<Vec<_>>()
        .join(", ");
    Err(GpuError::NoDevice(format!(
        "GPU {ordinal} does not exist; this machine has {} CUDA device(s): {list} (choose one with --gpu)",
        found.len()
    )))
}

/// Names of the CUDA devices, by ordinal, without creating a context.
pub fn device_names() -> Result<Vec<String>> {
    let n = probe()?;
    (0..n)
        .map(|i| {
            let dev = cudarc::driver::result::device::get(i as i32)
                .map_err(GpuError::driver("opening a CUDA device"))?;
            cudarc::driver::result::device::get_name(dev)
                .map_err(GpuError::driver("reading a device name"))
        })
        .collect()
}

/// `(free, total)` bytes of device `ordinal` as the engine sees them when
/// it opens it: after its CUDA context exists (the pre-flight plan's budget).
pub fn free_at_open(ordinal: usize) -> Result<(u64, u64)> {
    check_ordinal(ordinal, &device_names()?)?;
    let ctx = CudaContext::new(ordinal).map_err(GpuError::driver("creating the CUDA context"))?;
    let (free, total) = ctx
        .mem_get_info()
        .map_err(GpuError::driver("querying free device memory"))?;
    Ok((free as u64, total as u64))
}

/// The engine's share of the device: at most `limit` bytes in use, counted
/// from the driver-visible free memory right after the context exists
/// (memory other processes take afterwards counts too, conservatively).
/// Everything the engine allocates afterwards (weights, KV, scratch, cuBLAS
/// workspace, expert slots, staging, graphs, allocator slack) shows up as a
/// drop in driver-visible free memory, so that drop is what the limit caps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub limit: Option<u64>,
    pub free_at_open: u64,
}

impl Budget {
    /// Bytes in use by this engine when the driver reports `driver_free`.
    pub fn used(&self, driver_free: u64) -> u64 {
        self.free_at_open.saturating_sub(driver_free)
    }
    /// Free bytes the engine may still use: the driver's free memory, capped
    /// by what is left of the limit.
    pub fn free(&self, driver_free: u64) -> u64 {
        match self.limit {
            Some(l) => driver_free.min(l.saturating_sub(self.used(driver_free))),
            None => driver_free,
        }
    }
}

/// One device with its compute stream and GEMM handles.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub blas: crate::blas::Blas,
    pub info: DeviceInfo,
    pub budget: Budget,
    _blas_workspace: CudaSlice<u8>,
}

impl Gpu {
    pub fn open(ordinal: usize) -> Result<Self> {
        Self::open_limited(ordinal, None)
    }

    /// Opens the device; with `limit`, every later allocation is refused
    /// once the engine would hold more than `limit` bytes.
    pub fn open_limited(ordinal: usize, limit: Option<u64>) -> Result<Self> {
        check_ordinal(ordinal, &device_names()?)?;
        let ctx =
            CudaContext::new(ordinal).map_err(GpuError::driver("creating the CUDA context"))?;
        // SAFETY: the engine uses one stream for all device work (the VRAM
        // monitor only queries memory), so cudarc's per-buffer events would
        // only add work to every launch and break graph capture.
        unsafe { ctx.disable_event_tracking() };
        // A created (non-legacy) stream: graph capture is refused on the legacy default stream.
        let stream = ctx
            .new_stream()
            .map_err(GpuError::driver("creating the compute stream"))?;
        let name = ctx
            .name()
            .map_err(GpuError::driver("reading the device name"))?;
        let compute_capability = ctx
            .compute_capability()
            .map_err(GpuError::driver("reading the compute capability"))?;
        let total_bytes = ctx
            .total_mem()
            .map_err(GpuError::driver("reading device memory size"))?;
        let multiprocessors = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(GpuError::driver("reading the multiprocessor count"))?;
        let driver_version = driver_version()?;
        let legacy =
            CudaBlas::new(stream.clone()).map_err(GpuError::blas("creating the cuBLAS handle"))?;
        let blas = crate::blas::Blas::new(stream.clone(), legacy)?;
        let info = DeviceInfo {
            ordinal,
            name,
            compute_capability,
            total_bytes,
            driver_version,
            multiprocessors,
        };
        let (free_at_open, _) = ctx
            .mem_get_info()
            .map_err(GpuError::driver("querying free device memory"))?;
        let budget = Budget {
            limit,
            free_at_open: free_at_open as u64,
        };
        let workspace = alloc_raw::<u8>(&stream, budget, BLAS_WORKSPACE_BYTES, "cuBLAS workspace")?;
        {
            let (ptr, _g) = workspace.device_ptr(&stream);
            // SAFETY: the workspace outlives the handle (both live in `Gpu`,
            // and the handle is dropped first, being declared earlier).
            unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    *blas.legacy.handle(),
                    ptr as *mut std::ffi::c_void,
                    BLAS_WORKSPACE_BYTES,
                )
                .result()
                .map_err(GpuError::blas("setting the cuBLAS workspace"))?;
            }
        }
        Ok(Gpu {
            ctx,
            stream,
            blas,
            info,
            budget,
            _blas_workspace: workspace,
        })
    }

    /// `(free, total)` device bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx
            .mem_get_info()
            .map_err(GpuError::driver("querying free device memory"))
    }

    /// Free bytes within the budget now (driver-visible, capped by the limit).
    pub fn free_in_budget(&self) -> Result<u64> {
        Ok(self.budget.free(self.mem_info()?.0 as u64))
    }

    /// Uninitialised device memory of `len` elements; callers write every
    /// element before reading it.
    pub fn alloc<T: DeviceRepr>(&self, len: usize, what: &str) -> Result<CudaSlice<T>> {
        alloc_raw(&self.stream, self.budget, len, what)
    }

    /// `bytes` of uninitialised device memory straight from `cuMemAlloc`,
    /// not the stream-ordered pool [`Gpu::alloc`] uses: the pool may
    /// reserve more than an allocation asks for (measured on the H200: the
    /// resident HCS tier of qcn at 16 GiB left 10-16 MiB less free than
    /// its bytes allowed), while `cuMemAlloc` rounds to its 2 MiB
    /// granularity and gives the memory back to the driver when dropped. For
    /// the big allocations sized against the safety margin.
    pub fn alloc_block(&self, bytes: usize, what: &str) -> Result<DeviceBlock> {
        within_budget(&self.ctx, self.budget, bytes, what)?;
        self.ctx
            .bind_to_thread()
            .map_err(GpuError::driver("binding the CUDA context"))?;
        // SAFETY: a plain allocation; `DeviceBlock` frees it once.
        unsafe { cudarc::driver::result::malloc_sync(bytes.max(1)) }
            .map(|ptr| DeviceBlock {
                ctx: self.ctx.clone(),
                ptr,
            })
            .map_err(|e| alloc_failed(&self.ctx, e, bytes, what))
    }

    pub fn alloc_zeros<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
        what: &str,
    ) -> Result<CudaSlice<T>> {
        let mut s = alloc_raw(&self.stream, self.budget, len, what)?;
        self.stream
            .memset_zeros(&mut s)
            .map_err(GpuError::driver(format!("zeroing {what}")))?;
        Ok(s)
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T], what: &str) -> Result<CudaSlice<T>> {
        let mut s = alloc_raw(&self.stream, self.budget, host.len().max(1), what)?;
        if !host.is_empty() {
            self.stream
                .memcpy_htod(host, &mut s)
                .map_err(GpuError::driver(format!("copying {what} to the GPU")))?;
        }
        Ok(s)
    }

    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaSlice<T>,
        len: usize,
        what: &str,
    ) -> Result<Vec<T>> {
        let mut host = vec![T::default(); len];
        self.stream
            .memcpy_dtoh(&dev.slice(0..len), &mut host)
            .map_err(GpuError::driver(format!("copying {what} from the GPU")))?;
        Ok(host)
    }

    pub fn sync(&self, what: &str) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(GpuError::driver(format!("waiting for {what}")))
    }
}

/// Device memory from [`Gpu::alloc_block`], freed with `cuMemFree` when
/// dropped (`cuMemFree` waits for the device's outstanding work first).
pub struct DeviceBlock {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
}

impl DeviceBlock {
    pub fn addr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for DeviceBlock {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by `alloc_block`, freed once; like `cudaFree`,
        // `cuMemFree` waits for the device's outstanding work.
        let _ = unsafe { cudarc::driver::result::free_sync(self.ptr) };
    }
}

/// The raw device address of a buffer (kernels and cuBLAS take addresses).
pub fn addr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _g) = s.device_ptr(stream);
    p
}

fn alloc_raw<T: DeviceRepr>(
    stream: &Arc<CudaStream>,
    budget: Budget,
    len: usize,
    what: &str,
) -> Result<CudaSlice<T>> {
    let bytes = len * std::mem::size_of::<T>();
    within_budget(stream.context(), budget, bytes, what)?;
    // SAFETY: documented contract of `Gpu::alloc`: contents are written before use.
    unsafe { stream.alloc::<T>(len.max(1)) }
        .map_err(|e| alloc_failed(stream.context(), e, bytes, what))
}

/// Refuses `bytes` for `what` past the budget's limit (if any).
fn within_budget(ctx: &CudaContext, budget: Budget, bytes: usize, what: &str) -> Result<()> {
    let Some(limit) = budget.limit else {
        return Ok(());
    };
    let (free, _) = ctx
        .mem_get_info()
        .map_err(GpuError::driver("querying free device memory"))?;
    let left = budget.free(free as u64);
    if bytes as u64 > left {
        return Err(GpuError::OverLimit {
            what: what.to_string(),
            requested: bytes as u64,
            left,
            limit,
        });
    }
    Ok(())
}

/// The error of a failed allocation of `bytes` for `what`: out of memory
/// with the device's figures, or the driver's error.
fn alloc_failed(ctx: &CudaContext, e: DriverError, bytes: usize, what: &str) -> GpuError {
    if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        let (free, total) = ctx.mem_get_info().unwrap_or((0, 0));
        GpuError::OutOfMemory {
            what: what.to_string(),
            requested: bytes,
            free,
            total,
        }
    } else {
        GpuError::Driver {
            what: format!("allocating {bytes} bytes for {what}"),
            source: e,
        }
    }
}

fn driver_version() -> Result<i32> {
    let mut v = 0i32;
    // SAFETY: plain query into a local.
    unsafe { sys::cuDriverGetVersion(&mut v) }
        .result()
        .map_err(GpuError::driver("reading the driver version"))?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::{Budget, check_ordinal};

    #[test]
    fn a_missing_gpu_is_refused_naming_the_gpus_found() {
        let found = vec!["NVIDIA H200".to_string(), "NVIDIA RTX 4090".to_string()];
        check_ordinal(0, &found).unwrap();
        check_ordinal(1, &found).unwrap();
        let e = check_ordinal(2, &found).unwrap_err();
        assert!(e.is_no_device());
        assert_eq!(
            e.to_string(),
            "no CUDA device: GPU 2 does not exist; this machine has 2 CUDA device(s): 0: NVIDIA H200, 1: NVIDIA RTX 4090 (choose one with --gpu)"
        );
    }

    #[test]
    fn budget_counts_usage_since_open_and_caps_free_memory() {
        let b = Budget {
            limit: Some(6 << 30),
            free_at_open: 100 << 30,
        };
        // Nothing used yet: the limit, not the card, bounds what is free.
        assert_eq!(b.free(100 << 30), 6 << 30);
        // 5 GiB used: 1 GiB left in the limit.
        assert_eq!(b.used(95 << 30), 5 << 30);
        assert_eq!(b.free(95 << 30), 1 << 30);
        // Over the limit (another process cannot make this happen, the
        // engine's own allocations are refused first): nothing is free.
        assert_eq!(b.free(90 << 30), 0);
        // Without a limit the driver's free memory is the bound; with one,
        // memory another process takes after open is counted as used too
        // (conservative: the margin is never eaten by someone else).
        let wide = Budget {
            limit: Some(200 << 30),
            free_at_open: 100 << 30,
        };
        assert_eq!(wide.free(1 << 29), 1 << 29);
        let unlimited = Budget {
            limit: None,
            free_at_open: 100 << 30,
        };
        assert_eq!(unlimited.free(42), 42);
    }
}
