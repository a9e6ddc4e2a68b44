//! Finding the chat template in a Hugging Face model directory.

use std::path::Path;

use serde_json::Value;

use crate::error::ModelError;
use crate::tokenizer::token_string;

pub(super) struct Found {
    pub default: String,
    pub tool_use: Option<String>,
    pub bos: Option<String>,
    pub eos: Option<String>,
}

fn bad(path: &Path, reason: impl Into<String>) -> ModelError {
    ModelError::BadConfig {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// `chat_template` is either a string or a list of `{name, template}`.
fn parse_templates(path: &Path, v: &Value) -> Result<Option<(String, Option<String>)>, ModelError> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some((s.clone(), None))),
        Value::Array(items) => {
            let mut default = None;
            let mut tool_use = None;
            for (i, item) in items.iter().enumerate() {
                let name = item.get("name").and_then(Value::as_str);
                let template = item.get("template").and_then(Value::as_str);
                let (Some(name), Some(template)) = (name, template) else {
                    return Err(bad(
                        path,
                        format!(
                            "chat_template[{i}] must be an object with string 'name' and 'template'"
                        ),
                    ));
                };
                match name {
                    "default" => default = Some(template.to_string()),
                    "tool_use" => tool_use = Some(template.to_string()),
                    _ => {}
                }
            }
            let default = default
                .ok_or_else(|| bad(path, "chat_template list has no entry named 'default'"))?;
            Ok(Some((default, tool_use)))
        }
        other => Err(bad(
            path,
            format!(
                "chat_template must be a string or a list of {{name, template}}, found {other}"
            ),
        )),
    }
}

pub(super) fn find(dir: &Path) -> Result<Option<Found>, ModelError> {
    let tc_path = dir.join("tokenizer_config.json");
    let tc: Option<Value> = if tc_path.is_file() {
        let text = std::fs::read_to_string(&tc_path).map_err(|e| ModelError::io(&tc_path, e))?;
        Some(
            serde_json::from_str(&text)
                .map_err(|e| bad(&tc_path, format!("not valid JSON: {e}")))?,
        )
    } else {
        None
    };
    let special = |key: &str| tc.as_ref().and_then(|t| t.get(key)).and_then(token_string);
    let (bos, eos) = (special("bos_token"), special("eos_token"));

    let jinja_path = dir.join("chat_template.jinja");
    if jinja_path.is_file() {
        let src =
            std::fs::read_to_string(&jinja_path).map_err(|e| ModelError::io(&jinja_path, e))?;
        return Ok(Some(Found {
            default: src,
            tool_use: None,
            bos,
            eos,
        }));
    }
    let Some(tc) = &tc else {
        return Ok(None);
    };
    let Some((default, tool_use)) =
        parse_templates(&tc_path, tc.get("chat_template").unwrap_or(&Value::Null))?
    else {
        return Ok(None);
    };
    Ok(Some(Found {
        default,
        tool_use,
        bos,
        eos,
    }))
}
