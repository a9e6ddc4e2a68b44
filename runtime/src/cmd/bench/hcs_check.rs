//! `bench --hcs-exactness LIMITS`: with the same INT4 cache, the HCS engine
//! at each VRAM limit (streamed prefill, demand-copied experts) must give
//! bit-identical prompt logits, greedy tokens and decode logits to the
//! all-resident engine. Exits non-zero on any difference.

use super::{Args, engine_options, text_tokens};
use anyhow::Context;
use krasis_gpu::CudaEngine;
use krasis_model::Engine;

struct Run {
    prompt_logits: Vec<Vec<f32>>,
    /// Under a limit: the prompt streamed one prefill chunk per span (the
    /// path a prompt whose hidden states do not fit falls back to).
    span_logits: Option<Vec<Vec<f32>>>,
    tokens: Vec<u32>,
    decode_logits: Vec<Vec<f32>>,
}

fn run_once(
    a: &Args,
    limit: Option<u64>,
    prompt: &[u32],
    short: usize,
    n: usize,
) -> anyhow::Result<(Run, String)> {
    let mut opts = engine_options(a, prompt.len() + n + 16)?;
    opts.vram_limit = limit;
    if limit.is_none() {
        opts.hcs = false;
    }
    let mut e = CudaEngine::load(&a.model, &opts)
        .with_context(|| format!("loading {} (VRAM limit {limit:?})", a.model.display()))?;
    let prompt_logits = e.prompt_logits(prompt)?;
    let (tokens, decode_logits) = e.greedy_logits(&prompt[..short], n)?;
    let span_logits = if e.hcs_active() {
        e.set_prefill_span(Some(e.load_report().prefill_chunk));
        let l = e.prompt_logits(prompt)?;
        e.set_prefill_span(None);
        Some(l)
    } else {
        None
    };
    let desc = match e.hcs_stats() {
        Some(h) => format!(
            "{}/{} experts on the GPU, hit rate {:.3}, {:.1} cold experts over PCIe per step, prefill streamed {:.2} GB",
            h.resident_experts,
            h.total_experts,
            h.hit_rate,
            h.cold_experts_per_token,
            h.prefill_stream_bytes as f64 / 1e9
        ),
        None => "all experts resident".into(),
    };
    Ok((
        Run {
            prompt_logits,
            span_logits,
            tokens,
            decode_logits,
        },
        desc,
    ))
}

fn bits(rows: &[Vec<f32>]) -> Vec<u32> {
    rows.iter().flatten().map(|v| v.to_bits()).collect()
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    anyhow::ensure!(
        !a.hcs_exactness.is_empty(),
        "--hcs-exactness needs at least one VRAM limit"
    );
    let (prompt, _) = text_tokens(&a.model, &a.text, a.long_tokens)?;
    let short = 256.min(prompt.len());
    let n = 64;
    let (base, desc) = run_once(a, None, &prompt, short, n)?;
    eprintln!("baseline: {desc}");
    let mut failed = 0;
    let mut results = Vec::new();
    for s in &a.hcs_exactness {
        let limit = crate::cmd::engines::parse_vram_limit(s).map_err(anyhow::Error::msg)?;
        let (r, desc) = run_once(a, Some(limit), &prompt, short, n)?;
        let mut checks = vec![
            (
                format!("prompt logits of {} tokens bit-identical", prompt.len()),
                bits(&r.prompt_logits) == bits(&base.prompt_logits),
            ),
            (
                format!("greedy {n} tokens identical"),
                r.tokens == base.tokens,
            ),
            (
                format!("decode logits of {n} steps bit-identical"),
                bits(&r.decode_logits) == bits(&base.decode_logits),
            ),
        ];
        if let Some(l) = &r.span_logits {
            checks.push((
                "prompt logits with the prompt streamed one chunk per span bit-identical".into(),
                bits(l) == bits(&base.prompt_logits),
            ));
        }
        for (what, ok) in checks {
            println!(
                "CHECK HCS at {s} ({desc}): {what}: {}",
                if ok { "PASS" } else { "FAIL" }
            );
            failed += usize::from(!ok);
            results
                .push(serde_json::json!({"limit": s, "state": desc, "check": what, "passed": ok}));
        }
    }
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_string_pretty(&results)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    anyhow::ensure!(failed == 0, "{failed} HCS exactness check(s) failed");
    println!("all HCS exactness checks passed");
    Ok(())
}
