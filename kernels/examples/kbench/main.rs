//! Micro-benchmarks of the hot kernels on the first CUDA device, with the
//! a3b (Qwen3-30B-A3B) shapes, plus prefill attention at the qcn heads (16 q,
//! 2 kv, head_dim 256) and gpt-oss decode attention (sinks; full vs 128-token
//! sliding layer at 32K). Times are CUDA-event medians after warm-up.
//! Usage: `kbench [--int4] [--mxfp4] [--gemv] [--rows] [--prefill] [--grouped] [--grouped-mxfp4] [--host-experts] [--tail] [--cpu-expert] [--cpu-expert-host-only] [--baseline-int4 OLD.cu]`
//! (prints a table; exits with an error without a GPU). `--gemv` times only
//! the BF16 decode GEMVs next to cuBLAS; `--rows` times the kernels of a
//! batched decode step at 1/2/4/8 rows (BF16 GEMVs; INT4 w13 + w2 with
//! independent routes per row, for each w2 tokens-per-block choice);
//! `--int4` times only the INT4 decode GEMVs; `--mxfp4` times only the
//! MXFP4 decode GEMVs (gpt-oss-20b shape, 1/2/4/8 rows routed independently); `--prefill` times only prefill
//! attention (d128 with the portable and, on Hopper, the wgmma kernel;
//! d256); `--grouped` times a prefill chunk's routed
//! experts (gate/up + SwiGLU + down of every (token, expert) pair, rows
//! grouped by expert) with the grouped INT4 GEMMs (portable and, on Hopper,
//! wgmma) next to the dequantize + per-expert cuBLAS path they replace, at
//! 512 to 8,192 tokens (`int4_grouped.rs`, min / median / max);
//! `--grouped-mxfp4` the same for gpt-oss-20b's MXFP4 experts with the
//! grouped MXFP4 GEMMs (`mxfp4_grouped.rs`, min / median / max);
//! `--host-experts` times decode experts read straight from mapped host
//! memory against copying them first (`host.rs`); `--tail` what HCS decode's
//! device tail (lookup, fetch) costs per MoE layer (`tail.rs`); `--cpu-expert`
//! the host CPU as a miss server: a cold expert's FFN computed on the host in
//! the GPU's f32 order, bit-exactness against the INT4 GEMVs, a GPU -> CPU ->
//! GPU round trip, against the PCIe copy (`cpu_expert/`;
//! `--cpu-expert-host-only` runs its CPU parts without a GPU);
//! `--baseline-int4` also times the entry points of an older `int4.cu` with
//! the pre-slot-mask signatures (w13: 128 threads, grid (I/16, pairs); w2:
//! 32*top_k threads, grid (H/16, tokens)), for before/after numbers.

use std::sync::Arc;

use anyhow::Context;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, DevicePtr, LaunchConfig, PushKernelArg,
    sys::CUevent_flags,
};
use half::bf16;
use krasis_kernels::{
    CacheDir, GemvForm, Int4Layout, Kernels, KvBase, KvGeom, QkvGeom, SamplingParams, StartPos,
    decode_workspace_len, sample_workspace_len,
};
use rand::{Rng, SeedableRng, rngs::StdRng};

mod cpu_expert;
mod host;
mod int4_grouped;
mod mxfp4_grouped;
mod tail;

/// Prints one section's table: `==== kbench (TITLE) ====` (or `==== kbench
/// ====` for an empty title), then its rows.
fn print_table(title: &str, rows: Vec<String>) {
    if title.is_empty() {
        println!("\n==== kbench ====");
    } else {
        println!("\n==== kbench ({title}) ====");
    }
    for r in rows {
        println!("{r}");
    }
}

/// Compiles kbench's own CUDA source `source` with the crate's NVRTC
/// options and loads it.
fn adhoc_module(
    ctx: &Arc<cudarc::driver::CudaContext>,
    name: &'static str,
    source: &'static str,
) -> anyhow::Result<Arc<cudarc::driver::CudaModule>> {
    let m = krasis_kernels::sources::Module {
        name,
        source,
        kernels: &[],
        target: krasis_kernels::sources::Target::Portable,
    };
    let c = krasis_kernels::compile_module(&m, ctx.compute_capability()?, &[])?;
    Ok(ctx.load_module(cudarc::nvrtc::Ptx::from_binary(c.cubin))?)
}

fn time_ms(
    s: &Arc<CudaStream>,
    reps: usize,
    f: impl FnMut(usize) -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    Ok(time_stats_ms(s, reps, f)?.median)
}

/// Milliseconds per iteration of 5 CUDA-event-timed runs.
#[derive(Debug, Clone, Copy)]
struct Times {
    min: f64,
    median: f64,
    max: f64,
}

impl Times {
    /// "min / median / max us" and the TFLOP/s of the median for `flops`
    /// per iteration (the grouped GEMM tables).
    fn fmt(self, flops: f64) -> String {
        format!(
            "{:>8.1} / {:>8.1} / {:>8.1} us {:>6.1} TFLOP/s",
            self.min * 1e3,
            self.median * 1e3,
            self.max * 1e3,
            flops / self.median / 1e9
        )
    }
}

/// Three warm-up iterations of `f`, then 5 runs of `reps` iterations, each
/// timed with CUDA events: the runs' min, median and max per iteration.
fn time_stats_ms(
    s: &Arc<CudaStream>,
    reps: usize,
    mut f: impl FnMut(usize) -> anyhow::Result<()>,
) -> anyhow::Result<Times> {
    for i in 0..3 {
        f(i)?;
    }
    s.synchronize()?;
    let mut samples = Vec::new();
    for r in 0..5 {
        let a = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        for i in 0..reps {
            f(r * reps + i)?;
        }
        let b = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        samples.push(a.elapsed_ms(&b)? as f64 / reps as f64);
    }
    samples.sort_by(f64::total_cmp);
    Ok(Times {
        min: samples[0],
        median: samples[2],
        max: samples[4],
    })
}

/// Pure GPU time per iteration: `reps` iterations captured into one CUDA
/// graph (no host launch overhead), replayed and timed with events.
fn time_graph_ms(
    s: &Arc<CudaStream>,
    reps: usize,
    mut f: impl FnMut(usize) -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    f(0)?;
    s.synchronize()?;
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    for i in 0..reps {
        f(i)?;
    }
    let graph = s
        .end_capture(CUgraphInstantiate_flags(0))?
        .context("empty graph")?;
    graph.launch()?;
    s.synchronize()?;
    let mut samples = Vec::new();
    for _ in 0..5 {
        let a = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        graph.launch()?;
        let b = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        samples.push(a.elapsed_ms(&b)? as f64 / reps as f64);
    }
    samples.sort_by(f64::total_cmp);
    Ok(samples[2])
}

fn rand_bf16(rng: &mut StdRng, n: usize) -> Vec<bf16> {
    (0..n)
        .map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0)))
        .collect()
}

struct Args {
    /// Only the INT4 decode GEMVs.
    int4_only: bool,
    /// Only the MXFP4 decode GEMVs.
    mxfp4_only: bool,
    /// Only the BF16 decode GEMVs (and cuBLAS at the same shapes).
    gemv_only: bool,
    rows_only: bool,
    /// Only decode attention at a3b's geometry, 1K-32K live keys in a 32K
    /// cache (device positions, graph-timed).
    attn_decode_only: bool,
    /// The a3b INT4 decode experts at 4 rows, two eager launches of w13
    /// and w2, nothing else (for a profiler: `ncu -k regex:int4_w`).
    int4_probe: bool,
    /// Only prefill attention (a3b d128 and qcn d256).
    prefill_only: bool,
    grouped_only: bool,
    /// Only the grouped MXFP4 prefill GEMMs (gpt-oss-20b) against their
    /// dequantize + cuBLAS baseline.
    grouped_mxfp4_only: bool,
    host_only: bool,
    tail_only: bool,
    cpu_expert: bool,
    cpu_expert_host: bool,
    /// A `.cu` file with an earlier INT4 module, timed beside the current one.
    baseline: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let mut args = Args {
        int4_only: false,
        mxfp4_only: false,
        gemv_only: false,
        rows_only: false,
        attn_decode_only: false,
        int4_probe: false,
        prefill_only: false,
        grouped_only: false,
        grouped_mxfp4_only: false,
        host_only: false,
        tail_only: false,
        cpu_expert: false,
        cpu_expert_host: false,
        baseline: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--int4" => args.int4_only = true,
            "--mxfp4" => args.mxfp4_only = true,
            "--gemv" => args.gemv_only = true,
            "--rows" => args.rows_only = true,
            "--attn-decode" => args.attn_decode_only = true,
            "--int4-probe" => args.int4_probe = true,
            "--prefill" => args.prefill_only = true,
            "--grouped" => args.grouped_only = true,
            "--grouped-mxfp4" => args.grouped_mxfp4_only = true,
            "--host-experts" => args.host_only = true,
            "--tail" => args.tail_only = true,
            "--cpu-expert" => args.cpu_expert = true,
            "--cpu-expert-host-only" => args.cpu_expert_host = true,
            "--baseline-int4" => args.baseline = Some(it.next().context("--baseline-int4 FILE")?),
            other => {
                anyhow::bail!(
                    "unknown argument {other} (--int4, --mxfp4, --gemv, --rows, --attn-decode, --int4-probe, --prefill, --grouped, --grouped-mxfp4, --host-experts, --tail, --cpu-expert, --cpu-expert-host-only, --baseline-int4 FILE)"
                )
            }
        }
    }
    if args.cpu_expert_host {
        let mut rows = Vec::new();
        cpu_expert::bench_host_only(&mut rows)?;
        print_table("CPU expert, host only", rows);
        return Ok(());
    }
    let ctx = krasis_kernels::try_open_device(0).context("no CUDA device")?;
    // Single-stream benchmark: cudarc's per-argument event tracking would
    // add host work to every launch and hide the kernel times.
    // SAFETY: every buffer here is used on the one stream only.
    unsafe { ctx.disable_event_tracking() };
    let t0 = std::time::Instant::now();
    let k = Kernels::new(
        &ctx,
        &CacheDir::At(std::env::temp_dir().join("krasis-kbench-cache")),
    )?;
    println!(
        "device {} ({:?}), kernels ready in {:?}",
        ctx.name()?,
        k.compute_capability(),
        t0.elapsed()
    );
    let s = ctx.new_stream()?;
    let mut rng = StdRng::seed_from_u64(7);
    let mut rows: Vec<String> = Vec::new();
    let mut a3b_experts = None;
    if args.prefill_only {
        // a3b's heads (32 q, 4 kv, d 128; 24 layers): the portable kernel,
        // and the Hopper (wgmma) kernel where the device runs it.
        for t in [8192usize, 32768] {
            let flops = 4.0 * 128.0 * 32.0 * (t as f64) * (t as f64 + 1.0) / 2.0;
            let reps = if t > 8192 { 1 } else { 3 };
            for hopper in [false, true] {
                if hopper && !k.has_prefill_wgmma() {
                    rows.push(
                        "attn prefill wgmma: not run (not a compute capability 9.0 device)".into(),
                    );
                    continue;
                }
                let Times {
                    min: lo,
                    median: med,
                    max: hi,
                } = bench_prefill(&k, &s, &mut rng, (32, 4, 128), t, reps, hopper)?;
                rows.push(format!(
                    "attn prefill {} d128 nq32/nkv4 T={t:<5} {:>8.1} us {:>7.1} TFLOP/s \
                     (min-max {:.1}-{:.1})  x24 layers {:.1} ms",
                    if hopper { "wgmma" } else { "mma  " },
                    med * 1e3,
                    flops / med / 1e9,
                    flops / hi / 1e9,
                    flops / lo / 1e9,
                    24.0 * med
                ));
            }
        }
        bench_prefill_qcn(&k, &s, &mut rng, &mut rows)?;
        print_table("prefill attention", rows);
        return Ok(());
    }
    if args.mxfp4_only {
        bench_mxfp4(&k, &s, &mut rng, &mut rows)?;
        print_table("mxfp4", rows);
        return Ok(());
    }
    if args.grouped_only {
        int4_grouped::bench_grouped(&k, &s, &mut rng, &mut rows)?;
        print_table("grouped prefill experts", rows);
        return Ok(());
    }
    if args.grouped_mxfp4_only {
        mxfp4_grouped::bench_grouped_mxfp4(&k, &s, &mut rng, &mut rows)?;
        print_table("grouped MXFP4 prefill experts", rows);
        return Ok(());
    }
    if args.tail_only {
        tail::bench_tail(&k, &s, &mut rng, &mut rows)?;
        print_table("HCS decode tail", rows);
        return Ok(());
    }
    if args.cpu_expert {
        cpu_expert::bench_cpu_expert(&k, &s, &mut rng, &mut rows)?;
        print_table("CPU expert miss server", rows);
        return Ok(());
    }
    if args.host_only {
        host::bench_host_experts(&k, &s, &mut rng, &mut rows)?;
        print_table("host experts", rows);
        return Ok(());
    }
    if args.int4_probe {
        return int4_probe(&k, &s, &mut rng);
    }
    if args.attn_decode_only {
        bench_attn_decode(&k, &s, &mut rng, &mut rows)?;
        print_table("decode attention", rows);
        return Ok(());
    }
    if args.rows_only {
        bench_rows(&k, &s, &mut rng, &mut rows)?;
        print_table("rows", rows);
        return Ok(());
    }
    if args.gemv_only {
        bench_gemv(&k, &s, &mut rng, &mut rows)?;
        print_table("gemv", rows);
        return Ok(());
    }

    // ---- INT4 decode GEMVs: a3b (H 2048, I 768, top-8 of 128) and qcn
    // (H 2048, I 512, top-10 of 512; 128 experts allocated, ids cycle) on
    // the g = 128 fast path; dsv3 (DeepSeek-like H 7168, I 2048, top-8,
    // 32 experts allocated: 0.7 GB) and oss (gpt-oss-120b-like H 2880,
    // I 2880, group 32, top-4, 32 experts) on the general entry points.
    let baseline = args
        .baseline
        .as_deref()
        .map(|p| load_baseline(&ctx, p))
        .transpose()?;
    for (label, h, i, g, e, topk) in [
        ("a3b", 2048usize, 768usize, 128usize, 128usize, 8usize),
        ("qcn", 2048, 512, 128, 128, 10),
        ("dsv3", 7168, 2048, 128, 32, 8),
        ("oss g32", 2880, 2880, 32, 32, 4),
    ] {
        let buf = bench_int4(
            &k,
            &s,
            &mut rng,
            label,
            (h, i, g, e, topk),
            &baseline,
            &mut rows,
        )?;
        if label == "a3b" && !args.int4_only {
            a3b_experts = Some(buf);
        }
    }
    if !args.int4_only {
        bench_mxfp4(&k, &s, &mut rng, &mut rows)?;
    }
    if args.int4_only {
        print_table("int4", rows);
        return Ok(());
    }
    let (buf, table, layout) = a3b_experts.context("a3b experts")?;
    bench_gemv(&k, &s, &mut rng, &mut rows)?;
    let (h, i, e, topk) = (layout.hidden, layout.intermediate, 128usize, 8usize);
    let w13_bytes = (layout.w13_s - layout.w13_q) + 2 * i * (h / 128) * 2;
    let w2_bytes = h * i / 2 + h * (i / 128) * 2;
    let gbs = |bytes: usize, ms: f64| bytes as f64 / ms / 1e6;

    // ---- Dequantize all 128 experts to bf16 (prefill path).
    let all_ids = s.clone_htod(&(0..e as u32).collect::<Vec<_>>())?;
    let mut o13 = s.alloc_zeros::<bf16>(e * 2 * i * h)?;
    let mut o2 = s.alloc_zeros::<bf16>(e * h * i)?;
    let td = time_ms(&s, 3, |_| {
        Ok(k.int4_dequant(&s, &table, &all_ids, e, &layout, &mut o13, &mut o2)?)
    })?;
    let moved = e * (w13_bytes + w2_bytes) + e * 3 * i * h * 2;
    rows.push(format!(
        "int4 dequant 128 experts -> bf16      {:>8.1} us {:>7.0} GB/s (r+w)",
        td * 1e3,
        gbs(moved, td)
    ));
    drop((o13, o2, buf));

    // ---- Prefill attention at 8K, a3b heads (32 q, 4 kv, d 128).
    let t = 8192usize;
    let geom = QkvGeom {
        n_tokens: t,
        n_q_heads: 32,
        n_kv_heads: 4,
        head_dim: 128,
    };
    let kv = KvGeom {
        n_kv_heads: 4,
        head_dim: 128,
        capacity: t,
    };
    let qkv = s.clone_htod(&rand_bf16(&mut rng, geom.len()))?;
    let mut kc = s.alloc_zeros::<bf16>(kv.len())?;
    let mut vc = s.alloc_zeros::<bf16>(kv.len())?;
    k.kv_append(
        &s,
        &qkv,
        geom,
        StartPos::Host(0),
        kv,
        KvBase::Host(0),
        &mut kc,
        &mut vc,
    )?;
    let mut out = s.alloc_zeros::<bf16>(t * 32 * 128)?;
    let scale = 1.0 / (128f32).sqrt();
    let ta = time_ms(&s, 3, |_| {
        Ok(k.attention_prefill(&s, &qkv, geom, 0, kv, 0, &kc, &vc, scale, &mut out)?)
    })?;
    let flops = 4.0 * 128.0 * 32.0 * (t as f64) * (t as f64 + 1.0) / 2.0;
    rows.push(format!(
        "attn prefill mma T=8192 (1 layer)     {:>8.1} us {:>7.1} TFLOP/s  x24 layers {:.1} ms",
        ta * 1e3,
        flops / ta / 1e9,
        24.0 * ta
    ));
    let g2 = QkvGeom {
        n_tokens: 2048,
        ..geom
    };
    let ts = time_ms(&s, 1, |_| {
        Ok(k.attention_prefill_simt(&s, &qkv, g2, 0, kv, 0, &kc, &vc, scale, &mut out)?)
    })?;
    let tm = time_ms(&s, 3, |_| {
        Ok(k.attention_prefill(&s, &qkv, g2, 0, kv, 0, &kc, &vc, scale, &mut out)?)
    })?;
    rows.push(format!(
        "attn prefill T=2048: simt {:.2} ms, mma {:.3} ms",
        ts, tm
    ));
    bench_prefill_qcn(&k, &s, &mut rng, &mut rows)?;

    // ---- Decode attention at 8K and 32K context.
    for ctxlen in [8192usize, 32768] {
        let kv = KvGeom {
            n_kv_heads: 4,
            head_dim: 128,
            capacity: ctxlen,
        };
        let kc = s.clone_htod(&rand_bf16(&mut rng, kv.len()))?;
        let vc = s.clone_htod(&rand_bf16(&mut rng, kv.len()))?;
        let g1 = QkvGeom {
            n_tokens: 1,
            ..geom
        };
        let mut ws = s.alloc_zeros::<f32>(decode_workspace_len(32, 128))?;
        let mut o = s.alloc_zeros::<bf16>(32 * 128)?;
        let q1 = qkv.slice(0..g1.len());
        let pos = ctxlen as u32 - 1;
        let tdh = time_ms(&s, 100, |_| {
            Ok(k.attention_decode(
                &s,
                &q1,
                g1,
                StartPos::Host(pos),
                kv,
                KvBase::Host(0),
                &kc,
                &vc,
                scale,
                &mut ws,
                &mut o,
            )?)
        })?;
        let pos_buf = s.clone_htod(&[pos])?;
        let tdd = time_ms(&s, 100, |_| {
            Ok(k.attention_decode(
                &s,
                &q1,
                g1,
                StartPos::Device(&pos_buf),
                kv,
                KvBase::Host(0),
                &kc,
                &vc,
                scale,
                &mut ws,
                &mut o,
            )?)
        })?;
        let bytes = 2 * kv.len() * 2;
        let tg = time_graph_ms(&s, 32, |_| {
            Ok(k.attention_decode(
                &s,
                &q1,
                g1,
                StartPos::Device(&pos_buf),
                kv,
                KvBase::Host(0),
                &kc,
                &vc,
                scale,
                &mut ws,
                &mut o,
            )?)
        })?;
        rows.push(format!(
            "attn decode ctx={ctxlen} graph-timed {:.1} us {:.0} GB/s",
            tg * 1e3,
            gbs(bytes, tg)
        ));
        rows.push(format!(
            "attn decode ctx={ctxlen:<6} host-pos {:>7.1} us {:>5.0} GB/s, device-pos {:>7.1} us",
            tdh * 1e3,
            gbs(bytes, tdh),
            tdd * 1e3
        ));
    }

    bench_attn_gptoss(&k, &s, &mut rng, &mut rows)?;

    // ---- Router top-8 + grouping for an 8K-token prefill.
    let logits = s.clone_htod(&rand_bf16(&mut rng, t * e))?;
    let mut rid = s.alloc_zeros::<u32>(t * topk)?;
    let mut rw = s.alloc_zeros::<f32>(t * topk)?;
    let (mut c, mut off, mut rp, mut pr) = (
        s.alloc_zeros::<u32>(e)?,
        s.alloc_zeros::<u32>(e + 1)?,
        s.alloc_zeros::<u32>(t * topk)?,
        s.alloc_zeros::<u32>(t * topk)?,
    );
    let tr = time_ms(&s, 10, |_| {
        Ok(k.router_topk::<bf16>(&s, &logits, t, e, topk, true, &mut rid, &mut rw)?)
    })?;
    let tg = time_ms(&s, 10, |_| {
        Ok(k.moe_group(&s, &rid, t * topk, e, &mut c, &mut off, &mut rp, &mut pr)?)
    })?;
    rows.push(format!(
        "router top8/128 T=8192 {:.1} us; moe_group {:.1} us",
        tr * 1e3,
        tg * 1e3
    ));

    // ---- gpt-oss-20b at T=8192: router (bias, top-4 of 32 logits, softmax
    // over the 4) and RoPE from a frequency table (64 q + 8 kv heads, d 64).
    let (eo, ko) = (32usize, 4usize);
    let lo = s.clone_htod(&rand_bf16(&mut rng, t * eo))?;
    let bo = s.clone_htod(&vec![0.5f32; eo])?;
    let (mut io, mut wo) = (s.alloc_zeros::<u32>(t * ko)?, s.alloc_zeros::<f32>(t * ko)?);
    let mode = krasis_kernels::ops::moe::RouterMode::TopKSoftmax;
    let tro = time_ms(&s, 10, |_| {
        Ok(k.router_topk_with::<bf16>(&s, &lo, Some(&bo), t, eo, ko, mode, &mut io, &mut wo)?)
    })?;
    let go = QkvGeom {
        n_tokens: t,
        n_q_heads: 64,
        n_kv_heads: 8,
        head_dim: 64,
    };
    let mut qo = s.clone_htod(&rand_bf16(&mut rng, go.len()))?;
    let freqs: Vec<f32> = (0..32)
        .map(|i| 150_000f32.powf(-(i as f32) / 32.0))
        .collect();
    let fo = s.clone_htod(&freqs)?;
    let tro2 = time_ms(&s, 10, |_| {
        Ok(k.rope_table(&s, &mut qo, go, StartPos::Host(0), &fo, 1.35)?)
    })?;
    rows.push(format!(
        "gpt-oss T=8192: router bias+top4/32+softmax {:.1} us; rope_table {:.1} us ({:.0} GB/s)",
        tro * 1e3,
        tro2 * 1e3,
        (2 * 2 * t * 72 * 64) as f64 / tro2 / 1e6
    ));

    // ---- Sampling over a Qwen3 vocab.
    let v = 151_936usize;
    let lg = s.clone_htod(&rand_bf16(&mut rng, v))?;
    let mut counts = s.alloc_zeros::<u32>(v)?;
    let mut wsp = s.alloc_zeros::<u32>(sample_workspace_len(v))?;
    let mut tok = s.alloc_zeros::<u32>(1)?;
    let tgr = time_ms(&s, 50, |_| Ok(k.argmax::<bf16>(&s, &lg, 1, v, &mut tok)?))?;
    let p = SamplingParams {
        temperature: 0.7,
        top_k: 50,
        top_p: 0.9,
        min_p: 0.01,
        seed: 1,
        ..Default::default()
    };
    let tsm = time_ms(&s, 50, |it| {
        Ok(k.sample::<bf16>(
            &s,
            &lg,
            v,
            &p,
            it as u64,
            None,
            &mut counts,
            &mut wsp,
            &mut tok,
        )?)
    })?;
    let pf = SamplingParams {
        temperature: 1.0,
        seed: 1,
        ..Default::default()
    };
    let tsf = time_ms(&s, 50, |it| {
        Ok(k.sample::<bf16>(
            &s,
            &lg,
            v,
            &pf,
            it as u64,
            None,
            &mut counts,
            &mut wsp,
            &mut tok,
        )?)
    })?;
    rows.push(format!(
        "argmax V=151936 {:.1} us; sample top-k/p/min-p {:.1} us; sample plain {:.1} us",
        tgr * 1e3,
        tsm * 1e3,
        tsf * 1e3
    ));

    print_table("", rows);
    Ok(())
}

/// Median time (ms) of one causal prefill attention launch from position
/// 0 over `t` random tokens with `heads` = (n_q, n_kv, head_dim).
fn bench_prefill(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut StdRng,
    heads: (usize, usize, usize),
    t: usize,
    reps: usize,
    hopper: bool,
) -> anyhow::Result<Times> {
    let (nq, nkv, d) = heads;
    let geom = QkvGeom {
        n_tokens: t,
        n_q_heads: nq,
        n_kv_heads: nkv,
        head_dim: d,
    };
    let kv = KvGeom {
        n_kv_heads: nkv,
        head_dim: d,
        capacity: t,
    };
    let qkv = s.clone_htod(&rand_bf16(rng, geom.len()))?;
    let mut kc = s.alloc_zeros::<bf16>(kv.len())?;
    let mut vc = s.alloc_zeros::<bf16>(kv.len())?;
    k.kv_append(
        s,
        &qkv,
        geom,
        StartPos::Host(0),
        kv,
        KvBase::Host(0),
        &mut kc,
        &mut vc,
    )?;
    let mut out = s.alloc_zeros::<bf16>(t * nq * d)?;
    let scale = 1.0 / (d as f32).sqrt();
    time_stats_ms(s, reps, |_| {
        if hopper {
            Ok(k.attention_prefill_wgmma(s, &qkv, geom, 0, kv, 0, &kc, &vc, scale, &mut out)?)
        } else {
            Ok(k.attention_prefill(s, &qkv, geom, 0, kv, 0, &kc, &vc, scale, &mut out)?)
        }
    })
}

/// Prefill attention at the qcn heads (16 q, 2 kv, d 256; 48 layers), T 8K
/// and 32K from position 0, with causal TFLOP/s (2 * 2 * nq * D * T(T+1)/2).
fn bench_prefill_qcn(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut StdRng,
    rows: &mut Vec<String>,
) -> anyhow::Result<()> {
    for t in [8192usize, 32768] {
        let reps = if t > 8192 { 1 } else { 3 };
        let ms = bench_prefill(k, s, rng, (16, 2, 256), t, reps, false)?.median;
        let flops = 4.0 * 256.0 * 16.0 * (t as f64) * (t as f64 + 1.0) / 2.0;
        rows.push(format!(
            "attn prefill mma d256 nq16/nkv2 T={t:<5} {:>8.1} us {:>7.1} TFLOP/s  x48 layers {:.1} ms",
            ms * 1e3,
            flops / ms / 1e9,
            48.0 * ms
        ));
    }
    Ok(())
}

/// The old module's w13 and w2 entry points for NCL = NCLI = 1 and 2.
struct Baseline {
    w13: [CudaFunction; 2],
    w2: [CudaFunction; 2],
}

fn load_baseline(ctx: &Arc<cudarc::driver::CudaContext>, path: &str) -> anyhow::Result<Baseline> {
    let src: &'static str = Box::leak(std::fs::read_to_string(path)?.into_boxed_str());
    let names = [
        "int4_w13_swiglu_1",
        "int4_w13_swiglu_2",
        "int4_w2_combine_1",
        "int4_w2_combine_2",
    ];
    let module = adhoc_module(ctx, "int4_baseline", src)?;
    let f = |n: &str| module.load_function(n);
    Ok(Baseline {
        w13: [f(names[0])?, f(names[1])?],
        w2: [f(names[2])?, f(names[3])?],
    })
}

type Experts = (CudaSlice<u8>, CudaSlice<u64>, Int4Layout);

/// Times both INT4 decode GEMVs for one token on `shape` = (H, I, group,
/// experts, top_k), random weights with sane scales, expert sets cycling over 64
/// random draws (so successive launches read different experts).
fn bench_int4(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut StdRng,
    label: &str,
    shape: (usize, usize, usize, usize, usize),
    baseline: &Option<Baseline>,
    rows: &mut Vec<String>,
) -> anyhow::Result<Experts> {
    let (h, i, g, e, topk) = shape;
    let layout = Int4Layout::new(h, i, g).context("INT4 layout")?;
    let (buf, table) = random_int4_experts(s, rng, &layout, e)?;
    let n_sets = 64;
    let ids = s.clone_htod(&random_routes(rng, n_sets, e, topk))?;
    let w = s.clone_htod(&vec![0.125f32; topk])?;
    let x = s.clone_htod(&rand_bf16(rng, h))?;
    let mut act = s.alloc_zeros::<f32>(topk * i)?;
    let mut res = s.alloc_zeros::<f32>(h)?;
    let w13_bytes = (layout.w13_s - layout.w13_q) + 2 * i * (h / g) * 2;
    let w2_bytes = h * i / 2 + h * (i / g) * 2;
    let gbs = |bytes: usize, ms: f64| bytes as f64 / ms / 1e6;
    let sl = |it: usize| ids.slice((it % n_sets) * topk..(it % n_sets + 1) * topk);
    let t13 = time_ms(s, 200, |it| {
        Ok(k.int4_w13_swiglu(
            s,
            &x,
            &table,
            &sl(it),
            1,
            topk,
            &layout,
            u32::MAX,
            false,
            &mut act,
        )?)
    })?;
    let t2 = time_ms(s, 200, |it| {
        Ok(k.int4_w2_combine(s, &act, &table, &sl(it), &w, 1, topk, &layout, &mut res)?)
    })?;
    let g13 = time_graph_ms(s, 64, |it| {
        Ok(k.int4_w13_swiglu(
            s,
            &x,
            &table,
            &sl(it),
            1,
            topk,
            &layout,
            u32::MAX,
            false,
            &mut act,
        )?)
    })?;
    let g2 = time_graph_ms(s, 64, |it| {
        Ok(k.int4_w2_combine(s, &act, &table, &sl(it), &w, 1, topk, &layout, &mut res)?)
    })?;
    let gl = time_graph_ms(s, 64, |it| {
        k.int4_w13_swiglu(
            s,
            &x,
            &table,
            &sl(it),
            1,
            topk,
            &layout,
            u32::MAX,
            false,
            &mut act,
        )?;
        Ok(k.int4_w2_combine(s, &act, &table, &sl(it), &w, 1, topk, &layout, &mut res)?)
    })?;
    let (b13, b2) = (topk * w13_bytes, topk * w2_bytes);
    rows.push(format!(
        "{label} H{h} I{i} g{g} top{topk}: graph-timed w13 {:.2} us {:.0} GB/s, w2 {:.2} us {:.0} GB/s, layer (w13+w2 in one graph) {:.2} us {:.0} GB/s",
        g13 * 1e3,
        gbs(b13, g13),
        g2 * 1e3,
        gbs(b2, g2),
        gl * 1e3,
        gbs(b13 + b2, gl)
    ));
    rows.push(format!(
        "{label} launch loop: w13 {:.2} us {:.0} GB/s, w2 {:.2} us {:.0} GB/s, layer {:.2} us {:.0} GB/s",
        t13 * 1e3,
        gbs(b13, t13),
        t2 * 1e3,
        gbs(b2, t2),
        (t13 + t2) * 1e3,
        gbs(b13 + b2, t13 + t2)
    ));
    // The baseline entry points exist for the fast path's shapes only.
    if let Some(b) = baseline
        .as_ref()
        .filter(|_| g == 128 && h <= 2048 && i <= 2048)
    {
        let n_table = e as u32;
        let (kk, hh, ii, one) = (topk as u32, h as u32, i as u32, 1u32);
        let (o13q, o13s) = (layout.w13_q as u64, layout.w13_s as u64);
        let (o2q, o2s) = (layout.w2_q as u64, layout.w2_s as u64);
        let f13 = &b.w13[h.div_ceil(1024) - 1];
        let f2 = &b.w2[i.div_ceil(1024) - 1];
        let xp = x.device_ptr(s).0;
        let tp = table.device_ptr(s).0;
        let wp = w.device_ptr(s).0;
        let ap = act.device_ptr(s).0;
        let rp = res.device_ptr(s).0;
        let idp = |it: usize| ids.device_ptr(s).0 + ((it % n_sets) * topk * 4) as u64;
        let c13 = LaunchConfig {
            grid_dim: (ii / 16, kk, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let c2 = LaunchConfig {
            grid_dim: (hh / 16, 1, 1),
            block_dim: (32 * kk, 1, 1),
            shared_mem_bytes: 0,
        };
        let old13 = |it: usize| -> anyhow::Result<()> {
            let ip = idp(it);
            let mut l = s.launch_builder(f13);
            l.arg(&xp).arg(&tp).arg(&n_table).arg(&ip).arg(&kk).arg(&kk);
            l.arg(&hh).arg(&ii).arg(&o13q).arg(&o13s).arg(&ap);
            // SAFETY: the old kernel's arguments, sized as above.
            unsafe { l.launch(c13) }?;
            Ok(())
        };
        let old2 = |it: usize| -> anyhow::Result<()> {
            let ip = idp(it);
            let mut l = s.launch_builder(f2);
            l.arg(&ap)
                .arg(&tp)
                .arg(&n_table)
                .arg(&ip)
                .arg(&wp)
                .arg(&one);
            l.arg(&kk).arg(&hh).arg(&ii).arg(&o2q).arg(&o2s).arg(&rp);
            // SAFETY: as above.
            unsafe { l.launch(c2) }?;
            Ok(())
        };
        let o13 = time_graph_ms(s, 64, old13)?;
        let o2 = time_graph_ms(s, 64, old2)?;
        let ol = time_graph_ms(s, 64, |it| {
            old13(it)?;
            old2(it)
        })?;
        rows.push(format!(
            "{label} BASELINE graph-timed: w13 {:.2} us {:.0} GB/s, w2 {:.2} us {:.0} GB/s, layer {:.2} us {:.0} GB/s",
            o13 * 1e3,
            gbs(b13, o13),
            o2 * 1e3,
            gbs(b2, o2),
            ol * 1e3,
            gbs(b13 + b2, ol)
        ));
    }
    Ok((buf, table, layout))
}

/// One cuBLAS `gemm_ex` exactly as `runtime/gpu/src/blas.rs` issues it:
/// `Y[m, n] = X[m, k] · W[n, k]ᵀ + beta * Y`, bf16 inputs, f32 compute.
#[allow(clippy::too_many_arguments)]
fn cublas_gemm(
    blas: &CudaBlas,
    m: usize,
    n: usize,
    kk: usize,
    x: u64,
    w: u64,
    y: u64,
    out_f32: bool,
    beta: f32,
) -> anyhow::Result<()> {
    use cudarc::cublas::sys::{
        cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType,
    };
    let alpha = 1.0f32;
    let c_type = if out_f32 {
        cudaDataType::CUDA_R_32F
    } else {
        cudaDataType::CUDA_R_16BF
    };
    // SAFETY: live device buffers of the stated shapes; alpha/beta are host
    // scalars that outlive the (enqueue-only) call.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            n as i32,
            m as i32,
            kk as i32,
            (&alpha) as *const f32 as *const _,
            w as *const _,
            cudaDataType::CUDA_R_16BF,
            kk as i32,
            x as *const _,
            cudaDataType::CUDA_R_16BF,
            kk as i32,
            (&beta) as *const f32 as *const _,
            y as *mut _,
            c_type,
            n as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }?;
    Ok(())
}

/// A weight `[n, k]` in `copies` copies (>= 256 MB in all, so a launch never
/// finds its weight in the 50 MB L2, as in a real decode step).
struct Rotated {
    buf: CudaSlice<bf16>,
    len: usize,
    copies: usize,
}

impl Rotated {
    fn new(s: &Arc<CudaStream>, rng: &mut StdRng, n: usize, kk: usize) -> anyhow::Result<Self> {
        let len = n * kk;
        let copies = ((256usize << 20) / (2 * len)).max(1);
        let block = rand_bf16(rng, len.min(1 << 20));
        let host: Vec<bf16> = block.iter().copied().cycle().take(len).collect();
        let mut buf = s.alloc_zeros::<bf16>(copies * len)?;
        for c in 0..copies {
            s.memcpy_htod(&host, &mut buf.slice_mut(c * len..(c + 1) * len))?;
        }
        Ok(Rotated { buf, len, copies })
    }

    fn get(&self, it: usize) -> cudarc::driver::CudaView<'_, bf16> {
        let c = it % self.copies;
        self.buf.slice(c * self.len..(c + 1) * self.len)
    }
}

/// The BF16 decode GEMVs (`gemv_bf16`, `gemv_rmsnorm_bf16`) at the a3b dense
/// shapes next to cuBLAS `gemm_ex`, graph-timed, with GB/s of weight read.
fn bench_gemv(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut StdRng,
    rows: &mut Vec<String>,
) -> anyhow::Result<()> {
    // A fixed workspace, as the engine sets one, so capture never allocates
    // (declared first: dropped after the handle).
    let ws = s.alloc_zeros::<u8>(64 << 20)?;
    let blas = CudaBlas::new(s.clone())?;
    // SAFETY: `ws` outlives every use of the handle in this function.
    unsafe {
        cudarc::cublas::sys::cublasSetWorkspace_v2(
            *blas.handle(),
            ws.device_ptr(s).0 as *mut std::ffi::c_void,
            64 << 20,
        )
    }
    .result()?;
    let mut gi = GemvInputs::new(s, rng)?;
    let gbs = |bytes: usize, ms: f64| bytes as f64 / ms / 1e6;
    rows.push(
        "bf16 GEMV, graph-timed (back to back: on sm_90 each GEMV overlaps the previous one's tail \
         through PDL), GB/s of weight read; +norm: RMSNorm fused vs rmsnorm_f32 + cuBLAS"
            .to_string(),
    );
    let mut kept = Vec::new();
    for (label, m, n, kk, out_f32, acc) in [
        ("qkv", 1usize, 5120usize, 2048usize, false, false),
        ("o_proj +=", 1, 2048, 4096, true, true),
        ("router", 1, 128, 2048, true, false),
        ("lm_head", 1, 151_936, 2048, true, false),
        ("qkv", 4, 5120, 2048, false, false),
        ("qkv", 8, 5120, 2048, false, false),
    ] {
        let wr = Rotated::new(s, rng, n, kk)?;
        let bytes = wr.len * 2;
        let reps = if bytes > (100 << 20) { 8 } else { 64 };
        let mut yf = s.alloc_zeros::<f32>(m * n)?;
        let mut yb = s.alloc_zeros::<bf16>(m * n)?;
        let t_gemv = time_graph_ms(s, reps, |it| {
            gi.launch(
                k,
                s,
                &wr.get(it),
                (m, n, kk),
                false,
                out_f32,
                acc,
                GemvForm::CudaCores,
                &mut yf,
                &mut yb,
            )
        })?;
        let t_norm = time_graph_ms(s, reps, |it| {
            gi.launch(
                k,
                s,
                &wr.get(it),
                (m, n, kk),
                true,
                out_f32,
                acc,
                GemvForm::CudaCores,
                &mut yf,
                &mut yb,
            )
        })?;
        let xp = gi.x.device_ptr(s).0;
        let np = gi.normed.device_ptr(s).0;
        let yp = if out_f32 {
            yf.device_ptr(s).0
        } else {
            yb.device_ptr(s).0
        };
        let beta = if acc { 1.0 } else { 0.0 };
        let t_blas = time_graph_ms(s, reps, |it| {
            let wp = wr.get(it).device_ptr(s).0;
            cublas_gemm(&blas, m, n, kk, xp, wp, yp, out_f32, beta)
        })?;
        let t_blas_norm = time_graph_ms(s, reps, |it| {
            k.rmsnorm::<f32>(s, &gi.res, &gi.gw, m, kk, gi.eps, &mut gi.normed)?;
            let wp = wr.get(it).device_ptr(s).0;
            cublas_gemm(&blas, m, n, kk, np, wp, yp, out_f32, beta)
        })?;
        rows.push(format!(
            "{label:<10} m={m} {n:>6}x{kk} {}: gemv {:>7.2} us {:>5.0} GB/s | cuBLAS {:>7.2} us {:>5.0} GB/s | +norm: fused {:>7.2} us, rmsnorm+cuBLAS {:>7.2} us",
            if out_f32 { "f32 " } else { "bf16" },
            t_gemv * 1e3,
            gbs(bytes, t_gemv),
            t_blas * 1e3,
            gbs(bytes, t_blas),
            t_norm * 1e3,
            t_blas_norm * 1e3,
        ));
        if m == 1 && kept.len() < 3 {
            kept.push(wr);
        }
    }

    // The dense part of one decode layer: RMSNorm + QKV, o_proj += residual,
    // RMSNorm + router (consecutive GEMVs overlap through PDL on sm_90).
    let [wq, wo, wr]: [Rotated; 3] = kept
        .try_into()
        .map_err(|_| anyhow::anyhow!("qkv, o_proj and router weights"))?;
    let bytes = 2 * (wq.len + wo.len + wr.len);
    let GemvInputs {
        eps,
        x,
        res,
        gw,
        mut normed,
    } = gi;
    let mut qkv = s.alloc_zeros::<bf16>(5120)?;
    let mut resid = s.alloc_zeros::<f32>(2048)?;
    s.memcpy_dtod(&res.slice(..2048), &mut resid)?;
    let mut logits = s.alloc_zeros::<f32>(128)?;
    let reps = 32;
    let t_chain = time_graph_ms(s, reps, |it| {
        k.gemv_rmsnorm::<bf16, bf16>(
            s,
            &resid,
            &gw,
            eps,
            &wq.get(it),
            1,
            5120,
            2048,
            false,
            &mut normed,
            &mut qkv,
        )?;
        k.gemv::<bf16, f32>(s, &x, &wo.get(it), 1, 2048, 4096, true, &mut resid)?;
        k.gemv_rmsnorm::<bf16, f32>(
            s,
            &resid,
            &gw,
            eps,
            &wr.get(it),
            1,
            128,
            2048,
            false,
            &mut normed,
            &mut logits,
        )?;
        Ok(())
    })?;
    let (xp, np) = (x.device_ptr(s).0, normed.device_ptr(s).0);
    let (qp, rp, lp) = (
        qkv.device_ptr(s).0,
        resid.device_ptr(s).0,
        logits.device_ptr(s).0,
    );
    let t_chain_blas = time_graph_ms(s, reps, |it| {
        k.rmsnorm::<f32>(s, &resid, &gw, 1, 2048, eps, &mut normed)?;
        cublas_gemm(
            &blas,
            1,
            5120,
            2048,
            np,
            wq.get(it).device_ptr(s).0,
            qp,
            false,
            0.0,
        )?;
        cublas_gemm(
            &blas,
            1,
            2048,
            4096,
            xp,
            wo.get(it).device_ptr(s).0,
            rp,
            true,
            1.0,
        )?;
        k.rmsnorm::<f32>(s, &resid, &gw, 1, 2048, eps, &mut normed)?;
        cublas_gemm(
            &blas,
            1,
            128,
            2048,
            np,
            wr.get(it).device_ptr(s).0,
            lp,
            true,
            0.0,
        )
    })?;
    rows.push(format!(
        "layer dense part (norm+qkv, o_proj+=, norm+router): gemv {:.2} us {:.0} GB/s | rmsnorm+cuBLAS {:.2} us {:.0} GB/s",
        t_chain * 1e3,
        gbs(bytes, t_chain),
        t_chain_blas * 1e3,
        gbs(bytes, t_chain_blas)
    ));
    Ok(())
}

// ---- MXFP4 ----

/// Times both MXFP4 decode GEMVs for one token at gpt-oss-20b's expert
/// shape (H 2880, I 2880, 32 experts with biases, top-4, clamped SwiGLU):
/// random codes, scale 2^-7, expert sets cycling over 64 random draws.
/// GB/s counts the bytes each kernel must read: codes, scales and bias.
fn bench_mxfp4(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut StdRng,
    rows: &mut Vec<String>,
) -> anyhow::Result<()> {
    use krasis_kernels::ops::mxfp4::{ExpertActivation, Mxfp4Layout};
    let (h, i, e, topk) = (2880usize, 2880usize, 32usize, 4usize);
    let a = ExpertActivation::ClampedSwiglu {
        limit: 7.0,
        alpha: 1.702,
    };
    let layout = Mxfp4Layout::new(h, i, true).context("MXFP4 layout")?;
    let (_buf, table) = mxfp4_grouped::random_mxfp4_experts(s, rng, &layout, e)?;
    let w13_bytes = i * h + 2 * i * h / 32 + 2 * i * 2;
    let w2_bytes = h * i / 2 + h * i / 32 + h * 2;
    let gbs = |bytes: f64, ms: f64| bytes / ms / 1e6;
    // A batched decode step's rows route independently (top-4 of 32 each),
    // so M rows read between 4 and 4M distinct experts: the GB/s are of the
    // distinct experts' bytes (what HBM must deliver), the pairs' bytes are
    // what the kernels request (a pair reads its expert whatever the rows).
    for m in [1usize, 2, 4, 8] {
        let n_sets = 64;
        let (mut ids, mut distinct) = (Vec::new(), 0usize);
        for _ in 0..n_sets {
            let set = random_routes(rng, m, e, topk);
            let mut d = set.clone();
            d.sort_unstable();
            d.dedup();
            distinct += d.len();
            ids.extend_from_slice(&set);
        }
        let distinct = distinct as f64 / n_sets as f64;
        let pairs = m * topk;
        let ids = s.clone_htod(&ids)?;
        let w = s.clone_htod(&vec![0.25f32; pairs])?;
        let x = s.clone_htod(&rand_bf16(rng, m * h))?;
        let mut act = s.alloc_zeros::<f32>(pairs * i)?;
        let mut res = s.alloc_zeros::<f32>(m * h)?;
        let sl = |it: usize| ids.slice((it % n_sets) * pairs..(it % n_sets + 1) * pairs);
        let w13 = |it: usize, act: &mut CudaSlice<f32>| {
            k.mxfp4_w13_act(
                s,
                &x,
                &table,
                &sl(it),
                m,
                topk,
                &layout,
                u32::MAX,
                false,
                a,
                act,
            )
        };
        let w2 = |it: usize, act: &CudaSlice<f32>, res: &mut CudaSlice<f32>| {
            k.mxfp4_w2_combine(s, act, &table, &sl(it), &w, m, topk, &layout, res)
        };
        let g13 = time_graph_ms(s, 64, |it| Ok(w13(it, &mut act)?))?;
        let g2 = time_graph_ms(s, 64, |it| Ok(w2(it, &act, &mut res)?))?;
        let gl = time_graph_ms(s, 64, |it| {
            w13(it, &mut act)?;
            Ok(w2(it, &act, &mut res)?)
        })?;
        let (d13, d2) = (distinct * w13_bytes as f64, distinct * w2_bytes as f64);
        rows.push(format!(
            "mxfp4 oss-20b H{h} I{i} top{topk} M{m} ({pairs} pairs, {distinct:.1} distinct experts): graph-timed w13 {:.2} us {:.0} GB/s, w2 {:.2} us {:.0} GB/s, layer (w13+w2 in one graph) {:.2} us {:.0} GB/s of distinct experts ({:.0} GB/s requested by the pairs)",
            g13 * 1e3,
            gbs(d13, g13),
            g2 * 1e3,
            gbs(d2, g2),
            gl * 1e3,
            gbs(d13 + d2, gl),
            gbs((pairs * (w13_bytes + w2_bytes)) as f64, gl),
        ));
    }
    Ok(())
}

// ---- gpt-oss decode attention ----

/// Decode attention at gpt-oss-20b's heads (64 q, 8 kv, d 64, sinks) at
/// position 32767: a full layer (capacity 32K) against a 128-token sliding
/// layer over its ring (wrapped many times), and the plain causal kernel at
/// the full layer's shape for reference. A sliding layer reads its window
/// only, so its time must not grow with the context. GB/s counts the K and
/// V bytes each layer must read.
fn bench_attn_gptoss(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut StdRng,
    rows: &mut Vec<String>,
) -> anyhow::Result<()> {
    use krasis_kernels::ops::attention::{RingAttn, ring_min_capacity};
    let (nq, nkv, d, ctxlen, window) = (64usize, 8usize, 64usize, 32768usize, 128usize);
    let g1 = QkvGeom {
        n_tokens: 1,
        n_q_heads: nq,
        n_kv_heads: nkv,
        head_dim: d,
    };
    let q1 = s.clone_htod(&rand_bf16(rng, g1.len()))?;
    let sinks = s.clone_htod(&vec![1.0f32; nq])?;
    let mut ws = s.alloc_zeros::<f32>(decode_workspace_len(nq, d))?;
    let mut o = s.alloc_zeros::<bf16>(nq * d)?;
    let pos = ctxlen as u32 - 1;
    let pos_buf = s.clone_htod(&[pos])?;
    let scale = 1.0 / (d as f32).sqrt();
    // Full layer (window 0, capacity = context) and sliding layer (ring of
    // window + 512-token chunks - 1, rounded up to 64 rows).
    for (label, window, capacity) in [
        ("full   ", 0, ctxlen),
        (
            "sliding",
            window,
            ring_min_capacity(window, 512).next_multiple_of(64),
        ),
    ] {
        let kv = KvGeom {
            n_kv_heads: nkv,
            head_dim: d,
            capacity,
        };
        let kc = s.clone_htod(&rand_bf16(rng, kv.len()))?;
        let vc = s.clone_htod(&rand_bf16(rng, kv.len()))?;
        let attn = RingAttn {
            sinks: Some(&sinks),
            window,
            ring: if window == 0 { 0 } else { capacity },
        };
        let keys = if window == 0 { ctxlen } else { window };
        let bytes = 2 * nkv * keys * d * 2;
        let mut run = |sp: StartPos<'_>| -> anyhow::Result<()> {
            Ok(k.attention_decode_ring(
                s,
                &q1,
                g1,
                sp,
                kv,
                krasis_kernels::KvBase::Host(0),
                &kc,
                &vc,
                scale,
                attn,
                &mut ws,
                &mut o,
            )?)
        };
        let th = time_ms(s, 100, |_| run(StartPos::Host(pos)))?;
        let td = time_ms(s, 100, |_| run(StartPos::Device(&pos_buf)))?;
        let tg = time_graph_ms(s, 32, |_| run(StartPos::Device(&pos_buf)))?;
        rows.push(format!(
            "gpt-oss attn decode {label} ctx={ctxlen} host-pos {:>7.1} us, device-pos {:>7.1} us, graph {:>7.1} us {:>5.0} GB/s",
            th * 1e3,
            td * 1e3,
            tg * 1e3,
            bytes as f64 / tg / 1e6
        ));
        if window == 0 {
            let tp = time_ms(s, 100, |_| {
                Ok(k.attention_decode(
                    s,
                    &q1,
                    g1,
                    StartPos::Host(pos),
                    kv,
                    KvBase::Host(0),
                    &kc,
                    &vc,
                    scale,
                    &mut ws,
                    &mut o,
                )?)
            })?;
            rows.push(format!(
                "gpt-oss attn decode plain causal (no sinks) ctx={ctxlen} host-pos {:>7.1} us",
                tp * 1e3
            ));
        }
    }
    Ok(())
}

/// The kernels of a batched decode step at M = 1, 2, 4, 8 rows (one row per
/// sequence), graph-timed: the BF16 GEMVs at the a3b shapes (QKV and the
/// router with the RMSNorm fused, o_proj accumulating), then both INT4
/// expert GEMVs back to back with every token routed independently (top-k
/// of 128 drawn per token, as real rows route), for each block shape
/// (pairs per w13 block, tokens per w2 block; "auto" = the wrappers' own).
fn bench_rows(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut StdRng,
    rows: &mut Vec<String>,
) -> anyhow::Result<()> {
    let mut gi = GemvInputs::new(s, rng)?;
    rows.push("bf16 GEMV at M rows, graph-timed, us (x one row)".to_string());
    // The LM head in both forms: the engine's is the tensor-core one
    // (`LM_HEAD_FORM`), the others run on the CUDA cores.
    let (cc, tc) = (GemvForm::CudaCores, GemvForm::TensorCores);
    for (label, n, kk, norm, acc, form) in [
        ("qkv +norm", 5120usize, 2048usize, true, false, cc),
        ("o_proj +=", 2048, 4096, false, true, cc),
        ("router +norm", 128, 2048, true, false, cc),
        ("lm_head +norm", 151_936, 2048, true, false, cc),
        ("lm_head tc", 151_936, 2048, true, false, tc),
        ("lm_head oss", 201_088, 2880, true, false, cc),
        ("lm_head oss tc", 201_088, 2880, true, false, tc),
    ] {
        let wr = Rotated::new(s, rng, n, kk)?;
        let mut one = 0.0;
        let mut line = format!("{label:<14} {n:>6}x{kk}:");
        // The engine's outputs: qkv bf16, the others f32.
        let out_f32 = n != 5120;
        for m in [1usize, 2, 4, 8] {
            let mut yf = s.alloc_zeros::<f32>(m * n)?;
            let mut yb = s.alloc_zeros::<bf16>(m * n)?;
            let reps = if n > 100_000 { 8 } else { 64 };
            let t = time_graph_ms(s, reps, |it| {
                gi.launch(
                    k,
                    s,
                    &wr.get(it),
                    (m, n, kk),
                    norm,
                    out_f32,
                    acc,
                    form,
                    &mut yf,
                    &mut yb,
                )
            })?;
            if m == 1 {
                one = t;
            }
            line.push_str(&format!("  m{m} {:>7.2} ({:.2}x)", t * 1e3, t / one));
        }
        rows.push(line);
    }
    rows.push(
        "INT4 w13+w2 at M rows (independent routes), graph-timed, us; (tokens per w2 block)"
            .to_string(),
    );
    for (label, h, i, e, topk) in [
        ("a3b", 2048usize, 768usize, 128usize, 8usize),
        ("glm-air", 4096, 1408, 128, 8),
    ] {
        let layout = Int4Layout::new(h, i, 128).context("INT4 layout")?;
        let (_buf, table) = random_int4_experts(s, rng, &layout, e)?;
        let n_sets = 64;
        let ids = s.clone_htod(&random_routes(rng, n_sets * 8, e, topk))?;
        let w = s.clone_htod(&vec![0.125f32; 8 * topk])?;
        let xb = s.clone_htod(&rand_bf16(rng, 8 * h))?;
        let mut act = s.alloc_zeros::<f32>(8 * topk * i)?;
        let mut resd = s.alloc_zeros::<f32>(8 * h)?;
        for m in [1usize, 2, 4, 8] {
            let mut line = format!("{label} H{h} I{i} m{m}:");
            let sl =
                |it: usize| ids.slice((it % n_sets) * 8 * topk..((it % n_sets) * 8 + m) * topk);
            let auto = krasis_kernels::w2_tokens_per_block(&layout, m, topk);
            for t in [1usize, 2, 4] {
                if t > m {
                    continue;
                }
                let timed = time_graph_ms(s, 64, |it| {
                    k.int4_w13_swiglu(
                        s,
                        &xb,
                        &table,
                        &sl(it),
                        m,
                        topk,
                        &layout,
                        u32::MAX,
                        false,
                        &mut act,
                    )?;
                    Ok(k.int4_w2_combine_blocked(
                        s,
                        &act,
                        &table,
                        &sl(it),
                        &w,
                        m,
                        topk,
                        &layout,
                        t,
                        &mut resd,
                    )?)
                });
                match timed {
                    Ok(ms) => line.push_str(&format!("  ({t}) {:>6.2}", ms * 1e3)),
                    Err(e) => line.push_str(&format!("  ({t}) refused: {e}")),
                }
            }
            // Each kernel alone at the wrappers' choice.
            let t13 = time_graph_ms(s, 64, |it| {
                Ok(k.int4_w13_swiglu(
                    s,
                    &xb,
                    &table,
                    &sl(it),
                    m,
                    topk,
                    &layout,
                    u32::MAX,
                    false,
                    &mut act,
                )?)
            })?;
            let t2 = time_graph_ms(s, 64, |it| {
                Ok(k.int4_w2_combine(s, &act, &table, &sl(it), &w, m, topk, &layout, &mut resd)?)
            })?;
            line.push_str(&format!(
                "  | auto ({auto}): w13 {:.2} w2 {:.2}",
                t13 * 1e3,
                t2 * 1e3
            ));
            // w13 in the other block shape (16 or 32 rows per block; the
            // same bits), to compare with the wrappers' choice.
            let rt = krasis_kernels::w13_row_tiles(&layout, m);
            let other = 3 - rt;
            let t13o = time_graph_ms(s, 64, |it| {
                Ok(k.int4_w13_swiglu_tiled(
                    s,
                    &xb,
                    &table,
                    &sl(it),
                    m,
                    topk,
                    &layout,
                    u32::MAX,
                    false,
                    other,
                    &mut act,
                )?)
            });
            match t13o {
                Ok(ms) => line.push_str(&format!(
                    " (w13 {} rows per block; {} rows: {:.2})",
                    16 * rt,
                    16 * other,
                    ms * 1e3
                )),
                Err(e) => line.push_str(&format!(" (w13 {} rows per block; {e})", 16 * rt)),
            }
            rows.push(line);
        }
    }
    Ok(())
}

/// `--attn-decode`: a3b's decode attention (32 q / 4 kv heads x 128) over
/// 1K-32K live keys of a 32K cache, one row and four (each row its own
/// sequence), device positions as the engine runs it, graph-timed.
fn bench_attn_decode(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut StdRng,
    rows: &mut Vec<String>,
) -> anyhow::Result<()> {
    let (nq, nkv, d, cap, mt) = (32usize, 4usize, 128usize, 32768usize, 4usize);
    let kv = KvGeom {
        n_kv_heads: nkv,
        head_dim: d,
        capacity: cap,
    };
    let kc = s.clone_htod(&rand_bf16(rng, kv.len()))?;
    let vc = s.clone_htod(&rand_bf16(rng, kv.len()))?;
    let g4 = QkvGeom {
        n_tokens: mt,
        n_q_heads: nq,
        n_kv_heads: nkv,
        head_dim: d,
    };
    let qkv = s.clone_htod(&rand_bf16(rng, g4.len()))?;
    let mut ws = s.alloc_zeros::<f32>(mt * decode_workspace_len(nq, d))?;
    let mut o = s.alloc_zeros::<bf16>(mt * nq * d)?;
    for ctxlen in [1024usize, 4096, 8192, 32768] {
        for m in [1usize, mt] {
            // Row r: its own sequence in KV rows [r * ctxlen / m, ...): the
            // same keys per row as the engine's batched step reads.
            let span = ctxlen / m;
            let pos = s.clone_htod(&vec![span as u32 - 1; m])?;
            let base: Vec<u32> = (0..m).map(|r| (r * span) as u32).collect();
            let base = s.clone_htod(&base)?;
            let g = QkvGeom { n_tokens: m, ..g4 };
            let q = qkv.slice(0..g.len());
            let t = time_graph_ms(s, 32, |_| {
                Ok(k.attention_decode(
                    s,
                    &q,
                    g,
                    StartPos::Device(&pos),
                    kv,
                    KvBase::Device(&base),
                    &kc,
                    &vc,
                    0.088,
                    &mut ws,
                    &mut o,
                )?)
            })?;
            let bytes = 2 * m * span * nkv * d * 2;
            rows.push(format!(
                "attn decode {m} row(s) x {span:>5} keys (cache {cap}): {:>7.2} us {:>5.0} GB/s",
                t * 1e3,
                bytes as f64 / t / 1e6
            ));
        }
    }
    Ok(())
}

/// `--int4-probe`: the a3b INT4 decode experts at 4 rows (independent
/// routes), w13 then w2 launched twice, eager: something small for a
/// profiler to look at (session 20's ncu figures in
/// `docs/notes/batching-cuda.md`).
fn int4_probe(k: &Kernels, s: &Arc<CudaStream>, rng: &mut StdRng) -> anyhow::Result<()> {
    let (h, i, e, topk, m) = (2048usize, 768usize, 128usize, 8usize, 4usize);
    let layout = Int4Layout::new(h, i, 128).context("INT4 layout")?;
    let (_buf, table) = random_int4_experts(s, rng, &layout, e)?;
    let ids = s.clone_htod(&random_routes(rng, m, e, topk))?;
    let w = s.clone_htod(&vec![0.125f32; m * topk])?;
    let xb = s.clone_htod(&rand_bf16(rng, m * h))?;
    let mut act = s.alloc_zeros::<f32>(m * topk * i)?;
    let mut res = s.alloc_zeros::<f32>(m * h)?;
    for _ in 0..2 {
        k.int4_w13_swiglu(
            s,
            &xb,
            &table,
            &ids,
            m,
            topk,
            &layout,
            u32::MAX,
            false,
            &mut act,
        )?;
        k.int4_w2_combine(s, &act, &table, &ids, &w, m, topk, &layout, &mut res)?;
    }
    s.synchronize()?;
    println!("int4 probe done");
    Ok(())
}

/// `e` INT4 experts of `layout` with random nibbles and sane scales (f16
/// 0.01, so outputs stay finite), 4 KiB apart, and their pointer table.
fn random_int4_experts(
    s: &Arc<CudaStream>,
    rng: &mut StdRng,
    layout: &Int4Layout,
    e: usize,
) -> anyhow::Result<(CudaSlice<u8>, CudaSlice<u64>)> {
    let (h, i, g) = (layout.hidden, layout.intermediate, layout.group);
    let stride = layout.used_bytes().div_ceil(4096) * 4096;
    let mut host = vec![0u8; e * stride];
    rng.fill(&mut host[..]);
    for x in 0..e {
        let b = &mut host[x * stride..];
        for (off, n) in [(layout.w13_s, 2 * i * h / g), (layout.w2_s, h * i / g)] {
            for j in 0..n {
                b[off + 2 * j..off + 2 * j + 2]
                    .copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
            }
        }
    }
    let buf: CudaSlice<u8> = s.clone_htod(&host)?;
    let base = buf.device_ptr(s).0;
    let table: Vec<u64> = (0..e).map(|x| base + (x * stride) as u64).collect();
    let table = s.clone_htod(&table)?;
    Ok((buf, table))
}

/// `n` independent routes: `topk` distinct experts of `e` each.
fn random_routes(rng: &mut StdRng, n: usize, e: usize, topk: usize) -> Vec<u32> {
    let mut ids = Vec::new();
    for _ in 0..n {
        let mut all: Vec<u32> = (0..e as u32).collect();
        for j in 0..topk {
            let r = rng.random_range(j..e);
            all.swap(j, r);
        }
        ids.extend_from_slice(&all[..topk]);
    }
    ids
}

/// The inputs of the BF16 decode GEMVs (up to 8 rows of K <= 4096): x,
/// a residual and norm weight for the RMSNorm-fused form, its `normed`.
struct GemvInputs {
    eps: f32,
    x: CudaSlice<bf16>,
    res: CudaSlice<f32>,
    gw: CudaSlice<bf16>,
    normed: CudaSlice<bf16>,
}

impl GemvInputs {
    fn new(s: &Arc<CudaStream>, rng: &mut StdRng) -> anyhow::Result<Self> {
        let kmax = 4096usize;
        let x = s.clone_htod(&rand_bf16(rng, 8 * kmax))?;
        let resid: Vec<f32> = (0..8 * kmax)
            .map(|_| rng.random_range(-2.0f32..2.0))
            .collect();
        Ok(GemvInputs {
            eps: 1e-6,
            x,
            res: s.clone_htod(&resid)?,
            gw: s.clone_htod(&rand_bf16(rng, kmax))?,
            normed: s.alloc_zeros::<bf16>(8 * kmax)?,
        })
    }

    /// One GEMV as the engine launches it: the RMSNorm fused in or not, y
    /// in f32 (`acc`: added to it) or bf16 (`yb`; never accumulated).
    #[allow(clippy::too_many_arguments)]
    fn launch(
        &mut self,
        k: &Kernels,
        s: &Arc<CudaStream>,
        w: &CudaView<bf16>,
        (m, n, kk): (usize, usize, usize),
        norm: bool,
        out_f32: bool,
        acc: bool,
        form: GemvForm,
        yf: &mut CudaSlice<f32>,
        yb: &mut CudaSlice<bf16>,
    ) -> anyhow::Result<()> {
        let (res, gw, eps) = (&self.res, &self.gw, self.eps);
        match (norm, out_f32) {
            (false, true) => k.gemv::<bf16, f32>(s, &self.x, w, m, n, kk, acc, yf)?,
            (false, false) => k.gemv::<bf16, bf16>(s, &self.x, w, m, n, kk, false, yb)?,
            (true, true) => k.gemv_rmsnorm_form::<bf16, f32>(
                s,
                res,
                gw,
                eps,
                w,
                m,
                n,
                kk,
                acc,
                form,
                &mut self.normed,
                yf,
            )?,
            (true, false) => k.gemv_rmsnorm_form::<bf16, bf16>(
                s,
                res,
                gw,
                eps,
                w,
                m,
                n,
                kk,
                false,
                form,
                &mut self.normed,
                yb,
            )?,
        }
        Ok(())
    }
}
