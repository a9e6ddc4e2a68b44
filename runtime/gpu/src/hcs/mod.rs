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
//!   next experts (the prior) and, in its last slots, the recency tail.
//!
//! Decode: the expert pointer table ([`ExpertTable`]) names every expert,
//! its slot when it has one, else its page-locked host bytes mapped into
//! the device's address space (`Hcs::write_decode_table`). After each
//! router the device looks the layer's experts up and copies its misses
//! into the LRU tail itself (`tail.rs`, `cuda/expert_tail.cu`), so the
//! decode step is the all-resident one plus two small launches per MoE
//! layer, one CUDA graph per row count, and the host never waits for a
//! router (issue 16: the per-layer round trip cost ~0.6 ms of a 3.3 ms
//! token at 6 GiB). Results are bit-identical to all resident by
//! construction: every pointer names the expert's own bytes when the GEMVs
//! read it. Reading every miss in place instead, with no tail (session 8),
//! lost: the hit rate on a3b-24l at 6 GiB fell from 0.88 to 0.60 and decode
//! from 305 to 170 tok/s, because consecutive tokens reuse experts. After
//! each step the tail's counters come back with the sampled tokens.
//!
//! Prefill (`prefill.rs`): layer-group streaming, group outside the chunk
//! loop, with the next group's copy overlapping this group's compute.
//! After it the prior is reloaded while decode already runs
//! ([`Hcs::restore`]): each chunk of the reload is pointed at once its
//! copies land.

mod pinned;
mod prefill;
pub mod residency;
mod tail;

pub use residency::{Counters, Residency};

use crate::device::{Gpu, addr};
use crate::error::{GpuError, Result};
use crate::experts::ExpertTable;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, sys};
use krasis_cache::PinnedExperts;
use krasis_kernels::Kernels;
use std::sync::Arc;
use tail::Tail;
pub use tail::{Prefetch, TailLaunch};

/// Allowance for the driver rounding a device allocation up to its
/// granularity (2 MiB), kept free besides the floor when sizing the last
/// resident chunk.
const ALLOC_SLACK: u64 = 2 << 20;

/// The reclaimable tier's division ([`Hcs::split`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierSplit {
    /// Prior slots in staging, then in prefill's lent scratch.
    pub prior_staged: usize,
    pub prior_lent: usize,
    /// Tail slots in staging, then in prefill's lent scratch.
    pub tail_staged: usize,
    pub tail_lent: usize,
}

impl TierSplit {
    pub fn prior(&self) -> usize {
        self.prior_staged + self.prior_lent
    }

    pub fn tail(&self) -> usize {
        self.tail_staged + self.tail_lent
    }
}

/// Experts per landing of a reload (`Hcs::restore`): 16 a3b experts are
/// ~39 MB, ~0.75 ms of PCIe, so decode gets the hottest prior experts
/// early, for a few small launches on the copy stream per reload (4 for
/// a3b-24l's 57 prior experts at 6 GiB).
const LANDING_CHUNK: usize = 16;

/// How the cache is laid out; decided by calibration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct HcsShape {
    pub resident_slots: usize,
    /// The reclaimable prior, including `scratch_slots`.
    pub prior_slots: usize,
    /// Prior slots in buffers only prefill uses (`Hcs::lent_slots`).
    pub scratch_slots: usize,
    /// The decode recency tail (the reclaimable tier's last slots).
    pub tail_slots: usize,
    /// MoE layers per staging buffer (prefill layer-group size).
    pub group_layers: usize,
}

impl HcsShape {
    /// A prior of `prior` slots: the staging region's part first, so a
    /// smaller prior gives up scratch slots before staging ones.
    fn set_prior(&mut self, prior: usize) {
        let staged = self.prior_slots - self.scratch_slots;
        self.scratch_slots = prior.saturating_sub(staged);
        self.prior_slots = prior;
    }
}

/// Per-request traffic (the residency counters are in
/// [`Residency::counters`]).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct CopyStats {
    /// Experts brought over PCIe in decode: copied into the tail, or read
    /// in place by a (row, expert) pair when the tail had no slot for it.
    pub decode_cold_reads: u64,
    /// Their bytes over PCIe (an expert's whole block each).
    pub decode_bytes: u64,
    /// The cold reads that were demand copies into the tail.
    pub decode_promotions: u64,
    /// Experts decode prefetched into the tail (`tail.rs`), those a demand
    /// lookup then used (counted in `decode_cold_reads` too), and those
    /// evicted unused.
    pub prefetched: u64,
    pub prefetch_used: u64,
    pub prefetch_wasted: u64,
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
    /// Decoder layer of each MoE layer.
    moe_layers: Vec<usize>,
    host: Arc<PinnedExperts>,
    copy: Arc<CudaStream>,
    slot_addr: Vec<u64>,
    _resident_mem: Vec<crate::device::DeviceBlock>,
    staging: CudaSlice<u8>,
    tail: Tail,
    /// Each expert's mapped host address, `[moe layer * num_experts + e]`
    /// (the decode table's entry for an expert with no slot).
    host_addrs: Vec<u64>,
    ev_copy: CudaEvent,
    /// Recorded on the copy stream after a prefill's reload of the prior;
    /// `reload_pending` until the compute stream waits for it
    /// ([`Hcs::settle`]).
    ev_reload: CudaEvent,
    reload_pending: bool,
    /// `Fault::SkipReload` (tests only).
    #[cfg(any(test, feature = "fault-injection"))]
    pub(crate) skip_reload: bool,
    ev_staged: [CudaEvent; 2],
    ev_computed: [CudaEvent; 2],
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

    /// Device bytes of the decode tail's state for `keys` experts, at most
    /// `slots` tail slots and steps of `pairs` pairs (`tail.rs`).
    pub fn tail_state_bytes(keys: usize, slots: usize, pairs: usize) -> usize {
        Tail::device_bytes(keys, slots, pairs)
    }

    /// How the reclaimable tier's slots, staging (`2 * group_layers *
    /// num_experts`) then `lent` slots of prefill's scratch, divide between
    /// the heatmap prior and the decode recency tail. The tail takes `tail`
    /// slots, staging's first; by default the whole tier (at most every
    /// expert): the resident tier already holds the heatmap's top experts,
    /// and recently missed experts beat its marginal ones. Measured on the
    /// H200, a3b-24l at 6 GiB sized for 8K (session 14): a tail of the
    /// whole 441 slots decodes 128 tokens at 451.8 tok/s greedily and 347.3
    /// sampled, against 434.7 and 330.1 with two tokens' worth (384) and a
    /// prior of 57, and prefills 8K at 45,299 against 44,423 (no prior to
    /// reload after each prefill); session 13 measured 384 against 128.
    /// Always at least one step's experts, at most the device lookup's
    /// `TAIL_MAX_SLOTS`; the prior takes the rest, at most every expert.
    pub fn split(
        moe_layers: usize,
        num_experts: usize,
        top_k: usize,
        group_layers: usize,
        rows: usize,
        lent: usize,
        tail: Option<usize>,
    ) -> TierSplit {
        let reclaimable = 2 * group_layers * num_experts;
        let total = moe_layers * num_experts;
        let tail = tail
            .unwrap_or(total)
            .max(Self::tail_floor(num_experts, top_k, rows))
            .min(reclaimable + lent)
            .min(krasis_kernels::TAIL_MAX_SLOTS);
        let tail_staged = tail.min(reclaimable);
        let tail_lent = tail - tail_staged;
        let prior_staged = (reclaimable - tail_staged).min(total);
        let prior_lent = (lent - tail_lent).min(total - prior_staged);
        TierSplit {
            prior_staged,
            prior_lent,
            tail_staged,
            tail_lent,
        }
    }

    /// The fewest tail slots: one step's distinct experts (at least two
    /// rows' worth).
    fn tail_floor(num_experts: usize, top_k: usize, rows: usize) -> usize {
        (rows.max(1) * top_k).min(num_experts).max(2 * top_k)
    }

    /// Expert slots of `stride` bytes carved from `buffers` ((device
    /// address, bytes) each, addresses 16-byte aligned): whole slots only,
    /// in order.
    pub fn lent_slots(buffers: &[(u64, usize)], stride: usize) -> Vec<u64> {
        buffers
            .iter()
            .flat_map(|&(a, bytes)| {
                (0..bytes / stride.max(1)).map(move |i| a + (i * stride) as u64)
            })
            .collect()
    }

    /// Allocates the staging region and the decode tail for steps of up to
    /// `rows` sequences, loads the prior and writes the decode table. The
    /// resident tier is added later by [`Hcs::grow_resident`] (after
    /// calibration has measured what it may use). `lent`: buffers only
    /// prefill uses ((device address, bytes), `GroupedScratch::lendable`);
    /// the prior extends into them, so decode holds more experts in the
    /// same memory. They belong to the reclaimable tier: lent with it to
    /// every prefill, which is what overwrites them, and reloaded after.
    /// `tail`: the recency tail's slots (`None`:
    /// [`Hcs::split`]'s), the rest of the tier is the prior.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &Gpu,
        kn: &Kernels,
        host: Arc<PinnedExperts>,
        moe_layers: Vec<usize>,
        num_experts: usize,
        top_k: usize,
        group_layers: usize,
        rows: usize,
        ranked: &[(usize, usize)],
        table: &mut ExpertTable,
        lent: &[(u64, usize)],
        tail: Option<usize>,
    ) -> Result<Self> {
        let stride = host.cache().layout().expert_stride;
        let layer_bytes = num_experts * stride;
        let staging = gpu.alloc::<u8>(
            Self::staging_bytes(layer_bytes, group_layers),
            "expert staging / reclaimable HCS tier",
        )?;
        let base = addr(&staging, &gpu.stream);
        let reclaimable = 2 * group_layers * num_experts;
        let extra = Self::lent_slots(lent, stride);
        let split = Self::split(
            moe_layers.len(),
            num_experts,
            top_k,
            group_layers,
            rows,
            extra.len(),
            tail,
        );
        let (tail_slots, tail_s, tail_e) = (split.tail(), split.tail_staged, split.tail_lent);
        let staging_addr = |i: usize| base + (i * stride) as u64;
        // Staging's first slots, then the lent ones; the tail staging's
        // last, then the lent buffers' last.
        let mut slot_addr: Vec<u64> = (0..split.prior_staged).map(staging_addr).collect();
        slot_addr.extend(&extra[..split.prior_lent]);
        let prior = slot_addr.len();
        let shape = HcsShape {
            resident_slots: 0,
            prior_slots: prior,
            scratch_slots: split.prior_lent,
            tail_slots,
            group_layers,
        };
        let res = Residency::new(moe_layers.len(), num_experts, ranked, 0, prior)
            .map_err(GpuError::Hcs)?;
        let copy = gpu
            .ctx
            .new_stream()
            .map_err(GpuError::driver("creating the expert copy stream"))?;
        let tail_addrs: Vec<u64> = (reclaimable - tail_s..reclaimable)
            .map(staging_addr)
            .chain(extra[extra.len() - tail_e..].iter().copied())
            .collect();
        // Every expert's mapped host bytes, `[moe layer * num_experts + e]`.
        let mut host_addrs = Vec::with_capacity(moe_layers.len() * num_experts);
        for &layer in &moe_layers {
            for e in 0..num_experts {
                host_addrs.push(host.device_addr(layer, e).ok_or_else(|| {
                    GpuError::Hcs(format!(
                        "expert {e} of layer {layer} is outside the host backing"
                    ))
                })?);
            }
        }
        let tail = Tail::new(
            gpu,
            num_experts,
            &host_addrs,
            &tail_addrs,
            (rows.max(1), top_k),
            stride,
        )?;
        let mut hcs = Hcs {
            res,
            shape,
            stride,
            num_experts,
            host,
            copy,
            slot_addr,
            _resident_mem: Vec::new(),
            staging,
            tail,
            host_addrs,
            ev_copy: ev(gpu, false)?,
            ev_reload: ev(gpu, false)?,
            reload_pending: false,
            #[cfg(any(test, feature = "fault-injection"))]
            skip_reload: false,
            ev_staged: [ev(gpu, false)?, ev(gpu, false)?],
            ev_computed: [ev(gpu, false)?, ev(gpu, false)?],
            copies: CopyStats::default(),
            moe_layers,
        };
        // The prior starts on the GPU like after any prefill.
        hcs.res.lend_reclaimable();
        hcs.restore_and_wait(gpu, kn, table, "loading the reclaimable HCS tier")?;
        hcs.copies = CopyStats::default();
        Ok(hcs)
    }

    /// Adds up to `want` resident slots in chunks of at most `chunk_bytes`,
    /// stopping before free memory in the budget would drop below `floor`
    /// (the live guard against calibration drift). Returns the new slot
    /// count. The resident tier must be grown before the first request.
    #[allow(clippy::too_many_arguments)]
    pub fn grow_resident(
        &mut self,
        gpu: &Gpu,
        kn: &Kernels,
        table: &mut ExpertTable,
        ranked: &[(usize, usize)],
        want: usize,
        chunk_bytes: usize,
        floor: u64,
    ) -> Result<usize> {
        let per_chunk = (chunk_bytes / self.stride).max(1);
        let mut mem = Vec::new();
        let mut addrs = Vec::new();
        // Experts the last try overshot the floor by.
        let mut over = 0;
        while addrs.len() < want {
            // The last chunk takes only what is left above the floor, so at
            // most one expert's worth of the budget stays unused (stopping at
            // the first full chunk that did not fit left up to a whole chunk,
            // ~100 experts, idle, and the pre-flight plan, which divides the
            // room by the stride, disagreed by as much). The driver rounds
            // allocations up, hence the slack; should a chunk still take the
            // free memory below the floor, it goes back and a smaller one
            // takes its place, so the margin holds whatever the driver does.
            let free = gpu.free_in_budget()?;
            let room = free.saturating_sub(floor + ALLOC_SLACK) / self.stride as u64;
            let n = per_chunk
                .min(want - addrs.len())
                .min(room as usize)
                .saturating_sub(over);
            if n == 0 {
                break;
            }
            let bytes = n * self.stride;
            let chunk = gpu.alloc_block(bytes, "resident HCS experts")?;
            let after = gpu.free_in_budget()?;
            if after < floor {
                over += (floor - after).div_ceil(self.stride as u64) as usize;
                drop(chunk);
                continue;
            }
            over = 0;
            let base = chunk.addr();
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
        self.shape.set_prior(prior);
        self._resident_mem = mem;
        self.restore_and_wait(gpu, kn, table, "loading the resident HCS tier")?;
        self.copies = CopyStats::default();
        Ok(resident)
    }

    /// Keeps at most `cap` prior slots from the next [`Hcs::grow_resident`]
    /// on (`CudaEngineOptions::hcs_prior_cap`).
    pub fn cap_prior(&mut self, cap: usize) {
        self.shape.set_prior(self.shape.prior_slots.min(cap));
    }

    /// Whether every expert is on the GPU for decode.
    pub fn coverage(&self) -> f64 {
        self.res.held() as f64 / self.res.total_experts().max(1) as f64
    }

    pub fn expert_bytes(&self) -> usize {
        self.stride
    }

    /// Page-locked host memory this cache holds: the expert backing and the
    /// tail's counter read-back buffer.
    pub fn pinned_bytes(&self) -> u64 {
        self.host.pinned_bytes() + self.tail.pinned_bytes() as u64
    }

    /// This request's counters so far (no driver call, nothing reset): for
    /// live figures while decode runs.
    pub fn peek_stats(&self) -> (&Counters, &CopyStats) {
        (&self.res.counters, &self.copies)
    }

    /// Every MoE layer's decode table: each expert's slot, or its mapped
    /// host bytes when it has none.
    fn decode_ptrs(&self) -> Vec<u64> {
        let e = self.num_experts;
        (0..self.moe_layers.len() * e)
            .map(|k| match self.res.slot_of(k / e, k % e) {
                Some(slot) => self.slot_addr[slot],
                None => self.host_addrs[k],
            })
            .collect()
    }

    /// Points the expert table, and every key's home, at the decode
    /// placement, except `pending` (slot, moe layer, expert) loads whose
    /// copies have not landed yet: they name their host bytes until
    /// `tail_home` points them at their slot. Empties the tail. Ordered on
    /// the compute stream: kernels queued after this see all of it.
    fn write_decode_table(
        &mut self,
        gpu: &Gpu,
        table: &mut ExpertTable,
        pending: &[(usize, usize, usize)],
    ) -> Result<()> {
        if self.res.is_lent() {
            return Err(GpuError::Hcs(
                "the decode table was asked for while prefill holds the reclaimable tier".into(),
            ));
        }
        let mut ptrs = self.decode_ptrs();
        for &(_, l, x) in pending {
            let k = l * self.num_experts + x;
            ptrs[k] = self.host_addrs[k];
        }
        table.write_all(gpu, &ptrs)?;
        self.tail.reset(gpu)?;
        self.tail.write_home(gpu, &ptrs)
    }

    /// The tail kernels' arguments over `table` for a decode step, or
    /// `None` while prefill holds the reclaimable tier.
    pub fn tail_args<'a>(&'a self, gpu: &Gpu, table: &ExpertTable) -> Option<TailLaunch<'a>> {
        (!self.res.is_lent()).then(|| self.tail.launch(gpu, table.base(gpu), &self.moe_layers))
    }

    /// Most experts decode prefetches per MoE layer into the tail (0: no
    /// prefetch; `tail.rs`).
    pub fn set_prefetch(&mut self, max: usize) {
        self.tail.prefetch_max = max;
    }

    pub fn prefetch(&self) -> usize {
        self.tail.prefetch_max
    }

    /// Queues the read-back of the tail's counters after a decode step on
    /// the compute stream and returns its set; [`Hcs::tally_step`] of that
    /// set counts them once the stream has passed this point (the caller's
    /// read of the sampled tokens).
    pub fn read_counters(&mut self, gpu: &Gpu) -> Result<usize> {
        self.tail.read_counters(gpu)
    }

    /// Adds the step read into `set` by [`Hcs::read_counters`] to the
    /// request's counters; the compute stream must have passed that copy.
    /// Steps are tallied in the order they ran.
    pub fn tally_step(&mut self, set: usize) {
        let d = self.tail.take_delta(set);
        let c = &mut self.res.counters;
        c.lookups += d.lookups;
        c.hits += d.hits;
        c.steps += 1;
        // A used prefetch would have been a miss; a wasted one crossed PCIe
        // for nothing and is counted apart.
        let cold = d.promoted + d.in_place + d.prefetch_used;
        let c = &mut self.copies;
        c.decode_cold_reads += cold;
        c.decode_bytes += cold * self.stride as u64;
        c.decode_promotions += d.promoted;
        c.prefetched += d.prefetched;
        c.prefetch_used += d.prefetch_used;
        c.prefetch_wasted += d.prefetch_wasted;
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

    /// Reloads the reclaimable prior after prefill and gives decode its
    /// table back, without making decode wait for the reload (a3b-24l at
    /// 6 GiB: 57 experts, ~2.6 ms, with the default split; ~14 ms for the
    /// 313 of the split before session 13):
    /// - the table and every key's home are written on the compute stream
    ///   with the prior's experts at their host bytes, so until its copy
    ///   lands a prior expert is a miss like any other (read through the
    ///   tail);
    /// - the copies run on the copy stream after everything queued on the
    ///   compute stream so far (the prefill's kernels, which use these
    ///   slots, and the table writes above), in `LANDING_CHUNK`s hottest
    ///   first, each followed by `tail_home` pointing the chunk's experts at
    ///   their landed slots while decode runs (`cuda/expert_tail.cu` says
    ///   why every interleaving with the lookups is exact).
    ///
    /// What writes the tier's slots next (the next prefill, which writes its
    /// grouped scratch and stages into the tier) calls [`Hcs::settle`]
    /// first, and so does anything that frees them.
    pub fn restore(&mut self, gpu: &Gpu, kn: &Kernels, table: &mut ExpertTable) -> Result<()> {
        let loads = self.res.restore_reclaimable();
        self.write_decode_table(gpu, table, &loads)?;
        let landing: Vec<u64> = loads
            .iter()
            .flat_map(|&(slot, l, x)| [(l * self.num_experts + x) as u64, self.slot_addr[slot]])
            .collect();
        self.copy_after_compute(gpu)?;
        self.tail.stage_landing(&self.copy, &landing)?;
        let base = table.base(gpu);
        for (i, chunk) in loads.chunks(LANDING_CHUNK).enumerate() {
            let first = i * LANDING_CHUNK;
            if !self.skips_reload() {
                let bytes = self.copy_experts(chunk)?;
                self.copies.reload_bytes += bytes;
            }
            self.tail
                .land(gpu, kn, &self.copy, base, first..first + chunk.len())?;
        }
        self.ev_reload
            .record(&self.copy)
            .map_err(GpuError::driver("recording the reload"))?;
        self.reload_pending = true;
        Ok(())
    }

    /// `Fault::SkipReload` (tests only): the reload's slots are pointed at
    /// without their copies.
    fn skips_reload(&self) -> bool {
        #[cfg(any(test, feature = "fault-injection"))]
        {
            self.skip_reload
        }
        #[cfg(not(any(test, feature = "fault-injection")))]
        {
            false
        }
    }

    /// [`Hcs::restore`], then the host waits until the reload has landed
    /// (setup and measurements, which hand over a loaded tier).
    fn restore_and_wait(
        &mut self,
        gpu: &Gpu,
        kn: &Kernels,
        table: &mut ExpertTable,
        what: &str,
    ) -> Result<()> {
        self.restore(gpu, kn, table)?;
        self.settle(gpu)?;
        gpu.sync(what)
    }

    /// The compute stream waits for the last reload of the prior, if it
    /// has not yet: before anything that lends, copies into or frees the
    /// reclaimable tier (a prefill, a measurement, teardown). Decode does
    /// not: it runs beside the reload ([`Hcs::restore`]).
    pub fn settle(&mut self, gpu: &Gpu) -> Result<()> {
        if std::mem::take(&mut self.reload_pending) {
            gpu.stream
                .wait(&self.ev_reload)
                .map_err(GpuError::driver("waiting for the reload"))?;
        }
        Ok(())
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
        kn: &Kernels,
        table: &mut ExpertTable,
        experts: usize,
    ) -> Result<(f64, f64, usize)> {
        self.settle(gpu)?;
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
        self.restore_and_wait(gpu, kn, table, "reloading after the copy measurement")?;
        self.copies = CopyStats::default();
        Ok((expert_gbps, big_gbps, big_len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whole slots only, in buffer order; a buffer smaller than a slot
    /// gives none.
    #[test]
    fn lent_buffers_give_whole_slots_in_order() {
        let bufs = [(0x1000, 250), (0x9000, 99), (0x20000, 300)];
        assert_eq!(
            Hcs::lent_slots(&bufs, 100),
            vec![0x1000, 0x1000 + 100, 0x20000, 0x20000 + 100, 0x20000 + 200]
        );
        assert!(Hcs::lent_slots(&[], 100).is_empty());
    }

    /// a3b-24l: 256 staging slots and 185 lent: the tail takes all 441,
    /// staging first; a tail always holds one step's pairs and at most
    /// every expert or `TAIL_MAX_SLOTS`; the prior takes the rest, at most
    /// every expert.
    #[test]
    fn the_reclaimable_tier_splits_into_prior_and_tail() {
        let s = |prior_staged, prior_lent, tail_staged, tail_lent| TierSplit {
            prior_staged,
            prior_lent,
            tail_staged,
            tail_lent,
        };
        assert_eq!(Hcs::split(24, 128, 8, 1, 1, 185, None), s(0, 0, 256, 185));
        assert_eq!(Hcs::split(24, 128, 8, 1, 1, 0, None), s(0, 0, 256, 0));
        // --hcs-tail 64: the rows of the session 13 sweep.
        assert_eq!(
            Hcs::split(24, 128, 8, 1, 8, 185, Some(64)),
            s(192, 185, 64, 0)
        );
        assert_eq!(
            Hcs::split(24, 128, 8, 1, 1, 185, Some(1000)),
            s(0, 0, 256, 185)
        );
        assert_eq!(Hcs::split(2, 128, 8, 1, 1, 0, None), s(0, 0, 256, 0));
        // One step of 8 rows x top-8 over 64 experts: 64 at least.
        assert_eq!(Hcs::split(2, 64, 8, 1, 8, 0, Some(16)), s(64, 0, 64, 0));
        // Every expert at most, for the tail and for the prior.
        assert_eq!(Hcs::split(1, 8, 2, 1, 1, 5, None), s(8, 0, 8, 0));
        // The device lookup's limit: 8,192 of 9,216 staging slots.
        assert_eq!(
            Hcs::split(48, 512, 10, 9, 1, 0, None),
            s(1024, 0, krasis_kernels::TAIL_MAX_SLOTS, 0)
        );
        assert_eq!(Hcs::split(1, 8, 2, 1, 1, 5, Some(14)), s(2, 5, 14, 0));
    }
}
