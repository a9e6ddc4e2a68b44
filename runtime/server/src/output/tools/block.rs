//! The `<tool_call>` block scanner shared by the Qwen grammars.

use super::{ParsedCall, ToolEvent, ToolParser, ToolSet};
use crate::output::reasoning::partial_tag_suffix;
use std::sync::Arc;

pub const START: &str = "<tool_call>";
pub const END: &str = "</tool_call>";

/// Parses the text between the tags into calls, or says why it cannot.
pub type BodyParser = fn(&str, &ToolSet) -> Result<Vec<ParsedCall>, String>;

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

    fn block_as_text(&mut self, out: &mut Vec<ToolEvent>, block: String) {
        let ws = std::mem::take(&mut self.pending_ws);
        self.after_call = false;
        out.push(ToolEvent::Text(format!("{ws}{block}")));
    }
}

impl ToolParser for BlockParser {
    fn push(&mut self, text: &str, out: &mut Vec<ToolEvent>) {
        self.buf.push_str(text);
        loop {
            if self.inside {
                let Some(end) = self.buf.find(END) else {
                    return;
                };
                let body = self.buf[..end].to_string();
                self.buf.drain(..end + END.len());
                self.inside = false;
                match (self.body)(&body, &self.tools) {
                    Ok(calls) => {
                        self.calls += calls.len();
                        self.pending_ws.clear();
                        self.after_call = true;
                        out.extend(calls.into_iter().map(ToolEvent::Call));
                    }
                    Err(why) => {
                        tracing::warn!(
                            grammar = self.grammar,
                            "tool call block did not parse ({why}); returning it as text"
                        );
                        self.block_as_text(out, format!("{START}{body}{END}"));
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
            tracing::warn!(
                grammar = self.grammar,
                "tool call block was cut off; returning it as text"
            );
            self.inside = false;
            self.block_as_text(out, format!("{START}{rest}"));
        } else {
            self.emit_text(out, &rest);
        }
    }

    fn calls_seen(&self) -> usize {
        self.calls
    }
}
