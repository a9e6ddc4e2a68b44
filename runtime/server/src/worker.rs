//! The engine thread. The engine is `Send` but not `Sync`, and runs one
//! sequence at a time, so it lives on one dedicated thread that takes jobs
//! from a bounded FIFO queue. Detokenization and stop-string matching run in
//! the per-token callback on this thread, so a matched stop string or a
//! vanished client ends generation at the very next token.

use crate::output::stop::{StopMatcher, StopStep};
use krasis_common::status::EngineStats;
use krasis_model::tokenizer::Tokenizer;
use krasis_model::{Engine, EngineError, FinishReason, GenerateRequest, GenerateStats};
use std::ops::ControlFlow;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc::UnboundedSender;

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// End-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
    /// The request side asked to stop (client gone, enough tool calls).
    Cancelled,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    pub finish: Finish,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum GenError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("the engine panicked: {0}")]
    Panic(String),
    #[error("detokenizing the output failed: {0}")]
    Decode(String),
}

/// What a job sends back, in order: text pieces, then exactly one `Done`.
#[derive(Debug)]
pub enum StreamMsg {
    Text(String),
    Done(Result<Finished, GenError>),
}

/// One queued generation.
pub struct Job {
    pub request: GenerateRequest,
    pub stop_strings: Vec<String>,
    pub events: UnboundedSender<StreamMsg>,
    pub cancel: Arc<AtomicBool>,
}

/// Counters shared by the engine thread and the stats endpoint.
#[derive(Debug, Default)]
pub struct SharedStats {
    pub completed: AtomicU64,
    pub rejected: AtomicU64,
    pub queued: AtomicU64,
    pub last: Mutex<LastRun>,
}

#[derive(Debug, Default, Clone)]
pub struct LastRun {
    pub stats: GenerateStats,
    pub engine: Option<EngineStats>,
}

impl SharedStats {
    pub fn snapshot(&self) -> EngineStats {
        let last = self.last.lock().map(|g| g.clone()).unwrap_or_default();
        let mut s = last.engine.unwrap_or_default();
        s.requests_completed = self.completed.load(Ordering::Relaxed);
        s.requests_rejected = self.rejected.load(Ordering::Relaxed);
        s.queue_len = self.queued.load(Ordering::Relaxed);
        s.last_prompt_tokens = last.stats.prompt_tokens as u64;
        s.last_generated_tokens = last.stats.generated_tokens as u64;
        s.last_prefill_tok_s = last.stats.prefill_tok_s();
        s.last_decode_tok_s = last.stats.decode_tok_s();
        s
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the request queue is full ({depth} requests waiting)")]
    QueueFull { depth: usize },
    #[error("the engine thread has stopped; restart the server")]
    EngineGone,
}

/// Handle to the engine thread. Dropping every handle ends the thread after
/// the jobs already queued.
#[derive(Clone)]
pub struct Worker {
    tx: SyncSender<Job>,
    depth: usize,
    stats: Arc<SharedStats>,
}

impl Worker {
    pub fn spawn(
        engine: Box<dyn Engine>,
        tokenizer: Arc<Tokenizer>,
        queue_depth: usize,
        stats: Arc<SharedStats>,
    ) -> std::io::Result<Worker> {
        let (tx, rx) = sync_channel::<Job>(queue_depth);
        let thread_stats = stats.clone();
        std::thread::Builder::new()
            .name("krasis-engine".into())
            .spawn(move || {
                let mut engine = engine;
                if let Ok(mut last) = thread_stats.last.lock() {
                    last.engine = engine.stats();
                }
                while let Ok(job) = rx.recv() {
                    thread_stats.queued.fetch_sub(1, Ordering::Relaxed);
                    run_job(engine.as_mut(), &tokenizer, job, &thread_stats);
                }
            })?;
        Ok(Worker {
            tx,
            depth: queue_depth,
            stats,
        })
    }

    /// Queues a job, or refuses at once when `queue_depth` jobs already wait.
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        self.stats.queued.fetch_add(1, Ordering::Relaxed);
        let err = match self.tx.try_send(job) {
            Ok(()) => return Ok(()),
            Err(TrySendError::Full(_)) => SubmitError::QueueFull { depth: self.depth },
            Err(TrySendError::Disconnected(_)) => SubmitError::EngineGone,
        };
        self.stats.queued.fetch_sub(1, Ordering::Relaxed);
        self.stats.rejected.fetch_add(1, Ordering::Relaxed);
        Err(err)
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".into())
}

fn run_job(engine: &mut dyn Engine, tokenizer: &Tokenizer, job: Job, stats: &SharedStats) {
    // A client that left while its request waited costs nothing.
    if job.cancel.load(Ordering::Relaxed) || job.events.is_closed() {
        return;
    }
    let result = catch_unwind(AssertUnwindSafe(|| generate(engine, tokenizer, &job)))
        .unwrap_or_else(|p| Err(GenError::Panic(panic_message(p.as_ref()))));
    match &result {
        Ok((_, gen_stats)) => {
            stats.completed.fetch_add(1, Ordering::Relaxed);
            let engine_stats = catch_unwind(AssertUnwindSafe(|| engine.stats())).unwrap_or(None);
            if let Ok(mut last) = stats.last.lock() {
                last.stats = gen_stats.clone();
                last.engine = engine_stats;
            }
        }
        Err(e) => tracing::error!("generation failed: {e}"),
    }
    let _ = job.events.send(StreamMsg::Done(result.map(|(f, _)| f)));
}

fn generate(
    engine: &mut dyn Engine,
    tokenizer: &Tokenizer,
    job: &Job,
) -> Result<(Finished, GenerateStats), GenError> {
    let mut decoder = tokenizer.incremental();
    let mut stop = StopMatcher::new(job.stop_strings.clone());
    let mut completion_tokens = 0usize;
    let mut stopped_by_string = false;
    let mut client_gone = false;
    let mut decode_error = None;
    let send = |text: String| -> bool {
        text.is_empty() || job.events.send(StreamMsg::Text(text)).is_ok()
    };

    let outcome = engine.generate(&job.request, &mut |id| {
        completion_tokens += 1;
        if job.request.stop_token_ids.contains(&id) {
            return ControlFlow::Continue(());
        }
        if job.cancel.load(Ordering::Relaxed) {
            return ControlFlow::Break(());
        }
        let text = match decoder.push(id) {
            Ok(t) => t,
            Err(e) => {
                decode_error = Some(e.to_string());
                return ControlFlow::Break(());
            }
        };
        match stop.push(&text) {
            StopStep::Emit(t) => {
                if !send(t) {
                    client_gone = true;
                    return ControlFlow::Break(());
                }
                ControlFlow::Continue(())
            }
            StopStep::Stopped(t) => {
                stopped_by_string = true;
                send(t);
                ControlFlow::Break(())
            }
        }
    })?;
    if let Some(e) = decode_error {
        return Err(GenError::Decode(e));
    }
    if !stopped_by_string && !client_gone {
        let tail = decoder
            .finish()
            .map_err(|e| GenError::Decode(e.to_string()))?;
        match stop.push(&tail) {
            StopStep::Emit(t) => {
                send(t);
                send(stop.finish());
            }
            StopStep::Stopped(t) => {
                stopped_by_string = true;
                send(t);
            }
        }
    }
    let finish = if stopped_by_string {
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
            completion_tokens,
        },
        outcome.stats,
    ))
}
