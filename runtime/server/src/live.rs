//! A running job as `/v1/stats` sees it while it runs. The engine thread
//! writes a few atomics per generated token (no lock, no allocation) and the
//! engine itself reports prefill progress and its cache figures through the
//! request's [`LiveProgress`]; a stats snapshot turns these into a
//! [`LiveRequest`] with rates so far.

use krasis_common::status::{Activity, LiveRequest};
use krasis_model::LiveProgress;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Where a request came from: its route and the client's socket address
/// (absent when the server is driven without a socket, as in tests).
#[derive(Debug, Clone, Copy)]
pub struct Origin {
    pub endpoint: &'static str,
    pub client: Option<SocketAddr>,
}

/// Who asked for a job, and when; fixed when it is queued.
#[derive(Debug, Clone)]
pub struct JobInfo {
    /// Server-assigned, increasing.
    pub id: u64,
    /// The API route, e.g. `/v1/chat/completions`.
    pub endpoint: &'static str,
    pub client: Option<SocketAddr>,
    /// When the request was admitted: TTFT counts from here.
    pub arrived: Instant,
    pub prompt_tokens: u64,
    pub max_tokens: u64,
}

/// A job the engine is running.
#[derive(Debug)]
pub struct Running {
    pub info: JobInfo,
    /// When the engine took the job.
    pub started: Instant,
    /// The request's handle, written by the engine.
    pub progress: LiveProgress,
    /// Tokens generated so far; written only by the engine thread, published
    /// last (release) so a reader that sees a count also sees its times.
    generated: AtomicU64,
    /// Microseconds after `started` of the first and the latest token.
    first_token_us: AtomicU64,
    last_token_us: AtomicU64,
}

impl Running {
    pub fn new(info: JobInfo, progress: LiveProgress) -> Self {
        Running {
            info,
            started: Instant::now(),
            progress,
            generated: AtomicU64::new(0),
            first_token_us: AtomicU64::new(0),
            last_token_us: AtomicU64::new(0),
        }
    }

    /// Called by the engine thread for every generated token (stop tokens
    /// included, as the usage counts them).
    pub fn on_token(&self) {
        let now = self.started.elapsed().as_micros() as u64;
        let n = self.generated.load(Ordering::Relaxed);
        if n == 0 {
            self.first_token_us.store(now, Ordering::Relaxed);
        }
        self.last_token_us.store(now, Ordering::Relaxed);
        self.generated.store(n + 1, Ordering::Release);
    }

    pub fn generated(&self) -> u64 {
        self.generated.load(Ordering::Acquire)
    }

    /// Time to first token, once there is one.
    pub fn ttft(&self) -> Option<Duration> {
        let first = Duration::from_micros(self.first_token_us.load(Ordering::Relaxed));
        (self.generated.load(Ordering::Acquire) > 0).then(|| self.ttft_of(first))
    }

    /// From the request's arrival (admission), not from `started`: the
    /// client waited through the queue too.
    fn ttft_of(&self, first_token: Duration) -> Duration {
        self.started + first_token - self.info.arrived
    }

    /// What the job is doing and its figures so far, as of `now`.
    pub fn snapshot(&self, now: Instant) -> LiveRequest {
        let generated = self.generated.load(Ordering::Acquire);
        let first = Duration::from_micros(self.first_token_us.load(Ordering::Relaxed));
        let last = Duration::from_micros(self.last_token_us.load(Ordering::Relaxed));
        let elapsed = now.saturating_duration_since(self.started);
        let prompt = self.info.prompt_tokens;
        let (activity, prefilled, prefill_tok_s, decode_tok_s, ttft) = if generated == 0 {
            // An engine that reports no chunks still shows its elapsed time.
            let done = self.progress.prefilled().min(prompt);
            (Activity::Prefilling, done, rate(done, elapsed), 0.0, None)
        } else {
            // The first token ends the prefill; the decode rate counts the
            // tokens after it, as `GenerateStats::decode_tok_s` does.
            let ttft = self.ttft_of(first);
            let decode = rate(generated - 1, last.saturating_sub(first));
            (
                Activity::Decoding,
                prompt,
                rate(prompt, first),
                decode,
                Some(ttft),
            )
        };
        LiveRequest {
            id: self.info.id,
            activity,
            endpoint: self.info.endpoint.to_string(),
            client: self.info.client.map(|c| c.to_string()),
            prompt_tokens: prompt,
            prefilled_tokens: prefilled,
            generated_tokens: generated,
            max_tokens: self.info.max_tokens,
            elapsed_ms: ms(elapsed),
            ttft_ms: ttft.map(ms),
            prefill_tok_s,
            decode_tok_s,
        }
    }
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn rate(n: u64, d: Duration) -> f64 {
    let s = d.as_secs_f64();
    if s > 0.0 { n as f64 / s } else { 0.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running(prompt: u64) -> Running {
        let info = JobInfo {
            id: 7,
            endpoint: "/v1/completions",
            client: Some("127.0.0.1:4242".parse().unwrap()),
            arrived: Instant::now(),
            prompt_tokens: prompt,
            max_tokens: 16,
        };
        Running::new(info, LiveProgress::default())
    }

    #[test]
    fn prefilling_then_decoding_with_rates_so_far() {
        let r = running(100);
        let l = r.snapshot(r.started + Duration::from_millis(500));
        assert_eq!(
            (l.activity, l.prefilled_tokens, l.ttft_ms),
            (Activity::Prefilling, 0, None)
        );
        r.progress.set_prefilled(50);
        let l = r.snapshot(r.started + Duration::from_millis(500));
        assert_eq!((l.activity, l.prefilled_tokens), (Activity::Prefilling, 50));
        assert!(
            (l.prefill_tok_s - 100.0).abs() < 1e-6,
            "{}",
            l.prefill_tok_s
        );
        // An engine may over-report (a chunk padded); never past the prompt.
        r.progress.set_prefilled(130);
        assert_eq!(r.snapshot(Instant::now()).prefilled_tokens, 100);

        r.on_token();
        std::thread::sleep(Duration::from_millis(20));
        r.on_token();
        r.on_token();
        let l = r.snapshot(Instant::now());
        assert_eq!(l.activity, Activity::Decoding);
        assert_eq!((l.prefilled_tokens, l.generated_tokens), (100, 3));
        assert_eq!((l.id, l.endpoint.as_str()), (7, "/v1/completions"));
        assert_eq!(l.client.as_deref(), Some("127.0.0.1:4242"));
        let ttft = l.ttft_ms.unwrap();
        assert!(ttft >= 0.0, "{ttft}");
        assert_eq!(r.ttft().map(ms), Some(ttft));
        // Two tokens after the first, in at least 20 ms.
        assert!(
            l.decode_tok_s > 0.0 && l.decode_tok_s <= 100.0,
            "{}",
            l.decode_tok_s
        );
    }
}
