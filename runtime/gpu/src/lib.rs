//! The CUDA engine: whole-prompt GPU prefill and native decode of
//! `qwen3_moe` models with INT4 routed experts resident in VRAM.

pub mod blas;
pub mod bounds;
pub mod check;
pub mod device;
pub mod engine;
pub mod error;
pub mod experts;
pub mod forward;
mod moe;
pub mod monitor;
pub mod options;
pub mod profile;
pub mod scratch;
pub mod weights;

pub use device::{DeviceInfo, Gpu, probe};
pub use engine::{CudaEngine, LoadReport};
pub use error::GpuError;
pub use options::CudaEngineOptions;
