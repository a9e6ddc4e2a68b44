//! What `/v1/stats` reports: counters, the last finished run, the running
//! jobs' live figures ([`crate::live`]), the engine's KV use and the
//! request log ([`crate::requests`]). The launcher polls it several times
//! a second, so a snapshot takes each lock only long enough to clone a few
//! small values, and the engine thread takes them only when a job starts
//! or ends (and, for the KV figures, once per engine step).

use crate::live::Running;
use crate::requests::RequestLog;
use krasis_common::status::{Activity, EngineStats, KvStats};
use krasis_model::{GenerateStats, KvUsage};
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
    /// The jobs the engine is running, oldest first.
    running: Mutex<Vec<Arc<Running>>>,
    /// The engine's KV use, when it batches.
    kv: Mutex<Option<KvUsage>>,
    /// The most jobs the engine runs together.
    parallel: AtomicU64,
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

    /// The engine thread starts a job.
    pub fn add_running(&self, running: Arc<Running>) {
        lock(&self.running).push(running);
    }

    /// The engine thread ends the job of this id.
    pub fn remove_running(&self, id: u64) {
        lock(&self.running).retain(|r| r.info.id != id);
    }

    /// The engine's KV use after its last change.
    pub fn set_kv(&self, kv: KvUsage) {
        *lock(&self.kv) = Some(kv);
    }

    pub fn set_parallel(&self, n: usize) {
        self.parallel.store(n as u64, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> EngineStats {
        let now = Instant::now();
        let last = lock(&self.last).clone();
        let running = lock(&self.running).clone();
        let mut s = last.engine.unwrap_or_default();
        s.running = running.iter().map(|r| r.snapshot(now)).collect();
        s.active_sequences = s.running.len() as u64;
        s.activity = if s.running.iter().any(|r| r.activity == Activity::Prefilling) {
            Activity::Prefilling
        } else if s.running.is_empty() {
            Activity::Idle
        } else {
            Activity::Decoding
        };
        // The engine's figures so far in the latest running request that
        // published any replace those of the last finished one; what it
        // has not published yet stays.
        if let Some(e) = running.iter().rev().find_map(|r| r.progress.engine()) {
            s.hcs = e.hcs.or(s.hcs);
            s.vram = e.vram.or(s.vram);
            s.pinned_host_bytes = e.pinned_host_bytes.or(s.pinned_host_bytes);
        }
        s.parallel = self.parallel.load(Ordering::Relaxed);
        s.kv = lock(&self.kv).map(|k| KvStats {
            used_tokens: k.used_tokens as u64,
            total_tokens: k.total_tokens as u64,
        });
        (s.recent_requests, s.last_ttft_ms) = self.log.recent();
        s.requests_completed = self.completed.load(Ordering::Relaxed);
        s.requests_cancelled = self.cancelled.load(Ordering::Relaxed);
        s.requests_rejected = self.rejected.load(Ordering::Relaxed);
        s.tool_call_errors = self.log.tool_call_errors();
        s.queue_len = self.queued.load(Ordering::Relaxed);
        s.last_prompt_tokens = last.stats.prompt_tokens as u64;
        s.last_generated_tokens = last.stats.generated_tokens as u64;
        s.last_prefill_tok_s = last.stats.prefill_tok_s();
        s.last_decode_tok_s = last.stats.decode_tok_s();
        s
    }
}
