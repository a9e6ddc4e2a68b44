// BF16 weight GEMV for decode (M = 1..8 tokens): y[t, n] = sum_k x[t, k] * W[n, k]
// with W an nn.Linear weight [N, K] bf16, f32 accumulation, output bf16 or f32
// (optionally added to y: o_proj into the f32 residual). The _rmsnorm_ variant
// builds x itself from the f32 residual, exactly as rmsnorm_f32 does, and one
// block also writes that normalized x out (the routed experts read it).
//
// Why not cuBLAS: at M = 1 gemm_ex costs ~8-10 us for the a3b projections
// (QKV 5120x2048 = 21 MB, o_proj 2048x4096 = 16.8 MB, router 128x2048) while
// HBM moves those bytes in <= 5 us; a GEMV is a pure weight stream, so the
// kernel is built around keeping enough bytes in flight per SM and balancing
// bytes per SM, with the arithmetic kept cheap enough to hide under the loads.
//
// Work split. Grid = min(N, 2 * SMs) blocks of 8 warps (__launch_bounds__
// (256, 2): <= 128 registers, 2 blocks per SM, all resident at once). Block b
// owns the contiguous rows [N*b/G, N*(b+1)/G), so bytes per SM differ by at
// most one row (QKV: 19-20 rows per block; lm_head 151936: ~575). A warp owns
// a group of NR rows and all of K: lane l loads 16-byte vectors l, l+32, ...
// of each row (each load instruction reads 512 contiguous bytes of a row),
// streamed past L1. A group holds 16 vectors per lane (NR * U = 16, 256
// bytes, 64 registers), all issued before any is used: 8 KB per warp, up to
// 128 KB per SM in flight, well above the ~50 KB Little's law asks for at
// ~33 GB/s per SM (4.3 TB/s / 132). Two shapes of the group: NR = 2 rows x
// U = 8 vectors for K <= 2048 (a 2048-K row is 256 vectors = 8 per lane), and
// NR = 1 x U = 16 for larger K (o_proj's 4096-K row in one go); K beyond one
// group's reach (U * 256 elements) is walked in chunks of that size. The next
// group's (or chunk's) loads are issued right after the current one is
// multiplied, before its warp reduction and store. Smaller K leaves lanes
// idle (correct, not tuned: no decode projection has K < 2048).
//
// x is staged once per block in shared memory as bf16 (M*K*2 bytes, hence
// M*K <= 32768: 64 KB) and read as one 16-byte vector per weight vector
// (consecutive lanes, conflict free), shared by the NR rows of a group.
// Products are f32 FMAs in a fixed order per lane (two interleaved partial
// sums per row: lo halves and hi halves of each weight pair, for ILP,
// added once at the end), then a fixed xor-shuffle tree across lanes, so
// results are bit-reproducible; nothing is atomic. M is bucketed to 1, 2, 4
// or 8 at compile time (accumulators in registers). A bucket row past the
// real M reads x row M - 1 and is computed but never stored: a run-time
// guard per row split the inner loop into blocks the compiler could not
// schedule across (each with its own exposed shared-memory load and its
// own weight conversions: ~82 instructions per weight vector at M = 4,
// ~59 without the guard; static SASS, session 21). M = 8 keeps the guard
// (unguarded, its 8 rows' x loads and addresses spill).
// Row invariance (continuous batching): row t of an M-row launch runs
// exactly the FMAs, in the same order, of a one-row launch of that row
// (the same two partial sums, the same shuffle tree, the same block and
// warp owning each output), whatever M and whatever the other rows hold;
// so a sequence's projections do not depend on which sequences decode
// beside it. (M = 1 once used two partial sums and M > 1 one, which broke
// this; the M = 1 code is the one kept.) kernels/tests/gpu/gemv.rs checks
// it bit for bit for every M <= 8. Per 16-byte weight vector the M = 1 path costs ~27 instructions
// per lane (~20% of the SM's issue rate at full HBM speed); at M = 8 the x
// conversions and FMAs reach ~85% of it, so M > 4 may run below HBM speed.
// The prologue's row loads (sums of squares, normalization) are issued
// together, predicated, for the same reason: a loop over a run-time trip
// count, or a guard per row, put one L2 round trip per iteration or row in
// series ahead of the first FMA (K / 256 + M of them before, 1-2 now).
//
// RMSNorm variant: every block needs the whole normalized x, so every block
// recomputes the sums of squares of the M residual rows (8 KB each at K 2048,
// L2 hits) with rmsnorm_f32's exact code: 256 threads, thread t summing
// elements t, t+256, ... in order, then block_sum, then rsqrtf(ss/K + eps)
// and bf16(r * inv * g) rounded once. Same order => the same inv in every
// block and x bit-identical to rmsnorm_f32's output; block 0 writes it to
// `normed`. The M rows' sums run side by side (one thread's loads of every
// row in flight together, one pair of barriers for the M reductions:
// block_sum_rows), and the plain variant stages x with 4 loads per thread
// in flight: row by row, each extra row of a batched step cost a dependent
// round trip and a reduction (qkv +norm at 4 rows: 19.6 us that way, 15.5
// this way; kbench --rows on the H200).
//
// Launch overlap (sm_90): the host launches these kernels as programmatic
// dependents (PDL) of the previous kernel on the stream. A block triggers its
// own dependents at once, issues its first weight group's loads (weights are
// never written by the preceding kernel), then griddepcontrol.wait before
// it reads x / the residual / y or writes anything. So the launch latency and
// the first DRAM round trip overlap the previous kernel's tail. On sm_80 the
// griddepcontrol instructions are compiled out and the host launches
// normally. Data written by the previous kernel is read with plain
// (coherent) loads, not the read-only .nc path. A dependent that starts early
// waits on our completion the same way, so the early trigger is safe for any
// PDL-launched successor (int4_w2_combine, another GEMV).
//
// Written without a GPU at hand: the rates above are estimates (graph-timed
// targets: >= 3 TB/s for QKV and o_proj, ~2-3 us for the router); measure
// with `kbench --gemv`, which rotates the weights through > L2-sized copies.

#define GEMV_WARPS 8

// a[0] (and a[P-1]) += the 8 products of one weight vector and one x vector,
// lo halves into a[0], hi halves into a[P-1], in element order.
template <int P, class A>
__device__ __forceinline__ void gemv_dot8(float* a, const uint4 w, const uint4 x) {
    a[0] = fmaf(A::lo(w.x), A::lo(x.x), a[0]);
    a[P - 1] = fmaf(A::hi(w.x), A::hi(x.x), a[P - 1]);
    a[0] = fmaf(A::lo(w.y), A::lo(x.y), a[0]);
    a[P - 1] = fmaf(A::hi(w.y), A::hi(x.y), a[P - 1]);
    a[0] = fmaf(A::lo(w.z), A::lo(x.z), a[0]);
    a[P - 1] = fmaf(A::hi(w.z), A::hi(x.z), a[P - 1]);
    a[0] = fmaf(A::lo(w.w), A::lo(x.w), a[0]);
    a[P - 1] = fmaf(A::hi(w.w), A::hi(x.w), a[P - 1]);
}

// mode: 0 = 16-bit y (format A), 1 = f32 y, 2 = f32 y += result (gemv_store).
// MB: compile-time bound on m (1, 2, 4, 8). NR x U: rows x vectors per lane
// of one weight group (NR * U = 16). NORM: x from residual + norm weight.
// A: the format of w, x and normed (ActBf16; ActF16 for the QKV projection
// of an FP16 attention block and the projections of an FP16 MLP block,
// whose normed x is rounded to f16 as rmsnorm_f32_to_f16 rounds it). The
// norm weight g is bf16 either way.
template <int MB, int NR, int U, bool NORM, class A = ActBf16>
__device__ __forceinline__ void gemv_body(const unsigned short* x, const float* res, const bf16_t* __restrict__ g,
                                          float eps, const unsigned short* __restrict__ w, u32 m, u32 n, u32 K,
                                          u32 mode, unsigned short* normed, void* y) {
    extern __shared__ __align__(16) uint4 gemv_xs[];  // [m][K/8] vectors of 8 bf16
    __shared__ float scratch[MB * 32];
    constexpr int P = 2;  // per row: lo and hi partial sums (header: row invariance)
    constexpr u32 CH = 32u * U;  // vectors of a row per chunk
    pdl_trigger();
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 V = K >> 3;
    const u32 r0 = (u32)(((u64)n * blockIdx.x) / gridDim.x);
    const u32 r1 = (u32)(((u64)n * (blockIdx.x + 1)) / gridDim.x);
    const u32 ngroups = (r1 - r0 + NR - 1) / NR;
    const u32 nchunks = (V + CH - 1) / CH;

    uint4 wv[NR][U];
    // Issue every load of (group grp, chunk c); rows past r1 and vectors
    // past V are zero and never read.
    auto load = [&](u32 grp, u32 c) {
#pragma unroll
        for (int i = 0; i < NR; ++i)
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const u32 row = r0 + grp * NR + i;
                const u32 v = c * CH + u * 32 + lane;
                if (row < r1 && v < V)
                    wv[i][u] = ld_stream16(w + (u64)row * K + (u64)v * 8);
                else
                    wv[i][u] = make_uint4(0, 0, 0, 0);
            }
    };
    u32 grp = warp, c = 0;
    if (grp < ngroups) load(grp, 0);

    // Everything below may read what the previous kernel wrote.
    pdl_wait();
    // The prologue's global reads are issued together, all rows at once
    // (header: row by row, each row cost a dependent L2 round trip and a
    // block reduction in series). Each row's arithmetic is unchanged.
    if constexpr (NORM) {
        gemv_norm_rows<MB, A>(res, g, eps, m, K, V, gemv_xs, normed, scratch);
    } else {
        // Up to 4 vectors per thread in flight before any is stored (the
        // weight group's 64 registers are live here).
        const uint4* x4 = (const uint4*)x;
        const u32 total = m * V;
        for (u32 i0 = threadIdx.x; i0 < total; i0 += 4 * blockDim.x) {
            uint4 v[4];
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const u32 i = i0 + b * blockDim.x;
                if (i < total) v[b] = x4[i];
            }
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const u32 i = i0 + b * blockDim.x;
                if (i < total) gemv_xs[i] = v[b];
            }
        }
    }
    __syncthreads();

    float acc[MB][NR][P];
#pragma unroll
    for (int t = 0; t < MB; ++t)
#pragma unroll
        for (int i = 0; i < NR; ++i)
#pragma unroll
            for (int p = 0; p < P; ++p) acc[t][i][p] = 0.0f;

    // Bucket rows past the real m read x row m - 1 (staged, inside the
    // allocation); their sums are never stored. So at MB 2 and 4 the loop
    // over t has no runtime guard: a guard per (u, t) split the body into
    // blocks the compiler could not schedule across, each waiting on its own
    // shared-memory load and redoing the weight conversions (SASS of the m4
    // entry points: ~41 instructions and one exposed LDS latency per row and
    // vector). At MB 8 the unguarded body spills (its 8 rows' x addresses
    // and loads hoisted together), so it keeps the guard. Row t's FMAs and
    // their order are the same either way.
    const u32 mlast = m - 1;
    while (grp < ngroups) {  // warp-uniform
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const u32 v = c * CH + u * 32 + lane;
            if (v < V) {
                if constexpr (MB == 8) {
#pragma unroll
                    for (int t = 0; t < MB; ++t) {
                        if ((u32)t < m) {
                            const uint4 xv = gemv_xs[t * V + v];
#pragma unroll
                            for (int i = 0; i < NR; ++i) gemv_dot8<P, A>(acc[t][i], wv[i][u], xv);
                        }
                    }
                } else {
                    uint4 xv[MB];
#pragma unroll
                    for (int t = 0; t < MB; ++t) xv[t] = gemv_xs[(MB == 1 ? 0u : min((u32)t, mlast)) * V + v];
#pragma unroll
                    for (int t = 0; t < MB; ++t)
#pragma unroll
                        for (int i = 0; i < NR; ++i) gemv_dot8<P, A>(acc[t][i], wv[i][u], xv[t]);
                }
            }
        }
        // Next work item's loads go out before this one's reduction.
        const bool last = c + 1 == nchunks;
        const u32 ngrp = last ? grp + GEMV_WARPS : grp;
        const u32 nc = last ? 0 : c + 1;
        if (ngrp < ngroups) load(ngrp, nc);
        if (last) {
            // Every bucket row is reduced (the shuffles stay warp-uniform,
            // with no guard around them); only the real ones are stored.
#pragma unroll
            for (int t = 0; t < MB; ++t) {
#pragma unroll
                for (int i = 0; i < NR; ++i) {
                    const float s = warp_sum(acc[t][i][0] + acc[t][i][1]);
                    const u32 row = r0 + grp * NR + i;
                    if (lane == 0 && row < r1 && (MB == 1 || (u32)t < m)) gemv_store<A>(y, (u64)t * n + row, s, mode);
#pragma unroll
                    for (int p = 0; p < P; ++p) acc[t][i][p] = 0.0f;
                }
            }
        }
        grp = ngrp;
        c = nc;
    }
}

// Entry points: gemv_bf16_r<NR>_m<MB> and gemv_rmsnorm_bf16_r<NR>_m<MB>;
// r2 = 2 rows x 8 vectors per lane (K <= 2048), r1 = 1 row x 16 (K > 2048).
// Dynamic shared memory: m * K * 2 bytes.

#define GEMV_ARGS                                                                                             \
    const bf16_t *x, const bf16_t *__restrict__ w, u32 m, u32 n, u32 k, u32 mode, void *y
#define GEMV_NORM_ARGS                                                                                        \
    const float *res, const bf16_t *__restrict__ g, float eps, const bf16_t *__restrict__ w, u32 m, u32 n,   \
        u32 k, u32 mode, bf16_t *normed, void *y

extern "C" __global__ void __launch_bounds__(256, 2) gemv_bf16_r2_m1(GEMV_ARGS) {
    gemv_body<1, 2, 8, false>(x, nullptr, nullptr, 0.0f, w, m, n, k, mode, nullptr, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_bf16_r2_m2(GEMV_ARGS) {
    gemv_body<2, 2, 8, false>(x, nullptr, nullptr, 0.0f, w, m, n, k, mode, nullptr, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_bf16_r2_m4(GEMV_ARGS) {
    gemv_body<4, 2, 8, false>(x, nullptr, nullptr, 0.0f, w, m, n, k, mode, nullptr, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_bf16_r2_m8(GEMV_ARGS) {
    gemv_body<8, 2, 8, false>(x, nullptr, nullptr, 0.0f, w, m, n, k, mode, nullptr, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_bf16_r1_m1(GEMV_ARGS) {
    gemv_body<1, 1, 16, false>(x, nullptr, nullptr, 0.0f, w, m, n, k, mode, nullptr, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_bf16_r1_m2(GEMV_ARGS) {
    gemv_body<2, 1, 16, false>(x, nullptr, nullptr, 0.0f, w, m, n, k, mode, nullptr, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_bf16_r1_m4(GEMV_ARGS) {
    gemv_body<4, 1, 16, false>(x, nullptr, nullptr, 0.0f, w, m, n, k, mode, nullptr, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_bf16_r1_m8(GEMV_ARGS) {
    gemv_body<8, 1, 16, false>(x, nullptr, nullptr, 0.0f, w, m, n, k, mode, nullptr, y);
}

extern "C" __global__ void __launch_bounds__(256, 2) gemv_rmsnorm_bf16_r2_m1(GEMV_NORM_ARGS) {
    gemv_body<1, 2, 8, true>(nullptr, res, g, eps, w, m, n, k, mode, normed, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_rmsnorm_bf16_r2_m2(GEMV_NORM_ARGS) {
    gemv_body<2, 2, 8, true>(nullptr, res, g, eps, w, m, n, k, mode, normed, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_rmsnorm_bf16_r2_m4(GEMV_NORM_ARGS) {
    gemv_body<4, 2, 8, true>(nullptr, res, g, eps, w, m, n, k, mode, normed, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_rmsnorm_bf16_r2_m8(GEMV_NORM_ARGS) {
    gemv_body<8, 2, 8, true>(nullptr, res, g, eps, w, m, n, k, mode, normed, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_rmsnorm_bf16_r1_m1(GEMV_NORM_ARGS) {
    gemv_body<1, 1, 16, true>(nullptr, res, g, eps, w, m, n, k, mode, normed, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_rmsnorm_bf16_r1_m2(GEMV_NORM_ARGS) {
    gemv_body<2, 1, 16, true>(nullptr, res, g, eps, w, m, n, k, mode, normed, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_rmsnorm_bf16_r1_m4(GEMV_NORM_ARGS) {
    gemv_body<4, 1, 16, true>(nullptr, res, g, eps, w, m, n, k, mode, normed, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_rmsnorm_bf16_r1_m8(GEMV_NORM_ARGS) {
    gemv_body<8, 1, 16, true>(nullptr, res, g, eps, w, m, n, k, mode, normed, y);
}

// FP16 entry points (ActFormat::F16): gemv_rmsnorm_f16_r<NR>_m<MB>, the
// norm variant with w, x and normed in f16 (the decode QKV projection of an
// FP16 attention block, and the router and dense gate/up of an FP16 MLP
// block, matching the prefill path's rmsnorm_f32_to_f16 + f16 GEMM: the
// same normed bits, f32 accumulation; mode 0 rounds y to f16), and
// gemv_f16_r<NR>_m<MB>, the plain one (an FP16 MLP block's shared-expert
// gate/up and every down projection).
#define GEMV_NORM_F16_ARGS                                                                                    \
    const float *res, const bf16_t *__restrict__ g, float eps, const f16_t *__restrict__ w, u32 m, u32 n,    \
        u32 k, u32 mode, f16_t *normed, void *y

extern "C" __global__ void __launch_bounds__(256, 2) gemv_rmsnorm_f16_r2_m1(GEMV_NORM_F16_ARGS) {
    gemv_body<1, 2, 8, true, ActF16>(nullptr, res, g, eps, w, m, n, k, mode, normed, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_rmsnorm_f16_r2_m2(GEMV_NORM_F16_ARGS) {
    gemv_body<2, 2, 8, true, ActF16>(nullptr, res, g, eps, w, m, n, k, mode, normed, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_rmsnorm_f16_r2_m4(GEMV_NORM_F16_ARGS) {
    gemv_body<4, 2, 8, true, ActF16>(nullptr, res, g, eps, w, m, n, k, mode, normed, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_rmsnorm_f16_r2_m8(GEMV_NORM_F16_ARGS) {
    gemv_body<8, 2, 8, true, ActF16>(nullptr, res, g, eps, w, m, n, k, mode, normed, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_rmsnorm_f16_r1_m1(GEMV_NORM_F16_ARGS) {
    gemv_body<1, 1, 16, true, ActF16>(nullptr, res, g, eps, w, m, n, k, mode, normed, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_rmsnorm_f16_r1_m2(GEMV_NORM_F16_ARGS) {
    gemv_body<2, 1, 16, true, ActF16>(nullptr, res, g, eps, w, m, n, k, mode, normed, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_rmsnorm_f16_r1_m4(GEMV_NORM_F16_ARGS) {
    gemv_body<4, 1, 16, true, ActF16>(nullptr, res, g, eps, w, m, n, k, mode, normed, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_rmsnorm_f16_r1_m8(GEMV_NORM_F16_ARGS) {
    gemv_body<8, 1, 16, true, ActF16>(nullptr, res, g, eps, w, m, n, k, mode, normed, y);
}

#define GEMV_F16_ARGS const f16_t *x, const f16_t *__restrict__ w, u32 m, u32 n, u32 k, u32 mode, void *y

extern "C" __global__ void __launch_bounds__(256, 2) gemv_f16_r2_m1(GEMV_F16_ARGS) {
    gemv_body<1, 2, 8, false, ActF16>(x, nullptr, nullptr, 0.0f, w, m, n, k, mode, nullptr, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_f16_r2_m2(GEMV_F16_ARGS) {
    gemv_body<2, 2, 8, false, ActF16>(x, nullptr, nullptr, 0.0f, w, m, n, k, mode, nullptr, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_f16_r2_m4(GEMV_F16_ARGS) {
    gemv_body<4, 2, 8, false, ActF16>(x, nullptr, nullptr, 0.0f, w, m, n, k, mode, nullptr, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_f16_r2_m8(GEMV_F16_ARGS) {
    gemv_body<8, 2, 8, false, ActF16>(x, nullptr, nullptr, 0.0f, w, m, n, k, mode, nullptr, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_f16_r1_m1(GEMV_F16_ARGS) {
    gemv_body<1, 1, 16, false, ActF16>(x, nullptr, nullptr, 0.0f, w, m, n, k, mode, nullptr, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_f16_r1_m2(GEMV_F16_ARGS) {
    gemv_body<2, 1, 16, false, ActF16>(x, nullptr, nullptr, 0.0f, w, m, n, k, mode, nullptr, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_f16_r1_m4(GEMV_F16_ARGS) {
    gemv_body<4, 1, 16, false, ActF16>(x, nullptr, nullptr, 0.0f, w, m, n, k, mode, nullptr, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_f16_r1_m8(GEMV_F16_ARGS) {
    gemv_body<8, 1, 16, false, ActF16>(x, nullptr, nullptr, 0.0f, w, m, n, k, mode, nullptr, y);
}
