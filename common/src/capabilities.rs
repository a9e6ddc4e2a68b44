//! The capability report: what this runtime build implements. Printed by
//! `krasis-runtime capabilities --json`; the launcher offers only what is in it.

use crate::options::{Backend, LaunchOptions, OptionError};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Capabilities {
    pub protocol_version: u32,
    pub runtime_version: String,
    /// Backends compiled in, and whether each can run on this machine now.
    pub backends: Vec<BackendCaps>,
    pub architectures: Vec<ArchitectureCaps>,
    /// What the server enforces by grammar-constrained sampling (absent in
    /// reports of runtimes before it: nothing).
    #[serde(default)]
    pub structured_output: StructuredOutputCaps,
}

/// Structured output (both backends): the `response_format` types the
/// server accepts, and the tool-call grammars (named as the runtime logs
/// them: `hermes-json`, `qwen3-coder-xml`, `glm4-xml`, `harmony`) whose
/// calls it constrains to declared tools and their schemas: under every
/// `tool_choice`, only forced ones (`required`, a named function; `auto`
/// calls parsed as written), or none (parsed as the model wrote them).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StructuredOutputCaps {
    pub response_formats: Vec<String>,
    pub constrained_tool_grammars: Vec<String>,
    #[serde(default)]
    pub forced_only_tool_grammars: Vec<String>,
    pub parsed_tool_grammars: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BackendCaps {
    pub name: String,
    pub available: bool,
    /// Why it is unavailable (no driver, no GPU, ...), when it is.
    pub reason: Option<String>,
    /// The most requests its engine decodes together (continuous
    /// batching): `parallel` is refused above it; 1 runs one at a time.
    #[serde(default = "one")]
    pub max_parallel: u32,
    /// Whether it takes a KV budget (`kv_tokens`); without, the engine
    /// sizes its KV itself and the option is refused.
    #[serde(default)]
    pub kv_tokens: bool,
}

fn one() -> u32 {
    1
}

/// One architecture as the runtime implements it. The runtime derives these
/// from its architecture registry (`krasis_model::arch::registry`); nothing
/// on this side of the contract lists architectures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArchitectureCaps {
    /// Hugging Face `model_type`, e.g. `qwen3_moe`.
    pub model_type: String,
    /// Human name of the family, e.g. "Qwen3 MoE".
    pub display_name: String,
    /// Backends that build this architecture (a subset of the report's
    /// `backends`; whether each can run here is said there).
    pub backends: Vec<String>,
    pub expert_precisions: Vec<String>,
    pub attention_precisions: Vec<String>,
    pub kv_formats: Vec<String>,
    /// The MLP block's activation format (`bf16`, or `fp16` where the
    /// model's description runs that block in FP16).
    pub mlp_precisions: Vec<String>,
    pub hcs: bool,
    /// Backends with a prefix cache for this architecture (`--prefix-cache`
    /// with a size is refused on the others; `auto` is off there).
    #[serde(default)]
    pub prefix_cache_backends: Vec<String>,
    pub pruning_modes: Vec<String>,
    pub multi_gpu_modes: Vec<String>,
    pub defaults: ArchitectureDefaults,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArchitectureDefaults {
    pub expert_precision: String,
    pub attention_precision: String,
    pub kv_format: String,
    pub mlp_precision: String,
    pub pruning: String,
    pub multi_gpu: String,
}

impl Capabilities {
    /// A report: the reference backend (always available), the cuda backend
    /// (`Err(reason)` when it cannot run here), and `architectures` (the
    /// runtime passes those of its registry). Both backends run one request
    /// at a time without a KV budget until [`Capabilities::set_batching`]
    /// says what their engines do.
    pub fn new(
        runtime_version: &str,
        cuda: Result<(), String>,
        architectures: Vec<ArchitectureCaps>,
    ) -> Self {
        let backend = |name: &str, reason: Option<String>| BackendCaps {
            name: name.into(),
            available: reason.is_none(),
            reason,
            max_parallel: 1,
            kv_tokens: false,
        };
        Capabilities {
            protocol_version: crate::PROTOCOL_VERSION,
            runtime_version: runtime_version.to_string(),
            backends: vec![backend("reference", None), backend("cuda", cuda.err())],
            architectures,
            structured_output: StructuredOutputCaps::default(),
        }
    }

    /// Records that `backend`'s engine decodes up to `max_parallel`
    /// requests together and whether it takes `kv_tokens`.
    pub fn set_batching(&mut self, backend: Backend, max_parallel: u32, kv_tokens: bool) {
        if let Some(b) = self
            .backends
            .iter_mut()
            .find(|b| b.name == backend.as_str())
        {
            b.max_parallel = max_parallel.max(1);
            b.kv_tokens = kv_tokens;
        }
    }

    pub fn architecture(&self, model_type: &str) -> Option<&ArchitectureCaps> {
        self.architectures
            .iter()
            .find(|a| a.model_type == model_type)
    }
    pub fn backend(&self, name: &str) -> Option<&BackendCaps> {
        self.backends.iter().find(|b| b.name == name)
    }
}

impl Capabilities {
    /// Checks `opts` against what this runtime implements for `model_type`.
    /// The launcher (TUI, CLI, profiles) and the runtime both call this, so an
    /// unsupported combination is refused with the same words everywhere.
    pub fn check_options(&self, opts: &LaunchOptions, model_type: &str) -> Result<(), OptionError> {
        if self.protocol_version != crate::PROTOCOL_VERSION {
            return Err(OptionError::new(
                "runtime",
                format!(
                    "runtime speaks protocol {} but this launcher speaks {}; install matching krasis and krasis-runtime binaries",
                    self.protocol_version,
                    crate::PROTOCOL_VERSION
                ),
            ));
        }
        let backend = opts.backend.as_str();
        match self.backend(backend) {
            None => {
                return Err(OptionError::new(
                    "backend",
                    format!(
                        "this runtime build has no '{backend}' backend (it has: {})",
                        join(self.backends.iter().map(|b| b.name.as_str()))
                    ),
                ));
            }
            Some(b) if !b.available => {
                return Err(OptionError::new(
                    "backend",
                    format!(
                        "the '{backend}' backend cannot run on this machine: {}",
                        b.reason.as_deref().unwrap_or("no reason given")
                    ),
                ));
            }
            Some(b) => {
                if let Some(n) = opts.parallel
                    && n > b.max_parallel
                {
                    return Err(OptionError::new(
                        "parallel",
                        format!(
                            "the '{backend}' backend runs at most {} request(s) together in this \
                             runtime; pass at most that, or leave it to the engine",
                            b.max_parallel
                        ),
                    ));
                }
                if opts.kv_tokens.is_some() && !b.kv_tokens {
                    return Err(OptionError::new(
                        "kv_tokens",
                        format!(
                            "the '{backend}' backend sizes its KV memory itself in this runtime; \
                             leave kv_tokens unset"
                        ),
                    ));
                }
            }
        }
        let arch = self.architecture(model_type).ok_or_else(|| {
            OptionError::new(
                "model",
                format!(
                    "architecture '{model_type}' is not supported by this runtime (supported: {})",
                    join(self.architectures.iter().map(|a| a.model_type.as_str()))
                ),
            )
        })?;
        if !arch.backends.iter().any(|b| b == backend) {
            return Err(OptionError::new(
                "backend",
                format!(
                    "the '{backend}' backend does not implement '{model_type}' in this runtime (choose from: {})",
                    join(arch.backends.iter().map(|s| s.as_str()))
                ),
            ));
        }
        one_of(
            "expert_precision",
            &opts.expert_precision,
            &arch.expert_precisions,
            model_type,
        )?;
        one_of(
            "attention_precision",
            &opts.attention_precision,
            &arch.attention_precisions,
            model_type,
        )?;
        one_of("kv_format", &opts.kv_format, &arch.kv_formats, model_type)?;
        one_of(
            "mlp_precision",
            &opts.mlp_precision,
            &arch.mlp_precisions,
            model_type,
        )?;
        one_of("pruning", &opts.pruning, &arch.pruning_modes, model_type)?;
        for (option, choice) in [
            ("prefix_cache", opts.prefix_cache),
            ("prefix_cache_host", opts.prefix_cache_host),
        ] {
            if let crate::options::PrefixCacheChoice::Bytes(1..) = choice
                && opts.prefix_cache.is_on()
                && !arch.prefix_cache_backends.iter().any(|b| b == backend)
            {
                return Err(OptionError::new(
                    option,
                    format!(
                        "the '{backend}' backend has no prefix cache for '{model_type}' in this \
                         runtime (it has one on: {}); use auto (off there) or off",
                        join(arch.prefix_cache_backends.iter().map(|s| s.as_str()))
                    ),
                ));
            }
        }
        if let Some(path) = &opts.prefix_cache_file
            && !arch.prefix_cache_backends.iter().any(|b| b == backend)
        {
            return Err(OptionError::new(
                "prefix_cache_file",
                format!(
                    "{}: the '{backend}' backend has no prefix cache for '{model_type}' in this \
                     runtime, so there is nothing to keep in a file (it has one on: {}); drop \
                     the file",
                    path.display(),
                    join(arch.prefix_cache_backends.iter().map(|s| s.as_str()))
                ),
            ));
        }
        if opts.hcs && !arch.hcs {
            return Err(OptionError::new(
                "hcs",
                format!("HCS is not implemented for '{model_type}' in this runtime; turn it off"),
            ));
        }
        if opts.hcs && opts.backend != Backend::Cuda {
            return Err(OptionError::new(
                "hcs",
                format!(
                    "HCS keeps experts in GPU memory and needs the cuda backend; turn it off for the '{backend}' backend"
                ),
            ));
        }
        Ok(())
    }

    /// The options this runtime recommends for `model_type` on this machine:
    /// the architecture's defaults, the cuda backend when it can run (the
    /// reference engine otherwise, or when the architecture has no cuda
    /// build), and HCS exactly when the backend has it.
    pub fn default_options(&self, model_type: &str) -> Option<LaunchOptions> {
        let arch = self.architecture(model_type)?;
        let cuda = self.backend("cuda").is_some_and(|b| b.available)
            && arch.backends.iter().any(|b| b == "cuda");
        let backend = if cuda {
            Backend::Cuda
        } else {
            Backend::Reference
        };
        Some(LaunchOptions {
            backend,
            expert_precision: arch.defaults.expert_precision.clone(),
            attention_precision: arch.defaults.attention_precision.clone(),
            kv_format: arch.defaults.kv_format.clone(),
            mlp_precision: arch.defaults.mlp_precision.clone(),
            pruning: arch.defaults.pruning.clone(),
            hcs: arch.hcs && backend == Backend::Cuda,
            ..LaunchOptions::default()
        })
    }
}

fn join<'a>(items: impl Iterator<Item = &'a str>) -> String {
    let v: Vec<&str> = items.collect();
    if v.is_empty() {
        "none".into()
    } else {
        v.join(", ")
    }
}

fn one_of(
    option: &str,
    value: &str,
    allowed: &[String],
    model_type: &str,
) -> Result<(), OptionError> {
    if allowed.iter().any(|a| a == value) {
        Ok(())
    } else {
        Err(OptionError::new(
            option,
            format!(
                "'{value}' is not implemented for '{model_type}' in this runtime (choose from: {})",
                join(allowed.iter().map(|s| s.as_str()))
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(cuda: bool) -> Capabilities {
        let reason = if cuda {
            Ok(())
        } else {
            Err("no NVIDIA driver".into())
        };
        Capabilities::new("test", reason, fixture_architectures())
    }

    /// The runtime's registry as recorded in `fixtures/architectures.json`
    /// (a runtime test keeps that file equal to the registry).
    pub(crate) fn fixture_architectures() -> Vec<ArchitectureCaps> {
        serde_json::from_str(include_str!("../fixtures/architectures.json"))
            .expect("fixtures/architectures.json parses")
    }

    #[test]
    fn defaults_validate_with_and_without_gpu() {
        for cuda in [true, false] {
            let c = caps(cuda);
            let mut o = c.default_options("qwen3_moe").unwrap();
            o.model = "m".into();
            c.check_options(&o, "qwen3_moe").unwrap();
            assert_eq!(o.hcs, cuda);
        }
    }

    #[test]
    fn unsupported_choices_are_refused_with_the_option_name() {
        let c = caps(false);
        let base = LaunchOptions {
            backend: Backend::Reference,
            hcs: false,
            ..Default::default()
        };
        let err = c.check_options(
            &LaunchOptions {
                backend: Backend::Cuda,
                ..base.clone()
            },
            "qwen3_moe",
        );
        assert!(err.unwrap_err().reason.contains("no NVIDIA driver"));
        let err = c.check_options(
            &LaunchOptions {
                kv_format: "fp8".into(),
                ..base.clone()
            },
            "qwen3_moe",
        );
        assert_eq!(err.unwrap_err().option, "kv_format");
        let err = c.check_options(
            &LaunchOptions {
                mlp_precision: "fp16".into(),
                ..base.clone()
            },
            "qwen3_moe",
        );
        assert_eq!(err.unwrap_err().option, "mlp_precision");
        let err = c.check_options(
            &LaunchOptions {
                hcs: true,
                ..base.clone()
            },
            "qwen3_moe",
        );
        assert_eq!(err.unwrap_err().option, "hcs");
        let err = c.check_options(&base, "llama");
        assert!(err.unwrap_err().reason.contains("qwen3_moe"));
    }

    /// `parallel` up to the backend's `max_parallel`, `kv_tokens` only
    /// where the backend takes it; both refused by name otherwise.
    #[test]
    fn parallel_and_kv_tokens_follow_the_backends_batching() {
        let mut c = caps(true);
        c.set_batching(Backend::Reference, 8, true);
        let at = |backend, parallel, kv_tokens| LaunchOptions {
            model: "m".into(),
            backend,
            hcs: false,
            parallel,
            kv_tokens,
            ..Default::default()
        };
        let check = |o: LaunchOptions| c.check_options(&o, "qwen3_moe").map_err(|e| e.option);
        assert_eq!(check(at(Backend::Reference, Some(8), Some(4096))), Ok(()));
        assert_eq!(check(at(Backend::Reference, None, None)), Ok(()));
        // The cuda backend here runs one request at a time, no KV budget.
        assert_eq!(check(at(Backend::Cuda, Some(1), None)), Ok(()));
        assert_eq!(
            check(at(Backend::Cuda, Some(2), None)),
            Err("parallel".into())
        );
        assert_eq!(
            check(at(Backend::Cuda, None, Some(4096))),
            Err("kv_tokens".into())
        );
        // The option rules hold whatever the backend.
        for (o, name) in [
            (at(Backend::Reference, Some(0), None), "parallel"),
            (at(Backend::Reference, Some(9), None), "parallel"),
            (at(Backend::Reference, None, Some(0)), "kv_tokens"),
        ] {
            assert_eq!(o.validate().unwrap_err().option, name);
        }
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<Capabilities>(&json).unwrap(), c);
    }

    /// glm4_moe's MLP block is FP16 (its description): that is what it
    /// offers and defaults to, and a BF16 one is refused by name.
    #[test]
    fn glm4_moe_offers_and_defaults_to_its_fp16_mlp_block() {
        let c = caps(true);
        let o = c.default_options("glm4_moe").unwrap();
        assert_eq!(o.mlp_precision, "fp16");
        c.check_options(&o, "glm4_moe").unwrap();
        let e = c
            .check_options(
                &LaunchOptions {
                    mlp_precision: "bf16".into(),
                    ..o
                },
                "glm4_moe",
            )
            .unwrap_err();
        assert_eq!(e.option, "mlp_precision");
        assert!(e.reason.contains("choose from: fp16"), "{}", e.reason);
        assert_eq!(
            c.default_options("qwen3_moe").unwrap().mlp_precision,
            "bf16"
        );
    }

    /// A prefix cache size is refused on a backend without one for the
    /// family (here gpt_oss's entry without the cuda backend's cache, as
    /// it was until its rings were cached); auto and off pass.
    #[test]
    fn a_prefix_cache_size_needs_the_backends_cache() {
        use crate::options::PrefixCacheChoice;
        let mut c = caps(true);
        for a in c
            .architectures
            .iter_mut()
            .filter(|a| a.model_type == "gpt_oss")
        {
            a.prefix_cache_backends = vec!["reference".into()];
        }
        let at = |backend, prefix_cache| LaunchOptions {
            model: "m".into(),
            backend,
            hcs: backend == Backend::Cuda,
            expert_precision: "mxfp4".into(),
            attention_precision: "fp16".into(),
            kv_format: "fp16".into(),
            prefix_cache,
            ..Default::default()
        };
        let size = PrefixCacheChoice::Bytes(1 << 30);
        let e = c
            .check_options(&at(Backend::Cuda, size), "gpt_oss")
            .unwrap_err();
        assert_eq!(e.option, "prefix_cache");
        assert!(e.reason.contains("use auto"), "{}", e.reason);
        for ok in [PrefixCacheChoice::Auto, PrefixCacheChoice::Off] {
            c.check_options(&at(Backend::Cuda, ok), "gpt_oss").unwrap();
        }
        // A sized RAM tier too, unless the cache is off.
        let mut host = at(Backend::Cuda, PrefixCacheChoice::Auto);
        host.prefix_cache_host = size;
        let e = c.check_options(&host, "gpt_oss").unwrap_err();
        assert_eq!(e.option, "prefix_cache_host");
        host.prefix_cache = PrefixCacheChoice::Off;
        host.prefix_cache_host = PrefixCacheChoice::Auto;
        c.check_options(&host, "gpt_oss").unwrap();
        c.check_options(&at(Backend::Reference, size), "gpt_oss")
            .unwrap();
        let mut o = c.default_options("qwen3_moe").unwrap();
        o.model = "m".into();
        o.prefix_cache = size;
        c.check_options(&o, "qwen3_moe").unwrap();
        // A file for a cache the backend does not have for the family.
        let mut filed = at(Backend::Cuda, PrefixCacheChoice::Auto);
        filed.prefix_cache_file = Some("/tmp/p.krspc".into());
        let e = c.check_options(&filed, "gpt_oss").unwrap_err();
        assert_eq!(e.option, "prefix_cache_file");
        filed.backend = Backend::Reference;
        filed.hcs = false;
        c.check_options(&filed, "gpt_oss").unwrap();
    }

    #[test]
    fn a_backend_the_architecture_lacks_is_refused_and_not_defaulted() {
        let mut c = caps(true);
        let model_type = c.architectures[0].model_type.clone();
        c.architectures[0].backends = vec!["reference".into()];
        let mut o = c.default_options(&model_type).unwrap();
        assert_eq!(o.backend, Backend::Reference);
        assert!(!o.hcs);
        o.model = "m".into();
        c.check_options(&o, &model_type).unwrap();
        let err = c
            .check_options(
                &LaunchOptions {
                    backend: Backend::Cuda,
                    ..o
                },
                &model_type,
            )
            .unwrap_err();
        assert_eq!(err.option, "backend");
        assert!(err.reason.contains("does not implement"), "{}", err.reason);
    }
}
