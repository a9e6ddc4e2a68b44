//! Which logits are real tokens.

use crate::error::ModelError;
use std::path::Path;

/// How many leading logits a model in `dir` may sample from: the ids its
/// `tokenizer.json` defines (model vocabulary and added tokens), capped at the
/// config's `vocab_size`. Checkpoints pad the embedding past the tokenizer
/// (Qwen3: 151936 rows, 151669 tokens); a padded id has no text, so engines
/// never sample one. Without a tokenizer.json every row counts.
pub fn sampleable_vocab(dir: &Path, config_vocab: usize) -> Result<usize, ModelError> {
    let path = dir.join("tokenizer.json");
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(config_vocab),
        Err(e) => return Err(ModelError::io(&path, e)),
    };
    #[derive(serde::Deserialize)]
    struct Added {
        id: u32,
    }
    #[derive(serde::Deserialize)]
    struct Model {
        #[serde(default)]
        vocab: serde_json::Map<String, serde_json::Value>,
    }
    #[derive(serde::Deserialize)]
    struct File {
        model: Model,
        #[serde(default)]
        added_tokens: Vec<Added>,
    }
    let f: File = serde_json::from_slice(&text).map_err(|e| ModelError::Tokenizer {
        path: path.clone(),
        reason: format!("not a tokenizer.json: {e}"),
    })?;
    let max_vocab = f.model.vocab.values().filter_map(|v| v.as_u64()).max();
    let max_added = f.added_tokens.iter().map(|a| a.id as u64).max();
    let n = match max_vocab.max(max_added) {
        Some(m) => m as usize + 1,
        None => config_vocab,
    };
    Ok(n.min(config_vocab))
}
