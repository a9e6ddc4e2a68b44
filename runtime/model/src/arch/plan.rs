//! The layer plan: what each architecture's description says about its
//! components, in the shared vocabulary both engines build from.
//!
//! An architecture module (`arch/<model_type>.rs`) parses its `config.json`
//! into these values; the CPU reference (`reference/`) and the CUDA engine
//! (`krasis_gpu`) read only them, never the model type. Model-wide choices
//! (RoPE, the attention's extras, the router, the expert activation) are
//! single values; what varies by layer (attention window, dense or MoE
//! mixer) is in [`LayerSpec`]. This is the llama.cpp shape (hyperparameters
//! plus per-layer arrays, wired over shared `build_attn`/`build_moe_ffn`)
//! and vLLM's (the MoE layer takes its routing function as a part).
//!
//! A component an engine does not implement is refused when the engine is
//! built (see `krasis_gpu::supports`), naming the component; nothing falls
//! back to a different computation.

/// Rotary position embedding of every layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeSpec {
    pub theta: f64,
    pub scaling: RopeScaling,
    /// Partial rotary: only the first `rotary_dim` dimensions of each head
    /// rotate (`rotate_half` within them, frequencies over `rotary_dim`),
    /// the rest pass through (glm4_moe: `partial_rotary_factor` 0.5).
    /// `None`: the whole head.
    pub rotary_dim: Option<usize>,
}

/// How the rotary frequencies are stretched for long contexts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// `theta^(-2i/d)` as written.
    None,
    /// YaRN (Peng et al. 2023) as transformers' `_compute_yarn_parameters`:
    /// frequencies blended between interpolated (`/ factor`) and
    /// extrapolated by a linear ramp over the dimensions whose wavelengths
    /// fall between `beta_fast` and `beta_slow` rotations in
    /// `original_max_position` tokens, and cos/sin scaled by
    /// `0.1 ln(factor) + 1`. gpt-oss: factor 32 over 4,096 positions.
    Yarn {
        factor: f64,
        original_max_position: usize,
        beta_fast: f64,
        beta_slow: f64,
        /// Round the ramp's ends to whole dimensions (transformers'
        /// default `true`; gpt-oss sets `false`).
        truncate: bool,
    },
}

/// Model-wide extras of the attention block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AttentionSpec {
    /// Per-head RMSNorm of q and k before RoPE (qwen3_moe).
    pub qk_norm: bool,
    /// Biases on the q, k and v projections.
    pub qkv_bias: bool,
    /// A bias on the output projection.
    pub o_bias: bool,
    /// A learned logit per query head that joins every softmax and is then
    /// dropped (gpt_oss "attention sinks": lets a head attend to nothing).
    pub sinks: bool,
    /// The 16-bit format of the attention block's activations: the input
    /// RMSNorm's output (the QKV projection input), the QKV projection's
    /// weight, q/k/v, the KV cache and the softmax probabilities of `P·V`.
    /// The attention output (o_proj input) stays BF16 whatever this says.
    /// Both engines read it: the CUDA engine stores in it, the CPU
    /// reference's emulation of that engine rounds to it ([`ActFormat`]).
    pub activations: ActFormat,
}

/// A 16-bit activation format the engines store a block's activations in
/// ([`AttentionSpec::activations`], [`MlpSpec::activations`]).
///
/// BF16 is the default (the format of the checkpoints' weights). FP16 has
/// 3 more mantissa bits and a range of ±65504; both are 2 bytes, so the
/// choice changes no buffer size. A family takes FP16 for a block where
/// BF16's rounding there moves the logits by more than the 1% bound of the
/// GPU check (measured with the reference's emulation,
/// `examples/gpt_oss_rounding.rs`):
/// - gpt_oss's attention: its YaRN attention factor scales q and k by
///   1.347 each with no q/k norm, so every attention score by 1.81, and
///   BF16's rounding of the QKV input and of q/k moves the softmax past
///   the bound (benchmarks/results/2026-12-01-issue13-gpt-oss-rounding.md).
///   llama.cpp's default KV cache type is FP16 too.
/// - glm4_moe's MLP block: its MLP outputs are large against the residual
///   (routed scaling 2.5 plus the shared expert: block output rms ~1.2 vs
///   the attention's ~0.33), so BF16 rounding of the MLP inputs and
///   intermediates grows the residual's relative error ~0.15-0.2% per
///   layer; tiny-glm4-moe's emulation reaches 1.18 bounds with a BF16 MLP
///   block and 0.62 with an FP16 one (benchmarks/results/
///   2026-12-02-issue14-glm-rounding.md, -glm-fp16-mlp.md).
///
/// FP16 tensor cores run at BF16's rate; a value past ±65504 becomes
/// infinite in a conversion, which the engines refuse for weights (at
/// upload) and detect in the logits (the sampler), never as a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ActFormat {
    #[default]
    Bf16,
    F16,
}

impl ActFormat {
    /// Its name in engine options, capability reports, heatmap bindings
    /// and model reports (`attention_precision`, `kv_format`,
    /// `mlp_precision`): the registry's entries must equal it (tested
    /// there).
    pub fn name(self) -> &'static str {
        match self {
            ActFormat::Bf16 => "bf16",
            ActFormat::F16 => "fp16",
        }
    }
}

/// Model-wide choices of every layer's MLP block: a dense layer's MLP, a
/// MoE layer's router input, routed experts and shared expert (which kind
/// a layer has is [`LayerSpec::mlp`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MlpSpec {
    /// The 16-bit format of the block's activations and weights: the
    /// post-attention RMSNorm's output (the router's and every MLP's
    /// input), the router, dense and shared-expert weights (converted from
    /// the checkpoint's BF16), the routed experts' dequantized weights, the
    /// gate/up GEMM outputs and the SwiGLU product (the down projection's
    /// input). Router logits, accumulations and the block's output into
    /// the residual stay f32 whatever this says. Both engines read it: the
    /// CUDA engine stores in it, the CPU reference's emulation rounds to it.
    pub activations: ActFormat,
}

/// Which keys a layer's queries see.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKind {
    /// Every earlier position (causal).
    Full,
    /// Only the last `window` positions including the query's own
    /// (transformers: key `j` is visible from query `i` iff
    /// `0 <= i - j < window`).
    Sliding { window: usize },
}

impl AttentionKind {
    /// First key position visible from a query at `pos`.
    pub fn first_key(self, pos: usize) -> usize {
        match self {
            AttentionKind::Full => 0,
            AttentionKind::Sliding { window } => (pos + 1).saturating_sub(window),
        }
    }
}

/// What the MLP of a layer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpKind {
    /// Routed experts.
    Moe,
    /// A plain SwiGLU MLP of `Geometry::intermediate` width.
    Dense,
}

/// One decoder layer's plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSpec {
    pub attention: AttentionKind,
    pub mlp: MlpKind,
}

/// How a MoE router turns its logits into `(expert, weight)` pairs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RouterKind {
    /// Softmax over all experts in f32, the top-k, and (when `renormalize`)
    /// their weights divided by their sum (qwen3_moe `norm_topk_prob`).
    SoftmaxTopK { renormalize: bool },
    /// The top-k of the raw logits, then a softmax over those k
    /// (gpt_oss, Mixtral).
    TopKSoftmax,
    /// Group-limited selection on sigmoid scores (glm4_moe, DeepSeek-V3's
    /// "noaux_tc"): `s = sigmoid(logit)`; the choice score is `s` plus the
    /// layer's selection bias; the experts form `groups` equal groups,
    /// each scored by the sum of its two best choice scores; only the
    /// `topk_groups` best groups stay, the others' choice scores become 0;
    /// the top-k choice scores pick the experts, whose weights are their
    /// `s` (bias-free), divided by their sum (+1e-20) when `renormalize`,
    /// then multiplied by `scale` (`routed_scaling_factor`).
    SigmoidGroupedTopK {
        groups: usize,
        topk_groups: usize,
        renormalize: bool,
        scale: f32,
    },
}

/// The router of every MoE layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterSpec {
    pub kind: RouterKind,
    /// The router linear has a bias (added to its logits).
    pub bias: bool,
    /// A per-expert bias added to the scores for choosing experts only,
    /// never to their weights (glm4_moe's `e_score_correction_bias`).
    pub selection_bias: bool,
}

/// The gated activation between an expert's gate/up and down projections.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activation {
    /// `silu(gate) * up`.
    Swiglu,
    /// gpt_oss: `gate = min(gate, limit)`, `up = clamp(up, -limit, limit)`,
    /// `(up + 1) * gate * sigmoid(alpha * gate)`.
    ClampedSwiglu { limit: f32, alpha: f32 },
}

/// The routed experts of every MoE layer (their sizes are in `Geometry`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpertSpec {
    pub activation: Activation,
    /// gate/up and down projections have biases.
    pub bias: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sliding_window_first_key_matches_the_transformers_mask() {
        let w = AttentionKind::Sliding { window: 4 };
        // Query 5 sees keys 2..=5 (5 - j < 4).
        assert_eq!(w.first_key(5), 2);
        assert_eq!(w.first_key(3), 0);
        assert_eq!(w.first_key(0), 0);
        assert_eq!(AttentionKind::Full.first_key(100), 0);
    }
}
