//! Where the launcher keeps things: profiles in the platform config dir, the
//! demo model and user models in the platform data dir. Both can be moved with
//! the typed `--config-dir` / `--data-dir` flags (tests and portable installs).

use directories::ProjectDirs;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dirs {
    pub config: PathBuf,
    pub data: PathBuf,
}

impl Dirs {
    /// Platform defaults, overridden by the given directories.
    pub fn resolve(config: Option<&Path>, data: Option<&Path>) -> Result<Self, String> {
        let project = ProjectDirs::from("", "", "krasis");
        let pick = |given: Option<&Path>, what: &str, f: fn(&ProjectDirs) -> &Path| {
            given
                .map(Path::to_path_buf)
                .or_else(|| project.as_ref().map(|p| f(p).to_path_buf()))
                .ok_or_else(|| {
                    format!("cannot determine the {what} directory (no home directory); pass --{what}-dir")
                })
        };
        Ok(Dirs {
            config: pick(config, "config", ProjectDirs::config_dir)?,
            data: pick(data, "data", ProjectDirs::data_dir)?,
        })
    }
    pub fn profiles(&self) -> PathBuf {
        self.config.join("profiles")
    }
    pub fn models(&self) -> PathBuf {
        self.data.join("models")
    }
    pub fn demo_model(&self) -> PathBuf {
        self.models().join("krasis-demo-tiny")
    }
}
