// BF16 weight GEMV on tensor cores, with the final RMSNorm fused: the decode
// LM head (M = 1..8 tokens). y[t, n] = sum_k normed[t, k] * W[n, k], W the
// [vocab, hidden] head, f32 accumulation, f32 output; normed is built from
// the f32 residual exactly as rmsnorm_f32 builds it (bit-identical) and one
// block writes it out.
//
// Why a second GEMV form, for one call site. gemv.cu's CUDA-core form
// converts each row's x and issues 8 FMAs per row for every 16-byte weight
// vector, so its work grows with the rows; at 8 rows its bucket keeps a
// guard per row and runs the LM head at 2.5x its one-row time (a3b's
// 151,936 x 2048: 145.3 -> 367.2 us on the H200, 208 -> 374 on an H100;
// gpt-oss's 201,088 x 2880: 0.267 -> 1.073 ms of a 10.4 ms 8-row step).
// Here one mma.sync.m16n8k16 multiplies 8 weight rows x 16 K by all 8 token
// slots, so the work per weight vector is the same for 1 and 8 rows: the
// LM head at 8 rows costs what it costs at one (219.6 against 209.4 us on
// an H100, kbench --rows). The small decode GEMVs (qkv, o_proj, router)
// stay on the CUDA-core form: on tensor cores they lost 0.5-1.4 us each at
// one row (three forms, sessions 6, 29, 30: at one row they are latency
// bound, and a chunk's dependent MMAs sit on the critical path), while the
// LM head, a long weight stream, loses ~1 us of ~145-210 (kbench --rows,
// session 29 H200, session 30 H100). Row invariance needs one form per call
// site, not one form for every GEMV: every LM head of the engine (decode
// rows and a prefill's last token) takes this one.
//
// MMA operands. B = the weights: tile of 8 output rows (n8) x 16 K; A = x:
// token slot g (< 8) in A row g, rows 8-15 zero (their C is dropped). The
// dot product does not care about the order of K as long as A and B agree,
// so a 32-K piece's two k16 steps take a lane's 16-byte vector's elements
// 0-3 and 4-7: logical k (2q, 2q+1) <- elements 4s, 4s+1 and (2q+8, 2q+9)
// <- 4s+2, 4s+3 of step s, in both operands (a0 = x.x / x.z, a2 = x.y /
// x.w, b0 = w.x / w.z, b1 = w.y / w.w). C: lane (g, q) holds token g's
// sums for tile rows 2q and 2q+1 (c0, c1). Each load instruction reads 128
// contiguous bytes of each of 4 rows (8 rows x 64 bytes streamed ~5%
// slower, session 29), and each chunk passes through the warp's own
// shared tile into the fragment layout, half a chunk at a time (16-byte
// stores, then the fragment reads; 64-byte row padding keeps both
// conflict free; 20 KB per block).
//
// Work split. Grid = min(N, 2 * SMs) blocks of 8 warps (__launch_bounds__
// (256, 2): <= 128 registers). Block b owns the contiguous rows [N*b/G,
// N*(b+1)/G), as T = ceil(rows / 8) tiles (the last one partial: its
// missing rows load nothing). K is cut into chunks of 256 (8 pieces, 4 KB
// of a tile: 8 loads of 16 bytes per lane; the last chunk may be partial,
// K a multiple of 8), and each tile into S = min(chunks, 32 / T) (>= 1)
// slices of consecutive chunks (the LM head of a real vocabulary: one
// slice of the whole K). Warp w takes units (tile, slice) w, w + 8, ...,
// chunk by chunk, with two chunks' loads in flight (64 registers), the
// first two before the prologue, so the first DRAM round trip overlaps it.
// A slice's sum accumulates on the tensor core in K order, as four
// interleaved chains (the two k16 steps of even 32-K pieces, and of odd
// ones), added in a fixed tree at the slice's end; with S > 1 the slices'
// sums go to shared memory and are added in slice order after a barrier.
//
// Row invariance (continuous batching): a token's sums are its own column
// of every MMA, whatever the other slots hold (zero or other tokens), over
// the same chunks, slices and order for every M (they depend on N, K and
// the grid only); kernels/tests/gpu/rows.rs checks every M <= 8 bit for bit
// against the one-row launch. The grid follows the SM count, so the last
// bits may differ between GPU models (as cuBLAS's do). How the tensor core
// adds a k16 step's products to the running f32 sum is not specified: the
// tests compare with an f64 reference within a K-scaled tolerance.
//
// x is staged once per block in shared memory (M rows of K / 8 vectors plus
// 4 vectors of padding), hence M*K <= 32768 (64 KB). The RMSNorm prologue
// is gemv.cu's: every block recomputes the sums of squares of the M rows
// with rmsnorm_f32's order and tree (block_sum_rows), so every block gets
// the same inv and x bit-identical to rmsnorm_f32's output. The prologue is
// the only part bucketed by M (MB = 1, 2, 4, 8 at compile time).
//
// Launch overlap (sm_90): launched as a programmatic dependent, as gemv.cu's
// kernels are (its header says why the early trigger is safe): a block
// triggers at once, issues its first two chunks' weight loads, then
// griddepcontrol.wait before it reads the residual or writes anything.

#define GEMV_WARPS 8
// Most (tile, slice) units of a block whose sums go through shared memory.
#define GEMV_UNITS 32
// K per chunk, and 16-byte vectors of a row per chunk.
#define GEMV_CHUNK 256
#define GEMV_CHUNK_V 32
// Padding of a staged x row, in 16-byte vectors.
#define GEMV_PAD_V 4

// One item of a warp's work: chunk c of unit u (tile u / S, slice u % S),
// whose slice ends before chunk e; r8 = the tile's first row.
struct GemvItem {
    u32 u, c, e, r8;
};

// One chunk's loads, as they stream best: load i (0..7) reads 128
// contiguous bytes of each of 4 rows, rows 4 (i & 1) + lane / 8 of the
// tile, vectors 8 (i >> 1) + lane % 8 of the chunk. Rows past the block's
// end and vectors past K are zero.
__device__ __forceinline__ void gemv_load_chunk(uint4* wv, const unsigned short* __restrict__ w, u32 r8, u32 r1,
                                                u32 c, u32 lane, u32 K, u32 V) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u32 row = r8 + 4 * (i & 1) + (lane >> 3);
        const u32 v = c * GEMV_CHUNK_V + 8 * (i >> 1) + (lane & 7);
        wv[i] = (row < r1 && v < V) ? ld_stream16(w + (u64)row * K + (u64)v * 8) : make_uint4(0, 0, 0, 0);
    }
}

// C += this chunk. The loaded vectors go through the warp's tile wt into
// the fragment layout, half a chunk (128 K) at a time: loads 4h..4h+3 are
// stored as [8 rows][16 vectors + GEMV_PAD_V], then lane (g, q) reads
// vector 4(j % 4) + q of row g for piece j of the half. Then token g's x vectors (zero for a slot past m or past K)
// against them, two k16 steps per vector into four accumulators (acc[0] /
// acc[1]: the two steps of even pieces, acc[2] / acc[3]: of odd ones), so
// a chunk is four chains of 4 dependent MMAs; summed once per unit.
template <class A>
__device__ __forceinline__ void gemv_mma_piece(float (*acc)[4], int j, const uint4 wf, const uint4* xrow, bool tok,
                                               u32 ch, u32 q, u32 V) {
    const u32 v = ch * GEMV_CHUNK_V + 4 * j + q;
    const uint4 xv = (tok && v < V) ? xrow[v] : make_uint4(0, 0, 0, 0);
    mma16<A>(acc[2 * (j & 1)], xv.x, 0u, xv.y, 0u, wf.x, wf.y);
    mma16<A>(acc[2 * (j & 1) + 1], xv.z, 0u, xv.w, 0u, wf.z, wf.w);
}

template <class A>
__device__ __forceinline__ void gemv_mma_chunk(float (*acc)[4], const uint4* wv, uint4* wt, const uint4* xrow, bool tok,
                                               u32 ch, u32 lane, u32 V) {
    constexpr u32 TS = GEMV_CHUNK_V / 2 + GEMV_PAD_V;
    const u32 gq = lane >> 2, q = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        __syncwarp();  // the previous half's fragment reads are done
#pragma unroll
        for (int i = 4 * h; i < 4 * h + 4; ++i)
            wt[(4 * (i & 1) + (lane >> 3)) * TS + 8 * ((i >> 1) & 1) + (lane & 7)] = wv[i];
        __syncwarp();
#pragma unroll
        for (int j = 4 * h; j < 4 * h + 4; ++j) gemv_mma_piece<A>(acc, j, wt[gq * TS + 4 * (j & 3) + q], xrow, tok, ch, q, V);
    }
}

// MB: compile-time bound on m (1, 2, 4, 8) for the prologue. x is built
// from the f32 residual and the bf16 norm weight g, exactly as gemv.cu's
// rmsnorm variant builds it. A: the format of w and normed (ActBf16).
template <int MB, class A = ActBf16>
__device__ __forceinline__ void gemv_body(const float* res, const bf16_t* __restrict__ g,
                                          float eps, const unsigned short* __restrict__ w, u32 m, u32 n, u32 K,
                                          u32 mode, unsigned short* normed, void* y) {
    extern __shared__ __align__(16) uint4 gemv_xs[];  // [m][K/8 + pad] vectors of 8 16-bit values
    __shared__ float scratch[MB * 32];
    __shared__ __align__(16) float2 gemv_part[GEMV_UNITS * 32];  // [unit][token][row pair]
    // Per warp: half a chunk of its tile, [8 rows][16 vectors + pad].
    __shared__ __align__(16) uint4 gemv_wt[GEMV_WARPS * 8 * (GEMV_CHUNK_V / 2 + GEMV_PAD_V)];
    pdl_trigger();
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 gq = lane >> 2, q = lane & 3;
    const u32 V = K >> 3, RS = V + GEMV_PAD_V;
    const u32 r0 = (u32)(((u64)n * blockIdx.x) / gridDim.x);
    const u32 r1 = (u32)(((u64)n * (blockIdx.x + 1)) / gridDim.x);
    const u32 T = (r1 - r0 + 7) >> 3;
    const u32 KC = (V + GEMV_CHUNK_V - 1) / GEMV_CHUNK_V;
    const u32 S = max(1u, min(KC, (u32)GEMV_UNITS / T));
    const u32 U = T * S;

    // The warp's items, in order: units u = warp + 8i, each its slice's
    // chunks [c, e). The divisions run once per unit, not per chunk.
    auto begin = [&](GemvItem& it, u32 u) {
        it.u = u;
        if (u < U) {
            const u32 sl = u % S;
            it.c = KC * sl / S;
            it.e = KC * (sl + 1) / S;
            it.r8 = r0 + (u / S) * 8;
        }
    };
    auto advance = [&](GemvItem& it) {
        if (it.u < U && ++it.c == it.e) begin(it, it.u + GEMV_WARPS);
    };
    auto load = [&](uint4* wv, const GemvItem& it) {
        if (it.u < U) gemv_load_chunk(wv, w, it.r8, r1, it.c, lane, K, V);
    };
    uint4 wa[8], wb[8];
    GemvItem a, b;
    begin(a, warp);
    b = a;
    advance(b);
    load(wa, a);
    load(wb, b);

    // Everything below may read what the previous kernel wrote.
    pdl_wait();
    gemv_norm_rows<MB, A>(res, g, eps, m, K, RS, gemv_xs, normed, scratch);
    __syncthreads();

    const bool tok = gq < m;
    const uint4* xrow = gemv_xs + (u64)min(gq, MB - 1u) * RS;
    uint4* const wt = gemv_wt + warp * 8 * (GEMV_CHUNK_V / 2 + GEMV_PAD_V);
    float acc[4][4] = {};
    // The unit (tile u / S, slice u % S) ends: its sums ((acc 0 + acc 1) +
    // (acc 2 + acc 3)) to shared memory (S > 1) or to y.
    auto finish = [&](u32 u) {
        const float s0 = (acc[0][0] + acc[1][0]) + (acc[2][0] + acc[3][0]);
        const float s1 = (acc[0][1] + acc[1][1]) + (acc[2][1] + acc[3][1]);
        if (S > 1) {
            gemv_part[u * 32 + lane] = make_float2(s0, s1);
        } else if (tok) {
            const u32 row = r0 + u * 8 + 2 * q;
            if (row < r1) gemv_store<A>(y, (u64)gq * n + row, s0, mode);
            if (row + 1 < r1) gemv_store<A>(y, (u64)gq * n + row + 1, s1, mode);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][e] = 0.0f;
    };
    // Two items per iteration, each buffer reloaded with the item two ahead
    // as soon as it is multiplied (static register indices).
    while (a.u < U) {  // warp-uniform
        gemv_mma_chunk<A>(acc, wa, wt, xrow, tok, a.c, lane, V);
        GemvItem an = b;  // a's next load: the item after b
        advance(an);
        if (a.c + 1 == a.e) finish(a.u);
        load(wa, an);
        if (b.u >= U) break;
        gemv_mma_chunk<A>(acc, wb, wt, xrow, tok, b.c, lane, V);
        GemvItem bn = an;  // b's next load: the item after that
        advance(bn);
        if (b.c + 1 == b.e) finish(b.u);
        load(wb, bn);
        a = an;
        b = bn;
    }
    if (S > 1) {
        __syncthreads();
        // Slice sums added in slice order, per (tile, token, row).
        const u32 outs = T * 8 * m;
        for (u32 i = threadIdx.x; i < outs; i += blockDim.x) {
            const u32 t = i / (8 * m), rem = i - t * 8 * m, tk = rem >> 3, r = rem & 7;
            const u32 row = r0 + t * 8 + r;
            if (row >= r1) continue;
            const float* p = (const float*)gemv_part + (t * S) * 64 + tk * 8 + r;
            // In slice order; four slices' loads in flight at a time.
            float s = p[0];
            u32 sl = 1;
            for (; sl + 4 <= S; sl += 4) {
                const float p0 = p[sl * 64], p1 = p[(sl + 1) * 64], p2 = p[(sl + 2) * 64], p3 = p[(sl + 3) * 64];
                s += p0;
                s += p1;
                s += p2;
                s += p3;
            }
            for (; sl < S; ++sl) s += p[sl * 64];
            gemv_store<A>(y, (u64)tk * n + row, s, mode);
        }
    }
}

// Entry points gemv_tc_rmsnorm_bf16_m<MB> (MB = the prologue's bucket: m =
// 1, 2, 3-4, 5-8). Dynamic shared memory: m * (K / 8 + 4) * 16 bytes.
#define GEMV_TC_ARGS                                                                                          \
    const float *res, const bf16_t *__restrict__ g, float eps, const bf16_t *__restrict__ w, u32 m, u32 n,   \
        u32 k, u32 mode, bf16_t *normed, void *y

extern "C" __global__ void __launch_bounds__(256, 2) gemv_tc_rmsnorm_bf16_m1(GEMV_TC_ARGS) {
    gemv_body<1>(res, g, eps, w, m, n, k, mode, normed, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_tc_rmsnorm_bf16_m2(GEMV_TC_ARGS) {
    gemv_body<2>(res, g, eps, w, m, n, k, mode, normed, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_tc_rmsnorm_bf16_m4(GEMV_TC_ARGS) {
    gemv_body<4>(res, g, eps, w, m, n, k, mode, normed, y);
}
extern "C" __global__ void __launch_bounds__(256, 2) gemv_tc_rmsnorm_bf16_m8(GEMV_TC_ARGS) {
    gemv_body<8>(res, g, eps, w, m, n, k, mode, normed, y);
}
