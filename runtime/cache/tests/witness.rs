//! The independent witness: logits computed by Hugging Face transformers
//! (tools/witness) with routed experts dequantized from INT4 by a NumPy
//! re-implementation of the rule in layout.rs. The reference engine over our
//! cache must match them: same argmax, same top-10 set, and
//! max |delta logit| <= 1e-3 * max(1, max |logit|) on the stored top-20 at every
//! position and on the full last-position logits.
//!
//! Fixtures: `tests/fixtures/witness/<case>/int4/` with `case.json`
//! `{synth: {preset, seed, dtype, overrides}, sequences}`, `seqN.json`
//! `{argmax, top_ids, top_vals}` and `seqN.last.f32` (little-endian f32).
//! The `<preset>-hd64` cases (head_dim 64, what the GPU check reads) are
//! checked over the cache of the checkpoint benchmarks/run_device.sh
//! synthesizes (`testutil::witness_hd64`), the others over a checkpoint
//! synthesized from their `case.json`.

mod common;

use krasis_cache::{BuildOptions, CacheExperts, ModelSource, ensure_cache_at};
use krasis_model::Engine;
use krasis_model::reference::{ReferenceEngine, ReferenceOptions};
use krasis_model::synth::{SynthDtype, SynthSpec};
use krasis_model::testutil::{self, is_witness_hd64_case, witness_fixtures_dir};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// `int4` fixture directories, except the `<preset>-hd64` ones.
fn cases() -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(witness_fixtures_dir()) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| !is_witness_hd64_case(&e.file_name().to_string_lossy()))
        .map(|e| e.path().join("int4"))
        .filter(|p| p.join("case.json").exists())
        .collect();
    v.sort();
    v
}

fn read_json(p: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn top_k(x: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[b].total_cmp(&x[a]));
    idx.truncate(k);
    idx.sort();
    idx
}

/// The checkpoint `case.json` describes, synthesized into `tmp/model`.
fn synth_case(case_dir: &Path, tmp: &Path) -> PathBuf {
    let case = read_json(&case_dir.join("case.json"));
    let s = &case["synth"];
    let overrides: Vec<(String, Value)> = s["overrides"]
        .as_object()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    let dtype = SynthDtype::parse(s["dtype"].as_str().unwrap_or("bf16")).expect("dtype bf16|f32");
    let spec = SynthSpec::new(
        s["preset"].as_str().expect("synth.preset"),
        s["seed"].as_u64().expect("synth.seed"),
        dtype,
        s["router_skew"].as_f64().unwrap_or(0.0) as f32,
        &overrides,
    )
    .expect("fixture spec is valid");
    common::write_synth(tmp, "model", spec, true)
}

/// The `int4` fixture `case_dir` against the reference engine over the INT4
/// cache of the checkpoint `dir`, built into `tmp`.
fn check_case(case_dir: &Path, dir: &Path, tmp: &Path) {
    let case = read_json(&case_dir.join("case.json"));
    let source = ModelSource::open(dir).unwrap();
    let opts = BuildOptions {
        progress_bar: false,
        ..BuildOptions::default()
    };
    let cache = ensure_cache_at(&source, &tmp.join("w.kcache"), &opts)
        .unwrap()
        .cache;
    let experts = Arc::new(CacheExperts::new(Arc::new(cache)));
    let sequences = case["sequences"].as_array().expect("sequences");
    for (n, seq) in sequences.iter().enumerate() {
        let toks: Vec<u32> = seq
            .as_array()
            .expect("a sequence is a list of token ids")
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let want = read_json(&case_dir.join(format!("seq{n}.json")));
        let raw = std::fs::read(case_dir.join(format!("seq{n}.last.f32"))).unwrap();
        let want_logits: Vec<f32> = raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let opts = ReferenceOptions {
            context_length: Some(toks.len() + 1),
        };
        let mut engine = ReferenceEngine::with_experts(dir, opts, experts.clone()).unwrap();
        let logits = engine.prompt_logits(&toks).unwrap();
        let argmax_want = want["argmax"].as_array().expect("argmax per position");
        let top_ids_want = want["top_ids"].as_array().expect("top_ids per position");
        let top_vals_want = want["top_vals"].as_array().expect("top_vals per position");
        assert_eq!(
            logits.len(),
            argmax_want.len(),
            "{}: seq{n} positions",
            case_dir.display()
        );
        for (pos, got) in logits.iter().enumerate() {
            let scale = got.iter().fold(1f32, |m, v| m.max(v.abs()));
            assert_eq!(
                top_k_ordered(got, 1)[0] as u64,
                argmax_want[pos].as_u64().unwrap(),
                "{}: seq{n} argmax at position {pos}",
                case_dir.display()
            );
            let ids: Vec<usize> = top_ids_want[pos]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as usize)
                .collect();
            let mut want10 = ids[..10].to_vec();
            want10.sort();
            assert_eq!(
                top_k(got, 10),
                want10,
                "{}: seq{n} top-10 at position {pos}",
                case_dir.display()
            );
            for (id, val) in ids.iter().zip(top_vals_want[pos].as_array().unwrap()) {
                let d = (got[*id] - val.as_f64().unwrap() as f32).abs();
                assert!(
                    d <= 1e-3 * scale,
                    "{}: seq{n} position {pos} token {id}: |dlogit| {d} > {}",
                    case_dir.display(),
                    1e-3 * scale
                );
            }
        }
        let got = logits.last().unwrap();
        assert_eq!(
            got.len(),
            want_logits.len(),
            "{}: seq{n} vocab",
            case_dir.display()
        );
        let scale = want_logits.iter().fold(1f32, |m, v| m.max(v.abs()));
        let max_diff = got
            .iter()
            .zip(&want_logits)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            max_diff <= 1e-3 * scale,
            "{}: seq{n} last position max |dlogit| {max_diff} > {}",
            case_dir.display(),
            1e-3 * scale
        );
    }
}

/// Indices of the k largest values, largest first (ties: lower index first).
fn top_k_ordered(x: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

#[test]
fn int4_reference_matches_transformers_witness() {
    let cases = cases();
    assert!(
        !cases.is_empty(),
        "no fixtures under {}",
        witness_fixtures_dir().display()
    );
    for c in cases {
        let tmp = tempfile::tempdir().unwrap();
        let model = synth_case(&c, tmp.path());
        check_case(&c, &model, tmp.path());
    }
}

/// The `<preset>-hd64/int4` fixture over the cache of the checkpoint
/// benchmarks/run_device.sh synthesizes and builds a cache of for the GPU
/// check.
fn check_hd64(preset: &str) {
    let (fixture, ckpt) = testutil::witness_hd64(preset, "int4");
    let tmp = tempfile::tempdir().unwrap();
    check_case(&fixture, &ckpt, tmp.path());
}

#[test]
fn int4_reference_matches_transformers_witness_tiny_head_dim_64() {
    check_hd64("tiny");
}

#[test]
fn int4_reference_matches_transformers_witness_tiny_dense_head_dim_64() {
    check_hd64("tiny-dense");
}
