//! Fake hardware and models for tests (no GPU, no files).

use super::*;

/// A model shaped like Qwen3-30B-A3B.
pub fn a3b() -> ModelSummary {
    let g = krasis_model::synth::preset_geometry("a3b").expect("a3b is a preset");
    let stride = krasis_cache::ExpertLayout::new(2048, 768)
        .unwrap()
        .expert_stride as u64;
    ModelSummary {
        model_type: "qwen3_moe".into(),
        total_params: g.total_params(),
        routed_expert_params: g.routed_expert_params(),
        num_layers: 48,
        moe_layers: 48,
        num_experts: 128,
        top_k: 8,
        max_position_embeddings: 40960,
        int4_expert_stride: stride,
        int4_expert_bytes: stride * 48 * 128,
        source_expert_bytes: g.routed_expert_params() * 2,
        source_dtype: "bfloat16".into(),
        cache: CacheStatus::Missing {
            path: "/cache/experts/x/experts-int4-v1.kcache".into(),
        },
        geometry: g,
    }
}

pub struct FakeProbe {
    pub gpu: bool,
}

impl Probe for FakeProbe {
    fn hardware(&self) -> Hardware {
        Hardware {
            gpus: if self.gpu {
                GpuReport::Found {
                    driver_version: "580.00".into(),
                    gpus: vec![GpuInfo {
                        index: 0,
                        name: "Fake RTX 4090".into(),
                        total_bytes: 24 << 30,
                        free_bytes: 23 << 30,
                        compute_capability: Some((8, 9)),
                        pcie_gen: Some(4),
                        pcie_width: Some(16),
                    }],
                }
            } else {
                GpuReport::Unavailable {
                    reason: "no NVIDIA driver found".into(),
                }
            },
            host: HostInfo {
                total_ram_bytes: 64 << 30,
                available_ram_bytes: 60 << 30,
                cpu_brand: "Fake CPU".into(),
                logical_cpus: 16,
                physical_cores: Some(8),
                os: "FakeOS".into(),
            },
        }
    }
    fn models(&self) -> Vec<ModelInfo> {
        vec![
            ModelInfo {
                path: "/models/Qwen3-30B-A3B".into(),
                name: "Qwen/Qwen3-30B-A3B".into(),
                root: models::RootKind::HfHub,
                summary: Ok(a3b()),
            },
            ModelInfo {
                path: "/models/llama".into(),
                name: "llama-3".into(),
                root: models::RootKind::Local,
                summary: Err("model_type 'llama' is not supported".into()),
            },
        ]
    }
}
