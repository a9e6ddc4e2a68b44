// MoE token grouping, row gather and deterministic weighted combine.
//
// Pair p = t*top_k + j is token t's j-th routed expert.
// moe_count: block e counts the pairs routed to expert e (integer block
// reduction); the extra block e == E marks pairs with an invalid id
// (pair_row = 0xffffffff) so later kernels can refuse them.
// moe_scatter: block e sums counts[0..e) for its offset, then walks the
// pairs in 1024-wide chunks with a block-wide ballot/prefix scan, writing
// its pairs in ascending pair order (stable, so the grouping is identical
// run to run). Each block reads the id list twice; at E = 128 and 64K pairs
// that is ~64 MB of L2 reads, a few microseconds.
// gather_rows_bf16: one block per output row, 16-byte copies. It copies
// 16-bit patterns without converting them, so it gathers f16 rows (an FP16
// MLP block's normed input) too; its fill for an invalid row, 0x7fc0, is
// a NaN in both formats.
// moe_combine_*: one block per token; each element sums its top_k grouped
// rows in j order in f32, then adds once to the f32 residual. No atomics.

__device__ __forceinline__ u32 warp_sum_u32(u32 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

extern "C" __global__ void moe_count(const u32* __restrict__ ids, u32 n_pairs, u32 E, u32* __restrict__ counts,
                                     u32* __restrict__ pair_row) {
    const u32 e = blockIdx.x;
    if (e == E) {
        for (u32 p = threadIdx.x; p < n_pairs; p += blockDim.x)
            if (ids[p] >= E) pair_row[p] = 0xffffffffu;
        return;
    }
    __shared__ u32 part[32];
    u32 c = 0;
    for (u32 p = threadIdx.x; p < n_pairs; p += blockDim.x) c += ids[p] == e;
    c = warp_sum_u32(c);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = c;
    __syncthreads();
    if (threadIdx.x < 32) {
        u32 v = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0u;
        v = warp_sum_u32(v);
        if (threadIdx.x == 0) counts[e] = v;
    }
}

extern "C" __global__ void __launch_bounds__(1024)
    moe_scatter(const u32* __restrict__ ids, u32 n_pairs, u32 E, const u32* __restrict__ counts,
                u32* __restrict__ offsets, u32* __restrict__ row_pair, u32* __restrict__ pair_row) {
    __shared__ u32 part[32];
    __shared__ u32 base_s;
    const u32 e = blockIdx.x;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u32 b = 0;
    for (u32 i = threadIdx.x; i < e; i += blockDim.x) b += counts[i];
    b = warp_sum_u32(b);
    if (lane == 0) part[warp] = b;
    __syncthreads();
    if (threadIdx.x < 32) {
        u32 v = part[threadIdx.x];
        v = warp_sum_u32(v);
        if (threadIdx.x == 0) {
            base_s = v;
            offsets[e] = v;
            if (e == E - 1) offsets[E] = v + counts[e];
        }
    }
    __syncthreads();
    u32 running = base_s;
    for (u32 c0 = 0; c0 < n_pairs; c0 += 1024) {
        const u32 p = c0 + threadIdx.x;
        const bool hit = p < n_pairs && ids[p] == e;
        const u32 mask = __ballot_sync(0xffffffffu, hit);
        const u32 before = __popc(mask & ((1u << lane) - 1u));
        __syncthreads();  // part[] reuse
        if (lane == 0) part[warp] = __popc(mask);
        __syncthreads();
        u32 wbase = 0, total = 0;
        for (u32 w = 0; w < 32; ++w) {
            u32 c = part[w];
            if (w < warp) wbase += c;
            total += c;
        }
        if (hit) {
            const u32 r = running + wbase + before;
            row_pair[r] = p;
            pair_row[p] = r;
        }
        running += total;
    }
}

extern "C" __global__ void gather_rows_bf16(const bf16_t* __restrict__ src, const u32* __restrict__ idx, u32 div,
                                            u32 n_rows, u32 n_src, u32 hidden, bf16_t* __restrict__ out) {
    const u32 r = blockIdx.x;
    if (r >= n_rows) return;
    const u32 s = idx[r] / div;
    uint4* o = (uint4*)(out + (u64)r * hidden);
    if (s >= n_src) {
        const bf16_t nanb = 0x7fc0;
        for (u32 c = threadIdx.x; c < hidden; c += blockDim.x) out[(u64)r * hidden + c] = nanb;
        return;
    }
    const uint4* in = (const uint4*)(src + (u64)s * hidden);
    for (u32 c = threadIdx.x; c < hidden / 8; c += blockDim.x) o[c] = in[c];
}

template <typename Y> __device__ __forceinline__ float ld_y(const Y* p, u64 i);
template <> __device__ __forceinline__ float ld_y<float>(const float* p, u64 i) { return p[i]; }
template <> __device__ __forceinline__ float ld_y<bf16_t>(const bf16_t* p, u64 i) { return bf2f(p[i]); }

template <typename Y>
__device__ void moe_combine(float* __restrict__ res, const Y* __restrict__ y, const u32* __restrict__ pair_row,
                            const float* __restrict__ w, u32 n_tokens, u32 k, u32 hidden) {
    __shared__ u32 rows[32];
    __shared__ float ws[32];
    const u32 t = blockIdx.x;
    if (t >= n_tokens) return;
    const u32 n_pairs = n_tokens * k;
    if (threadIdx.x < k) {
        rows[threadIdx.x] = pair_row[(u64)t * k + threadIdx.x];
        ws[threadIdx.x] = w[(u64)t * k + threadIdx.x];
    }
    __syncthreads();
    float* r = res + (u64)t * hidden;
    for (u32 c = threadIdx.x; c < hidden; c += blockDim.x) {
        float acc = 0.0f;
        for (u32 j = 0; j < k; ++j) {
            const u32 row = rows[j];
            acc += row < n_pairs ? ws[j] * ld_y<Y>(y, (u64)row * hidden + c) : NAN_F;
        }
        r[c] += acc;
    }
}

extern "C" __global__ void moe_combine_bf16(float* __restrict__ res, const bf16_t* __restrict__ y,
                                            const u32* __restrict__ pair_row, const float* __restrict__ w,
                                            u32 n_tokens, u32 k, u32 hidden) {
    moe_combine<bf16_t>(res, y, pair_row, w, n_tokens, k, hidden);
}

extern "C" __global__ void moe_combine_f32(float* __restrict__ res, const float* __restrict__ y,
                                           const u32* __restrict__ pair_row, const float* __restrict__ w,
                                           u32 n_tokens, u32 k, u32 hidden) {
    moe_combine<float>(res, y, pair_row, w, n_tokens, k, hidden);
}
