// Grouped INT4 expert GEMMs for prefill: every expert of a MoE layer in one
// launch, the weights read in the expert cache's own format (INT4, group
// 128) and turned into tensor-core operands in registers.
//
// Compiled in the int4 module after int4.cu (sources.rs), whose helpers it
// uses: dq8 (8 nibbles -> 4 exact (q - 8) pairs in format A), mma16
// (m16n8k16, f32 accumulate), perm8 (8 16-bit values -> the pairs (x[j],
// x[j+4]) dq8's order needs) and expert_base (table lookup, null when the
// entry is missing or misaligned).
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
// Block. 8 warps: 4 feature slices x 2 token halves. A warp owns two 16-row
// weight tiles (gate/up: gate rows i..i+16 and up rows I+i..I+i+16, so its
// epilogue has g and u of the same (row, i) in the same lane; down: 32
// consecutive rows) and 32 tokens (4 mma column tiles of 8). K runs in
// 128-wide steps, one scale group each (so g = 128 only; other groups use
// the dequantize + GEMM path, expert_ffn.rs).
//
// Operands. A (weights): as in the decode kernels, lane (g, tq) loads 16
// bytes (K = 32tq..32tq+31 of the step) of rows g and g+8 of a tile; each
// 32-bit word is 4 A registers by dq8, and mma16 pairs nibbles (j, j+4).
// The dot product does not care about the order of K, so B (x) is
// presented in the same permuted order: lane (g, tq) of column tile c
// reads the 16 bytes of token c*8+g at K = 32tq + 8i (i = 0..3) from shared
// memory and perm8s them. The weights go straight from global memory to
// registers (each lane's bytes are its own), the next step's loads in
// flight while the current step multiplies.
//
// x staging. Each step's 64 x 128 tile of x (16 KB) is copied with cp.async
// into one of two shared buffers while the other is read; rows past the
// expert's last are zero-filled. The 16 chunks of 16 bytes of a row sit at
// chunk c ^ (((c >> 3) & 1) << 1) ^ (row & 1): the 8 lanes of a read phase
// (2 tokens x 4 tq at one i) then hit 8 distinct bank groups.
//
// Measured and not kept (H200, kbench --grouped, a3b): staging the weights
// through shared memory with x (3 cp.async stages, one barrier per step,
// 128 registers so two blocks share an SM) was slower at every length: 8K
// tokens 137 against this form's 158 TFLOP/s, 512-token prompts end to end
// 29.4K against 33.2K tok/s. This form keeps one block of 182 registers per
// SM; at 8K tokens it is below cuBLAS on dequantized experts (199 TFLOP/s),
// the open item (issue 17).
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
#define GG_XS_BYTES (GG_BT * 256)  // one step of x: 64 rows x 128 K x 2 bytes

// Physical 16-byte chunk of logical chunk c (0..15) of staged row `row`.
__device__ __forceinline__ u32 gg_chunk(u32 row, u32 c) {
    return row * 16 + (c ^ (((c >> 3) & 1u) << 1) ^ (row & 1u));
}

// Warp 0: expert, first row and end row of token tile `tile` into info[0..3]
// (info[0] stays ~0 when the tile is past the last expert's).
__device__ __forceinline__ void gg_find_tile(const u32* __restrict__ offsets, u32 n_experts, u32 tile, u32 lane,
                                             u32* info) {
    u32 before = 0;
    for (u32 c = 0; c < n_experts; c += 32) {
        const u32 e = c + lane;
        u32 a = 0, b = 0;
        if (e < n_experts) {
            a = offsets[e];
            b = offsets[e + 1];
        }
        const u32 n = b > a ? (b - a + GG_BT - 1) / GG_BT : 0;
        u32 s = n;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const u32 v = __shfl_up_sync(0xFFFFFFFFu, s, d);
            if (lane >= (u32)d) s += v;
        }
        const u32 first = before + s - n;
        if (n > 0 && tile >= first && tile < first + n) {
            const u32 ra = a + (tile - first) * GG_BT;
            info[0] = e;
            info[1] = ra;
            info[2] = min(b, ra + GG_BT);
        }
        before += __shfl_sync(0xFFFFFFFFu, s, 31);
    }
}

__device__ __forceinline__ u32 word_of(uint4 q, int i) { return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w; }

// W13: gate/up + SwiGLU into `out` (format A, [rows, N = I]); else down into
// `out` (f32, [rows, N = H]). K: the reduction width (H or I), I: the
// intermediate width (where the up rows start).
template <class A, bool W13>
__device__ __forceinline__ void grouped_int4(const unsigned short* __restrict__ x, const u32* __restrict__ offsets,
                                             u32 n_experts, const u64* __restrict__ table, u32 n_table, u32 K, u32 I,
                                             u32 N, u64 oq, u64 os, void* __restrict__ out) {
    __shared__ __align__(16) unsigned char xs[2 * GG_XS_BYTES];
    __shared__ u32 info[3];
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    if (threadIdx.x == 0) info[0] = ~0u;
    __syncthreads();
    if (warp == 0) gg_find_tile(offsets, n_experts, blockIdx.y, lane, info);
    __syncthreads();
    const u32 e = info[0];
    if (e == ~0u) return;  // block-uniform; only when the grid is larger than the tiles
    const u32 r0 = info[1], r1 = info[2];
    const u32 fw = warp & 3, th = warp >> 2;
    u32 rowt[2];
    if (W13) {
        const u32 i = blockIdx.x * 64 + fw * 16;
        rowt[0] = i;
        rowt[1] = I + i;
    } else {
        rowt[0] = blockIdx.x * 128 + fw * 32;
        rowt[1] = rowt[0] + 16;
    }
    const unsigned char* base = expert_base(table, n_table, e);
    float tot[2][4][4];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int c = 0; c < 4; ++c) tot[a][nt][c] = base ? 0.0f : NAN_F;
    if (base != nullptr) {  // block-uniform
        const u32 ng = K / 128;
        const u64 rb = K / 2;
        // This lane's rows: tile a, half h -> row rowt[a] + g + 8h.
        const unsigned char* wp[2][2];
        const f16_t* sp[2][2];
#pragma unroll
        for (int a = 0; a < 2; ++a)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u64 row = rowt[a] + g + 8 * h;
                wp[a][h] = base + oq + row * rb + tq * 16;
                sp[a][h] = (const f16_t*)(base + os) + row * ng;
            }
        // Stage step G of x into buffer `buf`: 1,024 chunks of 16 bytes, 4 per thread.
        auto stage = [&](u32 G, u32 buf) {
            unsigned char* dst = xs + buf * GG_XS_BYTES;
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const u32 c = threadIdx.x + r * GG_THREADS;
                const u32 row = c >> 4, lc = c & 15;
                const bool in = r0 + row < r1;
                const unsigned short* src = in ? x + (u64)(r0 + row) * K + G * 128 + lc * 8 : x;
                cp_async16_zfill(dst + gg_chunk(row, lc) * 16, src, in ? 16u : 0u);
            }
        };
        uint4 qn[2][2];
        float sn[2][2];
        auto load_w = [&](u32 G) {
#pragma unroll
            for (int a = 0; a < 2; ++a)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    qn[a][h] = ld_stream16(wp[a][h] + G * 64);
                    sn[a][h] = h2f(sp[a][h][G]);
                }
        };
        stage(0, 0);
        cp_async_commit();
        load_w(0);
        for (u32 G = 0; G < ng; ++G) {
            uint4 q[2][2];
            float s[2][2];
#pragma unroll
            for (int a = 0; a < 2; ++a)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    q[a][h] = qn[a][h];
                    s[a][h] = sn[a][h];
                }
            if (G + 1 < ng) {
                stage(G + 1, (G + 1) & 1);
                load_w(G + 1);
            }
            cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();
            const unsigned char* xb = xs + (G & 1) * GG_XS_BYTES;
            float part[2][4][4];
#pragma unroll
            for (int a = 0; a < 2; ++a)
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) part[a][nt][c] = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                u32 pa[2][4], pb[2][4];
#pragma unroll
                for (int a = 0; a < 2; ++a) {
                    dq8<A>(word_of(q[a][0], i), pa[a]);
                    dq8<A>(word_of(q[a][1], i), pb[a]);
                }
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    const u32 row = th * 32 + nt * 8 + g;
                    const uint4 b = perm8(*(const uint4*)(xb + gg_chunk(row, tq * 4 + i) * 16));
#pragma unroll
                    for (int a = 0; a < 2; ++a) {
                        mma16<A>(part[a][nt], pa[a][0], pb[a][0], pa[a][1], pb[a][1], b.x, b.y);
                        mma16<A>(part[a][nt], pa[a][2], pb[a][2], pa[a][3], pb[a][3], b.z, b.w);
                    }
                }
            }
#pragma unroll
            for (int a = 0; a < 2; ++a)
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    tot[a][nt][0] += s[a][0] * part[a][nt][0];
                    tot[a][nt][1] += s[a][0] * part[a][nt][1];
                    tot[a][nt][2] += s[a][1] * part[a][nt][2];
                    tot[a][nt][3] += s[a][1] * part[a][nt][3];
                }
            __syncthreads();  // every warp is done with buffer G & 1 before step G + 2 refills it
        }
    }
    // C layout: c[0], c[1] = row g, tokens 2tq, 2tq+1; c[2], c[3] = row g + 8.
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const u32 r = r0 + th * 32 + nt * 8 + 2 * tq + (c & 1);
            if (r >= r1) continue;
            const u32 dr = g + 8 * (c >> 1);
            if (W13) {
                const float v = silu(tot[0][nt][c]) * tot[1][nt][c];
                ((unsigned short*)out)[(u64)r * N + rowt[0] + dr] = A::store(v);
            } else {
#pragma unroll
                for (int a = 0; a < 2; ++a) ((float*)out)[(u64)r * N + rowt[a] + dr] = tot[a][nt][c];
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
