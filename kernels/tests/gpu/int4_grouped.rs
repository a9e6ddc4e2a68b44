//! The grouped INT4 prefill GEMMs (`cuda/int4_gemm.cu`) against the f64 CPU
//! reference, their row invariance (a row's bits do not depend on which
//! tile or position it lands in), and NaN for a missing expert.

use cudarc::driver::{CudaSlice, CudaStream};
use half::{bf16, f16};
use krasis_kernels::{Act16, Int4Layout, int4_grouped_tiles};
use rand::Rng;
use std::sync::Arc;

use crate::common::*;
use crate::int4::{Experts, experts};

/// Outputs of one grouped run: SwiGLU rows `[rows, I]` (as f32) and the
/// down rows `[rows, H]`.
struct Out {
    act: Vec<f32>,
    y: Vec<f32>,
}

fn run<A: Act16>(
    g: &Gpu,
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    table: &CudaSlice<u64>,
    layout: &Int4Layout,
    x: &[A],
    offsets: &[u32],
) -> Out {
    let (h, i) = (layout.hidden, layout.intermediate);
    let n_exp = offsets.len() - 1;
    let rows = x.len() / h;
    let tiles = int4_grouped_tiles(offsets);
    let d_off = up(s, offsets);
    let d_x = up(s, x);
    let mut act = up(s, &vec![A::default(); rows * i]);
    g.kernels
        .int4_grouped_w13_swiglu(s, &d_x, rows, &d_off, n_exp, tiles, table, layout, &mut act)
        .unwrap();
    let mut y = poison_f32(s, rows * h);
    g.kernels
        .int4_grouped_w2(s, &act, rows, &d_off, n_exp, tiles, table, layout, &mut y)
        .unwrap();
    Out {
        act: f32s(&down(s, &act)),
        y: down(s, &y),
    }
}

/// One shape: the outputs against the f64 reference (SwiGLU from x; down
/// from the kernel's own rounded SwiGLU rows, so only its f32 sums are
/// judged), then the same rows rotated inside each expert (other tiles,
/// other positions) bit for bit, then one expert missing from the table.
fn case<A: Act16>(
    g: &Gpu,
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    rng: &mut rand::rngs::StdRng,
    layout: &Int4Layout,
    counts: &[usize],
    act_tol: f64,
) {
    let (h, i) = (layout.hidden, layout.intermediate);
    let n_exp = counts.len();
    let ex: Experts = experts(g, s, rng, layout, n_exp);
    let offsets = offsets_of(counts);
    let rows = offsets[n_exp] as usize;
    let x: Vec<A> = randn_act(rng, rows * h, 1.0);
    let xf = f32s(&x);
    let got = run(g, s, &ex.table, layout, &x, &offsets);
    let tag = format!("H={h} I={i} counts={counts:?} f16={}", A::F16);

    let (mut want_act, mut want_y) = (vec![0f32; rows * i], vec![0f32; rows * h]);
    for e in 0..n_exp {
        for r in offsets[e] as usize..offsets[e + 1] as usize {
            let xr = &xf[r * h..][..h];
            for c in 0..i {
                let gt = dot(&ex.w13[e][c * h..][..h], xr);
                let ut = dot(&ex.w13[e][(i + c) * h..][..h], xr);
                want_act[r * i + c] = (gt / (1.0 + (-gt).exp()) * ut) as f32;
            }
            let ar = &got.act[r * i..][..i];
            for n in 0..h {
                want_y[r * h + n] = dot(&ex.w2[e][n * i..][..i], ar) as f32;
            }
        }
    }
    assert_close(
        &format!("grouped w13+swiglu {tag}"),
        &got.act,
        &want_act,
        act_tol,
    );
    assert_close(&format!("grouped w2 {tag}"), &got.y, &want_y, 2e-6);

    // Rotate each expert's rows by a different amount: every row moves to
    // another tile position (and tile, where an expert has several).
    let mut perm = Vec::with_capacity(rows);
    for e in 0..n_exp {
        let (a, n) = (offsets[e] as usize, counts[e]);
        let rot = if n > 1 { rng.random_range(1..n) } else { 0 };
        perm.extend((0..n).map(|j| a + (j + rot) % n));
    }
    let x2: Vec<A> = perm
        .iter()
        .flat_map(|&r| x[r * h..][..h].to_vec())
        .collect();
    let got2 = run(g, s, &ex.table, layout, &x2, &offsets);
    for (new, &old) in perm.iter().enumerate() {
        assert!(
            got2.act[new * i..][..i]
                .iter()
                .zip(&got.act[old * i..][..i])
                .all(|(a, b)| a.to_bits() == b.to_bits())
                && got2.y[new * h..][..h]
                    .iter()
                    .zip(&got.y[old * h..][..h])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{tag}: row {old} moved to {new} changed its bits"
        );
    }

    // Expert `gone` missing from the table: its rows NaN, the others' bits unchanged.
    let gone = counts.iter().position(|&c| c > 0).unwrap();
    let mut table = down(s, &ex.table);
    table[gone] = 0;
    let got3 = run(g, s, &up(s, &table), layout, &x, &offsets);
    let (a, b) = (offsets[gone] as usize, offsets[gone + 1] as usize);
    for r in 0..rows {
        let mine = &got3.y[r * h..][..h];
        if (a..b).contains(&r) {
            assert!(
                mine.iter().all(|v| v.is_nan())
                    && got3.act[r * i..][..i].iter().all(|v| v.is_nan()),
                "{tag}: row {r} of the missing expert {gone} must be NaN"
            );
        } else {
            assert!(
                mine.iter()
                    .zip(&got.y[r * h..][..h])
                    .all(|(p, q)| p.to_bits() == q.to_bits()),
                "{tag}: row {r} of a present expert changed"
            );
        }
    }
}

#[test]
fn int4_grouped_gemms_match_reference() {
    let name = "int4_grouped_gemms_match_reference";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    // Empty experts, single rows, exactly one tile, one past it, several
    // tiles; a3b's widths (2048 x 768) with a 1,000-token chunk's spread of
    // rows per expert; GLM-4.5-Air's intermediate (1408 = 11 x 128).
    let small = Int4Layout::new(1024, 384, 128).unwrap();
    case::<bf16>(
        g,
        &s,
        &mut rng,
        &small,
        &[0, 1, 63, 64, 65, 130, 7, 0, 200],
        4e-3,
    );
    case::<f16>(g, &s, &mut rng, &small, &[3, 0, 64, 129], 1e-3);
    let a3b = Int4Layout::new(2048, 768, 128).unwrap();
    let counts: Vec<usize> = (0..12).map(|_| rng.random_range(0..140)).collect();
    case::<bf16>(g, &s, &mut rng, &a3b, &counts, 4e-3);
    let glm = Int4Layout::new(1024, 1408, 128).unwrap();
    case::<bf16>(g, &s, &mut rng, &glm, &[5, 70, 0, 33], 4e-3);
}

#[test]
fn int4_grouped_refuses_other_groups_and_bad_tiles() {
    let name = "int4_grouped_refuses_other_groups_and_bad_tiles";
    let Some((g, s)) = gpu(name) else { return };
    assert_refusals(g, &s, false);
}

/// The gate/up wrapper (`hopper`: its wgmma form) refuses a group of 32 and
/// a tile count that cannot cover the rows.
pub fn assert_refusals(g: &Gpu, s: &Arc<CudaStream>, hopper: bool) {
    let (x, off) = (up(s, &vec![bf16::ZERO; 4 * 1024]), up(s, &[0u32, 4]));
    let table = up(s, &[0u64]);
    let mut act: CudaSlice<bf16> = s.alloc_zeros(4 * 384).unwrap();
    let mut launch = |l: &Int4Layout, tiles: usize| {
        let k = &g.kernels;
        let r = if hopper {
            k.int4_grouped_w13_swiglu_wgmma(s, &x, 4, &off, 1, tiles, &table, l, &mut act)
        } else {
            k.int4_grouped_w13_swiglu(s, &x, 4, &off, 1, tiles, &table, l, &mut act)
        };
        r.unwrap_err().to_string()
    };
    let e = launch(&Int4Layout::new(1024, 384, 32).unwrap(), 1);
    assert!(e.contains("group 128"), "hopper={hopper}: {e}");
    let e = launch(&Int4Layout::new(1024, 384, 128).unwrap(), 0);
    assert!(e.contains("cannot cover"), "hopper={hopper}: {e}");
}
