//! Turning a job's text stream into OpenAI responses: SSE chunks or one JSON
//! body, for chat (reasoning, tool calls) and text completions.

use super::Submitted;
use super::request::{PromptKind, max_new_tokens};
use crate::error::ApiError;
use crate::output::{OutputEvent, OutputParser};
use crate::worker::{Finish, Finished, GenError, Halt, StreamMsg};
use axum::Json;
use axum::http::{HeaderValue, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use krasis_model::EngineError;
use serde_json::{Value, json};
use std::convert::Infallible;
use std::time::Duration;
use tokio_stream::wrappers::ReceiverStream;

pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub struct ResponseMeta {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
}

impl ResponseMeta {
    pub fn new(prefix: &str, model: &str, include_usage: bool) -> Self {
        ResponseMeta {
            id: format!("{prefix}-{}", uuid::Uuid::new_v4().simple()),
            created: unix_now(),
            model: model.to_string(),
            include_usage,
        }
    }
}

/// What kind of answer is being built.
pub enum Shape {
    Chat {
        parser: OutputParser,
        /// `parallel_tool_calls: false`: stop after this many calls.
        max_calls: Option<usize>,
        /// The request used legacy `functions`: calls are answered as
        /// `function_call` (one per message) instead of `tool_calls`.
        legacy: bool,
    },
    Text,
}

impl Shape {
    fn push(&mut self, text: &str) -> Vec<OutputEvent> {
        match self {
            Shape::Chat { parser, .. } => parser.push(text),
            Shape::Text => vec![OutputEvent::Content(text.to_string())],
        }
    }

    fn finish(&mut self) -> Vec<OutputEvent> {
        match self {
            Shape::Chat { parser, .. } => parser.finish(),
            Shape::Text => Vec::new(),
        }
    }

    fn tool_calls(&self) -> usize {
        match self {
            Shape::Chat { parser, .. } => parser.tool_calls(),
            Shape::Text => 0,
        }
    }

    /// Why a tool call did not parse (or was cut off), once one has.
    fn tool_call_error(&self) -> Option<String> {
        match self {
            Shape::Chat { parser, .. } => parser.tool_call_error().map(str::to_string),
            Shape::Text => None,
        }
    }

    /// True once the allowed number of tool calls has been produced.
    fn calls_exhausted(&self) -> bool {
        match self {
            Shape::Chat {
                parser,
                max_calls: Some(m),
                ..
            } => parser.tool_calls() >= *m,
            _ => false,
        }
    }

    fn is_chat(&self) -> bool {
        matches!(self, Shape::Chat { .. })
    }

    fn is_legacy(&self) -> bool {
        matches!(self, Shape::Chat { legacy: true, .. })
    }
}

/// The choice's finish reason. A tool call that did not parse, or was cut
/// off, is `tool_call_error` (whatever else the answer holds): its text is
/// in the content and the choice's `error` object (`tool_call_error_json`)
/// says why, so a client never mistakes a broken call for an answer.
fn finish_reason(f: Finish, tool_calls: usize, legacy: bool, call_error: bool) -> &'static str {
    if call_error {
        return "tool_call_error";
    }
    if tool_calls > 0 {
        return if legacy {
            "function_call"
        } else {
            "tool_calls"
        };
    }
    match f {
        Finish::Length => "length",
        // Cancelled only reaches a response when we cut generation ourselves.
        Finish::Stop | Finish::Cancelled => "stop",
    }
}

/// The choice's `error` beside finish reason `tool_call_error`.
fn tool_call_error_json(why: &str) -> Value {
    json!({"type": "tool_call_error", "message": why})
}

/// OpenAI's usage object; `prompt_tokens_details.cached_tokens` is what
/// the prefix cache served (0 without a hit), the field clients read.
fn usage(f: &Finished) -> Value {
    json!({
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": f.cached_tokens},
    })
}

/// The HTTP error for a generation that failed.
pub fn gen_error(e: &GenError, kind: PromptKind) -> ApiError {
    match e {
        GenError::Engine(EngineError::PromptTooLong { prompt, context }) => {
            max_new_tokens(kind, None, *prompt, false, *context)
                .err()
                .unwrap_or_else(|| ApiError::internal(e.to_string()))
        }
        GenError::Engine(EngineError::EmptyPrompt) => {
            ApiError::invalid_param("prompt", "the prompt is empty")
        }
        GenError::Engine(e @ EngineError::BadToken { .. }) => {
            ApiError::invalid_param("prompt", e.to_string())
        }
        GenError::Engine(EngineError::InvalidRequest(m)) => {
            ApiError::bad_request(format!("the engine cannot run this request: {m}"))
        }
        GenError::Engine(EngineError::OutOfMemory(m)) => ApiError::overloaded(
            format!("the engine ran out of memory for this request: {m}"),
            5,
        ),
        GenError::Halted(Halt::Shutdown) => ApiError::overloaded(e.to_string(), 5),
        GenError::Halted(Halt::Fault(_)) => ApiError::overloaded(e.to_string(), 10),
        other if other.is_fatal() => ApiError::internal(format!(
            "{other}; the engine is retired and the server is exiting so it can be restarted"
        )),
        other => ApiError::internal(other.to_string()),
    }
}

struct ChunkWriter {
    meta: ResponseMeta,
    chat: bool,
    legacy: bool,
}

impl ChunkWriter {
    fn chunk(&self, delta: Value, finish: Option<&str>) -> Value {
        let mut c = if self.chat {
            json!({
                "id": self.meta.id,
                "object": "chat.completion.chunk",
                "created": self.meta.created,
                "model": self.meta.model,
                "system_fingerprint": null,
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
            })
        } else {
            let text = delta.get("content").cloned().unwrap_or(json!(""));
            json!({
                "id": self.meta.id,
                "object": "text_completion",
                "created": self.meta.created,
                "model": self.meta.model,
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
            })
        };
        if self.meta.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }

    fn deltas(&self, ev: OutputEvent) -> Vec<Value> {
        match ev {
            OutputEvent::Content(t) => vec![json!({"content": t})],
            OutputEvent::Reasoning(r) => vec![json!({"reasoning_content": r, "reasoning": r})],
            OutputEvent::ToolCall {
                name, arguments, ..
            } if self.legacy => vec![
                json!({"function_call": {"name": name, "arguments": ""}}),
                json!({"function_call": {"arguments": arguments}}),
            ],
            OutputEvent::ToolCall {
                index,
                id,
                name,
                arguments,
            } => vec![
                json!({"tool_calls": [{"index": index, "id": id, "type": "function",
                        "function": {"name": name, "arguments": ""}}]}),
                json!({"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}),
            ],
            // A streamed call: its name as soon as it is known, then its
            // arguments as the model writes them.
            OutputEvent::ToolCallStart { name, .. } if self.legacy => {
                vec![json!({"function_call": {"name": name, "arguments": ""}})]
            }
            OutputEvent::ToolCallArgs { fragment, .. } if self.legacy => {
                vec![json!({"function_call": {"arguments": fragment}})]
            }
            OutputEvent::ToolCallStart { index, id, name } => {
                vec![
                    json!({"tool_calls": [{"index": index, "id": id, "type": "function",
                             "function": {"name": name, "arguments": ""}}]}),
                ]
            }
            OutputEvent::ToolCallArgs { index, fragment } => {
                vec![json!({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})]
            }
            OutputEvent::ToolCallEnd { .. } => Vec::new(),
        }
    }

    fn usage_chunk(&self, f: &Finished) -> Value {
        json!({
            "id": self.meta.id,
            "object": if self.chat { "chat.completion.chunk" } else { "text_completion" },
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": [],
            "usage": usage(f),
        })
    }
}

fn event(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

/// Streams the answer as SSE. The spawned task ends when the job ends or the
/// client goes away; either way the job's cancel guard is dropped with it.
pub fn stream(job: Submitted, meta: ResponseMeta, mut shape: Shape) -> Response {
    let (out, out_rx) = tokio::sync::mpsc::channel::<Event>(64);
    let kind = prompt_kind(&shape);
    let w = ChunkWriter {
        chat: shape.is_chat(),
        legacy: shape.is_legacy(),
        meta,
    };
    tokio::spawn(async move {
        let Submitted { mut rx, guard } = job;
        let mut pending: Vec<Value> = Vec::new();
        if w.chat {
            pending.push(w.chunk(json!({"role": "assistant", "content": ""}), None));
        }
        let mut cut = false;
        loop {
            for v in pending.drain(..) {
                if out.send(event(&v)).await.is_err() {
                    return;
                }
            }
            let msg = tokio::select! {
                m = rx.recv() => m,
                _ = out.closed() => return,
            };
            match msg {
                Some(StreamMsg::Text(t)) if !cut => {
                    for ev in shape.push(&t) {
                        pending.extend(w.deltas(ev).into_iter().map(|d| w.chunk(d, None)));
                    }
                    if shape.calls_exhausted() {
                        cut = true;
                        guard.cancel();
                    }
                }
                Some(StreamMsg::Text(_)) => {}
                Some(StreamMsg::Done(Ok(fin), mut report)) => {
                    if !cut {
                        for ev in shape.finish() {
                            pending.extend(w.deltas(ev).into_iter().map(|d| w.chunk(d, None)));
                        }
                    }
                    let call_error = shape.tool_call_error();
                    let reason = finish_reason(
                        fin.finish,
                        shape.tool_calls(),
                        w.legacy,
                        call_error.is_some(),
                    );
                    // Logged before the client can see the end.
                    report.set_finish_reason(reason);
                    drop(report);
                    let empty = if w.chat {
                        json!({})
                    } else {
                        json!({"content": ""})
                    };
                    let mut last = w.chunk(empty, Some(reason));
                    if let Some(why) = &call_error {
                        last["choices"][0]["error"] = tool_call_error_json(why);
                    }
                    pending.push(last);
                    if w.meta.include_usage {
                        pending.push(w.usage_chunk(&fin));
                    }
                    break;
                }
                Some(StreamMsg::Done(Err(e), _report)) => {
                    pending.push(gen_error(&e, kind).body());
                    break;
                }
                None => {
                    pending
                        .push(ApiError::internal("the generation ended without a result").body());
                    break;
                }
            }
        }
        for v in pending.drain(..) {
            if out.send(event(&v)).await.is_err() {
                return;
            }
        }
        let _ = out.send(Event::default().data("[DONE]")).await;
    });
    let body = ReceiverStream::new(out_rx).map(Ok::<_, Infallible>);
    let mut resp = Sse::new(body)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(1)))
        .into_response();
    // Without the charset, clients such as `requests` decode the stream as
    // ISO-8859-1, and a 0x85 byte inside a UTF-8 character (NEL there)
    // splits a JSON line.
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    resp
}

fn prompt_kind(shape: &Shape) -> PromptKind {
    if shape.is_chat() {
        PromptKind::Messages
    } else {
        PromptKind::Prompt
    }
}

/// Waits for the whole answer and returns one JSON body. If the client
/// disconnects, this future is dropped and the guard cancels the job.
pub async fn collect(
    job: Submitted,
    meta: ResponseMeta,
    mut shape: Shape,
) -> Result<Response, ApiError> {
    let kind = prompt_kind(&shape);
    let Submitted { mut rx, guard } = job;
    let mut events = Vec::new();
    let mut cut = false;
    let (fin, mut report) = loop {
        match rx.recv().await {
            Some(StreamMsg::Text(t)) if !cut => {
                events.extend(shape.push(&t));
                if shape.calls_exhausted() {
                    cut = true;
                    guard.cancel();
                }
            }
            Some(StreamMsg::Text(_)) => {}
            Some(StreamMsg::Done(Ok(fin), report)) => break (fin, report),
            Some(StreamMsg::Done(Err(e), _report)) => return Err(gen_error(&e, kind)),
            None => return Err(ApiError::internal("the generation ended without a result")),
        }
    };
    if !cut {
        events.extend(shape.finish());
    }
    let legacy = shape.is_legacy();
    let call_error = shape.tool_call_error();
    let reason = finish_reason(fin.finish, shape.tool_calls(), legacy, call_error.is_some());
    report.set_finish_reason(reason);
    drop(report);
    let (mut content, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
    let mut open = std::collections::HashMap::new();
    for ev in events {
        match ev {
            OutputEvent::Content(t) => content.push_str(&t),
            OutputEvent::Reasoning(r) => reasoning.push_str(&r),
            OutputEvent::ToolCall {
                id,
                name,
                arguments,
                ..
            } => calls.push(json!({"id": id, "type": "function",
                                   "function": {"name": name, "arguments": arguments}})),
            // A streamed call counts once it ended (a call that broke off
            // is the error the finish reason reports).
            OutputEvent::ToolCallStart { index, id, name } => {
                open.insert(index, (id, name));
            }
            OutputEvent::ToolCallArgs { .. } => {}
            OutputEvent::ToolCallEnd { index, arguments } => {
                if let Some((id, name)) = open.remove(&index) {
                    calls.push(json!({"id": id, "type": "function",
                                      "function": {"name": name, "arguments": arguments}}));
                }
            }
        }
    }
    let mut body = if shape.is_chat() {
        let mut message = json!({
            "role": "assistant",
            "content": if content.is_empty() && !calls.is_empty() { Value::Null } else { json!(content) },
        });
        if !reasoning.is_empty() {
            message["reasoning_content"] = json!(reasoning);
            message["reasoning"] = json!(reasoning);
        }
        if legacy && let Some(call) = calls.first() {
            message["function_call"] = call["function"].clone();
        } else if !calls.is_empty() {
            message["tool_calls"] = Value::Array(calls);
        }
        json!({
            "id": meta.id,
            "object": "chat.completion",
            "created": meta.created,
            "model": meta.model,
            "system_fingerprint": null,
            "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": reason}],
            "usage": usage(&fin),
        })
    } else {
        json!({
            "id": meta.id,
            "object": "text_completion",
            "created": meta.created,
            "model": meta.model,
            "choices": [{"index": 0, "text": content, "logprobs": null, "finish_reason": reason}],
            "usage": usage(&fin),
        })
    };
    if let Some(why) = &call_error {
        body["choices"][0]["error"] = tool_call_error_json(why);
    }
    Ok(Json(body).into_response())
}
