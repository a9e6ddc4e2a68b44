//! A read-only table in page-locked host memory that kernels read directly
//! through its device mapping (zero-copy).
//!
//! Used for the input embedding: a decode token reads one row (hidden × 2
//! bytes, 4 KiB for Qwen3-30B-A3B) and an 8K-token prompt 32 MiB, so reading
//! it over PCIe costs microseconds per token, while keeping it in VRAM costs
//! `vocab × hidden × 2` bytes (622 MB for a 151,936-token vocabulary) that
//! the expert cache can use instead. llama.cpp keeps its token embeddings
//! on the host for the same reason. Bulk weights are never read this way:
//! the white paper measured mapped reads of cold experts ~30% slower than
//! explicit DMA (Appendix B, F52); a gather of a few rows is latency, not
//! bandwidth.

use crate::error::{GpuError, Result};
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DeviceSlice, SyncOnDrop, result, sys};
use std::sync::Arc;

pub struct HostTable<T: Copy> {
    host: *mut T,
    dev: sys::CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
}

// SAFETY: the allocation is owned by this value and only written during
// construction; afterwards host and device only read it.
unsafe impl<T: Copy> Send for HostTable<T> {}
unsafe impl<T: Copy> Sync for HostTable<T> {}

impl<T: Copy> HostTable<T> {
    /// Copies `data` into fresh page-locked memory mapped into the device's
    /// address space; kernels launched on `stream` may read it.
    pub fn new(stream: &Arc<CudaStream>, data: &[T], what: &str) -> Result<Self> {
        let ctx = stream.context().clone();
        ctx.bind_to_thread()
            .map_err(GpuError::driver("binding the CUDA context"))?;
        let len = data.len().max(1);
        let bytes = len * std::mem::size_of::<T>();
        // Write-combined: the host only writes it once, and the device's
        // PCIe reads then need no snoop of the CPU caches.
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP
            | sys::CU_MEMHOSTALLOC_PORTABLE
            | sys::CU_MEMHOSTALLOC_WRITECOMBINED;
        // SAFETY: fresh allocation of `bytes`, filled below before any read.
        let host = unsafe { result::malloc_host(bytes, flags) }.map_err(GpuError::driver(
            format!("allocating {bytes} bytes of mapped host memory for {what}"),
        ))? as *mut T;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: host was allocated with DEVICEMAP in this context.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host as *mut _, 0) }
            .result()
            .map_err(GpuError::driver(format!(
                "mapping the host copy of {what} into the device"
            )));
        let table = HostTable {
            host,
            dev,
            len: data.len(),
            stream: stream.clone(),
            ctx,
        };
        mapped?;
        // SAFETY: host holds `len` elements; data has data.len() <= len.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), table.host, data.len()) };
        Ok(table)
    }

    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
}

impl<T: Copy> Drop for HostTable<T> {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // Kernels reading the table must be done before its pages go.
        let _ = self.stream.synchronize();
        // SAFETY: allocated by malloc_host in new().
        let _ = unsafe { result::free_host(self.host as *mut std::ffi::c_void) };
    }
}

impl<T: Copy> DeviceSlice<T> for HostTable<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T: Copy> DevicePtr<T> for HostTable<T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        // Never written after construction, so no read needs ordering.
        (self.dev, SyncOnDrop::Record(None))
    }
}
