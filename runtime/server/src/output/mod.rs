//! Turning the model's text stream into OpenAI response parts: stop strings
//! ([`stop`]), reasoning ([`reasoning`]) and tool calls ([`tools`], which also
//! holds gpt-oss's harmony format, where channels carry the reasoning).

pub mod reasoning;
pub mod stop;
pub mod tools;

use reasoning::{Piece, ReasoningSplitter};
use tools::{ToolEvent, ToolParser};

/// One part of the assistant's answer, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputEvent {
    Reasoning(String),
    Content(String),
    ToolCall {
        index: usize,
        id: String,
        name: String,
        arguments: String,
    },
    /// A streamed call: its start (name known), its arguments' fragments,
    /// and its end with the arguments normalised (what a non-streamed
    /// answer carries); the fragments join into the same JSON value.
    ToolCallStart {
        index: usize,
        id: String,
        name: String,
    },
    ToolCallArgs {
        index: usize,
        fragment: String,
    },
    ToolCallEnd {
        index: usize,
        arguments: String,
    },
}

/// Reasoning split first (a tool call inside reasoning is only thought about),
/// then tool calls in the answer text when the request declared tools. For a
/// whole-output grammar (harmony) there is no `<think>` splitting: its parser
/// reads everything and says itself what is reasoning.
pub struct OutputParser {
    /// `None` for a whole-output grammar.
    reasoning: Option<ReasoningSplitter>,
    tools: Option<Box<dyn ToolParser>>,
    calls: usize,
    /// Why call blocks did not parse (their text went out as content).
    errors: Vec<String>,
    /// The index of the call being streamed, if one is.
    open: Option<usize>,
    /// Events of [`OutputParser::prime`]'s text, sent with the first
    /// output.
    early: Vec<OutputEvent>,
}

impl OutputParser {
    pub fn new(prompt_opens_reasoning: bool, tools: Option<Box<dyn ToolParser>>) -> Self {
        OutputParser {
            reasoning: Some(ReasoningSplitter::new(prompt_opens_reasoning)),
            tools,
            calls: 0,
            errors: Vec::new(),
            open: None,
            early: Vec::new(),
        }
    }

    /// For a grammar whose parser reads the whole output
    /// ([`tools::ToolGrammar::whole_output`]).
    pub fn whole(parser: Box<dyn ToolParser>) -> Self {
        OutputParser {
            reasoning: None,
            tools: Some(parser),
            calls: 0,
            errors: Vec::new(),
            open: None,
            early: Vec::new(),
        }
    }

    /// Text the output continues that the model did not write: a forced
    /// call's opening, appended to the prompt. It is parsed as output (the
    /// call starts there), and what it gives (e.g. a streamed call's name,
    /// once the opening names the tool) goes out with the first
    /// [`OutputParser::push`] or [`OutputParser::finish`].
    pub fn prime(&mut self, text: &str) {
        let events = self.push(text);
        self.early.extend(events);
    }

    pub fn push(&mut self, text: &str) -> Vec<OutputEvent> {
        let mut pieces = Vec::new();
        match self.reasoning.as_mut() {
            Some(r) => r.push(text, &mut pieces),
            None => pieces.push(Piece::Content(text.to_string())),
        }
        let events = self.route(pieces, false);
        self.with_early(events)
    }

    pub fn finish(&mut self) -> Vec<OutputEvent> {
        let mut pieces = Vec::new();
        if let Some(r) = self.reasoning.as_mut() {
            r.finish(&mut pieces);
        }
        let events = self.route(pieces, true);
        self.with_early(events)
    }

    fn with_early(&mut self, events: Vec<OutputEvent>) -> Vec<OutputEvent> {
        match self.early.is_empty() {
            true => events,
            false => {
                let mut all = std::mem::take(&mut self.early);
                all.extend(events);
                all
            }
        }
    }

    /// Complete tool calls emitted so far.
    pub fn tool_calls(&self) -> usize {
        self.calls
    }

    /// Why the first call block that did not parse (or was cut off) failed,
    /// once one has; its text went out as content.
    pub fn tool_call_error(&self) -> Option<&str> {
        self.errors.first().map(String::as_str)
    }

    fn route(&mut self, pieces: Vec<Piece>, finish: bool) -> Vec<OutputEvent> {
        let mut out = Vec::new();
        let mut tool_events = Vec::new();
        for p in pieces {
            match p {
                Piece::Reasoning(r) => out.push(OutputEvent::Reasoning(r)),
                Piece::Content(c) => match self.tools.as_mut() {
                    Some(t) => {
                        t.push(&c, &mut tool_events);
                        self.drain_tools(&mut tool_events, &mut out);
                    }
                    None => out.push(OutputEvent::Content(c)),
                },
            }
        }
        if finish && let Some(t) = self.tools.as_mut() {
            {
                t.finish(&mut tool_events);
                self.drain_tools(&mut tool_events, &mut out);
            }
        }
        out
    }

    fn drain_tools(&mut self, events: &mut Vec<ToolEvent>, out: &mut Vec<OutputEvent>) {
        for e in events.drain(..) {
            match e {
                ToolEvent::Text(t) => out.push(OutputEvent::Content(t)),
                ToolEvent::Malformed { text, error } => {
                    // A streamed call that then broke stays unfinished.
                    self.open = None;
                    self.errors.push(error);
                    out.push(OutputEvent::Content(text));
                }
                ToolEvent::CallStart { name } => {
                    self.open = Some(self.calls);
                    out.push(OutputEvent::ToolCallStart {
                        index: self.calls,
                        id: new_call_id(),
                        name,
                    });
                }
                ToolEvent::CallArgs(fragment) => {
                    if let Some(index) = self.open {
                        out.push(OutputEvent::ToolCallArgs { index, fragment });
                    }
                }
                ToolEvent::Call(c) if self.open.is_some() => {
                    let index = self.open.take().unwrap_or(self.calls);
                    out.push(OutputEvent::ToolCallEnd {
                        index,
                        arguments: c.arguments,
                    });
                    self.calls += 1;
                }
                ToolEvent::Reasoning(r) => out.push(OutputEvent::Reasoning(r)),
                ToolEvent::Call(c) => {
                    out.push(OutputEvent::ToolCall {
                        index: self.calls,
                        id: new_call_id(),
                        name: c.name,
                        arguments: c.arguments,
                    });
                    self.calls += 1;
                }
            }
        }
    }
}

pub fn new_call_id() -> String {
    format!("call_{}", &uuid::Uuid::new_v4().simple().to_string()[..24])
}
