//! Tool calls written in the model's own grammar. The grammar is chosen from
//! the loaded chat template's source (the template teaches the model how to
//! call tools, so it is the authority). Each grammar provides a body parser;
//! the shared [`BlockParser`] finds `<tool_call>…</tool_call>` blocks in the
//! streamed answer text, holding back text that may be the start of a tag.
//! A block that does not parse, or is cut off, is returned as ordinary text so
//! nothing the model wrote disappears.

mod block;
mod glm_xml;
mod harmony;
mod hermes;
mod qwen_xml;
pub mod schema;
mod xml_values;

pub use block::BlockParser;
pub use glm_xml::GlmXml;
pub use harmony::{Harmony, HarmonyParser, Header, Scanner, Segment, parse_header};
pub use hermes::HermesJson;
pub use qwen_xml::QwenXml;
pub use schema::ToolSet;

use krasis_model::tokenizer::Tokenizer;
use serde_json::Value;
use std::sync::Arc;

/// One complete call as the model wrote it, arguments as a JSON object string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    pub arguments: String,
}

/// What the tool-call parser makes of the answer text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    Text(String),
    /// A call is being written and its name is known (every grammar streams
    /// its calls: Hermes JSON as its arguments' text is written, the XML
    /// grammars one typed argument at a time as each completes, harmony at its
    /// message header then its body as it arrives); its arguments follow as
    /// [`ToolEvent::CallArgs`] and it ends with [`ToolEvent::Call`] (or
    /// `Malformed`, which leaves it unfinished). A call that arrives in one
    /// piece may come as a bare `Call`.
    CallStart {
        name: String,
    },
    /// The next fragment of the open call's arguments; the fragments join
    /// into a JSON object text equal (as JSON) to its `Call`'s arguments
    /// (for the XML grammars they are not the model's own text).
    CallArgs(String),
    /// A complete call; it completes the open call when one was started.
    Call(ParsedCall),
    /// A call block that does not parse, or was cut off: its text is kept
    /// (as content) and the response reports `error` (never a silent
    /// downgrade to text; `api/response.rs` says how).
    Malformed {
        text: String,
        error: String,
    },
    /// Reasoning, from grammars that read the whole output
    /// ([`ToolGrammar::whole_output`]); the Qwen grammars never emit it.
    Reasoning(String),
}

/// How the request constrains tool use (after `tool_choice: none` has removed
/// the tools altogether).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Forced {
    /// The model decides.
    Auto,
    /// Some tool must be called.
    Required,
    /// This tool must be called.
    Named(String),
}

/// A tool-call grammar (Qwen hermes JSON, Qwen3-Coder XML, gpt-oss harmony,
/// GLM-4.5 XML; a DeepSeek grammar would implement the same trait).
pub trait ToolGrammar: Send + Sync + std::fmt::Debug {
    /// Short name used in logs and error messages.
    fn name(&self) -> &'static str;

    /// A streaming parser for one response.
    fn parser(&self, tools: Arc<ToolSet>) -> Box<dyn ToolParser>;

    /// Text appended to the prompt (after the generation prompt) that makes
    /// the model start the forced call; `None` for [`Forced::Auto`].
    fn forced_prefix(&self, forced: &Forced) -> Option<String>;

    /// The grammar that makes the model's calls well formed (issue 18):
    /// after [`ToolGrammar::forced_prefix`] for a forced call, or for
    /// `auto` each call the model opens; arguments valid against each
    /// tool's schema.
    ///
    /// `answer`: a Lark item the model's answer must match when it does not
    /// call a tool (`response_format`'s JSON, from
    /// `krasis_model::structured::lark_json`); `None`: the answer is free
    /// text. It applies to `auto` only (a forced call has no answer), and
    /// makes `auto`'s grammar whole-output: the answer or calls.
    ///
    /// `Ok(None)`: this family has no constraint for that mode (its calls
    /// are parsed as written). `Err`: a tool cannot be constrained (its
    /// message says which).
    fn constraint(
        &self,
        _forced: &Forced,
        _tools: &ToolSet,
        _parallel: bool,
        _answer: Option<&str>,
        _tok: &Tokenizer,
    ) -> Result<Option<ToolConstraint>, String> {
        Ok(None)
    }

    /// The grammar of an answer that must match `answer` when the request
    /// declares no tools, for families whose output wraps the answer
    /// (harmony's `final` channel); `None`: the answer is the whole output,
    /// so `answer` alone is its grammar.
    fn answer_constraint(&self, _answer: &str, _tok: &Tokenizer) -> Option<ToolConstraint> {
        None
    }

    /// Whether [`ToolGrammar::constraint`] constrains this grammar's forced
    /// calls (`required`, a named function), and its `auto` calls (the
    /// capability report says so; a test holds these to what `constraint`
    /// does).
    fn constrains(&self) -> bool {
        false
    }

    fn constrains_auto(&self) -> bool {
        self.constrains()
    }

    /// True when the parser reads the whole output, reasoning included
    /// (harmony's channels), and is used even when the request declares no
    /// tools; false when `<think>` splitting comes first and the parser sees
    /// only the answer text.
    fn whole_output(&self) -> bool {
        false
    }
}

/// A tool-call grammar as the engine enforces it (Lark, llguidance's
/// dialect: `%json {schema}` for arguments, `<[id]>` for a token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolConstraint {
    /// The whole output after the forced prefix (then EOS).
    Whole(String),
    /// Free text; after each `trigger` token, one call as `lark` says.
    Lazy { trigger: u32, lark: String },
}

/// One declared tool in a [`CallShape`]: its name, the Lark of its name as
/// a call writes it, and the Lark of the rest of the call (its arguments
/// and the call's end).
pub struct CallRule {
    pub name: String,
    pub named: String,
    pub rest: String,
}

/// The shape the `<tool_call>` families share (Hermes JSON, Qwen3-Coder
/// XML, GLM-4.5 XML): after the `trigger` token the model writes `head`,
/// then one tool's name and the rest of its call; with parallel calls on,
/// more follow, each `"\n"`, the trigger (`open`: its Lark) and `head`.
pub struct CallShape {
    pub trigger: u32,
    pub open: String,
    pub head: String,
    pub tools: Vec<CallRule>,
    /// Rules the calls refer to (e.g. lazy string values), one per line.
    pub rules: String,
}

impl CallShape {
    /// The grammar for `forced`, matching [`ToolGrammar::forced_prefix`]:
    /// the prefix of `required` ends where a name starts, that of a named
    /// tool after its name; `auto` is lazy after each trigger, or, with an
    /// `answer` (a Lark item), the whole output is that answer or calls.
    pub fn constraint(
        &self,
        forced: &Forced,
        parallel: bool,
        answer: Option<&str>,
    ) -> Result<ToolConstraint, String> {
        let mut rules = self.rules.clone();
        for (i, t) in self.tools.iter().enumerate() {
            rules.push_str(&format!("t{i}: {} {}\n", t.named, t.rest));
        }
        let alts: Vec<String> = (0..self.tools.len()).map(|i| format!("t{i}")).collect();
        rules.push_str(&format!("call: {}\n", alts.join(" | ")));
        let (open, head) = (&self.open, &self.head);
        let more = |call: &str| match parallel {
            true => format!(" ({} {open} {head} {call})*", lark_str("\n")),
            false => String::new(),
        };
        Ok(match forced {
            Forced::Auto => match answer {
                None => {
                    rules.push_str(&format!("start: {head} call\n"));
                    ToolConstraint::Lazy {
                        trigger: self.trigger,
                        lark: rules,
                    }
                }
                Some(answer) => {
                    rules.push_str(&format!("answer: {answer}\n"));
                    rules.push_str(&format!(
                        "start: answer | {open} {head} call{}\n",
                        more("call")
                    ));
                    ToolConstraint::Whole(rules)
                }
            },
            Forced::Required => {
                rules.push_str(&format!("start: call{}\n", more("call")));
                ToolConstraint::Whole(rules)
            }
            Forced::Named(name) => {
                let i = self
                    .tools
                    .iter()
                    .position(|t| t.name == *name)
                    .ok_or_else(|| format!("tool_choice names '{name}', which is not declared"))?;
                rules.push_str(&format!("first: {}\n", self.tools[i].rest));
                rules.push_str(&format!("start: first{}\n", more(&format!("t{i}"))));
                ToolConstraint::Whole(rules)
            }
        })
    }
}

/// `s` as a Lark string literal (Lark's strings use JSON's syntax).
pub fn lark_str(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// `text` in a grammar: the token by id when the vocabulary has it as an
/// added token (a model writes `<tool_call>` as one special token, which
/// no text literal matches), else the literal text.
pub fn markup(tok: &Tokenizer, text: &str) -> String {
    match tok.token_id(text) {
        Some(id) if tok.is_added(id) => format!("<[{id}]>"),
        _ => lark_str(text),
    }
}

/// A streaming parser over answer text.
pub trait ToolParser: Send {
    fn push(&mut self, text: &str, out: &mut Vec<ToolEvent>);
    fn finish(&mut self, out: &mut Vec<ToolEvent>);
    /// Complete calls parsed so far.
    fn calls_seen(&self) -> usize;
}

/// Every grammar this build knows.
pub fn all_grammars() -> [&'static dyn ToolGrammar; 4] {
    [&HermesJson, &QwenXml, &GlmXml, &Harmony]
}

/// Picks the grammar the template teaches, or `None` when the template has no
/// grammar this build understands (requests with tools are then refused).
pub fn detect_grammar(template_source: &str) -> Option<Arc<dyn ToolGrammar>> {
    // gpt-oss: the template writes harmony's message markers itself.
    if ["<|start|>", "<|channel|>", "<|message|>"]
        .iter()
        .all(|m| template_source.contains(m))
    {
        return Some(Arc::new(Harmony));
    }
    if template_source.contains("<function=") && template_source.contains("<parameter=") {
        return Some(Arc::new(QwenXml));
    }
    // GLM-4.5's template also writes `<tool_call>`: its argument pairs
    // decide before the Hermes JSON fallback.
    if glm_xml::taught_by(template_source) {
        return Some(Arc::new(GlmXml));
    }
    if template_source.contains("<tool_call>") {
        return Some(Arc::new(HermesJson));
    }
    None
}

#[cfg(test)]
mod constrained_tests;
#[cfg(test)]
mod tests;
