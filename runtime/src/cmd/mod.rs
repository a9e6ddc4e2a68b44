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
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KRASIS_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
