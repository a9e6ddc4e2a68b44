// Grouped INT4 expert GEMMs for prefill: every expert of a MoE layer in one
// launch, the weights read in the expert cache's own format (INT4, group
// 128) and turned into tensor-core operands in registers.
//
// Compiled in the int4 module after int4_common.cuh and int4.cu
// (sources.rs), whose helpers it uses: dq8 (8 nibbles -> 4 exact (q - 8)
// pairs in format A), perm8 (8 16-bit values -> the pairs (x[j], x[j+4])
// dq8's order needs) and expert_base (table lookup, null when the entry is
// missing or misaligned) from int4_common.cuh; mma16 (m16n8k16, f32
// accumulate) and the tile lookup, grouped_find_tile, are common.cuh's
// (mxfp4_gemm.cu shares the lookup). int4_gemm_sm90.cu is this
// kernel's Hopper (wgmma) form, with the same arguments and contract.
//
// Why. Prefill used to dequantize each expert of a layer to 16-bit in
// memory and run one cuBLAS GEMM per expert and projection. At 30-60 rows
// per expert (a 512-1,000-token chunk, top-8 of 128) those 256 small
// GEMMs per layer, each a few blocks wide, and the dequantized round trip
// set the prefill speed, not the arithmetic.
//
// Problem. moe_group + gather_rows put expert e's rows of the chunk at
// offsets[e]..offsets[e+1] of x ([rows, K], format A). Per expert:
//   gate/up (int4_grouped_w13_swiglu): K = H, out[r, i] =
//     A(silu(W13_e[i] . x[r]) * (W13_e[I + i] . x[r])), out [rows, I];
//   down (int4_grouped_w2): K = I, out[r, n] = W2_e[n] . x[r], f32 [rows, H].
//
// Grid. y = one token tile (GG_BT = 64 rows of one expert); the tiles of all
// experts are numbered expert by expert, and warp 0 of each block finds its
// expert and rows from the offsets (a warp scan of ceil(rows / 64) per
// expert), so the host passes only the tile count. x = a slice of the output
// features: gate/up 64 i (64 gate + 64 up rows), down 128 rows.
//
// Block. 8 warps, each one 16-row weight tile x all 64 tokens (8 mma
// column tiles of 8), so each weight nibble is converted once per block.
// Gate/up: the tile's rows 0-7 are gate rows i..i+8 and rows 8-15 the up
// rows I+i..I+i+8, so a lane's C holds g (row g) and u (row g+8) of the
// same (i, token) and the SwiGLU epilogue needs no exchange; 8 warps cover
// 64 i. Down: 16 consecutive rows per warp, 128 per block. K runs in
// 128-wide steps, one scale group each (so g = 128 only; other groups use
// the dequantize + GEMM path, expert_ffn.rs).
//
// Operands. A (weights): as in the decode kernels, lane (g, tq) loads 16
// bytes (K = 32tq..32tq+31 of the step) of its rows g and g+8; each 32-bit
// word is 4 A registers by dq8, and mma16 pairs nibbles (j, j+4). The dot
// product does not care about the order of K, so B (x) is presented in the
// same permuted order: lane (g, tq) of column tile c needs perm8 of the 16
// bytes of token c*8+g at K = 32tq + 8i (i = 0..3). The weights go from
// global memory to registers, the next step's in flight during this one's.
//
// x staging. Each step's 64 x 128 tile of x (16 KB) is loaded into
// registers a step ahead, permuted once (perm8) and stored in fragment
// order, [column tile][i][lane] x 16 bytes, into one of two shared buffers:
// a warp's B load is 512 consecutive bytes, and the store of 32 threads
// too (no bank conflicts either way). One barrier per step. 184 registers,
// one block per SM (capping at 128 for two blocks spills). Against form (1)
// below: a3b 8K tokens 170 TFLOP/s (cuBLAS on dequantized experts: 199),
// 512-token prompts end to end 36,958 against 33,189 tok/s.
//
// Measured and not kept (H200, kbench --grouped, a3b 2048 x 768): (1) two
// weight tiles x 32 tokens per warp (4 feature slices x 2 token halves;
// both halves converted the same nibbles), x by cp.async and permuted at
// every read: 8K tokens 158 TFLOP/s, one block of 182 registers per SM,
// and Nsight Compute found it latency- and ALU-bound (no eligible warp in
// 57% of cycles, the integer pipe the busiest); (2) that form with the
// weights staged through shared memory too (3 cp.async stages, 128
// registers, two blocks per SM): slower at every length (8K 137 TFLOP/s).
//
// Numerics. Each mma multiplies exact (q - 8) by x (products exact in f32)
// and sums one scale group in f32 on the tensor core; the step's sum is
// scaled by the row's f16 scale and added to the f32 total, in K order.
// A row's result depends only on its own x and the expert (no split-K,
// no reduction across tokens), so it is the same whichever tile, chunk or
// batch the row lands in: chunked prefill stays boundary-invariant.
// SwiGLU is taken from the f32 totals and rounded once to format A.
// A missing or misaligned expert writes NaN to its rows.

#define GG_BT 64
#define GG_THREADS 256
#define GG_XS_U4 (GG_BT / 8 * 4 * 32)  // uint4s of one step of x: 8 column tiles x 4 i x 32 lanes (16 KB)

__device__ __forceinline__ u32 word_of(uint4 q, int i) { return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w; }

// W13: gate/up + SwiGLU into `out` (format A, [rows, N = I]); else down into
// `out` (f32, [rows, N = H]). K: the reduction width (H or I), I: the
// intermediate width (where the up rows start).
template <class A, bool W13>
__device__ __forceinline__ void grouped_int4(const unsigned short* __restrict__ x, const u32* __restrict__ offsets,
                                             u32 n_experts, const u64* __restrict__ table, u32 n_table, u32 K, u32 I,
                                             u32 N, u64 oq, u64 os, void* __restrict__ out) {
    __shared__ __align__(16) uint4 xs[2 * GG_XS_U4];
    __shared__ u32 info[3];
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    if (threadIdx.x == 0) info[0] = ~0u;
    __syncthreads();
    if (warp == 0) grouped_find_tile<GG_BT>(offsets, n_experts, blockIdx.y, lane, info);
    __syncthreads();
    const u32 e = info[0];
    if (e == ~0u) return;  // block-uniform; only when the grid is larger than the tiles
    const u32 r0 = info[1], r1 = info[2];
    // This lane's weight rows (h = 0: row g of the tile, h = 1: row g + 8)
    // and, for gate/up, its i.
    const u32 i0 = blockIdx.x * 64 + warp * 8 + g;
    u32 row[2];
    if (W13) {
        row[0] = i0;
        row[1] = I + i0;
    } else {
        row[0] = blockIdx.x * 128 + warp * 16 + g;
        row[1] = row[0] + 8;
    }
    const unsigned char* base = expert_base(table, n_table, e);
    float tot[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) tot[nt][c] = base ? 0.0f : NAN_F;
    if (base != nullptr) {  // block-uniform
        const u32 ng = K / 128;
        const unsigned char* wp[2];
        const f16_t* sp[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            wp[h] = base + oq + (u64)row[h] * (K / 2) + tq * 16;
            sp[h] = (const f16_t*)(base + os) + (u64)row[h] * ng;
        }
        // Step G of x: chunk c = t + 256r is lane c & 31 (token (c & 31) >> 2
        // of column tile c >> 7, K quarter tq = c & 3), word i = (c >> 5) & 3.
        uint4 xr[4];
        auto load_x = [&](u32 G) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const u32 c = threadIdx.x + r * GG_THREADS;
                const u32 tok = (c >> 7) * 8 + ((c & 31) >> 2);
                xr[r] = r0 + tok < r1 ? *(const uint4*)(x + (u64)(r0 + tok) * K + G * 128 + (c & 3) * 32 +
                                                          ((c >> 5) & 3) * 8)
                                      : make_uint4(0, 0, 0, 0);
            }
        };
        auto store_x = [&](u32 buf) {
#pragma unroll
            for (int r = 0; r < 4; ++r) xs[buf * GG_XS_U4 + threadIdx.x + r * GG_THREADS] = perm8(xr[r]);
        };
        uint4 qn[2];
        float sn[2];
        auto load_w = [&](u32 G) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                qn[h] = ld_stream16(wp[h] + G * 64);
                sn[h] = h2f(sp[h][G]);
            }
        };
        load_x(0);
        load_w(0);
        store_x(0);
        __syncthreads();
        for (u32 G = 0; G < ng; ++G) {
            const uint4 q0 = qn[0], q1 = qn[1];
            const float s0 = sn[0], s1 = sn[1];
            if (G + 1 < ng) {
                load_x(G + 1);
                load_w(G + 1);
            }
            const uint4* xb = xs + (G & 1) * GG_XS_U4 + lane;
            float part[8][4];
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int c = 0; c < 4; ++c) part[nt][c] = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                u32 pa[4], pb[4];
                dq8<A>(word_of(q0, i), pa);
                dq8<A>(word_of(q1, i), pb);
#pragma unroll
                for (int nt = 0; nt < 8; ++nt) {
                    const uint4 b = xb[(nt * 4 + i) * 32];
                    mma16<A>(part[nt], pa[0], pb[0], pa[1], pb[1], b.x, b.y);
                    mma16<A>(part[nt], pa[2], pb[2], pa[3], pb[3], b.z, b.w);
                }
            }
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                tot[nt][0] += s0 * part[nt][0];
                tot[nt][1] += s0 * part[nt][1];
                tot[nt][2] += s1 * part[nt][2];
                tot[nt][3] += s1 * part[nt][3];
            }
            // Buffer (G + 1) & 1 was last read in step G - 1, before the
            // previous barrier; this barrier publishes it and retires G & 1.
            if (G + 1 < ng) store_x((G + 1) & 1);
            __syncthreads();
        }
    }
    // C layout: c[0], c[1] = row g, tokens 2tq, 2tq+1; c[2], c[3] = row g + 8.
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const u32 r = r0 + nt * 8 + 2 * tq + c;
            if (r >= r1) continue;
            if (W13) {
                const float v = silu(tot[nt][c]) * tot[nt][2 + c];
                ((unsigned short*)out)[(u64)r * N + i0] = A::store(v);
            } else {
                ((float*)out)[(u64)r * N + row[0]] = tot[nt][c];
                ((float*)out)[(u64)r * N + row[1]] = tot[nt][2 + c];
            }
        }
}

#define GG_ARGS                                                                                                   \
    const unsigned short *__restrict__ x, const u32 *__restrict__ offsets, u32 n_experts,                          \
        const u64 *__restrict__ table, u32 n_table, u32 K, u32 I, u32 N, u64 oq, u64 os
#define GG_PASS x, offsets, n_experts, table, n_table, K, I, N, oq, os
extern "C" __global__ void __launch_bounds__(GG_THREADS, 1)
    int4_grouped_w13_swiglu_bf16(GG_ARGS, bf16_t* __restrict__ out) {
    grouped_int4<ActBf16, true>(GG_PASS, out);
}
extern "C" __global__ void __launch_bounds__(GG_THREADS, 1)
    int4_grouped_w13_swiglu_f16(GG_ARGS, f16_t* __restrict__ out) {
    grouped_int4<ActF16, true>(GG_PASS, out);
}
extern "C" __global__ void __launch_bounds__(GG_THREADS, 1) int4_grouped_w2_bf16(GG_ARGS, float* __restrict__ out) {
    grouped_int4<ActBf16, false>(GG_PASS, out);
}
extern "C" __global__ void __launch_bounds__(GG_THREADS, 1) int4_grouped_w2_f16(GG_ARGS, float* __restrict__ out) {
    grouped_int4<ActF16, false>(GG_PASS, out);
}
