// INT4 helpers shared by the portable INT4 module (int4.cu, int4_gemm.cu)
// and the Hopper grouped GEMMs (int4_gemm_sm90.cu), which are separate
// NVRTC units (sources.rs prepends this file to both). Moved here
// unchanged from int4.cu: the portable kernels' machine code is the same
// (checked with kcompile --dump and tools/cubin_diff.py).
//
// Expert blocks are found through a device pointer table (int4.cu's
// header); expert_base is null for an id past the table, a null or a
// misaligned entry, and the caller writes NaN instead of reading memory.

__device__ __forceinline__ const unsigned char* expert_base(const u64* table, u32 n_table, u32 id) {
    if (id >= n_table) return nullptr;
    const u64 b = table_entry(table, id);
    if (b == 0 || (b & 15u) != 0) return nullptr;
    return (const unsigned char*)b;
}

// (a & b) | c in one LOP3. Written out because the compiler, given
// `(w >> s) & 0x000F000F | magic` with both constants as immediates, emits
// an AND and an OR (a LOP3 takes one immediate): 4 instructions more per
// 32-bit word, which at M rows, where the decode GEMVs are issue bound,
// cost ~15% of w13's instructions (ncu, session 20). Same bits.
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Word of 8 nibbles -> 4 x2 pairs of (q - 8) in format A: o[j] = (nibble j,
// nibble j+4). bf16: 0x4300 | q = 128 + q, fma by 1 and -136; f16: 0x6400 |
// q = 1024 + q, fma by 1 and -1032 (0xE408). Exact either way.
template <class A = ActBf16>
__device__ __forceinline__ void dq8(u32 w, u32* o) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        if constexpr (A::F16) {
            const u32 v = and_or(w >> (4 * j), 0x000F000Fu, 0x64006400u);  // 1024 + q
            asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(o[j]) : "r"(v), "r"(0x3C003C00u), "r"(0xE408E408u));
        } else {
            const u32 v = and_or(w >> (4 * j), 0x000F000Fu, 0x43004300u);  // 128 + q
            asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(o[j]) : "r"(v), "r"(0x3F803F80u), "r"(0xC308C308u));
        }
    }
}

// 8 consecutive 16-bit values (one uint4) -> the permuted pairs (x[j], x[j+4]).
__device__ __forceinline__ uint4 perm8(uint4 u) {
    return make_uint4(__byte_perm(u.x, u.z, 0x5410), __byte_perm(u.x, u.z, 0x7632), __byte_perm(u.y, u.w, 0x5410),
                      __byte_perm(u.y, u.w, 0x7632));
}
