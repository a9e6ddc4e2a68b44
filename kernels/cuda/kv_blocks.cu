// Prefix-cache block copies between the layers' KV caches and a block pool.
//
// A pool slot holds one block: B positions of every layer's K and V, laid
// out [layer][K, V][kv_head][position][head_dim] as 16-bit values (bf16 or
// f16, copied as bits). The KV cache of layer l is [kv_head][capacity]
// [head_dim] (kv_cache.cu), one buffer for K and one for V, whose addresses
// come from two device arrays (layer_k, layer_v). One launch moves any
// number of blocks in one direction: pair i = (slot, block) is pool slot
// `slot` <-> positions block*B .. (block+1)*B of one sequence's rows of
// every layer, which start at row `base` of the KV arena (continuous
// batching: every running sequence owns a range of rows; `seq_offset` =
// base * head_dim elements).
//
// The pool is device memory (the VRAM tier) or page-locked host memory
// mapped into the device (the host tier): then the copy crosses PCIe as
// the kernel's own reads or posted writes, one launch for a whole hit
// instead of a DMA call per (block, layer, K/V).
//
// Ring caches (gpt-oss's sliding layers, ring_blocks > 0): the sequence's
// rows starting at `base` hold a ring of ring_blocks whole blocks, block b
// at ring block b % ring_blocks (positions p in row base + p % ring, the
// ring a multiple of the block: kv_cache.cu). Layers whose address is 0 in
// layer_k / layer_v are skipped: the engine moves its full layers (linear
// arena rows) and its sliding layers (rings) in separate launches, the
// same slot layout, so each launch leaves the other's layers alone.
//
// Design: one thread block of 256 per (pair, layer, K/V, kv head), whose
// B * head_dim elements are contiguous on both sides (a head's positions
// are consecutive rows), copied as 16-byte vectors (B * head_dim is a
// multiple of 8, addresses 16-byte aligned: checked by the host). A slot or
// block out of range traps (the host checks the pairs it uploads; this
// keeps a bad pair from writing outside the buffers).

extern "C" __global__ void __launch_bounds__(256)
    kv_blocks_copy(const u64* __restrict__ layer_k, const u64* __restrict__ layer_v, u64 head_stride, u64 seq_offset, u64 pool,
                   u32 pool_slots, const u32* __restrict__ pairs, u32 n_pairs, u32 layers, u32 heads, u32 run,
                   u32 blocks_per_head, u32 ring_blocks, u32 to_pool) {
    u64 i = blockIdx.x;
    const u32 h = (u32)(i % heads);
    i /= heads;
    const u32 w = (u32)(i % 2);
    i /= 2;
    const u32 l = (u32)(i % layers);
    const u32 p = (u32)(i / layers);
    if (p >= n_pairs) return;
    const u64 layer = w ? layer_v[l] : layer_k[l];
    if (!layer) return;  // another launch's layer
    const u32 slot = pairs[2 * p], block = pairs[2 * p + 1];
    const u32 row_block = ring_blocks ? block % ring_blocks : block;
    if (slot >= pool_slots || row_block >= blocks_per_head) asm volatile("trap;");
    const u64 slot_elems = (u64)layers * 2 * heads * run;
    uint4* seq = (uint4*)((unsigned short*)layer + (u64)h * head_stride + seq_offset + (u64)row_block * run);
    uint4* blk = (uint4*)((unsigned short*)pool + (u64)slot * slot_elems + ((u64)(l * 2 + w) * heads + h) * run);
    const u32 vecs = run / 8;
    if (to_pool) {
        for (u32 c = threadIdx.x; c < vecs; c += blockDim.x) blk[c] = seq[c];
    } else {
        for (u32 c = threadIdx.x; c < vecs; c += blockDim.x) seq[c] = blk[c];
    }
}
