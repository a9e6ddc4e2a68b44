//! Speed measurement: prefill tok/s per prompt length, decode tok/s per
//! decode length with and without the decode CUDA graph, min free VRAM
//! (monitor thread), each beside its physical bound.

use super::{Args, text_tokens};
use anyhow::Context;
use krasis_gpu::bounds::{self, Bound};
use krasis_gpu::monitor::VramMonitor;
use krasis_gpu::{CudaEngine, CudaEngineOptions};
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
    context_length: usize,
    load_seconds: f64,
    weight_bytes: usize,
    expert_bytes: usize,
    kv_bytes: usize,
}

#[derive(Debug, Serialize)]
struct PrefillResult {
    prompt_tokens: usize,
    text_repeated: bool,
    tok_s: f64,
    runs_tok_s: Vec<f64>,
    bound: Bound,
    fraction_of_bound: f64,
}

#[derive(Debug, Serialize)]
struct DecodeResult {
    decode_tokens: usize,
    prompt_tokens: usize,
    cuda_graphs: bool,
    tok_s: f64,
    runs_tok_s: Vec<f64>,
    bound: Bound,
    fraction_of_bound: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    identity: Identity,
    prefill: Vec<PrefillResult>,
    decode: Vec<DecodeResult>,
    decode_breakdown_ms: krasis_gpu::profile::DecodeBreakdown,
    min_free_vram_bytes: Option<u64>,
    total_vram_bytes: usize,
    hbm_bytes_per_s_assumed: f64,
    bf16_flop_per_s_assumed: f64,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

fn greedy(engine: &mut CudaEngine, prompt: &[u32], new: usize) -> anyhow::Result<GenerateStats> {
    let req = GenerateRequest {
        prompt: prompt.to_vec(),
        max_new_tokens: new,
        sampling: SamplingParams::greedy(),
        stop_token_ids: Vec::new(),
    };
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

pub fn run(a: &Args) -> anyhow::Result<()> {
    anyhow::ensure!(a.repeats >= 1, "--repeats must be at least 1");
    let max_prompt = a.prompt_tokens.iter().copied().max().unwrap_or(0);
    let max_decode = a.decode_tokens.iter().copied().max().unwrap_or(0);
    let context = a
        .context_length
        .unwrap_or(max_prompt.max(a.decode_prompt_tokens + max_decode) + 16);
    let opts = CudaEngineOptions {
        context_length: Some(context),
        prefill_chunk: a.prefill_chunk,
        cache_root: a.cache_dir.clone(),
        ..CudaEngineOptions::default()
    };
    let mut engine = CudaEngine::load(&a.model, &opts)
        .with_context(|| format!("loading {} on the GPU", a.model.display()))?;
    let monitor = VramMonitor::start(engine.gpu().ctx.clone(), Duration::from_millis(2));
    let g = engine.geometry().clone();
    let lr = engine.load_report().clone();
    let info = engine.gpu().info.clone();
    let expert_bytes = krasis_cache::ExpertLayout::new(g.hidden, g.expert_intermediate)
        .map_or(0, |l| l.used_bytes);
    let (all, repeated_all) = text_tokens(
        &a.model,
        &a.text,
        max_prompt.max(a.decode_prompt_tokens).max(64),
    )?;

    // Warm-up: module loads, cuBLAS heuristics, graph capture.
    greedy(&mut engine, &all[..64.min(all.len())], 8)?;

    let mut prefill = Vec::new();
    for &p in &a.prompt_tokens {
        let mut runs = Vec::new();
        for _ in 0..a.repeats {
            let s = greedy(&mut engine, &all[..p], 1)?;
            runs.push(s.prefill_tok_s());
        }
        let tok_s = median(&mut runs.clone());
        let bound = bounds::prefill_bound(&g, p);
        eprintln!(
            "prefill {p:>6} tokens: {tok_s:>10.0} tok/s (bound {:.0} tok/s at {:.0} TFLOP/s)",
            bound.max_tok_s,
            bounds::H200_BF16_FLOP_PER_S / 1e12
        );
        prefill.push(PrefillResult {
            prompt_tokens: p,
            text_repeated: repeated_all && p > all.len(),
            tok_s,
            fraction_of_bound: tok_s / bound.max_tok_s,
            runs_tok_s: runs,
            bound,
        });
    }

    let prompt = &all[..a.decode_prompt_tokens];
    let mut decode = Vec::new();
    for graphs in [true, false] {
        engine.set_cuda_graphs(graphs);
        for &d in &a.decode_tokens {
            let mut runs = Vec::new();
            for _ in 0..a.repeats {
                // +1: the first token comes from prefill and is not timed as decode.
                let s = greedy(&mut engine, prompt, d + 1)?;
                runs.push(s.decode_tok_s());
            }
            let tok_s = median(&mut runs.clone());
            let ctx = a.decode_prompt_tokens + d / 2;
            let bound = bounds::decode_bound(&g, expert_bytes, ctx);
            eprintln!(
                "decode {d:>4} tokens (graphs {}): {tok_s:>8.1} tok/s (bound {:.0} tok/s: {:.2} GB/token at {:.1} TB/s)",
                if graphs { "on " } else { "off" },
                bound.max_tok_s,
                bound.per_token / 1e9,
                bounds::H200_HBM_BYTES_PER_S / 1e12
            );
            decode.push(DecodeResult {
                decode_tokens: d,
                prompt_tokens: a.decode_prompt_tokens,
                cuda_graphs: graphs,
                tok_s,
                fraction_of_bound: tok_s / bound.max_tok_s,
                runs_tok_s: runs,
                bound,
            });
        }
    }
    engine.set_cuda_graphs(true);
    let breakdown = engine
        .decode_breakdown(a.decode_prompt_tokens, 20)
        .context("timing the parts of a decode step")?;
    eprintln!(
        "decode step parts (ms): layers {:.3} (per layer: attention {:.4}, router {:.4}, experts {:.4}), LM head {:.3}, sample {:.3}",
        breakdown.layers_ms,
        breakdown.attention_layer_ms,
        breakdown.router_layer_ms,
        breakdown.experts_layer_ms,
        breakdown.lm_head_ms,
        breakdown.sample_ms
    );
    let min_free = monitor.min_free();
    drop(monitor);

    let model_name = model_name(&a.model);
    let report = Report {
        identity: Identity {
            model: model_name.clone(),
            model_dir: a.model.display().to_string(),
            geometry: format!(
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
            ),
            cache_format_version: lr.cache_format_version,
            cache_path: lr.cache_path.as_ref().map(|p| p.display().to_string()),
            gpu: info.name.clone(),
            driver_version: info.driver_version,
            commit: a.commit.clone().unwrap_or_else(|| "unknown".into()),
            prefill_chunk: lr.prefill_chunk,
            context_length: lr.context_length,
            load_seconds: lr.load_seconds,
            weight_bytes: lr.weight_bytes,
            expert_bytes: lr.expert_bytes,
            kv_bytes: lr.kv_bytes,
        },
        prefill,
        decode,
        decode_breakdown_ms: breakdown,
        min_free_vram_bytes: min_free,
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

fn model_name(dir: &std::path::Path) -> String {
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

fn markdown_line(r: &Report) -> String {
    let pf: Vec<String> = r
        .prefill
        .iter()
        .map(|p| {
            format!(
                "{}: {:.0} ({:.0}% of bound)",
                p.prompt_tokens,
                p.tok_s,
                100.0 * p.fraction_of_bound
            )
        })
        .collect();
    let dc: Vec<String> = r
        .decode
        .iter()
        .filter(|d| d.cuda_graphs)
        .map(|d| {
            format!(
                "{}: {:.1} ({:.0}%)",
                d.decode_tokens,
                d.tok_s,
                100.0 * d.fraction_of_bound
            )
        })
        .collect();
    let eager: Vec<String> = r
        .decode
        .iter()
        .filter(|d| !d.cuda_graphs)
        .map(|d| format!("{}: {:.1}", d.decode_tokens, d.tok_s))
        .collect();
    format!(
        "| {} | {} | {} | prefill tok/s {} | decode tok/s (graphs) {} | decode tok/s (no graphs) {} | min free VRAM {:.1} GiB | commit {} |",
        r.identity.model,
        r.identity.gpu,
        r.identity.geometry,
        pf.join(", "),
        dc.join(", "),
        eager.join(", "),
        r.min_free_vram_bytes.unwrap_or(0) as f64 / (1u64 << 30) as f64,
        r.identity.commit
    )
}
