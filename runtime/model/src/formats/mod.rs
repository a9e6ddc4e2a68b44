//! Quantized weight formats that checkpoints ship, described once and decoded
//! exactly.
//!
//! These live in the model crate, not in `krasis-cache`, because the CPU
//! reference engine has to read them straight from a checkpoint (it is the
//! oracle, so it must see the checkpoint's own values), while `krasis-cache`
//! depends on this crate and reuses the same description for its native
//! storage. The INT4 cache format is different in kind: Krasis produces it
//! (`krasis_cache::layout`), whereas these are consumed as published.
//!
//! - [`mxfp4`]: OCP Microscaling MXFP4 (E2M1 values, one E8M0 scale per 32),
//!   the routed-expert format of gpt-oss checkpoints.

pub mod mxfp4;
#[cfg(test)]
mod mxfp4_tests;

pub use mxfp4::{Mxfp4Error, Mxfp4Matrix, Mxfp4Shape, Mxfp4Tensor, RawTensor};
