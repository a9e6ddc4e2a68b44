//! OpenAI chat messages -> the message list the chat template renders.
//! Clients differ: content may be a string, `null`, or an array of parts;
//! `developer` is the newer name for `system`; assistant tool-call arguments
//! arrive as JSON strings while Qwen templates iterate them as mappings.
//! Legacy function calling history (an assistant `function_call`, a
//! `function` message with the result) becomes tool calls and tool results.

use crate::error::ApiError;
use serde_json::{Map, Value, json};

pub fn normalize(messages: &[Value]) -> Result<Vec<Value>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "messages is empty; send at least one message",
        ));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| normalize_one(i, m))
        .collect()
}

fn normalize_one(i: usize, m: &Value) -> Result<Value, ApiError> {
    let param = format!("messages[{i}]");
    let obj = m
        .as_object()
        .ok_or_else(|| ApiError::invalid_param(&param, format!("{param} is not an object")))?;
    let role = obj.get("role").and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid_param(
            format!("{param}.role"),
            format!("{param} has no string 'role'"),
        )
    })?;
    let role = match role {
        "system" | "developer" => "system",
        "user" | "assistant" | "tool" => role,
        "function" => "tool",
        other => {
            return Err(ApiError::invalid_param(
                format!("{param}.role"),
                format!(
                    "{param} has role '{other}'; supported roles are system, developer, user, assistant, tool and function"
                ),
            ));
        }
    };
    let mut out = Map::new();
    out.insert("role".into(), json!(role));
    out.insert(
        "content".into(),
        Value::String(content_text(&param, obj.get("content"))?),
    );
    if let Some(Value::String(name)) = obj.get("name") {
        out.insert("name".into(), json!(name));
    }
    match role {
        "assistant" => {
            let reasoning = obj
                .get("reasoning_content")
                .or_else(|| obj.get("reasoning"))
                .and_then(Value::as_str);
            if let Some(r) = reasoning {
                out.insert("reasoning_content".into(), json!(r));
                // The gpt-oss template reads it as `thinking` (and keeps it
                // before a tool call, as harmony asks, dropping it otherwise).
                // It refuses a tool-call message with both content and
                // thinking, and renders such content as the analysis itself.
                let has_calls = ["tool_calls", "function_call"]
                    .iter()
                    .any(|k| obj.get(*k).is_some_and(|c| !c.is_null()));
                if !has_calls || out["content"] == "" {
                    out.insert("thinking".into(), json!(r));
                }
            }
            if let Some(calls) = obj.get("tool_calls").filter(|c| !c.is_null()) {
                out.insert("tool_calls".into(), tool_calls(&param, calls)?);
            } else if let Some(call) = obj.get("function_call").filter(|c| !c.is_null()) {
                let legacy = json!([{"type": "function", "function": call}]);
                out.insert("tool_calls".into(), tool_calls(&param, &legacy)?);
            }
        }
        "tool" => {
            if let Some(Value::String(id)) = obj.get("tool_call_id") {
                out.insert("tool_call_id".into(), json!(id));
            }
        }
        _ => {}
    }
    Ok(Value::Object(out))
}

/// String content, `null`, or text parts (joined by newlines).
fn content_text(param: &str, content: Option<&Value>) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
                match (kind, p.get("text").and_then(Value::as_str)) {
                    ("text" | "input_text", Some(t)) => texts.push(t),
                    ("text" | "input_text", None) => {
                        return Err(ApiError::invalid_param(
                            format!("{param}.content[{j}].text"),
                            format!("{param}.content[{j}] is a text part without a 'text' string"),
                        ));
                    }
                    (other, _) => {
                        return Err(ApiError::unsupported(
                            format!("{param}.content[{j}]"),
                            format!(
                                "{param}.content[{j}] has type '{other}'; this model accepts text parts only"
                            ),
                        ));
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        Some(other) => Err(ApiError::invalid_param(
            format!("{param}.content"),
            format!("{param}.content must be a string, null or an array of parts, not {other}"),
        )),
    }
}

fn tool_calls(param: &str, calls: &Value) -> Result<Value, ApiError> {
    let arr = calls.as_array().ok_or_else(|| {
        ApiError::invalid_param(
            format!("{param}.tool_calls"),
            format!("{param}.tool_calls must be an array"),
        )
    })?;
    let mut out = Vec::with_capacity(arr.len());
    for (j, c) in arr.iter().enumerate() {
        let p = format!("{param}.tool_calls[{j}]");
        let f = c
            .get("function")
            .ok_or_else(|| ApiError::invalid_param(&p, format!("{p} has no 'function' object")))?;
        let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid_param(
                format!("{p}.function.name"),
                format!("{p} has no function name"),
            )
        })?;
        let args = match f.get("arguments") {
            None | Some(Value::Null) => json!({}),
            Some(Value::String(s)) if s.trim().is_empty() => json!({}),
            Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                Ok(v @ Value::Object(_)) => v,
                _ => {
                    return Err(ApiError::invalid_param(
                        format!("{p}.function.arguments"),
                        format!("{p}.function.arguments is not a JSON object string: {s}"),
                    ));
                }
            },
            Some(v @ Value::Object(_)) => v.clone(),
            Some(other) => {
                return Err(ApiError::invalid_param(
                    format!("{p}.function.arguments"),
                    format!("{p}.function.arguments must be a JSON object, not {other}"),
                ));
            }
        };
        let mut call = json!({
            "type": "function",
            "function": {"name": name, "arguments": args},
        });
        if let Some(id) = c.get("id").and_then(Value::as_str) {
            call["id"] = json!(id);
        }
        out.push(call);
    }
    Ok(Value::Array(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_shapes_are_normalized() {
        let msgs = vec![
            json!({"role": "developer", "content": "be brief"}),
            json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}
            ]}),
            json!({"role": "tool", "tool_call_id": "call_1", "content": "42", "extra": true}),
        ];
        let out = normalize(&msgs).unwrap();
        assert_eq!(out[0], json!({"role": "system", "content": "be brief"}));
        assert_eq!(out[1]["content"], "a\nb");
        assert_eq!(out[2]["content"], "");
        assert_eq!(
            out[2]["tool_calls"][0]["function"]["arguments"],
            json!({"x": 1})
        );
        assert_eq!(
            out[3],
            json!({"role": "tool", "content": "42", "tool_call_id": "call_1"})
        );
    }

    #[test]
    fn unsupported_content_is_refused_with_its_path() {
        let msgs = vec![
            json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
        ];
        let e = normalize(&msgs).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0]"));
        let e = normalize(&[json!({"role": "wizard", "content": "x"})]).unwrap_err();
        assert!(e.message.contains("wizard"));
        let bad_args = json!({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]});
        assert!(normalize(&[bad_args]).is_err());
    }
}
