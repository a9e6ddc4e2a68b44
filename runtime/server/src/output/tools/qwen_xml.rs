//! Qwen3-Coder's XML grammar:
//! `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>`.
//! Values are text; the tool's JSON schema decides their JSON type.
//! A block's first call streams: its name once `<function=NAME>` is
//! written, then each parameter, once its `</parameter>` is, as a member
//! of the arguments object (typed as the complete call types it); a
//! block's further calls come whole.

use super::block::{BlockParser, END, PairStep, START};
use super::schema::arguments_string;
use super::xml_values::{Close, tool_args};
use super::{
    CallRule, CallShape, Forced, ParsedCall, ToolConstraint, ToolGrammar, ToolParser, ToolSet,
    lark_str, markup,
};
use crate::output::reasoning::partial_tag_suffix;
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
        Box::new(
            BlockParser::new(self.name(), parse_body, tools)
                .streaming_pairs(stream_head, stream_param),
        )
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
        answer: Option<&str>,
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
        shape.constraint(forced, parallel, answer).map(Some)
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
            .find(FUNCTION_CLOSE)
            .ok_or_else(|| format!("<function={name}> has no {FUNCTION_CLOSE}"))?;
        let params = parse_params(&name, &after[..end], tools)?;
        calls.push(ParsedCall {
            name,
            arguments: arguments_string(params),
        });
        rest = after[end + FUNCTION_CLOSE.len()..].trim_start();
    }
    if calls.is_empty() {
        return Err("no <function=…> in tool call".into());
    }
    Ok(calls)
}

const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";
const FUNCTION_CLOSE: &str = "</function>";

/// The first function's name and where its parameters start, once its
/// `<function=NAME>` is written (read as [`parse_body`] reads it).
fn stream_head(body: &str) -> Option<(String, usize)> {
    let after = body.trim_start().strip_prefix("<function=")?;
    let gt = after.find('>')?;
    let name = after[..gt].trim();
    (!name.is_empty()).then(|| (name.to_string(), body.len() - after.len() + gt + 1))
}

/// The parameter at `at` of the first function, whose text ends at its
/// `</function>` once that is written (as [`parse_body`] cuts it), or
/// before what may be its start.
fn stream_param<'a>(body: &'a str, func: &str, at: usize) -> PairStep<'a> {
    let end = match body[at..].find(FUNCTION_CLOSE) {
        Some(e) => at + e,
        None => body.len() - partial_tag_suffix(&body[at..], FUNCTION_CLOSE),
    };
    param_at(func, &body[..end], at)
}

/// The `<parameter=NAME>\nVALUE\n</parameter>` at `at` of a function's
/// text `s` (leading whitespace skipped). Both the parser and the stream
/// read parameters with it, so what streams is what the call carries.
fn param_at<'a>(func: &str, s: &'a str, at: usize) -> PairStep<'a> {
    let rest = s[at..].trim_start();
    if rest.is_empty() {
        return PairStep::End;
    }
    let Some(after) = rest.strip_prefix(PARAM_OPEN) else {
        let why = format!("unexpected text in <function={func}>: expected <parameter=NAME>");
        return match PARAM_OPEN.starts_with(rest) {
            true => PairStep::Partial(why),
            false => PairStep::Bad(why),
        };
    };
    let Some(gt) = after.find('>') else {
        return PairStep::Partial("unterminated <parameter= tag".into());
    };
    let key = after[..gt].trim().to_string();
    let after = &after[gt + 1..];
    let Some(end) = after.find(PARAM_CLOSE) else {
        return PairStep::Partial(format!("<parameter={key}> has no {PARAM_CLOSE}"));
    };
    PairStep::Pair {
        value: strip_layout(&after[..end]),
        next: s.len() - after.len() + end + PARAM_CLOSE.len(),
        key,
    }
}

fn parse_params(
    func: &str,
    s: &str,
    tools: &ToolSet,
) -> Result<Map<String, serde_json::Value>, String> {
    let mut params = Map::new();
    let mut at = 0;
    loop {
        match param_at(func, s, at) {
            PairStep::Pair { key, value, next } => {
                let value = tools.convert(func, &key, value);
                if params.insert(key.clone(), value).is_some() {
                    return Err(format!("parameter '{key}' given twice"));
                }
                at = next;
            }
            PairStep::End => return Ok(params),
            PairStep::Partial(why) | PairStep::Bad(why) => return Err(why),
        }
    }
}
