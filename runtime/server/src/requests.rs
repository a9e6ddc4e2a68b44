//! The request log: the last [`REQUEST_LOG_LEN`] finished requests for
//! `/v1/stats`, each also written as one `info` line.
//!
//! Every queued job ends in exactly one [`Report`], made by the engine
//! thread however the job ended and handed to the response side with the
//! job's `Done`. The record enters the log when the report is dropped, so
//! the response side can first set the finish reason its client actually
//! received (`tool_calls` is only known once the output has been parsed),
//! and a report whose client is gone (its `Done` undeliverable, or the
//! response dropped) is still logged, with the engine thread's reason.

use crate::live::{JobInfo, ms};
use krasis_common::status::{REQUEST_LOG_LEN, RequestRecord};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The finished requests, oldest first.
#[derive(Debug, Default)]
pub struct RequestLog {
    inner: Mutex<LogInner>,
}

#[derive(Debug, Default)]
struct LogInner {
    records: VecDeque<RequestRecord>,
    last_ttft_ms: Option<f64>,
    /// Every record with finish reason `tool_call_error`, ever.
    tool_call_errors: u64,
}

impl RequestLog {
    pub fn push(&self, record: RequestRecord) {
        let mut log = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if record.ttft_ms.is_some() {
            log.last_ttft_ms = record.ttft_ms;
        }
        if record.finish_reason == "tool_call_error" {
            log.tool_call_errors += 1;
        }
        if log.records.len() == REQUEST_LOG_LEN {
            log.records.pop_front();
        }
        log.records.push_back(record);
    }

    /// The records, oldest first, and the TTFT of the last request that
    /// produced a token.
    pub fn recent(&self) -> (Vec<RequestRecord>, Option<f64>) {
        let log = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        (log.records.iter().cloned().collect(), log.last_ttft_ms)
    }

    /// Answers that ended with a malformed tool call, ever.
    pub fn tool_call_errors(&self) -> u64 {
        let log = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        log.tool_call_errors
    }
}

/// What the engine thread knows of a finished job.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub completion_tokens: u64,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u64,
    pub ttft: Option<Duration>,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// The reason as far as the engine thread can tell (`stop`, `length`,
    /// `cancelled`, `error`); the response side may refine it.
    pub finish_reason: &'static str,
}

/// One finished request on its way into the log (on drop).
pub struct Report {
    record: RequestRecord,
    log: Arc<RequestLog>,
}

impl std::fmt::Debug for Report {
    // The record only: the log it joins is not this report's business.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Report").field(&self.record).finish()
    }
}

impl Report {
    pub fn new(log: Arc<RequestLog>, info: &JobInfo, outcome: Outcome) -> Self {
        Report {
            record: RequestRecord {
                id: info.id,
                finished_unix_ms: unix_ms(),
                endpoint: info.endpoint.to_string(),
                client: info.client.map(|c| c.to_string()),
                prompt_tokens: info.prompt_tokens,
                cached_tokens: outcome.cached_tokens,
                completion_tokens: outcome.completion_tokens,
                ttft_ms: outcome.ttft.map(ms),
                prefill_tok_s: outcome.prefill_tok_s,
                decode_tok_s: outcome.decode_tok_s,
                finish_reason: outcome.finish_reason.to_string(),
            },
            log,
        }
    }

    /// The finish reason the client was given.
    pub fn set_finish_reason(&mut self, reason: &str) {
        reason.clone_into(&mut self.record.finish_reason);
    }

    pub fn record(&self) -> &RequestRecord {
        &self.record
    }
}

impl Drop for Report {
    fn drop(&mut self) {
        let r = std::mem::take(&mut self.record);
        let ttft = r
            .ttft_ms
            .map_or_else(|| "-".to_string(), |t| format!("{t:.0} ms"));
        tracing::info!(
            "request {} {} from {}: {} prompt ({} cached) + {} completion tokens, TTFT {ttft}, prefill {:.1} tok/s, decode {:.1} tok/s, finish {}",
            r.id,
            r.endpoint,
            r.client.as_deref().unwrap_or("unknown"),
            r.prompt_tokens,
            r.cached_tokens,
            r.completion_tokens,
            r.prefill_tok_s,
            r.decode_tok_s,
            r.finish_reason,
        );
        self.log.push(r);
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn info(id: u64) -> JobInfo {
        JobInfo {
            id,
            endpoint: "/v1/chat/completions",
            client: None,
            arrived: Instant::now(),
            prompt_tokens: 3,
            max_tokens: 5,
        }
    }

    #[test]
    fn a_report_is_logged_once_on_drop_with_the_reason_set_last() {
        let log = Arc::new(RequestLog::default());
        let outcome = Outcome {
            completion_tokens: 2,
            ttft: Some(Duration::from_millis(40)),
            finish_reason: "cancelled",
            ..Default::default()
        };
        let mut r = Report::new(log.clone(), &info(1), outcome);
        assert!(log.recent().0.is_empty());
        r.set_finish_reason("tool_calls");
        drop(r);
        let (records, ttft) = log.recent();
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].finish_reason, "tool_calls");
        assert_eq!(
            (records[0].prompt_tokens, records[0].completion_tokens),
            (3, 2)
        );
        assert_eq!(ttft, Some(40.0));
        // A request without a first token keeps the last TTFT.
        drop(Report::new(log.clone(), &info(2), Outcome::default()));
        assert_eq!(log.recent().1, Some(40.0));
    }

    #[test]
    fn the_log_keeps_the_newest_records() {
        let log = Arc::new(RequestLog::default());
        for id in 1..=(REQUEST_LOG_LEN as u64 + 3) {
            drop(Report::new(log.clone(), &info(id), Outcome::default()));
        }
        let ids: Vec<u64> = log.recent().0.iter().map(|r| r.id).collect();
        assert_eq!(ids.len(), REQUEST_LOG_LEN);
        assert_eq!(ids[0], 4);
        assert!(ids.windows(2).all(|w| w[1] == w[0] + 1));
    }
}
