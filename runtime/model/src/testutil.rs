//! Helpers for tests across the workspace: the real vocabularies (Qwen's,
//! gpt-oss's o200k) and synthetic checkpoints built once and shared by every
//! test binary.
//!
//! Checkpoints live under `target/krasis-testdata/`, in a directory named by
//! a hash of everything that determines their bytes (generator version,
//! preset, config overrides, seed, tokenizer JSON, chat template, generation
//! config; each the preset family's own), so a stale one is never reused. `synthesize` renames a finished
//! temp dir into place, so test binaries racing on the same checkpoint
//! either see it complete or not at all.

use crate::arch::ModelConfig;
use crate::synth::{
    self, ChatTemplateKind, GENERATOR_VERSION, RECORD_FILE, SynthDtype, SynthError, SynthOptions,
    SynthSpec, TokenizerSource,
};
use serde_json::Value;
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

/// Path of gpt-oss's o200k_base ranks; panics with the fix when absent.
pub fn o200k_vocab() -> PathBuf {
    match crate::tokenizer::find_o200k_vocab(None) {
        Ok(p) => p,
        Err(e) => panic!(
            "the o200k_base vocabulary is needed by this test ({e}); run tools/harmony/vocab.sh"
        ),
    }
}

/// The family's tokenizer source (vocabulary path resolved) and its
/// `tokenizer.json`, built once per family.
fn family_tokenizer(config: &ModelConfig) -> (TokenizerSource, &'static str) {
    static QWEN: OnceLock<String> = OnceLock::new();
    static HARMONY: OnceLock<String> = OnceLock::new();
    static GLM4: OnceLock<String> = OnceLock::new();
    let built = |r: Result<String, crate::error::ModelError>| {
        r.unwrap_or_else(|e| panic!("building tokenizer.json for test checkpoints: {e}"))
    };
    match config {
        ModelConfig::Qwen3Moe(_) => (
            TokenizerSource::Qwen {
                vocab: Some(qwen_vocab()),
            },
            QWEN.get_or_init(|| built(crate::tokenizer::build_qwen_tokenizer_json(&qwen_vocab()))),
        ),
        ModelConfig::GptOss(_) => (
            TokenizerSource::Harmony {
                vocab: Some(o200k_vocab()),
            },
            HARMONY.get_or_init(|| {
                built(crate::tokenizer::build_harmony_tokenizer_json(
                    &o200k_vocab(),
                ))
            }),
        ),
        ModelConfig::Glm4Moe(_) => (
            TokenizerSource::Glm4 {
                vocab: Some(qwen_vocab()),
            },
            GLM4.get_or_init(|| built(crate::tokenizer::build_glm4_tokenizer_json(&qwen_vocab()))),
        ),
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

/// The directory name of a test checkpoint: unchanged for qwen3_moe
/// presets since before other families existed (their files hash the same).
fn cache_key(spec: &SynthSpec, preset: &str, overrides: &[(String, Value)]) -> String {
    let (_, tok) = family_tokenizer(spec.config());
    let mut h = blake3::Hasher::new();
    h.update(preset.as_bytes());
    h.update(&TEST_SEED.to_le_bytes());
    h.update(tok.as_bytes());
    h.update(
        ChatTemplateKind::for_family(spec.config())
            .source()
            .as_bytes(),
    );
    h.update(
        synth::generation_config(spec.config())
            .to_string()
            .as_bytes(),
    );
    h.update(
        synth::preset_config(preset)
            .map(|v| v.to_string())
            .unwrap_or_default()
            .as_bytes(),
    );
    // No overrides hashes as before, so existing checkpoints keep their name.
    if !overrides.is_empty() {
        h.update(format!("{overrides:?}").as_bytes());
    }
    let hex = h.finalize().to_hex();
    format!("synth-v{GENERATOR_VERSION}-{preset}-{}", &hex[..16])
}

/// A complete synthetic checkpoint of `preset` (BF16, seed [`TEST_SEED`],
/// the family's real tokenizer and chat template: Qwen3's, or gpt-oss's
/// o200k_harmony and template), synthesized at most once per content hash
/// and shared between tests and test binaries. Panics with the reason when
/// it cannot be made (tests only).
pub fn tiny_checkpoint(preset: &str) -> PathBuf {
    tiny_checkpoint_with(preset, &[])
}

/// The `tiny-gpt-oss` checkpoint ([`tiny_checkpoint`]): MXFP4 experts, the
/// full 201,088-token vocabulary with o200k_harmony, the gpt-oss template;
/// the bytes of `krasis-runtime synth --preset tiny-gpt-oss --seed 1
/// --dtype bf16`.
pub fn tiny_gpt_oss_checkpoint() -> PathBuf {
    tiny_checkpoint("tiny-gpt-oss")
}

/// The `tiny-glm4-moe` checkpoint ([`tiny_checkpoint`]): GLM's layout
/// (MTP layer included), the GLM-4.5 stand-in tokenizer and the GLM
/// template; the bytes of `krasis-runtime synth --preset tiny-glm4-moe
/// --seed 1 --dtype bf16`.
pub fn tiny_glm4_moe_checkpoint() -> PathBuf {
    tiny_checkpoint("tiny-glm4-moe")
}

/// [`tiny_checkpoint`] with `config.json` fields overridden, like
/// `krasis-runtime synth --preset PRESET --seed 1 --dtype bf16 --set KEY=VALUE`
/// (e.g. `("head_dim", json!(64))`).
pub fn tiny_checkpoint_with(preset: &str, overrides: &[(&str, Value)]) -> PathBuf {
    static DONE: OnceLock<Mutex<HashMap<String, PathBuf>>> = OnceLock::new();
    let overrides: Vec<(String, Value)> = overrides
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    let mut done = DONE
        .get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let memo = format!("{preset}/{overrides:?}");
    if let Some(p) = done.get(&memo) {
        return p.clone();
    }
    let spec = SynthSpec::new(preset, TEST_SEED, SynthDtype::Bf16, 0.0, &overrides)
        .unwrap_or_else(|e| panic!("test checkpoint '{preset}' {overrides:?}: {e}"));
    let dir = testdata_dir().join(cache_key(&spec, preset, &overrides));
    if !dir.join(RECORD_FILE).exists() {
        let (tokenizer, _) = family_tokenizer(spec.config());
        let mut opts = SynthOptions::new(spec);
        opts.tokenizer = tokenizer;
        match synth::synthesize(&opts, &dir) {
            Ok(_) => {}
            // Another test binary finished the same checkpoint first.
            Err(SynthError::OutputExists { .. }) if dir.join(RECORD_FILE).exists() => {}
            Err(e) => panic!(
                "synthesizing test checkpoint '{preset}' {overrides:?} into {}: {e}",
                dir.display()
            ),
        }
    }
    done.insert(memo, dir.clone());
    dir
}

/// `tests/fixtures/witness` of this workspace: the Hugging Face transformers
/// witness fixtures (`<case>/<variant>/`) written by `tools/witness`.
pub fn witness_fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/witness")
}

/// Presets witnessed at head_dim 64 too, as fixture cases `<preset>-hd64`:
/// the CUDA attention kernels have no head_dim 32 (the presets' own), so the
/// GPU check (`bench --check`, benchmarks/run_device.sh) reads these.
pub const WITNESS_HD64_PRESETS: [&str; 2] = ["tiny", "tiny-dense"];

/// Is `case` (a directory name under [`witness_fixtures_dir`]) one of the
/// `<preset>-hd64` cases of [`WITNESS_HD64_PRESETS`]?
pub fn is_witness_hd64_case(case: &str) -> bool {
    WITNESS_HD64_PRESETS
        .iter()
        .any(|p| case.strip_suffix("-hd64") == Some(p))
}

/// The fixture directory `<preset>-hd64/<variant>` and its checkpoint:
/// [`tiny_checkpoint_with`]`(preset, head_dim 64)`, the bytes of
/// `krasis-runtime synth --preset PRESET --seed 1 --dtype bf16 --set head_dim=64`
/// that benchmarks/run_device.sh feeds the GPU check. Panics unless the
/// fixture's `case.json` records exactly that synthesis: the synth options,
/// the generator version and the checkpoint's `config.json`.
pub fn witness_hd64(preset: &str, variant: &str) -> (PathBuf, PathBuf) {
    let fixture = witness_fixtures_dir()
        .join(format!("{preset}-hd64"))
        .join(variant);
    let ckpt = tiny_checkpoint_with(preset, &[("head_dim", serde_json::json!(64))]);
    let read = |p: &Path| -> Value {
        let text = std::fs::read_to_string(p).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; run tools/witness/run_device.sh --case {preset}-hd64",
                p.display()
            )
        });
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    };
    let case = read(&fixture.join("case.json"));
    let want_synth = serde_json::json!({
        "preset": preset,
        "seed": TEST_SEED,
        "dtype": SynthDtype::Bf16.name(),
        "overrides": {"head_dim": 64},
        "router_skew": 0.0,
    });
    let at = fixture.display();
    assert_eq!(case["synth"], want_synth, "{at}: case.json synth options");
    assert_eq!(case["variant"], variant, "{at}: case.json variant");
    assert_eq!(
        case["generator_version"], GENERATOR_VERSION,
        "{at}: fixture made for another synth generator version; regenerate it with \
         tools/witness/run_device.sh --case {preset}-hd64"
    );
    assert_eq!(
        case["config"],
        read(&ckpt.join("config.json")),
        "{at}: case.json config differs from the test checkpoint's config.json"
    );
    (fixture, ckpt)
}

/// The prompts of the gpt-oss prefix-cache steps (64-token blocks, a
/// sliding window of 16 in rings of 128 rows: tiny-gpt-oss) with the
/// cached tokens each one must get: the CUDA engine's GPU test
/// (`runtime/gpu/tests/prefix_cache.rs`) serves them, and the CPU test of
/// the window rules (`runtime/gpu/src/prefix_window.rs`) runs the same
/// steps through the real index, so the two cannot drift apart.
/// `tokens(n, seed)`: n token ids, distinct streams for distinct seeds.
pub fn gpt_oss_window_steps(tokens: impl Fn(usize, u32) -> Vec<u32>) -> Vec<(Vec<u32>, usize)> {
    let prompt = tokens(330, 1); // 5 blocks + 10 tokens
    let mut q = prompt[..150].to_vec();
    q.extend(tokens(90, 2));
    let mut next = prompt.clone();
    next.extend(tokens(150, 3));
    let system = tokens(150, 4);
    let conv = |seed| {
        let mut c = system.clone();
        c.extend(tokens(70, seed));
        c
    };
    vec![
        (prompt.clone(), 0),
        // Its last block keeps the window: the whole prompt again.
        (prompt.clone(), 320),
        // Ends in block 4: block 3 lacks the window until this prompt,
        // whose ring holds it at its end, completes it.
        (prompt[..320].to_vec(), 0),
        (prompt[..320].to_vec(), 256),
        (prompt[..257].to_vec(), 256),
        // Blocks 0 and 1 match, and neither keeps the window.
        (q, 0),
        // The conversation goes on, twice.
        (next.clone(), 320),
        (next, 448),
        // A second conversation sharing only a system prompt reuses
        // nothing of the first (which ended elsewhere); its own goes on.
        (conv(5), 0),
        (conv(6), 0),
        (conv(5), 192),
    ]
}
