//! GPUs through NVML. NVML is loaded dynamically, so a machine without the
//! NVIDIA driver gets a statement saying so rather than a crash.

use nvml_wrapper::Nvml;
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuInfo {
    pub index: u32,
    pub name: String,
    pub total_bytes: u64,
    pub free_bytes: u64,
    /// (major, minor), e.g. (9, 0) for Hopper.
    pub compute_capability: Option<(i32, i32)>,
    pub pcie_gen: Option<u32>,
    pub pcie_width: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum GpuReport {
    Found {
        driver_version: String,
        gpus: Vec<GpuInfo>,
    },
    /// No usable NVIDIA GPU, and why (no driver, no device, NVML error).
    Unavailable { reason: String },
}

impl GpuReport {
    pub fn gpus(&self) -> &[GpuInfo] {
        match self {
            GpuReport::Found { gpus, .. } => gpus,
            GpuReport::Unavailable { .. } => &[],
        }
    }
}

pub fn probe() -> GpuReport {
    let nvml = match Nvml::init() {
        Ok(n) => n,
        Err(e) => {
            return GpuReport::Unavailable {
                reason: format!(
                    "no NVIDIA driver found (NVML could not be loaded: {e}); only the CPU reference backend can run"
                ),
            };
        }
    };
    let driver_version = nvml
        .sys_driver_version()
        .unwrap_or_else(|e| format!("unknown ({e})"));
    let count = match nvml.device_count() {
        Ok(c) => c,
        Err(e) => {
            return GpuReport::Unavailable {
                reason: format!("NVML could not count GPUs: {e}"),
            };
        }
    };
    if count == 0 {
        return GpuReport::Unavailable {
            reason: format!("NVIDIA driver {driver_version} is installed but reports no GPU"),
        };
    }
    let mut gpus = Vec::new();
    for index in 0..count {
        let Ok(d) = nvml.device_by_index(index) else {
            continue;
        };
        let mem = d.memory_info().ok();
        gpus.push(GpuInfo {
            index,
            name: d.name().unwrap_or_else(|_| "unknown GPU".into()),
            total_bytes: mem.as_ref().map_or(0, |m| m.total),
            free_bytes: mem.as_ref().map_or(0, |m| m.free),
            compute_capability: d.cuda_compute_capability().ok().map(|c| (c.major, c.minor)),
            pcie_gen: d.current_pcie_link_gen().ok(),
            pcie_width: d.current_pcie_link_width().ok(),
        });
    }
    GpuReport::Found {
        driver_version,
        gpus,
    }
}
