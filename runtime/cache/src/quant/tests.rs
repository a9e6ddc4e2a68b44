use super::*;
use crate::layout::GROUP_SIZE;
use proptest::prelude::*;

/// Straight transcription of the rule in `layout.rs`, without the
/// vectorisation tricks of the real kernel.
fn reference_group(w: &[f32]) -> (Vec<u8>, u16) {
    let amax = w.iter().fold(0f32, |m, x| m.max(x.abs()));
    let s = f16::from_f32(amax / 7.0);
    let q: Vec<u8> = if s.to_f32() == 0.0 {
        vec![8; w.len()]
    } else {
        w.iter()
            .map(|x| ((x / s.to_f32()).round_ties_even() + 8.0).clamp(0.0, 15.0) as u8)
            .collect()
    };
    let packed = q.chunks(2).map(|p| p[0] | (p[1] << 4)).collect();
    (packed, s.to_bits())
}

fn quantize_f32(w: &[f32], rows: usize, k: usize) -> (Vec<u8>, Vec<u8>) {
    quantize_f32_group(w, rows, k, GROUP_SIZE)
}

fn quantize_f32_group(w: &[f32], rows: usize, k: usize, group: usize) -> (Vec<u8>, Vec<u8>) {
    let bytes: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut q = vec![0u8; rows * k / 2];
    let mut s = vec![0u8; rows * k / group * 2];
    quantize_rows(
        SourceMatrix {
            dtype: DType::F32,
            bytes: &bytes,
        },
        rows,
        k,
        group,
        &mut q,
        &mut s,
    )
    .unwrap();
    (q, s)
}

#[test]
fn hand_computed_group() {
    // s = f16(1/7) = 1.142578125 * 2^-3 = 0.142822265625 (bits 0x3092).
    let s = 0.142_822_27_f32;
    let mut w = [0f32; GROUP_SIZE];
    w[0] = 1.0; // 7.0017 -> 7 -> q 15
    w[1] = -0.5; // -3.5009 -> -4 -> q 4
    w[2] = 0.25; // 1.7504 -> 2 -> q 10
    w[3] = 0.07; // 0.4901 -> 0 -> q 8
    w[4] = -1.0; // -7.0017 -> -7 -> q 1
    w[5] = 2.5 * s; // exactly 2.5 -> ties to even 2 -> q 10
    w[6] = 3.5 * s; // exactly 3.5 -> ties to even 4 -> q 12
    let (q, sc) = quantize_f32(&w, 1, GROUP_SIZE);
    assert_eq!(sc, vec![0x92, 0x30]);
    assert_eq!(&q[..4], &[0x4F, 0x8A, 0xA1, 0x8C]);
    assert!(q[4..].iter().all(|&b| b == 0x88));
    let mut out = [0f32; GROUP_SIZE];
    dequantize_rows(&q, &sc, GROUP_SIZE, &mut out);
    assert_eq!(out[0], 7.0 * s);
    assert_eq!(out[0], 0.999_755_86);
    assert_eq!(out[1], -4.0 * s);
    assert_eq!(out[3], 0.0);
    assert_eq!(out[4], -7.0 * s);
    assert_eq!(out[5], 2.0 * s);
    assert_eq!(out[6], 4.0 * s);
}

#[test]
fn all_zero_group_has_zero_scale_and_q8() {
    let (q, s) = quantize_f32(&[0.0; 256], 2, GROUP_SIZE);
    assert!(q.iter().all(|&b| b == 0x88));
    assert!(s.iter().all(|&b| b == 0));
}

#[test]
fn rounding_trick_matches_round_ties_even() {
    // Every multiple of 2^-12 in [-16, 16] (all ties included) plus its
    // neighbours one ulp away.
    let mut x = -16.0f32;
    while x <= 16.0 {
        for v in [
            x,
            f32::from_bits(x.to_bits() + 1),
            f32::from_bits(x.to_bits().saturating_sub(1)),
        ] {
            assert_eq!(round_ties_even_small(v), v.round_ties_even(), "{v}");
        }
        x += 1.0 / 4096.0;
    }
}

#[test]
fn non_finite_and_overflow_are_refused() {
    let mut w = vec![0.5f32; 256];
    w[130] = f32::NAN;
    let bytes: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
    let (mut q, mut s) = (vec![0u8; 128], vec![0u8; 4]);
    let src = SourceMatrix {
        dtype: DType::F32,
        bytes: &bytes,
    };
    let e = quantize_rows(src, 2, 128, 128, &mut q, &mut s).unwrap_err();
    assert_eq!(e, GroupError::NonFinite { index: 128 });
    w[130] = 1e6;
    let bytes: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
    let src = SourceMatrix {
        dtype: DType::F32,
        bytes: &bytes,
    };
    let e = quantize_rows(src, 2, 128, 128, &mut q, &mut s).unwrap_err();
    assert!(
        matches!(e, GroupError::ScaleOverflow { index: 128, .. }),
        "{e:?}"
    );
}

#[test]
fn expert_round_trip_uses_the_layout() {
    let layout = ExpertLayout::int4(256, 128).unwrap();
    let (h, i) = (256, 128);
    let make = |n: usize, salt: f32| -> Vec<f32> {
        (0..n)
            .map(|j| ((j as f32 * 0.37 + salt).sin()) * 0.05)
            .collect()
    };
    let (g, u, d) = (make(i * h, 0.1), make(i * h, 0.2), make(h * i, 0.3));
    let as_bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let (gb, ub, db) = (as_bytes(&g), as_bytes(&u), as_bytes(&d));
    fn m(bytes: &[u8]) -> SourceMatrix<'_> {
        SourceMatrix {
            dtype: DType::F32,
            bytes,
        }
    }
    let mut block = vec![0xAAu8; layout.expert_stride];
    quantize_expert(&layout, m(&gb), m(&ub), m(&db), &mut block).unwrap();
    // Padding is zeroed, arrays sit where the layout says.
    assert!(block[layout.used_bytes..].iter().all(|&b| b == 0));
    let (gq, gs) = quantize_f32(&g, i, h);
    assert_eq!(&block[..gq.len()], &gq[..]);
    assert_eq!(&block[layout.w13_s..layout.w13_s + gs.len()], &gs[..]);
    let (dq, ds) = quantize_f32(&d, h, i);
    assert_eq!(&block[layout.w2_q..layout.w2_q + dq.len()], &dq[..]);
    assert_eq!(&block[layout.w2_s..layout.w2_s + ds.len()], &ds[..]);
    let e = dequantize_expert(&layout, &block);
    let mut up = vec![0f32; i * h];
    let (uq, us) = quantize_f32(&u, i, h);
    dequantize_rows(&uq, &us, GROUP_SIZE, &mut up);
    assert_eq!(e.up, up);
}

fn group_strategy() -> impl Strategy<Value = Vec<f32>> {
    // Magnitudes from 1e-3 to 1e3 per group, with occasional exact zeros.
    (
        prop::collection::vec(-1.0f32..1.0, GROUP_SIZE * 4),
        -3i32..3,
    )
        .prop_map(|(mut v, e)| {
            let m = 10f32.powi(e);
            for (j, x) in v.iter_mut().enumerate() {
                *x = if j % 37 == 0 { 0.0 } else { *x * m };
            }
            v
        })
}

proptest! {
    #[test]
    fn kernel_matches_reference_rule(w in group_strategy(), bf in any::<bool>()) {
        // Through BF16 as well, as checkpoints are stored.
        let (dtype, bytes, vals): (DType, Vec<u8>, Vec<f32>) = if bf {
            let b: Vec<half::bf16> = w.iter().map(|&x| half::bf16::from_f32(x)).collect();
            (DType::BF16, b.iter().flat_map(|x| x.to_le_bytes()).collect(), b.iter().map(|x| x.to_f32()).collect())
        } else {
            (DType::F32, w.iter().flat_map(|x| x.to_le_bytes()).collect(), w.clone())
        };
        let rows = 4;
        let mut q = vec![0u8; rows * GROUP_SIZE / 2];
        let mut s = vec![0u8; rows * 2];
        quantize_rows(SourceMatrix { dtype, bytes: &bytes }, rows, GROUP_SIZE, GROUP_SIZE, &mut q, &mut s).unwrap();
        for r in 0..rows {
            let (rq, rs) = reference_group(&vals[r * GROUP_SIZE..(r + 1) * GROUP_SIZE]);
            prop_assert_eq!(&q[r * 64..(r + 1) * 64], &rq[..]);
            prop_assert_eq!(u16::from_le_bytes([s[2 * r], s[2 * r + 1]]), rs);
        }
    }

    #[test]
    fn dequantized_error_at_most_half_a_step(w in group_strategy()) {
        let rows = 4;
        let (q, s) = quantize_f32(&w, rows, GROUP_SIZE);
        let mut out = vec![0f32; w.len()];
        dequantize_rows(&q, &s, GROUP_SIZE, &mut out);
        for (j, (a, b)) in w.iter().zip(&out).enumerate() {
            let sc = f16::from_bits(u16::from_le_bytes([s[2 * (j / GROUP_SIZE)], s[2 * (j / GROUP_SIZE) + 1]])).to_f32();
            // Normal f16 scales (amax >= 7 * 2^-14) only: the strategy keeps
            // amax above 1e-3, so no subnormal scale occurs here.
            prop_assert!((a - b).abs() <= sc / 2.0, "element {j}: {a} vs {b}, s {sc}");
        }
    }
}

#[test]
fn portable_and_dispatched_kernels_agree() {
    let rows = 16;
    let w: Vec<u8> = (0..rows * GROUP_SIZE)
        .flat_map(|j| {
            half::bf16::from_f32(((j as f32) * 0.731).sin() * 0.05 * (1 + j % 5) as f32)
                .to_le_bytes()
        })
        .collect();
    let src = SourceMatrix {
        dtype: DType::BF16,
        bytes: &w,
    };
    let (mut q1, mut s1) = (vec![0u8; rows * 64], vec![0u8; rows * 2]);
    let (mut q2, mut s2) = (vec![0u8; rows * 64], vec![0u8; rows * 2]);
    quantize_rows(src, rows, GROUP_SIZE, GROUP_SIZE, &mut q1, &mut s1).unwrap();
    quantize_rows_portable::<GROUP_SIZE>(src, rows, GROUP_SIZE, &mut q2, &mut s2).unwrap();
    assert_eq!((q1, s1), (q2, s2));
}

proptest! {
    /// Groups 64 and 32 follow the same rule per group: a row of 128
    /// elements is 2 or 4 independent groups, each its own scale.
    #[test]
    fn smaller_groups_match_the_reference_rule(w in group_strategy(), small in any::<bool>()) {
        let g = if small { 32 } else { 64 };
        let (rows, k) = (4, GROUP_SIZE);
        let (q, s) = quantize_f32_group(&w, rows, k, g);
        prop_assert_eq!(s.len(), rows * k / g * 2);
        for (j, grp) in w.chunks(g).enumerate() {
            let (rq, rs) = reference_group(grp);
            prop_assert_eq!(&q[j * g / 2..(j + 1) * g / 2], &rq[..]);
            prop_assert_eq!(u16::from_le_bytes([s[2 * j], s[2 * j + 1]]), rs);
        }
        let mut out = vec![0f32; w.len()];
        dequantize_rows(&q, &s, g, &mut out);
        for (j, (a, b)) in w.iter().zip(&out).enumerate() {
            let sc = f16::from_bits(u16::from_le_bytes([s[2 * (j / g)], s[2 * (j / g) + 1]])).to_f32();
            prop_assert!((a - b).abs() <= sc / 2.0, "element {j}: {a} vs {b}, s {sc}");
        }
    }
}

#[test]
fn group_64_expert_round_trip_uses_the_layout() {
    let layout = ExpertLayout::int4(192, 64).unwrap();
    assert_eq!(layout.group(), 64);
    let (h, i) = (192, 64);
    let make = |n: usize, salt: f32| -> Vec<f32> {
        (0..n)
            .map(|j| ((j as f32 * 0.41 + salt).sin()) * 0.05)
            .collect()
    };
    let (g, u, d) = (make(i * h, 0.1), make(i * h, 0.2), make(h * i, 0.3));
    let as_bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let (gb, ub, db) = (as_bytes(&g), as_bytes(&u), as_bytes(&d));
    let m = |bytes| SourceMatrix {
        dtype: DType::F32,
        bytes,
    };
    let mut block = vec![0xAAu8; layout.expert_stride];
    quantize_expert(&layout, m(&gb), m(&ub), m(&db), &mut block).unwrap();
    assert!(block[layout.used_bytes..].iter().all(|&b| b == 0));
    let (uq, us) = quantize_f32_group(&u, i, h, 64);
    let half_q = layout.w13_q_bytes() / 2;
    assert_eq!(&block[half_q..2 * half_q], &uq[..]);
    let half_s = layout.w13_s_bytes() / 2;
    assert_eq!(
        &block[layout.w13_s + half_s..layout.w13_s + 2 * half_s],
        &us[..]
    );
    let (dq, ds) = quantize_f32_group(&d, h, i, 64);
    assert_eq!(&block[layout.w2_s..layout.w2_s + ds.len()], &ds[..]);
    assert_eq!(&block[layout.w2_q..layout.w2_q + dq.len()], &dq[..]);
    let e = dequantize_expert(&layout, &block);
    let mut down = vec![0f32; h * i];
    dequantize_rows(&dq, &ds, 64, &mut down);
    assert_eq!(e.down, down);
}
