//! `bench --check`: the CUDA engine against the transformers witness
//! fixtures and the CPU reference engine over the same INT4 cache, decode
//! against prefill, graphs against no graphs, and greedy determinism across
//! fresh processes. Exits non-zero when any check fails.

use super::{Args, text_tokens};
use anyhow::Context;
use krasis_gpu::check::{
    Comparator, LogitReport, compare_full, compare_witness, load_witness, top_ids,
};
use krasis_gpu::{CudaEngine, CudaEngineOptions};
use krasis_model::reference::{ReferenceEngine, ReferenceOptions};
use krasis_model::{Engine, GenerateRequest, SamplingParams};
use std::ops::ControlFlow;
use std::sync::Arc;

/// Logit error bound against the f32 transformers witness, relative to the
/// largest |logit| of the sequence: BF16 activations and GEMM inputs (8-bit
/// mantissa, ~0.4% per rounding) through every layer.
const WITNESS_REL_BOUND: f32 = 0.03;
/// Same against the f32 CPU reference over the identical INT4 experts (only
/// activation rounding differs).
const REFERENCE_REL_BOUND: f32 = 0.03;

fn engine(a: &Args, context: usize) -> anyhow::Result<CudaEngine> {
    let opts = super::engine_options(a, context)?;
    CudaEngine::load(&a.model, &opts)
        .with_context(|| format!("loading {} on the GPU", a.model.display()))
}

fn greedy(e: &mut dyn Engine, prompt: &[u32], n: usize) -> anyhow::Result<Vec<u32>> {
    let req = GenerateRequest {
        prompt: prompt.to_vec(),
        max_new_tokens: n,
        sampling: SamplingParams::greedy(),
        stop_token_ids: Vec::new(),
        cancel: Default::default(),
    };
    let mut out = Vec::new();
    e.generate(&req, &mut |t| {
        out.push(t);
        ControlFlow::Continue(())
    })
    .context("greedy generation")?;
    Ok(out)
}

fn max_abs(rows: &[Vec<f32>]) -> f32 {
    rows.iter().flatten().fold(0f32, |m, v| m.max(v.abs()))
}

pub fn determinism_child(a: &Args) -> anyhow::Result<()> {
    let (prompt, _) = text_tokens(&a.model, &a.text, 64)?;
    let mut e = engine(a, 64 + a.determinism_tokens + 8)?;
    let toks = greedy(&mut e, &prompt, a.determinism_tokens)?;
    println!("DETERMINISM {}", serde_json::to_string(&toks)?);
    Ok(())
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let mut reports: Vec<LogitReport> = Vec::new();
    let mut other: Vec<(String, bool)> = Vec::new();
    let (long, repeated) = text_tokens(&a.model, &a.text, a.long_tokens)?;
    anyhow::ensure!(
        !repeated,
        "the prompt text has fewer than {} tokens",
        a.long_tokens
    );
    let mut fixtures = Vec::new();
    for dir in &a.witness {
        let (_, seqs) = load_witness(dir)?;
        fixtures.push((dir.clone(), seqs));
    }
    let context = a.long_tokens + 128;
    let mut gpu = engine(a, context)?;

    // 1. Witness fixtures.
    let mut gpu_fixture_logits = Vec::new();
    for (dir, seqs) in &fixtures {
        for (i, w) in seqs.iter().enumerate() {
            let logits = gpu.prompt_logits(&w.tokens)?;
            let scale = w
                .seq
                .top_vals
                .iter()
                .flatten()
                .fold(1f32, |m, v| m.max(v.abs()));
            let mut c = Comparator::new(
                format!("witness {} seq{i}", dir.display()),
                WITNESS_REL_BOUND * scale,
            );
            compare_witness(&mut c, &logits, w);
            reports.push(c.finish());
            gpu_fixture_logits.push((
                format!("{} seq{i}", dir.display()),
                w.tokens.clone(),
                logits,
            ));
        }
    }
    if fixtures.is_empty() {
        eprintln!("NOTE: no --witness fixtures given; the witness comparison did not run");
    }

    // 2. Decode path vs prefill path, graphs vs no graphs.
    let prompt = &long[..48];
    let with_graphs = greedy(&mut gpu, prompt, 64)?;
    gpu.set_cuda_graphs(false);
    let without = greedy(&mut gpu, prompt, 64)?;
    gpu.set_cuda_graphs(true);
    other.push((
        format!(
            "decode with CUDA graphs == without ({} tokens)",
            with_graphs.len()
        ),
        with_graphs == without,
    ));
    let mut seq = prompt.to_vec();
    seq.extend_from_slice(&with_graphs[..with_graphs.len() - 1]);
    let pl = gpu.prompt_logits(&seq)?;
    let mut near_ties = 0;
    let mut real = 0;
    for (j, &tok) in with_graphs.iter().enumerate() {
        let row = &pl[prompt.len() - 1 + j];
        let top = top_ids(row, 2);
        if top[0] != tok {
            let margin = row[top[0] as usize] - row[tok as usize];
            if margin > 0.02 * max_abs(std::slice::from_ref(row)).max(1.0) {
                real += 1;
            } else {
                near_ties += 1;
            }
        }
    }
    other.push((
        format!("greedy decode tokens == prefill argmax (64 tokens; {near_ties} near-ties, {real} real mismatches)"),
        real == 0,
    ));

    // 3. CPU reference over the same INT4 cache.
    let gl = gpu.prompt_logits(&long)?;
    drop(gpu);
    // Chunked prefill (attention across chunk boundaries) against one chunk.
    if a.prefill_chunk < long.len() {
        let mut whole = CudaEngine::load(
            &a.model,
            &CudaEngineOptions {
                prefill_chunk: long.len(),
                ..super::engine_options(a, context)?
            },
        )?;
        let one = whole.prompt_logits(&long)?;
        let bound = REFERENCE_REL_BOUND * max_abs(&one).max(1.0);
        reports.push(compare_full(
            &format!(
                "prefill in chunks of {} vs one chunk ({} tokens)",
                a.prefill_chunk,
                long.len()
            ),
            &gl,
            &one,
            bound,
        ));
    }
    if !a.no_reference {
        let cache = krasis_cache::ensure_cache(&a.model, a.cache_dir.as_deref())
            .context("opening the INT4 cache for the reference engine")?;
        let experts = Arc::new(krasis_cache::Int4Experts::new(Arc::new(cache)));
        let mut reference = ReferenceEngine::with_experts(
            &a.model,
            ReferenceOptions {
                context_length: Some(context),
            },
            experts,
        )
        .context("loading the CPU reference engine")?;
        for (label, tokens, logits) in &gpu_fixture_logits {
            let r = reference.prompt_logits(tokens)?;
            let bound = REFERENCE_REL_BOUND * max_abs(&r).max(1.0);
            reports.push(compare_full(
                &format!("reference {label}"),
                logits,
                &r,
                bound,
            ));
        }
        let t0 = std::time::Instant::now();
        let r = reference.prompt_logits(&long)?;
        eprintln!(
            "reference: {} tokens in {:.1}s",
            long.len(),
            t0.elapsed().as_secs_f64()
        );
        let bound = REFERENCE_REL_BOUND * max_abs(&r).max(1.0);
        reports.push(compare_full(
            &format!("reference long text ({} tokens)", long.len()),
            &gl,
            &r,
            bound,
        ));
    }

    // 4. Determinism across fresh processes.
    if a.determinism_runs > 0 {
        let exe = std::env::current_exe().context("locating this executable")?;
        let mut outs = Vec::new();
        for i in 0..a.determinism_runs {
            let mut cmd = std::process::Command::new(&exe);
            cmd.arg("bench")
                .arg("--model")
                .arg(&a.model)
                .arg("--text")
                .arg(&a.text)
                .arg("--determinism-child")
                .arg("--determinism-tokens")
                .arg(a.determinism_tokens.to_string());
            if let Some(c) = &a.cache_dir {
                cmd.arg("--cache-dir").arg(c);
            }
            let out = cmd
                .output()
                .with_context(|| format!("starting determinism run {i}"))?;
            let stdout = String::from_utf8_lossy(&out.stdout);
            let line = stdout
                .lines()
                .find_map(|l| l.strip_prefix("DETERMINISM "))
                .with_context(|| {
                    format!(
                        "determinism run {i} printed no tokens (exit {}): {}",
                        out.status,
                        String::from_utf8_lossy(&out.stderr)
                    )
                })?;
            let toks: Vec<u32> = serde_json::from_str(line)?;
            outs.push(toks);
        }
        let same = outs.windows(2).all(|w| w[0] == w[1]) && outs[0].len() == a.determinism_tokens;
        other.push((
            format!(
                "greedy {} tokens identical across {} fresh processes",
                a.determinism_tokens, a.determinism_runs
            ),
            same,
        ));
    }

    let mut failed = 0;
    for r in &reports {
        println!("CHECK {}", r.line());
        failed += usize::from(!r.passed());
    }
    for (what, ok) in &other {
        println!("CHECK {what}: {}", if *ok { "PASS" } else { "FAIL" });
        failed += usize::from(!ok);
    }
    if let Some(p) = &a.json {
        let j = serde_json::json!({ "logits": reports, "other": other.iter().map(|(w, ok)| serde_json::json!({"check": w, "passed": ok})).collect::<Vec<_>>() });
        std::fs::write(p, serde_json::to_string_pretty(&j)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    anyhow::ensure!(failed == 0, "{failed} check(s) failed");
    println!("all checks passed");
    Ok(())
}
