//! `kbench --grouped-mxfp4`: a prefill chunk's routed experts at
//! gpt-oss-20b's shape (H 2880, I 2880, 32 experts with biases, top-4,
//! clamped SwiGLU), rows already grouped by expert (random top-4 routes of
//! `t` tokens), at 512 to 8,192 tokens: the grouped MXFP4 GEMMs
//! (`cuda/mxfp4_gemm.cu`: gate/up + bias + activation, down + bias) against
//! the engine's prefill path today (dequantize the experts to bf16 in
//! batches of the runtime's 256 MiB budget, one cuBLAS GEMM per expert and
//! projection, each expert's bias + activation and down bias as kernels of
//! their own). CUDA-event times, min / median / max of 5 runs after 3
//! warm-up iterations; TFLOP/s of the median counts 2 * pairs * 3 * H * I.

use super::{cublas_gemm, rand_bf16, random_routes, time_stats_ms};
use anyhow::Context;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use half::bf16;
use krasis_kernels::Kernels;
use krasis_kernels::ops::mxfp4::{ExpertActivation, Mxfp4Layout, mxfp4_grouped_tiles};
use rand::{Rng, rngs::StdRng};
use std::sync::Arc;

const H: usize = 2880;
const I: usize = 2880;
const E: usize = 32;
const TOPK: usize = 4;
const GPT_OSS: ExpertActivation = ExpertActivation::ClampedSwiglu {
    limit: 7.0,
    alpha: 1.702,
};

/// `e` MXFP4 experts of `layout` with random codes, every scale byte 120
/// (2^-7, so outputs stay finite) and bf16 biases of 0.0625, 4 KiB apart,
/// and their pointer table.
pub(crate) fn random_mxfp4_experts(
    s: &Arc<CudaStream>,
    rng: &mut StdRng,
    layout: &Mxfp4Layout,
    e: usize,
) -> anyhow::Result<(CudaSlice<u8>, CudaSlice<u64>)> {
    let (h, i) = (layout.hidden, layout.intermediate);
    let stride = layout.used_bytes().div_ceil(4096) * 4096;
    let mut host = vec![0u8; e * stride];
    rng.fill(&mut host[..]);
    for x in 0..e {
        let b = &mut host[x * stride..];
        b[layout.w13_s..][..2 * i * h / 32].fill(120);
        b[layout.w2_s..][..h * i / 32].fill(120);
        if layout.has_bias {
            // Finite, whatever the random bytes were.
            for (off, n) in [(layout.w13_b, 2 * i), (layout.w2_b, h)] {
                for j in 0..n {
                    b[off + 2 * j..][..2].copy_from_slice(&bf16::from_f32(0.0625).to_le_bytes());
                }
            }
        }
    }
    let buf: CudaSlice<u8> = s.clone_htod(&host)?;
    let base = buf.device_ptr(s).0;
    let table: Vec<u64> = (0..e).map(|x| base + (x * stride) as u64).collect();
    let table = s.clone_htod(&table)?;
    Ok((buf, table))
}

pub(crate) fn bench_grouped_mxfp4(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut StdRng,
    rows: &mut Vec<String>,
) -> anyhow::Result<()> {
    let blas = CudaBlas::new(s.clone())?;
    let layout = Mxfp4Layout::new(H, I, true).context("MXFP4 layout")?;
    let (_buf, table) = random_mxfp4_experts(s, rng, &layout, E)?;
    // The runtime's dequantization batch (`scratch::dequant_batch`).
    let batch = ((256usize << 20) / (3 * H * I * 2)).clamp(1, E);
    let mut w13 = s.alloc_zeros::<bf16>(batch * 2 * I * H)?;
    let mut w2 = s.alloc_zeros::<bf16>(batch * H * I)?;
    let mut b13 = s.alloc_zeros::<f32>(batch * 2 * I)?;
    let mut b2 = s.alloc_zeros::<f32>(batch * H)?;
    let iota = s.clone_htod(&(0..E as u32).collect::<Vec<_>>())?;
    rows.push(format!(
        "gpt-oss-20b experts (H {H}, I {I}, top-{TOPK} of {E}, biases, clamped SwiGLU): min / median / max per chunk"
    ));
    for t in [512usize, 1024, 2048, 4096, 8192] {
        let pairs = t * TOPK;
        let ids = random_routes(rng, t, E, TOPK);
        let (_, offsets, _, _) = krasis_kernels::reference::moe_group(&ids, E);
        let tiles = mxfp4_grouped_tiles(&offsets);
        let d_off = s.clone_htod(&offsets)?;
        let xg = s.clone_htod(&rand_bf16(rng, pairs * H))?;
        let mut hact = s.alloc_zeros::<bf16>(pairs * I)?;
        let h13 = s.alloc_zeros::<bf16>(pairs * 2 * I)?;
        let mut y = s.alloc_zeros::<f32>(pairs * H)?;
        let grouped = time_stats_ms(s, 3, |_| {
            k.mxfp4_grouped_w13_act(
                s, &xg, pairs, &d_off, E, tiles, &table, &layout, GPT_OSS, &mut hact,
            )?;
            Ok(k.mxfp4_grouped_w2(s, &hact, pairs, &d_off, E, tiles, &table, &layout, &mut y)?)
        })?;
        let old = time_stats_ms(s, 1, |_| {
            for b0 in (0..E).step_by(batch) {
                let b1 = (b0 + batch).min(E);
                k.mxfp4_dequant(
                    s,
                    &table,
                    &iota.slice(b0..b1),
                    b1 - b0,
                    &layout,
                    &mut w13,
                    &mut w2,
                    Some((&mut b13, &mut b2)),
                )?;
                let p = |v: &CudaSlice<bf16>, off: usize| v.device_ptr(s).0 + 2 * off as u64;
                for x in b0..b1 {
                    let (a, b) = (offsets[x] as usize, offsets[x + 1] as usize);
                    if b > a {
                        let (xp, wp, yp) = (
                            p(&xg, a * H),
                            p(&w13, (x - b0) * 2 * I * H),
                            p(&h13, a * 2 * I),
                        );
                        cublas_gemm(&blas, b - a, 2 * I, H, xp, wp, yp, false, 0.0)?;
                        let bias = b13.slice((x - b0) * 2 * I..(x - b0 + 1) * 2 * I);
                        k.bias_act_rows::<bf16>(
                            s,
                            &h13.slice(a * 2 * I..b * 2 * I),
                            Some(&bias as &dyn DevicePtr<f32>),
                            b - a,
                            I,
                            GPT_OSS,
                            &mut hact.slice_mut(a * I..b * I),
                        )?;
                    }
                }
                for x in b0..b1 {
                    let (a, b) = (offsets[x] as usize, offsets[x + 1] as usize);
                    if b > a {
                        let yp = y.device_ptr(s).0 + 4 * (a * H) as u64;
                        let (xp, wp) = (p(&hact, a * I), p(&w2, (x - b0) * H * I));
                        cublas_gemm(&blas, b - a, H, I, xp, wp, yp, true, 0.0)?;
                        let bias = b2.slice((x - b0) * H..(x - b0 + 1) * H);
                        k.add_bias_rows::<f32>(s, &mut y.slice_mut(a * H..b * H), &bias, b - a, H)?;
                    }
                }
            }
            Ok(())
        })?;
        let flops = 2.0 * pairs as f64 * 3.0 * (H * I) as f64;
        rows.push(format!(
            "  T={t:<5} pairs {pairs:<6} tiles {tiles:<4} grouped MXFP4 {} | dequant+cuBLAS {} | {:.2}x",
            grouped.fmt(flops),
            old.fmt(flops),
            old.median / grouped.median
        ));
    }
    Ok(())
}
