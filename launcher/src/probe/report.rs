//! The output of `krasis probe`, as its own types. `krasis probe --json` is
//! read by scripts, so its shape is a contract (documented in
//! `docs/probe-json.md`, checked against that document by the schema test):
//! it is mapped here, field by field, from the internal probe types, so a
//! refactor of those never changes what scripts see. The text form is
//! rendered from the same report (`report_text.rs`), so the two never
//! disagree.
//!
//! Conventions: snake_case keys; every key is always present (a value that
//! does not apply is `null`, a list that does not apply is `[]`); anything
//! that can fail has a `status` string and a `reason`; paths are strings;
//! sizes are bytes. Bump [`SCHEMA`] when a key is removed, renamed or changes
//! type; adding a key keeps the number.

use super::models::{CacheStatus, RootKind};
use super::{GpuReport, Hardware, ModelInfo, ModelRoot};
use krasis_common::Capabilities;
use serde::Serialize;
use std::path::Path;

/// Version of the `krasis probe --json` shape.
pub const SCHEMA: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProbeReport {
    pub schema: u32,
    pub krasis_version: String,
    pub gpus: Gpus,
    pub host: Host,
    pub model_roots: Vec<Root>,
    pub models: Vec<Model>,
    pub runtime: Runtime,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuStatus {
    Found,
    Unavailable,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Gpus {
    pub status: GpuStatus,
    /// Why no GPU can be used (`unavailable` only).
    pub reason: Option<String>,
    pub driver_version: Option<String>,
    pub devices: Vec<Gpu>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Gpu {
    pub index: u32,
    pub name: String,
    pub total_bytes: u64,
    pub free_bytes: u64,
    /// "major.minor", e.g. "9.0" for Hopper.
    pub compute_capability: Option<String>,
    pub pcie_generation: Option<u32>,
    pub pcie_width: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Host {
    pub total_ram_bytes: u64,
    pub available_ram_bytes: u64,
    pub cpu: String,
    pub logical_cpus: u64,
    pub physical_cores: Option<u64>,
    pub os: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RootKindName {
    Local,
    HfHub,
    KrasisData,
    User,
}

impl From<RootKind> for RootKindName {
    fn from(k: RootKind) -> Self {
        match k {
            RootKind::Local => RootKindName::Local,
            RootKind::HfHub => RootKindName::HfHub,
            RootKind::KrasisData => RootKindName::KrasisData,
            RootKind::User => RootKindName::User,
        }
    }
}

impl RootKindName {
    /// Where this root comes from, in words.
    pub fn describe(self) -> &'static str {
        match self {
            RootKindName::Local => "under the working directory",
            RootKindName::HfHub => "Hugging Face cache",
            RootKindName::KrasisData => "Krasis data directory; the demo model lives here",
            RootKindName::User => "given with --model-root",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Root {
    pub path: String,
    pub kind: RootKindName,
    pub exists: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelStatus {
    /// Readable and of an architecture the launcher understands.
    Ok,
    /// Found, but cannot be served; `reason` says why.
    Unusable,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Model {
    pub name: String,
    pub path: String,
    pub root: RootKindName,
    pub status: ModelStatus,
    pub reason: Option<String>,
    /// `null` when the model is unusable.
    pub facts: Option<ModelFacts>,
    /// `null` when the model is unusable.
    pub cache: Option<Cache>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelFacts {
    /// Hugging Face `model_type`, e.g. `qwen3_moe`.
    pub model_type: String,
    pub total_params: u64,
    pub routed_expert_params: u64,
    pub num_layers: u64,
    pub moe_layers: u64,
    pub num_experts: u64,
    pub experts_per_token: u64,
    pub max_position_embeddings: u64,
    /// The checkpoint's weight dtype, e.g. `bfloat16`.
    pub source_dtype: String,
    /// All routed experts in the checkpoint's own precision.
    pub source_expert_bytes: u64,
    /// All routed experts in the expert cache (its INT4 or MXFP4 format).
    pub int4_expert_bytes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheState {
    /// Built from this checkpoint.
    Valid,
    /// Present but unusable (stale, damaged); rebuilt on launch.
    Invalid,
    /// Only an older format's cache: launching refuses it until the
    /// rebuild command in `reason` has run.
    OldFormat,
    /// Not built yet.
    Missing,
    /// The checkpoint could not be checked.
    Unknown,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Cache {
    pub status: CacheState,
    pub path: Option<String>,
    pub bytes: Option<u64>,
    pub reason: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RuntimeStatus {
    Ok,
    /// Not found, or it did not answer `capabilities --json`.
    Error,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Runtime {
    pub status: RuntimeStatus,
    pub reason: Option<String>,
    pub path: Option<String>,
    pub version: Option<String>,
    pub protocol_version: Option<u32>,
    pub backends: Vec<Backend>,
    pub architectures: Vec<Architecture>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Backend {
    pub name: String,
    pub available: bool,
    pub reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Architecture {
    pub model_type: String,
    pub expert_precisions: Vec<String>,
    pub attention_precisions: Vec<String>,
    pub kv_formats: Vec<String>,
    pub mlp_precisions: Vec<String>,
    pub pruning_modes: Vec<String>,
    pub hcs: bool,
}

/// What asking for the runtime gave: its path and capabilities, or why not
/// (with the path when it was found but did not answer).
pub type RuntimeFacts =
    Result<(std::path::PathBuf, Capabilities), (Option<std::path::PathBuf>, String)>;

fn path_text(p: &Path) -> String {
    p.display().to_string()
}

pub fn build(
    hw: &Hardware,
    roots: &[ModelRoot],
    models: &[ModelInfo],
    runtime: &RuntimeFacts,
) -> ProbeReport {
    ProbeReport {
        schema: SCHEMA,
        krasis_version: env!("CARGO_PKG_VERSION").to_string(),
        gpus: gpus(&hw.gpus),
        host: Host {
            total_ram_bytes: hw.host.total_ram_bytes,
            available_ram_bytes: hw.host.available_ram_bytes,
            cpu: hw.host.cpu_brand.clone(),
            logical_cpus: hw.host.logical_cpus as u64,
            physical_cores: hw.host.physical_cores.map(|c| c as u64),
            os: hw.host.os.clone(),
        },
        model_roots: roots
            .iter()
            .map(|r| Root {
                path: path_text(&r.path),
                kind: r.kind.into(),
                exists: r.path.is_dir(),
            })
            .collect(),
        models: models.iter().map(model_entry).collect(),
        runtime: runtime_entry(runtime),
    }
}

fn gpus(g: &GpuReport) -> Gpus {
    match g {
        GpuReport::Found {
            driver_version,
            gpus,
        } => Gpus {
            status: GpuStatus::Found,
            reason: None,
            driver_version: Some(driver_version.clone()),
            devices: gpus
                .iter()
                .map(|g| Gpu {
                    index: g.index,
                    name: g.name.clone(),
                    total_bytes: g.total_bytes,
                    free_bytes: g.free_bytes,
                    compute_capability: g.compute_capability.map(|(a, b)| format!("{a}.{b}")),
                    pcie_generation: g.pcie_gen,
                    pcie_width: g.pcie_width,
                })
                .collect(),
        },
        GpuReport::Unavailable { reason } => Gpus {
            status: GpuStatus::Unavailable,
            reason: Some(reason.clone()),
            driver_version: None,
            devices: Vec::new(),
        },
    }
}

/// The one place model facts enter the report: when the launcher's model
/// facts change source, only this function changes.
pub fn model_entry(m: &ModelInfo) -> Model {
    let (status, reason, facts, cache) = match &m.summary {
        Ok(s) => (
            ModelStatus::Ok,
            None,
            Some(ModelFacts {
                model_type: s.model_type.clone(),
                total_params: s.total_params,
                routed_expert_params: s.routed_expert_params,
                num_layers: s.num_layers as u64,
                moe_layers: s.moe_layers as u64,
                num_experts: s.num_experts as u64,
                experts_per_token: s.top_k as u64,
                max_position_embeddings: s.max_position_embeddings as u64,
                source_dtype: s.source_dtype.clone(),
                source_expert_bytes: s.source_expert_bytes,
                int4_expert_bytes: s.int4_expert_bytes,
            }),
            Some(cache_entry(&s.cache)),
        ),
        Err(e) => (ModelStatus::Unusable, Some(e.clone()), None, None),
    };
    Model {
        name: m.name.clone(),
        path: path_text(&m.path),
        root: m.root.into(),
        status,
        reason,
        facts,
        cache,
    }
}

fn cache_entry(c: &CacheStatus) -> Cache {
    let (status, path, bytes, reason) = match c {
        CacheStatus::Valid { path, bytes } => (CacheState::Valid, Some(path), Some(*bytes), None),
        CacheStatus::Invalid { path, reason } => {
            (CacheState::Invalid, Some(path), None, Some(reason.clone()))
        }
        CacheStatus::Missing { path } => (CacheState::Missing, Some(path), None, None),
        CacheStatus::OldFormat { path, reason, .. } => (
            CacheState::OldFormat,
            Some(path),
            None,
            Some(reason.clone()),
        ),
        CacheStatus::Unavailable { reason } => {
            (CacheState::Unknown, None, None, Some(reason.clone()))
        }
    };
    Cache {
        status,
        path: path.map(|p| path_text(p)),
        bytes,
        reason,
    }
}

fn runtime_entry(r: &RuntimeFacts) -> Runtime {
    match r {
        Ok((path, c)) => Runtime {
            status: RuntimeStatus::Ok,
            reason: None,
            path: Some(path_text(path)),
            version: Some(c.runtime_version.clone()),
            protocol_version: Some(c.protocol_version),
            backends: c
                .backends
                .iter()
                .map(|b| Backend {
                    name: b.name.clone(),
                    available: b.available,
                    reason: b.reason.clone(),
                })
                .collect(),
            architectures: c
                .architectures
                .iter()
                .map(|a| Architecture {
                    model_type: a.model_type.clone(),
                    expert_precisions: a.expert_precisions.clone(),
                    attention_precisions: a.attention_precisions.clone(),
                    kv_formats: a.kv_formats.clone(),
                    mlp_precisions: a.mlp_precisions.clone(),
                    pruning_modes: a.pruning_modes.clone(),
                    hcs: a.hcs,
                })
                .collect(),
        },
        Err((path, reason)) => Runtime {
            status: RuntimeStatus::Error,
            reason: Some(reason.clone()),
            path: path.as_deref().map(path_text),
            version: None,
            protocol_version: None,
            backends: Vec::new(),
            architectures: Vec::new(),
        },
    }
}

/// The checker the integration tests use, so these unit tests read the same
/// document the same way.
#[cfg(test)]
#[allow(dead_code)]
#[path = "../../tests/common/shape.rs"]
mod shape;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::Probe;
    use crate::probe::fake::FakeProbe;

    use super::shape;

    fn doc() -> String {
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/probe-json.md"))
            .expect("docs/probe-json.md")
    }

    /// The shapes the integration test cannot reach on a machine without a
    /// GPU (a found GPU) or with a working runtime path (a runtime error
    /// after it was found) match the document too.
    #[test]
    fn fake_reports_match_the_documented_shape() {
        let spec = shape::Spec::from_doc(&doc());
        for gpu in [true, false] {
            let p = FakeProbe { gpu };
            let caps = crate::runtime::tests::fake_caps(gpu);
            for rt in [
                Ok(("/opt/krasis/krasis-runtime".into(), caps.clone())),
                Err((
                    Some("/opt/krasis/krasis-runtime".into()),
                    "it crashed".to_string(),
                )),
                Err((None, "not found".to_string())),
            ] {
                let roots = crate::probe::models::default_roots("/data/models".into(), &[]);
                let r = build(&p.hardware(), &roots, &p.models(), &rt);
                let v = serde_json::to_value(&r).unwrap();
                let seen = spec.check(&v).unwrap_or_else(|e| panic!("{e}\n{v:#}"));
                if gpu {
                    assert!(seen.contains("gpus.devices[].compute_capability"));
                }
            }
        }
    }

    /// The document's example is checked too, so it cannot go stale.
    #[test]
    fn the_documented_example_matches_the_key_table() {
        let doc = doc();
        let spec = shape::Spec::from_doc(&doc);
        let json = doc
            .split("```json\n")
            .nth(1)
            .and_then(|r| r.split("```").next())
            .expect("a ```json example in the document");
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        spec.check(&v).unwrap_or_else(|e| panic!("{e}"));
    }

    #[test]
    fn statuses_are_plain_strings() {
        let p = FakeProbe { gpu: true };
        let r = build(
            &p.hardware(),
            &[],
            &p.models(),
            &Err((None, "no runtime".into())),
        );
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["schema"], SCHEMA);
        assert_eq!(v["gpus"]["status"], "found");
        assert_eq!(v["gpus"]["devices"][0]["compute_capability"], "8.9");
        assert_eq!(v["models"][0]["status"], "ok");
        assert_eq!(v["models"][0]["facts"]["experts_per_token"], 8);
        assert_eq!(v["models"][0]["cache"]["status"], "missing");
        assert_eq!(v["models"][1]["status"], "unusable");
        assert!(v["models"][1]["facts"].is_null());
        assert_eq!(v["runtime"]["status"], "error");
    }

    /// An older-format cache keeps its path and the refusal (with the
    /// rebuild command) as the reason, under its own status.
    #[test]
    fn an_old_format_cache_is_its_own_status_with_the_refusal() {
        let c = cache_entry(&CacheStatus::OldFormat {
            path: "/c/experts/ab/experts-int4-v1.kcache".into(),
            reason: "format-1 ... Rebuild it with `krasis-runtime build-cache --model /m`".into(),
            command: "krasis-runtime build-cache --model /m".into(),
        });
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(v["status"], "old_format");
        assert_eq!(v["path"], "/c/experts/ab/experts-int4-v1.kcache");
        assert!(
            v["reason"]
                .as_str()
                .unwrap()
                .contains("build-cache --model /m")
        );
        assert!(v["bytes"].is_null());
    }
}
