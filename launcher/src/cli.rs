//! Command-line interface. Every way of choosing options (flags, `--profile`,
//! the TUI) ends in one `LaunchOptions` that goes through `validate`.

use clap::{Args, Parser, Subcommand, ValueEnum};
use krasis_common::options::{API_KEY_ARGV_REFUSED, HeatmapChoice};
use krasis_common::{API_KEY_ENV, Backend, LaunchOptions, OptionError};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "krasis",
    version,
    about = "Run mixture-of-experts LLMs whose experts do not fit in VRAM",
    long_about = "Run mixture-of-experts LLMs whose experts do not fit in VRAM.\n\nWith no command on a terminal, opens the interactive launcher.\nStart here: `krasis demo` serves a tiny random-weights model on any machine."
)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    /// Serve a saved profile headless (same as `krasis serve --profile NAME`).
    #[arg(long, value_name = "NAME")]
    pub profile: Option<String>,
    #[command(subcommand)]
    pub command: Option<Cmd>,
}

#[derive(Args, Debug, Clone, Default)]
pub struct Global {
    /// Path to krasis-runtime (default: next to krasis, then PATH).
    #[arg(long, global = true, value_name = "PATH")]
    pub runtime: Option<PathBuf>,
    /// Where profiles live (default: the platform config directory).
    #[arg(long, global = true, value_name = "DIR")]
    pub config_dir: Option<PathBuf>,
    /// Where the demo model and downloaded models live (default: the platform data directory).
    #[arg(long, global = true, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Another directory to look for models in (repeatable).
    #[arg(long = "model-root", global = true, value_name = "DIR")]
    pub model_roots: Vec<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Open the interactive launcher.
    Tui,
    /// Start the runtime headless; prints phases and the ready URL; Ctrl-C stops it.
    Serve(ServeArgs),
    /// Serve a tiny random-weights demo model (synthesized on first use).
    Demo(DemoArgs),
    /// Show GPUs, host memory, models found and what the runtime supports.
    Probe {
        #[arg(long)]
        json: bool,
        /// Expert cache root to check (default: the platform cache directory).
        #[arg(long, value_name = "DIR")]
        cache_dir: Option<PathBuf>,
    },
    /// Manage saved launch profiles.
    #[command(subcommand)]
    Profiles(ProfilesCmd),
    /// Build (or check) a model's INT4 expert cache (runs krasis-runtime build-cache).
    BuildCache {
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        /// Expert cache root (default: the platform cache directory).
        #[arg(long, value_name = "DIR")]
        cache_dir: Option<PathBuf>,
        /// Further krasis-runtime build-cache arguments (e.g. -- --verify).
        #[arg(last = true)]
        rest: Vec<String>,
    },
    /// Measure prefill and decode speed (runs krasis-runtime bench with these arguments).
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Record the route heatmap that seeds the GPU expert cache of a model
    /// larger than the GPU (runs krasis-runtime heatmap with these arguments,
    /// e.g. --model DIR --vram-limit 24GiB).
    Heatmap {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

#[derive(Subcommand, Debug)]
pub enum ProfilesCmd {
    /// List your profiles and the shipped examples.
    List,
    /// Print a profile (yours, else a shipped example) as TOML.
    Show { name: String },
    /// Copy a shipped example into your profiles, to edit it.
    Copy {
        /// The example's name (see `krasis profiles list`).
        example: String,
        /// The new profile's name (default: the example's).
        name: Option<String>,
        /// Replace an existing profile of that name.
        #[arg(long)]
        force: bool,
    },
    /// Validate the given options and save them as a profile.
    Save {
        name: String,
        #[arg(long)]
        description: Option<String>,
        /// Replace an existing profile of that name.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        opts: Box<OptionFlags>,
    },
    /// Delete a profile.
    Delete { name: String },
}

#[derive(Args, Debug, Default, Clone)]
pub struct ServeArgs {
    /// Start from this saved profile or shipped example (see `krasis profiles
    /// list`); flags given here override its values.
    #[arg(long, value_name = "NAME", conflicts_with = "profile_file")]
    pub profile: Option<String>,
    /// Start from this profile file.
    #[arg(long, value_name = "FILE")]
    pub profile_file: Option<PathBuf>,
    /// Serve the random-weights demo model when no --model is given.
    #[arg(long)]
    pub demo: bool,
    /// Validate and print the estimate, but do not start the runtime.
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub opts: OptionFlags,
}

#[derive(Args, Debug, Default, Clone)]
pub struct DemoArgs {
    /// Validate and print the estimate, but do not start the runtime.
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub opts: OptionFlags,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnOff {
    On,
    Off,
}

/// Launch options as flags. Unset flags keep the profile's value or the
/// runtime's recommended default.
#[derive(Args, Debug, Default, Clone)]
pub struct OptionFlags {
    /// Hugging Face model directory, or a model's name (`Qwen/Qwen3-30B-A3B`,
    /// `krasis-demo-tiny`) looked up in the model roots.
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// cuda or reference (default: cuda when a GPU is usable, else reference).
    #[arg(long)]
    pub backend: Option<String>,
    #[arg(long)]
    pub host: Option<String>,
    #[arg(long)]
    pub port: Option<u16>,
    /// Refused: a key on the command line is visible to every user in `ps`.
    /// Use --api-key-file or KRASIS_API_KEY.
    #[arg(long, value_name = "KEY", hide = true)]
    pub api_key: Option<String>,
    /// Require the bearer token in this file (one line, `chmod 600`) on every
    /// API request. The KRASIS_API_KEY environment variable is the other way
    /// to give a key; this flag wins over it.
    #[arg(long, value_name = "PATH")]
    pub api_key_file: Option<PathBuf>,
    /// Allow browser pages from this origin (scheme://host[:port], or `*` for
    /// any) to call the API; repeatable. Default: loopback origins only.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    pub cors_origins: Vec<String>,
    /// Allow a non-loopback bind without an API key.
    #[arg(long)]
    pub insecure_public: bool,
    /// Maximum tokens per request (prompt + output); sizes the KV cache.
    #[arg(long)]
    pub context_length: Option<u32>,
    #[arg(long)]
    pub expert_precision: Option<String>,
    #[arg(long)]
    pub attention_precision: Option<String>,
    #[arg(long)]
    pub kv_format: Option<String>,
    #[arg(long)]
    pub mlp_precision: Option<String>,
    /// Use at most this much VRAM, e.g. 20GiB.
    #[arg(long, value_name = "SIZE")]
    pub vram_limit: Option<String>,
    /// VRAM kept free after calibration, in MiB (default 600).
    #[arg(long, value_name = "MIB")]
    pub safety_margin_mib: Option<u64>,
    /// Keep hot experts resident in spare VRAM.
    #[arg(long)]
    pub hcs: Option<OnOff>,
    /// auto, off, or a heatmap file.
    #[arg(long)]
    pub heatmap: Option<String>,
    /// Expert pruning mode ("off" is exact).
    #[arg(long)]
    pub pruning: Option<String>,
    /// Expert cache directory.
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    #[arg(long)]
    pub queue_depth: Option<u32>,
    /// CUDA device ordinal.
    #[arg(long)]
    pub gpu: Option<u32>,
    /// Prefix cache memory (its first tier, VRAM on the cuda backend):
    /// auto (the engine's rule), off (no cache), or a size such as 2GiB
    /// (0: no VRAM pool, the host tier carries the cache).
    #[arg(long, value_name = "auto|off|SIZE")]
    pub prefix_cache: Option<String>,
    /// The most requests decoding together, 1 to 8 (default: the engine's
    /// capacity).
    #[arg(long, value_name = "N")]
    pub parallel: Option<u32>,
    /// KV memory all running requests share, in tokens (cuda: the KV
    /// arena's rows, at least the context; default: the engine's).
    #[arg(long, value_name = "TOKENS")]
    pub kv_tokens: Option<u64>,
    /// The prefix cache's host tier (page-locked RAM): auto, off, or a size.
    #[arg(long, value_name = "auto|off|SIZE")]
    pub prefix_cache_host: Option<String>,
    /// Prompt tokens per prefix cache block (a multiple of 64).
    #[arg(long, value_name = "TOKENS")]
    pub prefix_block: Option<u32>,
    /// Keep the prefix cache across restarts in this file (written when
    /// the runtime stops, loaded when it starts), or `off` to keep it in
    /// memory only.
    #[arg(long, value_name = "PATH|off")]
    pub prefix_cache_file: Option<PathBuf>,
}

impl OptionFlags {
    /// Applies the flags that were given, and the `KRASIS_API_KEY`
    /// environment variable, on top of `base`.
    pub fn apply(&self, base: &mut LaunchOptions) -> Result<(), OptionError> {
        self.apply_with_env(base, std::env::var(API_KEY_ENV).ok())
    }

    /// [`OptionFlags::apply`] with the value of `KRASIS_API_KEY` given. Where
    /// the key comes from: `--api-key-file` over `KRASIS_API_KEY` over the
    /// profile's `api_key_file` (command line, then environment, then file).
    pub fn apply_with_env(
        &self,
        base: &mut LaunchOptions,
        env_key: Option<String>,
    ) -> Result<(), OptionError> {
        if self.api_key.is_some() {
            return Err(OptionError::new("api_key", API_KEY_ARGV_REFUSED));
        }
        if let Some(p) = &self.api_key_file {
            base.api_key_file = Some(p.clone());
            base.api_key = None;
        } else if let Some(k) = env_key {
            base.api_key = Some(k);
            base.api_key_file = None;
        }
        if !self.cors_origins.is_empty() {
            base.cors_origins = self.cors_origins.clone();
        }
        if let Some(m) = &self.model {
            base.model = m.clone();
        }
        if let Some(b) = &self.backend {
            base.backend = Backend::parse(b)?;
        }
        if let Some(h) = &self.host {
            base.host = h.clone();
        }
        if let Some(p) = self.port {
            base.port = p;
        }
        if self.insecure_public {
            base.insecure_public = true;
        }
        if let Some(c) = self.context_length {
            base.context_length = Some(c);
        }
        if let Some(v) = &self.expert_precision {
            base.expert_precision = v.clone();
        }
        if let Some(v) = &self.attention_precision {
            base.attention_precision = v.clone();
        }
        if let Some(v) = &self.kv_format {
            base.kv_format = v.clone();
        }
        if let Some(v) = &self.mlp_precision {
            base.mlp_precision = v.clone();
        }
        if let Some(v) = &self.vram_limit {
            base.vram_limit_bytes = Some(
                crate::units::parse_size(v)
                    .map_err(|e| OptionError::new("vram_limit", e.to_string()))?,
            );
        }
        if let Some(v) = self.safety_margin_mib {
            base.safety_margin_mib = v;
        }
        if let Some(v) = self.hcs {
            base.hcs = v == OnOff::On;
        }
        if let Some(v) = &self.heatmap {
            base.heatmap = HeatmapChoice::parse(v);
        }
        if let Some(v) = &self.pruning {
            base.pruning = v.clone();
        }
        if let Some(v) = &self.cache_dir {
            base.cache_dir = Some(v.clone());
        }
        if let Some(v) = self.queue_depth {
            base.queue_depth = v;
        }
        if let Some(v) = self.gpu {
            base.gpu = v;
        }
        if let Some(v) = &self.prefix_cache {
            base.prefix_cache = krasis_common::options::PrefixCacheChoice::parse(v)?;
        }
        if let Some(v) = self.parallel {
            base.parallel = Some(v);
        }
        if let Some(v) = self.kv_tokens {
            base.kv_tokens = Some(v);
        }
        if let Some(v) = &self.prefix_cache_host {
            base.prefix_cache_host = krasis_common::options::PrefixCacheChoice::parse(v)
                .map_err(|e| OptionError::new("prefix_cache_host", e.reason))?;
        }
        if let Some(v) = self.prefix_block {
            krasis_common::options::check_prefix_block(v)?;
            base.prefix_block = v;
        }
        if let Some(p) = &self.prefix_cache_file {
            base.prefix_cache_file = (p.as_os_str() != "off").then(|| p.clone());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_override_only_what_was_given() {
        let cli = Cli::try_parse_from([
            "krasis",
            "serve",
            "--model",
            "/m",
            "--vram-limit",
            "20GiB",
            "--hcs",
            "off",
            "--port",
            "9000",
        ])
        .unwrap();
        let Some(Cmd::Serve(s)) = cli.command else {
            panic!()
        };
        let mut o = LaunchOptions {
            context_length: Some(4096),
            ..Default::default()
        };
        s.opts.apply(&mut o).unwrap();
        assert_eq!(o.model, PathBuf::from("/m"));
        assert_eq!(o.vram_limit_bytes, Some(20 << 30));
        assert!(!o.hcs);
        assert_eq!(o.port, 9000);
        assert_eq!(o.context_length, Some(4096));
    }

    #[test]
    fn bad_values_name_the_option() {
        let f = OptionFlags {
            backend: Some("tpu".into()),
            ..Default::default()
        };
        assert_eq!(
            f.apply(&mut LaunchOptions::default()).unwrap_err().option,
            "backend"
        );
        let f = OptionFlags {
            vram_limit: Some("lots".into()),
            ..Default::default()
        };
        assert_eq!(
            f.apply(&mut LaunchOptions::default()).unwrap_err().option,
            "vram_limit"
        );
    }

    fn serve_flags(extra: &[&str]) -> OptionFlags {
        let mut argv = vec!["krasis", "serve", "--model", "/m"];
        argv.extend_from_slice(extra);
        let Some(Cmd::Serve(s)) = Cli::try_parse_from(argv).unwrap().command else {
            panic!()
        };
        s.opts
    }

    /// A file sets the option; `off` clears a profile's.
    #[test]
    fn the_prefix_cache_file_is_set_or_cleared() {
        let mut o = LaunchOptions::default();
        serve_flags(&["--prefix-cache-file", "/var/krasis/p.krspc"])
            .apply_with_env(&mut o, None)
            .unwrap();
        assert_eq!(
            o.prefix_cache_file,
            Some(PathBuf::from("/var/krasis/p.krspc"))
        );
        serve_flags(&["--port", "9000"])
            .apply_with_env(&mut o, None)
            .unwrap();
        assert!(o.prefix_cache_file.is_some(), "kept when not given");
        serve_flags(&["--prefix-cache-file", "off"])
            .apply_with_env(&mut o, None)
            .unwrap();
        assert_eq!(o.prefix_cache_file, None);
    }

    #[test]
    fn vram_limit_reads_sizes_like_the_runtime() {
        // The same table the runtime's --vram-limit test goes through.
        for (input, want) in krasis_common::size::EXAMPLES {
            let mut o = LaunchOptions::default();
            let got = serve_flags(&[&format!("--vram-limit={input}")])
                .apply_with_env(&mut o, None)
                .map(|()| o.vram_limit_bytes.unwrap());
            assert_eq!(got.as_ref().ok(), want.as_ref(), "{input:?}: {got:?}");
        }
        let mut o = LaunchOptions::default();
        let e = serve_flags(&["--vram-limit", "24G"])
            .apply_with_env(&mut o, None)
            .unwrap_err();
        assert!(e.reason.contains("24GiB (2^30) or 24GB (10^9)"), "{e}");
        serve_flags(&["--vram-limit", "24GB"])
            .apply_with_env(&mut o, None)
            .unwrap();
        assert_eq!(o.vram_limit_bytes, Some(24_000_000_000));
    }

    #[test]
    fn api_key_on_the_command_line_is_refused() {
        let mut o = LaunchOptions::default();
        let e = serve_flags(&["--api-key", "k3y-0f-sixteen-chars"])
            .apply_with_env(&mut o, None)
            .unwrap_err();
        assert!(
            e.reason.contains("--api-key-file") && e.reason.contains("KRASIS_API_KEY"),
            "{e}"
        );
        assert!(!e.to_string().contains("k3y-0f"), "the key is not echoed");
        assert_eq!(o.api_key, None);
    }

    #[test]
    fn key_sources_command_line_then_environment_then_profile() {
        let profile = LaunchOptions {
            model: "/m".into(),
            api_key_file: Some("/profile/key".into()),
            ..Default::default()
        };
        // Environment over the profile's file.
        let mut o = profile.clone();
        serve_flags(&[])
            .apply_with_env(&mut o, Some("from-env-0123456789".into()))
            .unwrap();
        assert_eq!(o.api_key.as_deref(), Some("from-env-0123456789"));
        assert_eq!(o.api_key_file, None);
        // --api-key-file over the environment.
        let mut o = profile.clone();
        serve_flags(&["--api-key-file", "/flag/key"])
            .apply_with_env(&mut o, Some("from-env-0123456789".into()))
            .unwrap();
        assert_eq!(o.api_key, None);
        assert_eq!(o.api_key_file, Some(PathBuf::from("/flag/key")));
        assert!(!o.to_serve_args().iter().any(|a| a.contains("from-env")));
        // Nothing given: the profile's file stays.
        let mut o = profile.clone();
        serve_flags(&[]).apply_with_env(&mut o, None).unwrap();
        assert_eq!(o, profile);
    }

    #[test]
    fn cors_origins_repeat_and_replace_the_profile_list() {
        let mut o = LaunchOptions {
            cors_origins: vec!["https://old.example".into()],
            ..Default::default()
        };
        serve_flags(&[
            "--cors-origin",
            "https://a.example",
            "--cors-origin",
            "http://localhost:3000",
        ])
        .apply_with_env(&mut o, None)
        .unwrap();
        assert_eq!(
            o.cors_origins,
            vec!["https://a.example", "http://localhost:3000"]
        );
        let mut o = LaunchOptions {
            model: "/m".into(),
            ..Default::default()
        };
        serve_flags(&["--cors-origin", "https://a.example/app"])
            .apply_with_env(&mut o, None)
            .unwrap();
        assert_eq!(o.validate().unwrap_err().option, "cors_origins");
    }

    #[test]
    fn top_level_profile_and_global_flags_parse() {
        let cli = Cli::try_parse_from(["krasis", "--profile", "p", "--config-dir", "/c"]).unwrap();
        assert_eq!(cli.profile.as_deref(), Some("p"));
        assert_eq!(cli.global.config_dir, Some(PathBuf::from("/c")));
        assert!(cli.command.is_none());
        Cli::try_parse_from(["krasis", "bench", "--model", "/m", "--tokens", "64"]).unwrap();
    }
}
