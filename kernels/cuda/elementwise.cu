// Elementwise kernels: embedding gather, residual adds, per-column bias
// adds, f32->bf16 cast and SwiGLU (bf16, or f16 for an FP16 MLP block).
//
// Design: memory-bound one-pass kernels. The embedding gather moves 16 bytes
// (8 bf16) per load and widens to the f32 residual stream. Grid-stride loops
// with 4 elements per thread per iteration keep enough loads in flight.
// Precision: every output is computed in f32 and rounded once.

extern "C" __global__ void embed_gather_bf16(const bf16_t* __restrict__ table, const u32* __restrict__ ids,
                                             float* __restrict__ out, u32 n_tokens, u32 hidden, u32 vocab) {
    u32 t = blockIdx.x;
    if (t >= n_tokens) return;
    u32 id = ids[t];
    float* o = out + (u64)t * hidden;
    if (id >= vocab) {
        for (u32 c = threadIdx.x; c < hidden; c += blockDim.x) o[c] = NAN_F;
        return;
    }
    const uint4* row = (const uint4*)(table + (u64)id * hidden);
    for (u32 c = threadIdx.x; c < hidden / 8; c += blockDim.x) {
        uint4 v = row[c];
        float4 a = make_float4(bf_lo(v.x), bf_hi(v.x), bf_lo(v.y), bf_hi(v.y));
        float4 b = make_float4(bf_lo(v.z), bf_hi(v.z), bf_lo(v.w), bf_hi(v.w));
        ((float4*)o)[2 * c] = a;
        ((float4*)o)[2 * c + 1] = b;
    }
}

extern "C" __global__ void add_bf16_into_f32(float* __restrict__ acc, const bf16_t* __restrict__ x, u32 n) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) acc[i] += bf2f(x[i]);
}

extern "C" __global__ void add_f32_into_f32(float* __restrict__ acc, const float* __restrict__ x, u32 n) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) acc[i] += x[i];
}

extern "C" __global__ void cast_f32_to_bf16(const float* __restrict__ x, bf16_t* __restrict__ out, u32 n) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = f2bf(x[i]);
}

// SwiGLU of [rows, 2*inter] gate|up rows in format A (the MLP block's:
// swiglu_f16 for an FP16 one), computed in f32 and rounded once to A.
template <class A>
__device__ __forceinline__ void swiglu_rows(const unsigned short* __restrict__ gate_up, unsigned short* __restrict__ out,
                                            u32 rows, u32 inter) {
    u32 n = rows * inter;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        u32 r = i / inter, c = i - r * inter;
        const unsigned short* row = gate_up + (u64)r * 2 * inter;
        float g = A::load(row[c]), u = A::load(row[inter + c]);
        out[i] = A::store(silu(g) * u);
    }
}

extern "C" __global__ void swiglu_bf16(const bf16_t* __restrict__ gate_up, bf16_t* __restrict__ out, u32 rows,
                                       u32 inter) {
    swiglu_rows<ActBf16>(gate_up, out, rows, inter);
}

extern "C" __global__ void swiglu_f16(const f16_t* __restrict__ gate_up, f16_t* __restrict__ out, u32 rows,
                                      u32 inter) {
    swiglu_rows<ActF16>(gate_up, out, rows, inter);
}

// rows[r, c] += bias[c] (f32 bias, in place; f32 sum rounded once for bf16
// rows): the per-expert down bias of a grouped prefill GEMM output.
template <typename T>
__device__ __forceinline__ void add_bias_rows(T* __restrict__ y, const float* __restrict__ bias, u32 rows, u32 cols);
template <>
__device__ __forceinline__ void add_bias_rows<float>(float* __restrict__ y, const float* __restrict__ bias, u32 rows,
                                                     u32 cols) {
    const u64 n = (u64)rows * cols;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        y[i] += bias[i % cols];
}
template <>
__device__ __forceinline__ void add_bias_rows<bf16_t>(bf16_t* __restrict__ y, const float* __restrict__ bias, u32 rows,
                                                      u32 cols) {
    const u64 n = (u64)rows * cols;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        y[i] = f2bf(bf2f(y[i]) + bias[i % cols]);
}

extern "C" __global__ void add_bias_rows_f32(float* __restrict__ y, const float* __restrict__ bias, u32 rows, u32 cols) {
    add_bias_rows<float>(y, bias, rows, cols);
}
extern "C" __global__ void add_bias_rows_bf16(bf16_t* __restrict__ y, const float* __restrict__ bias, u32 rows,
                                              u32 cols) {
    add_bias_rows<bf16_t>(y, bias, rows, cols);
}

// out[r, c] = bf16(x[r, c] + bias[c]): an f32 GEMM/GEMV output plus its
// bias, rounded to bf16 once, the reference engine's rounding point for
// biased q/k/v (add_bias_rows_bf16 on a bf16 GEMM output rounds twice:
// once in the GEMM, once after the bias). Rows on grid y (strided), columns
// on x: no per-element division.
extern "C" __global__ void bias_cast_f32_to_bf16(const float* __restrict__ x, const float* __restrict__ bias,
                                                 bf16_t* __restrict__ out, u32 rows, u32 cols) {
    for (u32 r = blockIdx.y; r < rows; r += gridDim.y) {
        const float* xr = x + (u64)r * cols;
        bf16_t* o = out + (u64)r * cols;
        for (u32 c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x)
            o[c] = f2bf(xr[c] + bias[c]);
    }
}

// The same, rounded once to f16 (the q/k/v of an FP16 attention block).
extern "C" __global__ void bias_cast_f32_to_f16(const float* __restrict__ x, const float* __restrict__ bias,
                                                f16_t* __restrict__ out, u32 rows, u32 cols) {
    for (u32 r = blockIdx.y; r < rows; r += gridDim.y) {
        const float* xr = x + (u64)r * cols;
        f16_t* o = out + (u64)r * cols;
        for (u32 c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x)
            o[c] = f2h(xr[c] + bias[c]);
    }
}
