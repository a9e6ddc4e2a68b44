//! `glm4_moe` synth presets, written as complete Hugging Face `config.json`
//! objects of the published checkpoints (zai-org/GLM-4.5-Air, GLM-4.5), so
//! `--set` can only change fields a real checkpoint has.

use crate::arch::registry::{Preset, with_fields};
use serde_json::{Value, json};

/// In `synth --help` order.
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "tiny-glm4-moe",
        summary: "witness-sized glm4_moe: 4 layers (1 dense), 8 experts in 4 groups top-2 + 1 shared, q/k norm, partial rotary, MTP layer",
        config: tiny,
    },
    Preset {
        name: "glm-4.5-air",
        summary: "GLM-4.5-Air: 46 layers (1 dense), 128 experts top-8 x 1408 + 1 shared, hidden 4096, 96q/8kv heads x 128",
        config: glm_4_5_air,
    },
    Preset {
        name: "glm-4.5-air-12l",
        summary: "GLM-4.5-Air cut to 12 layers (fits a 64 GB disk for benchmarks)",
        config: glm_4_5_air_12l,
    },
    Preset {
        name: "glm-4.5",
        summary: "GLM-4.5: 92 layers (3 dense), 160 experts top-8 x 1536 + 1 shared, hidden 5120, q/k norm",
        config: glm_4_5,
    },
];

/// zai-org/GLM-4.5-Air's `config.json` (minus `torch_dtype`, set from
/// `--dtype`; `transformers_version` omitted).
pub fn glm_4_5_air() -> Value {
    json!({
        "architectures": ["Glm4MoeForCausalLM"],
        "attention_bias": true,
        "attention_dropout": 0.0,
        "eos_token_id": [151329, 151336, 151338],
        "first_k_dense_replace": 1,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 10944,
        "max_position_embeddings": 131072,
        "model_type": super::MODEL_TYPE,
        "moe_intermediate_size": 1408,
        "n_group": 1,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "norm_topk_prob": true,
        "num_attention_heads": 96,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 46,
        "num_key_value_heads": 8,
        "num_nextn_predict_layers": 1,
        "pad_token_id": 151329,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-05,
        "rope_scaling": null,
        "rope_theta": 1000000,
        "routed_scaling_factor": 1.0,
        "tie_word_embeddings": false,
        "topk_group": 1,
        "use_cache": true,
        "use_qk_norm": false,
        "vocab_size": 151552
    })
}

fn glm_4_5_air_12l() -> Value {
    with_fields(glm_4_5_air(), json!({ "num_hidden_layers": 12 }))
}

/// zai-org/GLM-4.5: Air's layout at 355B (hidden 5120, 92 layers, the
/// first 3 dense, 160 experts x 1536, q/k norm, routed scaling 2.5).
pub fn glm_4_5() -> Value {
    with_fields(
        glm_4_5_air(),
        json!({
            "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
            "n_routed_experts": 160, "num_hidden_layers": 92, "first_k_dense_replace": 3,
            "routed_scaling_factor": 2.5, "use_qk_norm": true
        }),
    )
}

/// Real head layout (head_dim 64 so the CUDA attention kernels can take it
/// later), partial rotary, q/k norm and vocabulary; small widths; 8 experts
/// in 4 groups keeping 2 (GLM ships n_group 1, DeepSeek-V3 8/4: the witness
/// covers the group mask); routed scaling 2.5 as GLM-4.5.
pub fn tiny() -> Value {
    with_fields(
        glm_4_5_air(),
        json!({
            "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
            "topk_group": 2, "routed_scaling_factor": 2.5, "use_qk_norm": true,
            "max_position_embeddings": 8192
        }),
    )
}
