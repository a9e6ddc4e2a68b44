//! Page-locked host backing of the cache for GPU copies.
//!
//! The GPU engine streams cold experts host→device; DMA needs page-locked
//! memory, otherwise the driver bounces every copy through a staging buffer.
//! Two ways to get there, chosen explicitly ([`HostBacking`]):
//! - `RegisterMmap`: pin the mmap'ed file pages in place
//!   (`cuMemHostRegister`, read-only). No second copy of the data, but the
//!   registration faults in and locks every page of the file.
//! - `CopyToPinned`: allocate page-locked memory (`cuMemHostAlloc`) and copy
//!   the expert regions into it. Costs a copy and uses anonymous memory, but
//!   works where read-only registration of file pages is not supported.
//!
//! Which is faster to prepare and to copy from is measured on the target by
//! [`measure_host_modes`] (`krasis-runtime build-cache --measure-host-modes`).
//!
//! Either way the memory is also mapped into the device's address space
//! (`DEVICEMAP`): HCS decode kernels read a cold expert's blocks in place
//! over PCIe ([`PinnedExperts::device_addr`]), with no copy and no host
//! round trip.

use crate::cache::ExpertCache;
use crate::error::CacheError;
use cudarc::driver::{CudaContext, result, sys};
use krasis_common::events::{ByteProgress, EventSink, task};
use rayon::prelude::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How the cache's bytes are made DMA-ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostBacking {
    RegisterMmap,
    CopyToPinned,
}

impl HostBacking {
    pub const ALL: [HostBacking; 2] = [HostBacking::RegisterMmap, HostBacking::CopyToPinned];
    pub fn name(self) -> &'static str {
        match self {
            HostBacking::RegisterMmap => "register-mmap",
            HostBacking::CopyToPinned => "copy-to-pinned",
        }
    }
}

fn cuda(call: &'static str) -> impl Fn(result::DriverError) -> CacheError {
    move |e| CacheError::Cuda {
        call,
        error: e.to_string(),
    }
}

/// Creates (retains) the primary context of GPU `ordinal`, or explains why
/// there is none.
pub fn cuda_context(ordinal: usize) -> Result<Arc<CudaContext>, CacheError> {
    // SAFETY: only probes whether libcuda can be dlopen'ed.
    if !unsafe { sys::is_culib_present() } {
        return Err(CacheError::NoCudaDriver(
            "libcuda.so could not be loaded".into(),
        ));
    }
    CudaContext::new(ordinal)
        .map_err(|e| CacheError::NoCudaDriver(format!("cannot open GPU {ordinal}: {e}")))
}

/// The cache's expert regions in page-locked host memory.
pub struct PinnedExperts {
    cache: Arc<ExpertCache>,
    ctx: Arc<CudaContext>,
    mode: HostBacking,
    /// Start of the DMA-ready copy of `cache.data()`.
    data: *const u8,
    len: usize,
    /// Page-locked bytes this value holds: the whole registered file
    /// (header and index included) or the allocated copy of the data.
    locked: usize,
    /// What to release on drop: the registered or allocated base pointer.
    base: *mut std::ffi::c_void,
    /// The device-side address of `data` (the same bytes, mapped).
    dev_data: u64,
    prepare_time: Duration,
}

// SAFETY: the pointers refer to memory owned by this value (pinned
// allocation) or by the Arc'ed mmap; it is only read after construction.
unsafe impl Send for PinnedExperts {}
unsafe impl Sync for PinnedExperts {}

/// Bytes per parallel work item when faulting in or copying the cache.
const PIN_CHUNK: usize = 64 << 20;

/// Reads one byte of every page of `bytes`, in parallel, so the pages are
/// resident before `cuMemHostRegister` locks them (which would otherwise
/// fault them in one by one, with no progress to show), reporting the
/// bytes done.
fn fault_in(bytes: &[u8], progress: Option<&ByteProgress<'_>>) {
    const PAGE: usize = 4096;
    bytes.par_chunks(PIN_CHUNK).for_each(|c| {
        for i in (0..c.len()).step_by(PAGE) {
            std::hint::black_box(c[i]);
        }
        if let Some(p) = progress {
            p.add(c.len() as u64);
        }
    });
}

impl PinnedExperts {
    /// Makes `cache`'s expert data DMA-ready on `ctx` with `mode`.
    pub fn new(
        cache: Arc<ExpertCache>,
        ctx: &Arc<CudaContext>,
        mode: HostBacking,
    ) -> Result<Self, CacheError> {
        Self::new_reporting(cache, ctx, mode, None)
    }

    /// [`PinnedExperts::new`] that sends byte progress (bytes made
    /// page-locked, [`task::PIN_EXPERTS`]) to `progress`.
    pub fn new_reporting(
        cache: Arc<ExpertCache>,
        ctx: &Arc<CudaContext>,
        mode: HostBacking,
        progress: Option<EventSink<'_>>,
    ) -> Result<Self, CacheError> {
        ctx.bind_to_thread().map_err(cuda("cuCtxSetCurrent"))?;
        let start = Instant::now();
        let total = match mode {
            HostBacking::RegisterMmap => cache.file_bytes().len(),
            HostBacking::CopyToPinned => cache.data().len(),
        };
        let progress = progress.map(|s| ByteProgress::start(s, task::PIN_EXPERTS, total as u64));
        let (base, data, locked) = match mode {
            HostBacking::RegisterMmap => {
                let file = cache.file_bytes();
                fault_in(file, progress.as_ref());
                let base = file.as_ptr() as *mut std::ffi::c_void;
                let flags = sys::CU_MEMHOSTREGISTER_READ_ONLY
                    | sys::CU_MEMHOSTREGISTER_PORTABLE
                    | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
                // SAFETY: `file` is a live mapping (kept alive by `cache`),
                // page-aligned, and unregistered in Drop before the Arc goes.
                unsafe { sys::cuMemHostRegister_v2(base, file.len(), flags) }
                    .result()
                    .map_err(|e| CacheError::Cuda {
                        call: "cuMemHostRegister(READ_ONLY)",
                        error: format!(
                            "{e}; if this GPU or kernel cannot pin read-only file pages, use copy-to-pinned"
                        ),
                    })?;
                (base, cache.data().as_ptr(), file.len())
            }
            HostBacking::CopyToPinned => {
                let src = cache.data();
                // SAFETY: fresh allocation of src.len() bytes, fully written below.
                let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
                let base = unsafe { result::malloc_host(src.len().max(1), flags) }
                    .map_err(cuda("cuMemHostAlloc"))?;
                // SAFETY: base points to src.len() writable bytes we own.
                let dst = unsafe { std::slice::from_raw_parts_mut(base as *mut u8, src.len()) };
                dst.par_chunks_mut(PIN_CHUNK)
                    .zip(src.par_chunks(PIN_CHUNK))
                    .for_each(|(d, s)| {
                        d.copy_from_slice(s);
                        if let Some(p) = &progress {
                            p.add(s.len() as u64);
                        }
                    });
                (base, base as *const u8, src.len().max(1))
            }
        };
        if let Some(p) = progress {
            p.finish();
        }
        let mut dev_base = 0u64;
        // SAFETY: `base` was registered or allocated with DEVICEMAP above,
        // in this context.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev_base, base, 0) }.result();
        if let Err(e) = mapped {
            // Release what was locked before reporting (no value owns it yet).
            // SAFETY: base came from the register/alloc call above.
            let _ = unsafe {
                match mode {
                    HostBacking::RegisterMmap => sys::cuMemHostUnregister(base).result(),
                    HostBacking::CopyToPinned => result::free_host(base),
                }
            };
            return Err(CacheError::Cuda {
                call: "cuMemHostGetDevicePointer",
                error: format!(
                    "{e}; HCS decode reads cold experts in place from mapped host memory, which \
                     this GPU or driver does not offer for {} memory",
                    mode.name()
                ),
            });
        }
        let dev_data = dev_base + (data as usize - base as usize) as u64;
        Ok(PinnedExperts {
            len: cache.data().len(),
            cache,
            ctx: ctx.clone(),
            mode,
            data,
            locked,
            base,
            dev_data,
            prepare_time: start.elapsed(),
        })
    }

    pub fn mode(&self) -> HostBacking {
        self.mode
    }
    /// Time it took to make the data DMA-ready.
    pub fn prepare_time(&self) -> Duration {
        self.prepare_time
    }
    pub fn cache(&self) -> &Arc<ExpertCache> {
        &self.cache
    }
    /// Host memory this backing keeps page-locked (what the stats endpoint
    /// reports as pinned): the registered file, or the pinned copy.
    pub fn pinned_bytes(&self) -> u64 {
        self.locked as u64
    }
    /// All expert regions, page-locked (same bytes as `cache().data()`).
    pub fn data(&self) -> &[u8] {
        // SAFETY: data..data+len is live for self's lifetime (see new).
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }
    /// One expert's page-locked bytes, `None` if out of range.
    pub fn expert(&self, layer: usize, expert: usize) -> Option<&[u8]> {
        let off = self.cache.try_layer_offset(layer)? - self.cache.data_offset();
        if expert >= self.cache.num_experts() {
            return None;
        }
        let s = self.cache.layout().expert_stride;
        let start = off as usize + expert * s;
        Some(&self.data()[start..start + s])
    }
    /// The device-side address of one expert's page-locked bytes (mapped
    /// host memory: kernels read it over PCIe), `None` if out of range.
    pub fn device_addr(&self, layer: usize, expert: usize) -> Option<u64> {
        let bytes = self.expert(layer, expert)?;
        Some(self.dev_data + (bytes.as_ptr() as usize - self.data as usize) as u64)
    }
}

impl Drop for PinnedExperts {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: base came from the matching register/alloc call in new().
        let r = unsafe {
            match self.mode {
                HostBacking::RegisterMmap => sys::cuMemHostUnregister(self.base).result(),
                HostBacking::CopyToPinned => result::free_host(self.base),
            }
        };
        if let Err(e) = r {
            tracing::warn!("releasing pinned expert memory ({}): {e}", self.mode.name());
        }
    }
}

/// One host-backing mode's measurement.
#[derive(Debug, Clone)]
pub struct HostModeReport {
    pub mode: HostBacking,
    /// Time to make the whole cache DMA-ready.
    pub prepare: Duration,
    pub expert_bytes: usize,
    pub expert_copies: usize,
    /// H2D GB/s (10^9) for one-expert copies back to back on one stream.
    pub expert_gbps: f64,
    pub big_copy_bytes: usize,
    /// H2D GB/s for one large copy (1 GiB, or the whole cache if smaller), best of 3.
    pub big_gbps: f64,
}

struct DeviceBuffer(sys::CUdeviceptr);
impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_sync in measure_one, freed once.
        let _ = unsafe { result::free_sync(self.0) };
    }
}

fn gbps(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64().max(1e-12) / 1e9
}

/// Measures each mode in `modes` on GPU `ordinal`: preparation time and H2D
/// bandwidth for expert-sized and 1 GiB copies. Without a driver this fails
/// with [`CacheError::NoCudaDriver`].
pub fn measure_host_modes(
    cache: Arc<ExpertCache>,
    ordinal: usize,
    modes: &[HostBacking],
) -> Result<Vec<HostModeReport>, CacheError> {
    let ctx = cuda_context(ordinal)?;
    modes
        .iter()
        .map(|&mode| measure_one(cache.clone(), &ctx, mode))
        .collect()
}

fn measure_one(
    cache: Arc<ExpertCache>,
    ctx: &Arc<CudaContext>,
    mode: HostBacking,
) -> Result<HostModeReport, CacheError> {
    let pinned = PinnedExperts::new(cache.clone(), ctx, mode)?;
    let stream = ctx.new_stream().map_err(cuda("cuStreamCreate"))?;
    let cu_stream = stream.cu_stream();
    let data = pinned.data();
    let big = data.len().min(1 << 30);
    let stride = cache.layout().expert_stride;
    let dev_len = big.max(stride);
    // SAFETY: plain device allocation, freed by DeviceBuffer.
    let dev = DeviceBuffer(unsafe { result::malloc_sync(dev_len) }.map_err(cuda("cuMemAlloc"))?);
    let total_experts = cache.moe_layers().len() * cache.num_experts();
    let slots = (dev_len / stride).max(1);
    let copies = 2048.min(total_experts.max(1) * 4);
    let layers = cache.moe_layers().to_vec();
    let run_experts = |n: usize| -> Result<Duration, CacheError> {
        let t = Instant::now();
        for k in 0..n {
            // A scattered visiting order, like routing does.
            let id = (k * 7919) % total_experts;
            let src = pinned
                .expert(layers[id / cache.num_experts()], id % cache.num_experts())
                .expect("index in range");
            let dst = dev.0 + ((k % slots) * stride) as u64;
            // SAFETY: dst..dst+stride lies in the device buffer; src is pinned
            // and outlives the stream synchronisation below.
            unsafe { result::memcpy_htod_async(dst, src, cu_stream) }
                .map_err(cuda("cuMemcpyHtoDAsync"))?;
        }
        stream.synchronize().map_err(cuda("cuStreamSynchronize"))?;
        Ok(t.elapsed())
    };
    run_experts(copies.min(64))?; // warm-up
    let t_experts = run_experts(copies)?;
    let mut best = Duration::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        // SAFETY: the device buffer holds `big` bytes; data is pinned.
        unsafe { result::memcpy_htod_async(dev.0, &data[..big], cu_stream) }
            .map_err(cuda("cuMemcpyHtoDAsync"))?;
        stream.synchronize().map_err(cuda("cuStreamSynchronize"))?;
        best = best.min(t.elapsed());
    }
    Ok(HostModeReport {
        mode,
        prepare: pinned.prepare_time(),
        expert_bytes: stride,
        expert_copies: copies,
        expert_gbps: gbps(copies * stride, t_experts),
        big_copy_bytes: big,
        big_gbps: gbps(big, best),
    })
}
