//! The Hopper (sm_90a, wgmma) prefill attention kernel against the CPU
//! reference and the portable mma.sync kernel. On a compute capability 9.0
//! device the kernel must be loaded (a missing sm_90a module fails these
//! tests); on any other device the wrapper must refuse.

use half::bf16;
use krasis_kernels::{KernelError, QkvGeom};

use super::{case, reference_rows};
use crate::common::*;

/// Whether this device must run the Hopper kernel; on others, checks that
/// it is refused and returns false.
fn hopper(g: &Gpu, s: &std::sync::Arc<cudarc::driver::CudaStream>, test: &str) -> bool {
    let cc = g.kernels.compute_capability();
    if cc == (9, 0) {
        assert!(
            g.kernels.has_prefill_wgmma(),
            "{test}: a compute capability 9.0 device without the sm_90a module"
        );
        return true;
    }
    assert!(!g.kernels.has_prefill_wgmma());
    let geom = QkvGeom {
        n_tokens: 4,
        n_q_heads: 2,
        n_kv_heads: 1,
        head_dim: 128,
    };
    let mut rng = rng(test);
    let c = case::<bf16>(&mut rng, geom, 0, 8);
    let (q, k, v) = (up(s, &c.qkv), up(s, &c.kc), up(s, &c.vc));
    let mut out = poison_bf16(s, 4 * 2 * 128);
    let err = g
        .kernels
        .attention_prefill_wgmma(s, &q, geom, 0, c.kv, 0, &k, &v, 0.1, &mut out)
        .unwrap_err();
    assert!(matches!(err, KernelError::WrongTarget { .. }), "{err}");
    eprintln!("{test}: compute capability {cc:?}: the Hopper kernel is refused, as it must be");
    false
}

/// Against the CPU reference and the portable kernel: chunked prefill
/// (start > 0), n_tokens not a multiple of the 128-row tile, GQA groups
/// 1..8, T up to 2,100. Outputs are NaN-poisoned with a poisoned guard past
/// the last row, and a second launch must match bit for bit.
#[test]
fn attention_prefill_wgmma_matches_reference() {
    let name = "attention_prefill_wgmma_matches_reference";
    let Some((g, s)) = gpu(name) else { return };
    if !hopper(g, &s, name) {
        return;
    }
    let mut rng = rng(name);
    let d = 128;
    // (n_tokens, start, n_q_heads, n_kv_heads)
    for (t, start, nq, nkv) in [
        (150usize, 70usize, 8usize, 2usize),
        (64, 0, 8, 2),
        (128, 0, 4, 4),
        (1, 300, 8, 2),
        (129, 63, 16, 1),
        (300, 0, 32, 4),
        (1000, 500, 16, 2),
        (2100, 37, 8, 1),
    ] {
        let geom = QkvGeom {
            n_tokens: t,
            n_q_heads: nq,
            n_kv_heads: nkv,
            head_dim: d,
        };
        let what = format!("T={t} start={start} nq={nq} nkv={nkv}");
        let c = case::<bf16>(&mut rng, geom, start, start + t + 13);
        let scale = 1.0 / (d as f32).sqrt();
        let (q, k, v) = (up(&s, &c.qkv), up(&s, &c.kc), up(&s, &c.vc));
        let n = t * nq * d;
        let guard = 128 * nq * d;
        let run = |hopper: bool| {
            let label = format!("wgmma {what} hopper={hopper}");
            guarded_bf16(&s, n, guard, &label, |out| {
                if hopper {
                    g.kernels
                        .attention_prefill_wgmma(&s, &q, geom, start, c.kv, 0, &k, &v, scale, out)
                        .unwrap();
                } else {
                    g.kernels
                        .attention_prefill(&s, &q, geom, start, c.kv, 0, &k, &v, scale, out)
                        .unwrap();
                }
            })
        };
        let wg = run(true);
        let mma = run(false);
        assert!(
            run(true)
                .iter()
                .zip(&wg)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "wgmma {what}: two launches differ"
        );
        let windows: Vec<std::ops::Range<usize>> = if t <= 300 {
            std::iter::once(0..t).collect()
        } else {
            vec![0..20, t - 140..t]
        };
        let row = nq * d;
        for w in windows {
            let want = reference_rows(&c, geom, w.clone(), scale);
            let span = w.start * row..w.end * row;
            assert_close(
                &format!("prefill wgmma {what} rows {w:?}"),
                &wg[span],
                &want,
                1e-2,
            );
        }
        assert_close(&format!("prefill wgmma vs mma {what}"), &wg, &mma, 1e-2);
    }
}

/// A row's bits do not depend on the chunk it is computed in: one launch
/// over every row against chunkings whose starts are not multiples of the
/// 128-row tile (what a prefix-cache resume then chunks give), single rows
/// across a tile edge, and chunks of one warpgroup's 64 rows.
#[test]
fn attention_prefill_wgmma_rows_are_chunk_invariant() {
    let name = "attention_prefill_wgmma_rows_are_chunk_invariant";
    let Some((g, s)) = gpu(name) else { return };
    if !hopper(g, &s, name) {
        return;
    }
    let mut rng = rng(name);
    let t = 400usize;
    let chunkings: [&[usize]; 5] = [
        &[0, 128, 256, 384, 400],
        &[0, 37, 100, 163, 290, 400],
        &[0, 1, 2, 127, 128, 129, 260, 261, 399, 400],
        &[0, 64, 128, 192, 256, 320, 384, 400],
        &[0, 256, 399, 400],
    ];
    let (d, nq, nkv) = (128usize, 16usize, 2usize);
    let geom = QkvGeom {
        n_tokens: t,
        n_q_heads: nq,
        n_kv_heads: nkv,
        head_dim: d,
    };
    let c = case::<bf16>(&mut rng, geom, 0, t + 11);
    let scale = 1.0 / (d as f32).sqrt();
    let (k, v) = (up(&s, &c.kc), up(&s, &c.vc));
    let rs = geom.row_stride();
    let row = nq * d;
    let run = |a: usize, b: usize| {
        let q = up(&s, &c.qkv[a * rs..b * rs]);
        let gg = QkvGeom {
            n_tokens: b - a,
            ..geom
        };
        let mut out = poison_bf16(&s, (b - a) * row);
        g.kernels
            .attention_prefill_wgmma(&s, &q, gg, a, c.kv, 0, &k, &v, scale, &mut out)
            .unwrap();
        down(&s, &out)
            .iter()
            .map(|x| x.to_bits())
            .collect::<Vec<u16>>()
    };
    let whole = run(0, t);
    for bounds in chunkings {
        let mut got = Vec::with_capacity(whole.len());
        for w in bounds.windows(2) {
            got.extend(run(w[0], w[1]));
        }
        let first = (0..t).find(|&r| got[r * row..(r + 1) * row] != whole[r * row..(r + 1) * row]);
        assert!(
            first.is_none(),
            "{name}: chunks {bounds:?}: row {first:?} differs from the one-chunk prefill"
        );
    }
}

/// Only head_dim 128: other head dims are refused with a shape error that
/// names the portable kernel.
#[test]
fn attention_prefill_wgmma_refuses_other_head_dims() {
    let name = "attention_prefill_wgmma_refuses_other_head_dims";
    let Some((g, s)) = gpu(name) else { return };
    if !hopper(g, &s, name) {
        return;
    }
    let mut rng = rng(name);
    let geom = QkvGeom {
        n_tokens: 8,
        n_q_heads: 4,
        n_kv_heads: 2,
        head_dim: 64,
    };
    let c = case::<bf16>(&mut rng, geom, 0, 16);
    let (q, k, v) = (up(&s, &c.qkv), up(&s, &c.kc), up(&s, &c.vc));
    let mut out = poison_bf16(&s, 8 * 4 * 64);
    let err = g
        .kernels
        .attention_prefill_wgmma(&s, &q, geom, 0, c.kv, 0, &k, &v, 0.125, &mut out)
        .unwrap_err();
    assert!(
        matches!(err, KernelError::Shape { .. }) && err.to_string().contains("attention_prefill"),
        "{err}"
    );
}
