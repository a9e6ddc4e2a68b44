// MoE router: softmax over expert logits, top-k selection, optional
// renormalization (Qwen3 norm_topk_prob).
//
// Design: one warp per token (4 tokens per block); the token's
// probabilities live in shared memory (E <= 1024). Selection runs k rounds
// of a warp arg-max where (value, index) compares by value, then lower
// index, so ties resolve to the lower expert id, matching a stable
// descending sort. Lane r keeps round r's pick; the renormalizing sum is
// taken sequentially in selection order (the CPU reference does the same).
// Precision: f32 softmax `exp(x - max) / sum` with a fixed reduction order.

template <typename T> __device__ __forceinline__ float ld_logit(const T* p, u32 i);
template <> __device__ __forceinline__ float ld_logit<float>(const float* p, u32 i) { return p[i]; }
template <> __device__ __forceinline__ float ld_logit<bf16_t>(const bf16_t* p, u32 i) { return bf2f(p[i]); }

template <typename T>
__device__ void router_topk(const T* __restrict__ logits, u32* __restrict__ ids, float* __restrict__ wout,
                            u32 n_tokens, u32 E, u32 k, u32 norm) {
    __shared__ float probs[4][1024];
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 t = blockIdx.x * 4 + warp;
    if (t >= n_tokens) return;
    const T* x = logits + (u64)t * E;
    float* p = probs[warp];
    float mx = NEG_INF_F;
    for (u32 i = lane; i < E; i += 32) {
        float v = ld_logit<T>(x, i);
        p[i] = v;
        mx = fmaxf(mx, v);
    }
    mx = warp_max(mx);
    float sum = 0.0f;
    for (u32 i = lane; i < E; i += 32) {
        float e = expf(p[i] - mx);
        p[i] = e;
        sum += e;
    }
    sum = warp_sum(sum);
    for (u32 i = lane; i < E; i += 32) p[i] = p[i] / sum;
    __syncwarp();
    float my_v = 0.0f;
    u32 my_i = 0;
    for (u32 r = 0; r < k; ++r) {
        float bv = -1.0f;
        u32 bi = 0xffffffffu;
        for (u32 i = lane; i < E; i += 32) {
            float v = p[i];
            if (v > bv) {  // ascending i per lane: keeps the lower index on ties
                bv = v;
                bi = i;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            u32 oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == r) {
            my_v = bv;
            my_i = bi;
        }
        __syncwarp();
        if (lane == 0 && bi < E) p[bi] = -2.0f;  // taken
        __syncwarp();
    }
    float s = 0.0f;
    for (u32 r = 0; r < k; ++r) s += __shfl_sync(0xffffffffu, my_v, r);
    if (lane < k) {
        ids[(u64)t * k + lane] = my_i;
        wout[(u64)t * k + lane] = norm ? my_v / s : my_v;
    }
}

extern "C" __global__ void router_topk_f32(const float* __restrict__ logits, u32* __restrict__ ids,
                                           float* __restrict__ w, u32 n_tokens, u32 E, u32 k, u32 norm) {
    router_topk<float>(logits, ids, w, n_tokens, E, k, norm);
}

extern "C" __global__ void router_topk_bf16(const bf16_t* __restrict__ logits, u32* __restrict__ ids,
                                            float* __restrict__ w, u32 n_tokens, u32 E, u32 k, u32 norm) {
    router_topk<bf16_t>(logits, ids, w, n_tokens, E, k, norm);
}
