//! Structured progress events. With `--progress-json` the runtime writes one
//! JSON object per line to stdout while it loads, builds caches, calibrates and
//! serves; the launcher's supervisor parses them to drive its run screen.
//! Human-readable logs go to stderr.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ProgressEvent {
    /// Entering a startup phase (`loading`, `building_cache`, `calibrating`, ...).
    Phase { phase: String, detail: String },
    /// Progress inside a long step (cache build, weight upload).
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
