//! `krasis-runtime`: the model server binary and its tools. Each subcommand
//! lives in its own module under `cmd/`; this file only parses and dispatches.

mod cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "krasis-runtime",
    version,
    about = "Krasis MoE inference runtime"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a deterministic synthetic Hugging Face checkpoint.
    Synth(cmd::synth::Args),
    /// Generate text from a prompt (prints text and tokens/s).
    Generate(cmd::generate::Args),
    /// Build (or validate) the INT4 expert cache of a model.
    BuildCache(cmd::cache::Args),
    /// Serve the OpenAI-compatible HTTP API.
    Serve(cmd::serve::Args),
    /// Measure prefill and decode speed.
    Bench(cmd::bench::Args),
    /// Record expert route counts on real text (the GPU expert cache's prior).
    Heatmap(cmd::heatmap::Args),
    /// Print what this runtime build implements.
    Capabilities(cmd::capabilities::Args),
    /// Print the facts of model directories (geometry, parameters, formats, cache).
    Inspect(cmd::inspect::Args),
    /// Print the pre-flight memory plan for a model and engine options.
    Plan(cmd::plan::Args),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    cmd::init_logging();
    let result = match cli.command {
        Command::Synth(a) => cmd::synth::run(a),
        Command::Generate(a) => cmd::generate::run(a),
        Command::BuildCache(a) => cmd::cache::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Heatmap(a) => cmd::heatmap::run(a),
        Command::Capabilities(a) => cmd::capabilities::run(a),
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Plan(a) => cmd::plan::run(a),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
