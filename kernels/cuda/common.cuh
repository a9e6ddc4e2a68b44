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
