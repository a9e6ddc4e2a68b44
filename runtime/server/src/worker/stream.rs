//! One job's output as the engine thread produces it, token by token:
//! incremental detokenization, stop strings, the client's disconnect and
//! the job's cancel flag, then the flush and the finish reason once the
//! engine has ended the sequence. The one-at-a-time path calls it from
//! `Engine::generate`'s callback, the batching scheduler from each of the
//! job's `Token` events; the rules are these, once.

use super::{Finish, Finished, GenError, Job, StreamMsg};
use crate::live::Running;
use crate::output::stop::{StopMatcher, StopStep};
use krasis_model::tokenizer::{IncrementalDecoder, Tokenizer};
use krasis_model::{FinishReason, GenerateOutcome, GenerateStats};
use std::ops::ControlFlow;
use std::sync::atomic::Ordering;

pub(super) struct Stream {
    decoder: IncrementalDecoder,
    stop: StopMatcher,
    completion_tokens: usize,
    stopped_by_string: bool,
    client_gone: bool,
    decode_error: Option<String>,
}

impl Stream {
    pub fn new(tokenizer: &Tokenizer, job: &Job) -> Self {
        Stream {
            decoder: tokenizer.incremental_with(!job.keep_special_tokens),
            stop: StopMatcher::new(job.stop_strings.clone()),
            completion_tokens: 0,
            stopped_by_string: false,
            client_gone: false,
            decode_error: None,
        }
    }

    /// One generated token of `job` (stop tokens included, as the usage
    /// counts them). `Break` ends the job's generation: a stop string
    /// matched, the client is gone, the job was cancelled, or its text
    /// could not be decoded.
    pub fn on_token(&mut self, id: u32, job: &Job, running: &Running) -> ControlFlow<()> {
        running.on_token();
        self.completion_tokens += 1;
        if job.request.stop_token_ids.contains(&id) {
            return ControlFlow::Continue(());
        }
        if job.cancel.load(Ordering::Relaxed) {
            return ControlFlow::Break(());
        }
        let text = match self.decoder.push(id) {
            Ok(t) => t,
            Err(e) => {
                self.decode_error = Some(e.to_string());
                return ControlFlow::Break(());
            }
        };
        match self.stop.push(&text) {
            StopStep::Emit(t) => {
                if !send(job, t) {
                    self.client_gone = true;
                    return ControlFlow::Break(());
                }
                ControlFlow::Continue(())
            }
            StopStep::Stopped(t) => {
                self.stopped_by_string = true;
                send(job, t);
                ControlFlow::Break(())
            }
        }
    }

    /// The engine ended the job's sequence with `outcome`: sends the text
    /// still held back and says how the job finished.
    pub fn finish(
        mut self,
        job: &Job,
        outcome: GenerateOutcome,
    ) -> Result<(Finished, GenerateStats), GenError> {
        if let Some(e) = self.decode_error {
            return Err(GenError::Decode(e));
        }
        if !self.stopped_by_string && !self.client_gone {
            let tail = self
                .decoder
                .finish()
                .map_err(|e| GenError::Decode(e.to_string()))?;
            match self.stop.push(&tail) {
                StopStep::Emit(t) => {
                    send(job, t);
                    send(job, self.stop.finish());
                }
                StopStep::Stopped(t) => {
                    self.stopped_by_string = true;
                    send(job, t);
                }
            }
        }
        let finish = if self.stopped_by_string {
            Finish::Stop
        } else {
            match outcome.finish {
                FinishReason::Stop => Finish::Stop,
                FinishReason::Length => Finish::Length,
                FinishReason::Cancelled => Finish::Cancelled,
            }
        };
        Ok((
            Finished {
                finish,
                prompt_tokens: job.request.prompt.len(),
                cached_tokens: outcome.stats.cached_tokens,
                completion_tokens: self.completion_tokens,
            },
            outcome.stats,
        ))
    }
}

/// Sends a text piece; false when the client is gone.
fn send(job: &Job, text: String) -> bool {
    text.is_empty() || job.events.send(StreamMsg::Text(text)).is_ok()
}
