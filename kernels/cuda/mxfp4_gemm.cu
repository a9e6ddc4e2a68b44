// Grouped MXFP4 expert GEMMs for prefill: every expert of a MoE layer in
// one launch per projection, the weights read in the expert cache's own
// format (the checkpoint's E2M1 codes and E8M0 scales, mxfp4.cu's header)
// and turned into tensor-core operands in registers. The design is
// int4_gemm.cu's (read its header first); what differs is the decode, the
// fused biases and gpt-oss's activation, and widths that are multiples of
// 32 only (gpt-oss: H = I = 2880).
//
// Compiled in the mxfp4 module after mxfp4.cu (sources.rs), whose helpers
// it uses: mx_base (table lookup, null when the entry is missing or
// misaligned), mx_factors + dqmx8 (8 codes -> 4 exact bf16x2 pairs (code
// j, code j+4) of e2m1 * 2^(s-127)), mma_bf16_mx (m16n8k16 bf16, f32
// accumulate), mx_perm8 (8 bf16 -> the pairs (x[j], x[j+4])) and
// expert_act (SwiGLU or gpt-oss's clamped SwiGLU); grouped_find_tile is
// common.cuh's.
//
// Why. gpt-oss prefill dequantized each expert of a layer to bf16 in
// memory (256 MiB batches) and ran one cuBLAS GEMM per expert and
// projection, with the bias + activation and the down bias as kernels of
// their own per expert: at 512-2,048 tokens (64-256 rows per expert of 32,
// top-4) the launches and the dequantized round trip, not the arithmetic,
// set the speed, as they did for INT4 before int4_gemm.cu.
//
// Problem. moe_group + gather_rows put expert e's rows of the chunk at
// offsets[e]..offsets[e+1] of x ([rows, K], bf16). Per expert, in cache
// row order (w13 rows 0..I gate, I..2I up; the cache builder
// de-interleaves gpt-oss's alternating gate/up rows):
//   gate/up (mxfp4_grouped_w13_act): K = H, out[r, i] =
//     bf16(act(W13_e[i] . x[r] + b13_e[i], W13_e[I + i] . x[r] + b13_e[I + i])),
//     out [rows, I], act = SwiGLU or gpt-oss's clamped SwiGLU (expert_act:
//     gate clamped above at limit, up to [-limit, limit], (up + 1) * gate *
//     sigmoid(alpha * gate)), the biases only when the layout has them;
//   down (mxfp4_grouped_w2): K = I, out[r, n] = W2_e[n] . x[r] + b2_e[n],
//     f32 [rows, H].
// The two launches do, per expert, what the dequantization, both GEMMs,
// bias_act_rows and add_bias_rows of the per-expert path do (the engine's
// prefill path until these pass on the device).
//
// Grid and block as int4_grouped_*: y = one token tile (MXG_BT = 64 rows
// of one expert, found by warp 0), x = a slice of the output features
// (gate/up 64 i: warp w's 16-row weight tile is gate rows i..i+8 and up
// rows I+i..I+i+8, so a lane's C holds g and u of the same (i, token) and
// the activation needs no exchange; down 128 rows, 16 per warp). 8 warps,
// each its weight tile x all 64 tokens (8 mma column tiles), so each code
// is decoded once per block. The widths need only be multiples of 32:
// I / 8 gate/up and H / 16 down warp tiles exist, and a warp whose tile
// lies past the output (the last block of gpt-oss's down, 2880 = 22.5 x
// 128, has 4 live warps) loads and computes nothing but still stages x and
// meets every barrier.
//
// K steps of 128 = 4 MXFP4 blocks: lane (g, tq) loads 16 bytes of its rows
// g and g+8 at K = 128G + 32tq, exactly one block each, so one scale byte
// per row per step, loaded with the codes a step ahead. The four lanes tq
// of an mma K step hold four different blocks (scales), so the scale is
// applied while decoding, before the mma (mxfp4.cu's dqmx8: magnitude bits
// to bf16 bits 8..6, sign to 15, one fma.rn.bf16x2 by 2^(s-1), a second one
// when s > 128), not to C afterwards as INT4's one scale per step allows.
// Each 32-bit word of codes becomes the pairs (code j, code j+4), the
// permuted K order, and x is staged in that order (mx_perm8) in fragment
// order, [column tile][i][lane] x 16 bytes, in one of two shared buffers,
// a step ahead, as in int4_gemm.cu: one barrier per step.
// K not a multiple of 128 (gpt-oss H = 2880 is 22.5 steps; tiny-gpt-oss's
// down K = 64 half a step): the lanes whose block lies past K load no
// codes (zero weights, scale byte 127), and the x chunks past K are staged
// as zeros, so the padding adds exact zeros (never 0 * a stray NaN).
//
// Numerics. Every decoded weight e2m1 * 2^(s-127) is exact in bf16 (two
// significant bits; bf16 has f32's exponent range, subnormals included;
// bar the NaN scale 255 and the large codes past bf16's range at s >= 253,
// as in the decode kernels), so each product with x is exact in f32 and the tensor core sums one
// 128-wide step in f32; the step's sum is added to the f32 total in K
// order, the bias added to the total, and the activation taken from f32
// and rounded once to bf16 (the old path rounded the GEMM output to bf16
// before the bias). A row's result depends only on its own x and the
// expert (no split-K, no reduction across tokens), so it is the same
// whichever tile, chunk or batch the row lands in: chunked prefill stays
// boundary-invariant, and streamed prefill (the table naming staging
// buffers) computes the bits of all-resident. A missing or misaligned
// expert writes NaN to its rows (its bias is not read).
//
// Formats. x and the gate/up output are bf16 only, as every MXFP4 kernel:
// an FP16 MLP block with MXFP4 experts is refused at load (and f16 could
// not hold e2m1 * 2^(s-127) exactly outside s = 104..140).

#define MXG_BT 64
#define MXG_THREADS 256
#define MXG_XS_U4 (MXG_BT / 8 * 4 * 32)  // uint4s of one step of x: 8 column tiles x 4 i x 32 lanes (16 KB)

__device__ __forceinline__ u32 mx_word(uint4 q, int i) { return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w; }

// W13: gate/up + bias + activation into `out` (bf16 [rows, N = I]); else
// down + bias into `out` (f32 [rows, N = H]). K: the reduction width (H or
// I), I: the intermediate width (where the up rows start). ob: the
// projection's bias offset in the expert block (read only when has_bias).
template <bool W13>
__device__ __forceinline__ void grouped_mxfp4(const bf16_t* __restrict__ x, const u32* __restrict__ offsets,
                                              u32 n_experts, const u64* __restrict__ table, u32 n_table, u32 K, u32 I,
                                              u32 N, u64 oq, u64 os, u64 ob, u32 has_bias, u32 kind, float limit,
                                              float alpha, void* __restrict__ out) {
    __shared__ __align__(16) uint4 xs[2 * MXG_XS_U4];
    __shared__ u32 info[3];
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    if (threadIdx.x == 0) info[0] = ~0u;
    __syncthreads();
    if (warp == 0) grouped_find_tile<MXG_BT>(offsets, n_experts, blockIdx.y, lane, info);
    __syncthreads();
    const u32 e = info[0];
    if (e == ~0u) return;  // block-uniform; only when the grid is larger than the tiles
    const u32 r0 = info[1], r1 = info[2];
    // This lane's weight rows (h = 0: row g of the warp's tile, h = 1: row
    // g + 8) and, for gate/up, its i; `live`: the warp's tile lies inside
    // the output (warp-uniform: I and H are multiples of 32, so a tile is
    // wholly inside or wholly past).
    const u32 i0 = blockIdx.x * 64 + warp * 8 + g;
    u32 row[2];
    bool live;
    if (W13) {
        row[0] = i0;
        row[1] = I + i0;
        live = blockIdx.x * 64 + warp * 8 < I;
    } else {
        row[0] = blockIdx.x * 128 + warp * 16 + g;
        row[1] = row[0] + 8;
        live = blockIdx.x * 128 + warp * 16 < N;
    }
    const unsigned char* base = mx_base(table, n_table, e);
    float tot[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) tot[nt][c] = base ? 0.0f : NAN_F;
    if (base != nullptr) {  // block-uniform
        const u32 ng = (K + 127) / 128, nb = K / 32;
        const unsigned char* wp[2];
        const unsigned char* sp[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            wp[h] = base + oq + (u64)row[h] * (K / 2) + tq * 16;
            sp[h] = base + os + (u64)row[h] * nb + tq;
        }
        // Step G of x: chunk c = t + 256r is lane c & 31 (token (c & 31) >> 2
        // of column tile c >> 7, K quarter tq = c & 3), word i = (c >> 5) & 3;
        // zero past the tile's rows and past K (K is a multiple of 32, so a
        // quarter is wholly inside or wholly past).
        uint4 xr[4];
        auto load_x = [&](u32 G) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const u32 c = threadIdx.x + r * MXG_THREADS;
                const u32 tok = (c >> 7) * 8 + ((c & 31) >> 2);
                const u32 k = G * 128 + (c & 3) * 32;
                xr[r] = r0 + tok < r1 && k < K ? *(const uint4*)(x + (u64)(r0 + tok) * K + k + ((c >> 5) & 3) * 8)
                                               : make_uint4(0, 0, 0, 0);
            }
        };
        auto store_x = [&](u32 buf) {
#pragma unroll
            for (int r = 0; r < 4; ++r) xs[buf * MXG_XS_U4 + threadIdx.x + r * MXG_THREADS] = mx_perm8(xr[r]);
        };
        // Step G's codes and scale bytes of this lane's two rows: block
        // 4G + tq; past K (or in a dead warp) zero codes, whose decode is
        // +0 whatever the scale.
        uint4 qn[2];
        u32 sn[2];
        auto load_w = [&](u32 G) {
            const bool in = live && G * 4 + tq < nb;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if (in) {
                    qn[h] = ld_stream16(wp[h] + (u64)G * 64);
                    sn[h] = sp[h][G * 4];
                } else {
                    qn[h] = make_uint4(0, 0, 0, 0);
                    sn[h] = 127u;
                }
            }
        };
        load_x(0);
        load_w(0);
        store_x(0);
        __syncthreads();
        for (u32 G = 0; G < ng; ++G) {
            const uint4 q0 = qn[0], q1 = qn[1];
            const u32 s0 = sn[0], s1 = sn[1];
            if (G + 1 < ng) {
                load_x(G + 1);
                load_w(G + 1);
            }
            if (live) {  // warp-uniform: the mma needs the whole warp
                u32 fa1, fa2, fb1, fb2;
                mx_factors(s0, fa1, fa2);
                mx_factors(s1, fb1, fb2);
                const bool ta = s0 > 128u, tb = s1 > 128u;
                const uint4* xb = xs + (G & 1) * MXG_XS_U4 + lane;
                float part[8][4];
#pragma unroll
                for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) part[nt][c] = 0.0f;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    u32 pa[4], pb[4];
                    dqmx8(mx_word(q0, i), fa1, fa2, ta, pa);
                    dqmx8(mx_word(q1, i), fb1, fb2, tb, pb);
#pragma unroll
                    for (int nt = 0; nt < 8; ++nt) {
                        const uint4 b = xb[(nt * 4 + i) * 32];
                        mma_bf16_mx(part[nt], pa[0], pb[0], pa[1], pb[1], b.x, b.y);
                        mma_bf16_mx(part[nt], pa[2], pb[2], pa[3], pb[3], b.z, b.w);
                    }
                }
#pragma unroll
                for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) tot[nt][c] += part[nt][c];
            }
            // Buffer (G + 1) & 1 was last read in step G - 1, before the
            // previous barrier; this barrier publishes it and retires G & 1.
            if (G + 1 < ng) store_x((G + 1) & 1);
            __syncthreads();
        }
    }
    if (!live) return;  // after the last barrier
    // The bias of rows row[0] and row[1] (gate/up: b13[i], b13[I + i]).
    float bias[2] = {0.0f, 0.0f};
    if (base != nullptr && has_bias) {
        const bf16_t* b = (const bf16_t*)(base + ob);
        bias[0] = bf2f(b[row[0]]);
        bias[1] = bf2f(b[row[1]]);
    }
    // C layout: c[0], c[1] = row g, tokens 2tq, 2tq+1; c[2], c[3] = row g + 8.
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const u32 r = r0 + nt * 8 + 2 * tq + c;
            if (r >= r1) continue;
            if (W13) {
                const float v = expert_act(tot[nt][c] + bias[0], tot[nt][2 + c] + bias[1], kind, limit, alpha);
                ((bf16_t*)out)[(u64)r * N + i0] = f2bf(v);
            } else {
                ((float*)out)[(u64)r * N + row[0]] = tot[nt][c] + bias[0];
                ((float*)out)[(u64)r * N + row[1]] = tot[nt][2 + c] + bias[1];
            }
        }
}

#define MXG_ARGS                                                                                                  \
    const bf16_t *__restrict__ x, const u32 *__restrict__ offsets, u32 n_experts, const u64 *__restrict__ table, \
        u32 n_table, u32 K, u32 I, u32 N, u64 oq, u64 os, u64 ob, u32 has_bias
#define MXG_PASS x, offsets, n_experts, table, n_table, K, I, N, oq, os, ob, has_bias
extern "C" __global__ void __launch_bounds__(MXG_THREADS, 1)
    mxfp4_grouped_w13_act(MXG_ARGS, u32 kind, float limit, float alpha, bf16_t* __restrict__ out) {
    grouped_mxfp4<true>(MXG_PASS, kind, limit, alpha, out);
}
extern "C" __global__ void __launch_bounds__(MXG_THREADS, 1) mxfp4_grouped_w2(MXG_ARGS, float* __restrict__ out) {
    grouped_mxfp4<false>(MXG_PASS, ACT_SWIGLU, 0.0f, 0.0f, out);
}
