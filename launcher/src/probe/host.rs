//! Host RAM and CPU through sysinfo (works on Linux, Windows and macOS).

use serde::Serialize;
use sysinfo::{CpuRefreshKind, MemoryRefreshKind, RefreshKind, System};

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HostInfo {
    pub total_ram_bytes: u64,
    pub available_ram_bytes: u64,
    pub cpu_brand: String,
    pub logical_cpus: usize,
    pub physical_cores: Option<usize>,
    pub os: String,
}

pub fn probe() -> HostInfo {
    let sys = System::new_with_specifics(
        RefreshKind::nothing()
            .with_memory(MemoryRefreshKind::nothing().with_ram())
            .with_cpu(CpuRefreshKind::nothing()),
    );
    HostInfo {
        total_ram_bytes: sys.total_memory(),
        available_ram_bytes: sys.available_memory(),
        cpu_brand: sys
            .cpus()
            .first()
            .map(|c| c.brand().trim().to_string())
            .filter(|b| !b.is_empty())
            .unwrap_or_else(|| "unknown CPU".into()),
        logical_cpus: sys.cpus().len(),
        physical_cores: System::physical_core_count(),
        os: System::long_os_version().unwrap_or_else(|| std::env::consts::OS.into()),
    }
}
