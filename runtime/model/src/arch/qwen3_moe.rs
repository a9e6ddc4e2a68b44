//! `qwen3_moe` (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder MoE).
//!
//! GQA attention with per-head RMSNorm on q and k before RoPE, a softmax
//! top-k router (renormalised over the chosen experts when `norm_topk_prob`),
//! SwiGLU routed experts, and dense SwiGLU MLPs on the layers listed in
//! `mlp_only_layers` or skipped by `decoder_sparse_step`.

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
pub const MODEL_TYPE: &str = "qwen3_moe";

/// The registry entry: both engines build it; INT4 experts, BF16 attention
/// and KV cache, HCS (a cuda-backend feature; `check_options` refuses it
/// with the reference backend), exact decode only, one GPU.
pub const ARCHITECTURE: Architecture = Architecture {
    model_type: MODEL_TYPE,
    display_name: "Qwen3 MoE",
    parse: |v, path| Ok(ModelConfig::Qwen3Moe(Qwen3MoeConfig::from_value(v, path)?)),
    backends: &[Backend::Reference, Backend::Cuda],
    options: OptionSupport {
        expert_precisions: &["int4"],
        attention_precisions: &["bf16"],
        kv_formats: &["bf16"],
        mlp_precisions: &["bf16"],
        hcs: true,
        prefix_cache_backends: &[Backend::Reference, Backend::Cuda],
        pruning_modes: &["off"],
        multi_gpu_modes: &["single"],
        defaults: OptionDefaults {
            expert_precision: "int4",
            attention_precision: "bf16",
            kv_format: "bf16",
            mlp_precision: "bf16",
            pruning: "off",
            multi_gpu: "single",
        },
    },
    presets: presets::PRESETS,
};

fn default_rope_theta() -> f64 {
    10000.0
}
fn default_eps() -> f64 {
    1e-6
}
fn default_one() -> usize {
    1
}
fn default_true() -> bool {
    true
}

/// The fields of a `qwen3_moe` `config.json` this engine uses. Unknown fields
/// are ignored (HF configs carry many training-only ones).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Qwen3MoeConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    #[serde(default)]
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "default_one")]
    pub decoder_sparse_step: usize,
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    #[serde(default = "default_true")]
    pub norm_topk_prob: bool,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub use_sliding_window: bool,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub bos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub torch_dtype: Option<String>,
}

impl Qwen3MoeConfig {
    pub fn from_value(value: serde_json::Value, path: &Path) -> Result<Self, ModelError> {
        let bad = |reason: String| ModelError::BadConfig {
            path: path.to_path_buf(),
            reason,
        };
        let c: Qwen3MoeConfig = serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
        CommonShape {
            hidden: c.hidden_size,
            layers: c.num_hidden_layers,
            vocab: c.vocab_size,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim(),
            top_k: c.num_experts_per_tok,
            experts: c.num_experts,
            experts_field: "num_experts",
        }
        .check()
        .map_err(bad)?;
        if c.decoder_sparse_step == 0 {
            return Err(bad("decoder_sparse_step must be >= 1".into()));
        }
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
                "rope_scaling {s} is not supported yet; remove it or use a model without RoPE scaling"
            )));
        }
        if c.use_sliding_window {
            return Err(bad("use_sliding_window=true is not supported".into()));
        }
        if let Some(&l) = c
            .mlp_only_layers
            .iter()
            .find(|&&l| l >= c.num_hidden_layers)
        {
            return Err(bad(format!(
                "mlp_only_layers names layer {l} but the model has {} layers",
                c.num_hidden_layers
            )));
        }
        if c.mlp_kinds().contains(&MlpKind::Dense) && c.intermediate_size == 0 {
            return Err(bad("dense layers present but intermediate_size is 0".into()));
        }
        Ok(c)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// HF rule: a layer is MoE unless listed in `mlp_only_layers`, when it
    /// falls on the `decoder_sparse_step` grid and experts exist.
    pub fn mlp_kinds(&self) -> Vec<MlpKind> {
        (0..self.num_hidden_layers)
            .map(|i| {
                if !self.mlp_only_layers.contains(&i)
                    && self.num_experts > 0
                    && (i + 1) % self.decoder_sparse_step == 0
                {
                    MlpKind::Moe
                } else {
                    MlpKind::Dense
                }
            })
            .collect()
    }

    pub fn geometry(&self) -> Geometry {
        Geometry {
            vocab_size: self.vocab_size,
            hidden: self.hidden_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim(),
            intermediate: self.intermediate_size,
            expert_intermediate: self.moe_intermediate_size,
            num_experts: self.num_experts,
            top_k: self.num_experts_per_tok,
            shared_intermediate: None,
            rms_norm_eps: self.rms_norm_eps as f32,
            max_position_embeddings: self.max_position_embeddings,
            tie_word_embeddings: self.tie_word_embeddings,
            rope: RopeSpec {
                theta: self.rope_theta,
                scaling: RopeScaling::None,
                rotary_dim: None,
            },
            // transformers gives o_proj a bias too when attention_bias is set.
            attention: AttentionSpec {
                qk_norm: true,
                qkv_bias: self.attention_bias,
                o_bias: self.attention_bias,
                sinks: false,
                activations: ActFormat::Bf16,
            },
            mlp: MlpSpec {
                activations: ActFormat::Bf16,
            },
            router: RouterSpec {
                kind: RouterKind::SoftmaxTopK {
                    renormalize: self.norm_topk_prob,
                },
                bias: false,
                selection_bias: false,
            },
            experts: ExpertSpec {
                activation: Activation::Swiglu,
                bias: false,
            },
            layers: self
                .mlp_kinds()
                .into_iter()
                .map(|mlp| LayerSpec {
                    attention: AttentionKind::Full,
                    mlp,
                })
                .collect(),
        }
    }
}

/// Typed tensor names of a `qwen3_moe` checkpoint.
pub struct TensorNames {
    prefix: String,
}

impl TensorNames {
    pub const EMBED: &'static str = "model.embed_tokens.weight";
    pub const FINAL_NORM: &'static str = "model.norm.weight";
    pub const LM_HEAD: &'static str = "lm_head.weight";

    pub fn layer(i: usize) -> Self {
        TensorNames {
            prefix: format!("model.layers.{i}."),
        }
    }
    fn n(&self, s: &str) -> String {
        format!("{}{}", self.prefix, s)
    }
    /// The name of a tensor outside the layers.
    pub fn model(t: ModelTensor) -> &'static str {
        match t {
            ModelTensor::Embed => Self::EMBED,
            ModelTensor::FinalNorm => Self::FINAL_NORM,
            ModelTensor::LmHead => Self::LM_HEAD,
        }
    }
    /// The name of a layer role (`Sinks`, router biases and shared experts,
    /// which this family never has, get the names they would have).
    pub fn role(&self, t: LayerTensor) -> String {
        use LayerTensor::*;
        match t {
            InputNorm => self.input_norm(),
            PostAttentionNorm => self.post_attention_norm(),
            QProj => self.q_proj(),
            KProj => self.k_proj(),
            VProj => self.v_proj(),
            OProj => self.o_proj(),
            QBias => self.q_bias(),
            KBias => self.k_bias(),
            VBias => self.v_bias(),
            OBias => self.o_bias(),
            QNorm => self.q_norm(),
            KNorm => self.k_norm(),
            Sinks => self.n("self_attn.sinks"),
            Router => self.router(),
            RouterBias => self.n("mlp.gate.bias"),
            RouterSelectionBias => self.n("mlp.gate.e_score_correction_bias"),
            SharedGate => self.n("mlp.shared_expert.gate_proj.weight"),
            SharedUp => self.n("mlp.shared_expert.up_proj.weight"),
            SharedDown => self.n("mlp.shared_expert.down_proj.weight"),
            DenseGate => self.dense_gate(),
            DenseUp => self.dense_up(),
            DenseDown => self.dense_down(),
        }
    }
    pub fn input_norm(&self) -> String {
        self.n("input_layernorm.weight")
    }
    pub fn post_attention_norm(&self) -> String {
        self.n("post_attention_layernorm.weight")
    }
    pub fn q_proj(&self) -> String {
        self.n("self_attn.q_proj.weight")
    }
    pub fn k_proj(&self) -> String {
        self.n("self_attn.k_proj.weight")
    }
    pub fn v_proj(&self) -> String {
        self.n("self_attn.v_proj.weight")
    }
    pub fn o_proj(&self) -> String {
        self.n("self_attn.o_proj.weight")
    }
    pub fn q_bias(&self) -> String {
        self.n("self_attn.q_proj.bias")
    }
    pub fn k_bias(&self) -> String {
        self.n("self_attn.k_proj.bias")
    }
    pub fn v_bias(&self) -> String {
        self.n("self_attn.v_proj.bias")
    }
    pub fn o_bias(&self) -> String {
        self.n("self_attn.o_proj.bias")
    }
    pub fn q_norm(&self) -> String {
        self.n("self_attn.q_norm.weight")
    }
    pub fn k_norm(&self) -> String {
        self.n("self_attn.k_norm.weight")
    }
    pub fn router(&self) -> String {
        self.n("mlp.gate.weight")
    }
    pub fn expert_gate(&self, e: usize) -> String {
        self.n(&format!("mlp.experts.{e}.gate_proj.weight"))
    }
    pub fn expert_up(&self, e: usize) -> String {
        self.n(&format!("mlp.experts.{e}.up_proj.weight"))
    }
    pub fn expert_down(&self, e: usize) -> String {
        self.n(&format!("mlp.experts.{e}.down_proj.weight"))
    }
    pub fn dense_gate(&self) -> String {
        self.n("mlp.gate_proj.weight")
    }
    pub fn dense_up(&self) -> String {
        self.n("mlp.up_proj.weight")
    }
    pub fn dense_down(&self) -> String {
        self.n("mlp.down_proj.weight")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a3b() -> serde_json::Value {
        serde_json::json!({
            "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
            "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "max_position_embeddings": 40960, "num_experts": 128, "num_experts_per_tok": 8,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": true,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
            "hidden_act": "silu", "some_training_field": 3
        })
    }

    #[test]
    fn a3b_geometry_and_params() {
        let c = Qwen3MoeConfig::from_value(a3b(), Path::new("config.json")).unwrap();
        let g = c.geometry();
        assert_eq!(g.num_moe_layers(), 48);
        // q/k norms keep the scores small: the attention stays BF16.
        assert_eq!(g.attention.activations, ActFormat::Bf16);
        assert_eq!(g.mlp.activations, ActFormat::Bf16);
        // Qwen3-30B-A3B has ~30.5B parameters.
        let p = g.total_params() as f64 / 1e9;
        assert!((30.0..31.0).contains(&p), "{p}");
    }

    #[test]
    fn dense_layers_follow_hf_rule() {
        let mut v = a3b();
        v["mlp_only_layers"] = serde_json::json!([0]);
        v["decoder_sparse_step"] = serde_json::json!(2);
        let c = Qwen3MoeConfig::from_value(v, Path::new("c")).unwrap();
        let k = c.mlp_kinds();
        assert_eq!(k[0], MlpKind::Dense);
        assert_eq!(k[1], MlpKind::Moe);
        assert_eq!(k[2], MlpKind::Dense);
        assert_eq!(k[3], MlpKind::Moe);
    }

    #[test]
    fn bad_heads_rejected_with_reason() {
        let mut v = a3b();
        v["num_key_value_heads"] = serde_json::json!(5);
        let e = Qwen3MoeConfig::from_value(v, Path::new("c"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("num_key_value_heads"), "{e}");
    }
}
