use half::bf16;
use krasis_kernels::{SamplingParams, reference as cpu, sample_workspace_len};
use rand::Rng;
use rand::seq::SliceRandom;

use crate::common::*;

#[test]
fn argmax_ties_and_nan() {
    let name = "argmax_ties_and_nan";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let (rows, v) = (3usize, 151_936usize);
    let mut l = randn(&mut rng, rows * v, 2.0);
    l[1000] = 50.0;
    l[77] = 50.0; // tie: lower id wins
    l[v + 5] = f32::NAN;
    l[v + 9] = 40.0;
    for x in &mut l[2 * v..] {
        *x = f32::NAN;
    }
    let mut out = poison_u32(&s, rows);
    g.kernels
        .argmax::<f32>(&s, &up(&s, &l), rows, v, &mut out)
        .unwrap();
    assert_eq!(down(&s, &out), vec![77, 9, 0]);
    let lb = cpu::to_bf16(&l);
    let mut out = poison_u32(&s, rows);
    g.kernels
        .argmax::<bf16>(&s, &up(&s, &lb), rows, v, &mut out)
        .unwrap();
    let want: Vec<u32> = (0..rows)
        .map(|r| cpu::argmax(&f32s(&lb[r * v..][..v])))
        .collect();
    assert_eq!(down(&s, &out), want);
}

#[test]
fn sample_matches_reference() {
    let name = "sample_matches_reference";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let v = 50_000usize;
    let base = SamplingParams {
        temperature: 0.8,
        seed: rng.random(),
        ..Default::default()
    };
    let cases = [
        SamplingParams {
            temperature: 0.0,
            presence_penalty: 1.5,
            frequency_penalty: 0.5,
            ..base
        },
        base,
        SamplingParams { top_k: 40, ..base },
        SamplingParams { top_k: 1, ..base },
        SamplingParams { top_p: 0.9, ..base },
        SamplingParams {
            min_p: 0.05,
            ..base
        },
        SamplingParams {
            top_k: 50,
            top_p: 0.8,
            min_p: 0.02,
            presence_penalty: 0.7,
            frequency_penalty: 0.2,
            ..base
        },
        SamplingParams {
            temperature: 1.3,
            top_p: 0.5,
            ..base
        },
    ];
    for (ci, p) in cases.iter().enumerate() {
        for step in 0..5u64 {
            // Distinct logits 0.001 apart, so greedy has no near-ties.
            let mut perm: Vec<usize> = (0..v).collect();
            perm.shuffle(&mut rng);
            let mut logits: Vec<f32> = perm.iter().map(|&r| r as f32 * 0.001 - 25.0).collect();
            // A block of exact ties at the top exercises top-k tie ranks.
            for j in 0..60 {
                logits[j * 7] = 30.0;
            }
            let counts: Vec<u32> = (0..v)
                .map(|_| {
                    if rng.random_range(0..10) == 0 {
                        rng.random_range(1..4)
                    } else {
                        0
                    }
                })
                .collect();
            let mut d_counts = up(&s, &counts);
            let mut ws = poison_u32(&s, sample_workspace_len(v));
            let mut out = poison_u32(&s, 1);
            g.kernels
                .sample::<f32>(
                    &s,
                    &up(&s, &logits),
                    v,
                    p,
                    step,
                    None,
                    &mut d_counts,
                    &mut ws,
                    &mut out,
                )
                .unwrap();
            let tok = down(&s, &out)[0];
            assert!((tok as usize) < v, "case {ci}: token {tok} out of range");
            let mut want_counts = counts.clone();
            want_counts[tok as usize] += 1;
            assert_eq!(down(&s, &d_counts), want_counts, "case {ci}: counts");
            let prepared = cpu::prepared_logits(&logits, &counts, p);
            if p.temperature == 0.0 {
                assert_eq!(tok, cpu::argmax(&prepared), "case {ci}: greedy");
                continue;
            }
            let gw: Vec<u32> = down(&s, &ws)[..v].to_vec();
            let cw = cpu::sample_weights(&prepared);
            for (i, (a, b)) in gw.iter().zip(&cw).enumerate() {
                let tol = 2.0f64.max(*b as f64 * 2e-5);
                assert!(
                    ((*a as f64) - (*b as f64)).abs() <= tol,
                    "case {ci}: weight {i}: gpu {a} cpu {b}"
                );
            }
            assert_eq!(
                tok,
                cpu::sample_from_weights(&gw, p, step),
                "case {ci} step {step}: selection"
            );
        }
    }
}

/// A grammar mask: the sampler picks only allowed tokens, greedy or not,
/// with the weights and draw of the CPU reference over masked prepared
/// logits (`cpu::apply_mask`), even when the unmasked arg-max is refused;
/// the count of the chosen token (only) goes up.
#[test]
fn sample_respects_a_mask() {
    let name = "sample_respects_a_mask";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let v = 151_669usize;
    let seed = rng.random();
    let cases = [
        SamplingParams::default(),
        SamplingParams {
            temperature: 1.0,
            seed,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.9,
            presence_penalty: 0.5,
            seed,
            ..Default::default()
        },
    ];
    for (ci, p) in cases.iter().enumerate() {
        for step in 0..6u64 {
            let logits = randn(&mut rng, v, 3.0);
            // A few allowed tokens (one when step is 0: a forced token),
            // never the unmasked arg-max.
            let top = cpu::argmax(&logits) as usize;
            let n = if step == 0 {
                1
            } else {
                rng.random_range(2..40)
            };
            let mut mask = vec![0u32; v.div_ceil(32)];
            let mut allowed = Vec::new();
            while allowed.len() < n {
                let t = rng.random_range(0..v);
                if t != top && !allowed.contains(&t) {
                    mask[t / 32] |= 1 << (t % 32);
                    allowed.push(t);
                }
            }
            let counts = vec![0u32; v];
            let mut d_counts = up(&s, &counts);
            let mut ws = poison_u32(&s, sample_workspace_len(v));
            let mut out = poison_u32(&s, 1);
            let d_mask = up(&s, &mask);
            g.kernels
                .sample::<f32>(
                    &s,
                    &up(&s, &logits),
                    v,
                    p,
                    step,
                    Some(&d_mask),
                    &mut d_counts,
                    &mut ws,
                    &mut out,
                )
                .unwrap();
            let tok = down(&s, &out)[0] as usize;
            assert!(
                allowed.contains(&tok),
                "case {ci} step {step}: token {tok} is masked out"
            );
            let mut want_counts = counts.clone();
            want_counts[tok] += 1;
            assert_eq!(down(&s, &d_counts), want_counts, "case {ci}: counts");
            let mut prepared = cpu::prepared_logits(&logits, &counts, p);
            cpu::apply_mask(&mut prepared, &mask);
            let want = if p.temperature == 0.0 {
                cpu::argmax(&prepared)
            } else {
                cpu::sample_from_weights(&cpu::sample_weights(&prepared), p, step)
            };
            assert_eq!(
                tok as u32, want,
                "case {ci} step {step}: against the reference"
            );
        }
    }
}

#[test]
fn sample_distribution_follows_softmax() {
    let name = "sample_distribution_follows_softmax";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let logits = [0.0f32, 1.0, 2.0, -1.0, 0.5, 1.5, -3.0, 0.2];
    let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
    let p = SamplingParams {
        temperature: 1.0,
        seed: rng.random(),
        ..Default::default()
    };
    let n = 4000usize;
    let d_logits = up(&s, &logits);
    let mut counts = up(&s, &[0u32; 8]);
    let mut ws = poison_u32(&s, sample_workspace_len(8));
    let mut out = poison_u32(&s, 1);
    for step in 0..n as u64 {
        g.kernels
            .sample::<f32>(
                &s,
                &d_logits,
                8,
                &p,
                step,
                None,
                &mut counts,
                &mut ws,
                &mut out,
            )
            .unwrap();
    }
    let c = down(&s, &counts);
    assert_eq!(c.iter().map(|&x| x as usize).sum::<usize>(), n);
    for (i, &l) in logits.iter().enumerate() {
        let pi = (l as f64).exp() / z;
        let sigma = (n as f64 * pi * (1.0 - pi)).sqrt();
        let dev = (c[i] as f64 - n as f64 * pi).abs();
        assert!(
            dev <= 5.0 * sigma + 1.0,
            "token {i}: {} draws, expected {:.0} +- {sigma:.1}",
            c[i],
            n as f64 * pi
        );
    }
}

/// A non-finite logit anywhere (+inf, -inf, NaN; first, middle or last
/// prep block) makes the sampler write `SAMPLE_NONFINITE` and change no
/// count, greedy or not (`cpu::refuses`); the same logits made finite
/// sample as before.
#[test]
fn sample_refuses_non_finite_logits() {
    let name = "sample_refuses_non_finite_logits";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let v = 151_552usize;
    let greedy = SamplingParams::default();
    let sampled = SamplingParams {
        temperature: 0.7,
        top_p: 0.9,
        seed: rng.random(),
        ..Default::default()
    };
    let base = randn(&mut rng, v, 2.0);
    for p in [greedy, sampled] {
        for (at, bad) in [
            (0usize, f32::INFINITY),
            (v / 2, f32::NEG_INFINITY),
            (v - 1, f32::NAN),
        ] {
            let mut logits = base.clone();
            logits[at] = bad;
            assert!(cpu::refuses(&logits));
            let counts = vec![1u32; v];
            let mut d_counts = up(&s, &counts);
            let mut ws = poison_u32(&s, sample_workspace_len(v));
            let mut out = poison_u32(&s, 1);
            g.kernels
                .sample::<f32>(
                    &s,
                    &up(&s, &logits),
                    v,
                    &p,
                    3,
                    None,
                    &mut d_counts,
                    &mut ws,
                    &mut out,
                )
                .unwrap();
            assert_eq!(
                down(&s, &out)[0],
                krasis_kernels::SAMPLE_NONFINITE,
                "{bad} at {at}, temperature {}",
                p.temperature
            );
            assert_eq!(down(&s, &d_counts), counts, "counts changed");
        }
        assert!(!cpu::refuses(&base));
        let mut d_counts = up(&s, &vec![0u32; v]);
        let mut ws = poison_u32(&s, sample_workspace_len(v));
        let mut out = poison_u32(&s, 1);
        g.kernels
            .sample::<f32>(
                &s,
                &up(&s, &base),
                v,
                &p,
                3,
                None,
                &mut d_counts,
                &mut ws,
                &mut out,
            )
            .unwrap();
        let tok = down(&s, &out)[0];
        assert!((tok as usize) < v, "finite logits: token {tok}");
        if p.temperature == 0.0 {
            assert_eq!(tok, cpu::argmax(&base));
        }
    }
}

/// A decode step's rows sampled in one `sample_rows` launch pair (strided
/// logits and counts rows, counts slots out of order, masks on some rows,
/// every kind of setting) give each row exactly what `sample` gives it
/// alone: the same token, the same counts row; the other slots and the
/// padding past each row's vocabulary stay untouched.
#[test]
fn sample_rows_match_each_row_alone() {
    let name = "sample_rows_match_each_row_alone";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let (v, ls, cs) = (50_000usize, 50_064usize, 50_032usize);
    let words = v.div_ceil(32);
    let ms = words + 3;
    let slots = 8usize;
    let base = SamplingParams {
        temperature: 0.8,
        seed: rng.random(),
        ..Default::default()
    };
    let rows = [
        (
            5usize,
            false,
            SamplingParams {
                temperature: 0.0,
                presence_penalty: 1.5,
                frequency_penalty: 0.5,
                ..base
            },
        ),
        (0, true, SamplingParams { top_k: 40, ..base }),
        (3, false, SamplingParams { top_p: 0.9, ..base }),
        (
            7,
            false,
            SamplingParams {
                min_p: 0.05,
                ..base
            },
        ),
        (1, true, SamplingParams::default()),
        (
            2,
            false,
            SamplingParams {
                temperature: 1.3,
                top_k: 50,
                top_p: 0.8,
                ..base
            },
        ),
    ];
    let n = rows.len();
    let logits = randn(&mut rng, n * ls, 2.0);
    let counts: Vec<u32> = (0..slots * cs)
        .map(|_| {
            if rng.random_range(0..8) == 0 {
                rng.random_range(1..4)
            } else {
                0
            }
        })
        .collect();
    // Random words: each mask allows about half the tokens (never none);
    // the words past a row's vocabulary are noise the kernel never reads.
    let masks: Vec<u32> = (0..slots * ms).map(|_| rng.random()).collect();
    let samples: Vec<krasis_kernels::SampleRow> = rows
        .iter()
        .enumerate()
        .map(|(i, &(slot, masked, params))| krasis_kernels::SampleRow {
            params,
            step: 11 + i as u64,
            slot,
            masked,
        })
        .collect();
    let mut d_counts = up(&s, &counts);
    let d_masks = up(&s, &masks);
    let mut ws = poison_u32(&s, n * sample_workspace_len(v));
    let mut out = poison_u32(&s, n);
    g.kernels
        .sample_rows::<f32>(
            &s,
            &up(&s, &logits),
            ls,
            v,
            &samples,
            &mut d_counts,
            cs,
            Some((&d_masks, ms)),
            &mut ws,
            &mut out,
        )
        .unwrap();
    let got = down(&s, &out);
    let got_counts = down(&s, &d_counts);
    let mut want_counts = counts.clone();
    for (r, sr) in samples.iter().enumerate() {
        let row_counts = &counts[sr.slot * cs..][..v];
        let mut d1 = up(&s, row_counts);
        let mask1 = up(&s, &masks[sr.slot * ms..][..words]);
        let mut ws1 = poison_u32(&s, sample_workspace_len(v));
        let mut out1 = poison_u32(&s, 1);
        g.kernels
            .sample::<f32>(
                &s,
                &up(&s, &logits[r * ls..][..v]),
                v,
                &sr.params,
                sr.step,
                sr.masked
                    .then_some(&mask1 as &dyn cudarc::driver::DevicePtr<u32>),
                &mut d1,
                &mut ws1,
                &mut out1,
            )
            .unwrap();
        let alone = down(&s, &out1)[0];
        assert_eq!(got[r], alone, "row {r} (slot {}): token", sr.slot);
        assert!((alone as usize) < v, "row {r}: token {alone}");
        want_counts[sr.slot * cs..][..v].copy_from_slice(&down(&s, &d1));
    }
    assert!(
        got_counts == want_counts,
        "counts: a row's slot differs from its lone run, or another slot or the padding changed"
    );
    // Two rows on one counts slot would both increment it: refused.
    let mut dup = samples.clone();
    dup[1].slot = dup[0].slot;
    let err = g
        .kernels
        .sample_rows::<f32>(
            &s,
            &up(&s, &logits),
            ls,
            v,
            &dup,
            &mut d_counts,
            cs,
            Some((&d_masks, ms)),
            &mut ws,
            &mut out,
        )
        .unwrap_err();
    assert!(err.to_string().contains("share counts slot"), "{err}");
}
