//! What `/v1/stats` reports: counters, the last finished run, the running
//! job's live figures ([`crate::live`]) and the request log
//! ([`crate::requests`]). The launcher polls it several times a second, so
//! a snapshot takes each lock only long enough to clone a few small values,
//! and the engine thread takes them only when a job starts or ends.

use crate::live::Running;
use crate::requests::RequestLog;
use krasis_common::status::{Activity, EngineStats};
use krasis_model::GenerateStats;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// Shared by the engine thread, the response side and the stats endpoint.
#[derive(Debug, Default)]
pub struct SharedStats {
    pub completed: AtomicU64,
    /// Ended early because the client went away.
    pub cancelled: AtomicU64,
    pub rejected: AtomicU64,
    /// Jobs waiting for the engine thread.
    pub queued: AtomicU64,
    pub last: Mutex<LastRun>,
    /// The job the engine is running.
    running: Mutex<Option<Arc<Running>>>,
    pub log: Arc<RequestLog>,
    /// The id of the last queued job (ids start at 1).
    last_id: AtomicU64,
}

#[derive(Debug, Default, Clone)]
pub struct LastRun {
    pub stats: GenerateStats,
    pub engine: Option<EngineStats>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl SharedStats {
    /// A new job id, increasing.
    pub fn next_id(&self) -> u64 {
        self.last_id.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The engine thread starts (`Some`) or ends (`None`) a job.
    pub fn set_running(&self, running: Option<Arc<Running>>) {
        *lock(&self.running) = running;
    }

    pub fn snapshot(&self) -> EngineStats {
        let now = Instant::now();
        let last = lock(&self.last).clone();
        let running = lock(&self.running).clone();
        let mut s = last.engine.unwrap_or_default();
        if let Some(r) = &running {
            let (activity, current) = r.snapshot(now);
            s.activity = activity;
            s.current = Some(current);
            s.active_sequences = 1;
            // The engine's figures so far in this request replace those of
            // the last one; what it has not published yet stays.
            if let Some(e) = r.progress.engine() {
                s.hcs = e.hcs.or(s.hcs);
                s.vram = e.vram.or(s.vram);
                s.pinned_host_bytes = e.pinned_host_bytes.or(s.pinned_host_bytes);
            }
        } else {
            s.activity = Activity::Idle;
            s.current = None;
            s.active_sequences = 0;
        }
        (s.recent_requests, s.last_ttft_ms) = self.log.recent();
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
