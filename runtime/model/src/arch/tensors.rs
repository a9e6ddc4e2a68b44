//! Typed tensor roles. An architecture names each role in its checkpoint
//! (`ModelConfig::tensor_name`, `ModelConfig::layer_tensor_name`); which
//! roles a layer has, and their shapes, follow from the layer plan alone,
//! so loaders and the checkpoint validation are shared by every family.

use super::{Geometry, MlpKind};

/// A tensor outside the decoder layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelTensor {
    /// `[vocab, H]`.
    Embed,
    /// `[H]`.
    FinalNorm,
    /// `[vocab, H]`; absent when tied to the embedding.
    LmHead,
}

/// A non-expert tensor of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerTensor {
    InputNorm,
    PostAttentionNorm,
    QProj,
    KProj,
    VProj,
    OProj,
    QBias,
    KBias,
    VBias,
    OBias,
    QNorm,
    KNorm,
    /// `[num_heads]` attention-sink logits.
    Sinks,
    Router,
    RouterBias,
    /// `[num_experts]` f32 bias on the choice scores only
    /// (`RouterSpec::selection_bias`).
    RouterSelectionBias,
    /// The shared expert's `[S, H]`, `[S, H]` and `[H, S]`
    /// (`Geometry::shared_intermediate`).
    SharedGate,
    SharedUp,
    SharedDown,
    DenseGate,
    DenseUp,
    DenseDown,
}

impl LayerTensor {
    /// The roles layer `l` of `g` has, routed experts aside, with their
    /// shapes (`[out, in]` for linear weights, as stored).
    pub fn present(g: &Geometry, l: usize) -> Vec<(LayerTensor, Vec<usize>)> {
        use LayerTensor::*;
        let (h, q, kv, hd) = (g.hidden, g.q_dim(), g.kv_dim(), g.head_dim);
        let a = &g.attention;
        let mut v = vec![
            (InputNorm, vec![h]),
            (PostAttentionNorm, vec![h]),
            (QProj, vec![q, h]),
            (KProj, vec![kv, h]),
            (VProj, vec![kv, h]),
            (OProj, vec![h, q]),
        ];
        if a.qkv_bias {
            v.extend([(QBias, vec![q]), (KBias, vec![kv]), (VBias, vec![kv])]);
        }
        if a.o_bias {
            v.push((OBias, vec![h]));
        }
        if a.qk_norm {
            v.extend([(QNorm, vec![hd]), (KNorm, vec![hd])]);
        }
        if a.sinks {
            v.push((Sinks, vec![g.num_heads]));
        }
        match g.mlp_kind(l) {
            MlpKind::Moe => {
                v.push((Router, vec![g.num_experts, h]));
                if g.router.bias {
                    v.push((RouterBias, vec![g.num_experts]));
                }
                if g.router.selection_bias {
                    v.push((RouterSelectionBias, vec![g.num_experts]));
                }
                if let Some(s) = g.shared_intermediate {
                    v.extend([
                        (SharedGate, vec![s, h]),
                        (SharedUp, vec![s, h]),
                        (SharedDown, vec![h, s]),
                    ]);
                }
            }
            MlpKind::Dense => {
                let i = g.intermediate;
                v.extend([
                    (DenseGate, vec![i, h]),
                    (DenseUp, vec![i, h]),
                    (DenseDown, vec![h, i]),
                ]);
            }
        }
        v
    }
}

/// A model-level tensor's checkpoint name in the Hugging Face layout every
/// family here uses.
pub fn hf_model_name(t: ModelTensor) -> &'static str {
    match t {
        ModelTensor::Embed => "model.embed_tokens.weight",
        ModelTensor::FinalNorm => "model.norm.weight",
        ModelTensor::LmHead => "lm_head.weight",
    }
}

/// A layer role's checkpoint name in the Hugging Face layout gpt_oss and
/// glm4_moe share: `model.layers.{l}.` + the role's module path, where the
/// families differ only in the router module (`router`: `mlp.router`,
/// `mlp.gate`). Roles a family never has get the names they would have.
pub fn hf_layer_name(l: usize, t: LayerTensor, router: &str) -> String {
    use LayerTensor::*;
    let fixed = match t {
        InputNorm => "input_layernorm.weight",
        PostAttentionNorm => "post_attention_layernorm.weight",
        QProj => "self_attn.q_proj.weight",
        KProj => "self_attn.k_proj.weight",
        VProj => "self_attn.v_proj.weight",
        OProj => "self_attn.o_proj.weight",
        QBias => "self_attn.q_proj.bias",
        KBias => "self_attn.k_proj.bias",
        VBias => "self_attn.v_proj.bias",
        OBias => "self_attn.o_proj.bias",
        QNorm => "self_attn.q_norm.weight",
        KNorm => "self_attn.k_norm.weight",
        Sinks => "self_attn.sinks",
        SharedGate => "mlp.shared_experts.gate_proj.weight",
        SharedUp => "mlp.shared_experts.up_proj.weight",
        SharedDown => "mlp.shared_experts.down_proj.weight",
        DenseGate => "mlp.gate_proj.weight",
        DenseUp => "mlp.up_proj.weight",
        DenseDown => "mlp.down_proj.weight",
        Router => return format!("model.layers.{l}.{router}.weight"),
        RouterBias => return format!("model.layers.{l}.{router}.bias"),
        RouterSelectionBias => return format!("model.layers.{l}.{router}.e_score_correction_bias"),
    };
    format!("model.layers.{l}.{fixed}")
}
