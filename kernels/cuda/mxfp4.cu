// MXFP4 expert kernels (expert-cache format v2, precision "mxfp4"; the
// layout is `Mxfp4Layout` in kernels/src/ops/mxfp4.rs, the same offsets as
// runtime/cache/src/layout.rs).
//
// Format (OCP MX v1.0 as gpt-oss ships it, stored verbatim): w13_q [2I, H]
// and w2_q [H, I] as E2M1 codes, two per byte (element 2j in the LOW nibble
// of byte j), row-major with K contiguous; one E8M0 scale byte per 32
// consecutive K values of a row (w13_s [2I, H/32], w2_s [H, I/32]); value =
// e2m1(code) * 2^(s-127), E2M1 = sign bit 3, magnitudes {0, .5, 1, 1.5, 2,
// 3, 4, 6}; s = 255 is NaN and s = 0 is 2^-127. Optional bf16 biases
// w13_b [2I] and w2_b [H]. Every product is exact in bf16 (two significant
// bits times a power of two), so the kernels compute with the checkpoint's
// exact weights: no rounding before the f32 accumulation.
// Experts are found through a device pointer table: base = table[ids[p]]
// (bit 0: still being copied, wait first; as in int4.cu); an id past the table, a null or a misaligned base turns that pair's
// output into NaN instead of reading arbitrary memory.
//
// Decode GEMVs on tensor cores, with the structure of int4.cu (read its
// header first): a warp multiplies a 16-row x 128-K tile with 8
// mma.sync.m16n8k16 bf16 -> f32; lane (g = lane/4, tq = lane%4) loads the
// 16 bytes of rows g and g+8 at K = 128*G + 32*tq. Those 16 bytes are
// exactly one MXFP4 block, so each lane needs one scale byte per row. As
// the four lanes of an mma K step hold four different blocks (four
// scales), the scale is applied while decoding, before the mma:
//   - code -> bf16 bits: magnitude bits (e1 e0 m) at bf16 bits 8..6, sign
//     at bit 15. That bf16 is e2m1 * 2^-126 exactly (a bf16 subnormal for
//     e = 0, matching E2M1's own subnormal), for all 16 codes at once with
//     2 shifts + 2 logic ops per bf16x2;
//   - one fma.rn.bf16x2 by 2^(s-1) makes it e2m1 * 2^(s-127) (exact; bf16
//     fma keeps subnormals, which vLLM's Marlin FP4 dequant relies on in
//     the same way; the host model of these steps is the test
//     decode_bit_trick_is_exact_for_every_code_and_scale in ops/mxfp4.rs).
//     For s > 128 that factor is not a bf16, so the
//     lane multiplies by 2^127 then by 2^(s-128) (NaN for s = 255); real
//     checkpoints never take that branch.
// A 32-bit word of 8 codes becomes the pairs (code j, code j+4), the
// permuted K order of int4.cu: the sign bits of codes j and j+4 land on
// bits 15 and 31 by one shift. The activation (B operand) is permuted the
// same way (perm8). Tiles past K (H = 2880 is 22.5 tiles) load zero codes
// and the staged x/act is zero there.
// Bound: per weight 4.25 bits of HBM traffic and ~2.5 integer/bf16 ops
// (decode ~20 ops per 8 weights, the mma is nearly free). At H200 rates
// (4.8 TB/s, ~9e12 weights/s; ~17e12 int ops/s) the decode ALU work and the
// weight stream are of the same order: expect the kernels to run at a large
// fraction of HBM bandwidth, with ALU issue the co-limit (kbench reports
// GB/s of weights+scales).
//
// mxfp4_w13_act_<NCL>: decode gate/up GEMV + bias + activation. Grid
// (I/16, pairs), block = ceil(H/128 / NCL) warps (<= 16), warp w owns
// 128-K tiles [w*NCL, w*NCL+NCL) of both the 16 gate and the 16 up rows;
// partials summed in warp order; then bias (if any) and Swiglu or
// ClampedSwiglu. Slot mask, PDL trigger and NaN on a bad expert exactly as
// int4_w13_swiglu. mxfp4_w13_act_3s is NCL 3 (gpt-oss, H 2880) with each
// warp's weights staged in shared memory by cp.async instead of registers,
// so three blocks fit an SM instead of two; the host takes it only where
// three fit (228 KB per SM on sm_90). The same arithmetic in the same order
// as mxfp4_w13_act_3 (only where the weights wait differs; the rows test
// compares the two bit for bit). On an H100 (kbench --mxfp4, session 30)
// w13 at 4 rows 75.1 -> 66.4 us, at 8 143.6 -> 122.9; gpt-oss-20b's decode
// +1.2% at one row, +3.9% at four.
// mxfp4_w2_combine_<GPW>: down GEMV fused with the router-weighted combine,
// int4_w2_combine's contract: grid (H/16, tokens), warp items (j, K-part of
// GPW tiles), act staged in shared memory as bf16 hi + lo; in chunks of `jc`
// experts when top_k * I would not fit (I up to 4096 with top_k 16);
// partials reduced in (j, K-part) order, the expert's down bias added,
// weighted, summed in j order and added once to the f32 residual. PDL
// dependent of w13 on sm_90. No float atomics anywhere: bit-reproducible.
// A warp's items stream through a two-slot ring in shared memory (after
// the staged act): the next item's blocks are in flight while the current
// one is multiplied (`mx_ring_at`; the host sizes warps, ring and act
// chunks to the device's shared memory, `w2_plan` in ops/mxfp4.rs).
// The grouped GEMMs of mxfp4_gemm.cu (compiled in this module after this
// file, on these helpers) read the experts in place for prefill; until they
// pass on the device the engine's prefill runs the per-expert GEMM path
// (docs/notes/prefill-kernels.md): mxfp4_dequant_bf16: one thread per block of 32 -> 32 bf16
// (exact f32 value, rounded once), plus one thread per bias element -> f32;
// bias_act_rows_{bf16,f32}: the activation of one expert's gate/up GEMM
// output [m, 2I] (+ optional f32 b13) -> bf16 act [m, I].

#define ACT_SWIGLU 0u
#define ACT_CLAMPED_SWIGLU 1u

// gpt-oss clamped SwiGLU; comparisons (not fminf) so a NaN input stays NaN.
__device__ __forceinline__ float expert_act(float g, float u, u32 kind, float limit, float alpha) {
    if (kind == ACT_CLAMPED_SWIGLU) {
        g = g > limit ? limit : g;
        u = u > limit ? limit : (u < -limit ? -limit : u);
        return (u + 1.0f) * g / (1.0f + expf(-alpha * g));
    }
    return silu(g) * u;
}

__device__ __forceinline__ const unsigned char* mx_base(const u64* table, u32 n_table, u32 id) {
    if (id >= n_table) return nullptr;
    const u64 b = table_entry(table, id);
    if (b == 0 || (b & 15u) != 0) return nullptr;
    return (const unsigned char*)b;
}

// Exact f32 of E8M0 byte s: 2^(s-127), 2^-127 (subnormal) for 0, NaN for 255.
__device__ __forceinline__ float e8m0_f32(u32 s) {
    return s == 255u ? NAN_F : (s == 0u ? __uint_as_float(0x00400000u) : __uint_as_float(s << 23));
}

// Exact f32 of E2M1 code c (low 4 bits).
__device__ __forceinline__ float e2m1_f32(u32 c) {
    const u32 e = (c >> 1) & 3u, m = c & 1u;
    const u32 mag = e == 0u ? (m ? 0x3F000000u : 0u) : (((e + 126u) << 23) | (m << 22));
    return __uint_as_float(mag | ((c & 8u) << 28));
}

// bf16x2 factors for scale byte s: v * f1 (* f2 when s > 128) = e2m1 * 2^(s-127).
__device__ __forceinline__ void mx_factors(u32 s, u32& f1, u32& f2) {
    if (s <= 128u) {
        f1 = (s + 126u) << 7;  // 2^(s-1)
        f2 = 0x3F80u;          // 1
    } else {
        f1 = 0x7F00u;                                // 2^127
        f2 = s == 255u ? 0x7FC0u : (s - 1u) << 7;    // 2^(s-128) or NaN
    }
    f1 *= 0x00010001u;
    f2 *= 0x00010001u;
}

__device__ __forceinline__ u32 bf2_fma0(u32 a, u32 b) {
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u));
    return r;
}

// Word of 8 codes -> 4 bf16x2 e2m1 * 2^(s-127): o[j] = (code j, code j+4).
__device__ __forceinline__ void dqmx8(u32 w, u32 f1, u32 f2, bool two, u32* o) {
    const u32 mg[4] = {w << 6, w << 2, w >> 2, w >> 6};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const u32 v = (mg[j] & 0x01C001C0u) | ((w << (12 - 4 * j)) & 0x80008000u);
        o[j] = bf2_fma0(v, f1);
        if (two) o[j] = bf2_fma0(o[j], f2);
    }
}

__device__ __forceinline__ void mma_bf16_mx(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 16-row x 128-K tile: qa/qb = this lane's block of rows g / g+8 with
// scale bytes sa/sb, xv = the matching 32 permuted B values. Returns C
// (c[0..1]: row g, cols 2tq..; c[2..3]: row g+8), already scaled.
__device__ __forceinline__ void mx_tile16(uint4 qa, uint4 qb, u32 sa, u32 sb, const uint4* xv, float* c) {
    const u32 wa[4] = {qa.x, qa.y, qa.z, qa.w};
    const u32 wb[4] = {qb.x, qb.y, qb.z, qb.w};
    u32 fa1, fa2, fb1, fb2;
    mx_factors(sa, fa1, fa2);
    mx_factors(sb, fb1, fb2);
    const bool ta = sa > 128u, tb = sb > 128u;
    c[0] = c[1] = c[2] = c[3] = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 pa[4], pb[4];
        dqmx8(wa[i], fa1, fa2, ta, pa);
        dqmx8(wb[i], fb1, fb2, tb, pb);
        mma_bf16_mx(c, pa[0], pb[0], pa[1], pb[1], xv[i].x, xv[i].y);
        mma_bf16_mx(c, pa[2], pb[2], pa[3], pb[3], xv[i].z, xv[i].w);
    }
}

// 8 consecutive bf16 (one uint4) -> the permuted pairs (x[j], x[j+4]).
__device__ __forceinline__ uint4 mx_perm8(uint4 u) {
    return make_uint4(__byte_perm(u.x, u.z, 0x5410), __byte_perm(u.x, u.z, 0x7632), __byte_perm(u.y, u.w, 0x5410),
                      __byte_perm(u.y, u.w, 0x7632));
}

// Shared x layout: 32-element chunk c32 (tile G = c32/4, lane tq = c32%4)
// at u32 offset c32*20 (16 used + 4 pad: the 4 tq of a warp hit distinct banks).
#define MX_XS_STRIDE 20
#define MX_MAX_H 8192
#define MX_W13_MAX_WARPS 16

template <int NCL, bool STG = false>
__device__ __forceinline__ void w13_act_body(const bf16_t* __restrict__ x, const u64* __restrict__ table, u32 n_table,
                                        const u32* __restrict__ ids, u32 n_pairs, u32 k, u32 H, u32 I, u64 oq, u64 os,
                                        u64 ob, u32 has_bias, u32 slot_mask, u32 kind, float limit, float alpha,
                                        u32 wait_first, float* __restrict__ act) {
    __shared__ __align__(16) u32 xs[MX_MAX_H / 32 * MX_XS_STRIDE];
    __shared__ float part[MX_W13_MAX_WARPS][32];
    // 8-chunks of x per thread: ng*16 chunks over 32*ceil(ng/NCL) threads.
    constexpr int XPRE = (NCL + 1) / 2;
    // Launch overlap: as int4_w13_swiglu (int4.cu): wait first when
    // launched after the router top-k, then let mxfp4_w2_combine (which
    // reads ids and the table before its own wait) get scheduled.
    if (wait_first) pdl_wait();
    pdl_trigger();
    const u32 p = blockIdx.y;
    if (p >= n_pairs) return;
    const u32 j = p % k, t = p / k;
    if (j >= 32 || ((slot_mask >> j) & 1u) == 0) return;  // block-uniform
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 g = lane >> 2, tq = lane & 3;
    const u32 nw = blockDim.x >> 5, ng = (H + 127) / 128, nb = H / 32;
    const u32 i0 = blockIdx.x * 16;
    const unsigned char* base = mx_base(table, n_table, ids[p]);
    if (base == nullptr) {
        if (threadIdx.x < 16) act[(u64)p * I + i0 + threadIdx.x] = NAN_F;
        return;
    }
    const unsigned char* wq = base + oq;
    const unsigned char* wsc = base + os;
    const u64 rb = H / 2;
    // x first (an L2 hit that would otherwise queue behind the weights).
    const uint4* xrow = (const uint4*)(x + (u64)t * H);
    uint4 xpre[XPRE];
#pragma unroll
    for (int r = 0; r < XPRE; ++r) {
        const u32 c = threadIdx.x + r * blockDim.x;
        xpre[r] = c < H / 8 ? xrow[c] : make_uint4(0, 0, 0, 0);
    }
    // Then every weight and scale load of this warp, in consumption order.
    // STG (mxfp4_w13_act_3s, gpt-oss: H 2880) stages the weights in dynamic
    // shared memory by cp.async instead of registers: their 48 registers
    // held the block to two per SM, so a token's 180 blocks x 4 experts ran
    // in ~2.7 waves (w13 at 1.49 TB/s against w2's 1.0 after session 28);
    // with 48 KB a block, three fit an SM of 228 KB. Where they do not (100
    // KB per SM) the host keeps the register form. Lane l's chunk of (tile,
    // gg, h) is wst[((tile * NCL + gg) * 2 + h) * 32] of its warp's slice; a
    // lane reads back only what it copied. Same arithmetic either way.
    extern __shared__ __align__(16) uint4 mx_w13_ws[];
    uint4* wst = mx_w13_ws + (STG ? warp * (2 * NCL * 2 * 32) + lane : 0);
    uint4 q[2][STG ? 1 : NCL][2];
    u32 sc[2][NCL][2];
#pragma unroll
    for (int gg = 0; gg < NCL; ++gg)
#pragma unroll
        for (int tile = 0; tile < 2; ++tile)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u32 blk = (warp * NCL + gg) * 4 + tq;
                const u64 row = (u64)tile * I + i0 + g + 8 * h;
                uint4* dst = wst + ((tile * NCL + gg) * 2 + h) * 32;
                if (blk < nb) {
                    if constexpr (STG)
                        cp_async16(dst, wq + row * rb + blk * 16);
                    else
                        q[tile][gg][h] = ld_stream16(wq + row * rb + blk * 16);
                    sc[tile][gg][h] = wsc[row * nb + blk];
                } else {
                    if constexpr (STG)
                        *dst = make_uint4(0, 0, 0, 0);
                    else
                        q[tile][gg][h] = make_uint4(0, 0, 0, 0);
                    sc[tile][gg][h] = 127;
                }
            }
    // Stage x permuted into shared memory, zero past H (ng*16 chunks).
#pragma unroll
    for (int r = 0; r < XPRE; ++r) {
        const u32 c = threadIdx.x + r * blockDim.x;
        if (c < ng * 16) *(uint4*)&xs[(c >> 2) * MX_XS_STRIDE + (c & 3) * 4] = mx_perm8(xpre[r]);
    }
    if constexpr (STG) {
        cp_async_commit();
        cp_async_wait<0>();
    }
    __syncthreads();
    float acc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
#pragma unroll
    for (int gg = 0; gg < NCL; ++gg) {
        const u32 G = warp * NCL + gg;
        if (G < ng) {  // warp-uniform
            const uint4* xp = (const uint4*)&xs[(G * 4 + tq) * MX_XS_STRIDE];
            const uint4 xv[4] = {xp[0], xp[1], xp[2], xp[3]};
#pragma unroll
            for (int tile = 0; tile < 2; ++tile) {
                float c[4];
                if constexpr (STG) {
                    const uint4* w = wst + ((tile * NCL + gg) * 2) * 32;
                    mx_tile16(w[0], w[32], sc[tile][gg][0], sc[tile][gg][1], xv, c);
                } else {
                    mx_tile16(q[tile][gg][0], q[tile][gg][1], sc[tile][gg][0], sc[tile][gg][1], xv, c);
                }
                acc[tile][0] += c[0];
                acc[tile][1] += c[2];
            }
        }
    }
    if (tq == 0) {
        part[warp][g] = acc[0][0];
        part[warp][g + 8] = acc[0][1];
        part[warp][16 + g] = acc[1][0];
        part[warp][24 + g] = acc[1][1];
    }
    __syncthreads();
    if (threadIdx.x < 16) {
        float gs = 0.0f, us = 0.0f;
        for (u32 w = 0; w < nw; ++w) {
            gs += part[w][threadIdx.x];
            us += part[w][16 + threadIdx.x];
        }
        if (has_bias) {
            const bf16_t* b = (const bf16_t*)(base + ob);
            gs += bf2f(b[i0 + threadIdx.x]);
            us += bf2f(b[I + i0 + threadIdx.x]);
        }
        act[(u64)p * I + i0 + threadIdx.x] = expert_act(gs, us, kind, limit, alpha);
    }
}

// Block (0, 0) waits for the grid before it on its way out (why, and why
// only one: w13_swiglu, int4.cu).
template <int NCL, bool STG = false>
__device__ __forceinline__ void w13_act(const bf16_t* __restrict__ x, const u64* __restrict__ table, u32 n_table,
                                        const u32* __restrict__ ids, u32 n_pairs, u32 k, u32 H, u32 I, u64 oq, u64 os,
                                        u64 ob, u32 has_bias, u32 slot_mask, u32 kind, float limit, float alpha,
                                        u32 wait_first, float* __restrict__ act) {
    w13_act_body<NCL, STG>(x, table, n_table, ids, n_pairs, k, H, I, oq, os, ob, has_bias, slot_mask, kind, limit, alpha,
                      wait_first, act);
    if (blockIdx.x == 0 && blockIdx.y == 0) pdl_wait();
}

#define MX_W13_ARGS                                                                                             \
    const bf16_t *__restrict__ x, const u64 *__restrict__ table, u32 n_table, const u32 *__restrict__ ids,      \
        u32 n_pairs, u32 k, u32 H, u32 I, u64 oq, u64 os, u64 ob, u32 has_bias, u32 slot_mask, u32 kind,        \
        float limit, float alpha, u32 wait_first, float *__restrict__ act
#define MX_W13_PASS \
    x, table, n_table, ids, n_pairs, k, H, I, oq, os, ob, has_bias, slot_mask, kind, limit, alpha, wait_first, act

// One entry point per tiles-per-warp count NCL = min(4, ceil(ng / 8)),
// ng = ceil(H / 128) <= 64; only NCL 4 uses more than 8 warps.
extern "C" __global__ void __launch_bounds__(256, 3) mxfp4_w13_act_1(MX_W13_ARGS) { w13_act<1>(MX_W13_PASS); }
extern "C" __global__ void __launch_bounds__(256, 3) mxfp4_w13_act_2(MX_W13_ARGS) { w13_act<2>(MX_W13_PASS); }
extern "C" __global__ void __launch_bounds__(256, 2) mxfp4_w13_act_3(MX_W13_ARGS) { w13_act<3>(MX_W13_PASS); }
// NCL 3 with its weights staged in shared memory (three blocks per SM where
// they fit: the host's choice, Kernels::mxfp4_w13_act).
extern "C" __global__ void __launch_bounds__(256, 3) mxfp4_w13_act_3s(MX_W13_ARGS) { w13_act<3, true>(MX_W13_PASS); }
extern "C" __global__ void __launch_bounds__(512, 1) mxfp4_w13_act_4(MX_W13_ARGS) { w13_act<4>(MX_W13_PASS); }

// Shared act layout (dynamic): for (local expert jl, tile G, lane tq) a
// block of MX_AS_STRIDE u32 at ((jl*ng + G)*4 + tq)*MX_AS_STRIDE: 16 hi
// pairs, 16 lo pairs, 4 pad (the 8 (tq, hi/lo) reads of a warp hit
// distinct banks).
#define MX_AS_STRIDE 36
#define MX_W2_MAX_ITEMS 128

// Weight ring (dynamic shared memory, after the staged act): per warp two
// slots of one work item, GPW x 2 rows (h) x 32 lanes of 16-byte blocks;
// lane l's block of (slot s, tile gg, row half h) at
// ((s * GPW + gg) * 2 + h) * 32 + l. A lane reads back only the blocks it
// copied, so `cp.async.wait_group` alone orders them (no barrier).
// Why a ring: with the item's blocks in registers, a warp's next item was
// loaded only after the current one was multiplied, so a block of
// gpt-oss-20b's 48 items over 24 warps took two HBM round trips in series
// after staging act, and w2 ran at 0.8 TB/s against w13's 1.5 (kbench
// --mxfp4, H100, session 28). Two items in flight per warp in registers
// would take ~20 more than the 85 registers of a 768-thread block.
__device__ __forceinline__ uint4* mx_ring_at(uint4* ring, u32 s, u32 gg, u32 h, u32 lane, u32 gpw) {
    return ring + ((s * gpw + gg) * 2 + h) * 32 + lane;
}

template <int GPW>
__device__ __forceinline__ void w2_combine_mx(const float* __restrict__ act, const u64* __restrict__ table,
                                              u32 n_table, const u32* __restrict__ ids, const float* __restrict__ w,
                                              u32 n_tokens, u32 k, u32 H, u32 I, u64 oq, u64 os, u64 ob,
                                              u32 has_bias, u32 jc, float* __restrict__ res) {
    extern __shared__ __align__(16) u32 as_[];
    __shared__ float part[MX_W2_MAX_ITEMS][16];
    const u32 t = blockIdx.y;
    if (t >= n_tokens) return;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 g = lane >> 2, tq = lane & 3;
    const u32 nw = blockDim.x >> 5, ng = (I + 127) / 128, nb = I / 32;
    const u32 nkp = (ng + GPW - 1) / GPW, items = k * nkp;
    const u32 n0 = blockIdx.x * 16;
    const u64 rb = I / 2;
    uint4* ring = (uint4*)(as_ + jc * ng * 4 * MX_AS_STRIDE) + (u64)warp * (2 * GPW * 2 * 32);

    // The token's k table entries (0 past the table), read once up front:
    // looked up per item, a warp's next item waited on its ids -> table
    // round trips after the current item's multiply. mx_base's checks, the
    // wait on a fresh entry among them, stay with the warp that uses one.
    __shared__ u64 entries_s[16];
    for (u32 j = threadIdx.x; j < k; j += blockDim.x) {
        const u32 id = ids[(u64)t * k + j];
        entries_s[j] = id < n_table ? table[id] : 0;
    }
    __syncthreads();
    // Per slot: the item's scale bytes and whether its expert is valid, in
    // registers (each lambda call below names one slot's, so the indices
    // are static; NVRTC takes no generic lambdas in device code).
    u32 sc0[GPW][2], sc1[GPW][2];
    bool valid0 = false, valid1 = false;
    // Copy work item `it` (expert j, K-part kp) into slot s (its blocks by
    // cp.async, zeros past I or for a bad expert) and load its scales.
    auto load = [&](u32 it, u32 s, u32 (&sc)[GPW][2], bool& valid) {
        const u32 j = it / nkp, kp = it % nkp;
        const unsigned char* base = mx_base(entries_s, k, j);
        valid = base != nullptr;
        const unsigned char* wq = base + oq;
        const unsigned char* wsc = base + os;
#pragma unroll
        for (int gg = 0; gg < GPW; ++gg)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u32 blk = (kp * GPW + gg) * 4 + tq;
                const u64 row = n0 + g + 8 * h;
                uint4* dst = mx_ring_at(ring, s, gg, h, lane, GPW);
                if (valid && blk < nb) {
                    cp_async16(dst, wq + row * rb + blk * 16);
                    sc[gg][h] = wsc[row * nb + blk];
                } else {
                    *dst = make_uint4(0, 0, 0, 0);
                    sc[gg][h] = 127;
                }
            }
    };
    // Slot 0 holds items warp, warp + 2 nw, ...; slot 1 the others. One
    // commit group per item (empty past the last), so with the current and
    // the next item outstanding, wait_group 1 means the current one landed.
    u32 it = warp;
    if (it < items) load(it, 0, sc0, valid0);
    cp_async_commit();
    if (it + nw < items) load(it + nw, 1, sc1, valid1);
    cp_async_commit();
    // The experts' output biases for the epilogue, [j][row], loaded now
    // (biases were ready before the previous kernel started): in the
    // epilogue each of the k experts' ids -> table -> bias chain ran after
    // the last one, 3k dependent round trips.
    __shared__ float bias_s[16][16];
    if (has_bias) {
        for (u32 i = threadIdx.x; i < k * 16; i += blockDim.x) {
            const unsigned char* base = mx_base(entries_s, k, i >> 4);
            bias_s[i >> 4][i & 15] = base != nullptr ? bf2f(((const bf16_t*)(base + ob))[n0 + (i & 15)]) : 0.0f;
        }
    }
    // Launched as a programmatic dependent on sm_90: everything above (ids,
    // table, weights) was ready before the previous kernel started (a
    // fresh expert's loads waited, `table_entry`); act and res are touched
    // only after that kernel has completed.
    pdl_wait();
    const u32 cpr = ng * 16;  // staged 8-chunks per act row (zero past I)
    // Multiply the item in slot S, then refill S with the item two ahead.
    auto step = [&](u32 j0, u32 s, u32 (&sc)[GPW][2], bool& valid) {
        cp_async_wait<1>();
        const u32 jl = it / nkp - j0, kp = it % nkp;
        float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
        for (int gg = 0; gg < GPW; ++gg) {
            const u32 G = kp * GPW + gg;
            if (G < ng) {
                const uint4* xp = (const uint4*)(as_ + ((jl * ng + G) * 4 + tq) * MX_AS_STRIDE + (g & 1) * 16);
                const uint4 xv[4] = {xp[0], xp[1], xp[2], xp[3]};
                float c[4];
                mx_tile16(*mx_ring_at(ring, s, gg, 0, lane, GPW), *mx_ring_at(ring, s, gg, 1, lane, GPW),
                          sc[gg][0], sc[gg][1], xv, c);
                acc0 += c[0] + c[1];
                acc1 += c[2] + c[3];
            }
        }
        if (!valid) acc0 = acc1 = NAN_F;
        if (tq == 0) {
            part[it][g] = acc0;
            part[it][g + 8] = acc1;
        }
        // The slot's blocks were read above: refill it. cp.async's asm
        // names no memory, so a compiler barrier keeps those shared loads
        // ahead of the copies that overwrite them.
        asm volatile("" ::: "memory");
        if (it + 2 * nw < items) load(it + 2 * nw, s, sc, valid);
        cp_async_commit();
        it += nw;
    };
    bool odd = false;  // the current item is in slot 1
    for (u32 j0 = 0; j0 < k; j0 += jc) {  // block-uniform
        const u32 jn = min(jc, k - j0);
        if (j0 > 0) __syncthreads();  // every warp is done with the last chunk
        // Stage the chunk's act rows as permuted bf16 hi/lo pairs, a
        // thread's two chunks' loads issued before either is converted (one
        // at a time was a dependent round trip each).
        for (u32 c0 = threadIdx.x; c0 < jn * cpr; c0 += 2 * blockDim.x) {
            float4 u[2], v[2];
#pragma unroll
            for (int b = 0; b < 2; ++b) {
                const u32 c = c0 + b * blockDim.x, jl = c / cpr, c8 = c % cpr;
                if (c < jn * cpr && c8 < I / 8) {
                    const float4* a4 = (const float4*)(act + ((u64)t * k + j0 + jl) * I + (u64)c8 * 8);
                    u[b] = a4[0];
                    v[b] = a4[1];
                }
            }
#pragma unroll
            for (int b = 0; b < 2; ++b) {
                const u32 c = c0 + b * blockDim.x, jl = c / cpr, c8 = c % cpr;
                if (c >= jn * cpr) continue;
                u32 hv[4] = {0, 0, 0, 0}, lv[4] = {0, 0, 0, 0};
                if (c8 < I / 8) {
                    const float lo_[4] = {u[b].x, u[b].y, u[b].z, u[b].w}, hi_[4] = {v[b].x, v[b].y, v[b].z, v[b].w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        hv[e] = pack_bf2(lo_[e], hi_[e]);
                        lv[e] = pack_bf2(lo_[e] - bf_lo(hv[e]), hi_[e] - bf_hi(hv[e]));
                    }
                }
                u32* dst = as_ + ((jl * ng + c8 / 16) * 4 + (c8 % 16) / 4) * MX_AS_STRIDE + (c8 % 4) * 4;
                *(uint4*)dst = make_uint4(hv[0], hv[1], hv[2], hv[3]);
                *(uint4*)(dst + 16) = make_uint4(lv[0], lv[1], lv[2], lv[3]);
            }
        }
        __syncthreads();
        const u32 end = (j0 + jn) * nkp;
        while (it < end) {  // warp-uniform
            if (odd)
                step(j0, 1, sc1, valid1);
            else
                step(j0, 0, sc0, valid0);
            odd = !odd;
        }
    }
    __syncthreads();
    if (threadIdx.x < 16) {
        const u32 n = n0 + threadIdx.x;
        float sum = 0.0f;
        for (u32 j = 0; j < k; ++j) {
            float e = 0.0f;
            for (u32 kp = 0; kp < nkp; ++kp) e += part[j * nkp + kp][threadIdx.x];
            // A missing expert's bias is 0 here, and its partials are NaN.
            if (has_bias) e += bias_s[j][threadIdx.x];
            sum += w[(u64)t * k + j] * e;
        }
        res[(u64)t * H + n] += sum;
    }
}

#define MX_W2_ARGS                                                                                              \
    const float *__restrict__ act, const u64 *__restrict__ table, u32 n_table, const u32 *__restrict__ ids,     \
        const float *__restrict__ w, u32 n_tokens, u32 k, u32 H, u32 I, u64 oq, u64 os, u64 ob, u32 has_bias,   \
        u32 jc, float *__restrict__ res
#define MX_W2_PASS act, table, n_table, ids, w, n_tokens, k, H, I, oq, os, ob, has_bias, jc, res

// One entry point per tiles-per-item count (2 or 4): the host picks the
// smaller one that keeps top_k * ceil(ng / GPW) <= 128 items.
extern "C" __global__ void __launch_bounds__(768) mxfp4_w2_combine_2(MX_W2_ARGS) { w2_combine_mx<2>(MX_W2_PASS); }
extern "C" __global__ void __launch_bounds__(512) mxfp4_w2_combine_4(MX_W2_ARGS) { w2_combine_mx<4>(MX_W2_PASS); }

// Prefill dequantization. Threads [0, c13) decode w13 blocks, [c13, c13+c2)
// w2 blocks, then nb13 + nb2 threads copy the biases (0 without biases).
extern "C" __global__ void mxfp4_dequant_bf16(const u64* __restrict__ table, u32 n_table, const u32* __restrict__ ids,
                                              u32 n, u32 H, u32 I, u64 o13q, u64 o13s, u64 o13b, u64 o2q, u64 o2s,
                                              u64 o2b, u32 has_bias, bf16_t* __restrict__ w13_out,
                                              bf16_t* __restrict__ w2_out, float* __restrict__ b13_out,
                                              float* __restrict__ b2_out) {
    const u32 x = blockIdx.y;
    if (x >= n) return;
    const u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 c13 = (u64)2 * I * H / 32, c2 = (u64)H * I / 32;
    const u64 nbias = has_bias ? (u64)2 * I + H : 0;
    if (g >= c13 + c2 + nbias) return;
    const unsigned char* base = mx_base(table, n_table, ids[x]);
    if (g >= c13 + c2) {
        const u64 bi = g - c13 - c2;
        const bool is13 = bi < (u64)2 * I;
        float* dst = is13 ? b13_out + (u64)x * 2 * I + bi : b2_out + (u64)x * H + (bi - 2 * I);
        *dst = base == nullptr ? NAN_F : bf2f(((const bf16_t*)(base + (is13 ? o13b : o2b)))[is13 ? bi : bi - 2 * I]);
        return;
    }
    u32 K;
    u64 row, c;
    const unsigned char *q, *sc;
    bf16_t* dst;
    if (g < c13) {
        K = H;
        row = g / (H / 32);
        c = g % (H / 32);
        q = base + o13q;
        sc = base + o13s;
        dst = w13_out + (u64)x * 2 * I * H;
    } else {
        K = I;
        row = (g - c13) / (I / 32);
        c = (g - c13) % (I / 32);
        q = base + o2q;
        sc = base + o2s;
        dst = w2_out + (u64)x * H * I;
    }
    uint4* o = (uint4*)(dst + row * K + c * 32);
    if (base == nullptr) {
        const u32 nn = 0x7fc07fc0u;
        for (int v = 0; v < 4; ++v) o[v] = make_uint4(nn, nn, nn, nn);
        return;
    }
    const uint4 qv = ld_stream16(q + row * (K / 2) + c * 16);
    const float s = e8m0_f32(sc[row * (K / 32) + c]);
    const u32 w[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 r[4];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const u32 byte = (w[i] >> (8 * b)) & 0xFFu;
            r[b] = pack_bf2(e2m1_f32(byte) * s, e2m1_f32(byte >> 4) * s);
        }
        o[i] = make_uint4(r[0], r[1], r[2], r[3]);
    }
}

// Prefill activation: out[r, i] = act(gu[r, i] + b[i], gu[r, I + i] + b[I + i]).
template <typename T>
__device__ __forceinline__ float ld_f(const T* p, u64 i);
template <>
__device__ __forceinline__ float ld_f<bf16_t>(const bf16_t* p, u64 i) { return bf2f(p[i]); }
template <>
__device__ __forceinline__ float ld_f<float>(const float* p, u64 i) { return p[i]; }

template <typename T>
__device__ __forceinline__ void bias_act(const T* __restrict__ gu, const float* __restrict__ b, u32 has_bias, u32 rows,
                                         u32 I, u32 kind, float limit, float alpha, bf16_t* __restrict__ out) {
    const u64 n = (u64)rows * I;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / I, c = i - r * I;
        float g = ld_f<T>(gu, r * 2 * I + c), u = ld_f<T>(gu, r * 2 * I + I + c);
        if (has_bias) {
            g += b[c];
            u += b[I + c];
        }
        out[i] = f2bf(expert_act(g, u, kind, limit, alpha));
    }
}

extern "C" __global__ void bias_act_rows_bf16(const bf16_t* __restrict__ gu, const float* __restrict__ b, u32 has_bias,
                                              u32 rows, u32 I, u32 kind, float limit, float alpha,
                                              bf16_t* __restrict__ out) {
    bias_act<bf16_t>(gu, b, has_bias, rows, I, kind, limit, alpha, out);
}
extern "C" __global__ void bias_act_rows_f32(const float* __restrict__ gu, const float* __restrict__ b, u32 has_bias,
                                             u32 rows, u32 I, u32 kind, float limit, float alpha,
                                             bf16_t* __restrict__ out) {
    bias_act<float>(gu, b, has_bias, rows, I, kind, limit, alpha, out);
}
