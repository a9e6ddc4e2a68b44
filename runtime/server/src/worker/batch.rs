//! The batching scheduler: the engine thread's loop for an engine with a
//! batch interface ([`krasis_model::batch`]). Up to `parallel` jobs run
//! together; each turn it takes what arrived, admits queued jobs, runs one
//! engine step and routes every event to its job's [`Stream`].
//!
//! **Admission is FIFO.** Queued jobs are admitted in arrival order while
//! fewer than `parallel` run and the engine answers `Admitted`. When the
//! oldest one must wait for KV (`Admission::Wait`), nothing behind it is
//! admitted either, even a smaller request that would fit: a large
//! request is never overtaken forever. It waits at most until enough
//! running sequences end, and every running sequence ends (its token
//! budget is fixed at admission). A job whose client left, or that was
//! cancelled, while it waited is dropped from the queue at the next turn,
//! wherever it is, without running.
//!
//! **Stall bound.** A step runs at most one prefill chunk besides one
//! decode step of every running sequence (the engine's contract), so a
//! new prompt delays the running decodes by at most one chunk per token.
//!
//! **Ends.** A job's sequence ends in the engine (`Done`: stop token,
//! length, its cancel flag, a failure of its own), or from here when its
//! stream says so (stop string, client gone, a decode error): then
//! `Batch::end` frees it at once. A step that returns an error or panics
//! retires the engine: every running job fails with it, queued ones with
//! the fault. A shutdown cancels the running jobs (their flags), which
//! end at the next step, and fails the queued ones.

use super::stream::Stream;
use super::thread::{complete, fail, gone, panic_message, skip, start};
use super::{Control, GenError, Halt, Job, Msg, Queued};
use crate::live::Running;
use crate::stats::SharedStats;
use krasis_model::tokenizer::Tokenizer;
use krasis_model::{
    Admission, Batch, Engine, EngineError, FinishReason, GenerateOutcome, SeqEvent, SeqId,
};
use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};

/// A job whose sequence runs in the engine.
struct Active {
    seq: SeqId,
    job: Job,
    running: Arc<Running>,
    stream: Stream,
    /// Its stream ended it on a token that was also its last in the
    /// engine: the `Done` that follows is taken as `Cancelled`.
    broke: bool,
}

fn batch(engine: &mut dyn Engine) -> &mut dyn Batch {
    engine
        .batch()
        .expect("the scheduler runs only engines with a batch interface")
}

/// Runs jobs from `rx` through the engine's batch interface until a halt
/// with nothing left running, a fault, or every handle gone with nothing
/// left to do. Returns whether it stopped for a halt and the fault's
/// reason, if any; jobs still in `rx` are the caller's to answer.
pub(super) fn schedule(
    engine: &mut dyn Engine,
    tokenizer: &Tokenizer,
    rx: &Receiver<Msg>,
    stats: &Arc<SharedStats>,
    control: &Control,
    parallel: usize,
) -> (bool, Option<String>) {
    let mut s = Scheduler {
        waiting: VecDeque::new(),
        active: Vec::new(),
        stats,
        control,
        tokenizer,
        parallel,
    };
    stats.set_kv(batch(engine).kv_usage());
    let mut disconnected = false;
    loop {
        // Block only when there is nothing to do. A halt whose `Stop` was
        // taken while jobs ran is not waited for again: the engine thread
        // would sleep through the shutdown (and never save the prefix cache).
        if s.active.is_empty()
            && s.waiting.is_empty()
            && !disconnected
            && control.lock().halt.is_none()
        {
            match rx.recv() {
                Ok(Msg::Job(q)) => s.waiting.push_back(*q),
                Ok(Msg::Stop) => {}
                Err(_) => disconnected = true,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(Msg::Job(q)) => s.waiting.push_back(*q),
                Ok(Msg::Stop) => {}
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    disconnected = true;
                    break;
                }
            }
        }
        let halt = control.lock().halt.clone();
        s.drop_gone(halt.as_ref());
        if halt.is_none()
            && let Err(reason) = s.admit(engine)
        {
            return (true, Some(s.retire(reason)));
        }
        if s.active.is_empty() {
            if halt.is_some() {
                return (true, None);
            }
            if disconnected && s.waiting.is_empty() {
                return (false, None);
            }
            continue;
        }
        if let Err(reason) = s.step(engine) {
            return (true, Some(s.retire(reason)));
        }
    }
}

struct Scheduler<'a> {
    /// Jobs taken from the channel and not admitted yet, oldest first.
    waiting: VecDeque<Queued>,
    active: Vec<Active>,
    stats: &'a Arc<SharedStats>,
    control: &'a Control,
    tokenizer: &'a Tokenizer,
    parallel: usize,
}

impl Scheduler<'_> {
    /// Drops the waiting jobs whose client left; after a halt, fails every
    /// waiting job.
    fn drop_gone(&mut self, halt: Option<&Halt>) {
        let mut kept = VecDeque::with_capacity(self.waiting.len());
        for q in self.waiting.drain(..) {
            if let Some(h) = halt {
                self.stats.queued.fetch_sub(1, Ordering::Relaxed);
                fail(q, h, self.stats);
            } else if gone(&q) {
                self.stats.queued.fetch_sub(1, Ordering::Relaxed);
                skip(q, self.stats);
            } else {
                kept.push_back(q);
            }
        }
        self.waiting = kept;
    }

    /// Admits waiting jobs in order while there is room. `Err`: the engine
    /// faulted (the reason).
    fn admit(&mut self, engine: &mut dyn Engine) -> Result<(), String> {
        while self.active.len() < self.parallel
            && let Some(front) = self.waiting.front()
        {
            let req = front.job.request.clone();
            let admitted = catch_unwind(AssertUnwindSafe(|| batch(engine).admit(req)))
                .map_err(|p| format!("the engine panicked: {}", panic_message(p.as_ref())))?;
            let seq = match admitted {
                Ok(Admission::Admitted(seq)) => Some(seq),
                Ok(Admission::Wait) if !self.active.is_empty() => return Ok(()),
                // An idle engine that cannot take a request never will.
                Ok(Admission::Wait) => {
                    return Err(format!(
                        "the idle engine asked a request of {} prompt + {} new tokens to wait; \
                         it should have refused it",
                        front.job.request.prompt.len(),
                        front.job.request.max_new_tokens
                    ));
                }
                Err(e) => {
                    let q = self.pop_front();
                    if let Some((job, running)) = start(q, self.stats)
                        && let Some(reason) = complete(
                            job,
                            &running,
                            Err(e.into()),
                            Some(&*engine),
                            self.stats,
                            self.control,
                        )
                    {
                        return Err(reason);
                    }
                    None
                }
            };
            self.stats.set_kv(batch(engine).kv_usage());
            let Some(seq) = seq else { continue };
            let q = self.pop_front();
            // Registered under the lock `Worker::stop` takes: a stop from
            // now on cancels it; one that came just before fails it here.
            let halted = {
                let mut state = self.control.lock();
                state.current.push(q.job.cancel.clone());
                state.halt.clone()
            };
            if let Some(h) = halted {
                batch(engine).end(seq);
                self.forget_cancel(&q.job);
                fail(q, &h, self.stats);
                continue;
            }
            let flag = q.job.cancel.clone();
            match start(q, self.stats) {
                Some((job, running)) => self.active.push(Active {
                    seq,
                    stream: Stream::new(self.tokenizer, &job),
                    job,
                    running,
                    broke: false,
                }),
                // Gone since the sweep: its sequence ends at once.
                None => {
                    batch(engine).end(seq);
                    self.control
                        .lock()
                        .current
                        .retain(|c| !Arc::ptr_eq(c, &flag));
                }
            }
            self.stats.set_kv(batch(engine).kv_usage());
        }
        Ok(())
    }

    /// The job's cancel flag is no longer one [`super::Worker::stop`] must set.
    fn forget_cancel(&self, job: &Job) {
        self.control
            .lock()
            .current
            .retain(|c| !Arc::ptr_eq(c, &job.cancel));
    }

    fn pop_front(&mut self) -> Queued {
        self.stats.queued.fetch_sub(1, Ordering::Relaxed);
        self.waiting
            .pop_front()
            .expect("the front was just looked at")
    }

    /// One engine step and its events. `Err`: the engine faulted.
    fn step(&mut self, engine: &mut dyn Engine) -> Result<(), String> {
        let mut events = Vec::new();
        match catch_unwind(AssertUnwindSafe(|| batch(engine).step(&mut events))) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e.to_string()),
            Err(p) => {
                return Err(format!(
                    "the engine panicked: {}",
                    panic_message(p.as_ref())
                ));
            }
        }
        for ev in events {
            match ev {
                SeqEvent::Token { seq, token } => {
                    let Some(a) = self.active.iter_mut().find(|a| a.seq == seq) else {
                        continue;
                    };
                    if a.broke || a.stream.on_token(token, &a.job, &a.running).is_continue() {
                        continue;
                    }
                    match batch(engine).end(seq) {
                        Some(outcome) => self.finish(engine, seq, Ok(outcome))?,
                        None => a.broke = true,
                    }
                }
                SeqEvent::Done { seq, result } => self.finish(engine, seq, result)?,
            }
        }
        self.stats.set_kv(batch(engine).kv_usage());
        Ok(())
    }

    /// Completes the job of `seq` with the engine's `result`.
    fn finish(
        &mut self,
        engine: &mut dyn Engine,
        seq: SeqId,
        result: Result<GenerateOutcome, EngineError>,
    ) -> Result<(), String> {
        let Some(i) = self.active.iter().position(|a| a.seq == seq) else {
            return Ok(());
        };
        // The engine freed the sequence's KV before it reported the end:
        // `/v1/stats` says so before the client has its answer (a client
        // reading the stats right after must not see the KV still held).
        self.stats.set_kv(batch(engine).kv_usage());
        let a = self.active.swap_remove(i);
        let result = match result {
            Ok(o) if a.broke => Ok(GenerateOutcome {
                finish: FinishReason::Cancelled,
                ..o
            }),
            r => r,
        };
        let result = result
            .map_err(GenError::from)
            .and_then(|o| a.stream.finish(&a.job, o));
        self.forget_cancel(&a.job);
        match complete(
            a.job,
            &a.running,
            result,
            Some(&*engine),
            self.stats,
            self.control,
        ) {
            Some(reason) => Err(reason),
            None => Ok(()),
        }
    }

    /// The engine faulted: every running job fails with the reason (the
    /// waiting ones are failed by the caller with the halt). Returns it.
    fn retire(&mut self, reason: String) -> String {
        {
            let mut state = self.control.lock();
            state.halt = Some(Halt::Fault(reason.clone()));
            state.current.clear();
        }
        for a in self.active.drain(..) {
            // As a failing `generate` today: the engine's error, fatal.
            let err = GenError::Engine(EngineError::Backend(reason.clone()));
            complete(a.job, &a.running, Err(err), None, self.stats, self.control);
        }
        self.drop_gone(Some(&Halt::Fault(reason.clone())));
        reason
    }
}
