//! Typed launch options. The launcher builds a [`LaunchOptions`] from the TUI,
//! the CLI or a profile, validates it once ([`LaunchOptions::validate`] plus the
//! capability check in the launcher), and turns it into `krasis-runtime serve`
//! arguments with [`LaunchOptions::to_serve_args`]. The runtime parses the same
//! flags with clap; a test in the runtime checks that every argument produced
//! here is accepted there, so the two sides cannot drift apart.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Which engine executes the model. There is no automatic choice: the
/// reference engine is an oracle and is only ever used when asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    #[default]
    Cuda,
    Reference,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Cuda => "cuda",
            Backend::Reference => "reference",
        }
    }
    pub fn parse(s: &str) -> Result<Self, OptionError> {
        match s {
            "cuda" => Ok(Backend::Cuda),
            "reference" => Ok(Backend::Reference),
            other => Err(OptionError::new(
                "backend",
                format!("unknown backend '{other}'; expected 'cuda' or 'reference'"),
            )),
        }
    }
}

/// Where the initial HCS residents come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase", tag = "mode", content = "path")]
pub enum HeatmapChoice {
    /// Use the heatmap stored next to the expert cache if one exists and matches.
    #[default]
    Auto,
    /// Run without a heatmap (explicit; residents start empty and fill on demand).
    Off,
    /// Use this heatmap file; refused if it does not match the model and cache.
    File(PathBuf),
}

impl HeatmapChoice {
    pub fn to_arg(&self) -> String {
        match self {
            HeatmapChoice::Auto => "auto".into(),
            HeatmapChoice::Off => "off".into(),
            HeatmapChoice::File(p) => p.display().to_string(),
        }
    }
    pub fn parse(s: &str) -> Self {
        match s {
            "auto" => HeatmapChoice::Auto,
            "off" => HeatmapChoice::Off,
            p => HeatmapChoice::File(PathBuf::from(p)),
        }
    }
}

/// Everything needed to start a runtime server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LaunchOptions {
    /// Hugging Face model directory (config.json, safetensors, tokenizer).
    pub model: PathBuf,
    pub backend: Backend,
    pub host: String,
    pub port: u16,
    /// Bearer token required on every API request when set.
    pub api_key: Option<String>,
    /// Allow binding a non-loopback address without an API key.
    pub insecure_public: bool,
    /// Maximum context (prompt + generated tokens); KV cache is sized for it.
    /// `None` uses the model's `max_position_embeddings`.
    pub context_length: Option<u32>,
    /// Routed expert precision in the expert cache.
    pub expert_precision: String,
    /// Precision of attention weights and activations.
    pub attention_precision: String,
    /// KV cache element format.
    pub kv_format: String,
    /// Use at most this many bytes of the GPU (None: the whole card).
    pub vram_limit_bytes: Option<u64>,
    /// Free VRAM kept in reserve after calibration, in MiB.
    pub safety_margin_mib: u64,
    /// Keep hot experts resident in spare VRAM (GPU backend).
    pub hcs: bool,
    pub heatmap: HeatmapChoice,
    /// Expert pruning mode; "off" is exact. Anything else is an explicit approximation.
    pub pruning: String,
    /// Expert cache directory override (default: the platform cache directory).
    pub cache_dir: Option<PathBuf>,
    /// Requests allowed to wait while one is running; more get 503.
    pub queue_depth: u32,
    /// CUDA device ordinal.
    pub gpu: u32,
}

impl Default for LaunchOptions {
    fn default() -> Self {
        LaunchOptions {
            model: PathBuf::new(),
            backend: Backend::Cuda,
            host: "127.0.0.1".into(),
            port: 8080,
            api_key: None,
            insecure_public: false,
            context_length: None,
            expert_precision: "int4".into(),
            attention_precision: "bf16".into(),
            kv_format: "bf16".into(),
            vram_limit_bytes: None,
            safety_margin_mib: 600,
            hcs: true,
            heatmap: HeatmapChoice::Auto,
            pruning: "off".into(),
            cache_dir: None,
            queue_depth: 16,
            gpu: 0,
        }
    }
}

/// An option that is wrong, with the option's name and what to do about it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("option '{option}': {reason}")]
pub struct OptionError {
    pub option: String,
    pub reason: String,
}

impl OptionError {
    pub fn new(option: impl Into<String>, reason: impl Into<String>) -> Self {
        OptionError {
            option: option.into(),
            reason: reason.into(),
        }
    }
}

/// True for addresses only this machine can reach.
pub fn is_loopback_host(host: &str) -> bool {
    match host.parse::<std::net::IpAddr>() {
        Ok(ip) => ip.is_loopback(),
        Err(_) => host == "localhost",
    }
}

impl LaunchOptions {
    /// Checks that need no knowledge of the runtime's capabilities (those are
    /// checked by the launcher against the runtime's capability report).
    pub fn validate(&self) -> Result<(), OptionError> {
        if self.model.as_os_str().is_empty() {
            return Err(OptionError::new("model", "no model directory given"));
        }
        if self.host.trim().is_empty() {
            return Err(OptionError::new("host", "empty host"));
        }
        if self.port == 0 {
            return Err(OptionError::new(
                "port",
                "port 0 is not allowed; pick a port such as 8080",
            ));
        }
        if !is_loopback_host(&self.host) && self.api_key.is_none() && !self.insecure_public {
            return Err(OptionError::new(
                "host",
                format!(
                    "binding {} exposes the server to other machines; set an API key or pass --insecure-public explicitly",
                    self.host
                ),
            ));
        }
        if let Some(k) = &self.api_key
            && k.trim().is_empty()
        {
            return Err(OptionError::new("api_key", "API key is empty"));
        }
        if let Some(c) = self.context_length
            && c < 16
        {
            return Err(OptionError::new(
                "context_length",
                format!("{c} is too small (minimum 16)"),
            ));
        }
        if let Some(v) = self.vram_limit_bytes
            && v < 256 << 20
        {
            return Err(OptionError::new(
                "vram_limit",
                format!("{v} bytes is below the 256 MiB minimum"),
            ));
        }
        if self.queue_depth == 0 {
            return Err(OptionError::new("queue_depth", "must be at least 1"));
        }
        Ok(())
    }

    /// Arguments for `krasis-runtime serve` (without the program name and subcommand).
    pub fn to_serve_args(&self) -> Vec<String> {
        let mut a = vec![
            "--model".to_string(),
            self.model.display().to_string(),
            "--backend".into(),
            self.backend.as_str().into(),
            "--host".into(),
            self.host.clone(),
            "--port".into(),
            self.port.to_string(),
            "--expert-precision".into(),
            self.expert_precision.clone(),
            "--attention-precision".into(),
            self.attention_precision.clone(),
            "--kv-format".into(),
            self.kv_format.clone(),
            "--safety-margin-mib".into(),
            self.safety_margin_mib.to_string(),
            "--hcs".into(),
            if self.hcs { "on" } else { "off" }.into(),
            "--heatmap".into(),
            self.heatmap.to_arg(),
            "--pruning".into(),
            self.pruning.clone(),
            "--queue-depth".into(),
            self.queue_depth.to_string(),
            "--gpu".into(),
            self.gpu.to_string(),
            "--progress-json".into(),
        ];
        if let Some(k) = &self.api_key {
            a.push("--api-key".into());
            a.push(k.clone());
        }
        if self.insecure_public {
            a.push("--insecure-public".into());
        }
        if let Some(c) = self.context_length {
            a.push("--context-length".into());
            a.push(c.to_string());
        }
        if let Some(v) = self.vram_limit_bytes {
            a.push("--vram-limit".into());
            a.push(v.to_string());
        }
        if let Some(d) = &self.cache_dir {
            a.push("--cache-dir".into());
            a.push(d.display().to_string());
        }
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_bind_requires_key_or_explicit_flag() {
        let mut o = LaunchOptions {
            model: "m".into(),
            host: "0.0.0.0".into(),
            ..Default::default()
        };
        assert_eq!(o.validate().unwrap_err().option, "host");
        o.api_key = Some("k".into());
        o.validate().unwrap();
        o.api_key = None;
        o.insecure_public = true;
        o.validate().unwrap();
    }

    #[test]
    fn options_round_trip_toml_like_json() {
        let o = LaunchOptions {
            model: "/m".into(),
            vram_limit_bytes: Some(8 << 30),
            heatmap: HeatmapChoice::File("/h.json".into()),
            ..Default::default()
        };
        let s = serde_json::to_string(&o).unwrap();
        let back: LaunchOptions = serde_json::from_str(&s).unwrap();
        assert_eq!(o, back);
        assert!(
            o.to_serve_args()
                .windows(2)
                .any(|w| w[0] == "--vram-limit" && w[1] == (8u64 << 30).to_string())
        );
    }
}
