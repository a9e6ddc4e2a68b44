//! `rope_table` (RoPE without a q/k norm, from a frequency table) against
//! `reference::rope_table`, with gpt-oss's YaRN table at positions up to
//! 131071 and a default table at head_dim 128.

use half::bf16;
use krasis_kernels::reference as cpu;
use krasis_kernels::{QkvGeom, StartPos};

use crate::common::*;

/// gpt-oss's YaRN frequencies and cos/sin scale (head_dim 64, theta
/// 150000, factor 32 over 4096 positions, beta_fast 32, beta_slow 1, no
/// truncation), written out here as transformers' `_compute_yarn_parameters`
/// does it (f32 tensors, f64 scalars). The definition the engine uses is
/// `krasis_model::layers::rope::inv_freq`; the kernels crate does not
/// depend on krasis-model, and the kernel takes any table, so this copy
/// only has to give realistic values: dimensions 0..8 extrapolated (angles
/// up to 131071 rad), the last ones interpolated (/32), a ramp between.
fn gpt_oss_yarn() -> (Vec<f32>, f32) {
    let (d, theta, factor, orig) = (64f64, 150_000f64, 32f64, 4096f64);
    let pos: Vec<f32> = (0..32)
        .map(|i| (theta as f32).powf((2 * i) as f32 / d as f32))
        .collect();
    let corr = |rot: f64| d * (orig / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
    let (low, high) = (corr(32.0).max(0.0), corr(1.0).min(d - 1.0));
    let inv = pos
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            let ramp = ((i as f32 - low as f32) / (high - low) as f32).clamp(0.0, 1.0);
            let extra = 1.0 - ramp;
            (1.0 / (factor as f32 * p)) * (1.0 - extra) + (1.0 / p) * extra
        })
        .collect();
    (inv, (0.1 * factor.ln() + 1.0) as f32)
}

/// bf16 spacing at `v` (the unit in the last place of a bf16 near `v`).
fn bf16_ulp(v: f32) -> f32 {
    let e = v.abs().max(f32::MIN_POSITIVE).log2().floor();
    2f32.powf(e - 7.0)
}

#[test]
fn rope_table_matches_reference() {
    let name = "rope_table_matches_reference";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let (yarn, yarn_scale) = gpt_oss_yarn();
    assert!(yarn_scale > 1.3 && yarn[0] == 1.0 && yarn[31] < 1e-5);
    let default128: Vec<f32> = (0..64)
        .map(|i| 1.0 / 1_000_000f32.powf((2 * i) as f32 / 128.0))
        .collect();
    let n = 7usize;
    // (q heads, kv heads, table, scale, start, position on the device)
    type Case<'a> = (usize, usize, &'a [f32], f32, u32, bool);
    let cases: [Case<'_>; 5] = [
        // gpt-oss-20b heads: 64 q, 8 kv, d 64.
        (64, 8, &yarn, yarn_scale, 0, false),
        (64, 8, &yarn, yarn_scale, 4093, true),
        (64, 8, &yarn, yarn_scale, 131_071 - n as u32 + 1, false),
        (64, 8, &yarn, yarn_scale, 131_071 - n as u32 + 1, true),
        (8, 2, &default128, 1.0, 30_000, true),
    ];
    for (nq, nkv, table, scale, start, device_pos) in cases {
        let d = table.len() * 2;
        let geom = QkvGeom {
            n_tokens: n,
            n_q_heads: nq,
            n_kv_heads: nkv,
            head_dim: d,
        };
        let what = format!("rope_table d={d} start={start} device_pos={device_pos}");
        let x0 = randn_bf16(&mut rng, geom.len(), 2.0);
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
            .rope_table(&s, &mut x, geom, sp, &up(&s, table), scale)
            .unwrap();
        let got = down(&s, &x);
        let mut want = x0.clone();
        cpu::rope_table(&mut want, geom, start, table, scale);
        // Equal but for device vs host cosf/sinf (<= 2 + 1 f32 ulp): a
        // result may move by one bf16 ulp where its f32 value sits at a
        // rounding boundary (~1e-4 of elements), plus the absolute f32 trig
        // error where the rotation cancels to a value near zero.
        let half = d / 2;
        let mut differ = 0usize;
        for (idx, (gv, wv)) in got.iter().zip(&want).enumerate() {
            let (gf, wf) = (gv.to_f32(), wv.to_f32());
            let (t, c) = (idx / geom.row_stride(), idx % geom.row_stride());
            let (head, i) = (c / d, c % d);
            if head >= nq + nkv {
                assert_eq!(
                    gv.to_bits(),
                    x0[idx].to_bits(),
                    "{what}: v changed at {idx}"
                );
                continue;
            }
            let base = t * geom.row_stride() + head * d;
            let (a, b) = (
                x0[base + i % half].to_f32(),
                x0[base + half + i % half].to_f32(),
            );
            let tol = bf16_ulp(wf) + 8.0 * f32::EPSILON * scale * (a.abs() + b.abs());
            assert!(
                gf.is_finite() && (gf - wf).abs() <= tol,
                "{what}: token {t} head {head} dim {i}: got {gf} want {wf}"
            );
            differ += usize::from(gv.to_bits() != wv.to_bits());
        }
        eprintln!(
            "{what}: {differ} of {} elements differ by one bf16 ulp",
            got.len()
        );
        assert!(
            differ * 100 <= got.len(),
            "{what}: {differ} elements differ"
        );
    }
    // Host-side checks: the table must be head_dim / 2 long.
    let geom = QkvGeom {
        n_tokens: 1,
        n_q_heads: 2,
        n_kv_heads: 1,
        head_dim: 64,
    };
    let mut x = up(&s, &vec![bf16::ZERO; geom.len()]);
    let short = up(&s, &yarn[..16]);
    assert!(
        g.kernels
            .rope_table(&s, &mut x, geom, StartPos::Host(0), &short, 1.0)
            .is_err()
    );
    let table = up(&s, &yarn);
    assert!(
        g.kernels
            .rope_table(&s, &mut x, geom, StartPos::Host(0), &table, f32::NAN)
            .is_err()
    );
    sync(&s);
}
