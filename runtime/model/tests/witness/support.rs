//! Synthetic checkpoints for these tests and logits comparison helpers.

use krasis_model::reference::{ReferenceEngine, ReferenceOptions};
use krasis_model::synth::{
    self, GENERATOR_VERSION, RECORD_FILE, SynthDtype, SynthOptions, SynthSpec, TokenizerSource,
};
use serde_json::Value;
use std::path::PathBuf;

/// A synthetic checkpoint (no tokenizer files), written once per content
/// under `target/krasis-testdata/` and shared by tests and test binaries.
pub fn synth_dir(
    preset: &str,
    seed: u64,
    dtype: SynthDtype,
    router_skew: f32,
    overrides: &[(String, Value)],
) -> PathBuf {
    let spec = SynthSpec::new(preset, seed, dtype, router_skew, overrides)
        .unwrap_or_else(|e| panic!("synth spec {preset} {overrides:?}: {e}"));
    // The tensor list is part of the key so a change in what the
    // architecture expects never reuses a checkpoint written before it.
    let tensors: Vec<(String, Vec<usize>)> = spec
        .tensors()
        .into_iter()
        .map(|t| (t.name, t.shape))
        .collect();
    let key = blake3::hash(
        format!(
            "{GENERATOR_VERSION}/{preset}/{seed}/{}/{router_skew}/{overrides:?}/{tensors:?}",
            dtype.name()
        )
        .as_bytes(),
    )
    .to_hex();
    let dir =
        krasis_model::testutil::testdata_dir().join(format!("witness-{preset}-{}", &key[..16]));
    if !dir.join(RECORD_FILE).exists() {
        let mut opts = SynthOptions::new(spec);
        opts.tokenizer = TokenizerSource::None;
        match synth::synthesize(&opts, &dir) {
            Ok(_) => {}
            // Another test (binary) finished the same checkpoint first.
            Err(synth::SynthError::OutputExists { .. }) if dir.join(RECORD_FILE).exists() => {}
            Err(e) => panic!("synthesizing {preset} into {}: {e}", dir.display()),
        }
    }
    dir
}

/// A BF16 seed-1 checkpoint of `preset` with `overrides`.
pub fn preset_dir(preset: &str, overrides: &[(&str, Value)]) -> PathBuf {
    let o: Vec<(String, Value)> = overrides
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    synth_dir(preset, 1, SynthDtype::Bf16, 0.0, &o)
}

pub fn load(dir: &std::path::Path, context: usize) -> ReferenceEngine {
    let opts = ReferenceOptions {
        context_length: Some(context),
    };
    ReferenceEngine::load(dir, opts).unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}

pub fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, x| m.max(x.abs()))
}

/// Largest `|a - b|` divided by `max(1, max |b|)`.
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "logit rows differ in length");
    let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    d / max_abs(b).max(1.0)
}

/// Token ids of the `k` largest logits, largest first (ties: lower id first).
pub fn top_ids(row: &[f32], k: usize) -> Vec<u32> {
    let order = |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
    let mut ids: Vec<u32> = (0..row.len() as u32).collect();
    if k < ids.len() {
        ids.select_nth_unstable_by(k, order);
        ids.truncate(k);
    }
    ids.sort_by(order);
    ids
}
