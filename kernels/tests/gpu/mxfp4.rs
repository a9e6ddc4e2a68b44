//! MXFP4 expert kernels against `reference::mxfp4` (and `add_bias_rows`,
//! the prefill down bias).
//!
//! Tolerances: the decoded weights are exact in bf16 and x is bf16, so the
//! gate/up products are exact and only the f32 accumulation order differs
//! from the f64 reference (~1e-6 relative); the down GEMV sees act as bf16
//! hi + lo (16 significant bits, ~2^-17 relative per element). So every
//! element must be within 1e-3 relative + 1e-3 * rms(reference) absolute
//! (the norm-wise bound of the INT4 tests is 1e-4), while one wrongly
//! decoded code (a weight ~0.03 off, x ~1) moves a dot product of rms ~1.5
//! by ~2e-2, a sign or nibble-order error by far more. Dequantization is
//! compared bit for bit.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use half::bf16;
use krasis_kernels::ops::mxfp4::{ExpertActivation, Mxfp4Layout};
use krasis_kernels::reference::{self as cpu, Mxfp4Expert};
use rand::Rng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use std::ops::RangeInclusive;
use std::sync::Arc;

use crate::common::*;

pub const GPT_OSS: ExpertActivation = ExpertActivation::ClampedSwiglu {
    limit: 7.0,
    alpha: 1.702,
};

fn random_expert(rng: &mut StdRng, l: &Mxfp4Layout, scales: &RangeInclusive<u8>) -> Mxfp4Expert {
    let (h, i) = (l.hidden, l.intermediate);
    let bytes = |rng: &mut StdRng, n: usize| {
        let mut v = vec![0u8; n];
        rng.fill(&mut v[..]);
        v
    };
    let sc = |rng: &mut StdRng, n: usize| {
        (0..n)
            .map(|_| rng.random_range(scales.clone()))
            .collect::<Vec<u8>>()
    };
    let bias = |rng: &mut StdRng, n: usize| {
        if l.has_bias {
            randn_bf16(rng, n, 0.5)
        } else {
            vec![]
        }
    };
    Mxfp4Expert {
        w13_q: bytes(rng, i * h),
        w13_s: sc(rng, 2 * i * h / 32),
        w13_b: bias(rng, 2 * i),
        w2_q: bytes(rng, h * i / 2),
        w2_s: sc(rng, h * i / 32),
        w2_b: bias(rng, h),
    }
}

/// `n` random experts in one device buffer, 4096-aligned, and the pointer
/// table addressing them (reversed, so table index != storage order).
pub struct Experts {
    _buf: CudaSlice<u8>,
    pub table: CudaSlice<u64>,
    pub host: Vec<Mxfp4Expert>,
}

pub fn experts(
    s: &Arc<CudaStream>,
    rng: &mut StdRng,
    l: &Mxfp4Layout,
    n: usize,
    scales: RangeInclusive<u8>,
) -> Experts {
    let stride = l.used_bytes().div_ceil(4096) * 4096;
    let mut block = vec![0u8; n * stride];
    let mut host = Vec::new();
    for e in 0..n {
        let ex = random_expert(rng, l, &scales);
        ex.write(&mut block[e * stride..(e + 1) * stride], l);
        host.push(ex);
    }
    let buf = up(s, &block);
    let base = {
        let (p, _g) = buf.device_ptr(s);
        p
    };
    let table: Vec<u64> = (0..n)
        .map(|e| base + ((n - 1 - e) * stride) as u64)
        .collect();
    host.reverse();
    Experts {
        _buf: buf,
        table: up(s, &table),
        host,
    }
}

/// Per element `|got - want| <= rtol * |want| + atol_rms * rms(want)`; no
/// NaN/inf, and not all zero (an unwritten or skipped output fails).
pub fn assert_close_elem(what: &str, got: &[f32], want: &[f32], rtol: f64, atol_rms: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let rms = (want.iter().map(|&w| (w as f64).powi(2)).sum::<f64>() / want.len() as f64).sqrt();
    assert!(
        rms > 0.0,
        "{what}: the reference is all zero (bad test data)"
    );
    assert!(
        got.iter().any(|&v| v != 0.0),
        "{what}: the output is all zero"
    );
    let atol = atol_rms * rms;
    let mut worst = (0f64, 0usize);
    for (n, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what}: element {n} is {g}; want {w}");
        let d = (g as f64 - w as f64).abs();
        let lim = rtol * (w as f64).abs() + atol;
        assert!(
            d <= lim,
            "{what}: element {n}: got {g} want {w} (|d| {d:.3e} > {lim:.3e})"
        );
        if d > worst.0 {
            worst = (d, n);
        }
    }
    eprintln!(
        "{what}: rms {rms:.3e}, max abs err {:.3e} at {}",
        worst.0, worst.1
    );
}

fn random_ids(rng: &mut StdRng, t: usize, k: usize, n_exp: usize) -> Vec<u32> {
    let mut ids = Vec::new();
    for _ in 0..t {
        let mut all: Vec<u32> = (0..n_exp as u32).collect();
        all.shuffle(rng);
        ids.extend_from_slice(&all[..k]);
    }
    ids
}

/// One decode step (w13 + w2) on the GPU vs the reference, twice for
/// bit-reproducibility, then the dequantization of three experts.
#[allow(clippy::too_many_arguments)]
fn check_decode(
    g: &Gpu,
    s: &Arc<CudaStream>,
    rng: &mut StdRng,
    l: &Mxfp4Layout,
    n_exp: usize,
    t: usize,
    k: usize,
    a: ExpertActivation,
    scales: RangeInclusive<u8>,
    x_std: f32,
) {
    let (h, i) = (l.hidden, l.intermediate);
    let what = format!("H={h} I={i} t={t} k={k} bias={} {a:?}", l.has_bias);
    let ex = experts(s, rng, l, n_exp, scales);
    let ids = random_ids(rng, t, k, n_exp);
    let weights: Vec<f32> = (0..t * k).map(|_| rng.random_range(0.0..1.0)).collect();
    let x = randn_bf16(rng, t * h, x_std);
    let xf = f32s(&x);
    let (d_ids, d_w, d_x) = (up(s, &ids), up(s, &weights), up(s, &x));
    let res0 = randn(rng, t * h, 1.0);
    let mut runs = Vec::new();
    for _ in 0..2 {
        let mut act = poison_f32(s, t * k * i);
        g.kernels
            .mxfp4_w13_act(
                s,
                &d_x,
                &ex.table,
                &d_ids,
                t,
                k,
                l,
                u32::MAX,
                false,
                a,
                &mut act,
            )
            .unwrap();
        let mut res = up(s, &res0);
        g.kernels
            .mxfp4_w2_combine(s, &act, &ex.table, &d_ids, &d_w, t, k, l, &mut res)
            .unwrap();
        runs.push((down(s, &act), down(s, &res)));
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(
        bits(&runs[0].0) == bits(&runs[1].0) && bits(&runs[0].1) == bits(&runs[1].1),
        "{what}: two runs differ"
    );
    let (act, res) = runs.swap_remove(0);

    // Reference; each used expert decoded once (the big shapes do not fit
    // decoded all at once).
    let mut want_act = vec![0f32; t * k * i];
    let mut contrib = vec![0f64; t * h];
    let mut used: Vec<u32> = ids.clone();
    used.sort();
    used.dedup();
    for &e in &used {
        let d = ex.host[e as usize].decode(l);
        for p in (0..t * k).filter(|&p| ids[p] == e) {
            let tok = p / k;
            let (ac, y) = cpu::mxfp4_expert_forward(&d, h, i, &xf[tok * h..][..h], a);
            want_act[p * i..][..i].copy_from_slice(&ac);
            // The GPU sums over j in order; the f64 sum is order-free enough.
            for n in 0..h {
                contrib[tok * h + n] += weights[p] as f64 * y[n] as f64;
            }
        }
    }
    assert_close_elem(&format!("w13 act {what}"), &act, &want_act, 1e-3, 1e-3);
    let got: Vec<f32> = res.iter().zip(&res0).map(|(a, b)| a - b).collect();
    let want: Vec<f32> = contrib.iter().map(|&c| c as f32).collect();
    assert_close_elem(&format!("w2 combine {what}"), &got, &want, 1e-3, 1e-3);
}

/// Dequantize three experts, bit-exact against the reference (NaN = NaN).
fn check_dequant(g: &Gpu, s: &Arc<CudaStream>, ex: &Experts, l: &Mxfp4Layout) {
    let (h, i) = (l.hidden, l.intermediate);
    let n_exp = ex.host.len();
    let sel: Vec<u32> = vec![(n_exp - 1) as u32, 0, (n_exp / 2) as u32];
    let mut o13 = poison_bf16(s, 3 * 2 * i * h);
    let mut o2 = poison_bf16(s, 3 * h * i);
    let (mut b13, mut b2) = (poison_f32(s, 3 * 2 * i), poison_f32(s, 3 * h));
    let biases = l.has_bias.then_some((&mut b13, &mut b2));
    g.kernels
        .mxfp4_dequant(s, &ex.table, &up(s, &sel), 3, l, &mut o13, &mut o2, biases)
        .unwrap();
    let (g13, g2) = (down(s, &o13), down(s, &o2));
    let (gb13, gb2) = (down(s, &b13), down(s, &b2));
    let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
    for (x, &e) in sel.iter().enumerate() {
        let d = ex.host[e as usize].decode(l);
        for (what, got, want) in [
            ("w13", &g13[x * 2 * i * h..][..2 * i * h], &d.w13),
            ("w2", &g2[x * h * i..][..h * i], &d.w2),
        ] {
            for (n, (gv, wv)) in got.iter().zip(want.iter()).enumerate() {
                // The exact value rounded once to bf16 (exact here: two
                // significant bits).
                let w = bf16::from_f32(*wv).to_f32();
                assert!(
                    same(gv.to_f32(), w),
                    "dequant {what} of expert {e}, element {n}: {gv} vs {w}"
                );
            }
        }
        if l.has_bias {
            assert_eq!(gb13[x * 2 * i..][..2 * i], d.b13[..], "b13 of expert {e}");
            assert_eq!(gb2[x * h..][..h], d.b2[..], "b2 of expert {e}");
        }
    }
}

#[test]
fn mxfp4_decode_matches_reference() {
    let name = "mxfp4_decode_matches_reference";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    // gpt-oss-20b (32 experts, top-4) at 1 and 8 tokens, with and without
    // biases, both activations; 4096 x 1408; then shapes covering every
    // entry point: NCL 1 (H 1024), 2 (H 2048), 3 (H 2880), 4 with 8, 14
    // and 16 warps (H 4096, 7168, 8192), w2 with 2 and 4 tiles per item,
    // partial 128-K tiles (2880, 1408) and its chunked act staging (I 4096,
    // top_k 16: two chunks of 8); I 1280 at top_k 7 stages 70 tiles
    // (40,320 bytes), which with the static partials, entries and biases
    // passes 48 KB only by ~500 bytes (a host count that missed the entries
    // and biases did not opt in, and the launch failed).
    // Scales 118..=123 keep |w| <= 0.375 so gate/up (rms ~1.5) cross the
    // clamp limit 7 only sometimes.
    let sc = 118..=123u8;
    let cases: [(usize, usize, bool, usize, usize, usize, ExpertActivation); 12] = [
        (2880, 2880, true, 32, 1, 4, GPT_OSS),
        (2880, 2880, true, 32, 8, 4, GPT_OSS),
        (2880, 2880, false, 32, 2, 4, ExpertActivation::Swiglu),
        (2880, 2880, true, 32, 3, 4, ExpertActivation::Swiglu),
        (4096, 1408, false, 16, 1, 8, ExpertActivation::Swiglu),
        (4096, 1408, true, 16, 3, 8, GPT_OSS),
        (1024, 256, true, 6, 5, 2, GPT_OSS),
        (2048, 768, false, 16, 2, 16, ExpertActivation::Swiglu),
        (7168, 2048, true, 9, 2, 8, GPT_OSS),
        (8192, 1024, true, 6, 2, 4, GPT_OSS),
        (1024, 4096, false, 16, 1, 16, ExpertActivation::Swiglu),
        (1024, 1280, true, 8, 2, 7, GPT_OSS),
    ];
    for (h, i, bias, n_exp, t, k, a) in cases {
        let l = Mxfp4Layout::new(h, i, bias).unwrap();
        check_decode(g, &s, &mut rng, &l, n_exp, t, k, a, sc.clone(), 1.0);
    }
    // Dequantization at gpt-oss-20b's shape and 4096 x 1408.
    for (h, i, bias) in [(2880, 2880, true), (4096, 1408, false)] {
        let l = Mxfp4Layout::new(h, i, bias).unwrap();
        let ex = experts(&s, &mut rng, &l, 4, sc.clone());
        check_dequant(g, &s, &ex, &l);
    }
}

#[test]
fn mxfp4_scales_beyond_two_and_all_scale_bytes() {
    let name = "mxfp4_scales_beyond_two_and_all_scale_bytes";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    // Scales up to 2^13 take the kernels' two-step (s > 128) path; x is
    // small so the products stay moderate.
    let l = Mxfp4Layout::new(512, 256, true).unwrap();
    check_decode(
        g,
        &s,
        &mut rng,
        &l,
        4,
        2,
        3,
        GPT_OSS,
        115..=140,
        2f32.powi(-9),
    );
    check_decode(
        g,
        &s,
        &mut rng,
        &l,
        4,
        1,
        4,
        ExpertActivation::Swiglu,
        120..=135,
        2f32.powi(-7),
    );
    // Dequantization of every scale byte 0..=255 (255 -> NaN, 0 -> 2^-127,
    // 253/254 overflowing to +-inf where the code is large).
    let ex = experts(&s, &mut rng, &l, 3, 0..=255);
    check_dequant(g, &s, &ex, &l);
}

#[test]
fn mxfp4_invalid_expert_is_nan() {
    let name = "mxfp4_invalid_expert_is_nan";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let (h, i) = (2880, 2880);
    let l = Mxfp4Layout::new(h, i, true).unwrap();
    let ex = experts(&s, &mut rng, &l, 2, 118..=123);
    // Token 0: a valid expert and id 7 past the 2-entry table; token 1:
    // both valid.
    let ids = vec![0u32, 7, 1, 0];
    let x = randn_bf16(&mut rng, 2 * h, 1.0);
    let mut act = poison_f32(&s, 4 * i);
    let d_ids = up(&s, &ids);
    g.kernels
        .mxfp4_w13_act(
            &s,
            &up(&s, &x),
            &ex.table,
            &d_ids,
            2,
            2,
            &l,
            u32::MAX,
            false,
            GPT_OSS,
            &mut act,
        )
        .unwrap();
    let a = down(&s, &act);
    assert!(
        a[..i].iter().all(|v| v.is_finite()),
        "valid expert must be finite"
    );
    assert!(
        a[i..2 * i].iter().all(|v| v.is_nan()),
        "invalid expert must be NaN"
    );
    assert!(
        a[2 * i..].iter().all(|v| v.is_finite()),
        "token 1 must be finite"
    );
    // The down GEMV: token 0's residual row turns NaN, token 1's does not.
    let act_ok = up(&s, &randn(&mut rng, 4 * i, 1.0));
    let mut res = up(&s, &vec![0f32; 2 * h]);
    g.kernels
        .mxfp4_w2_combine(
            &s,
            &act_ok,
            &ex.table,
            &d_ids,
            &up(&s, &[0.5f32; 4]),
            2,
            2,
            &l,
            &mut res,
        )
        .unwrap();
    let r = down(&s, &res);
    assert!(
        r[..h].iter().all(|v| v.is_nan()),
        "token with a bad id must be NaN"
    );
    assert!(
        r[h..].iter().all(|v| v.is_finite()),
        "other token must be finite"
    );
    // Dequantization of a bad id: NaN weights and biases.
    let (mut o13, mut o2) = (poison_bf16(&s, 2 * i * h), poison_bf16(&s, h * i));
    let (mut b13, mut b2) = (up(&s, &vec![0f32; 2 * i]), up(&s, &vec![0f32; h]));
    g.kernels
        .mxfp4_dequant(
            &s,
            &ex.table,
            &up(&s, &[9u32]),
            1,
            &l,
            &mut o13,
            &mut o2,
            Some((&mut b13, &mut b2)),
        )
        .unwrap();
    assert!(down(&s, &o13).iter().all(|v| v.is_nan()));
    assert!(down(&s, &b2).iter().all(|v| v.is_nan()));
}

#[test]
fn mxfp4_w13_slot_mask() {
    let name = "mxfp4_w13_slot_mask";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let (h, i, n_exp, t, k) = (2880usize, 2880usize, 10usize, 3usize, 4usize);
    let l = Mxfp4Layout::new(h, i, true).unwrap();
    let ex = experts(&s, &mut rng, &l, n_exp, 118..=123);
    // Table entries past the real experts: NULL and a 16-byte aligned
    // address that faults if it is ever read.
    let mut table = down(&s, &ex.table);
    let (null_id, bad_id) = (table.len() as u32, table.len() as u32 + 1);
    table.push(0);
    table.push(0x0000_7ead_beef_0000);
    let table = up(&s, &table);
    let x = randn_bf16(&mut rng, t * h, 1.0);
    let xf = f32s(&x);
    let d_x = up(&s, &x);
    for (mask, masked_out_ids) in [
        (0b0110u32, None),
        (0b1001, Some((null_id, bad_id))),
        (0, Some((bad_id, bad_id))),
        (0xFFFF_FFF0 | 0b0100, Some((bad_id, u32::MAX))),
    ] {
        let mut ids = random_ids(&mut rng, t, k, n_exp);
        for (p, id) in ids.iter_mut().enumerate() {
            if mask >> (p % k) & 1 == 0
                && let Some((a, b)) = masked_out_ids
            {
                *id = if p % 2 == 0 { a } else { b };
            }
        }
        let mut act = poison_f32(&s, t * k * i);
        g.kernels
            .mxfp4_w13_act(
                &s,
                &d_x,
                &table,
                &up(&s, &ids),
                t,
                k,
                &l,
                mask,
                false,
                GPT_OSS,
                &mut act,
            )
            .unwrap();
        sync(&s);
        let got = down(&s, &act);
        let (mut got_in, mut want_in) = (Vec::new(), Vec::new());
        for p in 0..t * k {
            let row = &got[p * i..][..i];
            if mask >> (p % k) & 1 == 0 {
                assert!(
                    row.iter().all(|v| v.is_nan()),
                    "mask {mask:#x}: masked-out pair {p} was written"
                );
            } else {
                let d = ex.host[ids[p] as usize].decode(&l);
                let (a, _) = cpu::mxfp4_expert_forward(&d, h, i, &xf[(p / k) * h..][..h], GPT_OSS);
                got_in.extend_from_slice(row);
                want_in.extend(a);
            }
        }
        if !want_in.is_empty() {
            assert_close_elem(
                &format!("masked w13 mask {mask:#x}"),
                &got_in,
                &want_in,
                1e-3,
                1e-3,
            );
        }
    }
}

#[test]
fn bias_act_and_add_bias_rows_match_reference() {
    let name = "bias_act_and_add_bias_rows_match_reference";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let (rows, inter) = (37usize, 2880usize);
    // Gate/up spread wide enough (std 6) to hit both clamps often.
    let gu = randn(&mut rng, rows * 2 * inter, 6.0);
    let gu_bf = cpu::to_bf16(&gu);
    let b13 = randn(&mut rng, 2 * inter, 1.0);
    let d_b13 = up(&s, &b13);
    for a in [ExpertActivation::Swiglu, GPT_OSS] {
        for with_bias in [false, true] {
            for as_bf16 in [false, true] {
                let src: Vec<f32> = if as_bf16 { f32s(&gu_bf) } else { gu.clone() };
                let mut out = poison_bf16(&s, rows * inter);
                let b: Option<&dyn DevicePtr<f32>> = if with_bias { Some(&d_b13) } else { None };
                if as_bf16 {
                    g.kernels
                        .bias_act_rows(&s, &up(&s, &gu_bf), b, rows, inter, a, &mut out)
                        .unwrap();
                } else {
                    g.kernels
                        .bias_act_rows(&s, &up(&s, &gu), b, rows, inter, a, &mut out)
                        .unwrap();
                }
                let got = f32s(&down(&s, &out));
                let mut clamped = 0;
                for r in 0..rows {
                    for c in 0..inter {
                        let bias = |n: usize| if with_bias { b13[n] as f64 } else { 0.0 };
                        let gt = src[r * 2 * inter + c] as f64 + bias(c);
                        let u = src[r * 2 * inter + inter + c] as f64 + bias(inter + c);
                        clamped += usize::from(gt > 7.0 || u.abs() > 7.0);
                        let want = cpu::expert_activation(a, gt, u) as f32;
                        let gv = got[r * inter + c];
                        // One bf16 rounding of an f32 result.
                        assert!(
                            (gv - want).abs() <= 2f32.powi(-8) * want.abs() + 1e-5,
                            "{a:?} bias={with_bias} bf16={as_bf16} [{r},{c}]: {gv} vs {want}"
                        );
                    }
                }
                assert!(clamped > rows, "the data must exercise the clamps");
            }
        }
    }
    // add_bias_rows: f32 exact, bf16 one rounding of the f32 sum.
    let (m, n) = (19usize, 2880usize);
    let y = randn(&mut rng, m * n, 1.0);
    let bias = randn(&mut rng, n, 1.0);
    let d_bias = up(&s, &bias);
    let mut dy = up(&s, &y);
    g.kernels.add_bias_rows(&s, &mut dy, &d_bias, m, n).unwrap();
    let got = down(&s, &dy);
    for (k, v) in got.iter().enumerate() {
        assert_eq!(*v, y[k] + bias[k % n], "add_bias_rows f32 at {k}");
    }
    let yb = cpu::to_bf16(&y);
    let mut dyb = up(&s, &yb);
    g.kernels
        .add_bias_rows(&s, &mut dyb, &d_bias, m, n)
        .unwrap();
    let got = down(&s, &dyb);
    for (k, v) in got.iter().enumerate() {
        assert_eq!(
            *v,
            bf16::from_f32(yb[k].to_f32() + bias[k % n]),
            "add_bias_rows bf16 at {k}"
        );
    }
}
