// Causal GQA attention for prefill (flash attention 2 style).
//
// attn_prefill_mma_d{64,128,256}: tensor cores via mma.sync.m16n8k16 bf16
// -> f32, one template (attn_prefill_mma<D, BN, QS>) instantiated per head
// dim. A block of 4 warps owns 64 query rows of one q head (16 rows per
// warp) and walks BN-key tiles of its kv head up to the diagonal. K and V
// tiles are staged in dynamic shared memory with cp.async, XOR-swizzled by
// 16-byte chunk (chunk c of row r at c ^ (r & 7); a row is D/8 chunks: 8,
// 16 or 32) so the 32-bit K fragment loads and the ldmatrix(.trans) Q and V
// loads are free of bank conflicts. Pipeline (single K and V buffers): V of
// tile n is issued while S = Q K^T of tile n runs, K of tile n+1 while
// O += P V of tile n runs (two commit groups in flight, fixed wait counts).
// Softmax is online in f32 in the log2 domain; P is rounded to bf16 for the
// P V product (as in flash attention); the row sums use the f32 P. Query
// tiles are issued last-first so the longest blocks start early. Rows past
// n_tokens are computed with the last valid position (so they never read
// unwritten cache) and not stored.
//
// Per head dim (registers per lane: O = D/2 f32, S = BN/2 f32):
// - D=64:  BN=64, Q in registers (16 regs), 16 KB smem.
// - D=128: BN=64, Q in registers (32 regs), 32 KB smem.
// - D=256: O alone is 128 registers and Q would be 64 more, so Q is staged
//   once in shared memory (64 x 256 bf16 = 32 KB, same swizzle) and read per
//   k-step with ldmatrix.x4 (4 registers live); BN=64 (S = 32 registers).
//   Smem: Q 32 KB + K 32 KB + V 32 KB = 96 KB (dynamic, > 48 KB opt-in), so
//   two blocks (8 warps) fit an H100/H200 SM, one an A100/sm_8x SM.
// ptxas (NVRTC 13.0, sm_90): d64 167, d128 254, d256 255 registers, no
// spills; at <= 255 registers two 128-thread blocks fit an SM's register file.
// The gpt-oss (ring) variants (NVRTC 13.5): ring d64 167, ring d128 248, no
// spills; d256 has no ring variant (no register headroom; the SIMT kernel
// serves it).
// The launch passes exactly pf_smem_bytes(D, BN, QS) bytes of dynamic shared
// memory (mirrored in ops/attention.rs); a smaller launch traps.
//
// attn_prefill_simt: any head_dim in {64,128,192,256}; one warp per query
// row; each lane scores one key of a 32-key group, then the group's P V is
// accumulated with the probabilities broadcast by shuffle. f32 throughout.
// Used for other head dims and as an independent implementation in tests.
//
// Chunk invariance (the prefix cache resumes prefill at any block boundary,
// so a row must come out the same whichever chunk it is in and wherever
// that chunk starts): a query row's result depends only on its absolute
// position p, its q row and the cached keys/values 0..p. The mma kernel's
// key tiles start at absolute multiples of BN (kt0 = 0 for causal layers),
// so row p sees keys in the same tiles, in the same order, with the same
// per-tile reductions (the S MMAs over the head dim, the quad shuffles of
// the row max, each lane's partial row sum added at the end) in every
// chunking; the chunk only decides how many further tiles the block walks
// (up to its last row), and a tile wholly past p is an exact no-op for row
// p: its scores are -inf, so the running max stays (alpha = exp2(0) = 1
// exactly), its P is 0 and adds 0 to the row sum and, through the MMA, to
// O. Staged rows past the chunk's last position are zero-filled but
// masked for every row. Which lane and warp hold row p changes with the
// chunk start; mma.sync computes every element of its 16x8 tile the same
// way, so that does not change the bits (checked on the device by
// attention_prefill_rows_are_chunk_invariant in kernels/tests/gpu). The
// SIMT kernel walks 32-key groups from key 0 for each row alone. The ring
// variants start at the tile holding the window start of the query tile's
// first row (which depends on the chunk), still an absolute multiple of BN:
// the tiles they walk before row p's own window are wholly masked for p
// (-inf scores), an exact no-op as above (the running max stays, alpha =
// 1, P = 0), so row p's result is chunk-invariant there too (checked by
// attention_prefill_ring_rows_are_chunk_invariant).
//
// KV cache layout: [n_kv_heads][capacity][head_dim] bf16 per layer (f16 for
// the _f16 entry points).
//
// Activation format: every kernel is a template over A (ActBf16 / ActF16,
// common.cuh) for how q, K, V and P are stored and which MMA runs; the
// plain entry points instantiate ActBf16 (the code they had before the
// template), the _f16 ones ActF16 (at the end of the file).
//
// gpt-oss variants (entry points *_ring; the same templates with RING set,
// so the plain causal entry points compile to the code they had before):
// - Ring cache: key position p lives in row p % ring of the sequence's rows
//   (the host offsets kc / vc to the sequence's first row, as for the plain
//   kernels; continuous batching gives each sequence its own ring). A chunk
//   of n tokens is appended before it attends, so every query's window is
//   present iff ring >= window + n - 1 (checked by the wrappers); full
//   layers pass ring 0: row p, their linear rows.
// - Sliding window (window > 0): query at position pos sees keys j with
//   0 <= pos - j < window (window 0: all j <= pos). The mma kernel starts at
//   the key tile holding the window start of the query tile's first row, so
//   a sliding layer's cost per query tile is bounded by window + 64 keys
//   whatever the context; staged rows outside [window start, kend) are
//   zero-filled (their ring rows may already hold newer positions) and the
//   partial tiles are masked per row.
// - Sinks (optional f32 [n_q_heads]): one extra logit per head that joins
//   every row's softmax and whose probability is dropped (no value). Each
//   row's online softmax starts from the state of having seen that logit:
//   running max = sink * log2(e), row sum = 1 (held by one of the row's four
//   lanes, since the lanes' partial sums are added at the end), output 0.
//   This is exact, not an approximation: online softmax merges states
//   (max, sum, unnormalized output) associatively and every later rescale
//   multiplies the sink's term exactly like a key's, so the result is the
//   softmax over {scores, sink} with the sink's probability dropped, as in
//   transformers (max over scores and sink, denominator includes
//   exp(sink - max)). Starting from it also keeps the running max finite,
//   so tiles lying wholly before a row's window cost nothing extra; without
//   sinks such a row's max is still -inf and the update subtracts 0 instead
//   of it, so exp2 gives 0 rather than NaN.

#define PF_BM 64
#define PF_THREADS 128

__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_f16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The MMA of activation format A (bf16 or f16 inputs, f32 accumulators).
template <class A> __device__ __forceinline__ void mma16(float* c, const u32* a, u32 b0, u32 b1) {
    if constexpr (A::F16) mma_f16(c, a, b0, b1);
    else mma_bf16(c, a, b0, b1);
}

__device__ __forceinline__ void ldmatrix_x4(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

extern __shared__ __align__(128) uint4 pf_smem[];

// Dynamic shared memory of one block: K and V tiles, then Q (QS only).
__host__ __device__ constexpr u32 pf_smem_bytes(int d, int bn, bool qs) {
    return (u32)((2 * bn + (qs ? PF_BM : 0)) * d * 2);
}

// Stage `rows` rows of D bf16 (row r from src + r * src_stride, if r < valid)
// into dst, swizzled; rows >= valid are zero-filled. All 128 threads.
template <int D, int ROWS>
__device__ __forceinline__ void pf_stage(uint4* dst, const bf16_t* src, u64 src_stride, u32 valid) {
    constexpr u32 CH = D / 8;
    static_assert((ROWS * CH) % PF_THREADS == 0, "tile chunks must split evenly over the block");
#pragma unroll
    for (u32 it = 0; it < (ROWS * CH) / PF_THREADS; ++it) {
        const u32 i = threadIdx.x + it * PF_THREADS;
        const u32 r = i / CH, c = i % CH;
        uint4* d = &dst[r * CH + (c ^ (r & 7))];
        if (r < valid) cp_async16(d, src + (u64)r * src_stride + c * 8);
        else *d = make_uint4(0, 0, 0, 0);
    }
}

// Ring cache: tile row r is key position n0 + r, stored in row
// (n0 + r) % ring (row n0 + r with ring == 0: a full layer's linear rows);
// positions outside [lo, hi) are zero-filled.
template <int D, int ROWS>
__device__ __forceinline__ void pf_stage_ring(uint4* dst, const bf16_t* base, u32 n0, u32 lo, u32 hi, u32 ring) {
    constexpr u32 CH = D / 8;
    static_assert((ROWS * CH) % PF_THREADS == 0, "tile chunks must split evenly over the block");
#pragma unroll
    for (u32 it = 0; it < (ROWS * CH) / PF_THREADS; ++it) {
        const u32 i = threadIdx.x + it * PF_THREADS;
        const u32 r = i / CH, c = i % CH;
        const u32 p = n0 + r;
        uint4* d = &dst[r * CH + (c ^ (r & 7))];
        if (p >= lo && p < hi) cp_async16(d, base + (u64)(ring ? p % ring : p) * D + c * 8);
        else *d = make_uint4(0, 0, 0, 0);
    }
}

#define PF_LOG2E 1.4426950408889634f

template <class A, int D, int BN, bool QS, bool RING>
__device__ __forceinline__ void attn_prefill_mma(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ kc,
                                                 const bf16_t* __restrict__ vc, bf16_t* __restrict__ out,
                                                 u32 n_tokens, u32 start, u32 nq, u32 nkv, u32 cap, float sl2,
                                                 const float* __restrict__ sinks, u32 window, u32 ring = 0) {
    constexpr u32 CH = D / 8;  // 16-byte chunks per row of Q, K and V
    constexpr int KT = D / 16; // k-steps of S = Q K^T
    constexpr int NJ = BN / 8; // 8-key column tiles of S
    constexpr int PK = BN / 16; // k-steps of O += P V
    constexpr int NP = D / 16; // pairs of 8-column O tiles (one ldmatrix.x4.trans each)
    static_assert(D == 64 || D == 128 || D == 256, "head_dim");
    static_assert(BN % 16 == 0 && BN >= 16, "key tile");
    {
        u32 dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < pf_smem_bytes(D, BN, QS)) asm volatile("trap;");
    }
    uint4* Ks = pf_smem;
    uint4* Vs = Ks + BN * CH;
    uint4* Qs = Vs + BN * CH; // QS only: PF_BM rows

    const u32 mt = gridDim.x - 1 - blockIdx.x;
    const u32 h = blockIdx.y;
    const u32 kvh = h / (nq / nkv);
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 g = lane >> 2, tq = lane & 3;
    const u32 stride = (nq + 2 * nkv) * D;
    const u32 m0 = mt * PF_BM;
    const u32 r0 = m0 + warp * 16 + g, r1 = r0 + 8;
    const u32 last = start + n_tokens - 1;
    const u32 p0 = min(start + r0, last), p1 = min(start + r1, last);
    const u32 kend = min(start + m0 + PF_BM - 1, last) + 1;
    // RING: keys before kstart (the window start of the tile's first row) are
    // seen by none of its rows; the walk starts at kstart's tile, kt0.
    u32 win = 0, kstart = 0;
    if constexpr (RING) {
        win = window ? window : 0xffffffffu;
        kstart = start + m0 + 1 > win ? start + m0 + 1 - win : 0u;
    }
    const u32 kt0 = RING ? kstart / BN * BN : 0u;
    const u32 ntiles = (kend - kt0 + BN - 1) / BN;
    const bf16_t* qbase = qkv + (u64)h * D;
    const bf16_t* kbase = kc + (u64)kvh * cap * D;
    const bf16_t* vbase = vc + (u64)kvh * cap * D;

    // Prologue: Q (QS) and K tile 0 in one commit group.
    if constexpr (QS) pf_stage<D, PF_BM>(Qs, qbase + (u64)m0 * stride, stride, n_tokens - min(m0, n_tokens));
    if constexpr (RING) pf_stage_ring<D, BN>(Ks, kbase, kt0, kstart, kend, ring);
    else pf_stage<D, BN>(Ks, kbase, D, kend);
    cp_async_commit();

    // Q as A fragments (registers) when not staged: rows r0/r1, k-step kk.
    u32 qa[QS ? 1 : KT][4];
    if constexpr (!QS) {
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) {
            u32 col = kk * 16 + 2 * tq;
            qa[kk][0] = r0 < n_tokens ? *(const u32*)(qbase + (u64)r0 * stride + col) : 0u;
            qa[kk][1] = r1 < n_tokens ? *(const u32*)(qbase + (u64)r1 * stride + col) : 0u;
            qa[kk][2] = r0 < n_tokens ? *(const u32*)(qbase + (u64)r0 * stride + col + 8) : 0u;
            qa[kk][3] = r1 < n_tokens ? *(const u32*)(qbase + (u64)r1 * stride + col + 8) : 0u;
        }
    }
    // ldmatrix lane roles: lane l addresses row (l & 7) of 8x8 matrix l >> 3;
    // matrix mi covers rows (mi & 1) * 8.. and chunk (mi >> 1) of a 16x16 slice.
    const u32 mi = lane >> 3, rr = lane & 7;
    const u32 qrow = warp * 16 + (mi & 1) * 8 + rr; // QS: row within the block tile

    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float mrow0 = NEG_INF_F, mrow1 = NEG_INF_F, l0 = 0.0f, l1 = 0.0f;
    if constexpr (RING) {
        if (sinks) { // the sink as the first logit seen (header)
            mrow0 = mrow1 = sinks[h] * PF_LOG2E;
            l0 = l1 = tq == 0 ? 1.0f : 0.0f;
        }
    }

    for (u32 nt = 0; nt < ntiles; ++nt) {
        const u32 n0 = kt0 + nt * BN;
        __syncthreads(); // every warp is done reading Vs (tile nt - 1)
        if constexpr (RING) pf_stage_ring<D, BN>(Vs, vbase, n0, kstart, kend, ring);
        else pf_stage<D, BN>(Vs, vbase + (u64)n0 * D, D, kend - n0);
        cp_async_commit();
        cp_async_wait<1>(); // K tile nt (and Q) landed; V tile nt may be in flight
        __syncthreads();

        float s[NJ][4];
#pragma unroll
        for (int j = 0; j < NJ; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) {
            u32 qf[4];
            if constexpr (QS) {
                ldmatrix_x4(qf, &Qs[qrow * CH + ((2 * kk + (mi >> 1)) ^ rr)]);
            } else {
                qf[0] = qa[kk][0];
                qf[1] = qa[kk][1];
                qf[2] = qa[kk][2];
                qf[3] = qa[kk][3];
            }
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                u32 key = j * 8 + g;
                const u32* row = (const u32*)&Ks[key * CH];
                u32 b0 = row[(((2 * kk) ^ (key & 7)) << 2) + tq];
                u32 b1 = row[(((2 * kk + 1) ^ (key & 7)) << 2) + tq];
                mma16<A>(s[j], qf, b0, b1);
            }
        }
        // Mask, scale (log2 domain), online softmax.
        float mx0 = NEG_INF_F, mx1 = NEG_INF_F;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                u32 key = n0 + j * 8 + 2 * tq + (e & 1);
                u32 pos = e < 2 ? p0 : p1;
                const bool live = RING ? key <= pos && pos - key < win : key <= pos;
                float v = live ? s[j][e] * sl2 : NEG_INF_F;
                s[j][e] = v;
                if (e < 2) mx0 = fmaxf(mx0, v);
                else mx1 = fmaxf(mx1, v);
            }
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float mn0 = fmaxf(mrow0, mx0), mn1 = fmaxf(mrow1, mx1);
        // RING: a row may have no live key yet and no sink (max -inf).
        const float sb0 = RING && mn0 == NEG_INF_F ? 0.0f : mn0;
        const float sb1 = RING && mn1 == NEG_INF_F ? 0.0f : mn1;
        const float al0 = exp2f(mrow0 - sb0), al1 = exp2f(mrow1 - sb1);
        mrow0 = mn0;
        mrow1 = mn1;
        float ls0 = 0.0f, ls1 = 0.0f;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            s[j][0] = exp2f(s[j][0] - sb0);
            s[j][1] = exp2f(s[j][1] - sb0);
            s[j][2] = exp2f(s[j][2] - sb1);
            s[j][3] = exp2f(s[j][3] - sb1);
            ls0 += s[j][0] + s[j][1];
            ls1 += s[j][2] + s[j][3];
        }
        l0 = l0 * al0 + ls0;
        l1 = l1 * al1 + ls1;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            o[n][0] *= al0;
            o[n][1] *= al0;
            o[n][2] *= al1;
            o[n][3] *= al1;
        }
        cp_async_wait<0>();
        __syncthreads(); // V tile nt visible; every warp is done reading Ks
        if (nt + 1 < ntiles) {
            if constexpr (RING) pf_stage_ring<D, BN>(Ks, kbase, n0 + BN, kstart, kend, ring);
            else pf_stage<D, BN>(Ks, kbase + (u64)(n0 + BN) * D, D, kend - (n0 + BN));
        }
        cp_async_commit(); // possibly empty: keeps the group count fixed
#pragma unroll
        for (int kk = 0; kk < PK; ++kk) {
            u32 pa[4];
            pa[0] = A::pack2(s[2 * kk][0], s[2 * kk][1]);
            pa[1] = A::pack2(s[2 * kk][2], s[2 * kk][3]);
            pa[2] = A::pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[3] = A::pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            const u32 key = kk * 16 + (mi & 1) * 8 + rr;
#pragma unroll
            for (int np = 0; np < NP; ++np) {
                u32 dchunk = np * 2 + (mi >> 1);
                u32 vb[4];
                ldmatrix_x4_trans(vb, &Vs[key * CH + (dchunk ^ (key & 7))]);
                mma16<A>(o[2 * np], pa, vb[0], vb[1]);
                mma16<A>(o[2 * np + 1], pa, vb[2], vb[3]);
            }
        }
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = 1.0f / l0, inv1 = 1.0f / l1;
    const u32 ostride = nq * D;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        u32 col = h * D + n * 8 + 2 * tq;
        if (r0 < n_tokens) *(u32*)(out + (u64)r0 * ostride + col) = pack_bf2(o[n][0] * inv0, o[n][1] * inv0);
        if (r1 < n_tokens) *(u32*)(out + (u64)r1 * ostride + col) = pack_bf2(o[n][2] * inv1, o[n][3] * inv1);
    }
}

// Entry points (mirrored by PREFILL_MMA in ops/attention.rs): D, keys per
// tile, Q staged in shared memory.
extern "C" __global__ void __launch_bounds__(PF_THREADS)
    attn_prefill_mma_d64(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ kc,
                         const bf16_t* __restrict__ vc, bf16_t* __restrict__ out, u32 n_tokens, u32 start, u32 nq,
                         u32 nkv, u32 cap, float sl2) {
    attn_prefill_mma<ActBf16, 64, 64, false, false>(qkv, kc, vc, out, n_tokens, start, nq, nkv, cap, sl2, nullptr, 0);
}

extern "C" __global__ void __launch_bounds__(PF_THREADS)
    attn_prefill_mma_d128(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ kc,
                          const bf16_t* __restrict__ vc, bf16_t* __restrict__ out, u32 n_tokens, u32 start, u32 nq,
                          u32 nkv, u32 cap, float sl2) {
    attn_prefill_mma<ActBf16, 128, 64, false, false>(qkv, kc, vc, out, n_tokens, start, nq, nkv, cap, sl2, nullptr, 0);
}

extern "C" __global__ void __launch_bounds__(PF_THREADS)
    attn_prefill_mma_d256(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ kc,
                          const bf16_t* __restrict__ vc, bf16_t* __restrict__ out, u32 n_tokens, u32 start, u32 nq,
                          u32 nkv, u32 cap, float sl2) {
    attn_prefill_mma<ActBf16, 256, 64, true, false>(qkv, kc, vc, out, n_tokens, start, nq, nkv, cap, sl2, nullptr, 0);
}

// gpt-oss variants (ring cache, window, sinks): head dims 64 and 128. Mirrored
// by PREFILL_MMA_RING in ops/attention.rs.
extern "C" __global__ void __launch_bounds__(PF_THREADS)
    attn_prefill_mma_ring_d64(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ kc,
                              const bf16_t* __restrict__ vc, bf16_t* __restrict__ out, u32 n_tokens, u32 start,
                              u32 nq, u32 nkv, u32 cap, float sl2, const float* __restrict__ sinks, u32 window,
                              u32 ring) {
    attn_prefill_mma<ActBf16, 64, 64, false, true>(qkv, kc, vc, out, n_tokens, start, nq, nkv, cap, sl2, sinks,
                                                   window, ring);
}

extern "C" __global__ void __launch_bounds__(PF_THREADS)
    attn_prefill_mma_ring_d128(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ kc,
                               const bf16_t* __restrict__ vc, bf16_t* __restrict__ out, u32 n_tokens, u32 start,
                               u32 nq, u32 nkv, u32 cap, float sl2, const float* __restrict__ sinks, u32 window,
                               u32 ring) {
    attn_prefill_mma<ActBf16, 128, 64, false, true>(qkv, kc, vc, out, n_tokens, start, nq, nkv, cap, sl2, sinks,
                                                    window, ring);
}

// SIMT: RING starts at the first row's window start (kb), reads rows
// modulo the ring and starts each row's softmax from its sink (as above).
// Every 32-key group holds its first key kb <= pos, so a row's max is never
// -inf after the first group.
template <class A, bool RING>
__device__ __forceinline__ void attn_prefill_simt_t(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ kc,
                                                    const bf16_t* __restrict__ vc, bf16_t* __restrict__ out,
                                                    u32 n_tokens, u32 start, u32 nq, u32 nkv, u32 cap, float sl2,
                                                    u32 d, const float* __restrict__ sinks, u32 window,
                                                    u32 ring = 0) {
    __shared__ float qs[4][256];
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 t = blockIdx.x * 4 + warp, h = blockIdx.y;
    if (t >= n_tokens) return;
    const u32 kvh = h / (nq / nkv);
    const u32 pos = start + t;
    const u32 stride = (nq + 2 * nkv) * d;
    const bf16_t* q = qkv + (u64)t * stride + (u64)h * d;
    for (u32 i = lane; i < d; i += 32) qs[warp][i] = A::load(q[i]);
    __syncwarp();
    const bf16_t* kbase = kc + (u64)kvh * cap * d;
    const bf16_t* vbase = vc + (u64)kvh * cap * d;
    const u32 nd = d / 32;
    float o[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    float m = NEG_INF_F, l = 0.0f;
    u32 kfirst = 0;
    if constexpr (RING) {
        const u32 win = window ? window : 0xffffffffu;
        kfirst = pos + 1 > win ? pos + 1 - win : 0u;
        if (sinks) {
            m = sinks[h] * PF_LOG2E;
            l = 1.0f;
        }
    }
    for (u32 kb = kfirst; kb <= pos; kb += 32) {
        u32 key = kb + lane;
        float sc = NEG_INF_F;
        if (key <= pos) {
            const uint4* kr = (const uint4*)(kbase + (u64)(RING && ring ? key % ring : key) * d);
            float dot = 0.0f;
            for (u32 c = 0; c < d / 8; ++c) {
                uint4 v = kr[c];
                const float* qq = &qs[warp][c * 8];
                dot += qq[0] * A::lo(v.x) + qq[1] * A::hi(v.x) + qq[2] * A::lo(v.y) + qq[3] * A::hi(v.y) +
                       qq[4] * A::lo(v.z) + qq[5] * A::hi(v.z) + qq[6] * A::lo(v.w) + qq[7] * A::hi(v.w);
            }
            sc = dot * sl2;
        }
        float mn = fmaxf(m, warp_max(sc));
        float al = exp2f(m - mn);
        float p = exp2f(sc - mn);
        l = l * al + warp_sum(p);
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] *= al;
        u32 nk = min(32u, pos + 1 - kb);
        for (u32 k2 = 0; k2 < nk; ++k2) {
            float pk = __shfl_sync(0xffffffffu, p, k2);
            const bf16_t* vr = vbase + (u64)(RING && ring ? (kb + k2) % ring : kb + k2) * d;
#pragma unroll
            for (int j = 0; j < 8; ++j)
                if ((u32)j < nd) o[j] += pk * A::load(vr[lane + 32 * j]);
        }
        m = mn;
    }
    float inv = 1.0f / l;
    bf16_t* orow = out + (u64)t * nq * d + (u64)h * d;
#pragma unroll
    for (int j = 0; j < 8; ++j)
        if ((u32)j < nd) orow[lane + 32 * j] = f2bf(o[j] * inv);
}

extern "C" __global__ void __launch_bounds__(128)
    attn_prefill_simt(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
                      bf16_t* __restrict__ out, u32 n_tokens, u32 start, u32 nq, u32 nkv, u32 cap, float sl2,
                      u32 d) {
    attn_prefill_simt_t<ActBf16, false>(qkv, kc, vc, out, n_tokens, start, nq, nkv, cap, sl2, d, nullptr, 0);
}

extern "C" __global__ void __launch_bounds__(128)
    attn_prefill_simt_ring(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ kc,
                           const bf16_t* __restrict__ vc, bf16_t* __restrict__ out, u32 n_tokens, u32 start, u32 nq,
                           u32 nkv, u32 cap, float sl2, u32 d, const float* __restrict__ sinks, u32 window,
                           u32 ring) {
    attn_prefill_simt_t<ActBf16, true>(qkv, kc, vc, out, n_tokens, start, nq, nkv, cap, sl2, d, sinks, window,
                                       ring);
}

// FP16 variants (ActFormat::F16, gpt-oss): the same templates with ActF16,
// so q, K and V are read as f16, the MMAs are m16n8k16 .f32.f16.f16.f32 and
// P is rounded to f16 for P V (10 mantissa bits to BF16's 7). P <= 1 after
// the max subtraction, so f16's range suffices: a probability below 2^-24
// rounds to 0 (subnormals below 2^-14 keep fewer bits), a change of at most
// 2^-25 against a row sum >= 1 (the row sums keep the f32 P). The output
// stays bf16 (o_proj's input). Every head dim and ring variant of the bf16 entry points, with
// the same launch shapes and shared memory (2 bytes per element), mirrored
// by the `_f16` names in ops/attention.rs.
extern "C" __global__ void __launch_bounds__(PF_THREADS)
    attn_prefill_mma_d64_f16(const f16_t* __restrict__ qkv, const f16_t* __restrict__ kc,
                             const f16_t* __restrict__ vc, bf16_t* __restrict__ out, u32 n_tokens, u32 start, u32 nq,
                             u32 nkv, u32 cap, float sl2) {
    attn_prefill_mma<ActF16, 64, 64, false, false>(qkv, kc, vc, out, n_tokens, start, nq, nkv, cap, sl2, nullptr, 0);
}

extern "C" __global__ void __launch_bounds__(PF_THREADS)
    attn_prefill_mma_d128_f16(const f16_t* __restrict__ qkv, const f16_t* __restrict__ kc,
                              const f16_t* __restrict__ vc, bf16_t* __restrict__ out, u32 n_tokens, u32 start,
                              u32 nq, u32 nkv, u32 cap, float sl2) {
    attn_prefill_mma<ActF16, 128, 64, false, false>(qkv, kc, vc, out, n_tokens, start, nq, nkv, cap, sl2, nullptr, 0);
}

extern "C" __global__ void __launch_bounds__(PF_THREADS)
    attn_prefill_mma_d256_f16(const f16_t* __restrict__ qkv, const f16_t* __restrict__ kc,
                              const f16_t* __restrict__ vc, bf16_t* __restrict__ out, u32 n_tokens, u32 start,
                              u32 nq, u32 nkv, u32 cap, float sl2) {
    attn_prefill_mma<ActF16, 256, 64, true, false>(qkv, kc, vc, out, n_tokens, start, nq, nkv, cap, sl2, nullptr, 0);
}

extern "C" __global__ void __launch_bounds__(PF_THREADS)
    attn_prefill_mma_ring_d64_f16(const f16_t* __restrict__ qkv, const f16_t* __restrict__ kc,
                                  const f16_t* __restrict__ vc, bf16_t* __restrict__ out, u32 n_tokens, u32 start,
                                  u32 nq, u32 nkv, u32 cap, float sl2, const float* __restrict__ sinks, u32 window,
                                  u32 ring) {
    attn_prefill_mma<ActF16, 64, 64, false, true>(qkv, kc, vc, out, n_tokens, start, nq, nkv, cap, sl2, sinks,
                                                  window, ring);
}

extern "C" __global__ void __launch_bounds__(PF_THREADS)
    attn_prefill_mma_ring_d128_f16(const f16_t* __restrict__ qkv, const f16_t* __restrict__ kc,
                                   const f16_t* __restrict__ vc, bf16_t* __restrict__ out, u32 n_tokens, u32 start,
                                   u32 nq, u32 nkv, u32 cap, float sl2, const float* __restrict__ sinks,
                                   u32 window, u32 ring) {
    attn_prefill_mma<ActF16, 128, 64, false, true>(qkv, kc, vc, out, n_tokens, start, nq, nkv, cap, sl2, sinks,
                                                   window, ring);
}

extern "C" __global__ void __launch_bounds__(128)
    attn_prefill_simt_f16(const f16_t* __restrict__ qkv, const f16_t* __restrict__ kc, const f16_t* __restrict__ vc,
                          bf16_t* __restrict__ out, u32 n_tokens, u32 start, u32 nq, u32 nkv, u32 cap, float sl2,
                          u32 d) {
    attn_prefill_simt_t<ActF16, false>(qkv, kc, vc, out, n_tokens, start, nq, nkv, cap, sl2, d, nullptr, 0);
}

extern "C" __global__ void __launch_bounds__(128)
    attn_prefill_simt_ring_f16(const f16_t* __restrict__ qkv, const f16_t* __restrict__ kc,
                               const f16_t* __restrict__ vc, bf16_t* __restrict__ out, u32 n_tokens, u32 start,
                               u32 nq, u32 nkv, u32 cap, float sl2, u32 d, const float* __restrict__ sinks,
                               u32 window, u32 ring) {
    attn_prefill_simt_t<ActF16, true>(qkv, kc, vc, out, n_tokens, start, nq, nkv, cap, sl2, d, sinks, window, ring);
}
