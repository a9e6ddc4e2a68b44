//! Row invariance of the kernels a batched decode step runs over M rows
//! (one row per sequence, continuous batching): row `r` of an `m`-row
//! launch must be bit-identical to a one-row launch of that row alone,
//! for every `m <= GEMV_MAX_TOKENS`, whatever the other rows hold. This is
//! what makes a sequence's tokens and logits independent of which
//! sequences decode beside it (the INT4 and MXFP4 experts included). Each
//! kernel is checked in both 16-bit
//! activation formats where it has both. The per-sequence parts of a
//! step (positions for RoPE and the KV append, each row's own KV rows in
//! shared buffers for attention) are checked the same way.

use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use krasis_kernels::{
    Act16, GEMV_MAX_MK, GEMV_MAX_TOKENS, GemvOut, Int4Layout, Kernels, KvBase, KvGeom, QkNormArgs,
    QkvGeom, StartPos, w13_row_tiles,
};
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

/// The LM head's GEMV (`GemvForm::TensorCores`, bf16 with the norm fused):
/// the `m`-row launch's row `r` (its logits and its normed row) against the
/// one-row launch of row `r`, for every `m`. The work split differs by
/// shape (figures for 132 SMs): 3 tiles x 8 slices at 5120 x 2048, 1 x 16
/// at 2048 x 4096, one row per block and a partial last chunk at 151 x 2880
/// and 300 x 264, 19 tiles of one slice (the whole K, as a real vocabulary's
/// head) at 40000 x 1024 and 72 at 151936 x 2048 (a3b's head); 12288 allows
/// two rows per launch only.
#[test]
fn gemv_tensor_core_rows_are_batch_invariant() {
    use krasis_kernels::GemvForm;
    let name = "gemv_tensor_core_rows_are_batch_invariant";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let kr = &g.kernels;
    for (n, k) in [
        (5120usize, 2048usize),
        (2048, 4096),
        (151, 2880),
        (300, 264),
        (40000, 1024),
        (151936, 2048),
        (40, 12288),
    ] {
        let mt = max_rows(k);
        let w = up(&s, &randn_bf16(&mut rng, n * k, 0.05));
        let res = randn(&mut rng, mt * k, 3.0);
        let gw = up(&s, &randn_bf16(&mut rng, k, 1.0));
        let run = |m: usize, first: usize| {
            let dres = up(&s, &res[first * k..(first + m) * k]);
            let mut normed = up(&s, &vec![bf16::ZERO; m * k]);
            let mut y = poison_f32(&s, m * n);
            kr.gemv_rmsnorm_form::<bf16, f32>(
                &s,
                &dres,
                &gw,
                1e-6,
                &w,
                m,
                n,
                k,
                false,
                GemvForm::TensorCores,
                &mut normed,
                &mut y,
            )
            .unwrap();
            (down(&s, &normed), down(&s, &y))
        };
        let alone: Vec<_> = (0..mt).map(|r| run(1, r)).collect();
        for m in 1..=mt {
            let (normed, y) = run(m, 0);
            for r in 0..m {
                let nb = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
                assert!(
                    nb(&normed[r * k..(r + 1) * k]) == nb(&alone[r].0),
                    "gemv_tc_rmsnorm n={n} k={k} m={m}: normed row {r} differs from its one-row launch"
                );
                assert!(
                    bits32(&y[r * n..(r + 1) * n]) == bits32(&alone[r].1),
                    "gemv_tc_rmsnorm n={n} k={k} m={m}: row {r} differs from its one-row launch"
                );
            }
        }
    }
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
    // a3b's fast path, and a general (group 32, partial tile) shape; then
    // two whose several-tokens w2 blocks have more work items than warps
    // (top-8 x 4 K-parts, top-16 x 2: 32 items over 24 warps), so a warp's
    // next item crosses experts (the stepped item digits carry).
    for (h, i, gs, n_exp, k) in [
        (2048usize, 768usize, 128usize, 12usize, 8usize),
        (2880, 1408, 32, 6, 4),
        (1024, 512, 32, 6, 4),
        (1024, 1024, 128, 10, 8),
        (1024, 512, 64, 20, 16),
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
        // `tpb`: tokens per w2 block, None = the wrapper's own choice.
        let run = |t: usize, first: usize, tpb: Option<usize>| {
            let dx = up(s, &x[first * h..(first + t) * h]);
            let dids = up(s, &ids[first * k..(first + t) * k]);
            let dw = up(s, &weights[first * k..(first + t) * k]);
            let mut act: CudaSlice<f32> = poison_f32(s, t * k * i);
            let mut res = up(s, &res0[first * h..(first + t) * h]);
            kr.int4_w13_swiglu(
                s,
                &dx,
                &ex.table,
                &dids,
                t,
                k,
                &layout,
                u32::MAX,
                false,
                &mut act,
            )
            .unwrap();
            match tpb {
                None => kr
                    .int4_w2_combine(s, &act, &ex.table, &dids, &dw, t, k, &layout, &mut res)
                    .unwrap(),
                Some(tpb) => kr
                    .int4_w2_combine_blocked(
                        s, &act, &ex.table, &dids, &dw, t, k, &layout, tpb, &mut res,
                    )
                    .unwrap(),
            }
            (down(s, &act), down(s, &res))
        };
        let alone: Vec<_> = (0..mt).map(|r| run(1, r, Some(1))).collect();
        // w13 with 32 rows per block (what several tokens take where the
        // layout has it) on one token: the same bits as its 16-row launch.
        if w13_row_tiles(&layout, 2) == 2 {
            for (r, a) in alone.iter().enumerate() {
                let mut act: CudaSlice<f32> = poison_f32(s, k * i);
                kr.int4_w13_swiglu_tiled(
                    s,
                    &up(s, &x[r * h..(r + 1) * h]),
                    &ex.table,
                    &up(s, &ids[r * k..(r + 1) * k]),
                    1,
                    k,
                    &layout,
                    u32::MAX,
                    false,
                    2,
                    &mut act,
                )
                .unwrap();
                assert!(
                    bits32(&down(s, &act)) == bits32(&a.0),
                    "int4_w13_swiglu {fmt} H={h} I={i}: 32 rows per block differ from 16 (token {r})"
                );
            }
        }
        // Every w2 block shape: one token per block and, where the
        // several-tokens entry point serves I, 2..4 (others are refused).
        let mut shapes = vec![None, Some(1)];
        if i <= 1024 {
            shapes.extend([Some(2), Some(3), Some(4)]);
        }
        for m in 1..=mt {
            for &shape in &shapes {
                let tag = format!("{fmt} H={h} I={i} g={gs} m={m} w2 tokens per block {shape:?}");
                let (act, res) = run(m, 0, shape);
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

/// MXFP4 decode experts (gpt-oss): `mxfp4_w13_act` (every pair) and
/// `mxfp4_w2_combine` over `m` tokens against each token alone, at
/// gpt-oss-20b's shape (biases, clamped SwiGLU, partial 128-K tiles) and
/// one with plain SwiGLU and no biases; tokens share experts and each has
/// its own routes, weights and residual.
#[test]
fn mxfp4_decode_rows_are_batch_invariant() {
    use krasis_kernels::ops::mxfp4::{ExpertActivation, Mxfp4Layout};
    let name = "mxfp4_decode_rows_are_batch_invariant";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let kr = &g.kernels;
    for (h, i, bias, n_exp, k, a) in [
        (
            2880usize,
            2880usize,
            true,
            8usize,
            4usize,
            crate::mxfp4::GPT_OSS,
        ),
        (1024, 768, false, 12, 8, ExpertActivation::Swiglu),
    ] {
        let layout = Mxfp4Layout::new(h, i, bias).unwrap();
        let ex = crate::mxfp4::experts(&s, &mut rng, &layout, n_exp, 118..=123u8);
        let mt = GEMV_MAX_TOKENS;
        let mut ids = Vec::new();
        for _ in 0..mt {
            let mut all: Vec<u32> = (0..n_exp as u32).collect();
            all.shuffle(&mut rng);
            ids.extend_from_slice(&all[..k]);
        }
        let weights: Vec<f32> = (0..mt * k).map(|_| rng.random_range(0.0..1.0)).collect();
        let x = randn_bf16(&mut rng, mt * h, 1.0);
        let res0 = randn(&mut rng, mt * h, 1.0);
        let run = |t: usize, first: usize| {
            let dx = up(&s, &x[first * h..(first + t) * h]);
            let dids = up(&s, &ids[first * k..(first + t) * k]);
            let dw = up(&s, &weights[first * k..(first + t) * k]);
            let mut act: CudaSlice<f32> = poison_f32(&s, t * k * i);
            let mut res = up(&s, &res0[first * h..(first + t) * h]);
            kr.mxfp4_w13_act(
                &s,
                &dx,
                &ex.table,
                &dids,
                t,
                k,
                &layout,
                u32::MAX,
                false,
                a,
                &mut act,
            )
            .unwrap();
            kr.mxfp4_w2_combine(&s, &act, &ex.table, &dids, &dw, t, k, &layout, &mut res)
                .unwrap();
            (down(&s, &act), down(&s, &res))
        };
        let alone: Vec<_> = (0..mt).map(|r| run(1, r)).collect();
        for m in 1..=mt {
            let tag = format!("H={h} I={i} bias={bias} m={m}");
            let (act, res) = run(m, 0);
            for r in 0..m {
                assert!(
                    bits32(&act[r * k * i..(r + 1) * k * i]) == bits32(&alone[r].0),
                    "mxfp4_w13_act {tag}: token {r} differs from its one-token launch"
                );
                assert!(
                    bits32(&res[r * h..(r + 1) * h]) == bits32(&alone[r].1),
                    "mxfp4_w2_combine {tag}: token {r} differs from its one-token launch"
                );
            }
        }
        // Both NCL 3 forms (gpt-oss: weights in registers, or staged in
        // shared memory where three blocks fit an SM, as on every sm_90) give
        // the same bits for all mt tokens; elsewhere the staged form refuses.
        if h.div_ceil(128).div_ceil(8) == 3 {
            let dx = up(&s, &x[..mt * h]);
            let dids = up(&s, &ids[..mt * k]);
            let form = |staged: bool| {
                let mut act: CudaSlice<f32> = poison_f32(&s, mt * k * i);
                let r = kr.mxfp4_w13_act_form(
                    &s,
                    &dx,
                    &ex.table,
                    &dids,
                    mt,
                    k,
                    &layout,
                    u32::MAX,
                    false,
                    a,
                    Some(staged),
                    &mut act,
                );
                r.map(|()| down(&s, &act))
            };
            let registers = form(false).unwrap();
            match form(true) {
                Ok(staged) => assert!(
                    bits32(&staged) == bits32(&registers),
                    "mxfp4_w13_act H={h} I={i}: the staged form differs from the register form"
                ),
                Err(e) => assert!(
                    kr.compute_capability().0 != 9,
                    "mxfp4_w13_act H={h} I={i}: the staged form refused on sm_90: {e}"
                ),
            }
        }
    }
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

/// The q/k RoPE kernels with per-token device positions (each decode row
/// at its own sequence's position, in any order) against one host-position
/// launch per token: bit-identical.
#[test]
fn rope_rows_take_their_own_positions() {
    let name = "rope_rows_take_their_own_positions";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let kr = &g.kernels;
    let (nq, nkv, d, m) = (16usize, 4usize, 128usize, GEMV_MAX_TOKENS);
    let geom = |t| QkvGeom {
        n_tokens: t,
        n_q_heads: nq,
        n_kv_heads: nkv,
        head_dim: d,
    };
    let row = geom(1).len();
    let positions: Vec<u32> = (0..m).map(|_| rng.random_range(0..40_000u32)).collect();
    let dpos = up(&s, &positions);
    let qw = up(&s, &randn_bf16(&mut rng, d, 1.0));
    let kw = up(&s, &randn_bf16(&mut rng, d, 1.0));
    let inv: Vec<f32> = (0..d / 2)
        .map(|i| 1e6f32.powf(-((2 * i) as f32) / d as f32))
        .collect();
    let dinv = up(&s, &inv);
    let rot = 64usize;
    let dinv_rot = up(&s, &inv[..rot / 2]);
    let x0 = randn_bf16(&mut rng, m * row, 2.0);
    let x16: Vec<f16> = x0.iter().map(|v| f16::from_f32(v.to_f32())).collect();
    // (what, launch over `t` tokens of `x` at `sp`)
    type Launch<'a> = Box<dyn Fn(&mut CudaSlice<bf16>, usize, StartPos<'_>) + 'a>;
    let kernels: Vec<(&str, Launch<'_>)> = vec![
        (
            "qk_norm_rope",
            Box::new(|x, t, sp| {
                kr.qk_norm_rope(&s, x, geom(t), sp, &qw, &kw, 1_000_000.0, 1e-6)
                    .unwrap()
            }),
        ),
        (
            "rope_table",
            Box::new(|x, t, sp| kr.rope_table(&s, x, geom(t), sp, &dinv, 1.25).unwrap()),
        ),
        (
            "rope_partial",
            Box::new(|x, t, sp| {
                let norm = Some(QkNormArgs {
                    q: &qw,
                    k: &kw,
                    eps: 1e-6,
                });
                kr.rope_partial(&s, x, geom(t), sp, norm, &dinv_rot, 1.0, rot)
                    .unwrap()
            }),
        ),
    ];
    for (what, launch) in &kernels {
        let mut all = up(&s, &x0);
        launch(&mut all, m, StartPos::Device(&dpos));
        let all = down(&s, &all);
        for (t, &p) in positions.iter().enumerate() {
            let mut one = up(&s, &x0[t * row..(t + 1) * row]);
            launch(&mut one, 1, StartPos::Host(p));
            assert!(
                out_bits(&all[t * row..(t + 1) * row]) == out_bits(&down(&s, &one)),
                "{what}: row {t} at device position {p} differs from a host-position launch"
            );
        }
    }
    // rope_table's f16 variant.
    let mut all = up(&s, &x16);
    kr.rope_table(&s, &mut all, geom(m), StartPos::Device(&dpos), &dinv, 1.25)
        .unwrap();
    let all = down(&s, &all);
    for (t, &p) in positions.iter().enumerate() {
        let mut one = up(&s, &x16[t * row..(t + 1) * row]);
        kr.rope_table(&s, &mut one, geom(1), StartPos::Host(p), &dinv, 1.25)
            .unwrap();
        assert!(
            out_bits(&all[t * row..(t + 1) * row]) == out_bits(&down(&s, &one)),
            "rope_table f16: row {t} at device position {p} differs"
        );
    }
    sync(&s);
}

/// `heads` KV buffers of `cap` rows: sequence `i`'s `lens[i]` rows (from
/// `solo[i]`, laid out at row 0 of a buffer of the same shape) placed at
/// row `bases[i]`; every other row NaN.
fn place<A: Act16>(solo: &[Vec<A>], lens: &[usize], bases: &[usize], kv: KvGeom) -> Vec<A> {
    let (cap, d) = (kv.capacity, kv.head_dim);
    let mut out = vec![A::from_f32(f32::NAN); kv.len()];
    for ((src, &len), &b) in solo.iter().zip(lens).zip(bases) {
        for h in 0..kv.n_kv_heads {
            let (from, to) = (h * cap * d, (h * cap + b) * d);
            out[to..to + len * d].copy_from_slice(&src[from..from + len * d]);
        }
    }
    out
}

/// A decode step of several sequences, each in its own rows of shared KV
/// buffers (continuous batching), in one launch: `kv_append` puts row t's
/// k/v at `base[t] + pos[t]` and nowhere else, and `attention_decode` of
/// row t is bit-identical to that row decoded alone (over the shared
/// buffers at its base, and over a buffer of its own at row 0), and close
/// to the CPU reference.
fn decode_rows_in_their_own_kv<A: Act16>(name: &str) {
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let kr = &g.kernels;
    let (nq, nkv, d, cap) = (32usize, 4usize, 128usize, 6144usize);
    let kv = KvGeom {
        n_kv_heads: nkv,
        head_dim: d,
        capacity: cap,
    };
    let geom = |t| QkvGeom {
        n_tokens: t,
        n_q_heads: nq,
        n_kv_heads: nkv,
        head_dim: d,
    };
    // Positions across tile edges and one long sequence; bases packed
    // first-fit as the engine's arena places them.
    let positions = [0usize, 63, 64, 700, 1999, 5, 130, 1024];
    let mut bases = Vec::new();
    let mut next = 0;
    for &p in &positions {
        bases.push(next);
        next += p + 1 + 3;
    }
    assert!(next <= cap);
    let m = positions.len();
    let lens: Vec<usize> = positions.iter().map(|p| p + 1).collect();
    let row = geom(1).len();
    let qkv = randn_act::<A>(&mut rng, m * row, 1.0);
    // Each sequence's cache before its step (positions 0..p), at row 0.
    let mut solo_k = Vec::new();
    let mut solo_v = Vec::new();
    for &p in &positions {
        let (mut kc, mut vc) = (
            vec![A::from_f32(f32::NAN); kv.len()],
            vec![A::from_f32(f32::NAN); kv.len()],
        );
        for h in 0..nkv {
            let b = h * cap * d;
            kc[b..b + p * d].copy_from_slice(&randn_act::<A>(&mut rng, p * d, 1.0));
            vc[b..b + p * d].copy_from_slice(&randn_act::<A>(&mut rng, p * d, 1.0));
        }
        solo_k.push(kc);
        solo_v.push(vc);
    }
    let shared_k0 = place(&solo_k, &positions, &bases, kv);
    let shared_v0 = place(&solo_v, &positions, &bases, kv);
    let pos32: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
    let base32: Vec<u32> = bases.iter().map(|&b| b as u32).collect();
    let (dpos, dbase) = (up(&s, &pos32), up(&s, &base32));
    let dq = up(&s, &qkv);
    // The step: every row's k/v appended, then attention, in one launch each.
    let (mut kc, mut vc) = (up(&s, &shared_k0), up(&s, &shared_v0));
    kr.kv_append(
        &s,
        &dq,
        geom(m),
        StartPos::Device(&dpos),
        kv,
        KvBase::Device(&dbase),
        &mut kc,
        &mut vc,
    )
    .unwrap();
    // The appended rows, and nothing else, changed.
    let mut solo_k_after = Vec::new();
    let mut solo_v_after = Vec::new();
    for (t, &p) in positions.iter().enumerate() {
        let (mut k1, mut v1) = (solo_k[t].clone(), solo_v[t].clone());
        krasis_kernels::reference::kv_append(
            &qkv[t * row..(t + 1) * row],
            geom(1),
            p as u32,
            kv,
            &mut k1,
            &mut v1,
        );
        solo_k_after.push(k1);
        solo_v_after.push(v1);
    }
    let want_k = place(&solo_k_after, &lens, &bases, kv);
    let want_v = place(&solo_v_after, &lens, &bases, kv);
    assert!(
        out_bits(&down(&s, &kc)) == out_bits(&want_k)
            && out_bits(&down(&s, &vc)) == out_bits(&want_v),
        "kv_append of {m} rows: a row's k/v is not at its base + position only"
    );
    let scale = 0.088;
    let ws_len = krasis_kernels::decode_workspace_len(nq, d);
    let mut ws = poison_f32(&s, m * ws_len);
    let mut out = poison_bf16(&s, m * nq * d);
    kr.attention_decode(
        &s,
        &dq,
        geom(m),
        StartPos::Device(&dpos),
        kv,
        KvBase::Device(&dbase),
        &kc,
        &vc,
        scale,
        &mut ws,
        &mut out,
    )
    .unwrap();
    let out = down(&s, &out);
    let mut ws1 = poison_f32(&s, ws_len);
    for (t, &p) in positions.iter().enumerate() {
        let tag = format!("f16={} row {t} (position {p}, KV row {})", A::F16, bases[t]);
        let got = &out[t * nq * d..(t + 1) * nq * d];
        let q1 = up(&s, &qkv[t * row..(t + 1) * row]);
        let p1 = up(&s, &[p as u32]);
        // Alone, over the shared buffers at its base.
        let mut o1 = poison_bf16(&s, nq * d);
        kr.attention_decode(
            &s,
            &q1,
            geom(1),
            StartPos::Device(&p1),
            kv,
            KvBase::Host(bases[t]),
            &kc,
            &vc,
            scale,
            &mut ws1,
            &mut o1,
        )
        .unwrap();
        assert!(
            out_bits(got) == out_bits(&down(&s, &o1)),
            "attention_decode {tag}: differs from the row decoded alone"
        );
        // Alone, in a buffer of its own at row 0.
        let (k1, v1) = (up(&s, &solo_k_after[t]), up(&s, &solo_v_after[t]));
        let mut o2 = poison_bf16(&s, nq * d);
        kr.attention_decode(
            &s,
            &q1,
            geom(1),
            StartPos::Device(&p1),
            kv,
            KvBase::Host(0),
            &k1,
            &v1,
            scale,
            &mut ws1,
            &mut o2,
        )
        .unwrap();
        assert!(
            out_bits(got) == out_bits(&down(&s, &o2)),
            "attention_decode {tag}: differs from the sequence decoded in its own buffer"
        );
        let want = krasis_kernels::reference::attention(
            &qkv[t * row..(t + 1) * row],
            geom(1),
            p,
            kv,
            &solo_k_after[t],
            &solo_v_after[t],
            scale,
        );
        assert_close(&format!("attention_decode {tag}"), &f32s(got), &want, 5e-3);
    }
    sync(&s);
}

#[test]
fn attention_decode_rows_in_their_own_kv() {
    decode_rows_in_their_own_kv::<bf16>("attention_decode_rows_in_their_own_kv");
}

#[test]
fn attention_decode_f16_rows_in_their_own_kv() {
    decode_rows_in_their_own_kv::<f16>("attention_decode_f16_rows_in_their_own_kv");
}

/// A prefill chunk of a sequence whose rows start at row `b` of shared KV
/// buffers: the append writes only rows `b + start..b + start + n`, and the
/// attention (tensor-core and SIMT) is bit-identical to the same sequence
/// at row 0; a chunk past the buffer is refused.
#[test]
fn prefill_at_a_kv_base_matches_row_zero() {
    let name = "prefill_at_a_kv_base_matches_row_zero";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let kr = &g.kernels;
    let (nq, nkv, d, cap) = (16usize, 2usize, 128usize, 1024usize);
    let kv = KvGeom {
        n_kv_heads: nkv,
        head_dim: d,
        capacity: cap,
    };
    let (start, n) = (64usize, 100usize);
    let geom = QkvGeom {
        n_tokens: n,
        n_q_heads: nq,
        n_kv_heads: nkv,
        head_dim: d,
    };
    // Positions 0..start already in the cache (row 0 layout).
    let mut solo_k = vec![bf16::NAN; kv.len()];
    let mut solo_v = vec![bf16::NAN; kv.len()];
    for h in 0..nkv {
        let b = h * cap * d;
        solo_k[b..b + start * d].copy_from_slice(&randn_bf16(&mut rng, start * d, 1.0));
        solo_v[b..b + start * d].copy_from_slice(&randn_bf16(&mut rng, start * d, 1.0));
    }
    let qkv = up(&s, &randn_bf16(&mut rng, geom.len(), 1.0));
    let scale = 0.088;
    let run = |base: usize, simt: bool| -> (Vec<bf16>, Vec<bf16>, Vec<bf16>) {
        let k0 = place(std::slice::from_ref(&solo_k), &[start], &[base], kv);
        let v0 = place(std::slice::from_ref(&solo_v), &[start], &[base], kv);
        let (mut kc, mut vc) = (up(&s, &k0), up(&s, &v0));
        kr.kv_append(
            &s,
            &qkv,
            geom,
            StartPos::Host(start as u32),
            kv,
            KvBase::Host(base),
            &mut kc,
            &mut vc,
        )
        .unwrap();
        let mut out = poison_bf16(&s, n * nq * d);
        if simt {
            kr.attention_prefill_simt(&s, &qkv, geom, start, kv, base, &kc, &vc, scale, &mut out)
        } else {
            kr.attention_prefill(&s, &qkv, geom, start, kv, base, &kc, &vc, scale, &mut out)
        }
        .unwrap();
        (down(&s, &out), down(&s, &kc), down(&s, &vc))
    };
    for simt in [false, true] {
        let (o0, k0, v0) = run(0, simt);
        for base in [1usize, 37, cap - start - n] {
            let (o, k, v) = run(base, simt);
            assert!(
                out_bits(&o) == out_bits(&o0),
                "prefill (simt {simt}) at KV row {base} differs from row 0"
            );
            // The cache is row 0's moved down by `base` rows, NaN elsewhere.
            let moved = |x: &[bf16]| {
                let mut out = vec![bf16::NAN; kv.len()];
                for h in 0..nkv {
                    let (from, to) = (h * cap * d, (h * cap + base) * d);
                    out[to..to + (start + n) * d].copy_from_slice(&x[from..from + (start + n) * d]);
                }
                out
            };
            assert!(
                out_bits(&k) == out_bits(&moved(&k0)) && out_bits(&v) == out_bits(&moved(&v0)),
                "kv_append at KV row {base} wrote outside its rows"
            );
        }
    }
    // Past the buffer: refused before launching.
    let (mut kc, mut vc) = (poison_bf16(&s, kv.len()), poison_bf16(&s, kv.len()));
    let over = cap - start - n + 1;
    assert!(
        kr.kv_append(
            &s,
            &qkv,
            geom,
            StartPos::Host(start as u32),
            kv,
            KvBase::Host(over),
            &mut kc,
            &mut vc
        )
        .is_err()
    );
    let mut out = poison_bf16(&s, n * nq * d);
    assert!(
        kr.attention_prefill(&s, &qkv, geom, start, kv, over, &kc, &vc, scale, &mut out)
            .is_err()
    );
    sync(&s);
}

/// The elementwise kernels of a decode step (the embedding gather, q/k/v's
/// bias and one rounding in both formats, the o_proj bias, the shared
/// expert's SwiGLU in both formats) over `m` rows against each row alone.
#[test]
fn elementwise_rows_are_batch_invariant() {
    let name = "elementwise_rows_are_batch_invariant";
    let Some((g, s)) = gpu(name) else { return };
    let mut rng = rng(name);
    let kr = &g.kernels;
    let (m, n, inter, vocab) = (GEMV_MAX_TOKENS, 1280usize, 768usize, 1000usize);
    let x = randn(&mut rng, m * n, 2.0);
    let bias = up(&s, &randn(&mut rng, n, 0.5));
    let gu_b = randn_bf16(&mut rng, m * 2 * inter, 2.0);
    let gu_h: Vec<f16> = gu_b.iter().map(|v| f16::from_f32(v.to_f32())).collect();
    let table = up(&s, &randn_bf16(&mut rng, vocab * n, 1.0));
    let ids: Vec<u32> = (0..m as u32).map(|i| (i * 97 + 5) % vocab as u32).collect();
    // (what, (the m-row output, each row alone)), as bit patterns.
    type Bits = (Vec<u32>, Vec<Vec<u32>>);
    let mut cases: Vec<(&str, Bits)> = Vec::new();
    let rows = |t: usize, f: &dyn Fn(usize, usize) -> Vec<u32>| -> Bits {
        (f(0, t), (0..t).map(|r| f(r, 1)).collect())
    };
    let (all, one) = rows(m, &|r0, t| {
        let mut out = poison_bf16(&s, t * n);
        kr.bias_cast_f32_to_bf16(&s, &up(&s, &x[r0 * n..(r0 + t) * n]), &bias, t, n, &mut out)
            .unwrap();
        out_bits(&down(&s, &out))
    });
    cases.push(("bias_cast bf16", (all, one)));
    let (all, one) = rows(m, &|r0, t| {
        let mut out = poison_f16(&s, t * n);
        kr.bias_cast_f32_to_f16(&s, &up(&s, &x[r0 * n..(r0 + t) * n]), &bias, t, n, &mut out)
            .unwrap();
        out_bits(&down(&s, &out))
    });
    cases.push(("bias_cast f16", (all, one)));
    let (all, one) = rows(m, &|r0, t| {
        let mut y = up(&s, &x[r0 * n..(r0 + t) * n]);
        kr.add_bias_rows::<f32>(&s, &mut y, &bias, t, n).unwrap();
        out_bits(&down(&s, &y))
    });
    cases.push(("add_bias_rows", (all, one)));
    let (all, one) = rows(m, &|r0, t| {
        let mut out = poison_bf16(&s, t * inter);
        let gu = up(&s, &gu_b[r0 * 2 * inter..(r0 + t) * 2 * inter]);
        kr.swiglu::<bf16>(&s, &gu, t, inter, &mut out).unwrap();
        out_bits(&down(&s, &out))
    });
    cases.push(("swiglu bf16", (all, one)));
    let (all, one) = rows(m, &|r0, t| {
        let mut out = poison_f16(&s, t * inter);
        let gu = up(&s, &gu_h[r0 * 2 * inter..(r0 + t) * 2 * inter]);
        kr.swiglu::<f16>(&s, &gu, t, inter, &mut out).unwrap();
        out_bits(&down(&s, &out))
    });
    cases.push(("swiglu f16", (all, one)));
    let (all, one) = rows(m, &|r0, t| {
        let mut out = poison_f32(&s, t * n);
        kr.embed(&s, &table, vocab, n, &up(&s, &ids[r0..r0 + t]), t, &mut out)
            .unwrap();
        out_bits(&down(&s, &out))
    });
    cases.push(("embed", (all, one)));
    for (what, (all, one)) in cases {
        let w = all.len() / m;
        for (r, alone) in one.iter().enumerate() {
            assert!(
                all[r * w..(r + 1) * w] == alone[..],
                "{what}: row {r} of {m} differs from the row alone"
            );
        }
    }
    sync(&s);
}
