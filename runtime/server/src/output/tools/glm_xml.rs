//! GLM-4.5's XML grammar (glm4_moe):
//! `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n…</tool_call>`,
//! one call per block. The template writes string values raw and every
//! other value as JSON (`v | tojson if v is not string else v`), so a value
//! is text and the tool's JSON schema decides its JSON type, as in
//! Qwen3-Coder's grammar. A call streams: its name once its line ends (or
//! its first `<arg_key>` starts), then each argument, once its
//! `</arg_value>` is written, as a member of the arguments object.

use super::block::{BlockParser, END, PairStep, START};
use super::schema::arguments_string;
use super::xml_values::{Close, tool_args};
use super::{
    CallRule, CallShape, Forced, ParsedCall, ToolConstraint, ToolGrammar, ToolParser, ToolSet,
    lark_str, markup,
};
use krasis_model::tokenizer::Tokenizer;
use serde_json::Map;
use std::sync::Arc;

const KEY_OPEN: &str = "<arg_key>";
const KEY_CLOSE: &str = "</arg_key>";
const VALUE_OPEN: &str = "<arg_value>";
const VALUE_CLOSE: &str = "</arg_value>";

#[derive(Debug, Clone, Copy)]
pub struct GlmXml;

impl ToolGrammar for GlmXml {
    fn name(&self) -> &'static str {
        "glm4-xml"
    }

    fn parser(&self, tools: Arc<ToolSet>) -> Box<dyn ToolParser> {
        Box::new(
            BlockParser::new(self.name(), parse_body, tools).streaming_pairs(stream_head, arg_at),
        )
    }

    fn forced_prefix(&self, forced: &Forced) -> Option<String> {
        match forced {
            Forced::Auto => None,
            Forced::Required => Some(START.to_string()),
            Forced::Named(name) => Some(format!("{START}{name}\n")),
        }
    }

    fn constrains(&self) -> bool {
        true
    }

    /// `required` continues after `<tool_call>` at a declared tool's name,
    /// a named tool at its first argument; `auto` constrains what follows
    /// each `<tool_call>` the model writes. The tags are GLM's added
    /// tokens where its vocabulary has them; values follow `xml_values`.
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
        let m = |t: &str| markup(tok, t);
        let close = Close::Markup(format!("{} {}", m(VALUE_CLOSE), lark_str("\n")));
        let (args, value_rules) = tool_args(tools, &close, |p, v| {
            format!(
                "{} {} {} {} {} {v}",
                m(KEY_OPEN),
                lark_str(p),
                m(KEY_CLOSE),
                lark_str("\n"),
                m(VALUE_OPEN)
            )
        })?;
        let end = m(END);
        // The name follows `<tool_call>` directly: no head.
        let shape = CallShape {
            trigger: open,
            open: m(START),
            head: String::new(),
            tools: args
                .into_iter()
                .map(|(name, a)| CallRule {
                    named: lark_str(&format!("{name}\n")),
                    rest: format!("{a} {end}"),
                    name,
                })
                .collect(),
            rules: value_rules,
        };
        shape.constraint(forced, parallel, answer).map(Some)
    }
}

/// Whether a template teaches this grammar.
pub fn taught_by(template_source: &str) -> bool {
    template_source.contains(KEY_OPEN) && template_source.contains(VALUE_OPEN)
}

/// Where the name ends: at the end of its line or at the first argument,
/// once either is written.
fn name_end(body: &str) -> Option<usize> {
    [body.find('\n'), body.find(KEY_OPEN)]
        .into_iter()
        .flatten()
        .min()
}

/// The call's name as the body writes it before `end`.
fn call_name(body: &str, end: usize) -> Result<String, String> {
    let name = body[..end].trim().to_string();
    if name.is_empty() {
        return Err("empty function name".into());
    }
    if name.contains('<') || name.contains('{') {
        return Err(format!("'{name}' is not a function name"));
    }
    Ok(name)
}

/// The call's name and where its arguments start, once the name is
/// complete (read as [`parse_body`] reads it).
fn stream_head(body: &str) -> Option<(String, usize)> {
    let end = name_end(body)?;
    Some((call_name(body, end).ok()?, end))
}

/// The `<arg_key>K</arg_key>\n<arg_value>V</arg_value>` at `at` (leading
/// whitespace skipped). Both the parser and the stream read arguments with
/// it, so what streams is what the call carries.
fn arg_at<'a>(body: &'a str, name: &str, at: usize) -> PairStep<'a> {
    // A tag cut short waits for the rest of it; any other text is no tag.
    let expect = |rest: &str, tag: &str, why: String| match tag.starts_with(rest) {
        true => PairStep::Partial(why),
        false => PairStep::Bad(why),
    };
    let rest = body[at..].trim_start();
    if rest.is_empty() {
        return PairStep::End;
    }
    let Some(after) = rest.strip_prefix(KEY_OPEN) else {
        let why = format!("unexpected text in the call to {name}: expected {KEY_OPEN}");
        return expect(rest, KEY_OPEN, why);
    };
    let Some(end) = after.find(KEY_CLOSE) else {
        return PairStep::Partial(format!(
            "{KEY_OPEN} without {KEY_CLOSE} in the call to {name}"
        ));
    };
    let key = after[..end].trim().to_string();
    if key.is_empty() {
        return PairStep::Bad(format!("empty argument name in the call to {name}"));
    }
    let after = after[end + KEY_CLOSE.len()..].trim_start();
    let Some(after) = after.strip_prefix(VALUE_OPEN) else {
        let why = format!("argument '{key}' of {name} has no {VALUE_OPEN}");
        return expect(after, VALUE_OPEN, why);
    };
    let Some(end) = after.find(VALUE_CLOSE) else {
        return PairStep::Partial(format!("argument '{key}' of {name} has no {VALUE_CLOSE}"));
    };
    PairStep::Pair {
        value: &after[..end],
        next: body.len() - after.len() + end + VALUE_CLOSE.len(),
        key,
    }
}

fn parse_body(body: &str, tools: &ToolSet) -> Result<Vec<ParsedCall>, String> {
    let mut at = name_end(body).unwrap_or(body.len());
    let name = call_name(body, at)?;
    let mut args = Map::new();
    loop {
        match arg_at(body, &name, at) {
            PairStep::Pair { key, value, next } => {
                let value = tools.convert(&name, &key, value);
                if args.insert(key.clone(), value).is_some() {
                    return Err(format!(
                        "argument '{key}' given twice in the call to {name}"
                    ));
                }
                at = next;
            }
            PairStep::End => break,
            PairStep::Partial(why) | PairStep::Bad(why) => return Err(why),
        }
    }
    Ok(vec![ParsedCall {
        name,
        arguments: arguments_string(args),
    }])
}
