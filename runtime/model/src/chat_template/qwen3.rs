//! Our Qwen3-style templates and realistic Qwen3 `tokenizer_config.json` /
//! `generation_config.json` contents for synthetic checkpoints.

use serde_json::{Value, json};

use crate::tokenizer::QWEN3_SPECIAL_TOKENS;

/// Qwen3 (hybrid thinking) chat template; see `templates/qwen3.jinja`.
pub const QWEN3_CHAT_TEMPLATE: &str = include_str!("../templates/qwen3.jinja");
/// Qwen3-Coder (XML tool calls) chat template; see `templates/qwen3_coder.jinja`.
pub const QWEN3_CODER_CHAT_TEMPLATE: &str = include_str!("../templates/qwen3_coder.jinja");

/// Special tokens that real Qwen3 lists in `additional_special_tokens`.
const ADDITIONAL_SPECIAL: &[&str] = &[
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
];

/// A `tokenizer_config.json` like the one shipped with Qwen3 checkpoints.
pub fn qwen3_tokenizer_config(chat_template: &str) -> Value {
    let decoder = crate::tokenizer::added_tokens_decoder(QWEN3_SPECIAL_TOKENS.iter().copied());
    json!({
        "add_bos_token": false,
        "add_prefix_space": false,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ADDITIONAL_SPECIAL,
        "bos_token": null,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": false,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": false,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": null,
    })
}

/// A `generation_config.json` like Qwen3's (thinking-mode sampling defaults).
pub fn qwen3_generation_config() -> Value {
    json!({
        "bos_token_id": 151643,
        "do_sample": true,
        "eos_token_id": [151645, 151643],
        "pad_token_id": 151643,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    })
}
