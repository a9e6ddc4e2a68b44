//! The CUDA C sources, embedded at build time, and the kernel names each
//! module must export.
//!
//! Every module is compiled as `COMMON + module source` so shared device
//! helpers live in one place without needing NVRTC include paths.

/// Shared device helpers prepended to every module.
pub const COMMON: &str = include_str!("../cuda/common.cuh");

/// One NVRTC compilation unit.
#[derive(Debug, Clone, Copy)]
pub struct Module {
    pub name: &'static str,
    pub source: &'static str,
    /// The `extern "C" __global__` entry points the Rust wrappers launch.
    pub kernels: &'static [&'static str],
    /// The machine code it is compiled for, and so the devices it loads on.
    pub target: Target,
}

/// What a module is compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The device's own architecture (`sm_XY`): every supported device.
    Portable,
    /// `sm_90a`, Hopper's architecture-specific instructions (wgmma), which
    /// the portable `sm_90` target lacks and no other device runs: compiled
    /// and loaded on compute capability 9.0 only.
    Sm90a,
}

impl Target {
    /// The NVRTC architecture for a device of compute capability `cc`, or
    /// `None` when modules of this target do not load there.
    pub fn arch(self, cc: (i32, i32)) -> Option<String> {
        match self {
            Target::Portable => Some(format!("sm_{}{}", cc.0, cc.1)),
            Target::Sm90a => (cc == (9, 0)).then(|| "sm_90a".to_string()),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Target::Portable => "the device's own architecture",
            Target::Sm90a => "sm_90a (Hopper)",
        }
    }
}

pub const MODULES: &[Module] = &[
    Module {
        name: "elementwise",
        source: include_str!("../cuda/elementwise.cu"),
        target: Target::Portable,
        kernels: &[
            "embed_gather_bf16",
            "add_bf16_into_f32",
            "add_f32_into_f32",
            "cast_f32_to_bf16",
            "swiglu_bf16",
            "swiglu_f16",
            "add_bias_rows_f32",
            "add_bias_rows_bf16",
            "bias_cast_f32_to_bf16",
            "bias_cast_f32_to_f16",
        ],
    },
    Module {
        name: "norm",
        source: include_str!("../cuda/norm.cu"),
        target: Target::Portable,
        kernels: &[
            "rmsnorm_f32",
            "rmsnorm_f32_to_f16",
            "rmsnorm_bf16",
            "add_rmsnorm_bf16",
            "add_rmsnorm_f32",
        ],
    },
    Module {
        name: "rope",
        source: include_str!("../cuda/rope.cu"),
        target: Target::Portable,
        kernels: &[
            "qk_norm_rope_bf16",
            "rope_table_bf16",
            "rope_table_f16",
            "rope_partial_bf16",
        ],
    },
    Module {
        name: "kv_cache",
        source: include_str!("../cuda/kv_cache.cu"),
        target: Target::Portable,
        kernels: &["kv_append_bf16", "kv_append_ring_bf16"],
    },
    Module {
        name: "expert_tail",
        source: include_str!("../cuda/expert_tail.cu"),
        target: Target::Portable,
        kernels: &["tail_lookup", "tail_fetch", "tail_home"],
    },
    Module {
        name: "kv_blocks",
        source: include_str!("../cuda/kv_blocks.cu"),
        target: Target::Portable,
        kernels: &["kv_blocks_copy"],
    },
    Module {
        name: "attention_prefill",
        source: include_str!("../cuda/attention_prefill.cu"),
        target: Target::Portable,
        kernels: &[
            "attn_prefill_mma_d64",
            "attn_prefill_mma_d128",
            "attn_prefill_mma_d256",
            "attn_prefill_simt",
            "attn_prefill_mma_ring_d64",
            "attn_prefill_mma_ring_d128",
            "attn_prefill_simt_ring",
            "attn_prefill_mma_d64_f16",
            "attn_prefill_mma_d128_f16",
            "attn_prefill_mma_d256_f16",
            "attn_prefill_simt_f16",
            "attn_prefill_mma_ring_d64_f16",
            "attn_prefill_mma_ring_d128_f16",
            "attn_prefill_simt_ring_f16",
        ],
    },
    Module {
        name: "attention_prefill_sm90",
        // The wgmma helpers (sm90.cuh) are shared with int4_gemm_sm90.
        source: concat!(
            include_str!("../cuda/sm90.cuh"),
            "\n#line 1 \"attention_prefill_sm90.cu\"\n",
            include_str!("../cuda/attention_prefill_sm90.cu")
        ),
        target: Target::Sm90a,
        kernels: &["attn_prefill_wgmma_d128"],
    },
    Module {
        name: "attention_decode",
        source: include_str!("../cuda/attention_decode.cu"),
        target: Target::Portable,
        kernels: &[
            "attn_decode_split",
            "attn_decode_combine",
            "attn_decode_split_ring",
            "attn_decode_combine_ring",
            "attn_decode_split_f16",
            "attn_decode_split_ring_f16",
        ],
    },
    Module {
        name: "router",
        source: include_str!("../cuda/router.cu"),
        target: Target::Portable,
        kernels: &[
            "router_topk_f32",
            "router_topk_bf16",
            "router_topk_then_softmax_f32",
            "router_topk_then_softmax_bf16",
            "router_sigmoid_grouped_f32",
            "router_sigmoid_grouped_bf16",
        ],
    },
    Module {
        name: "moe",
        source: include_str!("../cuda/moe.cu"),
        target: Target::Portable,
        kernels: &[
            "moe_count",
            "moe_scatter",
            "gather_rows_bf16",
            "moe_combine_bf16",
            "moe_combine_f32",
        ],
    },
    Module {
        name: "int4",
        // The grouped prefill GEMMs use int4.cu's helpers, so they compile
        // in the same unit, after it; int4_common.cuh holds the helpers the
        // Hopper module (int4_gemm_sm90) shares.
        source: concat!(
            include_str!("../cuda/int4_common.cuh"),
            "\n#line 1 \"int4.cu\"\n",
            include_str!("../cuda/int4.cu"),
            "\n#line 1 \"int4_gemm.cu\"\n",
            include_str!("../cuda/int4_gemm.cu")
        ),
        target: Target::Portable,
        kernels: &[
            "int4_w13_swiglu_1",
            "int4_w13_swiglu_2",
            "int4_w13_swiglu_3",
            "int4_w13_swiglu_4",
            "int4_w13_swiglu_1_r32",
            "int4_w13_swiglu_2_r32",
            "int4_w13_swiglu_1_r32_f16",
            "int4_w13_swiglu_2_r32_f16",
            "int4_w2_combine_1",
            "int4_w2_combine_2",
            "int4_w13_swiglu_g1",
            "int4_w13_swiglu_g2",
            "int4_w13_swiglu_g3",
            "int4_w13_swiglu_g4",
            "int4_w13_swiglu_w16_3",
            "int4_w13_swiglu_w16_4",
            "int4_w2_combine_g1",
            "int4_w2_combine_g2",
            "int4_w2_combine_g3",
            "int4_dequant_bf16",
            "int4_w13_swiglu_1_f16",
            "int4_w13_swiglu_2_f16",
            "int4_w13_swiglu_3_f16",
            "int4_w13_swiglu_4_f16",
            "int4_w13_swiglu_g1_f16",
            "int4_w13_swiglu_g2_f16",
            "int4_w13_swiglu_g3_f16",
            "int4_w13_swiglu_g4_f16",
            "int4_w13_swiglu_w16_3_f16",
            "int4_w13_swiglu_w16_4_f16",
            "int4_dequant_f16",
            "int4_w2_combine_1_mt",
            "int4_w2_combine_g1_mt",
            "int4_grouped_w13_swiglu_bf16",
            "int4_grouped_w13_swiglu_f16",
            "int4_grouped_w2_bf16",
            "int4_grouped_w2_f16",
        ],
    },
    Module {
        name: "int4_gemm_sm90",
        // int4_gemm.cu's grouped GEMMs on Hopper's wgmma, with the same
        // arguments; their own unit (sm_90a), so the helpers come first.
        source: concat!(
            include_str!("../cuda/sm90.cuh"),
            "\n#line 1 \"int4_common.cuh\"\n",
            include_str!("../cuda/int4_common.cuh"),
            "\n#line 1 \"int4_gemm_sm90.cu\"\n",
            include_str!("../cuda/int4_gemm_sm90.cu")
        ),
        target: Target::Sm90a,
        kernels: &[
            "int4_grouped_w13_swiglu_wgmma_bf16",
            "int4_grouped_w13_swiglu_wgmma_f16",
            "int4_grouped_w2_wgmma_bf16",
            "int4_grouped_w2_wgmma_f16",
        ],
    },
    Module {
        name: "mxfp4",
        // The grouped prefill GEMMs use mxfp4.cu's helpers, so they compile
        // in the same unit, after it.
        source: concat!(
            include_str!("../cuda/mxfp4.cu"),
            "\n#line 1 \"mxfp4_gemm.cu\"\n",
            include_str!("../cuda/mxfp4_gemm.cu")
        ),
        target: Target::Portable,
        kernels: &[
            "mxfp4_w13_act_1",
            "mxfp4_w13_act_2",
            "mxfp4_w13_act_3",
            "mxfp4_w13_act_3s",
            "mxfp4_w13_act_4",
            "mxfp4_w2_combine_2",
            "mxfp4_w2_combine_4",
            "mxfp4_dequant_bf16",
            "bias_act_rows_bf16",
            "bias_act_rows_f32",
            "mxfp4_grouped_w13_act",
            "mxfp4_grouped_w2",
        ],
    },
    Module {
        name: "gemv",
        source: include_str!("../cuda/gemv.cu"),
        target: Target::Portable,
        kernels: &[
            "gemv_bf16_r2_m1",
            "gemv_bf16_r2_m2",
            "gemv_bf16_r2_m4",
            "gemv_bf16_r2_m8",
            "gemv_bf16_r1_m1",
            "gemv_bf16_r1_m2",
            "gemv_bf16_r1_m4",
            "gemv_bf16_r1_m8",
            "gemv_rmsnorm_bf16_r2_m1",
            "gemv_rmsnorm_bf16_r2_m2",
            "gemv_rmsnorm_bf16_r2_m4",
            "gemv_rmsnorm_bf16_r2_m8",
            "gemv_rmsnorm_bf16_r1_m1",
            "gemv_rmsnorm_bf16_r1_m2",
            "gemv_rmsnorm_bf16_r1_m4",
            "gemv_rmsnorm_bf16_r1_m8",
            "gemv_rmsnorm_f16_r2_m1",
            "gemv_rmsnorm_f16_r2_m2",
            "gemv_rmsnorm_f16_r2_m4",
            "gemv_rmsnorm_f16_r2_m8",
            "gemv_rmsnorm_f16_r1_m1",
            "gemv_rmsnorm_f16_r1_m2",
            "gemv_rmsnorm_f16_r1_m4",
            "gemv_rmsnorm_f16_r1_m8",
            "gemv_f16_r2_m1",
            "gemv_f16_r2_m2",
            "gemv_f16_r2_m4",
            "gemv_f16_r2_m8",
            "gemv_f16_r1_m1",
            "gemv_f16_r1_m2",
            "gemv_f16_r1_m4",
            "gemv_f16_r1_m8",
        ],
    },
    Module {
        name: "gemv_tc",
        source: include_str!("../cuda/gemv_tc.cu"),
        target: Target::Portable,
        kernels: &[
            "gemv_tc_rmsnorm_bf16_m1",
            "gemv_tc_rmsnorm_bf16_m2",
            "gemv_tc_rmsnorm_bf16_m4",
            "gemv_tc_rmsnorm_bf16_m8",
        ],
    },
    Module {
        name: "sampling",
        source: include_str!("../cuda/sampling.cu"),
        target: Target::Portable,
        kernels: &[
            "argmax_f32",
            "argmax_bf16",
            "sample_prepare_f32",
            "sample_prepare_bf16",
            "sample_select",
        ],
    },
];

/// Names of the `extern "C" __global__` functions defined in `source`, in
/// order. Tolerates `__launch_bounds__(..)` between `void` and the name.
pub fn exported_kernels(source: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = source;
    while let Some(at) = rest.find("extern \"C\" __global__") {
        rest = &rest[at + "extern \"C\" __global__".len()..];
        let mut s = rest.trim_start();
        if let Some(after) = s.strip_prefix("void") {
            s = after.trim_start();
        } else {
            continue;
        }
        if let Some(after) = s.strip_prefix("__launch_bounds__") {
            match after.find(')') {
                Some(close) => s = after[close + 1..].trim_start(),
                None => continue,
            }
        }
        let name: String = s
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            names.push(name);
        }
    }
    names
}

/// Hash of everything that determines a module's compiled output except the
/// architecture and compiler version (those are part of the cache key too).
pub fn source_hash(module: &Module) -> String {
    let mut h = blake3::Hasher::new();
    h.update(COMMON.as_bytes());
    h.update(b"\0");
    h.update(module.source.as_bytes());
    h.finalize().to_hex()[..32].to_string()
}
