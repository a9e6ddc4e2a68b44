//! The capability report: what this runtime build implements. Printed by
//! `krasis-runtime capabilities --json`; the launcher offers only what is in it.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Capabilities {
    pub protocol_version: u32,
    pub runtime_version: String,
    /// Backends compiled in, and whether each can run on this machine now.
    pub backends: Vec<BackendCaps>,
    pub architectures: Vec<ArchitectureCaps>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BackendCaps {
    pub name: String,
    pub available: bool,
    /// Why it is unavailable (no driver, no GPU, ...), when it is.
    pub reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArchitectureCaps {
    /// Hugging Face `model_type`, e.g. `qwen3_moe`.
    pub model_type: String,
    pub expert_precisions: Vec<String>,
    pub attention_precisions: Vec<String>,
    pub kv_formats: Vec<String>,
    pub hcs: bool,
    pub pruning_modes: Vec<String>,
    pub multi_gpu_modes: Vec<String>,
    pub defaults: ArchitectureDefaults,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArchitectureDefaults {
    pub expert_precision: String,
    pub attention_precision: String,
    pub kv_format: String,
    pub pruning: String,
    pub multi_gpu: String,
}

impl Capabilities {
    pub fn architecture(&self, model_type: &str) -> Option<&ArchitectureCaps> {
        self.architectures
            .iter()
            .find(|a| a.model_type == model_type)
    }
    pub fn backend(&self, name: &str) -> Option<&BackendCaps> {
        self.backends.iter().find(|b| b.name == name)
    }
}
