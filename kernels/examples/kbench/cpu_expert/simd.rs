//! Vector kernels: one output row per lane (vectorizing across rows keeps
//! each row's order), each lane computing what `tile_row` computes: per pass
//! the exact sum when every lane passes `fast_ok` (in f32 when the pass's
//! products fit 24 bits, else f64), otherwise the model itself, vectorized.
//! So every ISA gives the same bits.

use super::model::{BIG, Model, nu, pow2};
use std::arch::x86_64::*;

/// Whether a pass's products sum exactly in f32 (|sum| < 8 n 2^(max+1),
/// every product a multiple of 2^min lsb): then 16 lanes need one f32 FMA
/// per k, and C is added once in f64.
fn f32_exact(n: usize, st: [i32; 2]) -> bool {
    st[0] + 4 + n.trailing_zeros() as i32 - st[1] <= 24
}

#[target_feature(enable = "avx512f")]
fn check512(c: __m512, st: [i32; 2], neab: i32) -> u16 {
    let s1 = _mm512_set1_epi32;
    let ab = _mm512_and_si512(_mm512_castps_si512(c), s1(0x7fff_ffff));
    let z = _mm512_cmpeq_epi32_mask(ab, _mm512_setzero_si512());
    let ec = _mm512_sub_epi32(_mm512_srli_epi32::<23>(ab), s1(127));
    let mant = _mm512_or_si512(_mm512_and_si512(ab, s1(0x7f_ffff)), s1(0x80_0000));
    let low = _mm512_and_si512(mant, _mm512_sub_epi32(_mm512_setzero_si512(), mant));
    let tz = _mm512_sub_epi32(
        _mm512_srli_epi32::<23>(_mm512_castps_si512(_mm512_cvtepi32_ps(low))),
        s1(127),
    );
    let lsb = _mm512_mask_blend_epi32(
        z,
        _mm512_add_epi32(_mm512_sub_epi32(ec, s1(23)), tz),
        s1(BIG),
    );
    let ec = _mm512_mask_blend_epi32(z, ec, s1(-BIG));
    let lhs = _mm512_add_epi32(_mm512_min_epi32(lsb, s1(st[1])), s1(23 + neab));
    _mm512_cmplt_epi32_mask(lhs, _mm512_max_epi32(ec, s1(st[0] + 3)))
}

/// 16 rows at `base + off0 + l * rb` (their 64 bytes of one group).
/// Per pass: if every lane passes `check512`, one f64 FMA chain (exact);
/// else the model itself: products aligned to each lane's largest term
/// (`top` = exponent of the largest magnitude), truncated, summed.
#[target_feature(enable = "avx512f")]
pub fn tile_avx512(
    m: &Model,
    base: *const u8,
    off0: usize,
    rb: usize,
    b: &[f32],
    st: &[[i32; 2]],
    out: &mut [f32],
) {
    match m.n {
        16 => tile512::<16>(m, base, off0, rb, b, st, out),
        8 => tile512::<8>(m, base, off0, rb, b, st, out),
        _ => tile512::<4>(m, base, off0, rb, b, st, out),
    }
}
/// Passes of N products (a constant: the k loops unroll, shifts are immediates).
#[target_feature(enable = "avx512f")]
fn tile512<const N: usize>(
    m: &Model,
    base: *const u8,
    off0: usize,
    rb: usize,
    b: &[f32],
    st: &[[i32; 2]],
    out: &mut [f32],
) {
    let s1 = _mm512_set1_epi32;
    let (n, nb) = (N, 16 / N);
    let (expo, mag) = (_mm512_set1_epi64(0x7ff0 << 48), _mm512_set1_epi64(i64::MAX));
    let wide = _mm512_set1_pd(pow2(23 + m.neab));
    let table = _mm512_setr_ps(
        -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0,
    );
    let (mut c, mut c32) = ([_mm512_setzero_pd(); 2], _mm512_setzero_ps());
    let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let off = _mm512_add_epi32(s1(off0 as i32), _mm512_mullo_epi32(s1(rb as i32), lanes));
    for i in 0..4 {
        let mut w = [_mm512_setzero_si512(); 4];
        for (tq, w) in w.iter_mut().enumerate() {
            let o = _mm512_add_epi32(off, s1((tq * 16 + 4 * i) as i32));
            // SAFETY: the caller's rows hold 64 bytes each at these offsets.
            *w = unsafe { _mm512_i32gather_epi32::<1>(o, base as *const i32) };
        }
        for h in 0..2 {
            let s = 2 * i + h;
            for p in 0..nb {
                // a of pass k as f64, low and high 8 lanes
                let a = |k: usize| {
                    let q =
                        _mm512_srl_epi32(w[(k % 8) / 2], _mm_cvtsi32_si128(4 * nu(k, h) as i32));
                    let a = _mm512_sub_epi32(_mm512_and_si512(q, s1(15)), s1(8));
                    [
                        _mm512_cvtepi32_pd(_mm512_castsi512_si256(a)),
                        _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64::<1>(a)),
                    ]
                };
                let ks = p * n..(p + 1) * n;
                let mut acc = c;
                let stp = st[s * nb + p];
                let fast = check512(c32, stp, m.neab) == 0;
                if fast && f32_exact(n, stp) {
                    // the pass's products summed exactly in f32, then added to C
                    let mut pf = _mm512_setzero_ps();
                    for k in ks {
                        let q = _mm512_srl_epi32(
                            w[(k % 8) / 2],
                            _mm_cvtsi32_si128(4 * nu(k, h) as i32),
                        );
                        pf = _mm512_fmadd_ps(
                            _mm512_permutexvar_ps(q, table),
                            _mm512_set1_ps(b[s * 16 + k]),
                            pf,
                        );
                    }
                    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(pf)));
                    acc = [
                        _mm512_add_pd(c[0], _mm512_cvtps_pd(_mm512_castps512_ps256(pf))),
                        _mm512_add_pd(c[1], _mm512_cvtps_pd(hi)),
                    ];
                } else if fast {
                    for k in ks {
                        let (av, bv) = (a(k), _mm512_set1_pd(b[s * 16 + k] as f64));
                        for j in 0..2 {
                            acc[j] = _mm512_fmadd_pd(av[j], bv, acc[j]);
                        }
                    }
                } else {
                    let and = |x: __m512d, y: __m512i| {
                        _mm512_castsi512_pd(_mm512_and_si512(_mm512_castpd_si512(x), y))
                    };
                    let mut mx = [and(c[0], mag), and(c[1], mag)];
                    for k in ks.clone() {
                        let (av, bv) = (a(k), _mm512_set1_pd(b[s * 16 + k] as f64));
                        for j in 0..2 {
                            let t = if m.unnorm {
                                _mm512_mul_pd(and(av[j], expo), and(bv, expo))
                            } else {
                                _mm512_mul_pd(av[j], bv)
                            };
                            mx[j] = _mm512_max_pd(mx[j], and(t, mag));
                        }
                    }
                    let mut sc = [_mm512_setzero_pd(); 2];
                    for j in 0..2 {
                        let top = and(mx[j], expo);
                        let top = _mm512_mask_blend_pd(
                            _mm512_cmpeq_pd_mask(top, _mm512_setzero_pd()),
                            top,
                            _mm512_set1_pd(1.0),
                        );
                        sc[j] = _mm512_div_pd(wide, top);
                        acc[j] = _mm512_roundscale_pd::<11>(_mm512_mul_pd(c[j], sc[j]));
                    }
                    for k in ks {
                        let (av, bv) = (a(k), _mm512_set1_pd(b[s * 16 + k] as f64));
                        for j in 0..2 {
                            let t = _mm512_mul_pd(_mm512_mul_pd(av[j], bv), sc[j]);
                            acc[j] = _mm512_add_pd(acc[j], _mm512_roundscale_pd::<11>(t));
                        }
                    }
                    for j in 0..2 {
                        acc[j] = _mm512_div_pd(acc[j], sc[j]);
                    }
                }
                const RZ: i32 = _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC;
                let r = if m.rz {
                    [
                        _mm512_cvt_roundpd_ps::<RZ>(acc[0]),
                        _mm512_cvt_roundpd_ps::<RZ>(acc[1]),
                    ]
                } else {
                    [_mm512_cvtpd_ps(acc[0]), _mm512_cvtpd_ps(acc[1])]
                };
                c = [_mm512_cvtps_pd(r[0]), _mm512_cvtps_pd(r[1])];
                let lo512 = _mm512_castpd256_pd512(_mm256_castps_pd(r[0]));
                c32 = _mm512_castpd_ps(_mm512_insertf64x4::<1>(lo512, _mm256_castps_pd(r[1])));
            }
        }
    }
    // SAFETY: out holds 16 floats.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), c32) };
}

#[target_feature(enable = "avx2")]
fn check256(c: __m256, st: [i32; 2], neab: i32) -> u32 {
    let s1 = _mm256_set1_epi32;
    let ab = _mm256_and_si256(_mm256_castps_si256(c), s1(0x7fff_ffff));
    let z = _mm256_cmpeq_epi32(ab, _mm256_setzero_si256());
    let ec = _mm256_sub_epi32(_mm256_srli_epi32::<23>(ab), s1(127));
    let mant = _mm256_or_si256(_mm256_and_si256(ab, s1(0x7f_ffff)), s1(0x80_0000));
    let low = _mm256_and_si256(mant, _mm256_sub_epi32(_mm256_setzero_si256(), mant));
    let tz = _mm256_sub_epi32(
        _mm256_srli_epi32::<23>(_mm256_castps_si256(_mm256_cvtepi32_ps(low))),
        s1(127),
    );
    let lsb = _mm256_blendv_epi8(
        _mm256_add_epi32(_mm256_sub_epi32(ec, s1(23)), tz),
        s1(BIG),
        z,
    );
    let ec = _mm256_blendv_epi8(ec, s1(-BIG), z);
    let lhs = _mm256_add_epi32(_mm256_min_epi32(lsb, s1(st[1])), s1(23 + neab));
    let rhs = _mm256_max_epi32(ec, s1(st[0] + 3));
    _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(rhs, lhs))) as u32
}

/// f64 -> f32, to nearest or toward zero (nearest, then one ulp back in
/// magnitude where that rounded up).
#[target_feature(enable = "avx2")]
fn rnd256(rz: bool, v: __m256d) -> __m128 {
    let r = _mm256_cvtpd_ps(v);
    if !rz {
        return r;
    }
    let sign = _mm256_set1_pd(-0.0);
    let (back, val) = (
        _mm256_andnot_pd(sign, _mm256_cvtps_pd(r)),
        _mm256_andnot_pd(sign, v),
    );
    let gt = _mm256_castpd_si256(_mm256_cmp_pd::<_CMP_GT_OQ>(back, val));
    let gt32 = _mm256_permutevar8x32_epi32(gt, _mm256_setr_epi32(0, 2, 4, 6, 0, 0, 0, 0));
    _mm_castsi128_ps(_mm_add_epi32(
        _mm_castps_si128(r),
        _mm256_castsi256_si128(gt32),
    ))
}

/// `tile_avx512` for 8 rows.
#[target_feature(enable = "avx2,fma")]
pub fn tile_avx2(
    m: &Model,
    base: *const u8,
    off0: usize,
    rb: usize,
    b: &[f32],
    st: &[[i32; 2]],
    out: &mut [f32],
) {
    match m.n {
        16 => tile256::<16>(m, base, off0, rb, b, st, out),
        8 => tile256::<8>(m, base, off0, rb, b, st, out),
        _ => tile256::<4>(m, base, off0, rb, b, st, out),
    }
}
#[target_feature(enable = "avx2,fma")]
fn tile256<const N: usize>(
    m: &Model,
    base: *const u8,
    off0: usize,
    rb: usize,
    b: &[f32],
    st: &[[i32; 2]],
    out: &mut [f32],
) {
    let s1 = _mm256_set1_epi32;
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let off = _mm256_add_epi32(s1(off0 as i32), _mm256_mullo_epi32(s1(rb as i32), lanes));
    let (n, nb) = (N, 16 / N);
    let (expo, mag) = (
        _mm256_set1_epi64x(0x7ff0 << 48),
        _mm256_set1_epi64x(i64::MAX),
    );
    let wide = _mm256_set1_pd(pow2(23 + m.neab));
    let (mut c, mut c32) = ([_mm256_setzero_pd(); 2], _mm256_setzero_ps());
    for i in 0..4 {
        let mut w = [_mm256_setzero_si256(); 4];
        for (tq, w) in w.iter_mut().enumerate() {
            let o = _mm256_add_epi32(off, s1((tq * 16 + 4 * i) as i32));
            // SAFETY: as in tile_avx512.
            *w = unsafe { _mm256_i32gather_epi32::<1>(base as *const i32, o) };
        }
        for h in 0..2 {
            let s = 2 * i + h;
            for p in 0..nb {
                let a = |k: usize| {
                    let q =
                        _mm256_srl_epi32(w[(k % 8) / 2], _mm_cvtsi32_si128(4 * nu(k, h) as i32));
                    let a = _mm256_sub_epi32(_mm256_and_si256(q, s1(15)), s1(8));
                    [
                        _mm256_cvtepi32_pd(_mm256_castsi256_si128(a)),
                        _mm256_cvtepi32_pd(_mm256_extracti128_si256::<1>(a)),
                    ]
                };
                let ks = p * n..(p + 1) * n;
                let mut acc = c;
                let stp = st[s * nb + p];
                let fast = check256(c32, stp, m.neab) == 0;
                if fast && f32_exact(n, stp) {
                    let mut pf = _mm256_setzero_ps();
                    for k in ks {
                        let q = _mm256_srl_epi32(
                            w[(k % 8) / 2],
                            _mm_cvtsi32_si128(4 * nu(k, h) as i32),
                        );
                        let a = _mm256_cvtepi32_ps(_mm256_sub_epi32(
                            _mm256_and_si256(q, s1(15)),
                            s1(8),
                        ));
                        pf = _mm256_fmadd_ps(a, _mm256_set1_ps(b[s * 16 + k]), pf);
                    }
                    let hi = _mm256_extractf128_ps::<1>(pf);
                    acc = [
                        _mm256_add_pd(c[0], _mm256_cvtps_pd(_mm256_castps256_ps128(pf))),
                        _mm256_add_pd(c[1], _mm256_cvtps_pd(hi)),
                    ];
                } else if fast {
                    for k in ks {
                        let (av, bv) = (a(k), _mm256_set1_pd(b[s * 16 + k] as f64));
                        for j in 0..2 {
                            acc[j] = _mm256_fmadd_pd(av[j], bv, acc[j]);
                        }
                    }
                } else {
                    let and = |x: __m256d, y: __m256i| _mm256_and_pd(x, _mm256_castsi256_pd(y));
                    let mut mx = [and(c[0], mag), and(c[1], mag)];
                    for k in ks.clone() {
                        let (av, bv) = (a(k), _mm256_set1_pd(b[s * 16 + k] as f64));
                        for j in 0..2 {
                            let t = if m.unnorm {
                                _mm256_mul_pd(and(av[j], expo), and(bv, expo))
                            } else {
                                _mm256_mul_pd(av[j], bv)
                            };
                            mx[j] = _mm256_max_pd(mx[j], and(t, mag));
                        }
                    }
                    let mut sc = [_mm256_setzero_pd(); 2];
                    for j in 0..2 {
                        let top = and(mx[j], expo);
                        let top = _mm256_blendv_pd(
                            top,
                            _mm256_set1_pd(1.0),
                            _mm256_cmp_pd::<_CMP_EQ_OQ>(top, _mm256_setzero_pd()),
                        );
                        sc[j] = _mm256_div_pd(wide, top);
                        acc[j] = _mm256_round_pd::<11>(_mm256_mul_pd(c[j], sc[j]));
                    }
                    for k in ks {
                        let (av, bv) = (a(k), _mm256_set1_pd(b[s * 16 + k] as f64));
                        for j in 0..2 {
                            let t = _mm256_mul_pd(_mm256_mul_pd(av[j], bv), sc[j]);
                            acc[j] = _mm256_add_pd(acc[j], _mm256_round_pd::<11>(t));
                        }
                    }
                    for j in 0..2 {
                        acc[j] = _mm256_div_pd(acc[j], sc[j]);
                    }
                }
                let r = [rnd256(m.rz, acc[0]), rnd256(m.rz, acc[1])];
                c = [_mm256_cvtps_pd(r[0]), _mm256_cvtps_pd(r[1])];
                c32 = _mm256_set_m128(r[1], r[0]);
            }
        }
    }
    // SAFETY: out holds 8 floats.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), c32) };
}
