//! The JSON side files of a checkpoint: tokenizer, tokenizer config and
//! chat template, generation config.

use super::SynthOptions;
use super::error::SynthError;
use crate::chat_template::{
    QWEN3_CHAT_TEMPLATE, QWEN3_CODER_CHAT_TEMPLATE, qwen3_tokenizer_config,
};
use crate::tokenizer::{QWEN3_SPECIAL_TOKENS, build_qwen_tokenizer_json, find_qwen_vocab};
use std::path::{Path, PathBuf};

/// Where `tokenizer.json` comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenizerSource {
    /// The real Qwen vocabulary (`qwen.tiktoken`), at this path or found by
    /// `find_qwen_vocab` (see `tools/vocab.sh`).
    Qwen { vocab: Option<PathBuf> },
    /// Weights and configs only (fast unit tests with a shrunken vocab).
    None,
}

/// The chat template written into `tokenizer_config.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatTemplateKind {
    Qwen3,
    Qwen3Coder,
}

impl ChatTemplateKind {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "qwen3" => Some(ChatTemplateKind::Qwen3),
            "qwen3-coder" => Some(ChatTemplateKind::Qwen3Coder),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            ChatTemplateKind::Qwen3 => "qwen3",
            ChatTemplateKind::Qwen3Coder => "qwen3-coder",
        }
    }
    pub fn source(self) -> &'static str {
        match self {
            ChatTemplateKind::Qwen3 => QWEN3_CHAT_TEMPLATE,
            ChatTemplateKind::Qwen3Coder => QWEN3_CODER_CHAT_TEMPLATE,
        }
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
    let TokenizerSource::Qwen { vocab } = &opts.tokenizer else {
        return Ok(None);
    };
    // Ids the tokenizer can emit must have embedding rows.
    let needed = QWEN3_SPECIAL_TOKENS
        .iter()
        .map(|(id, _, _)| *id as usize + 1)
        .max()
        .unwrap_or(0);
    let vocab_size = opts.spec.geometry().vocab_size;
    if vocab_size < needed {
        return Err(SynthError::BadSpec(format!(
            "vocab_size {vocab_size} is smaller than the Qwen tokenizer's {needed} ids; \
             keep vocab_size >= {needed} or synthesize without a tokenizer"
        )));
    }
    let path = find_qwen_vocab(vocab.as_deref())?;
    let tokenizer_json = build_qwen_tokenizer_json(&path)?;
    let target = dir.join("tokenizer.json");
    std::fs::write(&target, tokenizer_json).map_err(|e| SynthError::io(&target, e))?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &qwen3_tokenizer_config(opts.chat_template.source()),
    )?;
    Ok(Some(opts.chat_template.name()))
}
