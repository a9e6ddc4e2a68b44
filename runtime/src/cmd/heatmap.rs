//! `krasis-runtime heatmap`: records how often each routed expert is
//! selected while the CUDA engine prefills real text, and writes the
//! versioned heatmap (`krasis_cache::Heatmap`) that the GPU expert cache
//! uses as its prior for the initial resident set.
//!
//! The prompts come from a text kept apart from the benchmark prompts
//! (`assets/text/kjv-psalms-matthew.txt`, see `assets/text/PROVENANCE.md`),
//! so the resident set is never fitted to the text used to report speed.

use super::engines::EngineArgs;
use anyhow::{Context, bail, ensure};
use krasis_cache::{
    ExpertCache, Heatmap, HeatmapBinding, default_heatmap_path, describe_prompt_text,
};
use krasis_common::options::{Backend, HeatmapChoice};
use krasis_gpu::{CudaEngine, CudaEngineOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// The benchmark's prompt text: warned about when used for a heatmap.
const BENCH_TEXT: &str = "assets/text/kjv-genesis-exodus.txt";

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Model, backend (only `cuda` records routes), cache directory, VRAM
    /// limit and context length, exactly as for `serve`.
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Prompt tokens to record in all.
    #[arg(long, default_value_t = 16384)]
    pub tokens: usize,
    /// Tokens per prompt (each prompt is prefilled from an empty KV cache).
    #[arg(long, default_value_t = 4096)]
    pub prompt_tokens: usize,
    /// Real text the prompts are tokenized from (keep it different from the
    /// benchmark text).
    #[arg(
        long,
        value_name = "FILE",
        default_value = "assets/text/kjv-psalms-matthew.txt"
    )]
    pub text: PathBuf,
    /// Where to write the heatmap (default: heatmap-v1.json next to the
    /// model's expert cache file, where the server looks for it).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

fn record_routes(engine: &mut CudaEngine, prompt: &[u32]) -> anyhow::Result<Vec<Vec<u64>>> {
    Ok(engine.record_routes(prompt)?)
}

fn expert_cache(engine: &CudaEngine) -> anyhow::Result<&Arc<ExpertCache>> {
    engine.expert_cache().ok_or_else(|| {
        anyhow::anyhow!("the model has no routed experts; there is nothing to record")
    })
}

/// Cuts `total` tokens into prompts of at most `per` tokens, taken in order
/// from `base` and starting again at its beginning when it runs out (the
/// bool says whether it did).
fn split_prompts(base: &[u32], total: usize, per: usize) -> (Vec<Vec<u32>>, bool) {
    if base.is_empty() || per == 0 {
        return (Vec::new(), false);
    }
    let stream: Vec<u32> = base.iter().copied().cycle().take(total).collect();
    let prompts = stream.chunks(per).map(<[u32]>::to_vec).collect();
    (prompts, total > base.len())
}

/// Pairs that make up the top `percent`% of all (layer, expert) pairs (at least one).
fn top_share_pairs(pairs: usize, percent: usize) -> usize {
    (pairs * percent).div_ceil(100).max(1)
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

pub fn run(a: Args) -> anyhow::Result<()> {
    ensure!(a.tokens >= 1, "--tokens must be at least 1");
    ensure!(a.prompt_tokens >= 1, "--prompt-tokens must be at least 1");
    if a.engine.backend != Backend::Cuda {
        bail!(
            "heatmap records the routes of the cuda backend (the one that uses the heatmap); \
             --backend reference is not supported here"
        );
    }
    if a.engine.heatmap != "auto" {
        bail!(
            "--heatmap {} does not apply here: this command records a heatmap (write it \
             elsewhere with --out FILE); it always runs without a prior",
            a.engine.heatmap
        );
    }
    let mut per = a.prompt_tokens.min(a.tokens);
    if let Some(context) = a.engine.context_length {
        ensure!(
            context >= per,
            "--context-length {context} is shorter than a prompt ({per} tokens); raise it or lower --prompt-tokens"
        );
    }
    let model = &a.engine.model;
    let config = krasis_model::ModelConfig::load(model)
        .with_context(|| format!("reading the model config in {}", model.display()))?;
    let max_pos = config.geometry().max_position_embeddings;
    if per > max_pos {
        tracing::warn!(
            prompt_tokens = per,
            max_position_embeddings = max_pos,
            "prompts are shortened to the model's maximum length"
        );
        per = max_pos;
    }
    let context = a.engine.context_length.unwrap_or(per);
    if same_file(&a.text, Path::new(BENCH_TEXT)) {
        tracing::warn!(
            text = %a.text.display(),
            "the heatmap is being recorded on the benchmark's prompt text; bench results will \
             then favour the resident set (use the default heatmap text for honest numbers)"
        );
    }

    let tok = krasis_model::tokenizer::Tokenizer::from_dir(model).with_context(|| {
        format!(
            "loading the tokenizer of {} for the heatmap prompts",
            model.display()
        )
    })?;
    let bytes = std::fs::read(&a.text).with_context(|| {
        format!(
            "reading heatmap prompt text {} (run from the repository root or pass --text)",
            a.text.display()
        )
    })?;
    let body = std::str::from_utf8(&bytes)
        .with_context(|| format!("{} is not UTF-8 text", a.text.display()))?;
    let base = tok
        .encode(body)
        .context("tokenizing the heatmap prompt text")?;
    ensure!(
        !base.is_empty(),
        "{} tokenizes to nothing",
        a.text.display()
    );
    let (prompts, repeated) = split_prompts(&base, a.tokens, per);
    if repeated {
        tracing::warn!(
            text_tokens = base.len(),
            tokens = a.tokens,
            "the prompt text is shorter than --tokens; it is repeated from its beginning"
        );
    }
    let text_name = a.text.file_name().map_or_else(
        || a.text.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let source = format!(
        "{}; {} tokens ({} in the text{}) in {} prompts of up to {per} tokens",
        describe_prompt_text(&text_name, &bytes),
        a.tokens,
        base.len(),
        if repeated { ", repeated" } else { "" },
        prompts.len()
    );

    let opts = CudaEngineOptions {
        context_length: Some(context),
        // Routes do not depend on which experts are resident, and the
        // heatmap being recorded cannot be the prior of its own run: a model
        // that does not fit in VRAM must load without one.
        heatmap: HeatmapChoice::Off,
        ..a.engine.cuda_options()
    };
    let mut engine = CudaEngine::load(model, &opts)
        .with_context(|| format!("loading {} with the cuda backend", model.display()))?;
    let cache = Arc::clone(expert_cache(&engine)?);
    let top_k = engine.geometry().top_k;
    // The precisions of the engine's attention and MLP blocks (the model's
    // `AttentionSpec::activations`, `MlpSpec::activations`) are in the
    // binding: others can change routes.
    let g = engine.geometry();
    let binding = HeatmapBinding::for_cache(
        &cache,
        top_k,
        g.attention.activations.name(),
        g.mlp.activations.name(),
    );
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| default_heatmap_path(cache.path()));
    let mut heatmap = Heatmap::for_cache(
        &cache,
        binding,
        source,
        format!("krasis-runtime {}", env!("CARGO_PKG_VERSION")),
    );

    let start = Instant::now();
    let mut done = 0usize;
    for (i, prompt) in prompts.iter().enumerate() {
        let t = Instant::now();
        let counts = record_routes(&mut engine, prompt)
            .with_context(|| format!("recording the routes of prompt {}", i + 1))?;
        let secs = t.elapsed().as_secs_f64();
        heatmap
            .add(&counts, prompt.len() as u64)
            .context("the CUDA engine returned route counts of the wrong shape")?;
        // Every token of every MoE layer routes to exactly top_k experts.
        let want = (prompt.len() * top_k) as u64;
        for (j, row) in counts.iter().enumerate() {
            let got: u64 = row.iter().sum();
            ensure!(
                got == want,
                "MoE layer {j} (decoder layer {}) recorded {got} routes for {} tokens, expected {want} (top-{top_k})",
                heatmap.moe_layers[j],
                prompt.len()
            );
        }
        done += prompt.len();
        eprintln!(
            "prompt {}/{}: {} tokens, {:.0} tok/s ({done}/{} tokens, {:.0} tok/s overall)",
            i + 1,
            prompts.len(),
            prompt.len(),
            prompt.len() as f64 / secs.max(1e-9),
            a.tokens,
            done as f64 / start.elapsed().as_secs_f64().max(1e-9)
        );
    }

    heatmap
        .save(&out)
        .with_context(|| format!("writing the heatmap to {}", out.display()))?;
    let pairs = heatmap.moe_layers.len() * heatmap.num_experts;
    let top1 = top_share_pairs(pairs, 1);
    let top10 = top_share_pairs(pairs, 10);
    println!(
        "heatmap: {} tokens in {} prompts, {} routes over {} MoE layers x {} experts (top-{top_k}), {:.1} s",
        heatmap.tokens,
        prompts.len(),
        heatmap.routes(),
        heatmap.moe_layers.len(),
        heatmap.num_experts,
        start.elapsed().as_secs_f64()
    );
    println!(
        "top 1% of experts ({top1} of {pairs}) take {:.1}% of routes; top 10% ({top10}) take {:.1}%",
        100.0 * heatmap.coverage_of(top1),
        100.0 * heatmap.coverage_of(top10)
    );
    println!("wrote {}", out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    #[test]
    fn defaults_and_flags() {
        let cli = Cli::try_parse_from(["x", "--model", "m"]).unwrap();
        assert_eq!(cli.args.tokens, 16384);
        assert_eq!(cli.args.prompt_tokens, 4096);
        assert_eq!(cli.args.engine.backend, Backend::Cuda);
        assert_eq!(
            cli.args.text,
            Path::new("assets/text/kjv-psalms-matthew.txt")
        );
        assert_ne!(cli.args.text, Path::new(BENCH_TEXT));
        assert!(cli.args.out.is_none());
        let cli = Cli::try_parse_from([
            "x",
            "--model",
            "m",
            "--cache-dir",
            "c",
            "--vram-limit",
            "20GiB",
            "--tokens",
            "100",
            "--prompt-tokens",
            "30",
            "--out",
            "h.json",
        ])
        .unwrap();
        assert_eq!(cli.args.engine.vram_limit, Some(20 << 30));
        assert_eq!(cli.args.engine.cache_dir.as_deref(), Some(Path::new("c")));
        assert_eq!(cli.args.out.as_deref(), Some(Path::new("h.json")));
        assert_eq!((cli.args.tokens, cli.args.prompt_tokens), (100, 30));
    }

    #[test]
    fn bad_arguments_are_refused_before_loading() {
        let parse = |extra: &[&str]| {
            let mut v = vec!["x", "--model", "/nonexistent"];
            v.extend_from_slice(extra);
            Cli::try_parse_from(v).unwrap().args
        };
        for (extra, what) in [
            (&["--tokens", "0"][..], "--tokens"),
            (&["--prompt-tokens", "0"][..], "--prompt-tokens"),
            (&["--backend", "reference"][..], "reference"),
            (&["--context-length", "10"][..], "--context-length"),
            (&["--heatmap", "off"][..], "--heatmap off does not apply"),
        ] {
            let e = format!("{:#}", run(parse(extra)).unwrap_err());
            assert!(e.contains(what), "{extra:?}: {e}");
        }
    }

    #[test]
    fn prompts_are_consecutive_and_repeat_only_when_needed() {
        let base: Vec<u32> = (0..10).collect();
        let (p, rep) = split_prompts(&base, 10, 4);
        assert!(!rep);
        assert_eq!(p, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]);
        let (p, rep) = split_prompts(&base, 14, 7);
        assert!(rep);
        assert_eq!(
            p,
            vec![(0..7).collect::<Vec<_>>(), vec![7, 8, 9, 0, 1, 2, 3]]
        );
        let (p, _) = split_prompts(&base, 3, 100);
        assert_eq!(p, vec![vec![0, 1, 2]]);
        assert!(split_prompts(&[], 5, 2).0.is_empty());
        assert_eq!(top_share_pairs(94 * 128, 1), 121);
        assert_eq!(top_share_pairs(3 * 8, 1), 1);
        assert_eq!(top_share_pairs(0, 1), 1);
    }

    #[test]
    fn heatmap_text_is_the_documented_asset() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let text = std::fs::read(root.join("assets/text/kjv-psalms-matthew.txt")).unwrap();
        assert_eq!(text.len(), 348_152);
        let bench = std::fs::read(root.join(BENCH_TEXT)).unwrap();
        assert_ne!(text, bench);
        let provenance = std::fs::read_to_string(root.join("assets/text/PROVENANCE.md")).unwrap();
        assert!(provenance.contains("# kjv-psalms-matthew.txt"));
        assert!(provenance.contains("348,152 bytes"));
    }
}
