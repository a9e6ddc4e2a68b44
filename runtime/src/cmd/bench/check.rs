//! `bench --check`: the CUDA engine against the transformers witness
//! fixtures and the CPU reference engine over the same expert cache, greedy
//! decode and chunked prefill against the reference too, chunked against
//! whole prefill, graphs against no graphs, and greedy determinism across
//! fresh processes. Exits non-zero when any check fails.
//!
//! The logit comparisons use the criterion of `krasis_gpu::check::followed`
//! (see its module docs): the oracle is the f32 CPU reference that takes the
//! GPU's expert set at exactly the routing decisions where its own router
//! gap is a near-tie (`max(0.01, 1% of the k-th logit, s)`, `s` the largest
//! gap movement of the reference's BF16 emulation before its first flip).
//! Both then run the same experts everywhere, so every position must be
//! within 1% of the sequence's max |logit|; followed decisions at most 2% of
//! the routing decisions; argmax agreement at least 98% (ties within the
//! bound agree). Against the witness, a position over the bound is
//! explained only where the following reference agrees with the GPU. The
//! GPU's routes are recorded by `CudaEngine::prompt_logits_with_routes` /
//! `greedy_logits_with_routes`.
//!
//! Chunked vs whole prefill are two BF16 paths of the same engine, compared
//! with `check::fidelity`'s engine-paths rule (they agree bit for bit in
//! practice). With `--no-reference`, greedy decode is compared with prefill
//! of the same tokens that way too, and nothing over the bound against a
//! witness is explained. Graphs vs no graphs and determinism are bit-exact
//! token comparisons.

use super::{Args, text_tokens};
use anyhow::Context;
use krasis_gpu::CudaEngine;
use krasis_gpu::check::{
    BOUND_FRACTION, Evidence, FidelityReport, Following, MAX_FLIP_PERCENT, MIN_ARGMAX_PERCENT,
    NEAR_TIE_ABS, NEAR_TIE_REL, Routes, Traced, WitnessSequence, classify_followed_full,
    classify_followed_witness, classify_full, classify_witness, load_witness, pooled,
    pre_flip_spread, routes_window,
};
use krasis_model::reference::{ReferenceEngine, ReferenceOptions};
use krasis_model::{Engine, GenerateRequest, SamplingParams};
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Instant;

/// Prompt tokens before the greedy decode checks.
const DECODE_PROMPT: usize = 48;
/// Greedy tokens of the decode checks: enough positions for the 2% flip
/// rate to mean something (at 128, one flip more is 0.8%).
const DECODE_TOKENS: usize = 512;

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
        live: Default::default(),
        cache_prompt: false,
        constraint: None,
    };
    let mut out = Vec::new();
    e.generate(&req, &mut |t| {
        out.push(t);
        ControlFlow::Continue(())
    })
    .context("greedy generation")?;
    Ok(out)
}

pub fn determinism_child(a: &Args) -> anyhow::Result<()> {
    let (prompt, _) = text_tokens(&a.model, &a.text, 64)?;
    let mut e = engine(a, 64 + a.determinism_tokens + 8)?;
    let toks = greedy(&mut e, &prompt, a.determinism_tokens)?;
    println!("DETERMINISM {}", serde_json::to_string(&toks)?);
    Ok(())
}

/// The GPU's greedy decode: the whole token sequence (prompt and fed-back
/// tokens), its logits rows (positions `window`), and its routes over every
/// position (the prompt's from prefill).
struct DecodeRun {
    seq: Vec<u32>,
    rows: Vec<Vec<f32>>,
    routes: Routes,
    window: std::ops::Range<usize>,
}

/// The GPU's run of one witness sequence.
struct FixtureRun {
    label: String,
    witness: WitnessSequence,
    logits: Vec<Vec<f32>>,
    routes: Routes,
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let mut reports: Vec<FidelityReport> = Vec::new();
    let mut other: Vec<(String, bool)> = Vec::new();
    anyhow::ensure!(
        a.long_tokens >= DECODE_PROMPT,
        "--long-tokens must be at least {DECODE_PROMPT} (the decode checks' prompt)"
    );
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
    let context = a.long_tokens.max(DECODE_PROMPT + DECODE_TOKENS) + 128;
    let mut gpu = engine(a, context)?;
    let moe_layers: Vec<usize> = gpu.geometry().moe_layers().collect();

    // 1. The witness sequences on the GPU, routes recorded (compared below,
    //    once the reference has traced them).
    let mut runs = Vec::new();
    for (dir, seqs) in fixtures {
        for (i, w) in seqs.into_iter().enumerate() {
            let (logits, routes) = gpu.prompt_logits_with_routes(&w.tokens)?;
            runs.push(FixtureRun {
                label: format!("{} seq{i}", dir.display()),
                witness: w,
                logits,
                routes,
            });
        }
    }
    if runs.is_empty() {
        eprintln!("NOTE: no --witness fixtures given; the witness comparison did not run");
    }

    // 2. Decode: graphs vs no graphs (bit-exact), recording routes changes
    //    nothing, and greedy decode vs prefill of the same tokens.
    let prompt = &long[..DECODE_PROMPT];
    let n = DECODE_TOKENS;
    let with_graphs = greedy(&mut gpu, prompt, n)?;
    gpu.set_cuda_graphs(false);
    let without = greedy(&mut gpu, prompt, n)?;
    other.push((
        format!(
            "decode with CUDA graphs == without ({} tokens)",
            with_graphs.len()
        ),
        with_graphs == without,
    ));
    let (dec_toks, dec_rows, dec_routes) = gpu.greedy_logits_with_routes(prompt, n)?;
    gpu.set_cuda_graphs(true);
    other.push((
        format!("decode recording its routes == without ({n} tokens)"),
        dec_toks == without,
    ));
    let mut seq = prompt.to_vec();
    seq.extend_from_slice(&dec_toks[..n - 1]);
    // Row j of the decode run is the logits of position DECODE_PROMPT - 1 + j.
    let window = DECODE_PROMPT - 1..DECODE_PROMPT - 1 + n;
    let decode = DecodeRun {
        seq,
        rows: dec_rows,
        routes: dec_routes,
        window,
    };
    if a.no_reference {
        // Without the reference, decode is held to the prefill path of the
        // same tokens (two BF16 paths; the older, guessing classification).
        let (pl, pl_routes) = gpu.prompt_logits_with_routes(&decode.seq)?;
        let w = decode.window.clone();
        let (oracle_routes, engine_routes) = (
            routes_window(&pl_routes, w.clone()),
            routes_window(&decode.routes, w.clone()),
        );
        reports.push(classify_full(
            &format!("greedy decode vs prefill argmax/logits ({n} positions)"),
            &decode.rows,
            &pl[w],
            &moe_layers,
            Evidence::EnginePaths {
                oracle: &oracle_routes,
                engine: &engine_routes,
            },
        ));
    }

    // 3. The long text on the GPU; chunked prefill (attention across chunk
    //    boundaries) against one chunk.
    let (gl, gl_routes) = gpu.prompt_logits_with_routes(&long)?;
    drop(gpu);
    if a.prefill_chunk < long.len() {
        let mut whole = CudaEngine::load(
            &a.model,
            &krasis_gpu::CudaEngineOptions {
                prefill_chunk: long.len(),
                ..super::engine_options(a, context)?
            },
        )?;
        let (one, one_routes) = whole.prompt_logits_with_routes(&long)?;
        drop(whole);
        reports.push(classify_full(
            &format!(
                "prefill in chunks of {} vs one chunk ({} tokens)",
                a.prefill_chunk,
                long.len()
            ),
            &gl,
            &one,
            &moe_layers,
            Evidence::EnginePaths {
                oracle: &one_routes,
                engine: &gl_routes,
            },
        ));
    }

    // 4. The oracles: witness fixtures and the f32 CPU reference, with the
    //    reference's routes in f32 and in its BF16 emulation.
    let mut reference_reports = Vec::new();
    if a.no_reference {
        if !runs.is_empty() {
            eprintln!(
                "NOTE: --no-reference: no routes to explain flips with; every witness position \
                 over the bound counts as unexplained"
            );
        }
        for run in &runs {
            reports.push(classify_witness(
                &format!("witness {}", run.label),
                &run.logits,
                &run.witness,
                &moe_layers,
                Evidence::None,
            ));
        }
    } else {
        let cache = krasis_cache::ensure_cache(&a.model, a.cache_dir.as_deref())
            .context("opening the INT4 cache for the reference engine")?;
        let experts = Arc::new(krasis_cache::CacheExperts::new(Arc::new(cache)));
        let mut reference = ReferenceEngine::with_experts(
            &a.model,
            ReferenceOptions {
                context_length: Some(context),
            },
            experts,
        )
        .context("loading the CPU reference engine")?;
        // The near-tie width's measured part: how far the BF16 emulation
        // moves router gaps before its first flip, on the long text.
        let t0 = Instant::now();
        let traced = Traced::new(&mut reference, &long, &moe_layers)?;
        let spread = pre_flip_spread(&traced.f32_routes, &traced.bf16_routes);
        drop(traced);
        let follow = |r: &mut ReferenceEngine, tokens: &[u32], routes: &Routes| {
            Following::new(r, tokens, &moe_layers, routes, spread)
        };
        let (mut witness, mut fixture_ref) = (Vec::new(), Vec::new());
        for run in &runs {
            let f = follow(&mut reference, &run.witness.tokens, &run.routes)?;
            witness.push(classify_followed_witness(
                &format!("witness {}", run.label),
                &run.logits,
                &run.routes,
                &run.witness,
                &f,
                &moe_layers,
            ));
            fixture_ref.push(classify_followed_full(
                &format!("reference {}", run.label),
                &run.logits,
                &run.routes,
                &f,
                &moe_layers,
            ));
        }
        // The fixtures' sequences are 31-64 positions long: the rate rules
        // are judged over all of them together.
        for (what, mut group, into) in [
            ("witness", witness, &mut reports),
            ("reference", fixture_ref, &mut reference_reports),
        ] {
            if group.is_empty() {
                continue;
            }
            let g = pooled(
                &format!("{what}: all {} fixture sequences pooled", group.len()),
                &mut group,
            );
            into.extend(group);
            into.push(g);
        }
        let f = follow(&mut reference, &long, &gl_routes)?;
        reference_reports.push(classify_followed_full(
            &format!("reference long text ({} tokens)", long.len()),
            &gl,
            &gl_routes,
            &f,
            &moe_layers,
        ));
        let f = follow(&mut reference, &decode.seq, &decode.routes)?.window(decode.window.clone());
        reference_reports.push(classify_followed_full(
            &format!(
                "reference: greedy decode ({n} positions after a {DECODE_PROMPT}-token prompt)"
            ),
            &decode.rows,
            &routes_window(&decode.routes, decode.window.clone()),
            &f,
            &moe_layers,
        ));
        eprintln!(
            "reference (f32, BF16 emulation, and following the GPU's near-tie choices): {:.1}s",
            t0.elapsed().as_secs_f64()
        );
    }
    reports.extend(reference_reports);

    // 5. Determinism across fresh processes.
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
        let j = serde_json::json!({
            "criterion": {
                "bound_fraction_of_max_abs_oracle_logit": BOUND_FRACTION,
                "oracle": "the f32 CPU reference taking the GPU's expert set at exactly the routing decisions where its own router gap is a near-tie",
                "near_tie_gap_below": format!("max({NEAR_TIE_ABS}, {NEAR_TIE_REL} * |k-th router logit|, the BF16 emulation's largest |gap movement| before its first flip)"),
                "max_followed_decision_percent": MAX_FLIP_PERCENT,
                "min_argmax_agreement_percent": MIN_ARGMAX_PERCENT,
            },
            "logits": reports,
            "other": other.iter().map(|(w, ok)| serde_json::json!({"check": w, "passed": ok})).collect::<Vec<_>>(),
        });
        std::fs::write(p, serde_json::to_string_pretty(&j)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    anyhow::ensure!(failed == 0, "{failed} check(s) failed");
    println!("all checks passed");
    Ok(())
}
