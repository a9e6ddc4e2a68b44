//! Finding the `krasis-runtime` binary and asking it what it implements
//! (`capabilities`), what a model directory holds (`inspect`) and how a
//! launch would place memory (`plan`). The runtime is the one authority on
//! those facts; the launcher never reads configs or caches itself.

use krasis_common::{Backend, Capabilities, InspectReport, LaunchOptions, PROTOCOL_VERSION, Plan};
use krasis_common::{ModelReport, size::format_size_exact};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

pub const RUNTIME_NAME: &str = if cfg!(windows) {
    "krasis-runtime.exe"
} else {
    "krasis-runtime"
};

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(
        "krasis-runtime was not found next to {exe} or on PATH; install it alongside krasis (installer/install.sh) or pass --runtime PATH"
    )]
    NotFound { exe: String },
    #[error("--runtime {0} does not exist or is not a file")]
    BadOverride(PathBuf),
    #[error("could not run {path} capabilities: {source}")]
    Spawn {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} capabilities --json failed ({status}): {stderr}")]
    Failed {
        path: PathBuf,
        status: String,
        stderr: String,
    },
    #[error("{path} printed a capability report this launcher cannot read: {reason}")]
    BadReport { path: PathBuf, reason: String },
    #[error(
        "{path} speaks protocol {theirs}, this launcher speaks {PROTOCOL_VERSION}; install matching krasis and krasis-runtime"
    )]
    Protocol { path: PathBuf, theirs: u32 },
}

/// `--runtime` if given, else next to the running `krasis`, else PATH.
pub fn locate(override_path: Option<&Path>) -> Result<PathBuf, RuntimeError> {
    if let Some(p) = override_path {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(RuntimeError::BadOverride(p.to_path_buf()))
        };
    }
    let exe = std::env::current_exe().ok();
    if let Some(dir) = exe.as_deref().and_then(Path::parent) {
        let c = dir.join(RUNTIME_NAME);
        if c.is_file() {
            return Ok(c);
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let c = dir.join(RUNTIME_NAME);
            if c.is_file() {
                return Ok(c);
            }
        }
    }
    Err(RuntimeError::NotFound {
        exe: exe.map_or_else(|| "krasis".into(), |e| e.display().to_string()),
    })
}

/// Runs `RUNTIME capabilities --json` and checks the protocol version.
pub fn capabilities(runtime: &Path) -> Result<Capabilities, RuntimeError> {
    let out = crate::supervisor::retry_busy(|| {
        Command::new(runtime)
            .args(["capabilities", "--json"])
            .output()
    })
    .map_err(|source| RuntimeError::Spawn {
        path: runtime.to_path_buf(),
        source,
    })?;
    if !out.status.success() {
        return Err(RuntimeError::Failed {
            path: runtime.to_path_buf(),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    parse_report(runtime, &out.stdout)
}

pub fn parse_report(runtime: &Path, stdout: &[u8]) -> Result<Capabilities, RuntimeError> {
    // The version first: a runtime of another protocol may report a shape
    // this launcher cannot parse, and the user should read "install matching
    // versions", not a missing-field error.
    #[derive(serde::Deserialize)]
    struct Version {
        protocol_version: u32,
    }
    if let Ok(v) = serde_json::from_slice::<Version>(stdout)
        && v.protocol_version != PROTOCOL_VERSION
    {
        return Err(RuntimeError::Protocol {
            path: runtime.to_path_buf(),
            theirs: v.protocol_version,
        });
    }
    let caps: Capabilities =
        serde_json::from_slice(stdout).map_err(|e| RuntimeError::BadReport {
            path: runtime.to_path_buf(),
            reason: e.to_string(),
        })?;
    if caps.protocol_version != PROTOCOL_VERSION {
        return Err(RuntimeError::Protocol {
            path: runtime.to_path_buf(),
            theirs: caps.protocol_version,
        });
    }
    Ok(caps)
}

/// Model facts and memory plans from the runtime. Behind a trait so the
/// TUI's tests use fakes (`probe::fake`).
pub trait RuntimeFacts: Send + Sync {
    /// One entry per directory, in order (`krasis-runtime inspect`).
    fn inspect(
        &self,
        dirs: &[PathBuf],
        cache_dir: Option<&Path>,
    ) -> Result<Vec<ModelReport>, String>;
    /// The plan for `krasis-runtime plan ARGS` (see [`plan_args`]).
    fn plan(&self, args: &[String]) -> Result<Plan, String>;
}

/// Runs `krasis-runtime ARGS --json` and parses its report.
fn run_json<T: serde::de::DeserializeOwned>(runtime: &Path, args: &[String]) -> Result<T, String> {
    let what = args.first().map_or("", |s| s.as_str());
    let out = crate::supervisor::retry_busy(|| {
        Command::new(runtime)
            .args(args)
            .arg("--json")
            .env("KRASIS_LOG", "error")
            .output()
    })
    .map_err(|e| format!("could not run {} {what}: {e}", runtime.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} {what} failed: {}",
            runtime.display(),
            String::from_utf8_lossy(&out.stderr)
                .trim()
                .trim_start_matches("error: ")
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "{} {what} printed a report this launcher cannot read: {e}",
            runtime.display()
        )
    })
}

/// The real runtime binary (or why there is none).
pub struct RuntimeClient {
    pub runtime: Result<PathBuf, String>,
}

impl RuntimeFacts for RuntimeClient {
    fn inspect(
        &self,
        dirs: &[PathBuf],
        cache_dir: Option<&Path>,
    ) -> Result<Vec<ModelReport>, String> {
        let rt = self.runtime.as_ref().map_err(|e| e.clone())?;
        if dirs.is_empty() {
            return Ok(Vec::new());
        }
        let mut args = vec!["inspect".to_string()];
        for d in dirs {
            args.push("--model".into());
            args.push(d.display().to_string());
        }
        if let Some(c) = cache_dir {
            args.push("--cache-dir".into());
            args.push(c.display().to_string());
        }
        let r: InspectReport = run_json(rt, &args)?;
        if r.protocol_version != PROTOCOL_VERSION {
            return Err(format!(
                "{} speaks protocol {}, this launcher speaks {PROTOCOL_VERSION}; install matching krasis and krasis-runtime",
                rt.display(),
                r.protocol_version
            ));
        }
        if r.models.len() != dirs.len() {
            return Err(format!(
                "{} inspect answered for {} of {} directories",
                rt.display(),
                r.models.len(),
                dirs.len()
            ));
        }
        Ok(r.models)
    }

    fn plan(&self, args: &[String]) -> Result<Plan, String> {
        let rt = self.runtime.as_ref().map_err(|e| e.clone())?;
        let p: Plan = run_json(rt, args)?;
        if p.protocol_version != PROTOCOL_VERSION {
            return Err(format!(
                "{} speaks protocol {}, this launcher speaks {PROTOCOL_VERSION}",
                rt.display(),
                p.protocol_version
            ));
        }
        Ok(p)
    }
}

/// `krasis-runtime plan` arguments for `opts` on a device with `device`
/// (free, total) bytes as the launcher's probe measured them (so planning
/// never creates a CUDA context next to a running engine). The engine
/// flags are the ones `serve` gets for the same options.
pub fn plan_args(opts: &LaunchOptions, device: Option<(u64, u64)>) -> Vec<String> {
    let mut a = vec![
        "plan".to_string(),
        "--model".into(),
        opts.model.display().to_string(),
        "--backend".into(),
        opts.backend.as_str().into(),
    ];
    if let Some(c) = opts.context_length {
        a.push("--context-length".into());
        a.push(c.to_string());
    }
    if let Some(t) = opts.kv_tokens {
        a.push("--kv-tokens".into());
        a.push(t.to_string());
    }
    if let Some(n) = opts.parallel {
        a.push("--parallel".into());
        a.push(n.to_string());
    }
    if opts.backend == Backend::Cuda {
        a.extend([
            "--safety-margin-mib".into(),
            opts.safety_margin_mib.to_string(),
            "--hcs".into(),
            if opts.hcs { "on" } else { "off" }.into(),
            "--heatmap".into(),
            opts.heatmap.to_arg(),
            "--gpu".into(),
            opts.gpu.to_string(),
            "--prefix-cache".into(),
            opts.prefix_cache.to_arg(),
            "--prefix-cache-host".into(),
            opts.prefix_cache_host.to_arg(),
            "--prefix-block".into(),
            opts.prefix_block.to_string(),
        ]);
        if let Some(v) = opts.vram_limit_bytes {
            a.push("--vram-limit".into());
            a.push(format_size_exact(v));
        }
        if let Some(d) = &opts.cache_dir {
            a.push("--cache-dir".into());
            a.push(d.display().to_string());
        }
        if let Some((free, total)) = device {
            a.push("--device-free".into());
            a.push(free.to_string());
            a.push("--device-total".into());
            a.push(total.to_string());
        }
    }
    a
}

/// Plans remembered per argument list, so a screen drawn many times a
/// second asks the runtime once per (model, options).
pub struct PlanCache {
    plans: Mutex<HashMap<Vec<String>, Result<Plan, String>>>,
}

impl Default for PlanCache {
    fn default() -> Self {
        PlanCache {
            plans: Mutex::new(HashMap::new()),
        }
    }
}

impl PlanCache {
    pub fn get(&self, facts: &dyn RuntimeFacts, args: Vec<String>) -> Result<Plan, String> {
        let mut m = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        m.entry(args).or_insert_with_key(|a| facts.plan(a)).clone()
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;

    /// What this build's runtime reports, with or without a usable GPU. The
    /// architectures are the runtime registry's, recorded in common's fixture
    /// (a runtime test keeps it current); the launcher has no list of its own.
    pub fn fake_caps(cuda: bool) -> Capabilities {
        let reason = if cuda {
            Ok(())
        } else {
            Err("no NVIDIA driver".into())
        };
        let architectures =
            serde_json::from_str(include_str!("../../common/fixtures/architectures.json"))
                .expect("common/fixtures/architectures.json parses");
        let mut c = Capabilities::new("0.1.0", reason, architectures);
        // As the runtime reports its engines (`runtime/src/cmd/capabilities.rs`):
        // both engines batch 8 requests and take a KV budget.
        c.set_batching(Backend::Reference, 8, true);
        c.set_batching(Backend::Cuda, 8, true);
        c
    }

    #[test]
    fn reports_are_parsed_and_protocol_checked() {
        let c = fake_caps(true);
        let json = serde_json::to_vec(&c).unwrap();
        assert_eq!(parse_report(Path::new("rt"), &json).unwrap(), c);
        let mut old = c.clone();
        old.protocol_version += 1;
        let json = serde_json::to_vec(&old).unwrap();
        assert!(matches!(
            parse_report(Path::new("rt"), &json),
            Err(RuntimeError::Protocol { .. })
        ));
        assert!(parse_report(Path::new("rt"), b"not json").is_err());
        // A runtime of the previous protocol, whose report lacks fields this
        // one needs, is told apart by its version, not by a parse error.
        let old = br#"{"protocol_version": 1, "version": "0.0.9"}"#;
        assert!(matches!(
            parse_report(Path::new("rt"), old),
            Err(RuntimeError::Protocol { theirs: 1, .. })
        ));
    }

    #[test]
    fn missing_override_is_refused() {
        let e = locate(Some(Path::new("/nonexistent/krasis-runtime"))).unwrap_err();
        assert!(e.to_string().contains("--runtime"));
    }
}
