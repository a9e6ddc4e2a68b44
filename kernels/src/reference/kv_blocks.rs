//! CPU reference of `cuda/kv_blocks.cu`: the same index arithmetic, one
//! element at a time.

use crate::ops::kv_blocks::{BlockCopy, KvBlockGeom};

/// [`crate::Kernels::kv_blocks_copy`] on host buffers: `k[l]`, `v[l]` are
/// layer `l`'s `[heads][capacity][head_dim]` caches (empty: a layer the
/// launch leaves alone, address 0 on the device), `pool` the slots,
/// `pairs` (slot, block) pairs of the sequence whose rows start at `base`
/// (its ring's, with `geom.ring`).
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
        let row_block = match g.ring_blocks() {
            0 => block,
            rb => block % rb,
        };
        assert!(
            row_block < g.blocks_after(base),
            "block {block} past the cache"
        );
        for l in 0..g.layers {
            for (w, cache) in [&mut k[l], &mut v[l]].into_iter().enumerate() {
                if cache.is_empty() {
                    continue;
                }
                for h in 0..g.heads {
                    let s = (h * g.capacity + base) * g.head_dim + row_block * run;
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
