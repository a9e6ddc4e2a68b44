//! The engine thread. The engine is `Send` but not `Sync`, and runs one
//! sequence at a time, so it lives on one dedicated thread that takes jobs
//! from a FIFO queue. Detokenization and stop-string matching run in the
//! per-token callback on this thread, so a matched stop string or a vanished
//! client ends generation at the very next token; the job's cancel flag is
//! also the engine's [`CancelToken`], so a cancel reaches a running prefill
//! at its next chunk.
//!
//! Admission comes first: a request [`Worker::reserve`]s a [`Slot`] before
//! its body is read, rendered or tokenized, and holds it until its job has
//! run, so at most `queue_depth + 1` requests are admitted (one running,
//! the rest waiting or being prepared) and a full server answers 503
//! without doing any work.
//!
//! The thread stops for good on [`Worker::stop`] (shutdown: the running
//! job is cancelled, queued ones fail at once) or after a fault: a panic or
//! an [`EngineError::is_fatal`] error leaves the engine in an unknown state,
//! so it is never given another job. The failing job gets its error, the
//! queued ones fail, and the fault is reported to whoever spawned the worker.

use crate::output::stop::{StopMatcher, StopStep};
use krasis_common::status::EngineStats;
use krasis_model::tokenizer::Tokenizer;
use krasis_model::{
    CancelToken, Engine, EngineError, FinishReason, GenerateRequest, GenerateStats,
};
use std::ops::ControlFlow;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::watch;

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

/// Why the engine thread stopped taking jobs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Halt {
    /// The server is shutting down.
    Shutdown,
    /// The engine faulted (the reason); it is never used again.
    Fault(String),
}

#[derive(Debug, thiserror::Error)]
pub enum GenError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("the engine panicked: {0}")]
    Panic(String),
    #[error("detokenizing the output failed: {0}")]
    Decode(String),
    /// The job was cancelled or never ran because the engine thread stopped.
    #[error("{}", halt_message(.0))]
    Halted(Halt),
}

impl GenError {
    /// The engine must not run another job after this error.
    pub fn is_fatal(&self) -> bool {
        match self {
            GenError::Panic(_) => true,
            GenError::Engine(e) => e.is_fatal(),
            GenError::Decode(_) | GenError::Halted(_) => false,
        }
    }
}

pub fn halt_message(h: &Halt) -> String {
    match h {
        Halt::Shutdown => "the server is shutting down; the request was cancelled".into(),
        Halt::Fault(reason) => format!(
            "the engine failed ({reason}) and will not run more requests; the server is exiting so it can be restarted"
        ),
    }
}

/// What a job sends back, in order: text pieces, then exactly one `Done`.
#[derive(Debug)]
pub enum StreamMsg {
    Text(String),
    Done(Result<Finished, GenError>),
}

/// One queued generation. `request.cancel` is set from `cancel` on submit.
pub struct Job {
    pub request: GenerateRequest,
    pub stop_strings: Vec<String>,
    pub events: UnboundedSender<StreamMsg>,
    pub cancel: Arc<AtomicBool>,
    /// The admission this job holds; released just before its `Done`.
    pub slot: Slot,
}

/// Counters shared by the engine thread and the stats endpoint.
#[derive(Debug, Default)]
pub struct SharedStats {
    pub completed: AtomicU64,
    /// Ended early because the client went away.
    pub cancelled: AtomicU64,
    pub rejected: AtomicU64,
    /// Jobs waiting for the engine thread.
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
        s.requests_cancelled = self.cancelled.load(Ordering::Relaxed);
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
    #[error("{}", halt_message(.0))]
    Halted(Halt),
    #[error("the engine thread has stopped; restart the server")]
    EngineGone,
}

enum Msg {
    Job(Box<Job>),
    /// Wakes the thread after [`Worker::stop`].
    Stop,
}

struct Control {
    /// Requests that may be admitted at once (`queue_depth + 1`).
    limit: usize,
    admitted: AtomicUsize,
    state: Mutex<ControlState>,
    /// Becomes true when the thread has stopped taking jobs.
    stopped: watch::Sender<bool>,
}

#[derive(Default)]
struct ControlState {
    halt: Option<Halt>,
    /// Cancel flag of the job the engine is running.
    current: Option<Arc<AtomicBool>>,
}

impl Control {
    fn lock(&self) -> MutexGuard<'_, ControlState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One admitted request. Dropping it frees the place for another.
pub struct Slot(Arc<Control>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.admitted.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Called once, from the engine thread, with the reason of a fault.
pub type FaultHook = Box<dyn FnOnce(String) + Send>;

/// Handle to the engine thread. Dropping every handle ends the thread after
/// the jobs already queued.
#[derive(Clone)]
pub struct Worker {
    tx: Sender<Msg>,
    control: Arc<Control>,
    depth: usize,
    stats: Arc<SharedStats>,
}

impl Worker {
    pub fn spawn(
        engine: Box<dyn Engine>,
        tokenizer: Arc<Tokenizer>,
        queue_depth: usize,
        stats: Arc<SharedStats>,
        on_fault: FaultHook,
    ) -> std::io::Result<Worker> {
        let (tx, rx) = channel::<Msg>();
        let control = Arc::new(Control {
            limit: queue_depth + 1,
            admitted: AtomicUsize::new(0),
            state: Mutex::new(ControlState::default()),
            stopped: watch::Sender::new(false),
        });
        let thread_stats = stats.clone();
        let thread_control = control.clone();
        std::thread::Builder::new()
            .name("krasis-engine".into())
            .spawn(move || {
                engine_thread(
                    engine,
                    &tokenizer,
                    rx,
                    &thread_stats,
                    &thread_control,
                    on_fault,
                )
            })?;
        Ok(Worker {
            tx,
            control,
            depth: queue_depth,
            stats,
        })
    }

    /// Admits one request, or refuses at once when `queue_depth` requests
    /// already wait besides the running one, or when the engine has stopped.
    pub fn reserve(&self) -> Result<Slot, SubmitError> {
        if let Some(h) = &self.control.lock().halt {
            return Err(SubmitError::Halted(h.clone()));
        }
        let c = &self.control;
        let mut n = c.admitted.load(Ordering::Acquire);
        loop {
            if n >= c.limit {
                self.stats.rejected.fetch_add(1, Ordering::Relaxed);
                return Err(SubmitError::QueueFull { depth: self.depth });
            }
            match c
                .admitted
                .compare_exchange_weak(n, n + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Ok(Slot(c.clone())),
                Err(now) => n = now,
            }
        }
    }

    /// Queues an admitted job. The job's cancel flag becomes its request's
    /// cancel token, so the engine sees it during prefill too.
    pub fn submit(&self, mut job: Job) -> Result<(), SubmitError> {
        job.request.cancel = CancelToken::new(job.cancel.clone());
        // Under the lock, so a job is either refused here or seen (and
        // failed) by the thread when it stops: none is left in the channel.
        let state = self.control.lock();
        if let Some(h) = &state.halt {
            return Err(SubmitError::Halted(h.clone()));
        }
        self.stats.queued.fetch_add(1, Ordering::Relaxed);
        if self.tx.send(Msg::Job(Box::new(job))).is_err() {
            self.stats.queued.fetch_sub(1, Ordering::Relaxed);
            return Err(SubmitError::EngineGone);
        }
        Ok(())
    }

    /// Stops the engine thread for shutdown: the running job is cancelled
    /// (at its next prefill chunk or token) and ends with
    /// [`Halt::Shutdown`], queued jobs fail at once, and nothing new is
    /// accepted. Returns at once; [`Worker::stopped`] waits for the thread.
    pub fn stop(&self) {
        let mut state = self.control.lock();
        if state.halt.is_none() {
            state.halt = Some(Halt::Shutdown);
        }
        if let Some(c) = &state.current {
            c.store(true, Ordering::Relaxed);
        }
        drop(state);
        let _ = self.tx.send(Msg::Stop);
    }

    /// Resolves once the engine thread has stopped taking jobs (after
    /// [`Worker::stop`] or a fault) and every queued job has its answer.
    pub async fn stopped(&self) {
        let mut rx = self.control.stopped.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// Why the engine stopped, if it did.
    pub fn halt(&self) -> Option<Halt> {
        self.control.lock().halt.clone()
    }

    /// Requests admitted now (being prepared, queued or running).
    pub fn admitted(&self) -> usize {
        self.control.admitted.load(Ordering::Acquire)
    }
}

fn engine_thread(
    mut engine: Box<dyn Engine>,
    tokenizer: &Tokenizer,
    rx: Receiver<Msg>,
    stats: &SharedStats,
    control: &Control,
    on_fault: FaultHook,
) {
    if let Ok(mut last) = stats.last.lock() {
        last.engine = catch_unwind(AssertUnwindSafe(|| engine.stats())).unwrap_or(None);
    }
    let mut fault = None;
    let halted = loop {
        let job = match rx.recv() {
            Ok(Msg::Job(job)) => job,
            Ok(Msg::Stop) => break true,
            // Every handle is gone: nobody can send more.
            Err(_) => break false,
        };
        stats.queued.fetch_sub(1, Ordering::Relaxed);
        {
            let mut state = control.lock();
            if let Some(h) = &state.halt {
                fail(*job, h);
                continue;
            }
            state.current = Some(job.cancel.clone());
        }
        let reason = run_job(engine.as_mut(), tokenizer, *job, stats, control);
        control.lock().current = None;
        if let Some(reason) = reason {
            tracing::error!("engine fault, the engine is retired: {reason}");
            control.lock().halt = Some(Halt::Fault(reason.clone()));
            fault = Some(reason);
            break true;
        }
    };
    {
        // Answer everything still queued; `submit` refuses from now on.
        let state = control.lock();
        let halt = state.halt.clone().unwrap_or(Halt::Shutdown);
        while let Ok(msg) = rx.try_recv() {
            if let Msg::Job(job) = msg {
                stats.queued.fetch_sub(1, Ordering::Relaxed);
                fail(*job, &halt);
            }
        }
    }
    drop(rx);
    if let Some(reason) = fault {
        on_fault(reason);
    }
    control.stopped.send_replace(true);
    if halted {
        // The process is about to exit: a faulted engine's teardown could
        // fail or hang in the driver, and releasing gigabytes of pinned
        // memory takes seconds that a shutdown should not wait for.
        std::mem::forget(engine);
    }
}

fn fail(job: Job, halt: &Halt) {
    let Job { events, slot, .. } = job;
    drop(slot);
    let _ = events.send(StreamMsg::Done(Err(GenError::Halted(halt.clone()))));
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".into())
}

/// Runs one job and sends its `Done`. Returns the fault's reason when the
/// engine must be retired.
fn run_job(
    engine: &mut dyn Engine,
    tokenizer: &Tokenizer,
    job: Job,
    stats: &SharedStats,
    control: &Control,
) -> Option<String> {
    // A client that left while its request waited costs nothing.
    if job.cancel.load(Ordering::Relaxed) || job.events.is_closed() {
        stats.cancelled.fetch_add(1, Ordering::Relaxed);
        return None;
    }
    let result = catch_unwind(AssertUnwindSafe(|| generate(engine, tokenizer, &job)))
        .unwrap_or_else(|p| Err(GenError::Panic(panic_message(p.as_ref()))));
    let mut fault = None;
    let result = match result {
        Ok((fin, gen_stats)) => {
            // Cut short with nobody left to answer: the client went away
            // (a cut after enough tool calls still has its reader).
            if fin.finish == Finish::Cancelled && job.events.is_closed() {
                stats.cancelled.fetch_add(1, Ordering::Relaxed);
            } else {
                stats.completed.fetch_add(1, Ordering::Relaxed);
            }
            let engine_stats = catch_unwind(AssertUnwindSafe(|| engine.stats())).unwrap_or(None);
            if let Ok(mut last) = stats.last.lock() {
                last.stats = gen_stats;
                last.engine = engine_stats;
            }
            match control.lock().halt.clone() {
                // Cut short by the shutdown, not by its client or a stop.
                Some(h @ Halt::Shutdown) if fin.finish == Finish::Cancelled => {
                    Err(GenError::Halted(h))
                }
                _ => Ok(fin),
            }
        }
        Err(e) => {
            tracing::error!("generation failed: {e}");
            if e.is_fatal() {
                fault = Some(e.to_string());
            }
            Err(e)
        }
    };
    let Job { events, slot, .. } = job;
    // Free the place before answering, so a client that sends its next
    // request as soon as this one ends is not refused.
    drop(slot);
    let _ = events.send(StreamMsg::Done(result));
    fault
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
