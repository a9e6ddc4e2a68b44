//! `krasis-runtime bench`: internal prefill and decode speed of the CUDA
//! engine on real text, with min free VRAM, identity and the physical bound
//! beside each figure; `bench --check` runs the correctness checks instead
//! (witness fixtures, CPU reference over the same INT4 cache, determinism
//! across fresh processes).

mod baseline;
mod batched;
mod check;
mod grammar;
mod hcs_check;
mod speed;
mod stats;

use std::path::PathBuf;

#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Hugging Face model directory (its INT4 expert cache is opened or built).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// INT4 expert cache root (default: the platform cache directory).
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    /// KV-cache positions (default: longest prompt + longest decode + 16).
    #[arg(long, value_name = "TOKENS")]
    pub context_length: Option<usize>,
    /// Prompt tokens per prefill chunk.
    #[arg(long, default_value_t = 8192)]
    pub prefill_chunk: usize,
    /// Prompt lengths to measure prefill at (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1000,8000,32000")]
    pub prompt_tokens: Vec<usize>,
    /// Decode lengths to measure (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "50,100,250")]
    pub decode_tokens: Vec<usize>,
    /// Prompt length for the decode measurements ("short context").
    #[arg(long, default_value_t = 32)]
    pub decode_prompt_tokens: usize,
    /// Sample the decode measurements at this temperature (seeded, so
    /// every run draws the same tokens) instead of greedily. On a
    /// synthetic model greedy text soon repeats itself, and so do its
    /// expert routes; sampled text does not, which is the harder case for
    /// an expert cache that keeps recent experts. 0: greedy.
    #[arg(long, default_value_t = 0.0, value_name = "T")]
    pub decode_temperature: f32,
    /// Timed runs of each measurement, at least 3: min / median / max are
    /// reported (the median, mean of the middle two for even counts, is the
    /// figure). Each measurement first gets one warm-up run of the same
    /// length, reported as `warmup_tok_s` and never counted.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Real text the prompts are tokenized from.
    #[arg(
        long,
        value_name = "FILE",
        default_value = "assets/text/kjv-genesis-exodus.txt"
    )]
    pub text: PathBuf,
    /// Write the results as JSON here.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Append the one-line markdown summary to this file.
    #[arg(long, value_name = "FILE")]
    pub markdown: Option<PathBuf>,
    /// Commit the binary was built from (recorded in the identity).
    #[arg(long)]
    pub commit: Option<String>,
    /// Run the correctness checks instead of measuring speed.
    #[arg(long)]
    pub check: bool,
    /// Witness fixture directory (`tests/fixtures/witness/<case>/int4`) of
    /// the checkpoint in --model, for --check. Repeatable.
    #[arg(long, value_name = "DIR")]
    pub witness: Vec<PathBuf>,
    /// Length of the long sequence compared with the CPU reference (--check).
    #[arg(long, default_value_t = 4096)]
    pub long_tokens: usize,
    /// Skip the CPU reference comparison (--check on models too large for it).
    #[arg(long)]
    pub no_reference: bool,
    /// Fresh processes that must generate identical greedy text (--check).
    #[arg(long, default_value_t = 5)]
    pub determinism_runs: usize,
    /// Greedy tokens each determinism process generates.
    #[arg(long, default_value_t = 256)]
    pub determinism_tokens: usize,
    /// Use at most this much GPU memory, e.g. `6GiB` (experts that do not
    /// fit are cached by HCS and copied on demand).
    #[arg(long, value_name = "SIZE", value_parser = super::engines::parse_vram_limit)]
    pub vram_limit: Option<u64>,
    /// Initial HCS residents: `auto` (the heatmap next to the cache), `off`,
    /// or a heatmap file.
    #[arg(long, default_value = "auto")]
    pub heatmap: String,
    /// Free VRAM kept in reserve after calibration, MiB.
    #[arg(long, default_value_t = krasis_common::DEFAULT_SAFETY_MARGIN_MIB)]
    pub safety_margin_mib: u64,
    /// With --vram-limit: also measure the all-resident engine (no limit)
    /// first, for the bounds of the constrained figures.
    #[arg(long)]
    pub baseline: bool,
    /// With --vram-limit: take the all-resident figures from the
    /// `baseline` section of an earlier bench JSON of the same model
    /// (they do not depend on the limit) instead of measuring them again.
    #[arg(long, value_name = "FILE", conflicts_with = "baseline")]
    pub baseline_from: Option<PathBuf>,
    /// Check that HCS at each of these VRAM limits (comma-separated, e.g.
    /// `6GiB,10GiB`) is bit-identical to the all-resident engine.
    #[arg(long, value_delimiter = ',', value_name = "SIZES")]
    pub hcs_exactness: Vec<String>,
    /// Also measure the aggregate decode speed of this many sequences
    /// decoding together (comma-separated row counts, e.g. `1,2,4,8`),
    /// each with a `--decode-prompt-tokens` prompt and the first of
    /// `--decode-tokens` new tokens, with a breakdown of one step.
    #[arg(long, value_delimiter = ',', value_name = "ROWS")]
    pub decode_rows: Vec<usize>,
    /// Under HCS, besides the engine's default decode prefetch (measured
    /// with graphs on and off): decode with graphs on and each of these
    /// prefetch settings (most experts prefetched per MoE layer,
    /// comma-separated; 0: off). Not measured when every expert is
    /// resident (the run says so).
    #[arg(long, value_delimiter = ',', value_name = "N", default_value = "2,8")]
    pub hcs_prefetch: Vec<usize>,
    /// All resident: after each prompt length's runs, time the prefill's
    /// parts (attention, router, routed experts, the rest) with CUDA
    /// events. Refused under a VRAM limit (streamed prefill's parts overlap
    /// its copies).
    #[arg(long, conflicts_with_all = ["check", "hcs_exactness", "vram_limit"])]
    pub prefill_breakdown: bool,
    /// Under HCS, give the decode recency tail this many slots of the
    /// reclaimable tier (default: the engine's split), the rest to the
    /// heatmap prior: measures the split. Bench only.
    #[arg(long, value_name = "SLOTS")]
    pub hcs_tail: Option<usize>,
    /// Also measure decode with a grammar active (structured output)
    /// against the same decode without one, at each `--decode-tokens`
    /// count (graphs on, greedy; the model needs its tokenizer).
    #[arg(long)]
    pub grammar: bool,
    /// Internal: generate once and print the tokens (used by --check).
    #[arg(long, hide = true)]
    pub determinism_child: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.determinism_child {
        check::determinism_child(&a)
    } else if !a.hcs_exactness.is_empty() {
        hcs_check::run(&a)
    } else if a.check {
        check::run(&a)
    } else {
        speed::run(&a)
    }
}

/// Engine options from the bench flags, for a KV cache of `context`.
pub(crate) fn engine_options(
    a: &Args,
    context: usize,
) -> anyhow::Result<krasis_gpu::CudaEngineOptions> {
    // Batched decode rows (--decode-rows) each hold their own KV rows.
    let rows = a.decode_rows.iter().copied().max().unwrap_or(1).max(1);
    let per_seq = a.decode_prompt_tokens + batched::decode_tokens(a) + 1;
    Ok(krasis_gpu::CudaEngineOptions {
        context_length: Some(context),
        parallel: (rows > 1).then_some(rows),
        kv_rows: (rows > 1).then_some(context.max(rows * per_seq)),
        prefill_chunk: a.prefill_chunk,
        cache_root: a.cache_dir.clone(),
        vram_limit: a.vram_limit,
        heatmap: krasis_common::options::HeatmapChoice::parse(&a.heatmap),
        safety_margin: a.safety_margin_mib << 20,
        hcs_tail_slots: a.hcs_tail,
        ..krasis_gpu::CudaEngineOptions::default()
    })
}

/// `n` tokens of `text`'s tokenization, repeated if the text is shorter
/// (returns whether it had to repeat).
pub(crate) fn text_tokens(
    model: &std::path::Path,
    text: &std::path::Path,
    n: usize,
) -> anyhow::Result<(Vec<u32>, bool)> {
    use anyhow::Context;
    let tok = krasis_model::tokenizer::Tokenizer::from_dir(model).with_context(|| {
        format!(
            "loading the tokenizer of {} for the bench prompts",
            model.display()
        )
    })?;
    let body = std::fs::read_to_string(text).with_context(|| {
        format!(
            "reading prompt text {} (run from the repository root or pass --text)",
            text.display()
        )
    })?;
    let base = tok.encode(&body).context("tokenizing the prompt text")?;
    anyhow::ensure!(!base.is_empty(), "{} tokenizes to nothing", text.display());
    let repeated = base.len() < n;
    let out: Vec<u32> = base.iter().copied().cycle().take(n).collect();
    Ok((out, repeated))
}

#[cfg(test)]
mod tests {
    use super::Args;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: Args,
    }

    /// `bench --model /models/qcn` with `extra`, as the command line parses
    /// it (the bench modules' tests share it).
    pub(super) fn parse(extra: &[&str]) -> Result<Args, clap::Error> {
        let mut v = vec!["bench", "--model", "/models/qcn"];
        v.extend_from_slice(extra);
        Cli::try_parse_from(v).map(|c| c.bench)
    }

    #[test]
    fn the_prefill_breakdown_is_refused_where_it_would_be_ignored() {
        assert!(parse(&["--prefill-breakdown"]).unwrap().prefill_breakdown);
        for other in [
            &["--vram-limit", "6GiB"][..],
            &["--check"],
            &["--hcs-exactness", "6GiB"],
        ] {
            let mut v = vec!["--prefill-breakdown"];
            v.extend_from_slice(other);
            let e = parse(&v)
                .err()
                .unwrap_or_else(|| panic!("{v:?} was accepted"));
            assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict, "{v:?}");
        }
    }
}
