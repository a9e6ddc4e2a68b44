//! The device parts of `--cpu-expert`: the probes that calibrate the CPU's
//! model of the tensor core and `MUFU.EX2`, the real kernels against the
//! CPU, the GPU -> CPU -> GPU round trip and the PCIe copy.

use super::call::{Call, Order};
use super::model::{Ex2, Model, mma_block, silu};
use super::pool::Pool;
use super::{Experts, NQ, differ, stats, token, wide};
use crate::host::Mapped;
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg, sys};
use half::bf16;
use krasis_kernels::Kernels;
use rand::{Rng, SeedableRng, rngs::StdRng};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering::*};
use std::time::{Duration, Instant};

/// The probes and the round trip, compiled after `common.cuh` (its `silu`).
pub(super) const SRC: &str = r#"
__device__ __forceinline__ float ex2a(float r) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(r)); return y; }
__device__ __forceinline__ u64 gtime() { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
// One m16n8k16 bf16 mma per warp: A [16][16], B [16 k][8 n], C [16][8] (the PTX fragment layout).
extern "C" __global__ void probe_mma(const bf16_t* A, const bf16_t* B, const float* C, float* D, u32 n) {
    const u32 m = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    if (m >= n) return;  // warp-uniform
    const bf16_t *a = A + m * 256, *b = B + m * 128;
    auto p = [](bf16_t lo, bf16_t hi) { return (u32)lo | ((u32)hi << 16); };
    const u32 a0 = p(a[g * 16 + 2 * t], a[g * 16 + 2 * t + 1]), a1 = p(a[g * 16 + 128 + 2 * t], a[g * 16 + 129 + 2 * t]);
    const u32 a2 = p(a[g * 16 + 2 * t + 8], a[g * 16 + 2 * t + 9]), a3 = p(a[g * 16 + 136 + 2 * t], a[g * 16 + 137 + 2 * t]);
    const u32 b0 = p(b[2 * t * 8 + g], b[(2 * t + 1) * 8 + g]), b1 = p(b[(2 * t + 8) * 8 + g], b[(2 * t + 9) * 8 + g]);
    const u32 o0 = m * 128 + g * 8 + 2 * t, o1 = o0 + 64;
    float d0 = C[o0], d1 = C[o0 + 1], d2 = C[o1], d3 = C[o1 + 1];
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    D[o0] = d0; D[o0 + 1] = d1; D[o1] = d2; D[o1 + 1] = d3;
}
// Over every float r in [-1, 2) (subnormals as 0, as .ftz): counts[2 (F - 20) + rint] = how often
// ex2(r) != ex2(r floored (rint: rounded) to F = 20..24 fraction bits).
extern "C" __global__ void probe_ex2(unsigned long long* counts) {
    unsigned long long c[10] = {};
    const u32 npos = 0x40000000u, n = npos + 0x3F800000u;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float r0 = __uint_as_float(i < npos ? i : 0x80000001u + (i - npos));
        const float r = fabsf(r0) < 1.17549435e-38f ? 0.0f : r0, e = ex2a(r);
        for (int f = 20; f <= 24; ++f) {
            const float s = (float)(1 << f);
            c[2 * (f - 20)] += ex2a(floorf(r * s) / s) != e;
            c[2 * (f - 20) + 1] += ex2a(rintf(r * s) / s) != e;
        }
    }
    for (int j = 0; j < 10; ++j) if (c[j]) atomicAdd(&counts[j], c[j]);
}
extern "C" __global__ void ex2_table(float* out, u32 f, u32 n) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = ex2a((float)((double)i / (double)(1u << f) - 1.0));
}
extern "C" __global__ void probe_silu(const float* g, float* out, u32 n) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = silu(g[i]);
}
// `trips` round trips, one block: x (from xsrc) and a request flag to mapped host memory, spin
// (system-scope acquire) for the done flag, read y back; ns[it] = globaltimer span (~0: timed out).
extern "C" __global__ void round_trip(u32* mail, float* xs, const float* xsrc, const volatile float* ys, u32 h,
                                      u32 trips, u64* ns, float* sink) {
    __shared__ u64 t0;
    __shared__ int dead;
    float acc = 0.0f;
    for (u32 it = 1; it <= trips; ++it) {
        if (threadIdx.x == 0) { t0 = gtime(); dead = 0; }
        __syncthreads();
        for (u32 i = threadIdx.x; i < h; i += blockDim.x) xs[i] = xsrc[i];
        __threadfence_system();
        __syncthreads();
        if (threadIdx.x == 0) {
            asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(mail), "r"(it) : "memory");
            for (u32 d = 0; d != it;) {
                asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(d) : "l"(mail + 32) : "memory");
                if (gtime() - t0 > 2000000000ull) { dead = 1; break; }
            }
        }
        __syncthreads();
        if (dead) { if (threadIdx.x == 0) ns[it - 1] = ~0ull; return; }
        for (u32 i = threadIdx.x; i < h; i += blockDim.x) acc += ys[i];
        __syncthreads();
        if (threadIdx.x == 0) ns[it - 1] = gtime() - t0;
    }
    if (acc == 1.2345f) sink[0] = acc;
}
"#;

fn cfg(blocks: u32, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Random mma on the device (A: the kernels' nibbles -8..7; B: bf16 uniform
/// or over 2^-20..2^6; C: 0 or any f32 over 2^-8..2^12), then every model:
/// the one that reproduces the most outputs is used.
pub(super) fn calibrate(
    s: &Arc<CudaStream>,
    f: &CudaFunction,
    rng: &mut StdRng,
    rows: &mut Vec<String>,
) -> anyhow::Result<Model> {
    let nm = 1024usize;
    let a: Vec<i32> = (0..nm * 256).map(|_| rng.random_range(-8..8)).collect();
    let unif = |rng: &mut StdRng| bf16::from_f32(rng.random_range(-1.0f32..1.0)).to_f32();
    let b: Vec<f32> = (0..nm * 128)
        .map(|_| {
            if rng.random_bool(0.5) {
                wide(rng, -20.0, 6.0)
            } else {
                unif(rng)
            }
        })
        .collect();
    let c: Vec<f32> = (0..nm * 128)
        .map(|_| {
            let v = rng.random_range(1.0f32..2.0) * (rng.random_range(-8..12) as f32).exp2();
            if rng.random_bool(0.25) {
                0.0
            } else if rng.random_bool(0.5) {
                -v
            } else {
                v
            }
        })
        .collect();
    let bf = |v: &mut dyn Iterator<Item = f32>| v.map(bf16::from_f32).collect::<Vec<_>>();
    let da = s.clone_htod(&bf(&mut a.iter().map(|&x| x as f32)))?;
    let (db, dc) = (
        s.clone_htod(&bf(&mut b.iter().copied()))?,
        s.clone_htod(&c)?,
    );
    let mut dd = s.alloc_zeros::<f32>(nm * 128)?;
    let n32 = nm as u32;
    let mut l = s.launch_builder(f);
    l.arg(&da).arg(&db).arg(&dc).arg(&mut dd).arg(&n32);
    // SAFETY: buffers sized for nm mma, 4 warps a block.
    unsafe { l.launch(cfg(n32 / 4, 128)) }?;
    let d = s.clone_dtoh(&dd)?;
    let mut scored = Vec::new();
    for n in [16, 8, 4] {
        for neab in [0, 1, 2, 3, 200] {
            for (unnorm, rz) in [(false, true), (true, true), (false, false), (true, false)] {
                let m = Model {
                    n,
                    neab,
                    unnorm,
                    rz,
                };
                let hits = (0..nm * 128)
                    .filter(|&o| {
                        let (mm, r, col) = (o / 128, o % 128 / 8, o % 8);
                        let bc: [f64; 16] =
                            std::array::from_fn(|k| b[mm * 128 + k * 8 + col] as f64);
                        let ar = &a[mm * 256 + r * 16..][..16];
                        let v = (0..16)
                            .step_by(n)
                            .fold(c[o], |c, p| mma_block(&m, c, &ar[p..p + n], &bc[p..p + n]));
                        v.to_bits() == d[o].to_bits()
                    })
                    .count();
                scored.push((hits, m));
            }
        }
    }
    scored.sort_by_key(|&(h, _)| std::cmp::Reverse(h));
    rows.push(format!(
        "mma model calibration, {} random HMMA.16816.F32.BF16 outputs (neab 200: exact sum):",
        nm * 128
    ));
    for (h, m) in &scored[..4] {
        rows.push(format!(
            "  {m:?}: {h} identical ({:.4}%)",
            *h as f64 * 100.0 / (nm * 128) as f64
        ));
    }
    Ok(scored[0].1)
}

/// Whether MUFU.EX2 is a function of its input at F fraction bits (then a
/// table of it is exact), and `silu` against the device's.
pub(super) fn probe_ex2(
    s: &Arc<CudaStream>,
    f: [&CudaFunction; 3],
    rng: &mut StdRng,
    rows: &mut Vec<String>,
) -> anyhow::Result<Ex2> {
    let mut counts = s.alloc_zeros::<u64>(10)?;
    let mut l = s.launch_builder(f[0]);
    l.arg(&mut counts);
    // SAFETY: counts holds 10 counters.
    unsafe { l.launch(cfg(132 * 16, 256)) }?;
    let c = s.clone_dtoh(&counts)?;
    let per_f: Vec<String> = (0..5)
        .map(|j| format!("F{} {} | {}", 20 + j, c[2 * j], c[2 * j + 1]))
        .collect();
    rows.push(format!(
        "MUFU.EX2, floats r in [-1, 2) where ex2(r) != ex2(r at F fraction bits), floor | rint: {}",
        per_f.join(", ")
    ));
    let ex2 = match (0..10).find(|&j| c[j] == 0) {
        Some(j) => {
            let (fb, n) = (20 + j as u32 / 2, 3usize << (20 + j / 2));
            let (mut t, n32) = (s.alloc_zeros::<f32>(n)?, n as u32);
            let mut l = s.launch_builder(f[1]);
            l.arg(&mut t).arg(&fb).arg(&n32);
            // SAFETY: t holds n floats.
            unsafe { l.launch(cfg(n32.div_ceil(256), 256)) }?;
            Ex2 {
                f: fb as i32,
                rint: j % 2 == 1,
                table: s.clone_dtoh(&t)?,
            }
        }
        None => Ex2 {
            f: 0,
            rint: false,
            table: Vec::new(),
        },
    };
    let n = 1usize << 22;
    let g: Vec<f32> = (0..n)
        .map(|q| {
            if q % 2 == 0 {
                wide(rng, -20.0, 7.0)
            } else {
                rng.random_range(-30.0f32..30.0)
            }
        })
        .collect();
    let (dg, mut dout, n32) = (s.clone_htod(&g)?, s.alloc_zeros::<f32>(n)?, n as u32);
    let mut l = s.launch_builder(f[2]);
    l.arg(&dg).arg(&mut dout).arg(&n32);
    // SAFETY: n inputs and outputs.
    unsafe { l.launch(cfg(n32 / 256, 256)) }?;
    let out = s.clone_dtoh(&dout)?;
    let same = |e: &Ex2| {
        g.iter()
            .zip(&out)
            .filter(|&(&g, o)| silu(g, e).to_bits() == o.to_bits())
            .count()
    };
    let standin = same(&Ex2 {
        f: 0,
        rint: false,
        table: Vec::new(),
    });
    let used = match ex2.table.is_empty() {
        true => "no table (no F passed)".to_string(),
        false => format!(
            "the F={} {} table",
            ex2.f,
            if ex2.rint { "rint" } else { "floor" }
        ),
    };
    rows.push(format!("silu vs the device's on {n} inputs: {} identical with {used}, {standin} with 2^r correctly rounded", same(&ex2)));
    Ok(ex2)
}

/// The real kernels on the NQ quantized experts (a token each, top_k 1, read
/// in place from mapped host memory) against the CPU, bit for bit.
pub(super) fn exactness(
    k: &Kernels,
    s: &Arc<CudaStream>,
    x: &Experts,
    cpu: &Pool,
    o: &Order,
    rng: &mut StdRng,
) -> anyhow::Result<String> {
    let (lay, h, i) = (&x.lay, x.lay.hidden, x.lay.intermediate);
    let xs: Vec<Vec<f32>> = (0..NQ).map(|t| token(rng, h, t >= NQ / 2)).collect();
    let w: Vec<f32> = (0..NQ).map(|_| rng.random_range(0.05f32..0.5)).collect();
    let xb: Vec<bf16> = xs.iter().flatten().map(|&v| bf16::from_f32(v)).collect();
    let table: Vec<u64> = (0..NQ).map(|e| x.dev + (e * x.stride) as u64).collect();
    let (dx, dt, dw) = (s.clone_htod(&xb)?, s.clone_htod(&table)?, s.clone_htod(&w)?);
    let ids = s.clone_htod(&(0..NQ as u32).collect::<Vec<_>>())?;
    let (mut act, mut res) = (s.alloc_zeros::<f32>(NQ * i)?, s.alloc_zeros::<f32>(NQ * h)?);
    k.int4_w13_swiglu(s, &dx, &dt, &ids, NQ, 1, lay, u32::MAX, false, &mut act)?;
    k.int4_w2_combine_blocked(s, &act, &dt, &ids, &dw, NQ, 1, lay, 1, &mut res)?;
    let (ga, gy) = (s.clone_dtoh(&act)?, s.clone_dtoh(&res)?);
    let mut c = Call::new(o, *lay, 1);
    let (mut same, mut da, mut dy, mut max_abs, mut max_rel) = (0, 0, 0, 0f32, 0f32);
    for t in 0..NQ {
        c.x.clone_from(&xs[t]);
        c.experts = vec![(x.at(t), w[t])];
        c.serve(cpu);
        let a = differ(c.act.get(), &ga[t * i..(t + 1) * i]);
        let d = differ(c.y.get(), &gy[t * h..(t + 1) * h]);
        for (&p, &q) in c.y.get().iter().zip(&gy[t * h..]) {
            max_abs = max_abs.max((p - q).abs());
            max_rel = max_rel.max((p - q).abs() / q.abs().max(1e-30));
        }
        (da, dy, same) = (da + a, dy + d, same + usize::from(a + d == 0));
    }
    let (na, ny) = (NQ * i, NQ * h);
    Ok(format!(
        "  vs int4_w13_swiglu + int4_w2_combine: bit-identical: {same}/{NQ} experts; differing act {da}/{na}, y {dy}/{ny} (max |diff| {max_abs:.3e}, max rel {max_rel:.3e})"
    ))
}

/// GPU-timed round trips (us); `ne` experts served per trip (0: none).
pub(super) fn round_trip(
    s: &Arc<CudaStream>,
    f: &CudaFunction,
    c: &mut Call,
    cpu: &Pool,
    x: &Experts,
    ne: usize,
) -> anyhow::Result<Vec<f64>> {
    let (h, trips) = (c.lay.hidden, 1000u32);
    let mut mail = Mapped::new(1 << 16)?;
    mail.bytes().fill(0);
    // The flags at bytes 0 and 128, x at 4096, y at 16384.
    let at = |o: usize| mail.host.wrapping_add(o);
    // SAFETY: both flags lie in the mailbox, 4-byte aligned, for its lifetime.
    let (req, done) = unsafe {
        (
            &*(at(0) as *const AtomicU32),
            &*(at(128) as *const AtomicU32),
        )
    };
    let (xs, ys) = (at(4096) as *const f32, at(16384) as *mut f32);
    let xsrc = s.clone_htod(&token(&mut StdRng::seed_from_u64(3), h, false))?;
    let (mut ns, sink) = (
        s.alloc_zeros::<u64>(trips as usize)?,
        s.alloc_zeros::<f32>(1)?,
    );
    let (dm, dxs, dys, h32) = (mail.dev, mail.dev + 4096, mail.dev + 16384, h as u32);
    let mut l = s.launch_builder(f);
    l.arg(&dm)
        .arg(&dxs)
        .arg(&xsrc)
        .arg(&dys)
        .arg(&h32)
        .arg(&trips)
        .arg(&mut ns)
        .arg(&sink);
    // SAFETY: the mailbox holds the flags, x and y; ns holds `trips`.
    unsafe { l.launch(cfg(1, 256)) }?;
    c.out = ys;
    for it in 1..=trips {
        let t0 = Instant::now();
        while req.load(Acquire) != it {
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(5),
                "round trip {it}: no request"
            );
            std::hint::spin_loop();
        }
        if ne > 0 {
            for (q, v) in c.x.iter_mut().enumerate() {
                // SAFETY: x of the mailbox, written before the flag (fence.sys).
                *v = unsafe { xs.add(q).read_volatile() };
            }
            c.experts = (0..ne)
                .map(|q| (x.at(it as usize * ne + q), 0.3f32))
                .collect();
            c.serve(cpu);
        }
        done.store(it, Release);
    }
    c.out = c.y.p();
    s.synchronize()?;
    let ns = s.clone_dtoh(&ns)?;
    anyhow::ensure!(
        ns.iter().all(|&t| t != u64::MAX),
        "round trip timed out on the device"
    );
    Ok(ns.iter().map(|&t| t as f64 / 1e3).collect())
}

/// cuMemcpyHtoDAsync of `q` experts from the pinned pool, timed per copy.
pub(super) fn copy_us(s: &Arc<CudaStream>, x: &Experts, q: usize) -> anyhow::Result<(f64, f64)> {
    use cudarc::driver::{DevicePtr, sys::CUevent_flags::CU_EVENT_DEFAULT};
    let dst = s.alloc_zeros::<u8>(q * x.stride)?;
    let d = dst.device_ptr(s).0;
    let mut ev = Vec::new();
    for it in 0..203 {
        let a = s.record_event(Some(CU_EVENT_DEFAULT))?;
        for j in 0..q {
            let (to, from) = (d + (j * x.stride) as u64, x.at(it * q + j) as *const _);
            // SAFETY: source expert and destination slot hold used_bytes.
            unsafe { sys::cuMemcpyHtoDAsync_v2(to, from, x.lay.used_bytes(), s.cu_stream()) }
                .result()?;
        }
        ev.push((a, s.record_event(Some(CU_EVENT_DEFAULT))?));
    }
    s.synchronize()?;
    let t: Result<Vec<f64>, _> = ev[3..]
        .iter()
        .map(|(a, b)| a.elapsed_ms(b).map(|ms| ms as f64 * 1e3))
        .collect();
    Ok(stats(&mut t?))
}
