//! How many of the GPU's router flips does the CPU reference's emulation
//! of the CUDA engine's BF16 rounding (`Activations::Bf16`) reproduce?
//!
//! Reads the JSON report of `krasis-runtime bench --check --json` (one or
//! more files), and for every comparison against the f32 reference (labels
//! `witness …/<case>/int4 seqN`, `reference …/<case>/int4 seqN`,
//! `reference long text (N tokens)`) reruns the reference over the same
//! tokens twice, traced: in f32 and in the current BF16 emulation. For each
//! MoE layer listed under an over-bound position it compares the expert sets
//! (as sets): f32 trace vs the report's `oracle_experts` (a sanity check),
//! the report's `emulation_experts` (the emulation when the report was made,
//! "before") and the new emulation's ("after") vs the GPU's `engine_experts`.
//!
//! ```text
//! cargo run --release -p krasis-model --example emulation_vs_gpu_routes -- \
//!     [--preset tiny|tiny-dense] REPORT.json [REPORT.json ...]
//! ```
//!
//! The preset defaults to the fixture case in the labels (`tiny-hd64` →
//! `tiny`), else to `tiny-dense` when the file name contains it, else `tiny`.
//! The checkpoint is `krasis-runtime synth --preset P --seed 1 --dtype bf16
//! --set head_dim=64` (written once under `target/krasis-testdata/`, shared
//! with the `bf16_conditioning` example), the routed experts the INT4
//! cache's round trip (`--variant int4`), the long text the first N tokens
//! of `assets/text/kjv-genesis-exodus.txt`. Needs the Qwen vocabulary
//! (`bash tools/vocab.sh`).

use krasis_model::reference::{
    Activations, CheckpointExperts, ReferenceEngine, ReferenceOptions, Trace,
};
use krasis_model::tokenizer::Tokenizer;
use krasis_model::{Checkpoint, ModelConfig};
use serde_json::Value;
use shared::{Int4RoundTrip, checkpoint};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

mod shared;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The tokens a comparison ran over, or `None` for engine-vs-engine ones.
fn tokens_of(label: &str, dir: &Path) -> Option<(String, Vec<u32>)> {
    if let Some(rest) = label.strip_prefix("reference long text (") {
        let n: usize = rest.split_whitespace().next()?.parse().ok()?;
        let text =
            std::fs::read_to_string(root().join("assets/text/kjv-genesis-exodus.txt")).ok()?;
        let ids = Tokenizer::from_dir(dir).ok()?.encode(&text).ok()?;
        return Some((format!("kjv{n}"), ids[..n].to_vec()));
    }
    let rest = label
        .strip_prefix("witness ")
        .or_else(|| label.strip_prefix("reference "))?;
    let (case_dir, seq) = rest.rsplit_once(' ')?;
    let i: usize = seq.strip_prefix("seq")?.parse().ok()?;
    let case: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join(case_dir).join("case.json")).ok()?,
    )
    .ok()?;
    let ids = case["sequences"][i]
        .as_array()?
        .iter()
        .map(|v| v.as_u64().map(|x| x as u32))
        .collect::<Option<Vec<u32>>>()?;
    Some((format!("{case_dir} {seq}"), ids))
}

fn preset_of(report: &Value, file: &str) -> String {
    for c in report["logits"].as_array().into_iter().flatten() {
        let label = c["label"].as_str().unwrap_or("");
        if let Some(i) = label.find("tests/fixtures/witness/") {
            let case = label[i..].split('/').nth(3).unwrap_or("");
            return case.trim_end_matches("-hd64").to_string();
        }
    }
    if file.contains("tiny-dense") {
        "tiny-dense"
    } else {
        "tiny"
    }
    .to_string()
}

fn set(v: &Value) -> Option<Vec<usize>> {
    let mut s: Vec<usize> = v
        .as_array()?
        .iter()
        .map(|x| x.as_u64().map(|x| x as usize))
        .collect::<Option<_>>()?;
    s.sort_unstable();
    Some(s)
}

fn sorted(v: &[usize]) -> Vec<usize> {
    let mut s = v.to_vec();
    s.sort_unstable();
    s
}

#[derive(Default, Debug)]
struct Counts {
    /// (position, layer) entries where the GPU's set differs from the f32 one.
    gpu_flips: usize,
    flips_before: usize,
    flips_after: usize,
    /// Entries where the GPU kept the f32 set.
    kept: usize,
    kept_before: usize,
    kept_after: usize,
    /// f32 trace disagreeing with the report's oracle (should be 0).
    oracle_mismatch: usize,
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut preset_arg = None;
    if let Some(i) = args.iter().position(|a| a == "--preset") {
        preset_arg = Some(args.remove(i + 1));
        args.remove(i);
    }
    assert!(
        !args.is_empty(),
        "usage: emulation_vs_gpu_routes [--preset P] REPORT.json ..."
    );
    let mut total = Counts::default();
    for file in &args {
        let report: Value = serde_json::from_str(&std::fs::read_to_string(file).unwrap())
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        let preset = preset_arg
            .clone()
            .unwrap_or_else(|| preset_of(&report, file));
        let dir = checkpoint(&preset);
        let config = ModelConfig::load(&dir).unwrap();
        let experts = Arc::new(Int4RoundTrip(CheckpointExperts::new(
            Arc::new(Checkpoint::open(&dir).unwrap()),
            &config,
        )));
        let opts = ReferenceOptions {
            context_length: Some(8192),
        };
        let mut e = ReferenceEngine::with_experts(&dir, opts, experts).unwrap();
        let mut runs: HashMap<Vec<u32>, (Trace, Trace)> = HashMap::new();
        println!("== {file} (preset {preset})");
        for c in report["logits"].as_array().into_iter().flatten() {
            let label = c["label"].as_str().unwrap_or("");
            let Some((name, tokens)) = tokens_of(label, &dir) else {
                println!("  skip: {label} (not against the f32 reference)");
                continue;
            };
            let (tf, tb) = runs.entry(tokens.clone()).or_insert_with(|| {
                e.set_activations(Activations::F32);
                let t0 = Instant::now();
                let (_, tf) = e.prompt_logits_traced(&tokens).unwrap();
                let f32_s = t0.elapsed().as_secs_f64();
                e.set_activations(Activations::Bf16);
                let t0 = Instant::now();
                let (_, tb) = e.prompt_logits_traced(&tokens).unwrap();
                let bf_s = t0.elapsed().as_secs_f64();
                let moe: Vec<usize> = (0..tf.experts.len())
                    .filter(|&l| !tf.experts[l].is_empty())
                    .collect();
                let flipped = (0..tokens.len())
                    .filter(|&t| {
                        moe.iter()
                            .any(|&l| sorted(&tf.experts[l][t]) != sorted(&tb.experts[l][t]))
                    })
                    .count();
                println!(
                    "  ran {name}: {} tokens, f32 {f32_s:.1} s, bf16 emulation {bf_s:.1} s; \
                     positions the emulation flips vs f32: {flipped}",
                    tokens.len()
                );
                (tf, tb)
            });
            let mut k = Counts::default();
            let positions = c["over_bound_positions"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            for p in &positions {
                let t = p["position"].as_u64().unwrap() as usize;
                for ly in p["layers"].as_array().into_iter().flatten() {
                    let l = ly["layer"].as_u64().unwrap() as usize;
                    let (Some(oracle), Some(gpu)) =
                        (set(&ly["oracle_experts"]), set(&ly["engine_experts"]))
                    else {
                        continue;
                    };
                    let before = set(&ly["emulation_experts"]);
                    let f32_now = sorted(&tf.experts[l][t]);
                    let after = sorted(&tb.experts[l][t]);
                    k.oracle_mismatch += usize::from(f32_now != oracle);
                    if gpu != oracle {
                        k.gpu_flips += 1;
                        k.flips_before += usize::from(before.as_ref() == Some(&gpu));
                        k.flips_after += usize::from(after == gpu);
                        println!(
                            "    pos {t} L{l} gap {:.5}: f32 {oracle:?} gpu {gpu:?} \
                             before {before:?} after {after:?}{}",
                            ly["gap"].as_f64().unwrap_or(f64::NAN),
                            if after == gpu { "  reproduced" } else { "" }
                        );
                    } else {
                        k.kept += 1;
                        k.kept_before += usize::from(before.as_ref() == Some(&gpu));
                        k.kept_after += usize::from(after == gpu);
                    }
                }
            }
            println!(
                "  {label}: GPU flips {} (reproduced before {}, after {}); GPU kept f32 {} \
                 (emulation kept before {}, after {}); f32 trace vs report oracle mismatches {}",
                k.gpu_flips,
                k.flips_before,
                k.flips_after,
                k.kept,
                k.kept_before,
                k.kept_after,
                k.oracle_mismatch
            );
            total.gpu_flips += k.gpu_flips;
            total.flips_before += k.flips_before;
            total.flips_after += k.flips_after;
            total.kept += k.kept;
            total.kept_before += k.kept_before;
            total.kept_after += k.kept_after;
            total.oracle_mismatch += k.oracle_mismatch;
        }
    }
    println!("== total: {total:?}");
}
