//! Structured progress events. With `--progress-json` the runtime writes one
//! JSON object per line to stdout while it loads, builds caches, calibrates and
//! serves; the launcher's supervisor parses them to drive its run screen.
//! Human-readable logs go to stderr.

use serde::{Deserialize, Serialize};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ProgressEvent {
    /// Entering a startup phase (`loading`, `building_cache`, `calibrating`, ...).
    Phase { phase: String, detail: String },
    /// Progress inside a long step (cache build, weight upload). With
    /// `unit: "bytes"` the runtime sends at most one per
    /// [`PROGRESS_INTERVAL`] per task, `done` never decreases, the first
    /// has `done: 0` and the last `done == total`; rates and ETAs are the
    /// reader's to compute from when the events arrive. `task` is one of
    /// [`task`]'s names.
    Progress {
        task: String,
        done: u64,
        total: u64,
        unit: String,
    },
    /// What calibration decided for the GPU expert cache.
    HcsDecision {
        resident_experts: u64,
        total_experts: u64,
        bytes: u64,
        safety_margin_bytes: u64,
    },
    /// The server accepts requests at this URL.
    Ready { url: String, model: String },
    /// A log line worth showing in the launcher.
    Log { level: String, message: String },
    /// Startup failed; the process exits after this.
    Fatal { message: String },
}

impl ProgressEvent {
    pub fn to_line(&self) -> String {
        serde_json::to_string(self).expect("progress events always serialize")
    }
    /// Parse one stdout line; `None` for lines that are not events.
    pub fn parse_line(line: &str) -> Option<Self> {
        let t = line.trim();
        if !t.starts_with('{') {
            return None;
        }
        serde_json::from_str(t).ok()
    }
}

/// The `task` of the runtime's byte-progress events (shown as labels).
pub mod task {
    /// Quantizing the checkpoint's routed experts into the INT4 cache.
    pub const BUILD_EXPERT_CACHE: &str = "building the expert cache";
    /// Non-expert weights from the checkpoint into the engine (converted,
    /// and on the cuda backend uploaded or mapped).
    pub const LOAD_WEIGHTS: &str = "loading weights";
    /// The INT4 expert cache into page-locked host memory (HCS backing).
    pub const PIN_EXPERTS: &str = "pinning the expert cache";
    /// INT4 experts from the cache into VRAM (every expert, or the HCS
    /// resident tier).
    pub const UPLOAD_EXPERTS: &str = "uploading experts";
}

/// The shortest time between two byte-progress events of one task (at most
/// 10 a second: enough for a smooth bar, negligible on stdout).
pub const PROGRESS_INTERVAL: Duration = Duration::from_millis(100);

/// Where a long step sends its events (the runtime prints them as JSON
/// lines with `--progress-json`, and drops them otherwise).
pub type EventSink<'a> = &'a (dyn Fn(ProgressEvent) + Sync);

/// The byte progress of one task, shared by the threads doing it: each
/// adds what it finished with [`ByteProgress::add`], and events go to the
/// sink throttled to one per [`PROGRESS_INTERVAL`], never decreasing, from
/// `done: 0` at the start to `done == total` at [`ByteProgress::finish`].
pub struct ByteProgress<'a> {
    sink: EventSink<'a>,
    task: &'static str,
    total: u64,
    done: AtomicU64,
    /// When the last event went out; held while one is sent, so events
    /// leave in the order of the counts they carry.
    last: Mutex<Instant>,
}

impl<'a> ByteProgress<'a> {
    /// Starts `task` of `total` bytes: sends `done: 0` now.
    pub fn start(sink: EventSink<'a>, task: &'static str, total: u64) -> Self {
        let p = ByteProgress {
            sink,
            task,
            total,
            done: AtomicU64::new(0),
            last: Mutex::new(Instant::now()),
        };
        p.send(0);
        p
    }

    /// `bytes` more are done; sends an event when the last one is at least
    /// [`PROGRESS_INTERVAL`] old (and no other thread is sending one).
    pub fn add(&self, bytes: u64) {
        self.done.fetch_add(bytes, Ordering::Relaxed);
        let Ok(mut last) = self.last.try_lock() else {
            return;
        };
        if last.elapsed() >= PROGRESS_INTERVAL {
            // Read under the lock: a later event never carries less.
            self.send(self.done.load(Ordering::Relaxed));
            *last = Instant::now();
        }
    }

    pub fn total(&self) -> u64 {
        self.total
    }

    /// Bytes added so far (may pass `total` when the caller's total was
    /// wrong; events never show more than `total`).
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// The task is complete: sends `done == total`.
    pub fn finish(self) {
        let _last = self.last.lock();
        self.send(self.total);
    }

    fn send(&self, done: u64) {
        (self.sink)(ProgressEvent::Progress {
            task: self.task.into(),
            done: done.min(self.total),
            total: self.total,
            unit: "bytes".into(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(run: impl FnOnce(EventSink<'_>)) -> Vec<(u64, u64)> {
        let seen = Mutex::new(Vec::new());
        let sink = |e: ProgressEvent| {
            if let ProgressEvent::Progress {
                done, total, unit, ..
            } = e
            {
                assert_eq!(unit, "bytes");
                seen.lock().unwrap().push((done, total));
            }
        };
        run(&sink);
        seen.into_inner().unwrap()
    }

    #[test]
    fn byte_progress_is_throttled_monotonic_and_ends_at_total() {
        let total = 8 * 1000 * 1000;
        let start = Instant::now();
        let seen = events(|sink| {
            let p = ByteProgress::start(sink, task::LOAD_WEIGHTS, total);
            // Eight threads adding 1 KB at a time for about 350 ms.
            std::thread::scope(|s| {
                for _ in 0..8 {
                    s.spawn(|| {
                        for _ in 0..1000 {
                            p.add(1000);
                            std::thread::sleep(Duration::from_micros(350));
                        }
                    });
                }
            });
            p.finish();
        });
        let secs = start.elapsed().as_secs_f64();
        assert_eq!(seen.first(), Some(&(0, total)), "{seen:?}");
        assert_eq!(seen.last(), Some(&(total, total)), "{seen:?}");
        assert!(seen.windows(2).all(|w| w[0].0 <= w[1].0), "{seen:?}");
        // Start, finish, and one per interval in between.
        let most = 2.0 + secs / PROGRESS_INTERVAL.as_secs_f64();
        assert!(seen.len() >= 3, "{seen:?}");
        assert!(
            seen.len() as f64 <= most + 1.0,
            "{} in {secs:.2} s",
            seen.len()
        );
    }

    #[test]
    fn done_never_exceeds_total() {
        let seen = events(|sink| {
            let p = ByteProgress::start(sink, task::PIN_EXPERTS, 10);
            std::thread::sleep(PROGRESS_INTERVAL);
            p.add(25);
            p.finish();
        });
        assert_eq!(seen, vec![(0, 10), (10, 10), (10, 10)]);
    }
}
