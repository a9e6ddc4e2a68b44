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

/// How much memory a tier of the engine's prefix cache gets (the KV of
/// prompt prefixes kept for later requests that start with them):
/// `prefix_cache` is the cache and its first tier (VRAM on the CUDA
/// engine), `prefix_cache_host` its RAM tier (page-locked host memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase", tag = "mode", content = "bytes")]
pub enum PrefixCacheChoice {
    /// The engine's rule. First tier: the CUDA engine's VRAM pool is the
    /// smaller of one context's KV and half the VRAM left once every
    /// expert is resident, and none when not every expert fits (the host
    /// tier carries the cache then); the reference engine 256 MiB. RAM
    /// tier: the smaller of four contexts' KV and a quarter of the host's
    /// available memory (CUDA), 1 GiB (reference). Whole blocks; none where
    /// the engine lacks the cache (the CUDA engine with sliding-window
    /// layers).
    #[default]
    Auto,
    /// First tier: no prefix cache at all (every prompt is prefilled in
    /// full; the RAM tier is off too). RAM tier: no RAM tier.
    Off,
    /// Exactly this many bytes (whole blocks of it); refused where the
    /// engine cannot hold it. `0` for the first tier: no VRAM pool, the
    /// RAM tier carries the cache.
    Bytes(u64),
}

impl PrefixCacheChoice {
    /// The `--prefix-cache` / `--prefix-cache-host` value: `auto`, `off`,
    /// or an exact byte count.
    pub fn to_arg(self) -> String {
        match self {
            PrefixCacheChoice::Auto => "auto".into(),
            PrefixCacheChoice::Off => "off".into(),
            PrefixCacheChoice::Bytes(b) => b.to_string(),
        }
    }

    /// `auto`, `off`, or a size (`2GiB`, `512MiB`, a byte count, `0`;
    /// `crate::size` rules).
    pub fn parse(s: &str) -> Result<Self, OptionError> {
        match s.trim() {
            "auto" => Ok(PrefixCacheChoice::Auto),
            "off" => Ok(PrefixCacheChoice::Off),
            t => crate::size::parse_size(t)
                .map(PrefixCacheChoice::Bytes)
                .map_err(|e| {
                    OptionError::new(
                        "prefix_cache",
                        format!("'{t}': {e}; use auto, off, or a size such as 2GiB"),
                    )
                }),
        }
    }

    /// Whether this first-tier choice leaves the prefix cache on.
    pub fn is_on(self) -> bool {
        self != PrefixCacheChoice::Off
    }
}

/// Prompt tokens per prefix cache block unless `--prefix-block` says
/// otherwise: a later turn of a conversation re-prefills at most one
/// partial block (255 tokens, a few ms at prefill rates) beyond what it
/// appended, while a 24K-token conversation is ~100 blocks, one copy
/// launch per tier and a cheap index walk.
pub const DEFAULT_PREFIX_BLOCK: u32 = 256;

/// Block sizes are whole 64-token tiles (the attention kernels' key tile).
pub const PREFIX_BLOCK_MULTIPLE: u32 = 64;

/// Checks a `--prefix-block` value.
pub fn check_prefix_block(tokens: u32) -> Result<(), OptionError> {
    if tokens == 0 || !tokens.is_multiple_of(PREFIX_BLOCK_MULTIPLE) {
        return Err(OptionError::new(
            "prefix_block",
            format!(
                "{tokens} tokens: a prefix cache block is a positive multiple of \
                 {PREFIX_BLOCK_MULTIPLE} tokens (default {DEFAULT_PREFIX_BLOCK})"
            ),
        ));
    }
    Ok(())
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
    /// Bearer token required on every API request, held in memory only (typed
    /// in the TUI or read from `KRASIS_API_KEY`). Never written to a profile
    /// and never put on a command line: it reaches the runtime through
    /// [`LaunchOptions::serve_env`].
    #[serde(skip_serializing)]
    pub api_key: Option<String>,
    /// File holding the bearer token (one line; readable only by its owner).
    /// What profiles store instead of a key; passed to the runtime as
    /// `--api-key-file`, which reads it.
    pub api_key_file: Option<PathBuf>,
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
    /// Precision of the MLP block's activations and weights (dense MLPs,
    /// the router input, routed and shared experts).
    pub mlp_precision: String,
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
    /// Requests allowed to wait while `parallel` run; more get 503.
    pub queue_depth: u32,
    /// The most requests decoding together (continuous batching, 1 to
    /// [`MAX_PARALLEL`]); `None`: the engine's batch capacity (the
    /// backend's `max_parallel` in the capability report).
    pub parallel: Option<u32>,
    /// KV memory all running requests share, in tokens (each reserves its
    /// prompt + max_tokens; one that does not fit waits in the queue);
    /// `None`: the engine's default. Only backends whose capability says
    /// `kv_tokens` take it.
    pub kv_tokens: Option<u64>,
    /// CUDA device ordinal.
    pub gpu: u32,
    /// Memory for the prefix cache (reuse of prompt prefixes' KV): its
    /// first tier (VRAM on the CUDA engine), or `off` for none.
    pub prefix_cache: PrefixCacheChoice,
    /// The prefix cache's RAM tier (page-locked host memory on the CUDA
    /// engine), where blocks evicted from the first tier go.
    pub prefix_cache_host: PrefixCacheChoice,
    /// Prompt tokens per prefix cache block (a multiple of 64).
    pub prefix_block: u32,
    /// File the prefix cache is written to at a graceful shutdown and
    /// loaded from at startup, so cached prompt prefixes survive a restart
    /// (`None`: kept in memory only). A file written by another model,
    /// setting, block size, device or build is refused at startup.
    pub prefix_cache_file: Option<PathBuf>,
    /// Browser origins allowed to call the API cross-origin (CORS), each
    /// `scheme://host[:port]`, or `*` for any. Empty: loopback origins only.
    pub cors_origins: Vec<String>,
}

impl Default for LaunchOptions {
    fn default() -> Self {
        LaunchOptions {
            model: PathBuf::new(),
            backend: Backend::Cuda,
            host: "127.0.0.1".into(),
            port: 8080,
            api_key: None,
            api_key_file: None,
            insecure_public: false,
            context_length: None,
            expert_precision: "int4".into(),
            attention_precision: "bf16".into(),
            kv_format: "bf16".into(),
            mlp_precision: "bf16".into(),
            vram_limit_bytes: None,
            safety_margin_mib: crate::plan::DEFAULT_SAFETY_MARGIN_MIB,
            hcs: true,
            heatmap: HeatmapChoice::Auto,
            pruning: "off".into(),
            cache_dir: None,
            queue_depth: 16,
            parallel: None,
            kv_tokens: None,
            gpu: 0,
            prefix_cache: PrefixCacheChoice::Auto,
            prefix_cache_host: PrefixCacheChoice::Auto,
            prefix_block: DEFAULT_PREFIX_BLOCK,
            prefix_cache_file: None,
            cors_origins: Vec::new(),
        }
    }
}

/// How long a stopping server waits for its engine to write the prefix
/// cache's file (`prefix_cache_file`) before it exits without it (the
/// previous file stays: it is replaced atomically). A few GiB take seconds.
pub const PREFIX_FILE_SAVE_LIMIT: std::time::Duration = std::time::Duration::from_secs(120);

/// The most requests any engine decodes together (`parallel`): the CUDA
/// decode kernels take at most 8 rows.
pub const MAX_PARALLEL: u32 = 8;

/// Environment variable that carries the API key to the launcher and the
/// runtime (the launcher sets it for the runtime it starts).
pub const API_KEY_ENV: &str = "KRASIS_API_KEY";

/// Why `--api-key KEY` is refused on both command lines.
pub const API_KEY_ARGV_REFUSED: &str = "--api-key on the command line is refused: other users of this machine can read a process's arguments (ps, /proc/PID/cmdline). Put the key in a file only you can read (chmod 600) and pass --api-key-file PATH, or set the KRASIS_API_KEY environment variable";

/// Placeholder keys from examples and tutorials, refused on a public bind.
const PLACEHOLDER_KEYS: [&str; 5] = ["change-me", "changeme", "password", "secret", "api-key"];

/// Shortest API key accepted on a non-loopback bind.
pub const MIN_PUBLIC_KEY_CHARS: usize = 16;

/// Reads an API key file: its contents without the trailing newline. A
/// leading `~/` is the home directory. Refused when empty, and on Unix when
/// group or others may read it (as ssh does with private keys): the key would
/// be as visible as on a command line.
pub fn read_api_key_file(path: &std::path::Path) -> Result<String, OptionError> {
    let path = &expand_home(path);
    let shown = path.display();
    let text = std::fs::read_to_string(path)
        .map_err(|e| OptionError::new("api_key_file", format!("cannot read {shown}: {e}")))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(path)
            .map_err(|e| OptionError::new("api_key_file", format!("cannot stat {shown}: {e}")))?
            .permissions()
            .mode();
        if mode & 0o044 != 0 {
            return Err(OptionError::new(
                "api_key_file",
                format!(
                    "{shown} is readable by other users (mode {:03o}); run `chmod 600 {shown}`",
                    mode & 0o777
                ),
            ));
        }
    }
    let key = text.trim_end_matches(['\n', '\r']);
    if key.trim().is_empty() {
        return Err(OptionError::new(
            "api_key_file",
            format!("{shown} is empty; write the API key into it"),
        ));
    }
    Ok(key.to_string())
}

/// `~/x` as `$HOME/x` (`%USERPROFILE%` on Windows); other paths unchanged.
pub fn expand_home(path: &std::path::Path) -> PathBuf {
    let home = std::env::var_os(if cfg!(windows) { "USERPROFILE" } else { "HOME" });
    match (path.strip_prefix("~"), home) {
        (Ok(rest), Some(h)) => PathBuf::from(h).join(rest),
        _ => path.to_path_buf(),
    }
}

/// Checks one CORS origin: `*`, or `http`/`https` `://host[:port]` with no
/// path, query or trailing slash, lower case (what browsers send in `Origin`).
pub fn check_cors_origin(origin: &str) -> Result<(), String> {
    if origin == "*" {
        return Ok(());
    }
    let example =
        "write it as a browser sends it, e.g. https://chat.example.com or http://localhost:3000";
    let rest = origin
        .strip_prefix("https://")
        .or_else(|| origin.strip_prefix("http://"))
        .ok_or_else(|| {
            format!(
                "'{origin}' is not an origin: it must start with http:// or https://; {example}"
            )
        })?;
    if rest.contains(['/', '?', '#']) {
        return Err(format!(
            "'{origin}' has a path; an origin is only scheme://host[:port] (no trailing '/'); {example}"
        ));
    }
    if rest.contains('@') {
        return Err(format!("'{origin}' has user information; {example}"));
    }
    let (host, port) = if let Some(v6) = rest.strip_prefix('[') {
        let (h, after) = v6
            .split_once(']')
            .ok_or_else(|| format!("'{origin}' has an unclosed IPv6 bracket"))?;
        if h.is_empty()
            || !h
                .chars()
                .all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.')
        {
            return Err(format!("'{origin}' has a bad IPv6 address"));
        }
        match after {
            "" => (h, None),
            p => (
                h,
                Some(p.strip_prefix(':').ok_or_else(|| {
                    format!("'{origin}': expected ':PORT' after the IPv6 address")
                })?),
            ),
        }
    } else {
        match rest.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (rest, None),
        }
    };
    let host_ok = !host.is_empty()
        && !host.starts_with(['.', '-'])
        && (rest.starts_with('[')
            || host
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.'));
    if !host_ok {
        return Err(format!(
            "'{origin}' has a bad host '{host}' (lower-case letters, digits, '-' and '.'); {example}"
        ));
    }
    if let Some(p) = port
        && (p.starts_with('0') || !p.parse::<u16>().is_ok_and(|n| n > 0))
    {
        return Err(format!("'{origin}' has a bad port '{p}' (1-65535)"));
    }
    Ok(())
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

/// An API key's own checks: not empty, no whitespace, and on a public bind
/// neither a well-known placeholder nor shorter than [`MIN_PUBLIC_KEY_CHARS`].
fn check_api_key(k: &str, public: bool) -> Result<(), OptionError> {
    if k.trim().is_empty() {
        return Err(OptionError::new("api_key", "API key is empty"));
    }
    if k.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(OptionError::new(
            "api_key",
            "API key contains whitespace or control characters (a key file holds the key on one line)",
        ));
    }
    if !public {
        return Ok(());
    }
    let generate = "generate one with e.g. `openssl rand -hex 32`";
    if PLACEHOLDER_KEYS.iter().any(|p| k.eq_ignore_ascii_case(p)) {
        return Err(OptionError::new(
            "api_key",
            format!(
                "the API key is the placeholder '{k}'; anyone could guess it on a public bind; {generate}"
            ),
        ));
    }
    let n = k.chars().count();
    if n < MIN_PUBLIC_KEY_CHARS {
        return Err(OptionError::new(
            "api_key",
            format!(
                "the API key has {n} characters; a public bind needs at least {MIN_PUBLIC_KEY_CHARS}; {generate}"
            ),
        ));
    }
    Ok(())
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
        let public = !is_loopback_host(&self.host);
        if public && self.api_key.is_none() && self.api_key_file.is_none() && !self.insecure_public
        {
            return Err(OptionError::new(
                "host",
                format!(
                    "binding {} exposes the server to other machines; set an API key (--api-key-file PATH or KRASIS_API_KEY) or pass --insecure-public explicitly",
                    self.host
                ),
            ));
        }
        if self.api_key.is_some() && self.api_key_file.is_some() {
            return Err(OptionError::new(
                "api_key",
                "both an API key and an API key file are set; use one of them",
            ));
        }
        if let Some(k) = &self.api_key {
            check_api_key(k, public)?;
        }
        for o in &self.cors_origins {
            check_cors_origin(o).map_err(|e| OptionError::new("cors_origins", e))?;
        }
        if self.cors_origins.len() > 1 && self.cors_origins.iter().any(|o| o == "*") {
            return Err(OptionError::new(
                "cors_origins",
                "'*' already allows every origin; give it alone",
            ));
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
        if let Some(n) = self.parallel
            && !(1..=MAX_PARALLEL).contains(&n)
        {
            return Err(OptionError::new(
                "parallel",
                format!(
                    "{n} is outside 1..={MAX_PARALLEL} (the decode kernels take at most {MAX_PARALLEL} rows)"
                ),
            ));
        }
        if self.kv_tokens == Some(0) {
            return Err(OptionError::new("kv_tokens", "must be at least 1"));
        }
        check_prefix_block(self.prefix_block)?;
        if let (PrefixCacheChoice::Off, Some(p)) = (self.prefix_cache, &self.prefix_cache_file) {
            return Err(OptionError::new(
                "prefix_cache_file",
                format!(
                    "{} with the prefix cache off: there is nothing to keep in it; turn the \
                     cache on (prefix_cache auto) or drop the file",
                    p.display()
                ),
            ));
        }
        if let (PrefixCacheChoice::Off, PrefixCacheChoice::Bytes(b @ 1..)) =
            (self.prefix_cache, self.prefix_cache_host)
        {
            return Err(OptionError::new(
                "prefix_cache_host",
                format!(
                    "a {b}-byte RAM tier with the prefix cache off; turn the cache on (prefix_cache \
                     auto, or 0 for no VRAM pool) or the RAM tier off"
                ),
            ));
        }
        Ok(())
    }

    /// How long a launcher waits for the runtime it stops (SIGTERM) before
    /// killing it: `base`, plus [`PREFIX_FILE_SAVE_LIMIT`] when the runtime
    /// writes the prefix cache's file on its way out.
    pub fn shutdown_grace(&self, base: std::time::Duration) -> std::time::Duration {
        match self.prefix_cache_file {
            Some(_) => base + PREFIX_FILE_SAVE_LIMIT,
            None => base,
        }
    }

    /// The API key these options give the server: the in-memory key, else
    /// the contents of `api_key_file` (read now, with its checks).
    pub fn resolved_api_key(&self) -> Result<Option<String>, OptionError> {
        match (&self.api_key, &self.api_key_file) {
            (Some(k), _) => Ok(Some(k.clone())),
            (None, Some(p)) => read_api_key_file(p).map(Some),
            (None, None) => Ok(None),
        }
    }

    /// Environment for the `krasis-runtime serve` child: `KRASIS_API_KEY`
    /// when the key is held in memory (a key file goes by path in
    /// [`LaunchOptions::to_serve_args`]). The spawner should also remove any
    /// inherited `KRASIS_API_KEY` when this does not set it.
    pub fn serve_env(&self) -> Vec<(String, String)> {
        match &self.api_key {
            Some(k) => vec![(API_KEY_ENV.to_string(), k.clone())],
            None => Vec::new(),
        }
    }

    /// Arguments for `krasis-runtime serve` (without the program name and
    /// subcommand). Never contains the API key: see [`LaunchOptions::serve_env`].
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
            "--mlp-precision".into(),
            self.mlp_precision.clone(),
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
            "--prefix-cache".into(),
            self.prefix_cache.to_arg(),
            "--prefix-cache-host".into(),
            self.prefix_cache_host.to_arg(),
            "--prefix-block".into(),
            self.prefix_block.to_string(),
            "--progress-json".into(),
        ];
        if let Some(p) = &self.prefix_cache_file {
            a.push("--prefix-cache-file".into());
            a.push(p.display().to_string());
        }
        if let Some(p) = &self.api_key_file {
            a.push("--api-key-file".into());
            a.push(p.display().to_string());
        }
        for o in &self.cors_origins {
            a.push("--cors-origin".into());
            a.push(o.clone());
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
        if let Some(n) = self.parallel {
            a.push("--parallel".into());
            a.push(n.to_string());
        }
        if let Some(t) = self.kv_tokens {
            a.push("--kv-tokens".into());
            a.push(t.to_string());
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
        o.api_key = Some("k3y-0f-sixteen-chars".into());
        o.validate().unwrap();
        o.api_key = None;
        o.api_key_file = Some("/etc/krasis/key".into());
        o.validate().unwrap();
        o.api_key_file = None;
        o.insecure_public = true;
        o.validate().unwrap();
    }

    #[test]
    fn public_bind_refuses_placeholder_and_short_keys() {
        let public = |k: &str| LaunchOptions {
            model: "m".into(),
            host: "0.0.0.0".into(),
            api_key: Some(k.into()),
            ..Default::default()
        };
        for k in ["change-me", "CHANGEME", "Password", "secret"] {
            let e = public(k).validate().unwrap_err();
            assert_eq!(e.option, "api_key");
            assert!(e.reason.contains("placeholder"), "{k}: {e}");
        }
        let e = public("fifteen-chars!!").validate().unwrap_err();
        assert!(e.reason.contains("at least 16"), "{e}");
        public("sixteen-chars!!!").validate().unwrap();
        // Even with --insecure-public a weak key is refused: it would look safe.
        let mut o = public("secret");
        o.insecure_public = true;
        assert!(o.validate().is_err());
        // On loopback the key is the user's business.
        let mut o = public("secret");
        o.host = "127.0.0.1".into();
        o.validate().unwrap();
        // Whitespace never works in a bearer token.
        assert!(public("sixteen chars!!!!").validate().is_err());
        // Key and key file together are ambiguous.
        let mut o = public("sixteen-chars!!!");
        o.api_key_file = Some("/k".into());
        assert!(o.validate().unwrap_err().reason.contains("both"));
    }

    #[test]
    fn the_key_never_reaches_argv_or_a_saved_form() {
        let o = LaunchOptions {
            model: "/m".into(),
            api_key: Some("a-very-secret-key-123".into()),
            ..Default::default()
        };
        assert!(
            !o.to_serve_args()
                .iter()
                .any(|a| a.contains("a-very-secret") || a == "--api-key"),
            "{:?}",
            o.to_serve_args()
        );
        assert_eq!(
            o.serve_env(),
            vec![(
                "KRASIS_API_KEY".to_string(),
                "a-very-secret-key-123".to_string()
            )]
        );
        let json = serde_json::to_string(&o).unwrap();
        assert!(!json.contains("a-very-secret"), "{json}");
        // A key file travels by path; there is nothing to put in the environment.
        let o = LaunchOptions {
            model: "/m".into(),
            api_key_file: Some("/run/key".into()),
            ..Default::default()
        };
        assert!(o.serve_env().is_empty());
        assert!(
            o.to_serve_args()
                .windows(2)
                .any(|w| w[0] == "--api-key-file" && w[1] == "/run/key")
        );
    }

    #[test]
    fn key_files_are_trimmed_and_checked() {
        let dir = std::env::temp_dir().join(format!("krasis-key-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, text: &str, mode: u32| {
            let p = dir.join(name);
            std::fs::write(&p, text).unwrap();
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
            }
            #[cfg(not(unix))]
            let _ = mode;
            p
        };
        let p = write("good", "k3y-0f-sixteen-chars\n", 0o600);
        assert_eq!(read_api_key_file(&p).unwrap(), "k3y-0f-sixteen-chars");
        let o = LaunchOptions {
            api_key_file: Some(p),
            ..Default::default()
        };
        assert_eq!(
            o.resolved_api_key().unwrap().as_deref(),
            Some("k3y-0f-sixteen-chars")
        );
        let p = write("crlf", "abc\r\n", 0o600);
        assert_eq!(read_api_key_file(&p).unwrap(), "abc");
        let p = write("empty", "\n", 0o600);
        assert!(read_api_key_file(&p).unwrap_err().reason.contains("empty"));
        #[cfg(unix)]
        {
            let p = write("shared", "k3y-0f-sixteen-chars\n", 0o644);
            let e = read_api_key_file(&p).unwrap_err();
            assert!(e.reason.contains("chmod 600"), "{e}");
        }
        let e = read_api_key_file(&dir.join("missing")).unwrap_err();
        assert!(e.reason.contains("cannot read"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn cors_origins_are_checked_and_passed() {
        for ok in [
            "*",
            "http://localhost:3000",
            "https://chat.example.com",
            "http://192.168.1.5:8080",
            "http://[::1]:8080",
        ] {
            check_cors_origin(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for bad in [
            "",
            "localhost:3000",
            "ftp://x.org",
            "https://x.org/",
            "https://x.org/path",
            "https://X.org",
            "https://x.org:0",
            "https://x.org:99999",
            "https://x.org:",
            "https://user@x.org",
            "https://",
            "null",
        ] {
            assert!(check_cors_origin(bad).is_err(), "{bad}");
        }
        let mut o = LaunchOptions {
            model: "/m".into(),
            cors_origins: vec!["https://a.example".into(), "http://localhost:5173".into()],
            ..Default::default()
        };
        o.validate().unwrap();
        let args = o.to_serve_args();
        let passed: Vec<_> = args
            .windows(2)
            .filter(|w| w[0] == "--cors-origin")
            .map(|w| w[1].clone())
            .collect();
        assert_eq!(passed, o.cors_origins);
        o.cors_origins.push("*".into());
        assert!(o.validate().unwrap_err().reason.contains("alone"));
        o.cors_origins = vec!["https://a.example/".into()];
        assert_eq!(o.validate().unwrap_err().option, "cors_origins");
        // Nothing is allowed cross-origin unless asked for.
        assert!(LaunchOptions::default().cors_origins.is_empty());
    }

    #[test]
    fn prefix_cache_choices_parse_and_pass() {
        assert_eq!(
            PrefixCacheChoice::parse("auto").unwrap(),
            PrefixCacheChoice::Auto
        );
        assert_eq!(
            PrefixCacheChoice::parse("off").unwrap(),
            PrefixCacheChoice::Off
        );
        // 0 is a size (no first-tier pool; the RAM tier carries the cache).
        for zero in ["0", "0MiB"] {
            assert_eq!(
                PrefixCacheChoice::parse(zero).unwrap(),
                PrefixCacheChoice::Bytes(0)
            );
        }
        assert_eq!(
            PrefixCacheChoice::parse("2GiB").unwrap(),
            PrefixCacheChoice::Bytes(2 << 30)
        );
        let e = PrefixCacheChoice::parse("lots").unwrap_err();
        assert_eq!(e.option, "prefix_cache");
        for c in [
            PrefixCacheChoice::Auto,
            PrefixCacheChoice::Off,
            PrefixCacheChoice::Bytes(0),
            PrefixCacheChoice::Bytes(123 << 20),
        ] {
            assert_eq!(PrefixCacheChoice::parse(&c.to_arg()).unwrap(), c);
            let o = LaunchOptions {
                model: "/m".into(),
                prefix_cache: c,
                prefix_cache_host: c,
                prefix_block: 512,
                ..Default::default()
            };
            let args = o.to_serve_args();
            let has = |flag: &str, v: &str| args.windows(2).any(|w| w[0] == flag && w[1] == v);
            assert!(has("--prefix-cache", &c.to_arg()));
            assert!(has("--prefix-cache-host", &c.to_arg()));
            assert!(has("--prefix-block", "512"));
            let back: LaunchOptions =
                serde_json::from_str(&serde_json::to_string(&o).unwrap()).unwrap();
            assert_eq!(back, o);
        }
    }

    #[test]
    fn prefix_block_and_host_tier_are_checked() {
        let base = LaunchOptions {
            model: "/m".into(),
            ..Default::default()
        };
        base.validate().unwrap();
        assert_eq!(base.prefix_block, DEFAULT_PREFIX_BLOCK);
        for bad in [0, 100, 32] {
            let o = LaunchOptions {
                prefix_block: bad,
                ..base.clone()
            };
            assert_eq!(o.validate().unwrap_err().option, "prefix_block");
        }
        // A sized RAM tier with the cache off is contradictory; auto or off
        // with it is not (nothing is allocated).
        let o = LaunchOptions {
            prefix_cache: PrefixCacheChoice::Off,
            prefix_cache_host: PrefixCacheChoice::Bytes(1 << 30),
            ..base.clone()
        };
        assert_eq!(o.validate().unwrap_err().option, "prefix_cache_host");
        for host in [PrefixCacheChoice::Auto, PrefixCacheChoice::Off] {
            let o = LaunchOptions {
                prefix_cache: PrefixCacheChoice::Off,
                prefix_cache_host: host,
                ..base.clone()
            };
            o.validate().unwrap();
        }
        // A file for a cache that is off holds nothing: refused. With the
        // cache on it goes to the runtime, and the launcher waits for the
        // save when it stops it.
        let filed = LaunchOptions {
            prefix_cache_file: Some("/tmp/p.krspc".into()),
            ..base.clone()
        };
        filed.validate().unwrap();
        let args = filed.to_serve_args();
        assert!(
            args.windows(2)
                .any(|w| w[0] == "--prefix-cache-file" && w[1] == "/tmp/p.krspc"),
            "{args:?}"
        );
        let base_grace = std::time::Duration::from_secs(10);
        assert_eq!(base.shutdown_grace(base_grace), base_grace);
        assert_eq!(
            filed.shutdown_grace(base_grace),
            base_grace + PREFIX_FILE_SAVE_LIMIT
        );
        let off = LaunchOptions {
            prefix_cache: PrefixCacheChoice::Off,
            ..filed
        };
        let e = off.validate().unwrap_err();
        assert_eq!(e.option, "prefix_cache_file");
        assert!(e.reason.contains("nothing to keep"), "{}", e.reason);
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
