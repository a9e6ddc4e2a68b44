//! What this machine has: GPUs (NVML), host RAM and CPU (sysinfo) and the
//! models found on disk. Front ends use the [`Probe`] trait so tests can feed
//! fake hardware and models; [`SystemProbe`] is the real one.

#[cfg(test)]
pub mod fake;
pub mod gpu;
pub mod host;
pub mod models;
pub mod report;
pub mod report_text;

pub use gpu::{GpuInfo, GpuReport};
pub use host::HostInfo;
pub use models::{CacheStatus, ModelInfo, ModelRoot, ModelSummary};

use serde::Serialize;
use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Hardware {
    pub gpus: GpuReport,
    pub host: HostInfo,
}

/// Source of hardware and model facts.
pub trait Probe {
    fn hardware(&self) -> Hardware;
    fn models(&self) -> Vec<ModelInfo>;
}

/// Probes the real machine and the model roots it was given.
pub struct SystemProbe {
    pub roots: Vec<ModelRoot>,
    /// Expert cache root to check (None: the platform cache directory).
    pub cache_root: Option<PathBuf>,
}

impl SystemProbe {
    /// The standard roots (./models, the Hugging Face hub cache, the Krasis
    /// data dir) plus the user's own.
    pub fn new(data_models: PathBuf, extra: &[PathBuf]) -> Self {
        SystemProbe {
            roots: models::default_roots(data_models, extra),
            cache_root: None,
        }
    }
}

impl Probe for SystemProbe {
    fn hardware(&self) -> Hardware {
        Hardware {
            gpus: gpu::probe(),
            host: host::probe(),
        }
    }
    fn models(&self) -> Vec<ModelInfo> {
        models::discover(&self.roots, self.cache_root.as_deref())
    }
}
