//! Lark for the XML tool-call grammars (Qwen3-Coder, GLM-4.5): their
//! argument values are text between tags that [`ToolSet::convert`] turns
//! back into the JSON type the tool's schema declares, so each value's
//! grammar writes exactly such text.
//!
//! - A string is raw text without `<` (so the closing tag ends it), at most
//!   `maxLength` characters; an enum of strings is one of its strings raw.
//!   Before a plain-text closing tag the string is a lazy rule (it ends at
//!   the tag's first occurrence).
//! - Numbers, integers, booleans, null, objects and arrays are their JSON
//!   text (`%json`, compact), which is what `convert` parses.
//! - A union (`"type": [...]`, `anyOf`) is any of its members.
//!
//! A string constraint text cannot carry (`pattern`, `format`, `minLength`
//! beyond what the regex allows is kept) is refused by name, never dropped.

use super::{ToolSet, lark_str};
use krasis_model::structured::lark_json;
use serde_json::{Value, json};

/// What ends an argument value.
pub enum Close {
    /// Plain text (Qwen3-Coder's `\n</parameter>\n`): a string value is a
    /// lazy rule that ends at its first occurrence (llguidance's `suffix=`),
    /// since a greedy `[^<]*` would also take the closing newline.
    Text(&'static str),
    /// Lark for markup that no text can spell (GLM's `</arg_value>` added
    /// token): a string simply stops before it.
    Markup(String),
}

/// The Lark expression of one argument value of `schema` (`param` of
/// `tool`, for messages), its `close` included. String values that need a
/// rule of their own add it to `rules`.
pub fn value_expr(
    tool: &str,
    param: &str,
    schema: &Value,
    close: &Close,
    rules: &mut Vec<String>,
) -> Result<String, String> {
    let err = |what: &str| {
        Err(format!(
            "parameter '{param}' of tool '{tool}' {what}, which XML tool calls cannot constrain"
        ))
    };
    let after = match close {
        Close::Text(t) => lark_str(t),
        Close::Markup(m) => m.clone(),
    };
    let json = |s: &Value| {
        lark_json(s)
            .map(|j| format!("{j} {after}"))
            .map_err(|e| e.to_string())
    };
    if let Some(Value::Array(alts)) = schema.get("anyOf") {
        let exprs = alts
            .iter()
            .map(|a| value_expr(tool, param, a, close, rules))
            .collect::<Result<Vec<_>, _>>()?;
        return Ok(format!("({})", exprs.join(" | ")));
    }
    if let Some(Value::Array(values)) = schema.get("enum") {
        if let Some(strings) = values.iter().map(Value::as_str).collect::<Option<Vec<_>>>() {
            let alts: Vec<String> = strings.iter().map(|s| lark_str(s)).collect();
            return Ok(format!("({}) {after}", alts.join(" | ")));
        }
        return json(schema);
    }
    match schema.get("type") {
        Some(Value::Array(types)) => {
            let exprs = types
                .iter()
                .map(|t| {
                    let mut one = schema.clone();
                    one["type"] = t.clone();
                    value_expr(tool, param, &one, close, rules)
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(format!("({})", exprs.join(" | ")))
        }
        Some(Value::String(t)) if t == "string" => {
            for key in ["pattern", "format"] {
                if schema.get(key).is_some() {
                    return err(&format!("has a string `{key}`"));
                }
            }
            let n = |k: &str| schema.get(k).and_then(Value::as_u64);
            let (lo, hi) = (n("minLength").unwrap_or(0), n("maxLength"));
            let text = match hi {
                Some(hi) => format!("/[^<]{{{lo},{hi}}}/"),
                None if lo > 0 => format!("/[^<]{{{lo},}}/"),
                None => "/[^<]*/".to_string(),
            };
            Ok(match close {
                Close::Text(t) => {
                    let name = format!("s{}", rules.len());
                    rules.push(format!("{name}[suffix={}]: {text}", lark_str(t)));
                    name
                }
                Close::Markup(m) => format!("{text} {m}"),
            })
        }
        // JSON text, compact: what `ToolSet::convert` parses.
        Some(_) => json(schema),
        // No type: any JSON value but a string, or raw text (a string).
        None => {
            let mut any = schema.clone();
            any["type"] = json!(["string", "number", "boolean", "null", "object", "array"]);
            value_expr(tool, param, &any, close, rules)
        }
    }
}

/// The tool's parameters as (name, schema, required) in declaration order;
/// a schema whose `additionalProperties` is not false still gets only its
/// declared parameters (a call cannot name others).
pub fn params(schema: &Value) -> Vec<(String, Value, bool)> {
    let required: Vec<&str> = schema
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    schema
        .get("properties")
        .and_then(Value::as_object)
        .map(|props| {
            props
                .iter()
                .map(|(k, v)| (k.clone(), v.clone(), required.contains(&k.as_str())))
                .collect()
        })
        .unwrap_or_default()
}

/// Each declared tool's name and the Lark body of its arguments (each
/// written by `arg(name, value)`, the value ended by `close`; required ones
/// always, optional ones `?`, in declaration order; empty for a tool
/// without parameters), and the rules the values need.
pub fn tool_args(
    tools: &ToolSet,
    close: &Close,
    arg: impl Fn(&str, &str) -> String,
) -> Result<(Vec<(String, String)>, String), String> {
    let mut rules = Vec::new();
    let mut out = Vec::new();
    for (name, schema) in tools.schemas() {
        let mut args = Vec::new();
        for (p, s, required) in params(&schema) {
            let one = arg(&p, &value_expr(name, &p, &s, close, &mut rules)?);
            args.push(if required { one } else { format!("({one})?") });
        }
        out.push((name.to_string(), args.join(" ")));
    }
    let mut text = rules.join("\n");
    if !text.is_empty() {
        text.push('\n');
    }
    Ok((out, text))
}
