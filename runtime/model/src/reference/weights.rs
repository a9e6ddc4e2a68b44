//! The non-expert weights of a model, converted to f32 once at load time.

use crate::arch::{Geometry, LayerTensor, MlpKind, ModelConfig, ModelTensor};
use crate::checkpoint::Checkpoint;
use crate::error::ModelError;
use krasis_common::events::ByteProgress;
use rayon::prelude::*;
use std::collections::HashMap;

/// Reads tensors as f32, counting the stored bytes read into `progress`.
struct Reader<'a> {
    ckpt: &'a Checkpoint,
    progress: Option<&'a ByteProgress<'a>>,
}

impl Reader<'_> {
    fn read_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let t = self.ckpt.expect(name, shape)?;
        let v = t.to_f32();
        if let Some(p) = self.progress {
            p.add(t.bytes.len() as u64);
        }
        Ok(v)
    }
}

pub(crate) struct AttnWeights {
    /// `[q_dim, H]`, `[kv_dim, H]`, `[kv_dim, H]`, `[H, q_dim]`.
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub o: Vec<f32>,
    /// q, k and v biases (`AttentionSpec::qkv_bias`).
    pub qkv_bias: Option<[Vec<f32>; 3]>,
    /// o_proj bias (`AttentionSpec::o_bias`).
    pub o_bias: Option<Vec<f32>>,
    /// Per-head RMSNorm weights, `[head_dim]` each (`AttentionSpec::qk_norm`).
    pub qk_norm: Option<[Vec<f32>; 2]>,
    /// `[num_heads]` sink logits (`AttentionSpec::sinks`).
    pub sinks: Option<Vec<f32>>,
}

pub(crate) enum MlpWeights {
    /// `gate`/`up` `[I, H]`, `down` `[H, I]`.
    Dense {
        gate: Vec<f32>,
        up: Vec<f32>,
        down: Vec<f32>,
    },
    /// Router `[num_experts, H]`, its bias and its selection bias, and the
    /// shared expert (`gate`, `up`, `down`); the routed experts come from
    /// an `ExpertWeights`.
    Moe {
        router: Vec<f32>,
        router_bias: Option<Vec<f32>>,
        selection_bias: Option<Vec<f32>>,
        shared: Option<[Vec<f32>; 3]>,
    },
}

pub(crate) struct LayerWeights {
    pub input_norm: Vec<f32>,
    pub post_attention_norm: Vec<f32>,
    pub attn: AttnWeights,
    pub mlp: MlpWeights,
}

pub(crate) struct Weights {
    /// `[vocab, H]`.
    pub embed: Vec<f32>,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    /// `[vocab, H]`; `None` when tied to `embed`.
    pub lm_head: Option<Vec<f32>>,
}

impl Weights {
    /// Reads every non-expert tensor the layer plan implies (shapes were
    /// validated by the caller, but are checked again here because this is
    /// where they are relied on), adding the stored bytes read to
    /// `progress`.
    pub fn load(
        ckpt: &Checkpoint,
        config: &ModelConfig,
        progress: Option<&ByteProgress<'_>>,
    ) -> Result<Self, ModelError> {
        let ckpt = &Reader { ckpt, progress };
        let g = config.geometry();
        let h = g.hidden;
        let layers = (0..g.num_layers)
            .into_par_iter()
            .map(|l| load_layer(ckpt, config, &g, l))
            .collect::<Result<Vec<_>, _>>()?;
        let lm_head = if g.tie_word_embeddings {
            None
        } else {
            let name = config.tensor_name(ModelTensor::LmHead);
            Some(ckpt.read_f32(&name, &[g.vocab_size, h])?)
        };
        Ok(Weights {
            embed: ckpt.read_f32(&config.tensor_name(ModelTensor::Embed), &[g.vocab_size, h])?,
            layers,
            final_norm: ckpt.read_f32(&config.tensor_name(ModelTensor::FinalNorm), &[h])?,
            lm_head,
        })
    }

    pub fn lm_head(&self) -> &[f32] {
        self.lm_head.as_deref().unwrap_or(&self.embed)
    }
}

fn load_layer(
    ckpt: &Reader<'_>,
    config: &ModelConfig,
    g: &Geometry,
    l: usize,
) -> Result<LayerWeights, ModelError> {
    let mut roles: HashMap<LayerTensor, Vec<f32>> = HashMap::new();
    for (role, shape) in LayerTensor::present(g, l) {
        let v = ckpt.read_f32(&config.layer_tensor_name(l, role), &shape)?;
        roles.insert(role, v);
    }
    // `present` listed every role the plan implies, so a missing one here
    // is a plan/loader disagreement, reported rather than panicking.
    let mut take = |role: LayerTensor| {
        roles.remove(&role).ok_or_else(|| {
            ModelError::Other(format!(
                "layer {l}: the layer plan has no {role:?} tensor but the reference engine needs it"
            ))
        })
    };
    use LayerTensor::*;
    let a = g.attention;
    let attn = AttnWeights {
        q: take(QProj)?,
        k: take(KProj)?,
        v: take(VProj)?,
        o: take(OProj)?,
        qkv_bias: if a.qkv_bias {
            Some([take(QBias)?, take(KBias)?, take(VBias)?])
        } else {
            None
        },
        o_bias: a.o_bias.then(|| take(OBias)).transpose()?,
        qk_norm: if a.qk_norm {
            Some([take(QNorm)?, take(KNorm)?])
        } else {
            None
        },
        sinks: a.sinks.then(|| take(Sinks)).transpose()?,
    };
    let mlp = match g.mlp_kind(l) {
        MlpKind::Dense => MlpWeights::Dense {
            gate: take(DenseGate)?,
            up: take(DenseUp)?,
            down: take(DenseDown)?,
        },
        MlpKind::Moe => MlpWeights::Moe {
            router: take(Router)?,
            router_bias: g.router.bias.then(|| take(RouterBias)).transpose()?,
            selection_bias: g
                .router
                .selection_bias
                .then(|| take(RouterSelectionBias))
                .transpose()?,
            shared: match g.shared_intermediate {
                Some(_) => Some([take(SharedGate)?, take(SharedUp)?, take(SharedDown)?]),
                None => None,
            },
        },
    };
    Ok(LayerWeights {
        input_norm: take(InputNorm)?,
        post_attention_norm: take(PostAttentionNorm)?,
        attn,
        mlp,
    })
}
