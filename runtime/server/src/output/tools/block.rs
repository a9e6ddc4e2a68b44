//! The `<tool_call>` block scanner shared by the Qwen grammars.

use super::{ParsedCall, ToolEvent, ToolParser, ToolSet};
use crate::output::reasoning::partial_tag_suffix;
use serde_json::Value;
use std::sync::Arc;

pub const START: &str = "<tool_call>";
pub const END: &str = "</tool_call>";

/// Parses the text between the tags into calls, or says why it cannot.
pub type BodyParser = fn(&str, &ToolSet) -> Result<Vec<ParsedCall>, String>;

/// For grammars whose (first) call per block can be streamed: from the
/// body so far, the call's name and where its arguments start, once both
/// are written.
pub type StreamHead = fn(&str) -> Option<(String, usize)>;

/// For grammars that write arguments as key/value pairs (the XML ones):
/// the pair that starts at byte `at` of the body written so far, in the
/// call to `name`. The grammar's [`BodyParser`] reads its pairs with the
/// same function, so the pairs streamed are the arguments its `Call`
/// carries.
pub type PairReader = for<'a> fn(body: &'a str, name: &str, at: usize) -> PairStep<'a>;

/// What a [`PairReader`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum PairStep<'a> {
    /// A complete pair: its key, its value's text as it is converted
    /// ([`ToolSet::convert`]), and where the next pair may start.
    Pair {
        key: String,
        value: &'a str,
        next: usize,
    },
    /// Only whitespace follows: the pairs end here if the body does.
    End,
    /// The text stops inside a pair: `why` the body does not parse if it
    /// ends here (more text may complete the pair).
    Partial(String),
    /// Not a pair, whatever follows: `why` the body does not parse.
    Bad(String),
}

/// How a streamed call's arguments are written in the body.
#[derive(Clone, Copy)]
enum Args {
    /// As JSON text (Hermes): sent on as written.
    Json,
    /// As pairs (XML grammars): each sent, once complete, as the JSON
    /// member its typed conversion makes of it.
    Pairs(PairReader),
}

/// The call being streamed in the current block.
struct Open {
    name: String,
    /// `Json`: how much of the body went out (as `CallStart` + `CallArgs`);
    /// `Pairs`: where the next pair starts.
    at: usize,
    /// `Pairs`: the keys sent so far (a repeated key means the block will
    /// not parse, so its second value is not sent).
    keys: Vec<String>,
    /// `Pairs`: the body cannot parse any more; nothing more is sent.
    stopped: bool,
}

pub struct BlockParser {
    grammar: &'static str,
    body: BodyParser,
    tools: Arc<ToolSet>,
    buf: String,
    inside: bool,
    /// Whitespace between the answer and the open block: layout when the
    /// block is a call, given back when it turns out to be text.
    pending_ws: String,
    /// Just after a call: leading whitespace of what follows is layout.
    after_call: bool,
    calls: usize,
    stream: Option<(StreamHead, Args)>,
    /// Inside a streamed block, once its call's name went out.
    open: Option<Open>,
}

impl BlockParser {
    pub fn new(grammar: &'static str, body: BodyParser, tools: Arc<ToolSet>) -> Self {
        BlockParser {
            grammar,
            body,
            tools,
            buf: String::new(),
            inside: false,
            pending_ws: String::new(),
            after_call: false,
            calls: 0,
            stream: None,
            open: None,
        }
    }

    /// Streams each block's call as it is written: its name once known,
    /// then its arguments' JSON text in fragments (`head` finds where it
    /// starts).
    pub fn streaming(mut self, head: StreamHead) -> Self {
        self.stream = Some((head, Args::Json));
        self
    }

    /// Streams each block's (first) call as it is written: its name once
    /// known (`head` also says where its first pair may start), then each
    /// argument pair once complete (`pair` reads them), as a JSON object's
    /// members: `{"a": 1`, `, "b": "x"`, and `}` at the block's end.
    pub fn streaming_pairs(mut self, head: StreamHead, pair: PairReader) -> Self {
        self.stream = Some((head, Args::Pairs(pair)));
        self
    }

    /// Inside a block (no end tag yet): sends the call's start and the
    /// arguments written so far: JSON text but for what may be the call's
    /// own closing (`}`, whitespace), or the complete pairs; never what
    /// may be the start of the end tag.
    fn stream_body(&mut self, out: &mut Vec<ToolEvent>) {
        let Some((head, args)) = self.stream else {
            return;
        };
        // What may be the start of the end tag is not body (yet).
        let held = partial_tag_suffix(&self.buf, END);
        let body = &self.buf[..self.buf.len() - held];
        if self.open.is_none() {
            let Some((name, at)) = head(body) else { return };
            out.push(ToolEvent::CallStart { name: name.clone() });
            self.open = Some(Open {
                name,
                at,
                keys: Vec::new(),
                stopped: false,
            });
        }
        let Some(open) = self.open.as_mut() else {
            return;
        };
        match args {
            Args::Json => {
                let safe = body
                    .trim_end_matches(|c: char| c == '}' || c.is_whitespace())
                    .len();
                if safe > open.at {
                    out.push(ToolEvent::CallArgs(body[open.at..safe].to_string()));
                    open.at = safe;
                }
            }
            Args::Pairs(pair) => send_pairs(open, pair, body, &self.tools, out),
        }
    }

    /// The rest of a streamed call's arguments once its block is complete
    /// and parses (into calls, the first of which is the one streamed).
    fn finish_stream(&mut self, body: &str, out: &mut Vec<ToolEvent>) {
        let Some(mut open) = self.open.take() else {
            return;
        };
        let Some((_, args)) = self.stream else {
            return;
        };
        match args {
            // Up to the call object's own closing brace.
            Args::Json => {
                let end = body.rfind('}').unwrap_or(body.len()).max(open.at);
                let rest = body[open.at..end].trim_end();
                if !rest.is_empty() {
                    out.push(ToolEvent::CallArgs(rest.to_string()));
                }
            }
            // The pairs not sent yet (all complete now), then the object's
            // end.
            Args::Pairs(pair) => {
                // The body parsed, so its pairs read (whatever a partial
                // body looked like).
                open.stopped = false;
                send_pairs(&mut open, pair, body, &self.tools, out);
                let close = if open.keys.is_empty() { "{}" } else { "}" };
                out.push(ToolEvent::CallArgs(close.to_string()));
            }
        }
    }

    fn emit_text(&mut self, out: &mut Vec<ToolEvent>, text: &str) {
        let text = if self.after_call {
            text.trim_start()
        } else {
            text
        };
        if !text.is_empty() {
            self.after_call = false;
            out.push(ToolEvent::Text(text.to_string()));
        }
    }

    /// A block that is not a call: its text, and why.
    fn malformed(&mut self, out: &mut Vec<ToolEvent>, block: String, error: String) {
        let ws = std::mem::take(&mut self.pending_ws);
        self.after_call = false;
        tracing::warn!(grammar = self.grammar, "{error}");
        out.push(ToolEvent::Malformed {
            text: format!("{ws}{block}"),
            error,
        });
    }
}

/// Sends the complete pairs of `body` from `open.at` on, each converted as
/// the body parser converts it (so the members join into the call's
/// arguments).
fn send_pairs(
    open: &mut Open,
    pair: PairReader,
    body: &str,
    tools: &ToolSet,
    out: &mut Vec<ToolEvent>,
) {
    while !open.stopped {
        match pair(body, &open.name, open.at) {
            PairStep::Pair { key, value, next } => {
                if open.keys.contains(&key) {
                    // The body parser refuses a repeated key.
                    open.stopped = true;
                    break;
                }
                let value = tools.convert(&open.name, &key, value);
                let sep = if open.keys.is_empty() { "{" } else { ", " };
                let member = format!("{sep}{}: {value}", Value::String(key.clone()));
                out.push(ToolEvent::CallArgs(member));
                open.keys.push(key);
                open.at = next;
            }
            PairStep::End | PairStep::Partial(_) => break,
            // The block will end as `Malformed`: nothing more to send.
            PairStep::Bad(_) => open.stopped = true,
        }
    }
}

impl ToolParser for BlockParser {
    fn push(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        self.buf.push_str(text);
        loop {
            if self.inside {
                let Some(end) = self.buf.find(END) else {
                    self.stream_body(out);
                    return;
                };
                let body = self.buf[..end].to_string();
                self.buf.drain(..end + END.len());
                self.inside = false;
                let parsed = (self.body)(&body, &self.tools);
                // The streamed call is the block's first; the block's other
                // calls (Qwen3-Coder XML may write several) come whole.
                if parsed.as_ref().is_ok_and(|c| !c.is_empty()) {
                    self.finish_stream(&body, out);
                }
                self.open = None;
                match parsed {
                    Ok(calls) => {
                        self.calls += calls.len();
                        self.pending_ws.clear();
                        self.after_call = true;
                        out.extend(calls.into_iter().map(ToolEvent::Call));
                    }
                    Err(why) => {
                        let error = format!("a {} tool call did not parse: {why}", self.grammar);
                        self.malformed(out, format!("{START}{body}{END}"), error);
                    }
                }
            } else if let Some(start) = self.buf.find(START) {
                let before: String = self.buf.drain(..start + START.len()).collect();
                let before = &before[..start];
                let text_len = before.trim_end().len();
                self.emit_text(out, &before[..text_len]);
                self.pending_ws = before[text_len..].to_string();
                self.inside = true;
            } else {
                // Hold back a possible tag start and the whitespace before it.
                let tag_part = partial_tag_suffix(&self.buf, START);
                let text_len = self.buf[..self.buf.len() - tag_part].trim_end().len();
                let text: String = self.buf.drain(..text_len).collect();
                self.emit_text(out, &text);
                return;
            }
        }
    }

    fn finish(&mut self, out: &mut Vec<ToolEvent>) {
        let rest = std::mem::take(&mut self.buf);
        if self.inside {
            self.inside = false;
            self.open = None;
            let error = format!(
                "a {} tool call was cut off before its {END} (the output ended inside it)",
                self.grammar
            );
            self.malformed(out, format!("{START}{rest}"), error);
        } else {
            self.emit_text(out, &rest);
        }
    }

    fn calls_seen(&self) -> usize {
        self.calls
    }
}
