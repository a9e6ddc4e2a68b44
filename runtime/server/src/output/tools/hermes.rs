//! Qwen's hermes-style grammar: `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`
//! (Qwen2.5, Qwen3 and Qwen3-MoE chat templates).

use super::block::{BlockParser, START};
use super::{Forced, ParsedCall, ToolGrammar, ToolParser, ToolSet};
use serde_json::Value;
use std::sync::Arc;

#[derive(Debug, Clone, Copy)]
pub struct HermesJson;

impl ToolGrammar for HermesJson {
    fn name(&self) -> &'static str {
        "hermes-json"
    }

    fn parser(&self, tools: Arc<ToolSet>) -> Box<dyn ToolParser> {
        Box::new(BlockParser::new(self.name(), parse_body, tools))
    }

    fn forced_prefix(&self, forced: &Forced) -> Option<String> {
        match forced {
            Forced::Auto => None,
            Forced::Required => Some(format!("{START}\n{{\"name\": \"")),
            Forced::Named(name) => Some(format!(
                "{START}\n{{\"name\": {}, \"arguments\": ",
                Value::String(name.clone())
            )),
        }
    }
}

fn parse_body(body: &str, _tools: &ToolSet) -> Result<Vec<ParsedCall>, String> {
    let v: Value =
        serde_json::from_str(body.trim()).map_err(|e| format!("invalid JSON in tool call: {e}"))?;
    let obj = v.as_object().ok_or("tool call is not a JSON object")?;
    let name = obj
        .get("name")
        .and_then(Value::as_str)
        .ok_or("tool call has no string \"name\"")?
        .to_string();
    let args = obj
        .get("arguments")
        .or_else(|| obj.get("parameters"))
        .cloned()
        .unwrap_or_else(|| Value::Object(Default::default()));
    let arguments = match args {
        Value::Object(_) => args.to_string(),
        // Some models write the arguments as an already-encoded JSON string.
        Value::String(s) => match serde_json::from_str::<Value>(&s) {
            Ok(v @ Value::Object(_)) => v.to_string(),
            _ => return Err("\"arguments\" is a string that is not a JSON object".into()),
        },
        other => return Err(format!("\"arguments\" is not an object: {other}")),
    };
    Ok(vec![ParsedCall { name, arguments }])
}
