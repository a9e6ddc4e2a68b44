//! What the CUDA engine builds: the layer-plan components it implements and
//! the sizes its kernels take. A model whose plan names anything else is
//! refused before anything is uploaded, with every missing part named (the
//! reference backend runs every component; `--backend reference`).

use crate::error::{GpuError, Result};
use krasis_model::Geometry;
use krasis_model::arch::{Activation, AttentionKind, RopeScaling, RouterKind};

/// The components of `g`'s layer plan this engine has no kernels for.
fn missing_components(g: &Geometry) -> Vec<String> {
    let mut why = Vec::new();
    let a = &g.attention;
    if !a.qk_norm {
        why.push("attention without q/k RMSNorm".to_string());
    }
    if a.qkv_bias || a.o_bias {
        why.push("attention projection biases".to_string());
    }
    if a.sinks {
        why.push("attention sinks".to_string());
    }
    if g.layers
        .iter()
        .any(|l| matches!(l.attention, AttentionKind::Sliding { .. }))
    {
        why.push("sliding-window attention layers".to_string());
    }
    if let RopeScaling::Yarn { .. } = g.rope.scaling {
        why.push("YaRN RoPE scaling".to_string());
    }
    if g.num_moe_layers() > 0 {
        if g.router.kind == RouterKind::TopKSoftmax {
            why.push("a top-k-then-softmax router".to_string());
        }
        if g.router.bias {
            why.push("a router bias".to_string());
        }
        if let Activation::ClampedSwiglu { .. } = g.experts.activation {
            why.push("clamped SwiGLU experts".to_string());
        }
        if g.experts.bias {
            why.push("expert biases".to_string());
        }
    }
    why
}

/// Refuses geometries the kernels cannot run, before anything is uploaded.
pub(crate) fn check_supported(g: &Geometry) -> Result<()> {
    let mut why = missing_components(g);
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
    if !g.hidden.is_multiple_of(128) {
        why.push(format!("hidden {} (must be a multiple of 128)", g.hidden));
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
        // The INT4 group is the largest of 128/64/32 dividing both widths,
        // as the cache chooses it; the decode GEMVs' own limits decide.
        let (h, i) = (g.hidden, g.expert_intermediate);
        let fits = krasis_kernels::INT4_GROUPS
            .iter()
            .rev()
            .find_map(|&grp| krasis_kernels::Int4Layout::new(h, i, grp))
            .ok_or_else(|| format!("expert {h}x{i} (no INT4 group of 32/64/128 divides both)"))
            .and_then(|l| l.check_decode(g.top_k).map_err(|e| e.to_string()));
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
    use krasis_model::arch::{AttentionKind, LayerSpec, MlpKind};
    use krasis_model::synth::preset_config;

    fn a3b() -> Geometry {
        let json = preset_config("a3b-24l").unwrap().to_string();
        krasis_model::ModelConfig::from_json_str(&json, std::path::Path::new("a3b-24l"))
            .unwrap()
            .geometry()
    }

    #[test]
    fn qwen3_moe_plan_is_fully_supported() {
        check_supported(&a3b()).unwrap();
    }

    #[test]
    fn every_missing_component_is_named() {
        let mut g = a3b();
        g.attention.sinks = true;
        g.attention.qk_norm = false;
        g.layers[0] = LayerSpec {
            attention: AttentionKind::Sliding { window: 128 },
            mlp: MlpKind::Moe,
        };
        g.router.kind = RouterKind::TopKSoftmax;
        g.experts.bias = true;
        let e = check_supported(&g).unwrap_err().to_string();
        for part in [
            "attention sinks",
            "q/k RMSNorm",
            "sliding-window",
            "top-k-then-softmax",
            "expert biases",
        ] {
            assert!(e.contains(part), "{part} missing from: {e}");
        }
    }
}
