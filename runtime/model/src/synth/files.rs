//! The JSON side files of a checkpoint: tokenizer, tokenizer config and
//! chat template, generation config.

use super::SynthOptions;
use super::error::SynthError;
use crate::arch::ModelConfig;
use crate::chat_template::{
    QWEN3_CHAT_TEMPLATE, QWEN3_CODER_CHAT_TEMPLATE, qwen3_tokenizer_config,
};
use crate::tokenizer::{
    GLM4_CHAT_TEMPLATE, GLM4_SPECIAL_TOKENS, GPT_OSS_CHAT_TEMPLATE, HARMONY_LAST_ID,
    QWEN3_SPECIAL_TOKENS, build_glm4_tokenizer_json, build_harmony_tokenizer_json,
    build_qwen_tokenizer_json, find_o200k_vocab, find_qwen_vocab, glm4_generation_config,
    glm4_tokenizer_config, harmony_generation_config, harmony_tokenizer_config,
};
use std::path::{Path, PathBuf};

/// Where `tokenizer.json` comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenizerSource {
    /// The real Qwen vocabulary (`qwen.tiktoken`), at this path or found by
    /// `find_qwen_vocab` (see `tools/vocab.sh`).
    Qwen { vocab: Option<PathBuf> },
    /// gpt-oss's `o200k_harmony` (ranks from `o200k_base.tiktoken`, at this
    /// path or found by `find_o200k_vocab`; see `tools/harmony/vocab.sh`).
    Harmony { vocab: Option<PathBuf> },
    /// glm4_moe's stand-in (`tokenizer::glm4`): Qwen's first 151,329 ranks
    /// (`qwen.tiktoken`, at this path or found by `find_qwen_vocab`) and
    /// GLM's added tokens at their ids.
    Glm4 { vocab: Option<PathBuf> },
    /// Weights and configs only (fast unit tests with a shrunken vocab).
    None,
}

impl TokenizerSource {
    /// The real tokenizer of `config`'s family, its vocabulary at `vocab`
    /// or found in `.cache/vocab/`.
    pub fn for_family(config: &ModelConfig, vocab: Option<PathBuf>) -> Self {
        match config {
            ModelConfig::GptOss(_) => TokenizerSource::Harmony { vocab },
            ModelConfig::Qwen3Moe(_) => TokenizerSource::Qwen { vocab },
            ModelConfig::Glm4Moe(_) => TokenizerSource::Glm4 { vocab },
        }
    }
}

/// The chat template written into `tokenizer_config.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatTemplateKind {
    Qwen3,
    Qwen3Coder,
    /// The template published with openai/gpt-oss-120b (harmony).
    GptOss,
    /// The template published with the zai-org GLM-4.5/4.6 checkpoints.
    Glm4,
}

impl ChatTemplateKind {
    /// Every kind, in `--chat-template` order.
    pub const ALL: [ChatTemplateKind; 4] = [
        ChatTemplateKind::Qwen3,
        ChatTemplateKind::Qwen3Coder,
        ChatTemplateKind::GptOss,
        ChatTemplateKind::Glm4,
    ];
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == s)
    }
    pub fn name(self) -> &'static str {
        match self {
            ChatTemplateKind::Qwen3 => "qwen3",
            ChatTemplateKind::Qwen3Coder => "qwen3-coder",
            ChatTemplateKind::GptOss => "gpt-oss",
            ChatTemplateKind::Glm4 => "glm4",
        }
    }
    pub fn source(self) -> &'static str {
        match self {
            ChatTemplateKind::Qwen3 => QWEN3_CHAT_TEMPLATE,
            ChatTemplateKind::Qwen3Coder => QWEN3_CODER_CHAT_TEMPLATE,
            ChatTemplateKind::GptOss => GPT_OSS_CHAT_TEMPLATE,
            ChatTemplateKind::Glm4 => GLM4_CHAT_TEMPLATE,
        }
    }
    /// The template `config`'s family ships with.
    pub fn for_family(config: &ModelConfig) -> Self {
        match config {
            ModelConfig::GptOss(_) => ChatTemplateKind::GptOss,
            ModelConfig::Qwen3Moe(_) => ChatTemplateKind::Qwen3,
            ModelConfig::Glm4Moe(_) => ChatTemplateKind::Glm4,
        }
    }
    /// Whether this template speaks `config`'s family's tokens.
    fn fits(self, config: &ModelConfig) -> bool {
        match config {
            ModelConfig::GptOss(_) => self == ChatTemplateKind::GptOss,
            ModelConfig::Glm4Moe(_) => self == ChatTemplateKind::Glm4,
            ModelConfig::Qwen3Moe(_) => {
                matches!(self, ChatTemplateKind::Qwen3 | ChatTemplateKind::Qwen3Coder)
            }
        }
    }
}

/// The `generation_config.json` of `config`'s family.
pub fn generation_config(config: &ModelConfig) -> serde_json::Value {
    match config {
        ModelConfig::GptOss(_) => harmony_generation_config(),
        ModelConfig::Qwen3Moe(_) => crate::chat_template::qwen3_generation_config(),
        ModelConfig::Glm4Moe(_) => glm4_generation_config(),
    }
}

/// Object keys sorted recursively, as `save_pretrained` writes them.
pub fn sorted(v: &serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            serde_json::Value::Object(
                keys.into_iter()
                    .map(|k| (k.clone(), sorted(&m[k])))
                    .collect(),
            )
        }
        serde_json::Value::Array(a) => serde_json::Value::Array(a.iter().map(sorted).collect()),
        other => other.clone(),
    }
}

pub fn write_json(path: &Path, value: &serde_json::Value) -> Result<(), SynthError> {
    let mut text = serde_json::to_string_pretty(value).expect("JSON value serializes");
    text.push('\n');
    std::fs::write(path, text).map_err(|e| SynthError::io(path, e))
}

/// Writes `tokenizer.json` and `tokenizer_config.json`; returns the chat
/// template name, or `None` when no tokenizer was requested.
pub fn write_tokenizer_files(
    opts: &SynthOptions,
    dir: &Path,
) -> Result<Option<&'static str>, SynthError> {
    let config = opts.spec.config();
    let template = opts.chat_template;
    // Ids past the added tokens' last one have no text.
    let past =
        |added: &[(u32, &str, bool)]| added.iter().map(|t| t.0 as usize + 1).max().unwrap_or(0);
    let (name, needed) = match &opts.tokenizer {
        TokenizerSource::None => return Ok(None),
        TokenizerSource::Qwen { .. } => ("Qwen", past(QWEN3_SPECIAL_TOKENS)),
        TokenizerSource::Harmony { .. } => ("o200k_harmony", HARMONY_LAST_ID as usize + 1),
        TokenizerSource::Glm4 { .. } => ("GLM-4.5 stand-in", past(GLM4_SPECIAL_TOKENS)),
    };
    // A tokenizer or template of another family would give the checkpoint
    // special tokens its config and template do not know.
    let family = std::mem::discriminant(&TokenizerSource::for_family(config, None));
    if family != std::mem::discriminant(&opts.tokenizer) || !template.fits(config) {
        return Err(SynthError::BadSpec(format!(
            "preset '{}' is a {} model: use its tokenizer and the '{}' chat template \
             (got the {name} tokenizer and '{}')",
            opts.spec.preset,
            config.architecture().display_name,
            ChatTemplateKind::for_family(config).name(),
            template.name()
        )));
    }
    // Ids the tokenizer can emit must have embedding rows.
    let vocab_size = opts.spec.geometry().vocab_size;
    if vocab_size < needed {
        return Err(SynthError::BadSpec(format!(
            "vocab_size {vocab_size} is smaller than the {name} tokenizer's {needed} ids; \
             keep vocab_size >= {needed} or synthesize without a tokenizer"
        )));
    }
    let (tokenizer_json, tokenizer_config) = match &opts.tokenizer {
        TokenizerSource::Harmony { vocab } => (
            build_harmony_tokenizer_json(&find_o200k_vocab(vocab.as_deref())?)?,
            harmony_tokenizer_config(template.source()),
        ),
        TokenizerSource::Qwen { vocab } => (
            build_qwen_tokenizer_json(&find_qwen_vocab(vocab.as_deref())?)?,
            qwen3_tokenizer_config(template.source()),
        ),
        TokenizerSource::Glm4 { vocab } => (
            build_glm4_tokenizer_json(&find_qwen_vocab(vocab.as_deref())?)?,
            glm4_tokenizer_config(template.source()),
        ),
        TokenizerSource::None => unreachable!("returned above"),
    };
    let target = dir.join("tokenizer.json");
    std::fs::write(&target, tokenizer_json).map_err(|e| SynthError::io(&target, e))?;
    write_json(&dir.join("tokenizer_config.json"), &tokenizer_config)?;
    Ok(Some(template.name()))
}
