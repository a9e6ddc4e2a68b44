//! The reference engine's continuous batching ([`crate::batch`]): every
//! admitted sequence has its own KV cache, sized at admission for what it
//! can ever hold (prompt + new tokens, within the context) out of the
//! engine's KV budget ([`ReferenceEngine::set_kv_tokens`]), its own sampler
//! and its own request (cancel token, live progress, prefix-cache choice).
//!
//! A step first ends the sequences whose cancel token is set (they free
//! their KV at once, wherever they were), then runs one prefill chunk of the
//! oldest sequence still prefilling, then one decode step of every sequence
//! that was decoding when the step began, in admission order. Every forward
//! pass reads only its own sequence's KV and the weights, so a sequence's
//! logits (and, with its own sampler, its tokens) are bit for bit those it
//! gets alone: batch invariance holds by construction here, and
//! `tests/batch.rs` checks it. [`crate::Engine::generate`] is
//! [`crate::batch::generate_one`] over this, so there is one code path.
//!
//! The prefix cache is consulted when a sequence's prefill begins (not at
//! admission: a sequence admitted beside another with the same prefix then
//! finds the blocks the first one stored, since prefills run oldest first),
//! restored into that sequence's KV, and stored from it once its prefill
//! completed and it was not cancelled.

use super::ReferenceEngine;
use super::kv::KvCache;
use crate::batch::{Admission, Batch, KvUsage, SeqEvent, SeqId, finish_after_token};
use crate::engine::{EngineError, FinishReason, GenerateOutcome, GenerateRequest, GenerateStats};
use crate::prefix_cache::Hit;
use crate::sampling::Sampler;
use crate::structured::{Constraint, Grammar};
use std::time::Instant;

/// The most sequences the reference engine runs together (as many as the
/// CUDA engine's decode kernels take, so both engines are driven alike).
pub const BATCH_CAPACITY: usize = 8;

/// Where a sequence is.
enum State {
    /// Admitted; its prefill (and prefix-cache lookup) has not begun.
    Admitted,
    /// Prompt positions `0..next` are in its KV.
    Prefilling { next: usize, hit: Option<Hit> },
    /// `token` (the latest) is fed back at position `pos` by its next step.
    Decoding { token: u32, pos: usize },
}

pub(super) struct Seq {
    id: SeqId,
    req: GenerateRequest,
    kv: KvCache,
    sampler: Sampler,
    /// Its place in the request's grammar, when it has one.
    constraint: Option<Constraint>,
    stats: GenerateStats,
    state: State,
    /// The prefill chunk fixed when its prefill began.
    chunk: usize,
    prefill_started: Option<Instant>,
    first_token: Option<Instant>,
    /// Prefill chunks run (the test hook `cancel_after_chunks` counts them).
    chunks_done: usize,
}

/// What one prefill step of a sequence did.
pub(super) enum Prefill {
    /// A chunk ran; more follow.
    Running,
    /// The last chunk ran: the last position's logits.
    Done(Vec<f32>),
    /// Its cancel token was set during the last chunk: no token follows.
    Cancelled,
}

/// A greedy request of `prompt` alone (what the prefill helpers run).
pub(super) fn prompt_only(prompt: &[u32]) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt.to_vec(),
        max_new_tokens: 1,
        sampling: Default::default(),
        stop_token_ids: Vec::new(),
        cancel: Default::default(),
        live: Default::default(),
        cache_prompt: false,
        constraint: None,
    }
}

impl Seq {
    pub(super) fn new(id: SeqId, req: GenerateRequest, kv: KvCache) -> Self {
        Seq {
            id,
            sampler: Sampler::new(&req.sampling),
            constraint: req.constraint.as_ref().map(Grammar::start),
            stats: GenerateStats {
                prompt_tokens: req.prompt.len(),
                ..GenerateStats::default()
            },
            req,
            kv,
            state: State::Admitted,
            chunk: 1,
            prefill_started: None,
            first_token: None,
            chunks_done: 0,
        }
    }

    /// Prompt tokens served from the prefix cache (set when its prefill completed).
    pub(super) fn cached_tokens(&self) -> usize {
        self.stats.cached_tokens
    }

    /// Its outcome, ending now with `finish`.
    fn outcome(&self, finish: FinishReason) -> GenerateOutcome {
        let mut stats = self.stats.clone();
        if stats.prefill_seconds == 0.0
            && let Some(t) = self.prefill_started
        {
            // Ended during its prefill.
            stats.prefill_seconds = t.elapsed().as_secs_f64();
        }
        if let Some(t) = self.first_token {
            stats.decode_seconds = t.elapsed().as_secs_f64();
        }
        GenerateOutcome { finish, stats }
    }
}

impl ReferenceEngine {
    /// The KV tokens all running sequences may reserve together (default
    /// [`BATCH_CAPACITY`] contexts, so every sequence can hold a whole
    /// context; 0 is taken as 1). A sequence reserves prompt +
    /// `max_new_tokens` (within the context) at admission; one that does
    /// not fit beside the running ones waits ([`Admission::Wait`]), one
    /// that never fits is refused. Applies to admissions from now on.
    pub fn set_kv_tokens(&mut self, tokens: usize) {
        self.kv_tokens = tokens.max(1);
    }

    pub fn kv_tokens(&self) -> usize {
        self.kv_tokens
    }

    fn kv_reserved(&self) -> usize {
        self.seqs.iter().map(|s| s.kv.capacity()).sum()
    }

    /// Runs the next prefill chunk of `seq` (the first one looks the
    /// prompt up in the prefix cache and restores the hit); after the last,
    /// stores the prompt's blocks unless the request was cancelled.
    pub(super) fn prefill_step(&mut self, seq: &mut Seq) -> Result<Prefill, EngineError> {
        if let State::Admitted = seq.state {
            seq.prefill_started = Some(Instant::now());
            seq.chunk = self.prefill_chunk.max(1);
            let hit = self.reuse_prefix(&seq.req.prompt, seq.req.cache_prompt, &mut seq.kv);
            let from = hit.as_ref().map_or(0, |h| h.tokens);
            seq.req.live.set_prefilled(from);
            seq.state = State::Prefilling { next: from, hit };
        }
        let State::Prefilling { next, .. } = &seq.state else {
            unreachable!("prefill_step of a decoding sequence");
        };
        let prompt = &seq.req.prompt;
        let (start, end) = (*next, next.saturating_add(seq.chunk).min(prompt.len()));
        let hidden = self.forward(&mut seq.kv, &prompt[start..end], start)?;
        // The server's stats endpoint shows "prefilling end of n".
        seq.req.live.set_prefilled(end);
        seq.chunks_done += 1;
        #[cfg(test)]
        if let Some((n, flag)) = &self.cancel_after_chunks
            && seq.chunks_done == *n
        {
            flag.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let State::Prefilling { next, hit } = &mut seq.state else {
            unreachable!()
        };
        *next = end;
        if end < seq.req.prompt.len() {
            return Ok(Prefill::Running);
        }
        let hit = hit.take();
        let h = self.geometry.hidden;
        let logits = self.logits(&hidden[hidden.len() - h..]);
        seq.stats.prefill_seconds = seq
            .prefill_started
            .map_or(0.0, |t| t.elapsed().as_secs_f64());
        // Also when it came during the last chunk: nothing after a cancel,
        // and nothing stored from a cancelled request.
        if seq.req.cancel.is_cancelled() {
            return Ok(Prefill::Cancelled);
        }
        self.store_prefix(&seq.req.prompt, hit.as_ref(), &seq.kv);
        seq.stats.cached_tokens = hit.map_or(0, |h| h.tokens);
        Ok(Prefill::Done(logits))
    }

    /// Samples `seq`'s next token from `logits` (`pos`: where it would be
    /// fed back), among the tokens its grammar allows, and reports it;
    /// true when the sequence ended with it. A grammar that cannot go on
    /// ends the sequence with its error; a sampled token the grammar
    /// refuses is a fatal fault (the sampler ignored the mask).
    fn emit(
        &mut self,
        seq: &mut Seq,
        logits: &[f32],
        pos: usize,
        events: &mut Vec<SeqEvent>,
    ) -> Result<bool, EngineError> {
        #[cfg(test)]
        if let Some(log) = &mut self.logits_log {
            log.push((seq.id, logits.to_vec()));
        }
        let mask = match seq.constraint.as_mut().map(Constraint::mask).transpose() {
            Ok(m) => m.flatten(),
            Err(e) => {
                done(seq, Err(EngineError::InvalidRequest(e.to_string())), events);
                return Ok(true);
            }
        };
        #[cfg(any(test, feature = "fault-injection"))]
        let mask = mask.filter(|_| self.fault != super::Fault::IgnoreMask);
        let token = seq
            .sampler
            .sample_masked(&logits[..self.sampleable], mask.as_ref());
        if let Some(c) = seq.constraint.as_mut() {
            c.commit(token).map_err(|e| {
                EngineError::Backend(format!("the sampler ignored the grammar's mask: {e}"))
            })?;
        }
        seq.first_token.get_or_insert_with(Instant::now);
        seq.stats.generated_tokens += 1;
        events.push(SeqEvent::Token { seq: seq.id, token });
        Ok(
            match finish_after_token(token, &seq.req, seq.stats.generated_tokens, self.context) {
                Some(finish) => {
                    done(seq, Ok(seq.outcome(finish)), events);
                    true
                }
                None => {
                    seq.state = State::Decoding { token, pos };
                    false
                }
            },
        )
    }

    /// One step of `seqs` (taken out of `self` so a forward pass can borrow
    /// the engine and one sequence's KV together); ended sequences are
    /// removed. A fatal error is returned as it is.
    fn step_seqs(
        &mut self,
        seqs: &mut Vec<Seq>,
        events: &mut Vec<SeqEvent>,
    ) -> Result<(), EngineError> {
        // Cancelled sequences free their KV at once, wherever they are;
        // a request for no token ends without any work.
        seqs.retain(|s| {
            let finish = if s.req.max_new_tokens == 0 {
                FinishReason::Length
            } else if s.req.cancel.is_cancelled() {
                FinishReason::Cancelled
            } else {
                return true;
            };
            done(s, Ok(s.outcome(finish)), events);
            false
        });
        let decoding: Vec<SeqId> = (seqs.iter())
            .filter(|s| matches!(s.state, State::Decoding { .. }))
            .map(|s| s.id)
            .collect();
        let mut ended: Vec<SeqId> = Vec::new();
        if let Some(seq) = seqs
            .iter_mut()
            .find(|s| !matches!(s.state, State::Decoding { .. }))
        {
            let end = match self.prefill_step(seq) {
                Ok(Prefill::Running) => false,
                Ok(Prefill::Done(logits)) => {
                    let pos = seq.req.prompt.len();
                    self.emit(seq, &logits, pos, events)?
                }
                Ok(Prefill::Cancelled) => {
                    done(seq, Ok(seq.outcome(FinishReason::Cancelled)), events);
                    true
                }
                Err(e) => fail(seq, e, events)?,
            };
            if end {
                ended.push(seq.id);
            }
        }
        for seq in seqs.iter_mut().filter(|s| decoding.contains(&s.id)) {
            let State::Decoding { token, pos } = seq.state else {
                unreachable!("a decoding sequence stays decoding until it ends")
            };
            let end = match self.last_logits(&mut seq.kv, &[token], pos) {
                Ok(logits) => self.emit(seq, &logits, pos + 1, events)?,
                Err(e) => fail(seq, e, events)?,
            };
            if end {
                ended.push(seq.id);
            }
        }
        seqs.retain(|s| !ended.contains(&s.id));
        Ok(())
    }
}

fn done(seq: &Seq, result: Result<GenerateOutcome, EngineError>, events: &mut Vec<SeqEvent>) {
    events.push(SeqEvent::Done {
        seq: seq.id,
        result,
    });
}

/// A failed forward pass of `seq`: a fatal error is the engine's (returned
/// as it is); any other ends this sequence alone (true).
fn fail(seq: &Seq, e: EngineError, events: &mut Vec<SeqEvent>) -> Result<bool, EngineError> {
    if e.is_fatal() {
        return Err(e);
    }
    done(seq, Err(e), events);
    Ok(true)
}

impl Batch for ReferenceEngine {
    fn capacity(&self) -> usize {
        BATCH_CAPACITY
    }

    fn admit(&mut self, req: GenerateRequest) -> Result<Admission, EngineError> {
        // The context must also hold the first generated token.
        self.check_tokens(&req.prompt, self.context - 1)?;
        crate::batch::check_constraint(&req)?;
        let tokens = match req.max_new_tokens {
            0 => 0,
            n => (req.prompt.len() + n).min(self.context),
        };
        if tokens > self.kv_tokens {
            return Err(EngineError::InvalidRequest(format!(
                "the request needs {tokens} KV tokens ({} prompt + {} new, within the context of \
                 {}) but the engine's KV budget is {} tokens; ask for fewer new tokens",
                req.prompt.len(),
                req.max_new_tokens,
                self.context,
                self.kv_tokens
            )));
        }
        if self.seqs.len() >= BATCH_CAPACITY || self.kv_reserved() + tokens > self.kv_tokens {
            return Ok(Admission::Wait);
        }
        let id = SeqId(self.next_seq);
        self.next_seq += 1;
        let kv = self.new_kv(tokens);
        self.seqs.push(Seq::new(id, req, kv));
        Ok(Admission::Admitted(id))
    }

    fn step(&mut self, events: &mut Vec<SeqEvent>) -> Result<(), EngineError> {
        let mut seqs = std::mem::take(&mut self.seqs);
        // After a fatal error every sequence is lost (the contract): they
        // are dropped with `seqs`.
        self.step_seqs(&mut seqs, events)?;
        self.seqs = seqs;
        Ok(())
    }

    fn end(&mut self, seq: SeqId) -> Option<GenerateOutcome> {
        let i = self.seqs.iter().position(|s| s.id == seq)?;
        let s = self.seqs.remove(i);
        Some(s.outcome(FinishReason::Cancelled))
    }

    fn active(&self) -> usize {
        self.seqs.len()
    }

    fn kv_usage(&self) -> KvUsage {
        KvUsage {
            used_tokens: self.kv_reserved(),
            total_tokens: self.kv_tokens,
        }
    }
}
