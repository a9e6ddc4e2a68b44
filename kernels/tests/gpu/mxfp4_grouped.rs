//! The grouped MXFP4 prefill GEMMs (`cuda/mxfp4_gemm.cu`) against the f64
//! CPU reference (`reference::mxfp4_grouped_*`), their row invariance (a
//! row's bits do not depend on which tile or position it lands in), NaN for
//! a missing or misaligned expert, and the wrappers' refusals. BF16 only:
//! the MXFP4 kernels have no FP16 entry points (the engine refuses an FP16
//! MLP block with MXFP4 experts).
//!
//! Tolerances, per element (`assert_close_elem`): the decoded weights are
//! exact in bf16 and x is bf16, so every product is exact and only the f32
//! sums differ from f64 (~1e-6 relative to a dot product's scale); the
//! gate/up output is then rounded once to bf16 (<= 2^-8 relative), hence
//! 5e-3 relative + 1e-3 * rms; the down rows are f32 sums of the kernel's
//! own bf16 activation rows, hence 1e-4 relative + 1e-4 * rms. One wrongly
//! decoded code (a weight ~0.03 off, x ~1) moves a dot product of rms ~1.5
//! by ~2e-2, far outside either.

use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use krasis_kernels::ops::mxfp4::{ExpertActivation, Mxfp4Layout, mxfp4_grouped_tiles};
use krasis_kernels::reference::{self as cpu, Mxfp4Expert};
use rand::Rng;
use rand::rngs::StdRng;
use std::ops::RangeInclusive;
use std::sync::Arc;

use crate::common::*;
use crate::mxfp4::{Experts, GPT_OSS, assert_close_elem, experts};

/// Outputs of one grouped run: activation rows `[rows, I]` (as f32) and the
/// down rows `[rows, H]`.
struct Out {
    act: Vec<f32>,
    y: Vec<f32>,
}

fn run(
    g: &Gpu,
    s: &Arc<CudaStream>,
    table: &CudaSlice<u64>,
    l: &Mxfp4Layout,
    a: ExpertActivation,
    x: &[bf16],
    offsets: &[u32],
) -> Out {
    let (h, i) = (l.hidden, l.intermediate);
    let n_exp = offsets.len() - 1;
    let rows = x.len() / h;
    let tiles = mxfp4_grouped_tiles(offsets);
    let d_off = up(s, offsets);
    let d_x = up(s, x);
    let mut act = poison_bf16(s, rows * i);
    g.kernels
        .mxfp4_grouped_w13_act(s, &d_x, rows, &d_off, n_exp, tiles, table, l, a, &mut act)
        .unwrap();
    let mut y = poison_f32(s, rows * h);
    g.kernels
        .mxfp4_grouped_w2(s, &act, rows, &d_off, n_exp, tiles, table, l, &mut y)
        .unwrap();
    Out {
        act: f32s(&down(s, &act)),
        y: down(s, &y),
    }
}

/// One shape: the outputs against the f64 reference (activation from x;
/// down from the kernel's own bf16 activation rows, so only its f32 sums
/// and bias are judged), then the same rows rotated inside each expert
/// (other tiles, other positions) bit for bit, then one expert missing from
/// the table and another misaligned.
#[allow(clippy::too_many_arguments)]
fn case(
    g: &Gpu,
    s: &Arc<CudaStream>,
    rng: &mut StdRng,
    l: &Mxfp4Layout,
    counts: &[usize],
    a: ExpertActivation,
    scales: RangeInclusive<u8>,
    x_std: f32,
) {
    let (h, i) = (l.hidden, l.intermediate);
    let n_exp = counts.len();
    let ex: Experts = experts(s, rng, l, n_exp, scales);
    let host: Vec<Option<&Mxfp4Expert>> = ex.host.iter().map(Some).collect();
    let offsets = offsets_of(counts);
    let rows = offsets[n_exp] as usize;
    let x = randn_bf16(rng, rows * h, x_std);
    let xf = f32s(&x);
    let got = run(g, s, &ex.table, l, a, &x, &offsets);
    let tag = format!("H={h} I={i} bias={} {a:?} counts={counts:?}", l.has_bias);

    let want_act = cpu::mxfp4_grouped_w13_act(&host, l, &xf, &offsets, a);
    assert_close_elem(
        &format!("grouped w13+act {tag}"),
        &got.act,
        &want_act,
        5e-3,
        1e-3,
    );
    let want_y = cpu::mxfp4_grouped_w2(&host, l, &got.act, &offsets);
    assert_close_elem(&format!("grouped w2 {tag}"), &got.y, &want_y, 1e-4, 1e-4);

    // Rotate each expert's rows by a different amount: every row moves to
    // another tile position (and tile, where an expert has several).
    let mut perm = Vec::with_capacity(rows);
    for e in 0..n_exp {
        let (a0, n) = (offsets[e] as usize, counts[e]);
        let rot = if n > 1 { rng.random_range(1..n) } else { 0 };
        perm.extend((0..n).map(|j| a0 + (j + rot) % n));
    }
    let x2: Vec<bf16> = perm
        .iter()
        .flat_map(|&r| x[r * h..][..h].to_vec())
        .collect();
    let got2 = run(g, s, &ex.table, l, a, &x2, &offsets);
    for (new, &old) in perm.iter().enumerate() {
        assert!(
            bits_equal(&got2.act[new * i..][..i], &got.act[old * i..][..i])
                && bits_equal(&got2.y[new * h..][..h], &got.y[old * h..][..h]),
            "{tag}: row {old} moved to {new} changed its bits"
        );
    }

    // Expert `gone` missing from the table (null) and expert `skew`
    // misaligned: their rows NaN, the others' bits unchanged.
    let with_rows: Vec<usize> = (0..n_exp).filter(|&e| counts[e] > 0).collect();
    let (gone, skew) = (with_rows[0], with_rows[with_rows.len() - 1]);
    let mut table = down(s, &ex.table);
    table[gone] = 0;
    table[skew] += 8;
    let got3 = run(g, s, &up(s, &table), l, a, &x, &offsets);
    for r in 0..rows {
        let e = offsets.partition_point(|&o| o as usize <= r) - 1;
        let (act, y) = (&got3.act[r * i..][..i], &got3.y[r * h..][..h]);
        if e == gone || e == skew {
            assert!(
                act.iter().chain(y).all(|v| v.is_nan()),
                "{tag}: row {r} of the bad expert {e} must be NaN"
            );
        } else {
            assert!(
                bits_equal(act, &got.act[r * i..][..i]) && bits_equal(y, &got.y[r * h..][..h]),
                "{tag}: row {r} of a present expert changed"
            );
        }
    }
}

#[test]
fn mxfp4_grouped_gemms_match_reference() {
    let name = "mxfp4_grouped_gemms_match_reference";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let swiglu = ExpertActivation::Swiglu;
    // Scales 118..=123 keep |w| <= 0.375 so the gate/up dot products (rms
    // ~1.5 at x std 1) cross the clamp limit 7 only sometimes; x std 3
    // crosses it often.
    let sc = 118..=123u8;
    // gpt-oss-20b's expert (H = I = 2880: both K 22.5 steps of 128, the
    // down output 22.5 blocks of 128 rows), with biases and the clamped
    // activation: empty experts, a single row, a tile exactly, one past
    // it, two tiles and a partial third.
    let oss = Mxfp4Layout::new(2880, 2880, true).unwrap();
    case(
        g,
        &s,
        &mut rng,
        &oss,
        &[0, 1, 64, 65, 0, 130, 7, 0],
        GPT_OSS,
        sc.clone(),
        1.0,
    );
    case(
        g,
        &s,
        &mut rng,
        &oss,
        &[20, 0, 70],
        GPT_OSS,
        sc.clone(),
        3.0,
    );
    // tiny-gpt-oss's expert (H 128, I 64: the down K is half a step, one
    // gate/up block).
    let tiny = Mxfp4Layout::new(128, 64, true).unwrap();
    case(
        g,
        &s,
        &mut rng,
        &tiny,
        &[3, 0, 64, 129, 1, 0, 2, 40],
        GPT_OSS,
        sc.clone(),
        1.0,
    );
    // Widths that are multiples of 32 only (H 160: 1.25 steps and a down
    // block with 2 live warps; I 96: 0.75 steps and a gate/up block with 4
    // live warps), no biases, plain SwiGLU.
    let odd = Mxfp4Layout::new(160, 96, false).unwrap();
    case(
        g,
        &s,
        &mut rng,
        &odd,
        &[0, 5, 63, 0, 66],
        swiglu,
        sc.clone(),
        1.0,
    );
    // A 128-aligned shape (4096 x 1408: GLM-4.5-Air's widths) with
    // biases and SwiGLU, many experts at a 1,000-token chunk's spread.
    let wide = Mxfp4Layout::new(1024, 1408, true).unwrap();
    let counts: Vec<usize> = (0..12).map(|_| rng.random_range(0..140)).collect();
    case(g, &s, &mut rng, &wide, &counts, swiglu, sc, 1.0);
}

#[test]
fn mxfp4_grouped_scales_beyond_two() {
    let name = "mxfp4_grouped_scales_beyond_two";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    // Scales up to 2^13 take the decode's two-step (s > 128) path; x is
    // small so the products stay moderate.
    let l = Mxfp4Layout::new(512, 256, true).unwrap();
    case(
        g,
        &s,
        &mut rng,
        &l,
        &[9, 70, 0, 33],
        GPT_OSS,
        115..=140,
        2f32.powi(-9),
    );
}

#[test]
fn mxfp4_grouped_refuses_bad_arguments() {
    let name = "mxfp4_grouped_refuses_bad_arguments";
    let Some((g, s)) = gpu(name) else { return };
    let l = Mxfp4Layout::new(2880, 2880, true).unwrap();
    let (h, i) = (l.hidden, l.intermediate);
    let x = up(&s, &vec![bf16::ZERO; 4 * h]);
    let off = up(&s, &[0u32, 4]);
    let table = up(&s, &[0u64]);
    let mut act: CudaSlice<bf16> = s.alloc_zeros(4 * i).unwrap();
    let mut y: CudaSlice<f32> = s.alloc_zeros(4 * h).unwrap();
    let w13 = |x: &CudaSlice<bf16>,
               rows: usize,
               n_exp: usize,
               tiles: usize,
               l: &Mxfp4Layout,
               a: ExpertActivation,
               act: &mut CudaSlice<bf16>| {
        g.kernels
            .mxfp4_grouped_w13_act(&s, x, rows, &off, n_exp, tiles, &table, l, a, act)
            .unwrap_err()
            .to_string()
    };
    let e = w13(&x, 4, 1, 0, &l, GPT_OSS, &mut act);
    assert!(e.contains("cannot cover"), "{e}");
    let e = w13(&x, 4, 1, 3, &l, GPT_OSS, &mut act);
    assert!(e.contains("cannot cover"), "{e}");
    let e = w13(&x, 5, 1, 1, &l, GPT_OSS, &mut act);
    assert!(e.contains("buffer `hact`"), "{e}");
    let e = w13(&x, 4, 0, 1, &l, GPT_OSS, &mut act);
    assert!(e.contains("no experts"), "{e}");
    let e = w13(&x, 4, 2, 1, &l, GPT_OSS, &mut act);
    assert!(e.contains("buffer `offsets`"), "{e}");
    let nan = ExpertActivation::ClampedSwiglu {
        limit: f32::NAN,
        alpha: 1.0,
    };
    let e = w13(&x, 4, 1, 1, &l, nan, &mut act);
    assert!(e.contains("finite limit"), "{e}");
    let moved = Mxfp4Layout {
        w2_q: l.w2_q + 8,
        ..l
    };
    let e = w13(&x, 4, 1, 1, &moved, GPT_OSS, &mut act);
    assert!(e.contains("16-byte aligned"), "{e}");
    let short = up(&s, &vec![bf16::ZERO; 4 * h - 1]);
    let e = w13(&short, 4, 1, 1, &l, GPT_OSS, &mut act);
    assert!(e.contains("buffer `x`"), "{e}");
    // The down GEMM reads x as [rows, I] and writes y [rows, H].
    let mut short_y: CudaSlice<f32> = s.alloc_zeros(4 * h - 1).unwrap();
    let e = g
        .kernels
        .mxfp4_grouped_w2(&s, &act, 4, &off, 1, 1, &table, &l, &mut short_y)
        .unwrap_err()
        .to_string();
    assert!(e.contains("buffer `y`"), "{e}");
    // Nothing to do: no launch, no error.
    let none = up(&s, &[0u32, 0]);
    g.kernels
        .mxfp4_grouped_w2(&s, &act, 0, &none, 1, 0, &table, &l, &mut y)
        .unwrap();
}
