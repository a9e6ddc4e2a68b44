// Decode attention (one new token) with split-K flash-decoding.
//
// attn_decode_split: block (split s, kv head) handles keys
// [s*chunk, min((s+1)*chunk, pos+1)) for every q head of the GQA group, so
// each K/V row is read once per group. The group's q is loaded first as
// 16-byte vectors, all of a thread's in flight, and kept in shared memory as
// f32 (group x head_dim <= 2048, checked by the host). Keys go in tiles of
// up to 64 (16 KB of K and of V): (0) all threads stage the tile's K and V
// rows into shared memory with cp.async, every 16-byte copy of the tile in
// flight before the one wait (a latency-bound loop over keys was 20x
// slower; a loop of loads each stored before the next was issued left 8
// dependent round trips per tile); (1) each lane scores one key for half of the
// group's heads (q in shared memory as f32, read as broadcasts; K chunks
// XOR-swizzled so the row-parallel reads are conflict-free); (2) one warp
// per head updates the running max/sum (log2 domain) and turns the scores
// into probabilities; (3) each thread owns head_dim/128 output dims and
// accumulates P V for all heads from shared memory. Partial (unnormalized) outputs,
// maxima and sums go to the workspace: o_part [S][nq][d], then m [S][nq],
// then l [S][nq], S = DEC_MAX_SPLITS. Splits that start past the sequence
// write m = -inf, l = 0. The position may come from device memory, so the
// launch shape depends only on the capacity (graph-capturable); then
// `chunk` is 0 and both kernels derive it from the position they read
// (decode_chunk): the live keys spread over every split, at least one
// 64-key tile each, so a 1K-token context runs 16 splits per KV head
// instead of the 1 that a capacity-derived chunk (32K / 128) would give it.
// Split count (kernels/src/ops/attention.rs, decode_splits): about four
// blocks per SM, up to 128 splits. Each block is latency-bound (a tile's
// loads, then its dependent phases), so more, shorter splits hide more of
// it: on the H200 at an 8K context, 128 splits of 64 keys instead of 64 of
// 128 took the split kernel from ~55 to ~47 us per layer (a3b-24l,
// benchmarks/results/2026-12-03-session12.md).
// attn_decode_combine: one block per q head merges the active splits in
// ascending order (fixed order, no atomics) and writes bf16; the splits'
// maxima and sums are staged in shared memory first and the partial
// outputs loaded 8 splits at a time, so its cost does not grow with a
// chain of dependent loads per split.
// Rows (continuous batching): a launch decodes `rows` tokens of different
// sequences at once, grid z (split) / y (combine) = row. Row z reads its q
// from qkv row z, its position from pos_ptr[z] (token_pos, common.cuh),
// its sequence's KV from row kv_base[z] on (plain kernels; 0 without
// kv_base), uses workspace block z and writes output row z. The split
// count n_splits is the launch's (from the capacity), so a row runs exactly
// the splits, chunks and combine order it runs when launched alone: its
// result does not depend on the other rows. A block runs splits
// blockIdx.x, + gridDim.x, ... (the host launches ceil(n_splits / rows)
// per kv head and row): which block runs a split changes nothing in its
// arithmetic, and the launch keeps about the one-row block count instead
// of n_splits x rows mostly empty blocks at short contexts (2,048 blocks
// for a3b at 4 rows, 256 of them with keys at a 1K context); the group's q
// is staged once per block for all of its splits.
// Launch overlap (sm_90, pdl_* in common.cuh): the split kernel launches as
// a programmatic dependent of the KV append and the combine as one of the
// split; each waits for the grid before it first and lets its own
// dependent (the combine; the o_proj GEMV) get scheduled, so each boundary
// costs the wait, not a drain plus a launch (an empty kernel alone costs
// ~1.2 us in a graph, int4.cu).
// Precision: f32 everywhere; one rounding to bf16 at the end.
// Activation format: the split kernel is a template over A (ActBf16 /
// ActF16, common.cuh) for how q, K and V are stored; attn_decode_split* is
// ActBf16 (its code before the template), attn_decode_split*_f16 ActF16.
// The combine kernels read only the f32 workspace and serve both.
//
// gpt-oss variants (attn_decode_split_ring / attn_decode_combine_ring; the
// same templates with RING set, so the plain entry points keep their code):
// - Ring cache: key position p of the sequence whose rows start at
//   kv_base[z] (0 without kv_base) lives in row kv_base[z] + p % ring, or
//   kv_base[z] + p with ring == 0 (a full layer's linear rows; kv_cache.cu).
//   Rows, splits and the combine order are the plain kernels', so a row's
//   result does not depend on the other rows of the launch here either.
// - Sliding window (window > 0): the token at pos sees keys
//   [max(0, pos + 1 - window), pos]; the splits divide those live keys, not
//   the context, so a sliding layer's decode cost is bounded by the window
//   (at 128 keys: two 64-key splits per kv head) whatever the context. With
//   window 0 the live keys are [0, pos] as in the plain kernels.
// - Sinks (optional f32 [n_q_heads]): the combine kernel enters the head's
//   sink logit once into the final max/sum merge (max over the splits'
//   maxima and sink * log2(e), denominator + exp2(sink2 - max)), with no
//   value; the split kernels never see it, so it is counted exactly once
//   however many splits run.

#define DEC_MAX_SPLITS 128
#define DEC_TILE_ELEMS 8192  // bf16 elements of one staged K (or V) tile: 16 KB
#define DEC_MIN_DYN_CHUNK 64  // keys per split at least when derived on the device

// Keys per split: the launch's fixed chunk, or (chunk == 0) the live keys
// spread over n_splits in whole 64-key tiles.
__device__ __forceinline__ u32 decode_chunk(u32 chunk, u32 n_keys, u32 n_splits) {
    if (chunk) return chunk;
    u32 c = (n_keys + n_splits - 1) / n_splits;
    c = (c + DEC_MIN_DYN_CHUNK - 1) / DEC_MIN_DYN_CHUNK * DEC_MIN_DYN_CHUNK;
    return max(c, (u32)DEC_MIN_DYN_CHUNK);
}

#define DEC_LOG2E 1.4426950408889634f

// First live key and number of live keys of the token at pos.
template <bool RING>
__device__ __forceinline__ void decode_span(u32 pos, u32 cap, u32 window, u32& kfirst, u32& n_keys) {
    if constexpr (RING) {
        const u32 win = window ? window : 0xffffffffu;
        kfirst = pos + 1 > win ? pos + 1 - win : 0u;
        n_keys = pos + 1 - kfirst;
    } else {
        kfirst = 0;
        n_keys = min(pos + 1, cap);
    }
}

template <class A, bool RING>
__device__ __forceinline__ void attn_decode_split_t(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ kc,
                                                    const bf16_t* __restrict__ vc, float* __restrict__ ws,
                                                    const u32* __restrict__ pos_ptr, u32 pos_base,
                                                    const u32* __restrict__ kv_base, u32 nq, u32 nkv, u32 d, u32 cap,
                                                    u32 chunk, u32 n_splits, float sl2, u32 window, u32 ring) {
    pdl_wait();
    pdl_trigger();
    __shared__ __align__(16) float qs[2048];
    __shared__ __align__(16) uint4 ks[DEC_TILE_ELEMS / 8];
    __shared__ __align__(16) uint4 vs[DEC_TILE_ELEMS / 8];
    __shared__ float sc[16][64];
    __shared__ float m_s[16], l_s[16], a_s[16];
    const u32 kvh = blockIdx.y, z = blockIdx.z;
    const u32 G = nq / nkv;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 pos = token_pos(pos_ptr, pos_base, z);
    qkv += (u64)z * (nq + 2 * nkv) * d;
    ws += (u64)z * DEC_MAX_SPLITS * nq * (d + 2);
    const u32 row0 = kv_base ? kv_base[z] : 0u;  // the sequence's first KV row
    u32 kfirst, n_keys;
    decode_span<RING>(pos, cap, window, kfirst, n_keys);
    chunk = decode_chunk(chunk, n_keys, n_splits);
    float* o_part = ws;
    float* m_part = ws + (u64)DEC_MAX_SPLITS * nq * d;
    float* l_part = m_part + DEC_MAX_SPLITS * nq;
    const u32 h0 = kvh * G;
    // Split s covers keys [s * chunk, (s + 1) * chunk) of the live span;
    // this block runs splits blockIdx.x, + gridDim.x, ... (splits past the
    // keys write m = -inf, l = 0). Once one is empty every later one is.
    if (blockIdx.x * chunk >= n_keys) {
        for (u32 s = blockIdx.x; s < n_splits; s += gridDim.x) {
            if (threadIdx.x < G) {
                m_part[s * nq + h0 + threadIdx.x] = NEG_INF_F;
                l_part[s * nq + h0 + threadIdx.x] = 0.0f;
            }
        }
        return;
    }
    // q: the group's G * d values (<= 2048) as 16-byte chunks, each
    // thread's (<= 2) loaded before any is stored. (A loop of 2-byte loads,
    // each stored before the next was issued, cost ~G * d / 128 dependent
    // L2 round trips: the qkv row was just written.) The host checks that
    // qkv is 16-byte aligned; d is a multiple of 64.
    {
        const uint4* q4 = (const uint4*)(qkv + (u64)h0 * d);
        const u32 nqc = G * d / 8;
        uint4 qv[2];
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            const u32 c = threadIdx.x + b * blockDim.x;
            if (c < nqc) qv[b] = q4[c];
        }
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            const u32 c = threadIdx.x + b * blockDim.x;
            if (c < nqc) {
                *(float4*)&qs[c * 8] = make_float4(A::lo(qv[b].x), A::hi(qv[b].x), A::lo(qv[b].y), A::hi(qv[b].y));
                *(float4*)&qs[c * 8 + 4] =
                    make_float4(A::lo(qv[b].z), A::hi(qv[b].z), A::lo(qv[b].w), A::hi(qv[b].w));
            }
        }
    }
    const bf16_t* kbase = kc + ((u64)kvh * cap + row0) * d;
    const bf16_t* vbase = vc + ((u64)kvh * cap + row0) * d;
    const u32 cpr = d / 8;                       // 16-byte chunks per row
    const u32 TK = min(64u, DEC_TILE_ELEMS / d);  // keys per staged tile
    const u32 od = (d + 127) / 128;               // output dims per thread
    const u32 kl = (warp & 1) * 32 + lane;        // this lane's key in the tile
    const u32 gstart = warp >> 1;                 // heads gstart, gstart+2, ...
    for (u32 s = blockIdx.x; s < n_splits; s += gridDim.x) {  // block-uniform
    const u32 k0 = kfirst + s * chunk;
    const u32 k1 = min(k0 + chunk, kfirst + n_keys);
    if (k0 >= k1) {
        if (threadIdx.x < G) {
            m_part[s * nq + h0 + threadIdx.x] = NEG_INF_F;
            l_part[s * nq + h0 + threadIdx.x] = 0.0f;
        }
        continue;
    }
    __syncthreads();  // the previous split's m_s / l_s are written out
    if (threadIdx.x < 16) {
        m_s[threadIdx.x] = NEG_INF_F;
        l_s[threadIdx.x] = 0.0f;
    }
    float acc[16][2];
#pragma unroll
    for (int g = 0; g < 16; ++g) acc[g][0] = acc[g][1] = 0.0f;

    for (u32 kb = k0; kb < k1; kb += TK) {
        const u32 nk = min(TK, k1 - kb);
        __syncthreads();  // previous tile fully consumed (and qs/m_s ready)
        // Stage K and V rows with all copies in flight: cp.async, global to
        // shared with no registers, every chunk of the tile issued before
        // the wait. (A plain loop stored each chunk before issuing the next
        // load: 8 dependent DRAM round trips per 64-key tile, ~17 us per
        // layer at a 1K context, ncu, session 11.) Chunk c of row r is
        // stored at c ^ (r & 7) so row-parallel 16-byte reads are
        // conflict-free.
        for (u32 c = threadIdx.x; c < nk * cpr; c += blockDim.x) {
            const u32 r = c / cpr, ch = c - r * cpr;
            const u32 dst = r * cpr + (ch ^ (r & 7));
            const u32 row = RING && ring ? (kb + r) % ring : kb + r;
            cp_async16(&ks[dst], kbase + (u64)row * d + ch * 8);
            cp_async16(&vs[dst], vbase + (u64)row * d + ch * 8);
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        // Scores: one key per lane, warps split keys (halves) and heads (parity).
        float dots[8];
#pragma unroll
        for (int gi = 0; gi < 8; ++gi) dots[gi] = 0.0f;
        if (kl < nk) {
            for (u32 ch = 0; ch < cpr; ++ch) {
                const uint4 kv = ks[kl * cpr + (ch ^ (kl & 7))];
                const float kf[8] = {A::lo(kv.x), A::hi(kv.x), A::lo(kv.y), A::hi(kv.y),
                                     A::lo(kv.z), A::hi(kv.z), A::lo(kv.w), A::hi(kv.w)};
#pragma unroll
                for (int gi = 0; gi < 8; ++gi) {
                    const u32 g = gstart + 2 * gi;
                    if (g < G) {
                        const float4 a = *(const float4*)&qs[g * d + ch * 8];
                        const float4 b = *(const float4*)&qs[g * d + ch * 8 + 4];
                        dots[gi] += a.x * kf[0] + a.y * kf[1] + a.z * kf[2] + a.w * kf[3] + b.x * kf[4] +
                                    b.y * kf[5] + b.z * kf[6] + b.w * kf[7];
                    }
                }
            }
        }
#pragma unroll
        for (int gi = 0; gi < 8; ++gi) {
            const u32 g = gstart + 2 * gi;
            if (g < G) sc[g][kl] = kl < nk ? dots[gi] * sl2 : NEG_INF_F;
        }
        __syncthreads();
        for (u32 g = warp; g < G; g += 4) {
            float a = sc[g][lane], b = sc[g][lane + 32];
            float mx = warp_max(fmaxf(a, b));
            float mo = m_s[g];
            float mn = fmaxf(mo, mx);
            float pa = exp2f(a - mn), pb = exp2f(b - mn);
            sc[g][lane] = pa;
            sc[g][lane + 32] = pb;
            float sum = warp_sum(pa + pb);
            __syncwarp();
            if (lane == 0) {
                float al = exp2f(mo - mn);
                a_s[g] = al;
                l_s[g] = l_s[g] * al + sum;
                m_s[g] = mn;
            }
        }
        __syncthreads();
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const u32 i = threadIdx.x + 128 * e;
            if ((u32)e < od && i < d) {
#pragma unroll
                for (int g = 0; g < 16; ++g)
                    if ((u32)g < G) acc[g][e] *= a_s[g];
                for (u32 k2 = 0; k2 < nk; ++k2) {
                    const bf16_t* vrow = (const bf16_t*)&vs[k2 * cpr + ((i >> 3) ^ (k2 & 7))];
                    const float v = A::load(vrow[i & 7]);
#pragma unroll
                    for (int g = 0; g < 16; ++g)
                        if ((u32)g < G) acc[g][e] += sc[g][k2] * v;
                }
            }
        }
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        u32 i = threadIdx.x + 128 * e;
        if ((u32)e < od && i < d) {
#pragma unroll
            for (int g = 0; g < 16; ++g)
                if ((u32)g < G) o_part[((u64)s * nq + h0 + g) * d + i] = acc[g][e];
        }
    }
    if (threadIdx.x < G) {
        m_part[s * nq + h0 + threadIdx.x] = m_s[threadIdx.x];
        l_part[s * nq + h0 + threadIdx.x] = l_s[threadIdx.x];
    }
    }  // splits
}

extern "C" __global__ void __launch_bounds__(128)
    attn_decode_split(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
                      float* __restrict__ ws, const u32* __restrict__ pos_ptr, u32 pos_base,
                      const u32* __restrict__ kv_base, u32 nq, u32 nkv, u32 d, u32 cap, u32 chunk, u32 n_splits,
                      float sl2) {
    attn_decode_split_t<ActBf16, false>(qkv, kc, vc, ws, pos_ptr, pos_base, kv_base, nq, nkv, d, cap, chunk, n_splits,
                                        sl2, 0, 0);
}

extern "C" __global__ void __launch_bounds__(128)
    attn_decode_split_ring(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ kc,
                           const bf16_t* __restrict__ vc, float* __restrict__ ws, const u32* __restrict__ pos_ptr,
                           u32 pos_base, const u32* __restrict__ kv_base, u32 nq, u32 nkv, u32 d, u32 cap,
                           u32 chunk, u32 n_splits, float sl2, u32 window, u32 ring) {
    attn_decode_split_t<ActBf16, true>(qkv, kc, vc, ws, pos_ptr, pos_base, kv_base, nq, nkv, d, cap, chunk, n_splits,
                                       sl2, window, ring);
}

// FP16 variants (ActFormat::F16): q, K and V read as f16; the partial
// outputs are f32, so the combine kernels serve both formats.
extern "C" __global__ void __launch_bounds__(128)
    attn_decode_split_f16(const f16_t* __restrict__ qkv, const f16_t* __restrict__ kc, const f16_t* __restrict__ vc,
                          float* __restrict__ ws, const u32* __restrict__ pos_ptr, u32 pos_base,
                          const u32* __restrict__ kv_base, u32 nq, u32 nkv, u32 d, u32 cap, u32 chunk, u32 n_splits,
                          float sl2) {
    attn_decode_split_t<ActF16, false>(qkv, kc, vc, ws, pos_ptr, pos_base, kv_base, nq, nkv, d, cap, chunk, n_splits,
                                       sl2, 0, 0);
}

extern "C" __global__ void __launch_bounds__(128)
    attn_decode_split_ring_f16(const f16_t* __restrict__ qkv, const f16_t* __restrict__ kc,
                               const f16_t* __restrict__ vc, float* __restrict__ ws, const u32* __restrict__ pos_ptr,
                               u32 pos_base, const u32* __restrict__ kv_base, u32 nq, u32 nkv, u32 d, u32 cap,
                               u32 chunk, u32 n_splits, float sl2, u32 window, u32 ring) {
    attn_decode_split_t<ActF16, true>(qkv, kc, vc, ws, pos_ptr, pos_base, kv_base, nq, nkv, d, cap, chunk, n_splits,
                                      sl2, window, ring);
}

template <bool RING>
__device__ __forceinline__ void attn_decode_combine_t(const float* __restrict__ ws, bf16_t* __restrict__ out,
                                                      const u32* __restrict__ pos_ptr, u32 pos_base, u32 nq, u32 d,
                                                      u32 n_splits, u32 chunk, const float* __restrict__ sinks,
                                                      u32 window) {
    pdl_wait();
    pdl_trigger();
    // Per-split maxima and weights, staged once for the block: a loop of
    // global loads per split, each waiting on the last, made a 64-split
    // combine ~35 us (8K context), ten times the split kernel's writes.
    __shared__ float ms_s[DEC_MAX_SPLITS], f_s[DEC_MAX_SPLITS], l_s[DEC_MAX_SPLITS];
    const u32 h = blockIdx.x, i = threadIdx.x, z = blockIdx.y;
    if (h >= nq) return;
    const u32 pos = token_pos(pos_ptr, pos_base, z);
    ws += (u64)z * DEC_MAX_SPLITS * nq * (d + 2);
    out += (u64)z * nq * d;
    // Splits that hold live keys: s * chunk < n_keys (plain: s * chunk <= pos).
    u32 n_keys = pos + 1;
    if constexpr (RING) {
        u32 kfirst;
        decode_span<true>(pos, 0, window, kfirst, n_keys);
    }
    chunk = decode_chunk(chunk, n_keys, n_splits);
    const u32 n_act = min(n_splits, RING ? (n_keys + chunk - 1) / chunk : pos / chunk + 1);
    const float* o_part = ws;
    const float* m_part = ws + (u64)DEC_MAX_SPLITS * nq * d;
    const float* l_part = m_part + DEC_MAX_SPLITS * nq;
    for (u32 s = i; s < n_act; s += blockDim.x) {
        ms_s[s] = m_part[s * nq + h];
        l_s[s] = l_part[s * nq + h];
    }
    __syncthreads();
    // Every thread reduces the same values in the same order, so all agree
    // (max is order-free; the sums below keep the split order).
    float M = NEG_INF_F;
    float sink2 = NEG_INF_F;
    if constexpr (RING) {
        if (sinks) sink2 = sinks[h] * DEC_LOG2E;
        M = sink2;
    }
    for (u32 s = 0; s < n_act; ++s) M = fmaxf(M, ms_s[s]);
    __syncthreads();
    // A split without keys (m = -inf) weighs 0 and is skipped below.
    for (u32 s = i; s < n_act; s += blockDim.x) f_s[s] = ms_s[s] == NEG_INF_F ? 0.0f : exp2f(ms_s[s] - M);
    __syncthreads();
    if (i >= d) return;
    float L = 0.0f, O = 0.0f;
    // The sink: one more logit in the denominator, no value (header).
    if constexpr (RING) {
        if (sinks) L = exp2f(sink2 - M);
    }
    // In split order, as one sequential merge would; the o loads of a group
    // of 8 splits are issued together (an empty split's o is never written:
    // loaded, not used).
    for (u32 s0 = 0; s0 < n_act; s0 += 8) {
        float o[8];
#pragma unroll
        for (u32 j = 0; j < 8; ++j) o[j] = s0 + j < n_act ? o_part[((u64)(s0 + j) * nq + h) * d + i] : 0.0f;
#pragma unroll
        for (u32 j = 0; j < 8; ++j) {
            const u32 s = s0 + j;
            if (s < n_act && ms_s[s] != NEG_INF_F) {
                L += l_s[s] * f_s[s];
                O += o[j] * f_s[s];
            }
        }
    }
    out[(u64)h * d + i] = f2bf(O / L);
}

extern "C" __global__ void attn_decode_combine(const float* __restrict__ ws, bf16_t* __restrict__ out,
                                               const u32* __restrict__ pos_ptr, u32 pos_base, u32 nq, u32 d,
                                               u32 n_splits, u32 chunk) {
    attn_decode_combine_t<false>(ws, out, pos_ptr, pos_base, nq, d, n_splits, chunk, nullptr, 0);
}

extern "C" __global__ void attn_decode_combine_ring(const float* __restrict__ ws, bf16_t* __restrict__ out,
                                                    const u32* __restrict__ pos_ptr, u32 pos_base, u32 nq, u32 d,
                                                    u32 n_splits, u32 chunk, const float* __restrict__ sinks,
                                                    u32 window) {
    attn_decode_combine_t<true>(ws, out, pos_ptr, pos_base, nq, d, n_splits, chunk, sinks, window);
}
