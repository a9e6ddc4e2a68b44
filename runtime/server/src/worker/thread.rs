//! The engine thread's loop: one job at a time, each published for
//! `/v1/stats` while it runs and reported to the request log when it ends.

use super::{Control, FaultHook, Finish, Finished, GenError, Halt, Job, Msg, Queued, StreamMsg};
use crate::live::Running;
use crate::output::stop::{StopMatcher, StopStep};
use crate::requests::{Outcome, Report};
use crate::stats::SharedStats;
use krasis_model::tokenizer::Tokenizer;
use krasis_model::{Engine, FinishReason, GenerateStats};
use std::ops::ControlFlow;
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
    on_fault: FaultHook,
) {
    if let Ok(mut last) = stats.last.lock() {
        last.engine = catch_unwind(AssertUnwindSafe(|| engine.stats())).unwrap_or(None);
    }
    let mut fault = None;
    let halted = loop {
        let queued = match rx.recv() {
            Ok(Msg::Job(q)) => *q,
            Ok(Msg::Stop) => break true,
            // Every handle is gone: nobody can send more.
            Err(_) => break false,
        };
        stats.queued.fetch_sub(1, Ordering::Relaxed);
        {
            let mut state = control.lock();
            if let Some(h) = &state.halt {
                fail(queued, h, &stats);
                continue;
            }
            state.current = Some(queued.job.cancel.clone());
        }
        let reason = run_job(engine.as_mut(), tokenizer, queued, &stats, control);
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
            if let Msg::Job(q) = msg {
                stats.queued.fetch_sub(1, Ordering::Relaxed);
                fail(*q, &halt, &stats);
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

/// Answers a job that will not run because the engine stopped.
fn fail(queued: Queued, halt: &Halt, stats: &Arc<SharedStats>) {
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
    queued: Queued,
    stats: &Arc<SharedStats>,
    control: &Control,
) -> Option<String> {
    let Queued { job, info } = queued;
    // A client that left while its request waited costs nothing.
    if job.cancel.load(Ordering::Relaxed) || job.events.is_closed() {
        stats.cancelled.fetch_add(1, Ordering::Relaxed);
        let outcome = Outcome {
            finish_reason: "cancelled",
            ..Outcome::default()
        };
        drop(Report::new(stats.log.clone(), &info, outcome));
        return None;
    }
    let running = Arc::new(Running::new(info, job.request.live.clone()));
    stats.set_running(Some(running.clone()));
    let result = catch_unwind(AssertUnwindSafe(|| {
        generate(engine, tokenizer, &job, &running)
    }))
    .unwrap_or_else(|p| Err(GenError::Panic(panic_message(p.as_ref()))));
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
    stats.set_running(None);
    let report = Report::new(stats.log.clone(), &running.info, outcome);
    let Job { events, slot, .. } = job;
    // Free the place before answering, so a client that sends its next
    // request as soon as this one ends is not refused.
    drop(slot);
    // Undeliverable (the client is gone): the report is logged as it is.
    let _ = events.send(StreamMsg::Done(result, report));
    fault
}

fn generate(
    engine: &mut dyn Engine,
    tokenizer: &Tokenizer,
    job: &Job,
    running: &Running,
) -> Result<(Finished, GenerateStats), GenError> {
    let mut decoder = tokenizer.incremental_with(!job.keep_special_tokens);
    let mut stop = StopMatcher::new(job.stop_strings.clone());
    let mut completion_tokens = 0usize;
    let mut stopped_by_string = false;
    let mut client_gone = false;
    let mut decode_error = None;
    let send = |text: String| -> bool {
        text.is_empty() || job.events.send(StreamMsg::Text(text)).is_ok()
    };

    let outcome = engine.generate(&job.request, &mut |id| {
        running.on_token();
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
            cached_tokens: outcome.stats.cached_tokens,
            completion_tokens,
        },
        outcome.stats,
    ))
}
