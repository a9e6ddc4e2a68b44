//! `krasis_synth.json`: how a synthetic checkpoint was made, enough to
//! regenerate any tensor of it without reading the shards.

use super::error::SynthError;
use super::spec::SynthDtype;
use serde::{Deserialize, Serialize};
use std::path::Path;

pub const RECORD_FILE: &str = "krasis_synth.json";
const GENERATOR: &str = "krasis-synth";

/// Bumped whenever any tensor's values, the presets' fields or the file set
/// change, so cached checkpoints and `from_checkpoint_dir` never mix rules.
pub const GENERATOR_VERSION: u32 = 2;

pub const VALUE_RULE: &str = "element i of tensor NAME: bits = words 2i,2i+1 of ChaCha8 keyed by \
blake3(\"krasis-synth/v1/tensor\\0\" || seed as u64 LE || NAME); n = (sum of the four 16-bit \
quarters of bits - 131070) / 37837.23 (approx. N(0,1)); value = std*n (embeddings std 1, \
lm_head std 4/sqrt(hidden), other projections std 1/sqrt(fan_in)), 1 + 0.05*n (RMSNorm weights), 0.1*n (biases); then rounded \
to the stored dtype (round to nearest even)";

pub const ROUTER_SKEW_RULE: &str = "router row e (mlp.gate.weight) is multiplied by \
c*(1+rank_e)^(-router_skew), where rank_e orders the layer's experts by the first 8 bytes (LE u64) \
of blake3_keyed(key = tensor key of \"NAME#expert-rank\", e as u64 LE) ascending, and c makes the \
scales' RMS 1; router_skew 0 leaves rows unscaled";

pub const SINK_RULE: &str = "attention sinks (self_attn.sinks, one logit per head) are drawn by \
the value rule with std 1.0, then rounded to the stored dtype; router biases (mlp.router.bias) \
with std 0.1";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SynthRecord {
    pub generator: String,
    pub generator_version: u32,
    pub preset: String,
    pub seed: u64,
    pub dtype: String,
    pub router_skew: f32,
    pub overrides: serde_json::Map<String, serde_json::Value>,
    /// Routed expert tensors were not written (`--experts-in-cache-only`).
    pub routed_experts_omitted: bool,
    /// `qwen3` / `qwen3-coder` / `gpt-oss`, or `null` without tokenizer files.
    pub chat_template: Option<String>,
    /// Bytes of tensor data over all shards.
    pub tensor_bytes: u64,
    pub value_rule: String,
    pub router_skew_rule: String,
    /// How MXFP4 expert tensors were encoded ([`super::MXFP4_RULE`]);
    /// absent for checkpoints with float experts, whose records stay as
    /// they were.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mxfp4_rule: Option<String>,
    /// How attention-sink logits were drawn ([`SINK_RULE`]); absent for
    /// models without sinks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sink_rule: Option<String>,
}

impl SynthRecord {
    pub(crate) fn new(
        spec: &super::SynthSpec,
        routed_experts_omitted: bool,
        chat_template: Option<&str>,
        tensor_bytes: u64,
    ) -> Self {
        SynthRecord {
            generator: GENERATOR.into(),
            generator_version: GENERATOR_VERSION,
            preset: spec.preset.clone(),
            seed: spec.seed,
            dtype: spec.dtype.name().into(),
            router_skew: spec.router_skew,
            overrides: spec.overrides.clone(),
            routed_experts_omitted,
            chat_template: chat_template.map(str::to_string),
            tensor_bytes,
            value_rule: VALUE_RULE.into(),
            router_skew_rule: ROUTER_SKEW_RULE.into(),
            mxfp4_rule: spec
                .tensors()
                .iter()
                .any(|t| matches!(t.storage, super::Storage::Mxfp4 { .. }))
                .then(|| super::MXFP4_RULE.into()),
            sink_rule: spec.geometry().attention.sinks.then(|| SINK_RULE.into()),
        }
    }

    /// Reads `DIR/krasis_synth.json`, refusing other generators and versions.
    pub fn load(dir: &Path) -> Result<Self, SynthError> {
        let path = dir.join(RECORD_FILE);
        let text = std::fs::read_to_string(&path).map_err(|e| SynthError::io(&path, e))?;
        let bad = |reason: String| SynthError::BadRecord {
            path: path.clone(),
            reason,
        };
        let r: SynthRecord =
            serde_json::from_str(&text).map_err(|e| bad(format!("invalid record: {e}")))?;
        if r.generator != GENERATOR {
            return Err(bad(format!(
                "generator is '{}', not '{GENERATOR}'",
                r.generator
            )));
        }
        if r.generator_version != GENERATOR_VERSION {
            return Err(bad(format!(
                "written by synth generator version {}, this build is version {GENERATOR_VERSION}; re-run synth",
                r.generator_version
            )));
        }
        Ok(r)
    }

    pub fn dtype(&self) -> Result<SynthDtype, SynthError> {
        SynthDtype::parse(&self.dtype).ok_or_else(|| SynthError::BadRecord {
            path: RECORD_FILE.into(),
            reason: format!("unknown dtype '{}' (expected bf16 or f32)", self.dtype),
        })
    }
}
