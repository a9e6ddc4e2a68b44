//! `glm4_moe` (GLM-4.5-Air, GLM-4.5, GLM-4.6): the description.
//!
//! GQA attention with q/k/v biases (no o bias), optional per-head q/k
//! RMSNorm (`use_qk_norm`: GLM-4.5/4.6 yes, Air no), partial rotary
//! (`partial_rotary_factor` 0.5: the first half of each head rotates,
//! `rotate_half` within it). The first `first_k_dense_replace` layers are
//! dense SwiGLU MLPs; the others are MoE with a sigmoid group-limited router
//! (choice on `sigmoid + e_score_correction_bias`, weights the bias-free
//! sigmoid scores renormalised and scaled by `routed_scaling_factor`),
//! SwiGLU experts and one ungated shared expert added to the routed output.
//! The next-token-prediction (MTP) layer the checkpoints carry at index
//! `num_hidden_layers` is skipped on load, as transformers and vLLM do.

pub mod presets;

use super::registry::{Architecture, OptionDefaults, OptionSupport};
use super::{
    ActFormat, Activation, AttentionKind, AttentionSpec, CommonShape, ExpertSpec, Geometry,
    LayerSpec, LayerTensor, MlpKind, MlpSpec, ModelConfig, ModelTensor, RopeScaling, RopeSpec,
    RouterKind, RouterSpec,
};
use crate::error::ModelError;
use krasis_common::Backend;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The `model_type` of these checkpoints.
pub const MODEL_TYPE: &str = "glm4_moe";

/// The registry entry: both engines build it; the CUDA engine runs the
/// BF16 checkpoint experts from the INT4 expert cache (as qwen3_moe), with
/// HCS; BF16 attention and KV cache, the MLP block in FP16
/// (`MlpSpec::activations`), one GPU.
pub const ARCHITECTURE: Architecture = Architecture {
    model_type: MODEL_TYPE,
    display_name: "GLM-4.5 MoE",
    parse: |v, path| Ok(ModelConfig::Glm4Moe(Glm4MoeConfig::from_value(v, path)?)),
    backends: &[Backend::Reference, Backend::Cuda],
    options: OptionSupport {
        expert_precisions: &["int4"],
        attention_precisions: &["bf16"],
        kv_formats: &["bf16"],
        mlp_precisions: &["fp16"],
        hcs: true,
        prefix_cache_backends: &[Backend::Reference, Backend::Cuda],
        pruning_modes: &["off"],
        multi_gpu_modes: &["single"],
        defaults: OptionDefaults {
            expert_precision: "int4",
            attention_precision: "bf16",
            kv_format: "bf16",
            mlp_precision: "fp16",
            pruning: "off",
            multi_gpu: "single",
        },
    },
    presets: presets::PRESETS,
};

fn default_partial_rotary() -> f64 {
    0.5
}
fn default_eps() -> f64 {
    1e-5
}
fn default_one() -> usize {
    1
}
fn default_true() -> bool {
    true
}
fn default_scale() -> f64 {
    1.0
}

/// The fields of a `glm4_moe` `config.json` this engine uses. Unknown
/// fields are ignored. Defaults are transformers' `Glm4MoeConfig`'s except
/// where the published checkpoints always give the field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Glm4MoeConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// The dense MLP width (layers below `first_k_dense_replace`).
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_partial_rotary")]
    pub partial_rotary_factor: f64,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub use_qk_norm: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    pub n_routed_experts: usize,
    #[serde(default)]
    pub n_shared_experts: usize,
    pub num_experts_per_tok: usize,
    #[serde(default = "default_one")]
    pub n_group: usize,
    #[serde(default = "default_one")]
    pub topk_group: usize,
    #[serde(default = "default_scale")]
    pub routed_scaling_factor: f64,
    #[serde(default = "default_true")]
    pub norm_topk_prob: bool,
    #[serde(default = "default_one")]
    pub first_k_dense_replace: usize,
    /// MTP layers stored after the decoder layers (skipped on load).
    #[serde(default)]
    pub num_nextn_predict_layers: usize,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub pad_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub torch_dtype: Option<String>,
}

impl Glm4MoeConfig {
    pub fn from_value(value: serde_json::Value, path: &Path) -> Result<Self, ModelError> {
        let bad = |reason: String| ModelError::BadConfig {
            path: path.to_path_buf(),
            reason,
        };
        let c: Glm4MoeConfig = serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
        CommonShape {
            hidden: c.hidden_size,
            layers: c.num_hidden_layers,
            vocab: c.vocab_size,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim(),
            top_k: c.num_experts_per_tok,
            experts: c.n_routed_experts,
            experts_field: "n_routed_experts",
        }
        .check()
        .map_err(bad)?;
        if let Some(act) = &c.hidden_act
            && act != "silu"
        {
            return Err(bad(format!(
                "hidden_act '{act}' is not supported (only 'silu')"
            )));
        }
        if let Some(s) = &c.rope_scaling
            && !s.is_null()
        {
            return Err(bad(format!(
                "rope_scaling {s} is not supported for glm4_moe (the published checkpoints have none)"
            )));
        }
        let r = c.rotary_dim();
        if !(c.partial_rotary_factor > 0.0 && c.partial_rotary_factor <= 1.0)
            || r < 2
            || !r.is_multiple_of(2)
        {
            return Err(bad(format!(
                "partial_rotary_factor {} gives {r} rotary dimensions of head_dim {}; it must give an even number >= 2",
                c.partial_rotary_factor,
                c.head_dim()
            )));
        }
        let (e, g, kg) = (c.n_routed_experts, c.n_group, c.topk_group);
        if g == 0 || !e.is_multiple_of(g) || kg == 0 || kg > g {
            return Err(bad(format!(
                "n_group {g} / topk_group {kg} do not split {e} routed experts into equal groups keeping 1..=n_group of them"
            )));
        }
        if c.num_experts_per_tok > kg * (e / g) {
            return Err(bad(format!(
                "num_experts_per_tok {} exceeds the {} experts of the {kg} groups kept",
                c.num_experts_per_tok,
                kg * (e / g)
            )));
        }
        if g > 1 && e / g < 2 {
            return Err(bad(format!(
                "groups of {} expert(s): a group is scored by its two best experts",
                e / g
            )));
        }
        if !(c.routed_scaling_factor > 0.0 && c.routed_scaling_factor.is_finite()) {
            return Err(bad(format!(
                "routed_scaling_factor {} must be > 0",
                c.routed_scaling_factor
            )));
        }
        if c.first_k_dense_replace > c.num_hidden_layers {
            return Err(bad(format!(
                "first_k_dense_replace {} exceeds the {} layers",
                c.first_k_dense_replace, c.num_hidden_layers
            )));
        }
        if c.first_k_dense_replace > 0 && c.intermediate_size == 0 {
            return Err(bad("dense layers present but intermediate_size is 0".into()));
        }
        if c.moe_intermediate_size == 0 {
            return Err(bad("moe_intermediate_size must be >= 1".into()));
        }
        Ok(c)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// transformers: `int(head_dim * partial_rotary_factor)`.
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim() as f64 * self.partial_rotary_factor) as usize
    }

    pub fn geometry(&self) -> Geometry {
        let hd = self.head_dim();
        Geometry {
            vocab_size: self.vocab_size,
            hidden: self.hidden_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads,
            head_dim: hd,
            intermediate: self.intermediate_size,
            expert_intermediate: self.moe_intermediate_size,
            num_experts: self.n_routed_experts,
            top_k: self.num_experts_per_tok,
            shared_intermediate: (self.n_shared_experts > 0)
                .then(|| self.moe_intermediate_size * self.n_shared_experts),
            rms_norm_eps: self.rms_norm_eps as f32,
            max_position_embeddings: self.max_position_embeddings,
            tie_word_embeddings: self.tie_word_embeddings,
            rope: RopeSpec {
                theta: self.rope_theta,
                scaling: RopeScaling::None,
                rotary_dim: Some(self.rotary_dim()).filter(|&r| r != hd),
            },
            // Glm4MoeAttention: q/k/v get `attention_bias`, o_proj never.
            attention: AttentionSpec {
                qk_norm: self.use_qk_norm,
                qkv_bias: self.attention_bias,
                o_bias: false,
                sinks: false,
                activations: ActFormat::Bf16,
            },
            // Its MLP outputs are large against the residual (routed
            // scaling plus the shared expert): BF16 there exceeds the GPU
            // check's bound, FP16 does not (ActFormat). The attention stays
            // BF16 (FP16 attention alone measured 0.92 bounds, and its
            // partial rotary has a BF16 kernel only).
            mlp: MlpSpec {
                activations: ActFormat::F16,
            },
            router: RouterSpec {
                kind: RouterKind::SigmoidGroupedTopK {
                    groups: self.n_group,
                    topk_groups: self.topk_group,
                    renormalize: self.norm_topk_prob,
                    scale: self.routed_scaling_factor as f32,
                },
                bias: false,
                selection_bias: true,
            },
            experts: ExpertSpec {
                activation: Activation::Swiglu,
                bias: false,
            },
            layers: (0..self.num_hidden_layers)
                .map(|l| LayerSpec {
                    attention: AttentionKind::Full,
                    mlp: if l < self.first_k_dense_replace {
                        MlpKind::Dense
                    } else {
                        MlpKind::Moe
                    },
                })
                .collect(),
        }
    }

    /// Name prefixes of the MTP layers (`model.layers.{N + i}.`), which
    /// the checkpoints carry and no engine here runs: loaders skip them
    /// (transformers' `_keys_to_ignore_on_load_unexpected`, vLLM's
    /// `get_spec_layer_idx_from_weight_name`).
    pub fn skipped_prefixes(&self) -> Vec<String> {
        (0..self.num_nextn_predict_layers)
            .map(|i| format!("model.layers.{}.", self.num_hidden_layers + i))
            .collect()
    }

    /// The MTP layers' tensors as the published checkpoints lay them out
    /// (vLLM `glm4_moe_mtp.py`): a MoE decoder layer plus `enorm`, `hnorm`,
    /// `eh_proj` `[H, 2H]`, `shared_head.norm`, `shared_head.head` and
    /// `embed_tokens`. Synth writes them so loaders meet them as they
    /// would in a download.
    pub fn mtp_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let g = self.geometry();
        let (h, v) = (g.hidden, g.vocab_size);
        let mut moe = g.clone();
        moe.layers = vec![LayerSpec {
            attention: AttentionKind::Full,
            mlp: MlpKind::Moe,
        }];
        let mut out = Vec::new();
        for i in 0..self.num_nextn_predict_layers {
            let l = self.num_hidden_layers + i;
            for (role, shape) in LayerTensor::present(&moe, 0) {
                out.push((TensorNames::layer(l, role), shape));
            }
            for e in 0..g.num_experts {
                let [gate, up, down] = TensorNames::expert(l, e);
                out.push((gate, vec![g.expert_intermediate, h]));
                out.push((up, vec![g.expert_intermediate, h]));
                out.push((down, vec![h, g.expert_intermediate]));
            }
            let p = |s: &str| format!("model.layers.{l}.{s}");
            out.extend([
                (p("enorm.weight"), vec![h]),
                (p("hnorm.weight"), vec![h]),
                (p("eh_proj.weight"), vec![h, 2 * h]),
                (p("shared_head.norm.weight"), vec![h]),
                (p("shared_head.head.weight"), vec![v, h]),
                (p("embed_tokens.weight"), vec![v, h]),
            ]);
        }
        out
    }
}

/// Typed tensor names of a `glm4_moe` checkpoint.
pub struct TensorNames;

impl TensorNames {
    pub fn model(t: ModelTensor) -> &'static str {
        super::tensors::hf_model_name(t)
    }

    /// The name of role `t` of layer `l` (sinks, router and o biases, which
    /// this family never has, get the names they would have).
    pub fn layer(l: usize, t: LayerTensor) -> String {
        super::tensors::hf_layer_name(l, t, "mlp.gate")
    }

    /// (gate, up, down) of routed expert `e` of layer `l`.
    pub fn expert(l: usize, e: usize) -> [String; 3] {
        ["gate_proj", "up_proj", "down_proj"]
            .map(|p| format!("model.layers.{l}.mlp.experts.{e}.{p}.weight"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn air() -> serde_json::Value {
        presets::glm_4_5_air()
    }

    /// GLM-4.5-Air is "106B total, 12B active": the geometry's count (the
    /// decoder layers, without the MTP layer) is ~106.8B.
    #[test]
    fn air_geometry_and_params() {
        let c = Glm4MoeConfig::from_value(air(), Path::new("config.json")).unwrap();
        let g = c.geometry();
        assert_eq!(g.num_moe_layers(), 45);
        assert_eq!(g.mlp_kind(0), MlpKind::Dense);
        assert_eq!(g.rope.rotary_dim, Some(64));
        assert_eq!(g.shared_intermediate, Some(1408));
        assert_eq!(g.q_dim(), 12288);
        assert!(!g.attention.o_bias && g.attention.qkv_bias && !g.attention.qk_norm);
        // The MLP block in FP16, the attention in BF16 (ActFormat).
        assert_eq!(g.mlp.activations, ActFormat::F16);
        assert_eq!(g.attention.activations, ActFormat::Bf16);
        let p = g.total_params() as f64 / 1e9;
        assert!((100.0..108.0).contains(&p), "{p}");
        assert_eq!(c.skipped_prefixes(), ["model.layers.46."]);
    }

    #[test]
    fn glm_4_5_has_qk_norm_three_dense_layers_and_scaled_routing() {
        let c = Glm4MoeConfig::from_value(presets::glm_4_5(), Path::new("c")).unwrap();
        let g = c.geometry();
        assert!(g.attention.qk_norm);
        assert_eq!(g.num_layers - g.num_moe_layers(), 3);
        assert_eq!(
            g.router.kind,
            RouterKind::SigmoidGroupedTopK {
                groups: 1,
                topk_groups: 1,
                renormalize: true,
                scale: 2.5
            }
        );
        // GLM-4.5: "355B total"; the decoder layers alone are ~353B.
        let p = g.total_params() as f64 / 1e9;
        assert!((340.0..356.0).contains(&p), "{p}");
    }

    #[test]
    fn bad_fields_are_refused_with_the_field() {
        for (field, value, says) in [
            ("n_group", serde_json::json!(3), "n_group 3"),
            ("topk_group", serde_json::json!(0), "topk_group 0"),
            (
                "partial_rotary_factor",
                serde_json::json!(0.01),
                "partial_rotary_factor",
            ),
            ("hidden_act", serde_json::json!("gelu"), "hidden_act"),
            (
                "routed_scaling_factor",
                serde_json::json!(0),
                "routed_scaling_factor",
            ),
            (
                "first_k_dense_replace",
                serde_json::json!(47),
                "first_k_dense_replace",
            ),
            (
                "rope_scaling",
                serde_json::json!({"type": "yarn"}),
                "rope_scaling",
            ),
        ] {
            let mut v = air();
            v[field] = value;
            let e = Glm4MoeConfig::from_value(v, Path::new("c")).unwrap_err();
            assert!(e.to_string().contains(says), "{field}: {e}");
        }
    }

    #[test]
    fn mtp_tensors_sit_under_the_skipped_prefix() {
        let c = Glm4MoeConfig::from_value(presets::tiny(), Path::new("c")).unwrap();
        let prefixes = c.skipped_prefixes();
        let mtp = c.mtp_tensors();
        assert!(mtp.iter().all(|(n, _)| n.starts_with(&prefixes[0])));
        assert!(
            mtp.iter().any(|(n, s)| n.ends_with("eh_proj.weight")
                && s == &vec![c.hidden_size, 2 * c.hidden_size])
        );
        assert!(
            mtp.iter()
                .any(|(n, _)| n.ends_with("mlp.experts.0.down_proj.weight"))
        );
    }
}
