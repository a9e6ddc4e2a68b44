//! HCS: the exact GPU expert cache for models whose experts (INT4 or MXFP4,
//! whole `expert_stride` blocks of the cache) do not all fit in the VRAM
//! the engine may use.
//!
//! Memory (see `docs/ARCHITECTURE.md`, memory classes):
//! - *Host backing*: the whole expert cache, page-locked ([`PinnedExperts`]),
//!   one contiguous region per MoE layer; every copy reads from it.
//! - *Resident tier*: slots in chunks allocated after calibration, holding
//!   the heatmap's top experts for the life of the engine.
//! - *Staging / reclaimable tier*: one allocation of two staging buffers of
//!   `group_layers` whole MoE layers each. During prefill it double-buffers
//!   layer groups; during decode the same bytes are slots for the heatmap's
//!   next experts (the prior).
//!
//! Decode: the expert pointer table ([`ExpertTable`]) names every expert,
//! its slot when it has one, else its page-locked host bytes mapped into
//! the device's address space ([`Hcs::write_decode_table`]). The decode
//! step is then exactly the all-resident one, same kernels, same launch
//! shapes, one CUDA graph per row count: a cold expert's GEMV blocks read
//! its INT4/MXFP4 blocks over PCIe in place, while the hits' blocks of the
//! same launch read VRAM. Results are bit-identical to all resident by
//! construction (the same bytes through the same code), and the host never
//! waits for a router (issue 16: the per-layer round trip and the serialized
//! copy-then-compute cost ~0.6 + ~0.3 ms of a 3.3 ms token at 6 GiB).
//! Measured on the H200 (`kbench --host-experts`): a kernel reads mapped
//! host memory at 45-51 GB/s (memcpy: 50-55), and an a3b GEMV with one of
//! its 8 experts in host memory takes 68 us against 71 us for copying that
//! expert first. Rows that share a cold expert each read it (per-pair
//! blocks); the residency never changes during decode. After each step the
//! step's routes (every MoE layer's, kept apart in the scratch) come back
//! with the sampled tokens and [`Residency::tally`] counts hits and cold
//! reads for the stats.
//!
//! Prefill (`prefill.rs`): layer-group streaming, group outside the chunk
//! loop, with the next group's copy overlapping this group's compute.

mod pinned;
mod prefill;
pub mod residency;

pub use residency::{Counters, Residency};

use crate::device::{Gpu, addr};
use crate::error::{GpuError, Result};
use crate::experts::ExpertTable;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, sys};
use krasis_cache::PinnedExperts;
use pinned::PinnedBuf;
use std::sync::Arc;

/// Allowance for the driver rounding a device allocation up to its
/// granularity (2 MiB), kept free besides the floor when sizing the last
/// resident chunk.
const ALLOC_SLACK: u64 = 2 << 20;

/// How the cache is laid out; decided by calibration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct HcsShape {
    pub resident_slots: usize,
    pub prior_slots: usize,
    /// MoE layers per staging buffer (prefill layer-group size).
    pub group_layers: usize,
}

/// Per-request traffic (the residency counters are in
/// [`Residency::counters`]).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct CopyStats {
    /// Decode (row, expert) pairs whose expert was read from host memory.
    pub decode_cold_reads: u64,
    /// Their bytes over PCIe (an expert's whole block each).
    pub decode_bytes: u64,
    /// Expert bytes streamed during prefill (non-resident experts of every group).
    pub prefill_bytes: u64,
    /// Bytes reloaded into the reclaimable tier after prefill.
    pub reload_bytes: u64,
    pub decode_tokens: u64,
}

pub struct Hcs {
    pub res: Residency,
    pub shape: HcsShape,
    stride: usize,
    num_experts: usize,
    top_k: usize,
    /// Decoder layer of each MoE layer.
    moe_layers: Vec<usize>,
    host: Arc<PinnedExperts>,
    copy: Arc<CudaStream>,
    slot_addr: Vec<u64>,
    _resident_mem: Vec<CudaSlice<u8>>,
    staging: CudaSlice<u8>,
    /// A decode step's routes, every MoE layer's `pairs` ids, read back
    /// with the step's sampled tokens.
    routes_host: PinnedBuf<u32>,
    ev_copy: CudaEvent,
    ev_staged: [CudaEvent; 2],
    ev_computed: [CudaEvent; 2],
    /// (row, expert) pairs of the largest decode step: `rows * top_k`.
    pairs: usize,
    pub copies: CopyStats,
}

fn ev(gpu: &Gpu, timing: bool) -> Result<CudaEvent> {
    let flags = if timing {
        sys::CUevent_flags::CU_EVENT_DEFAULT
    } else {
        sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
    };
    gpu.ctx
        .new_event(Some(flags))
        .map_err(GpuError::driver("creating a CUDA event"))
}

impl Hcs {
    /// Bytes of the staging region for `group_layers` layers per buffer.
    pub fn staging_bytes(layer_bytes: usize, group_layers: usize) -> usize {
        2 * group_layers * layer_bytes
    }

    /// Prior slots of the reclaimable tier: all `2 * group_layers *
    /// num_experts` of them, at most every expert.
    pub fn prior_slots(moe_layers: usize, num_experts: usize, group_layers: usize) -> usize {
        (2 * group_layers * num_experts).min(moe_layers * num_experts)
    }

    /// Allocates the staging region and the routes read-back buffer for
    /// decode steps of up to `rows` sequences, loads the prior and writes
    /// the decode table. The resident tier is added later by
    /// [`Hcs::grow_resident`] (after calibration has measured what it may
    /// use).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &Gpu,
        host: Arc<PinnedExperts>,
        moe_layers: Vec<usize>,
        num_experts: usize,
        top_k: usize,
        group_layers: usize,
        rows: usize,
        ranked: &[(usize, usize)],
        table: &mut ExpertTable,
    ) -> Result<Self> {
        let stride = host.cache().layout().expert_stride;
        let layer_bytes = num_experts * stride;
        let staging = gpu.alloc::<u8>(
            Self::staging_bytes(layer_bytes, group_layers),
            "expert staging / reclaimable HCS tier",
        )?;
        let base = addr(&staging, &gpu.stream);
        let prior = Self::prior_slots(moe_layers.len(), num_experts, group_layers);
        let shape = HcsShape {
            resident_slots: 0,
            prior_slots: prior,
            group_layers,
        };
        let res = Residency::new(moe_layers.len(), num_experts, ranked, 0, prior)
            .map_err(GpuError::Hcs)?;
        let slot_addr = (0..prior).map(|i| base + (i * stride) as u64).collect();
        let copy = gpu
            .ctx
            .new_stream()
            .map_err(GpuError::driver("creating the expert copy stream"))?;
        // A decode step's (row, expert) pairs, `rows * top_k` of them.
        let pairs = rows.max(1) * top_k;
        let n = moe_layers.len();
        let mut hcs = Hcs {
            res,
            shape,
            stride,
            num_experts,
            top_k,
            host,
            copy,
            slot_addr,
            _resident_mem: Vec::new(),
            staging,
            routes_host: PinnedBuf::new(&gpu.ctx, n * pairs, "decode step routes")?,
            ev_copy: ev(gpu, false)?,
            ev_staged: [ev(gpu, false)?, ev(gpu, false)?],
            ev_computed: [ev(gpu, false)?, ev(gpu, false)?],
            pairs,
            copies: CopyStats::default(),
            moe_layers,
        };
        // The prior starts on the GPU like after any prefill.
        hcs.res.lend_reclaimable();
        hcs.restore(gpu, table)?;
        gpu.sync("loading the reclaimable HCS tier")?;
        hcs.copies = CopyStats::default();
        Ok(hcs)
    }

    /// Adds up to `want` resident slots in chunks of at most `chunk_bytes`,
    /// stopping before free memory in the budget would drop below `floor`
    /// (the live guard against calibration drift). Returns the new slot
    /// count. The resident tier must be grown before the first request.
    pub fn grow_resident(
        &mut self,
        gpu: &Gpu,
        table: &mut ExpertTable,
        ranked: &[(usize, usize)],
        want: usize,
        chunk_bytes: usize,
        floor: u64,
    ) -> Result<usize> {
        let per_chunk = (chunk_bytes / self.stride).max(1);
        let mut mem = Vec::new();
        let mut addrs = Vec::new();
        while addrs.len() < want {
            // The last chunk takes only what is left above the floor, so at
            // most one expert's worth of the budget stays unused (stopping at
            // the first full chunk that did not fit left up to a whole chunk,
            // ~100 experts, idle, and the pre-flight plan, which divides the
            // room by the stride, disagreed by as much). The driver rounds
            // allocations up, hence the slack.
            let free = gpu.free_in_budget()?;
            let room = free.saturating_sub(floor + ALLOC_SLACK) / self.stride as u64;
            let n = per_chunk.min(want - addrs.len()).min(room as usize);
            if n == 0 {
                break;
            }
            let bytes = n * self.stride;
            let chunk = gpu.alloc::<u8>(bytes, "resident HCS experts")?;
            let base = addr(&chunk, &gpu.stream);
            addrs.extend((0..n).map(|i| base + (i * self.stride) as u64));
            mem.push(chunk);
        }
        let resident = addrs.len();
        let reclaimable = self.slot_addr.clone();
        let mut res = Residency::new(
            self.moe_layers.len(),
            self.num_experts,
            ranked,
            resident,
            self.shape
                .prior_slots
                .min((self.moe_layers.len() * self.num_experts).saturating_sub(resident)),
        )
        .map_err(GpuError::Hcs)?;
        // Unused prior slots (every expert already resident) just stay empty.
        let prior = res.prior_slots();
        self.slot_addr = addrs;
        self.slot_addr.extend_from_slice(&reclaimable[..prior]);
        // Load the resident tier, then the prior, like after a prefill.
        let mut loads = Vec::new();
        for slot in 0..resident {
            if let Some((l, e)) = res.owner(slot) {
                loads.push((slot, l, e));
            }
        }
        self.copy_experts(&loads)?;
        res.lend_reclaimable();
        self.res = res;
        self.shape.resident_slots = resident;
        self.shape.prior_slots = prior;
        self._resident_mem = mem;
        self.restore(gpu, table)?;
        gpu.sync("loading the resident HCS tier")?;
        self.copies = CopyStats::default();
        Ok(resident)
    }

    /// Whether every expert is on the GPU for decode.
    pub fn coverage(&self) -> f64 {
        self.res.held() as f64 / self.res.total_experts().max(1) as f64
    }

    pub fn expert_bytes(&self) -> usize {
        self.stride
    }

    /// Page-locked host memory this cache holds: the expert backing and the
    /// routes read-back buffer of decode.
    pub fn pinned_bytes(&self) -> u64 {
        self.host.pinned_bytes() + self.routes_host.bytes() as u64
    }

    /// This request's counters so far (no driver call, nothing reset): for
    /// live figures while decode runs.
    pub fn peek_stats(&self) -> (&Counters, &CopyStats) {
        (&self.res.counters, &self.copies)
    }

    /// Every MoE layer's decode table: each expert's slot, or its mapped
    /// host bytes when it has none.
    fn decode_ptrs(&self) -> Result<Vec<u64>> {
        let mut ptrs = Vec::with_capacity(self.moe_layers.len() * self.num_experts);
        for m in 0..self.moe_layers.len() {
            for e in 0..self.num_experts {
                ptrs.push(match self.res.slot_of(m, e) {
                    Some(slot) => self.slot_addr[slot],
                    None => self.host_addr(m, e)?,
                });
            }
        }
        Ok(ptrs)
    }

    /// Points the expert table at the decode placement (ordered on the
    /// compute stream: kernels queued after this read it).
    pub fn write_decode_table(&self, gpu: &Gpu, table: &mut ExpertTable) -> Result<()> {
        if self.res.is_lent() {
            return Err(GpuError::Hcs(
                "the decode table was asked for while prefill holds the reclaimable tier".into(),
            ));
        }
        table.write_all(gpu, &self.decode_ptrs()?)
    }

    /// Queues the read-back of a decode step's routes (the scratch's
    /// `decode_ids`: every MoE layer's `seqs * top_k` ids) on the compute
    /// stream; [`Hcs::tally_routes`] counts them once the stream has
    /// passed this point (the caller's read of the sampled tokens).
    pub fn read_routes(&mut self, gpu: &Gpu, sc: &crate::scratch::Scratch) -> Result<()> {
        let n = self.moe_layers.len() * self.pairs;
        let ids = &sc.decode_ids;
        if sc.seqs * self.top_k != self.pairs || ids.len() != n {
            return Err(GpuError::Hcs(format!(
                "decode routes of {} ids for {} sequences; HCS counts {} MoE layers of {} pairs",
                ids.len(),
                sc.seqs,
                self.moe_layers.len(),
                self.pairs
            )));
        }
        // SAFETY: routes_host holds n pinned u32 and is not read on the host
        // before the stream has passed this copy (tally_routes' contract).
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                self.routes_host.as_mut_slice(),
                addr(ids, &gpu.stream),
                gpu.stream.cu_stream(),
            )
        }
        .map_err(GpuError::driver("reading a decode step's routes"))
    }

    /// Counts the routes of a step of `rows` rows read by
    /// [`Hcs::read_routes`]; the compute stream must have passed that copy.
    pub fn tally_routes(&mut self, rows: usize) -> Result<()> {
        let used = rows * self.top_k;
        let cold = self
            .res
            .tally(self.routes_host.as_slice(), self.pairs, used)
            .map_err(GpuError::Hcs)?;
        self.copies.decode_cold_reads += cold;
        self.copies.decode_bytes += cold * self.stride as u64;
        Ok(())
    }

    /// Copies `(slot, moe layer, expert)` from the host backing on the copy
    /// stream (no event recorded).
    fn copy_experts(&mut self, loads: &[(usize, usize, usize)]) -> Result<u64> {
        let mut bytes = 0u64;
        for &(slot, l, e) in loads {
            let src = self.host_expert(l, e)?;
            // SAFETY: the destination is a slot of `stride` bytes owned by
            // this cache; the source is page-locked host memory that lives
            // as long as `self.host`.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    self.slot_addr[slot],
                    src,
                    self.copy.cu_stream(),
                )
            }
            .map_err(GpuError::driver("copying an expert to the GPU"))?;
            bytes += src.len() as u64;
        }
        Ok(bytes)
    }

    /// The device-side address of an expert's mapped host bytes.
    fn host_addr(&self, moe_index: usize, expert: usize) -> Result<u64> {
        let layer = self.moe_layers[moe_index];
        self.host.device_addr(layer, expert).ok_or_else(|| {
            GpuError::Hcs(format!(
                "expert {expert} of layer {layer} is outside the host backing"
            ))
        })
    }

    fn host_expert(&self, moe_index: usize, expert: usize) -> Result<&'static [u8]> {
        let layer = self.moe_layers[moe_index];
        let src = self.host.expert(layer, expert).ok_or_else(|| {
            GpuError::Hcs(format!(
                "expert {expert} of layer {layer} is outside the host backing"
            ))
        })?;
        // SAFETY: the bytes live in `self.host` (an Arc held for the life of
        // this cache) and are only read; the 'static lets a copy borrow them
        // while `self` is mutably borrowed for bookkeeping.
        Ok(unsafe { std::slice::from_raw_parts(src.as_ptr(), src.len()) })
    }

    /// Reloads the reclaimable prior after prefill, on the copy stream after
    /// everything already on the compute stream; the compute stream waits
    /// for the reload, then the table gets the decode placement back.
    pub fn restore(&mut self, gpu: &Gpu, table: &mut ExpertTable) -> Result<()> {
        self.copy_after_compute(gpu)?;
        let loads = self.res.restore_reclaimable();
        let bytes = self.copy_experts(&loads)?;
        self.copies.reload_bytes += bytes;
        self.ev_copy
            .record(&self.copy)
            .map_err(GpuError::driver("recording the reload"))?;
        gpu.stream
            .wait(&self.ev_copy)
            .map_err(GpuError::driver("waiting for the reload"))?;
        self.write_decode_table(gpu, table)
    }

    /// Orders everything queued on the copy stream from now on after all
    /// work already on the compute stream (so a copy never overwrites bytes
    /// a queued kernel still reads).
    fn copy_after_compute(&self, gpu: &Gpu) -> Result<()> {
        self.ev_copy
            .record(&gpu.stream)
            .map_err(GpuError::driver("recording the compute stream"))?;
        self.copy
            .wait(&self.ev_copy)
            .map_err(GpuError::driver("ordering copies after compute"))
    }

    /// Resets the per-request counters; returns the previous ones.
    pub fn take_stats(&mut self) -> (Counters, CopyStats) {
        (
            std::mem::take(&mut self.res.counters),
            std::mem::take(&mut self.copies),
        )
    }
}

impl Hcs {
    /// Measures host→device copy rates from the real host backing into the
    /// staging region: `experts` one-expert copies back to back, and one
    /// copy of the whole staging region. Returns (expert GB/s, big GB/s,
    /// big copy bytes). The reclaimable tier is reloaded afterwards.
    pub fn measure_copy_rates(
        &mut self,
        gpu: &Gpu,
        table: &mut ExpertTable,
        experts: usize,
    ) -> Result<(f64, f64, usize)> {
        gpu.sync("measuring copy rates")?;
        self.res.lend_reclaimable();
        let base = addr(&self.staging, &gpu.stream);
        let staging = self.staging.len();
        let n = experts
            .min(staging / self.stride)
            .min(self.num_experts)
            .max(1);
        let (a, b) = (ev(gpu, true)?, ev(gpu, true)?);
        let rate = |copies: &[(u64, &[u8])]| -> Result<f64> {
            let mut best = 0f64;
            for _ in 0..3 {
                a.record(&self.copy)
                    .map_err(GpuError::driver("timing copies"))?;
                let mut bytes = 0;
                for &(dst, src) in copies {
                    // SAFETY: destinations lie in the staging region (lent,
                    // unused); sources in the page-locked backing.
                    unsafe {
                        cudarc::driver::result::memcpy_htod_async(dst, src, self.copy.cu_stream())
                    }
                    .map_err(GpuError::driver("timing copies"))?;
                    bytes += src.len();
                }
                b.record(&self.copy)
                    .map_err(GpuError::driver("timing copies"))?;
                let ms = a
                    .elapsed_ms(&b)
                    .map_err(GpuError::driver("timing copies"))? as f64;
                best = best.max(bytes as f64 / (ms / 1e3) / 1e9);
            }
            Ok(best)
        };
        let mut one = Vec::new();
        for x in 0..n {
            one.push((base + (x * self.stride) as u64, self.host_expert(0, x)?));
        }
        let expert_gbps = rate(&one)?;
        let data = self.host.data();
        let big_len = staging.min(data.len());
        // SAFETY: the first big_len bytes of the pinned backing.
        let big_src: &[u8] = unsafe { std::slice::from_raw_parts(data.as_ptr(), big_len) };
        let big_gbps = rate(&[(base, big_src)])?;
        self.restore(gpu, table)?;
        gpu.sync("reloading after the copy measurement")?;
        self.copies = CopyStats::default();
        Ok((expert_gbps, big_gbps, big_len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole reclaimable tier is prior (a3b-24l: 256 slots, one layer
    /// per staging buffer), and never more than every expert.
    #[test]
    fn the_reclaimable_tier_is_all_prior() {
        assert_eq!(Hcs::prior_slots(24, 128, 1), 256);
        assert_eq!(Hcs::prior_slots(1, 8, 1), 8);
        assert_eq!(Hcs::prior_slots(3, 16, 2), 48);
    }
}
