"""Probe (session 19): HBM read rate of three per-instruction load patterns a
decode kernel can use, same bytes and loads in flight per warp (16 x 16 B per
lane), rows of 4 KB (a 2048-wide bf16 row):
  A  one row, 512 contiguous bytes per instruction (the FMA GEMV's pattern)
  B  8 rows x 64 bytes per instruction (mma fragments: 4 lanes per row)
  C  4 rows x 128 bytes per instruction
Prints GB/s per pattern and grid (median of 20 timed launches)."""
import cupy as cp

SRC = r'''
__device__ __forceinline__ uint4 lds(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
// item = 8 KB for one warp: 16 loads per lane.
extern "C" __global__ void probe(const uint4* __restrict__ w, unsigned long long items, int pat, uint4* out) {
    const unsigned lane = threadIdx.x & 31;
    const unsigned long long warps = (unsigned long long)gridDim.x * (blockDim.x >> 5);
    unsigned long long wid = (unsigned long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (unsigned long long it = wid; it < items; it += warps) {
        uint4 v[16];
        // 8 KB per item = 512 vectors of 16 B; rows of 256 vectors.
        const unsigned long long base = it * 512;
#pragma unroll
        for (int u = 0; u < 16; ++u) {
            unsigned long long off;
            if (pat == 0) {          // A: 2 rows x 8 instr x 512 B contiguous
                off = base + (u / 8) * 256 + (u % 8) * 32 + lane;
            } else if (pat == 1) {   // B: 8 rows x 64 B per instr; 16 instr cover 8 rows x 1 KB
                // the 8 KB item = 8 rows x 1 KB (a quarter of each 4 KB row's span, rows 4 KB apart)
                const unsigned g = lane >> 2, tq = lane & 3;
                const unsigned long long tile = it / 4, q = it % 4;
                off = (tile * 8 + g) * 256 + q * 64 + u * 4 + tq;
            } else {                 // C: 4 rows x 128 B per instr; 16 instr cover 4 rows x 2 KB
                const unsigned r = lane >> 3, s = lane & 7;
                const unsigned long long tile = it / 2, h = it % 2;
                off = (tile * 4 + r) * 256 + h * 128 + u * 8 + s;
            }
            v[u] = lds(w + off);
        }
#pragma unroll
        for (int u = 0; u < 16; ++u) { acc.x ^= v[u].x; acc.y += v[u].y; acc.z ^= v[u].z; acc.w += v[u].w; }
    }
    if (acc.x == 0x12345678u && acc.y == 7u) out[0] = acc;
}
'''
mod = cp.RawModule(code=SRC, options=("-std=c++17",))
k = mod.get_function("probe")
nbytes = 640 << 20
w = cp.random.randint(0, 2**31, size=nbytes // 4, dtype=cp.int32)
out = cp.zeros(4, dtype=cp.uint32)
items = nbytes // 8192
for threads, blocks_per_sm in [(256, 2), (512, 2), (256, 4)]:
    grid = 132 * blocks_per_sm
    for pat, name in [(0, "A 1 row x 512 B"), (1, "B 8 rows x 64 B"), (2, "C 4 rows x 128 B")]:
        args = (w, cp.uint64(items), cp.int32(pat), out)
        for _ in range(3):
            k((grid,), (threads,), args)
        ts = []
        for _ in range(20):
            s, e = cp.cuda.Event(), cp.cuda.Event()
            s.record(); k((grid,), (threads,), args); e.record(); e.synchronize()
            ts.append(cp.cuda.get_elapsed_time(s, e))
        ts.sort()
        print(f"threads {threads} grid {grid}: pattern {name}: {nbytes / ts[10] / 1e6:.0f} GB/s "
              f"(min {nbytes / ts[-1] / 1e6:.0f}, max {nbytes / ts[0] / 1e6:.0f})")
