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

use crate::runtime::{RuntimeClient, RuntimeFacts};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Hardware {
    pub gpus: GpuReport,
    pub host: HostInfo,
}

/// Source of hardware and model facts.
pub trait Probe {
    fn hardware(&self) -> Hardware;
    /// Every model directory found, with the runtime's facts about it.
    fn models(&self) -> Vec<ModelInfo>;
    /// The runtime's model facts and memory plans, kept by front ends that
    /// re-inspect a model (after a cache build) or plan a launch later.
    fn facts(&self) -> Arc<dyn RuntimeFacts>;
}

/// Probes the real machine and the model roots it was given; model facts
/// come from `krasis-runtime inspect`.
pub struct SystemProbe {
    pub roots: Vec<ModelRoot>,
    /// Expert cache root to check (None: the platform cache directory).
    pub cache_root: Option<PathBuf>,
    pub runtime: Arc<RuntimeClient>,
}

impl SystemProbe {
    /// The standard roots (./models, the Hugging Face hub cache, the Krasis
    /// data dir) plus the user's own; `runtime` is `--runtime` if given
    /// (else the runtime next to `krasis`, else on PATH).
    pub fn new(data_models: PathBuf, extra: &[PathBuf], runtime: Option<&Path>) -> Self {
        SystemProbe {
            roots: models::default_roots(data_models, extra),
            cache_root: None,
            runtime: Arc::new(RuntimeClient {
                runtime: crate::runtime::locate(runtime).map_err(|e| e.to_string()),
            }),
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
        models::with_facts(
            models::discover(&self.roots),
            self.runtime.as_ref(),
            self.cache_root.as_deref(),
        )
    }
    fn facts(&self) -> Arc<dyn RuntimeFacts> {
        self.runtime.clone()
    }
}
