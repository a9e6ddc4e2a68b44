//! Qwen3-Coder's XML grammar:
//! `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>`.
//! Values are text; the tool's JSON schema decides their JSON type.

use super::block::{BlockParser, END, START};
use super::schema::arguments_string;
use super::xml_values::{Close, tool_args};
use super::{
    CallRule, CallShape, Forced, ParsedCall, ToolConstraint, ToolGrammar, ToolParser, ToolSet,
    lark_str, markup,
};
use krasis_model::tokenizer::Tokenizer;
use serde_json::Map;
use std::sync::Arc;

#[derive(Debug, Clone, Copy)]
pub struct QwenXml;

impl ToolGrammar for QwenXml {
    fn name(&self) -> &'static str {
        "qwen3-coder-xml"
    }

    fn parser(&self, tools: Arc<ToolSet>) -> Box<dyn ToolParser> {
        Box::new(BlockParser::new(self.name(), parse_body, tools))
    }

    fn forced_prefix(&self, forced: &Forced) -> Option<String> {
        match forced {
            Forced::Auto => None,
            Forced::Required => Some(format!("{START}\n<function=")),
            Forced::Named(name) => Some(format!("{START}\n<function={name}>\n")),
        }
    }

    fn constrains(&self) -> bool {
        true
    }

    /// Calls as the forced prefixes leave them: `required` continues at a
    /// declared tool's name inside `<function=`, a named tool at its first
    /// parameter; `auto` constrains what follows each `<tool_call>` the
    /// model writes. Values follow `xml_values` (typed text).
    fn constraint(
        &self,
        forced: &Forced,
        tools: &ToolSet,
        parallel: bool,
        tok: &Tokenizer,
    ) -> Result<Option<ToolConstraint>, String> {
        let (Some(open), Some(_)) = (tok.token_id(START), tok.token_id(END)) else {
            return Ok(None);
        };
        let (args, value_rules) = tool_args(tools, &Close::Text("\n</parameter>\n"), |p, v| {
            format!("{} {v}", lark_str(&format!("<parameter={p}>\n")))
        })?;
        let close = format!("{} {}", lark_str("</function>\n"), markup(tok, END));
        let shape = CallShape {
            trigger: open,
            open: markup(tok, START),
            head: lark_str("\n<function="),
            tools: args
                .into_iter()
                .map(|(name, a)| CallRule {
                    named: lark_str(&format!("{name}>\n")),
                    rest: format!("{a} {close}"),
                    name,
                })
                .collect(),
            rules: value_rules,
        };
        shape.constraint(forced, parallel).map(Some)
    }
}

/// One value's layout newlines (`>\nVALUE\n<`) are not part of the value.
fn strip_layout(v: &str) -> &str {
    let v = v.strip_prefix('\n').unwrap_or(v);
    v.strip_suffix('\n').unwrap_or(v)
}

fn parse_body(body: &str, tools: &ToolSet) -> Result<Vec<ParsedCall>, String> {
    let mut rest = body.trim();
    let mut calls = Vec::new();
    while !rest.is_empty() {
        let after = rest
            .strip_prefix("<function=")
            .ok_or("expected <function=NAME>")?;
        let gt = after.find('>').ok_or("unterminated <function= tag")?;
        let name = after[..gt].trim().to_string();
        if name.is_empty() {
            return Err("empty function name".into());
        }
        let after = &after[gt + 1..];
        let end = after
            .find("</function>")
            .ok_or_else(|| format!("<function={name}> has no </function>"))?;
        let params = parse_params(&name, &after[..end], tools)?;
        calls.push(ParsedCall {
            name,
            arguments: arguments_string(params),
        });
        rest = after[end + "</function>".len()..].trim_start();
    }
    if calls.is_empty() {
        return Err("no <function=…> in tool call".into());
    }
    Ok(calls)
}

fn parse_params(
    func: &str,
    mut s: &str,
    tools: &ToolSet,
) -> Result<Map<String, serde_json::Value>, String> {
    let mut params = Map::new();
    loop {
        s = s.trim_start();
        if s.is_empty() {
            return Ok(params);
        }
        let after = s.strip_prefix("<parameter=").ok_or_else(|| {
            format!("unexpected text in <function={func}>: expected <parameter=NAME>")
        })?;
        let gt = after.find('>').ok_or("unterminated <parameter= tag")?;
        let pname = after[..gt].trim().to_string();
        let after = &after[gt + 1..];
        let end = after
            .find("</parameter>")
            .ok_or_else(|| format!("<parameter={pname}> has no </parameter>"))?;
        let value = tools.convert(func, &pname, strip_layout(&after[..end]));
        if params.insert(pname.clone(), value).is_some() {
            return Err(format!("parameter '{pname}' given twice"));
        }
        s = &after[end + "</parameter>".len()..];
    }
}
