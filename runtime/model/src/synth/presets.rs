//! Synth presets by name. The presets themselves are written with their
//! architecture (`arch/<model_type>/presets.rs`) and listed through the
//! architecture registry; this is the lookup synth and estimates use.

use crate::arch::registry;
use serde_json::Value;

/// Names accepted by `--preset`, in registry order.
pub fn preset_names() -> Vec<&'static str> {
    registry::presets().map(|(_, p)| p.name).collect()
}

/// The typed geometry of a preset (for tests and estimates that need a real
/// model shape without writing a checkpoint).
pub fn preset_geometry(name: &str) -> Option<crate::Geometry> {
    let json = preset_config(name)?.to_string();
    crate::arch::ModelConfig::from_json_str(&json, std::path::Path::new(name))
        .ok()
        .map(|c| c.geometry())
}

/// The full `config.json` of a preset, or `None` for an unknown name.
pub fn preset_config(name: &str) -> Option<Value> {
    registry::preset(name).map(|(_, p)| (p.config)())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::ModelConfig;
    use std::path::Path;

    #[test]
    fn every_preset_is_a_valid_config() {
        for p in preset_names() {
            let v = preset_config(p).unwrap();
            ModelConfig::from_json_str(&v.to_string(), Path::new(p)).unwrap();
        }
        assert!(preset_config("nope").is_none());
    }

    #[test]
    fn preset_sizes() {
        let g = |p| {
            let v = preset_config(p).unwrap();
            ModelConfig::from_json_str(&v.to_string(), Path::new(p))
                .unwrap()
                .geometry()
        };
        let qcn = g("qcn").total_params() as f64 / 1e9;
        assert!((77.0..79.0).contains(&qcn), "{qcn}");
        let a = g("a3b-24l");
        assert_eq!(a.num_layers, 24);
        assert_eq!(a.num_experts, 128);
        let td = g("tiny-dense");
        assert_eq!(td.mlp_kind(0), crate::arch::MlpKind::Dense);
        assert!(td.tie_word_embeddings);
        assert!(g("tiny").max_position_embeddings >= 4096);
    }
}
