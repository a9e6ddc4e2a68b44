use cudarc::driver::CudaSlice;
use half::bf16;
use krasis_kernels::{GEMV_MAX_MK, GEMV_MAX_TOKENS, GemvForm, reference as cpu};

use crate::common::*;

fn bits32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn bits16(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// (n, k) shapes: the brief's grid plus edges: many rows per block and per
/// warp (20000), K not a multiple of 256 (264: a partial lane set; 4104: a
/// second chunk of one vector), and the largest K (4 chunks).
fn shapes() -> Vec<(usize, usize)> {
    let mut v = Vec::new();
    for k in [8usize, 2048, 4096] {
        for n in [1usize, 7, 128, 5120] {
            v.push((n, k));
        }
    }
    v.extend([(20000, 8), (300, 264), (129, 4104), (37, 16384)]);
    v
}

fn max_tokens(k: usize) -> usize {
    (GEMV_MAX_MK / k).min(GEMV_MAX_TOKENS)
}

/// `sum_k |x[t, k] * w[j, k]|` per output: the scale of its rounding error.
fn abs_scale(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let a = |v: &[f32]| v.iter().map(|e| e.abs()).collect::<Vec<f32>>();
    cpu::gemv(&a(&x[..m * k]), &a(&w[..n * k]), m, n, k, None)
}

/// Elementwise check of a GEMV output against the f64 reference `want`,
/// with `scale` from [`abs_scale`]. f32 accumulation of at most k/32 terms
/// per lane, a 6-level tree and the reference's own rounding stay within
/// (k/32 + 8) * 2^-24 * scale (first order; doubled here); a bf16 output
/// adds its rounding, 2^-9 |y| (doubled). Elementwise, so a single output
/// (n = 1) whose sum happens to cancel does not make a flaky test.
fn assert_gemv_close(what: &str, got: &[f32], want: &[f32], scale: &[f32], k: usize, bf16: bool) {
    assert_gemv_close_form(what, got, want, scale, k, bf16, GemvForm::CudaCores);
}

/// [`assert_gemv_close`] for either form. The tensor core adds each k16
/// step's exact products to the f32 running sum with at most one ulp of
/// error (its rounding is not specified to be to nearest): k/16 steps, then
/// up to 32 slice sums (more only for K past 8,192), so (k/16 + 8) in place
/// of (k/32 + 8).
fn assert_gemv_close_form(
    what: &str,
    got: &[f32],
    want: &[f32],
    scale: &[f32],
    k: usize,
    bf16: bool,
    form: GemvForm,
) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let per = match form {
        GemvForm::CudaCores => 32.0,
        GemvForm::TensorCores => 16.0,
    };
    let acc_tol = 2.0 * (k as f64 / per + 8.0) * 2f64.powi(-24);
    let (mut worst, mut wi) = (0f64, 0usize);
    for (i, ((&g, &w), &sc)) in got.iter().zip(want).zip(scale).enumerate() {
        assert!(
            g.is_finite(),
            "{what}: element {i} is {g} (unwritten or overflow); want {w}"
        );
        let rounding = if bf16 {
            2f64.powi(-8) * (w as f64).abs()
        } else {
            0.0
        };
        let bound = acc_tol * sc as f64 + rounding + 1e-30;
        let r = (g as f64 - w as f64).abs() / bound;
        if r > worst {
            worst = r;
            wi = i;
        }
    }
    eprintln!("{what}: worst error {worst:.3} of the bound (element {wi})");
    assert!(
        worst <= 1.0,
        "{what}: element {wi}: got {} want {} (sum |x w| = {}): {worst:.2}x the error bound",
        got[wi],
        want[wi],
        scale[wi]
    );
}

fn assert_tail_nan_f32(what: &str, v: &[f32]) {
    assert!(v.iter().all(|x| x.is_nan()), "{what}: wrote past m*n");
}

fn assert_tail_nan_bf16(what: &str, v: &[bf16]) {
    assert!(v.iter().all(|x| x.is_nan()), "{what}: wrote past the end");
}

#[test]
fn gemv_matches_reference() {
    let name = "gemv_matches_reference";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let kr = &g.kernels;
    const EXTRA: usize = 5;
    for (n, k) in shapes() {
        let mt = max_tokens(k);
        let w = randn_bf16(&mut rng, n * k, 0.05);
        let x = randn_bf16(&mut rng, mt * k, 1.0);
        // The reference for all mt rows; m tokens use the first m rows.
        let (xf, wf) = (f32s(&x), f32s(&w));
        let dot = cpu::gemv(&xf, &wf, mt, n, k, None);
        let scale = abs_scale(&xf, &wf, mt, n, k);
        let (dw, dx) = (up(&s, &w), up(&s, &x));
        for m in 1..=mt {
            let tag = format!("m={m} n={n} k={k}");
            let (want, sc) = (&dot[..m * n], &scale[..m * n]);

            // bf16 out (rounded once).
            let mut yb = poison_bf16(&s, m * n + EXTRA);
            kr.gemv::<bf16, bf16>(&s, &dx, &dw, m, n, k, false, &mut yb)
                .unwrap();
            let got = down(&s, &yb);
            assert_tail_nan_bf16(&format!("bf16 y {tag}"), &got[m * n..]);
            assert_gemv_close(
                &format!("bf16 y {tag}"),
                &f32s(&got[..m * n]),
                want,
                sc,
                k,
                true,
            );

            // f32 out, twice: bit-identical runs.
            let mut runs = Vec::new();
            for _ in 0..2 {
                let mut yf = poison_f32(&s, m * n + EXTRA);
                kr.gemv::<bf16, f32>(&s, &dx, &dw, m, n, k, false, &mut yf)
                    .unwrap();
                runs.push(down(&s, &yf));
            }
            assert_eq!(
                bits32(&runs[0]),
                bits32(&runs[1]),
                "f32 y {tag}: two runs differ"
            );
            assert_tail_nan_f32(&format!("f32 y {tag}"), &runs[0][m * n..]);
            assert_gemv_close(
                &format!("f32 y {tag}"),
                &runs[0][..m * n],
                want,
                sc,
                k,
                false,
            );
            // bf16 out is the f32 result rounded once.
            let rounded: Vec<u16> = runs[0][..m * n]
                .iter()
                .map(|&v| bf16::from_f32(v).to_bits())
                .collect();
            assert_eq!(
                bits16(&got[..m * n]),
                rounded,
                "bf16 y {tag}: not RNE(f32 y)"
            );

            // f32 accumulate into y0: exactly y0 + (the f32 result).
            let y0 = randn(&mut rng, m * n, 1.0);
            let mut ya = up(&s, &y0);
            kr.gemv::<bf16, f32>(&s, &dx, &dw, m, n, k, true, &mut ya)
                .unwrap();
            let got = down(&s, &ya);
            let want_acc: Vec<u32> = y0
                .iter()
                .zip(&runs[0])
                .map(|(a, b)| (a + b).to_bits())
                .collect();
            assert_eq!(bits32(&got), want_acc, "f32 accumulate {tag}");
        }
    }
    sync(&s);
}

/// Both forms of the fused norm + GEMV (`GemvForm`): the CUDA-core one of
/// every projection and the tensor-core one of the LM head.
#[test]
fn gemv_rmsnorm_matches_rmsnorm_then_gemv() {
    let name = "gemv_rmsnorm_matches_rmsnorm_then_gemv";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let kr = &g.kernels;
    let eps = 1e-6f32;
    for ((n, k), form) in shapes()
        .into_iter()
        .flat_map(|nk| [(nk, GemvForm::CudaCores), (nk, GemvForm::TensorCores)])
    {
        let mt = max_tokens(k);
        let w = randn_bf16(&mut rng, n * k, 0.05);
        let wf = f32s(&w);
        let res = randn(&mut rng, mt * k, 3.0);
        let gw = randn_bf16(&mut rng, k, 1.0);
        let (dw, dres, dg) = (up(&s, &w), up(&s, &res), up(&s, &gw));
        for m in [1usize, 2, 3, 5, 8] {
            if m > mt {
                continue;
            }
            let tag = format!("m={m} n={n} k={k} {form:?}");
            // The real rmsnorm_f32 kernel on the same input.
            let mut nref = poison_bf16(&s, m * k);
            kr.rmsnorm::<f32>(&s, &dres, &dg, m, k, eps, &mut nref)
                .unwrap();
            let nref = down(&s, &nref);
            // ... which agrees with the CPU reference.
            assert_close(
                &format!("rmsnorm {tag}"),
                &f32s(&nref),
                &f32s(&cpu::rmsnorm(&res[..m * k], &gw, k, eps)),
                4e-3,
            );
            let nf = f32s(&nref);
            let dot = cpu::gemv(&nf, &wf, m, n, k, None);
            let scale = abs_scale(&nf, &wf, m, n, k);
            // One launch; checks that `normed` is rmsnorm_f32's output, bit
            // for bit, and that nothing was written past it.
            let launch = |yf: &mut CudaSlice<f32>,
                          yb: &mut CudaSlice<bf16>,
                          f32_out: bool,
                          acc: bool| {
                let mut normed = poison_bf16(&s, m * k + 8);
                if f32_out {
                    kr.gemv_rmsnorm_form::<bf16, f32>(
                        &s,
                        &dres,
                        &dg,
                        eps,
                        &dw,
                        m,
                        n,
                        k,
                        acc,
                        form,
                        &mut normed,
                        yf,
                    )
                } else {
                    kr.gemv_rmsnorm_form::<bf16, bf16>(
                        &s,
                        &dres,
                        &dg,
                        eps,
                        &dw,
                        m,
                        n,
                        k,
                        false,
                        form,
                        &mut normed,
                        yb,
                    )
                }
                .unwrap();
                let normed = down(&s, &normed);
                assert_eq!(
                    bits16(&normed[..m * k]),
                    bits16(&nref),
                    "normed {tag} (f32 y: {f32_out}, accumulate: {acc}): differs from rmsnorm_f32"
                );
                assert_tail_nan_bf16(&format!("normed {tag}"), &normed[m * k..]);
            };
            let mut yb = poison_bf16(&s, m * n + 3);
            let mut yf = poison_f32(&s, m * n + 3);
            launch(&mut yf, &mut yb, false, false);
            launch(&mut yf, &mut yb, true, false);
            let (got_b, got_f) = (down(&s, &yb), down(&s, &yf));
            assert_tail_nan_bf16(&format!("norm bf16 y {tag}"), &got_b[m * n..]);
            assert_tail_nan_f32(&format!("norm f32 y {tag}"), &got_f[m * n..]);
            let got_f = &got_f[..m * n];
            assert_gemv_close_form(
                &format!("norm f32 y {tag}"),
                got_f,
                &dot,
                &scale,
                k,
                false,
                form,
            );
            let rounded: Vec<u16> = got_f.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
            assert_eq!(
                bits16(&got_b[..m * n]),
                rounded,
                "norm bf16 y {tag}: not RNE(f32 y)"
            );
            // Run to run: bit-identical.
            let mut yf2 = poison_f32(&s, m * n);
            launch(&mut yf2, &mut yb, true, false);
            assert_eq!(bits32(&down(&s, &yf2)), bits32(got_f), "{tag}: runs differ");
            // Accumulate: exactly y0 + the f32 result.
            let y0 = randn(&mut rng, m * n, 1.0);
            let mut ya = up(&s, &y0);
            launch(&mut ya, &mut yb, true, true);
            let want_acc: Vec<u32> = y0
                .iter()
                .zip(got_f)
                .map(|(a, b)| (a + b).to_bits())
                .collect();
            assert_eq!(bits32(&down(&s, &ya)), want_acc, "norm f32 y += {tag}");
        }
    }
    sync(&s);
}

/// Back-to-back launches with no host sync: on sm_90 each GEMV starts as a
/// programmatic dependent of the previous one and must wait for it before
/// reading its output (x, residual) or writing what it still reads.
#[test]
fn gemv_chains_respect_dependencies() {
    let name = "gemv_chains_respect_dependencies";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let kr = &g.kernels;
    let eps = 1e-6f32;

    // y1 = W1 x (bf16, NaN-poisoned before), then y2 = W2 y1.
    let (n1, k1, n2) = (5120usize, 2048usize, 64usize);
    let w1 = randn_bf16(&mut rng, n1 * k1, 0.05);
    let w2 = randn_bf16(&mut rng, n2 * n1, 0.05);
    let x = randn_bf16(&mut rng, k1, 1.0);
    let (dw1, dw2, dx) = (up(&s, &w1), up(&s, &w2), up(&s, &x));
    for _ in 0..3 {
        let mut y1 = poison_bf16(&s, n1);
        let mut y2 = poison_f32(&s, n2);
        kr.gemv::<bf16, bf16>(&s, &dx, &dw1, 1, n1, k1, false, &mut y1)
            .unwrap();
        kr.gemv::<bf16, f32>(&s, &y1, &dw2, 1, n2, n1, false, &mut y2)
            .unwrap();
        let y1h = down(&s, &y1);
        let (y1f, w2f) = (f32s(&y1h), f32s(&w2));
        let want = cpu::gemv(&y1f, &w2f, 1, n2, n1, None);
        let scale = abs_scale(&y1f, &w2f, 1, n2, n1);
        assert_gemv_close("y2 = W2 (W1 x)", &down(&s, &y2), &want, &scale, n1, false);
    }

    // o_proj into the residual, then the router with its RMSNorm, 4 times.
    let (h, kin, ne) = (2048usize, 4096usize, 128usize);
    let wo = randn_bf16(&mut rng, h * kin, 0.02);
    let wr = randn_bf16(&mut rng, ne * h, 0.05);
    let xa = randn_bf16(&mut rng, kin, 1.0);
    let gw = randn_bf16(&mut rng, h, 1.0);
    let r0 = randn(&mut rng, h, 1.0);
    let (dwo, dwr, dxa, dg) = (up(&s, &wo), up(&s, &wr), up(&s, &xa), up(&s, &gw));
    // The o_proj result alone (accumulated into zeros: exact).
    let mut delta = up(&s, &vec![0f32; h]);
    kr.gemv::<bf16, f32>(&s, &dxa, &dwo, 1, h, kin, true, &mut delta)
        .unwrap();
    let delta = down(&s, &delta);
    const STEPS: usize = 4;
    let mut res = up(&s, &r0);
    let mut normed: Vec<CudaSlice<bf16>> = (0..STEPS).map(|_| poison_bf16(&s, h)).collect();
    let mut logits: Vec<CudaSlice<f32>> = (0..STEPS).map(|_| poison_f32(&s, ne)).collect();
    for i in 0..STEPS {
        kr.gemv::<bf16, f32>(&s, &dxa, &dwo, 1, h, kin, true, &mut res)
            .unwrap();
        kr.gemv_rmsnorm::<bf16, f32>(
            &s,
            &res,
            &dg,
            eps,
            &dwr,
            1,
            ne,
            h,
            false,
            &mut normed[i],
            &mut logits[i],
        )
        .unwrap();
    }
    sync(&s);
    let mut r = r0.clone();
    for i in 0..STEPS {
        for (a, d) in r.iter_mut().zip(&delta) {
            *a += *d;
        }
        // The residual after step i is known exactly; rmsnorm_f32 of it
        // must equal what the fused kernel saw.
        let mut nref = poison_bf16(&s, h);
        kr.rmsnorm::<f32>(&s, &up(&s, &r), &dg, 1, h, eps, &mut nref)
            .unwrap();
        let nref = down(&s, &nref);
        assert_eq!(
            bits16(&down(&s, &normed[i])),
            bits16(&nref),
            "step {i}: the router saw a stale residual"
        );
        let (nf, wrf) = (f32s(&nref), f32s(&wr));
        let want = cpu::gemv(&nf, &wrf, 1, ne, h, None);
        let scale = abs_scale(&nf, &wrf, 1, ne, h);
        assert_gemv_close(
            &format!("router step {i}"),
            &down(&s, &logits[i]),
            &want,
            &scale,
            h,
            false,
        );
    }
    assert_eq!(bits32(&down(&s, &res)), bits32(&r), "final residual");
}

#[test]
fn gemv_rejects_bad_launches() {
    let name = "gemv_rejects_bad_launches";
    let Some((g, s)) = gpu(name) else { return };
    let kr = &g.kernels;
    let (m, n, k) = (2usize, 16usize, 64usize);
    let x = up(&s, &vec![bf16::ONE; m * k + 8]);
    let w = up(&s, &vec![bf16::ONE; n * k + 8]);
    let res = up(&s, &vec![1f32; m * k + 8]);
    let gw = up(&s, &vec![bf16::ONE; k + 8]);
    let mut y = up(&s, &vec![0f32; m * n]);
    let mut yb = up(&s, &vec![bf16::ZERO; m * n]);
    let mut normed = up(&s, &vec![bf16::ZERO; m * k + 8]);
    let err = |r: krasis_kernels::Result<()>, what: &str, needle: &str| {
        let e = r.expect_err(what).to_string();
        assert!(e.contains(needle), "{what}: message `{e}` lacks `{needle}`");
    };

    // Dims.
    err(
        kr.gemv::<bf16, f32>(&s, &x, &w, m, n, 12, false, &mut y),
        "k not a multiple of 8",
        "k = 12",
    );
    err(
        kr.gemv::<bf16, f32>(&s, &x, &w, m, n, 0, false, &mut y),
        "k = 0",
        "k = 0",
    );
    err(
        kr.gemv::<bf16, f32>(&s, &x, &w, 1, n, 16392, false, &mut y),
        "k too large",
        "k = 16392",
    );
    err(
        kr.gemv::<bf16, f32>(&s, &x, &w, 9, n, 8, false, &mut y),
        "m = 9",
        "m = 9",
    );
    err(
        kr.gemv::<bf16, f32>(&s, &x, &w, 3, n, 16384, false, &mut y),
        "m * k too large",
        "m * k",
    );
    err(
        kr.gemv::<bf16, bf16>(&s, &x, &w, m, n, k, true, &mut yb),
        "accumulate into bf16",
        "accumulate",
    );

    // The tensor-core form has bf16 entry points only.
    {
        use half::f16;
        let wh = up(&s, &vec![f16::ONE; n * k + 8]);
        let mut nh = up(&s, &vec![f16::ZERO; m * k + 8]);
        err(
            kr.gemv_rmsnorm_form::<f16, f32>(
                &s,
                &res,
                &gw,
                1e-6,
                &wh,
                m,
                n,
                k,
                false,
                GemvForm::TensorCores,
                &mut nh,
                &mut y,
            ),
            "f16 on the tensor-core form",
            "bf16 entry points only",
        );
    }

    // Alignment: views starting 1 and 4 elements in.
    err(
        kr.gemv::<bf16, f32>(&s, &x.slice(1..), &w, m, n, k, false, &mut y),
        "misaligned x",
        "`x`",
    );
    err(
        kr.gemv::<bf16, f32>(&s, &x, &w.slice(4..), m, n, k, false, &mut y),
        "misaligned w",
        "aligned",
    );
    err(
        kr.gemv_rmsnorm::<bf16, f32>(
            &s,
            &res.slice(2..),
            &gw,
            1e-6,
            &w,
            m,
            n,
            k,
            false,
            &mut normed,
            &mut y,
        ),
        "misaligned residual",
        "`residual`",
    );
    err(
        kr.gemv_rmsnorm::<bf16, f32>(
            &s,
            &res,
            &gw,
            1e-6,
            &w,
            m,
            n,
            k,
            false,
            &mut normed.slice_mut(4..),
            &mut y,
        ),
        "misaligned normed",
        "`normed`",
    );

    // Short buffers.
    err(
        kr.gemv::<bf16, f32>(&s, &x.slice(..m * k - 8), &w, m, n, k, false, &mut y),
        "short x",
        "`x`",
    );
    err(
        kr.gemv::<bf16, f32>(&s, &x, &w.slice(..n * k - 8), m, n, k, false, &mut y),
        "short w",
        "`w`",
    );
    err(
        kr.gemv::<bf16, f32>(&s, &x, &w, m, n, k, false, &mut y.slice_mut(..m * n - 1)),
        "short y",
        "`y`",
    );
    err(
        kr.gemv_rmsnorm::<bf16, f32>(
            &s,
            &res.slice(..m * k - 4),
            &gw,
            1e-6,
            &w,
            m,
            n,
            k,
            false,
            &mut normed,
            &mut y,
        ),
        "short residual",
        "`residual`",
    );
    err(
        kr.gemv_rmsnorm::<bf16, f32>(
            &s,
            &res,
            &gw.slice(..k - 8),
            1e-6,
            &w,
            m,
            n,
            k,
            false,
            &mut normed,
            &mut y,
        ),
        "short norm_w",
        "`norm_w`",
    );
    err(
        kr.gemv_rmsnorm::<bf16, f32>(
            &s,
            &res,
            &gw,
            1e-6,
            &w,
            m,
            n,
            k,
            false,
            &mut normed.slice_mut(..m * k - 8),
            &mut y,
        ),
        "short normed",
        "`normed`",
    );

    // Nothing to do is fine.
    kr.gemv::<bf16, f32>(&s, &x, &w, 0, n, k, false, &mut y)
        .unwrap();
    kr.gemv::<bf16, f32>(&s, &x, &w, m, 0, k, false, &mut y)
        .unwrap();
    sync(&s);
    assert!(
        down(&s, &y).iter().all(|&v| v == 0.0),
        "a refused launch wrote y"
    );
}
