// Token selection: greedy argmax and seeded sampling with penalties,
// temperature, top-k, top-p and min-p (semantics in
// kernels/src/ops/sampling.rs; the CPU reference mirrors them).
//
// argmax_*: one 1024-thread block per row; (value, index) reduction with
// ties to the lower index; NaN is treated as -inf.
// sample_prepare_*: multi-block pass writing penalized, temperature-scaled
// logits (f32 bits) into the workspace plus one partial (max, argmax) per
// block, so greedy selection reduces 256 partials instead of walking the
// whole vocabulary in one block (34 us for 152K logits on an H200).
// Fail closed on a non-finite logit (an FP16 activation past 65504 becomes
// inf, and from there NaN): sample_prepare marks a block that read a
// non-finite raw logit by storing NaN as its partial max (never a prepared
// value: those are cleaned to -inf), and sample_select then writes
// SAMPLE_NONFINITE (0xffffffff, no token id) and touches no count, so the
// host refuses the step instead of emitting a token.
// Grammar masks (structured output): sample_prepare takes an optional
// bitmask (bit v & 31 of word v >> 5 allows token v; null: no mask) and
// gives every token it does not allow -inf after the penalties, so it has
// weight 0, can never be the greedy pick (unless nothing is allowed: the
// host never sends an empty mask), and no later step brings it back. The
// non-finite check still reads every raw logit: a masked-out overflow is
// still an overflow.
// sample_select: a single 1024-thread block. Logits become 24-bit integer
// weights w = min(floor(exp(l - max) * 2^24), 2^24 - 1), so all masses are
// exact u64 sums and the result cannot depend on summation order. Top-k and
// top-p thresholds come from 3-round (8 bits each) radix selects with
// shared-memory integer histograms; the draw is Philox4x32-10(seed, step)
// scaled into the kept mass and located with a block-wide prefix scan over
// contiguous per-thread ranges (ascending ids).

__device__ __forceinline__ float clean(float v) { return v != v ? NEG_INF_F : v; }

__device__ __forceinline__ bool better(float v, u32 i, float bv, u32 bi) { return v > bv || (v == bv && i < bi); }

// Block arg-max (1024 threads); result valid in all threads.
__device__ void block_argmax(float v, u32 i, float* sv, u32* si, float& out_v, u32& out_i) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        u32 oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
    __syncthreads();
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    v = lane < (blockDim.x >> 5) ? sv[lane] : NEG_INF_F;
    i = lane < (blockDim.x >> 5) ? si[lane] : 0xffffffffu;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        u32 oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
    out_v = v;
    out_i = i;
}

template <typename T> __device__ __forceinline__ float ld_l(const T* p, u64 i);
template <> __device__ __forceinline__ float ld_l<float>(const float* p, u64 i) { return p[i]; }
template <> __device__ __forceinline__ float ld_l<bf16_t>(const bf16_t* p, u64 i) { return bf2f(p[i]); }

template <typename T> __device__ void argmax_row(const T* __restrict__ logits, u32* __restrict__ out, u32 rows, u32 V) {
    __shared__ float sv[32];
    __shared__ u32 si[32];
    const u32 r = blockIdx.x;
    if (r >= rows) return;
    const T* x = logits + (u64)r * V;
    float bv = NEG_INF_F;
    u32 bi = 0xffffffffu;
    for (u32 i = threadIdx.x; i < V; i += blockDim.x) {
        float v = clean(ld_l<T>(x, i));
        if (better(v, i, bv, bi)) {
            bv = v;
            bi = i;
        }
    }
    float fv;
    u32 fi;
    block_argmax(bv, bi, sv, si, fv, fi);
    if (threadIdx.x == 0) out[r] = fi < V ? fi : 0u;
}

extern "C" __global__ void __launch_bounds__(1024) argmax_f32(const float* __restrict__ l, u32* __restrict__ out,
                                                              u32 rows, u32 V) {
    argmax_row<float>(l, out, rows, V);
}
extern "C" __global__ void __launch_bounds__(1024) argmax_bf16(const bf16_t* __restrict__ l, u32* __restrict__ out,
                                                               u32 rows, u32 V) {
    argmax_row<bf16_t>(l, out, rows, V);
}

#define PREP_MAX_BLOCKS 256  // = SAMPLE_PREP_BLOCKS in kernels/src/ops/sampling.rs
#define SAMPLE_NONFINITE 0xffffffffu  // = SAMPLE_NONFINITE there
#define SAMPLE_MAX_ROWS 8  // = SAMPLE_MAX_ROWS there

// Rows: one launch pair samples every row of a decode step (prepare: grid
// y = row; select: one block per row), each row with its own settings,
// counts row and mask row, so a step of M rows costs two launches whose
// blocks run side by side instead of 2M launches one after another (the
// select pass is one block, ~10 passes over the vocabulary when sampling).
// The settings travel by value in the kernel parameters (SampleRows, the
// layout of SampleRowsArg in ops/sampling.rs): nothing is written to the
// device per step. A row's arithmetic is the single-row kernels': its
// result does not depend on the other rows.
struct SampleRow {
    u64 seed;
    u64 step;     // Philox counter
    u32 slot;     // the row's counts row and mask row
    u32 masked;   // 1: mask row `slot` applies
    u32 greedy;   // 1: temperature 0
    u32 top_k;    // 0: off (the host clears k >= V)
    float presence, frequency, inv_t, top_p, min_p;
    u32 pad;
};
struct SampleRows {
    SampleRow r[SAMPLE_MAX_ROWS];
};

template <typename T>
__device__ void sample_prepare(const T* __restrict__ logits, const u32* __restrict__ counts,
                               const u32* __restrict__ mask, u32* __restrict__ ws, u32 V, float presence,
                               float frequency, float inv_t) {
    __shared__ float sv[32];
    __shared__ u32 si[32];
    float bv = NEG_INF_F;
    u32 bi = 0xffffffffu;
    int bad = 0;
    for (u32 v = blockIdx.x * blockDim.x + threadIdx.x; v < V; v += gridDim.x * blockDim.x) {
        const u32 c = counts[v];
        float l = ld_l<T>(logits, v);
        bad |= !isfinite(l);
        l = (l - (c > 0 ? presence : 0.0f) - frequency * (float)c) * inv_t;
        l = clean(l);
        if (mask && !((mask[v >> 5] >> (v & 31)) & 1u)) l = NEG_INF_F;
        ws[v] = __float_as_uint(l);
        if (better(l, v, bv, bi)) {
            bv = l;
            bi = v;
        }
    }
    bad = __syncthreads_or(bad);
    float fv;
    u32 fi;
    block_argmax(bv, bi, sv, si, fv, fi);
    if (threadIdx.x == 0) {
        ws[V + blockIdx.x] = bad ? 0x7fc00000u : __float_as_uint(fv);
        ws[V + PREP_MAX_BLOCKS + blockIdx.x] = fi;
    }
}

// Row blockIdx.y of a launch: its logits, counts, mask and workspace rows.
template <typename T>
__device__ __forceinline__ void sample_prepare_row(const T* __restrict__ l, u32 l_stride,
                                                   const u32* __restrict__ counts, u32 c_stride,
                                                   const u32* __restrict__ masks, u32 m_stride, u32* __restrict__ ws,
                                                   u32 ws_stride, u32 V, const SampleRows& rows) {
    const u32 row = blockIdx.y;
    const SampleRow& r = rows.r[row];
    const u32* mask = masks && r.masked ? masks + (u64)r.slot * m_stride : nullptr;
    sample_prepare<T>(l + (u64)row * l_stride, counts + (u64)r.slot * c_stride, mask, ws + (u64)row * ws_stride, V,
                      r.presence, r.frequency, r.inv_t);
}

extern "C" __global__ void sample_prepare_f32(const float* __restrict__ l, u32 l_stride,
                                              const u32* __restrict__ counts, u32 c_stride,
                                              const u32* __restrict__ masks, u32 m_stride, u32* __restrict__ ws,
                                              u32 ws_stride, u32 V, SampleRows rows) {
    sample_prepare_row<float>(l, l_stride, counts, c_stride, masks, m_stride, ws, ws_stride, V, rows);
}
extern "C" __global__ void sample_prepare_bf16(const bf16_t* __restrict__ l, u32 l_stride,
                                               const u32* __restrict__ counts, u32 c_stride,
                                               const u32* __restrict__ masks, u32 m_stride, u32* __restrict__ ws,
                                               u32 ws_stride, u32 V, SampleRows rows) {
    sample_prepare_row<bf16_t>(l, l_stride, counts, c_stride, masks, m_stride, ws, ws_stride, V, rows);
}

__device__ void philox(u64 seed, u64 ctr, u32* out) {
    u32 c0 = (u32)ctr, c1 = (u32)(ctr >> 32), c2 = 0, c3 = 0;
    u32 k0 = (u32)seed, k1 = (u32)(seed >> 32);
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const u32 hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const u32 hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        const u32 n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

// Exclusive block scan (1024 threads) of u64; returns the exclusive prefix,
// total in *total.
__device__ u64 block_scan_u64(u64 v, u64* sh, u64* total) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 inc = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        u64 n = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= (u32)o) inc += n;
    }
    __syncthreads();
    if (lane == 31) sh[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        u64 w = sh[lane];
        u64 wi = w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            u64 n = __shfl_up_sync(0xffffffffu, wi, o);
            if (lane >= (u32)o) wi += n;
        }
        sh[32 + lane] = wi - w;  // exclusive prefix of warp totals
        if (lane == 31) sh[64] = wi;
    }
    __syncthreads();
    *total = sh[64];
    return sh[32 + warp] + inc - v;
}

#define W_ONE 16777216.0f
#define W_MAX 16777215u

// One row (the block's: blockIdx.x) of a launch.
extern "C" __global__ void __launch_bounds__(1024)
    sample_select(u32* __restrict__ ws, u32 ws_stride, u32* __restrict__ counts, u32 c_stride, u32* __restrict__ out,
                  u32 V, u32 nblocks, SampleRows rows) {
    const u32 row = blockIdx.x;
    const SampleRow& rr = rows.r[row];
    ws += (u64)row * ws_stride;
    counts += (u64)rr.slot * c_stride;
    out += row;
    const u32 greedy = rr.greedy, top_k = rr.top_k;
    const float top_p = rr.top_p, min_p = rr.min_p;
    const u64 seed = rr.seed, step = rr.step;
    __shared__ float sv[32];
    __shared__ u32 si[32];
    __shared__ u32 hist[256];
    __shared__ u64 hmass[256];
    __shared__ u64 sh[65];
    __shared__ u32 sel[4];
    __shared__ u64 selm[2];
    const u32 tid = threadIdx.x;

    // A block read a non-finite logit (its partial max is NaN): no token.
    int bad = 0;
    for (u32 b = tid; b < nblocks; b += blockDim.x) {
        const float l = __uint_as_float(ws[V + b]);
        bad |= l != l;
    }
    if (__syncthreads_or(bad)) {
        if (tid == 0) out[0] = SAMPLE_NONFINITE;
        return;
    }

    if (greedy) {
        // The blocks' partial (max, lowest argmax) pairs; ties across
        // blocks also go to the lowest id.
        float bv = NEG_INF_F;
        u32 bi = 0xffffffffu;
        for (u32 b = tid; b < nblocks; b += blockDim.x) {
            const float l = __uint_as_float(ws[V + b]);
            const u32 i = ws[V + PREP_MAX_BLOCKS + b];
            if (better(l, i, bv, bi)) {
                bv = l;
                bi = i;
            }
        }
        float fv;
        u32 fi;
        block_argmax(bv, bi, sv, si, fv, fi);
        if (tid == 0) {
            const u32 id = fi < V ? fi : 0u;
            out[0] = id;
            counts[id] += 1;
        }
        return;
    }

    // Global max of the prepared logits.
    float mx = NEG_INF_F;
    for (u32 b = tid; b < nblocks; b += blockDim.x) mx = fmaxf(mx, __uint_as_float(ws[V + b]));
    {
        float fv;
        u32 fi;
        block_argmax(mx, 0, sv, si, fv, fi);
        mx = fv;
    }
    // Integer weights, in place (each thread rewrites only its own entries).
    for (u32 v = tid; v < V; v += blockDim.x) {
        const float l = __uint_as_float(ws[v]);
        const float e = expf(l - mx) * W_ONE;
        ws[v] = e >= (float)W_MAX ? W_MAX : (u32)e;
    }
    __syncthreads();

    // Top-k threshold: the k-th largest weight tk and how many of the
    // weights equal to tk are kept (need_eq, lowest ids first).
    u32 tk = 0, need_eq = 0;
    const bool use_k = top_k > 0;
    if (use_k) {
        u32 prefix = 0, want = top_k;
        for (int round = 2; round >= 0; --round) {
            const int shift = 8 * round;
            const u32 hmask = round == 2 ? 0u : (0xFFFFFFu << (shift + 8)) & 0xFFFFFFu;
            for (u32 b = tid; b < 256; b += blockDim.x) hist[b] = 0;
            __syncthreads();
            for (u32 v = tid; v < V; v += blockDim.x) {
                const u32 w = ws[v];
                if ((w & hmask) == prefix) atomicAdd(&hist[(w >> shift) & 0xFF], 1u);
            }
            __syncthreads();
            if (tid == 0) {
                u32 cum = 0, b = 255;
                for (;; --b) {
                    if (cum + hist[b] >= want || b == 0) break;
                    cum += hist[b];
                }
                sel[0] = prefix | (b << shift);
                sel[1] = want - cum;
            }
            __syncthreads();
            prefix = sel[0];
            want = sel[1];
            __syncthreads();
        }
        tk = prefix;
        need_eq = want;
    }

    // Top-p threshold over the top-k set.
    u32 tp = 0;
    if (top_p < 1.0f) {
        u64 local = 0;
        for (u32 v = tid; v < V; v += blockDim.x) {
            const u32 w = ws[v];
            if (!use_k || w > tk) local += w;
        }
        u64 mk;
        block_scan_u64(local, sh, &mk);
        if (use_k) mk += (u64)need_eq * tk;
        u64 target = (u64)ceil((double)top_p * (double)mk);
        if (target < 1) target = 1;
        u32 prefix = 0;
        u64 above = 0;
        for (int round = 2; round >= 0; --round) {
            const int shift = 8 * round;
            const u32 hmask = round == 2 ? 0u : (0xFFFFFFu << (shift + 8)) & 0xFFFFFFu;
            for (u32 b = tid; b < 256; b += blockDim.x) hmass[b] = 0;
            __syncthreads();
            for (u32 v = tid; v < V; v += blockDim.x) {
                const u32 w = ws[v];
                if ((w & hmask) == prefix && (!use_k || w > tk))
                    atomicAdd((unsigned long long*)&hmass[(w >> shift) & 0xFF], (unsigned long long)w);
            }
            __syncthreads();
            if (tid == 0) {
                if (use_k && need_eq > 0 && (tk & hmask) == prefix) hmass[(tk >> shift) & 0xFF] += (u64)need_eq * tk;
                u64 cum = above;
                u32 b = 255;
                for (;; --b) {
                    if (cum + hmass[b] >= target || b == 0) break;
                    cum += hmass[b];
                }
                sel[2] = prefix | (b << shift);
                selm[0] = cum;
            }
            __syncthreads();
            prefix = sel[2];
            above = selm[0];
            __syncthreads();
        }
        tp = prefix;
    }
    const u32 tm = min_p > 0.0f ? (u32)ceil((double)min_p * (double)W_MAX) : 0u;
    const u32 thr = max(tp, tm);

    // Contiguous per-thread ranges: tie ranks, then kept mass, then draw.
    const u32 cs = (V + blockDim.x - 1) / blockDim.x;
    const u32 lo = min(tid * cs, V), hi = min(lo + cs, V);
    u64 eq_local = 0;
    if (use_k)
        for (u32 v = lo; v < hi; ++v) eq_local += ws[v] == tk;
    u64 eq_total;
    u64 eq_rank = block_scan_u64(eq_local, sh, &eq_total);
    u64 mass = 0;
    {
        u64 r = eq_rank;
        for (u32 v = lo; v < hi; ++v) {
            const u32 w = ws[v];
            bool in_k = !use_k || w > tk || (w == tk && r++ < need_eq);
            if (in_k && w >= thr) mass += w;
        }
    }
    u64 total;
    const u64 before = block_scan_u64(mass, sh, &total);
    u32 rnd[4];
    philox(seed, step, rnd);
    const u64 r64 = ((u64)rnd[0] << 32) | rnd[1];
    const u64 target = __umul64hi(r64, total);
    if (total == 0) {  // every logit was -inf or NaN: nothing to draw from
        if (tid == 0) {
            out[0] = 0;
            counts[0] += 1;
        }
        return;
    }
    if (target >= before && target < before + mass) {
        u64 cum = before, r = eq_rank;
        for (u32 v = lo; v < hi; ++v) {
            const u32 w = ws[v];
            bool in_k = !use_k || w > tk || (w == tk && r++ < need_eq);
            if (in_k && w >= thr) {
                cum += w;
                if (cum > target) {
                    out[0] = v;
                    counts[v] += 1;
                    break;
                }
            }
        }
    }
}
