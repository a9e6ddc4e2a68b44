// Hopper (sm_90a) helpers shared by the wgmma kernels
// (attention_prefill_sm90.cu, int4_gemm_sm90.cu), prepended to their
// modules by sources.rs (Target::Sm90a modules only: wgmma is not in the
// portable sm_90 target). Moved unchanged from attention_prefill_sm90.cu,
// whose machine code is the same (kcompile --dump, tools/cubin_diff.py).

// A shared-memory matrix descriptor with the 128-byte swizzle (layout type
// 1 in bits 62-63); addresses and offsets in 16-byte units, 14 bits each.
__device__ __forceinline__ u64 h_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)((lbo & 0x3FFFFu) >> 4) << 16) |
           ((u64)((sbo & 0x3FFFFu) >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Pins registers in place around asynchronous products: the compiler may
// not move their reads or writes across this point.
template <int N> __device__ __forceinline__ void h_fence_regs(float* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void h_fence_regs(u32* r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// Waits until at most N committed wgmma groups of this warpgroup are still
// in flight (N = 0: all complete; N = 1: the previous group is complete
// while the last runs).
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
