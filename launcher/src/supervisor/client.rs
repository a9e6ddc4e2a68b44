//! The launcher's HTTP view of a running runtime: readiness (`/health`) and
//! the live figures of the run screen (`/v1/stats`), with the API key as a
//! bearer token when one is set.

use super::fmt_duration;
use krasis_common::status::HealthStatus;
use krasis_common::{EngineStats, Health};
use std::time::{Duration, Instant};

/// `GET /health` and `GET /v1/stats` of a running server.
pub struct StatsClient {
    base: String,
    api_key: Option<String>,
    http: reqwest::blocking::Client,
}

impl StatsClient {
    pub fn new(base_url: &str, api_key: Option<String>) -> Result<Self, String> {
        let http = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| format!("HTTP client: {e}"))?;
        Ok(StatsClient {
            base: base_url.trim_end_matches('/').to_string(),
            api_key,
            http,
        })
    }

    fn send(&self, path: &str) -> Result<reqwest::blocking::Response, String> {
        let mut rq = self.http.get(format!("{}{path}", self.base));
        if let Some(k) = &self.api_key {
            rq = rq.bearer_auth(k);
        }
        rq.send().map_err(|e| format!("GET {path}: {e}"))
    }

    fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T, String> {
        let r = self.send(path)?;
        if !r.status().is_success() {
            return Err(format!("GET {path}: HTTP {}", r.status()));
        }
        r.json()
            .map_err(|e| format!("GET {path}: bad payload: {e}"))
    }

    /// The server's readiness. `/health` answers 503 while the model loads
    /// (`status: loading`) and after a fault (`status: error`); those are
    /// answers, so only a failed request or another status is an `Err`.
    pub fn health(&self) -> Result<Health, String> {
        let r = self.send("/health")?;
        let code = r.status();
        if !code.is_success() && code != reqwest::StatusCode::SERVICE_UNAVAILABLE {
            return Err(format!("GET /health: HTTP {code}"));
        }
        r.json()
            .map_err(|e| format!("GET /health: HTTP {code} without a health report: {e}"))
    }

    /// Polls `/health` until it reports `status: ok`. An `error` status ends
    /// the wait at once with the runtime's reason; a server that is not
    /// answering yet, or still `loading`, is asked again until `timeout`.
    pub fn wait_ready(&self, timeout: Duration) -> Result<Health, String> {
        let deadline = Instant::now() + timeout;
        loop {
            let last = match self.health() {
                Ok(h) if h.status == HealthStatus::Ok => return Ok(h),
                Ok(h) if h.status == HealthStatus::Error => {
                    return Err(format!(
                        "the runtime reports an error: {}",
                        h.error.as_deref().unwrap_or("(no reason given)")
                    ));
                }
                Ok(h) => format!("status {:?}, phase {:?}", h.status, h.phase),
                Err(e) => e,
            };
            if Instant::now() >= deadline {
                return Err(format!(
                    "not ready within {}; last answer: {last}",
                    fmt_duration(timeout)
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn stats(&self) -> Result<EngineStats, String> {
        self.get("/v1/stats")
    }
}
