//! Plain CPU implementations of every kernel, written for obviousness, not
//! speed. Tests compare the GPU against these on random inputs. They take
//! and return host data (`f32` where the kernel's input is bf16, converted
//! by the caller, so one function serves both input types) and use f64
//! where the exact answer is cheap (attention, norms).

mod attention;
mod basic;
mod expert_tail;
mod gemv;
mod int4;
mod kv_blocks;
mod moe;
mod mxfp4;
mod rope_partial;
mod sampling;

pub use attention::{attention, attention_ring, kv_append_ring};
pub use basic::{
    add_rmsnorm, bias_cast, bias_cast_as, embed, kv_append, qk_norm_rope, rmsnorm, rmsnorm_as,
    rope_table, swiglu, swiglu_as, to_bf16, to_f32,
};
pub use expert_tail::TailState;
pub use gemv::{gemv, gemv_rmsnorm, gemv_rmsnorm_as};
pub use int4::{dequant_rows, expert_forward, quantize_rows, write_expert};
pub use kv_blocks::kv_blocks_copy;
pub use moe::{moe_combine, moe_group, router_topk, router_topk_with};
pub use mxfp4::{
    E2M1, Mxfp4Decoded, Mxfp4Expert, e8m0, expert_activation, mxfp4_decode_rows,
    mxfp4_expert_forward, mxfp4_grouped_w2, mxfp4_grouped_w13_act,
};
pub use rope_partial::rope_partial;
pub use sampling::{
    apply_mask, argmax, philox4x32_10, prepared_logits, refuses, sample_from_weights,
    sample_weights,
};
