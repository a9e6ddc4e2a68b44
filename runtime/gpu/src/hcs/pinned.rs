//! Small page-locked host buffers for HCS decode's read-backs (the tail's
//! counters after each step). Page-locked so the
//! copies are truly asynchronous and ordered on their stream; plain raw
//! buffers because cudarc's pinned slices synchronise an event on every
//! host access, which would add a wait per layer.

use crate::error::{GpuError, Result};
use cudarc::driver::{CudaContext, result, sys};
use std::sync::Arc;

pub struct PinnedBuf<T: Copy + Default> {
    ptr: *mut T,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is owned by this value; access goes through &self/&mut
// self, and the device only touches it through copies the owner orders.
unsafe impl<T: Copy + Default> Send for PinnedBuf<T> {}

impl<T: Copy + Default> PinnedBuf<T> {
    pub fn new(ctx: &Arc<CudaContext>, len: usize, what: &str) -> Result<Self> {
        ctx.bind_to_thread()
            .map_err(GpuError::driver("binding the CUDA context"))?;
        let bytes = (len.max(1)) * std::mem::size_of::<T>();
        // SAFETY: fresh allocation, initialised below before any read.
        let ptr = unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }.map_err(
            GpuError::driver(format!("allocating pinned host memory for {what}")),
        )? as *mut T;
        // SAFETY: ptr points to len.max(1) elements we own.
        unsafe { std::slice::from_raw_parts_mut(ptr, len.max(1)).fill(T::default()) };
        Ok(PinnedBuf {
            ptr,
            len,
            ctx: ctx.clone(),
        })
    }

    /// Page-locked bytes allocated (at least one element).
    pub fn bytes(&self) -> usize {
        self.len.max(1) * std::mem::size_of::<T>()
    }

    /// The host view. Callers only read or write elements whose last device
    /// copy has completed (checked by an event wait before the access).
    pub fn as_slice(&self) -> &[T] {
        // SAFETY: ptr..ptr+len is owned and initialised.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as above, exclusive through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T: Copy + Default> Drop for PinnedBuf<T> {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by malloc_host in new().
        let _ = unsafe { result::free_host(self.ptr as *mut std::ffi::c_void) };
    }
}
