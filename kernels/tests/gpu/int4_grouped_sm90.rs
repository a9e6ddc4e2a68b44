//! The Hopper (sm_90a, wgmma) grouped INT4 prefill GEMMs
//! (`cuda/int4_gemm_sm90.cu`) against the f64 CPU reference and the
//! portable kernels (`int4_grouped.rs`), their row invariance, NaN rows for
//! a missing expert and bit-equal repeated launches. On a compute
//! capability 9.0 device the kernels must be loaded (a missing sm_90a
//! module fails these tests); on any other device the wrappers must refuse.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use half::{bf16, f16};
use krasis_kernels::{Act16, Int4Layout, KernelError, int4_grouped_tiles};
use rand::Rng;

use crate::common::*;
use crate::int4::experts;

type Stream = Arc<CudaStream>;

/// Whether this device must run the Hopper kernels; on others, checks that
/// both wrappers are refused and returns false.
fn hopper(g: &Gpu, s: &Stream, test: &str) -> bool {
    let cc = g.kernels.compute_capability();
    if cc == (9, 0) {
        assert!(
            g.kernels.has_int4_grouped_wgmma(),
            "{test}: a compute capability 9.0 device without the sm_90a module"
        );
        return true;
    }
    assert!(!g.kernels.has_int4_grouped_wgmma());
    let l = Int4Layout::new(1024, 384, 128).unwrap();
    let (x, off) = (up(s, &vec![bf16::ZERO; 4 * 1024]), up(s, &[0u32, 4]));
    let table = up(s, &[0u64]);
    let mut act: CudaSlice<bf16> = s.alloc_zeros(4 * 384).unwrap();
    let mut y: CudaSlice<f32> = s.alloc_zeros(4 * 1024).unwrap();
    let e1 = g
        .kernels
        .int4_grouped_w13_swiglu_wgmma(s, &x, 4, &off, 1, 1, &table, &l, &mut act)
        .unwrap_err();
    let e2 = g
        .kernels
        .int4_grouped_w2_wgmma(s, &act, 4, &off, 1, 1, &table, &l, &mut y)
        .unwrap_err();
    for e in [e1, e2] {
        assert!(matches!(e, KernelError::WrongTarget { .. }), "{e}");
    }
    eprintln!("{test}: compute capability {cc:?}: the Hopper kernels are refused, as they must be");
    false
}

/// Which grouped kernels a run uses.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kernel {
    Wgmma,
    Portable,
}

/// Outputs of one run: SwiGLU rows `[rows, I]` (as uploaded, and as f32)
/// and the down rows `[rows, H]`.
struct Out<A> {
    act_raw: Vec<A>,
    act: Vec<f32>,
    y: Vec<f32>,
}

/// Gate/up + SwiGLU on `x`, then down on its own output; both outputs
/// NaN-poisoned first, so an unwritten element fails the comparisons.
fn run<A: Act16>(
    g: &Gpu,
    s: &Stream,
    kernel: Kernel,
    table: &CudaSlice<u64>,
    layout: &Int4Layout,
    x: &[A],
    offsets: &[u32],
) -> Out<A> {
    let (h, i) = (layout.hidden, layout.intermediate);
    let n_exp = offsets.len() - 1;
    let rows = x.len() / h;
    let tiles = int4_grouped_tiles(offsets);
    let (d_off, d_x) = (up(s, offsets), up(s, x));
    let mut act = up(s, &vec![A::from_f32(f32::NAN); rows * i]);
    let k = &g.kernels;
    match kernel {
        Kernel::Wgmma => k.int4_grouped_w13_swiglu_wgmma(
            s, &d_x, rows, &d_off, n_exp, tiles, table, layout, &mut act,
        ),
        Kernel::Portable => {
            k.int4_grouped_w13_swiglu(s, &d_x, rows, &d_off, n_exp, tiles, table, layout, &mut act)
        }
    }
    .unwrap();
    let act_raw = down(s, &act);
    Out {
        act: f32s(&act_raw),
        y: down_rows(g, s, kernel, table, layout, &act_raw, offsets),
        act_raw,
    }
}

/// The down GEMM alone on the rows `act` (`[rows, I]`).
fn down_rows<A: Act16>(
    g: &Gpu,
    s: &Stream,
    kernel: Kernel,
    table: &CudaSlice<u64>,
    layout: &Int4Layout,
    act: &[A],
    offsets: &[u32],
) -> Vec<f32> {
    let (h, i) = (layout.hidden, layout.intermediate);
    let n_exp = offsets.len() - 1;
    let rows = act.len() / i;
    let tiles = int4_grouped_tiles(offsets);
    let (d_off, d_act) = (up(s, offsets), up(s, act));
    let mut y = poison_f32(s, rows * h);
    let k = &g.kernels;
    match kernel {
        Kernel::Wgmma => {
            k.int4_grouped_w2_wgmma(s, &d_act, rows, &d_off, n_exp, tiles, table, layout, &mut y)
        }
        Kernel::Portable => {
            k.int4_grouped_w2(s, &d_act, rows, &d_off, n_exp, tiles, table, layout, &mut y)
        }
    }
    .unwrap();
    down(s, &y)
}

fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
}

/// `f(row, out_row)` for every row of `out` (`width` wide), on all cores:
/// the f64 reference of a few hundred rows is most of these tests' time.
fn par_rows(out: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    let rows = out.len() / width.max(1);
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let per = rows.div_ceil(threads).max(1);
    std::thread::scope(|sc| {
        for (c, chunk) in out.chunks_mut(per * width).enumerate() {
            let f = &f;
            sc.spawn(move || {
                for (j, row) in chunk.chunks_mut(width).enumerate() {
                    f(c * per + j, row);
                }
            });
        }
    });
}

/// One shape: `counts[e]` rows for table entry e, which addresses distinct
/// expert e % `distinct` (a table of 128 entries without 128 experts'
/// weights on the host). Checks, in order: two launches bit-equal; the
/// f64 reference (SwiGLU from x; down from the kernel's own SwiGLU rows);
/// the portable kernels within the same tolerances (down on the same
/// rows); rows rotated inside each expert keep their bits; a missing
/// expert's rows NaN and the others' bits unchanged.
fn case<A: Act16>(
    g: &Gpu,
    s: &Stream,
    rng: &mut rand::rngs::StdRng,
    layout: &Int4Layout,
    counts: &[usize],
    distinct: usize,
    act_tol: f64,
) {
    let (h, i) = (layout.hidden, layout.intermediate);
    let n_exp = counts.len();
    let ex = experts(g, s, rng, layout, distinct);
    let stored = down(s, &ex.table);
    let entries: Vec<u64> = (0..n_exp).map(|e| stored[e % distinct]).collect();
    let table = up(s, &entries);
    let offsets = offsets_of(counts);
    let rows = offsets[n_exp] as usize;
    let x: Vec<A> = randn_act(rng, rows * h, 1.0);
    let xf = f32s(&x);
    let tag = format!(
        "wgmma H={h} I={i} experts={n_exp} rows={rows} f16={}",
        A::F16
    );
    let got = run(g, s, Kernel::Wgmma, &table, layout, &x, &offsets);
    let again = run(g, s, Kernel::Wgmma, &table, layout, &x, &offsets);
    assert!(
        bits_equal(&got.act, &again.act) && bits_equal(&got.y, &again.y),
        "{tag}: two launches differ"
    );

    let mut expert_of = vec![0usize; rows];
    for e in 0..n_exp {
        expert_of[offsets[e] as usize..offsets[e + 1] as usize].fill(e % distinct);
    }
    let mut want_act = vec![0f32; rows * i];
    par_rows(&mut want_act, i, |r, out| {
        let (w13, xr) = (&ex.w13[expert_of[r]], &xf[r * h..][..h]);
        for (c, o) in out.iter_mut().enumerate() {
            let gt = dot(&w13[c * h..][..h], xr);
            let ut = dot(&w13[(i + c) * h..][..h], xr);
            *o = (gt / (1.0 + (-gt).exp()) * ut) as f32;
        }
    });
    let mut want_y = vec![0f32; rows * h];
    par_rows(&mut want_y, h, |r, out| {
        let (w2, ar) = (&ex.w2[expert_of[r]], &got.act[r * i..][..i]);
        for (n, o) in out.iter_mut().enumerate() {
            *o = dot(&w2[n * i..][..i], ar) as f32;
        }
    });
    assert_close(&format!("{tag} w13+swiglu"), &got.act, &want_act, act_tol);
    assert_close(&format!("{tag} w2"), &got.y, &want_y, 2e-6);

    let port = run(g, s, Kernel::Portable, &table, layout, &x, &offsets);
    assert_close(
        &format!("{tag} w13+swiglu vs portable"),
        &got.act,
        &port.act,
        act_tol,
    );
    let port_y = down_rows(
        g,
        s,
        Kernel::Portable,
        &table,
        layout,
        &got.act_raw,
        &offsets,
    );
    assert_close(&format!("{tag} w2 vs portable"), &got.y, &port_y, 2e-6);

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
    let got2 = run(g, s, Kernel::Wgmma, &table, layout, &x2, &offsets);
    for (new, &old) in perm.iter().enumerate() {
        assert!(
            bits_equal(&got2.act[new * i..][..i], &got.act[old * i..][..i])
                && bits_equal(&got2.y[new * h..][..h], &got.y[old * h..][..h]),
            "{tag}: row {old} moved to {new} changed its bits"
        );
    }

    // Entry `gone` missing from the table: its rows NaN, the others' bits
    // unchanged.
    let gone = counts.iter().position(|&c| c > 0).unwrap();
    let mut holed = entries.clone();
    holed[gone] = 0;
    let got3 = run(g, s, Kernel::Wgmma, &up(s, &holed), layout, &x, &offsets);
    let (a, b) = (offsets[gone] as usize, offsets[gone + 1] as usize);
    for r in 0..rows {
        let (act, y) = (&got3.act[r * i..][..i], &got3.y[r * h..][..h]);
        if (a..b).contains(&r) {
            assert!(
                act.iter().all(|v| v.is_nan()) && y.iter().all(|v| v.is_nan()),
                "{tag}: row {r} of the missing expert {gone} must be NaN"
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
fn int4_grouped_wgmma_matches_reference() {
    let name = "int4_grouped_wgmma_matches_reference";
    let Some((g, s)) = gpu(name) else { return };
    if !hopper(g, &s, name) {
        return;
    }
    let mut rng = rng(name);
    // Empty experts, single rows, exactly one tile, one past it, several
    // tiles; K steps odd (I = 384: 3, the loop's odd last step) and even.
    let small = Int4Layout::new(1024, 384, 128).unwrap();
    let counts = [0, 1, 63, 64, 65, 130, 7, 0, 200];
    case::<bf16>(g, &s, &mut rng, &small, &counts, 9, 4e-3);
    case::<f16>(g, &s, &mut rng, &small, &[3, 0, 64, 129], 4, 1e-3);
    // One K step (I = 128: the down GEMM is the prologue and the odd step).
    let tiny = Int4Layout::new(512, 128, 128).unwrap();
    case::<bf16>(g, &s, &mut rng, &tiny, &[1, 64, 65, 0, 17], 5, 4e-3);
    // a3b: 128 table entries (the tile lookup's four 32-expert passes),
    // the row counts above and random ones up front, a few past entry 32,
    // 64 and 96, the rest empty.
    let a3b = Int4Layout::new(2048, 768, 128).unwrap();
    let mut counts = vec![0usize; 128];
    counts[..6].copy_from_slice(&[0, 1, 63, 64, 65, 130]);
    for c in &mut counts[6..12] {
        *c = rng.random_range(0..140);
    }
    counts[40] = 2;
    counts[77] = 65;
    counts[127] = 3;
    case::<bf16>(g, &s, &mut rng, &a3b, &counts, 16, 4e-3);
    // Qwen3-Coder-Next-like widths (2048 x 512: 4 down steps).
    let qcn = Int4Layout::new(2048, 512, 128).unwrap();
    let counts: Vec<usize> = (0..10).map(|_| rng.random_range(0..140)).collect();
    case::<bf16>(g, &s, &mut rng, &qcn, &counts, 10, 4e-3);
    // GLM-4.5-Air's widths (4096 x 1408: 11 down steps, 32 gate/up).
    let glm = Int4Layout::new(4096, 1408, 128).unwrap();
    case::<bf16>(g, &s, &mut rng, &glm, &[5, 70, 0, 33], 4, 4e-3);
}

#[test]
fn int4_grouped_wgmma_refuses_other_groups_and_bad_tiles() {
    let name = "int4_grouped_wgmma_refuses_other_groups_and_bad_tiles";
    let Some((g, s)) = gpu(name) else { return };
    if !hopper(g, &s, name) {
        return;
    }
    crate::int4_grouped::assert_refusals(g, &s, true);
}
