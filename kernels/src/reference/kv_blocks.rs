//! CPU reference of `cuda/kv_blocks.cu`: the same index arithmetic, one
//! element at a time.

use crate::ops::kv_blocks::{BlockCopy, KvBlockGeom};

/// [`crate::Kernels::kv_blocks_copy`] on host buffers: `k[l]`, `v[l]` are
/// layer `l`'s `[heads][capacity][head_dim]` caches, `pool` the slots,
/// `pairs` (slot, block) pairs of the sequence whose rows start at `base`.
pub fn kv_blocks_copy(
    k: &mut [Vec<u16>],
    v: &mut [Vec<u16>],
    geom: KvBlockGeom,
    base: usize,
    pool: &mut [u16],
    pairs: &[(u32, u32)],
    dir: BlockCopy,
) {
    let g = geom;
    let run = g.run();
    for &(slot, block) in pairs {
        let (slot, block) = (slot as usize, block as usize);
        assert!(
            base + (block + 1) * g.block_tokens <= g.capacity,
            "block {block} past the cache"
        );
        for l in 0..g.layers {
            for (w, cache) in [&mut k[l], &mut v[l]].into_iter().enumerate() {
                for h in 0..g.heads {
                    let s = (h * g.capacity + base) * g.head_dim + block * run;
                    let p = slot * g.slot_elems() + ((l * 2 + w) * g.heads + h) * run;
                    for e in 0..run {
                        match dir {
                            BlockCopy::ToPool => pool[p + e] = cache[s + e],
                            BlockCopy::ToSequence => cache[s + e] = pool[p + e],
                        }
                    }
                }
            }
        }
    }
}
