use cudarc::driver::{CudaSlice, DevicePtr};
use half::bf16;
use krasis_kernels::{Int4Layout, reference as cpu};
use rand::Rng;
use rand::seq::SliceRandom;

use crate::common::*;

/// `n` random experts quantized into one device buffer, 4096-aligned, and
/// the pointer table addressing them (also used by `fp16_mlp.rs`).
pub(crate) struct Experts {
    _buf: CudaSlice<u8>,
    pub(crate) table: CudaSlice<u64>,
    pub(crate) w13: Vec<Vec<f32>>,
    pub(crate) w2: Vec<Vec<f32>>,
}

pub(crate) fn experts(
    g: &crate::common::Gpu,
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    rng: &mut rand::rngs::StdRng,
    layout: &Int4Layout,
    n: usize,
) -> Experts {
    let _ = g;
    let stride = layout.used_bytes().div_ceil(4096) * 4096;
    let (h, i) = (layout.hidden, layout.intermediate);
    let mut host = vec![0u8; n * stride];
    let (mut w13s, mut w2s) = (Vec::new(), Vec::new());
    for e in 0..n {
        // Magnitudes vary 1x / 2x / 3x across 32-wide chunks of K, so
        // every group's scale differs from its neighbours' and a kernel
        // applying the wrong group's scale is far off.
        let spread = |mut w: Vec<f32>, k: usize| {
            for (x, v) in w.iter_mut().enumerate() {
                *v *= 1.0 + ((x % k) / 32 % 3) as f32;
            }
            w
        };
        let w13 = spread(randn(rng, 2 * i * h, 0.05), h);
        let w2 = spread(randn(rng, h * i, 0.05), i);
        let (d13, d2) =
            cpu::write_expert(&mut host[e * stride..(e + 1) * stride], layout, &w13, &w2);
        w13s.push(d13);
        w2s.push(d2);
    }
    let buf = up(s, &host);
    let base = {
        let (p, _g) = buf.device_ptr(s);
        p
    };
    // Reversed so table index != storage order.
    let table: Vec<u64> = (0..n)
        .map(|e| base + ((n - 1 - e) * stride) as u64)
        .collect();
    w13s.reverse();
    w2s.reverse();
    Experts {
        _buf: buf,
        table: up(s, &table),
        w13: w13s,
        w2: w2s,
    }
}

/// What a decode GEMV check leaves for further checks on the same routes.
pub(crate) struct DecodeRun<A> {
    pub(crate) d_x: CudaSlice<A>,
    pub(crate) d_ids: CudaSlice<u32>,
    /// The f64 reference's activations, `[t * k, I]`.
    pub(crate) want_act: Vec<f32>,
}

/// `t` tokens routed to `k` distinct of `n_exp` experts, x random in `A`:
/// `int4_w13_swiglu` (all pairs) then `int4_w2_combine` into a random f32
/// residual, run twice (bit-identical: fixed reduction order), against the
/// f64 CPU reference over the same x; `tag` names the shape, `act_what`
/// and `res_what` the act and residual comparisons.
pub(crate) fn decode_gemv_matches_cpu<A: krasis_kernels::Act16>(
    kr: &krasis_kernels::Kernels,
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    rng: &mut rand::rngs::StdRng,
    ex: &Experts,
    layout: &Int4Layout,
    (n_exp, t, k): (usize, usize, usize),
    (tag, act_what, res_what): (&str, &str, &str),
) -> DecodeRun<A> {
    let (h, i) = (layout.hidden, layout.intermediate);
    let mut ids = Vec::new();
    for _ in 0..t {
        let mut all: Vec<u32> = (0..n_exp as u32).collect();
        all.shuffle(rng);
        ids.extend_from_slice(&all[..k]);
    }
    let weights: Vec<f32> = (0..t * k).map(|_| rng.random_range(0.0..1.0)).collect();
    let x = randn_act::<A>(rng, t * h, 1.0);
    let xf = f32s(&x);
    let (d_x, d_ids, d_w) = (up(s, &x), up(s, &ids), up(s, &weights));
    let res0 = randn(rng, t * h, 1.0);
    let mut runs = Vec::new();
    for _ in 0..2 {
        let mut act = poison_f32(s, t * k * i);
        kr.int4_w13_swiglu(
            s,
            &d_x,
            &ex.table,
            &d_ids,
            t,
            k,
            layout,
            u32::MAX,
            false,
            &mut act,
        )
        .unwrap();
        let mut res = up(s, &res0);
        kr.int4_w2_combine(s, &act, &ex.table, &d_ids, &d_w, t, k, layout, &mut res)
            .unwrap();
        runs.push((down(s, &act), down(s, &res)));
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(
        bits(&runs[0].0) == bits(&runs[1].0) && bits(&runs[0].1) == bits(&runs[1].1),
        "{tag}: two runs differ"
    );
    let (act, res) = runs.swap_remove(0);
    let mut want_act = Vec::new();
    let mut want_res = res0.clone();
    for tok in 0..t {
        let mut acc = vec![0f64; h];
        for j in 0..k {
            let e = ids[tok * k + j] as usize;
            let (a, y) = cpu::expert_forward(&ex.w13[e], &ex.w2[e], h, i, &xf[tok * h..][..h]);
            want_act.extend(a);
            for n in 0..h {
                acc[n] += weights[tok * k + j] as f64 * y[n] as f64;
            }
        }
        for n in 0..h {
            want_res[tok * h + n] += acc[n] as f32;
        }
    }
    assert_close(act_what, &act, &want_act, 1e-4);
    let got: Vec<f32> = res.iter().zip(&res0).map(|(a, b)| a - b).collect();
    let want: Vec<f32> = want_res.iter().zip(&res0).map(|(a, b)| a - b).collect();
    assert_close(res_what, &got, &want, 1e-4);
    DecodeRun {
        d_x,
        d_ids,
        want_act,
    }
}

#[test]
fn int4_decode_gemv_matches_reference() {
    let name = "int4_decode_gemv_matches_reference";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    // a3b and qcn dims at 1 and up to 8 tokens, then odd dims exercising
    // every g = 128 fast entry point: partial K splits, H up to 4096, I up
    // to 2048 with top_k 16 (the shared-memory opt-in of w2). Then every
    // general entry point (each row's comment: the w13 / w2 entry): groups
    // 32 and 64, partial 128-wide tiles (2880 = 22.5 x 128, 1408, 96) and
    // the families' widths H 2880..7168, I 768..2880.
    for (h, i, gs, n_exp, t, k) in [
        (2048usize, 768usize, 128usize, 16usize, 1usize, 8usize),
        (2048, 768, 128, 16, 2, 8),
        (2048, 512, 128, 12, 8, 10),
        (1152, 1280, 128, 6, 3, 3),
        (4096, 384, 128, 5, 2, 4),
        (3072, 256, 128, 4, 1, 3),
        (640, 128, 128, 3, 5, 2),
        (1024, 2048, 128, 16, 1, 16),
        (640, 96, 32, 3, 3, 2),      // g1 / g1, partial tiles in both
        (2048, 768, 64, 9, 2, 8),    // g2 / g1
        (2048, 768, 32, 9, 1, 8),    // g2 / g1
        (2880, 2880, 32, 5, 1, 4),   // g3 / g3 (gpt-oss, group 32)
        (2880, 2880, 64, 4, 2, 4),   // g3 / g3 (group 64)
        (2880, 1408, 32, 17, 1, 16), // g3 / g2, top_k 16
        (4096, 1536, 64, 9, 1, 8),   // g4 / g2 (Qwen3-235B-like)
        (5120, 1408, 128, 9, 1, 8),  // w16_3 / g2 (GLM-4.5-like)
        (5120, 1536, 32, 4, 2, 3),   // w16_3 / g2
        (7168, 2048, 128, 8, 1, 8),  // w16_4 / fast 2 (DeepSeek-like)
        (7168, 2880, 64, 3, 1, 2),   // w16_4 / g3
        (8192, 4096, 128, 3, 1, 2),  // w16_4 / g3 at the limits
    ] {
        let layout = Int4Layout::new(h, i, gs).unwrap();
        let ex = experts(g, &s, &mut rng, &layout, n_exp);
        let tag = format!("H={h} I={i} g={gs}");
        decode_gemv_matches_cpu::<bf16>(
            &g.kernels,
            &s,
            &mut rng,
            &ex,
            &layout,
            (n_exp, t, k),
            (
                &tag,
                &format!("w13+swiglu {tag}"),
                &format!("w2+combine {tag}"),
            ),
        );

        // Dequantization to bf16 is exact up to the one rounding.
        let sel: Vec<u32> = vec![2, 0, (n_exp - 1) as u32];
        let mut o13 = poison_bf16(&s, 3 * 2 * i * h);
        let mut o2 = poison_bf16(&s, 3 * h * i);
        g.kernels
            .int4_dequant(&s, &ex.table, &up(&s, &sel), 3, &layout, &mut o13, &mut o2)
            .unwrap();
        let (g13, g2) = (down(&s, &o13), down(&s, &o2));
        for (x, &e) in sel.iter().enumerate() {
            let w13: Vec<bf16> = cpu::to_bf16(&ex.w13[e as usize]);
            let w2: Vec<bf16> = cpu::to_bf16(&ex.w2[e as usize]);
            assert!(
                g13[x * 2 * i * h..][..2 * i * h] == w13[..],
                "dequant w13 of expert {e} (H={h} I={i} g={gs})"
            );
            assert!(
                g2[x * h * i..][..h * i] == w2[..],
                "dequant w2 of expert {e} (H={h} I={i} g={gs})"
            );
        }
    }
}

#[test]
fn int4_invalid_expert_is_nan() {
    let name = "int4_invalid_expert_is_nan";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    // The fast path and the general entry points (partial tiles, w16).
    for (h, i, gs) in [
        (1024usize, 256usize, 128usize),
        (2880, 1408, 32),
        (5120, 2880, 64),
    ] {
        let layout = Int4Layout::new(h, i, gs).unwrap();
        let ex = experts(g, &s, &mut rng, &layout, 2);
        // Token 0 uses valid experts; token 1 also uses 7, past the table.
        let ids = vec![0u32, 1, 1, 7];
        let d_ids = up(&s, &ids);
        let x = randn_bf16(&mut rng, 2 * h, 1.0);
        let mut act = poison_f32(&s, 4 * i);
        g.kernels
            .int4_w13_swiglu(
                &s,
                &up(&s, &x),
                &ex.table,
                &d_ids,
                2,
                2,
                &layout,
                u32::MAX,
                false,
                &mut act,
            )
            .unwrap();
        let mut res = up(&s, &vec![0f32; 2 * h]);
        let w = up(&s, &[0.5f32, 0.5, 0.5, 0.5]);
        g.kernels
            .int4_w2_combine(&s, &act, &ex.table, &d_ids, &w, 2, 2, &layout, &mut res)
            .unwrap();
        let (a, r) = (down(&s, &act), down(&s, &res));
        assert!(
            a[..3 * i].iter().all(|v| v.is_finite()),
            "H={h} I={i} g={gs}: valid experts must be finite"
        );
        assert!(
            a[3 * i..].iter().all(|v| v.is_nan()),
            "H={h} I={i} g={gs}: invalid expert must be NaN"
        );
        assert!(
            r[..h].iter().all(|v| v.is_finite()) && r[h..].iter().all(|v| v.is_nan()),
            "H={h} I={i} g={gs}: the token with an invalid expert must be NaN, only it"
        );
    }
}

#[test]
fn int4_w13_slot_mask() {
    let name = "int4_w13_slot_mask";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    // The fast path (a3b) and a general entry point (group 64, partial tile).
    for (h, i, gs) in [(2048usize, 768usize, 128usize), (2880, 384, 64)] {
        slot_mask_case(g, &s, &mut rng, h, i, gs);
    }
}

fn slot_mask_case(
    g: &crate::common::Gpu,
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    rng: &mut rand::rngs::StdRng,
    h: usize,
    i: usize,
    gs: usize,
) {
    let s = s.clone();
    let (n_exp, t, k) = (10usize, 3usize, 8usize);
    let layout = Int4Layout::new(h, i, gs).unwrap();
    let ex = experts(g, &s, rng, &layout, n_exp);
    // Table entries past the real experts: NULL and a 16-byte aligned
    // address that faults if it is ever read.
    let mut table = down(&s, &ex.table);
    let (null_id, bad_id) = (table.len() as u32, table.len() as u32 + 1);
    table.push(0);
    table.push(0x0000_7ead_beef_0000);
    let table = up(&s, &table);
    let x = randn_bf16(rng, t * h, 1.0);
    let xf = f32s(&x);
    let d_x = up(&s, &x);
    for (mask, masked_out_ids) in [
        (0b1010_0110u32, None),
        (0b0101_1001, Some((null_id, bad_id))),
        (0, Some((bad_id, bad_id))),
        (0xFFFF_FF00 | 0b1000_0001, Some((bad_id, u32::MAX))),
    ] {
        let mut ids = Vec::new();
        for _ in 0..t {
            let mut all: Vec<u32> = (0..n_exp as u32).collect();
            all.shuffle(rng);
            ids.extend_from_slice(&all[..k]);
        }
        for (p, id) in ids.iter_mut().enumerate() {
            if mask >> (p % k) & 1 == 0
                && let Some((a, b)) = masked_out_ids
            {
                *id = if p % 2 == 0 { a } else { b };
            }
        }
        let mut act = poison_f32(&s, t * k * i);
        g.kernels
            .int4_w13_swiglu(
                &s,
                &d_x,
                &table,
                &up(&s, &ids),
                t,
                k,
                &layout,
                mask,
                false,
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
                    "H={h} g={gs} mask {mask:#x}: masked-out pair {p} was written"
                );
            } else {
                let e = ids[p] as usize;
                let (a, _) =
                    cpu::expert_forward(&ex.w13[e], &ex.w2[e], h, i, &xf[(p / k) * h..][..h]);
                got_in.extend_from_slice(row);
                want_in.extend(a);
            }
        }
        if !want_in.is_empty() {
            assert_close(
                &format!("masked w13 H={h} g={gs} mask {mask:#x}"),
                &got_in,
                &want_in,
                1e-4,
            );
        }
    }
}
