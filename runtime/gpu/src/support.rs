//! What the CUDA engine builds: the layer-plan components it implements and
//! the sizes its kernels take. A model whose plan names anything else is
//! refused before anything is uploaded, with every missing part named (the
//! reference backend runs every component; `--backend reference`).

use crate::error::{GpuError, Result};
use krasis_kernels::ops::moe::ROUTER_MAX_GROUPS;
use krasis_kernels::ops::mxfp4::{
    MXFP4_DECODE_MAX_HIDDEN, MXFP4_DECODE_MAX_INTER, MXFP4_DECODE_MAX_TOPK,
};
use krasis_model::arch::{ActFormat, Activation, RopeScaling, RouterKind};
use krasis_model::{ExpertStorage, Geometry, ModelConfig};

/// How the expert cache will hold a model's routed experts: the
/// checkpoint's MXFP4 bits are kept as they are, float experts become INT4
/// (`krasis_cache`'s rule).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExpertBits {
    Int4,
    Mxfp4,
}

impl ExpertBits {
    pub(crate) fn of(config: &ModelConfig) -> Self {
        let g = config.geometry();
        let fused = g
            .moe_layers()
            .any(|l| matches!(config.expert_storage(l), ExpertStorage::FusedMxfp4(_)));
        if fused { Self::Mxfp4 } else { Self::Int4 }
    }
}

/// The components of `g`'s layer plan this engine has no kernels for, with
/// experts cached as `bits`.
fn missing_components(g: &Geometry, bits: ExpertBits) -> Vec<String> {
    let mut why = Vec::new();
    // The fused q/k-norm + RoPE kernel computes full-head default
    // frequencies; table RoPE (any scaling) runs without a q/k norm, and
    // the partial-rotary kernel takes a table with or without one.
    let partial = g.rope.rotary_dim.is_some_and(|r| r != g.head_dim);
    if g.attention.qk_norm && g.rope.scaling != RopeScaling::None && !partial {
        why.push("RoPE scaling together with q/k RMSNorm".to_string());
    }
    // The FP16 attention path (ActFormat::F16) is built for gpt_oss's
    // shape: table RoPE, and q/k/v biases (its projection goes through f32
    // + bias, rounded once to FP16).
    if g.attention.activations == ActFormat::F16 {
        if g.attention.qk_norm {
            why.push(
                "FP16 attention with q/k RMSNorm (the fused q/k-norm RoPE is BF16 only)".into(),
            );
        }
        if !g.attention.qkv_bias {
            why.push("FP16 attention without q/k/v biases".to_string());
        }
        if partial {
            why.push("FP16 attention with partial rotary (its RoPE kernel is BF16 only)".into());
        }
    }
    if let Some(r) = g.rope.rotary_dim.filter(|_| partial)
        && (r < 2 || !r.is_multiple_of(2) || r > g.head_dim)
    {
        why.push(format!(
            "partial rotary over {r} of {} dimensions (must be even)",
            g.head_dim
        ));
    }
    if g.num_moe_layers() > 0 {
        match g.router.kind {
            RouterKind::SigmoidGroupedTopK {
                groups,
                topk_groups,
                ..
            } => {
                // The kernel adds its one bias to the choice scores.
                if g.router.bias {
                    why.push(
                        "a router logit bias with the sigmoid group-limited router".to_string(),
                    );
                }
                let e = g.num_experts;
                if !(1..=ROUTER_MAX_GROUPS).contains(&groups)
                    || !e.is_multiple_of(groups)
                    || !(1..=groups).contains(&topk_groups)
                    || (groups > 1 && e / groups < 2)
                    || g.top_k > topk_groups * (e / groups)
                {
                    why.push(format!(
                        "sigmoid grouped routing of {e} experts in {groups} groups keeping                          {topk_groups} for top-{} (at most {ROUTER_MAX_GROUPS} equal groups                          of >= 2 experts holding top_k)",
                        g.top_k
                    ));
                }
            }
            _ if g.router.selection_bias => {
                why.push("a router selection bias on a softmax router".to_string());
            }
            _ => {}
        }
        let kmax = krasis_kernels::GEMV_MAX_K;
        if let Some(s) = g.shared_intermediate
            && (s == 0 || !s.is_multiple_of(8) || s > kmax)
        {
            why.push(format!(
                "shared expert width {s} (must be a multiple of 8 up to {kmax})"
            ));
        }
    }
    // The FP16 MLP block (ActFormat::F16, glm4_moe) is built for INT4
    // experts; the MXFP4 kernels are BF16 only.
    if g.mlp.activations == ActFormat::F16 && g.num_moe_layers() > 0 && bits == ExpertBits::Mxfp4 {
        why.push("an FP16 MLP block with MXFP4 experts (their kernels are BF16 only)".into());
    }
    if g.num_moe_layers() > 0 && bits == ExpertBits::Int4 {
        if let Activation::ClampedSwiglu { .. } = g.experts.activation {
            why.push("clamped SwiGLU on INT4 experts".to_string());
        }
        if g.experts.bias {
            why.push("expert biases on INT4 experts".to_string());
        }
    }
    why
}

/// Refuses models the kernels cannot run, before anything is uploaded.
pub(crate) fn check_supported(config: &ModelConfig) -> Result<()> {
    check_geometry(&config.geometry(), ExpertBits::of(config))
}

/// [`check_supported`] of a geometry whose experts are cached as `bits`.
pub(crate) fn check_geometry(g: &Geometry, bits: ExpertBits) -> Result<()> {
    let mut why = missing_components(g, bits);
    if ![64, 128, 192, 256].contains(&g.head_dim) {
        why.push(format!(
            "head_dim {} (supported: 64, 128, 192, 256)",
            g.head_dim
        ));
    }
    if g.num_heads / g.num_kv_heads.max(1) > 16 {
        why.push(format!(
            "GQA group of {} query heads per KV head (at most 16)",
            g.num_heads / g.num_kv_heads
        ));
    }
    // Embedding gather, RMSNorm, the grouped-row gather and the decode
    // GEMVs (the fused q/k/v, router, dense and LM-head rows read hidden-
    // wide inputs, o_proj a q-wide one) read 16-byte vectors of BF16.
    let max_k = krasis_kernels::GEMV_MAX_K.min(krasis_kernels::GEMV_MAX_MK);
    for (what, k) in [("hidden", g.hidden), ("q width", g.q_dim())] {
        if k == 0 || !k.is_multiple_of(8) || k > max_k {
            why.push(format!(
                "{what} {k} (the decode GEMVs take multiples of 8 up to {max_k})"
            ));
        }
    }
    // The dense MLPs' and shared experts' down GEMV reads their width.
    let kmax = krasis_kernels::GEMV_MAX_K;
    if g.has_mlp(krasis_model::MlpKind::Dense)
        && (!g.intermediate.is_multiple_of(8) || g.intermediate > kmax)
    {
        why.push(format!(
            "dense intermediate {} (must be a multiple of 8 up to {kmax})",
            g.intermediate
        ));
    }
    if g.num_moe_layers() > 0 {
        if g.num_experts > krasis_kernels::ROUTER_MAX_EXPERTS {
            why.push(format!(
                "{} experts (at most {})",
                g.num_experts,
                krasis_kernels::ROUTER_MAX_EXPERTS
            ));
        }
        if g.top_k > krasis_kernels::ROUTER_MAX_TOPK {
            why.push(format!(
                "top-{} routing (at most {})",
                g.top_k,
                krasis_kernels::ROUTER_MAX_TOPK
            ));
        }
        let (h, i) = (g.hidden, g.expert_intermediate);
        let fits = match bits {
            // The INT4 group is the largest of 128/64/32 dividing both
            // widths, as the cache chooses it; the decode GEMVs' own limits
            // decide.
            ExpertBits::Int4 => krasis_kernels::INT4_GROUPS
                .iter()
                .rev()
                .find_map(|&grp| krasis_kernels::Int4Layout::new(h, i, grp))
                .ok_or_else(|| format!("expert {h}x{i} (no INT4 group of 32/64/128 divides both)"))
                .and_then(|l| l.check_decode(g.top_k).map_err(|e| e.to_string())),
            ExpertBits::Mxfp4 => {
                if !h.is_multiple_of(32) || !i.is_multiple_of(32) {
                    Err(format!(
                        "MXFP4 expert {h}x{i} (both must be multiples of 32)"
                    ))
                } else if h > MXFP4_DECODE_MAX_HIDDEN || i > MXFP4_DECODE_MAX_INTER {
                    Err(format!(
                        "MXFP4 expert {h}x{i} (the decode GEMVs take up to \
                         {MXFP4_DECODE_MAX_HIDDEN}x{MXFP4_DECODE_MAX_INTER})"
                    ))
                } else if g.top_k > MXFP4_DECODE_MAX_TOPK {
                    Err(format!(
                        "top-{} routing over MXFP4 experts (at most {MXFP4_DECODE_MAX_TOPK})",
                        g.top_k
                    ))
                } else {
                    Ok(())
                }
            }
        };
        if let Err(e) = fits {
            why.push(e);
        }
    }
    if why.is_empty() {
        Ok(())
    } else {
        Err(GpuError::Unsupported(format!(
            "the CUDA engine cannot run this model: {}",
            why.join("; ")
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use krasis_model::synth::preset_config;

    fn config(preset: &str) -> ModelConfig {
        let json = preset_config(preset).unwrap().to_string();
        ModelConfig::from_json_str(&json, std::path::Path::new(preset)).unwrap()
    }

    #[test]
    fn qwen3_moe_plan_is_fully_supported() {
        check_supported(&config("a3b-24l")).unwrap();
    }

    /// gpt-oss (sinks, biases, sliding windows, YaRN table RoPE, the
    /// top-k-then-softmax router with bias, clamped SwiGLU on MXFP4 experts
    /// with biases; hidden 2880) is built by this engine.
    #[test]
    fn gpt_oss_plans_are_fully_supported() {
        for preset in ["gpt-oss-20b", "gpt-oss-120b", "tiny-gpt-oss"] {
            let c = config(preset);
            assert_eq!(ExpertBits::of(&c), ExpertBits::Mxfp4, "{preset}");
            check_supported(&c).unwrap_or_else(|e| panic!("{preset}: {e}"));
        }
        assert_eq!(ExpertBits::of(&config("a3b-24l")), ExpertBits::Int4);
    }

    #[test]
    fn every_missing_component_is_named() {
        let mut g = config("a3b-24l").geometry();
        g.rope.scaling = RopeScaling::Yarn {
            factor: 32.0,
            original_max_position: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: false,
        };
        g.experts.bias = true;
        g.experts.activation = Activation::ClampedSwiglu {
            limit: 7.0,
            alpha: 1.702,
        };
        g.hidden = 2884;
        let e = check_geometry(&g, ExpertBits::Int4)
            .unwrap_err()
            .to_string();
        for part in [
            "RoPE scaling together with q/k RMSNorm",
            "clamped SwiGLU on INT4",
            "expert biases on INT4",
            "hidden 2884",
        ] {
            assert!(e.contains(part), "{part} missing from: {e}");
        }
        // MXFP4 experts take biases and the clamped activation, not widths
        // past their decode GEMVs.
        let mut g = config("gpt-oss-20b").geometry();
        g.expert_intermediate = 8192;
        let e = check_geometry(&g, ExpertBits::Mxfp4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("MXFP4 expert 2880x8192"), "{e}");
        assert!(!e.contains("clamped"), "{e}");
    }

    /// The attention format comes from the description (gpt_oss FP16,
    /// qwen3_moe BF16), and the FP16 path is refused where it is not
    /// built: with q/k norms, without q/k/v biases.
    #[test]
    fn fp16_attention_follows_the_description_and_is_refused_where_not_built() {
        assert_eq!(
            config("gpt-oss-20b").geometry().attention.activations,
            ActFormat::F16
        );
        assert_eq!(
            config("a3b-24l").geometry().attention.activations,
            ActFormat::Bf16
        );
        let mut g = config("a3b-24l").geometry();
        g.attention.activations = ActFormat::F16;
        let e = check_geometry(&g, ExpertBits::Int4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("FP16 attention with q/k RMSNorm"), "{e}");
        assert!(e.contains("FP16 attention without q/k/v biases"), "{e}");
        let mut g = config("glm-4.5-air").geometry();
        g.attention.activations = ActFormat::F16;
        let e = check_geometry(&g, ExpertBits::Int4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("FP16 attention with partial rotary"), "{e}");
        let mut g = config("gpt-oss-20b").geometry();
        g.attention.qkv_bias = false;
        let e = check_geometry(&g, ExpertBits::Mxfp4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("FP16 attention without q/k/v biases"), "{e}");
        g.attention.activations = ActFormat::Bf16;
        check_geometry(&g, ExpertBits::Mxfp4).unwrap();
    }

    /// glm4_moe (partial rotary with and without q/k norms, q/k/v biases,
    /// the sigmoid group-limited router with its selection bias, the
    /// shared expert, dense first layers; INT4 experts; its MLP block in
    /// FP16) is built by this engine.
    #[test]
    fn glm4_moe_plans_are_fully_supported() {
        for preset in ["tiny-glm4-moe", "glm-4.5-air", "glm-4.5-air-12l", "glm-4.5"] {
            let c = config(preset);
            assert_eq!(ExpertBits::of(&c), ExpertBits::Int4, "{preset}");
            assert_eq!(c.geometry().mlp.activations, ActFormat::F16, "{preset}");
            check_supported(&c).unwrap_or_else(|e| panic!("{preset}: {e}"));
        }
    }

    /// What glm4_moe's components still cannot be combined with is named:
    /// a selection bias on a softmax router, a logit bias beside it, more
    /// groups than the kernel's lanes, a shared expert the GEMVs cannot
    /// read, an odd partial rotary.
    #[test]
    fn unsupported_router_and_shared_expert_combinations_are_named() {
        let mut g = config("a3b-24l").geometry();
        g.router.selection_bias = true;
        let e = check_geometry(&g, ExpertBits::Int4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("selection bias on a softmax router"), "{e}");
        let mut g = config("glm-4.5-air").geometry();
        g.router.bias = true;
        g.shared_intermediate = Some(1404);
        g.rope.rotary_dim = Some(63);
        let RouterKind::SigmoidGroupedTopK { topk_groups, .. } = g.router.kind else {
            panic!("glm4_moe routes by sigmoid groups");
        };
        g.router.kind = RouterKind::SigmoidGroupedTopK {
            groups: 64,
            topk_groups,
            renormalize: true,
            scale: 1.0,
        };
        let e = check_geometry(&g, ExpertBits::Int4)
            .unwrap_err()
            .to_string();
        for part in [
            "logit bias with the sigmoid group-limited router",
            "in 64 groups",
            "shared expert width 1404",
            "partial rotary over 63 of 128",
        ] {
            assert!(e.contains(part), "{part} missing from: {e}");
        }
    }

    /// The MLP format comes from the description (glm4_moe FP16, the
    /// others BF16); an FP16 MLP block runs with INT4 experts (any family's
    /// other components) and is refused, by name, only with MXFP4 experts.
    #[test]
    fn fp16_mlp_follows_the_description_and_is_refused_only_with_mxfp4() {
        assert_eq!(
            config("glm-4.5-air").geometry().mlp.activations,
            ActFormat::F16
        );
        for preset in ["a3b-24l", "gpt-oss-20b"] {
            assert_eq!(
                config(preset).geometry().mlp.activations,
                ActFormat::Bf16,
                "{preset}"
            );
        }
        let mut g = config("a3b-24l").geometry();
        g.mlp.activations = ActFormat::F16;
        check_geometry(&g, ExpertBits::Int4).unwrap();
        let mut g = config("gpt-oss-20b").geometry();
        g.mlp.activations = ActFormat::F16;
        let e = check_geometry(&g, ExpertBits::Mxfp4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("an FP16 MLP block with MXFP4 experts"), "{e}");
        // A dense-only model has no experts to refuse.
        g.layers
            .iter_mut()
            .for_each(|l| l.mlp = krasis_model::MlpKind::Dense);
        g.intermediate = 2880;
        check_geometry(&g, ExpertBits::Mxfp4).unwrap();
    }
}
