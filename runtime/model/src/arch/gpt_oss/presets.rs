//! `gpt_oss` synth presets, written as complete Hugging Face `config.json`
//! objects of the published checkpoints (openai/gpt-oss-20b and -120b), so
//! `--set` can only change fields a real checkpoint has.

use crate::arch::registry::{Preset, with_fields};
use serde_json::{Value, json};

/// In `synth --help` order.
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "tiny-gpt-oss",
        summary: "witness-sized gpt_oss: 4 layers (sliding window 16 / full), 8 experts top-2, hidden 128",
        config: tiny,
    },
    Preset {
        name: "gpt-oss-20b",
        summary: "gpt-oss-20b: 24 layers, 32 experts top-4, hidden 2880, MXFP4 experts",
        config: gpt_oss_20b,
    },
    Preset {
        name: "gpt-oss-120b",
        summary: "gpt-oss-120b: 36 layers, 128 experts top-4 (61 GiB of MXFP4 experts)",
        config: gpt_oss_120b,
    },
    Preset {
        name: "gpt-oss-120b-12l",
        summary: "gpt-oss-120b cut to 12 layers (fits a 64 GB disk for benchmarks)",
        config: gpt_oss_120b_12l,
    },
];

fn layer_types(n: usize) -> Value {
    (0..n)
        .map(|i| {
            if i % 2 == 0 {
                "sliding_attention"
            } else {
                "full_attention"
            }
        })
        .collect()
}

/// openai/gpt-oss-20b's `config.json` (minus `torch_dtype`, set from
/// `--dtype`).
pub fn gpt_oss_20b() -> Value {
    json!({
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": true,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": layer_types(24),
        "max_position_embeddings": 131072,
        "model_type": super::MODEL_TYPE,
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 8,
        "num_local_experts": 32,
        "output_router_logits": false,
        "pad_token_id": 199999,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head"
            ],
            "quant_method": "mxfp4"
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": false
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": false,
        "use_cache": true,
        "vocab_size": 201088
    })
}

/// openai/gpt-oss-120b: the 20b config with 36 layers and 128 experts.
pub fn gpt_oss_120b() -> Value {
    with_fields(
        gpt_oss_20b(),
        json!({
            "num_hidden_layers": 36, "num_local_experts": 128,
            "layer_types": layer_types(36)
        }),
    )
}

fn gpt_oss_120b_12l() -> Value {
    with_fields(
        gpt_oss_120b(),
        json!({ "num_hidden_layers": 12, "layer_types": layer_types(12) }),
    )
}

/// Real head layout, YaRN and vocabulary; small widths and a 16-token
/// window so short witness prompts cross it.
fn tiny() -> Value {
    with_fields(
        gpt_oss_20b(),
        json!({
            "hidden_size": 128, "intermediate_size": 64, "num_hidden_layers": 4,
            "layer_types": layer_types(4), "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
            "experts_per_token": 2, "sliding_window": 16
        }),
    )
}
