//! HCS decode's recency tail on the device: the lookup and LRU promotion of
//! one MoE layer's routed experts, and the copy of the promoted experts
//! from mapped page-locked host memory (`cuda/expert_tail.cu`, which
//! describes the state and the policy; the CPU reference is
//! [`crate::reference::TailState`]).

use cudarc::driver::{CudaStream, DevicePtr, PushKernelArg};

use crate::launch::{builder, cfg, check_len, dim_u32, ensure, submit};
use crate::{Kernels, Result};

/// Most (row, expert) pairs one lookup takes (one thread each).
pub const TAIL_MAX_PAIRS: usize = 256;
/// "No slot" / "no owner" in `tail_of` and `owner`.
pub const TAIL_NONE: u32 = u32::MAX;
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
    /// u32 `[layers * experts]`.
    pub tail_of: u64,
    /// u32 `[tail]`.
    pub owner: u64,
    /// u32 `[tail]`.
    pub stamp: u64,
    /// u64 `[tail]`: slot addresses.
    pub slot: u64,
    /// u32 `[1]`.
    pub clock: u64,
    /// u64 `[2 * max_pairs]`.
    pub fetch: u64,
    /// u32 `[1]`.
    pub n_fetch: u64,
    /// u64 `[4]`: lookups, hits, promoted, read in place.
    pub counters: u64,
    pub layers: usize,
    pub experts: usize,
    pub tail: usize,
    pub max_pairs: usize,
    /// Bytes of one expert block (a multiple of 16).
    pub expert_bytes: usize,
}

impl Kernels {
    /// [`Kernels::tail_lookup`] then [`Kernels::tail_fetch`]: afterwards
    /// MoE layer `layer`'s table entries name bytes equal to each selected
    /// expert's block.
    pub fn expert_tail(
        &self,
        stream: &CudaStream,
        t: &ExpertTail,
        layer: usize,
        ids: &impl DevicePtr<u32>,
        n_pairs: usize,
    ) -> Result<()> {
        self.tail_lookup(stream, t, layer, ids, n_pairs)?;
        self.tail_fetch(stream, t)
    }

    /// Looks up MoE layer `layer`'s `n_pairs` selected experts (`ids`) and
    /// promotes its misses into the tail, writing the fetch list (the
    /// table already names the slots: [`Kernels::tail_fetch`] must run
    /// before anything reads them).
    pub fn tail_lookup(
        &self,
        stream: &CudaStream,
        t: &ExpertTail,
        layer: usize,
        ids: &impl DevicePtr<u32>,
        n_pairs: usize,
    ) -> Result<()> {
        const K: &str = "tail_lookup";
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
        dim_u32(K, "layers * experts", t.layers * t.experts)?;
        let (ip, _g) = ids.device_ptr(stream);
        let f = self.func(K)?;
        let mut b = builder(stream, f);
        b.arg(&t.table)
            .arg(&t.host)
            .arg(&t.tail_of)
            .arg(&t.owner)
            .arg(&t.stamp)
            .arg(&t.slot)
            .arg(&t.clock)
            .arg(&t.fetch)
            .arg(&t.n_fetch)
            .arg(&t.counters);
        b.arg(&ip).arg(&n).arg(&l).arg(&e).arg(&tail);
        submit(K, b, cfg((1, 1, 1), 256, 0))
    }

    /// Copies the last lookup's fetch list (host bytes into tail slots).
    pub fn tail_fetch(&self, stream: &CudaStream, t: &ExpertTail) -> Result<()> {
        const F: &str = "tail_fetch";
        let vecs = (t.expert_bytes / 16) as u64;
        let f = self.func(F)?;
        let mut b = builder(stream, f);
        b.arg(&t.fetch).arg(&t.n_fetch).arg(&vecs);
        submit(F, b, cfg((FETCH_BLOCKS, 1, 1), 256, 0))
    }
}
