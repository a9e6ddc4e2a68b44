//! Speed measurement: prefill tok/s per prompt length, decode tok/s per
//! decode length with and without the decode CUDA graph, min free VRAM
//! (monitor thread), each beside its physical bound.

use super::stats::{RunStats, grouped};
use super::{Args, text_tokens};
use anyhow::Context;
use krasis_gpu::CudaEngine;
use krasis_gpu::bounds::{self, Bound};
use krasis_gpu::monitor::VramMonitor;
use krasis_model::{Engine, GenerateRequest, GenerateStats, SamplingParams};
use serde::Serialize;
use std::ops::ControlFlow;
use std::time::Duration;

#[derive(Debug, Serialize)]
struct Identity {
    model: String,
    model_dir: String,
    geometry: String,
    cache_format_version: u32,
    cache_path: Option<String>,
    gpu: String,
    driver_version: i32,
    commit: String,
    prefill_chunk: usize,
    /// The engine's prefill kernel families (`krasis_gpu::prefill_kernels`).
    prefill_kernels: String,
    context_length: usize,
    load_seconds: f64,
    weight_bytes: usize,
    host_weight_bytes: usize,
    expert_bytes: usize,
    kv_bytes: usize,
}

#[derive(Debug, Serialize)]
struct PrefillResult {
    prompt_tokens: usize,
    text_repeated: bool,
    /// The median (kept under this name for older readers).
    tok_s: f64,
    /// warmup_tok_s, runs_tok_s, min/median/max_tok_s.
    #[serde(flatten)]
    stats: RunStats,
    bound: Bound,
    fraction_of_bound: f64,
    /// With HCS: the streamed expert bytes at the measured H2D rate, and
    /// the measured all-resident prefill time (needs --baseline).
    constrained: Option<ConstrainedBound>,
    /// All resident: where the prefill's device time goes (CUDA events
    /// around its parts run on their own, `krasis_gpu::profile_prefill`).
    breakdown_ms: Option<krasis_gpu::profile_prefill::PrefillBreakdown>,
}

#[derive(Debug, Serialize, Clone)]
struct ConstrainedBound {
    /// Cold expert bytes (decode: per token; prefill: per prompt).
    cold_bytes: f64,
    h2d_bytes_per_s: f64,
    resident_tok_s: Option<f64>,
    /// The upper bound: copies overlapping the all-resident compute
    /// perfectly, 1 / max(copy time, all-resident time) per token (the copy
    /// time alone without a baseline). `fraction` is the median against it.
    max_tok_s: f64,
    fraction: f64,
    /// Prefill with a baseline only: copies and compute one after the
    /// other, 1 / (copy time + all-resident time) per token. Not a bound
    /// (overlap beats it); it shows how much of the copy time overlap hid.
    serial_tok_s: Option<f64>,
    hcs: krasis_common::status::HcsStats,
}

#[derive(Debug, Serialize)]
struct DecodeResult {
    decode_tokens: usize,
    prompt_tokens: usize,
    cuda_graphs: bool,
    /// Most experts prefetched per MoE layer (HCS only; 0: off).
    hcs_prefetch: Option<usize>,
    /// Sampling temperature (0: greedy; `--decode-temperature`).
    temperature: f32,
    /// The median (kept under this name for older readers).
    tok_s: f64,
    #[serde(flatten)]
    stats: RunStats,
    bound: Bound,
    fraction_of_bound: f64,
    constrained: Option<ConstrainedBound>,
}

#[derive(Debug, Serialize)]
struct CopyRates {
    expert_gb_s: f64,
    big_gb_s: f64,
    big_bytes: usize,
    expert_fraction_of_big: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    identity: Identity,
    prefill: Vec<PrefillResult>,
    decode: Vec<DecodeResult>,
    decode_breakdown_ms: krasis_gpu::profile::DecodeBreakdown,
    /// `--decode-rows`: sequences decoding together.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    batched: Vec<super::batched::BatchedResult>,
    /// `--grammar`: decode with a grammar against without.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    grammar: Vec<super::grammar::GrammarResult>,
    min_free_vram_bytes: Option<u64>,
    /// Free VRAM in the budget after each stage of the run (the monitor's
    /// minimum says how low it went; these say after which stage memory
    /// stayed taken).
    free_after_stage_bytes: Vec<(String, u64)>,
    vram_limit_bytes: Option<u64>,
    safety_margin_bytes: u64,
    min_free_at_least_margin: bool,
    hcs_load: Option<krasis_gpu::setup::HcsReport>,
    /// The all-resident figures the constrained bounds use.
    baseline: Option<super::baseline::Baseline>,
    copy_rates: Option<CopyRates>,
    total_vram_bytes: usize,
    hbm_bytes_per_s_assumed: f64,
    bf16_flop_per_s_assumed: f64,
}

/// A greedy request of `new` tokens after `prompt`, without the prefix
/// cache (every bench run prefills cold).
pub(super) fn greedy_request(prompt: &[u32], new: usize) -> GenerateRequest {
    sampled_request(prompt, new, 0.0)
}

/// [`greedy_request`] sampled at `temperature` with a fixed seed (greedy
/// at 0), for `--decode-temperature`.
pub(super) fn sampled_request(prompt: &[u32], new: usize, temperature: f32) -> GenerateRequest {
    let sampling = if temperature > 0.0 {
        SamplingParams {
            temperature,
            seed: Some(0x6b72_6173),
            ..SamplingParams::default()
        }
    } else {
        SamplingParams::greedy()
    };
    GenerateRequest {
        prompt: prompt.to_vec(),
        max_new_tokens: new,
        sampling,
        stop_token_ids: Vec::new(),
        cancel: Default::default(),
        live: Default::default(),
        cache_prompt: false,
        constraint: None,
    }
}

pub(super) fn greedy(
    engine: &mut CudaEngine,
    prompt: &[u32],
    new: usize,
) -> anyhow::Result<GenerateStats> {
    sampled(engine, prompt, new, 0.0)
}

fn sampled(
    engine: &mut CudaEngine,
    prompt: &[u32],
    new: usize,
    temperature: f32,
) -> anyhow::Result<GenerateStats> {
    let req = sampled_request(prompt, new, temperature);
    let out = engine
        .generate(&req, &mut |_| ControlFlow::Continue(()))
        .context("generating")?;
    anyhow::ensure!(
        out.stats.generated_tokens == new,
        "asked for {new} tokens, got {}",
        out.stats.generated_tokens
    );
    Ok(out.stats)
}

/// One warm-up run of `new` tokens after `prompt` (reported, not
/// counted), then `repeats` timed runs, greedy or (`temperature` > 0)
/// seeded sampling: the statistics of each run's figure (`pick`), and the
/// HCS traffic of the last run when HCS is active.
pub(super) fn measure(
    e: &mut CudaEngine,
    prompt: &[u32],
    temperature: f32,
    new: usize,
    repeats: usize,
    pick: fn(&GenerateStats) -> f64,
) -> anyhow::Result<(RunStats, Option<krasis_common::status::HcsStats>)> {
    let stats = RunStats::measure(repeats, || Ok(pick(&sampled(e, prompt, new, temperature)?)))?;
    let hcs = e.hcs_stats().filter(|_| e.hcs_active());
    Ok((stats, hcs))
}

impl ConstrainedBound {
    fn new(
        cold_bytes: f64,
        h2d_bytes_per_s: f64,
        resident_tok_s: Option<f64>,
        max_tok_s: f64,
        serial_tok_s: Option<f64>,
        tok_s: f64,
        hcs: krasis_common::status::HcsStats,
    ) -> Self {
        ConstrainedBound {
            cold_bytes,
            h2d_bytes_per_s,
            resident_tok_s,
            max_tok_s,
            fraction: tok_s / max_tok_s,
            serial_tok_s,
            hcs,
        }
    }
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    super::stats::check_repeats(a.repeats)?;
    let max_prompt = a.prompt_tokens.iter().copied().max().unwrap_or(0);
    let max_decode = a.decode_tokens.iter().copied().max().unwrap_or(0);
    let context = a
        .context_length
        .unwrap_or(max_prompt.max(a.decode_prompt_tokens + max_decode) + 16);
    let opts = super::engine_options(a, context)?;
    let (all, repeated_all) = text_tokens(
        &a.model,
        &a.text,
        max_prompt.max(a.decode_prompt_tokens).max(64),
    )?;
    // The all-resident figures the constrained bounds are measured against.
    let baseline = match (&a.baseline_from, a.baseline && a.vram_limit.is_some()) {
        (Some(p), _) => {
            let g = krasis_model::ModelConfig::load(&a.model)
                .with_context(|| format!("reading {}", a.model.display()))?
                .geometry();
            Some(super::baseline::read(p, &geometry_line(&g), a)?)
        }
        (None, true) => Some(super::baseline::measure_all_resident(a, &opts, &all)?),
        (None, false) => None,
    };
    if let Some(b) = &baseline {
        eprintln!(
            "baseline (all resident): prefill {:?} tok/s, decode {:?} tok/s",
            b.prefill_tok_s, b.decode_tok_s
        );
    }
    let base_prefill = baseline
        .as_ref()
        .map(|b| b.prefill_tok_s.clone())
        .unwrap_or_default();
    let base_decode = baseline
        .as_ref()
        .map(|b| b.decode_tok_s.clone())
        .unwrap_or_default();
    let mut engine = CudaEngine::load(&a.model, &opts)
        .with_context(|| format!("loading {} on the GPU", a.model.display()))?;
    let budget = engine.gpu().budget;
    let monitor = VramMonitor::start_in_budget(
        engine.gpu().ctx.clone(),
        Duration::from_millis(2),
        Some(budget),
    );
    let g = engine.geometry().clone();
    let info = engine.gpu().info.clone();
    // The bytes an expert GEMV reads: the loaded cache's own format (INT4,
    // or a checkpoint's MXFP4 with its biases).
    let expert_bytes = engine.expert_cache().map_or(0, |c| c.layout().used_bytes);
    let copy_rates = engine.measure_copy_rates()?.map(|(e, b, n)| CopyRates {
        expert_gb_s: e,
        big_gb_s: b,
        big_bytes: n,
        expert_fraction_of_big: e / b,
    });
    if let Some(c) = &copy_rates {
        eprintln!(
            "H2D from the host backing: {:.1} GB/s per expert copy, {:.1} GB/s for one {:.0} MB copy ({:.0}%)",
            c.expert_gb_s,
            c.big_gb_s,
            c.big_bytes as f64 / 1e6,
            100.0 * c.expert_fraction_of_big
        );
    }
    let h2d = copy_rates.as_ref().map_or(0.0, |c| c.big_gb_s * 1e9);
    let lr = engine.load_report().clone();
    eprintln!("prefill kernels: {}", lr.prefill_kernels);
    let mut stages = Vec::new();
    let mut stage = |engine: &CudaEngine, name: &str| -> anyhow::Result<()> {
        let free = engine.gpu().free_in_budget()?;
        stages.push((name.to_string(), free));
        Ok(())
    };
    stage(&engine, "load and copy rates")?;

    // Warm-up: module loads, cuBLAS heuristics, graph capture.
    greedy(&mut engine, &all[..64.min(all.len())], 8)?;
    stage(&engine, "warm-up")?;

    let mut prefill = Vec::new();
    for &p in &a.prompt_tokens {
        let (stats, hcs) = measure(
            &mut engine,
            &all[..p],
            0.0,
            1,
            a.repeats,
            GenerateStats::prefill_tok_s,
        )?;
        let tok_s = stats.median_tok_s;
        let bound = bounds::prefill_bound(&g, p);
        let constrained = hcs.map(|h| {
            let cold = h.prefill_stream_bytes as f64;
            let resident = base_prefill.get(&p).copied();
            let (max_tok_s, serial) = streamed_prefill_bounds(p, cold / h2d, resident);
            eprintln!(
                "  HCS: streamed {:.2} GB ({:.3} s at {:.1} GB/s); bound {max_tok_s:.0} tok/s ({:.0}%; {}){}",
                cold / 1e9,
                cold / h2d,
                h2d / 1e9,
                100.0 * tok_s / max_tok_s,
                if resident.is_some() {
                    "copies overlapping the all-resident compute"
                } else {
                    "the copies alone: --baseline adds the compute"
                },
                serial.map_or(String::new(), |s| format!(
                    ", serial (no overlap) {s:.0} tok/s"
                ))
            );
            ConstrainedBound::new(cold, h2d, resident, max_tok_s, serial, tok_s, h)
        });
        eprintln!(
            "prefill {p:>6} tokens: {} tok/s, warm-up {} not counted (bound {} tok/s at {:.0} TFLOP/s)",
            stats.display(0),
            grouped(stats.warmup_tok_s, 0),
            grouped(bound.max_tok_s, 0),
            bounds::H200_BF16_FLOP_PER_S / 1e12
        );
        let breakdown = if a.prefill_breakdown {
            let b = engine
                .prefill_breakdown(&all[..p], 3)
                .context("timing the parts of a prefill")?;
            eprintln!(
                "  parts (ms, {} chunk(s)): total {:.1} = attention {:.1} + router {:.1} + routed experts {:.1} + rest {:.1}",
                b.chunks, b.total_ms, b.attention_ms, b.router_ms, b.experts_ms, b.rest_ms
            );
            Some(b)
        } else {
            None
        };
        prefill.push(PrefillResult {
            prompt_tokens: p,
            text_repeated: repeated_all && p > all.len(),
            tok_s,
            fraction_of_bound: tok_s / bound.max_tok_s,
            stats,
            bound,
            constrained,
            breakdown_ms: breakdown,
        });
        stage(&engine, &format!("prefill {p}"))?;
    }

    let prompt = &all[..a.decode_prompt_tokens];
    let mut decode = Vec::new();
    // The engine's own prefetch with graphs on and off, then (HCS only)
    // every other --hcs-prefetch setting with graphs on.
    let own_prefetch = engine.hcs_prefetch();
    let mut runs = vec![(true, own_prefetch), (false, own_prefetch)];
    match own_prefetch {
        Some(own) => runs.extend(
            a.hcs_prefetch
                .iter()
                .filter(|&&p| p != own)
                .map(|&p| (true, Some(p))),
        ),
        None => eprintln!("every expert is resident: no HCS prefetch to measure"),
    }
    for (graphs, prefetch) in runs {
        engine.set_cuda_graphs(graphs);
        if let Some(p) = prefetch {
            engine.set_hcs_prefetch(p);
        }
        for &d in &a.decode_tokens {
            // +1: the first token comes from prefill and is not timed as decode.
            let (stats, hcs) = measure(
                &mut engine,
                prompt,
                a.decode_temperature,
                d + 1,
                a.repeats,
                GenerateStats::decode_tok_s,
            )?;
            let tok_s = stats.median_tok_s;
            let ctx = a.decode_prompt_tokens + d / 2;
            let bound = bounds::decode_bound(&g, expert_bytes, ctx);
            eprintln!(
                "decode {d:>4} tokens (graphs {}{}{}): {} tok/s, warm-up {} not counted (bound {} tok/s: {:.2} GB/token at {:.1} TB/s)",
                if graphs { "on " } else { "off" },
                prefetch.map_or(String::new(), |p| format!(", prefetch {p}")),
                if a.decode_temperature > 0.0 {
                    format!(", sampled at temperature {}", a.decode_temperature)
                } else {
                    String::new()
                },
                stats.display(1),
                grouped(stats.warmup_tok_s, 1),
                grouped(bound.max_tok_s, 0),
                bound.per_token / 1e9,
                bounds::H200_HBM_BYTES_PER_S / 1e12
            );
            let constrained = hcs.map(|h| {
                let cold = h.cold_bytes_per_token;
                let resident = base_decode.get(&d).copied();
                let t = (cold / h2d).max(resident.map_or(0.0, |r| 1.0 / r));
                let max_tok_s = 1.0 / t.max(1e-12);
                eprintln!(
                    "  HCS: hit rate {:.3}, {:.1} cold experts ({:.1} MB)/token over PCIe; bound {max_tok_s:.1} tok/s ({:.0}%)",
                    h.hit_rate,
                    h.cold_experts_per_token,
                    cold / 1e6,
                    100.0 * tok_s / max_tok_s
                );
                if h.prefetched_experts_per_token > 0.0 {
                    // Precision: prefetched experts used; recall: the
                    // needed cold experts that prefetch had brought.
                    eprintln!(
                        "  prefetch: {:.1} experts/token, precision {:.3}, recall {:.3}, wasted {:.1} MB/token",
                        h.prefetched_experts_per_token,
                        h.prefetch_used_per_token / h.prefetched_experts_per_token,
                        h.prefetch_used_per_token / h.cold_experts_per_token.max(1e-9),
                        h.prefetch_wasted_per_token * cold / h.cold_experts_per_token.max(1e-9) / 1e6
                    );
                }
                ConstrainedBound::new(cold, h2d, resident, max_tok_s, None, tok_s, h)
            });
            decode.push(DecodeResult {
                decode_tokens: d,
                prompt_tokens: a.decode_prompt_tokens,
                cuda_graphs: graphs,
                hcs_prefetch: prefetch,
                temperature: a.decode_temperature,
                tok_s,
                fraction_of_bound: tok_s / bound.max_tok_s,
                stats,
                bound,
                constrained,
            });
        }
        let pf = prefetch.map_or(String::new(), |p| format!(", prefetch {p}"));
        stage(&engine, &format!("decode (graphs {graphs}{pf})"))?;
    }
    engine.set_cuda_graphs(true);
    if let Some(p) = own_prefetch {
        engine.set_hcs_prefetch(p);
    }
    // Under HCS the parts run through the decode table as the step does
    // (the timed MoE layer's lookup, and its cold experts copied into the
    // tail).
    let breakdown = engine
        .decode_breakdown(a.decode_prompt_tokens, 1, 20)
        .context("timing the parts of a decode step")?;
    stage(&engine, "decode breakdown")?;
    {
        eprintln!(
            "decode step parts (ms): layers {:.3} (per layer: attention {:.4}, router {:.4}, experts {:.4}), LM head {:.3}, sample {:.3}",
            breakdown.layers_ms,
            breakdown.attention_layer_ms,
            breakdown.router_layer_ms,
            breakdown.experts_layer_ms,
            breakdown.lm_head_ms,
            breakdown.sample_ms
        );
    }
    let batched = if a.decode_rows.is_empty() {
        Vec::new()
    } else {
        let d = super::batched::decode_tokens(a);
        let rows = a.decode_rows.iter().copied().max().unwrap_or(1);
        let (text, _) = super::text_tokens(&a.model, &a.text, rows * a.decode_prompt_tokens)?;
        super::batched::measure(
            &mut engine,
            &text,
            &a.decode_rows,
            a.decode_prompt_tokens,
            d,
            a.repeats,
            expert_bytes,
        )?
    };
    if !batched.is_empty() {
        stage(&engine, "batched decode")?;
    }
    let grammar = if a.grammar {
        super::grammar::measure(&mut engine, &a.model, prompt, &a.decode_tokens, a.repeats)?
    } else {
        Vec::new()
    };
    let min_free = monitor.min_free();
    drop(monitor);
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    eprintln!(
        "free VRAM in the budget after each stage (MiB): {}; lowest seen {:.1}",
        stages
            .iter()
            .map(|(n, b)| format!("{n} {:.1}", mib(*b)))
            .collect::<Vec<_>>()
            .join(", "),
        min_free.map_or(f64::NAN, mib)
    );

    let model_name = model_name(&a.model);
    let report = Report {
        identity: Identity {
            model: model_name.clone(),
            model_dir: a.model.display().to_string(),
            geometry: geometry_line(&g),
            cache_format_version: lr.cache_format_version,
            cache_path: lr.cache_path.as_ref().map(|p| p.display().to_string()),
            gpu: info.name.clone(),
            driver_version: info.driver_version,
            commit: a.commit.clone().unwrap_or_else(|| "unknown".into()),
            prefill_chunk: lr.prefill_chunk,
            prefill_kernels: lr.prefill_kernels.clone(),
            context_length: lr.context_length,
            load_seconds: lr.load_seconds,
            weight_bytes: lr.weight_bytes,
            host_weight_bytes: lr.host_weight_bytes,
            expert_bytes: lr.expert_bytes,
            kv_bytes: lr.kv_bytes,
        },
        prefill,
        decode,
        decode_breakdown_ms: breakdown,
        batched,
        grammar,
        min_free_vram_bytes: min_free,
        free_after_stage_bytes: stages,
        vram_limit_bytes: budget.limit,
        safety_margin_bytes: opts.safety_margin,
        min_free_at_least_margin: min_free.is_none_or(|m| m >= opts.safety_margin),
        hcs_load: lr.hcs.clone(),
        baseline,
        copy_rates,
        total_vram_bytes: info.total_bytes,
        hbm_bytes_per_s_assumed: bounds::H200_HBM_BYTES_PER_S,
        bf16_flop_per_s_assumed: bounds::H200_BF16_FLOP_PER_S,
    };
    let md = markdown_line(&report);
    println!("{md}");
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &a.markdown {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .with_context(|| format!("opening {}", p.display()))?;
        writeln!(f, "{md}").with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

/// One line naming the geometry, for reports and baseline matching.
pub(super) fn geometry_line(g: &krasis_model::Geometry) -> String {
    format!(
        "{} layers ({} MoE), hidden {}, {} experts top-{} x {}, {}q/{}kv heads x {}, vocab {}",
        g.num_layers,
        g.num_moe_layers(),
        g.hidden,
        g.num_experts,
        g.top_k,
        g.expert_intermediate,
        g.num_heads,
        g.num_kv_heads,
        g.head_dim,
        g.vocab_size
    )
}

pub(super) fn model_name(dir: &std::path::Path) -> String {
    let synth = std::fs::read_to_string(dir.join("krasis_synth.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| {
            v.get("preset")
                .and_then(|p| p.as_str())
                .map(|p| format!("synth:{p}"))
        });
    synth.unwrap_or_else(|| {
        dir.file_name().map_or_else(
            || dir.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        )
    })
}

/// A streamed prefill of `p` tokens whose expert copies take `copy_s`:
/// its upper bound in tok/s, 1 / max(copy, all-resident time) per prompt
/// (the copies alone without the all-resident rate), and with that rate
/// the serial figure, copies then compute, which overlap beats.
fn streamed_prefill_bounds(
    p: usize,
    copy_s: f64,
    resident_tok_s: Option<f64>,
) -> (f64, Option<f64>) {
    let compute_s = resident_tok_s.map(|r| p as f64 / r);
    let bound = p as f64 / copy_s.max(compute_s.unwrap_or(0.0)).max(1e-12);
    (bound, compute_s.map(|c| p as f64 / (copy_s + c).max(1e-12)))
}

fn markdown_line(r: &Report) -> String {
    // Each figure is `median (min, max)`; fractions of bounds use the
    // median. Entries are separated by `; ` since the numbers carry commas.
    let pf: Vec<String> = r
        .prefill
        .iter()
        .map(|p| match &p.constrained {
            // Under a limit the bound that matters is the copies overlapping
            // the all-resident compute, not the FLOP rate.
            Some(c) => format!(
                "{}: {} ({:.0}% of HCS bound)",
                p.prompt_tokens,
                p.stats.display(0),
                100.0 * c.fraction
            ),
            None => format!(
                "{}: {} ({:.0}% of bound)",
                p.prompt_tokens,
                p.stats.display(0),
                100.0 * p.fraction_of_bound
            ),
        })
        .collect();
    let dc: Vec<String> = r
        .decode
        .iter()
        .filter(|d| d.cuda_graphs)
        .map(|d| match &d.constrained {
            Some(c) => format!(
                "{}{}: {} ({:.0}% of HCS bound)",
                d.decode_tokens,
                d.hcs_prefetch
                    .map_or(String::new(), |p| format!(" prefetch {p}")),
                d.stats.display(1),
                100.0 * c.fraction
            ),
            None => format!(
                "{}: {} ({:.0}%)",
                d.decode_tokens,
                d.stats.display(1),
                100.0 * d.fraction_of_bound
            ),
        })
        .collect();
    let eager: Vec<String> = r
        .decode
        .iter()
        .filter(|d| !d.cuda_graphs)
        .map(|d| format!("{}: {}", d.decode_tokens, d.stats.display(1)))
        .collect();
    let memory = match (&r.hcs_load, r.vram_limit_bytes) {
        (Some(h), Some(l)) if h.shape.is_some() => {
            let hit: Vec<String> = r
                .decode
                .iter()
                .filter_map(|d| d.constrained.as_ref())
                .map(|c| format!("{:.3}", c.hcs.hit_rate))
                .collect();
            format!(
                "VRAM limit {:.0} GiB, HCS {}/{} experts ({:.1}%), decode hit rate {}",
                l as f64 / (1u64 << 30) as f64,
                h.experts_on_gpu,
                h.total_experts,
                100.0 * h.experts_on_gpu as f64 / h.total_experts.max(1) as f64,
                hit.join("/")
            )
        }
        _ => "all experts resident".into(),
    };
    format!(
        "| {} | {} | {} | {memory} | prefill tok/s {} | decode tok/s (graphs) {} | decode tok/s (no graphs) {} | min free VRAM {:.2} GiB | commit {} |",
        r.identity.model,
        r.identity.gpu,
        r.identity.geometry,
        pf.join("; "),
        dc.join("; "),
        eager.join("; "),
        r.min_free_vram_bytes.unwrap_or(0) as f64 / (1u64 << 30) as f64,
        r.identity.commit
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> Report {
        let identity = Identity {
            model: "a3b-24l".into(),
            model_dir: "/tmp/a3b-24l".into(),
            geometry: "24 layers".into(),
            cache_format_version: 1,
            cache_path: None,
            gpu: "NVIDIA H200".into(),
            driver_version: 13000,
            commit: "c0ffee".into(),
            prefill_chunk: 8192,
            prefill_kernels: "attention mma.sync".into(),
            context_length: 32016,
            load_seconds: 1.0,
            weight_bytes: 0,
            host_weight_bytes: 0,
            expert_bytes: 0,
            kv_bytes: 0,
        };
        let stats = RunStats::new(30000.0, vec![51900.0, 53100.0, 52725.0]);
        let prefill = PrefillResult {
            prompt_tokens: 8000,
            text_repeated: false,
            tok_s: stats.median_tok_s,
            fraction_of_bound: stats.median_tok_s / 100000.0,
            stats,
            bound: Bound {
                per_token: 1.0,
                max_tok_s: 100000.0,
            },
            constrained: None,
            breakdown_ms: None,
        };
        let decode = |graphs, runs: Vec<f64>| {
            let stats = RunStats::new(500.0, runs);
            DecodeResult {
                decode_tokens: 50,
                prompt_tokens: 32,
                cuda_graphs: graphs,
                hcs_prefetch: None,
                temperature: 0.0,
                tok_s: stats.median_tok_s,
                fraction_of_bound: stats.median_tok_s / 2000.0,
                stats,
                bound: Bound {
                    per_token: 1.0,
                    max_tok_s: 2000.0,
                },
                constrained: None,
            }
        };
        Report {
            identity,
            prefill: vec![prefill],
            decode: vec![
                decode(true, vec![600.0, 598.0, 601.0]),
                decode(false, vec![550.0, 548.0, 552.0, 551.0]),
            ],
            decode_breakdown_ms: Default::default(),
            batched: Vec::new(),
            grammar: Vec::new(),
            min_free_vram_bytes: None,
            free_after_stage_bytes: Vec::new(),
            vram_limit_bytes: None,
            safety_margin_bytes: 0,
            min_free_at_least_margin: true,
            hcs_load: None,
            baseline: None,
            copy_rates: None,
            total_vram_bytes: 0,
            hbm_bytes_per_s_assumed: 0.0,
            bf16_flop_per_s_assumed: 0.0,
        }
    }

    #[test]
    fn markdown_shows_min_median_max_and_fractions_of_the_median() {
        let md = markdown_line(&report());
        assert!(
            md.contains("prefill tok/s 8000: 52,725 (min 51,900, max 53,100) (53% of bound)"),
            "{md}"
        );
        assert!(
            md.contains("decode tok/s (graphs) 50: 600.0 (min 598.0, max 601.0) (30%)"),
            "{md}"
        );
        // Even count: the median is the mean of the middle two.
        assert!(
            md.contains("decode tok/s (no graphs) 50: 550.5 (min 548.0, max 552.0)"),
            "{md}"
        );
    }

    #[test]
    fn json_keeps_tok_s_as_the_median_beside_every_run_and_the_warm_up() {
        let v = serde_json::to_value(report()).unwrap();
        let p = &v["prefill"][0];
        assert_eq!(p["tok_s"], 52725.0);
        assert_eq!(p["median_tok_s"], 52725.0);
        assert_eq!(p["min_tok_s"], 51900.0);
        assert_eq!(p["max_tok_s"], 53100.0);
        assert_eq!(p["warmup_tok_s"], 30000.0);
        assert_eq!(
            p["runs_tok_s"],
            serde_json::json!([51900.0, 53100.0, 52725.0])
        );
        assert_eq!(v["decode"][1]["tok_s"], 550.5);
    }

    /// The a3b-24l 6 GiB row of 2026-12-01 (8,000 tokens, 5.48 GB streamed
    /// in 0.099 s, 52,527 tok/s all resident, 35,711 measured): the old
    /// "bound" was copies + compute (31,861 tok/s), which the measurement
    /// beat (112%); the bound is the overlapped one, 52,527 (68%).
    #[test]
    fn a_streamed_prefill_bound_is_never_beaten_by_overlap() {
        let (p, copy) = (8000, 0.099);
        let (bound, serial) = streamed_prefill_bounds(p, copy, Some(52527.0));
        assert!((bound - 52527.0).abs() < 1.0, "{bound}");
        let serial = serial.unwrap();
        assert!((serial - 31861.0).abs() < 50.0, "{serial}");
        assert!(35711.0 / bound < 1.0 && 35711.0 / serial > 1.0);
        // Copy-bound: the copies alone decide.
        let (b, _) = streamed_prefill_bounds(p, 0.5, Some(52527.0));
        assert!((b - 16000.0).abs() < 1e-6, "{b}");
        // No baseline: the copies alone, and no serial figure.
        let (b, s) = streamed_prefill_bounds(p, copy, None);
        assert!((b - p as f64 / copy).abs() < 1e-6 && s.is_none());
    }
}
