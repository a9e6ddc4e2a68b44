//! The pre-flight memory plan of the CUDA engine, from the size functions
//! [`CudaEngine::load`](crate::CudaEngine::load) itself allocates by: the
//! weights ([`weight_bytes`]), the expert pointer table, the KV cache
//! (`scratch::KvShape`), the prefill chunk ([`chunk_for_free`]) and its scratch
//! ([`ScratchLens`]), the HCS staging region ([`staging_group`],
//! [`Hcs::staging_bytes`]) and the all-resident-or-HCS decision
//! ([`decide`]). The load path calls the same functions, so the plan can only
//! differ from a load where the load measures: the per-request transient,
//! which calibration measures and the plan estimates from the prefill's
//! hidden-state buffers ([`hidden_state_bytes`]), and memory outside the
//! formulas (the CUDA context, kernel modules, allocator slack).

use crate::device::BLAS_WORKSPACE_BYTES;
use crate::experts::pointer_table_bytes;
use crate::hcs::Hcs;
use crate::options::{CudaEngineOptions, GEMV_MAX_TOKENS};
use crate::scratch::{ScratchLens, SeqLens, chunk_for_free};
use crate::weights::weight_bytes;
use krasis_common::plan::{DeviceBudget, ExpertPlan, GpuPlan, Placement, PlanItem, Verdict};
use krasis_common::size::format_size as b;
use krasis_model::Geometry;

/// Staging buffers hold at least this many bytes of whole layers (more
/// layers per group for models with small layers, so copies stay large).
pub const MIN_GROUP_BYTES: usize = 64 << 20;

/// MoE layers per HCS staging buffer for layers of `layer_bytes`.
pub fn staging_group(layer_bytes: usize, moe_layers: usize) -> usize {
    MIN_GROUP_BYTES
        .div_ceil(layer_bytes.max(1))
        .clamp(1, moe_layers.max(1))
}

/// Bytes of the f32 hidden states streamed prefill keeps for a prompt of
/// `tokens` (the per-request transient under HCS).
pub fn hidden_state_bytes(tokens: usize, hidden: usize) -> u64 {
    (tokens * hidden * std::mem::size_of::<f32>()) as u64
}

/// Where the routed experts go once the fixed allocations exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Every expert fits next to the floor: upload all (the staging region
    /// is freed first).
    AllResident,
    /// HCS with at most `want` resident experts.
    Hcs { want: usize },
}

/// The decision of `setup_experts`: `free` bytes in the budget with the
/// staging region allocated, `floor` = transient + safety margin.
pub fn decide(free: u64, staging: u64, all_bytes: u64, floor: u64, stride: usize) -> Decision {
    if free + staging >= all_bytes + floor {
        Decision::AllResident
    } else {
        Decision::Hcs {
            want: (free.saturating_sub(floor) / stride.max(1) as u64) as usize,
        }
    }
}

/// Expert slots of `stride` bytes in the parts of the scratch only prefill
/// uses, decode keeping `kept` rows ([`ScratchLens::lendable`]), which
/// decode's experts hold under HCS (`Hcs::new` carves the same parts:
/// whole slots of each).
pub fn scratch_slots(lens: &ScratchLens, kept: usize, stride: usize) -> usize {
    lens.lendable(kept)
        .iter()
        .map(|l| l.bytes / stride.max(1))
        .sum()
}

/// Why the CUDA engine refuses the model `config` at load, if it does.
pub fn unsupported(config: &krasis_model::ModelConfig) -> Option<String> {
    crate::support::check_supported(config)
        .err()
        .map(|e| e.to_string())
}

/// The device the plan is for.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceFigures {
    /// Free bytes the engine would see when it opens the device.
    pub free: u64,
    pub total: Option<u64>,
    /// `driver` or `given`.
    pub source: String,
}

/// The CUDA engine's plan for a model of geometry `g` whose INT4 experts
/// are `stride` bytes each, with the options `load` would get. `device`:
/// the device figures, or why there are none.
pub fn plan_cuda(
    g: &Geometry,
    stride: usize,
    opts: &CudaEngineOptions,
    device: Result<DeviceFigures, String>,
) -> (GpuPlan, Vec<String>) {
    let context = opts.context_length.unwrap_or(g.max_position_embeddings);
    let moe_layers = g.num_moe_layers();
    let total_experts = moe_layers * g.num_experts;
    let all_bytes = (total_experts * stride) as u64;
    let hcs = opts.hcs && moe_layers > 0;
    let mut notes = Vec::new();
    let budget = device
        .as_ref()
        .ok()
        .map(|d| opts.vram_limit.map_or(d.free, |l| l.min(d.free)));
    let mut items = vec![
        PlanItem::exact("cuBLAS workspace", BLAS_WORKSPACE_BYTES as u64),
        PlanItem::exact("non-expert weights (bf16)", weight_bytes(g).device as u64),
    ];
    if moe_layers > 0 {
        items.push(PlanItem::exact(
            "expert pointer table",
            pointer_table_bytes(moe_layers, g.num_experts) as u64,
        ));
        if !hcs {
            items.push(PlanItem::exact("every routed expert (int4)", all_bytes));
        }
    }
    // Sliding layers' ring caches are sized for the largest chunk asked
    // for (its pieces: `scratch::ring_rows`), and kept for as
    // many sequences as that chunk allows (as at load; a refused option is
    // noted below).
    let want = opts.prefill_chunk.min(context);
    let rows = opts.kv_rows.unwrap_or(context);
    let most = crate::options::batching(opts, context, want).map_or(1, |(p, _)| p);
    let shape = opts.kv_shape(g, context, want, most);
    let rings = match shape.ring {
        0 => String::new(),
        r => format!(", sliding layers {most} ring(s) of {r}"),
    };
    items.push(PlanItem::exact(
        &if rows == context {
            format!("KV cache (bf16, {context} positions{rings})")
        } else {
            format!(
                "KV cache (bf16, an arena of {rows} positions for a {context}-position \
                 context{rings})"
            )
        },
        shape.bytes(g) as u64,
    ));
    let used = |items: &[PlanItem]| items.iter().map(|i| i.bytes).sum::<u64>();
    let path = crate::scratch::GroupedPath::int4(g);
    let cap = match budget {
        Some(bud) => chunk_for_free(bud.saturating_sub(used(&items)), g, want, path),
        None => want,
    };
    let lens = ScratchLens::new(g, cap, GEMV_MAX_TOKENS, path);
    items.push(PlanItem::exact(
        &format!("activation scratch ({cap}-token chunk)"),
        lens.bytes() as u64,
    ));
    // The engine refuses at load what `batching` refuses; the plan notes it
    // and plans one sequence.
    let parallel = match crate::options::batching(opts, context, cap) {
        Ok((p, _)) => p,
        Err(e) => {
            notes.push(format!("the engine refuses these options: {e}"));
            1
        }
    };
    let kept = crate::scratch::decode_rows_kept(parallel, GEMV_MAX_TOKENS);
    let scratch_slots = scratch_slots(&lens, kept, stride);
    items.push(PlanItem::exact(
        &format!("per-sequence decode state ({parallel} sequence(s) per step)"),
        SeqLens::new(g, parallel).bytes() as u64,
    ));
    let layer_bytes = g.num_experts * stride;
    let group = staging_group(layer_bytes, moe_layers);
    // The reclaimable tier's prior and tail, as `Hcs::new` divides it.
    let split = Hcs::split(
        moe_layers,
        g.num_experts,
        g.top_k,
        group,
        parallel,
        scratch_slots,
        None,
    );
    // The staging region is what `setup_experts` weighs (it is given back
    // when every expert fits).
    let staging = if hcs {
        let s = Hcs::staging_bytes(layer_bytes, group);
        let tail = split.tail();
        items.push(PlanItem::exact(
            &format!("HCS staging / reclaimable tier ({group} layer(s) x 2) and decode tail state"),
            (s + Hcs::tail_state_bytes(moe_layers * g.num_experts, tail, g.top_k * parallel.max(1)))
                as u64,
        ));
        s as u64
    } else {
        0
    };
    let margin = opts.safety_margin;
    let transient = if hcs {
        notes.push(
            "the per-request transient is measured by calibration at load; the plan estimates it \
             as the hidden states of a full-context prompt"
                .into(),
        );
        PlanItem {
            name: "transient (prompt hidden states)".into(),
            bytes: hidden_state_bytes(context, g.hidden),
            estimate: true,
        }
    } else {
        PlanItem::exact("transient (none beyond the scratch)", 0)
    };
    // The prefix cache's VRAM pool, allocated at load before the expert
    // placement (as `setup_prefix` does): `auto` only from what stays
    // above the floor once every expert is resident.
    if let Some(bud) = budget {
        let floor = if hcs {
            transient.bytes + margin
        } else {
            margin
        };
        let experts = if hcs { all_bytes } else { 0 };
        let spare = bud.checked_sub(used(&items) + floor + experts);
        let kv = opts.context_kv_bytes(g, context, want);
        let block = opts.prefix_block;
        match crate::prefix::pool_bytes(opts.prefix_cache, g, block, kv, spare) {
            Ok(0) => {}
            Ok(pool) => items.push(PlanItem::exact(
                &format!(
                    "prefix cache VRAM pool ({} blocks of {block} tokens)",
                    pool / crate::prefix::block_bytes(g, block).max(1)
                ),
                pool,
            )),
            Err(e) => notes.push(format!("the prefix cache is refused: {e}")),
        }
    }
    let fixed = used(&items);
    notes.push(
        "not counted: the CUDA context and kernel modules (taken before or outside the budget), \
         allocator slack"
            .into(),
    );
    let mut experts = ExpertPlan {
        placement: if moe_layers == 0 {
            Placement::NoExperts
        } else if hcs {
            Placement::Unknown
        } else {
            Placement::AllResident
        },
        total_experts: total_experts as u64,
        expert_stride: stride as u64,
        all_bytes,
        on_gpu_experts: if hcs { 0 } else { total_experts as u64 },
        on_gpu_bytes: if hcs { 0 } else { all_bytes },
    };
    let verdict = match budget {
        None => Verdict::Unknown {
            reason: device.as_ref().err().cloned().unwrap_or_default(),
        },
        Some(bud) => {
            let floor = if hcs { transient.bytes + margin } else { 0 };
            if fixed + floor > bud {
                Verdict::DoesNotFit {
                    reason: format!(
                        "the fixed allocations ({}){} need {} but the budget is {}; lower the \
                         context length or raise the VRAM limit",
                        b(fixed),
                        if hcs {
                            format!(
                                " + the transient ({}, estimate) + the safety margin ({})",
                                b(transient.bytes),
                                b(margin)
                            )
                        } else {
                            String::new()
                        },
                        b(fixed + floor),
                        b(bud)
                    ),
                }
            } else {
                if hcs {
                    let free = bud - fixed;
                    match decide(free, staging, all_bytes, floor, stride) {
                        Decision::AllResident => {
                            experts.placement = Placement::AllResident;
                            experts.on_gpu_experts = total_experts as u64;
                            experts.on_gpu_bytes = all_bytes;
                        }
                        Decision::Hcs { want } => {
                            let resident = want.min(total_experts);
                            // The tail's slots hold experts too, but which
                            // ones changes every step: not counted.
                            let prior = split.prior().min(total_experts - resident);
                            experts.placement = Placement::Hcs;
                            experts.on_gpu_experts = (resident + prior) as u64;
                            experts.on_gpu_bytes = resident as u64 * stride as u64 + staging;
                        }
                    }
                }
                Verdict::Fits
            }
        }
    };
    let device = match device {
        Ok(d) => DeviceBudget::Known {
            source: d.source,
            free_bytes: d.free,
            total_bytes: d.total,
            budget_bytes: budget.unwrap_or(0),
        },
        Err(reason) => DeviceBudget::Unknown { reason },
    };
    let plan = GpuPlan {
        device,
        items,
        fixed_bytes: fixed,
        prefill_chunk: cap as u64,
        transient,
        safety_margin_bytes: margin,
        experts,
        verdict,
    };
    (plan, notes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use krasis_model::synth::preset_geometry;

    fn dev(free: u64) -> Result<DeviceFigures, String> {
        Ok(DeviceFigures {
            free,
            total: Some(free),
            source: "given".into(),
        })
    }

    /// Qwen3-30B-A3B: 2,433,024 bytes per INT4 expert.
    const A3B_STRIDE: usize = 2_433_024;

    #[test]
    fn a3b_on_a_16gib_card_is_hcs_and_the_items_are_the_load_functions() {
        let g = preset_geometry("a3b").unwrap();
        let opts = CudaEngineOptions {
            context_length: Some(32768),
            ..Default::default()
        };
        let (p, notes) = plan_cuda(&g, A3B_STRIDE, &opts, dev(15 << 30));
        assert_eq!(p.verdict, Verdict::Fits);
        assert_eq!(p.experts.placement, Placement::Hcs);
        // KV: 2 * 48 layers * 512 * 32768 * 2 bytes = 3 GiB exactly.
        let kv = p.items.iter().find(|i| i.name.starts_with("KV")).unwrap();
        assert_eq!(kv.bytes, 3 << 30);
        assert_eq!(
            kv.bytes,
            opts.kv_shape(&g, 32768, opts.prefill_chunk, 8).bytes(&g) as u64
        );
        let w = &p.items[1];
        assert_eq!(w.bytes, weight_bytes(&g).device as u64);
        assert!(p.experts.coverage() > 0.3 && p.experts.coverage() < 1.0);
        assert!(p.transient.estimate);
        assert!(notes.iter().any(|n| n.contains("calibration")));
        assert_eq!(
            p.transient.bytes,
            hidden_state_bytes(32768, g.hidden),
            "the estimate is the streamed prefill's hidden states"
        );
        assert_eq!(p.safety_margin_bytes, 600 << 20);
    }

    #[test]
    fn a_tight_limit_does_not_fit_and_a_big_card_holds_every_expert() {
        let g = preset_geometry("a3b").unwrap();
        let tight = CudaEngineOptions {
            vram_limit: Some(2 << 30),
            ..Default::default()
        };
        let (p, _) = plan_cuda(&g, A3B_STRIDE, &tight, dev(23 << 30));
        assert!(matches!(p.verdict, Verdict::DoesNotFit { .. }), "{p:?}");
        assert_eq!(p.device.budget_bytes(), Some(2 << 30));
        let big = CudaEngineOptions {
            context_length: Some(4096),
            ..Default::default()
        };
        let (p, _) = plan_cuda(&g, A3B_STRIDE, &big, dev(139 << 30));
        assert_eq!(p.verdict, Verdict::Fits);
        assert_eq!(p.experts.placement, Placement::AllResident);
        assert_eq!(p.experts.on_gpu_experts, 48 * 128);
        // No device: the fixed sizes are still planned, the fit is unknown.
        let (p, _) = plan_cuda(&g, A3B_STRIDE, &big, Err("no driver".into()));
        assert!(matches!(p.verdict, Verdict::Unknown { .. }));
        assert_eq!(p.prefill_chunk, 4096);
    }

    /// a3b at a 4,096-token chunk: 55 + 20 + 110 slots in the gathered
    /// rows, SwiGLU rows and expert outputs (the engine on the H200 said
    /// "185 of them in prefill's grouped scratch"), then 13 + 6 + 17 + 13
    /// in the residual, normed, q/k/v and attention rows past decode's 8
    /// (the router's 2 MB hold none); none of a chunk decode keeps whole.
    #[test]
    fn the_scratch_lends_whole_slots_past_decode_rows() {
        let g = preset_geometry("a3b").unwrap();
        let path = crate::scratch::GroupedPath::int4(&g);
        let lens = ScratchLens::new(&g, 4096, GEMV_MAX_TOKENS, path);
        let kept = crate::scratch::decode_rows_kept(8, GEMV_MAX_TOKENS);
        let per: Vec<usize> = lens
            .lendable(kept)
            .iter()
            .map(|l| l.bytes / A3B_STRIDE)
            .collect();
        assert_eq!(per, [55, 20, 110, 13, 6, 17, 13, 0]);
        assert_eq!(scratch_slots(&lens, kept, A3B_STRIDE), 234);
        // More decode rows keep more of each row buffer.
        assert!(scratch_slots(&lens, 512, A3B_STRIDE) < 234);
        let short = ScratchLens::new(&g, GEMV_MAX_TOKENS, GEMV_MAX_TOKENS, path);
        assert_eq!(scratch_slots(&short, kept, A3B_STRIDE), 0);
    }

    #[test]
    fn decide_is_the_setup_rule() {
        // Everything fits with the staging region given back.
        assert_eq!(decide(90, 10, 80, 20, 1), Decision::AllResident);
        assert_eq!(decide(89, 10, 80, 20, 4), Decision::Hcs { want: 17 });
        assert_eq!(decide(5, 10, 80, 20, 4), Decision::Hcs { want: 0 });
    }

    /// gpt-oss-20b's plan counts its sliding layers' rings (sized for
    /// 512-token pieces of the chunk asked for, one per sequence of the
    /// default parallelism: 8 at 16K), its biases and sinks (weight_bytes)
    /// and its MXFP4 experts at their stride.
    #[test]
    fn gpt_oss_kv_is_planned_per_layer() {
        let g = preset_geometry("gpt-oss-20b").unwrap();
        let stride = krasis_cache::ExpertLayout::new(
            krasis_cache::ExpertFormat::Mxfp4,
            g.hidden,
            g.expert_intermediate,
            true,
        )
        .unwrap()
        .expert_stride;
        let opts = CudaEngineOptions {
            context_length: Some(16384),
            prefill_chunk: 2048,
            ..Default::default()
        };
        let (p, _) = plan_cuda(&g, stride, &opts, dev(139 << 30));
        let kv = p.items.iter().find(|i| i.name.starts_with("KV")).unwrap();
        assert_eq!(kv.bytes, opts.kv_shape(&g, 16384, 2048, 8).bytes(&g) as u64);
        let per_pos = (2 * g.kv_dim() * 2) as u64;
        // Rings for 512-token pieces, whatever the chunk.
        assert_eq!(kv.bytes, 12 * (16384 + 8 * (128 + 512 - 1)) * per_pos);
        assert!(kv.name.contains("8 ring(s) of 639"), "{}", kv.name);
        // With the prefix cache on, rings of whole 256-token blocks.
        let cached = CudaEngineOptions {
            prefix_cache: krasis_common::options::PrefixCacheChoice::Auto,
            ..opts.clone()
        };
        let (p, _) = plan_cuda(&g, stride, &cached, dev(139 << 30));
        let kv = p.items.iter().find(|i| i.name.starts_with("KV")).unwrap();
        assert_eq!(kv.bytes, 12 * (16384 + 8 * 768) * per_pos);
        assert!(kv.name.contains("8 ring(s) of 768"), "{}", kv.name);
        assert_eq!(p.items[1].bytes, weight_bytes(&g).device as u64);
        assert_eq!(p.experts.placement, Placement::AllResident);
        assert_eq!(p.experts.all_bytes, (24 * 32 * stride) as u64);
    }
}
