// Grouped INT4 expert GEMMs for prefill on Hopper (sm_90a): warpgroup MMA
// (wgmma) with the weights dequantized in registers as the A operand.
//
// Why. int4_gemm.cu's mma.sync kernel reaches 170 TFLOP/s on a3b at 8K
// tokens, 0.85x cuBLAS on dequantized experts (docs/notes/prefill-kernels.md);
// Nsight Compute found it latency- and ALU-bound: each warp reloads its B
// fragments from shared memory (32 ld.shared.v4 per 128-K step) and issues
// 64 mma.sync per step. On Hopper the tensor cores reach their rate only
// through wgmma, which reads B from shared memory itself, runs
// asynchronously, and takes A from registers: the dequantized nibbles go
// straight in, as in the portable kernel, and no thread loads B.
//
// Contract. Exactly int4_gemm.cu's: the same arguments, grid (x = output
// feature blocks: gate/up 64 i, down 128 rows; y = the 64-row token tiles
// numbered expert by expert, found by grouped_find_tile), outputs, NaN rows
// for a missing or misaligned expert, group 128 only. An engine could pick
// this kernel or that one per device with no other change, but not mix
// them: the tensor core's f32 sums are not specified to match between
// mma.sync and wgmma (see Numerics), so the bits must be taken to differ,
// and one model must use one kernel for every chunk (row invariance holds
// within each kernel). Compiled for
// sm_90a only and loaded only on compute capability 9.0 (sources.rs,
// Target::Sm90a); the helpers come first in the module: sm90.cuh (wgmma
// descriptor, fences, waits) and int4_common.cuh (dq8, perm8, expert_base).
//
// Block. 256 threads = 2 warpgroups; warpgroup w multiplies a 64-row weight
// tile by the tile's 64 tokens with wgmma.m64n64k16 (f32 accumulators, 32
// per thread). Warp v of warpgroup w (block warp 4w + v) holds rows
// 16v..16v+15 of that A tile, which are the block's weight rows of the
// portable kernel's warp 4w + v: gate/up, its rows 0-7 are gate rows
// i..i+7 and rows 8-15 the up rows I+i..I+i+7 (i = 64 bx + 8 (4w + v)), so
// a lane's D holds g and u of the same (i, token) and the SwiGLU epilogue
// needs no exchange; down, 16 consecutive rows. The accumulator layout of
// m64nN is per warp that of mma.m16n8 C fragments, one per 8-token column
// tile (d[4j..4j+3]: rows g / g+8, tokens 8j + 2tq, +1), so the epilogue is
// the portable kernel's. Both warpgroups read the same staged x.
//
// A operand (weights, registers). Per 128-K step (one scale group) lane
// (g, tq) loads, as in the portable kernel, 16 bytes of rows g and g+8 (K
// 32tq..32tq+31 of the step); word i of them (K 32tq+8i..+7) becomes 4
// format-A pairs by dq8, pair j = (nibble j, nibble j+4). For wgmma with A
// from registers, each warp's 16 x 16 slice of the 64 x 16 A tile has the
// mma.m16n8k16 A fragment layout: a0 = (row g, k 2tq, 2tq+1), a1 = the
// same for row g+8, a2 / a3 = k + 8. k16 step s = 2i + h (i = 0..3, h =
// 0..1) takes a0 = pair 2h of row g's word i, a1 = pair 2h of row g+8's,
// a2 / a3 = pair 2h + 1: the portable kernel's mma16 arguments.
//
// K permutation. The dot product does not care about the order of K as
// long as A and B agree; the A registers above put physical K (within the
// 128-K step)
//     K(s, k) = 32 t + 8 i + 2 h + hi + 4 lo,   s = 2i + h,
//     t = (k >> 1) & 3, hi = k >> 3, lo = k & 1,
// at logical position k (0..15) of k16 step s. It is a bijection of 0..127
// (t: bits 5-6, i: 3-4, lo: 2, h: 1, hi: 0). B must present x in the same
// order: logical position L = 16 s + k of a token's 128-K step holds
// x[K(s, k)]. The host model is the test int4_wgmma_k_permutation_matches_
// the_fragments in ops/int4/grouped_sm90.rs.
//
// Shared memory (dynamic, 1024-byte aligned, 64 KB + 16 bytes): 4
// buffers of one step of x, 64 tokens x 128 K of format A (16 KB each),
// then info[3] (grouped_find_tile's answer). A buffer is two 64-K halves
// [half][token][64] (128 bytes per token row: logical L = 64 half + 8
// chunk + e), in the 128-byte swizzle of wgmma's canonical K-major layout:
// the 16-byte chunk c of row r sits at chunk c ^ (r & 7), an 8-row group is
// one 1024-byte atom. Step G uses buffer G % 4. Descriptor of B for k16
// step s (K-major, N = 64 tokens): start = buffer + 8192 (s >> 2) + 32 (s &
// 3), SBO 1024 (8-token groups), LBO unused (16): as in
// attention_prefill_sm90.cu, the +32-byte steps inside a row move only
// address bits 4-6, so the atom phase stays 0. The host model is the test
// int4_wgmma_swizzle_matches_the_canonical_layout.
//
// Staging x. Thread (warp w, lane l) owns token 8w + (l & 7) and quarter
// i = l >> 3 of a step: it loads the 4 source chunks u[t] = x[32t + 8i ..
// +7] (t = 0..3; a warp reads 64 contiguous bytes of each of 8 tokens per
// load), p[t] = perm8(u[t]) (words (x0,x4), (x1,x5), (x2,x6), (x3,x7)), and
// stores the 4 logical chunks 4i + c (c = 2h + hi = 0..3), logical chunk c
// = (p[0].c, p[1].c, p[2].c, p[3].c): its word t is (x[32t + 8i + c],
// x[32t + 8i + c + 4]) = logical k 2t, 2t+1 (+ 8 hi) of step 2i + h. A
// quarter-warp's 16-byte stores go to 8 tokens' rows at 8 distinct swizzled
// chunks: no bank conflicts. Rows past the tile's end (r1) stage zeros, so
// their D columns are 0, and are not stored.
//
// Pipeline (two 128-K steps G, G + 1 per iteration, one barrier). On
// entry step G's A registers (a0) are dequantized, steps G and G + 1 are
// staged (buffers G % 4, (G + 1) % 4) and the weights of steps G + 1 and
// G + 2 are in registers. The iteration issues step G's 8 wgmma (one per
// k16 step) into acc0 as one commit group, dequantizes step G + 1 into a1
// under them, issues it into acc1; stages steps G + 2 and G + 3 into their
// buffers from registers loaded just before (those buffers were last read
// two steps ago, retired before the previous barrier); wgmma.wait_group 1
// retires step G, whose sum is scaled into the total and whose registers
// take step G + 2's dequantized nibbles under step G + 1's products;
// wait_group 0 retires step G + 1; fence.proxy.async.shared::cta (the
// staging stores are generic-proxy writes that wgmma reads through the
// async proxy) and the barrier end it. Weights are loaded two steps ahead
// (one per parity), x one iteration ahead; loads past the last step are
// clamped to it and their results unused. An odd last step runs alone
// after the loop. Nothing is in flight across the loop's back edge: ptxas
// serializes every wgmma of a kernel (C7513 / C7514) when products may be
// in flight across a back edge or a conditional issue, which a pipeline
// one step deep across iterations needs (tried; kcompile -v reports it).
// The cost is a bubble per iteration (step G + 1's scaling, the barrier)
// that the other warpgroup's products do not fill, as both run in step.
// h_fence_regs pins the A and accumulator registers around every issue and
// wait. Registers: 254, no spills (ptxas, sm_90a): two accumulator sets and
// the total (96 f32), two A sets (64), weights (16) and x (16) in flight;
// one block (8 warps) per SM.
//
// Numerics. As the portable kernel: exact (q - 8) times x on the tensor
// core, each scale group summed in f32 there (8 k16 steps, K order), scaled
// by the row's f16 scale in f32 and added to the f32 total in group order
// (tot += s * sum, the portable expression). No split-K and no reduction
// across tokens: a row's result depends only on its x and expert, and a
// wgmma computes each element of its tile the same way wherever the row
// sits, so a row's bits do not depend on its tile or position (checked on
// the device: int4_grouped_wgmma_matches_reference rotates rows). How the
// tensor core adds the 16 products of a k16 step and the running sum is not
// specified, and nothing promises mma.sync and wgmma do it alike: the bits
// are taken to differ from the portable kernel's (the tests compare the two
// within the reference tolerance, not bit for bit).
//
// Expected speed (unmeasured). Per SM and iteration the two warpgroups
// issue 32 m64n64k16 (4.2 MFLOP, ~1,024 tensor-core cycles at the H200's
// dense rate) against ~350 instructions per warp (dq8 2 x ~100, scaling
// 2 x 32, staging ~60, issue and addresses), ~700 issue cycles per
// scheduler, of which the exposed part (step G + 1's scaling, the barrier,
// the products' drain) is ~150-250 cycles: at most ~0.8 of the tensor
// rate inside the loop. Each 64-token tile re-reads its expert's weights
// (mostly from L2) and the tile count is fixed by the portable contract, so
// the device will land below that; a 1.5x gain over the portable kernel's
// 170 TFLOP/s at 8K tokens (its B loads from shared memory and mma.sync
// issue are gone) would pass cuBLAS on dequantized experts (199). B reads
// from shared memory (64 bytes per 2K flops) use half the SM's bandwidth.
// The device run decides (kbench --grouped).

#define GW_BT 64                         // tokens per tile: GG_BT, the portable kernel's tiles
#define GW_THREADS 256                   // 2 warpgroups
#define GW_HALF 8192u                    // one 64-K half of a step of x: 64 rows of 128 bytes
#define GW_BUF (2u * GW_HALF)            // one 128-K step of x (16 KB)
#define GW_NBUF 4u
#define GW_SMEM (GW_NBUF * GW_BUF + 16u) // the buffers, then info[3]

extern __shared__ __align__(1024) unsigned char gw_smem[];

// The 32 f32 accumulator registers of an m64n64 product, as asm operands
// %0..%31 (read and written) and as the operand list naming them.
#define GW_ACC_OPS \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define GW_ACC_REGS(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// D (+)= A B over one k16 step: A (64 x 16, format A) from registers in the
// per-warp mma.m16n8k16 fragment layout, B (16 x 64 tokens) from shared
// memory, K-major (no transpose). `acc` 0 on a step's first k16 (D = A B).
template <class A>
__device__ __forceinline__ void wgmma_rs_m64n64k16(float* d, const u32* a, u64 db, u32 acc) {
    if constexpr (A::F16) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
            GW_ACC_OPS ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
            : GW_ACC_REGS(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
    } else {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
            GW_ACC_OPS ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
            : GW_ACC_REGS(d)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
    }
}

__device__ __forceinline__ u32 gw_word(uint4 q, int i) { return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w; }

// W13: gate/up + SwiGLU into `out` (format A, [rows, N = I]); else down into
// `out` (f32, [rows, N = H]). K: the reduction width (H or I), I: the
// intermediate width (where the up rows start). As int4_gemm.cu.
template <class A, bool W13>
__device__ __forceinline__ void grouped_int4_wgmma(const unsigned short* __restrict__ x,
                                                   const u32* __restrict__ offsets, u32 n_experts,
                                                   const u64* __restrict__ table, u32 n_table, u32 K, u32 I, u32 N,
                                                   u64 oq, u64 os, void* __restrict__ out) {
    {
        u32 dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        // The launch must pass GW_SMEM bytes, and the swizzle atoms need
        // 1024-byte alignment (the descriptors' base offset is 0).
        if (dyn < GW_SMEM || (smem_addr(gw_smem) & 1023u) != 0) asm volatile("trap;");
    }
    u32* info = (u32*)(gw_smem + GW_NBUF * GW_BUF);
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    if (threadIdx.x == 0) info[0] = ~0u;
    __syncthreads();
    if (warp == 0) grouped_find_tile<GW_BT>(offsets, n_experts, blockIdx.y, lane, info);
    __syncthreads();
    const u32 e = info[0];
    if (e == ~0u) return;  // block-uniform; only when the grid is larger than the tiles
    const u32 r0 = info[1], r1 = info[2];
    // This lane's weight rows (h = 0: row g of its warp's 16, h = 1: row
    // g + 8) and, for gate/up, its i: the portable kernel's, warp for warp.
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
    float tot[32];
#pragma unroll
    for (int c = 0; c < 32; ++c) tot[c] = base ? 0.0f : NAN_F;
    if (base != nullptr) {  // block-uniform
        const u32 ng = K / 128;
        const unsigned char* wp[2];
        const f16_t* sp[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            wp[h] = base + oq + (u64)row[h] * (K / 2) + tq * 16;
            sp[h] = (const f16_t*)(base + os) + (u64)row[h] * ng;
        }
        // x staging (header): token xt, quarter xi; this thread's 4 logical
        // chunks 4 xi + c sit in half xi >> 1 of row xt at chunks
        // (4 (xi & 1) + c) ^ (xt & 7). Steps past the last are clamped to
        // it (the pipeline's loads run two steps ahead; the copies land in
        // buffers nothing reads).
        const u32 xt = warp * 8 + (lane & 7), xi = lane >> 3;
        const bool xin = r0 + xt < r1;
        const unsigned short* xrow = x + (u64)(r0 + xt) * K + xi * 8;
        const u32 xs = smem_addr(gw_smem);
        unsigned char* xdst = gw_smem + (xi >> 1) * GW_HALF + xt * 128u;
        uint4 xr[4];
        auto load_x = [&](u32 G) {
            G = min(G, ng - 1);
#pragma unroll
            for (int t = 0; t < 4; ++t)
                xr[t] = xin ? *(const uint4*)(xrow + G * 128 + t * 32) : make_uint4(0, 0, 0, 0);
        };
        auto store_x = [&](u32 G) {
            uint4 p[4];
#pragma unroll
            for (int t = 0; t < 4; ++t) p[t] = perm8(xr[t]);
#pragma unroll
            for (int c = 0; c < 4; ++c)
                *(uint4*)(xdst + (G % GW_NBUF) * GW_BUF + (((4 * (xi & 1) + c) ^ (xt & 7)) << 4)) =
                    make_uint4(gw_word(p[0], c), gw_word(p[1], c), gw_word(p[2], c), gw_word(p[3], c));
        };
        // Weights by parity p of the step: wq[p] / ws[p] hold the next step
        // of that parity not yet dequantized (rows g, g + 8), sa[p] the
        // scales of the step whose A registers (a0 / a1) and sum (acc0 /
        // acc1) are in use.
        uint4 wq[2][2];
        float ws[2][2], sa[2][2];
        auto load_w = [&](int p, u32 G) {
            G = min(G, ng - 1);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                wq[p][h] = ld_stream16(wp[h] + G * 64);
                ws[p][h] = h2f(sp[h][G]);
            }
        };
        // A fragments of k16 step s = 2i + h (header): a0 / a2 = pairs 2h /
        // 2h + 1 of row g's word i, a1 / a3 the same of row g + 8.
        auto dequant = [&](int p, u32* a) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                u32 pa[4], pb[4];
                dq8<A>(gw_word(wq[p][0], i), pa);
                dq8<A>(gw_word(wq[p][1], i), pb);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    a[8 * i + 4 * h + 0] = pa[2 * h];
                    a[8 * i + 4 * h + 1] = pb[2 * h];
                    a[8 * i + 4 * h + 2] = pa[2 * h + 1];
                    a[8 * i + 4 * h + 3] = pb[2 * h + 1];
                }
            }
            sa[p][0] = ws[p][0];
            sa[p][1] = ws[p][1];
        };
        // Step G's 8 k16 products into acc (D = A B, then D += A B), one
        // commit group.
        auto issue = [&](float* acc, u32* a, u32 G) {
            h_fence_regs<32>(acc);
            h_fence_regs<32>(a);
            wgmma_fence();
            const u32 xb = xs + (G % GW_NBUF) * GW_BUF;
#pragma unroll
            for (u32 s = 0; s < 8; ++s) {
                const u64 db = h_desc(xb + (s >> 2) * GW_HALF + (s & 3) * 32u, 16, 1024);
                wgmma_rs_m64n64k16<A>(acc, a + 4 * s, db, s > 0 ? 1u : 0u);
            }
            wgmma_commit();
        };
        // A retired step: pin its registers after the wait, then scale its
        // sum into the total (rows g, g + 8), in step order.
        auto retire = [&](float* acc, u32* a, const float* sc) {
            h_fence_regs<32>(acc);
            h_fence_regs<32>(a);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                tot[4 * j + 0] += sc[0] * acc[4 * j + 0];
                tot[4 * j + 1] += sc[0] * acc[4 * j + 1];
                tot[4 * j + 2] += sc[1] * acc[4 * j + 2];
                tot[4 * j + 3] += sc[1] * acc[4 * j + 3];
            }
        };
        float acc0[32], acc1[32];
        u32 a0[32], a1[32];
#pragma unroll
        for (int c = 0; c < 32; ++c) acc0[c] = acc1[c] = 0.0f;
        // Prologue: steps 0 and 1 staged, step 0 dequantized into a0, the
        // weights of steps 1 and 2 in registers.
        load_x(0);
        load_w(0, 0);
        load_w(1, 1);
        store_x(0);
        load_x(1);
        store_x(1);
        dequant(0, a0);
        load_w(0, 2);
        fence_proxy_async();
        __syncthreads();
        // Two steps per iteration, with nothing in flight across the loop's
        // back edge: ptxas serializes every wgmma of the kernel when
        // products are in flight across a back edge or a branch (C7513 /
        // C7514), so the overlap is inside the iteration only: step G + 1's
        // dequantization under step G's products, step G's scaling and step
        // G + 2's dequantization under step G + 1's.
        for (u32 G = 0; G + 1 < ng; G += 2) {
            load_x(G + 2);
            issue(acc0, a0, G);
            dequant(1, a1);
            load_w(1, G + 3);
            issue(acc1, a1, G + 1);
            store_x(G + 2);
            load_x(G + 3);
            wgmma_wait<1>();  // step G retired
            retire(acc0, a0, sa[0]);
            dequant(0, a0);  // step G + 2 (past the last: unused)
            load_w(0, G + 4);
            store_x(G + 3);
            wgmma_wait<0>();  // step G + 1 retired
            retire(acc1, a1, sa[1]);
            // Steps G + 2 and G + 3 staged for the async proxy; every
            // warpgroup is done with the buffers of steps G and G + 1.
            fence_proxy_async();
            __syncthreads();
        }
        if (ng & 1) {  // the last step, dequantized into a0 above
            issue(acc0, a0, ng - 1);
            wgmma_wait<0>();
            retire(acc0, a0, sa[0]);
        }
    }
    // D layout: d[4j], d[4j+1] = row g, tokens 8j + 2tq, +1; d[4j+2], d[4j+3]
    // = row g + 8.
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const u32 r = r0 + j * 8 + 2 * tq + c;
            if (r >= r1) continue;
            if (W13) {
                const float v = silu(tot[4 * j + c]) * tot[4 * j + 2 + c];
                ((unsigned short*)out)[(u64)r * N + i0] = A::store(v);
            } else {
                ((float*)out)[(u64)r * N + row[0]] = tot[4 * j + c];
                ((float*)out)[(u64)r * N + row[1]] = tot[4 * j + 2 + c];
            }
        }
}

#define GW_ARGS                                                                                                   \
    const unsigned short *__restrict__ x, const u32 *__restrict__ offsets, u32 n_experts,                          \
        const u64 *__restrict__ table, u32 n_table, u32 K, u32 I, u32 N, u64 oq, u64 os
#define GW_PASS x, offsets, n_experts, table, n_table, K, I, N, oq, os
extern "C" __global__ void __launch_bounds__(GW_THREADS, 1)
    int4_grouped_w13_swiglu_wgmma_bf16(GW_ARGS, bf16_t* __restrict__ out) {
    grouped_int4_wgmma<ActBf16, true>(GW_PASS, out);
}
extern "C" __global__ void __launch_bounds__(GW_THREADS, 1)
    int4_grouped_w13_swiglu_wgmma_f16(GW_ARGS, f16_t* __restrict__ out) {
    grouped_int4_wgmma<ActF16, true>(GW_PASS, out);
}
extern "C" __global__ void __launch_bounds__(GW_THREADS, 1)
    int4_grouped_w2_wgmma_bf16(GW_ARGS, float* __restrict__ out) {
    grouped_int4_wgmma<ActBf16, false>(GW_PASS, out);
}
extern "C" __global__ void __launch_bounds__(GW_THREADS, 1)
    int4_grouped_w2_wgmma_f16(GW_ARGS, float* __restrict__ out) {
    grouped_int4_wgmma<ActF16, false>(GW_PASS, out);
}
