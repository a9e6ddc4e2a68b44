//! `kbench --cpu-expert`: the host CPU as a second miss server for HCS decode
//! (issue 16). A cold expert's FFN for one token runs on the host from the
//! page-locked expert cache; only hidden-sized vectors cross PCIe instead of
//! its ~2.4 MB block. Measured, for a3b and qcn experts:
//! 1. CPU latency of 1, 2, 4 experts per call on a persistent pool of spinning
//!    threads (1, 4, 8, all cores), cycling through > 600 MB of experts;
//! 2. bit-exactness against the real `int4_w13_swiglu` + `int4_w2_combine`.
//!    The CPU follows the GPU's f32 order (SASS of `int4_w13_swiglu_2` and
//!    `int4_w2_combine_1`, NVRTC 13.5 sm_90; see `tile_row`, `expert_ref`).
//!    Two steps have no CPU instruction: the tensor core's sum inside one
//!    `mma` and `MUFU.EX2` inside `expf`; both are calibrated on the device
//!    first (`probe_mma`, `probe_ex2`);
//! 3. a GPU -> CPU -> GPU round trip through mapped memory (flag + 2,048
//!    floats each way), timed by the kernel, empty and serving 1 or 2 experts;
//! 4. the PCIe copy of the expert blocks it would replace.
//!
//! `--cpu-expert-host-only` runs 1 and the CPU cross-checks without a GPU.
//!
//! Files: `model.rs` the GPU's arithmetic, scalar (the mma model, MUFU.EX2,
//! `silu`, `expert_ref`); `simd.rs` the AVX-512 / AVX2 kernels; `pool.rs` the
//! spinning pool; `call.rs` one call's phases; `device.rs` the NVRTC probes,
//! the exactness check, the round trip and the copy; here the two drivers.
//!
//! Measured on the H200 device (2026-12-04; Intel Xeon host, 16 cores,
//! AVX-512; `benchmarks/results/2026-12-04-session15/kbench-cpu-expert.txt`),
//! the conclusion: the lever is not in the engine (issue 16).
//! - Exactness is out of reach. The tensor core is reproduced: `Model { n: 16,
//!   neab: 2, unnorm: true, rz: true }` gave 131,072 of 131,072 random
//!   HMMA.16816.F32.BF16 outputs (100%). MUFU.EX2 (inside the kernels' precise
//!   `expf`) is not: its result is no function of its input cut to 20-24
//!   fraction bits (F24: 96,465,877 floats of [-1, 2) differ with floor), so
//!   `silu` matched on 3,723,004 of 4,194,304 inputs and 0 of 16 experts were
//!   bit-identical to `int4_w13_swiglu` + `int4_w2_combine` (max |diff|
//!   4.8e-7). A CPU miss server could only be an approximate, default-off
//!   option.
//! - It is slower than the copy it would replace. 16 threads, AVX-512: one
//!   a3b expert (2.43 MB) 169.8 us (14.3 GB/s), qcn (1.62 MB) 118.8 us
//!   (13.7 GB/s). GPU -> CPU -> GPU through mapped memory: 14.8 us empty,
//!   181.0 us serving one a3b expert, 353.4 us two; the PCIe copy of one a3b
//!   expert 47.8 us, two 94.2 us (3.8x faster); qcn 134.2 vs 33.3 us (4.0x).
//! - So the copy engine beats the CPU at every miss count a layer sees in
//!   decode: the CPU taking one of a layer's m misses shortens it only when
//!   its round trip beats m copies, m >= 4 for a3b (181.0 < 4 x 47.8 us) and
//!   m >= 5 for qcn (134.2 < 5 x 33.3 us), where decode averages 0.25-0.6
//!   misses per layer (`benchmarks/results/2026-12-04-session15.md`).

mod call;
mod device;
mod model;
mod pool;
#[cfg(target_arch = "x86_64")]
mod simd;

use super::host::{Mapped, fill_experts};
use call::{Call, Order, isas};
use cudarc::driver::CudaStream;
use device::{SRC, calibrate, copy_us, exactness, probe_ex2, round_trip};
use half::bf16;
use krasis_kernels::{Int4Layout, Kernels};
use model::{DEFAULT_MODEL, Ex2, Model, expert_ref};
use pool::Pool;
use rand::{Rng, SeedableRng, rngs::StdRng};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// (label, H, I, experts in the pool (> 600 MB)); the first `NQ` experts are
/// quantized from random weights by the reference quantizer.
const SHAPES: [(&str, usize, usize, usize); 2] = [("a3b", 2048, 768, 256), ("qcn", 2048, 512, 384)];
const NQ: usize = 16;

// ---- Host harness.

/// A pool of `n` expert blocks `stride` apart in host memory (`dev`: their
/// device address when mapped), experts `0..NQ` quantized.
struct Experts {
    lay: Int4Layout,
    host: *const u8,
    dev: u64,
    n: usize,
    stride: usize,
}
impl Experts {
    fn at(&self, e: usize) -> *const u8 {
        self.host.wrapping_add(e % self.n * self.stride)
    }
    fn block(&self, e: usize) -> &[u8] {
        // SAFETY: expert e % n lies inside the pool, which outlives self.
        unsafe { std::slice::from_raw_parts(self.at(e), self.lay.used_bytes()) }
    }
}

/// Experts `0..NQ` quantized from random weights by the reference quantizer
/// (`write_expert`, a thread each), the rest random nibbles with f16 scales
/// of 0.01 (`fill_experts`: the values do not change the CPU's time).
fn fill_pool(rng: &mut StdRng, lay: &Int4Layout, stride: usize, bytes: &mut [u8]) {
    let (h, i) = (lay.hidden, lay.intermediate);
    let (quant, rest) = bytes.split_at_mut(NQ * stride);
    fill_experts(rng, lay, stride, rest);
    std::thread::scope(|s| {
        for (e, b) in quant.chunks_mut(stride).enumerate() {
            s.spawn(move || {
                let mut r = StdRng::seed_from_u64(100 + e as u64);
                let mut w = |n: usize| {
                    (0..n)
                        .map(|_| r.random_range(-0.05f32..0.05))
                        .collect::<Vec<_>>()
                };
                let (w13, w2) = (w(2 * i * h), w(h * i));
                krasis_kernels::reference::write_expert(b, lay, &w13, &w2);
            });
        }
    });
}

fn stats(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[v.len() * 9 / 10])
}

fn differ(a: &[f32], b: &[f32]) -> usize {
    a.iter()
        .zip(b)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count()
}

/// bf16 values of magnitude 2^U(lo, hi), random sign.
fn wide(rng: &mut StdRng, lo: f32, hi: f32) -> f32 {
    let v = rng.random_range(lo..hi).exp2();
    bf16::from_f32(if rng.random_bool(0.5) { -v } else { v }).to_f32()
}

/// A token's x: uniform in [-1, 1] (as kbench's other modes) or spread
/// over 2^-14..2^3 (more passes off the fast path).
fn token(rng: &mut StdRng, h: usize, spread: bool) -> Vec<f32> {
    let u = |rng: &mut StdRng| bf16::from_f32(rng.random_range(-1.0f32..1.0)).to_f32();
    (0..h)
        .map(|_| {
            if spread {
                wide(rng, -14.0, 3.0)
            } else {
                u(rng)
            }
        })
        .collect()
}

/// Every ISA path against the scalar transliteration, bit for bit.
fn self_check(x: &Experts, o: &Order, rng: &mut StdRng) -> String {
    let pool = Pool::new(std::thread::available_parallelism().map_or(1, |n| n.get()));
    let mut line = format!("  CPU paths vs expert_ref ({:?}), differing act / y:", o.m);
    for (e, spread) in [(0usize, false), (1, true)] {
        let (xs, w) = (token(rng, x.lay.hidden, spread), 0.37f32);
        let (act, y) = expert_ref(&o.m, &x.lay, x.block(e), &xs, w, &o.ex2);
        for isa in isas() {
            let mut c = Call::new(o, x.lay, 1);
            c.isa = isa;
            c.x.clone_from(&xs);
            c.experts = vec![(x.at(e), w)];
            c.serve(&pool);
            let (da, dy) = (differ(c.act.get(), &act), differ(c.y.get(), &y));
            let tag = if spread { "wide" } else { "unif" };
            line.push_str(&format!(" {tag} {isa:?} {da}/{dy};"));
        }
    }
    line
}

/// Per-call latency of 1, 2, 4 experts on 1, 4, 8 and all threads, cycling
/// through the pool. Returns the best 1-expert median.
fn time_cpu(x: &Experts, o: &Order, rng: &mut StdRng, rows: &mut Vec<String>) -> f64 {
    let all = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut ts: Vec<usize> = [1, 4, 8, all].into_iter().filter(|&t| t <= all).collect();
    ts.dedup();
    let xs = token(rng, x.lay.hidden, false);
    let mut best = f64::MAX;
    for t in ts {
        let pool = Pool::new(t);
        let mut line = format!("  {:?} T={t:<3}", isas()[0]);
        for ne in [1usize, 2, 4] {
            let mut c = Call::new(o, x.lay, ne);
            c.x.clone_from(&xs);
            let (mut lat, mut next, t0) = (Vec::new(), 0usize, Instant::now());
            while lat.len() < 400 && (lat.len() < 20 || t0.elapsed() < Duration::from_secs(2)) {
                c.experts = (0..ne).map(|q| (x.at(next + q), 0.3)).collect();
                next += ne;
                let t1 = Instant::now();
                c.serve(&pool);
                lat.push(t1.elapsed().as_secs_f64() * 1e6);
            }
            let (med, p90) = stats(&mut lat[3..]);
            if ne == 1 {
                best = best.min(med);
            }
            let gbs = (ne * x.lay.used_bytes()) as f64 / med / 1e3;
            line.push_str(&format!(
                " | {ne} exp {med:>7.1} us (p90 {p90:>7.1}) {gbs:>5.1} GB/s"
            ));
        }
        rows.push(line);
    }
    best
}

/// `kbench --cpu-expert-host-only`: the CPU parts without a device, with
/// `DEFAULT_MODEL` and 2^r correctly rounded standing in for MUFU.EX2.
pub fn bench_host_only(rows: &mut Vec<String>) -> anyhow::Result<()> {
    let mut rng = StdRng::seed_from_u64(7);
    let ex2 = Arc::new(Ex2 {
        f: 0,
        rint: false,
        table: Vec::new(),
    });
    let threads = std::thread::available_parallelism()?;
    rows.push(format!(
        "ISAs {:?}, {threads} threads; uncalibrated model, MUFU.EX2 stand-in",
        isas()
    ));
    for (label, h, i, n) in SHAPES {
        let lay = Int4Layout::new(h, i, 128).expect("layout");
        let stride = lay.used_bytes().div_ceil(4096) * 4096;
        let mut bytes = vec![0u8; n * stride];
        fill_pool(&mut rng, &lay, stride, &mut bytes);
        let x = Experts {
            lay,
            host: bytes.as_ptr(),
            dev: 0,
            n,
            stride,
        };
        rows.push(format!(
            "{label} H{h} I{i}: {n} experts of {:.2} MB",
            lay.used_bytes() as f64 / 1e6
        ));
        for m in [
            DEFAULT_MODEL,
            Model {
                n: 8,
                neab: 0,
                unnorm: true,
                rz: false,
            },
        ] {
            rows.push(self_check(
                &x,
                &Order {
                    m,
                    ex2: ex2.clone(),
                },
                &mut rng,
            ));
        }
        time_cpu(
            &x,
            &Order {
                m: DEFAULT_MODEL,
                ex2: ex2.clone(),
            },
            &mut rng,
            rows,
        );
    }
    Ok(())
}

pub fn bench_cpu_expert(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut StdRng,
    rows: &mut Vec<String>,
) -> anyhow::Result<()> {
    let ctx = s.context();
    let md = super::adhoc_module(ctx, "kbench_cpu_expert", SRC)?;
    let fun = |n: &str| md.load_function(n);
    let all = std::thread::available_parallelism()?.get();
    // Rows also go to stderr as they come: a later stage failing keeps these.
    let mut shown = 0;
    let mut show = |rows: &Vec<String>| {
        rows[shown..].iter().for_each(|r| eprintln!("{r}"));
        shown = rows.len();
    };
    rows.push(format!("host: ISAs {:?}, {all} threads", isas()));
    let m = calibrate(s, &fun("probe_mma")?, rng, rows)?;
    show(rows);
    let ex2 = probe_ex2(
        s,
        [&fun("probe_ex2")?, &fun("ex2_table")?, &fun("probe_silu")?],
        rng,
        rows,
    )?;
    show(rows);
    let (o, rt) = (
        Order {
            m,
            ex2: Arc::new(ex2),
        },
        fun("round_trip")?,
    );
    for (label, h, i, n) in SHAPES {
        let lay = Int4Layout::new(h, i, 128).expect("layout");
        let stride = lay.used_bytes().div_ceil(4096) * 4096;
        let mut pool = Mapped::new(n * stride)?;
        fill_pool(rng, &lay, stride, pool.bytes());
        let x = Experts {
            lay,
            host: pool.host,
            dev: pool.dev,
            n,
            stride,
        };
        let mb = lay.used_bytes() as f64 / 1e6;
        rows.push(format!(
            "{label} H{h} I{i}: {n} pinned experts of {mb:.2} MB, model {m:?}"
        ));
        rows.push(self_check(&x, &o, rng));
        rows.push(exactness(k, s, &x, &Pool::new(all), &o, rng)?);
        show(rows);
        time_cpu(&x, &o, rng, rows);
        show(rows);
        let (cpu, mut c) = (Pool::new(all), Call::new(&o, lay, 2));
        let mut line = format!("  round trip GPU->CPU->GPU (T={all}, globaltimer, 1000 trips):");
        let mut e2e = Vec::new();
        for ne in 0..3 {
            let (med, p90) = stats(&mut round_trip(s, &rt, &mut c, &cpu, &x, ne)?);
            line.push_str(&format!(" | {ne} experts {med:.1} us (p90 {p90:.1})"));
            e2e.push(med);
        }
        rows.push(line);
        drop(cpu);
        let (c1, c2) = (copy_us(s, &x, 1)?, copy_us(s, &x, 2)?);
        let copy = format!(
            "1 expert {:.1} us (p90 {:.1}), 2 experts {:.1} us (p90 {:.1})",
            c1.0, c1.1, c2.0, c2.1
        );
        rows.push(format!("  PCIe copy, pinned -> VRAM: {copy}"));
        for (ne, cpu_us, copy) in [(1, e2e[1], c1.0), (2, e2e[2], c2.0)] {
            let (who, r) = if cpu_us < copy {
                ("CPU", copy / cpu_us)
            } else {
                ("PCIe copy", cpu_us / copy)
            };
            rows.push(format!(
                "  projection, {ne} cold expert(s): CPU served end to end {cpu_us:.1} us vs copy {copy:.1} us: {who} faster by {r:.2}x"
            ));
        }
    }
    Ok(())
}
