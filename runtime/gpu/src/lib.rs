//! The CUDA engine: whole-prompt GPU prefill and native decode of the
//! families whose layer plan it implements (`support.rs`: qwen3_moe and
//! glm4_moe with INT4 routed experts, gpt_oss with its native MXFP4
//! experts), all resident
//! in VRAM when they fit, otherwise cached by HCS (`hcs`) with streamed
//! prefill; several requests decode together (continuous batching,
//! `batch`).

mod act;
pub mod arena;
mod attention;
pub mod batch;
pub mod blas;
pub mod bounds;
pub mod calibrate;
pub mod check;
pub mod device;
pub mod engine;
pub mod error;
pub mod expert_ffn;
pub mod experts;
pub mod forward;
pub mod hcs;
pub mod host_table;
mod mlp;
mod moe;
pub mod monitor;
pub mod options;
pub mod plan;
pub mod prefill_kernels;
pub mod prefix;
mod prefix_window;
pub mod profile;
pub mod profile_prefill;
pub mod scratch;
pub mod setup;
pub mod stats;
mod streamed;
pub mod support;
pub mod weights;

pub use batch::StepTiming;
pub use device::{Budget, DeviceInfo, Gpu, probe};
pub use engine::{CudaEngine, LoadReport};
pub use error::GpuError;
pub use options::CudaEngineOptions;
