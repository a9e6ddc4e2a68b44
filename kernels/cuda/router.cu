// MoE routers, from each token's router logits (plus an optional f32 bias
// [E], added in f32 before anything else) to its top-k (expert, weight)
// pairs, in two modes:
// - router_topk_*: softmax over all experts, top-k of the probabilities,
//   optional renormalisation (Qwen3 norm_topk_prob);
// - router_topk_then_softmax_*: top-k of the raw (biased) logits, then a
//   softmax over those k only (gpt-oss GptOssTopKRouter);
// - router_sigmoid_grouped_*: glm4_moe / DeepSeek-V3 "noaux_tc": scores
//   s = sigmoid(logit); the choice score c = s + bias (here the bias is the
//   selection bias, never added to the weights); with topk_groups < groups
//   each group is scored by the sum of its two best c and only the best
//   topk_groups groups keep their c (the others' become 0, as transformers'
//   masked_fill does); the top-k of c pick the experts, weighted by their
//   s, divided by sum(s) + 1e-20 when norm, then times scale.
//
// Design: one warp per token (4 tokens per block); the token's values live
// in shared memory (E <= 1024). Selection runs k rounds of a warp arg-max
// where (value, index) compares by value, then lower index, so ties resolve
// to the lower expert id, matching a stable descending sort. Lane r keeps
// round r's pick; the sums over the k picks are taken sequentially in
// selection order (the CPU references do the same).
// Precision: f32 throughout, `exp(x - max) / sum` with a fixed reduction
// order.

// Launch overlap (sm_90, pdl_* in common.cuh): the host launches these as
// programmatic dependents of the router GEMV, so every entry point waits
// for it before reading the logits, after letting its own dependent get
// scheduled: the HCS decode tail's lookup (`cuda/expert_tail.cu`, which
// reads its own clock and stamps first and then waits for this grid) or,
// all resident, the w13 GEMV (which waits first).

template <typename T> __device__ __forceinline__ float ld_logit(const T* p, u32 i);
template <> __device__ __forceinline__ float ld_logit<float>(const float* p, u32 i) { return p[i]; }
template <> __device__ __forceinline__ float ld_logit<bf16_t>(const bf16_t* p, u32 i) { return bf2f(p[i]); }

// Row x[0..E) (plus bias, if any, in f32) into p[0..E), lane-strided as
// the loops below read it. Each lane's loads (8 at a time: 1 batch for E
// <= 256) are issued, predicated, before any is stored: a loop that
// stored each value before loading the next cost E / 32 dependent L2 round
// trips (the logits were just written), most of a ~5 us router top-k.
template <typename T>
__device__ __forceinline__ void stage_row(const T* __restrict__ x, const float* __restrict__ bias, float* p, u32 E,
                                          u32 lane) {
    for (u32 i0 = lane; i0 < E; i0 += 8 * 32) {
        float v[8], b[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 i = i0 + 32 * j;
            v[j] = i < E ? ld_logit<T>(x, i) : 0.0f;
            b[j] = bias && i < E ? bias[i] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 i = i0 + 32 * j;
            if (i < E) p[i] = bias ? v[j] + b[j] : v[j];
        }
    }
    __syncwarp();
}

// Warp arg-max of (bv, bi): larger value, then lower index; every lane
// ends with the winner.
__device__ __forceinline__ void warp_argmax(float& bv, u32& bi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        u32 oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) {
            bv = ov;
            bi = oi;
        }
    }
}

template <typename T>
__device__ void router_topk(const T* __restrict__ logits, const float* __restrict__ bias, u32* __restrict__ ids,
                            float* __restrict__ wout, u32 n_tokens, u32 E, u32 k, u32 norm) {
    __shared__ float probs[4][1024];
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 t = blockIdx.x * 4 + warp;
    if (t >= n_tokens) return;
    const T* x = logits + (u64)t * E;
    float* p = probs[warp];
    stage_row<T>(x, bias, p, E, lane);
    float mx = NEG_INF_F;
    for (u32 i = lane; i < E; i += 32) mx = fmaxf(mx, p[i]);
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
        warp_argmax(bv, bi);
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

// Top-k of the logits, then softmax over the k. Logits are unbounded, so
// "taken" is a per-lane bit mask (lane owns experts lane + 32*m, m < 32)
// rather than a sentinel value, and the first candidate a lane sees always
// becomes its best, so -inf logits are still selectable as the reference's
// total order selects them. A NaN logit anywhere in the row makes every
// weight of the token NaN (the reference's softmax over k is NaN then too,
// as NaN sorts first), so a poisoned router cannot pass as a valid route.
template <typename T>
__device__ void router_topk_then_softmax(const T* __restrict__ logits, const float* __restrict__ bias,
                                         u32* __restrict__ ids, float* __restrict__ wout, u32 n_tokens, u32 E,
                                         u32 k) {
    __shared__ float vals[4][1024];
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 t = blockIdx.x * 4 + warp;
    if (t >= n_tokens) return;
    const T* x = logits + (u64)t * E;
    float* p = vals[warp];
    stage_row<T>(x, bias, p, E, lane);
    bool nan = false;
    for (u32 i = lane; i < E; i += 32) nan |= p[i] != p[i];
    nan = __any_sync(0xffffffffu, nan);
    __syncwarp();
    u32 taken = 0;
    float my_v = 0.0f;
    u32 my_i = 0xffffffffu;
    for (u32 r = 0; r < k; ++r) {
        float bv = NEG_INF_F;
        u32 bi = 0xffffffffu;
        u32 m = 0;
        for (u32 i = lane; i < E; i += 32, ++m) {
            if ((taken >> m) & 1u) continue;
            float v = p[i];
            if (bi == 0xffffffffu || v > bv) {  // ascending i: lower index on ties
                bv = v;
                bi = i;
            }
        }
        warp_argmax(bv, bi);
        if (lane == r) {
            my_v = bv;
            my_i = bi;
        }
        if (bi < E && (bi & 31u) == lane) taken |= 1u << (bi >> 5);
    }
    // Picks are in descending order, so the max of the k is round 0's.
    const float mx = __shfl_sync(0xffffffffu, my_v, 0);
    const float e = lane < k ? expf(my_v - mx) : 0.0f;
    float s = 0.0f;
    for (u32 r = 0; r < k; ++r) s += __shfl_sync(0xffffffffu, e, r);
    if (lane < k) {
        ids[(u64)t * k + lane] = my_i;
        wout[(u64)t * k + lane] = nan ? NAN_F : e / s;
    }
}

// glm4_moe's router (see the header). Groups: at most 32 (one lane each)
// of E / groups experts. Selection of groups and of experts are warp
// arg-max rounds with the lower index winning ties, as the reference's
// stable sorts.
template <typename T>
__device__ void router_sigmoid_grouped(const T* __restrict__ logits, const float* __restrict__ sel_bias,
                                       u32* __restrict__ ids, float* __restrict__ wout, u32 n_tokens, u32 E, u32 k,
                                       u32 groups, u32 topk_groups, u32 norm, float scale) {
    __shared__ float score[4][1024];
    __shared__ float choice[4][1024];
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 t = blockIdx.x * 4 + warp;
    if (t >= n_tokens) return;
    const T* x = logits + (u64)t * E;
    float* s = score[warp];
    float* c = choice[warp];
    stage_row<T>(x, nullptr, s, E, lane);  // the raw logits, then in place:
    for (u32 i = lane; i < E; i += 32) {
        const float v = 1.0f / (1.0f + expf(-s[i]));
        s[i] = v;
        c[i] = sel_bias ? v + sel_bias[i] : v;
    }
    __syncwarp();
    if (topk_groups < groups) {
        const u32 per = E / groups;
        // Lane g: the sum of group g's two best choice scores.
        float gs = NEG_INF_F;
        if (lane < groups) {
            float b1 = NEG_INF_F, b2 = NEG_INF_F;
            for (u32 j = 0; j < per; ++j) {
                const float v = c[lane * per + j];
                if (v > b1) {
                    b2 = b1;
                    b1 = v;
                } else if (v > b2) {
                    b2 = v;
                }
            }
            gs = b1 + b2;
        }
        bool kept = false;
        for (u32 r = 0; r < topk_groups; ++r) {
            float bv = kept ? NEG_INF_F : gs;
            u32 bi = (lane < groups && !kept) ? lane : 0xffffffffu;
            warp_argmax(bv, bi);
            if (bi == lane) kept = true;
        }
        __syncwarp();
        for (u32 g = 0; g < groups; ++g) {
            const bool keep = __shfl_sync(0xffffffffu, kept, g);
            if (!keep)
                for (u32 j = lane; j < per; j += 32) c[g * per + j] = 0.0f;
        }
        __syncwarp();
    }
    u32 taken = 0;
    float my_s = 0.0f;
    u32 my_i = 0xffffffffu;
    for (u32 r = 0; r < k; ++r) {
        float bv = NEG_INF_F;
        u32 bi = 0xffffffffu;
        u32 m = 0;
        for (u32 i = lane; i < E; i += 32, ++m) {
            if ((taken >> m) & 1u) continue;
            const float v = c[i];
            if (bi == 0xffffffffu || v > bv) {  // ascending i: lower index on ties
                bv = v;
                bi = i;
            }
        }
        warp_argmax(bv, bi);
        if (lane == r) {
            my_i = bi;
            my_s = bi < E ? s[bi] : 0.0f;
        }
        if (bi < E && (bi & 31u) == lane) taken |= 1u << (bi >> 5);
    }
    float sum = 0.0f;
    for (u32 r = 0; r < k; ++r) sum += __shfl_sync(0xffffffffu, my_s, r);
    if (lane < k) {
        ids[(u64)t * k + lane] = my_i;
        wout[(u64)t * k + lane] = (norm ? my_s / (sum + 1e-20f) : my_s) * scale;
    }
}

extern "C" __global__ void router_topk_f32(const float* __restrict__ logits, const float* __restrict__ bias,
                                           u32* __restrict__ ids, float* __restrict__ w, u32 n_tokens, u32 E, u32 k,
                                           u32 norm) {
    pdl_wait();
    pdl_trigger();
    router_topk<float>(logits, bias, ids, w, n_tokens, E, k, norm);
}

extern "C" __global__ void router_topk_bf16(const bf16_t* __restrict__ logits, const float* __restrict__ bias,
                                            u32* __restrict__ ids, float* __restrict__ w, u32 n_tokens, u32 E, u32 k,
                                            u32 norm) {
    pdl_wait();
    pdl_trigger();
    router_topk<bf16_t>(logits, bias, ids, w, n_tokens, E, k, norm);
}

extern "C" __global__ void router_topk_then_softmax_f32(const float* __restrict__ logits,
                                                        const float* __restrict__ bias, u32* __restrict__ ids,
                                                        float* __restrict__ w, u32 n_tokens, u32 E, u32 k) {
    pdl_wait();
    pdl_trigger();
    router_topk_then_softmax<float>(logits, bias, ids, w, n_tokens, E, k);
}

extern "C" __global__ void router_topk_then_softmax_bf16(const bf16_t* __restrict__ logits,
                                                         const float* __restrict__ bias, u32* __restrict__ ids,
                                                         float* __restrict__ w, u32 n_tokens, u32 E, u32 k) {
    pdl_wait();
    pdl_trigger();
    router_topk_then_softmax<bf16_t>(logits, bias, ids, w, n_tokens, E, k);
}

extern "C" __global__ void router_sigmoid_grouped_f32(const float* __restrict__ logits,
                                                      const float* __restrict__ sel_bias, u32* __restrict__ ids,
                                                      float* __restrict__ w, u32 n_tokens, u32 E, u32 k, u32 groups,
                                                      u32 topk_groups, u32 norm, float scale) {
    pdl_wait();
    pdl_trigger();
    router_sigmoid_grouped<float>(logits, sel_bias, ids, w, n_tokens, E, k, groups, topk_groups, norm, scale);
}

extern "C" __global__ void router_sigmoid_grouped_bf16(const bf16_t* __restrict__ logits,
                                                       const float* __restrict__ sel_bias, u32* __restrict__ ids,
                                                       float* __restrict__ w, u32 n_tokens, u32 E, u32 k, u32 groups,
                                                       u32 topk_groups, u32 norm, float scale) {
    pdl_wait();
    pdl_trigger();
    router_sigmoid_grouped<bf16_t>(logits, sel_bias, ids, w, n_tokens, E, k, groups, topk_groups, norm, scale);
}
