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
//!   next experts (the prior) and the recency tail that receives misses.
//!
//! Decode, per MoE layer (`decode.rs`): the router runs on the GPU; the
//! `top_k` ids of every row of the step come down through a pinned buffer
//! and one event (not a device sync); [`Residency`] places each distinct
//! expert once (a cold expert is copied once per step and serves every row
//! that routed to it); misses are copied on the copy stream (one row: while
//! the hits' gate/up GEMV runs); the misses' GEMV waits for the copy
//! event, then the down GEMV combines all of them in the fixed order the
//! all-resident path uses, so results are bit-identical to it.
//!
//! Prefill (`prefill.rs`): layer-group streaming, group outside the chunk
//! loop, with the next group's copy overlapping this group's compute.

mod decode;
mod pinned;
mod prefill;
pub mod residency;

pub use residency::{Counters, Placement, Residency};

use crate::device::{Gpu, addr};
use crate::error::{GpuError, Result};
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
    pub tail_slots: usize,
    /// MoE layers per staging buffer (prefill layer-group size).
    pub group_layers: usize,
}

/// Per-request copy statistics (the residency counters are in
/// [`Residency::counters`]).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct CopyStats {
    /// Experts copied during decode (misses).
    pub decode_copies: u64,
    pub decode_bytes: u64,
    /// Copy-stream time of decode misses, from CUDA events.
    pub decode_copy_ms: f64,
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
    ids_host: PinnedBuf<u32>,
    /// Per MoE layer, `2 * top_k` addresses: hits only, then all.
    sel_host: PinnedBuf<u64>,
    sel_dev: CudaSlice<u64>,
    iota: CudaSlice<u32>,
    ev_ids: CudaEvent,
    ev_copy: CudaEvent,
    ev_staged: [CudaEvent; 2],
    ev_computed: [CudaEvent; 2],
    /// Per MoE layer: copy start/end events of the last token with misses.
    timing: Vec<Option<(CudaEvent, CudaEvent)>>,
    placements: Vec<Placement>,
    /// (slot, MoE layer, expert) copies of the current layer (reused).
    misses: Vec<(usize, usize, usize)>,
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

    /// How the reclaimable tier's `2 * group_layers * num_experts` slots
    /// divide into (prior, recency tail) slots during decode. The tail
    /// holds at least every distinct expert one layer of a decode step of
    /// `rows` sequences selects (`rows * top_k`, at most the layer's
    /// experts; and at least two tokens' worth), so a step's misses never
    /// evict each other (`Residency::route`); a layer's experts always fit
    /// (half the reclaimable slots are at least one layer's).
    pub fn reclaimable_split(
        moe_layers: usize,
        num_experts: usize,
        top_k: usize,
        group_layers: usize,
        rows: usize,
    ) -> (usize, usize) {
        let reclaimable = 2 * group_layers * num_experts;
        let step = (rows.max(1) * top_k).min(num_experts).max(2 * top_k);
        let tail = (moe_layers * top_k).clamp(step, (reclaimable / 2).max(step));
        let tail = tail.min(reclaimable);
        let prior = (reclaimable - tail).min(moe_layers * num_experts);
        (prior, tail)
    }

    /// Allocates the staging region and the decode exchange buffers. The
    /// resident tier is added later by [`Hcs::grow_resident`] (after
    /// calibration has measured what it may use).
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
    ) -> Result<Self> {
        let stride = host.cache().layout().expert_stride;
        let layer_bytes = num_experts * stride;
        let staging = gpu.alloc::<u8>(
            Self::staging_bytes(layer_bytes, group_layers),
            "expert staging / reclaimable HCS tier",
        )?;
        let base = addr(&staging, &gpu.stream);
        let reclaimable = 2 * group_layers * num_experts;
        let (prior, tail) =
            Self::reclaimable_split(moe_layers.len(), num_experts, top_k, group_layers, rows);
        let shape = HcsShape {
            resident_slots: 0,
            prior_slots: prior,
            tail_slots: tail,
            group_layers,
        };
        let res = Residency::new(moe_layers.len(), num_experts, ranked, 0, prior, tail)
            .map_err(GpuError::Hcs)?;
        let slot_addr = (0..reclaimable)
            .map(|i| base + (i * stride) as u64)
            .collect();
        let copy = gpu
            .ctx
            .new_stream()
            .map_err(GpuError::driver("creating the expert copy stream"))?;
        // A decode step's (row, expert) pairs, `rows * top_k` of them.
        let pairs = rows.max(1) * top_k;
        let iota: Vec<u32> = (0..pairs as u32).collect();
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
            ids_host: PinnedBuf::new(&gpu.ctx, pairs, "selected expert ids")?,
            sel_host: PinnedBuf::new(&gpu.ctx, n * 2 * pairs, "selected expert addresses")?,
            sel_dev: gpu.alloc_zeros(2 * pairs, "selected expert addresses")?,
            iota: gpu.upload(&iota, "expert slot indices")?,
            ev_ids: ev(gpu, false)?,
            ev_copy: ev(gpu, false)?,
            ev_staged: [ev(gpu, false)?, ev(gpu, false)?],
            ev_computed: [ev(gpu, false)?, ev(gpu, false)?],
            timing: (0..n).map(|_| None).collect(),
            placements: Vec::with_capacity(pairs),
            misses: Vec::with_capacity(pairs),
            pairs,
            copies: CopyStats::default(),
            moe_layers,
        };
        // The prior starts on the GPU like after any prefill.
        hcs.res.lend_reclaimable();
        hcs.restore(gpu)?;
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
            self.shape.tail_slots,
        )
        .map_err(GpuError::Hcs)?;
        // Unused prior slots (every expert already resident) just stay empty.
        let prior = res.prior_slots();
        self.slot_addr = addrs;
        self.slot_addr.extend_from_slice(&reclaimable[..prior]);
        self.slot_addr
            .extend_from_slice(&reclaimable[reclaimable.len() - self.shape.tail_slots..]);
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
        self.restore(gpu)?;
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
    /// per-layer exchange buffers of decode.
    pub fn pinned_bytes(&self) -> u64 {
        self.host.pinned_bytes() + (self.ids_host.bytes() + self.sel_host.bytes()) as u64
    }

    /// This request's counters so far, without collecting the copy timings
    /// still pending (no driver call, nothing reset): for live figures
    /// while decode runs. `copies.decode_copy_ms` then covers the copies
    /// whose events were already read (each layer's latest copy is read at
    /// that layer's next miss or when the request ends).
    pub fn peek_stats(&self) -> (&Counters, &CopyStats) {
        (&self.res.counters, &self.copies)
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
    /// for the reload before any later work reads those slots.
    pub fn restore(&mut self, gpu: &Gpu) -> Result<()> {
        self.copy_after_compute(gpu)?;
        let loads = self.res.restore_reclaimable();
        let bytes = self.copy_experts(&loads)?;
        self.copies.reload_bytes += bytes;
        self.ev_copy
            .record(&self.copy)
            .map_err(GpuError::driver("recording the reload"))?;
        gpu.stream
            .wait(&self.ev_copy)
            .map_err(GpuError::driver("waiting for the reload"))
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

    /// Collects finished copy timings and resets the per-request counters;
    /// returns the previous ones.
    pub fn take_stats(&mut self) -> Result<(Counters, CopyStats)> {
        self.collect_timing()?;
        Ok((
            std::mem::take(&mut self.res.counters),
            std::mem::take(&mut self.copies),
        ))
    }

    fn collect_timing(&mut self) -> Result<()> {
        for t in self.timing.iter_mut() {
            if let Some((a, b)) = t.take() {
                self.copies.decode_copy_ms += a
                    .elapsed_ms(&b)
                    .map_err(GpuError::driver("reading expert copy timing"))?
                    as f64;
            }
        }
        Ok(())
    }
}

impl Hcs {
    /// Measures host→device copy rates from the real host backing into the
    /// staging region: `experts` one-expert copies back to back, and one
    /// copy of the whole staging region. Returns (expert GB/s, big GB/s,
    /// big copy bytes). The reclaimable tier is reloaded afterwards.
    pub fn measure_copy_rates(&mut self, gpu: &Gpu, experts: usize) -> Result<(f64, f64, usize)> {
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
        self.restore(gpu)?;
        gpu.sync("reloading after the copy measurement")?;
        self.copies = CopyStats::default();
        Ok((expert_gbps, big_gbps, big_len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The recency tail holds a whole decode step's distinct experts of one
    /// layer (rows x top_k, at most the layer's experts), so
    /// `Residency::route` never refuses a step; with room to spare it is
    /// what it was for one row (a3b-24l at 6 GiB: 128 tail slots).
    #[test]
    fn the_tail_holds_a_whole_steps_experts() {
        // a3b-24l, one layer per staging buffer: 256 reclaimable slots.
        assert_eq!(Hcs::reclaimable_split(24, 128, 8, 1, 1), (128, 128));
        assert_eq!(Hcs::reclaimable_split(24, 128, 8, 1, 8), (128, 128));
        for rows in 1..=8 {
            for (layers, experts, k, group) in
                [(2, 8, 2, 1), (3, 16, 4, 2), (48, 128, 8, 1), (1, 8, 8, 1)]
            {
                let (prior, tail) = Hcs::reclaimable_split(layers, experts, k, group, rows);
                let step = (rows * k).min(experts);
                assert!(
                    tail >= step,
                    "{layers}x{experts} top-{k}, {rows} rows: tail {tail}"
                );
                assert!(prior + tail <= 2 * group * experts);
            }
        }
        // A model with fewer layers than rows: the tail grows past one
        // token per layer to a step's experts.
        assert_eq!(Hcs::reclaimable_split(2, 16, 2, 1, 8), (16, 16));
        assert_eq!(Hcs::reclaimable_split(2, 16, 2, 1, 1), (28, 4));
    }
}
