//! Shared helpers of the cache integration tests: small synthetic checkpoints.
#![allow(dead_code)]

use krasis_model::synth::{SynthDtype, SynthOptions, SynthSpec, TokenizerSource, synthesize};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

/// The `tiny` preset with a small vocabulary, so writing and loading it takes
/// milliseconds: 3 MoE layers x 8 experts of 128x128.
pub fn small_overrides() -> Vec<(String, Value)> {
    vec![("vocab_size".into(), json!(512))]
}

/// A 512-hidden, 8-layer, 32-expert model (the "medium" quality case).
pub fn medium_overrides() -> Vec<(String, Value)> {
    vec![
        ("vocab_size".into(), json!(2048)),
        ("hidden_size".into(), json!(512)),
        ("num_hidden_layers".into(), json!(8)),
        ("max_window_layers".into(), json!(8)),
        ("num_experts".into(), json!(32)),
        ("num_experts_per_tok".into(), json!(4)),
        ("moe_intermediate_size".into(), json!(256)),
        ("num_attention_heads".into(), json!(8)),
        ("num_key_value_heads".into(), json!(2)),
        ("head_dim".into(), json!(64)),
    ]
}

pub fn spec(preset: &str, seed: u64, overrides: &[(String, Value)]) -> SynthSpec {
    SynthSpec::new(preset, seed, SynthDtype::Bf16, 0.0, overrides).expect("valid synth spec")
}

/// Writes a synthetic checkpoint of `spec` to `parent/name`.
pub fn write_synth(
    parent: &Path,
    name: &str,
    spec: SynthSpec,
    experts_in_cache_only: bool,
) -> PathBuf {
    let dir = parent.join(name);
    let mut opts = SynthOptions::new(spec);
    opts.tokenizer = TokenizerSource::None;
    opts.skip_routed_experts = experts_in_cache_only;
    synthesize(&opts, &dir).expect("synthesize test checkpoint");
    dir
}

pub fn small_model(parent: &Path) -> PathBuf {
    write_synth(parent, "model", spec("tiny", 7, &small_overrides()), false)
}

/// Writes `dir/model.safetensors` holding `tensors` (name, dtype, shape,
/// bytes), in the order given.
pub fn write_safetensors(dir: &Path, tensors: &[(String, &str, Vec<usize>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        header.insert(
            name.clone(),
            json!({"dtype": dtype, "shape": shape,
                "data_offsets": [data.len(), data.len() + bytes.len()]}),
        );
        data.extend_from_slice(bytes);
    }
    let h = serde_json::to_vec(&header).unwrap();
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&h);
    file.extend_from_slice(&data);
    std::fs::write(dir.join("model.safetensors"), file).unwrap();
}

/// A `config.json` of the `tiny` preset with `overrides`, alone in
/// `parent/name` (the caller adds the safetensors).
pub fn write_config(parent: &Path, name: &str, overrides: &[(&str, Value)]) -> PathBuf {
    let dir = parent.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg = krasis_model::synth::preset_config("tiny").expect("tiny preset");
    for (k, v) in overrides {
        cfg[*k] = v.clone();
    }
    cfg["torch_dtype"] = json!("bfloat16");
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&cfg).unwrap(),
    )
    .unwrap();
    dir
}

/// Deterministic bytes (an LCG), different for each `salt`.
pub fn bytes(n: usize, salt: u64) -> Vec<u8> {
    let mut x = salt
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) as u8
        })
        .collect()
}
