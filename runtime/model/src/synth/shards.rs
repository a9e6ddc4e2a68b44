//! Shard planning and safetensors headers, computed from shapes alone so a
//! shard's header can be written before any of its values exist.

use super::spec::{SynthDtype, TensorDesc};
use std::collections::BTreeMap;

/// One output file and the tensors it holds, in file order.
#[derive(Debug, Clone)]
pub struct ShardPlan {
    pub file: String,
    pub tensors: Vec<TensorDesc>,
}

impl ShardPlan {
    pub fn data_bytes(&self, dtype: SynthDtype) -> u64 {
        self.tensors.iter().map(|t| t.bytes(dtype)).sum()
    }
}

/// Hugging Face's rule: tensors in order, a new shard whenever the next
/// tensor would push the current one past `max_bytes` (a tensor larger than
/// `max_bytes` gets a shard of its own). One shard is `model.safetensors`,
/// several are `model-0000i-of-0000N.safetensors`.
pub fn plan_shards(tensors: Vec<TensorDesc>, dtype: SynthDtype, max_bytes: u64) -> Vec<ShardPlan> {
    let mut groups: Vec<Vec<TensorDesc>> = vec![Vec::new()];
    let mut current = 0u64;
    for t in tensors {
        let bytes = t.bytes(dtype);
        let last = groups.last_mut().expect("never empty");
        if !last.is_empty() && current + bytes > max_bytes {
            groups.push(Vec::new());
            current = 0;
        }
        current += bytes;
        groups.last_mut().expect("never empty").push(t);
    }
    let n = groups.len();
    groups
        .into_iter()
        .enumerate()
        .map(|(i, tensors)| ShardPlan {
            file: if n == 1 {
                "model.safetensors".into()
            } else {
                format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
            },
            tensors,
        })
        .collect()
}

/// The 8-byte length prefix plus JSON header of a shard, padded with spaces
/// to a multiple of 8 bytes (as the reference serializer does) so tensor data
/// starts aligned.
pub fn safetensors_header(shard: &ShardPlan, dtype: SynthDtype) -> Vec<u8> {
    let mut map = serde_json::Map::new();
    map.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut offset = 0u64;
    for t in &shard.tensors {
        let bytes = t.bytes(dtype);
        map.insert(
            t.name.clone(),
            serde_json::json!({
                "dtype": t.safetensors_dtype(dtype),
                "shape": t.shape,
                "data_offsets": [offset, offset + bytes],
            }),
        );
        offset += bytes;
    }
    let mut json = serde_json::to_vec(&map).expect("header serializes");
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out
}

/// `model.safetensors.index.json` for a multi-shard plan.
pub fn index_json(shards: &[ShardPlan], dtype: SynthDtype) -> serde_json::Value {
    let total: u64 = shards.iter().map(|s| s.data_bytes(dtype)).sum();
    let weight_map: BTreeMap<&str, &str> = shards
        .iter()
        .flat_map(|s| s.tensors.iter().map(|t| (t.name.as_str(), s.file.as_str())))
        .collect();
    serde_json::json!({
        "metadata": { "total_size": total },
        "weight_map": weight_map,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::values::Init;

    fn t(name: &str, n: usize) -> TensorDesc {
        TensorDesc {
            name: name.into(),
            shape: vec![n],
            init: Init::Normal { std: 1.0 },
            routed_expert: false,
            storage: crate::synth::spec::Storage::Float,
        }
    }

    #[test]
    fn hf_sharding_rule() {
        let ts = vec![t("a", 10), t("b", 10), t("c", 30), t("d", 5)];
        // 2-byte elements: 20, 20, 60, 10 bytes; max 45.
        let p = plan_shards(ts.clone(), SynthDtype::Bf16, 45);
        let names: Vec<Vec<&str>> = p
            .iter()
            .map(|s| s.tensors.iter().map(|t| t.name.as_str()).collect())
            .collect();
        assert_eq!(names, vec![vec!["a", "b"], vec!["c"], vec!["d"]]);
        assert_eq!(p[0].file, "model-00001-of-00003.safetensors");
        let one = plan_shards(ts, SynthDtype::Bf16, 1000);
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].file, "model.safetensors");
    }

    #[test]
    fn header_is_aligned_and_parses() {
        let p = &plan_shards(vec![t("x", 3), t("yy", 5)], SynthDtype::F32, 1 << 20)[0];
        let h = safetensors_header(p, SynthDtype::F32);
        let n = u64::from_le_bytes(h[..8].try_into().unwrap()) as usize;
        assert_eq!(n + 8, h.len());
        assert_eq!(h.len() % 8, 0);
        let v: serde_json::Value = serde_json::from_slice(&h[8..]).unwrap();
        assert_eq!(v["yy"]["data_offsets"], serde_json::json!([12, 32]));
        assert_eq!(v["__metadata__"]["format"], "pt");
    }
}
