//! The FP16 MLP block's kernels (`MlpSpec::activations = F16`, glm4_moe)
//! against their CPU references: the INT4 decode gate/up GEMV reading an
//! f16 x (`int4_w13_swiglu_*_f16`, every entry point, then the unchanged
//! `int4_w2_combine` on its f32 output), the dequantization to f16
//! (`int4_dequant_f16`), the plain and norm-folded f16 GEMVs with f16 and
//! f32 outputs (`gemv_f16_*`, `gemv_rmsnorm_f16_*`), `swiglu_f16` and the
//! row gather of f16 rows (`gather_rows_bf16` copies bit patterns).

use half::f16;
use krasis_kernels::{Int4Layout, reference as cpu};
use rand::seq::SliceRandom;

use crate::common::*;
use crate::int4::{DecodeRun, decode_gemv_matches_cpu, experts};

/// `got` is `want` (an f64-accurate value) rounded to f16, give or take the
/// one f16 ulp a different f32 summation order can move it across.
fn assert_f16_close(what: &str, got: &[f16], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let (a, b) = (a.to_f32(), *b);
        let tol = b.abs().max(6.1e-5) / 1024.0 + 1e-6;
        assert!(
            a.is_finite() && (a - b).abs() <= tol,
            "{what} at {i}: {a} vs {b}"
        );
    }
}

/// A 16-bit y is the same launch's f32 y rounded once (RNE): the f16 and
/// f32 outputs run the same sum, so this holds bit for bit, whatever the
/// summation error of that sum (checked against the reference on the f32
/// y). Comparing the f16 y with the reference directly needs a tolerance
/// for the f32 sum's error on results that cancel, which one f16 ulp is not.
fn assert_rounded_once(what: &str, got: &[f16], f32_y: &[f32]) {
    assert_eq!(got.len(), f32_y.len(), "{what}: length");
    for (i, (a, b)) in got.iter().zip(f32_y).enumerate() {
        assert!(
            a.to_bits() == f16::from_f32(*b).to_bits(),
            "{what} at {i}: {a} is not the f32 result {b} rounded once"
        );
    }
}

/// Every `int4_w13_swiglu_*_f16` entry point (fast 1-4, the two-row-tile
/// 1/2_r32 that several tokens take, general g1-g4, 16-warp w16_3/4;
/// tiny-glm4-moe's 128 x 128 first) against the f64
/// reference over the f16 x, bit-identical run to run, masked pairs left
/// untouched; `int4_w2_combine` on its output; `int4_dequant_f16` equal to
/// the f16 rounding of the exact dequantized value, NaN for an invalid id.
#[test]
fn int4_f16_decode_gemv_and_dequant_match_reference() {
    let name = "int4_f16_decode_gemv_and_dequant_match_reference";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    for (h, i, gs, n_exp, t, k) in [
        (128usize, 128usize, 128usize, 8usize, 1usize, 2usize), // _1_f16 (tiny-glm4-moe)
        (2048, 768, 128, 16, 1, 8),                             // _2_f16
        (2048, 768, 128, 16, 2, 8),                             // _2_r32_f16
        (1024, 256, 128, 6, 3, 4),                              // _1_r32_f16
        (3072, 256, 128, 4, 1, 3),                              // _3_f16
        (4096, 384, 128, 5, 2, 4),                              // _4_f16
        (640, 96, 32, 3, 3, 2),                                 // g1_f16
        (2048, 768, 64, 9, 2, 8),                               // g2_f16
        (2880, 1408, 32, 5, 1, 4),                              // g3_f16
        (4096, 1408, 64, 9, 1, 8),                              // g4_f16 (GLM-4.5-Air-like)
        (5120, 1536, 128, 9, 1, 8),                             // w16_3_f16 (GLM-4.5-like)
        (7168, 2048, 128, 4, 1, 4),                             // w16_4_f16
    ] {
        let tag = format!("H={h} I={i} g={gs}");
        let layout = Int4Layout::new(h, i, gs).unwrap();
        let ex = experts(g, &s, &mut rng, &layout, n_exp);
        let DecodeRun {
            d_x,
            d_ids,
            want_act,
        } = decode_gemv_matches_cpu::<f16>(
            &g.kernels,
            &s,
            &mut rng,
            &ex,
            &layout,
            (n_exp, t, k),
            (
                &tag,
                &format!("w13_f16 {tag}"),
                &format!("w2 after w13_f16 {tag}"),
            ),
        );

        // Masked pairs (slot 0 of each token) are neither read nor written.
        if k >= 2 {
            let mut act = poison_f32(&s, t * k * i);
            g.kernels
                .int4_w13_swiglu(
                    &s, &d_x, &ex.table, &d_ids, t, k, &layout, !1u32, false, &mut act,
                )
                .unwrap();
            let a = down(&s, &act);
            for p in 0..t * k {
                let row = &a[p * i..][..i];
                if p % k == 0 {
                    assert!(
                        row.iter().all(|v| v.is_nan()),
                        "{tag}: masked pair {p} written"
                    );
                } else {
                    let want = &want_act[p * i..][..i];
                    assert_close(&format!("masked w13_f16 {tag} pair {p}"), row, want, 1e-4);
                }
            }
        }

        // Dequantization to f16: the exact value rounded once; NaN past the table.
        let sel: Vec<u32> = vec![(n_exp - 1) as u32, 0, n_exp as u32 + 3];
        let mut o13 = poison_f16(&s, 3 * 2 * i * h);
        let mut o2 = poison_f16(&s, 3 * h * i);
        g.kernels
            .int4_dequant(&s, &ex.table, &up(&s, &sel), 3, &layout, &mut o13, &mut o2)
            .unwrap();
        let (g13, g2) = (down(&s, &o13), down(&s, &o2));
        for (x, &e) in sel[..2].iter().enumerate() {
            let w13: Vec<f16> = ex.w13[e as usize]
                .iter()
                .map(|v| f16::from_f32(*v))
                .collect();
            let w2: Vec<f16> = ex.w2[e as usize]
                .iter()
                .map(|v| f16::from_f32(*v))
                .collect();
            assert!(
                f16_bits(&g13[x * 2 * i * h..][..2 * i * h]) == f16_bits(&w13),
                "dequant_f16 w13 of expert {e} ({tag})"
            );
            assert!(
                f16_bits(&g2[x * h * i..][..h * i]) == f16_bits(&w2),
                "dequant_f16 w2 of expert {e} ({tag})"
            );
        }
        assert!(
            g13[2 * 2 * i * h..].iter().all(|v| v.is_nan()),
            "{tag}: invalid id w13"
        );
        assert!(
            g2[2 * h * i..].iter().all(|v| v.is_nan()),
            "{tag}: invalid id w2"
        );
    }
    sync(&s);
}

/// `gemv_f16_*` (both row shapes, every token bucket) with an f16 output
/// (rounded once), an f32 one and an f32 accumulation; the norm-folded
/// `gemv_rmsnorm_f16_*` with an f16 output (the FP16 dense gate/up), its
/// normed row bit-identical to `rmsnorm_f32_to_f16`'s.
#[test]
fn gemv_f16_outputs_match_reference() {
    let name = "gemv_f16_outputs_match_reference";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let kr = &g.kernels;
    let eps = 1e-5f32;
    // tiny-glm4-moe's shared expert (256 x 128, 128 x 128); GLM-4.5-Air's
    // shared gate/up (2816 x 4096) and down (4096 x 1408).
    for (n, k) in [(256usize, 128usize), (128, 128), (2816, 4096), (4096, 1408)] {
        let w = randn_act::<f16>(&mut rng, n * k, 0.05);
        let wf = f32s(&w);
        let dw = up(&s, &w);
        for m in [1usize, 2, 5, 8] {
            if m * k > krasis_kernels::GEMV_MAX_MK {
                continue;
            }
            let tag = format!("m={m} n={n} k={k}");
            let x = randn_act::<f16>(&mut rng, m * k, 1.0);
            let dx = up(&s, &x);
            let want = cpu::gemv(&f32s(&x), &wf, m, n, k, None);
            let mut yh = poison_f16(&s, m * n + 5);
            kr.gemv::<f16, f16>(&s, &dx, &dw, m, n, k, false, &mut yh)
                .unwrap();
            let got = down(&s, &yh);
            assert!(
                got[m * n..].iter().all(|v| v.is_nan()),
                "{tag}: wrote past y"
            );
            let mut yf = poison_f32(&s, m * n);
            kr.gemv::<f16, f32>(&s, &dx, &dw, m, n, k, false, &mut yf)
                .unwrap();
            let gotf = down(&s, &yf);
            assert_close(&format!("gemv_f16 f32 y {tag}"), &gotf, &want, 1e-5);
            assert_rounded_once(&format!("gemv_f16 f16 y {tag}"), &got[..m * n], &gotf);
            let y0 = randn(&mut rng, m * n, 1.0);
            let mut ya = up(&s, &y0);
            kr.gemv::<f16, f32>(&s, &dx, &dw, m, n, k, true, &mut ya)
                .unwrap();
            let want_acc = cpu::gemv(&f32s(&x), &wf, m, n, k, Some(&y0));
            assert_close(
                &format!("gemv_f16 += {tag}"),
                &down(&s, &ya),
                &want_acc,
                1e-5,
            );

            // The norm-folded one with an f16 y.
            let res = randn(&mut rng, m * k, 3.0);
            let gw = randn_bf16(&mut rng, k, 1.0);
            let (dres, dg) = (up(&s, &res), up(&s, &gw));
            let mut normed = poison_f16(&s, m * k);
            kr.rmsnorm_f32_to_f16(&s, &dres, &dg, m, k, eps, &mut normed)
                .unwrap();
            let nref = down(&s, &normed);
            let mut fnormed = poison_f16(&s, m * k);
            let mut y = poison_f16(&s, m * n);
            kr.gemv_rmsnorm::<f16, f16>(
                &s,
                &dres,
                &dg,
                eps,
                &dw,
                m,
                n,
                k,
                false,
                &mut fnormed,
                &mut y,
            )
            .unwrap();
            assert_eq!(
                f16_bits(&down(&s, &fnormed)),
                f16_bits(&nref),
                "{tag}: normed differs"
            );
            let want = cpu::gemv(&f32s(&nref), &wf, m, n, k, None);
            let mut yf = poison_f32(&s, m * n);
            kr.gemv_rmsnorm::<f16, f32>(
                &s,
                &dres,
                &dg,
                eps,
                &dw,
                m,
                n,
                k,
                false,
                &mut fnormed,
                &mut yf,
            )
            .unwrap();
            let gotf = down(&s, &yf);
            assert_close(&format!("gemv_rmsnorm_f16 f32 y {tag}"), &gotf, &want, 1e-5);
            assert_rounded_once(
                &format!("gemv_rmsnorm_f16 f16 y {tag}"),
                &down(&s, &y),
                &gotf,
            );
        }
    }
    // A 16-bit y cannot accumulate.
    let (x, w) = (up(&s, &[f16::ONE; 8]), up(&s, &[f16::ONE; 8]));
    let mut y = poison_f16(&s, 1);
    assert!(
        kr.gemv::<f16, f16>(&s, &x, &w, 1, 1, 8, true, &mut y)
            .is_err()
    );
    sync(&s);
}

/// `swiglu_f16`: the f32 product rounded once to f16 (within the one ulp
/// device expf can move it), infinite past 65504.
#[test]
fn swiglu_f16_matches_reference() {
    let name = "swiglu_f16_matches_reference";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    for (rows, inter) in [(37usize, 128usize), (5, 1408), (300, 10944)] {
        let mut gu = randn_act::<f16>(&mut rng, rows * 2 * inter, 2.0);
        gu[0] = f16::from_f32(400.0);
        gu[inter] = f16::from_f32(400.0);
        let mut out = poison_f16(&s, rows * inter);
        g.kernels
            .swiglu(&s, &up(&s, &gu), rows, inter, &mut out)
            .unwrap();
        let got = down(&s, &out);
        let want: Vec<f16> = cpu::swiglu_as(&f32s(&gu), inter);
        assert!(got[0].is_infinite() && want[0].is_infinite());
        assert_f16_close(
            &format!("swiglu_f16 {rows}x{inter}"),
            &got[1..],
            &f32s(&want[1..]),
        );
        let differ = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert!(
            differ * 100 <= got.len(),
            "{differ} of {} differ",
            got.len()
        );
    }
    sync(&s);
}

/// `gather_rows` moves f16 rows bit for bit; an index past the source
/// writes NaN (0x7fc0 is a NaN in f16 too).
#[test]
fn gather_rows_f16_copies_bits() {
    let name = "gather_rows_f16_copies_bits";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let (t, k, h) = (50usize, 2usize, 128usize);
    let x = randn_act::<f16>(&mut rng, t * h, 1.0);
    let mut idx: Vec<u32> = (0..(t * k) as u32).collect();
    idx.shuffle(&mut rng);
    idx[3] = (t * k + 7) as u32;
    let mut out = poison_f16(&s, t * k * h);
    g.kernels
        .gather_rows(&s, &up(&s, &x), t, h, &up(&s, &idx), k, t * k, &mut out)
        .unwrap();
    let got = down(&s, &out);
    for (r, &i) in idx.iter().enumerate() {
        let row = &got[r * h..][..h];
        if r == 3 {
            assert!(row.iter().all(|v| v.is_nan()), "invalid row {r}");
        } else {
            let src = i as usize / k;
            assert_eq!(f16_bits(row), f16_bits(&x[src * h..][..h]), "row {r}");
        }
    }
    sync(&s);
}
