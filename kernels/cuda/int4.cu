// INT4 expert kernels (cache format v2 precision "int4", group g in
// {32, 64, 128}; g = 128 is format v1; see runtime/cache/src/layout.rs).
//
// Weights: w13_q [2I, H] and w2_q [H, I] nibble-packed row-major (element k
// of a row in byte k/2, low nibble for even k), f16 scales [rows, K/g],
// value (q - 8) * s, H and I multiples of g. One 16-byte load = 32
// consecutive K elements of a row, all inside one group (32 | g), so each
// load needs exactly one scale.
// Experts are found through a device pointer table: base = table[ids[p]]
// (bit 0 marks an expert HCS decode is still copying: the thread waits for
// the copy first, `table_entry` in common.cuh). An id past the table, a
// null or a misaligned base turns that pair's output into NaN instead of
// reading arbitrary memory.
//
// Decode GEMVs on tensor cores. A GEMV for one pair is memory bound, but
// the scalar nibble->f32 path costs ~4 ALU ops per weight (half of them on
// the half-rate integer pipe) and could not keep up with HBM. Instead a warp
// multiplies a 16-row x 128-K tile (one scale group, 1 KB of weights) with
// 8 mma.sync.m16n8k16 bf16 -> f32: lane (g = lane/4, tq = lane%4) loads 16
// bytes of rows g and g+8 (K = 32*tq..+32 of the group); each 32-bit word
// (8 nibbles) becomes 4 bf16x2 A registers by the 2^7 magic number
// (lop3(w >> 4j, 0x000F000F, 0x43004300) = 128 + q, one bf16x2 fma -> q - 8,
// exact), pairing nibbles j and j+4. The dot product is invariant under a
// permutation of K, so the activation (B operand) is stored permuted the
// same way, (x[j], x[j+4]) per 8-chunk. Products are exact, the sum is the
// tensor core's f32 accumulation; per group C is scaled (f32) and summed in
// group order. Only C column 0 is needed (every column holds the same x).
// All weight loads of a warp are issued first (16 bytes each, streamed past
// L1), so one launch keeps nearly the whole working set in flight.
//
// int4_w13_swiglu_<NCL>: decode gate/up GEMV + SwiGLU. Grid (I/16, pairs);
// block = ceil(H/128 / NCL) <= 8 warps for 16 gate rows i and the 16 up rows
// I+i of one pair (int4_w13_swiglu_<NCL>_r32, for several tokens: 32 and
// 32, grid (I/32, pairs), the same arithmetic per row), warp w owns scale
// groups [w*NCL, w*NCL+NCL) of K (split-K, NCL = ceil(H/1024)). x (an L2 hit) is loaded before the weights, which
// are issued in the order they are consumed, then staged in shared memory in
// the permuted layout; per-warp partials are summed in warp order, then
// silu(g) * u. Pair
// p = t*top_k + j runs only if bit j of slot_mask is set: a masked pair
// reads neither ids[p] nor its table entry and leaves act[p] untouched (the
// expert cache fills missing experts on demand).
// int4_w2_combine_<NCLI>: decode down GEMV fused with the router-weighted
// combine. Grid (H/16, tokens); one block covers 16 output rows of one token
// for all top_k experts: warp items (j, K-part of 2*NCLI groups); the _mt
// entry points take up to 4 tokens per block (w2_combine, MULTI; at g = 128
// the block's pairs grouped by expert, each expert's rows dequantized once
// for all its tokens: W2Groups). act is f32,
// so the block first stages it in shared memory as bf16 hi + lo (hi =
// bf16(a), lo = bf16(a - hi); 16 significant bits) in the permuted layout;
// even B columns carry hi, odd carry lo, so C col 0 + col 1 = W2 row . act.
// Partials [item][row] are reduced in (j, K-part) order, weighted, and added
// once to the f32 residual. No float atomics anywhere: bit-reproducible.
// Launch floor and overlap: an empty kernel costs ~1.2 us in a graph, and
// w2's ids -> table -> weights chain is latency bound, so on sm_90 the host
// launches w2 as a programmatic dependent (PDL) of w13: w13 lets it launch
// (pdl_trigger, common.cuh) once ids and the table are final (at its start
// after the tail's fetch; after its own wait when it follows the router
// top-k), w2 issues its weight loads, then pdl_wait before it touches act
// or res. w13 itself launches as a dependent too (of the router top-k all
// resident, of tail_fetch under HCS: see w13_swiglu).
// Groups below 128 and widths past 4096 / 2048 (the GEN entry points).
// The tile stays 16 rows x 128 K (4 lanes x 32 K), so with g < 128 one mma
// sums over ns = 128/g scale groups (lane tq's chunk is group tq*ns/4 of
// the tile) and a scale can no longer be applied to C afterwards. The 8 B
// columns, which the g = 128 path fills with copies of x, now separate the
// groups: lane (g', tq) zeroes its B registers unless its chunk's group is
// (g' >> 1) % ns, so C column c holds group (c >> 1) % ns only (w2 keeps
// hi in even, lo in odd columns). Lane tq < ns then owns group tq: its C
// columns 2tq, 2tq+1 are that group, it scales them with that group's
// scale (the other lanes with 0), and the 4 lanes of a quad are summed
// ((0+1)+(2+3)) after the K loop. Same loads, same mma count, a few selects
// and shuffles more. K need not be a multiple of 128 (gpt-oss: 2880 = 22.5
// tiles): the chunks past K load nothing and zero their B, their scales are
// 0. Widths: H up to 8192 (64 tiles) in blocks of up to 16 warps, keeping
// NCL <= 4 tiles per warp, i.e. the registers of the 8-warp NCL 3/4 entry
// points (128 at most, no spills); x in shared memory sized for 8192
// (20 KB). I up to 4096 in w2 with 8 tiles per work item (<= 64 items for
// top_k 16); its act staging, top_k * ceil(I/128) * 576 bytes, must fit the
// 227 KB a block may use on sm_90, so top_k 16 stops at I 3072 (the host
// refuses more). The g = 128 fast-path entry points are the same template
// with GEN = false, which compiles to the code they had before (checked:
// identical SASS), so the a3b decode is unaffected.
// int4_dequant_bf16: one thread per 16-byte chunk -> 32 bf16 (exact value
// (q-8)*s in f32, rounded once), for the prefill cuBLAS path; its scale is
// group (chunk >> gl), gl = log2(g / 32).
// FP16 MLP blocks (MlpSpec::activations = F16, glm4_moe): the _f16 entry
// points are the same templates with A = ActF16. int4_w13_swiglu_*_f16
// read an f16 x: the nibbles become f16x2 by the f16 magic number
// (0x6400 = 1024: 1024 + q, one f16x2 fma -> q - 8, exact), the mma is
// m16n8k16 .f32.f16.f16.f32; act stays f32 and int4_w2_combine (bf16
// hi/lo of the f32 act, format-free) serves both. int4_dequant_f16 rounds
// (q-8)*s once to f16 (past 65504: inf, which the sampler refuses). With
// A = ActBf16 every template compiles to the code the BF16 entry points had
// (checked: identical SASS).
// dq8, perm8 and expert_base are in int4_common.cuh (shared with the
// Hopper grouped GEMMs, int4_gemm_sm90.cu), which sources.rs puts first.
// Nibbles become floats with the 2^23 magic-number trick (exact).

#define MAGIC_F 8388608.0f  // 2^23

__device__ __forceinline__ float nib(u32 word, int shift) {
    return __uint_as_float(0x4B000000u | ((word >> shift) & 0xFu)) - (MAGIC_F + 8.0f);
}

// One 16-row x 128-K tile: qa/qb = this lane's 16 bytes of rows g / g+8,
// xv = the matching 32 permuted B values (4 x (x[j], x[j+4]) per 8-chunk)
// in format A. Returns C (c[0..1]: row g, cols 2tq..; c[2..3]: row g+8).
template <class A = ActBf16>
__device__ __forceinline__ void tile16(uint4 qa, uint4 qb, const uint4* xv, float* c) {
    const u32 wa[4] = {qa.x, qa.y, qa.z, qa.w};
    const u32 wb[4] = {qb.x, qb.y, qb.z, qb.w};
    c[0] = c[1] = c[2] = c[3] = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 pa[4], pb[4];
        dq8<A>(wa[i], pa);
        dq8<A>(wb[i], pb);
        mma16<A>(c, pa[0], pb[0], pa[1], pb[1], xv[i].x, xv[i].y);
        mma16<A>(c, pa[2], pb[2], pa[3], pb[3], xv[i].z, xv[i].w);
    }
}

// GEN paths: zero this lane's B registers unless `keep` (its chunk lies in
// the scale group its B column carries, and inside K).
__device__ __forceinline__ void mask_b(uint4* xv, bool keep) {
    if (!keep) {
#pragma unroll
        for (int i = 0; i < 4; ++i) xv[i] = make_uint4(0, 0, 0, 0);
    }
}

// Sum over the 4 lanes tq of a quad, in a fixed order ((0+1)+(2+3)).
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 1);
    return v + __shfl_xor_sync(0xFFFFFFFFu, v, 2);
}

// Shared x layout: 32-element chunk c32 (group G = c32/4, lane tq = c32%4)
// at u32 offset c32*20 (16 used + 4 pad: the 4 tq of a warp hit distinct banks).
#define XS_STRIDE 20

// GEN = false: the g = 128 fast path (H a multiple of 128, one scale per
// tile; the code the a3b decode was measured with). GEN = true: any group
// gl = log2(g / 32) and a partial last tile, as described in the header.
// A: the format of x (and of the dequantized weights in the mma).
// One pair per block (grid y = pair), at every row count: several pairs
// of one token per block (two register sets per warp, the next pair's
// loads in flight) measured no faster at 2-8 rows (kbench --rows: a3b 4
// rows 47.4 us one pair per block, 48.6 four): w13 at M rows reads the
// union of the rows' experts, and that byte count, not the grid, sets it.
// RT: 16-row tiles of gate (and of up) rows per block, 1 or 2 (the _r32
// entry points, g = 128 and NCL <= 2 only: their registers). A row's
// arithmetic does not depend on RT (same loads, same mma chain, partials
// summed in warp order), so RT is chosen per launch, by the row count.
template <int NCL, int MAXH, int MAXW, bool GEN, class A = ActBf16, int RT = 1>
__device__ __forceinline__ void w13_swiglu_body(const unsigned short* __restrict__ x, const u64* __restrict__ table,
                                                u32 n_table, const u32* __restrict__ ids, u32 n_pairs, u32 k, u32 H,
                                                u32 I, u64 oq, u64 os, u32 slot_mask, u32 wait_first, u32 gl,
                                                float* __restrict__ act) {
    __shared__ __align__(16) u32 xs[MAXH / 32 * XS_STRIDE];
    __shared__ float part[MAXW][32 * RT];
    static_assert(RT == 1 || (RT == 2 && !GEN && NCL <= 2), "two row tiles: fast path, NCL <= 2 only");
    // x chunks per thread: H/8 chunks over 32*ceil(H/128/NCL) threads.
    constexpr int XPRE = (NCL + 1) / 2;
    // Launch overlap (sm_90; the host launches this as a programmatic
    // dependent on every path). After the router top-k (all resident),
    // wait_first: ids and x come from the grids before it, so wait for them
    // first, and only then let our dependent (int4_w2_combine, which reads
    // ids and the table before its own wait) get scheduled. After the
    // tail's fetch, the lookup has completed before this grid could start
    // (tail_fetch waits for it before it lets dependents launch), so the
    // trigger comes at once and only threads that meet a fresh table entry
    // wait (table_entry), for the copy.
    if (wait_first) pdl_wait();
    pdl_trigger();
    const u32 p = blockIdx.y;
    if (p >= n_pairs) return;
    const u32 j = p % k, t = p / k;
    if (j >= 32 || ((slot_mask >> j) & 1u) == 0) return;  // block-uniform
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 g = lane >> 2, tq = lane & 3;
    const u32 nw = blockDim.x >> 5, ng = GEN ? (H + 127) / 128 : H / 128;
    // GEN: ns scale groups per tile, nsg per row, H / 32 valid 32-chunks.
    const u32 ns = GEN ? 4u >> gl : 1u, nsg = GEN ? H >> (5 + gl) : ng, nch = H / 32;
    const u32 i0 = blockIdx.x * 16 * RT;
    const unsigned char* base = expert_base(table, n_table, ids[p]);
    if (base == nullptr) {
        if (threadIdx.x < 16 * RT) act[(u64)p * I + i0 + threadIdx.x] = NAN_F;
        return;
    }
    const unsigned char* wq = base + oq;
    const f16_t* wsc = (const f16_t*)(base + os);
    const u64 rb = H / 2;
    // x first (an L2 hit that would otherwise queue behind the weights).
    const uint4* xrow = (const uint4*)(x + (u64)t * H);
    uint4 xpre[XPRE];
#pragma unroll
    for (int r = 0; r < XPRE; ++r) {
        const u32 c = threadIdx.x + r * blockDim.x;
        if (c < H / 8) xpre[r] = xrow[c];
    }
    // Then every weight and scale load of this warp, in the order they are
    // consumed below (group, then gate/up tile). Addresses are this lane's
    // first chunk and scale plus offsets that do not depend on the lane:
    // written per load as row * rb + ..., they cost 64-bit multiplies and
    // carries for each of the 16 loads (~1/3 of a warp's instructions went
    // to this prologue, session 20). Scales stay plain loads, not the
    // read-only path: under HCS the previous kernel may have just written
    // this slot (and __ldcg cost the one-token w2's 512-thread entry point
    // more spills).
    const unsigned char* wl = wq + (u64)(i0 + g) * rb + warp * NCL * 64 + tq * 16;
    const f16_t* sl = wsc + (u64)(i0 + g) * ng + warp * NCL;
    const u64 wt = (u64)I * rb, st = (u64)I * ng;  // the up tile's offsets
    // tile: gate (0) or up (1) rows; rt: which 16 of the block's rows.
    uint4 q[RT][2][NCL][2];
    f16_t sh[RT][2][NCL][2];
#pragma unroll
    for (int gg = 0; gg < NCL; ++gg)
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
            for (int tile = 0; tile < 2; ++tile)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const u32 G = warp * NCL + gg;
                    const u64 row = (u64)tile * I + i0 + g + 8 * h;  // GEN: RT = 1
                    if (G < ng && (!GEN || G * 4 + tq < nch)) {
                        q[rt][tile][gg][h] = ld_stream16(wl + (tile ? wt : 0) + (rt * 16 + h * 8) * rb + gg * 64);
                        if (!GEN) sh[rt][tile][gg][h] = sl[(tile ? st : 0) + (rt * 16 + h * 8) * ng + gg];
                    } else {
                        q[rt][tile][gg][h] = make_uint4(0, 0, 0, 0);
                        if (!GEN) sh[rt][tile][gg][h] = 0;
                    }
                    if (GEN) {  // the scale of the group this lane's C columns hold
                        const u32 sg = G * ns + tq;
                        sh[rt][tile][gg][h] = (G < ng && tq < ns && sg < nsg) ? wsc[row * nsg + sg] : (f16_t)0;
                    }
                }
    // Stage x permuted into shared memory (H/8 <= XPRE * blockDim chunks).
#pragma unroll
    for (int r = 0; r < XPRE; ++r) {
        const u32 c = threadIdx.x + r * blockDim.x;
        if (c < H / 8) *(uint4*)&xs[(c >> 2) * XS_STRIDE + (c & 3) * 4] = perm8(xpre[r]);
    }
    __syncthreads();
    float acc[RT][2][2];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int tile = 0; tile < 2; ++tile) acc[rt][tile][0] = acc[rt][tile][1] = 0.0f;
#pragma unroll
    for (int gg = 0; gg < NCL; ++gg) {
        const u32 G = warp * NCL + gg;
        if (G < ng) {  // warp-uniform
            const uint4* xp = (const uint4*)&xs[(G * 4 + tq) * XS_STRIDE];
            uint4 xv[4] = {xp[0], xp[1], xp[2], xp[3]};
            if (GEN) mask_b(xv, G * 4 + tq < nch && ((tq * ns) >> 2) == ((g >> 1) & (ns - 1)));
#pragma unroll
            for (int rt = 0; rt < RT; ++rt)
#pragma unroll
                for (int tile = 0; tile < 2; ++tile) {
                    float c[4];
                    tile16<A>(q[rt][tile][gg][0], q[rt][tile][gg][1], xv, c);
                    acc[rt][tile][0] += h2f(sh[rt][tile][gg][0]) * c[0];
                    acc[rt][tile][1] += h2f(sh[rt][tile][gg][1]) * c[2];
                }
        }
    }
    if (GEN) {  // lanes tq < ns hold one group each, the others 0
#pragma unroll
        for (int tile = 0; tile < 2; ++tile)
#pragma unroll
            for (int h = 0; h < 2; ++h) acc[0][tile][h] = quad_sum(acc[0][tile][h]);
    }
    // part[w][32 rt + r]: gate row 16 rt + r; [32 rt + 16 + r]: its up row.
    if (tq == 0) {
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
            part[warp][32 * rt + g] = acc[rt][0][0];
            part[warp][32 * rt + g + 8] = acc[rt][0][1];
            part[warp][32 * rt + 16 + g] = acc[rt][1][0];
            part[warp][32 * rt + 24 + g] = acc[rt][1][1];
        }
    }
    __syncthreads();
    if (threadIdx.x < 16 * RT) {
        const u32 r = threadIdx.x & 15, o = 32 * (threadIdx.x >> 4);
        float gs = 0.0f, us = 0.0f;
        for (u32 w = 0; w < nw; ++w) {
            gs += part[w][o + r];
            us += part[w][o + 16 + r];
        }
        act[(u64)p * I + i0 + threadIdx.x] = silu(gs) * us;
    }
}

// Block (0, 0) waits for the grid before it on its way out, whatever path
// it took. After the tail's fetch (wait_first 0) a block that meets no
// fresh entry never waits, so without this the grid could complete while
// the fetch still copies (when the prior's reload has since pointed the
// table away from the promoted slot: tail_home), and the kernels after it,
// all programmatic dependents, would no longer be ordered after the copy
// (the next lookup could reuse the fetch list or the slot). One block
// suffices (the grid completes when its last block does) and costs one
// slot: if every block waited, finished blocks would hold their slots until
// the copies end and the next wave of resident experts could not start,
// which is the overlap this mode exists for. (The act rows written before
// any wait in that mode were last read by the previous layer's w2, which
// completed before the lookup did.)
template <int NCL, int MAXH, int MAXW, bool GEN, class A = ActBf16, int RT = 1>
__device__ __forceinline__ void w13_swiglu(const unsigned short* __restrict__ x, const u64* __restrict__ table, u32 n_table,
                                           const u32* __restrict__ ids, u32 n_pairs, u32 k, u32 H, u32 I, u64 oq,
                                           u64 os, u32 slot_mask, u32 wait_first, u32 gl,
                                           float* __restrict__ act) {
    w13_swiglu_body<NCL, MAXH, MAXW, GEN, A, RT>(x, table, n_table, ids, n_pairs, k, H, I, oq, os, slot_mask,
                                                 wait_first, gl, act);
    if (blockIdx.x == 0 && blockIdx.y == 0) pdl_wait();
}

// The g = 128 fast path, one entry point per tiles-per-warp count
// (NCL = ceil(H / 1024), H <= 4096, <= 8 warps).
#define W13_ARGS                                                                                                 \
    const bf16_t *__restrict__ x, const u64 *__restrict__ table, u32 n_table, const u32 *__restrict__ ids,       \
        u32 n_pairs, u32 k, u32 H, u32 I, u64 oq, u64 os, u32 slot_mask, u32 wait_first
#define W13_PASS x, table, n_table, ids, n_pairs, k, H, I, oq, os, slot_mask, wait_first
extern "C" __global__ void __launch_bounds__(256, 3) int4_w13_swiglu_1(W13_ARGS, float* __restrict__ act) {
    w13_swiglu<1, 4096, 8, false>(W13_PASS, 0, act);
}
extern "C" __global__ void __launch_bounds__(256, 3) int4_w13_swiglu_2(W13_ARGS, float* __restrict__ act) {
    w13_swiglu<2, 4096, 8, false>(W13_PASS, 0, act);
}
extern "C" __global__ void __launch_bounds__(256, 2) int4_w13_swiglu_3(W13_ARGS, float* __restrict__ act) {
    w13_swiglu<3, 4096, 8, false>(W13_PASS, 0, act);
}
extern "C" __global__ void __launch_bounds__(256, 2) int4_w13_swiglu_4(W13_ARGS, float* __restrict__ act) {
    w13_swiglu<4, 4096, 8, false>(W13_PASS, 0, act);
}
// The same with 32 rows (two 16-row tiles) per block, for several tokens:
// the per-block work (pair lookup, x staging, reduction) serves twice the
// weights (NCL <= 2: H <= 2048).
extern "C" __global__ void __launch_bounds__(256, 2) int4_w13_swiglu_1_r32(W13_ARGS, float* __restrict__ act) {
    w13_swiglu<1, 4096, 8, false, ActBf16, 2>(W13_PASS, 0, act);
}
extern "C" __global__ void __launch_bounds__(256, 2) int4_w13_swiglu_2_r32(W13_ARGS, float* __restrict__ act) {
    w13_swiglu<2, 4096, 8, false, ActBf16, 2>(W13_PASS, 0, act);
}
// Any group (gl = log2(g / 32)), H <= 4096 in <= 8 warps: NCL = ceil(tiles / 8).
extern "C" __global__ void __launch_bounds__(256, 3) int4_w13_swiglu_g1(W13_ARGS, u32 gl, float* __restrict__ act) {
    w13_swiglu<1, 4096, 8, true>(W13_PASS, gl, act);
}
extern "C" __global__ void __launch_bounds__(256, 3) int4_w13_swiglu_g2(W13_ARGS, u32 gl, float* __restrict__ act) {
    w13_swiglu<2, 4096, 8, true>(W13_PASS, gl, act);
}
extern "C" __global__ void __launch_bounds__(256, 2) int4_w13_swiglu_g3(W13_ARGS, u32 gl, float* __restrict__ act) {
    w13_swiglu<3, 4096, 8, true>(W13_PASS, gl, act);
}
extern "C" __global__ void __launch_bounds__(256, 2) int4_w13_swiglu_g4(W13_ARGS, u32 gl, float* __restrict__ act) {
    w13_swiglu<4, 4096, 8, true>(W13_PASS, gl, act);
}
// Any group, 4096 < H <= 8192 in <= 16 warps: NCL = ceil(tiles / 16) in {3, 4},
// the same registers per thread as the 8-warp NCL 3/4 entry points.
extern "C" __global__ void __launch_bounds__(512, 1) int4_w13_swiglu_w16_3(W13_ARGS, u32 gl, float* __restrict__ act) {
    w13_swiglu<3, 8192, 16, true>(W13_PASS, gl, act);
}
extern "C" __global__ void __launch_bounds__(512, 1) int4_w13_swiglu_w16_4(W13_ARGS, u32 gl, float* __restrict__ act) {
    w13_swiglu<4, 8192, 16, true>(W13_PASS, gl, act);
}

// The same with an f16 x (FP16 MLP blocks): <name>_f16.
extern "C" __global__ void __launch_bounds__(256, 3) int4_w13_swiglu_1_f16(W13_ARGS, float* __restrict__ act) {
    w13_swiglu<1, 4096, 8, false, ActF16>(W13_PASS, 0, act);
}
extern "C" __global__ void __launch_bounds__(256, 3) int4_w13_swiglu_2_f16(W13_ARGS, float* __restrict__ act) {
    w13_swiglu<2, 4096, 8, false, ActF16>(W13_PASS, 0, act);
}
extern "C" __global__ void __launch_bounds__(256, 2) int4_w13_swiglu_3_f16(W13_ARGS, float* __restrict__ act) {
    w13_swiglu<3, 4096, 8, false, ActF16>(W13_PASS, 0, act);
}
extern "C" __global__ void __launch_bounds__(256, 2) int4_w13_swiglu_4_f16(W13_ARGS, float* __restrict__ act) {
    w13_swiglu<4, 4096, 8, false, ActF16>(W13_PASS, 0, act);
}
extern "C" __global__ void __launch_bounds__(256, 2) int4_w13_swiglu_1_r32_f16(W13_ARGS, float* __restrict__ act) {
    w13_swiglu<1, 4096, 8, false, ActF16, 2>(W13_PASS, 0, act);
}
extern "C" __global__ void __launch_bounds__(256, 2) int4_w13_swiglu_2_r32_f16(W13_ARGS, float* __restrict__ act) {
    w13_swiglu<2, 4096, 8, false, ActF16, 2>(W13_PASS, 0, act);
}
extern "C" __global__ void __launch_bounds__(256, 3)
    int4_w13_swiglu_g1_f16(W13_ARGS, u32 gl, float* __restrict__ act) {
    w13_swiglu<1, 4096, 8, true, ActF16>(W13_PASS, gl, act);
}
extern "C" __global__ void __launch_bounds__(256, 3)
    int4_w13_swiglu_g2_f16(W13_ARGS, u32 gl, float* __restrict__ act) {
    w13_swiglu<2, 4096, 8, true, ActF16>(W13_PASS, gl, act);
}
extern "C" __global__ void __launch_bounds__(256, 2)
    int4_w13_swiglu_g3_f16(W13_ARGS, u32 gl, float* __restrict__ act) {
    w13_swiglu<3, 4096, 8, true, ActF16>(W13_PASS, gl, act);
}
extern "C" __global__ void __launch_bounds__(256, 2)
    int4_w13_swiglu_g4_f16(W13_ARGS, u32 gl, float* __restrict__ act) {
    w13_swiglu<4, 4096, 8, true, ActF16>(W13_PASS, gl, act);
}
extern "C" __global__ void __launch_bounds__(512, 1)
    int4_w13_swiglu_w16_3_f16(W13_ARGS, u32 gl, float* __restrict__ act) {
    w13_swiglu<3, 8192, 16, true, ActF16>(W13_PASS, gl, act);
}
extern "C" __global__ void __launch_bounds__(512, 1)
    int4_w13_swiglu_w16_4_f16(W13_ARGS, u32 gl, float* __restrict__ act) {
    w13_swiglu<4, 8192, 16, true, ActF16>(W13_PASS, gl, act);
}

// Shared act layout (dynamic): for (j, group G, lane tq) a block of
// AS_STRIDE u32 at ((j*ng + G)*4 + tq)*AS_STRIDE: 16 hi pairs, 16 lo pairs,
// 4 pad (the 8 (tq, hi/lo) reads of a warp hit distinct banks).
#define AS_STRIDE 36
#define W2_MAX_ITEMS 64

// One warp's share of one w2 work item (expert j, K-part kp): GPW scale
// groups x rows g / g+8, with their scales; valid = the expert was found.
template <int GPW>
struct W2Regs {
    uint4 q[GPW][2];
    f16_t sh[GPW][2];
    bool valid;
};

struct W2Geo {
    u32 g, tq, ng, ns, nsg, nch, nkp, n0;
    u64 rb, oq, os;
};

template <int GPW, bool GEN>
__device__ __forceinline__ W2Geo w2_geo(u32 I, u64 oq, u64 os, u32 gl) {
    W2Geo e;
    const u32 lane = threadIdx.x & 31;
    e.g = lane >> 2;
    e.tq = lane & 3;
    e.ng = GEN ? (I + 127) / 128 : I / 128;
    e.ns = GEN ? 4u >> gl : 1u;
    e.nsg = GEN ? I >> (5 + gl) : e.ng;
    e.nch = I / 32;
    e.nkp = (e.ng + GPW - 1) / GPW;
    e.n0 = blockIdx.x * 16;
    e.rb = I / 2;
    e.oq = oq;
    e.os = os;
    return e;
}

// Issue the weight and scale loads of K-part kp of the expert at `base`.
template <int GPW, bool GEN>
__device__ __forceinline__ void w2_load(W2Regs<GPW>& r, const unsigned char* base, u32 kp, const W2Geo& e) {
    r.valid = base != nullptr;
    const unsigned char* wq = base + e.oq;
    const f16_t* wsc = (const f16_t*)(base + e.os);
    // This lane's first chunk and scale of the item, plus lane-free offsets
    // (as w13's prologue).
    const unsigned char* wl = wq + (u64)(e.n0 + e.g) * e.rb + kp * GPW * 64 + e.tq * 16;
    const f16_t* sl = wsc + (u64)(e.n0 + e.g) * e.ng + kp * GPW;
#pragma unroll
    for (int gg = 0; gg < GPW; ++gg)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u32 G = kp * GPW + gg;
            const u64 row = e.n0 + e.g + 8 * h;
            if (r.valid && G < e.ng && (!GEN || G * 4 + e.tq < e.nch)) {
                r.q[gg][h] = ld_stream16(wl + h * 8 * e.rb + gg * 64);
                if (!GEN) r.sh[gg][h] = sl[h * 8 * e.ng + gg];
            } else {
                r.q[gg][h] = make_uint4(0, 0, 0, 0);
                if (!GEN) r.sh[gg][h] = 0;
            }
            if (GEN) {
                const u32 sg = G * e.ns + e.tq;
                r.sh[gg][h] = (r.valid && G < e.ng && e.tq < e.ns && sg < e.nsg) ? wsc[row * e.nsg + sg] : (f16_t)0;
            }
        }
}

// One work item's partial of the 16 rows into prow[0..16) (as_: the token's
// staged act).
template <int GPW, bool GEN>
__device__ __forceinline__ void w2_item(const W2Regs<GPW>& r, const u32* as_, u32 j, u32 kp, const W2Geo& e,
                                        float* prow) {
    float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
    for (int gg = 0; gg < GPW; ++gg) {
        const u32 G = kp * GPW + gg;
        if (G < e.ng) {
            const uint4* xp = (const uint4*)(as_ + ((j * e.ng + G) * 4 + e.tq) * AS_STRIDE + (e.g & 1) * 16);
            uint4 xv[4] = {xp[0], xp[1], xp[2], xp[3]};
            if (GEN) mask_b(xv, G * 4 + e.tq < e.nch && ((e.tq * e.ns) >> 2) == ((e.g >> 1) & (e.ns - 1)));
            float c[4];
            tile16(r.q[gg][0], r.q[gg][1], xv, c);
            acc0 += h2f(r.sh[gg][0]) * (c[0] + c[1]);
            acc1 += h2f(r.sh[gg][1]) * (c[2] + c[3]);
        }
    }
    if (GEN) {
        acc0 = quad_sum(acc0);
        acc1 = quad_sum(acc1);
    }
    if (!r.valid) acc0 = acc1 = NAN_F;
    if (e.tq == 0) {
        prow[e.g] = acc0;
        prow[e.g + 8] = acc1;
    }
}

// Stage the act rows of tokens [t0, t0 + nt) (top_k rows each) as permuted
// bf16 hi/lo pairs, token tl at as_ + tl * tok_u32; B chunks per thread
// are loaded before any is stored (B = 4 for several tokens; 1 keeps the
// one-token kernel's registers).
template <int B>
__device__ __forceinline__ void w2_stage(const float* __restrict__ act, u32* as_, u32 t0, u32 nt, u32 k, u32 I,
                                         u32 ng, u32 tok_u32) {
    const u32 cpr = I / 8;  // 8-chunks per row
    const u32 total = nt * k * cpr;
    for (u32 c0 = threadIdx.x; c0 < total; c0 += B * blockDim.x) {
        float4 u[B], v[B];
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const u32 c = c0 + b * blockDim.x;
            if (c < total) {
                const u32 row = c / cpr, c8 = c % cpr;  // row = tl * k + j
                const float4* a4 = (const float4*)(act + ((u64)t0 * k + row) * I + (u64)c8 * 8);
                u[b] = a4[0];
                v[b] = a4[1];
            }
        }
#pragma unroll
        for (int b = 0; b < B; ++b) {
            const u32 c = c0 + b * blockDim.x;
            if (c < total) {
                const u32 row = c / cpr, c8 = c % cpr, tl = row / k, j = row % k;
                const float lo_[4] = {u[b].x, u[b].y, u[b].z, u[b].w}, hi_[4] = {v[b].x, v[b].y, v[b].z, v[b].w};
                u32 hv[4], lv[4];
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    hv[q] = pack_bf2(lo_[q], hi_[q]);
                    lv[q] = pack_bf2(lo_[q] - bf_lo(hv[q]), hi_[q] - bf_hi(hv[q]));
                }
                u32* dst = as_ + tl * tok_u32 + ((j * ng + c8 / 16) * 4 + (c8 % 16) / 4) * AS_STRIDE + (c8 % 4) * 4;
                *(uint4*)dst = make_uint4(hv[0], hv[1], hv[2], hv[3]);
                *(uint4*)(dst + 16) = make_uint4(lv[0], lv[1], lv[2], lv[3]);
            }
        }
    }
}

// Work item i of a w2 block = (tl * top_k + j) * nkp + kp: token tl of
// the block, expert j, K-part kp, kept as its digits in one register,
// tl << 16 | j << 8 | kp (each < 256: nkp <= 32, top_k <= 16, tl < 4).
// A warp of a several-tokens block walks items i, i + nw, ...; stepping
// the digits (one conditional carry each: the step's digits are below
// their radices) replaces the ~8 runtime divisions per item that decoding
// i took (406 of int4_w2_combine_1_mt's 1,984 instructions were IMAD,
// session 20). One register, not four: the 4-digit form spilled on sm_120.
__device__ __forceinline__ u32 w2_pos(u32 i, u32 items, u32 nkp) {
    return (i / items) << 16 | ((i % items) / nkp) << 8 | (i % nkp);
}
__device__ __forceinline__ u32 w2_next(u32 p, u32 step, u32 k, u32 nkp) {
    p += step;  // digit-wise: kp < 2 nkp, j < 2 k, no carry between bytes
    if ((p & 0xFFu) >= nkp) p += (1u << 8) - nkp;
    if (((p >> 8) & 0xFFu) >= k) p += (1u << 16) - (k << 8);
    return p;
}
__device__ __forceinline__ u32 w2_tl(u32 p) { return p >> 16; }
__device__ __forceinline__ u32 w2_j(u32 p) { return (p >> 8) & 0xFFu; }
__device__ __forceinline__ u32 w2_kp(u32 p) { return p & 0xFFu; }

// Row n of token t: the items' partials (part[j * nkp + kp][r]) summed over
// kp, weighted, summed over j in order, added once to the residual.
__device__ __forceinline__ void w2_out(float (*part)[16], const float* __restrict__ w, u32 t, u32 k, u32 nkp, u32 r,
                                       u32 n, u32 H, float* __restrict__ res) {
    float sum = 0.0f;
    for (u32 j = 0; j < k; ++j) {
        float e = 0.0f;
        for (u32 kp = 0; kp < nkp; ++kp) e += part[j * nkp + kp][r];
        sum += w[(u64)t * k + j] * e;
    }
    res[(u64)t * H + n] += sum;
}

// Several tokens, g = 128 (SHARE): the block's pairs grouped by expert.
// A pair is (token tl, slot j), coded tl << 4 | j (j < 16, tl < 4). An
// expert routed from m tokens of the block is one group of m members in
// token order (m <= 4: a token routes to an expert at most once; see
// w2_group for repeated ids); its
// work items (group, K-part) load and dequantize the expert's 16 rows once
// and multiply them with every member's act at once: the mma's 8 B columns
// are 4 (hi, lo) pairs, member c in columns 2c and 2c + 1, where one token
// alone fills all four pairs with copies of its act. An output element of
// the mma depends on its A row and its B column only, so each member's
// partial has the bits of its own item (the rows:: tests compare every
// token of an M-token launch with its launch alone). At 4 rows a3b-24l's
// last MoE layer routes its 32 pairs to 18 experts (session 28), so a
// block's items fall from 96 to ~54 there; w2 at M rows was issue bound
// (session 20), its instructions per item unchanged by the grouping.
#define W2_MAX_PAIRS 64
struct W2Groups {
    unsigned char mem[W2_MAX_PAIRS][4];  // members' pair codes
    unsigned char nmem[W2_MAX_PAIRS];
    u32 n;                               // groups
};

// The block's groups, in static shared memory only where SHARE uses them.
__device__ __forceinline__ W2Groups* w2_groups_smem() {
    __shared__ W2Groups g;
    return &g;
}

// Groups the nt * k pairs whose ids are ids_s[tl * k + j] (warp 0; the
// caller syncs after): pairs of one id in pair order, four to a group (a
// well-formed route has at most one per token; more only from repeated
// ids, which then take several groups). Group leaders are the pairs whose
// rank among their id's pairs is a multiple of 4; groups are numbered in
// leader order.
__device__ __forceinline__ void w2_group(const u32* ids_s, u32 nt, u32 k, W2Groups& gr) {
    const u32 lane = threadIdx.x & 31, np = nt * k;
    u32 lead[2], rank[2] = {0, 0}, first[2] = {0, 0}, size[2] = {0, 0};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 p = lane + 32 * h;
        if (p < np) {
            // One pass over the id's pairs: p's rank r, their count n, and
            // its leader f, the last pair up to p whose rank is a multiple
            // of 4 (the one of rank 4 * (r / 4)).
            const u32 id = ids_s[p];
            u32 r = 0, n = 0, f = p;
            for (u32 q = 0; q < np; ++q) {
                if (ids_s[q] != id) continue;
                if (q <= p && (n & 3u) == 0) f = q;
                r += q < p;
                ++n;
            }
            rank[h] = r;
            first[h] = f;
            size[h] = min(n - (r & ~3u), 4u);
        }
        lead[h] = __ballot_sync(0xFFFFFFFFu, p < np && (rank[h] & 3u) == 0);
    }
    // Group of the pair led by q: the leaders before q.
    auto group_of = [&](u32 q) {
        return q < 32 ? __popc(lead[0] & ((1u << q) - 1u)) : __popc(lead[0]) + __popc(lead[1] & ((1u << (q - 32)) - 1u));
    };
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 p = lane + 32 * h;
        if (p < np) {
            const u32 d = group_of(first[h]);
            gr.mem[d][rank[h] & 3u] = (unsigned char)((p / k) << 4 | (p % k));
            if ((rank[h] & 3u) == 0) gr.nmem[d] = (unsigned char)size[h];
        }
    }
    if (lane == 0) gr.n = __popc(lead[0]) + __popc(lead[1]);
}

// One shared work item (group d, K-part kp): the group's expert's loads in
// r, each member's partial of the 16 rows into part[(tl * k + j) * nkp + kp].
template <int GPW>
__device__ __forceinline__ void w2_item_shared(const W2Regs<GPW>& r, const u32* as_, u32 tok_u32, const W2Groups& gr,
                                               u32 d, u32 kp, u32 k, const W2Geo& e, float (*part)[16]) {
    const u32 nm = gr.nmem[d], m = e.g >> 1;
    const u32 mc = gr.mem[d][m < nm ? m : 0];
    const u32* arow = as_ + (mc >> 4) * tok_u32 + (mc & 15) * e.ng * 4 * AS_STRIDE + (e.g & 1) * 16;
    float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
    for (int gg = 0; gg < GPW; ++gg) {
        const u32 G = kp * GPW + gg;
        if (G < e.ng) {
            const uint4* xp = (const uint4*)(arow + (G * 4 + e.tq) * AS_STRIDE);
            uint4 xv[4] = {xp[0], xp[1], xp[2], xp[3]};
            mask_b(xv, m < nm);
            float c[4];
            tile16(r.q[gg][0], r.q[gg][1], xv, c);
            acc0 += h2f(r.sh[gg][0]) * (c[0] + c[1]);
            acc1 += h2f(r.sh[gg][1]) * (c[2] + c[3]);
        }
    }
    if (!r.valid) acc0 = acc1 = NAN_F;
    if (e.tq < nm) {  // lane tq holds member tq's columns
        const u32 mt = gr.mem[d][e.tq];
        float* prow = part[((mt >> 4) * k + (mt & 15)) * e.nkp + kp];
        prow[e.g] = acc0;
        prow[e.g + 8] = acc1;
    }
}

// Grid (H/16, ceil(tokens / tpb)): block y takes tokens [y * tpb, + tpb),
// warps take work items (token, expert j, K-part) round robin. tpb = 1 is
// the one-token decode; with tpb > 1 (a batched step, MULTI) a warp
// issues its next item's loads before it multiplies the current one (two
// register sets), and the partials live in dynamic shared memory after
// the staged act. One token per block made 4 rows 512 blocks of 24 warps
// in four latency-bound waves (w2 3.1x the one-row time); the arithmetic
// of every item and every output row is the same either way.
template <int GPW, bool GEN, bool MULTI>
__device__ __forceinline__ void w2_combine(const float* __restrict__ act, const u64* __restrict__ table, u32 n_table,
                                           const u32* __restrict__ ids, const float* __restrict__ w, u32 n_tokens,
                                           u32 k, u32 H, u32 I, u64 oq, u64 os, u32 gl, u32 tpb,
                                           float* __restrict__ res) {
    constexpr bool SHARE = MULTI && !GEN;
    extern __shared__ __align__(16) u32 as_[];
    __shared__ float part_s[MULTI ? 1 : W2_MAX_ITEMS][16];
    const u32 t0 = blockIdx.y * tpb;
    if (t0 >= n_tokens) return;
    const u32 nt = MULTI ? min(tpb, n_tokens - t0) : 1u;
    const u32 warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const W2Geo e = w2_geo<GPW, GEN>(I, oq, os, gl);
    const u32 items = k * e.nkp, total = nt * items;
    const u32 tok_u32 = k * e.ng * 4 * AS_STRIDE;
    float(*part)[16] = MULTI ? (float(*)[16])(as_ + nt * tok_u32) : part_s;
    // Several tokens: the block's expert bases (nt * k <= 64) are looked up
    // once, up front. Looked up per item, each of a warp's items waited on
    // its ids -> table round trips before its weight loads could go out,
    // with the previous item's multiply queued behind that wait.
    // entries_s[tl][j] (tl < 4, j < k <= 16) holds the raw table entry
    // (0 past the table); expert_base's checks, the wait on a fresh entry
    // among them, stay with the warp that uses it.
    __shared__ u64 entries_s[MULTI ? 4 * 16 : 1];
    __shared__ u32 ids_s[SHARE ? W2_MAX_PAIRS : 1];
    W2Groups* gr = nullptr;
    if (MULTI) {
        if (threadIdx.x < nt * k) {
            const u32 tl = threadIdx.x / k, j = threadIdx.x % k, id = ids[(u64)t0 * k + threadIdx.x];
            entries_s[tl * 16 + j] = id < n_table ? table[id] : 0;
            if (SHARE) ids_s[threadIdx.x] = id;
        }
        __syncthreads();
        if constexpr (SHARE) {
            gr = w2_groups_smem();
            if (warp == 0) w2_group(ids_s, nt, k, *gr);
            __syncthreads();
        }
    }
    auto base_of = [&](u32 p) {
        if (MULTI) return expert_base(&entries_s[w2_tl(p) * 16 + w2_j(p)], 1, 0);
        return expert_base(table, n_table, ids[(u64)(t0 + w2_tl(p)) * k + w2_j(p)]);
    };
    // SHARE: an item is group d, K-part kp, coded d << 8 | kp, stepped as
    // w2_next steps its digits (no carry out of d: groups < 256).
    const u32 ng_items = SHARE ? gr->n : 0;
    auto sh_first = [&](u32 i) { return (i / e.nkp) << 8 | (i % e.nkp); };
    auto sh_next = [&](u32 p, u32 step) {
        p += step;
        if ((p & 0xFFu) >= e.nkp) p += (1u << 8) - e.nkp;
        return p;
    };
    auto sh_base = [&](u32 p) {
        const u32 c = gr->mem[p >> 8][0];
        return expert_base(&entries_s[(c >> 4) * 16 + (c & 15)], 1, 0);
    };

    W2Regs<GPW> ra, rb;
    u32 pa = SHARE ? sh_first(warp) : w2_pos(warp, items, e.nkp);
    if constexpr (SHARE) {
        if ((pa >> 8) < ng_items) w2_load<GPW, GEN>(ra, sh_base(pa), pa & 0xFFu, e);
    } else {
        if (w2_tl(pa) < nt) w2_load<GPW, GEN>(ra, base_of(pa), w2_kp(pa), e);
    }
    // Launched as a programmatic dependent on sm_90: everything above (ids,
    // table, weights) was ready before the previous kernel started (a
    // fresh expert's loads waited, `table_entry`); act and res are touched
    // only after that kernel has completed.
    pdl_wait();
    w2_stage<MULTI ? 4 : 1>(act, as_, t0, nt, k, I, e.ng, tok_u32);
    __syncthreads();
    auto run = [&](const W2Regs<GPW>& r, u32 p) {
        const u32 tl = w2_tl(p), j = w2_j(p), kp = w2_kp(p);
        w2_item<GPW, GEN>(r, as_ + tl * tok_u32, j, kp, e, part[(tl * k + j) * e.nkp + kp]);
    };
    if constexpr (SHARE) {
        const u32 step = sh_first(nw);
        auto run_sh = [&](const W2Regs<GPW>& r, u32 p) {
            w2_item_shared<GPW>(r, as_, tok_u32, *gr, p >> 8, p & 0xFFu, k, e, part);
        };
        while ((pa >> 8) < ng_items) {  // warp-uniform; two items per pass, static registers
            const u32 pb = sh_next(pa, step);
            if ((pb >> 8) < ng_items) w2_load<GPW, GEN>(rb, sh_base(pb), pb & 0xFFu, e);
            run_sh(ra, pa);
            if ((pb >> 8) >= ng_items) break;
            const u32 pc = sh_next(pb, step);
            if ((pc >> 8) < ng_items) w2_load<GPW, GEN>(ra, sh_base(pc), pc & 0xFFu, e);
            run_sh(rb, pb);
            pa = pc;
        }
    } else if (MULTI) {
        const u32 step = w2_pos(nw, items, e.nkp);
        while (w2_tl(pa) < nt) {  // warp-uniform; two items per pass, static registers
            const u32 pb = w2_next(pa, step, k, e.nkp);
            if (w2_tl(pb) < nt) w2_load<GPW, GEN>(rb, base_of(pb), w2_kp(pb), e);
            run(ra, pa);
            if (w2_tl(pb) >= nt) break;
            const u32 pc = w2_next(pb, step, k, e.nkp);
            if (w2_tl(pc) < nt) w2_load<GPW, GEN>(ra, base_of(pc), w2_kp(pc), e);
            run(rb, pb);
            pa = pc;
        }
    } else {
        // One token (nt = 1, a warp has 1-3 items): the item is decoded.
        for (u32 it = warp; it < total; it += nw) {  // warp-uniform
            run(ra, pa);
            pa = w2_pos(it + nw, items, e.nkp);
            if (it + nw < total) w2_load<GPW, GEN>(ra, base_of(pa), w2_kp(pa), e);
        }
    }
    __syncthreads();
    if (threadIdx.x < 16 * nt) {
        const u32 tl = threadIdx.x >> 4, r = threadIdx.x & 15;
        w2_out(part + tl * items, w, t0 + tl, k, e.nkp, r, e.n0 + r, H, res);
    }
}

// The g = 128 fast path, one entry point per chunk count (NCLI =
// ceil(I / 1024), I <= 2048); each work item covers 2*NCLI scale groups, so
// a block has <= 64 items.
#define W2_ARGS                                                                                                  \
    const float *__restrict__ act, const u64 *__restrict__ table, u32 n_table, const u32 *__restrict__ ids,      \
        const float *__restrict__ w, u32 n_tokens, u32 k, u32 H, u32 I, u64 oq, u64 os
#define W2_PASS act, table, n_table, ids, w, n_tokens, k, H, I, oq, os
extern "C" __global__ void __launch_bounds__(768) int4_w2_combine_1(W2_ARGS, float* __restrict__ res) {
    w2_combine<2, false, false>(W2_PASS, 0, 1, res);
}
extern "C" __global__ void __launch_bounds__(512, 2) int4_w2_combine_2(W2_ARGS, float* __restrict__ res) {
    w2_combine<4, false, false>(W2_PASS, 0, 1, res);
}
// Any group (gl = log2(g / 32)) and a partial last tile: tiles = ceil(I / 128)
// <= 8, 16, 32 with 2, 4, 8 tiles per item (still <= 64 items for top_k 16).
extern "C" __global__ void __launch_bounds__(768) int4_w2_combine_g1(W2_ARGS, u32 gl, float* __restrict__ res) {
    w2_combine<2, true, false>(W2_PASS, gl, 1, res);
}
extern "C" __global__ void __launch_bounds__(512) int4_w2_combine_g2(W2_ARGS, u32 gl, float* __restrict__ res) {
    w2_combine<4, true, false>(W2_PASS, gl, 1, res);
}
extern "C" __global__ void __launch_bounds__(512) int4_w2_combine_g3(W2_ARGS, u32 gl, float* __restrict__ res) {
    w2_combine<8, true, false>(W2_PASS, gl, 1, res);
}
// Several tokens per block (tpb, MULTI): <name>_mt, I <= 1024 (2-tile
// items). Measured (kbench --rows, H200): a3b at 4 rows 47.4 -> 38.4 us
// for w13 + w2; GLM-4.5-Air's I = 1408 (4-tile items) lost (129 -> 138 us:
// two register sets leave one block per SM), so it keeps one token per
// block. The
// dynamic shared memory holds tpb tokens' act and their partials.
#define W2_MT_ARGS W2_ARGS, u32 gl, u32 tpb, float *__restrict__ res
#define W2_MT_PASS W2_PASS, gl, tpb, res
extern "C" __global__ void __launch_bounds__(768) int4_w2_combine_1_mt(W2_MT_ARGS) {
    w2_combine<2, false, true>(W2_MT_PASS);
}
extern "C" __global__ void __launch_bounds__(768) int4_w2_combine_g1_mt(W2_MT_ARGS) {
    w2_combine<2, true, true>(W2_MT_PASS);
}

// O: the output format (the MLP block's).
template <class O>
__device__ __forceinline__ void int4_dequant(const u64* __restrict__ table, u32 n_table, const u32* __restrict__ ids,
                                             u32 n, u32 H, u32 I, u32 gl, u64 o13q, u64 o13s, u64 o2q, u64 o2s,
                                             unsigned short* __restrict__ w13_out, unsigned short* __restrict__ w2_out) {
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
    unsigned short* dst;
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
        const u32 nn = O::F16 ? 0x7e007e00u : 0x7fc07fc0u;  // NaN pairs
        for (int v = 0; v < 4; ++v) o[v] = make_uint4(nn, nn, nn, nn);
        return;
    }
    const uint4 qv = ld_stream16(q + row * (K / 2) + c * 16);
    const float s = h2f(sc[row * (K >> (5 + gl)) + (c >> gl)]);
    const u32 w[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        uint4 r;
        r.x = O::pack2(nib(w[i], 0) * s, nib(w[i], 4) * s);
        r.y = O::pack2(nib(w[i], 8) * s, nib(w[i], 12) * s);
        r.z = O::pack2(nib(w[i], 16) * s, nib(w[i], 20) * s);
        r.w = O::pack2(nib(w[i], 24) * s, nib(w[i], 28) * s);
        o[i] = r;
    }
}

#define DQ_ARGS                                                                                                  \
    const u64 *__restrict__ table, u32 n_table, const u32 *__restrict__ ids, u32 n, u32 H, u32 I, u32 gl,        \
        u64 o13q, u64 o13s, u64 o2q, u64 o2s
#define DQ_PASS table, n_table, ids, n, H, I, gl, o13q, o13s, o2q, o2s
extern "C" __global__ void int4_dequant_bf16(DQ_ARGS, bf16_t* __restrict__ w13_out, bf16_t* __restrict__ w2_out) {
    int4_dequant<ActBf16>(DQ_PASS, w13_out, w2_out);
}
extern "C" __global__ void int4_dequant_f16(DQ_ARGS, f16_t* __restrict__ w13_out, f16_t* __restrict__ w2_out) {
    int4_dequant<ActF16>(DQ_PASS, w13_out, w2_out);
}
