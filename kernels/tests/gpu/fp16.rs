//! The FP16 attention path's non-attention kernels (`ActFormat::F16`):
//! `rmsnorm_f32_to_f16`, `bias_cast_f32_to_f16`, `rope_table_f16` and
//! `gemv_rmsnorm_f16` against their CPU references, each bit for bit where
//! its bf16 sibling is. (The attention kernels' f16 entry points run in
//! `attention.rs` and `attention/ring.rs`.)

use half::f16;
use krasis_kernels::{QkvGeom, StartPos, reference as cpu};

use crate::common::*;

/// The f16 norm output is the bf16 kernel's f32 value rounded to f16: the
/// CPU reference (f64 statistics) within an f16 ulp, and bit-identical to
/// what the fused decode GEMV writes (same code, same order).
#[test]
fn rmsnorm_f32_to_f16_and_gemv_rmsnorm_f16() {
    let name = "rmsnorm_f32_to_f16_and_gemv_rmsnorm_f16";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let kr = &g.kernels;
    let eps = 1e-5f32;
    // gpt-oss-20b: hidden 2880 into the fused q/k/v (5120); a K <= 2048
    // shape for the two-rows-per-warp entry points.
    for (n, k) in [(5120usize, 2880usize), (640, 2048)] {
        let res = randn(&mut rng, 8 * k, 3.0);
        let gw = randn_bf16(&mut rng, k, 1.0);
        let w: Vec<f16> = randn(&mut rng, n * k, 0.05)
            .into_iter()
            .map(f16::from_f32)
            .collect();
        let wf: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        let (dres, dg, dw) = (up(&s, &res), up(&s, &gw), up(&s, &w));
        for m in [1usize, 2, 5, 8] {
            if m * k > krasis_kernels::GEMV_MAX_MK {
                continue;
            }
            let tag = format!("m={m} n={n} k={k}");
            let mut normed = poison_f16(&s, m * k + 8);
            kr.rmsnorm_f32_to_f16(&s, &dres, &dg, m, k, eps, &mut normed)
                .unwrap();
            let nref = down(&s, &normed);
            assert!(
                nref[m * k..].iter().all(|v| v.is_nan()),
                "{tag}: wrote past the rows"
            );
            let nref = &nref[..m * k];
            let want: Vec<f16> = cpu::rmsnorm_as(&res[..m * k], &gw, k, eps);
            for (i, (a, b)) in nref.iter().zip(&want).enumerate() {
                let (a, b) = (a.to_f32(), b.to_f32());
                assert!(
                    (a - b).abs() <= b.abs() / 1024.0 + 1e-7,
                    "rmsnorm f16 {tag} at {i}: {a} vs {b}"
                );
            }
            // The fused GEMV: normed bit-identical, y its f32 GEMV.
            let mut fnormed = poison_f16(&s, m * k);
            let mut y = poison_f32(&s, m * n + 3);
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
                &mut y,
            )
            .unwrap();
            assert_eq!(
                f16_bits(&down(&s, &fnormed)),
                f16_bits(nref),
                "{tag}: normed differs"
            );
            let got = down(&s, &y);
            assert!(got[m * n..].iter().all(|v| v.is_nan()), "{tag}: y past m*n");
            let x: Vec<f32> = nref.iter().map(|v| v.to_f32()).collect();
            let want = cpu::gemv(&x, &wf, m, n, k, None);
            assert_close(
                &format!("gemv_rmsnorm_f16 {tag}"),
                &got[..m * n],
                &want,
                1e-5,
            );
        }
    }
    sync(&s);
}

/// One rounding of the f32 sum to f16 (bit for bit), infinite past 65504.
#[test]
fn bias_cast_f32_to_f16_rounds_once() {
    let name = "bias_cast_f32_to_f16_rounds_once";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    for (rows, cols) in [(37usize, 5120usize), (3, 1000)] {
        let mut x = randn(&mut rng, rows * cols, 3.0);
        let bias = f32s(&randn_bf16(&mut rng, cols, 1.0));
        x[1] = 70_000.0;
        let mut out = poison_f16(&s, rows * cols);
        g.kernels
            .bias_cast_f32_to_f16(&s, &up(&s, &x), &up(&s, &bias), rows, cols, &mut out)
            .unwrap();
        let got = down(&s, &out);
        let want: Vec<f16> = cpu::bias_cast_as(&x, &bias);
        assert_eq!(
            f16_bits(&got),
            f16_bits(&want),
            "bias_cast_f32_to_f16 {rows}x{cols}"
        );
        assert!(got[1].is_infinite());
    }
    sync(&s);
}

/// `rope_table_f16` (gpt-oss's path): the bf16 kernel's f32 arithmetic
/// rounded to f16; equal to the reference but where device and host
/// cos/sin differ by their few f32 ulp at an f16 rounding boundary.
#[test]
fn rope_table_f16_matches_reference() {
    let name = "rope_table_f16_matches_reference";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let d = 64usize;
    let table: Vec<f32> = (0..d / 2)
        .map(|i| 1.0 / 150_000f32.powf((2 * i) as f32 / d as f32))
        .collect();
    let scale = 0.1 * 32f32.ln() + 1.0;
    for (start, device) in [(0u32, false), (4093, true), (131_065, false)] {
        let geom = QkvGeom {
            n_tokens: 7,
            n_q_heads: 64,
            n_kv_heads: 8,
            head_dim: d,
        };
        let x0: Vec<f16> = randn(&mut rng, geom.len(), 2.0)
            .into_iter()
            .map(f16::from_f32)
            .collect();
        let mut x = up(&s, &x0);
        // Device positions: one per token.
        let pos = up(
            &s,
            &(start..start + geom.n_tokens as u32).collect::<Vec<u32>>(),
        );
        let sp = if device {
            StartPos::Device(&pos)
        } else {
            StartPos::Host(start)
        };
        g.kernels
            .rope_table(&s, &mut x, geom, sp, &up(&s, &table), scale)
            .unwrap();
        let got = down(&s, &x);
        let mut want = x0.clone();
        cpu::rope_table(&mut want, geom, start, &table, scale);
        let mut differ = 0usize;
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            let (af, bf) = (a.to_f32(), b.to_f32());
            // One f16 ulp at |b| (2^-10 relative), plus f32 trig error.
            let tol = bf.abs().max(6.1e-5) / 1024.0 + 1e-5 * scale;
            assert!(
                af.is_finite() && (af - bf).abs() <= tol,
                "rope_table_f16 start={start} at {i}: {af} vs {bf}"
            );
            differ += usize::from(a.to_bits() != b.to_bits());
        }
        assert!(
            differ * 100 <= got.len(),
            "start={start}: {differ} elements differ"
        );
        // v untouched.
        let vo = (geom.n_q_heads + geom.n_kv_heads) * d;
        for t in 0..geom.n_tokens {
            let r = t * geom.row_stride() + vo;
            assert_eq!(
                f16_bits(&got[r..r + geom.n_kv_heads * d]),
                f16_bits(&x0[r..r + geom.n_kv_heads * d])
            );
        }
    }
    sync(&s);
}
