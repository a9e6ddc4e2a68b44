// INT4 expert kernels (cache format v1, see runtime/cache/src/layout.rs).
//
// Weights: w13_q [2I, H] and w2_q [H, I] nibble-packed row-major (element k
// of a row in byte k/2, low nibble for even k), f16 scales [rows, K/128],
// value (q - 8) * s. One 16-byte load = 32 consecutive K elements of a row,
// all inside one 128-group, so each load needs exactly one scale.
// Experts are found through a device pointer table: base = table[ids[p]].
// An id past the table, a null or a misaligned base turns that pair's
// output into NaN instead of reading arbitrary memory.
//
// int4_w13_swiglu_<NCL>: decode gate/up GEMV + SwiGLU. Grid (I/16, pairs),
// 4 warps per block, each warp owns 4 consecutive rows i of one pair and
// computes gate row i and up row I+i together. Lane l handles K chunks
// l + 32*c (NCL = ceil(H/1024) chunks per lane); the token's activations
// for those chunks stay in registers (f32) across all rows of the warp, so
// x is read from L2 once per warp. Weight loads are 16-byte, streamed past
// L1, and issued for several rows before use to keep enough bytes in
// flight for HBM bandwidth. f32 accumulation, fixed warp reduction order.
// int4_w2_combine_<NCLI>: decode down GEMV fused with the router-weighted
// combine. Block = top_k (<= 16) warps (warp j = the token's j-th expert) x 16
// output rows; per-expert dot products go to shared memory, then 16
// threads sum them in j order and add once to the f32 residual.
// int4_dequant_bf16: one thread per 16-byte chunk -> 32 bf16 (exact value
// (q-8)*s in f32, rounded once), for the prefill cuBLAS path.
// Nibbles become floats with the 2^23 magic-number trick (exact).

#define MAGIC_F 8388608.0f  // 2^23

__device__ __forceinline__ float nib(u32 word, int shift) {
    return __uint_as_float(0x4B000000u | ((word >> shift) & 0xFu)) - (MAGIC_F + 8.0f);
}

// sum_{e<32} (q_e - 8) * x[e], x as 32 f32 in registers.
__device__ __forceinline__ float dot32(uint4 q, const float* x) {
    const u32 w[4] = {q.x, q.y, q.z, q.w};
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            s0 += nib(w[i], 8 * b) * x[8 * i + 2 * b];
            s1 += nib(w[i], 8 * b + 4) * x[8 * i + 2 * b + 1];
        }
    }
    return s0 + s1;
}

__device__ __forceinline__ const unsigned char* expert_base(const u64* table, u32 n_table, u32 id) {
    if (id >= n_table) return nullptr;
    u64 b = table[id];
    if (b == 0 || (b & 15u) != 0) return nullptr;
    return (const unsigned char*)b;
}

template <int NCL>
__device__ __forceinline__ void w13_swiglu(const bf16_t* __restrict__ x, const u64* __restrict__ table, u32 n_table,
                                           const u32* __restrict__ ids, u32 n_pairs, u32 k, u32 H, u32 I, u64 oq,
                                           u64 os, float* __restrict__ act) {
    constexpr int RP = NCL <= 2 ? 4 : (NCL <= 4 ? 2 : 1);
    const u32 p = blockIdx.y;
    if (p >= n_pairs) return;
    const u32 t = p / k;
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 i0 = blockIdx.x * 16 + warp * 4;
    if (i0 >= I) return;
    const u32 nc = H / 32;
    const unsigned char* base = expert_base(table, n_table, ids[p]);
    if (base == nullptr) {
        if (lane < 4 && i0 + lane < I) act[(u64)p * I + i0 + lane] = NAN_F;
        return;
    }
    float xr[NCL][32];
    const uint4* xrow = (const uint4*)(x + (u64)t * H);
#pragma unroll
    for (int cc = 0; cc < NCL; ++cc) {
        const u32 c = lane + 32 * cc;
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            uint4 u = c < nc ? xrow[c * 4 + v] : make_uint4(0, 0, 0, 0);
            xr[cc][8 * v + 0] = bf_lo(u.x);
            xr[cc][8 * v + 1] = bf_hi(u.x);
            xr[cc][8 * v + 2] = bf_lo(u.y);
            xr[cc][8 * v + 3] = bf_hi(u.y);
            xr[cc][8 * v + 4] = bf_lo(u.z);
            xr[cc][8 * v + 5] = bf_hi(u.z);
            xr[cc][8 * v + 6] = bf_lo(u.w);
            xr[cc][8 * v + 7] = bf_hi(u.w);
        }
    }
    const unsigned char* wq = base + oq;
    const f16_t* wsc = (const f16_t*)(base + os);
    const u64 rb = H / 2, sb = H / 128;
#pragma unroll
    for (int r0 = 0; r0 < 4; r0 += RP) {
        uint4 qg[RP][NCL], qu[RP][NCL];
        float sg[RP][NCL], su[RP][NCL];
#pragma unroll
        for (int rr = 0; rr < RP; ++rr) {
            const u32 i = min(i0 + r0 + rr, I - 1);
#pragma unroll
            for (int cc = 0; cc < NCL; ++cc) {
                const u32 c = lane + 32 * cc;
                if (c < nc) {
                    qg[rr][cc] = ld_stream16(wq + (u64)i * rb + c * 16);
                    qu[rr][cc] = ld_stream16(wq + (u64)(I + i) * rb + c * 16);
                    sg[rr][cc] = h2f(wsc[(u64)i * sb + c / 4]);
                    su[rr][cc] = h2f(wsc[(u64)(I + i) * sb + c / 4]);
                } else {
                    qg[rr][cc] = qu[rr][cc] = make_uint4(0x88888888u, 0x88888888u, 0x88888888u, 0x88888888u);
                    sg[rr][cc] = su[rr][cc] = 0.0f;
                }
            }
        }
#pragma unroll
        for (int rr = 0; rr < RP; ++rr) {
            float g = 0.0f, u = 0.0f;
#pragma unroll
            for (int cc = 0; cc < NCL; ++cc) {
                g += sg[rr][cc] * dot32(qg[rr][cc], xr[cc]);
                u += su[rr][cc] * dot32(qu[rr][cc], xr[cc]);
            }
            g = warp_sum(g);
            u = warp_sum(u);
            const u32 i = i0 + r0 + rr;
            if (lane == 0 && i < I) act[(u64)p * I + i] = silu(g) * u;
        }
    }
}

// One entry point per chunks-per-lane count (NCL = ceil(H / 1024), H <= 4096).
extern "C" __global__ void __launch_bounds__(128)
    int4_w13_swiglu_1(const bf16_t* __restrict__ x, const u64* __restrict__ table, u32 n_table,
                      const u32* __restrict__ ids, u32 n_pairs, u32 k, u32 H, u32 I, u64 oq, u64 os,
                      float* __restrict__ act) {
    w13_swiglu<1>(x, table, n_table, ids, n_pairs, k, H, I, oq, os, act);
}
extern "C" __global__ void __launch_bounds__(128)
    int4_w13_swiglu_2(const bf16_t* __restrict__ x, const u64* __restrict__ table, u32 n_table,
                      const u32* __restrict__ ids, u32 n_pairs, u32 k, u32 H, u32 I, u64 oq, u64 os,
                      float* __restrict__ act) {
    w13_swiglu<2>(x, table, n_table, ids, n_pairs, k, H, I, oq, os, act);
}
extern "C" __global__ void __launch_bounds__(128)
    int4_w13_swiglu_3(const bf16_t* __restrict__ x, const u64* __restrict__ table, u32 n_table,
                      const u32* __restrict__ ids, u32 n_pairs, u32 k, u32 H, u32 I, u64 oq, u64 os,
                      float* __restrict__ act) {
    w13_swiglu<3>(x, table, n_table, ids, n_pairs, k, H, I, oq, os, act);
}
extern "C" __global__ void __launch_bounds__(128)
    int4_w13_swiglu_4(const bf16_t* __restrict__ x, const u64* __restrict__ table, u32 n_table,
                      const u32* __restrict__ ids, u32 n_pairs, u32 k, u32 H, u32 I, u64 oq, u64 os,
                      float* __restrict__ act) {
    w13_swiglu<4>(x, table, n_table, ids, n_pairs, k, H, I, oq, os, act);
}


template <int NCLI>
__device__ __forceinline__ void w2_combine(const float* __restrict__ act, const u64* __restrict__ table, u32 n_table,
                                           const u32* __restrict__ ids, const float* __restrict__ w, u32 n_tokens,
                                           u32 k, u32 H, u32 I, u64 oq, u64 os, float* __restrict__ res) {
    __shared__ float ys[32][17];
    const u32 t = blockIdx.y;
    if (t >= n_tokens) return;
    const u32 j = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 p = t * k + j;
    const u32 n0 = blockIdx.x * 16;
    const u32 nc = I / 32;
    const unsigned char* base = expert_base(table, n_table, ids[p]);
    if (base == nullptr) {
        if (lane < 16) ys[j][lane] = NAN_F;
    } else {
        float ar[NCLI][32];
#pragma unroll
        for (int cc = 0; cc < NCLI; ++cc) {
            const u32 c = lane + 32 * cc;
            const float4* a4 = (const float4*)(act + (u64)p * I + (u64)c * 32);
#pragma unroll
            for (int v = 0; v < 8; ++v) {
                float4 f = c < nc ? a4[v] : make_float4(0, 0, 0, 0);
                ar[cc][4 * v] = f.x;
                ar[cc][4 * v + 1] = f.y;
                ar[cc][4 * v + 2] = f.z;
                ar[cc][4 * v + 3] = f.w;
            }
        }
        const unsigned char* wq = base + oq;
        const f16_t* wsc = (const f16_t*)(base + os);
        const u64 rb = I / 2, sb = I / 128;
        // Rows whose loads are issued together: 8 keep ~2x more bytes in
        // flight per warp than 4 while staying under the 128-register cap.
        constexpr int RW = NCLI == 1 ? 8 : 4;
#pragma unroll
        for (int r0 = 0; r0 < 16; r0 += RW) {
            uint4 q[RW][NCLI];
            float s[RW][NCLI];
#pragma unroll
            for (int rr = 0; rr < RW; ++rr) {
                const u32 n = min(n0 + r0 + rr, H - 1);
#pragma unroll
                for (int cc = 0; cc < NCLI; ++cc) {
                    const u32 c = lane + 32 * cc;
                    if (c < nc) {
                        q[rr][cc] = ld_stream16(wq + (u64)n * rb + c * 16);
                        s[rr][cc] = h2f(wsc[(u64)n * sb + c / 4]);
                    } else {
                        q[rr][cc] = make_uint4(0x88888888u, 0x88888888u, 0x88888888u, 0x88888888u);
                        s[rr][cc] = 0.0f;
                    }
                }
            }
#pragma unroll
            for (int rr = 0; rr < RW; ++rr) {
                float y = 0.0f;
#pragma unroll
                for (int cc = 0; cc < NCLI; ++cc) y += s[rr][cc] * dot32(q[rr][cc], ar[cc]);
                y = warp_sum(y);
                if (lane == 0) ys[j][r0 + rr] = y;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x < 16) {
        const u32 n = n0 + threadIdx.x;
        if (n < H) {
            float sum = 0.0f;
            for (u32 jj = 0; jj < k; ++jj) sum += w[(u64)t * k + jj] * ys[jj][threadIdx.x];
            res[(u64)t * H + n] += sum;
        }
    }
}

// One entry point per chunks-per-lane count (NCLI = ceil(I / 1024), I <= 2048).
extern "C" __global__ void __launch_bounds__(512)
    int4_w2_combine_1(const float* __restrict__ act, const u64* __restrict__ table, u32 n_table,
                      const u32* __restrict__ ids, const float* __restrict__ w, u32 n_tokens, u32 k, u32 H, u32 I,
                      u64 oq, u64 os, float* __restrict__ res) {
    w2_combine<1>(act, table, n_table, ids, w, n_tokens, k, H, I, oq, os, res);
}
extern "C" __global__ void __launch_bounds__(512)
    int4_w2_combine_2(const float* __restrict__ act, const u64* __restrict__ table, u32 n_table,
                      const u32* __restrict__ ids, const float* __restrict__ w, u32 n_tokens, u32 k, u32 H, u32 I,
                      u64 oq, u64 os, float* __restrict__ res) {
    w2_combine<2>(act, table, n_table, ids, w, n_tokens, k, H, I, oq, os, res);
}


extern "C" __global__ void int4_dequant_bf16(const u64* __restrict__ table, u32 n_table, const u32* __restrict__ ids,
                                             u32 n, u32 H, u32 I, u64 o13q, u64 o13s, u64 o2q, u64 o2s,
                                             bf16_t* __restrict__ w13_out, bf16_t* __restrict__ w2_out) {
    const u32 x = blockIdx.y;
    if (x >= n) return;
    const u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 c13 = (u64)2 * I * H / 32, c2 = (u64)H * I / 32;
    if (g >= c13 + c2) return;
    const unsigned char* base = expert_base(table, n_table, ids[x]);
    u32 K;
    u64 row, c;
    const unsigned char* q;
    const f16_t* sc;
    bf16_t* dst;
    if (g < c13) {
        K = H;
        row = g / (H / 32);
        c = g % (H / 32);
        q = base + o13q;
        sc = (const f16_t*)(base + o13s);
        dst = w13_out + (u64)x * 2 * I * H;
    } else {
        K = I;
        row = (g - c13) / (I / 32);
        c = (g - c13) % (I / 32);
        q = base + o2q;
        sc = (const f16_t*)(base + o2s);
        dst = w2_out + (u64)x * H * I;
    }
    uint4* o = (uint4*)(dst + row * K + c * 32);
    if (base == nullptr) {
        const u32 nn = 0x7fc07fc0u;
        for (int v = 0; v < 4; ++v) o[v] = make_uint4(nn, nn, nn, nn);
        return;
    }
    const uint4 qv = ld_stream16(q + row * (K / 2) + c * 16);
    const float s = h2f(sc[row * (K / 128) + c / 4]);
    const u32 w[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        uint4 r;
        r.x = pack_bf2(nib(w[i], 0) * s, nib(w[i], 4) * s);
        r.y = pack_bf2(nib(w[i], 8) * s, nib(w[i], 12) * s);
        r.z = pack_bf2(nib(w[i], 16) * s, nib(w[i], 20) * s);
        r.w = pack_bf2(nib(w[i], 24) * s, nib(w[i], 28) * s);
        o[i] = r;
    }
}
