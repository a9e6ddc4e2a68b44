//! HCS decode's recency tail on the device: the lookup and LRU promotion of
//! one MoE layer's routed experts, and the copy of the promoted experts
//! from mapped page-locked host memory (`cuda/expert_tail.cu`, which
//! describes the state and the policy; the CPU reference is
//! [`crate::reference::TailState`]).

use std::ffi::c_void;

use cudarc::driver::{CudaStream, DevicePtr, PushKernelArg};

use crate::launch::{builder, cfg, check_len, dim_u32, ensure, launch_dependent, submit};
use crate::{Kernels, Result};

/// Most (row, expert) pairs one lookup takes (one thread each).
pub const TAIL_MAX_PAIRS: usize = 256;
/// Most tail slots a lookup takes (their stamps are staged in the block's
/// shared memory, 32 KiB).
pub const TAIL_MAX_SLOTS: usize = 8192;
/// Bit 0 of a table entry: a tail slot this step's demand lookup promoted,
/// whose copy may still run (`cuda/common.cuh`, `TABLE_FRESH`).
pub const TABLE_FRESH: u64 = 1;
/// "No slot" / "no owner" in `tail_of` and `owner`.
pub const TAIL_NONE: u32 = u32::MAX;
/// Cumulative counters of the tail state (`cuda/expert_tail.cu`).
pub const TAIL_COUNTERS: usize = 8;

/// What a [`Kernels::tail_lookup`] launch is for (`cuda/expert_tail.cu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TailMode {
    /// The layer's routed experts, which its GEMVs read next.
    Demand,
    /// Predicted experts of a layer that has not routed yet: at most `max`
    /// promoted, sparing the slots of the previous (demand) launch.
    Prefetch { max: usize },
    /// Fault injection only (`Fault::UnmarkedFetch`): a demand lookup
    /// whose promotions are not marked fresh, so GEMVs launched to overlap
    /// the fetch read the slots before their copies land. Never correct.
    DemandUnmarked,
}
/// Blocks of the fetch launch: enough 256-thread blocks to keep PCIe reads
/// in flight on any part this engine supports (kbench: 132 to 1,056 blocks
/// read mapped host memory at the same 46-51 GB/s on the H200).
const FETCH_BLOCKS: u32 = 264;

/// Device addresses of the tail's state (layout in `cuda/expert_tail.cu`),
/// owned by the caller for as long as launches may use them; plain
/// addresses so a captured decode graph replays against the same buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertTail {
    /// u64 `[layers * experts]`: the expert pointer table.
    pub table: u64,
    /// u64 `[layers * experts]`: each expert's mapped host address.
    pub host: u64,
    /// u64 `[layers * experts]`: where an evicted expert's table entry
    /// returns (its host address, or its landed prior slot:
    /// [`Kernels::tail_home`]).
    pub home: u64,
    /// u32 `[layers * experts]`.
    pub tail_of: u64,
    /// u32 `[tail]`.
    pub owner: u64,
    /// u32 `[tail]`.
    pub stamp: u64,
    /// u32 `[tail]`.
    pub pending: u64,
    /// u64 `[tail]`: slot addresses.
    pub slot: u64,
    /// u32 `[1]`.
    pub clock: u64,
    /// u64 `[2 * max_pairs]`.
    pub fetch: u64,
    /// u32 `[1]`.
    pub n_fetch: u64,
    /// u64 `[TAIL_COUNTERS]`: lookups, hits, promoted, read in place;
    /// predicted, prefetched, prefetches used, prefetches wasted.
    pub counters: u64,
    pub layers: usize,
    pub experts: usize,
    pub tail: usize,
    /// Experts per row: a launch's ids are `[rows, top_k]`.
    pub top_k: usize,
    pub max_pairs: usize,
    /// Bytes of one expert block (a multiple of 16).
    pub expert_bytes: usize,
}

impl Kernels {
    /// Looks up MoE layer `layer`'s `n_pairs` selected (or, in
    /// [`TailMode::Prefetch`], predicted) experts (`ids`, `[rows, top_k]`)
    /// and promotes its misses into the tail, writing `t`'s fetch list (the
    /// table already names the slots: [`Kernels::tail_fetch`] over the same
    /// `t` must run right after, before anything reads them). A demand
    /// launch marks the promoted table entries fresh (bit 0): the GEMVs
    /// launched right after the fetch wait for it where they meet one, and
    /// strip the bit anywhere (`cuda/common.cuh`). On sm_90+ it launches as
    /// a programmatic dependent of the kernel before it on `stream`
    /// (normally the router, which writes `ids`): it reads only its own
    /// state (stamps, clock) before that kernel has completed.
    pub fn tail_lookup(
        &self,
        stream: &CudaStream,
        t: &ExpertTail,
        layer: usize,
        ids: &impl DevicePtr<u32>,
        n_pairs: usize,
        mode: TailMode,
    ) -> Result<()> {
        const K: &str = "tail_lookup";
        ensure(K, t.top_k > 0 && n_pairs.is_multiple_of(t.top_k), || {
            format!("{n_pairs} pairs: whole rows of top_k = {}", t.top_k)
        })?;
        ensure(K, layer < t.layers, || {
            format!("MoE layer {layer} of {} layers", t.layers)
        })?;
        ensure(
            K,
            (1..=t.max_pairs.min(TAIL_MAX_PAIRS)).contains(&n_pairs),
            || {
                format!(
                    "{n_pairs} pairs: 1..={} (the fetch list's room, at most {TAIL_MAX_PAIRS})",
                    t.max_pairs.min(TAIL_MAX_PAIRS)
                )
            },
        )?;
        ensure(
            K,
            t.expert_bytes > 0 && t.expert_bytes.is_multiple_of(16),
            || {
                format!(
                    "expert blocks of {} bytes: a positive multiple of 16",
                    t.expert_bytes
                )
            },
        )?;
        check_len(K, "ids", ids.len(), n_pairs)?;
        let (n, l, e, tail) = (
            dim_u32(K, "n_pairs", n_pairs)?,
            dim_u32(K, "layer", layer)?,
            dim_u32(K, "experts", t.experts)?,
            dim_u32(K, "tail", t.tail)?,
        );
        ensure(K, t.tail <= TAIL_MAX_SLOTS, || {
            format!(
                "a tail of {} slots: at most {TAIL_MAX_SLOTS} (their stamps are staged in shared memory)",
                t.tail
            )
        })?;
        dim_u32(K, "layers * experts", t.layers * t.experts)?;
        let (prefetch, max) = match mode {
            TailMode::Demand => (0u32, u32::MAX),
            TailMode::Prefetch { max } => (1, max.try_into().unwrap_or(u32::MAX)),
            TailMode::DemandUnmarked => (2, u32::MAX),
        };
        let k = dim_u32(K, "top_k", t.top_k)?;
        let (ip, _g) = ids.device_ptr(stream);
        let f = self.func(K)?;
        let config = cfg((1, 1, 1), 256, 0);
        if self.compute_capability().0 >= 9 {
            let mut args: Vec<*mut c_void> = [
                &t.table,
                &t.host,
                &t.home,
                &t.tail_of,
                &t.owner,
                &t.stamp,
                &t.pending,
                &t.slot,
                &t.clock,
                &t.fetch,
                &t.n_fetch,
                &t.counters,
                &ip,
            ]
            .into_iter()
            .map(|a| a as *const u64 as *mut c_void)
            .collect();
            for v in [&n, &l, &e, &tail, &k, &prefetch, &max] {
                args.push(v as *const u32 as *mut c_void);
            }
            // SAFETY: the arguments match tail_lookup's parameters in order
            // and type and point to values that outlive the call; the
            // addresses are the caller's live tail state and `ids`.
            return unsafe { launch_dependent(K, stream, f, config, &mut args) };
        }
        let mut b = builder(stream, f);
        b.arg(&t.table)
            .arg(&t.host)
            .arg(&t.home)
            .arg(&t.tail_of)
            .arg(&t.owner)
            .arg(&t.stamp)
            .arg(&t.pending)
            .arg(&t.slot)
            .arg(&t.clock)
            .arg(&t.fetch)
            .arg(&t.n_fetch)
            .arg(&t.counters);
        b.arg(&ip).arg(&n).arg(&l).arg(&e).arg(&tail);
        b.arg(&k).arg(&prefetch).arg(&max);
        submit(K, b, config)
    }

    /// Copies the last lookup's fetch list (host bytes into tail slots).
    /// On sm_90+ it launches as a programmatic dependent of that lookup,
    /// which must be the kernel launched right before it on `stream`: it
    /// starts early and waits for the lookup before it reads the list.
    pub fn tail_fetch(&self, stream: &CudaStream, t: &ExpertTail) -> Result<()> {
        const F: &str = "tail_fetch";
        let vecs = (t.expert_bytes / 16) as u64;
        let f = self.func(F)?;
        let config = cfg((FETCH_BLOCKS, 1, 1), 256, 0);
        if self.compute_capability().0 >= 9 {
            let mut args: Vec<*mut c_void> = vec![
                &t.fetch as *const u64 as *mut c_void,
                &t.n_fetch as *const u64 as *mut c_void,
                &vecs as *const u64 as *mut c_void,
            ];
            // SAFETY: the arguments match tail_fetch's parameters in order
            // and type and point to values that outlive the call; the
            // addresses are the caller's live tail state.
            return unsafe { launch_dependent(F, stream, f, config, &mut args) };
        }
        let mut b = builder(stream, f);
        b.arg(&t.fetch).arg(&t.n_fetch).arg(&vecs);
        submit(F, b, config)
    }

    /// Points `n` experts at slots that now hold them: for each (key,
    /// address) pair of `list` (u64 `[2 * n]`), `home[key]` and
    /// `table[key]` become the address. Meant for another stream than the
    /// lookups' (a reload's copy stream, after the copies it names): every
    /// interleaving with them is exact (`cuda/expert_tail.cu`).
    pub fn tail_home(
        &self,
        stream: &CudaStream,
        t: &ExpertTail,
        list: u64,
        n: usize,
    ) -> Result<()> {
        const K: &str = "tail_home";
        if n == 0 {
            return Ok(());
        }
        let n32 = dim_u32(K, "n", n)?;
        let f = self.func(K)?;
        let mut b = builder(stream, f);
        b.arg(&t.table).arg(&t.home).arg(&list).arg(&n32);
        submit(K, b, cfg((n32.div_ceil(256), 1, 1), 256, 0))
    }
}
