use cudarc::driver::{CudaSlice, DevicePtr};
use half::bf16;
use krasis_kernels::{Int4Layout, reference as cpu};
use rand::Rng;
use rand::seq::SliceRandom;

use crate::common::*;

/// `n` random experts quantized into one device buffer, 4096-aligned, and
/// the pointer table addressing them.
struct Experts {
    _buf: CudaSlice<u8>,
    table: CudaSlice<u64>,
    w13: Vec<Vec<f32>>,
    w2: Vec<Vec<f32>>,
}

fn experts(
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
        let w13 = randn(rng, 2 * i * h, 0.05);
        let w2 = randn(rng, h * i, 0.05);
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

#[test]
fn int4_decode_gemv_matches_reference() {
    let name = "int4_decode_gemv_matches_reference";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    // a3b and qcn dims at 1 and up to 8 tokens, then odd dims exercising
    // every entry point: partial K splits, H up to 4096, I up to 2048 with
    // top_k 16 (the shared-memory opt-in of w2).
    for (h, i, n_exp, t, k) in [
        (2048usize, 768usize, 16usize, 1usize, 8usize),
        (2048, 768, 16, 2, 8),
        (2048, 512, 12, 8, 10),
        (1152, 1280, 6, 3, 3),
        (4096, 384, 5, 2, 4),
        (3072, 256, 4, 1, 3),
        (640, 128, 3, 5, 2),
        (1024, 2048, 16, 1, 16),
    ] {
        let layout = Int4Layout::new(h, i).unwrap();
        let ex = experts(g, &s, &mut rng, &layout, n_exp);
        let mut ids = Vec::new();
        for _ in 0..t {
            let mut all: Vec<u32> = (0..n_exp as u32).collect();
            all.shuffle(&mut rng);
            ids.extend_from_slice(&all[..k]);
        }
        let weights: Vec<f32> = (0..t * k).map(|_| rng.random_range(0.0..1.0)).collect();
        let x = randn_bf16(&mut rng, t * h, 1.0);
        let xf = f32s(&x);
        let (d_ids, d_w) = (up(&s, &ids), up(&s, &weights));
        let d_x = up(&s, &x);
        let res0 = randn(&mut rng, t * h, 1.0);
        // Run twice: the results must be bit-identical (fixed reduction order).
        let mut runs = Vec::new();
        for _ in 0..2 {
            let mut act = poison_f32(&s, t * k * i);
            g.kernels
                .int4_w13_swiglu(
                    &s,
                    &d_x,
                    &ex.table,
                    &d_ids,
                    t,
                    k,
                    &layout,
                    u32::MAX,
                    &mut act,
                )
                .unwrap();
            let mut res = up(&s, &res0);
            g.kernels
                .int4_w2_combine(&s, &act, &ex.table, &d_ids, &d_w, t, k, &layout, &mut res)
                .unwrap();
            runs.push((down(&s, &act), down(&s, &res)));
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(
            bits(&runs[0].0) == bits(&runs[1].0) && bits(&runs[0].1) == bits(&runs[1].1),
            "H={h} I={i}: two runs differ"
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
        assert_close(&format!("w13+swiglu H={h} I={i}"), &act, &want_act, 1e-4);
        let got: Vec<f32> = res.iter().zip(&res0).map(|(a, b)| a - b).collect();
        let want: Vec<f32> = want_res.iter().zip(&res0).map(|(a, b)| a - b).collect();
        assert_close(&format!("w2+combine H={h} I={i}"), &got, &want, 1e-4);

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
                "dequant w13 of expert {e}"
            );
            assert!(
                g2[x * h * i..][..h * i] == w2[..],
                "dequant w2 of expert {e}"
            );
        }
    }
}

#[test]
fn int4_invalid_expert_is_nan() {
    let name = "int4_invalid_expert_is_nan";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let layout = Int4Layout::new(1024, 256).unwrap();
    let ex = experts(g, &s, &mut rng, &layout, 2);
    let ids = vec![0u32, 7]; // 7 is past the 2-entry table
    let x = randn_bf16(&mut rng, 1024, 1.0);
    let mut act = poison_f32(&s, 2 * 256);
    g.kernels
        .int4_w13_swiglu(
            &s,
            &up(&s, &x),
            &ex.table,
            &up(&s, &ids),
            1,
            2,
            &layout,
            u32::MAX,
            &mut act,
        )
        .unwrap();
    let a = down(&s, &act);
    assert!(
        a[..256].iter().all(|v| v.is_finite()),
        "valid expert must be finite"
    );
    assert!(
        a[256..].iter().all(|v| v.is_nan()),
        "invalid expert must be NaN"
    );
}

#[test]
fn int4_w13_slot_mask() {
    let name = "int4_w13_slot_mask";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let (h, i, n_exp, t, k) = (2048usize, 768usize, 10usize, 3usize, 8usize);
    let layout = Int4Layout::new(h, i).unwrap();
    let ex = experts(g, &s, &mut rng, &layout, n_exp);
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
        (0b1010_0110u32, None),
        (0b0101_1001, Some((null_id, bad_id))),
        (0, Some((bad_id, bad_id))),
        (0xFFFF_FF00 | 0b1000_0001, Some((bad_id, u32::MAX))),
    ] {
        let mut ids = Vec::new();
        for _ in 0..t {
            let mut all: Vec<u32> = (0..n_exp as u32).collect();
            all.shuffle(&mut rng);
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
                let e = ids[p] as usize;
                let (a, _) =
                    cpu::expert_forward(&ex.w13[e], &ex.w2[e], h, i, &xf[(p / k) * h..][..h]);
                got_in.extend_from_slice(row);
                want_in.extend(a);
            }
        }
        if !want_in.is_empty() {
            assert_close(
                &format!("masked w13 mask {mask:#x}"),
                &got_in,
                &want_in,
                1e-4,
            );
        }
    }
}
