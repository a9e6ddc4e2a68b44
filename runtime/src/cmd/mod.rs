pub mod bench;
pub mod cache;
pub mod capabilities;
pub mod engines;
pub mod generate;
pub mod heatmap;
pub mod inspect;
pub mod plan;
pub mod serve;
pub mod synth;

/// Human-readable logs go to stderr so stdout stays free for results and
/// `--progress-json` events. `KRASIS_LOG`/`RUST_LOG` only select log verbosity.
/// Colours only when stderr is a terminal: piped into the launcher, a file
/// or a journal, escape codes would be noise in every line. (Progress bars
/// hide themselves off a terminal the same way: indicatif's stderr target
/// draws nothing there, and the cache builder asks for none.)
pub fn init_logging() {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("KRASIS_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}
