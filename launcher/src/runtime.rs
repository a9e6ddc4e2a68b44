//! Finding the `krasis-runtime` binary and asking it what it implements.

use krasis_common::{Capabilities, PROTOCOL_VERSION};
use std::path::{Path, PathBuf};
use std::process::Command;

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

#[cfg(test)]
pub mod tests {
    use super::*;

    /// What this build's runtime reports, with or without a usable GPU.
    pub fn fake_caps(cuda: bool) -> Capabilities {
        let reason = if cuda {
            Ok(())
        } else {
            Err("no NVIDIA driver".into())
        };
        Capabilities::of_this_build("0.1.0", reason)
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
    }

    #[test]
    fn missing_override_is_refused() {
        let e = locate(Some(Path::new("/nonexistent/krasis-runtime"))).unwrap_err();
        assert!(e.to_string().contains("--runtime"));
    }
}
