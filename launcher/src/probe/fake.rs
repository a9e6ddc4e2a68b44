//! Fake hardware, models and runtime facts for tests (no GPU, no files, no
//! runtime process).

use super::*;
use crate::runtime::RuntimeFacts;
use krasis_common::inspect::{
    BackendFormat, CacheState, Formats, GeometryFacts, HeatmapState, ModelFacts, ModelReport,
    ParamCounts,
};
use krasis_common::plan::{
    DeviceBudget, ExpertPlan, GpuPlan, HostPlan, Placement, Plan, PlanItem, Verdict,
};
use krasis_common::{Backend, PROTOCOL_VERSION};
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Qwen3-30B-A3B's INT4 expert stride (4-bit + f16 scales per 128).
pub const A3B_STRIDE: u64 = 2_433_024;
pub const A3B_PATH: &str = "/models/Qwen3-30B-A3B";

/// What `krasis-runtime inspect` reports for Qwen3-30B-A3B (figures from
/// the real config), with the cache in `cache`.
pub fn a3b_facts(cache: CacheState) -> ModelFacts {
    let experts = 48 * 128;
    ModelFacts {
        path: A3B_PATH.into(),
        model_type: "qwen3_moe".into(),
        geometry: GeometryFacts {
            vocab_size: 151_936,
            hidden_size: 2048,
            num_layers: 48,
            moe_layers: 48,
            num_experts: 128,
            experts_per_token: 8,
            num_attention_heads: 32,
            num_kv_heads: 4,
            head_dim: 128,
            moe_intermediate_size: 768,
            intermediate_size: 6144,
            max_position_embeddings: 40960,
            tie_word_embeddings: false,
        },
        params: ParamCounts {
            total: 30_532_122_624,
            routed_experts: 28_991_029_248,
            active_per_token: 3_353_032_704,
        },
        formats: Formats {
            checkpoint_dtype: "bf16".into(),
            int4_expert_stride: A3B_STRIDE,
            int4_expert_bytes: A3B_STRIDE * experts,
            checkpoint_expert_bytes: 28_991_029_248 * 2,
            backends: vec![
                BackendFormat {
                    backend: Backend::Cuda,
                    experts: "int4".into(),
                    expert_source: "INT4 expert cache".into(),
                    compute: "bf16".into(),
                    kv: "bf16".into(),
                },
                BackendFormat {
                    backend: Backend::Reference,
                    experts: "bf16".into(),
                    expert_source: "checkpoint".into(),
                    compute: "f32".into(),
                    kv: "f32".into(),
                },
            ],
        },
        heatmap: HeatmapState::Unavailable {
            reason: "the expert cache is not built yet".into(),
        },
        cache,
    }
}

pub fn missing_cache() -> CacheState {
    CacheState::Missing {
        path: "/cache/experts/x/experts-int4-v1.kcache".into(),
    }
}

/// A model shaped like Qwen3-30B-A3B, its cache not built.
pub fn a3b() -> ModelSummary {
    ModelSummary::from_facts(a3b_facts(missing_cache()))
}

/// A runtime that answers `inspect` and `plan` from fixed facts and
/// counts how often it was asked.
pub struct FakeFacts {
    /// The a3b cache state `inspect` reports (tests change it to mimic a
    /// cache build).
    pub cache: Mutex<CacheState>,
    pub inspects: AtomicUsize,
    pub plans: AtomicUsize,
}

impl Default for FakeFacts {
    fn default() -> Self {
        FakeFacts {
            cache: Mutex::new(missing_cache()),
            inspects: AtomicUsize::new(0),
            plans: AtomicUsize::new(0),
        }
    }
}

fn arg<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    let i = args.iter().position(|a| a == flag)?;
    args.get(i + 1).map(|s| s.as_str())
}

impl RuntimeFacts for FakeFacts {
    fn inspect(&self, dirs: &[PathBuf], _: Option<&Path>) -> Result<Vec<ModelReport>, String> {
        self.inspects.fetch_add(1, Ordering::SeqCst);
        let cache = self.cache.lock().unwrap().clone();
        Ok(dirs
            .iter()
            .map(|d| {
                if d == Path::new(A3B_PATH) {
                    ModelReport::Ok(a3b_facts(cache.clone()))
                } else {
                    ModelReport::Error {
                        path: d.clone(),
                        reason: "model_type 'llama' is not supported".into(),
                    }
                }
            })
            .collect())
    }

    /// A plan with a3b's real fixed sizes at 32k context (weights 2.3 GiB,
    /// KV 3 GiB) and the runtime's fit rule; enough for screens.
    fn plan(&self, args: &[String]) -> Result<Plan, String> {
        self.plans.fetch_add(1, Ordering::SeqCst);
        let backend =
            Backend::parse(arg(args, "--backend").unwrap_or("cuda")).map_err(|e| e.reason)?;
        let context: u64 = arg(args, "--context-length").map_or(40960, |c| c.parse().unwrap());
        let all = A3B_STRIDE * 48 * 128;
        let (host, gpu) = match backend {
            Backend::Reference => (
                vec![PlanItem::exact(
                    "routed experts from the checkpoint (bf16, memory-mapped)",
                    28_991_029_248 * 2,
                )],
                None,
            ),
            Backend::Cuda => {
                let size = |f: &str| arg(args, f).map(|v| crate::units::parse_size(v).unwrap());
                let free = size("--device-free");
                let budget = match (free, size("--vram-limit")) {
                    (Some(f), Some(l)) => Some(f.min(l)),
                    (f, _) => f,
                };
                let items = vec![
                    PlanItem::exact("non-expert weights (bf16)", 2_464_000_000),
                    PlanItem::exact("KV cache (bf16)", 2 * 48 * 512 * context * 2),
                ];
                let fixed: u64 = items.iter().map(|i| i.bytes).sum();
                let floor = context * 2048 * 4 + (600 << 20);
                let on_gpu = budget.map_or(0, |b| {
                    (b.saturating_sub(fixed + floor) / A3B_STRIDE).min(48 * 128)
                });
                let verdict = match budget {
                    None => Verdict::Unknown {
                        reason: "no GPU".into(),
                    },
                    Some(b) if fixed + floor > b => Verdict::DoesNotFit {
                        reason: "the fixed allocations need more than the budget".into(),
                    },
                    Some(_) => Verdict::Fits,
                };
                let gpu = GpuPlan {
                    device: match budget {
                        Some(b) => DeviceBudget::Known {
                            source: "given".into(),
                            free_bytes: free.unwrap_or(0),
                            total_bytes: None,
                            budget_bytes: b,
                        },
                        None => DeviceBudget::Unknown {
                            reason: "no GPU".into(),
                        },
                    },
                    items,
                    fixed_bytes: fixed,
                    prefill_chunk: 8192,
                    transient: PlanItem {
                        name: "transient (prompt hidden states)".into(),
                        bytes: context * 2048 * 4,
                        estimate: true,
                    },
                    safety_margin_bytes: 600 << 20,
                    experts: ExpertPlan {
                        placement: Placement::Hcs,
                        total_experts: 48 * 128,
                        expert_stride: A3B_STRIDE,
                        all_bytes: all,
                        on_gpu_experts: on_gpu,
                        on_gpu_bytes: on_gpu * A3B_STRIDE,
                    },
                    verdict,
                };
                (
                    vec![PlanItem::exact("the INT4 expert cache", all)],
                    Some(gpu),
                )
            }
        };
        Ok(Plan {
            protocol_version: PROTOCOL_VERSION,
            model: arg(args, "--model").unwrap_or("").into(),
            backend,
            context_length: context,
            host: HostPlan {
                total_bytes: host.iter().map(|i| i.bytes).sum(),
                items: host,
            },
            gpu,
            notes: Vec::new(),
            warnings: Vec::new(),
        })
    }
}

pub struct FakeProbe {
    pub gpu: bool,
}

impl FakeProbe {
    fn found() -> Vec<models::FoundDir> {
        vec![
            models::FoundDir {
                path: A3B_PATH.into(),
                name: "Qwen/Qwen3-30B-A3B".into(),
                root: models::RootKind::HfHub,
            },
            models::FoundDir {
                path: "/models/llama".into(),
                name: "llama-3".into(),
                root: models::RootKind::Local,
            },
        ]
    }
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
        models::with_facts(Self::found(), &FakeFacts::default(), None)
    }
    fn facts(&self) -> Arc<dyn RuntimeFacts> {
        Arc::new(FakeFacts::default())
    }
}
