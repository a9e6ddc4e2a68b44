//! gpt-oss's "harmony" output format. Unlike the Qwen grammars, harmony has
//! no `<think>` tag and no call envelope inside the answer text: the whole
//! output is a sequence of messages, each with a header naming its channel
//! and recipient, so one parser reads all of it (reasoning included).
//!
//! After the prompt's `<|start|>assistant` the model writes, for example
//!
//! ```text
//! <|channel|>analysis<|message|>thinking…<|end|>
//! <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>
//! ```
//!
//! (the recipient may also stand before the channel:
//! `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`).
//! Mapping onto OpenAI fields:
//! - `analysis` → reasoning (`reasoning_content`);
//! - `final` → content;
//! - a recipient `functions.NAME` naming a declared tool → a tool call whose
//!   arguments must be a JSON object; if they are not (or the message is cut
//!   off), the arguments are returned as content, as the other grammars return
//!   a block that does not parse, so nothing the model wrote disappears and no
//!   client receives arguments it cannot parse;
//! - `commentary` without recipient → content: harmony calls these
//!   "preambles", written for the user before a tool call;
//! - any other recipient (built-in tools such as `browser.search` or
//!   `python`, which this server does not run, or an undeclared function) is
//!   not a call we can hand to the client: the message counts as its channel
//!   (analysis → reasoning, otherwise content).
//!
//! `<|return|>` and `<|call|>` end the turn; they are the checkpoint's stop
//! tokens, so the engine stops on them and the parser usually sees the end of
//! the stream instead. The markers are special tokens: the text reaching this
//! parser must be decoded with special tokens kept.

use super::{
    Forced, ParsedCall, ToolConstraint, ToolEvent, ToolGrammar, ToolParser, ToolSet, lark_str,
    markup,
};
use crate::output::reasoning::partial_tag_suffix;
use krasis_model::structured::lark_json;
use krasis_model::tokenizer::Tokenizer;
use serde_json::Value;
use std::sync::Arc;

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
const CONSTRAIN: &str = "<|constrain|>";
const CALL: &str = "<|call|>";
const END: &str = "<|end|>";
/// Markers that end a message's body. `<|start|>` is among them because a
/// model that skips `<|end|>` still starts its next message with it.
const BODY_ENDS: [&str; 4] = [END, CALL, "<|return|>", START];
/// A header longer than this without `<|message|>` is not a header: the model
/// is writing plain text, which is then kept as content.
const MAX_HEADER: usize = 512;

#[derive(Debug, Clone, Copy)]
pub struct Harmony;

impl ToolGrammar for Harmony {
    fn name(&self) -> &'static str {
        "harmony"
    }

    fn parser(&self, tools: Arc<ToolSet>) -> Box<dyn ToolParser> {
        Box::new(HarmonyParser::new(tools))
    }

    fn forced_prefix(&self, forced: &Forced) -> Option<String> {
        // The prompt ends with `<|start|>assistant`; a forced call skips the
        // analysis message and opens the commentary call directly.
        match forced {
            Forced::Auto => None,
            Forced::Required => Some(format!("{CHANNEL}commentary to=functions.")),
            Forced::Named(name) => Some(format!(
                "{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}"
            )),
        }
    }

    fn whole_output(&self) -> bool {
        true
    }

    fn constrains(&self) -> bool {
        true
    }

    /// `required`: after the prefix's `to=functions.`, a declared tool's
    /// name, ` <|constrain|>json<|message|>`, arguments valid against its
    /// schema, `<|call|>` (which ends the turn); named: the arguments and
    /// `<|call|>`. One call per turn, as harmony writes them.
    ///
    /// `auto`: the whole output as harmony messages ([`messages_lark`]):
    /// reasoning and preambles are free text, and the turn ends with either
    /// a `final` answer (free, or `answer`) or a call of a declared tool,
    /// its recipient before or after the channel, its arguments valid.
    fn constraint(
        &self,
        forced: &Forced,
        tools: &ToolSet,
        _parallel: bool,
        answer: Option<&str>,
        tok: &Tokenizer,
    ) -> Result<Option<ToolConstraint>, String> {
        if !has_markers(tok) {
            return Ok(None);
        }
        let m = |t: &str| markup(tok, t);
        let mut rules = String::new();
        let mut alts = Vec::new();
        for (i, (name, schema)) in tools.schemas().enumerate() {
            let args = lark_json(&schema).map_err(|e| {
                format!("tool '{name}' has a parameters schema that is not an object: {e}")
            })?;
            rules.push_str(&format!("args{i}: {args} {}\n", m(CALL)));
            alts.push((name, i));
        }
        let index = |name: &str| {
            alts.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, i)| *i)
                .ok_or_else(|| format!("tool_choice names '{name}', which is not declared"))
        };
        match forced {
            Forced::Named(name) => rules.push_str(&format!("start: args{}\n", index(name)?)),
            Forced::Required => {
                let calls: Vec<String> = alts
                    .iter()
                    .map(|(name, i)| {
                        format!(
                            "{} {} {} {} args{i}",
                            lark_str(&format!("{name} ")),
                            m(CONSTRAIN),
                            lark_str("json"),
                            m(MESSAGE)
                        )
                    })
                    .collect();
                rules.push_str(&format!("start: {}\n", calls.join(" | ")));
            }
            Forced::Auto => {
                let names: Vec<(String, usize)> =
                    alts.iter().map(|(n, i)| (n.to_string(), *i)).collect();
                rules.push_str(&messages_lark(tok, &names, answer));
            }
        }
        Ok(Some(ToolConstraint::Whole(rules)))
    }

    /// The reasoning stays free; the `final` message is `answer`.
    fn answer_constraint(&self, answer: &str, tok: &Tokenizer) -> Option<ToolConstraint> {
        has_markers(tok).then(|| ToolConstraint::Whole(messages_lark(tok, &[], Some(answer))))
    }
}

/// Whether the vocabulary has harmony's markers as tokens (a grammar over
/// them needs each one).
fn has_markers(tok: &Tokenizer) -> bool {
    [START, CHANNEL, MESSAGE, CONSTRAIN, CALL, END]
        .iter()
        .all(|t| tok.token_id(t).is_some())
}

/// A harmony turn as Lark, after the prompt's `<|start|>assistant`:
/// messages on `analysis` or `commentary` (free text, each ended by
/// `<|end|><|start|>assistant`), then the last message: the `final` answer
/// (free text, or `answer`; the grammar's EOS, `<|return|>`, follows) or a
/// call of one of `tools` (name, rule index of its `args{i}`), which ends
/// with `<|call|>`. The call's recipient may stand before the channel or
/// after it, with or without a content type, as gpt-oss writes them.
///
/// With an `answer` format there are no `commentary` preambles: they are
/// content for the user, and the content must then be the answer alone.
fn messages_lark(tok: &Tokenizer, tools: &[(String, usize)], answer: Option<&str>) -> String {
    let m = |t: &str| markup(tok, t);
    let (ch, msg) = (m(CHANNEL), m(MESSAGE));
    let notes = match answer {
        None => format!("{} | {}", lark_str("analysis"), lark_str("commentary")),
        Some(_) => lark_str("analysis"),
    };
    let mut lark = format!(
        "TEXT: /(?s:.+)/\n\
         note: {ch} ({notes}) {msg} TEXT? {} {} {}\n\
         answer: {}\n\
         final: {ch} {} {msg} answer\n\
         ctype: {} {} {} | {}\n",
        m(END),
        m(START),
        lark_str("assistant"),
        answer.unwrap_or("TEXT?"),
        lark_str("final"),
        lark_str(" "),
        m(CONSTRAIN),
        lark_str("json"),
        lark_str(" json"),
    );
    let mut last = vec!["final".to_string()];
    for (name, i) in tools {
        let to = lark_str(&format!(" to=functions.{name}"));
        lark.push_str(&format!(
            "call{i}: ({ch} {} {to} | {to} {ch} {}) ctype? {msg} args{i}\n",
            lark_str("commentary"),
            lark_str("commentary"),
        ));
        last.push(format!("call{i}"));
    }
    lark.push_str(&format!("start: note* ({})\n", last.join(" | ")));
    lark
}

/// One message's header as the model wrote it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Header {
    pub channel: Option<String>,
    pub recipient: Option<String>,
    /// What remains of the header, e.g. `<|constrain|>json` or `json`.
    pub content_type: Option<String>,
}

/// The message structure of the output, streamed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    Begin(Header),
    Text(String),
    End,
}

/// Splits the output into messages, holding back text that may be the start
/// of a marker split across detokenized pieces.
#[derive(Debug, Default)]
pub struct Scanner {
    buf: String,
    in_body: bool,
}

impl Scanner {
    pub fn push(&mut self, text: &str, out: &mut Vec<Segment>) {
        self.buf.push_str(text);
        loop {
            if self.in_body {
                let end = BODY_ENDS
                    .iter()
                    .filter_map(|m| self.buf.find(m).map(|at| (at, *m)))
                    .min();
                if let Some((at, marker)) = end {
                    let body: String = self.buf.drain(..at).collect();
                    // `<|start|>` belongs to the next header.
                    if marker != START {
                        self.buf.drain(..marker.len());
                    }
                    text_segment(out, body);
                    out.push(Segment::End);
                    self.in_body = false;
                    continue;
                }
                let hold = BODY_ENDS
                    .iter()
                    .map(|m| partial_tag_suffix(&self.buf, m))
                    .max()
                    .unwrap_or(0);
                let body: String = self.buf.drain(..self.buf.len() - hold).collect();
                text_segment(out, body);
                return;
            }
            if let Some(at) = self.buf.find(MESSAGE) {
                let header: String = self.buf.drain(..at + MESSAGE.len()).collect();
                out.push(Segment::Begin(parse_header(&header[..at])));
                self.in_body = true;
            } else if self.buf.len() > MAX_HEADER {
                tracing::warn!("harmony: output without a message header; keeping it as content");
                out.push(Segment::Begin(Header::default()));
                self.in_body = true;
            } else {
                return;
            }
        }
    }

    pub fn finish(&mut self, out: &mut Vec<Segment>) {
        let rest = std::mem::take(&mut self.buf);
        if self.in_body {
            self.in_body = false;
            text_segment(out, rest);
            out.push(Segment::End);
        } else if !rest.trim().is_empty() && !rest.contains("<|") {
            // Plain text with no harmony markers at all: the model did not
            // speak harmony; its words are still the answer.
            out.push(Segment::Begin(Header::default()));
            out.push(Segment::Text(rest));
            out.push(Segment::End);
        } else if !rest.trim().is_empty() {
            // A header cut off (by max_tokens) before its message began.
            tracing::debug!(header = rest, "harmony: dropping an unfinished header");
        }
    }
}

fn text_segment(out: &mut Vec<Segment>, text: String) {
    if !text.is_empty() {
        out.push(Segment::Text(text));
    }
}

/// `[<|start|>ROLE][ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ TYPE]`.
pub fn parse_header(raw: &str) -> Header {
    let mut s = raw;
    if let Some(at) = s.rfind(START) {
        // The role after `<|start|>` is the assistant's own; the prompt's
        // `<|start|>assistant` already said so for the first message.
        s = &s[at + START.len()..];
        s = s.trim_start().strip_prefix("assistant").unwrap_or(s);
    }
    let (before, after) = match s.find(CHANNEL) {
        Some(at) => (&s[..at], Some(&s[at + CHANNEL.len()..])),
        None => (s, None),
    };
    let mut rest = String::new();
    rest.push_str(before);
    let mut channel = None;
    if let Some(after) = after {
        let after = after.trim_start();
        let end = word_end(after);
        channel = (end > 0).then(|| after[..end].to_string());
        rest.push(' ');
        rest.push_str(&after[end..]);
    }
    let mut recipient = None;
    if let Some(at) = rest.find("to=") {
        let value = &rest[at + 3..];
        let end = word_end(value);
        recipient = (end > 0).then(|| value[..end].to_string());
        rest.replace_range(at..at + 3 + end, " ");
    }
    let content_type = rest.trim();
    Header {
        channel,
        recipient,
        content_type: (!content_type.is_empty()).then(|| content_type.to_string()),
    }
}

/// A header word ends at whitespace or at the next marker.
fn word_end(s: &str) -> usize {
    s.find(|c: char| c.is_whitespace())
        .into_iter()
        .chain(s.find("<|"))
        .min()
        .unwrap_or(s.len())
}

/// What the current message becomes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    Reasoning,
    Content,
    /// A call to this declared function; the body is its arguments.
    Call(String),
}

/// Reads the whole output. A call streams: `CallStart` at its header, its
/// body as `CallArgs` fragments as the scanner releases it (leading and
/// trailing whitespace left out, so the fragments join into the body's
/// JSON text), and at the message's end the `Call` with the arguments
/// compact, or `Malformed` when they are not a JSON object (the started
/// call then stays unfinished and the body is content).
pub struct HarmonyParser {
    scanner: Scanner,
    tools: Arc<ToolSet>,
    kind: Kind,
    args: String,
    /// How much of `args` went out as `CallArgs` (0: nothing yet).
    sent: usize,
    calls: usize,
}

impl HarmonyParser {
    /// `tools`: the declared functions (empty when the request has none, so
    /// no message becomes a call).
    pub fn new(tools: Arc<ToolSet>) -> Self {
        HarmonyParser {
            scanner: Scanner::default(),
            tools,
            kind: Kind::Content,
            args: String::new(),
            sent: 0,
            calls: 0,
        }
    }

    /// Sends the call's body written so far, but for whitespace at its
    /// start and (until more follows) at its end: neither is part of the
    /// JSON text.
    fn send_args(&mut self, out: &mut Vec<ToolEvent>) {
        let from = match self.sent {
            0 => self.args.len() - self.args.trim_start().len(),
            sent => sent,
        };
        let to = self.args.trim_end().len();
        if to > from {
            out.push(ToolEvent::CallArgs(self.args[from..to].to_string()));
            self.sent = to;
        }
    }

    fn kind_of(&self, h: &Header) -> Kind {
        let function = h
            .recipient
            .as_deref()
            .and_then(|r| r.strip_prefix("functions."));
        match function {
            Some(name) if self.tools.contains(name) => return Kind::Call(name.to_string()),
            Some(name) => {
                tracing::warn!(
                    function = name,
                    "harmony: call to an undeclared function; keeping it as text"
                );
            }
            None => {}
        }
        match h.channel.as_deref() {
            Some("analysis") => Kind::Reasoning,
            _ => Kind::Content,
        }
    }

    fn route(&mut self, segments: Vec<Segment>, out: &mut Vec<ToolEvent>) {
        for s in segments {
            match s {
                Segment::Begin(h) => {
                    self.kind = self.kind_of(&h);
                    self.args.clear();
                    self.sent = 0;
                    if let Kind::Call(name) = &self.kind {
                        out.push(ToolEvent::CallStart { name: name.clone() });
                    }
                }
                Segment::Text(t) => match &self.kind {
                    Kind::Reasoning => out.push(ToolEvent::Reasoning(t)),
                    Kind::Content => out.push(ToolEvent::Text(t)),
                    Kind::Call(_) => {
                        self.args.push_str(&t);
                        self.send_args(out);
                    }
                },
                Segment::End => {
                    if let Kind::Call(name) = std::mem::replace(&mut self.kind, Kind::Content) {
                        let args = std::mem::take(&mut self.args);
                        match call_arguments(&args) {
                            Some(arguments) => {
                                self.calls += 1;
                                out.push(ToolEvent::Call(ParsedCall { name, arguments }));
                            }
                            None => {
                                let error = format!(
                                    "a harmony call to {name} has arguments that are not a JSON object"
                                );
                                tracing::warn!("{error}");
                                out.push(ToolEvent::Malformed { text: args, error });
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The arguments as a compact JSON object string, or `None` when they are not
/// one (invalid, truncated, or another JSON type).
fn call_arguments(body: &str) -> Option<String> {
    match serde_json::from_str::<Value>(body.trim()) {
        Ok(v @ Value::Object(_)) => Some(v.to_string()),
        _ => None,
    }
}

impl ToolParser for HarmonyParser {
    fn push(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        let mut segments = Vec::new();
        self.scanner.push(text, &mut segments);
        self.route(segments, out);
    }

    fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        let mut segments = Vec::new();
        self.scanner.finish(&mut segments);
        self.route(segments, out);
    }

    fn calls_seen(&self) -> usize {
        self.calls
    }
}
