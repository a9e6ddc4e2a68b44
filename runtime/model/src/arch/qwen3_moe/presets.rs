//! `qwen3_moe` synth presets, written as complete Hugging Face `config.json`
//! objects so that `--set` can only change fields a real checkpoint has.

use crate::arch::registry::{Preset, with_fields};
use serde_json::{Value, json};

/// In `synth --help` order.
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "tiny",
        summary: "witness-sized qwen3_moe: 3 layers, 8 experts top-2, hidden 128",
        config: tiny,
    },
    Preset {
        name: "tiny-dense",
        summary: "tiny with a dense first layer and tied embeddings",
        config: tiny_dense,
    },
    Preset {
        name: "a3b",
        summary: "Qwen3-30B-A3B: 48 layers, 128 experts top-8",
        config: a3b,
    },
    Preset {
        name: "a3b-24l",
        summary: "Qwen3-30B-A3B cut to 24 layers",
        config: a3b_24l,
    },
    Preset {
        name: "qcn",
        summary: "Qwen3-Coder-Next geometry as qwen3_moe: 512 experts top-10",
        config: qcn,
    },
];

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
        "model_type": super::MODEL_TYPE,
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

fn tiny() -> Value {
    with_fields(
        a3b(),
        json!({
            "hidden_size": 128, "num_hidden_layers": 3, "max_window_layers": 3,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
            "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "max_position_embeddings": 8192
        }),
    )
}

fn tiny_dense() -> Value {
    with_fields(
        tiny(),
        json!({ "mlp_only_layers": [0], "tie_word_embeddings": true }),
    )
}

fn a3b_24l() -> Value {
    with_fields(
        a3b(),
        json!({ "num_hidden_layers": 24, "max_window_layers": 24 }),
    )
}

/// Qwen3-Coder-Next geometry expressed as qwen3_moe: 512 experts top-10,
/// ~77B routed-expert parameters.
fn qcn() -> Value {
    with_fields(
        a3b(),
        json!({
            "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
            "intermediate_size": 5120, "num_attention_heads": 16, "num_key_value_heads": 2,
            "head_dim": 256, "rope_theta": 10000000.0, "max_position_embeddings": 262144
        }),
    )
}
