//! Non-expert weights (embeddings, attention, router, norms, dense MLPs, LM
//! head), converted once to BF16 and
//! uploaded (norm weights too: the kernels take BF16 norm weights, which
//! is what checkpoints store). Matrices that the same input feeds are fused on upload (q/k/v
//! into one `[q+2kv, H]` matrix, gate/up into `[2I, H]`) so each is one GEMM.
//!
//! The input embedding of an untied model stays in mapped host memory
//! ([`HostTable`]): only the gather reads it, a row per token, and its VRAM
//! is worth more as expert cache. A tied embedding is also the LM head,
//! which reads all of it every token, so it is uploaded.

use crate::device::Gpu;
use crate::error::{GpuError, Result};
use crate::host_table::HostTable;
use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use krasis_common::events::{ByteProgress, EventSink, task};
use krasis_model::arch::{LayerTensor, ModelTensor};
use krasis_model::{Checkpoint, DType, Geometry, MlpKind, ModelConfig, TensorView};

pub struct LayerWeights {
    pub input_norm: CudaSlice<bf16>,
    pub post_attention_norm: CudaSlice<bf16>,
    pub q_norm: CudaSlice<bf16>,
    pub k_norm: CudaSlice<bf16>,
    /// `[q_dim + 2*kv_dim, H]`: rows of q_proj, then k_proj, then v_proj.
    pub qkv: CudaSlice<bf16>,
    /// `[H, q_dim]`.
    pub o_proj: CudaSlice<bf16>,
    pub mlp: MlpWeights,
}

pub enum MlpWeights {
    Moe {
        /// `[E, H]`.
        router: CudaSlice<bf16>,
        /// Index of this layer among the MoE layers (row of the expert pointer table).
        moe_index: usize,
    },
    Dense {
        /// `[2I, H]`: gate rows then up rows (the same fusion as the INT4 `w13`).
        gate_up: CudaSlice<bf16>,
        /// `[H, I]`.
        down: CudaSlice<bf16>,
    },
}

/// The `[V, H]` input embedding and LM head, and where each lives.
pub enum Embedding {
    /// One matrix in VRAM, read by the gather and the LM head.
    Tied(CudaSlice<bf16>),
    /// The embedding in mapped host memory (read by the gather over PCIe),
    /// the LM head in VRAM.
    Untied {
        embed: HostTable<bf16>,
        head: CudaSlice<bf16>,
    },
}

pub struct ModelWeights {
    pub embed: Embedding,
    pub final_norm: CudaSlice<bf16>,
    pub layers: Vec<LayerWeights>,
    /// Bytes uploaded, for reports.
    pub bytes: usize,
    /// Bytes kept in mapped host memory (the untied input embedding).
    pub host_bytes: usize,
}

impl ModelWeights {
    pub fn lm_head(&self) -> &CudaSlice<bf16> {
        match &self.embed {
            Embedding::Tied(h) | Embedding::Untied { head: h, .. } => h,
        }
    }

    /// Converts and uploads (or maps) every non-expert weight, sending the
    /// bytes placed to `progress` ([`task::LOAD_WEIGHTS`]; the total is
    /// [`weight_bytes`], device and host).
    pub fn upload(
        gpu: &Gpu,
        ckpt: &Checkpoint,
        config: &ModelConfig,
        progress: Option<EventSink<'_>>,
    ) -> Result<Self> {
        let g = &config.geometry();
        // Only the components `support::check_supported` admits are
        // uploaded; it runs before this.
        crate::support::check_supported(g)?;
        let (h, q, kv, hd) = (g.hidden, g.q_dim(), g.kv_dim(), g.head_dim);
        let embed_name = config.tensor_name(ModelTensor::Embed);
        let head_name = config.tensor_name(ModelTensor::LmHead);
        let planned = weight_bytes(g);
        let progress = progress.map(|s| {
            ByteProgress::start(
                s,
                task::LOAD_WEIGHTS,
                (planned.device + planned.host) as u64,
            )
        });
        let mut up = Uploader {
            gpu,
            ckpt,
            bytes: 0,
            progress: progress.as_ref(),
        };
        let (embed, host_bytes) = if g.tie_word_embeddings {
            let e = up.bf16(&[&embed_name], &[g.vocab_size, h])?;
            (Embedding::Tied(e), 0)
        } else {
            let t = ckpt.expect(&embed_name, &[g.vocab_size, h])?;
            let embed = HostTable::new(&gpu.stream, &to_bf16_bits(&t), &embed_name)?;
            let n = embed.bytes();
            up.done(n);
            let head = up.bf16(&[&head_name], &[g.vocab_size, h])?;
            (Embedding::Untied { embed, head }, n)
        };
        let final_norm = up.bf16_one(&config.tensor_name(ModelTensor::FinalNorm), &[h])?;
        let mut layers = Vec::with_capacity(g.num_layers);
        let mut moe_index = 0;
        for i in 0..g.num_layers {
            let t = |role: LayerTensor| config.layer_tensor_name(i, role);
            use LayerTensor::*;
            let qkv = up.bf16_fused(&[(t(QProj), q), (t(KProj), kv), (t(VProj), kv)], h)?;
            let mlp = match g.mlp_kind(i) {
                MlpKind::Moe => {
                    let m = MlpWeights::Moe {
                        router: up.bf16(&[&t(Router)], &[g.num_experts, h])?,
                        moe_index,
                    };
                    moe_index += 1;
                    m
                }
                MlpKind::Dense => MlpWeights::Dense {
                    gate_up: up.bf16_fused(
                        &[(t(DenseGate), g.intermediate), (t(DenseUp), g.intermediate)],
                        h,
                    )?,
                    down: up.bf16(&[&t(DenseDown)], &[h, g.intermediate])?,
                },
            };
            layers.push(LayerWeights {
                input_norm: up.bf16_one(&t(InputNorm), &[h])?,
                post_attention_norm: up.bf16_one(&t(PostAttentionNorm), &[h])?,
                q_norm: up.bf16_one(&t(QNorm), &[hd])?,
                k_norm: up.bf16_one(&t(KNorm), &[hd])?,
                qkv,
                o_proj: up.bf16(&[&t(OProj)], &[h, q])?,
                mlp,
            });
        }
        let bytes = up.bytes;
        // The pre-flight plan sizes the weights with [`weight_bytes`]; a
        // load that put other sizes on the device would make every plan
        // wrong, so it is refused rather than served.
        if (bytes, host_bytes) != (planned.device, planned.host) {
            return Err(GpuError::Unsupported(format!(
                "internal: uploaded {} B of weights (+{} B in host memory) but weight_bytes() plans {} B (+{} B)",
                bytes, host_bytes, planned.device, planned.host
            )));
        }
        if let Some(p) = progress {
            p.finish();
        }
        Ok(ModelWeights {
            embed,
            final_norm,
            layers,
            bytes,
            host_bytes,
        })
    }
}

/// Where [`ModelWeights::upload`] puts the non-expert weights, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightBytes {
    /// BF16 in VRAM: attention, norms, routers, dense MLPs, the LM head (and
    /// the input embedding when tied to it).
    pub device: usize,
    /// BF16 in mapped host memory: the untied input embedding.
    pub host: usize,
}

/// The sizes [`ModelWeights::upload`] allocates for `g` (it checks its own
/// total against this), tensor by tensor.
pub fn weight_bytes(g: &Geometry) -> WeightBytes {
    let (h, q, kv, hd) = (g.hidden, g.q_dim(), g.kv_dim(), g.head_dim);
    let table = g.vocab_size * h;
    // The LM head (or the tied embedding), the final norm.
    let mut elems = table + h;
    for kind in g.layers.iter().map(|l| l.mlp) {
        // Fused q/k/v, o_proj, the two RMSNorms and the q/k norms.
        elems += (q + 2 * kv) * h + h * q + 2 * h + 2 * hd;
        elems += match kind {
            MlpKind::Moe => g.num_experts * h,
            MlpKind::Dense => 3 * g.intermediate * h,
        };
    }
    let host = if g.tie_word_embeddings { 0 } else { table };
    WeightBytes {
        device: 2 * elems,
        host: 2 * host,
    }
}

struct Uploader<'a> {
    gpu: &'a Gpu,
    ckpt: &'a Checkpoint,
    bytes: usize,
    progress: Option<&'a ByteProgress<'a>>,
}

impl Uploader<'_> {
    fn done(&self, bytes: usize) {
        if let Some(p) = self.progress {
            p.add(bytes as u64);
        }
    }

    fn bf16(&mut self, name: &[&str], shape: &[usize]) -> Result<CudaSlice<bf16>> {
        let t = self.ckpt.expect(name[0], shape)?;
        let host = to_bf16_bits(&t);
        self.bytes += host.len() * 2;
        let dev = self.gpu.upload(&host, name[0])?;
        self.done(host.len() * 2);
        Ok(dev)
    }

    /// Row-concatenation of `[rows_i, cols]` tensors.
    fn bf16_fused(&mut self, parts: &[(String, usize)], cols: usize) -> Result<CudaSlice<bf16>> {
        let total: usize = parts.iter().map(|(_, r)| r * cols).sum();
        let mut host = Vec::with_capacity(total);
        for (name, rows) in parts {
            let t = self.ckpt.expect(name, &[*rows, cols])?;
            host.extend(to_bf16_bits(&t));
        }
        self.bytes += host.len() * 2;
        let dev = self.gpu.upload(&host, &parts[0].0)?;
        self.done(host.len() * 2);
        Ok(dev)
    }

    fn bf16_one(&mut self, name: &str, shape: &[usize]) -> Result<CudaSlice<bf16>> {
        self.bf16(&[name], shape)
    }
}

/// BF16 values of a stored tensor: BF16 is taken as is; F16 and F32
/// round to nearest even (F16 → BF16 can lose mantissa bits; this is the
/// engine's stated activation/weight precision).
pub fn to_bf16_bits(t: &TensorView<'_>) -> Vec<bf16> {
    match t.dtype {
        DType::BF16 => t
            .bytes
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        DType::F16 => t
            .bytes
            .chunks_exact(2)
            .map(|c| bf16::from_f32(f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()))
            .collect(),
        DType::F32 => t
            .bytes
            .chunks_exact(4)
            .map(|c| bf16::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use krasis_model::ModelConfig;

    /// The plan's weight sizes are the checkpoint's non-expert tensors, in
    /// BF16, for a tied and an untied synthetic model with dense layers.
    #[test]
    fn weight_bytes_are_the_checkpoints_non_expert_tensors() {
        for (preset, tie) in [("tiny", false), ("tiny", true), ("tiny-dense", false)] {
            let dir = krasis_model::testutil::tiny_checkpoint_with(
                preset,
                &[("tie_word_embeddings", serde_json::json!(tie))],
            );
            let config = ModelConfig::load(&dir).unwrap();
            let g = config.geometry();
            let ckpt = Checkpoint::open(&dir).unwrap();
            let experts: std::collections::HashSet<String> = g
                .moe_layers()
                .flat_map(|l| {
                    (0..g.num_experts).flat_map({
                        let config = &config;
                        move |e| config.expert_tensor_names(l, e)
                    })
                })
                .collect();
            let mut elems = 0;
            for name in ckpt.tensor_names() {
                if !experts.contains(name) {
                    elems += ckpt.get(name).unwrap().numel();
                }
            }
            let w = weight_bytes(&g);
            assert_eq!(w.device + w.host, 2 * elems, "{preset} tie={tie}");
            let table = 2 * g.vocab_size * g.hidden;
            assert_eq!(w.host, if tie { 0 } else { table }, "{preset} tie={tie}");
        }
    }
}
