//! The one list of architectures this build supports.
//!
//! Everything that names architectures derives from [`ARCHITECTURES`]:
//! `config.json` dispatch ([`super::ModelConfig::from_json_str`]), the
//! "supported: ..." refusal, the synth presets (`krasis-runtime synth
//! --preset` help and validation), and the capability report
//! (`krasis-runtime capabilities --json`, which the launcher reads; the
//! launcher has no list of its own). A test scans the workspace sources for
//! a registered `model_type` written as a string outside `arch/` and test
//! code, so a second list is caught in review.
//!
//! # How to add a model family
//!
//! 1. Write `arch/<model_type>.rs`: the typed config (`from_value`
//!    validates it and refuses what the engines cannot run), typed tensor
//!    names, `geometry()`, `expected_tensors()`; `pub const MODEL_TYPE` and
//!    `pub const ARCHITECTURE: Architecture` (display name, parser, the
//!    backends that build it, the options it implements and their
//!    defaults, its presets). Its synth presets go in
//!    `arch/<model_type>/presets.rs` as complete Hugging Face `config.json`
//!    objects of the published checkpoints.
//! 2. Add a variant to [`super::ModelConfig`] and its arm in each match
//!    there (the compiler lists them).
//! 3. Add `<model_type>::ARCHITECTURE` to [`ARCHITECTURES`].
//! 4. List a backend in `backends` only once that engine builds the family
//!    and its witness tests pass; list an option value only once it is
//!    implemented for the family (the launcher offers exactly these, and
//!    `check_options` refuses everything else).
//!
//! Tests in this module check that every entry's presets parse back as that
//! entry and that names are unique; `runtime/src/cmd/capabilities.rs` checks
//! that every entry appears in the report with its backends.

use super::{ModelConfig, glm4_moe, gpt_oss, qwen3_moe};
use crate::error::ModelError;
use krasis_common::{ArchitectureCaps, ArchitectureDefaults, Backend};
use serde_json::Value;
use std::path::Path;

/// Every architecture this build supports, in the order reports list them.
pub const ARCHITECTURES: &[Architecture] =
    &[qwen3_moe::ARCHITECTURE, GPT_OSS, glm4_moe::ARCHITECTURE];

/// gpt_oss (gpt-oss-20b/120b; description in `arch/gpt_oss.rs`): both
/// backends, HCS on the CUDA engine; its experts run in their checkpoint
/// precision, MXFP4, never re-quantized.
pub const GPT_OSS: Architecture = Architecture {
    model_type: gpt_oss::MODEL_TYPE,
    display_name: "gpt-oss",
    parse: |v, path| {
        Ok(ModelConfig::GptOss(gpt_oss::GptOssConfig::from_value(
            v, path,
        )?))
    },
    backends: &[Backend::Reference, Backend::Cuda],
    options: OptionSupport {
        expert_precisions: &["mxfp4"],
        // ActFormat::F16 (`AttentionSpec::activations`): the attention's
        // activations and its KV cache are FP16; its MLP block is BF16.
        attention_precisions: &["fp16"],
        kv_formats: &["fp16"],
        mlp_precisions: &["bf16"],
        hcs: true,
        // The CUDA engine's cache keeps the sliding layers' window with the
        // blocks at a prompt's end (`krasis_gpu::prefix`, `RingPart`).
        prefix_cache_backends: &[Backend::Reference, Backend::Cuda],
        pruning_modes: &["off"],
        multi_gpu_modes: &["single"],
        defaults: OptionDefaults {
            expert_precision: "mxfp4",
            attention_precision: "fp16",
            kv_format: "fp16",
            mlp_precision: "bf16",
            pruning: "off",
            multi_gpu: "single",
        },
    },
    presets: gpt_oss::presets::PRESETS,
};

/// One supported architecture: everything outside its module needs to know.
pub struct Architecture {
    /// Hugging Face `model_type` in `config.json`.
    pub model_type: &'static str,
    /// Human name of the family, shown in reports.
    pub display_name: &'static str,
    /// Parses and validates a `config.json` whose `model_type` is this one.
    pub parse: fn(Value, &Path) -> Result<ModelConfig, ModelError>,
    /// Backends that build this architecture.
    pub backends: &'static [Backend],
    /// Engine options implemented for it.
    pub options: OptionSupport,
    /// Built-in synth geometries of this family.
    pub presets: &'static [Preset],
}

/// Which engine options an architecture implements, and the recommended ones.
pub struct OptionSupport {
    pub expert_precisions: &'static [&'static str],
    pub attention_precisions: &'static [&'static str],
    pub kv_formats: &'static [&'static str],
    /// The MLP block's activation format (`MlpSpec::activations`).
    pub mlp_precisions: &'static [&'static str],
    /// HCS (hot expert cache in VRAM); a cuda-backend feature.
    pub hcs: bool,
    /// Backends whose prefix cache handles this family's layers
    /// (`krasis_gpu`'s test checks the CUDA engine's entry against its
    /// `prefix::unsupported` on every preset).
    pub prefix_cache_backends: &'static [Backend],
    pub pruning_modes: &'static [&'static str],
    pub multi_gpu_modes: &'static [&'static str],
    pub defaults: OptionDefaults,
}

pub struct OptionDefaults {
    pub expert_precision: &'static str,
    pub attention_precision: &'static str,
    pub kv_format: &'static str,
    pub mlp_precision: &'static str,
    pub pruning: &'static str,
    pub multi_gpu: &'static str,
}

/// A named synthetic geometry: the complete `config.json` it writes.
pub struct Preset {
    pub name: &'static str,
    /// One line for `synth --help`.
    pub summary: &'static str,
    pub config: fn() -> Value,
}

impl Architecture {
    /// This architecture's entry of the capability report.
    pub fn caps(&self) -> ArchitectureCaps {
        let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let o = &self.options;
        ArchitectureCaps {
            model_type: self.model_type.into(),
            display_name: self.display_name.into(),
            backends: self.backends.iter().map(|b| b.as_str().into()).collect(),
            expert_precisions: v(o.expert_precisions),
            attention_precisions: v(o.attention_precisions),
            kv_formats: v(o.kv_formats),
            mlp_precisions: v(o.mlp_precisions),
            hcs: o.hcs,
            prefix_cache_backends: o
                .prefix_cache_backends
                .iter()
                .map(|b| b.as_str().into())
                .collect(),
            pruning_modes: v(o.pruning_modes),
            multi_gpu_modes: v(o.multi_gpu_modes),
            defaults: ArchitectureDefaults {
                expert_precision: o.defaults.expert_precision.into(),
                attention_precision: o.defaults.attention_precision.into(),
                kv_format: o.defaults.kv_format.into(),
                mlp_precision: o.defaults.mlp_precision.into(),
                pruning: o.defaults.pruning.into(),
                multi_gpu: o.defaults.multi_gpu.into(),
            },
        }
    }
}

/// The registered architecture of `model_type`.
pub fn find(model_type: &str) -> Option<&'static Architecture> {
    ARCHITECTURES.iter().find(|a| a.model_type == model_type)
}

/// Every supported `model_type`, in registry order.
pub fn model_types() -> Vec<&'static str> {
    ARCHITECTURES.iter().map(|a| a.model_type).collect()
}

/// The capability-report entries of every architecture.
pub fn caps() -> Vec<ArchitectureCaps> {
    ARCHITECTURES.iter().map(Architecture::caps).collect()
}

/// Every preset with the architecture it belongs to.
pub fn presets() -> impl Iterator<Item = (&'static Architecture, &'static Preset)> {
    ARCHITECTURES
        .iter()
        .flat_map(|a| a.presets.iter().map(move |p| (a, p)))
}

/// The preset called `name`.
pub fn preset(name: &str) -> Option<(&'static Architecture, &'static Preset)> {
    presets().find(|(_, p)| p.name == name)
}

/// `base` with `fields` replaced: how a preset derives from another. Only
/// fields `base` already has may be set, so a preset cannot invent a
/// `config.json` key the real checkpoint lacks.
pub(crate) fn with_fields(mut base: Value, fields: Value) -> Value {
    for (k, x) in fields.as_object().expect("preset patch is an object") {
        assert!(base.get(k).is_some(), "preset patch adds unknown field {k}");
        base[k] = x.clone();
    }
    base
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn every_preset_parses_back_as_its_architecture() {
        for (arch, p) in presets() {
            let json = (p.config)();
            assert_eq!(json["model_type"], arch.model_type, "preset {}", p.name);
            let c = ModelConfig::from_json_str(&json.to_string(), Path::new(p.name))
                .unwrap_or_else(|e| panic!("preset {}: {e}", p.name));
            assert_eq!(c.model_type(), arch.model_type, "preset {}", p.name);
            // The entry's own parser gives the same config as dispatch.
            assert_eq!((arch.parse)(json, Path::new(p.name)).unwrap(), c);
        }
    }

    #[test]
    fn names_are_unique_and_entries_complete() {
        let mut types = HashSet::new();
        let mut presets_seen = HashSet::new();
        for a in ARCHITECTURES {
            assert!(types.insert(a.model_type), "{} twice", a.model_type);
            assert!(!a.backends.is_empty(), "{} has no backend", a.model_type);
            assert!(!a.presets.is_empty(), "{} has no preset", a.model_type);
            let o = &a.options;
            let d = &o.defaults;
            for (value, allowed) in [
                (d.expert_precision, o.expert_precisions),
                (d.attention_precision, o.attention_precisions),
                (d.kv_format, o.kv_formats),
                (d.mlp_precision, o.mlp_precisions),
                (d.pruning, o.pruning_modes),
                (d.multi_gpu, o.multi_gpu_modes),
            ] {
                assert!(
                    allowed.contains(&value),
                    "{}: default {value}",
                    a.model_type
                );
            }
            for p in a.presets {
                assert!(presets_seen.insert(p.name), "preset {} twice", p.name);
            }
        }
        assert!(find("llama").is_none());
        assert!(preset("nope").is_none());
    }

    /// The attention precision, KV format and MLP precision an
    /// architecture offers are the ones its description builds
    /// (`AttentionSpec::activations`, `MlpSpec::activations`), for every
    /// preset.
    #[test]
    fn precision_options_are_the_descriptions_formats() {
        for a in ARCHITECTURES {
            let o = &a.options;
            for p in a.presets {
                let json = (p.config)().to_string();
                let g = ModelConfig::from_json_str(&json, Path::new(p.name))
                    .unwrap()
                    .geometry();
                let name = g.attention.activations.name();
                assert_eq!(o.attention_precisions, [name], "{}", p.name);
                assert_eq!(o.kv_formats, [name], "{}", p.name);
                assert_eq!(o.defaults.attention_precision, name, "{}", p.name);
                assert_eq!(o.defaults.kv_format, name, "{}", p.name);
                let mlp = g.mlp.activations.name();
                assert_eq!(o.mlp_precisions, [mlp], "{}", p.name);
                assert_eq!(o.defaults.mlp_precision, mlp, "{}", p.name);
            }
        }
    }

    #[test]
    fn unsupported_model_type_lists_the_registry() {
        let e = ModelConfig::from_json_str(r#"{"model_type":"llama"}"#, Path::new("c.json"))
            .unwrap_err()
            .to_string();
        for t in model_types() {
            assert!(e.contains(t), "{e}");
        }
    }
}
