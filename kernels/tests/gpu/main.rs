//! GPU kernel tests against the CPU references in `krasis_kernels::reference`.
//! Each test prints `SKIPPED (no CUDA device): <name>` and passes when no
//! CUDA device is present, and runs for real on a GPU machine.

mod attention;
mod common;
mod elementwise;
mod expert_tail;
mod fp16;
mod fp16_mlp;
mod gemv;
mod int4;
mod int4_grouped;
mod int4_grouped_sm90;
mod kv_blocks;
mod moe;
mod mxfp4;
mod mxfp4_grouped;
mod rope;
mod rope_partial;
mod rows;
mod sampling;
