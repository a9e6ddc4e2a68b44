//! Architectures. Each supported Hugging Face `model_type` has one module
//! here with a typed config and typed tensor names, and one entry in
//! [`registry::ARCHITECTURES`] (see there for how to add a family);
//! everything else (loading, layers, engines) is shared and dispatches on
//! [`ModelConfig`].

pub mod qwen3_moe;
pub mod registry;

use crate::error::ModelError;
use std::path::Path;

/// A parsed `config.json` of a supported architecture.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelConfig {
    Qwen3Moe(qwen3_moe::Qwen3MoeConfig),
}

impl ModelConfig {
    /// Reads and validates `DIR/config.json`.
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        Self::from_json_str(&text, &path)
    }

    pub fn from_json_str(text: &str, path: &Path) -> Result<Self, ModelError> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| ModelError::BadConfig {
                path: path.to_path_buf(),
                reason: format!("not valid JSON: {e}"),
            })?;
        let model_type = value
            .get("model_type")
            .and_then(|v| v.as_str())
            .ok_or_else(|| ModelError::BadConfig {
                path: path.to_path_buf(),
                reason: "no \"model_type\" field".into(),
            })?;
        match registry::find(model_type) {
            Some(arch) => (arch.parse)(value.clone(), path),
            None => Err(ModelError::UnsupportedModelType {
                model_type: model_type.to_string(),
                path: path.to_path_buf(),
            }),
        }
    }

    pub fn model_type(&self) -> &'static str {
        match self {
            ModelConfig::Qwen3Moe(_) => qwen3_moe::MODEL_TYPE,
        }
    }

    /// This config's registry entry.
    pub fn architecture(&self) -> &'static registry::Architecture {
        registry::find(self.model_type()).expect("every ModelConfig variant is registered")
    }

    /// The token-embedding tensor (present in every checkpoint).
    pub fn embed_tensor_name(&self) -> &'static str {
        match self {
            ModelConfig::Qwen3Moe(_) => qwen3_moe::TensorNames::EMBED,
        }
    }

    /// The architecture-independent view every shared layer and engine uses.
    pub fn geometry(&self) -> Geometry {
        match self {
            ModelConfig::Qwen3Moe(c) => c.geometry(),
        }
    }

    /// Every tensor the checkpoint must contain, with its shape.
    pub fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        match self {
            ModelConfig::Qwen3Moe(c) => c.expected_tensors(),
        }
    }

    /// How MoE layer `layer`'s routed experts are stored in the checkpoint.
    pub fn expert_storage(&self, layer: usize) -> ExpertStorage {
        match self {
            ModelConfig::Qwen3Moe(_) => {
                let _ = layer;
                ExpertStorage::PerExpert
            }
        }
    }

    /// Names of the routed-expert tensors of one expert: (gate, up, down),
    /// for [`ExpertStorage::PerExpert`] layers.
    pub fn expert_tensor_names(&self, layer: usize, expert: usize) -> [String; 3] {
        match self {
            ModelConfig::Qwen3Moe(_) => {
                let t = qwen3_moe::TensorNames::layer(layer);
                [
                    t.expert_gate(expert),
                    t.expert_up(expert),
                    t.expert_down(expert),
                ]
            }
        }
    }
}

/// How one MoE layer's routed experts are stored in a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExpertStorage {
    /// One float tensor (BF16/F16/F32) per expert and projection, named by
    /// [`ModelConfig::expert_tensor_names`]: gate `[I, H]`, up `[I, H]`,
    /// down `[H, I]` (qwen3_moe, glm4_moe, deepseek_v3).
    PerExpert,
    /// All experts of the layer in MXFP4 tensors (`*_blocks` U8
    /// `[E, rows, cols/32, 16]` + `*_scales` U8 `[E, rows, cols/32]`, see
    /// [`crate::formats::mxfp4`]) plus optional float biases (gpt_oss).
    FusedMxfp4(FusedMxfp4Names),
}

/// Tensor names of a [`ExpertStorage::FusedMxfp4`] layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FusedMxfp4Names {
    /// `[E, 2I, H/32, 16]`: gate and up rows.
    pub gate_up_blocks: String,
    pub gate_up_scales: String,
    /// `[E, 2I]`, when the experts have biases.
    pub gate_up_bias: Option<String>,
    /// `[E, H, I/32, 16]`.
    pub down_blocks: String,
    pub down_scales: String,
    /// `[E, H]`.
    pub down_bias: Option<String>,
    /// Gate and up rows alternate (row `2j` gate j, `2j + 1` up j), as in
    /// gpt-oss; otherwise rows `0..I` are gate and `I..2I` up.
    pub gate_up_interleaved: bool,
}

/// What the MLP of a layer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpKind {
    /// Routed experts (plus a shared expert when `shared_expert_intermediate > 0`).
    Moe,
    /// A plain SwiGLU MLP of `intermediate` width.
    Dense,
}

/// Architecture-independent model geometry.
#[derive(Debug, Clone, PartialEq)]
pub struct Geometry {
    pub vocab_size: usize,
    pub hidden: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Dense MLP width (layers that are not MoE).
    pub intermediate: usize,
    /// Routed expert FFN width.
    pub expert_intermediate: usize,
    pub num_experts: usize,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    /// Per layer: MoE or dense.
    pub mlp_kinds: Vec<MlpKind>,
}

impl Geometry {
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
    pub fn moe_layers(&self) -> impl Iterator<Item = usize> + '_ {
        self.mlp_kinds
            .iter()
            .enumerate()
            .filter(|(_, k)| **k == MlpKind::Moe)
            .map(|(i, _)| i)
    }
    pub fn num_moe_layers(&self) -> usize {
        self.moe_layers().count()
    }
    /// Elements of one routed expert (gate + up + down).
    pub fn expert_params(&self) -> usize {
        3 * self.hidden * self.expert_intermediate
    }
    /// Total parameters (embeddings, attention, norms, MLPs, experts, head).
    pub fn total_params(&self) -> u64 {
        let h = self.hidden as u64;
        let mut p = self.vocab_size as u64 * h; // embeddings
        if !self.tie_word_embeddings {
            p += self.vocab_size as u64 * h;
        }
        p += h; // final norm
        let q = self.q_dim() as u64;
        let kv = self.kv_dim() as u64;
        let mut per_attn = h * q + 2 * h * kv + q * h + 2 * self.head_dim as u64 + 2 * h;
        if self.attention_bias {
            per_attn += q + 2 * kv + h; // q, k, v and o_proj biases
        }
        for k in &self.mlp_kinds {
            p += per_attn;
            p += match k {
                MlpKind::Moe => {
                    self.num_experts as u64 * (self.expert_params() as u64)
                        + self.num_experts as u64 * h
                }
                MlpKind::Dense => 3 * h * self.intermediate as u64,
            };
        }
        p
    }
    /// Parameters of all routed experts.
    pub fn routed_expert_params(&self) -> u64 {
        self.num_moe_layers() as u64 * self.num_experts as u64 * self.expert_params() as u64
    }
}
