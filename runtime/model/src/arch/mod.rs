//! Architectures. Each supported Hugging Face `model_type` has one module
//! here with a typed config and typed tensor names, and one entry in
//! [`registry::ARCHITECTURES`] (see there for how to add a family);
//! everything else (loading, layers, engines) is shared and dispatches on
//! [`ModelConfig`].

pub mod glm4_moe;
pub mod gpt_oss;
pub mod plan;
pub mod qwen3_moe;
pub mod registry;
pub mod tensors;

pub use plan::{
    ActFormat, Activation, AttentionKind, AttentionSpec, ExpertSpec, LayerSpec, MlpKind, MlpSpec,
    RopeScaling, RopeSpec, RouterKind, RouterSpec,
};
pub use tensors::{LayerTensor, ModelTensor};

use crate::error::ModelError;
use crate::formats::mxfp4::Mxfp4Shape;
use std::path::Path;

/// A parsed `config.json` of a supported architecture.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelConfig {
    Qwen3Moe(qwen3_moe::Qwen3MoeConfig),
    GptOss(gpt_oss::GptOssConfig),
    Glm4Moe(glm4_moe::Glm4MoeConfig),
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
            ModelConfig::GptOss(_) => gpt_oss::MODEL_TYPE,
            ModelConfig::Glm4Moe(_) => glm4_moe::MODEL_TYPE,
        }
    }

    /// This config's registry entry.
    pub fn architecture(&self) -> &'static registry::Architecture {
        registry::find(self.model_type()).expect("every ModelConfig variant is registered")
    }

    /// The token-embedding tensor (present in every checkpoint).
    pub fn embed_tensor_name(&self) -> String {
        self.tensor_name(ModelTensor::Embed)
    }

    /// The checkpoint name of a tensor outside the layers.
    pub fn tensor_name(&self, t: ModelTensor) -> String {
        match self {
            ModelConfig::Qwen3Moe(_) => qwen3_moe::TensorNames::model(t).to_string(),
            ModelConfig::GptOss(_) => gpt_oss::TensorNames::model(t).to_string(),
            ModelConfig::Glm4Moe(_) => glm4_moe::TensorNames::model(t).to_string(),
        }
    }

    /// The checkpoint name of role `t` of decoder layer `layer`.
    pub fn layer_tensor_name(&self, layer: usize, t: LayerTensor) -> String {
        match self {
            ModelConfig::Qwen3Moe(_) => qwen3_moe::TensorNames::layer(layer).role(t),
            ModelConfig::GptOss(_) => gpt_oss::TensorNames::layer(layer, t),
            ModelConfig::Glm4Moe(_) => glm4_moe::TensorNames::layer(layer, t),
        }
    }

    /// The architecture-independent view every shared layer and engine uses.
    pub fn geometry(&self) -> Geometry {
        match self {
            ModelConfig::Qwen3Moe(c) => c.geometry(),
            ModelConfig::GptOss(c) => c.geometry(),
            ModelConfig::Glm4Moe(c) => c.geometry(),
        }
    }

    /// Every tensor the checkpoint must contain, with its shape: the roles
    /// the layer plan implies plus each MoE layer's expert storage.
    pub fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let g = self.geometry();
        let (h, ne, ei) = (g.hidden, g.num_experts, g.expert_intermediate);
        let mut v = vec![(self.tensor_name(ModelTensor::Embed), vec![g.vocab_size, h])];
        for l in 0..g.num_layers {
            for (role, shape) in LayerTensor::present(&g, l) {
                v.push((self.layer_tensor_name(l, role), shape));
            }
            if g.mlp_kind(l) != MlpKind::Moe {
                continue;
            }
            match self.expert_storage(l) {
                ExpertStorage::PerExpert => {
                    for e in 0..ne {
                        let [gate, up, down] = self.expert_tensor_names(l, e);
                        v.push((gate, vec![ei, h]));
                        v.push((up, vec![ei, h]));
                        v.push((down, vec![h, ei]));
                    }
                }
                ExpertStorage::FusedMxfp4(n) => {
                    // The config refused widths that are not whole blocks.
                    let shape = |rows, cols| Mxfp4Shape {
                        experts: ne,
                        rows,
                        cols,
                    };
                    let (gate_up, down) = (shape(2 * ei, h), shape(h, ei));
                    v.push((n.gate_up_blocks, gate_up.blocks_shape().to_vec()));
                    v.push((n.gate_up_scales, gate_up.scales_shape().to_vec()));
                    v.push((n.down_blocks, down.blocks_shape().to_vec()));
                    v.push((n.down_scales, down.scales_shape().to_vec()));
                    if let Some(bias) = n.gate_up_bias {
                        v.push((bias, vec![ne, 2 * ei]));
                    }
                    if let Some(bias) = n.down_bias {
                        v.push((bias, vec![ne, h]));
                    }
                }
            }
        }
        v.push((self.tensor_name(ModelTensor::FinalNorm), vec![h]));
        if !g.tie_word_embeddings {
            v.push((self.tensor_name(ModelTensor::LmHead), vec![g.vocab_size, h]));
        }
        v
    }

    /// Tensors the published checkpoints carry that no engine here loads
    /// (glm4_moe's MTP layers), as synth writes them.
    pub fn skipped_tensors(&self) -> Vec<(String, Vec<usize>)> {
        match self {
            ModelConfig::Glm4Moe(c) => c.mtp_tensors(),
            _ => Vec::new(),
        }
    }

    /// Name prefixes under which a checkpoint's tensors are skipped on load
    /// whatever they are (glm4_moe's `model.layers.{N}.` MTP layer), as
    /// transformers and vLLM skip them.
    pub fn skipped_prefixes(&self) -> Vec<String> {
        match self {
            ModelConfig::Glm4Moe(c) => c.skipped_prefixes(),
            _ => Vec::new(),
        }
    }

    /// How MoE layer `layer`'s routed experts are stored in the checkpoint.
    pub fn expert_storage(&self, layer: usize) -> ExpertStorage {
        match self {
            ModelConfig::Qwen3Moe(_) | ModelConfig::Glm4Moe(_) => ExpertStorage::PerExpert,
            ModelConfig::GptOss(_) => gpt_oss::GptOssConfig::expert_storage(layer),
        }
    }

    /// Every checkpoint tensor holding MoE layer `layer`'s routed experts,
    /// whatever their storage.
    pub fn routed_expert_tensor_names(&self, layer: usize) -> Vec<String> {
        match self.expert_storage(layer) {
            ExpertStorage::PerExpert => (0..self.geometry().num_experts)
                .flat_map(|e| self.expert_tensor_names(layer, e))
                .collect(),
            ExpertStorage::FusedMxfp4(n) => [
                Some(n.gate_up_blocks),
                Some(n.gate_up_scales),
                n.gate_up_bias,
                Some(n.down_blocks),
                Some(n.down_scales),
                n.down_bias,
            ]
            .into_iter()
            .flatten()
            .collect(),
        }
    }

    /// Names of the routed-expert tensors of one expert: (gate, up, down),
    /// for [`ExpertStorage::PerExpert`] layers. (A fused layer has no such
    /// tensors: the names returned for it are absent from its checkpoint,
    /// so a caller that did not check the storage gets "tensor not found".)
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
            ModelConfig::GptOss(_) => ["gate_proj", "up_proj", "down_proj"]
                .map(|p| format!("model.layers.{layer}.mlp.experts.{expert}.{p}.weight")),
            ModelConfig::Glm4Moe(_) => glm4_moe::TensorNames::expert(layer, expert),
        }
    }
}

/// The sizes every family's `config.json` gives, for the checks they share.
pub(crate) struct CommonShape<'a> {
    pub hidden: usize,
    pub layers: usize,
    pub vocab: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub top_k: usize,
    pub experts: usize,
    /// The family's name for the expert count (`num_experts`, `num_local_experts`).
    pub experts_field: &'a str,
}

impl CommonShape<'_> {
    /// Sizes present, query heads a positive multiple of KV heads, an even
    /// head_dim for RoPE, `num_experts_per_tok` in `1..=experts`; the reason
    /// names the `config.json` fields.
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.hidden == 0 || self.layers == 0 || self.vocab == 0 {
            return Err("hidden_size, num_hidden_layers and vocab_size must be > 0".into());
        }
        if self.heads == 0 || self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return Err(format!(
                "num_attention_heads ({}) must be a positive multiple of num_key_value_heads ({})",
                self.heads, self.kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!("head_dim {} must be even for RoPE", self.head_dim));
        }
        if self.top_k == 0 || self.top_k > self.experts {
            return Err(format!(
                "num_experts_per_tok ({}) must be in 1..={} ({})",
                self.top_k, self.experts_field, self.experts
            ));
        }
        Ok(())
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
    /// Width of the shared expert every MoE layer adds to its routed
    /// output, ungated (a plain SwiGLU MLP; glm4_moe: `moe_intermediate_size
    /// * n_shared_experts`). `None`: no shared expert.
    pub shared_intermediate: Option<usize>,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub rope: RopeSpec,
    pub attention: AttentionSpec,
    /// The MLP blocks' format (every layer's, dense or MoE).
    pub mlp: MlpSpec,
    pub router: RouterSpec,
    pub experts: ExpertSpec,
    /// The layer plan: per decoder layer its attention and MLP kind.
    pub layers: Vec<LayerSpec>,
}

impl Geometry {
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
    pub fn moe_layers(&self) -> impl Iterator<Item = usize> + '_ {
        self.layers
            .iter()
            .enumerate()
            .filter(|(_, l)| l.mlp == MlpKind::Moe)
            .map(|(i, _)| i)
    }
    /// The MLP kind of layer `l`.
    pub fn mlp_kind(&self, l: usize) -> MlpKind {
        self.layers[l].mlp
    }
    /// Whether any layer has this MLP kind.
    pub fn has_mlp(&self, kind: MlpKind) -> bool {
        self.layers.iter().any(|l| l.mlp == kind)
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
        let a = &self.attention;
        let mut per_attn = h * q + 2 * h * kv + q * h + 2 * h;
        if a.qk_norm {
            per_attn += 2 * self.head_dim as u64;
        }
        if a.qkv_bias {
            per_attn += q + 2 * kv;
        }
        if a.o_bias {
            per_attn += h;
        }
        if a.sinks {
            per_attn += self.num_heads as u64;
        }
        let e = self.num_experts as u64;
        let i = self.expert_intermediate as u64;
        let mut per_moe = e * (self.expert_params() as u64) + e * h;
        if self.router.bias {
            per_moe += e;
        }
        if self.router.selection_bias {
            per_moe += e;
        }
        if let Some(s) = self.shared_intermediate {
            per_moe += 3 * h * s as u64;
        }
        if self.experts.bias {
            per_moe += e * (2 * i + h);
        }
        for l in &self.layers {
            p += per_attn;
            p += match l.mlp {
                MlpKind::Moe => per_moe,
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
