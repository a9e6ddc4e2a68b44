//! The options form: which fields exist, how each is shown, cycled through
//! the runtime's capability lists, or typed in, and which ones the selected
//! backend or this machine cannot use (shown disabled, with the reason).

use crate::probe::GpuInfo;
use crate::units::{fmt_bytes, format_size_exact, parse_size};
use krasis_common::options::{HeatmapChoice, PrefixCacheChoice};
use krasis_common::{Backend, Capabilities, LaunchOptions};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    Backend,
    ExpertPrecision,
    AttentionPrecision,
    KvFormat,
    MlpPrecision,
    ContextLength,
    VramLimit,
    SafetyMargin,
    Hcs,
    Heatmap,
    Pruning,
    Host,
    Port,
    ApiKey,
    ApiKeyFile,
    CorsOrigins,
    Gpu,
    PrefixCache,
    Parallel,
    KvTokens,
    PrefixCacheHost,
    PrefixBlock,
    PrefixCacheFile,
}

/// In form order. GPU, the prefix cache and the batching fields come last
/// so the rows above keep their places (the tmux flow test counts them).
pub const FIELDS: [Field; 23] = [
    Field::Backend,
    Field::ExpertPrecision,
    Field::AttentionPrecision,
    Field::KvFormat,
    Field::MlpPrecision,
    Field::ContextLength,
    Field::VramLimit,
    Field::SafetyMargin,
    Field::Hcs,
    Field::Heatmap,
    Field::Pruning,
    Field::Host,
    Field::Port,
    Field::ApiKey,
    Field::ApiKeyFile,
    Field::CorsOrigins,
    Field::Gpu,
    Field::PrefixCache,
    Field::Parallel,
    Field::KvTokens,
    Field::PrefixCacheHost,
    Field::PrefixBlock,
    Field::PrefixCacheFile,
];

/// What availability and choices are derived from: the runtime's report
/// and the probed GPUs.
#[derive(Clone, Copy)]
pub struct FieldCtx<'a> {
    pub caps: &'a Capabilities,
    pub model_type: Option<&'a str>,
    pub gpus: &'a [GpuInfo],
}

impl Field {
    pub fn label(self) -> &'static str {
        match self {
            Field::Backend => "Backend",
            Field::ExpertPrecision => "Expert precision",
            Field::AttentionPrecision => "Attention precision",
            Field::KvFormat => "KV cache format",
            Field::MlpPrecision => "MLP precision",
            Field::ContextLength => "Context length",
            Field::VramLimit => "VRAM limit",
            Field::SafetyMargin => "Safety margin (MiB)",
            Field::Hcs => "HCS (hot experts in VRAM)",
            Field::Heatmap => "Heatmap",
            Field::Pruning => "Pruning",
            Field::Host => "Host",
            Field::Port => "Port",
            Field::ApiKey => "API key (this run only)",
            Field::ApiKeyFile => "API key file",
            Field::CorsOrigins => "CORS origins",
            Field::Gpu => "GPU (CUDA device)",
            Field::PrefixCache => "Prefix cache (auto/off/size)",
            Field::Parallel => "Parallel requests",
            Field::KvTokens => "KV budget (tokens)",
            Field::PrefixCacheHost => "Prefix cache host tier",
            Field::PrefixBlock => "Prefix block (tokens)",
            Field::PrefixCacheFile => "Prefix cache file",
        }
    }

    /// Chosen from a list (Left/Right) rather than typed (Enter).
    pub fn is_choice(self) -> bool {
        matches!(
            self,
            Field::Backend
                | Field::ExpertPrecision
                | Field::AttentionPrecision
                | Field::KvFormat
                | Field::MlpPrecision
                | Field::Hcs
                | Field::Pruning
                | Field::Gpu
                | Field::Parallel
        )
    }

    pub fn show(self, o: &LaunchOptions) -> String {
        match self {
            Field::Backend => o.backend.as_str().into(),
            Field::ExpertPrecision => o.expert_precision.clone(),
            Field::AttentionPrecision => o.attention_precision.clone(),
            Field::KvFormat => o.kv_format.clone(),
            Field::MlpPrecision => o.mlp_precision.clone(),
            Field::ContextLength => o
                .context_length
                .map_or("model maximum".into(), |c| c.to_string()),
            Field::VramLimit => o.vram_limit_bytes.map_or("whole GPU".into(), fmt_bytes),
            Field::SafetyMargin => o.safety_margin_mib.to_string(),
            Field::Hcs => if o.hcs { "on" } else { "off" }.into(),
            Field::Heatmap => o.heatmap.to_arg(),
            Field::Pruning => {
                if o.pruning == "off" {
                    "off (exact)".into()
                } else {
                    format!("{} (APPROXIMATE)", o.pruning)
                }
            }
            Field::Host => o.host.clone(),
            Field::Port => o.port.to_string(),
            Field::ApiKey => o
                .api_key
                .as_ref()
                .map_or("none".into(), |_| "set (hidden, not saved)".into()),
            Field::ApiKeyFile => o
                .api_key_file
                .as_ref()
                .map_or("none".into(), |p| p.display().to_string()),
            Field::CorsOrigins => {
                if o.cors_origins.is_empty() {
                    "loopback only".into()
                } else {
                    o.cors_origins.join(", ")
                }
            }
            Field::Gpu => o.gpu.to_string(),
            Field::PrefixCache => match o.prefix_cache {
                PrefixCacheChoice::Auto => "auto (engine's rule)".into(),
                PrefixCacheChoice::Off => "off".into(),
                PrefixCacheChoice::Bytes(0) => "no VRAM pool (host tier only)".into(),
                PrefixCacheChoice::Bytes(b) => fmt_bytes(b),
            },
            Field::Parallel => o.parallel.map_or(AUTO_PARALLEL.into(), |n| n.to_string()),
            Field::KvTokens => o
                .kv_tokens
                .map_or("engine default".into(), |t| t.to_string()),
            Field::PrefixCacheHost => match o.prefix_cache_host {
                PrefixCacheChoice::Auto => "auto (engine's rule)".into(),
                PrefixCacheChoice::Off | PrefixCacheChoice::Bytes(0) => "off".into(),
                PrefixCacheChoice::Bytes(b) => fmt_bytes(b),
            },
            Field::PrefixBlock => o.prefix_block.to_string(),
            Field::PrefixCacheFile => o
                .prefix_cache_file
                .as_ref()
                .map_or("none (memory only)".into(), |p| p.display().to_string()),
        }
    }

    /// Initial text when editing starts.
    pub fn text(self, o: &LaunchOptions) -> String {
        match self {
            Field::ContextLength => o.context_length.map(|c| c.to_string()).unwrap_or_default(),
            Field::VramLimit => o
                .vram_limit_bytes
                .map(format_size_exact)
                .unwrap_or_default(),
            Field::ApiKey => o.api_key.clone().unwrap_or_default(),
            Field::ApiKeyFile => o
                .api_key_file
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            Field::PrefixCacheFile => o
                .prefix_cache_file
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            Field::CorsOrigins => o.cors_origins.join(" "),
            Field::PrefixCache => match o.prefix_cache {
                PrefixCacheChoice::Bytes(b) => format_size_exact(b),
                c => c.to_arg(),
            },
            Field::KvTokens => o.kv_tokens.map(|t| t.to_string()).unwrap_or_default(),
            Field::PrefixCacheHost => match o.prefix_cache_host {
                PrefixCacheChoice::Bytes(b) => format_size_exact(b),
                c => c.to_arg(),
            },
            _ => self.show(o),
        }
    }

    /// Sets a typed field; empty text means "default" where there is one.
    pub fn set_text(self, o: &mut LaunchOptions, t: &str) -> Result<(), String> {
        let t = t.trim();
        let num = |what: &str| -> Result<u64, String> {
            t.parse::<u64>()
                .map_err(|_| format!("{what}: '{t}' is not a whole number"))
        };
        match self {
            Field::ContextLength => {
                o.context_length = if t.is_empty() {
                    None
                } else {
                    Some(
                        u32::try_from(num("context length")?)
                            .map_err(|_| "context length too large".to_string())?,
                    )
                }
            }
            Field::VramLimit => {
                o.vram_limit_bytes = if t.is_empty() {
                    None
                } else {
                    Some(parse_size(t).map_err(|e| e.to_string())?)
                }
            }
            Field::SafetyMargin => o.safety_margin_mib = num("safety margin")?,
            Field::KvTokens => {
                o.kv_tokens = match t {
                    "" => None,
                    _ => match num("KV budget")? {
                        0 => return Err("KV budget: at least 1 token".into()),
                        n => Some(n),
                    },
                }
            }
            Field::PrefixCache => {
                o.prefix_cache = PrefixCacheChoice::parse(if t.is_empty() { "auto" } else { t })
                    .map_err(|e| e.reason)?
            }
            Field::PrefixCacheHost => {
                o.prefix_cache_host =
                    PrefixCacheChoice::parse(if t.is_empty() { "auto" } else { t })
                        .map_err(|e| e.reason)?
            }
            Field::PrefixBlock => {
                let v = if t.is_empty() {
                    krasis_common::options::DEFAULT_PREFIX_BLOCK
                } else {
                    u32::try_from(num("prefix block")?)
                        .map_err(|_| "prefix block too large".to_string())?
                };
                krasis_common::options::check_prefix_block(v).map_err(|e| e.reason)?;
                o.prefix_block = v;
            }
            Field::Heatmap => {
                o.heatmap = HeatmapChoice::parse(if t.is_empty() { "auto" } else { t })
            }
            // Empty (or `off`): the cache is kept in memory only.
            Field::PrefixCacheFile => {
                o.prefix_cache_file =
                    (!t.is_empty() && t != "off").then(|| std::path::PathBuf::from(t))
            }
            Field::Host => o.host = t.to_string(),
            Field::Port => {
                o.port =
                    u16::try_from(num("port")?).map_err(|_| format!("port {t} is above 65535"))?
            }
            // A typed key and a key file are alternatives: setting one clears the other.
            Field::ApiKey => {
                o.api_key = (!t.is_empty()).then(|| t.to_string());
                if o.api_key.is_some() {
                    o.api_key_file = None;
                }
            }
            Field::ApiKeyFile => {
                o.api_key_file = (!t.is_empty()).then(|| std::path::PathBuf::from(t));
                if o.api_key_file.is_some() {
                    o.api_key = None;
                }
            }
            Field::CorsOrigins => {
                let v: Vec<String> = t
                    .split([',', ' '])
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect();
                for origin in &v {
                    krasis_common::options::check_cors_origin(origin)?;
                }
                o.cors_origins = v;
            }
            _ => return Err(format!("{} is chosen with Left/Right", self.label())),
        }
        Ok(())
    }

    /// What the runtime offers for a choice field, with `o` as chosen so far.
    pub fn choices(self, o: &LaunchOptions, cx: FieldCtx) -> Vec<String> {
        let caps = cx.caps;
        let arch = cx.model_type.and_then(|t| caps.architecture(t));
        match self {
            // Only the backends that build this model's family (the
            // registry's list).
            Field::Backend => caps
                .backends
                .iter()
                .filter(|b| b.available)
                .filter(|b| arch.is_none_or(|a| a.backends.contains(&b.name)))
                .map(|b| b.name.clone())
                .collect(),
            Field::ExpertPrecision => arch
                .map(|a| a.expert_precisions.clone())
                .unwrap_or_default(),
            Field::AttentionPrecision => arch
                .map(|a| a.attention_precisions.clone())
                .unwrap_or_default(),
            Field::KvFormat => arch.map(|a| a.kv_formats.clone()).unwrap_or_default(),
            Field::MlpPrecision => arch.map(|a| a.mlp_precisions.clone()).unwrap_or_default(),
            Field::Pruning => arch.map(|a| a.pruning_modes.clone()).unwrap_or_default(),
            Field::Hcs => {
                let mut v = vec!["off".to_string()];
                if arch.is_some_and(|a| a.hcs) {
                    v.push("on".into());
                }
                v
            }
            Field::Gpu => cx.gpus.iter().map(|g| g.index.to_string()).collect(),
            // auto, then 1 to what the selected backend runs together.
            Field::Parallel => {
                let max = caps
                    .backend(o.backend.as_str())
                    .map_or(1, |b| b.max_parallel);
                std::iter::once(AUTO_PARALLEL.to_string())
                    .chain((1..=max).map(|n| n.to_string()))
                    .collect()
            }
            _ => Vec::new(),
        }
    }

    /// Why this field cannot be used with `o` on this machine, if it cannot:
    /// the row is shown disabled with this reason and does not change.
    pub fn unavailable(self, o: &LaunchOptions, cx: FieldCtx) -> Option<String> {
        match self {
            Field::VramLimit | Field::SafetyMargin | Field::Gpu => {
                if let Some(b) = cx.caps.backend(Backend::Cuda.as_str())
                    && !b.available
                {
                    return Some(format!(
                        "a GPU setting, and the cuda backend cannot run here: {}",
                        b.reason.as_deref().unwrap_or("no reason given")
                    ));
                }
                if o.backend != Backend::Cuda {
                    return Some(format!(
                        "a GPU setting; the {} backend runs on the CPU",
                        o.backend.as_str()
                    ));
                }
                (self == Field::Gpu && cx.gpus.is_empty())
                    .then(|| "the hardware probe found no GPU".to_string())
            }
            Field::KvTokens => {
                let b = cx.caps.backend(o.backend.as_str())?;
                (!b.kv_tokens).then(|| {
                    format!(
                        "the {} backend sizes its KV memory itself",
                        o.backend.as_str()
                    )
                })
            }
            // Asked of the one authority: would these options pass with
            // HCS on? Only a refusal of HCS itself disables the field.
            Field::Hcs => {
                let with_hcs = LaunchOptions {
                    hcs: true,
                    ..o.clone()
                };
                match cx.caps.check_options(&with_hcs, cx.model_type?) {
                    Err(e) if e.option == "hcs" => Some(e.reason),
                    _ => None,
                }
            }
            _ => None,
        }
    }

    /// Moves to the next/previous offered value.
    pub fn cycle(self, o: &mut LaunchOptions, cx: FieldCtx, forward: bool) {
        let (caps, model_type) = (cx.caps, cx.model_type);
        let c = self.choices(o, cx);
        if c.is_empty() {
            return;
        }
        let cur = match self {
            Field::Hcs => if o.hcs { "on" } else { "off" }.to_string(),
            Field::Pruning => o.pruning.clone(),
            _ => self.show(o),
        };
        let i = c.iter().position(|v| *v == cur);
        let n = c.len();
        let next = match (i, forward) {
            (Some(i), true) => (i + 1) % n,
            (Some(i), false) => (i + n - 1) % n,
            (None, _) => 0,
        };
        let v = c[next].clone();
        match self {
            Field::Backend => {
                if let Ok(b) = Backend::parse(&v) {
                    o.backend = b;
                    // HCS follows the backend; the user can turn it off again.
                    o.hcs = b == Backend::Cuda
                        && model_type
                            .and_then(|t| caps.architecture(t))
                            .is_some_and(|a| a.hcs);
                    // A limit the new backend cannot use is not passed on.
                    if Field::VramLimit.unavailable(o, cx).is_some() {
                        o.vram_limit_bytes = None;
                    }
                    // Nor batching it cannot do.
                    let b = caps.backend(o.backend.as_str());
                    if o.parallel > b.map(|b| b.max_parallel) {
                        o.parallel = None;
                    }
                    if !b.is_some_and(|b| b.kv_tokens) {
                        o.kv_tokens = None;
                    }
                }
            }
            Field::Gpu => {
                if let Ok(g) = v.parse() {
                    o.gpu = g;
                }
            }
            Field::ExpertPrecision => o.expert_precision = v,
            Field::AttentionPrecision => o.attention_precision = v,
            Field::KvFormat => o.kv_format = v,
            Field::MlpPrecision => o.mlp_precision = v,
            Field::Pruning => o.pruning = v,
            Field::Hcs => o.hcs = v == "on",
            Field::Parallel => o.parallel = v.parse().ok(),
            _ => {}
        }
    }
}

/// How the Parallel field shows "the engine decides".
const AUTO_PARALLEL: &str = "auto (engine's capacity)";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_and_key_file_replace_each_other_and_the_key_is_hidden() {
        let mut o = LaunchOptions::default();
        Field::ApiKeyFile.set_text(&mut o, "/k").unwrap();
        Field::ApiKey
            .set_text(&mut o, "typed-key-0123456789")
            .unwrap();
        assert_eq!(o.api_key_file, None);
        assert!(!Field::ApiKey.show(&o).contains("typed"));
        Field::ApiKeyFile.set_text(&mut o, " ~/key ").unwrap();
        assert_eq!(o.api_key, None);
        assert_eq!(Field::ApiKeyFile.show(&o), "~/key");
    }

    #[test]
    fn cors_origins_are_typed_as_a_list_and_checked() {
        let mut o = LaunchOptions::default();
        assert_eq!(Field::CorsOrigins.show(&o), "loopback only");
        Field::CorsOrigins
            .set_text(&mut o, "https://a.example, http://localhost:3000")
            .unwrap();
        assert_eq!(
            o.cors_origins,
            vec!["https://a.example", "http://localhost:3000"]
        );
        assert!(Field::CorsOrigins.set_text(&mut o, "a.example").is_err());
        assert_eq!(o.cors_origins.len(), 2, "a refused list changes nothing");
        Field::CorsOrigins.set_text(&mut o, "").unwrap();
        assert!(o.cors_origins.is_empty());
    }

    #[test]
    fn vram_limit_is_typed_with_the_shared_size_rules() {
        let mut o = LaunchOptions::default();
        Field::VramLimit.set_text(&mut o, "20GB").unwrap();
        assert_eq!(o.vram_limit_bytes, Some(20_000_000_000));
        let e = Field::VramLimit.set_text(&mut o, "20G").unwrap_err();
        assert!(e.contains("20GiB (2^30)"), "{e}");
        Field::VramLimit.set_text(&mut o, "20GiB").unwrap();
        assert_eq!(Field::VramLimit.text(&o), "20GiB");
    }
}
