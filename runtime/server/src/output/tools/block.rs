//! The `<tool_call>` block scanner shared by the Qwen grammars.

use super::{ParsedCall, ToolEvent, ToolParser, ToolSet};
use crate::output::reasoning::partial_tag_suffix;
use std::sync::Arc;

pub const START: &str = "<tool_call>";
pub const END: &str = "</tool_call>";

/// Parses the text between the tags into calls, or says why it cannot.
pub type BodyParser = fn(&str, &ToolSet) -> Result<Vec<ParsedCall>, String>;

/// For grammars whose one call per block can be streamed: from the body
/// so far, the call's name and where its arguments start, once both are
/// written.
pub type StreamHead = fn(&str) -> Option<(String, usize)>;

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
    stream: Option<StreamHead>,
    /// Inside a streamed block: how much of the body went out as
    /// `CallStart` + `CallArgs` (the arguments' text up to here).
    streamed: Option<usize>,
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
            streamed: None,
        }
    }

    /// Streams each block's call as it is written: its name once known,
    /// then its arguments in fragments (`head` finds where they start).
    pub fn streaming(mut self, head: StreamHead) -> Self {
        self.stream = Some(head);
        self
    }

    /// Inside a block (no end tag yet): sends the call's start and the
    /// arguments written so far, holding back what may be the call's own
    /// closing (`}`, whitespace) or the start of the end tag.
    fn stream_body(&mut self, out: &mut Vec<ToolEvent>) {
        let Some(head) = self.stream else { return };
        let done = match self.streamed {
            Some(d) => d,
            None => match head(&self.buf) {
                Some((name, at)) => {
                    out.push(ToolEvent::CallStart { name });
                    self.streamed = Some(at);
                    at
                }
                None => return,
            },
        };
        let held = partial_tag_suffix(&self.buf, END);
        let safe = self.buf[..self.buf.len() - held]
            .trim_end_matches(|c: char| c == '}' || c.is_whitespace())
            .len();
        if safe > done {
            out.push(ToolEvent::CallArgs(self.buf[done..safe].to_string()));
            self.streamed = Some(safe);
        }
    }

    /// The rest of a streamed call's arguments once its block is complete:
    /// up to the call object's own closing brace.
    fn finish_stream(&mut self, body: &str, out: &mut Vec<ToolEvent>) {
        let Some(done) = self.streamed.take() else {
            return;
        };
        let end = body.rfind('}').unwrap_or(body.len()).max(done);
        let rest = body[done..end].trim_end();
        if !rest.is_empty() {
            out.push(ToolEvent::CallArgs(rest.to_string()));
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
                if parsed.as_ref().is_ok_and(|c| c.len() == 1) {
                    self.finish_stream(&body, out);
                }
                self.streamed = None;
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
            self.streamed = None;
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
