//! The engine thread. The engine is `Send` but not `Sync`, so it lives on
//! one dedicated thread that takes jobs from a FIFO queue. An engine with a
//! batch interface runs up to `parallel` jobs together through the
//! scheduler in `batch.rs` (admission order, KV waits, one engine step at a
//! time); one without runs one job at a time through `Engine::generate`
//! (`thread.rs`). Either way each job's tokens go through its own
//! `stream.rs` on this thread (incremental detokenization, stop strings,
//! the client's disconnect), so a matched stop string or a vanished client
//! ends that job's sequence at the very next token; the job's cancel flag
//! is also the engine's [`CancelToken`], so a cancel reaches a running
//! prefill at its next chunk.
//!
//! Admission comes first: a request [`Worker::reserve`]s a [`Slot`] before
//! its body is read, rendered or tokenized, and holds it until its job has
//! run, so at most `queue_depth + parallel` requests are admitted (up to
//! `parallel` running, the rest waiting or being prepared) and a full
//! server answers 503 without doing any work. A job waiting for the
//! engine's KV stays in the queue; it never fails for memory.
//!
//! The thread stops for good on [`Worker::stop`] (shutdown: the running
//! jobs are cancelled, queued ones fail at once) or after a fault: a panic
//! or an [`EngineError::is_fatal`] error leaves the engine in an unknown
//! state, so it is never given another job. The running jobs get the
//! error, the queued ones fail, and the fault is reported to whoever
//! spawned the worker.
//!
//! While jobs run the thread publishes them ([`crate::live::Running`]) for
//! `/v1/stats`, and every queued job, however it ends, leaves one
//! [`Report`] for the request log, sent with its `Done`.

mod batch;
mod stream;
mod thread;

use crate::live::{JobInfo, Origin};
use crate::requests::Report;
use crate::stats::SharedStats;
use krasis_model::tokenizer::Tokenizer;
use krasis_model::{CancelToken, Engine, EngineError, GenerateRequest};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
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
    /// Prompt tokens served from the engine's prefix cache.
    pub cached_tokens: usize,
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

/// What a job sends back, in order: text pieces, then exactly one `Done`
/// with the job's [`Report`], which enters the request log when dropped
/// (after the response side has set the finish reason its client got).
#[derive(Debug)]
pub enum StreamMsg {
    Text(String),
    Done(Result<Finished, GenError>, Report),
}

/// One queued generation. `request.cancel` is set from `cancel` on submit.
pub struct Job {
    pub request: GenerateRequest,
    pub stop_strings: Vec<String>,
    pub events: UnboundedSender<StreamMsg>,
    pub cancel: Arc<AtomicBool>,
    /// The admission this job holds; released just before its `Done`.
    pub slot: Slot,
    pub origin: Origin,
    /// Decode special tokens into the text instead of dropping them: harmony's
    /// message markers (`<|channel|>`, `<|message|>`, …) are special tokens,
    /// and its output parser needs them.
    pub keep_special_tokens: bool,
}

/// A job in the queue, with the facts fixed when it was queued.
struct Queued {
    job: Job,
    info: JobInfo,
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
    Job(Box<Queued>),
    /// Wakes the thread after [`Worker::stop`].
    Stop,
}

struct Control {
    /// Requests that may be admitted at once (`queue_depth + parallel`).
    limit: usize,
    admitted: AtomicUsize,
    state: Mutex<ControlState>,
    /// Becomes true when the thread has stopped taking jobs.
    stopped: watch::Sender<bool>,
}

#[derive(Default)]
struct ControlState {
    halt: Option<Halt>,
    /// Cancel flags of the jobs the engine is running.
    current: Vec<Arc<AtomicBool>>,
}

impl Control {
    fn lock(&self) -> MutexGuard<'_, ControlState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One admitted request. Dropping it frees the place for another.
pub struct Slot {
    control: Arc<Control>,
    /// The request's arrival, as time to first token counts it.
    admitted_at: Instant,
}

impl Slot {
    pub fn admitted_at(&self) -> Instant {
        self.admitted_at
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.control.admitted.fetch_sub(1, Ordering::AcqRel);
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

/// The sequences to run together on `engine`: `asked` (the `--parallel`
/// option), by default the engine's batch capacity; 1 for an engine
/// without a batch interface. More than the engine can run, or 0, is
/// refused with the reason.
pub fn parallel_for(engine: &mut dyn Engine, asked: Option<usize>) -> Result<usize, String> {
    let capacity = engine.batch().map(|b| b.capacity());
    match (asked, capacity) {
        (Some(0), _) => Err("--parallel 0: at least one request must run".into()),
        (None, Some(c)) => Ok(c.max(1)),
        (None, None) => Ok(1),
        (Some(n), Some(c)) if n > c => Err(format!(
            "--parallel {n}: this engine runs at most {c} sequences together; pass at most {c}"
        )),
        (Some(n), None) if n > 1 => Err(format!(
            "--parallel {n}: the {} engine runs one request at a time (it has no batching);              pass 1 or leave it out",
            engine.info().backend
        )),
        (Some(n), _) => Ok(n),
    }
}

impl Worker {
    /// Starts the engine thread; up to `parallel` jobs run together (see
    /// [`parallel_for`]).
    pub fn spawn(
        engine: Box<dyn Engine>,
        tokenizer: Arc<Tokenizer>,
        queue_depth: usize,
        parallel: usize,
        stats: Arc<SharedStats>,
        on_fault: FaultHook,
    ) -> std::io::Result<Worker> {
        let (tx, rx) = channel::<Msg>();
        stats.set_parallel(parallel);
        let control = Arc::new(Control {
            limit: queue_depth + parallel,
            admitted: AtomicUsize::new(0),
            state: Mutex::new(ControlState::default()),
            stopped: watch::Sender::new(false),
        });
        let thread_stats = stats.clone();
        let thread_control = control.clone();
        std::thread::Builder::new()
            .name("krasis-engine".into())
            .spawn(move || {
                thread::engine_thread(
                    engine,
                    &tokenizer,
                    rx,
                    thread_stats,
                    &thread_control,
                    parallel,
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
    /// already wait besides the running ones, or when the engine has stopped.
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
                Ok(_) => {
                    return Ok(Slot {
                        control: c.clone(),
                        admitted_at: Instant::now(),
                    });
                }
                Err(now) => n = now,
            }
        }
    }

    /// Queues an admitted job and returns its id. The job's cancel flag
    /// becomes its request's cancel token, so the engine sees it during
    /// prefill too.
    pub fn submit(&self, mut job: Job) -> Result<u64, SubmitError> {
        job.request.cancel = CancelToken::new(job.cancel.clone());
        // Under the lock, so a job is either refused here or seen (and
        // failed) by the thread when it stops: none is left in the channel.
        let state = self.control.lock();
        if let Some(h) = &state.halt {
            return Err(SubmitError::Halted(h.clone()));
        }
        let info = JobInfo {
            id: self.stats.next_id(),
            endpoint: job.origin.endpoint,
            client: job.origin.client,
            arrived: job.slot.admitted_at(),
            prompt_tokens: job.request.prompt.len() as u64,
            max_tokens: job.request.max_new_tokens as u64,
        };
        let id = info.id;
        self.stats.queued.fetch_add(1, Ordering::Relaxed);
        if self
            .tx
            .send(Msg::Job(Box::new(Queued { job, info })))
            .is_err()
        {
            self.stats.queued.fetch_sub(1, Ordering::Relaxed);
            return Err(SubmitError::EngineGone);
        }
        Ok(id)
    }

    /// Stops the engine thread for shutdown: the running jobs are cancelled
    /// (at their next prefill chunk or token) and end with
    /// [`Halt::Shutdown`], queued jobs fail at once, and nothing new is
    /// accepted. Returns at once; [`Worker::stopped`] waits for the thread.
    pub fn stop(&self) {
        let mut state = self.control.lock();
        if state.halt.is_none() {
            state.halt = Some(Halt::Shutdown);
        }
        for c in &state.current {
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
