use half::bf16;
use krasis_kernels::{KvBase, KvGeom, QkvGeom, StartPos, reference as cpu};
use rand::Rng;

use crate::common::*;

#[test]
fn embed_gather() {
    let name = "embed_gather";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let (vocab, hidden, n) = (1000, 256, 37);
    let table = randn_bf16(&mut rng, vocab * hidden, 1.0);
    let mut ids: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab as u32)).collect();
    ids[5] = vocab as u32 + 5; // invalid -> NaN row
    let mut out = poison_f32(&s, n * hidden);
    g.kernels
        .embed(
            &s,
            &up(&s, &table),
            vocab,
            hidden,
            &up(&s, &ids),
            n,
            &mut out,
        )
        .unwrap();
    let got = down(&s, &out);
    let want = cpu::embed(&table, hidden, &ids);
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert!(
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            "element {i}: {a} vs {b}"
        );
    }
    assert!(got[5 * hidden].is_nan());
}

#[test]
fn adds_cast_swiglu() {
    let name = "adds_cast_swiglu";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let n = 10_007;
    let acc0 = randn(&mut rng, n, 1.0);
    let xb = randn_bf16(&mut rng, n, 1.0);
    let xf = randn(&mut rng, n, 1.0);
    let mut acc = up(&s, &acc0);
    g.kernels
        .add_into_f32(&s, &mut acc, &up(&s, &xb), n)
        .unwrap();
    g.kernels
        .add_into_f32(&s, &mut acc, &up(&s, &xf), n)
        .unwrap();
    let got = down(&s, &acc);
    for i in 0..n {
        assert_eq!(got[i], acc0[i] + xb[i].to_f32() + xf[i], "add at {i}");
    }
    let mut cast = poison_bf16(&s, n);
    g.kernels
        .cast_f32_to_bf16(&s, &up(&s, &xf), &mut cast, n)
        .unwrap();
    assert_eq!(down(&s, &cast), cpu::to_bf16(&xf));

    let (rows, inter) = (13, 384);
    let gu = randn_bf16(&mut rng, rows * 2 * inter, 2.0);
    let mut out = poison_bf16(&s, rows * inter);
    g.kernels
        .swiglu(&s, &up(&s, &gu), rows, inter, &mut out)
        .unwrap();
    let want = cpu::swiglu(&f32s(&gu), inter);
    assert_close("swiglu", &f32s(&down(&s, &out)), &f32s(&want), 4e-3);
}

#[test]
fn bias_cast_rounds_once() {
    let name = "bias_cast_rounds_once";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    // gpt-oss-20b's fused q/k/v width ((64 + 2*8) * 64) and a ragged one.
    for (rows, cols) in [(37usize, 5120usize), (3, 1000)] {
        let mut x = randn(&mut rng, rows * cols, 3.0);
        let mut bias = f32s(&randn_bf16(&mut rng, cols, 1.0));
        // Row 0, column 0: the sum rounds differently from a bf16 GEMM
        // output plus the bias (see the CPU hand-value test).
        bias[0] = 2f32.powi(-19);
        x[0] = 1.0 + 2f32.powi(-8) - 2f32.powi(-20);
        let mut out = poison_bf16(&s, rows * cols);
        g.kernels
            .bias_cast_f32_to_bf16(&s, &up(&s, &x), &up(&s, &bias), rows, cols, &mut out)
            .unwrap();
        let got = down(&s, &out);
        let want = cpu::bias_cast(&x, &bias);
        assert!(
            got.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "bias_cast {rows}x{cols} differs from one rounding of the f32 sum"
        );
        assert_eq!(got[0].to_f32(), 1.0 + 2f32.powi(-7));
    }
    let short = up(&s, &[0f32; 7]);
    let mut out = poison_bf16(&s, 16);
    assert!(
        g.kernels
            .bias_cast_f32_to_bf16(&s, &up(&s, &[0f32; 16]), &short, 2, 8, &mut out)
            .is_err()
    );
    sync(&s);
}

#[test]
fn rmsnorm_variants() {
    let name = "rmsnorm_variants";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let (rows, hidden, eps) = (9, 2048, 1e-6f32);
    let w = randn_bf16(&mut rng, hidden, 1.0);
    let x = randn(&mut rng, rows * hidden, 3.0);
    let xb = randn_bf16(&mut rng, rows * hidden, 3.0);
    let wd = up(&s, &w);

    let mut out = poison_bf16(&s, rows * hidden);
    g.kernels
        .rmsnorm(&s, &up(&s, &x), &wd, rows, hidden, eps, &mut out)
        .unwrap();
    assert_close(
        "rmsnorm f32",
        &f32s(&down(&s, &out)),
        &f32s(&cpu::rmsnorm(&x, &w, hidden, eps)),
        4e-3,
    );

    let mut out = poison_bf16(&s, rows * hidden);
    g.kernels
        .rmsnorm(&s, &up(&s, &xb), &wd, rows, hidden, eps, &mut out)
        .unwrap();
    let want = cpu::rmsnorm(&f32s(&xb), &w, hidden, eps);
    assert_close("rmsnorm bf16", &f32s(&down(&s, &out)), &f32s(&want), 4e-3);

    for delta_f32 in [false, true] {
        let mut res_cpu = x.clone();
        let mut res = up(&s, &x);
        let mut out = poison_bf16(&s, rows * hidden);
        let delta = randn(&mut rng, rows * hidden, 1.0);
        let want = if delta_f32 {
            g.kernels
                .add_rmsnorm(
                    &s,
                    &mut res,
                    &up(&s, &delta),
                    &wd,
                    rows,
                    hidden,
                    eps,
                    &mut out,
                )
                .unwrap();
            cpu::add_rmsnorm(&mut res_cpu, &delta, &w, hidden, eps)
        } else {
            let db = cpu::to_bf16(&delta);
            g.kernels
                .add_rmsnorm(&s, &mut res, &up(&s, &db), &wd, rows, hidden, eps, &mut out)
                .unwrap();
            cpu::add_rmsnorm(&mut res_cpu, &f32s(&db), &w, hidden, eps)
        };
        assert_eq!(
            down(&s, &res),
            res_cpu,
            "residual after add (delta f32: {delta_f32})"
        );
        assert_close("add_rmsnorm", &f32s(&down(&s, &out)), &f32s(&want), 4e-3);
    }
}

#[test]
fn qk_norm_rope_and_kv_append() {
    let name = "qk_norm_rope_and_kv_append";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    for (d, start, device_pos) in [
        (128usize, 37u32, false),
        (128, 30_000, true),
        (64, 5, false),
    ] {
        let geom = QkvGeom {
            n_tokens: 19,
            n_q_heads: 8,
            n_kv_heads: 2,
            head_dim: d,
        };
        let kv = KvGeom {
            n_kv_heads: 2,
            head_dim: d,
            capacity: start as usize + 64,
        };
        let qkv0 = randn_bf16(&mut rng, geom.len(), 1.5);
        let qn = randn_bf16(&mut rng, d, 1.0);
        let kn = randn_bf16(&mut rng, d, 1.0);
        let mut qkv = up(&s, &qkv0);
        // Device positions: one per token.
        let pos_buf = up(
            &s,
            &(start..start + geom.n_tokens as u32).collect::<Vec<u32>>(),
        );
        let sp = if device_pos {
            StartPos::Device(&pos_buf)
        } else {
            StartPos::Host(start)
        };
        g.kernels
            .qk_norm_rope(
                &s,
                &mut qkv,
                geom,
                sp,
                &up(&s, &qn),
                &up(&s, &kn),
                1_000_000.0,
                1e-6,
            )
            .unwrap();
        let mut want = qkv0.clone();
        cpu::qk_norm_rope(&mut want, geom, start, &qn, &kn, 1_000_000.0, 1e-6);
        let got = down(&s, &qkv);
        assert_close(
            &format!("qk_norm_rope d={d} start={start}"),
            &f32s(&got),
            &f32s(&want),
            4e-3,
        );
        // v heads untouched.
        let vo = (geom.n_q_heads + geom.n_kv_heads) * d;
        for t in 0..geom.n_tokens {
            let r = t * geom.row_stride() + vo;
            assert_eq!(
                got[r..r + 2 * d],
                qkv0[r..r + 2 * d],
                "v of token {t} changed"
            );
        }
        let mut kc = poison_bf16(&s, kv.len());
        let mut vc = poison_bf16(&s, kv.len());
        g.kernels
            .kv_append(&s, &qkv, geom, sp, kv, KvBase::Host(0), &mut kc, &mut vc)
            .unwrap();
        let mut kw = vec![bf16::NAN; kv.len()];
        let mut vw = vec![bf16::NAN; kv.len()];
        cpu::kv_append(&got, geom, start, kv, &mut kw, &mut vw);
        let same =
            |a: &[bf16], b: &[bf16]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same(&down(&s, &kc), &kw), "k cache differs");
        assert!(same(&down(&s, &vc), &vw), "v cache differs");
    }
    // Host-side capacity check.
    let geom = QkvGeom {
        n_tokens: 4,
        n_q_heads: 4,
        n_kv_heads: 2,
        head_dim: 128,
    };
    let kv = KvGeom {
        n_kv_heads: 2,
        head_dim: 128,
        capacity: 10,
    };
    let qkv = poison_bf16(&s, geom.len());
    let (mut kc, mut vc) = (poison_bf16(&s, kv.len()), poison_bf16(&s, kv.len()));
    assert!(
        g.kernels
            .kv_append(
                &s,
                &qkv,
                geom,
                StartPos::Host(7),
                kv,
                KvBase::Host(0),
                &mut kc,
                &mut vc
            )
            .is_err()
    );
    sync(&s);
}
