//! `krasis-runtime synth`: write a deterministic synthetic Hugging Face
//! checkpoint (see `krasis_model::synth`).

use anyhow::Context;
use krasis_model::arch::registry;
use krasis_model::synth::{
    self, ChatTemplateKind, SynthDtype, SynthOptions, SynthSpec, TokenizerSource,
};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Model geometry (the architecture registry's presets).
    #[arg(long, value_parser = preset_parser())]
    pub preset: String,
    /// Output directory (must not exist, or be empty).
    #[arg(long)]
    pub out: PathBuf,
    /// Seed of every tensor's values.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stored element type.
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "f32"])]
    pub dtype: String,
    /// Zipf exponent of expert popularity (0 = no skew); the formula is
    /// recorded in krasis_synth.json.
    #[arg(long, default_value_t = 0.0)]
    pub router_skew: f32,
    /// Maximum tensor bytes per shard file (e.g. 4GB, 500MB, 2GiB).
    #[arg(long, default_value = "4GB")]
    pub shard_size: String,
    /// Path of the family's BPE ranks: qwen.tiktoken (tools/vocab.sh) or, for
    /// gpt-oss, o200k_base.tiktoken (tools/harmony/vocab.sh); default: found
    /// in .cache/vocab/.
    #[arg(long)]
    pub vocab: Option<PathBuf>,
    /// Chat template written into tokenizer_config.json (default: the
    /// family's own, qwen3 or gpt-oss).
    #[arg(long, value_parser = ["qwen3", "qwen3-coder", "gpt-oss"])]
    pub chat_template: Option<String>,
    /// Override a config.json field, e.g. --set num_hidden_layers=4 (value is JSON). Repeatable.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Write everything except the routed expert tensors; build the INT4
    /// cache from the generator instead (recorded in krasis_synth.json).
    #[arg(long)]
    pub experts_in_cache_only: bool,
    /// Write no tokenizer.json / tokenizer_config.json (weights and configs only).
    #[arg(long)]
    pub no_tokenizer: bool,
}

/// `--preset` values with their one-line summaries, from the registry, so
/// help and validation list exactly the presets that exist.
fn preset_parser() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(
        registry::presets().map(|(_, p)| clap::builder::PossibleValue::new(p.name).help(p.summary)),
    )
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let dtype = SynthDtype::parse(&a.dtype)
        .with_context(|| format!("--dtype {}: expected bf16 or f32", a.dtype))?;
    let chat_template = a
        .chat_template
        .as_deref()
        .map(|t| {
            ChatTemplateKind::parse(t).with_context(|| {
                format!("--chat-template {t}: expected qwen3, qwen3-coder or gpt-oss")
            })
        })
        .transpose()?;
    let shard_bytes = krasis_common::size::parse_size(&a.shard_size)
        .map_err(|e| anyhow::anyhow!("--shard-size: {e}"))?;
    let overrides = a
        .set
        .iter()
        .map(|s| synth::parse_override(s))
        .collect::<Result<Vec<_>, _>>()?;
    let spec = SynthSpec::new(&a.preset, a.seed, dtype, a.router_skew, &overrides)?;
    let g = spec.geometry();
    let tokenizer = if a.no_tokenizer {
        TokenizerSource::None
    } else {
        TokenizerSource::for_family(spec.config(), a.vocab)
    };
    let mut opts = SynthOptions::new(spec);
    opts.shard_bytes = shard_bytes;
    if let Some(t) = chat_template {
        opts.chat_template = t;
    }
    opts.skip_routed_experts = a.experts_in_cache_only;
    opts.progress = true;
    opts.tokenizer = tokenizer;
    eprintln!(
        "synthesizing '{}' ({:.3}B parameters, {} layers, {} experts top-{}) into {}",
        a.preset,
        g.total_params() as f64 / 1e9,
        g.num_layers,
        g.num_experts,
        g.top_k,
        a.out.display()
    );
    let s = synth::synthesize(&opts, &a.out)?;
    println!(
        "wrote {}: {} tensors in {} shard(s), {:.3} GB in {:.1} s ({:.2} GB/s)",
        s.dir.display(),
        s.tensors,
        s.shard_files.len(),
        s.tensor_bytes as f64 / 1e9,
        s.seconds,
        s.bytes_per_second() / 1e9
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        a: Args,
    }

    #[test]
    fn preset_flag_offers_exactly_the_registry_presets() {
        let cmd = Cli::command();
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_id() == "preset")
            .unwrap();
        let offered: Vec<String> = arg
            .get_possible_values()
            .iter()
            .map(|v| v.get_name().to_string())
            .collect();
        let registered: Vec<String> = registry::presets()
            .map(|(_, p)| p.name.to_string())
            .collect();
        assert_eq!(offered, registered);
        for name in &registered {
            Cli::try_parse_from(["synth", "--preset", name, "--out", "o"]).unwrap();
        }
        let e = Cli::try_parse_from(["synth", "--preset", "nope", "--out", "o"])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("a3b-24l"), "{e}");
    }
}
