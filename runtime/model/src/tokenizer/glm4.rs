//! glm4_moe's tokenizer for synthetic checkpoints. GLM-4.5's byte-level BPE
//! (ids 0..151,328) ships only with the checkpoints, in no PyPI package, so
//! the first 151,329 ranks of the Qwen vocabulary (`qwen.tiktoken`, a
//! byte-level BPE of the same family, with Qwen's split pattern) stand in
//! for it; GLM's 36 added tokens sit at their published ids 151,329..151,364
//! (`<|endoftext|>`, `[gMASK]`, `<sop>`, the role tokens, `<think>`,
//! `<tool_call>`, `<arg_key>`, `<arg_value>`, ...). The embedding has
//! 151,552 rows: 151,365.. are padding the tokenizer never produces. The
//! server resolves every marker by its text in `tokenizer.json`, never by a
//! hard-coded id.

use super::vocab::{BpeVocab, QWEN, build_tokenizer_json};
use crate::error::ModelError;
use serde_json::{Value, json};
use std::path::Path;

/// The chat template published with the zai-org GLM checkpoints (see
/// `tests/fixtures/glm4_moe/README.md` for its provenance).
pub const GLM4_CHAT_TEMPLATE: &str =
    include_str!("../../../../tests/fixtures/glm4_moe/zai-org-GLM-4.6.jinja");

/// Regular BPE ids of GLM-4.5's tokenizer (`<|endoftext|>` is 151,329).
pub const GLM4_BPE_RANKS: usize = 151_329;

/// GLM-4.5's added tokens, `(id, content, special)`. The tag-like markers
/// (`<think>`, tool calls and responses, `/nothink`, boxes) are kept in
/// decoded text as Qwen3 keeps its own (`special: false`), so the reasoning
/// and tool-call parsers see them.
pub const GLM4_SPECIAL_TOKENS: &[(u32, &str, bool)] = &[
    (151329, "<|endoftext|>", true),
    (151330, "[MASK]", true),
    (151331, "[gMASK]", true),
    (151332, "[sMASK]", true),
    (151333, "<sop>", true),
    (151334, "<eop>", true),
    (151335, "<|system|>", true),
    (151336, "<|user|>", true),
    (151337, "<|assistant|>", true),
    (151338, "<|observation|>", true),
    (151339, "<|begin_of_image|>", true),
    (151340, "<|end_of_image|>", true),
    (151341, "<|begin_of_video|>", true),
    (151342, "<|end_of_video|>", true),
    (151343, "<|begin_of_audio|>", true),
    (151344, "<|end_of_audio|>", true),
    (151345, "<|begin_of_transcription|>", true),
    (151346, "<|end_of_transcription|>", true),
    (151347, "<|code_prefix|>", true),
    (151348, "<|code_middle|>", true),
    (151349, "<|code_suffix|>", true),
    (151350, "<think>", false),
    (151351, "</think>", false),
    (151352, "<tool_call>", false),
    (151353, "</tool_call>", false),
    (151354, "<tool_response>", false),
    (151355, "</tool_response>", false),
    (151356, "<arg_key>", false),
    (151357, "</arg_key>", false),
    (151358, "<arg_value>", false),
    (151359, "</arg_value>", false),
    (151360, "/nothink", false),
    (151361, "<|begin_of_box|>", false),
    (151362, "<|end_of_box|>", false),
    (151363, "<|image|>", true),
    (151364, "<|video|>", true),
];

/// The stand-in vocabulary: Qwen's rank file, its first 151,329 ranks.
pub(crate) const GLM4_STANDIN: BpeVocab = BpeVocab {
    name: "Qwen (first 151,329 ranks, standing in for GLM-4.5's)",
    use_ranks: GLM4_BPE_RANKS,
    ..QWEN
};

/// glm4_moe's `tokenizer.json` from `qwen.tiktoken` (see the module doc).
pub fn build_glm4_tokenizer_json(tiktoken: &Path) -> Result<String, ModelError> {
    build_tokenizer_json(tiktoken, &GLM4_STANDIN, GLM4_SPECIAL_TOKENS)
}

/// glm4_moe's `tokenizer_config.json` with `chat_template`.
pub fn glm4_tokenizer_config(chat_template: &str) -> Value {
    let decoder = super::added_tokens_decoder(GLM4_SPECIAL_TOKENS.iter().copied());
    json!({
        "added_tokens_decoder": decoder,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": false,
        "do_lower_case": false,
        "eos_token": "<|endoftext|>",
        "model_max_length": 128000,
        "pad_token": "<|endoftext|>",
        "padding_side": "left",
        "remove_space": false,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
}

/// GLM-4.5's `generation_config.json`: a turn ends at `<|endoftext|>`,
/// `<|user|>` (the next user turn) or `<|observation|>` (a tool call's
/// result is awaited); stopping on the first alone never ends a chat turn.
pub fn glm4_generation_config() -> Value {
    json!({
        "do_sample": true,
        "eos_token_id": [151329, 151336, 151338],
        "pad_token_id": 151329,
        "temperature": 0.6,
        "top_p": 0.95,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn added_tokens_are_contiguous_from_the_bpe_ranks() {
        for (i, &(id, _, _)) in GLM4_SPECIAL_TOKENS.iter().enumerate() {
            assert_eq!(id as usize, GLM4_BPE_RANKS + i);
        }
        assert_eq!(GLM4_SPECIAL_TOKENS.len(), 36);
        let eos = glm4_generation_config()["eos_token_id"].clone();
        for id in eos.as_array().unwrap() {
            let id = id.as_u64().unwrap() as u32;
            assert!(GLM4_SPECIAL_TOKENS.iter().any(|t| t.0 == id && t.2));
        }
    }
}
