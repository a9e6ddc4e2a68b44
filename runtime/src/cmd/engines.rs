//! Engine construction shared by `generate`, `serve` and `bench`: one set of
//! flags ([`EngineArgs`], flattened into each subcommand) and one place that
//! turns them into a `Box<dyn Engine>`. The backend is always the one asked
//! for; nothing falls back to another backend.

use anyhow::{Context, bail};
use krasis_common::events::EventSink;
use krasis_common::options::{Backend, PrefixCacheChoice};
use krasis_model::Engine;
use krasis_model::reference::{ReferenceEngine, ReferenceOptions};
use std::path::PathBuf;

#[derive(clap::Args, Debug, Clone)]
pub struct EngineArgs {
    /// Hugging Face model directory (config.json, safetensors, tokenizer).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// `cuda` (the GPU engine) or `reference` (the CPU f32 oracle: exact but
    /// slow, for checks and tiny models).
    #[arg(long, default_value = "cuda", value_parser = parse_backend)]
    pub backend: Backend,
    /// Maximum prompt + generated tokens; the KV cache is sized for it
    /// (default: the model's max_position_embeddings; the reference backend
    /// caps the default at 32768).
    #[arg(long, value_name = "TOKENS")]
    pub context_length: Option<usize>,
    /// Expert cache directory (cuda backend; default: the platform cache directory).
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Use at most this much GPU memory (cuda backend): `20GiB` (2^30),
    /// `20GB` (10^9) or a byte count.
    #[arg(long, value_name = "SIZE", value_parser = parse_vram_limit)]
    pub vram_limit: Option<u64>,
    /// Free VRAM kept in reserve after calibration, in MiB (cuda backend).
    #[arg(long, default_value_t = krasis_common::DEFAULT_SAFETY_MARGIN_MIB)]
    pub safety_margin_mib: u64,
    /// Keep hot experts in spare VRAM and copy the others on demand:
    /// on|off (cuda backend, where it defaults to on; off needs every expert
    /// to fit). The reference backend has no HCS and refuses `on`.
    #[arg(long, value_parser = ["on", "off"])]
    pub hcs: Option<String>,
    /// Initial HCS residents: auto (the heatmap next to the expert cache),
    /// off, or a heatmap file (cuda backend).
    #[arg(long, default_value = "auto")]
    pub heatmap: String,
    /// CUDA device ordinal (cuda backend); `nvidia-smi -L` lists them.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub gpu: u32,
    /// The prefix cache, which keeps the KV of prompt prefixes for later
    /// requests that start with them, and its first tier: `auto` (cuda: a
    /// VRAM pool of the smaller of one context's KV and half the VRAM left
    /// once every expert is resident, taken before HCS places experts, and
    /// none when not every expert fits; reference: 256 MiB of host memory),
    /// `off` (no cache at all), or a size such as `2GiB` (`0`: no first
    /// tier, the RAM tier carries the cache). Default: auto for `serve`,
    /// off otherwise.
    #[arg(long, value_name = "auto|off|SIZE", value_parser = parse_prefix_cache)]
    pub prefix_cache: Option<PrefixCacheChoice>,
    /// The prefix cache's RAM tier, where blocks evicted from the first tier
    /// go and are restored from: `auto` (cuda: page-locked host memory, the
    /// smaller of four contexts' KV and a quarter of the available host
    /// memory; reference: 1 GiB), `off`, or a size (default: auto for
    /// `serve`, off otherwise).
    #[arg(long, value_name = "auto|off|SIZE", value_parser = parse_prefix_cache)]
    pub prefix_cache_host: Option<PrefixCacheChoice>,
    /// Prompt tokens per prefix cache block, a multiple of 64 (default
    /// 256): a later prompt reuses every whole block it shares and
    /// prefills the rest.
    #[arg(long, value_name = "TOKENS", value_parser = parse_prefix_block)]
    pub prefix_block: Option<u32>,
    /// Prompt tokens per prefill chunk (default: cuda 8192, reference 512);
    /// any prefill rows form prefix cache blocks whatever the chunk.
    #[arg(long, value_name = "TOKENS")]
    pub prefill_chunk: Option<usize>,
    /// KV memory all running requests share, in tokens (reference: default
    /// 8 contexts, so each of its 8 sequences can hold a whole context;
    /// cuda: the KV arena's rows, at least the context, default one
    /// context). A request reserves its prompt + max_tokens when it starts;
    /// one that does not fit beside the running ones waits in the queue,
    /// one that never fits is refused.
    #[arg(long, value_name = "TOKENS")]
    pub kv_tokens: Option<u64>,
    /// Most requests decoding together (`serve --parallel`; the cuda
    /// engine sizes its per-sequence state and decode graphs for them).
    /// Not a flag of this group: `serve` sets it.
    #[arg(skip)]
    pub parallel: Option<u32>,
    /// The prefix cache's file (`serve --prefix-cache-file`): loaded now,
    /// written when the server stops. Not a flag of this group: only
    /// `serve` saves it.
    #[arg(skip)]
    pub prefix_cache_file: Option<PathBuf>,
}

/// The reference engine's prefix cache tiers under `auto`: host memory.
pub const REFERENCE_AUTO_PREFIX_CACHE: u64 = 256 << 20;
pub const REFERENCE_AUTO_PREFIX_CACHE_HOST: u64 = 1 << 30;

impl EngineArgs {
    /// Whether HCS is on: as asked, else on exactly for the cuda backend.
    pub fn hcs_enabled(&self) -> bool {
        match self.hcs.as_deref() {
            Some(v) => v == "on",
            None => self.backend == Backend::Cuda,
        }
    }

    /// The CUDA engine options these flags describe.
    pub fn cuda_options(&self) -> krasis_gpu::CudaEngineOptions {
        let d = krasis_gpu::CudaEngineOptions::default();
        krasis_gpu::CudaEngineOptions {
            prefix_cache: self.prefix_cache.unwrap_or(PrefixCacheChoice::Off),
            prefix_cache_host: self.prefix_cache_host.unwrap_or(PrefixCacheChoice::Off),
            prefix_block: self.prefix_block.map_or(d.prefix_block, |b| b as usize),
            prefill_chunk: self.prefill_chunk.unwrap_or(d.prefill_chunk),
            context_length: self.context_length,
            cache_root: self.cache_dir.clone(),
            vram_limit: self.vram_limit,
            device: self.gpu as usize,
            hcs: self.hcs_enabled(),
            heatmap: krasis_common::options::HeatmapChoice::parse(&self.heatmap),
            safety_margin: self.safety_margin_mib << 20,
            parallel: self.parallel.map(|n| n as usize),
            kv_rows: self
                .kv_tokens
                .map(|t| usize::try_from(t).unwrap_or(usize::MAX)),
            prefix_cache_file: self.prefix_cache_file.clone(),
            ..krasis_gpu::CudaEngineOptions::default()
        }
    }
}

fn parse_prefix_cache(s: &str) -> Result<PrefixCacheChoice, String> {
    PrefixCacheChoice::parse(s).map_err(|e| e.reason)
}

fn parse_prefix_block(s: &str) -> Result<u32, String> {
    let v: u32 = s
        .parse()
        .map_err(|_| format!("'{s}' is not a whole number of tokens"))?;
    krasis_common::options::check_prefix_block(v).map_err(|e| e.reason)?;
    Ok(v)
}

fn parse_backend(s: &str) -> Result<Backend, String> {
    Backend::parse(s).map_err(|e| e.reason)
}

/// A byte size flag (`20GiB`, `8000MB`, a byte count), read by the rules
/// the launcher uses too (`krasis_common::size`).
pub(crate) fn parse_vram_limit(s: &str) -> Result<u64, String> {
    krasis_common::size::parse_size(s).map_err(|e| e.to_string())
}

/// Loads the engine `args` ask for.
pub fn load_engine(args: &EngineArgs) -> anyhow::Result<Box<dyn Engine>> {
    load_engine_reporting(args, None)
}

/// [`load_engine`] that sends the byte progress of loading (weights, expert
/// cache build, pinning, expert upload) to `progress`.
pub fn load_engine_reporting(
    args: &EngineArgs,
    progress: Option<EventSink<'_>>,
) -> anyhow::Result<Box<dyn Engine>> {
    match args.backend {
        Backend::Reference => {
            // These would be silently ignored by a CPU engine that reads
            // experts from the checkpoint, so they are refused instead.
            if args.vram_limit.is_some() {
                bail!(
                    "--vram-limit applies to the cuda backend; the reference backend runs on the CPU"
                );
            }
            if args.heatmap != "auto"
                || args.safety_margin_mib != krasis_common::DEFAULT_SAFETY_MARGIN_MIB
            {
                bail!(
                    "--heatmap and --safety-margin-mib apply to the cuda backend's expert cache; \
                     the reference backend keeps every expert in host memory"
                );
            }
            if args.hcs.as_deref() == Some("on") {
                bail!(
                    "--hcs on applies to the cuda backend's expert cache; the reference backend keeps every expert in host memory"
                );
            }
            if args.gpu != 0 {
                bail!(
                    "--gpu {} applies to the cuda backend; the reference backend runs on the CPU",
                    args.gpu
                );
            }
            if args.cache_dir.is_some() {
                bail!(
                    "--cache-dir applies to the cuda backend; the reference backend reads routed \
                     experts from the checkpoint"
                );
            }
            if args.kv_tokens == Some(0) {
                bail!("--kv-tokens 0: the KV budget holds at least one token");
            }
            let opts = ReferenceOptions {
                context_length: args.context_length,
            };
            let mut engine = ReferenceEngine::load_reporting(&args.model, opts, progress)
                .with_context(|| {
                    format!(
                        "loading {} with the reference backend",
                        args.model.display()
                    )
                })?;
            if let Some(c) = args.prefill_chunk {
                if c == 0 {
                    bail!("--prefill-chunk 0: a chunk holds at least one token");
                }
                engine.set_prefill_chunk(c);
            }
            set_reference_prefix_cache(&mut engine, args)?;
            if let Some(path) = &args.prefix_cache_file {
                let model = krasis_model::Checkpoint::open(&args.model)?.content_identity()?;
                let l = engine.set_prefix_file(path, &model)?;
                eprintln!("prefix cache file {}: {}", path.display(), l.describe());
            }
            if let Some(t) = args.kv_tokens {
                engine.set_kv_tokens(usize::try_from(t).unwrap_or(usize::MAX));
            }
            tracing::info!(
                model = %args.model.display(),
                experts = %engine.expert_source(),
                context = engine.info().context_length,
                "reference engine loaded"
            );
            Ok(Box::new(engine))
        }
        Backend::Cuda => {
            // `--kv-tokens` is the KV arena's rows (the engine refuses fewer
            // than the context, by name).
            let engine =
                krasis_gpu::CudaEngine::load_reporting(&args.model, &args.cuda_options(), progress)
                    .with_context(|| {
                        format!("loading {} with the cuda backend", args.model.display())
                    })?;
            Ok(Box::new(engine))
        }
    }
}

/// The reference engine's prefix cache from the flags: both tiers in host
/// memory (`auto`: [`REFERENCE_AUTO_PREFIX_CACHE`] and
/// [`REFERENCE_AUTO_PREFIX_CACHE_HOST`]); a size holding no block is
/// refused, naming the block's size.
fn set_reference_prefix_cache(
    engine: &mut ReferenceEngine,
    args: &EngineArgs,
) -> anyhow::Result<()> {
    let first = args.prefix_cache.unwrap_or(PrefixCacheChoice::Off);
    if !first.is_on() {
        return Ok(());
    }
    let bytes = |c: PrefixCacheChoice, auto: u64| match c {
        PrefixCacheChoice::Off => 0,
        PrefixCacheChoice::Auto => auto,
        PrefixCacheChoice::Bytes(b) => b,
    };
    let block_tokens = args
        .prefix_block
        .unwrap_or(krasis_common::options::DEFAULT_PREFIX_BLOCK) as usize;
    let sizes = krasis_model::reference::PrefixSizes {
        primary_bytes: bytes(first, REFERENCE_AUTO_PREFIX_CACHE),
        secondary_bytes: bytes(
            args.prefix_cache_host.unwrap_or(PrefixCacheChoice::Off),
            REFERENCE_AUTO_PREFIX_CACHE_HOST,
        ),
        block_tokens,
    };
    let g = engine.geometry();
    let block = (g.num_layers * 2 * block_tokens * g.kv_dim() * 4) as u64;
    for (flag, b) in [
        ("--prefix-cache", sizes.primary_bytes),
        ("--prefix-cache-host", sizes.secondary_bytes),
    ] {
        if b > 0 && b < block {
            bail!(
                "{flag} {b} bytes holds no block: a block of {block_tokens} tokens \
                 (--prefix-block) of this model's KV is {block} bytes in the reference engine"
            );
        }
    }
    engine.set_prefix_cache(sizes);
    match engine.prefix_cache_stats() {
        Some(s) => eprintln!(
            "prefix cache: blocks of {} tokens; {}",
            s.block_tokens,
            s.tiers
                .iter()
                .map(|t| format!(
                    "{} {:.2} GiB ({} blocks)",
                    t.location,
                    t.capacity_bytes as f64 / (1u64 << 30) as f64,
                    t.capacity_blocks
                ))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        None => eprintln!("prefix cache: off (no tier holds a block)"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        engine: EngineArgs,
    }

    #[test]
    fn backend_defaults_to_cuda_and_never_falls_back() {
        let cli = Cli::try_parse_from(["x", "--model", "/nonexistent"]).unwrap();
        assert_eq!(cli.engine.backend, Backend::Cuda);
        // Whatever the cuda engine's reason, the failure is reported as the
        // cuda backend's; the reference engine is never tried instead.
        let err = format!("{:#}", load_engine(&cli.engine).err().unwrap());
        assert!(err.contains("with the cuda backend"), "{err}");
    }

    #[test]
    fn flags_parse_and_bad_values_are_refused() {
        let cli = Cli::try_parse_from([
            "x",
            "--model",
            "m",
            "--backend",
            "reference",
            "--context-length",
            "512",
            "--vram-limit",
            "2GiB",
        ])
        .unwrap();
        assert_eq!(cli.engine.backend, Backend::Reference);
        assert_eq!(cli.engine.context_length, Some(512));
        assert_eq!(cli.engine.vram_limit, Some(2 << 30));
        let err = load_engine(&cli.engine).err().unwrap().to_string();
        assert!(err.contains("--vram-limit"), "{err}");
        assert!(Cli::try_parse_from(["x", "--model", "m", "--backend", "gpu"]).is_err());
        assert!(Cli::try_parse_from(["x", "--model", "m", "--vram-limit", "lots"]).is_err());
    }

    #[test]
    fn vram_limit_reads_sizes_like_the_launcher() {
        // The table the launcher's --vram-limit test goes through too.
        for (input, want) in krasis_common::size::EXAMPLES {
            let got = Cli::try_parse_from(["x", "--model", "m", &format!("--vram-limit={input}")])
                .map(|c| c.engine.vram_limit.unwrap());
            assert_eq!(got.as_ref().ok(), want.as_ref(), "{input:?}");
        }
        // GB is 10^9 bytes, GiB 2^30, and a bare G is refused as ambiguous.
        let gb = Cli::try_parse_from(["x", "--model", "m", "--vram-limit", "8GB"]).unwrap();
        assert_eq!(gb.engine.vram_limit, Some(8_000_000_000));
        let e = Cli::try_parse_from(["x", "--model", "m", "--vram-limit", "8G"])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("write 8GiB (2^30) or 8GB (10^9)"), "{e}");
    }

    #[test]
    fn prefix_cache_and_prefill_chunk_reach_both_engines() {
        let p = |extra: &[&str]| {
            let mut argv = vec!["x", "--model", "m"];
            argv.extend_from_slice(extra);
            Cli::try_parse_from(argv).map(|c| c.engine)
        };
        let o = p(&[
            "--prefix-cache",
            "2GiB",
            "--prefix-cache-host",
            "0",
            "--prefix-block",
            "512",
            "--prefill-chunk",
            "2048",
        ])
        .unwrap()
        .cuda_options();
        assert_eq!(o.prefix_cache, PrefixCacheChoice::Bytes(2 << 30));
        assert_eq!(o.prefix_cache_host, PrefixCacheChoice::Bytes(0));
        assert_eq!((o.prefix_block, o.prefill_chunk), (512, 2048));
        // Outside `serve` (which asks for auto) the cache is off.
        let o = p(&[]).unwrap().cuda_options();
        assert_eq!(o.prefix_cache, PrefixCacheChoice::Off);
        assert_eq!(o.prefix_cache_host, PrefixCacheChoice::Off);
        assert_eq!((o.prefix_block, o.prefill_chunk), (256, 8192));
        assert!(p(&["--prefix-cache", "lots"]).is_err());
        for bad in ["100", "0", "x"] {
            let e = p(&["--prefix-block", bad]).err().unwrap().to_string();
            assert!(e.contains("prefix-block"), "{e}");
        }
        // The reference engine: blocks of --prefix-block whatever the
        // chunk, two host tiers, and a size that holds no block is refused,
        // naming the block's size.
        let model = krasis_model::testutil::tiny_checkpoint("tiny");
        let model = model.to_str().unwrap();
        let reference = |extra: &[&str]| {
            let mut argv = vec!["x", "--model", model, "--backend", "reference"];
            argv.extend_from_slice(extra);
            load_engine(&Cli::try_parse_from(argv).unwrap().engine)
        };
        for (flag, e) in [
            ("--prefix-cache", reference(&["--prefix-cache", "1KiB"])),
            (
                "--prefix-cache-host",
                reference(&["--prefix-cache", "auto", "--prefix-cache-host", "1KiB"]),
            ),
        ] {
            let e = e.err().unwrap().to_string();
            assert!(e.contains("holds no block") && e.contains(flag), "{e}");
        }
        let e = reference(&["--prefill-chunk", "0"])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("--prefill-chunk 0"), "{e}");
        let stats = |extra: &[&str]| {
            reference(extra)
                .unwrap()
                .stats()
                .and_then(|s| s.prefix_cache)
        };
        let s = stats(&[
            "--prefix-cache",
            "auto",
            "--prefix-cache-host",
            "auto",
            "--prefix-block",
            "64",
            "--prefill-chunk",
            "100",
        ])
        .unwrap();
        assert_eq!((s.block_tokens, s.location.as_str()), (64, "host+host-ram"));
        assert!(s.tiers[0].capacity_bytes <= REFERENCE_AUTO_PREFIX_CACHE);
        assert!(s.tiers[1].capacity_bytes <= REFERENCE_AUTO_PREFIX_CACHE_HOST);
        assert!(s.tiers.iter().all(|t| t.capacity_blocks > 0));
        // No first tier: the RAM tier alone.
        let s = stats(&["--prefix-cache", "0", "--prefix-cache-host", "auto"]).unwrap();
        assert_eq!((s.location.as_str(), s.block_tokens), ("host-ram", 256));
        assert!(stats(&[]).is_none(), "off by default");
        assert!(
            stats(&["--prefix-cache", "off", "--prefix-cache-host", "auto"]).is_none(),
            "off is the whole cache"
        );
    }

    /// `--kv-tokens` becomes the reference engine's KV budget (its default
    /// is 8 contexts; 0 is refused) and the cuda engine's KV arena rows;
    /// serve's parallelism reaches the cuda engine's options.
    #[test]
    fn kv_tokens_and_parallel_reach_the_engines() {
        let model = krasis_model::testutil::tiny_checkpoint("tiny");
        let engine = |extra: &[&str]| {
            let mut argv = vec!["x", "--model", model.to_str().unwrap()];
            argv.extend_from_slice(extra);
            load_engine(&Cli::try_parse_from(argv).unwrap().engine)
        };
        let kv = |extra: &[&str]| {
            let mut e = engine(extra).unwrap();
            e.batch().unwrap().kv_usage().total_tokens
        };
        let r = ["--backend", "reference", "--context-length", "128"];
        assert_eq!(kv(&r), 128 * krasis_model::reference::BATCH_CAPACITY);
        assert_eq!(kv(&[&r[..], &["--kv-tokens", "300"]].concat()), 300);
        let e = engine(&[&r[..], &["--kv-tokens", "0"]].concat())
            .err()
            .unwrap();
        assert!(e.to_string().contains("--kv-tokens 0"), "{e}");
        let mut cuda = Cli::try_parse_from(["x", "--model", "m", "--kv-tokens", "70000"])
            .unwrap()
            .engine;
        assert_eq!(cuda.cuda_options().kv_rows, Some(70_000));
        assert_eq!(cuda.cuda_options().parallel, None);
        cuda.parallel = Some(4);
        assert_eq!(cuda.cuda_options().parallel, Some(4));
    }

    #[test]
    fn gpu_ordinal_reaches_the_cuda_engine_options() {
        let cli = Cli::try_parse_from(["x", "--model", "m", "--gpu", "3"]).unwrap();
        assert_eq!(cli.engine.cuda_options().device, 3);
        let cli = Cli::try_parse_from(["x", "--model", "m"]).unwrap();
        assert_eq!(cli.engine.cuda_options().device, 0);
        // The reference backend runs on the CPU and refuses a GPU choice.
        let cli =
            Cli::try_parse_from(["x", "--model", "m", "--backend", "reference", "--gpu", "1"])
                .unwrap();
        let err = load_engine(&cli.engine).err().unwrap().to_string();
        assert!(err.contains("--gpu 1"), "{err}");
    }

    #[test]
    fn hcs_follows_the_backend_unless_asked_and_reference_refuses_on() {
        let p = |extra: &[&str]| {
            let mut argv = vec!["x", "--model", "m"];
            argv.extend_from_slice(extra);
            Cli::try_parse_from(argv).unwrap().engine
        };
        assert!(p(&[]).hcs_enabled());
        assert!(!p(&["--hcs", "off"]).hcs_enabled());
        assert!(!p(&["--backend", "reference"]).hcs_enabled());
        let e = load_engine(&p(&["--backend", "reference", "--hcs", "on"]))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("--hcs on"), "{e}");
    }
}
