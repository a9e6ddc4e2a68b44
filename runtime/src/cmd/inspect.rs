//! `krasis-runtime inspect --model DIR [--model DIR ...] [--cache-dir D] [--json]`:
//! the facts of model directories as this runtime reads them. One process
//! answers for many directories, so the launcher's model discovery costs one
//! spawn. A directory that cannot be read or served is an entry with its
//! reason; the command itself only fails on bad arguments.

use krasis_cache::{CacheError, ExpertCache, ModelSource, Verify};
use krasis_common::inspect::{
    BackendFormat, CacheState, Formats, GeometryFacts, HeatmapState, InspectReport, ModelFacts,
    ModelReport, ParamCounts,
};
use krasis_common::{Backend, PROTOCOL_VERSION};
use krasis_model::{Checkpoint, Geometry, ModelConfig};
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct Args {
    /// Hugging Face model directory; repeat for several.
    #[arg(long, value_name = "DIR", required = true)]
    pub model: Vec<PathBuf>,
    /// Expert cache directory (default: the platform cache directory).
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Print one JSON object (`krasis_common::inspect::InspectReport`).
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let report = InspectReport {
        protocol_version: PROTOCOL_VERSION,
        models: a
            .model
            .iter()
            .map(|d| inspect(d, a.cache_dir.as_deref()))
            .collect(),
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        for m in &report.models {
            print!("{}", human(m));
        }
    }
    Ok(())
}

/// The facts of `dir`, or why it cannot be served.
pub fn inspect(dir: &Path, cache_root: Option<&Path>) -> ModelReport {
    facts(dir, cache_root).map_or_else(
        |reason| ModelReport::Error {
            path: dir.to_path_buf(),
            reason,
        },
        ModelReport::Ok,
    )
}

fn facts(dir: &Path, cache_root: Option<&Path>) -> Result<ModelFacts, String> {
    let config = ModelConfig::load(dir).map_err(|e| e.to_string())?;
    let ckpt = Checkpoint::open(dir).map_err(|e| e.to_string())?;
    let g = config.geometry();
    // The CUDA engine's attention activations and KV cache format, and its
    // MLP block's format: the heatmap binding's precisions too.
    let attention = g.attention.activations.name();
    let mlp = g.mlp.activations.name();
    let routed = g.routed_expert_params();
    let total = g.total_params();
    let active = total - routed + (g.num_moe_layers() * g.top_k) as u64 * g.expert_params() as u64;
    // How the routed experts are stored (what the reference engine reads):
    // a float dtype, MXFP4, or absent (a checkpoint written without them);
    // and their bytes as stored, summed over the tensors themselves.
    let stored_experts =
        krasis_model::reference::stored_expert_format(&config, &ckpt).map(str::to_lowercase);
    let embed_dtype = ckpt.get(&config.embed_tensor_name()).ok().map(|t| t.dtype);
    let checkpoint_dtype = stored_experts
        .clone()
        .or_else(|| embed_dtype.map(|d| d.name().to_lowercase()))
        .unwrap_or_else(|| "unknown".into());
    let checkpoint_expert_bytes = if stored_experts.is_some() {
        g.moe_layers()
            .flat_map(|l| config.routed_expert_tensor_names(l))
            .map(|n| ckpt.raw(&n).map_or(0, |t| t.bytes.len() as u64))
            .sum()
    } else {
        routed * embed_dtype.map_or(2, |d| d.size()) as u64
    };
    let layout = krasis_cache::model_layout(&config, dir).ok();
    let stride = layout.map_or(0, |l| l.expert_stride as u64);
    let experts = (g.num_moe_layers() * g.num_experts) as u64;
    let has_experts = experts > 0;
    // One entry per backend the registry says builds this family.
    let backends = config
        .architecture()
        .backends
        .iter()
        .map(|&backend| match backend {
            Backend::Cuda => BackendFormat {
                backend,
                experts: match (has_experts, layout) {
                    (false, _) => "none".into(),
                    (true, Some(l)) => l.format.precision().name().into(),
                    (true, None) => "unsupported".into(),
                },
                expert_source: match (has_experts, layout) {
                    (false, _) => "dense model".into(),
                    (true, Some(l)) => format!("expert cache ({})", l.format),
                    (true, None) => "no expert cache format fits this model".into(),
                },
                compute: match (attention, mlp) {
                    ("bf16", "bf16") => "bf16".into(),
                    (a, m) => format!("attention {a}, MLP {m}"),
                },
                kv: attention.into(),
            },
            Backend::Reference => BackendFormat {
                backend,
                experts: match (has_experts, &stored_experts) {
                    (false, _) => "none".into(),
                    (true, Some(d)) => d.clone(),
                    (true, None) => "missing".into(),
                },
                expert_source: if !has_experts {
                    "dense model".into()
                } else if stored_experts.is_some() {
                    "checkpoint".into()
                } else {
                    "absent from the checkpoint; the reference engine cannot load it".into()
                },
                compute: "f32".into(),
                kv: "f32".into(),
            },
        })
        .collect();
    let (cache, heatmap) = cache_and_heatmap(dir, cache_root, g.top_k, (attention, mlp));
    Ok(ModelFacts {
        path: dir.to_path_buf(),
        model_type: config.model_type().to_string(),
        geometry: geometry(&g),
        params: ParamCounts {
            total,
            routed_experts: routed,
            active_per_token: active,
        },
        formats: Formats {
            checkpoint_dtype,
            int4_expert_stride: stride,
            int4_expert_bytes: stride * experts,
            checkpoint_expert_bytes,
            backends,
        },
        cache,
        heatmap,
    })
}

fn geometry(g: &Geometry) -> GeometryFacts {
    let u = |v: usize| v as u64;
    GeometryFacts {
        vocab_size: u(g.vocab_size),
        hidden_size: u(g.hidden),
        num_layers: u(g.num_layers),
        moe_layers: u(g.num_moe_layers()),
        num_experts: u(g.num_experts),
        experts_per_token: u(g.top_k),
        num_attention_heads: u(g.num_heads),
        num_kv_heads: u(g.num_kv_heads),
        head_dim: u(g.head_dim),
        moe_intermediate_size: u(g.expert_intermediate),
        intermediate_size: u(g.intermediate),
        max_position_embeddings: u(g.max_position_embeddings),
        tie_word_embeddings: g.tie_word_embeddings,
    }
}

/// The cache where the CUDA engine would look for it
/// (`krasis_cache::cache_path`), whether it was built from this checkpoint,
/// and the heatmap bound to it.
fn cache_and_heatmap(
    dir: &Path,
    cache_root: Option<&Path>,
    top_k: usize,
    (attention, mlp): (&str, &str),
) -> (CacheState, HeatmapState) {
    let unavailable = |e: CacheError| {
        let reason = e.to_string();
        (
            CacheState::Unavailable {
                reason: reason.clone(),
            },
            HeatmapState::Unavailable { reason },
        )
    };
    let source = match ModelSource::open(dir) {
        Ok(s) => s,
        Err(e) => return unavailable(e),
    };
    let path = match krasis_cache::cache_path(&source, cache_root) {
        Ok(p) => p,
        Err(e) => return unavailable(e),
    };
    let no_cache = |why: &str| HeatmapState::Unavailable {
        reason: format!("the expert cache {why}; a heatmap is bound to a built cache"),
    };
    let Ok(meta) = std::fs::metadata(&path) else {
        let command = krasis_cache::rebuild_command(&source, &path);
        if let Some(e) = krasis_cache::format_1_beside(&path, &command) {
            let state = CacheState::OldFormat {
                path: path.with_file_name(krasis_cache::V1_FILE_NAME),
                reason: e.to_string(),
                command,
            };
            return (state, no_cache("is of an older format"));
        }
        return (CacheState::Missing { path }, no_cache("is not built yet"));
    };
    let cache =
        match ExpertCache::open_with(&path, source.config(), source.format(), Verify::HeaderOnly) {
            Ok(c) if c.source() == source.identity() => c,
            Ok(_) => {
                let reason = "built from a different checkpoint".to_string();
                return (CacheState::Invalid { path, reason }, no_cache("is stale"));
            }
            Err(e) => {
                let reason = e.to_string();
                return (
                    CacheState::Invalid { path, reason },
                    no_cache("is unusable"),
                );
            }
        };
    let hpath = krasis_cache::default_heatmap_path(&path);
    // The engine binds heatmaps to its attention and MLP precisions
    // (`setup::prior`).
    let heatmap = if !hpath.exists() {
        HeatmapState::Missing { path: hpath }
    } else {
        match krasis_cache::Heatmap::load_for_cache(&hpath, &cache, top_k, attention, mlp) {
            Ok(h) => HeatmapState::Present {
                tokens: h.tokens,
                routes: h.routes(),
                path: hpath,
            },
            Err(e) => HeatmapState::Invalid {
                path: hpath,
                reason: e.to_string(),
            },
        }
    };
    (
        CacheState::Valid {
            path,
            bytes: meta.len(),
        },
        heatmap,
    )
}

/// Count with a unit: `30.5B`, `145.2M`, `9.4K`, `512`.
pub fn fmt_count(n: u64) -> String {
    krasis_common::inspect::format_count(n)
}

fn human(m: &ModelReport) -> String {
    use krasis_common::format_size as b;
    match m {
        ModelReport::Error { path, reason } => {
            format!("{}\n  cannot be served: {reason}\n", path.display())
        }
        ModelReport::Ok(f) => {
            let g = &f.geometry;
            let mut s = format!(
                "{}\n  {}: {} parameters ({} routed experts, {} active per token)\n",
                f.path.display(),
                f.model_type,
                fmt_count(f.params.total),
                fmt_count(f.params.routed_experts),
                fmt_count(f.params.active_per_token),
            );
            s += &format!(
                "  {} layers ({} MoE), {} experts, {} per token; hidden {}, {} heads / {} KV heads of {}; context up to {} tokens\n",
                g.num_layers,
                g.moe_layers,
                g.num_experts,
                g.experts_per_token,
                g.hidden_size,
                g.num_attention_heads,
                g.num_kv_heads,
                g.head_dim,
                g.max_position_embeddings
            );
            s += &format!(
                "  checkpoint {}; routed experts {} as stored, {} in the expert cache\n",
                f.formats.checkpoint_dtype,
                b(f.formats.checkpoint_expert_bytes),
                b(f.formats.int4_expert_bytes)
            );
            for bf in &f.formats.backends {
                s += &format!(
                    "  {} backend: experts {}, compute {}, KV {}\n",
                    bf.backend.as_str(),
                    bf.describe_experts(),
                    bf.compute,
                    bf.kv
                );
            }
            s += &format!("  expert cache: {}\n", f.cache.describe());
            s += &format!("  heatmap: {}\n", f.heatmap.describe());
            s
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_synthetic_checkpoint_reports_its_facts_and_a_bad_dir_an_entry() {
        let dir = krasis_model::testutil::tiny_checkpoint("tiny");
        let cache = tempfile::tempdir().unwrap();
        let ModelReport::Ok(f) = inspect(&dir, Some(cache.path())) else {
            panic!("tiny is servable")
        };
        let g = ModelConfig::load(&dir).unwrap().geometry();
        assert_eq!(f.model_type, "qwen3_moe");
        assert_eq!(f.params.total, g.total_params());
        assert!(f.params.active_per_token < f.params.total);
        assert!(f.params.active_per_token > f.params.total - f.params.routed_experts);
        assert!(
            matches!(f.cache, CacheState::Missing { .. }),
            "{:?}",
            f.cache
        );
        assert!(matches!(f.heatmap, HeatmapState::Unavailable { .. }));
        // The engines' real precisions: INT4 from the cache on the GPU, the
        // checkpoint's own dtype on the reference engine.
        assert_eq!(f.formats.backend(Backend::Cuda).unwrap().experts, "int4");
        let r = f.formats.backend(Backend::Reference).unwrap();
        assert_eq!(r.experts, f.formats.checkpoint_dtype);
        assert_eq!(r.expert_source, "checkpoint");
        let bad = tempfile::tempdir().unwrap();
        match inspect(bad.path(), None) {
            ModelReport::Error { reason, .. } => {
                assert!(reason.contains("config.json"), "{reason}")
            }
            ok => panic!("{ok:?}"),
        }
        assert!(human(&inspect(bad.path(), None)).contains("cannot be served"));
    }

    /// Only a format-1 cache beside where format 2 would be: the report
    /// says launching refuses it and names the rebuild command, not "not
    /// built yet" (which would promise a build the engine refuses).
    #[test]
    fn a_format_1_cache_alone_is_reported_with_its_rebuild_command() {
        let dir = krasis_model::testutil::tiny_checkpoint("tiny");
        let root = tempfile::tempdir().unwrap();
        let source = ModelSource::open(&dir).unwrap();
        let v2 = krasis_cache::cache_path(&source, Some(root.path())).unwrap();
        let v1 = v2.with_file_name(krasis_cache::V1_FILE_NAME);
        std::fs::create_dir_all(v1.parent().unwrap()).unwrap();
        std::fs::write(&v1, b"KRSXINT4\x01\0\0\0").unwrap();
        let ModelReport::Ok(f) = inspect(&dir, Some(root.path())) else {
            panic!("tiny is servable")
        };
        let CacheState::OldFormat {
            path,
            reason,
            command,
        } = &f.cache
        else {
            panic!("{:?}", f.cache)
        };
        assert_eq!(path, &v1);
        assert!(
            command.starts_with("krasis-runtime build-cache --model "),
            "{command}"
        );
        assert!(
            reason.contains("format-1") && reason.contains(command.as_str()),
            "{reason}"
        );
        assert!(f.cache.describe().contains(command.as_str()));
        assert!(matches!(f.heatmap, HeatmapState::Unavailable { .. }));
    }

    #[test]
    fn a_gpt_oss_checkpoint_reports_mxfp4_experts_on_both_backends() {
        let dir = krasis_model::testutil::tiny_gpt_oss_checkpoint();
        let cache = tempfile::tempdir().unwrap();
        let ModelReport::Ok(f) = inspect(&dir, Some(cache.path())) else {
            panic!("tiny-gpt-oss is servable")
        };
        assert_eq!(f.model_type, "gpt_oss");
        assert_eq!(f.formats.checkpoint_dtype, "mxfp4");
        let r = f.formats.backend(Backend::Reference).unwrap();
        assert_eq!(
            (r.experts.as_str(), r.expert_source.as_str()),
            ("mxfp4", "checkpoint")
        );
        // The CUDA engine runs the experts from the cache, in MXFP4 as stored.
        let c = f.formats.backend(Backend::Cuda).unwrap();
        assert_eq!(c.experts, "mxfp4");
        assert!(
            c.expert_source.starts_with("expert cache ("),
            "{}",
            c.expert_source
        );
        // 4.25 bits per weight plus bf16 biases, summed over the tensors.
        let g = ModelConfig::load(&dir).unwrap().geometry();
        let (e, h, i) = (
            g.num_experts as u64,
            g.hidden as u64,
            g.expert_intermediate as u64,
        );
        let per_layer = e * 3 * h * i * 17 / 32 + e * (2 * i + h) * 2;
        assert_eq!(
            f.formats.checkpoint_expert_bytes,
            per_layer * g.num_moe_layers() as u64
        );
        assert!(human(&ModelReport::Ok(f)).contains("in the expert cache"));
    }
}
