//! What determines a synthetic checkpoint's contents: preset, `--set`
//! overrides, seed, dtype and router skew. Everything else (shard size,
//! tokenizer, which tensors are written) only changes packaging.

use super::error::SynthError;
use super::presets::preset_config;
use super::record::SynthRecord;
use super::values::{Init, fill_f32, router_scales};
use crate::arch::{ExpertStorage, ModelConfig, ModelTensor};
use crate::experts::ExpertF32;
use crate::{Geometry, MlpKind};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

/// INT4 group size of the expert cache: hidden and expert widths must be
/// multiples of it.
const INT4_GROUP: usize = 128;

/// Std of the RMSNorm-weight noise around 1.
const NORM_NOISE_STD: f32 = 0.05;
/// Std of attention biases (only present with `attention_bias=true`).
pub(super) const BIAS_STD: f32 = 0.1;
/// An untied LM head of std `LM_HEAD_GAIN / sqrt(hidden)` gives logits of
/// std ~4: with std 1 the top-2 gap over a 152K vocabulary is often below
/// 1e-3, so argmax comparisons between implementations would hinge on
/// rounding noise. Real models are similarly peaky.
const LM_HEAD_GAIN: f32 = 4.0;
/// Std of attention-sink logits (gpt_oss): attention scores of unit-RMS
/// q/k are about N(0, 1) too, so a sink takes a share comparable to one
/// position's, neither absorbing all attention nor vanishing. (Recorded as
/// `record::SINK_RULE`.)
const SINK_STD: f32 = 1.0;
/// Std of router selection biases (glm4_moe `e_score_correction_bias`):
/// sigmoid scores of unit-RMS router logits spread over ~0.3..0.7, so a
/// bias of ~0.05 moves choices near the top-k boundary without deciding
/// them all, as the load-balancing bias does in a trained model.
const SELECTION_BIAS_STD: f32 = 0.05;
/// How checkpoints name the selection bias (`...mlp.gate.e_score_correction_bias`).
const SELECTION_BIAS_SUFFIX: &str = "e_score_correction_bias";

/// A selection bias: drawn around 0, stored F32 whatever `--dtype`.
fn selection_bias_init() -> (Init, Storage) {
    (
        Init::Normal {
            std: SELECTION_BIAS_STD,
        },
        Storage::F32,
    )
}

/// Element type of the stored tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SynthDtype {
    Bf16,
    F32,
}

impl SynthDtype {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "bf16" => Some(SynthDtype::Bf16),
            "f32" => Some(SynthDtype::F32),
            _ => None,
        }
    }
    /// The CLI / `krasis_synth.json` spelling.
    pub fn name(self) -> &'static str {
        match self {
            SynthDtype::Bf16 => "bf16",
            SynthDtype::F32 => "f32",
        }
    }
    /// The safetensors header spelling.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            SynthDtype::Bf16 => "BF16",
            SynthDtype::F32 => "F32",
        }
    }
    /// The `torch_dtype` of `config.json`.
    pub fn torch_name(self) -> &'static str {
        match self {
            SynthDtype::Bf16 => "bfloat16",
            SynthDtype::F32 => "float32",
        }
    }
    pub fn size(self) -> usize {
        match self {
            SynthDtype::Bf16 => 2,
            SynthDtype::F32 => 4,
        }
    }
}

/// One tensor of the checkpoint and how its values are drawn.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorDesc {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
    /// A routed expert's tensor (weights, MXFP4 parts or biases).
    pub routed_expert: bool,
    pub storage: Storage,
}

/// How a tensor's values reach the file.
#[derive(Debug, Clone, PartialEq)]
pub enum Storage {
    /// Floats of the spec's dtype, drawn under the tensor's own name.
    Float,
    /// Floats stored as F32 whatever the spec's dtype, drawn under the
    /// tensor's own name (glm4_moe's `e_score_correction_bias`, which the
    /// published checkpoints keep in f32).
    F32,
    /// One U8 part of an MXFP4 projection: f32 values drawn from the
    /// tensor's `init` under the name `source` (the projection, e.g.
    /// `model.layers.0.mlp.experts.gate_up_proj`, element `i` of its
    /// row-major `[E, rows, cols]`), never rounded through the dtype, then
    /// encoded by [`crate::formats::mxfp4::encode_rows`].
    Mxfp4 { part: Mxfp4Part, source: String },
}

/// Which of an MXFP4 projection's two tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mxfp4Part {
    /// `*_blocks`: 16 bytes per 32 values.
    Blocks,
    /// `*_scales`: one E8M0 byte per 32 values.
    Scales,
}

impl TensorDesc {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Values drawn to produce the tensor: its elements, or for an MXFP4
    /// part the source values it encodes.
    pub fn source_numel(&self) -> usize {
        match &self.storage {
            Storage::Float | Storage::F32 => self.numel(),
            Storage::Mxfp4 {
                part: Mxfp4Part::Blocks,
                ..
            } => self.numel() * 2,
            Storage::Mxfp4 {
                part: Mxfp4Part::Scales,
                ..
            } => self.numel() * crate::formats::mxfp4::BLOCK_VALUES,
        }
    }
    /// Bytes of the stored tensor.
    pub fn bytes(&self, dtype: SynthDtype) -> u64 {
        match self.storage {
            Storage::Float | Storage::F32 => (self.numel() * self.float_dtype(dtype).size()) as u64,
            Storage::Mxfp4 { .. } => self.numel() as u64,
        }
    }
    /// The safetensors header spelling of its element type.
    pub fn safetensors_dtype(&self, dtype: SynthDtype) -> &'static str {
        match self.storage {
            Storage::Float | Storage::F32 => self.float_dtype(dtype).safetensors_name(),
            Storage::Mxfp4 { .. } => crate::formats::mxfp4::STORAGE_DTYPE,
        }
    }
    /// The float type its values are stored (and rounded) in under the
    /// spec's `dtype`.
    pub fn float_dtype(&self, dtype: SynthDtype) -> SynthDtype {
        match self.storage {
            Storage::F32 => SynthDtype::F32,
            _ => dtype,
        }
    }
    /// Elements per row (the last dimension).
    pub fn row_len(&self) -> usize {
        self.shape.last().copied().unwrap_or(1).max(1)
    }
}

/// A fully validated description of a synthetic model.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthSpec {
    pub preset: String,
    pub seed: u64,
    pub dtype: SynthDtype,
    /// Router skew exponent `s` (0 = no skew); see [`super::values::router_scales`].
    pub router_skew: f32,
    /// `--set` overrides applied to the preset, in first-set order (the last
    /// value of a repeated key wins).
    pub overrides: serde_json::Map<String, Value>,
    config_json: Value,
    config: ModelConfig,
}

/// Parses one `--set key=value`. The value is JSON; a bare word that is not
/// valid JSON is taken as a string (`--set hidden_act=silu`).
pub fn parse_override(arg: &str) -> Result<(String, Value), SynthError> {
    let (key, raw) = arg.split_once('=').ok_or_else(|| SynthError::BadOverride {
        key: arg.to_string(),
        reason: "expected key=value, e.g. --set num_hidden_layers=4".into(),
    })?;
    let key = key.trim();
    if key.is_empty() {
        return Err(SynthError::BadOverride {
            key: arg.to_string(),
            reason: "empty key".into(),
        });
    }
    let value =
        serde_json::from_str(raw.trim()).unwrap_or_else(|_| Value::String(raw.trim().to_string()));
    Ok((key.to_string(), value))
}

fn same_kind(old: &Value, new: &Value) -> bool {
    matches!(
        (old, new),
        (Value::Null, _)
            | (Value::Bool(_), Value::Bool(_))
            | (Value::Number(_), Value::Number(_))
            | (Value::String(_), Value::String(_))
            | (Value::Array(_), Value::Array(_))
            | (Value::Object(_), Value::Object(_))
    ) || (!old.is_null() && new.is_null())
}

impl SynthSpec {
    /// Builds and validates a spec. Overrides may only name fields the
    /// preset's `config.json` has (a typo must not silently add a field), must
    /// keep the field's JSON type, and the result must pass the typed
    /// `qwen3_moe` config validation plus the INT4 width rule.
    pub fn new(
        preset: &str,
        seed: u64,
        dtype: SynthDtype,
        router_skew: f32,
        overrides: &[(String, Value)],
    ) -> Result<Self, SynthError> {
        let mut config_json = preset_config(preset).ok_or_else(|| SynthError::UnknownPreset {
            name: preset.to_string(),
        })?;
        if !router_skew.is_finite() || router_skew < 0.0 {
            return Err(SynthError::BadSpec(format!(
                "--router-skew must be a finite number >= 0, got {router_skew}"
            )));
        }
        let mut recorded = serde_json::Map::new();
        for (key, value) in overrides {
            let obj = config_json.as_object_mut().expect("preset is an object");
            if key == "torch_dtype" || key == "dtype" {
                return Err(SynthError::BadOverride {
                    key: key.clone(),
                    reason: "the stored dtype is chosen with --dtype bf16|f32".into(),
                });
            }
            let Some(old) = obj.get_mut(key) else {
                let mut known: Vec<&str> = obj.keys().map(|k| k.as_str()).collect();
                known.sort_unstable();
                return Err(SynthError::BadOverride {
                    key: key.clone(),
                    reason: format!(
                        "not a config.json field of preset '{preset}'; known fields: {}",
                        known.join(", ")
                    ),
                });
            };
            if !same_kind(old, value) {
                return Err(SynthError::BadOverride {
                    key: key.clone(),
                    reason: format!("{value} has a different JSON type than the preset's {old}"),
                });
            }
            *old = value.clone();
            recorded.insert(key.clone(), value.clone());
        }
        config_json["torch_dtype"] = Value::String(dtype.torch_name().into());
        let config = ModelConfig::from_json_str(
            &config_json.to_string(),
            Path::new("<synthesized config.json>"),
        )?;
        let g = config.geometry();
        // The INT4 width rule binds only where the cache quantizes float
        // experts; MXFP4 checkpoints (gpt_oss) keep their own 32-value
        // blocks, which their config validation already checks.
        let fused = g
            .moe_layers()
            .any(|l| matches!(config.expert_storage(l), ExpertStorage::FusedMxfp4(_)));
        if !fused && !g.hidden.is_multiple_of(INT4_GROUP) {
            return Err(SynthError::BadSpec(format!(
                "hidden_size {} must be a multiple of {INT4_GROUP} (the INT4 group size)",
                g.hidden
            )));
        }
        if !fused && g.num_moe_layers() > 0 && !g.expert_intermediate.is_multiple_of(INT4_GROUP) {
            return Err(SynthError::BadSpec(format!(
                "moe_intermediate_size {} must be a multiple of {INT4_GROUP} (the INT4 group size)",
                g.expert_intermediate
            )));
        }
        Ok(SynthSpec {
            preset: preset.to_string(),
            seed,
            dtype,
            router_skew,
            overrides: recorded,
            config_json,
            config,
        })
    }

    /// Rebuilds the spec of a checkpoint written by `synth` from its
    /// `krasis_synth.json`, and checks that its `config.json` is still the one
    /// that spec produces (fail closed on edited or foreign checkpoints).
    pub fn from_checkpoint_dir(dir: &Path) -> Result<Self, SynthError> {
        let record = SynthRecord::load(dir)?;
        let overrides: Vec<(String, Value)> = record.overrides.clone().into_iter().collect();
        let spec = SynthSpec::new(
            &record.preset,
            record.seed,
            record.dtype()?,
            record.router_skew,
            &overrides,
        )?;
        let on_disk = ModelConfig::load(dir)?;
        if on_disk != spec.config {
            return Err(SynthError::BadRecord {
                path: dir.join("config.json"),
                reason: "does not match the model krasis_synth.json describes (edited after synthesis?); re-run synth".into(),
            });
        }
        Ok(spec)
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn geometry(&self) -> Geometry {
        self.config.geometry()
    }

    /// The `config.json` this spec writes.
    pub fn config_json(&self) -> &Value {
        &self.config_json
    }

    /// Every tensor of the checkpoint, in file order.
    pub fn tensors(&self) -> Vec<TensorDesc> {
        let g = self.geometry();
        let mut special = self.layer_inits(&g);
        special.extend(super::mxfp4::fused_expert_tensors(&self.config, &g));
        // The tensors loaders skip (MTP layers) are written too, as a
        // download has them; their selection biases are F32 as the layers'.
        let skipped = self.config.skipped_tensors();
        for (name, _) in &skipped {
            if name.ends_with(SELECTION_BIAS_SUFFIX) {
                special.insert(name.clone(), selection_bias_init());
            }
        }
        self.config
            .expected_tensors()
            .into_iter()
            .chain(skipped)
            .map(|(name, shape)| {
                let (init, storage) = special
                    .remove(&name)
                    .unwrap_or_else(|| (self.init_for(&name, &shape, &g), Storage::Float));
                let routed_expert = name.contains(".mlp.experts.");
                TensorDesc {
                    name,
                    shape,
                    init,
                    routed_expert,
                    storage,
                }
            })
            .collect()
    }

    /// The tensor called `name`, if the checkpoint has one.
    pub fn tensor(&self, name: &str) -> Option<TensorDesc> {
        self.tensors().into_iter().find(|t| t.name == name)
    }

    /// Layer tensors drawn by role rather than by shape: routers (with the
    /// skew), router biases and attention sinks.
    fn layer_inits(&self, g: &Geometry) -> HashMap<String, (Init, Storage)> {
        use crate::arch::LayerTensor;
        let mut m = HashMap::new();
        for l in 0..g.num_layers {
            let name = |t| self.config.layer_tensor_name(l, t);
            if g.attention.sinks {
                m.insert(
                    name(LayerTensor::Sinks),
                    (Init::Normal { std: SINK_STD }, Storage::Float),
                );
            }
            if g.mlp_kind(l) != MlpKind::Moe {
                continue;
            }
            let router = name(LayerTensor::Router);
            let init = Init::Router {
                std: 1.0 / (g.hidden as f32).sqrt(),
                scales: router_scales(self.seed, &router, g.num_experts, self.router_skew),
            };
            m.insert(router, (init, Storage::Float));
            if g.router.bias {
                m.insert(
                    name(LayerTensor::RouterBias),
                    (Init::Normal { std: BIAS_STD }, Storage::Float),
                );
            }
            if g.router.selection_bias {
                m.insert(
                    name(LayerTensor::RouterSelectionBias),
                    selection_bias_init(),
                );
            }
        }
        m
    }

    /// Scales: embeddings ~N(0,1); every projection ~N(0, 1/fan_in) so a
    /// unit-RMS input gives unit-RMS outputs (activations neither vanish nor
    /// blow up with depth); norms near 1; the LM head a little larger.
    /// (Routers, router biases and sinks: [`Self::layer_inits`].)
    pub(super) fn init_for(&self, name: &str, shape: &[usize], g: &Geometry) -> Init {
        if name == self.config.tensor_name(ModelTensor::Embed) {
            Init::Normal { std: 1.0 }
        } else if name == self.config.tensor_name(ModelTensor::LmHead) {
            Init::Normal {
                std: LM_HEAD_GAIN / (g.hidden as f32).sqrt(),
            }
        } else if shape.len() == 1 && name.ends_with(".bias") {
            Init::Normal { std: BIAS_STD }
        } else if shape.len() == 1 {
            Init::NearOne {
                std: NORM_NOISE_STD,
            }
        } else {
            Init::Normal {
                std: 1.0 / (shape[1] as f32).sqrt(),
            }
        }
    }

    /// The values of one whole tensor as stored (rounded through the dtype),
    /// or `None` if the checkpoint has no tensor of that name.
    pub fn tensor_f32(&self, name: &str) -> Option<Vec<f32>> {
        let t = self
            .tensor(name)
            .filter(|t| matches!(t.storage, Storage::Float | Storage::F32))?;
        let mut out = vec![0f32; t.numel()];
        fill_f32(
            self.seed,
            &t.name,
            &t.init,
            t.float_dtype(self.dtype),
            t.row_len(),
            0,
            &mut out,
        );
        Some(out)
    }

    /// One row of a 2-D tensor (e.g. a token's embedding) without generating
    /// the rest of it.
    pub fn tensor_row_f32(&self, name: &str, row: usize) -> Option<Vec<f32>> {
        let t = self
            .tensor(name)
            .filter(|t| matches!(t.storage, Storage::Float | Storage::F32))?;
        if t.shape.len() != 2 || row >= t.shape[0] {
            return None;
        }
        let mut out = vec![0f32; t.shape[1]];
        fill_f32(
            self.seed,
            &t.name,
            &t.init,
            t.float_dtype(self.dtype),
            t.row_len(),
            row * t.shape[1],
            &mut out,
        );
        Some(out)
    }

    /// Is `layer` a MoE layer with an expert `expert`?
    pub fn has_expert(&self, layer: usize, expert: usize) -> bool {
        let g = self.geometry();
        layer < g.num_layers && g.mlp_kind(layer) == MlpKind::Moe && expert < g.num_experts
    }
}

/// The exact f32 values of one routed expert as the checkpoint stores them
/// (already rounded through the spec's dtype, or decoded from its MXFP4
/// bytes, biases included), generated on their own. Values depend only on
/// (seed, tensor name), so this is defined for any indices; callers iterate
/// the geometry (see [`SynthSpec::has_expert`]).
pub fn expert_weights(spec: &SynthSpec, layer: usize, expert: usize) -> ExpertF32 {
    if let Some(raw) = super::mxfp4::expert_mxfp4(spec, layer, expert) {
        return super::mxfp4::decode_expert(spec, layer, &raw);
    }
    let g = spec.geometry();
    let (h, i) = (g.hidden, g.expert_intermediate);
    let [gate, up, down] = spec.config.expert_tensor_names(layer, expert);
    let gen_one = |name: &str, shape: [usize; 2]| {
        let init = spec.init_for(name, &shape, &g);
        let mut v = vec![0f32; shape[0] * shape[1]];
        fill_f32(spec.seed, name, &init, spec.dtype, shape[1], 0, &mut v);
        v
    };
    ExpertF32 {
        gate: gen_one(&gate, [i, h]),
        up: gen_one(&up, [i, h]),
        down: gen_one(&down, [h, i]),
        bias: None,
    }
}
