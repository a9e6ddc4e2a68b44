//! Qwen's hermes-style grammar: `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`
//! (Qwen2.5, Qwen3 and Qwen3-MoE chat templates).

use super::block::{BlockParser, END, START};
use super::{
    CallRule, CallShape, Forced, ParsedCall, ToolConstraint, ToolGrammar, ToolParser, ToolSet,
    lark_str,
};
use krasis_model::structured::lark_json;
use krasis_model::tokenizer::Tokenizer;
use serde_json::Value;
use std::sync::Arc;

#[derive(Debug, Clone, Copy)]
pub struct HermesJson;

impl ToolGrammar for HermesJson {
    fn name(&self) -> &'static str {
        "hermes-json"
    }

    fn parser(&self, tools: Arc<ToolSet>) -> Box<dyn ToolParser> {
        Box::new(BlockParser::new(self.name(), parse_body, tools).streaming(stream_head))
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

    fn constrains(&self) -> bool {
        true
    }

    /// `required`: the forced prefix ends inside the first call's
    /// `{"name": "`, so the grammar starts at a declared tool's name;
    /// named: it ends at `"arguments": `, so the grammar starts at that
    /// tool's arguments. More calls follow only with parallel calls on.
    /// `auto`: after each `<tool_call>` the model writes, one call.
    fn constraint(
        &self,
        forced: &Forced,
        tools: &ToolSet,
        parallel: bool,
        answer: Option<&str>,
        tok: &Tokenizer,
    ) -> Result<Option<ToolConstraint>, String> {
        let (Some(open), Some(end)) = (tok.token_id(START), tok.token_id(END)) else {
            // A vocabulary without the call tokens: nothing to trigger on.
            return Ok(None);
        };
        let mut calls = Vec::new();
        for (name, schema) in tools.schemas() {
            let args = lark_json(&schema).map_err(|e| {
                format!("tool '{name}' has a parameters schema that is not an object: {e}")
            })?;
            // The name as JSON writes it inside its quotes.
            let quoted = Value::String(name.to_string()).to_string();
            let inner = &quoted[1..quoted.len() - 1];
            calls.push(CallRule {
                name: name.to_string(),
                named: lark_str(&format!("{inner}\", \"arguments\": ")),
                rest: format!("{args} {} <[{end}]>", lark_str("}\n")),
            });
        }
        let shape = CallShape {
            trigger: open,
            open: format!("<[{open}]>"),
            head: lark_str("\n{\"name\": \""),
            tools: calls,
            rules: String::new(),
        };
        shape.constraint(forced, parallel, answer).map(Some)
    }
}

/// A call's name and where its arguments start, once the body has both:
/// `{"name": "NAME", "arguments": ` (any JSON whitespace around them).
fn stream_head(body: &str) -> Option<(String, usize)> {
    let ws = |s: &str| s.len() - s.trim_start().len();
    let mut at = ws(body);
    let expect = |lit: &str, at: &mut usize| -> Option<()> {
        let rest = body.get(*at..)?;
        let rest_trim = &rest[ws(rest)..];
        rest_trim.strip_prefix(lit)?;
        *at += ws(rest) + lit.len();
        Some(())
    };
    expect("{", &mut at)?;
    expect("\"name\"", &mut at)?;
    expect(":", &mut at)?;
    at += ws(&body[at..]);
    // The name: a JSON string, read by the JSON parser up to its quote.
    let rest = body.get(at..)?;
    let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<String>();
    let name = stream.next()?.ok()?;
    at += stream.byte_offset();
    expect(",", &mut at)?;
    expect("\"arguments\"", &mut at)?;
    expect(":", &mut at)?;
    // Arguments start at their first non-space character.
    let rest = body.get(at..)?;
    if rest.trim_start().is_empty() {
        return None;
    }
    Some((name, at + ws(rest)))
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
