//! EOS discovery. Chat models stop on `<|im_end|>` while base models stop on
//! `<|endoftext|>`; the configs disagree across releases, so take the union.

use std::path::Path;

use serde_json::Value;

use super::Tokenizer;
use crate::error::ModelError;

fn read_json(path: &Path) -> Result<Option<Value>, ModelError> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| ModelError::BadConfig {
            path: path.to_path_buf(),
            reason: format!("not valid JSON: {e}"),
        })
}

/// `eos_token_id` as int, list of ints, or null/absent.
fn eos_ids(path: &Path, v: &Value) -> Result<Vec<u32>, ModelError> {
    let bad = || ModelError::BadConfig {
        path: path.to_path_buf(),
        reason: format!("eos_token_id must be an integer or a list of integers, found {v}"),
    };
    let one = |x: &Value| {
        x.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(bad)
    };
    match v {
        Value::Null => Ok(Vec::new()),
        Value::Array(items) => items.iter().map(one).collect(),
        x => Ok(vec![one(x)?]),
    }
}

/// `eos_token` as a string or an AddedToken object `{ "content": ... }`.
pub(crate) fn token_string(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(m) => m.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

pub(super) fn discover(dir: &Path, tok: &Tokenizer) -> Result<Vec<u32>, ModelError> {
    let mut ids = Vec::new();
    let gen_path = dir.join("generation_config.json");
    let from_gen = match read_json(&gen_path)? {
        Some(g) => eos_ids(&gen_path, g.get("eos_token_id").unwrap_or(&Value::Null))?,
        None => Vec::new(),
    };
    if from_gen.is_empty() {
        let cfg_path = dir.join("config.json");
        if let Some(c) = read_json(&cfg_path)? {
            ids.extend(eos_ids(
                &cfg_path,
                c.get("eos_token_id").unwrap_or(&Value::Null),
            )?);
        }
    } else {
        ids.extend(from_gen);
    }
    let tc_path = dir.join("tokenizer_config.json");
    if let Some(tc) = read_json(&tc_path)?
        && let Some(name) = tc.get("eos_token").and_then(token_string)
    {
        let id = tok.token_id(&name).ok_or_else(|| ModelError::BadConfig {
            path: tc_path.clone(),
            reason: format!("eos_token '{name}' is not in tokenizer.json's vocabulary"),
        })?;
        ids.push(id);
    }
    if ids.is_empty() {
        return Err(ModelError::BadConfig {
            path: dir.to_path_buf(),
            reason: "no EOS token: none of generation_config.json, config.json (eos_token_id) \
                     or tokenizer_config.json (eos_token) names one; generation could not stop"
                .into(),
        });
    }
    Ok(ids)
}
