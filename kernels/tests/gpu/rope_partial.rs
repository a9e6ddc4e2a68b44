//! `rope_partial` (glm4_moe's partial rotary, with and without the q/k
//! RMSNorm) against `reference::rope_partial`, at GLM-4.5-Air's heads
//! (96 q / 8 kv x 128, rotary 64, no norm) and tiny-glm4-moe's (4 x 64,
//! rotary 32, q/k norm), plus the whole-head limit.

use krasis_kernels::reference as cpu;
use krasis_kernels::{QkNormArgs, QkvGeom, StartPos};

use crate::common::*;

/// Default frequencies over `rot` dimensions (`theta^(-2i/rot)`, f32), as
/// `krasis_model::layers::rope::inv_freq` computes them for a partial rotary.
fn table(rot: usize, theta: f32) -> Vec<f32> {
    (0..rot / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / rot as f32))
        .collect()
}

#[test]
fn rope_partial_matches_reference() {
    let name = "rope_partial_matches_reference";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let n = 5usize;
    // (q heads, kv heads, head_dim, rotary_dim, norm, start, device pos)
    let cases = [
        (96, 8, 128, 64, false, 0u32, false),
        (96, 8, 128, 64, false, 131_000, true),
        (4, 4, 64, 32, true, 7, false),
        (4, 4, 64, 32, true, 4_000, true),
        (8, 2, 128, 64, true, 100, true),
        (8, 2, 128, 128, true, 100, false),
    ];
    for (nq, nkv, d, rot, with_norm, start, device_pos) in cases {
        let geom = QkvGeom {
            n_tokens: n,
            n_q_heads: nq,
            n_kv_heads: nkv,
            head_dim: d,
        };
        let what = format!("rope_partial d={d} rot={rot} norm={with_norm} start={start}");
        let freqs = table(rot, 1_000_000.0);
        let x0 = randn_bf16(&mut rng, geom.len(), 2.0);
        let (qw, kw) = (randn_bf16(&mut rng, d, 1.0), randn_bf16(&mut rng, d, 1.0));
        let (qd, kd) = (up(&s, &qw), up(&s, &kw));
        let eps = 1e-5f32;
        let norm = with_norm.then_some(QkNormArgs {
            q: &qd,
            k: &kd,
            eps,
        });
        let mut x = up(&s, &x0);
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
            .rope_partial(&s, &mut x, geom, sp, norm, &up(&s, &freqs), 1.0, rot)
            .unwrap();
        let got = down(&s, &x);
        let mut want = x0.clone();
        let cpu_norm = with_norm.then_some((&qw[..], &kw[..], eps));
        cpu::rope_partial(&mut want, geom, start, cpu_norm, &freqs, 1.0, rot);
        let stride = geom.row_stride();
        for (idx, (gv, wv)) in got.iter().zip(&want).enumerate() {
            let (head, i) = ((idx % stride) / d, idx % d);
            let (gf, wf) = (gv.to_f32(), wv.to_f32());
            if head >= nq + nkv || (!with_norm && i >= rot) {
                // v, and the pass-through dims without a norm: untouched.
                assert_eq!(gv.to_bits(), x0[idx].to_bits(), "{what}: changed at {idx}");
                continue;
            }
            // Device vs host trig and the f32 vs f64 norm: a bf16 ulp or
            // two, plus absolute f32 error where a rotation cancels.
            let tol = 2.0 * wf.abs() / 128.0 + 1e-3;
            assert!(
                gf.is_finite() && (gf - wf).abs() <= tol,
                "{what}: element {idx} (head {head} dim {i}): got {gf} want {wf}"
            );
        }
        assert_close(&what, &f32s(&got), &f32s(&want), 4e-3);
    }
    // Host-side checks: an odd rotary dim and a table of the wrong length.
    let geom = QkvGeom {
        n_tokens: 1,
        n_q_heads: 2,
        n_kv_heads: 1,
        head_dim: 64,
    };
    let mut x = up(&s, &randn_bf16(&mut rng, geom.len(), 1.0));
    let t32 = up(&s, &table(32, 10_000.0));
    let k = &g.kernels;
    assert!(
        k.rope_partial(&s, &mut x, geom, StartPos::Host(0), None, &t32, 1.0, 31)
            .is_err()
    );
    assert!(
        k.rope_partial(&s, &mut x, geom, StartPos::Host(0), None, &t32, 1.0, 48)
            .is_err()
    );
    assert!(
        k.rope_partial(&s, &mut x, geom, StartPos::Host(0), None, &t32, 1.0, 96)
            .is_err()
    );
    sync(&s);
}
