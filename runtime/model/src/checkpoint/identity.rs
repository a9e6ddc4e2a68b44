//! What a checkpoint's computed values depend on, as one hash: what the
//! prefix cache's file is bound to (`prefix_cache::persist`), so KV saved
//! from one model is never restored into another.

use super::Checkpoint;
use crate::error::ModelError;

/// Bytes sampled at the start, middle and end of every tensor.
const SAMPLE: usize = 256;

/// Files of the model directory besides the weights that change what it
/// computes (the synthetic recipe generates experts that are not in the
/// safetensors).
const RECIPES: [&str; 2] = ["config.json", "krasis_synth.json"];

impl Checkpoint {
    /// blake3 (hex) over `config.json` and `krasis_synth.json` as stored,
    /// and every tensor's name, storage type, shape and three samples of
    /// its bytes, in name order. A different revision, seed or
    /// quantization with the same names and shapes changes it at the cost
    /// of ~3 page reads per tensor (the expert cache's source identity
    /// samples its experts the same way); what it cannot see is an edit
    /// confined to unsampled bytes of a tensor.
    pub fn content_identity(&self) -> Result<String, ModelError> {
        let mut h = blake3::Hasher::new();
        for name in RECIPES {
            let path = self.dir.join(name);
            match std::fs::read(&path) {
                Ok(bytes) => {
                    h.update(name.as_bytes());
                    h.update(&(bytes.len() as u64).to_le_bytes());
                    h.update(&bytes);
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(ModelError::io(&path, e)),
            }
        }
        let mut names: Vec<&String> = self.entries.keys().collect();
        names.sort();
        for name in names {
            let e = &self.entries[name];
            let bytes = &self.shards[e.shard].map[e.start..e.end];
            let dtype = match &e.dtype {
                Ok(d) => d.name().to_string(),
                Err(other) => other.clone(),
            };
            h.update(format!("{name} {dtype} {:?} {}\n", e.shape, bytes.len()).as_bytes());
            let n = bytes.len();
            let mid = n / 2;
            for range in [
                0..n.min(SAMPLE),
                mid.saturating_sub(SAMPLE / 2)..(mid + SAMPLE / 2).min(n),
                n.saturating_sub(SAMPLE)..n,
            ] {
                h.update(&bytes[range]);
            }
        }
        Ok(h.finalize().to_hex().to_string())
    }
}
