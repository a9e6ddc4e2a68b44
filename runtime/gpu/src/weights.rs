//! Non-expert weights (embeddings, attention, router, norms, dense MLPs, LM
//! head), converted once to BF16 and
//! uploaded (norm weights too: the kernels take BF16 norm weights, which
//! is what checkpoints store). Matrices that the same input feeds are fused on upload (q/k/v
//! into one `[q+2kv, H]` matrix, gate/up into `[2I, H]`) so each is one GEMM.
//! A block whose description runs it in FP16 gets its matrices in FP16
//! ([`Weight16`], converted from the BF16 values by [`to_f16`]): the fused
//! QKV weight of an FP16 attention block, the router, dense-MLP and
//! shared-expert weights of an FP16 MLP block. Both are 2 bytes, so
//! [`weight_bytes`] does not depend on the formats.
//!
//! Small per-channel vectors the kernels add in f32 (q/k/v and o biases,
//! attention sinks, the router bias) are widened to f32 on upload, which is
//! exact for the BF16 a checkpoint stores; so is the RoPE frequency table
//! of a family without q/k norms, computed on the host once.
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
use krasis_kernels::Act16;
use krasis_model::arch::{ActFormat, LayerTensor, ModelTensor};
use krasis_model::{Checkpoint, DType, Geometry, MlpKind, ModelConfig, TensorView};

pub struct LayerWeights {
    pub input_norm: CudaSlice<bf16>,
    pub post_attention_norm: CudaSlice<bf16>,
    /// Per-head q and k RMSNorm weights `[head_dim]` (families with q/k
    /// norms, whose RoPE is fused with them).
    pub qk_norm: Option<QkNorm>,
    /// `[q_dim + 2*kv_dim, H]`: rows of q_proj, then k_proj, then v_proj,
    /// in the attention's format.
    pub qkv: Weight16,
    /// f32 `[q_dim + 2*kv_dim]`: the q, k and v biases fused like `qkv`.
    pub qkv_bias: Option<CudaSlice<f32>>,
    /// `[H, q_dim]`.
    pub o_proj: CudaSlice<bf16>,
    /// f32 `[H]`.
    pub o_bias: Option<CudaSlice<f32>>,
    /// f32 `[num_heads]` attention-sink logits.
    pub sinks: Option<CudaSlice<f32>>,
    pub mlp: MlpWeights,
}

/// A matrix in its block's 16-bit activation format (`AttentionSpec::
/// activations` for the fused QKV weight, `MlpSpec::activations` for the
/// router, dense-MLP and shared-expert weights): the GEMM's two inputs
/// share it.
pub enum Weight16 {
    Bf16(CudaSlice<bf16>),
    /// Converted from the BF16 weight at upload ([`to_f16`]).
    F16(CudaSlice<f16>),
}

impl Weight16 {
    pub fn format(&self) -> ActFormat {
        match self {
            Weight16::Bf16(_) => ActFormat::Bf16,
            Weight16::F16(_) => ActFormat::F16,
        }
    }

    /// The weight as `A`, which must be its format: a block asks for the
    /// format its description says, so a weight uploaded in another one is
    /// refused (`what` names it), never read as the wrong type.
    pub(crate) fn get<A: Act16>(&self, what: &str) -> Result<cudarc::driver::CudaView<'_, A>> {
        match self {
            // SAFETY (both arms): `A` is this variant's own element type
            // (checked by its format), so the view is the slice itself.
            Weight16::Bf16(w) if !A::F16 => {
                Ok(unsafe { w.transmute::<A>(w.len()) }.expect("the slice's own element type"))
            }
            Weight16::F16(w) if A::F16 => {
                Ok(unsafe { w.transmute::<A>(w.len()) }.expect("the slice's own element type"))
            }
            _ => Err(GpuError::Unsupported(format!(
                "internal: {what} is {} but its block runs in {}",
                self.format().name(),
                crate::act::format_of::<A>().name()
            ))),
        }
    }

    /// Device address of element `offset` (either format: 2 bytes each).
    pub(crate) fn ptr(&self, gpu: &Gpu, offset: usize) -> u64 {
        match self {
            Weight16::Bf16(w) => crate::forward::ptr(gpu, w, offset),
            Weight16::F16(w) => crate::forward::ptr(gpu, w, offset),
        }
    }
}

pub struct QkNorm {
    pub q: CudaSlice<bf16>,
    pub k: CudaSlice<bf16>,
}

/// RoPE from a frequency table (families without q/k norms, and every
/// partial rotary): f32 `[rotary_dim / 2]` inverse frequencies and the
/// cos/sin scale, from `krasis_model::layers::rope::inv_freq` over the
/// rotated dimensions (YaRN's blend and attention factor, or the default
/// table and 1).
pub struct RopeTable {
    pub inv_freq: CudaSlice<f32>,
    pub scale: f32,
    /// The rotated leading dimensions of each head (`head_dim` unless the
    /// rotary is partial).
    pub rotary_dim: usize,
}

/// Whether the engine computes RoPE from a host table (see [`RopeTable`]):
/// the fused q/k-norm kernel computes full-head default frequencies
/// itself; everything else reads the table. The one rule the upload and
/// [`weight_bytes`] share.
pub(crate) fn rope_table_len(g: &Geometry) -> Option<usize> {
    let rot = g.rope.rotary_dim.unwrap_or(g.head_dim);
    (!g.attention.qk_norm || rot != g.head_dim).then_some(rot / 2)
}

/// A layer's MLP block; every matrix in the model's
/// `MlpSpec::activations` format.
pub enum MlpWeights {
    Moe {
        /// `[E, H]`.
        router: Weight16,
        /// f32 `[E]`, added to the logits before selection.
        router_bias: Option<CudaSlice<f32>>,
        /// f32 `[E]`, added to the choice scores only (glm4_moe's
        /// `e_score_correction_bias`; the checkpoint stores it in f32).
        selection_bias: Option<CudaSlice<f32>>,
        /// The ungated shared expert added to every token's routed output
        /// (always resident: it runs for every token).
        shared: Option<SwigluMlp>,
        /// Index of this layer among the MoE layers (row of the expert pointer table).
        moe_index: usize,
    },
    Dense(SwigluMlp),
}

/// A SwiGLU MLP (a dense layer's MLP, or a MoE layer's shared expert), run
/// by `crate::mlp::swiglu_mlp`.
pub struct SwigluMlp {
    /// `[2I, H]`: gate rows then up rows (the same fusion as the INT4 `w13`).
    pub gate_up: Weight16,
    /// `[H, I]`.
    pub down: Weight16,
    /// `I`.
    pub inter: usize,
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
    /// The RoPE table ([`rope_table_len`]).
    pub rope: Option<RopeTable>,
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
        crate::support::check_supported(config)?;
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
            let a = &g.attention;
            let qkv_parts = [(t(QProj), q), (t(KProj), kv), (t(VProj), kv)];
            let qkv = up.matrix(a.activations, &qkv_parts, h)?;
            let mf = g.mlp.activations;
            let qkv_bias = match a.qkv_bias {
                true => Some(up.f32_fused(&[(t(QBias), q), (t(KBias), kv), (t(VBias), kv)])?),
                false => None,
            };
            let mlp = match g.mlp_kind(i) {
                MlpKind::Moe => {
                    let m = MlpWeights::Moe {
                        router: up.matrix(mf, &[(t(Router), g.num_experts)], h)?,
                        router_bias: match g.router.bias {
                            true => Some(up.f32(&t(RouterBias), g.num_experts)?),
                            false => None,
                        },
                        selection_bias: match g.router.selection_bias {
                            true => Some(up.f32(&t(RouterSelectionBias), g.num_experts)?),
                            false => None,
                        },
                        shared: match g.shared_intermediate {
                            Some(s) => Some(up.swiglu(
                                mf,
                                [t(SharedGate), t(SharedUp), t(SharedDown)],
                                s,
                                h,
                            )?),
                            None => None,
                        },
                        moe_index,
                    };
                    moe_index += 1;
                    m
                }
                MlpKind::Dense => MlpWeights::Dense(up.swiglu(
                    mf,
                    [t(DenseGate), t(DenseUp), t(DenseDown)],
                    g.intermediate,
                    h,
                )?),
            };
            let input_norm = up.bf16_one(&t(InputNorm), &[h])?;
            let post_attention_norm = up.bf16_one(&t(PostAttentionNorm), &[h])?;
            let qk_norm = match a.qk_norm {
                true => Some(QkNorm {
                    q: up.bf16_one(&t(QNorm), &[hd])?,
                    k: up.bf16_one(&t(KNorm), &[hd])?,
                }),
                false => None,
            };
            layers.push(LayerWeights {
                input_norm,
                post_attention_norm,
                qk_norm,
                qkv,
                qkv_bias,
                o_proj: up.bf16(&[&t(OProj)], &[h, q])?,
                o_bias: match a.o_bias {
                    true => Some(up.f32(&t(OBias), h)?),
                    false => None,
                },
                sinks: match a.sinks {
                    true => Some(up.f32(&t(Sinks), g.num_heads)?),
                    false => None,
                },
                mlp,
            });
        }
        let rope = match rope_table_len(g) {
            None => None,
            Some(half) => {
                let (inv_freq, scale) = krasis_model::layers::rope::inv_freq(2 * half, g.rope);
                let dev = gpu.upload(&inv_freq, "RoPE frequency table")?;
                up.bytes += 4 * inv_freq.len();
                up.done(4 * inv_freq.len());
                Some(RopeTable {
                    inv_freq: dev,
                    scale,
                    rotary_dim: 2 * half,
                })
            }
        };
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
            rope,
            bytes,
            host_bytes,
        })
    }
}

/// Where [`ModelWeights::upload`] puts the non-expert weights, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WeightBytes {
    /// 16-bit in VRAM (BF16, or FP16 for an FP16 block's matrices):
    /// attention, norms, routers, dense MLPs and shared experts, the LM
    /// head (and the input embedding when tied to it); f32 biases, sinks,
    /// selection biases and the RoPE table.
    pub device: usize,
    /// BF16 in mapped host memory: the untied input embedding.
    pub host: usize,
}

/// The sizes [`ModelWeights::upload`] allocates for `g` (it checks its own
/// total against this), tensor by tensor: BF16 matrices and norms, f32
/// biases, sinks and RoPE table.
pub fn weight_bytes(g: &Geometry) -> WeightBytes {
    let (h, q, kv, hd) = (g.hidden, g.q_dim(), g.kv_dim(), g.head_dim);
    let a = &g.attention;
    let table = g.vocab_size * h;
    // The LM head (or the tied embedding), the final norm.
    let mut elems = table + h;
    let mut f32s = rope_table_len(g).unwrap_or(0);
    for kind in g.layers.iter().map(|l| l.mlp) {
        // Fused q/k/v, o_proj, the two RMSNorms.
        elems += (q + 2 * kv) * h + h * q + 2 * h;
        if a.qk_norm {
            elems += 2 * hd;
        }
        if a.qkv_bias {
            f32s += q + 2 * kv;
        }
        if a.o_bias {
            f32s += h;
        }
        if a.sinks {
            f32s += g.num_heads;
        }
        elems += match kind {
            MlpKind::Moe => g.num_experts * h + 3 * g.shared_intermediate.unwrap_or(0) * h,
            MlpKind::Dense => 3 * g.intermediate * h,
        };
        if kind == MlpKind::Moe {
            f32s +=
                g.num_experts * (usize::from(g.router.bias) + usize::from(g.router.selection_bias));
        }
    }
    let host = if g.tie_word_embeddings { 0 } else { table };
    WeightBytes {
        device: 2 * elems + 4 * f32s,
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

    /// [`Uploader::bf16_fused`] converted to FP16 ([`to_f16`]).
    fn f16_fused(&mut self, parts: &[(String, usize)], cols: usize) -> Result<CudaSlice<f16>> {
        let mut host = Vec::with_capacity(parts.iter().map(|(_, r)| r * cols).sum());
        for (name, rows) in parts {
            let t = self.ckpt.expect(name, &[*rows, cols])?;
            host.extend(to_f16(&to_bf16_bits(&t), name)?);
        }
        self.bytes += host.len() * 2;
        let dev = self.gpu.upload(&host, &parts[0].0)?;
        self.done(host.len() * 2);
        Ok(dev)
    }

    /// The row-concatenation of `[rows_i, cols]` tensors in `format` (a
    /// block's matrix, one part or fused).
    fn matrix(
        &mut self,
        format: ActFormat,
        parts: &[(String, usize)],
        cols: usize,
    ) -> Result<Weight16> {
        Ok(match format {
            ActFormat::Bf16 => Weight16::Bf16(self.bf16_fused(parts, cols)?),
            ActFormat::F16 => Weight16::F16(self.f16_fused(parts, cols)?),
        })
    }

    /// A SwiGLU MLP of width `inter` in `format` (`[gate, up, down]`
    /// tensor names): gate and up fused into `[2I, H]`.
    fn swiglu(
        &mut self,
        format: ActFormat,
        [gate, up, down]: [String; 3],
        inter: usize,
        h: usize,
    ) -> Result<SwigluMlp> {
        Ok(SwigluMlp {
            gate_up: self.matrix(format, &[(gate, inter), (up, inter)], h)?,
            down: self.matrix(format, &[(down, h)], inter)?,
            inter,
        })
    }

    fn bf16_one(&mut self, name: &str, shape: &[usize]) -> Result<CudaSlice<bf16>> {
        self.bf16(&[name], shape)
    }

    /// A `[len]` vector widened to f32 (exact from BF16/F16).
    fn f32(&mut self, name: &str, len: usize) -> Result<CudaSlice<f32>> {
        self.f32_fused(&[(name.to_string(), len)])
    }

    /// Concatenation of `[len_i]` vectors, in f32.
    fn f32_fused(&mut self, parts: &[(String, usize)]) -> Result<CudaSlice<f32>> {
        let mut host = Vec::with_capacity(parts.iter().map(|(_, n)| n).sum());
        for (name, len) in parts {
            host.extend(self.ckpt.expect(name, &[*len])?.to_f32());
        }
        self.bytes += host.len() * 4;
        let dev = self.gpu.upload(&host, &parts[0].0)?;
        self.done(host.len() * 4);
        Ok(dev)
    }
}

/// A BF16 weight `name` as FP16, for a block that runs in FP16 (the fused
/// QKV weight of an FP16 attention block; the router, dense-MLP and
/// shared-expert weights of an FP16 MLP block).
/// Exact for every value in FP16's normal range (|w| from 2^-14 to 65504:
/// FP16 has 3 more mantissa bits than BF16); values below 2^-14 become FP16
/// subnormals, rounded to nearest (2^-24 steps, under 2^-25 to 0), a
/// change of at most 2^-25 absolute per weight (the reference's emulation
/// rounds the MLP block's weights the same way, `Rounding::mlp_weights`).
/// A value FP16 cannot hold (|w| > 65504, inf, NaN) is refused, naming the
/// tensor: the engine never computes with a weight that became infinite.
pub fn to_f16(w: &[bf16], name: &str) -> Result<Vec<f16>> {
    if let Some((i, v)) = w
        .iter()
        .enumerate()
        .find(|(_, v)| v.is_nan() || v.to_f32().abs() > f16::MAX.to_f32())
    {
        return Err(GpuError::Unsupported(format!(
            "{name}: element {i} is {v}, outside FP16's range (±65504); this model's \
             description runs the weight's block in FP16, which cannot hold it"
        )));
    }
    Ok(w.iter().map(|v| f16::from_f32(v.to_f32())).collect())
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

    /// The plan's weight sizes are the checkpoint's non-expert tensors
    /// (BF16 matrices, norms and shared experts; f32 biases, sinks, router
    /// and selection biases), plus the f32 RoPE table of a family without
    /// q/k norms or with a partial rotary, for a tied and an untied
    /// synthetic model with dense layers, for gpt_oss and for glm4_moe (an
    /// MTP layer the checkpoint carries is skipped, never uploaded).
    #[test]
    fn weight_bytes_are_the_checkpoints_non_expert_tensors() {
        for (preset, tie) in [
            ("tiny", false),
            ("tiny", true),
            ("tiny-dense", false),
            ("tiny-gpt-oss", false),
            ("tiny-glm4-moe", false),
        ] {
            let dir = krasis_model::testutil::tiny_checkpoint_with(
                preset,
                &[("tie_word_embeddings", serde_json::json!(tie))],
            );
            let config = ModelConfig::load(&dir).unwrap();
            let g = config.geometry();
            let ckpt = Checkpoint::open(&dir).unwrap();
            let experts: std::collections::HashSet<String> = g
                .moe_layers()
                .flat_map(|l| config.routed_expert_tensor_names(l))
                .collect();
            // Roles uploaded in f32, by their names in this checkpoint.
            use LayerTensor::*;
            let wide: std::collections::HashSet<String> = (0..g.num_layers)
                .flat_map(|l| {
                    [
                        QBias,
                        KBias,
                        VBias,
                        OBias,
                        Sinks,
                        RouterBias,
                        RouterSelectionBias,
                    ]
                    .map(|r| config.layer_tensor_name(l, r))
                })
                .collect();
            let skipped = config.skipped_prefixes();
            let mut bytes = 0;
            for name in ckpt.tensor_names() {
                if !experts.contains(name) && !skipped.iter().any(|p| name.starts_with(p)) {
                    let size = if wide.contains(name) { 4 } else { 2 };
                    bytes += size * ckpt.get(name).unwrap().numel();
                }
            }
            bytes += 4 * rope_table_len(&g).unwrap_or(0);
            let w = weight_bytes(&g);
            assert_eq!(w.device + w.host, bytes, "{preset} tie={tie}");
            let table = 2 * g.vocab_size * g.hidden;
            assert_eq!(w.host, if tie { 0 } else { table }, "{preset} tie={tie}");
        }
    }

    /// A weight converted to FP16: exact in FP16's normal range, subnormal
    /// (and rounded) below it, refused (naming the tensor) past ±65504.
    #[test]
    fn to_f16_is_exact_in_range_and_refuses_overflow() {
        let name = "model.layers.3.self_attn.k_proj.weight";
        // Every BF16 value with |w| in [2^-14, 65504] is exact in FP16.
        let normal: Vec<bf16> = (0..=u16::MAX)
            .map(bf16::from_bits)
            .filter(|v| {
                let a = v.to_f32().abs();
                (2f32.powi(-14)..=65504.0).contains(&a)
            })
            .collect();
        let h = to_f16(&normal, name).unwrap();
        assert!(h.iter().zip(&normal).all(|(h, b)| h.to_f32() == b.to_f32()));
        // Below 2^-14: subnormal FP16, rounded to 2^-24 steps.
        let tiny = [
            bf16::from_f32(2f32.powi(-20)),
            bf16::from_f32(3e-8),
            bf16::ZERO,
        ];
        let h = to_f16(&tiny, name).unwrap();
        assert_eq!(h[0].to_f32(), 2f32.powi(-20));
        assert!(!h[0].is_normal() && h[0] != f16::ZERO, "subnormal");
        assert_eq!(
            h[1].to_f32(),
            2f32.powi(-24),
            "3e-8 rounds to the smallest subnormal"
        );
        assert_eq!(h[2], f16::ZERO);
        // Past FP16's range: refused with the tensor and the value.
        for bad in [65536.0f32, -1e5, f32::INFINITY, f32::NAN] {
            let e = to_f16(&[bf16::ONE, bf16::from_f32(bad)], name)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(name) && e.contains("element 1") && e.contains("65504"),
                "{e}"
            );
        }
    }

    /// gpt_oss uploads its biases and sinks and no q/k norms: the sizes
    /// differ from a qwen3-shaped plan by exactly those tensors.
    #[test]
    fn gpt_oss_weight_bytes_count_biases_sinks_and_the_rope_table() {
        let dir = krasis_model::testutil::tiny_gpt_oss_checkpoint();
        let g = ModelConfig::load(&dir).unwrap().geometry();
        assert!(g.attention.sinks && g.attention.qkv_bias && !g.attention.qk_norm);
        let mut plain = g.clone();
        plain.attention = krasis_model::arch::AttentionSpec {
            qk_norm: true,
            ..Default::default()
        };
        plain.router.bias = false;
        let (q, kv, h, hd) = (g.q_dim(), g.kv_dim(), g.hidden, g.head_dim);
        let per_layer = 4 * (q + 2 * kv + h + g.num_heads) - 2 * 2 * hd;
        let want = weight_bytes(&plain).device
            + g.num_layers * per_layer
            + 4 * g.num_moe_layers() * g.num_experts
            + 4 * hd / 2;
        assert_eq!(weight_bytes(&g).device, want);
    }

    /// glm4_moe's sizes differ from the same plan without its parts by
    /// exactly those parts: the shared expert (3 S H BF16) and selection
    /// bias (f32 E) of every MoE layer, and the partial rotary's table
    /// (f32 rotary_dim / 2, present although tiny-glm4-moe has q/k norms).
    #[test]
    fn glm4_moe_weight_bytes_count_the_shared_expert_selection_bias_and_table() {
        let json = krasis_model::synth::preset_config("tiny-glm4-moe")
            .unwrap()
            .to_string();
        let g = ModelConfig::from_json_str(&json, std::path::Path::new("tiny-glm4-moe"))
            .unwrap()
            .geometry();
        let (s, rot) = (g.shared_intermediate.unwrap(), g.rope.rotary_dim.unwrap());
        assert!(g.attention.qk_norm && rot < g.head_dim && g.router.selection_bias);
        assert!(g.num_moe_layers() < g.num_layers, "a dense first layer");
        let mut plain = g.clone();
        plain.shared_intermediate = None;
        plain.router.selection_bias = false;
        plain.rope.rotary_dim = None;
        let moe = g.num_moe_layers();
        let want = weight_bytes(&plain).device
            + moe * (2 * 3 * s * g.hidden + 4 * g.num_experts)
            + 4 * rot / 2;
        assert_eq!(weight_bytes(&g).device, want);
    }
}
