//! Continuous batching: the step interface an engine offers so several
//! sequences share its decode steps (issue 15).
//!
//! The server's engine thread owns one [`Batch`] and drives it in a loop:
//! it [`Batch::admit`]s queued requests while the engine has room, calls
//! [`Batch::step`], and hands each [`SeqEvent`] to that request's stream
//! (detokenizing, stop strings, client gone). A sequence the server wants to
//! stop (stop string matched, client gone, enough tool calls) is ended with
//! [`Batch::end`].
//!
//! ## One step
//! A step runs **at most one prefill chunk** of the oldest admitted
//! sequence that is still prefilling (its first token is sampled when its
//! last chunk ends), then **one decode step of every sequence that has a
//! token to feed back** (all of them together, up to [`Batch::capacity`]).
//! So a new request's prefill is interleaved with running decodes, and a
//! running decode stalls for at most one prefill chunk per token. (An
//! engine whose prefill cannot be split that way, e.g. streamed prefill
//! that reloads the expert cache per layer group, documents its own bound.)
//!
//! ## Exactness: batch invariance
//! A sequence's tokens and logits are the same whether it ran alone or
//! beside others: every row is computed independently with a fixed reduction
//! order, whatever the other rows are. [`generate_one`] runs a single request
//! through this same interface, so "alone" and "batched" are one code path.
//!
//! ## Memory
//! [`Batch::admit`] reserves what the sequence can ever need (its KV rows:
//! prompt + `max_new_tokens`, within the context); when that is not free it
//! answers [`Admission::Wait`] and the request stays queued until a sequence
//! ends. A running sequence never fails for memory. A request that could
//! never fit is an error at once.
//!
//! ## Cancellation and faults
//! `req.cancel` is checked by the engine before every prefill chunk and
//! decode step of that sequence; once set, the sequence ends with
//! [`FinishReason::Cancelled`] at the next step (no token after it) and
//! frees what it held. A non-fatal failure of one sequence (e.g. a prefill
//! out of memory) ends that sequence with `Done { result: Err(..) }`; an
//! error returned by `step` itself is fatal for the engine
//! ([`EngineError::is_fatal`]): every sequence is lost and the engine is
//! never stepped again.

use crate::engine::{EngineError, FinishReason, GenerateOutcome, GenerateRequest};
use std::ops::ControlFlow;

/// One sequence of a [`Batch`], from [`Batch::admit`] until its `Done`
/// event (or [`Batch::end`]). Ids are never reused by an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// The sequence holds its memory and runs from the next step.
    Admitted(SeqId),
    /// Not now: the KV it needs (or a batch place) is held by running
    /// sequences. Nothing was reserved; try again after one ends.
    Wait,
}

#[derive(Debug)]
pub enum SeqEvent {
    /// The next token of `seq` (the first one comes from its prefill).
    Token { seq: SeqId, token: u32 },
    /// `seq` ended (stop token, length, cancelled, or a non-fatal error of
    /// this sequence alone) and holds nothing in the engine any more.
    Done {
        seq: SeqId,
        result: Result<GenerateOutcome, EngineError>,
    },
}

/// KV memory of a batching engine, in tokens (one token: one position of
/// every layer's keys and values). `used_tokens` is what the running
/// sequences have reserved at admission ([`Batch::admit`]), so it returns
/// to its idle value whenever every sequence has ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvUsage {
    pub used_tokens: usize,
    pub total_tokens: usize,
}

/// The step interface of a batching engine (see the module docs).
pub trait Batch {
    /// The most sequences one decode step runs together.
    fn capacity(&self) -> usize;

    /// Validates `req` (empty prompt, token ids, sampling values, a prompt
    /// that can never fit: `Err`, nothing held) and admits it when its
    /// memory and a batch place are free.
    fn admit(&mut self, req: GenerateRequest) -> Result<Admission, EngineError>;

    /// Runs one step and appends what happened to `events`, in order. A
    /// returned error is fatal for the engine.
    fn step(&mut self, events: &mut Vec<SeqEvent>) -> Result<(), EngineError>;

    /// Ends `seq` now, from the caller's side (after one of its tokens):
    /// it frees what it held, runs no more work, and its outcome (finish
    /// `Cancelled`, with the tokens produced so far) is returned here
    /// instead of as a `Done` event. `None` when `seq` is not running: it
    /// ended by itself, and its `Done` follows its last `Token` in the
    /// same step's events (a sequence's last token and its end come
    /// together).
    fn end(&mut self, seq: SeqId) -> Option<GenerateOutcome>;

    /// Sequences admitted and not yet ended.
    fn active(&self) -> usize;

    /// The KV tokens reserved by running sequences and the engine's total.
    fn kv_usage(&self) -> KvUsage;
}

/// Runs one request alone through `batch`: the single-request path of an
/// engine that batches ([`crate::Engine::generate`] of such an engine is
/// this), so alone and batched share every line of engine code. `on_token`
/// as in `Engine::generate`: breaking ends the generation with `Cancelled`.
/// The engine must be idle; a request that must wait for memory in an idle
/// engine can never run and is refused.
pub fn generate_one(
    batch: &mut dyn Batch,
    req: &GenerateRequest,
    on_token: &mut dyn FnMut(u32) -> ControlFlow<()>,
) -> Result<GenerateOutcome, EngineError> {
    let seq = match batch.admit(req.clone())? {
        Admission::Admitted(seq) => seq,
        Admission::Wait => {
            return Err(EngineError::InvalidRequest(format!(
                "the request needs more KV memory ({} prompt + {} new tokens) than the idle engine has",
                req.prompt.len(),
                req.max_new_tokens
            )));
        }
    };
    let mut events = Vec::new();
    let mut broke = false;
    loop {
        events.clear();
        batch.step(&mut events)?;
        for ev in events.drain(..) {
            match ev {
                SeqEvent::Token { seq: s, token } if s == seq && !broke => {
                    if on_token(token).is_break() {
                        if let Some(outcome) = batch.end(seq) {
                            return Ok(outcome);
                        }
                        // It ended with this very token: its `Done` is
                        // next, and a break still makes it `Cancelled`.
                        broke = true;
                    }
                }
                SeqEvent::Done { seq: s, result } if s == seq => {
                    return match result {
                        Ok(o) if broke => Ok(GenerateOutcome {
                            finish: FinishReason::Cancelled,
                            ..o
                        }),
                        r => r,
                    };
                }
                other => {
                    return Err(EngineError::Backend(format!(
                        "an idle engine reported an event of a sequence it was not given: {other:?}"
                    )));
                }
            }
        }
        if broke {
            return Err(EngineError::Backend(format!(
                "sequence {} vanished from the batch before it ended",
                seq.0
            )));
        }
    }
}

/// Refuses a request whose grammar could never end: its EOS is not one of
/// the request's stop tokens (every engine's [`Batch::admit`] checks it).
pub fn check_constraint(req: &GenerateRequest) -> Result<(), EngineError> {
    match &req.constraint {
        Some(g) if !req.stop_token_ids.contains(&g.eos()) => {
            Err(EngineError::InvalidRequest(format!(
                "the request's grammar ends with token {} but that is not one of its stop tokens \
                 {:?}, so a complete output could never end",
                g.eos(),
                req.stop_token_ids
            )))
        }
        _ => Ok(()),
    }
}

/// A finished outcome's reason, for engines that end a sequence on a stop
/// token, its token budget or the context (the same rule for every engine).
pub fn finish_after_token(
    token: u32,
    req: &GenerateRequest,
    generated: usize,
    context: usize,
) -> Option<FinishReason> {
    if req.stop_token_ids.contains(&token) {
        Some(FinishReason::Stop)
    } else if generated >= req.max_new_tokens || req.prompt.len() + generated >= context {
        Some(FinishReason::Length)
    } else {
        None
    }
}
