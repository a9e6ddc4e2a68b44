//! The recency tail of HCS decode, kept on the device.
//!
//! The last slots of the reclaimable tier hold recently missed experts.
//! After each decode router, `tail_lookup` (`cuda/expert_tail.cu`, which
//! describes the policy) looks the layer's selected experts up in the
//! pointer table, promotes the misses into the least recently used tail
//! slots, and `tail_fetch` copies them there from the mapped page-locked
//! backing, all on the compute stream: no host round trip, and the decode
//! step stays one CUDA graph. A miss the tail cannot take in that launch
//! (every slot used by it) is read in place by the GEMVs. The device owns
//! the tail's placement during decode; the host reads only the cumulative
//! counters after each step ([`Tail::read_counters`]). Prefill borrows the
//! tail's memory with the rest of the reclaimable tier, so [`Tail::reset`]
//! empties it whenever the decode table is rewritten.
//!
//! Prefetch (on when [`Tail::prefetch_max`] > 0): the copies above wait
//! for the router, so PCIe idles while attention runs. After a layer's
//! fetch the compute stream predicts the next MoE layer's experts (its
//! router over the current residual, `moe.rs`) and forks to [`Tail`]'s
//! side stream, which promotes and copies the best-ranked predictions
//! (`TailMode::Prefetch`) while the layer's GEMVs and the next layer's
//! attention run; the next layer's demand lookup waits for it
//! ([`Prefetch`]). A right guess is then a hit; a wrong one cost PCIe time
//! and a tail slot, never a result. Off by default: on the H200 the extra
//! router, the joins and the side copy's SMs cost more than the hidden
//! copies save (`benchmarks/results/2026-12-03-issue16-prefetch.md`).

use super::pinned::PinnedBuf;
use crate::device::{Gpu, addr};
use crate::error::{GpuError, Result};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, sys};
use krasis_kernels::{ExpertTail, Kernels, TAIL_COUNTERS, TAIL_MAX_PAIRS, TAIL_NONE};
use std::sync::Arc;

/// Counters of the tail since the last [`Tail::take_delta`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TailDelta {
    /// (row, expert) pairs looked up.
    pub lookups: u64,
    /// Pairs whose expert was in a slot.
    pub hits: u64,
    /// Experts copied into the tail.
    pub promoted: u64,
    /// Pairs whose expert was read in place from host memory.
    pub in_place: u64,
    /// Predicted (row, expert) pairs of prefetch launches.
    pub predicted: u64,
    /// Experts copied into the tail by prefetch launches.
    pub prefetched: u64,
    /// Prefetched experts a demand lookup then used.
    pub prefetch_used: u64,
    /// Prefetched experts evicted before any use.
    pub prefetch_wasted: u64,
}

/// What a decode step's MoE layers launch the tail with (`moe.rs`).
#[derive(Clone, Copy)]
pub struct TailLaunch<'a> {
    /// The demand lookup's arguments (the compute stream's fetch list).
    pub demand: ExpertTail,
    /// `None` when prefetch is off.
    pub prefetch: Option<Prefetch<'a>>,
}

/// The prefetch side of a decode step: MoE layer `m` (a decoder layer
/// `moe_layers[m]`) predicts layer `m + 1`, records `fork` on the compute
/// stream, and `stream` waits for it, launches the prefetch lookup and
/// fetch (its own fetch list, `args`) and records `done`, which layer
/// `m + 1` waits for before its demand lookup. Every prefetch is waited
/// for within the step, so a captured graph joins the side stream back.
#[derive(Clone, Copy)]
pub struct Prefetch<'a> {
    pub args: ExpertTail,
    /// Most experts promoted per prefetch launch.
    pub max: usize,
    pub stream: &'a CudaStream,
    pub fork: &'a CudaEvent,
    pub done: &'a CudaEvent,
    /// The decoder layer of each MoE layer.
    pub moe_layers: &'a [usize],
}

pub struct Tail {
    host: CudaSlice<u64>,
    /// Where an evicted expert's table entry returns (`cuda/expert_tail.cu`).
    home: CudaSlice<u64>,
    /// (key, slot address) pairs of the prior's reload, pointed at chunk by
    /// chunk as they land ([`Tail::land`]).
    landing: CudaSlice<u64>,
    tail_of: CudaSlice<u32>,
    owner: CudaSlice<u32>,
    stamp: CudaSlice<u32>,
    pending: CudaSlice<u32>,
    slot: CudaSlice<u64>,
    clock: CudaSlice<u32>,
    fetch: CudaSlice<u64>,
    n_fetch: CudaSlice<u32>,
    pf_fetch: CudaSlice<u64>,
    pf_n_fetch: CudaSlice<u32>,
    counters: CudaSlice<u64>,
    /// Two read-back sets, used in turn: a decode step queued ahead
    /// (`batch/ahead.rs`) copies its counters into one while the host
    /// reads the step before it from the other.
    counters_host: [PinnedBuf<u64>; 2],
    /// The set the next [`Tail::read_counters`] copies into.
    counters_next: usize,
    /// The counters at the last [`Tail::take_delta`].
    seen: [u64; TAIL_COUNTERS],
    slots: usize,
    layers: usize,
    experts: usize,
    top_k: usize,
    max_pairs: usize,
    expert_bytes: usize,
    /// Most experts prefetched per MoE layer (0: no prefetch).
    pub prefetch_max: usize,
    side: Arc<CudaStream>,
    fork: CudaEvent,
    done: CudaEvent,
}

impl Tail {
    /// `host[k]`: the mapped host address of key `k` (`moe_layer *
    /// experts + expert`); `slots`: the tail slots' device addresses;
    /// steps of up to `rows` rows of `top_k` experts.
    pub fn new(
        gpu: &Gpu,
        experts: usize,
        host: &[u64],
        slots: &[u64],
        (rows, top_k): (usize, usize),
        expert_bytes: usize,
    ) -> Result<Self> {
        let max_pairs = rows * top_k;
        if experts == 0
            || top_k == 0
            || !host.len().is_multiple_of(experts)
            || !(1..=TAIL_MAX_PAIRS).contains(&max_pairs)
            || !expert_bytes.is_multiple_of(16)
        {
            return Err(GpuError::Hcs(format!(
                "a decode tail over {} experts in layers of {experts}, steps of {rows} rows of \
                 top-{top_k} ({max_pairs} pairs: 1..={TAIL_MAX_PAIRS}) and expert blocks of \
                 {expert_bytes} bytes (a multiple of 16)",
                host.len()
            )));
        }
        let event = |what: &str| {
            gpu.ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(GpuError::driver(what))
        };
        let n = slots.len().max(1);
        let mut slot_addrs = slots.to_vec();
        slot_addrs.resize(n, 0);
        let mut t = Tail {
            host: gpu.upload(host, "decode tail: host addresses")?,
            home: gpu.upload(host, "decode tail: home addresses")?,
            landing: gpu.alloc_zeros::<u64>(2 * host.len(), "decode tail: landing list")?,
            tail_of: gpu.alloc::<u32>(host.len(), "decode tail: slot of each expert")?,
            owner: gpu.alloc::<u32>(n, "decode tail: slot owners")?,
            stamp: gpu.alloc::<u32>(n, "decode tail: slot stamps")?,
            pending: gpu.alloc::<u32>(n, "decode tail: prefetched slots")?,
            slot: gpu.upload(&slot_addrs, "decode tail: slot addresses")?,
            clock: gpu.alloc_zeros::<u32>(1, "decode tail: clock")?,
            fetch: gpu.alloc_zeros::<u64>(2 * max_pairs, "decode tail: fetch list")?,
            n_fetch: gpu.alloc_zeros::<u32>(1, "decode tail: fetch count")?,
            pf_fetch: gpu.alloc_zeros::<u64>(2 * max_pairs, "decode tail: prefetch list")?,
            pf_n_fetch: gpu.alloc_zeros::<u32>(1, "decode tail: prefetch count")?,
            counters: gpu.alloc_zeros::<u64>(TAIL_COUNTERS, "decode tail: counters")?,
            counters_host: [
                PinnedBuf::new(&gpu.ctx, TAIL_COUNTERS, "decode tail counters")?,
                PinnedBuf::new(&gpu.ctx, TAIL_COUNTERS, "decode tail counters")?,
            ],
            counters_next: 0,
            seen: [0; TAIL_COUNTERS],
            slots: slots.len(),
            layers: host.len() / experts,
            experts,
            top_k,
            max_pairs,
            expert_bytes,
            prefetch_max: 0,
            side: gpu
                .ctx
                .new_stream()
                .map_err(GpuError::driver("creating the prefetch stream"))?,
            fork: event("creating the prefetch fork event")?,
            done: event("creating the prefetch done event")?,
        };
        t.reset(gpu)?;
        Ok(t)
    }

    /// Device bytes [`Tail::new`] allocates for `keys` experts, `slots`
    /// tail slots and steps of `max_pairs` pairs.
    pub fn device_bytes(keys: usize, slots: usize, max_pairs: usize) -> usize {
        let n = slots.max(1);
        keys * (8 + 8 + 16 + 4)
            + n * (4 + 4 + 4 + 8)
            + 4
            + 2 * (2 * max_pairs * 8 + 4)
            + TAIL_COUNTERS * 8
    }

    /// Page-locked bytes of the counters' read-back sets.
    pub fn pinned_bytes(&self) -> usize {
        self.counters_host.iter().map(|b| b.bytes()).sum()
    }

    /// Empties the tail (ordered on the compute stream): after the decode
    /// table was rewritten without it.
    pub fn reset(&mut self, gpu: &Gpu) -> Result<()> {
        let s = &gpu.stream;
        s.memset_zeros(&mut self.stamp)
            .and_then(|_| s.memset_zeros(&mut self.pending))
            .and_then(|_| s.memset_zeros(&mut self.clock))
            .map_err(GpuError::driver("emptying the decode tail"))?;
        let none = vec![TAIL_NONE; self.tail_of.len()];
        s.memcpy_htod(&none, &mut self.tail_of)
            .and_then(|_| s.memcpy_htod(&none[..self.owner.len()], &mut self.owner))
            .map_err(GpuError::driver("emptying the decode tail"))
    }

    /// Sets every key's home to `ptrs` (the decode table just written, on
    /// the compute stream).
    pub fn write_home(&mut self, gpu: &Gpu, ptrs: &[u64]) -> Result<()> {
        gpu.stream
            .memcpy_htod(ptrs, &mut self.home)
            .map_err(GpuError::driver("writing the decode tail's home addresses"))
    }

    /// Uploads the (key, slot address) pairs a reload will land, on
    /// `stream` (the copy stream, before the copies).
    pub fn stage_landing(&mut self, stream: &Arc<CudaStream>, pairs: &[u64]) -> Result<()> {
        if pairs.len() > self.landing.len() {
            return Err(GpuError::Hcs(format!(
                "{} landing pairs for a table of {} experts",
                pairs.len() / 2,
                self.landing.len() / 2
            )));
        }
        if pairs.is_empty() {
            return Ok(());
        }
        let mut dst = self.landing.slice_mut(..pairs.len());
        stream
            .memcpy_htod(pairs, &mut dst)
            .map_err(GpuError::driver("uploading the reload's landing list"))
    }

    /// Points pairs `range` of the landing list at their slots, on
    /// `stream` after their copies (`tail_home`).
    pub fn land(
        &self,
        gpu: &Gpu,
        kn: &Kernels,
        stream: &CudaStream,
        table: u64,
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        let list = addr(&self.landing, stream) + (range.start * 16) as u64;
        kn.tail_home(stream, &self.args(gpu, table), list, range.len())
            .map_err(GpuError::from)
    }

    /// What a decode step launches over the pointer table at `table`
    /// (device address of its `layers * experts` entries); `moe_layers`:
    /// the decoder layer of each MoE layer.
    pub fn launch<'a>(&'a self, gpu: &Gpu, table: u64, moe_layers: &'a [usize]) -> TailLaunch<'a> {
        let demand = self.args(gpu, table);
        let s = &gpu.stream;
        let prefetch = (self.prefetch_max > 0).then(|| Prefetch {
            args: ExpertTail {
                fetch: addr(&self.pf_fetch, s),
                n_fetch: addr(&self.pf_n_fetch, s),
                ..demand
            },
            max: self.prefetch_max,
            stream: &self.side,
            fork: &self.fork,
            done: &self.done,
            moe_layers,
        });
        TailLaunch { demand, prefetch }
    }

    /// The demand lookup's kernel arguments over the pointer table at
    /// `table`.
    fn args(&self, gpu: &Gpu, table: u64) -> ExpertTail {
        let s = &gpu.stream;
        ExpertTail {
            table,
            host: addr(&self.host, s),
            home: addr(&self.home, s),
            tail_of: addr(&self.tail_of, s),
            owner: addr(&self.owner, s),
            stamp: addr(&self.stamp, s),
            pending: addr(&self.pending, s),
            slot: addr(&self.slot, s),
            clock: addr(&self.clock, s),
            fetch: addr(&self.fetch, s),
            n_fetch: addr(&self.n_fetch, s),
            counters: addr(&self.counters, s),
            layers: self.layers,
            experts: self.experts,
            tail: self.slots,
            top_k: self.top_k,
            max_pairs: self.max_pairs,
            expert_bytes: self.expert_bytes,
        }
    }

    /// Queues the read-back of the counters on the compute stream into
    /// the next of the two sets, and returns it; [`Tail::take_delta`] of
    /// that set reads them once the stream has passed the copy. The sets
    /// alternate, so a set is rewritten two read-backs later: the caller
    /// reads each set before it queues the read-back after the next.
    pub fn read_counters(&mut self, gpu: &Gpu) -> Result<usize> {
        let set = self.counters_next;
        self.counters_next ^= 1;
        // SAFETY: the set holds TAIL_COUNTERS pinned u64 and is not read on
        // the host before the stream has passed this copy (take_delta's
        // contract).
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                self.counters_host[set].as_mut_slice(),
                addr(&self.counters, &gpu.stream),
                gpu.stream.cu_stream(),
            )
        }
        .map_err(GpuError::driver("reading the decode tail counters"))?;
        Ok(set)
    }

    /// What the counters read into `set` by [`Tail::read_counters`] add
    /// since the last call; the compute stream must have passed that copy.
    /// Sets are taken in the order they were read (the counters are
    /// cumulative).
    pub fn take_delta(&mut self, set: usize) -> TailDelta {
        let now: [u64; TAIL_COUNTERS] = self.counters_host[set & 1]
            .as_slice()
            .try_into()
            .unwrap_or(self.seen);
        let d = |i: usize| now[i].saturating_sub(self.seen[i]);
        let delta = TailDelta {
            lookups: d(0),
            hits: d(1),
            promoted: d(2),
            in_place: d(3),
            predicted: d(4),
            prefetched: d(5),
            prefetch_used: d(6),
            prefetch_wasted: d(7),
        };
        self.seen = now;
        delta
    }
}
