//! Shared by the `krasis-model` examples: the checkpoints `bench --check`
//! runs on the GPU, and their experts after the INT4 cache's
//! quantize/dequantize round trip, by the cache's exact rule
//! (runtime/cache/src/layout.rs; re-implemented here as tools/witness/int4.py
//! does, since krasis-model cannot depend on krasis-cache), i.e. what
//! `krasis_cache::Int4Experts` returns.

use half::f16;
use krasis_model::reference::CheckpointExperts;
use krasis_model::synth::{
    self, GENERATOR_VERSION, RECORD_FILE, SynthDtype, SynthSpec, TokenizerSource,
};
use krasis_model::{ExpertF32, ExpertWeights, ModelError, testutil};
use serde_json::json;
use std::path::PathBuf;

/// `tiny`/`tiny-dense` with head_dim 64, seed 1, BF16, the Qwen tokenizer:
/// `krasis-runtime synth --preset P --seed 1 --dtype bf16 --set head_dim=64`,
/// written once under `target/krasis-testdata/`.
pub fn checkpoint(preset: &str) -> PathBuf {
    let overrides = vec![("head_dim".to_string(), json!(64))];
    let spec = SynthSpec::new(preset, 1, SynthDtype::Bf16, 0.0, &overrides).unwrap();
    let vocab = testutil::qwen_vocab();
    let mut h = blake3::Hasher::new();
    h.update(format!("{GENERATOR_VERSION}/{}", spec.config_json()).as_bytes());
    h.update(&std::fs::read(&vocab).unwrap());
    let key = h.finalize().to_hex();
    let dir =
        testutil::testdata_dir().join(format!("bf16-conditioning-{preset}-hd64-{}", &key[..16]));
    if !dir.join(RECORD_FILE).exists() {
        let mut opts = synth::SynthOptions::new(spec);
        opts.tokenizer = TokenizerSource::Qwen { vocab: Some(vocab) };
        synth::synthesize(&opts, &dir).unwrap_or_else(|e| panic!("synthesizing {preset}: {e}"));
    }
    dir
}

const GROUP: usize = 128;

pub struct Int4RoundTrip(pub CheckpointExperts);

/// Symmetric INT4, groups of 128 along K (rows are K-contiguous):
/// `s = f16(amax / 7)`, `q = clamp(round_ties_even(w / s) + 8, 0, 15)`,
/// value `(q - 8) * s`; a zero scale gives zeros.
fn int4_roundtrip(w: &mut [f32]) {
    assert_eq!(w.len() % GROUP, 0);
    for g in w.chunks_exact_mut(GROUP) {
        let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = f16::from_f32(amax / 7.0).to_f32();
        if s == 0.0 {
            g.fill(0.0);
            continue;
        }
        for v in g {
            let q = ((*v / s).round_ties_even() + 8.0).clamp(0.0, 15.0);
            *v = (q - 8.0) * s;
        }
    }
}

impl ExpertWeights for Int4RoundTrip {
    fn describe(&self) -> String {
        format!("INT4 round trip of {}", self.0.describe())
    }
    fn expert_f32(&self, layer: usize, expert: usize) -> Result<ExpertF32, ModelError> {
        let mut e = self.0.expert_f32(layer, expert)?;
        for m in [&mut e.gate, &mut e.up, &mut e.down] {
            int4_roundtrip(m);
        }
        Ok(e)
    }
}
