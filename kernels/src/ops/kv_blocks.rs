//! Prefix-cache block copies between the layers' KV caches and a block pool
//! in device or mapped page-locked host memory (`cuda/kv_blocks.cu`).

use cudarc::driver::{CudaStream, DevicePtr, PushKernelArg};

use crate::launch::{builder, cfg, check_len, dim_u32, ensure, submit};
use crate::{Kernels, Result};

/// The block layout both sides share: `layers` layers of `heads` KV heads
/// of `head_dim`, blocks of `block_tokens` positions, a KV cache of
/// `capacity` positions per head (`[head][capacity][head_dim]`) in which a
/// sequence's rows from its base are linear (`ring == 0`: block `b` at
/// rows `b * B ..`) or a ring of `ring` rows, a whole number of blocks
/// (block `b` at ring block `b % (ring / B)`: gpt-oss's sliding layers,
/// `ops/attention/ring.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvBlockGeom {
    pub layers: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub block_tokens: usize,
    pub capacity: usize,
    pub ring: usize,
}

impl KvBlockGeom {
    /// 16-bit elements of one block of one (layer, K/V, head).
    pub fn run(&self) -> usize {
        self.block_tokens * self.head_dim
    }

    /// 16-bit elements of one pool slot (a whole block).
    pub fn slot_elems(&self) -> usize {
        self.layers * 2 * self.heads * self.run()
    }

    /// Whole blocks a head's cache holds.
    pub fn blocks_per_head(&self) -> usize {
        self.blocks_after(0)
    }

    /// Whole blocks a sequence whose rows start at row `base` can hold
    /// (a ring: its blocks, if it lies in the cache).
    pub fn blocks_after(&self, base: usize) -> usize {
        let b = self.block_tokens.max(1);
        match self.ring {
            0 => self.capacity.saturating_sub(base) / b,
            r if base + r <= self.capacity => r / b,
            _ => 0,
        }
    }

    /// Blocks of one sequence's ring (0: linear rows).
    pub fn ring_blocks(&self) -> usize {
        self.ring / self.block_tokens.max(1)
    }
}

/// Which way a [`Kernels::kv_blocks_copy`] moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockCopy {
    /// Pool slots into the sequence's KV (a prefix cache hit).
    ToSequence,
    /// The sequence's KV into pool slots (storing a prefill's blocks).
    ToPool,
}

impl Kernels {
    /// Moves `n_pairs` blocks: pair `i` (`pairs[2i]`, `pairs[2i + 1]`) =
    /// (pool slot, block index), between positions `block * B ..` of the
    /// sequence whose rows start at row `base` (in its ring, with
    /// `geom.ring`) of every layer's K and V (`layer_k[l]`, `layer_v[l]`:
    /// device addresses of 16-bit `[heads][capacity][head_dim]` buffers; a
    /// layer at address 0 is left alone) and slot `slot` of the
    /// pool at address `pool` (`pool_slots` slots of
    /// [`KvBlockGeom::slot_elems`], device memory or page-locked host
    /// memory mapped into the device; 16-byte aligned). Bits are copied, so
    /// it serves bf16 and f16 caches. The device traps on a pair out of
    /// range; the caller checks the pairs it uploads.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_blocks_copy(
        &self,
        stream: &CudaStream,
        layer_k: &impl DevicePtr<u64>,
        layer_v: &impl DevicePtr<u64>,
        geom: KvBlockGeom,
        base: usize,
        pool: u64,
        pool_slots: usize,
        pairs: &impl DevicePtr<u32>,
        n_pairs: usize,
        dir: BlockCopy,
    ) -> Result<()> {
        const K: &str = "kv_blocks_copy";
        let g = geom;
        ensure(
            K,
            g.layers > 0 && g.heads > 0 && g.run() > 0 && g.run().is_multiple_of(8),
            || format!("{g:?}: block_tokens * head_dim must be a positive multiple of 8"),
        )?;
        ensure(K, pool.is_multiple_of(16), || {
            format!("pool address {pool:#x} is not 16-byte aligned")
        })?;
        ensure(
            K,
            g.ring.is_multiple_of(g.block_tokens.max(1)) && g.blocks_after(base) > 0,
            || format!("{g:?} at row {base}: a ring of whole blocks inside the cache"),
        )?;
        ensure(
            K,
            base < g.capacity && (base * g.head_dim).is_multiple_of(8),
            || {
                format!(
                    "sequence base row {base} of {g:?}: inside the cache, at a 16-byte boundary"
                )
            },
        )?;
        check_len(K, "layer_k", layer_k.len(), g.layers)?;
        check_len(K, "layer_v", layer_v.len(), g.layers)?;
        check_len(K, "pairs", pairs.len(), 2 * n_pairs)?;
        let grid = n_pairs as u64 * g.layers as u64 * 2 * g.heads as u64;
        ensure(K, grid < (1u64 << 31), || {
            format!("{n_pairs} blocks of {g:?} exceed the grid")
        })?;
        let head_stride = (g.capacity * g.head_dim) as u64;
        let seq_offset = (base * g.head_dim) as u64;
        let (slots, n, layers, heads, run, bph, ring_blocks) = (
            dim_u32(K, "pool_slots", pool_slots)?,
            dim_u32(K, "n_pairs", n_pairs)?,
            dim_u32(K, "layers", g.layers)?,
            dim_u32(K, "heads", g.heads)?,
            dim_u32(K, "block_tokens * head_dim", g.run())?,
            dim_u32(K, "blocks per head", g.blocks_after(base))?,
            dim_u32(K, "ring blocks", g.ring_blocks())?,
        );
        let to_pool = u32::from(dir == BlockCopy::ToPool);
        let f = self.func(K)?;
        let (kp, _g1) = layer_k.device_ptr(stream);
        let (vp, _g2) = layer_v.device_ptr(stream);
        let (pp, _g3) = pairs.device_ptr(stream);
        let mut b = builder(stream, f);
        b.arg(&kp)
            .arg(&vp)
            .arg(&head_stride)
            .arg(&seq_offset)
            .arg(&pool)
            .arg(&slots);
        b.arg(&pp)
            .arg(&n)
            .arg(&layers)
            .arg(&heads)
            .arg(&run)
            .arg(&bph)
            .arg(&ring_blocks);
        b.arg(&to_pool);
        submit(K, b, cfg((grid as u32, 1, 1), 256, 0))
    }
}
