//! `krasis-runtime plan --model DIR [engine flags] [--json]`: the pre-flight
//! memory plan for the engine the same flags would load. The CUDA figures
//! come from `krasis_gpu::plan`, built on the size functions the engine's
//! load path allocates by; the reference figures from the reference
//! engine's own sizes. The launcher shows this instead of estimating.

use super::engines::EngineArgs;
use super::inspect::inspect;
use anyhow::bail;
use krasis_common::plan::{HostPlan, Plan, PlanItem};
use krasis_common::{Backend, ModelReport, PROTOCOL_VERSION};
use krasis_gpu::plan::DeviceFigures;
use krasis_model::ModelConfig;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Free device memory to plan against (what the caller measured, e.g.
    /// the launcher's NVML probe); without it the plan asks the CUDA driver,
    /// which creates a context on --gpu.
    #[arg(long, value_name = "SIZE", value_parser = super::engines::parse_vram_limit)]
    pub device_free: Option<u64>,
    /// Total device memory, reported with --device-free.
    #[arg(long, value_name = "SIZE", value_parser = super::engines::parse_vram_limit)]
    pub device_total: Option<u64>,
    /// Print one JSON object (`krasis_common::plan::Plan`).
    #[arg(long)]
    pub json: bool,
    /// Most requests decoding together, as `serve --parallel` gets it (cuda:
    /// the per-sequence decode state is planned for them; default the
    /// engine's; a value the engine would refuse is noted in the plan).
    #[arg(long, value_name = "N")]
    pub parallel: Option<u32>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let p = plan(&a)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
    } else {
        println!(
            "{} with the {} backend, context {} tokens:",
            p.model.display(),
            p.backend.as_str(),
            p.context_length
        );
        for l in p.lines() {
            println!("  {l}");
        }
    }
    Ok(())
}

/// The plan for `a`; fails only when the model cannot be read or the
/// options are refused, as loading would.
pub fn plan(a: &Args) -> anyhow::Result<Plan> {
    let e = &a.engine;
    let facts = match inspect(&e.model, e.cache_dir.as_deref()) {
        ModelReport::Ok(f) => f,
        ModelReport::Error { path, reason } => {
            bail!("{} cannot be served: {reason}", path.display())
        }
    };
    let config = ModelConfig::load(&e.model)?;
    let g = config.geometry();
    let max = g.max_position_embeddings;
    let context = match e.backend {
        Backend::Cuda => e.context_length.unwrap_or(max),
        Backend::Reference => e
            .context_length
            .unwrap_or(max.min(krasis_model::reference::DEFAULT_CONTEXT_CAP)),
    };
    if context == 0 || context > max {
        bail!(
            "context length {context} must be in 1..={max} (max_position_embeddings of {})",
            e.model.display()
        );
    }
    let mut warnings = Vec::new();
    let mut notes = Vec::new();
    let (host, gpu) = match e.backend {
        Backend::Reference => {
            let routed = g.routed_expert_params();
            let non_expert = g.total_params() - routed;
            let mut items = vec![
                PlanItem::exact(
                    &format!(
                        "routed experts from the checkpoint ({}, memory-mapped)",
                        facts.formats.checkpoint_dtype
                    ),
                    facts.formats.checkpoint_expert_bytes,
                ),
                PlanItem::exact("non-expert weights (f32)", non_expert * 4),
            ];
            if routed * 4 <= krasis_model::reference::F32_CACHE_LIMIT_BYTES {
                items.push(PlanItem::exact("routed experts kept as f32", routed * 4));
            }
            // Every running request has its own KV, reserved out of the
            // budget at admission and committed as it is written.
            let batch = krasis_model::reference::BATCH_CAPACITY;
            let kv_tokens = e.kv_tokens.map_or(batch * context, |t| t as usize);
            items.push(PlanItem::exact(
                &format!(
                    "KV cache (f32, at most {kv_tokens} tokens shared by up to {batch} running requests)"
                ),
                (2 * g.num_layers * g.kv_dim() * kv_tokens * 4) as u64,
            ));
            notes.push(
                "the reference engine is the CPU f32 oracle: exact, and far too slow to serve a real model"
                    .into(),
            );
            (host_plan(items), None)
        }
        Backend::Cuda => {
            let stride = facts.formats.int4_expert_stride as usize;
            if g.num_moe_layers() > 0 && stride == 0 {
                warnings.push(format!(
                    "hidden {} / expert width {} fit no expert cache format; the cuda backend cannot load this model",
                    g.hidden, g.expert_intermediate
                ));
            }
            if let Some(why) = krasis_gpu::plan::unsupported(&config) {
                warnings.push(why);
            }
            let device = match a.device_free {
                Some(free) => Ok(DeviceFigures {
                    free,
                    total: a.device_total,
                    source: "given".into(),
                }),
                None => krasis_gpu::device::free_at_open(e.gpu as usize)
                    .map(|(free, total)| DeviceFigures {
                        free,
                        total: Some(total),
                        source: "driver".into(),
                    })
                    .map_err(|e| e.to_string()),
            };
            let mut opts = e.cuda_options();
            opts.context_length = Some(context);
            opts.parallel = a.parallel.map(|n| n as usize);
            // As `serve` loads it: the prefix cache is on unless turned off.
            opts.prefix_cache = e.prefix_cache.unwrap_or_default();
            opts.prefix_cache_host = e.prefix_cache_host.unwrap_or_default();
            let (gpu, n) = krasis_gpu::plan::plan_cuda(&g, stride, &opts, device);
            notes.extend(n);
            let mut items = Vec::new();
            if g.num_moe_layers() > 0 {
                items.push(PlanItem::exact(
                    "INT4 expert cache (memory-mapped; page-locked under HCS)",
                    gpu.experts.all_bytes,
                ));
            }
            let emb = krasis_gpu::weights::weight_bytes(&g).host as u64;
            if emb > 0 {
                items.push(PlanItem::exact("input embedding (mapped host memory)", emb));
            }
            // The prefix cache's host tier, by the rule `serve` applies.
            if opts.prefix_cache.is_on() {
                let chunk = opts.prefill_chunk.min(context);
                let kv = opts.context_kv_bytes(&g, context, chunk);
                let block = opts.prefix_block;
                let avail = krasis_gpu::prefix::host_available();
                match krasis_gpu::prefix::host_bytes(opts.prefix_cache_host, &g, block, kv, avail) {
                    Ok(0) => {}
                    Ok(b) => items.push(PlanItem::exact(
                        &format!("prefix cache host tier (page-locked, blocks of {block} tokens)"),
                        b,
                    )),
                    Err(err) => {
                        notes.push(format!("the prefix cache's host tier is refused: {err}"))
                    }
                }
            }
            (host_plan(items), Some(gpu))
        }
    };
    Ok(Plan {
        protocol_version: PROTOCOL_VERSION,
        model: PathBuf::from(&e.model),
        backend: e.backend,
        context_length: context as u64,
        host,
        gpu,
        notes,
        warnings,
    })
}

fn host_plan(items: Vec<PlanItem>) -> HostPlan {
    HostPlan {
        total_bytes: items.iter().map(|i| i.bytes).sum(),
        items,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use krasis_common::plan::{Placement, Verdict};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: Args,
    }

    fn args(extra: &[&str]) -> Args {
        let dir = krasis_model::testutil::tiny_checkpoint("tiny");
        let mut argv = vec!["x".to_string(), "--model".into(), dir.display().to_string()];
        argv.extend(extra.iter().map(|s| s.to_string()));
        Cli::try_parse_from(argv).unwrap().a
    }

    /// The plan of a synthetic checkpoint is what the load path's size
    /// functions compute for it.
    #[test]
    fn cuda_plan_of_a_synthetic_checkpoint_is_the_load_functions() {
        let a = args(&["--device-free", "8GiB", "--context-length", "512"]);
        let p = plan(&a).unwrap();
        let g = ModelConfig::load(&a.engine.model).unwrap().geometry();
        let gpu = p.gpu.as_ref().unwrap();
        let item = |prefix: &str| {
            gpu.items
                .iter()
                .find(|i| i.name.starts_with(prefix))
                .unwrap_or_else(|| panic!("{prefix} in {:?}", gpu.items))
                .bytes
        };
        assert_eq!(
            item("non-expert weights"),
            krasis_gpu::weights::weight_bytes(&g).device as u64
        );
        assert_eq!(
            item("KV cache"),
            krasis_gpu::scratch::KvShape::new(&g, 512, 512, 1, 1).bytes(&g) as u64
        );
        let cap = gpu.prefill_chunk as usize;
        assert_eq!(
            item("activation scratch"),
            krasis_gpu::scratch::ScratchLens::new(
                &g,
                cap,
                krasis_gpu::options::GEMV_MAX_TOKENS,
                krasis_gpu::scratch::GroupedPath::int4(&g)
            )
            .bytes() as u64
        );
        assert_eq!(gpu.verdict, Verdict::Fits);
        // A tiny model fits whole in 8 GiB.
        assert_eq!(gpu.experts.placement, Placement::AllResident);
        assert_eq!(gpu.safety_margin_bytes, 600 << 20);
        assert_eq!(p.context_length, 512);
    }

    #[test]
    fn reference_plan_uses_host_memory_and_refuses_a_context_beyond_the_model() {
        let p = plan(&args(&["--backend", "reference"])).unwrap();
        assert!(p.gpu.is_none());
        assert!(p.host.items[0].name.contains("checkpoint"));
        assert!(
            plan(&args(&[
                "--context-length",
                "99999999",
                "--device-free",
                "1GiB"
            ]))
            .is_err()
        );
    }
}
