//! Helpers for tests across the workspace: the real Qwen vocabulary and
//! synthetic checkpoints built once and shared by every test binary.
//!
//! Checkpoints live under `target/krasis-testdata/`, in a directory named by
//! a hash of everything that determines their bytes (generator version,
//! preset, seed, tokenizer JSON, chat template, generation config), so a
//! stale one is never reused. `synthesize` renames a finished temp dir into
//! place, so test binaries racing on the same checkpoint either see it
//! complete or not at all.

use crate::synth::{
    self, ChatTemplateKind, GENERATOR_VERSION, RECORD_FILE, SynthDtype, SynthError, SynthOptions,
    SynthSpec, TokenizerSource,
};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// Seed of every `tiny_checkpoint`.
pub const TEST_SEED: u64 = 1;

/// Path of the real Qwen vocabulary; panics with the fix when absent.
pub fn qwen_vocab() -> PathBuf {
    match crate::tokenizer::find_qwen_vocab(None) {
        Ok(p) => p,
        Err(e) => panic!("the Qwen vocabulary is needed by this test ({e}); run tools/vocab.sh"),
    }
}

/// `target/` of this workspace (or `CARGO_TARGET_DIR` as set at build time).
fn target_dir() -> PathBuf {
    if let Some(t) = option_env!("CARGO_TARGET_DIR") {
        return PathBuf::from(t);
    }
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .ancestors()
        .find(|a| a.join("Cargo.lock").exists())
        .unwrap_or(manifest)
        .join("target")
}

/// Where shared test data is written.
pub fn testdata_dir() -> PathBuf {
    target_dir().join("krasis-testdata")
}

fn cache_key(preset: &str) -> String {
    static TOKENIZER: OnceLock<String> = OnceLock::new();
    let tok = TOKENIZER.get_or_init(|| {
        crate::tokenizer::build_qwen_tokenizer_json(&qwen_vocab())
            .unwrap_or_else(|e| panic!("building tokenizer.json for test checkpoints: {e}"))
    });
    let mut h = blake3::Hasher::new();
    h.update(preset.as_bytes());
    h.update(&TEST_SEED.to_le_bytes());
    h.update(tok.as_bytes());
    h.update(ChatTemplateKind::Qwen3.source().as_bytes());
    h.update(
        crate::chat_template::qwen3_generation_config()
            .to_string()
            .as_bytes(),
    );
    h.update(
        synth::preset_config(preset)
            .map(|v| v.to_string())
            .unwrap_or_default()
            .as_bytes(),
    );
    let hex = h.finalize().to_hex();
    format!("synth-v{GENERATOR_VERSION}-{preset}-{}", &hex[..16])
}

/// A complete synthetic checkpoint of `preset` (BF16, seed [`TEST_SEED`],
/// real tokenizer, Qwen3 chat template), synthesized at most once per
/// content hash and shared between tests and test binaries. Panics with the
/// reason when it cannot be made (tests only).
pub fn tiny_checkpoint(preset: &str) -> PathBuf {
    static DONE: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let mut done = DONE
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(p) = done.get(preset) {
        return p.clone();
    }
    let dir = testdata_dir().join(cache_key(preset));
    if !dir.join(RECORD_FILE).exists() {
        let spec = SynthSpec::new(preset, TEST_SEED, SynthDtype::Bf16, 0.0, &[])
            .unwrap_or_else(|e| panic!("test checkpoint '{preset}': {e}"));
        let mut opts = SynthOptions::new(spec);
        opts.tokenizer = TokenizerSource::Qwen {
            vocab: Some(qwen_vocab()),
        };
        match synth::synthesize(&opts, &dir) {
            Ok(_) => {}
            // Another test binary finished the same checkpoint first.
            Err(SynthError::OutputExists { .. }) if dir.join(RECORD_FILE).exists() => {}
            Err(e) => panic!(
                "synthesizing test checkpoint '{preset}' into {}: {e}",
                dir.display()
            ),
        }
    }
    done.insert(preset.to_string(), dir.clone());
    dir
}
