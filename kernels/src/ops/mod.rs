//! Typed launch wrappers, one module per kernel family (mirrors `cuda/`).

pub mod attention;
pub mod elementwise;
pub mod expert_tail;
pub mod gemv;
pub mod grouped;
pub mod int4;
pub mod kv_blocks;
pub mod moe;
pub mod mxfp4;
pub mod norm;
pub mod rope;
pub mod sampling;
