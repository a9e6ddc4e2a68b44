//! The options form: which fields exist, how each is shown, cycled through
//! the runtime's capability lists, or typed in.

use crate::units::{fmt_bytes, parse_bytes};
use krasis_common::options::HeatmapChoice;
use krasis_common::{Backend, Capabilities, LaunchOptions};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    Backend,
    ExpertPrecision,
    AttentionPrecision,
    KvFormat,
    ContextLength,
    VramLimit,
    SafetyMargin,
    Hcs,
    Heatmap,
    Pruning,
    Host,
    Port,
    ApiKey,
}

pub const FIELDS: [Field; 13] = [
    Field::Backend,
    Field::ExpertPrecision,
    Field::AttentionPrecision,
    Field::KvFormat,
    Field::ContextLength,
    Field::VramLimit,
    Field::SafetyMargin,
    Field::Hcs,
    Field::Heatmap,
    Field::Pruning,
    Field::Host,
    Field::Port,
    Field::ApiKey,
];

impl Field {
    pub fn label(self) -> &'static str {
        match self {
            Field::Backend => "Backend",
            Field::ExpertPrecision => "Expert precision",
            Field::AttentionPrecision => "Attention precision",
            Field::KvFormat => "KV cache format",
            Field::ContextLength => "Context length",
            Field::VramLimit => "VRAM limit",
            Field::SafetyMargin => "Safety margin (MiB)",
            Field::Hcs => "HCS (hot experts in VRAM)",
            Field::Heatmap => "Heatmap",
            Field::Pruning => "Pruning",
            Field::Host => "Host",
            Field::Port => "Port",
            Field::ApiKey => "API key",
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
                | Field::Hcs
                | Field::Pruning
        )
    }

    pub fn show(self, o: &LaunchOptions) -> String {
        match self {
            Field::Backend => o.backend.as_str().into(),
            Field::ExpertPrecision => o.expert_precision.clone(),
            Field::AttentionPrecision => o.attention_precision.clone(),
            Field::KvFormat => o.kv_format.clone(),
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
                .map_or("none".into(), |_| "set (hidden)".into()),
        }
    }

    /// Initial text when editing starts.
    pub fn text(self, o: &LaunchOptions) -> String {
        match self {
            Field::ContextLength => o.context_length.map(|c| c.to_string()).unwrap_or_default(),
            Field::VramLimit => o
                .vram_limit_bytes
                .map(fmt_bytes)
                .unwrap_or_default()
                .replace(' ', ""),
            Field::ApiKey => o.api_key.clone().unwrap_or_default(),
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
                    Some(parse_bytes(t)?)
                }
            }
            Field::SafetyMargin => o.safety_margin_mib = num("safety margin")?,
            Field::Heatmap => {
                o.heatmap = HeatmapChoice::parse(if t.is_empty() { "auto" } else { t })
            }
            Field::Host => o.host = t.to_string(),
            Field::Port => {
                o.port =
                    u16::try_from(num("port")?).map_err(|_| format!("port {t} is above 65535"))?
            }
            Field::ApiKey => o.api_key = (!t.is_empty()).then(|| t.to_string()),
            _ => return Err(format!("{} is chosen with Left/Right", self.label())),
        }
        Ok(())
    }

    /// What the runtime offers for a choice field.
    pub fn choices(self, caps: &Capabilities, model_type: Option<&str>) -> Vec<String> {
        let arch = model_type.and_then(|t| caps.architecture(t));
        match self {
            Field::Backend => caps
                .backends
                .iter()
                .filter(|b| b.available)
                .map(|b| b.name.clone())
                .collect(),
            Field::ExpertPrecision => arch
                .map(|a| a.expert_precisions.clone())
                .unwrap_or_default(),
            Field::AttentionPrecision => arch
                .map(|a| a.attention_precisions.clone())
                .unwrap_or_default(),
            Field::KvFormat => arch.map(|a| a.kv_formats.clone()).unwrap_or_default(),
            Field::Pruning => arch.map(|a| a.pruning_modes.clone()).unwrap_or_default(),
            Field::Hcs => {
                let mut v = vec!["off".to_string()];
                if arch.is_some_and(|a| a.hcs) {
                    v.push("on".into());
                }
                v
            }
            _ => Vec::new(),
        }
    }

    /// Moves to the next/previous offered value.
    pub fn cycle(
        self,
        o: &mut LaunchOptions,
        caps: &Capabilities,
        model_type: Option<&str>,
        forward: bool,
    ) {
        let c = self.choices(caps, model_type);
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
                }
            }
            Field::ExpertPrecision => o.expert_precision = v,
            Field::AttentionPrecision => o.attention_precision = v,
            Field::KvFormat => o.kv_format = v,
            Field::Pruning => o.pruning = v,
            Field::Hcs => o.hcs = v == "on",
            _ => {}
        }
    }
}
