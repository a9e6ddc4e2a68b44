// RMSNorm, optionally fused with the residual add.
//
// Design: one block (256 threads) per row; the row is read once into
// registers-through-L1 for the sum of squares and again for the output
// (rows are <= 64K elements, so the second read hits L1/L2).
// Precision policy: the residual stream is f32. The fused variant adds the
// bf16/f32 delta to the f32 residual and writes it back. Sum of squares,
// rsqrt and the weight multiply are f32; the normalized output is rounded
// to bf16 once (to f16 by rmsnorm_f32_to_f16, the FP16 attention's input). Reduction order is fixed (block_sum), so results are
// bit-reproducible.

template <typename T> __device__ __forceinline__ float load_f(const T* p, u32 i);
template <> __device__ __forceinline__ float load_f<float>(const float* p, u32 i) { return p[i]; }
template <> __device__ __forceinline__ float load_f<bf16_t>(const bf16_t* p, u32 i) { return bf2f(p[i]); }

// O: the output's format (ActBf16, or ActF16 for the QKV input of an FP16
// attention block: rmsnorm_f32_to_f16).
template <typename T, class O = ActBf16>
__device__ void rmsnorm_row(const T* __restrict__ x, const bf16_t* __restrict__ w, unsigned short* __restrict__ out,
                            u32 hidden, float eps) {
    __shared__ float scratch[32];
    float ss = 0.0f;
    for (u32 c = threadIdx.x; c < hidden; c += blockDim.x) {
        float v = load_f<T>(x, c);
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    float inv = rsqrtf(ss / (float)hidden + eps);
    for (u32 c = threadIdx.x; c < hidden; c += blockDim.x) out[c] = O::store(load_f<T>(x, c) * inv * bf2f(w[c]));
}

extern "C" __global__ void rmsnorm_f32(const float* __restrict__ x, const bf16_t* __restrict__ w,
                                       bf16_t* __restrict__ out, u32 rows, u32 hidden, float eps) {
    u32 r = blockIdx.x;
    if (r >= rows) return;
    rmsnorm_row<float>(x + (u64)r * hidden, w, out + (u64)r * hidden, hidden, eps);
}

extern "C" __global__ void rmsnorm_f32_to_f16(const float* __restrict__ x, const bf16_t* __restrict__ w,
                                              f16_t* __restrict__ out, u32 rows, u32 hidden, float eps) {
    u32 r = blockIdx.x;
    if (r >= rows) return;
    rmsnorm_row<float, ActF16>(x + (u64)r * hidden, w, out + (u64)r * hidden, hidden, eps);
}

extern "C" __global__ void rmsnorm_bf16(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                        bf16_t* __restrict__ out, u32 rows, u32 hidden, float eps) {
    u32 r = blockIdx.x;
    if (r >= rows) return;
    rmsnorm_row<bf16_t>(x + (u64)r * hidden, w, out + (u64)r * hidden, hidden, eps);
}

template <typename T>
__device__ void add_rmsnorm_row(float* __restrict__ res, const T* __restrict__ d, const bf16_t* __restrict__ w,
                                bf16_t* __restrict__ out, u32 hidden, float eps) {
    __shared__ float scratch[32];
    float ss = 0.0f;
    for (u32 c = threadIdx.x; c < hidden; c += blockDim.x) {
        float v = res[c] + load_f<T>(d, c);
        res[c] = v;
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    float inv = rsqrtf(ss / (float)hidden + eps);
    // Each thread re-reads only the residual elements it wrote itself.
    for (u32 c = threadIdx.x; c < hidden; c += blockDim.x) out[c] = f2bf(res[c] * inv * bf2f(w[c]));
}

extern "C" __global__ void add_rmsnorm_bf16(float* __restrict__ res, const bf16_t* __restrict__ d,
                                            const bf16_t* __restrict__ w, bf16_t* __restrict__ out, u32 rows,
                                            u32 hidden, float eps) {
    u32 r = blockIdx.x;
    if (r >= rows) return;
    add_rmsnorm_row<bf16_t>(res + (u64)r * hidden, d + (u64)r * hidden, w, out + (u64)r * hidden, hidden, eps);
}

extern "C" __global__ void add_rmsnorm_f32(float* __restrict__ res, const float* __restrict__ d,
                                           const bf16_t* __restrict__ w, bf16_t* __restrict__ out, u32 rows,
                                           u32 hidden, float eps) {
    u32 r = blockIdx.x;
    if (r >= rows) return;
    add_rmsnorm_row<float>(res + (u64)r * hidden, d + (u64)r * hidden, w, out + (u64)r * hidden, hidden, eps);
}
