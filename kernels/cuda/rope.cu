// Per-head q/k RMSNorm fused with rotary position embedding (Qwen3).
//
// Design: one warp per (token, head); each lane owns the rotation pairs
// (i, i + d/2) for i = lane + 32*j, so the norm's sum of squares is a warp
// reduction and the rotation needs no data exchange. Operates in place on
// the fused QKV GEMM output [T, (nq + 2*nkv) * d]; q heads come first, then
// k heads, so head index hh < nq + nkv addresses both with offset hh*d.
// RoPE follows HF rotate_half: out_i = a_i*cos - b_i*sin,
// out_{i+d/2} = b_i*cos + a_i*sin with inv_freq_i = 1 / theta^(2i/d) and
// angle = f32(pos) * inv_freq_i.
// Precision: norm, weight multiply and rotation in f32 (precise cosf/sinf);
// one rounding to bf16 (HF rounds after the norm, after the weight and
// after the rotation).

extern "C" __global__ void qk_norm_rope_bf16(bf16_t* __restrict__ qkv, const bf16_t* __restrict__ qw,
                                             const bf16_t* __restrict__ kw, const u32* __restrict__ pos_ptr,
                                             u32 pos_base, u32 n_tokens, u32 nq, u32 nkv, u32 d, float theta,
                                             float eps) {
    u32 t = blockIdx.x;
    u32 hh = blockIdx.y * 4 + (threadIdx.x >> 5);
    u32 lane = threadIdx.x & 31;
    if (t >= n_tokens || hh >= nq + nkv) return;
    u32 stride = (nq + 2 * nkv) * d;
    bf16_t* x = qkv + (u64)t * stride + (u64)hh * d;
    const bf16_t* w = hh < nq ? qw : kw;
    u32 half = d / 2, np = d / 64;  // pairs per lane (d % 64 == 0, d <= 256)
    float a[4], b[4];
    float ss = 0.0f;
#pragma unroll
    for (u32 j = 0; j < 4; ++j) {
        if (j < np) {
            u32 i = lane + 32 * j;
            a[j] = bf2f(x[i]);
            b[j] = bf2f(x[i + half]);
            ss += a[j] * a[j] + b[j] * b[j];
        }
    }
    ss = warp_sum(ss);
    float inv = rsqrtf(ss / (float)d + eps);
    float pos = (float)((pos_ptr ? *pos_ptr : 0u) + pos_base + t);
#pragma unroll
    for (u32 j = 0; j < 4; ++j) {
        if (j < np) {
            u32 i = lane + 32 * j;
            float an = a[j] * inv * bf2f(w[i]);
            float bn = b[j] * inv * bf2f(w[i + half]);
            float inv_freq = 1.0f / powf(theta, (float)(2 * i) / (float)d);
            float ang = pos * inv_freq;
            float c = cosf(ang), s = sinf(ang);
            x[i] = f2bf(an * c - bn * s);
            x[i + half] = f2bf(bn * c + an * s);
        }
    }
}
