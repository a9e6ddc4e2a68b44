// Causal GQA prefill attention on Hopper (sm_90a): warpgroup MMA (wgmma).
//
// Why. attention_prefill.cu's mma.sync kernel (flash attention 2 form) runs
// at ~236 TFLOP/s at head_dim 128 on the H200 (kbench --prefill), and at
// 32K tokens attention is ~70% of a3b-24l's prefill. mma.sync issues
// 16x8x16 products per warp from registers; on Hopper the tensor cores
// reach their rate only through wgmma, which multiplies a 64-row tile per
// warpgroup (4 warps) with both operands read straight from shared memory
// (or A from registers), asynchronously. This is the flash attention 3 idea
// (Shah et al. 2024) without its TMA producer warps: read, not copied.
//
// Scope. head_dim 128, bf16 q/K/V, causal over a linear cache (qwen3_moe,
// glm4_moe). The portable kernel serves everything else (other head dims,
// f16, gpt-oss's ring/window/sinks, pre-Hopper cards) and stays the one the
// tests compare this against. Compiled for sm_90a only (wgmma is not in
// the portable sm_90 target), loaded only on compute capability 9.0
// (sources.rs, Target::Sm90a). The descriptor, fence and wait helpers are
// sm90.cuh's (shared with int4_gemm_sm90.cu; sources.rs puts it first).
//
// Block. 2 warpgroups (256 threads) own 128 query rows of one q head
// (warpgroup w: rows 64w..64w+63, warp v of it rows 16v.., as in
// mma.m16n8k16: lane (g, tq) holds rows g and g + 8); the block walks
// 128-key tiles of the q head's kv head from key 0 up to its last row.
// Per tile and warpgroup:
//   S = Q K^T : 8 wgmma.m64n128k16 (k over head_dim), Q and K both from
//               shared memory, K-major; S is 64 f32 registers per thread
//               in the accumulator layout (that of mma.m16n8 C fragments,
//               one per 8-key column tile j: s[4j..4j+3]).
//   online softmax in f32 (log2 domain) on those registers, as in the
//   portable kernel; P rounded to bf16;
//   O += P V  : 8 wgmma.m64n128k16 (k over the tile's keys) with P as the A
//               operand from registers. For 16-bit types the accumulator
//               layout of S columns 16k..16k+15 is exactly the A fragment
//               layout of k-step k, so P needs no exchange between lanes;
//               V from shared memory, MN-major (V is [key][d]: d
//               contiguous), hence the transposed-B form.
// A warpgroup skips a tile wholly past its last row (an exact no-op for
// its rows, see chunk invariance below); both warpgroups keep the block's
// barriers.
//
// Shared memory (1024-byte aligned; 160 KB, one block per SM): Q, then K
// and V double-buffered, each a 128-row x 128-d tile stored as two 64-d
// halves [half][row][64] (128 bytes per row), in the 128-byte swizzle of
// wgmma's canonical layouts: the 16-byte chunk c of row r sits at chunk
// c ^ (r & 7) within its row, so an 8-row group is one 1024-byte swizzle
// atom. Descriptors (h_desc): start address, leading byte offset (LBO),
// stride byte offset (SBO), swizzle mode 128B:
//   Q (A, K-major, warpgroup w, k-step k): Q + 16384 (k / 4) + 8192 w +
//     32 (k % 4); SBO 1024 (8-row groups); LBO unused for a swizzled
//     K-major operand whose k16 slice lies inside the 128-byte row.
//   K (B, K-major, N = 128 keys): K + 16384 (k / 4) + 32 (k % 4); SBO 1024.
//   V (B, MN-major, keys 16k..16k+15): V + 2048 k; LBO 16384 (the next 64
//     d, i.e. the other half), SBO 1024 (the next 8 keys).
// The +32-byte steps inside a row move only address bits 4-6, which the
// hardware XORs with bits 7-9 (the row within the atom), so the atom's
// phase stays 0 (base offset 0); the host model of these addresses is the
// test hopper_swizzle_matches_the_canonical_layout in ops/attention/hopper.rs.
//
// Pipeline. cp.async, 16 bytes per thread and step, 8 steps per tile and
// matrix; Q, K0 and V0 before the loop. One barrier per tile: at the top
// of tile n every thread waits for its own copies (tile n's, all that are
// pending) and fences them into the async proxy (cp.async writes through
// the generic proxy, wgmma reads through the async one), then the barrier
// publishes tile n and says every warpgroup is done with tile n-1, whose
// buffers tile n+1's loads then take: they run under tile n's products
// and softmax.
//
// Pingpong (flash attention 3's warpgroup scheduling). One warpgroup's
// wgmma already uses the tensor cores of all four SM sub-partitions, so
// two warpgroups issuing at once only queue behind each other, and
// their softmax (f32 and MUFU work) would leave the tensor cores idle.
// Instead they take turns through two named barriers (HP_TURN + w: "w may
// issue"): w waits for its turn, issues a product, hands the turn over,
// then waits for its product and runs the softmax (or the next tile's top)
// while the other's product runs. Per tile the tensor cores see S(0),
// S(1), PV(0), PV(1) back to back, with softmax(0) under S(1) and
// softmax(1) under PV(0). Warpgroup 1 hands warpgroup 0 the first turn
// before the loop and warpgroup 0 takes the last hand-over after it, so
// every arrival is matched; a warpgroup whose rows skip a tile still takes
// and hands over its turns. Turns only order issue; no data passes
// between the warpgroups, whose registers are their own.
// Register operands of a wgmma in flight (S, O, P) must not be touched:
// each product is committed and waited for (wgmma.wait_group 0) before its
// registers are read, wgmma.fence orders the preceding register writes,
// and h_fence_regs keeps the compiler from moving accesses across either.
//
// Chunk invariance (the prefix cache resumes prefill at any block
// boundary): as in attention_prefill.cu, a row's result depends only on its
// absolute position p, its q row and the cached keys 0..p. Key tiles start
// at absolute multiples of 128 (key 0), so row p sees the same tiles in the
// same order with the same per-tile reductions in every chunking; a tile
// wholly past p is an exact no-op for row p (scores -inf: alpha = 1, P = 0),
// which is also why a warpgroup may skip tiles past all of its rows. The
// rows' lanes, warps and warpgroup change with the chunk start; a wgmma
// computes each element of its tile the same way wherever the row sits
// (checked on the device: attention_prefill_wgmma_rows_are_chunk_invariant).
// This kernel's bits differ from the portable kernel's (128-key tiles, not
// 64: a different rescale sequence), so one engine uses one kernel for
// every chunk of a model (runtime/gpu/src/prefill_kernels.rs picks per
// engine, by device; attention.rs by dtype and head_dim).
//
// Rows past n_tokens are computed with the last valid position (they never
// read unwritten cache) and not stored; K/V rows past the block's last key
// are zero-filled (never read from unwritten cache, where NaN * 0 would
// poison O) and masked.

#define HP_BM 128   // query rows per block (2 warpgroups x 64)
#define HP_BN 128   // keys per tile
#define HP_D 128    // head_dim
#define HP_THREADS 256
#define HP_TILE 32768u                 // bytes of one 128 x 128 bf16 tile
#define HP_HALF 16384u                 // bytes of one 64-d half of a tile
#define HP_SMEM (5u * HP_TILE)         // Q, K x 2, V x 2
#define HP_LOG2E 1.4426950408889634f
#define HP_TURN 1u                     // named barriers 1 and 2 (0 is __syncthreads)

// Wait for warpgroup `wg`'s turn (bar.sync: its 128 threads and the other
// warpgroup's 128 arrivals), and hand the turn to warpgroup `wg`.
// 2^x on the MUFU unit alone (ftz: the probabilities' subnormals, below
// 2^-126 of the row maximum, flush to 0; -inf gives 0).
__device__ __forceinline__ float hp_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Immediate barrier ids, so ptxas reserves two barriers, not all 16.
__device__ __forceinline__ void hp_take_turn(u32 wg) {
    if (wg == 0) asm volatile("bar.sync 1, 256;" ::: "memory");
    else asm volatile("bar.sync 2, 256;" ::: "memory");
}
__device__ __forceinline__ void hp_give_turn(u32 wg) {
    if (wg == 0) asm volatile("bar.arrive 1, 256;" ::: "memory");
    else asm volatile("bar.arrive 2, 256;" ::: "memory");
}

extern __shared__ __align__(1024) unsigned char hp_smem[];

// The 64 f32 accumulator registers of an m64n128 product, as asm operands
// %0..%63 (read and written) and as the operand list naming them.
#define HP_ACC_OPS \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define HP_ACC_REGS(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// D (+)= A B over one k16 step: A (64 x 16) and B (16 x 128) from shared
// memory through descriptors, both K-major. `acc` 0 on the first step of a
// product (D = A B), 1 after (D += A B).
__device__ __forceinline__ void wgmma_ss_m64n128k16(float* d, u64 da, u64 db, u32 acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        HP_ACC_OPS ", %64, %65, p, 1, 1, 0, 0;\n}\n"
        : HP_ACC_REGS(d)
        : "l"(da), "l"(db), "r"(acc));
}

// D += A B over one k16 step with A (64 x 16, bf16) in registers, in the
// fragment layout of mma.m16n8k16 per warp (warp w: rows 16w..16w+15), and
// B (16 x 128) from shared memory, MN-major (transposed: N contiguous).
__device__ __forceinline__ void wgmma_rs_m64n128k16_tb(float* d, const u32* a, u64 db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        HP_ACC_OPS ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : HP_ACC_REGS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1u));
}

// Stage 128 rows of 128 bf16 (row r from src + r * stride if r < valid,
// else zeros) into a tile in the swizzled two-half layout (header). All
// 256 threads; 16 consecutive threads copy one row's 256 bytes.
__device__ __forceinline__ void hp_stage(unsigned char* dst, const bf16_t* src, u64 stride, u32 valid) {
#pragma unroll
    for (u32 it = 0; it < 8; ++it) {
        const u32 i = threadIdx.x + it * HP_THREADS;
        const u32 r = i >> 4, j = i & 15;
        unsigned char* d = dst + (j >> 3) * HP_HALF + r * 128u + (((j & 7) ^ (r & 7)) << 4);
        if (r < valid) cp_async16(d, src + (u64)r * stride + j * 8);
        else *(uint4*)d = make_uint4(0, 0, 0, 0);
    }
}

extern "C" __global__ void __launch_bounds__(HP_THREADS, 1)
    attn_prefill_wgmma_d128(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ kc,
                            const bf16_t* __restrict__ vc, bf16_t* __restrict__ out, u32 n_tokens, u32 start, u32 nq,
                            u32 nkv, u32 cap, float sl2) {
    {
        u32 dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        // The launch must pass HP_SMEM bytes, and the swizzle atoms need
        // 1024-byte alignment (the descriptors' base offset is 0).
        if (dyn < HP_SMEM || (smem_addr(hp_smem) & 1023u) != 0) asm volatile("trap;");
    }
    unsigned char* Qs = hp_smem;
    unsigned char* Ks = hp_smem + HP_TILE;     // 2 buffers
    unsigned char* Vs = hp_smem + 3 * HP_TILE; // 2 buffers
    const u32 qa = smem_addr(Qs), ka = smem_addr(Ks), va = smem_addr(Vs);

    const u32 mt = gridDim.x - 1 - blockIdx.x; // longest tiles first
    const u32 h = blockIdx.y;
    const u32 kvh = h / (nq / nkv);
    const u32 wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const u32 g = lane >> 2, tq = lane & 3;
    const u32 stride = (nq + 2 * nkv) * HP_D;
    const u32 m0 = mt * HP_BM;
    const u32 last = start + n_tokens - 1;
    const u32 r0 = m0 + wg * 64 + warp * 16 + g, r1 = r0 + 8;
    const u32 p0 = min(start + r0, last), p1 = min(start + r1, last);
    // This warpgroup's rows lie at positions [wfirst, wlast]; the block's
    // keys end at kend.
    const u32 wfirst = min(start + m0 + wg * 64, last), wlast = min(start + m0 + wg * 64 + 63, last);
    const u32 kend = min(start + m0 + HP_BM - 1, last) + 1;
    const u32 ntiles = (kend + HP_BN - 1) / HP_BN;
    const bf16_t* qbase = qkv + (u64)h * HP_D;
    const bf16_t* kbase = kc + (u64)kvh * cap * HP_D;
    const bf16_t* vbase = vc + (u64)kvh * cap * HP_D;

    hp_stage(Qs, qbase + (u64)m0 * stride, stride, n_tokens - min(m0, n_tokens));
    hp_stage(Ks, kbase, HP_D, kend);
    hp_stage(Vs, vbase, HP_D, kend);
    cp_async_commit();

    float o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    float mrow0 = NEG_INF_F, mrow1 = NEG_INF_F, l0 = 0.0f, l1 = 0.0f;

    if (wg == 1) hp_give_turn(0);
    for (u32 nt = 0; nt < ntiles; ++nt) {
        const u32 n0 = nt * HP_BN, buf = nt & 1;
        cp_async_wait<0>(); // (Q,) K and V of tile nt
        fence_proxy_async();
        __syncthreads(); // tile nt published; every warpgroup is done with tile nt - 1
        if (nt + 1 < ntiles) {
            const u32 n1 = n0 + HP_BN;
            hp_stage(Ks + (buf ^ 1) * HP_TILE, kbase + (u64)n1 * HP_D, HP_D, kend - n1);
            hp_stage(Vs + (buf ^ 1) * HP_TILE, vbase + (u64)n1 * HP_D, HP_D, kend - n1);
            cp_async_commit();
        }

        const bool live = n0 <= wlast;
        float s[64];
        u32 pa[8][4];
        hp_take_turn(wg);
        if (live) {
#pragma unroll
            for (int i = 0; i < 64; ++i) s[i] = 0.0f;
            h_fence_regs<64>(s);
            wgmma_fence();
#pragma unroll
            for (u32 kk = 0; kk < 8; ++kk) {
                const u32 koff = (kk >> 2) * HP_HALF + (kk & 3) * 32u;
                const u64 dq = h_desc(qa + koff + wg * 8192u, 16, 1024);
                const u64 dk = h_desc(ka + buf * HP_TILE + koff, 16, 1024);
                wgmma_ss_m64n128k16(s, dq, dk, kk > 0 ? 1u : 0u);
            }
            wgmma_commit();
            // The issue and the wait of a product stay in one branch: ptxas
            // serializes wgmma whose wait it must place in a divergent path.
            hp_give_turn(wg ^ 1);
            wgmma_wait<0>();
            h_fence_regs<64>(s);

            // Mask (only a tile reaching past the warpgroup's first row
            // needs it) and the online softmax in the log2 domain. The
            // maximum is taken over the raw scores and scaled once (sl2 > 0,
            // so the scaled maximum is the same number), and each
            // probability is one fma and one ex2: exp2(s * sl2 - m).
            const bool mask = n0 + HP_BN - 1 > wfirst;
            float mx0 = NEG_INF_F, mx1 = NEG_INF_F;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const u32 key = n0 + j * 8 + 2 * tq + (e & 1);
                    const u32 pos = e < 2 ? p0 : p1;
                    float v = (!mask || key <= pos) ? s[4 * j + e] : NEG_INF_F;
                    s[4 * j + e] = v;
                    if (e < 2) mx0 = fmaxf(mx0, v);
                    else mx1 = fmaxf(mx1, v);
                }
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            // A live tile holds key n0 <= every row's position, so the new
            // maxima are finite.
            const float mn0 = fmaxf(mrow0, mx0 * sl2), mn1 = fmaxf(mrow1, mx1 * sl2);
            const float al0 = hp_ex2(mrow0 - mn0), al1 = hp_ex2(mrow1 - mn1);
            mrow0 = mn0;
            mrow1 = mn1;
            float ls0 = 0.0f, ls1 = 0.0f;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                s[4 * j + 0] = hp_ex2(fmaf(s[4 * j + 0], sl2, -mn0));
                s[4 * j + 1] = hp_ex2(fmaf(s[4 * j + 1], sl2, -mn0));
                s[4 * j + 2] = hp_ex2(fmaf(s[4 * j + 2], sl2, -mn1));
                s[4 * j + 3] = hp_ex2(fmaf(s[4 * j + 3], sl2, -mn1));
                ls0 += s[4 * j + 0] + s[4 * j + 1];
                ls1 += s[4 * j + 2] + s[4 * j + 3];
            }
            l0 = l0 * al0 + ls0;
            l1 = l1 * al1 + ls1;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                o[4 * j + 0] *= al0;
                o[4 * j + 1] *= al0;
                o[4 * j + 2] *= al1;
                o[4 * j + 3] *= al1;
            }
            // P as the A fragments of the 8 key steps (header).
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                pa[kk][0] = pack_bf2(s[8 * kk + 0], s[8 * kk + 1]);
                pa[kk][1] = pack_bf2(s[8 * kk + 2], s[8 * kk + 3]);
                pa[kk][2] = pack_bf2(s[8 * kk + 4], s[8 * kk + 5]);
                pa[kk][3] = pack_bf2(s[8 * kk + 6], s[8 * kk + 7]);
            }
        } else {
            hp_give_turn(wg ^ 1);
        }
        hp_take_turn(wg);
        if (live) {
            h_fence_regs<64>(o);
            h_fence_regs<32>(&pa[0][0]);
            wgmma_fence();
#pragma unroll
            for (u32 kk = 0; kk < 8; ++kk) {
                const u64 dv = h_desc(va + buf * HP_TILE + kk * 2048u, HP_HALF, 1024);
                wgmma_rs_m64n128k16_tb(o, pa[kk], dv);
            }
            wgmma_commit();
            hp_give_turn(wg ^ 1);
            wgmma_wait<0>();
            h_fence_regs<64>(o);
            h_fence_regs<32>(&pa[0][0]);
        } else {
            hp_give_turn(wg ^ 1);
        }
    }
    if (wg == 0) hp_take_turn(0); // warpgroup 1's last hand-over

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = 1.0f / l0, inv1 = 1.0f / l1;
    const u32 ostride = nq * HP_D;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const u32 col = h * HP_D + j * 8 + 2 * tq;
        if (r0 < n_tokens) *(u32*)(out + (u64)r0 * ostride + col) = pack_bf2(o[4 * j] * inv0, o[4 * j + 1] * inv0);
        if (r1 < n_tokens)
            *(u32*)(out + (u64)r1 * ostride + col) = pack_bf2(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1);
    }
}
