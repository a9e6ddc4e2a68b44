// KV-cache append.
//
// Cache layout (per layer, one buffer each for K and V):
// [n_kv_heads][capacity][head_dim] bf16, head-major so that attention reads
// one head's keys as one contiguous run. Design: one block per (token, kv
// head) copying the k and v head rows of the fused QKV output with 16-byte
// loads/stores.
//
// kv_append_bf16 (linear cache): position p of the sequence whose rows
// start at row b lives in row b + p. b is per token from kv_base (a batched
// decode step: each row its own sequence's slice of the layer's buffers,
// continuous batching) or 0 (the host offsets the buffers to a prefill's
// sequence instead). A row >= capacity (possible only when positions or
// bases are read from device memory) is skipped rather than written out of
// bounds. Token t's position: pos_ptr[t] from the device, else pos_base + t.
// kv_append_ring_bf16 (gpt-oss): a sequence's rows start at b (kv_base as
// above) and hold a ring of `ring` rows: position p lives in row
// b + p % ring, so a sliding layer keeps only the rows its window can still
// see and a later position overwrites the oldest. ring == 0 is the linear
// layout (row b + p), which is how the full layers of the same model use
// it (their sinks still need the ring attention kernels). Continuous
// batching gives every sequence its own ring (b = its slot x ring). The
// host checks n_tokens <= ring (a chunk must not overwrite its own keys);
// the attention wrappers check that the window fits (ops/attention/ring.rs).
// Separate entry points (one template) so the linear path's code does not
// change for the ring one.
// Launch overlap: a programmatic dependent of the RoPE kernel on sm_90
// (pdl_* in common.cuh): waits for it before reading qkv or writing the
// cache, after letting the decode attention get scheduled.
// Both copy 16-bit patterns without converting them, so the same entry
// points append f16 K and V (ActFormat::F16) to an f16 cache.

template <bool RING>
__device__ __forceinline__ void kv_append(const bf16_t* __restrict__ qkv, bf16_t* __restrict__ kc,
                                          bf16_t* __restrict__ vc, const u32* __restrict__ pos_ptr, u32 pos_base,
                                          const u32* __restrict__ kv_base, u32 n_tokens, u32 nq, u32 nkv, u32 d,
                                          u32 cap, u32 ring) {
    pdl_wait();
    pdl_trigger();
    u32 t = blockIdx.x, h = blockIdx.y;
    if (t >= n_tokens || h >= nkv) return;
    u32 pos = token_pos(pos_ptr, pos_base, t);
    if constexpr (RING) {
        if (ring) pos %= ring;
    }
    pos += kv_base ? kv_base[t] : 0u;
    if (pos >= cap) return;
    u32 stride = (nq + 2 * nkv) * d;
    const uint4* ksrc = (const uint4*)(qkv + (u64)t * stride + (u64)(nq + h) * d);
    const uint4* vsrc = (const uint4*)(qkv + (u64)t * stride + (u64)(nq + nkv + h) * d);
    uint4* kdst = (uint4*)(kc + ((u64)h * cap + pos) * d);
    uint4* vdst = (uint4*)(vc + ((u64)h * cap + pos) * d);
    u32 chunks = d / 8;
    for (u32 c = threadIdx.x; c < 2 * chunks; c += blockDim.x) {
        if (c < chunks) kdst[c] = ksrc[c];
        else vdst[c - chunks] = vsrc[c - chunks];
    }
}

extern "C" __global__ void kv_append_bf16(const bf16_t* __restrict__ qkv, bf16_t* __restrict__ kc,
                                          bf16_t* __restrict__ vc, const u32* __restrict__ pos_ptr, u32 pos_base,
                                          const u32* __restrict__ kv_base, u32 n_tokens, u32 nq, u32 nkv, u32 d,
                                          u32 cap) {
    kv_append<false>(qkv, kc, vc, pos_ptr, pos_base, kv_base, n_tokens, nq, nkv, d, cap, 0);
}

extern "C" __global__ void kv_append_ring_bf16(const bf16_t* __restrict__ qkv, bf16_t* __restrict__ kc,
                                               bf16_t* __restrict__ vc, const u32* __restrict__ pos_ptr,
                                               u32 pos_base, const u32* __restrict__ kv_base, u32 n_tokens, u32 nq,
                                               u32 nkv, u32 d, u32 cap, u32 ring) {
    kv_append<true>(qkv, kc, vc, pos_ptr, pos_base, kv_base, n_tokens, nq, nkv, d, cap, ring);
}
