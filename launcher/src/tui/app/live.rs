//! What the run screen remembers between runtime events and `/v1/stats`
//! polls: the progress of a long startup step with its rate and ETA, the
//! rate histories behind the sparklines, the request log, and where the log
//! pane is scrolled. Times come in as arguments, so tests are deterministic.

use krasis_common::{Activity, EngineStats, RequestRecord};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Rates are measured over the events of the last few seconds: long enough
/// to smooth bursty chunks, short enough to follow a change of speed.
const RATE_WINDOW: Duration = Duration::from_secs(5);

/// A long startup step (cache build, weight upload) as the runtime reports
/// it, with the rate the launcher measured from the events' arrival times.
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    pub task: String,
    pub done: u64,
    pub total: u64,
    pub unit: String,
    /// (arrival, done) of this task's recent events.
    samples: VecDeque<(Instant, u64)>,
}

impl Progress {
    /// `prev` updated by an event that arrived at `now`; a new task (or a
    /// count that went backwards, i.e. a restarted step) starts afresh.
    pub fn next(
        prev: Option<Progress>,
        task: String,
        done: u64,
        total: u64,
        unit: String,
        now: Instant,
    ) -> Progress {
        let mut samples = match prev {
            Some(p)
                if p.task == task
                    && p.unit == unit
                    && p.samples.back().is_some_and(|&(_, d)| d <= done) =>
            {
                p.samples
            }
            _ => VecDeque::new(),
        };
        samples.push_back((now, done));
        while samples.len() > 2
            && samples
                .front()
                .is_some_and(|&(t, _)| now.duration_since(t) > RATE_WINDOW)
        {
            samples.pop_front();
        }
        Progress {
            task,
            done,
            total,
            unit,
            samples,
        }
    }

    pub fn ratio(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            (self.done as f64 / self.total as f64).clamp(0.0, 1.0)
        }
    }

    /// Units per second over the recent events; `None` until two events
    /// some time apart have arrived.
    pub fn rate(&self) -> Option<f64> {
        let (&(t0, d0), &(t1, d1)) = (self.samples.front()?, self.samples.back()?);
        let dt = t1.duration_since(t0).as_secs_f64();
        (dt >= 0.1 && d1 > d0).then(|| (d1 - d0) as f64 / dt)
    }

    pub fn eta(&self) -> Option<Duration> {
        let rate = self.rate()?;
        let left = self.total.saturating_sub(self.done) as f64;
        Some(Duration::from_secs_f64(left / rate))
    }

    /// `cache build: 1.2 GiB / 3.4 GiB (35%)  210 MiB/s  ETA 11 s`.
    pub fn label(&self) -> String {
        use crate::units::{fmt_bytes, fmt_duration};
        let bytes = self.unit == "bytes";
        let amount = if bytes {
            format!("{} / {}", fmt_bytes(self.done), fmt_bytes(self.total))
        } else {
            format!("{}/{} {}", self.done, self.total, self.unit)
        };
        let mut s = format!(
            "{}: {amount} ({:.0}%)",
            self.task,
            (self.ratio() * 100.0).floor()
        );
        match self.rate() {
            Some(r) if bytes => s.push_str(&format!("  {}/s", fmt_bytes(r as u64))),
            Some(r) => s.push_str(&format!("  {r:.1} {}/s", self.unit)),
            None => s.push_str("  measuring rate ..."),
        }
        if let Some(eta) = self.eta() {
            s.push_str(&format!("  ETA {}", fmt_duration(eta)));
        }
        s
    }
}

/// Samples kept for the sparklines (about a minute at five polls a second;
/// a wide terminal shows what fits).
pub const HISTORY: usize = 300;
/// Finished requests kept in the launcher's request log.
pub const REQUEST_LOG: usize = 500;

/// What the launcher keeps from successive `/v1/stats` answers.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Live {
    /// Prefill and decode tok/s at each poll: the running request's rate
    /// while it is in that stage, 0 otherwise, so the sparklines show when
    /// the engine was busy as well as how fast.
    pub prefill_tok_s: VecDeque<f64>,
    pub decode_tok_s: VecDeque<f64>,
    /// Finished requests, oldest first, each once.
    pub requests: VecDeque<RequestRecord>,
    /// The newest request id logged from the current runtime process.
    last_id: Option<u64>,
}

fn push_capped<T>(q: &mut VecDeque<T>, v: T, cap: usize) {
    if q.len() == cap {
        q.pop_front();
    }
    q.push_back(v);
}

/// Prompt tokens per second being prefilled now: the prefilling running
/// requests' rates together (0 when none prefills).
pub fn prefilling_tok_s(s: &EngineStats) -> f64 {
    (s.running.iter())
        .filter(|r| r.activity == Activity::Prefilling)
        .map(|r| r.prefill_tok_s)
        .sum()
}

/// Tokens per second decoded now, by every decoding request together
/// (they share the engine's decode steps).
pub fn decoding_tok_s(s: &EngineStats) -> f64 {
    (s.running.iter())
        .filter(|r| r.activity == Activity::Decoding)
        .map(|r| r.decode_tok_s)
        .sum()
}

impl Live {
    pub fn observe(&mut self, s: &EngineStats) {
        push_capped(&mut self.prefill_tok_s, prefilling_tok_s(s), HISTORY);
        push_capped(&mut self.decode_tok_s, decoding_tok_s(s), HISTORY);
        // The runtime keeps its last 64 requests and every poll repeats
        // them; ids increase within one runtime process.
        for r in &s.recent_requests {
            if self.last_id.is_none_or(|last| r.id > last) {
                self.last_id = Some(r.id);
                push_capped(&mut self.requests, r.clone(), REQUEST_LOG);
            }
        }
    }

    /// A new runtime process numbers its requests from the start again.
    pub fn new_process(&mut self) {
        self.last_id = None;
    }
}

/// Where the log pane is: rows scrolled up from the newest (0 follows new
/// lines), columns scrolled right when not wrapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogView {
    pub up: usize,
    pub right: usize,
    pub wrap: bool,
}

impl Default for LogView {
    fn default() -> Self {
        LogView {
            up: 0,
            right: 0,
            wrap: true,
        }
    }
}

/// Rows a page scroll moves (the pane is rarely shorter).
pub const PAGE: usize = 10;
/// Columns a horizontal scroll moves.
pub const PAN: usize = 8;
