//! gpt-oss's tokenizer, `o200k_harmony`: OpenAI's o200k_base byte-level BPE
//! ranks (`o200k_base.tiktoken`, fetched by `tools/harmony/vocab.sh`) with
//! the harmony special tokens at their published ids, converted to the
//! Hugging Face `tokenizer.json` a gpt-oss checkpoint ships, plus its
//! `tokenizer_config.json` and `generation_config.json`.
//!
//! Sources: the split pattern is `O200K_BASE_PAT_STR` of the `tiktoken-rs`
//! crate 0.12.1 (`src/tiktoken_ext/openai_public.rs`, the crate
//! `tools/harmony/vocab.sh` takes the rank file from), the same as OpenAI
//! tiktoken's `o200k_base` `pat_str`; the special tokens are that file's
//! `o200k_harmony()` table, and `tools/harmony/token_ids.py` checks ids
//! against the `openai-harmony` package's own encoding
//! (`tests/fixtures/harmony/token_ids.json`).

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use super::vocab::{BpeVocab, build_tokenizer_json, find_vocab};
use crate::error::ModelError;

/// Number of ranks in `o200k_base.tiktoken`; the special tokens start here.
pub const O200K_BPE_RANKS: usize = 199_998;

/// o200k's pre-tokenizer split pattern (see the module docs for its source).
pub const O200K_PRETOKENIZE_REGEX: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"\p{N}{1,3}",
    "|",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    "|",
    r"\s*[\r\n]+",
    "|",
    r"\s+(?!\S)",
    "|",
    r"\s+",
);

/// The harmony tokens with names; every other id in
/// `O200K_BPE_RANKS..=HARMONY_LAST_ID` is `<|reserved_ID|>`.
pub const HARMONY_NAMED_TOKENS: &[(u32, &str)] = &[
    (199_998, "<|startoftext|>"),
    (199_999, "<|endoftext|>"),
    (200_002, "<|return|>"),
    (200_003, "<|constrain|>"),
    (200_005, "<|channel|>"),
    (200_006, "<|start|>"),
    (200_007, "<|end|>"),
    (200_008, "<|message|>"),
    (200_012, "<|call|>"),
];

/// The last special-token id; gpt-oss's vocab_size is this plus one.
pub const HARMONY_LAST_ID: u32 = 201_087;

/// `eos_token_id` of gpt-oss's `generation_config.json`: `<|return|>`,
/// `<|endoftext|>`, `<|call|>`.
pub const HARMONY_EOS_IDS: [u32; 3] = [200_002, 199_999, 200_012];

/// The vocabulary as the converter needs it.
pub(crate) const O200K: BpeVocab = BpeVocab {
    name: "o200k_base",
    file: "o200k_base.tiktoken",
    fetch: "tools/harmony/vocab.sh",
    ranks: O200K_BPE_RANKS,
    use_ranks: O200K_BPE_RANKS,
    regex: O200K_PRETOKENIZE_REGEX,
    nfc: false,
};

/// The chat template published with openai/gpt-oss-120b (see
/// `tests/fixtures/harmony/README.md` for its provenance).
pub const GPT_OSS_CHAT_TEMPLATE: &str =
    include_str!("../../../../tests/fixtures/harmony/openai-gpt-oss-120b.jinja");

/// Every special token of o200k_harmony, `(id, content, special)`, in id
/// order: all of `O200K_BPE_RANKS..=HARMONY_LAST_ID`.
pub fn harmony_special_tokens() -> Vec<(u32, String, bool)> {
    (O200K_BPE_RANKS as u32..=HARMONY_LAST_ID)
        .map(|id| {
            let content = HARMONY_NAMED_TOKENS
                .iter()
                .find(|(i, _)| *i == id)
                .map(|(_, c)| c.to_string())
                .unwrap_or_else(|| format!("<|reserved_{id}|>"));
            (id, content, true)
        })
        .collect()
}

/// Locate `o200k_base.tiktoken` like [`super::find_qwen_vocab`] finds
/// `qwen.tiktoken` (`.cache/vocab/`, where `tools/harmony/vocab.sh` puts it).
pub fn find_o200k_vocab(explicit: Option<&Path>) -> Result<PathBuf, ModelError> {
    find_vocab(&O200K, explicit)
}

/// Convert `o200k_base.tiktoken` into gpt-oss's `tokenizer.json` (byte-level
/// BPE, o200k split pattern, no normalizer, the harmony special tokens).
pub fn build_harmony_tokenizer_json(tiktoken: &Path) -> Result<String, ModelError> {
    let special = harmony_special_tokens();
    let added: Vec<(u32, &str, bool)> = special
        .iter()
        .map(|(id, c, s)| (*id, c.as_str(), *s))
        .collect();
    build_tokenizer_json(tiktoken, &O200K, &added)
}

/// gpt-oss's `tokenizer_config.json` with `chat_template`.
pub fn harmony_tokenizer_config(chat_template: &str) -> Value {
    let special = harmony_special_tokens();
    let decoder =
        super::added_tokens_decoder(special.iter().map(|(id, c, s)| (*id, c.as_str(), *s)));
    json!({
        "added_tokens_decoder": decoder,
        "bos_token": "<|startoftext|>",
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": false,
        "eos_token": "<|return|>",
        "extra_special_tokens": {},
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
}

/// gpt-oss's `generation_config.json` (openai/gpt-oss-20b and -120b).
pub fn harmony_generation_config() -> Value {
    json!({
        "bos_token_id": 199_998,
        "do_sample": true,
        "eos_token_id": HARMONY_EOS_IDS,
        "pad_token_id": 199_999,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_tokens_sit_at_their_published_ids() {
        let t = harmony_special_tokens();
        assert_eq!(t.len(), (HARMONY_LAST_ID as usize + 1) - O200K_BPE_RANKS);
        let by_id = |id: u32| t[(id as usize) - O200K_BPE_RANKS].1.clone();
        assert_eq!(by_id(199_998), "<|startoftext|>");
        assert_eq!(by_id(199_999), "<|endoftext|>");
        assert_eq!(by_id(200_000), "<|reserved_200000|>");
        assert_eq!(by_id(200_002), "<|return|>");
        assert_eq!(by_id(200_003), "<|constrain|>");
        assert_eq!(by_id(200_005), "<|channel|>");
        assert_eq!(by_id(200_006), "<|start|>");
        assert_eq!(by_id(200_007), "<|end|>");
        assert_eq!(by_id(200_008), "<|message|>");
        assert_eq!(by_id(200_012), "<|call|>");
        assert_eq!(by_id(200_018), "<|reserved_200018|>");
        assert_eq!(by_id(201_087), "<|reserved_201087|>");
        assert!(t.iter().all(|(_, _, special)| *special));
    }

    #[test]
    fn missing_vocab_names_the_fetch_script() {
        let e = find_o200k_vocab(Some(Path::new("/nonexistent/o200k_base.tiktoken")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("tools/harmony/vocab.sh"), "{e}");
    }
}
