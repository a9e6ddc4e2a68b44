// Rotary position embedding: per-head q/k RMSNorm fused with RoPE from
// theta (qk_norm_rope_bf16, Qwen3), and RoPE alone from a precomputed
// frequency table (rope_table_bf16, below).
//
// qk_norm_rope_bf16 design: one warp per (token, head); each lane owns the
// rotation pairs (i, i + d/2) for i = lane + 32*j, so the norm's sum of
// squares is a warp reduction and the rotation needs no data exchange.
// Operates in place on the fused QKV GEMM output [T, (nq + 2*nkv) * d]; q
// heads come first, then k heads, so head index hh < nq + nkv addresses
// both with offset hh*d.
// RoPE follows HF rotate_half: out_i = a_i*cos - b_i*sin,
// out_{i+d/2} = b_i*cos + a_i*sin with inv_freq_i = 1 / theta^(2i/d) and
// angle = f32(pos) * inv_freq_i.
// Precision: norm, weight multiply and rotation in f32 (precise cosf/sinf);
// one rounding to bf16 (HF rounds after the norm, after the weight and
// after the rotation).
// Launch overlap (every kernel here; pdl_* in common.cuh): launched as
// programmatic dependents of the QKV projection on sm_90, so each waits for
// it before touching qkv, after letting the KV append get scheduled.
// Positions (every kernel here): token t is at pos_ptr[t] when the
// positions come from the device (each row of a batched decode step its
// own sequence's position), else at pos_base + t (token_pos, common.cuh).

extern "C" __global__ void qk_norm_rope_bf16(bf16_t* __restrict__ qkv, const bf16_t* __restrict__ qw,
                                             const bf16_t* __restrict__ kw, const u32* __restrict__ pos_ptr,
                                             u32 pos_base, u32 n_tokens, u32 nq, u32 nkv, u32 d, float theta,
                                             float eps) {
    pdl_wait();
    pdl_trigger();
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
    float pos = (float)token_pos(pos_ptr, pos_base, t);
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

// RoPE without a q/k norm, from a precomputed inverse-frequency table
// (gpt-oss; any family whose q/k enter RoPE straight from the projection).
//
// Design: the layout and threading of qk_norm_rope_bf16 (one warp per
// (token, head), lane owns the pairs (i, i + d/2) for i = lane + 32*j), but
// the frequencies come from `inv_freq` [d/2] f32, which the host computes
// once per model (default RoPE or YaRN's blended frequencies), and cos/sin
// are multiplied by `scale` (YaRN's attention factor; 1 for default RoPE).
// One kernel then serves every RoPE variant that is "frequencies + scale";
// qk_norm_rope_bf16 stays as it was so qwen3's hot path is untouched.
// Arithmetic: exactly the reference engine's (krasis_model::layers::rope):
// angle = f32(pos) * inv_freq[i] (one f32 multiply), c = cos(angle)*scale,
// s = sin(angle)*scale, out = a*c - b*s and b*c + a*s with each product
// and difference rounded separately (__fmul_rn/__fsub_rn/__fadd_rn, so
// --fmad cannot contract them where the host does not), one rounding to
// bf16. The only difference from the host is cos/sin themselves: the
// precise (non fast-math) device sincosf is within 2 ulp over the full
// range (CUDA Programming Guide, "Mathematical Functions", single
// precision; the large-argument path does exact Payne-Hanek reduction, so
// angles up to 131071 rad at position 131071 stay accurate), and glibc's
// cosf/sinf within 1 ulp. That is <= ~3 * 2^-24 absolute on values in
// [-1, 1], far below the final bf16 rounding (2^-9 relative), so a result
// can differ from the host's only where the f32 value sits within a few
// f32 ulp of a bf16 rounding boundary, and then by one bf16 ulp.

// rope_table_f16: the same over f16 q/k (ActFormat::F16, gpt-oss): read
// f16, the same f32 arithmetic, one rounding to f16. The template over the
// format (ActBf16 / ActF16, common.cuh) leaves rope_table_bf16's code as it
// was.
template <class A>
__device__ __forceinline__ void rope_table_t(unsigned short* __restrict__ qkv, const float* __restrict__ inv_freq,
                                             float scale, const u32* __restrict__ pos_ptr, u32 pos_base,
                                             u32 n_tokens, u32 nq, u32 nkv, u32 d) {
    pdl_wait();
    pdl_trigger();
    u32 t = blockIdx.x;
    u32 hh = blockIdx.y * 4 + (threadIdx.x >> 5);
    u32 lane = threadIdx.x & 31;
    if (t >= n_tokens || hh >= nq + nkv) return;
    u32 stride = (nq + 2 * nkv) * d;
    unsigned short* x = qkv + (u64)t * stride + (u64)hh * d;
    u32 half = d / 2, np = d / 64;  // pairs per lane (d % 64 == 0, d <= 256)
    float pos = (float)token_pos(pos_ptr, pos_base, t);
#pragma unroll
    for (u32 j = 0; j < 4; ++j) {
        if (j < np) {
            u32 i = lane + 32 * j;
            float a = A::load(x[i]), b = A::load(x[i + half]);
            float ang = __fmul_rn(pos, inv_freq[i]);
            float sn, cs;
            sincosf(ang, &sn, &cs);  // one shared range reduction
            float c = __fmul_rn(cs, scale), s = __fmul_rn(sn, scale);
            x[i] = A::store(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
            x[i + half] = A::store(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
        }
    }
}

extern "C" __global__ void rope_table_bf16(bf16_t* __restrict__ qkv, const float* __restrict__ inv_freq, float scale,
                                           const u32* __restrict__ pos_ptr, u32 pos_base, u32 n_tokens, u32 nq,
                                           u32 nkv, u32 d) {
    rope_table_t<ActBf16>(qkv, inv_freq, scale, pos_ptr, pos_base, n_tokens, nq, nkv, d);
}

extern "C" __global__ void rope_table_f16(f16_t* __restrict__ qkv, const float* __restrict__ inv_freq, float scale,
                                          const u32* __restrict__ pos_ptr, u32 pos_base, u32 n_tokens, u32 nq, u32 nkv,
                                          u32 d) {
    rope_table_t<ActF16>(qkv, inv_freq, scale, pos_ptr, pos_base, n_tokens, nq, nkv, d);
}

// Partial rotary (glm4_moe, partial_rotary_factor 0.5): only the first `rot`
// dimensions of each head rotate, the rest pass through, optionally after
// a per-head q/k RMSNorm over the whole head (tiny-glm4-moe has q/k norms,
// GLM-4.5-Air does not). A separate entry point so the full-head kernels
// above keep their machine code.
//
// Convention (transformers' glm4_moe apply_rotary_pos_emb: q_rot = q[..., :rot],
// q_pass = q[..., rot:]): rotate_half within the rotary part, so element
// i < rot/2 pairs with i + rot/2 (not i + d/2), at the table's frequencies
// inv_freq[rot/2], which the host computes over `rot` (theta^(-2i/rot)).
//
// Design: one warp per (token, head). Lane owns the rotation pairs
// (i, i + rot/2) for i = lane + 32*j (j < 4, i < rot/2; rot/2 <= 128) and
// the pass-through elements rot + lane + 32*j (j < 8, < d), so the norm's
// sum of squares over all d is a warp reduction and the rotation needs no
// data exchange. Without a norm (qw == nullptr) the pass-through elements
// are not touched. Arithmetic: the norm as qk_norm_rope_bf16 (f32,
// rsqrtf), the rotation exactly as rope_table_bf16 (one f32 angle
// multiply, sincosf, separately rounded products), one rounding to bf16.

extern "C" __global__ void rope_partial_bf16(bf16_t* __restrict__ qkv, const bf16_t* __restrict__ qw,
                                             const bf16_t* __restrict__ kw, const float* __restrict__ inv_freq,
                                             float scale, const u32* __restrict__ pos_ptr, u32 pos_base,
                                             u32 n_tokens, u32 nq, u32 nkv, u32 d, u32 rot, float eps) {
    pdl_wait();
    pdl_trigger();
    u32 t = blockIdx.x;
    u32 hh = blockIdx.y * 4 + (threadIdx.x >> 5);
    u32 lane = threadIdx.x & 31;
    if (t >= n_tokens || hh >= nq + nkv) return;
    u32 stride = (nq + 2 * nkv) * d;
    bf16_t* x = qkv + (u64)t * stride + (u64)hh * d;
    const bf16_t* w = qw ? (hh < nq ? qw : kw) : nullptr;
    u32 half = rot / 2;
    float a[4], b[4], p[8];
    float ss = 0.0f;
#pragma unroll
    for (u32 j = 0; j < 4; ++j) {
        u32 i = lane + 32 * j;
        if (i < half) {
            a[j] = bf2f(x[i]);
            b[j] = bf2f(x[i + half]);
            ss += a[j] * a[j] + b[j] * b[j];
        }
    }
#pragma unroll
    for (u32 j = 0; j < 8; ++j) {
        u32 i = rot + lane + 32 * j;
        if (w && i < d) {
            p[j] = bf2f(x[i]);
            ss += p[j] * p[j];
        }
    }
    float inv = 1.0f;
    if (w) {
        ss = warp_sum(ss);
        inv = rsqrtf(ss / (float)d + eps);
#pragma unroll
        for (u32 j = 0; j < 8; ++j) {
            u32 i = rot + lane + 32 * j;
            if (i < d) x[i] = f2bf(p[j] * inv * bf2f(w[i]));
        }
    }
    float pos = (float)token_pos(pos_ptr, pos_base, t);
#pragma unroll
    for (u32 j = 0; j < 4; ++j) {
        u32 i = lane + 32 * j;
        if (i < half) {
            float an = w ? a[j] * inv * bf2f(w[i]) : a[j];
            float bn = w ? b[j] * inv * bf2f(w[i + half]) : b[j];
            float ang = __fmul_rn(pos, inv_freq[i]);
            float sn, cs;
            sincosf(ang, &sn, &cs);
            float c = __fmul_rn(cs, scale), s = __fmul_rn(sn, scale);
            x[i] = f2bf(__fsub_rn(__fmul_rn(an, c), __fmul_rn(bn, s)));
            x[i + half] = f2bf(__fadd_rn(__fmul_rn(bn, c), __fmul_rn(an, s)));
        }
    }
}
