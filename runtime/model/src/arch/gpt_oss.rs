//! `gpt_oss` (gpt-oss-20b, gpt-oss-120b): the description.
//!
//! Attention with q/k/v/o biases, no q/k norm, a learned sink logit per
//! head, layers alternating 128-token sliding-window and full attention
//! (`layer_types`), YaRN RoPE (factor 32 over 4,096 original positions,
//! θ 150,000). Every layer is MoE: a linear router with bias, top-k of its
//! logits then a softmax over the k, experts with biases and the clamped
//! SwiGLU (`swiglu_limit` 7.0, α 1.702 as transformers hard-codes it), stored
//! as MXFP4 (`*_blocks` + `*_scales`, gate/up rows interleaved).

pub mod presets;

use super::{
    ActFormat, Activation, AttentionKind, AttentionSpec, CommonShape, ExpertSpec, ExpertStorage,
    FusedMxfp4Names, Geometry, LayerSpec, LayerTensor, MlpKind, MlpSpec, ModelTensor, RopeScaling,
    RopeSpec, RouterKind, RouterSpec,
};
use crate::error::ModelError;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The `model_type` of these checkpoints.
pub const MODEL_TYPE: &str = "gpt_oss";

/// `alpha` of the clamped SwiGLU (transformers `GptOssExperts.alpha`; not
/// in `config.json`).
pub const SWIGLU_ALPHA: f32 = 1.702;

const SLIDING: &str = "sliding_attention";
const FULL: &str = "full_attention";

fn default_eps() -> f64 {
    1e-5
}
fn default_limit() -> f64 {
    7.0
}
fn default_true() -> bool {
    true
}

/// The fields of a `gpt_oss` `config.json` this engine uses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GptOssConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// The expert FFN width.
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub num_local_experts: usize,
    pub num_experts_per_tok: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<serde_json::Value>,
    pub max_position_embeddings: usize,
    pub sliding_window: usize,
    pub layer_types: Vec<String>,
    #[serde(default = "default_limit")]
    pub swiglu_limit: f64,
    #[serde(default = "default_true")]
    pub attention_bias: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub quantization_config: Option<serde_json::Value>,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub pad_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub torch_dtype: Option<String>,
}

impl GptOssConfig {
    pub fn from_value(value: serde_json::Value, path: &Path) -> Result<Self, ModelError> {
        let bad = |reason: String| ModelError::BadConfig {
            path: path.to_path_buf(),
            reason,
        };
        let c: GptOssConfig = serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
        CommonShape {
            hidden: c.hidden_size,
            layers: c.num_hidden_layers,
            vocab: c.vocab_size,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            top_k: c.num_experts_per_tok,
            experts: c.num_local_experts,
            experts_field: "num_local_experts",
        }
        .check()
        .map_err(bad)?;
        if c.head_dim == 0 {
            return Err(bad(format!(
                "head_dim {} must be even for RoPE",
                c.head_dim
            )));
        }
        let b = crate::formats::mxfp4::BLOCK_VALUES;
        if !c.hidden_size.is_multiple_of(b) || !c.intermediate_size.is_multiple_of(b) {
            return Err(bad(format!(
                "hidden_size {} and intermediate_size {} must be multiples of the MXFP4 block ({b})",
                c.hidden_size, c.intermediate_size
            )));
        }
        if c.layer_types.len() != c.num_hidden_layers {
            return Err(bad(format!(
                "layer_types has {} entries for {} layers",
                c.layer_types.len(),
                c.num_hidden_layers
            )));
        }
        if let Some(t) = c.layer_types.iter().find(|t| *t != SLIDING && *t != FULL) {
            return Err(bad(format!(
                "layer_types entry '{t}' is not supported ('{SLIDING}' or '{FULL}')"
            )));
        }
        if c.sliding_window == 0 {
            return Err(bad("sliding_window must be >= 1".into()));
        }
        if !c.attention_bias {
            return Err(bad(
                "attention_bias=false: every published gpt-oss checkpoint has attention biases"
                    .into(),
            ));
        }
        if !(c.swiglu_limit > 0.0 && c.swiglu_limit.is_finite()) {
            return Err(bad(format!("swiglu_limit {} must be > 0", c.swiglu_limit)));
        }
        let quant = c
            .quantization_config
            .as_ref()
            .and_then(|q| q.get("quant_method"))
            .and_then(|m| m.as_str());
        if quant != Some("mxfp4") {
            return Err(bad(format!(
                "quantization_config.quant_method is {quant:?}; gpt-oss checkpoints ship their \
                 experts as MXFP4 (quant_method \"mxfp4\"), and dequantized re-exports are not \
                 supported: use the published checkpoint"
            )));
        }
        c.yarn().map_err(bad)?;
        Ok(c)
    }

    /// The RoPE scaling: YaRN as published, checked rather than assumed.
    fn yarn(&self) -> Result<RopeScaling, String> {
        let s = self
            .rope_scaling
            .as_ref()
            .filter(|s| !s.is_null())
            .ok_or("rope_scaling is missing; gpt-oss uses YaRN")?;
        let kind = s.get("rope_type").or_else(|| s.get("type"));
        if kind.and_then(|k| k.as_str()) != Some("yarn") {
            return Err(format!("rope_scaling {s} is not YaRN"));
        }
        let num = |k: &str, default: Option<f64>| {
            s.get(k)
                .and_then(|v| v.as_f64())
                .or(default)
                .ok_or(format!("rope_scaling.{k} is missing"))
        };
        let factor = num("factor", None)?;
        let original = num("original_max_position_embeddings", None)? as usize;
        // transformers derives the factor from the two lengths when both
        // are present; a config where they disagree is ambiguous.
        if original == 0
            || (self.max_position_embeddings as f64 / original as f64 - factor).abs() > 1e-9
        {
            return Err(format!(
                "rope_scaling.factor {factor} disagrees with max_position_embeddings / \
                 original_max_position_embeddings = {} / {original}",
                self.max_position_embeddings
            ));
        }
        for k in ["attention_factor", "mscale", "mscale_all_dim"] {
            if s.get(k).is_some_and(|v| !v.is_null()) {
                return Err(format!("rope_scaling.{k} is not supported"));
            }
        }
        Ok(RopeScaling::Yarn {
            factor,
            original_max_position: original,
            beta_fast: num("beta_fast", Some(32.0))?,
            beta_slow: num("beta_slow", Some(1.0))?,
            truncate: s.get("truncate").and_then(|v| v.as_bool()).unwrap_or(true),
        })
    }

    pub fn geometry(&self) -> Geometry {
        let window = self.sliding_window;
        Geometry {
            vocab_size: self.vocab_size,
            hidden: self.hidden_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            intermediate: 0,
            expert_intermediate: self.intermediate_size,
            num_experts: self.num_local_experts,
            top_k: self.num_experts_per_tok,
            shared_intermediate: None,
            rms_norm_eps: self.rms_norm_eps as f32,
            max_position_embeddings: self.max_position_embeddings,
            tie_word_embeddings: self.tie_word_embeddings,
            rope: RopeSpec {
                theta: self.rope_theta,
                scaling: self.yarn().expect("validated in from_value"),
                rotary_dim: None,
            },
            attention: AttentionSpec {
                qk_norm: false,
                qkv_bias: true,
                o_bias: true,
                sinks: true,
                // YaRN scales every score by 1.81 with no q/k norm (ActFormat).
                activations: ActFormat::F16,
            },
            mlp: MlpSpec {
                activations: ActFormat::Bf16,
            },
            router: RouterSpec {
                kind: RouterKind::TopKSoftmax,
                bias: true,
                selection_bias: false,
            },
            experts: ExpertSpec {
                activation: Activation::ClampedSwiglu {
                    limit: self.swiglu_limit as f32,
                    alpha: SWIGLU_ALPHA,
                },
                bias: true,
            },
            layers: self
                .layer_types
                .iter()
                .map(|t| LayerSpec {
                    attention: if t == SLIDING {
                        AttentionKind::Sliding { window }
                    } else {
                        AttentionKind::Full
                    },
                    mlp: MlpKind::Moe,
                })
                .collect(),
        }
    }

    /// Every layer's experts: fused MXFP4 tensors with biases.
    pub fn expert_storage(layer: usize) -> ExpertStorage {
        let n = |s: &str| format!("model.layers.{layer}.mlp.experts.{s}");
        ExpertStorage::FusedMxfp4(FusedMxfp4Names {
            gate_up_blocks: n("gate_up_proj_blocks"),
            gate_up_scales: n("gate_up_proj_scales"),
            gate_up_bias: Some(n("gate_up_proj_bias")),
            down_blocks: n("down_proj_blocks"),
            down_scales: n("down_proj_scales"),
            down_bias: Some(n("down_proj_bias")),
            gate_up_interleaved: true,
        })
    }
}

/// Checkpoint names of gpt-oss tensors.
pub struct TensorNames;

impl TensorNames {
    pub fn model(t: ModelTensor) -> &'static str {
        super::tensors::hf_model_name(t)
    }

    /// The name of role `t` of layer `l` (q/k norms, dense MLPs, selection
    /// biases and shared experts, which this family never has, get the
    /// names they would have).
    pub fn layer(l: usize, t: LayerTensor) -> String {
        super::tensors::hf_layer_name(l, t, "mlp.router")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::ModelConfig;

    /// Parsed through the module's own parser: `gpt_oss` joins the
    /// registry (and so `config.json` dispatch) once an engine passes its
    /// witness tests.
    fn parse(v: serde_json::Value) -> Result<ModelConfig, ModelError> {
        GptOssConfig::from_value(v, Path::new("config.json")).map(ModelConfig::GptOss)
    }

    #[test]
    fn gpt_oss_20b_plan_and_size() {
        let c = parse(presets::gpt_oss_20b()).unwrap();
        let g = c.geometry();
        assert_eq!(g.num_moe_layers(), 24);
        assert_eq!(
            g.layers[0].attention,
            AttentionKind::Sliding { window: 128 }
        );
        assert_eq!(g.layers[1].attention, AttentionKind::Full);
        assert!(g.attention.sinks && !g.attention.qk_norm);
        // YaRN's 1.81x scores without a q/k norm: the attention in FP16.
        assert_eq!(g.attention.activations, crate::arch::ActFormat::F16);
        // Its MLP block (MXFP4 experts) stays BF16.
        assert_eq!(g.mlp.activations, crate::arch::ActFormat::Bf16);
        // gpt-oss-20b has 20.9B parameters (OpenAI's model card).
        let p = g.total_params() as f64 / 1e9;
        assert!((20.5..21.5).contains(&p), "{p}");
        // gpt-oss-120b: 116.8B.
        let g = parse(presets::gpt_oss_120b()).unwrap().geometry();
        let p = g.total_params() as f64 / 1e9;
        assert!((116.0..118.0).contains(&p), "{p}");
    }

    #[test]
    fn expected_tensors_are_the_published_layout() {
        let c = parse(presets::gpt_oss_20b()).unwrap();
        let t: std::collections::HashMap<String, Vec<usize>> =
            c.expected_tensors().into_iter().collect();
        let l = "model.layers.3.";
        assert_eq!(t[&format!("{l}self_attn.sinks")], [64]);
        assert_eq!(t[&format!("{l}self_attn.q_proj.bias")], [4096]);
        assert_eq!(t[&format!("{l}mlp.router.bias")], [32]);
        assert_eq!(
            t[&format!("{l}mlp.experts.gate_up_proj_blocks")],
            [32, 5760, 90, 16]
        );
        assert_eq!(
            t[&format!("{l}mlp.experts.gate_up_proj_scales")],
            [32, 5760, 90]
        );
        assert_eq!(t[&format!("{l}mlp.experts.down_proj_bias")], [32, 2880]);
        assert!(!t.contains_key(&format!("{l}self_attn.q_norm.weight")));
        assert_eq!(t["lm_head.weight"], [201088, 2880]);
    }

    #[test]
    fn refusals_name_the_field() {
        for (field, value, needle) in [
            ("quantization_config", serde_json::Value::Null, "mxfp4"),
            (
                "layer_types",
                serde_json::json!(["chunked_attention"]),
                "layer_types",
            ),
            (
                "rope_scaling",
                serde_json::json!({"rope_type": "linear", "factor": 2.0}),
                "YaRN",
            ),
            (
                "num_experts_per_tok",
                serde_json::json!(99),
                "num_experts_per_tok",
            ),
        ] {
            let mut v = presets::gpt_oss_20b();
            v[field] = value;
            let e = parse(v).unwrap_err().to_string();
            assert!(e.contains(needle), "{field}: {e}");
        }
        let mut v = presets::gpt_oss_20b();
        v["rope_scaling"]["factor"] = serde_json::json!(16.0);
        let e = parse(v).unwrap_err().to_string();
        assert!(e.contains("disagrees"), "{e}");
    }
}
