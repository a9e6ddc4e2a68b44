//! The engine thread: the loop that feeds the engine (the batching
//! scheduler in `batch.rs` when the engine has a batch interface, else one
//! job at a time here), and what every job goes through on either path:
//! skipped when its client left while it waited, published for
//! `/v1/stats` while it runs, and reported to the request log when it ends.

use super::stream::Stream;
use super::{Control, FaultHook, Finish, Finished, GenError, Halt, Job, Msg, Queued, StreamMsg};
use crate::live::Running;
use crate::requests::{Outcome, Report};
use crate::stats::SharedStats;
use krasis_model::tokenizer::Tokenizer;
use krasis_model::{Engine, GenerateStats};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;

pub(super) fn engine_thread(
    mut engine: Box<dyn Engine>,
    tokenizer: &Tokenizer,
    rx: Receiver<Msg>,
    stats: Arc<SharedStats>,
    control: &Control,
    parallel: usize,
    on_fault: FaultHook,
) {
    if let Ok(mut last) = stats.last.lock() {
        last.engine = catch_unwind(AssertUnwindSafe(|| engine.stats())).unwrap_or(None);
    }
    let (halted, fault) = if engine.batch().is_some() {
        super::batch::schedule(engine.as_mut(), tokenizer, &rx, &stats, control, parallel)
    } else {
        one_at_a_time(engine.as_mut(), tokenizer, &rx, &stats, control)
    };
    if let Some(reason) = &fault {
        tracing::error!("engine fault, the engine is retired: {reason}");
        control.lock().halt = Some(Halt::Fault(reason.clone()));
    }
    {
        // Answer everything still queued; `submit` refuses from now on.
        let state = control.lock();
        let halt = state.halt.clone().unwrap_or(Halt::Shutdown);
        while let Ok(msg) = rx.try_recv() {
            if let Msg::Job(q) = msg {
                stats.queued.fetch_sub(1, Ordering::Relaxed);
                fail(*q, &halt, &stats);
            }
        }
    }
    drop(rx);
    if let Some(reason) = fault {
        on_fault(reason);
    } else if halted {
        // A graceful stop: the prefix cache goes to its file, if it has one
        // (never after a fault: the engine's state is unknown then).
        save_prefix_cache(engine.as_mut());
    }
    control.stopped.send_replace(true);
    if halted {
        // The process is about to exit: a faulted engine's teardown could
        // fail or hang in the driver, and releasing gigabytes of pinned
        // memory takes seconds that a shutdown should not wait for.
        std::mem::forget(engine);
    }
}

/// Writes the engine's prefix cache file and logs what happened; a failure
/// (or a panic) is logged, and the previous file stays.
fn save_prefix_cache(engine: &mut dyn Engine) {
    match catch_unwind(AssertUnwindSafe(|| engine.save_prefix_cache())) {
        Ok(Ok(None)) => {}
        Ok(Ok(Some(s))) => tracing::info!(
            "prefix cache saved: {} blocks ({:.2} GiB) in {:.0} ms",
            s.blocks,
            s.bytes as f64 / (1u64 << 30) as f64,
            s.ms
        ),
        Ok(Err(e)) => {
            tracing::error!("the prefix cache was not saved (the previous file stays): {e}")
        }
        Err(_) => tracing::error!("saving the prefix cache panicked (the previous file stays)"),
    }
}

/// The loop for an engine without a batch interface: one job at a time
/// through [`Engine::generate`]. Returns whether it stopped for a halt
/// (not because every handle is gone) and the fault's reason, if any.
fn one_at_a_time(
    engine: &mut dyn Engine,
    tokenizer: &Tokenizer,
    rx: &Receiver<Msg>,
    stats: &Arc<SharedStats>,
    control: &Control,
) -> (bool, Option<String>) {
    loop {
        let queued = match rx.recv() {
            Ok(Msg::Job(q)) => *q,
            Ok(Msg::Stop) => return (true, None),
            // Every handle is gone: nobody can send more.
            Err(_) => return (false, None),
        };
        stats.queued.fetch_sub(1, Ordering::Relaxed);
        {
            let mut state = control.lock();
            if let Some(h) = &state.halt {
                fail(queued, h, stats);
                continue;
            }
            state.current.push(queued.job.cancel.clone());
        }
        let Some((job, running)) = start(queued, stats) else {
            control.lock().current.clear();
            continue;
        };
        let result = catch_unwind(AssertUnwindSafe(|| {
            let mut stream = Stream::new(tokenizer, &job);
            let outcome =
                engine.generate(&job.request, &mut |id| stream.on_token(id, &job, &running))?;
            stream.finish(&job, outcome)
        }))
        .unwrap_or_else(|p| Err(GenError::Panic(panic_message(p.as_ref()))));
        control.lock().current.clear();
        if let Some(reason) = complete(job, &running, result, Some(&*engine), stats, control) {
            return (true, Some(reason));
        }
    }
}

/// Answers a job that will not run because the engine stopped.
pub(super) fn fail(queued: Queued, halt: &Halt, stats: &Arc<SharedStats>) {
    let Queued { job, info } = queued;
    let Job { events, slot, .. } = job;
    drop(slot);
    let outcome = Outcome {
        finish_reason: match halt {
            Halt::Shutdown => "cancelled",
            Halt::Fault(_) => "error",
        },
        ..Outcome::default()
    };
    let report = Report::new(stats.log.clone(), &info, outcome);
    let _ = events.send(StreamMsg::Done(Err(GenError::Halted(halt.clone())), report));
}

pub(super) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".into())
}

/// Whether a queued job's client left (or the job was cancelled) while it
/// waited.
pub(super) fn gone(queued: &Queued) -> bool {
    queued.job.cancel.load(Ordering::Relaxed) || queued.job.events.is_closed()
}

/// Starts a queued job: published as running for `/v1/stats`. A job
/// whose client left while it waited costs nothing: it is logged as
/// cancelled and `None` is returned.
pub(super) fn start(queued: Queued, stats: &Arc<SharedStats>) -> Option<(Job, Arc<Running>)> {
    if gone(&queued) {
        skip(queued, stats);
        return None;
    }
    let Queued { job, info } = queued;
    let running = Arc::new(Running::new(info, job.request.live.clone()));
    stats.add_running(running.clone());
    Some((job, running))
}

/// Logs a job that never ran because its client left.
pub(super) fn skip(queued: Queued, stats: &Arc<SharedStats>) {
    stats.cancelled.fetch_add(1, Ordering::Relaxed);
    let outcome = Outcome {
        finish_reason: "cancelled",
        ..Outcome::default()
    };
    drop(Report::new(stats.log.clone(), &queued.info, outcome));
}

/// Ends a started job with `result`: counters, the last run's figures
/// (with `engine`'s, when given), its report, the freed admission and its
/// `Done`. Returns the fault's reason when the engine must be retired.
pub(super) fn complete(
    job: Job,
    running: &Running,
    result: Result<(Finished, GenerateStats), GenError>,
    engine: Option<&dyn Engine>,
    stats: &Arc<SharedStats>,
    control: &Control,
) -> Option<String> {
    let mut fault = None;
    let mut outcome = Outcome {
        completion_tokens: running.generated(),
        ttft: running.ttft(),
        finish_reason: "error",
        ..Outcome::default()
    };
    let result = match result {
        Ok((fin, gen_stats)) => {
            // Cut short with nobody left to answer: the client went away
            // (a cut after enough tool calls still has its reader).
            if fin.finish == Finish::Cancelled && job.events.is_closed() {
                stats.cancelled.fetch_add(1, Ordering::Relaxed);
            } else {
                stats.completed.fetch_add(1, Ordering::Relaxed);
            }
            outcome.prefill_tok_s = gen_stats.prefill_tok_s();
            outcome.cached_tokens = gen_stats.cached_tokens as u64;
            outcome.decode_tok_s = gen_stats.decode_tok_s();
            // The response side names the reason its client got (tool
            // calls, or a stop after enough of them); these are the
            // engine's, kept when nobody is left to answer.
            outcome.finish_reason = match fin.finish {
                Finish::Stop => "stop",
                Finish::Length => "length",
                Finish::Cancelled => "cancelled",
            };
            let engine_stats =
                engine.and_then(|e| catch_unwind(AssertUnwindSafe(|| e.stats())).unwrap_or(None));
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
    stats.remove_running(running.info.id);
    let report = Report::new(stats.log.clone(), &running.info, outcome);
    let Job { events, slot, .. } = job;
    // Free the place before answering, so a client that sends its next
    // request as soon as this one ends is not refused.
    drop(slot);
    // Undeliverable (the client is gone): the report is logged as it is.
    let _ = events.send(StreamMsg::Done(result, report));
    fault
}
