// Shared device helpers, prepended to every kernel module.
//
// No CUDA headers are included (NVRTC then needs no include paths): bf16 and
// f16 are carried as raw 16-bit patterns and converted with PTX `cvt`, which
// rounds to nearest even exactly like `half::bf16::from_f32` /
// `half::f16::from_f32` on the host.
// Reductions use fixed shuffle/tree orders only; there are no atomics on
// floating-point values anywhere, so every result is bit-reproducible.

typedef unsigned short bf16_t;
typedef unsigned short f16_t;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;

#define NAN_F __int_as_float(0x7fc00000)
#define NEG_INF_F __int_as_float(0xff800000)

// Programmatic dependent launch (sm_90+; compiled out below it, where the
// host launches every kernel plainly). A kernel the host launches as a
// programmatic dependent (`launch.rs`: `launch_dependent`, `submit_ex`) may
// start while the kernel before it on the stream is still running:
// pdl_wait() blocks the thread until that grid has completed and its
// writes are visible. Every such kernel calls it, in every block that
// touches memory another kernel writes, before the first such access (the
// exceptions, documented where they are: a GEMV's weight loads, w2's ids,
// table and weights, the tail lookup's own state, w13 after the tail's
// fetch), and at least one block of every such grid calls it, so a
// dependent's completion still implies its predecessors' (a successor that
// waits on it waits on them). pdl_trigger() lets this grid's own dependent
// get scheduled once every block has passed it (or exited): its blocks
// then sit in their pdl_wait while this grid finishes, so the launch and
// block start-up overlap the tail instead of following it. A kernel that
// computes nothing before its wait (rope, the KV append, decode attention,
// the router top-k) waits first and triggers after: triggering first let a
// chain of dependents become resident one after another, each waiting on the
// one before, holding SM slots the running grid's later work needed (a3b at a
// 1K context, H200: one decode row 544.5 -> 621.1 tok/s once they waited
// first, session 23). Both are no-ops in a kernel launched plainly.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Position of token (or decode row) t of a launch: from the device array
// (pos_ptr[t]: each row of a batched decode step is its own sequence's
// next position; a captured graph reads them at replay), else the host's
// first position + t (a prefill chunk).
__device__ __forceinline__ u32 token_pos(const u32* pos_ptr, u32 pos_base, u32 t) {
    return pos_ptr ? pos_ptr[t] : pos_base + t;
}

__device__ __forceinline__ float bf2f(bf16_t x) { return __uint_as_float(((u32)x) << 16); }

__device__ __forceinline__ bf16_t f2bf(float f) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

__device__ __forceinline__ float h2f(f16_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}

// Pack two floats into bf16x2: `lo` in the low half (lower address).
__device__ __forceinline__ u32 pack_bf2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float bf_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ f16_t f2h(float f) {
    unsigned short r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// Pack two floats into f16x2: `lo` in the low half (lower address).
__device__ __forceinline__ u32 pack_h2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float h_lo(u32 v) { return h2f((f16_t)(v & 0xffffu)); }
__device__ __forceinline__ float h_hi(u32 v) { return h2f((f16_t)(v >> 16)); }

// The 16-bit activation formats of the attention path (AttentionSpec::
// activations): tag types whose static members load/store one format, so
// one kernel template serves both. ActBf16's members are the helpers above,
// so a template instantiated with it compiles to the code written with them
// directly. Both formats are carried as the same raw 16-bit type.
struct ActBf16 {
    static constexpr bool F16 = false;
    static __device__ __forceinline__ float load(unsigned short x) { return bf2f(x); }
    static __device__ __forceinline__ unsigned short store(float f) { return f2bf(f); }
    static __device__ __forceinline__ u32 pack2(float lo, float hi) { return pack_bf2(lo, hi); }
    static __device__ __forceinline__ float lo(u32 v) { return bf_lo(v); }
    static __device__ __forceinline__ float hi(u32 v) { return bf_hi(v); }
};

// IEEE half: out-of-range values round to +-inf (cvt.rn), as the host's
// half::f16::from_f32 does.
struct ActF16 {
    static constexpr bool F16 = true;
    static __device__ __forceinline__ float load(unsigned short x) { return h2f(x); }
    static __device__ __forceinline__ unsigned short store(float f) { return f2h(f); }
    static __device__ __forceinline__ u32 pack2(float lo, float hi) { return pack_h2(lo, hi); }
    static __device__ __forceinline__ float lo(u32 v) { return h_lo(v); }
    static __device__ __forceinline__ float hi(u32 v) { return h_hi(v); }
};

// c += A(16x16) * B(16x8) in format A (bf16 or f16), f32 accumulate
// (mma.sync.m16n8k16: the INT4 expert kernels and the LM head GEMV).
template <class A = ActBf16>
__device__ __forceinline__ void mma16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    if constexpr (A::F16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum, result broadcast to all threads. `scratch` holds >= 32
// floats. Fixed order: per-warp xor tree, then warp 0 over warp totals.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = (lane < nw) ? scratch[lane] : 0.0f;
    t = warp_sum(t);
    return t;
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// Expert pointer tables (decode GEMVs, grouped GEMMs): an entry is a
// 16-byte aligned address, so bit 0 is free to mean "fresh": HCS decode's
// tail lookup promoted the expert in this step and `tail_fetch`, the
// kernel this one was launched as a programmatic dependent of, is still
// copying its bytes into the slot (`cuda/expert_tail.cu`). A thread that
// meets a fresh entry waits for that grid (griddepcontrol.wait: completed,
// its writes visible) before it reads the expert, so the layer's resident
// experts are computed while the misses are copied. A fresh bit met
// anywhere else (the kernel launched normally: the wait returns at once;
// an entry the next lookup has not cleared yet) costs nothing and means
// nothing: the slot holds the expert's bytes.
#define TABLE_FRESH 1ull
__device__ __forceinline__ u64 table_entry(const u64* table, u32 id) {
    u64 b = table[id];
    if (b & TABLE_FRESH) {
        pdl_wait();
        b &= ~TABLE_FRESH;
    }
    return b;
}

// Grouped expert GEMMs for prefill (int4_gemm.cu, mxfp4_gemm.cu): expert
// e's rows are offsets[e]..offsets[e+1], covered in token tiles of BT rows
// of one expert, the tiles of all experts numbered expert by expert, so
// the host passes only the tile count. Warp 0 writes the expert, first row
// and end row of tile `tile` into info[0..3] (a warp scan of ceil(rows /
// BT) per expert); info[0] keeps the caller's ~0 when the tile is past the
// last expert's.
template <u32 BT>
__device__ __forceinline__ void grouped_find_tile(const u32* __restrict__ offsets, u32 n_experts, u32 tile, u32 lane,
                                                  u32* info) {
    u32 before = 0;
    for (u32 c = 0; c < n_experts; c += 32) {
        const u32 e = c + lane;
        u32 a = 0, b = 0;
        if (e < n_experts) {
            a = offsets[e];
            b = offsets[e + 1];
        }
        const u32 n = b > a ? (b - a + BT - 1) / BT : 0;
        u32 s = n;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const u32 v = __shfl_up_sync(0xFFFFFFFFu, s, d);
            if (lane >= (u32)d) s += v;
        }
        const u32 first = before + s - n;
        if (n > 0 && tile >= first && tile < first + n) {
            const u32 ra = a + (tile - first) * BT;
            info[0] = e;
            info[1] = ra;
            info[2] = min(b, ra + BT);
        }
        before += __shfl_sync(0xFFFFFFFFu, s, 31);
    }
}

// 16-byte global load that bypasses L1 allocation (streamed weights).
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// Asynchronous 16-byte global -> shared copies (sm_80+), past L1.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(smem)), "l"(gmem));
}
// Copies `bytes` (0 or 16) and zero-fills the rest of the 16: a row past
// the end reads nothing and stages zeros.
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, u32 bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(smem)), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
// "memory": shared-memory reads of the staged data must not move above the
// wait (the callers' __syncthreads also orders them; this does not rely on it).
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// block_sum (above) of MB values at once: each value takes exactly
// block_sum's tree (warp_sum, then the warps' sums in warp order through
// shared memory, then warp_sum), with one pair of barriers for all.
template <int MB>
__device__ __forceinline__ void block_sum_rows(float* v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int t = 0; t < MB; ++t) v[t] = warp_sum(v[t]);
    __syncthreads();
    if (lane == 0) {
#pragma unroll
        for (int t = 0; t < MB; ++t) scratch[t * 32 + warp] = v[t];
    }
    __syncthreads();
#pragma unroll
    for (int t = 0; t < MB; ++t) v[t] = warp_sum((lane < nw) ? scratch[t * 32 + lane] : 0.0f);
}

// Output y[o] = s of both decode GEMV forms (gemv.cu, gemv_tc.cu), by their
// mode argument: 0 = 16-bit y (format A), 1 = f32 y, 2 = f32 y += s.
template <class A>
__device__ __forceinline__ void gemv_store(void* y, u64 o, float s, u32 mode) {
    if (mode == 0) {
        ((unsigned short*)y)[o] = A::store(s);
    } else {
        float* yf = (float*)y;
        yf[o] = mode == 2 ? yf[o] + s : s;
    }
}

// The fused RMSNorm prologue of both decode GEMV forms (gemv.cu, gemv_tc.cu):
// x[t] = A(res[t] * rsqrt(mean(res[t]^2) + eps) * g) for the M rows, into the
// block's staged rows xs (row stride rs 16-byte vectors) and, from block 0,
// into normed. Each row's arithmetic is rmsnorm_f32's (its thread count,
// term order and reduction tree), so every block computes the same bits and
// normed equals rmsnorm_f32's output. The global reads of all rows are
// issued together (row by row, each row cost a dependent L2 round trip and
// a block reduction in series).
template <int MB, class A>
__device__ __forceinline__ void gemv_norm_rows(const float* res, const bf16_t* __restrict__ g, float eps, u32 m,
                                               u32 K, u32 rs, uint4* xs, unsigned short* normed, float* scratch) {
    const u32 V = K >> 3;
    // rmsnorm_row's sum, verbatim per row (same thread count, same
    // order of each row's terms, the same reduction tree).
    // Bucket rows past m sum row m - 1 again (unguarded, so one
    // iteration's loads of all rows go out together); unused.
    float ss[MB];
    const float* rrow[MB];
#pragma unroll
    for (int t = 0; t < MB; ++t) {
        ss[t] = 0.0f;
        rrow[t] = res + (u64)(MB == 1 ? 0u : min((u32)t, m - 1)) * K;
    }
    // NB of a thread's iterations at a time, their loads predicated
    // rather than behind the loop's exit test, so they go out together
    // (`#pragma unroll 4` over a runtime trip count left one L2 round
    // trip per iteration: K / 256 in series). Same terms, same order.
    constexpr int NB = MB <= 2 ? 8 : (MB == 4 ? 4 : 2);
    for (u32 i0 = threadIdx.x; i0 < K; i0 += NB * blockDim.x) {
        float v[NB][MB];
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            const u32 i = i0 + b * blockDim.x;
#pragma unroll
            for (int t = 0; t < MB; ++t) v[b][t] = i < K ? rrow[t][i] : 0.0f;
        }
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            if (i0 + b * blockDim.x < K) {
#pragma unroll
                for (int t = 0; t < MB; ++t) ss[t] += v[b][t] * v[b][t];
            }
        }
    }
    block_sum_rows<MB>(ss, scratch);
    float inv[MB];
#pragma unroll
    for (int t = 0; t < MB; ++t) inv[t] = rsqrtf(ss[t] / (float)K + eps);
    // The rows' loads go out together (TN rows at a time: a guard per
    // row serialized one L2 round trip per row); stores only for t < m.
    const uint4* g4 = (const uint4*)g;
    constexpr int TN = MB < 2 ? MB : 2;
    for (u32 c8 = threadIdx.x; c8 < V; c8 += blockDim.x) {
        const uint4 gv = g4[c8];
#pragma unroll
        for (int t0 = 0; t0 < MB; t0 += TN) {
            float4 a[TN], b[TN];
#pragma unroll
            for (int tt = 0; tt < TN; ++tt) {
                const float4* r4 = (const float4*)rrow[t0 + tt];
                a[tt] = r4[2 * c8];
                b[tt] = r4[2 * c8 + 1];
            }
#pragma unroll
            for (int tt = 0; tt < TN; ++tt) {
                const int t = t0 + tt;
                if (MB == 1 || (u32)t < m) {
                    uint4 o;
                    o.x = A::pack2(a[tt].x * inv[t] * bf_lo(gv.x), a[tt].y * inv[t] * bf_hi(gv.x));
                    o.y = A::pack2(a[tt].z * inv[t] * bf_lo(gv.y), a[tt].w * inv[t] * bf_hi(gv.y));
                    o.z = A::pack2(b[tt].x * inv[t] * bf_lo(gv.z), b[tt].y * inv[t] * bf_hi(gv.z));
                    o.w = A::pack2(b[tt].z * inv[t] * bf_lo(gv.w), b[tt].w * inv[t] * bf_hi(gv.w));
                    xs[t * rs + c8] = o;
                    if (blockIdx.x == 0) ((uint4*)normed)[(u64)t * V + c8] = o;
                }
            }
        }
    }
}
