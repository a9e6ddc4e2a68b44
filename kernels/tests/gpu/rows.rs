//! Row invariance of the kernels a batched decode step runs over M rows
//! (one row per sequence, continuous batching): row `r` of an `m`-row
//! launch must be bit-identical to a one-row launch of that row alone,
//! for every `m <= GEMV_MAX_TOKENS`, whatever the other rows hold. This is
//! what makes a sequence's tokens and logits independent of which
//! sequences decode beside it. Each kernel is checked in both 16-bit
//! activation formats where it has both.

use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use krasis_kernels::{Act16, GEMV_MAX_MK, GEMV_MAX_TOKENS, GemvOut, Int4Layout, Kernels};
use rand::Rng;
use rand::seq::SliceRandom;

use crate::common::*;

fn bits32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Most rows one GEMV launch takes at this `k`.
fn max_rows(k: usize) -> usize {
    (GEMV_MAX_MK / k).min(GEMV_MAX_TOKENS)
}

/// `gemv` and `gemv_rmsnorm` with output `O`: the `m`-row launch's row `r`
/// against the one-row launch of row `r`, for every `m`, plain, accumulate
/// (f32 only) and with the RMSNorm fused in (its `normed` row too).
fn gemv_rows_are_invariant<A: Act16, O: GemvOut<A> + Default>(
    kr: &Kernels,
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    rng: &mut rand::rngs::StdRng,
    fmt: &str,
) {
    let wide = std::mem::size_of::<O>() == 4;
    // K <= 2048 runs the 2-rows-per-warp entry points, larger K the
    // 1-row ones; 264 leaves lanes idle; 12288 allows 2 rows only.
    for (n, k) in [
        (5120usize, 2048usize),
        (2048, 4096),
        (151, 2880),
        (300, 264),
        (40, 12288),
    ] {
        let mt = max_rows(k);
        let w = up(s, &randn_act::<A>(rng, n * k, 0.05));
        let x = randn_act::<A>(rng, mt * k, 1.0);
        let res = randn(rng, mt * k, 3.0);
        let y0 = randn(rng, mt * n, 1.0);
        let gw = up(s, &randn_bf16(rng, k, 1.0));
        let eps = 1e-6f32;
        // The rows alone.
        let mut alone_plain = Vec::new();
        let mut alone_acc = Vec::new();
        let mut alone_norm = Vec::new();
        for r in 0..mt {
            let xr = up(s, &x[r * k..(r + 1) * k]);
            let mut y = up(s, &vec![O::default(); n]);
            kr.gemv::<A, O>(s, &xr, &w, 1, n, k, false, &mut y).unwrap();
            alone_plain.push(down(s, &y));
            if wide {
                let mut ya = up(s, &y0[r * n..(r + 1) * n]);
                kr.gemv::<A, f32>(s, &xr, &w, 1, n, k, true, &mut ya)
                    .unwrap();
                alone_acc.push(down(s, &ya));
            }
            let rr = up(s, &res[r * k..(r + 1) * k]);
            let mut normed = up(s, &vec![A::default(); k]);
            let mut y = up(s, &vec![O::default(); n]);
            kr.gemv_rmsnorm::<A, O>(s, &rr, &gw, eps, &w, 1, n, k, false, &mut normed, &mut y)
                .unwrap();
            alone_norm.push((down(s, &normed), down(s, &y)));
        }
        let (dx, dres) = (up(s, &x), up(s, &res));
        for m in 1..=mt {
            let tag = format!("{fmt} m={m} n={n} k={k} f32 out {wide}");
            let mut y = up(s, &vec![O::default(); m * n]);
            kr.gemv::<A, O>(s, &dx, &w, m, n, k, false, &mut y).unwrap();
            let y = down(s, &y);
            let mut normed = up(s, &vec![A::default(); m * k]);
            let mut yn = up(s, &vec![O::default(); m * n]);
            kr.gemv_rmsnorm::<A, O>(s, &dres, &gw, eps, &w, m, n, k, false, &mut normed, &mut yn)
                .unwrap();
            let (normed, yn) = (down(s, &normed), down(s, &yn));
            let ya = wide.then(|| {
                let mut ya = up(s, &y0[..m * n]);
                kr.gemv::<A, f32>(s, &dx, &w, m, n, k, true, &mut ya)
                    .unwrap();
                down(s, &ya)
            });
            for r in 0..m {
                assert!(
                    out_bits(&y[r * n..(r + 1) * n]) == out_bits(&alone_plain[r]),
                    "gemv {tag}: row {r} differs from its one-row launch"
                );
                assert!(
                    out_bits(&normed[r * k..(r + 1) * k]) == out_bits(&alone_norm[r].0),
                    "gemv_rmsnorm {tag}: normed row {r} differs from its one-row launch"
                );
                assert!(
                    out_bits(&yn[r * n..(r + 1) * n]) == out_bits(&alone_norm[r].1),
                    "gemv_rmsnorm {tag}: row {r} differs from its one-row launch"
                );
                if let Some(ya) = &ya {
                    assert!(
                        bits32(&ya[r * n..(r + 1) * n]) == bits32(&alone_acc[r]),
                        "gemv accumulate {tag}: row {r} differs from its one-row launch"
                    );
                }
            }
        }
    }
}

/// The bits of a GEMV output of either width.
fn out_bits<O>(v: &[O]) -> Vec<u32> {
    match std::mem::size_of::<O>() {
        // SAFETY: O is f32 (4 bytes) or a 16-bit format (2 bytes), plain
        // values; the bytes are initialised and live as long as `v`.
        4 => unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u32, v.len()) }.to_vec(),
        2 => unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u16, v.len()) }
            .iter()
            .map(|&b| b as u32)
            .collect(),
        w => panic!("GEMV output of {w} bytes"),
    }
}

#[test]
fn gemv_rows_are_batch_invariant() {
    let name = "gemv_rows_are_batch_invariant";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let kr = &g.kernels;
    gemv_rows_are_invariant::<bf16, f32>(kr, &s, &mut rng, "bf16");
    gemv_rows_are_invariant::<bf16, bf16>(kr, &s, &mut rng, "bf16");
    gemv_rows_are_invariant::<f16, f32>(kr, &s, &mut rng, "f16");
    gemv_rows_are_invariant::<f16, f16>(kr, &s, &mut rng, "f16");
    sync(&s);
}

/// INT4 decode experts: `int4_w13_swiglu` (every pair) and
/// `int4_w2_combine` over `m` tokens against each token alone, with x in
/// format `A`; tokens share experts (as sequences routed to the same
/// expert do) and each token has its own routes, weights and residual.
fn int4_rows_are_invariant<A: Act16>(
    g: &crate::common::Gpu,
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    rng: &mut rand::rngs::StdRng,
    fmt: &str,
) {
    let kr = &g.kernels;
    // a3b's fast path, and a general (group 32, partial tile) shape.
    for (h, i, gs, n_exp, k) in [
        (2048usize, 768usize, 128usize, 12usize, 8usize),
        (2880, 1408, 32, 6, 4),
    ] {
        let layout = Int4Layout::new(h, i, gs).unwrap();
        let ex = crate::int4::experts(g, s, rng, &layout, n_exp);
        let mt = GEMV_MAX_TOKENS;
        let mut ids = Vec::new();
        for _ in 0..mt {
            let mut all: Vec<u32> = (0..n_exp as u32).collect();
            all.shuffle(rng);
            ids.extend_from_slice(&all[..k]);
        }
        let weights: Vec<f32> = (0..mt * k).map(|_| rng.random_range(0.0..1.0)).collect();
        let x = randn_act::<A>(rng, mt * h, 1.0);
        let res0 = randn(rng, mt * h, 1.0);
        let run = |t: usize, first: usize| -> (Vec<f32>, Vec<f32>) {
            let dx = up(s, &x[first * h..(first + t) * h]);
            let dids = up(s, &ids[first * k..(first + t) * k]);
            let dw = up(s, &weights[first * k..(first + t) * k]);
            let mut act: CudaSlice<f32> = poison_f32(s, t * k * i);
            kr.int4_w13_swiglu(s, &dx, &ex.table, &dids, t, k, &layout, u32::MAX, &mut act)
                .unwrap();
            let mut res = up(s, &res0[first * h..(first + t) * h]);
            kr.int4_w2_combine(s, &act, &ex.table, &dids, &dw, t, k, &layout, &mut res)
                .unwrap();
            (down(s, &act), down(s, &res))
        };
        let alone: Vec<_> = (0..mt).map(|r| run(1, r)).collect();
        for m in 1..=mt {
            let tag = format!("{fmt} H={h} I={i} g={gs} m={m}");
            let (act, res) = run(m, 0);
            for r in 0..m {
                assert!(
                    bits32(&act[r * k * i..(r + 1) * k * i]) == bits32(&alone[r].0),
                    "int4_w13_swiglu {tag}: token {r} differs from its one-token launch"
                );
                assert!(
                    bits32(&res[r * h..(r + 1) * h]) == bits32(&alone[r].1),
                    "int4_w2_combine {tag}: token {r} differs from its one-token launch"
                );
            }
        }
    }
}

#[test]
fn int4_decode_rows_are_batch_invariant() {
    let name = "int4_decode_rows_are_batch_invariant";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    int4_rows_are_invariant::<bf16>(g, &s, &mut rng, "bf16");
    int4_rows_are_invariant::<f16>(g, &s, &mut rng, "f16");
    sync(&s);
}

/// The router's top-k over `m` tokens' logits against each token alone.
#[test]
fn router_rows_are_batch_invariant() {
    let name = "router_rows_are_batch_invariant";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let kr = &g.kernels;
    let (e, k, mt) = (128usize, 8usize, GEMV_MAX_TOKENS);
    let logits = randn(&mut rng, mt * e, 2.0);
    let run = |t: usize, first: usize| -> (Vec<u32>, Vec<f32>) {
        let dl = up(&s, &logits[first * e..(first + t) * e]);
        let mut ids = poison_u32(&s, t * k);
        let mut w = poison_f32(&s, t * k);
        kr.router_topk::<f32>(&s, &dl, t, e, k, true, &mut ids, &mut w)
            .unwrap();
        (down(&s, &ids), down(&s, &w))
    };
    let alone: Vec<_> = (0..mt).map(|r| run(1, r)).collect();
    for m in 1..=mt {
        let (ids, w) = run(m, 0);
        for r in 0..m {
            assert_eq!(
                ids[r * k..(r + 1) * k],
                alone[r].0[..],
                "router m={m} row {r}"
            );
            assert_eq!(
                bits32(&w[r * k..(r + 1) * k]),
                bits32(&alone[r].1),
                "router weights m={m} row {r}"
            );
        }
    }
    sync(&s);
}
