//! `kbench --grouped`: a prefill chunk's routed experts, rows already
//! grouped by expert (random top-k routes of `t` tokens, 512 to 8,192), for
//! a3b (H 2048, I 768, top-8 of 128), GLM-4.5-Air (H 4096, I 1408, top-8
//! of 128) and qcn (Qwen3-Next/Coder-Next: H 2048, I 512, top-10 of 512, so
//! ~10 rows per expert at 512 tokens): the grouped INT4 GEMMs (w13 + SwiGLU, w2) in their portable
//! form (`cuda/int4_gemm.cu`) and, on a compute capability 9.0 device,
//! their Hopper wgmma form (`cuda/int4_gemm_sm90.cu`; a "not run" row
//! elsewhere), against the path they replace (dequantize the experts to
//! bf16 in batches of the runtime's 256 MiB budget, one cuBLAS GEMM per
//! expert and projection, the SwiGLU kernel between). CUDA-event times,
//! min / median / max of 5 runs after 3 warm-up iterations; TFLOP/s of the
//! median counts 2 * pairs * 3 * H * I.

use super::{cublas_gemm, rand_bf16, random_int4_experts, random_routes, time_stats_ms};
use anyhow::Context;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use half::bf16;
use krasis_kernels::{Int4Layout, Kernels};
use rand::rngs::StdRng;
use std::sync::Arc;

pub(crate) fn bench_grouped(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut StdRng,
    rows: &mut Vec<String>,
) -> anyhow::Result<()> {
    let blas = CudaBlas::new(s.clone())?;
    let hopper = k.has_int4_grouped_wgmma();
    for (label, h, i, e, topk) in [
        ("a3b", 2048usize, 768usize, 128usize, 8usize),
        ("glm", 4096, 1408, 128, 8),
        ("qcn", 2048, 512, 512, 10),
    ] {
        rows.push(format!(
            "{label} experts (H {h}, I {i}, top-{topk} of {e}): min / median / max per chunk"
        ));
        let layout = Int4Layout::new(h, i, 128).context("INT4 layout")?;
        let (_buf, table) = random_int4_experts(s, rng, &layout, e)?;
        let batch = ((256usize << 20) / (3 * h * i * 2)).clamp(1, e);
        let mut w13 = s.alloc_zeros::<bf16>(batch * 2 * i * h)?;
        let mut w2 = s.alloc_zeros::<bf16>(batch * h * i)?;
        let iota = s.clone_htod(&(0..e as u32).collect::<Vec<_>>())?;
        for t in [512usize, 1024, 2048, 4096, 8192] {
            let pairs = t * topk;
            let ids = random_routes(rng, t, e, topk);
            let (_, offsets, _, _) = krasis_kernels::reference::moe_group(&ids, e);
            let tiles = krasis_kernels::int4_grouped_tiles(&offsets);
            let d_off = s.clone_htod(&offsets)?;
            let xg = s.clone_htod(&rand_bf16(rng, pairs * h))?;
            let mut hact = s.alloc_zeros::<bf16>(pairs * i)?;
            let h13 = s.alloc_zeros::<bf16>(pairs * 2 * i)?;
            let mut y = s.alloc_zeros::<f32>(pairs * h)?;
            let flops = 2.0 * pairs as f64 * 3.0 * (h * i) as f64;
            let portable = time_stats_ms(s, 3, |_| {
                k.int4_grouped_w13_swiglu(
                    s, &xg, pairs, &d_off, e, tiles, &table, &layout, &mut hact,
                )?;
                Ok(k.int4_grouped_w2(s, &hact, pairs, &d_off, e, tiles, &table, &layout, &mut y)?)
            })?;
            let wgmma = if hopper {
                Some(time_stats_ms(s, 3, |_| {
                    k.int4_grouped_w13_swiglu_wgmma(
                        s, &xg, pairs, &d_off, e, tiles, &table, &layout, &mut hact,
                    )?;
                    Ok(k.int4_grouped_w2_wgmma(
                        s, &hact, pairs, &d_off, e, tiles, &table, &layout, &mut y,
                    )?)
                })?)
            } else {
                None
            };
            let old = time_stats_ms(s, 1, |_| {
                for b0 in (0..e).step_by(batch) {
                    let b1 = (b0 + batch).min(e);
                    k.int4_dequant(
                        s,
                        &table,
                        &iota.slice(b0..b1),
                        b1 - b0,
                        &layout,
                        &mut w13,
                        &mut w2,
                    )?;
                    let p = |v: &CudaSlice<bf16>, off: usize| v.device_ptr(s).0 + 2 * off as u64;
                    for x in b0..b1 {
                        let (a, b) = (offsets[x] as usize, offsets[x + 1] as usize);
                        if b > a {
                            let (xp, wp, yp) = (
                                p(&xg, a * h),
                                p(&w13, (x - b0) * 2 * i * h),
                                p(&h13, a * 2 * i),
                            );
                            cublas_gemm(&blas, b - a, 2 * i, h, xp, wp, yp, false, 0.0)?;
                        }
                    }
                    let (r0, r1) = (offsets[b0] as usize, offsets[b1] as usize);
                    k.swiglu(
                        s,
                        &h13.slice(r0 * 2 * i..),
                        r1 - r0,
                        i,
                        &mut hact.slice_mut(r0 * i..),
                    )?;
                    for x in b0..b1 {
                        let (a, b) = (offsets[x] as usize, offsets[x + 1] as usize);
                        if b > a {
                            let yp = y.device_ptr(s).0 + 4 * (a * h) as u64;
                            let (xp, wp) = (p(&hact, a * i), p(&w2, (x - b0) * h * i));
                            cublas_gemm(&blas, b - a, h, i, xp, wp, yp, true, 0.0)?;
                        }
                    }
                }
                Ok(())
            })?;
            let head = format!("  T={t:<5} pairs {pairs:<6} tiles {tiles:<5}");
            rows.push(format!(
                "{head} grouped INT4 mma.sync {} | {:.2}x cuBLAS",
                portable.fmt(flops),
                old.median / portable.median
            ));
            rows.push(match wgmma {
                Some(w) => format!(
                    "{head} grouped INT4 wgmma    {} | {:.2}x cuBLAS, {:.2}x mma.sync",
                    w.fmt(flops),
                    old.median / w.median,
                    portable.median / w.median
                ),
                None => format!(
                    "{head} grouped INT4 wgmma: not run (not a compute capability 9.0 device)"
                ),
            });
            rows.push(format!("{head} dequant+cuBLAS        {}", old.fmt(flops)));
        }
    }
    Ok(())
}
