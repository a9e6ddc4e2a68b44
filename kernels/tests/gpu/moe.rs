use cudarc::driver::CudaStream;
use half::bf16;
use krasis_kernels::ops::moe::RouterMode;
use krasis_kernels::reference as cpu;
use rand::Rng;
use std::sync::Arc;

use crate::common::*;

#[test]
fn router_topk_matches_reference() {
    let name = "router_topk_matches_reference";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    for (e, k) in [(128usize, 8usize), (60, 4), (512, 10)] {
        let t = 33;
        let mut logits = randn(&mut rng, t * e, 2.0);
        // Exact ties must resolve to the lower expert id.
        for j in 0..e {
            logits[3 * e + j] = 0.5;
        }
        logits[4 * e + 7] = 3.0;
        logits[4 * e + 2] = 3.0;
        for normalize in [true, false] {
            for as_bf16 in [false, true] {
                let lf: Vec<f32> = if as_bf16 {
                    f32s(&cpu::to_bf16(&logits))
                } else {
                    logits.clone()
                };
                let (want_i, want_w) = cpu::router_topk(&lf, e, k, normalize);
                let mut ids = poison_u32(&s, t * k);
                let mut w = poison_f32(&s, t * k);
                if as_bf16 {
                    let lb = up(&s, &cpu::to_bf16(&logits));
                    g.kernels
                        .router_topk::<bf16>(&s, &lb, t, e, k, normalize, &mut ids, &mut w)
                        .unwrap();
                } else {
                    let lg = up(&s, &logits);
                    g.kernels
                        .router_topk::<f32>(&s, &lg, t, e, k, normalize, &mut ids, &mut w)
                        .unwrap();
                }
                assert_eq!(
                    down(&s, &ids),
                    want_i,
                    "ids (E={e} k={k} norm={normalize} bf16={as_bf16})"
                );
                assert_close("router weights", &down(&s, &w), &want_w, 1e-5);
            }
        }
    }
}

#[test]
fn moe_group_gather_combine() {
    let name = "moe_group_gather_combine";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let (t, k, e, hidden) = (1000usize, 8usize, 64usize, 256usize);
    let n_pairs = t * k;
    // Experts 0..e/2 only, so half the experts are empty.
    let mut ids: Vec<u32> = (0..n_pairs)
        .map(|_| rng.random_range(0..(e / 2) as u32))
        .collect();
    let (counts, offsets, row_pair, pair_row) = {
        let mut d_counts = poison_u32(&s, e);
        let mut d_offsets = poison_u32(&s, e + 1);
        let mut d_rp = poison_u32(&s, n_pairs);
        let mut d_pr = poison_u32(&s, n_pairs);
        g.kernels
            .moe_group(
                &s,
                &up(&s, &ids),
                n_pairs,
                e,
                &mut d_counts,
                &mut d_offsets,
                &mut d_rp,
                &mut d_pr,
            )
            .unwrap();
        (
            down(&s, &d_counts),
            down(&s, &d_offsets),
            down(&s, &d_rp),
            down(&s, &d_pr),
        )
    };
    let (wc, wo, wrp, wpr) = cpu::moe_group(&ids, e);
    assert_eq!(counts, wc, "counts");
    assert_eq!(offsets, wo, "offsets");
    assert_eq!(row_pair, wrp, "row_pair");
    assert_eq!(pair_row, wpr, "pair_row");

    // Gather token rows in grouped order.
    let x = randn_bf16(&mut rng, t * hidden, 1.0);
    let mut gathered = poison_bf16(&s, n_pairs * hidden);
    g.kernels
        .gather_rows(
            &s,
            &up(&s, &x),
            t,
            hidden,
            &up(&s, &row_pair),
            k,
            n_pairs,
            &mut gathered,
        )
        .unwrap();
    let got = down(&s, &gathered);
    for r in 0..n_pairs {
        let tok = row_pair[r] as usize / k;
        assert_eq!(
            got[r * hidden..][..hidden],
            x[tok * hidden..][..hidden],
            "gathered row {r}"
        );
    }

    // Combine (bf16 and f32 expert outputs).
    let weights: Vec<f32> = (0..n_pairs).map(|_| rng.random_range(0.0..1.0)).collect();
    let res0 = randn(&mut rng, t * hidden, 1.0);
    let yb = randn_bf16(&mut rng, n_pairs * hidden, 1.0);
    let yf = f32s(&yb);
    let mut want = res0.clone();
    cpu::moe_combine(&mut want, &yf, &pair_row, &weights, k, hidden);
    let (d_pr, d_w) = (up(&s, &pair_row), up(&s, &weights));
    let mut res = up(&s, &res0);
    g.kernels
        .moe_combine(&s, &mut res, &up(&s, &yb), &d_pr, &d_w, t, k, hidden)
        .unwrap();
    assert_close("combine bf16", &down(&s, &res), &want, 1e-6);
    let mut res = up(&s, &res0);
    g.kernels
        .moe_combine(&s, &mut res, &up(&s, &yf), &d_pr, &d_w, t, k, hidden)
        .unwrap();
    let first = down(&s, &res);
    assert_close("combine f32", &first, &want, 1e-6);
    // Bit-reproducible run to run.
    let mut res = up(&s, &res0);
    g.kernels
        .moe_combine(&s, &mut res, &up(&s, &yf), &d_pr, &d_w, t, k, hidden)
        .unwrap();
    assert!(
        down(&s, &res)
            .iter()
            .zip(&first)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "combine not reproducible"
    );

    // An invalid id is never grouped and poisons that token's combine.
    ids[3] = e as u32 + 1;
    let mut d_counts = poison_u32(&s, e);
    let mut d_offsets = poison_u32(&s, e + 1);
    let mut d_rp = poison_u32(&s, n_pairs);
    let mut d_pr = poison_u32(&s, n_pairs);
    g.kernels
        .moe_group(
            &s,
            &up(&s, &ids),
            n_pairs,
            e,
            &mut d_counts,
            &mut d_offsets,
            &mut d_rp,
            &mut d_pr,
        )
        .unwrap();
    let pr = down(&s, &d_pr);
    assert_eq!(pr[3], u32::MAX);
    assert_eq!(down(&s, &d_offsets)[e] as usize, n_pairs - 1);
    let mut res = up(&s, &res0);
    g.kernels
        .moe_combine(&s, &mut res, &up(&s, &yf), &d_pr, &d_w, t, k, hidden)
        .unwrap();
    let r = down(&s, &res);
    assert!(
        r[0].is_nan() && r[hidden].is_finite(),
        "invalid pair must poison token 0 only"
    );
}

/// One router launch shape: `t` tokens of `e` experts, top-`k`, `mode`.
struct Router<'a> {
    g: &'a Gpu,
    s: &'a Arc<CudaStream>,
    t: usize,
    e: usize,
    k: usize,
    mode: RouterMode,
}

impl Router<'_> {
    /// Runs the kernel on `logits` (rounded to bf16 first when `as_bf16`)
    /// with `bias` and checks its ids exactly and its weights to 1e-5
    /// against the reference's `want`.
    fn check_biased(
        &self,
        logits: &[f32],
        bias: &[f32],
        as_bf16: bool,
        (want_i, want_w): (&[u32], &[f32]),
        what: &str,
    ) {
        let Router {
            g,
            s,
            t,
            e,
            k,
            mode,
        } = *self;
        let mut ids = poison_u32(s, t * k);
        let mut w = poison_f32(s, t * k);
        let db = up(s, bias);
        if as_bf16 {
            let lb = up(s, &cpu::to_bf16(logits));
            g.kernels
                .router_topk_with::<bf16>(s, &lb, Some(&db), t, e, k, mode, &mut ids, &mut w)
                .unwrap();
        } else {
            let lg = up(s, logits);
            g.kernels
                .router_topk_with::<f32>(s, &lg, Some(&db), t, e, k, mode, &mut ids, &mut w)
                .unwrap();
        }
        assert_eq!(down(s, &ids), want_i, "ids ({what})");
        assert_close(
            &format!("router weights ({what})"),
            &down(s, &w),
            want_w,
            1e-5,
        );
    }
}

/// glm4_moe's router on the GPU against the reference: GLM-4.5-Air's 128
/// experts top-8 in one group, GLM-4.5's 160, DeepSeek-V3's 256 in 8 groups
/// keeping 4, and the tiny preset's 8 in 4 keeping 2; selection biases of
/// the scores' size (they move choices); f32 and bf16 logits; exact ties.
#[test]
fn router_sigmoid_grouped_matches_reference() {
    let name = "router_sigmoid_grouped_matches_reference";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let t = 37;
    for (e, k, groups, keep, normalize, scale) in [
        (128usize, 8usize, 1usize, 1usize, true, 1.0f32),
        (160, 8, 1, 1, true, 2.5),
        (256, 8, 8, 4, true, 2.5),
        (8, 2, 4, 2, false, 1.0),
    ] {
        let mode = RouterMode::SigmoidGrouped {
            groups,
            topk_groups: keep,
            normalize,
            scale,
        };
        let mut logits = randn(&mut rng, t * e, 1.5);
        let bias: Vec<f32> = randn(&mut rng, e, 0.1)
            .iter()
            .map(|b| (b * 64.0).round() / 64.0)
            .collect();
        // Token 3: every logit 0 and no bias difference among the first
        // experts' choices (ties to the lower index after the bias).
        for j in 0..e {
            logits[3 * e + j] = 0.0;
        }
        for as_bf16 in [false, true] {
            let lf: Vec<f32> = if as_bf16 {
                f32s(&cpu::to_bf16(&logits))
            } else {
                logits.clone()
            };
            let what = format!("E={e} k={k} groups={groups}/{keep} bf16={as_bf16}");
            let (want_i, want_w) = cpu::router_topk_with(&lf, Some(&bias), e, k, mode);
            let (plain_i, _) = cpu::router_topk_with(&lf, None, e, k, mode);
            assert_ne!(plain_i, want_i, "{what}: the bias changes no choice");
            let router = Router {
                g,
                s: &s,
                t,
                e,
                k,
                mode,
            };
            router.check_biased(&logits, &bias, as_bf16, (&want_i, &want_w), &what);
        }
    }
    // Groups that do not split the experts are refused before launch.
    let lg = up(&s, &[0f32; 10]);
    let (mut ids, mut w) = (poison_u32(&s, 2), poison_f32(&s, 2));
    let bad = RouterMode::SigmoidGrouped {
        groups: 3,
        topk_groups: 1,
        normalize: true,
        scale: 1.0,
    };
    assert!(
        g.kernels
            .router_topk_with::<f32>(&s, &lg, None, 1, 10, 2, bad, &mut ids, &mut w)
            .is_err()
    );
}

#[test]
fn router_topk_then_softmax_and_bias_match_reference() {
    let name = "router_topk_then_softmax_and_bias_match_reference";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let t = 37;
    // gpt-oss-20b (32 experts) and -120b (128), top-4; then the softmax
    // mode with a bias.
    let cases = [
        (32usize, 4usize, RouterMode::TopKSoftmax),
        (128, 4, RouterMode::TopKSoftmax),
        (128, 8, RouterMode::SoftmaxTopK { normalize: false }),
        (60, 4, RouterMode::SoftmaxTopK { normalize: true }),
    ];
    for (e, k, mode) in cases {
        let mut logits = randn(&mut rng, t * e, 1.0);
        // The bias is of the logits' size, so it moves the choice.
        let mut bias: Vec<f32> = randn(&mut rng, e, 1.5)
            .iter()
            .map(|b| (b * 4.0).round() / 4.0)
            .collect();
        // Exact ties (after the bias: quarters, exact in f32 and bf16)
        // resolve to the lower expert id; an
        // expert the bias pushes to -inf is never picked while k others
        // are finite.
        for j in 0..e {
            logits[3 * e + j] = 0.25 - bias[j];
        }
        logits[4 * e + 7] = 6.0 - bias[7];
        logits[4 * e + 2] = 6.0 - bias[2];
        bias[e - 1] = f32::NEG_INFINITY;
        for as_bf16 in [false, true] {
            let lf: Vec<f32> = if as_bf16 {
                f32s(&cpu::to_bf16(&logits))
            } else {
                logits.clone()
            };
            let what = format!("E={e} k={k} {mode:?} bf16={as_bf16}");
            let (want_i, want_w) = cpu::router_topk_with(&lf, Some(&bias), e, k, mode);
            // The test data must tell the modes apart: without the bias, or
            // with the other mode, the reference answer differs.
            let (plain_i, _) = cpu::router_topk_with(&lf, None, e, k, mode);
            assert_ne!(plain_i, want_i, "{what}: the bias changes no choice");
            if mode == RouterMode::TopKSoftmax {
                let all = RouterMode::SoftmaxTopK { normalize: false };
                let (_, all_w) = cpu::router_topk_with(&lf, Some(&bias), e, k, all);
                let gap = want_w.iter().zip(&all_w).map(|(a, b)| (a - b).abs());
                assert!(gap.fold(0f32, f32::max) > 1e-2, "{what}: modes indistinct");
            }
            let router = Router {
                g,
                s: &s,
                t,
                e,
                k,
                mode,
            };
            router.check_biased(&logits, &bias, as_bf16, (&want_i, &want_w), &what);
        }
    }
    // A NaN logit poisons that token's top-k-then-softmax weights, only its.
    let (e, k) = (32, 4);
    let mut logits = randn(&mut rng, 2 * e, 1.0);
    logits[e + 5] = f32::NAN;
    let (mut ids, mut w) = (poison_u32(&s, 2 * k), poison_f32(&s, 2 * k));
    g.kernels
        .router_topk_with::<f32>(
            &s,
            &up(&s, &logits),
            None,
            2,
            e,
            k,
            RouterMode::TopKSoftmax,
            &mut ids,
            &mut w,
        )
        .unwrap();
    let w = down(&s, &w);
    assert!(
        w[..k].iter().all(|v| v.is_finite()) && w[k..].iter().all(|v| v.is_nan()),
        "{w:?}"
    );
    // A bias of the wrong length is refused.
    let short = up(&s, &vec![0f32; e - 1]);
    let lg = up(&s, &logits);
    assert!(
        g.kernels
            .router_topk_with::<f32>(
                &s,
                &lg,
                Some(&short),
                2,
                e,
                k,
                RouterMode::TopKSoftmax,
                &mut ids,
                &mut up(&s, &[0f32; 8])
            )
            .is_err()
    );
    sync(&s);
}
