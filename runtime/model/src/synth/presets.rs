//! Built-in model geometries, written as complete Hugging Face `config.json`
//! objects so that `--set` can only change fields a real checkpoint has.

use serde_json::{Value, json};

/// Names accepted by `--preset`.
pub const PRESETS: &[&str] = &["tiny", "tiny-dense", "a3b", "a3b-24l", "qcn"];

/// Qwen3-30B-A3B's `config.json` (minus `torch_dtype`, set from `--dtype`).
fn a3b() -> Value {
    json!({
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": true,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "output_router_logits": false,
        "rms_norm_eps": 1e-6,
        "rope_scaling": null,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": null,
        "tie_word_embeddings": false,
        "use_cache": true,
        "use_sliding_window": false,
        "vocab_size": 151936
    })
}

fn set(mut v: Value, fields: Value) -> Value {
    for (k, x) in fields.as_object().expect("preset patch is an object") {
        debug_assert!(v.get(k).is_some(), "preset patch adds unknown field {k}");
        v[k] = x.clone();
    }
    v
}

/// The typed geometry of a preset (for tests and estimates that need a real
/// model shape without writing a checkpoint).
pub fn preset_geometry(name: &str) -> Option<crate::Geometry> {
    let json = preset_config(name)?.to_string();
    crate::arch::ModelConfig::from_json_str(&json, std::path::Path::new(name))
        .ok()
        .map(|c| c.geometry())
}

/// The full `config.json` of a preset, or `None` for an unknown name.
pub fn preset_config(name: &str) -> Option<Value> {
    let tiny = || {
        set(
            a3b(),
            json!({
                "hidden_size": 128, "num_hidden_layers": 3, "max_window_layers": 3,
                "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 32, "max_position_embeddings": 8192
            }),
        )
    };
    Some(match name {
        "tiny" => tiny(),
        "tiny-dense" => set(
            tiny(),
            json!({ "mlp_only_layers": [0], "tie_word_embeddings": true }),
        ),
        "a3b" => a3b(),
        "a3b-24l" => set(
            a3b(),
            json!({ "num_hidden_layers": 24, "max_window_layers": 24 }),
        ),
        // Qwen3-Coder-Next geometry expressed as qwen3_moe: 512 experts top-10,
        // ~77B routed-expert parameters.
        "qcn" => set(
            a3b(),
            json!({
                "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
                "intermediate_size": 5120, "num_attention_heads": 16, "num_key_value_heads": 2,
                "head_dim": 256, "rope_theta": 10000000.0, "max_position_embeddings": 262144
            }),
        ),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::ModelConfig;
    use std::path::Path;

    #[test]
    fn every_preset_is_a_valid_config() {
        for p in PRESETS {
            let v = preset_config(p).unwrap();
            ModelConfig::from_json_str(&v.to_string(), Path::new(p)).unwrap();
        }
        assert!(preset_config("nope").is_none());
    }

    #[test]
    fn preset_sizes() {
        let g = |p| {
            let v = preset_config(p).unwrap();
            ModelConfig::from_json_str(&v.to_string(), Path::new(p))
                .unwrap()
                .geometry()
        };
        let qcn = g("qcn").total_params() as f64 / 1e9;
        assert!((77.0..79.0).contains(&qcn), "{qcn}");
        let a = g("a3b-24l");
        assert_eq!(a.num_layers, 24);
        assert_eq!(a.num_experts, 128);
        let td = g("tiny-dense");
        assert_eq!(td.mlp_kinds[0], crate::arch::MlpKind::Dense);
        assert!(td.tie_word_embeddings);
        assert!(g("tiny").max_position_embeddings >= 4096);
    }
}
