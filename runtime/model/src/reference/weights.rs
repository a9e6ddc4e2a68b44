//! The non-expert weights of a model, converted to f32 once at load time.

use crate::arch::qwen3_moe::TensorNames;
use crate::arch::{Geometry, MlpKind};
use crate::checkpoint::Checkpoint;
use crate::error::ModelError;
use krasis_common::events::ByteProgress;
use rayon::prelude::*;

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
    /// q, k, v and o biases, present when `attention_bias`.
    pub bias: Option<[Vec<f32>; 4]>,
    /// Per-head RMSNorm weights, `[head_dim]` each.
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

pub(crate) enum MlpWeights {
    /// `gate`/`up` `[I, H]`, `down` `[H, I]`.
    Dense {
        gate: Vec<f32>,
        up: Vec<f32>,
        down: Vec<f32>,
    },
    /// Router `[num_experts, H]`; the experts come from an `ExpertWeights`.
    Moe { router: Vec<f32> },
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
    /// Reads every dense tensor (shapes were validated by the caller, but
    /// are checked again here because this is where they are relied on),
    /// adding the stored bytes read to `progress`.
    pub fn load(
        ckpt: &Checkpoint,
        g: &Geometry,
        progress: Option<&ByteProgress<'_>>,
    ) -> Result<Self, ModelError> {
        let ckpt = &Reader { ckpt, progress };
        let h = g.hidden;
        let layers = g
            .mlp_kinds
            .par_iter()
            .enumerate()
            .map(|(i, kind)| load_layer(ckpt, g, i, *kind))
            .collect::<Result<Vec<_>, _>>()?;
        let lm_head = if g.tie_word_embeddings {
            None
        } else {
            Some(ckpt.read_f32(TensorNames::LM_HEAD, &[g.vocab_size, h])?)
        };
        Ok(Weights {
            embed: ckpt.read_f32(TensorNames::EMBED, &[g.vocab_size, h])?,
            layers,
            final_norm: ckpt.read_f32(TensorNames::FINAL_NORM, &[h])?,
            lm_head,
        })
    }

    pub fn lm_head(&self) -> &[f32] {
        self.lm_head.as_deref().unwrap_or(&self.embed)
    }
}

fn load_layer(
    ckpt: &Reader<'_>,
    g: &Geometry,
    i: usize,
    kind: MlpKind,
) -> Result<LayerWeights, ModelError> {
    let t = TensorNames::layer(i);
    let (h, q, kv, hd) = (g.hidden, g.q_dim(), g.kv_dim(), g.head_dim);
    let bias = if g.attention_bias {
        Some([
            ckpt.read_f32(&t.q_bias(), &[q])?,
            ckpt.read_f32(&t.k_bias(), &[kv])?,
            ckpt.read_f32(&t.v_bias(), &[kv])?,
            ckpt.read_f32(&t.o_bias(), &[h])?,
        ])
    } else {
        None
    };
    let attn = AttnWeights {
        q: ckpt.read_f32(&t.q_proj(), &[q, h])?,
        k: ckpt.read_f32(&t.k_proj(), &[kv, h])?,
        v: ckpt.read_f32(&t.v_proj(), &[kv, h])?,
        o: ckpt.read_f32(&t.o_proj(), &[h, q])?,
        bias,
        q_norm: ckpt.read_f32(&t.q_norm(), &[hd])?,
        k_norm: ckpt.read_f32(&t.k_norm(), &[hd])?,
    };
    let mlp = match kind {
        MlpKind::Dense => MlpWeights::Dense {
            gate: ckpt.read_f32(&t.dense_gate(), &[g.intermediate, h])?,
            up: ckpt.read_f32(&t.dense_up(), &[g.intermediate, h])?,
            down: ckpt.read_f32(&t.dense_down(), &[h, g.intermediate])?,
        },
        MlpKind::Moe => MlpWeights::Moe {
            router: ckpt.read_f32(&t.router(), &[g.num_experts, h])?,
        },
    };
    Ok(LayerWeights {
        input_norm: ckpt.read_f32(&t.input_norm(), &[h])?,
        post_attention_norm: ckpt.read_f32(&t.post_attention_norm(), &[h])?,
        attn,
        mlp,
    })
}
