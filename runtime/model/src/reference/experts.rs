//! Routed-expert sources: [`CheckpointExperts`] reads them from the mapped
//! checkpoint, and [`ExpertCache`] keeps converted experts of small models
//! in memory so repeated tokens do not convert the same bytes again.

use crate::arch::{ExpertStorage, FusedMxfp4Names, Geometry, MlpKind, ModelConfig};
use crate::checkpoint::{Checkpoint, convert_to_f32};
use crate::error::ModelError;
use crate::experts::{ExpertBias, ExpertF32, ExpertWeights};
use crate::formats::mxfp4::Mxfp4Tensor;
use std::sync::{Arc, OnceLock};

/// Routed experts straight from the checkpoint in source precision,
/// converted to f32 only when an expert is selected.
pub struct CheckpointExperts {
    ckpt: Arc<Checkpoint>,
    config: ModelConfig,
    geometry: Geometry,
}

/// How `ckpt` stores its routed experts: the float dtype of per-expert
/// tensors ("BF16", ...) or "MXFP4"; `None` when the model has no experts
/// or the checkpoint was written without them (`--experts-in-cache-only`).
pub fn stored_expert_format(config: &ModelConfig, ckpt: &Checkpoint) -> Option<&'static str> {
    let l = config.geometry().moe_layers().next()?;
    match config.expert_storage(l) {
        ExpertStorage::PerExpert => {
            let [gate, _, _] = config.expert_tensor_names(l, 0);
            ckpt.get(&gate).ok().map(|t| t.dtype.name())
        }
        ExpertStorage::FusedMxfp4(n) => ckpt.raw(&n.gate_up_blocks).ok().map(|_| "MXFP4"),
    }
}

impl CheckpointExperts {
    /// Row `row` of a `[rows, cols]` float tensor, converting only that row
    /// (an expert's bias out of the layer's `[E, n]` tensor).
    fn read_row(&self, name: &str, shape: [usize; 2], row: usize) -> Result<Vec<f32>, ModelError> {
        let t = self.ckpt.expect(name, &shape)?;
        let width = shape[1] * t.dtype.size();
        let mut out = vec![0f32; shape[1]];
        convert_to_f32(t.dtype, &t.bytes[row * width..(row + 1) * width], &mut out);
        Ok(out)
    }

    pub fn new(ckpt: Arc<Checkpoint>, config: &ModelConfig) -> Self {
        CheckpointExperts {
            ckpt,
            geometry: config.geometry(),
            config: config.clone(),
        }
    }
}

impl ExpertWeights for CheckpointExperts {
    fn describe(&self) -> String {
        let dtype = stored_expert_format(&self.config, &self.ckpt).unwrap_or("no experts");
        format!("checkpoint {dtype}")
    }

    fn expert_f32(&self, layer: usize, expert: usize) -> Result<ExpertF32, ModelError> {
        check_expert_index(&self.geometry, layer, expert)?;
        let (h, i) = (self.geometry.hidden, self.geometry.expert_intermediate);
        if let ExpertStorage::FusedMxfp4(names) = self.config.expert_storage(layer) {
            return self.mxfp4_expert(&names, expert);
        }
        let [gate, up, down] = self.config.expert_tensor_names(layer, expert);
        Ok(ExpertF32 {
            gate: self.ckpt.read_f32(&gate, &[i, h])?,
            up: self.ckpt.read_f32(&up, &[i, h])?,
            down: self.ckpt.read_f32(&down, &[h, i])?,
            bias: None,
        })
    }
}

impl CheckpointExperts {
    /// One expert of a fused MXFP4 layer, decoded exactly to f32
    /// (`formats::mxfp4`), gate/up de-interleaved, biases read as stored.
    fn mxfp4_expert(&self, n: &FusedMxfp4Names, e: usize) -> Result<ExpertF32, ModelError> {
        let (h, i, ne) = (
            self.geometry.hidden,
            self.geometry.expert_intermediate,
            self.geometry.num_experts,
        );
        let tensor = |blocks: &str, scales: &str| -> Result<_, ModelError> {
            let (b, s) = (self.ckpt.raw(blocks)?, self.ckpt.raw(scales)?);
            Mxfp4Tensor::from_safetensors(blocks, b.as_mxfp4_raw(), s.as_mxfp4_raw())
                .map_err(|err| ModelError::Other(format!("{}: {err}", self.ckpt.dir().display())))
        };
        let gate_up = tensor(&n.gate_up_blocks, &n.gate_up_scales)?;
        let down = tensor(&n.down_blocks, &n.down_scales)?;
        let (gu_shape, d_shape) = (gate_up.shape(), down.shape());
        if (gu_shape.experts, gu_shape.rows, gu_shape.cols) != (ne, 2 * i, h)
            || (d_shape.experts, d_shape.rows, d_shape.cols) != (ne, h, i)
        {
            return Err(ModelError::Other(format!(
                "{}: MXFP4 experts {:?} / {:?} do not match the config ({ne} experts, \
                 hidden {h}, width {i})",
                n.gate_up_blocks, gu_shape, d_shape
            )));
        }
        let missing = |t: &str| ModelError::Other(format!("{t}: expert {e} missing"));
        let gu = gate_up
            .expert(e)
            .ok_or_else(|| missing(&n.gate_up_blocks))?;
        let (gate, up) = if n.gate_up_interleaved {
            gu.dequant_gate_up()
        } else {
            let all = gu.dequant();
            let (g, u) = all.split_at(i * h);
            (g.to_vec(), u.to_vec())
        };
        let down_w = down
            .expert(e)
            .ok_or_else(|| missing(&n.down_blocks))?
            .dequant();
        let bias = match (&n.gate_up_bias, &n.down_bias) {
            (Some(gb), Some(db)) => {
                let row = self.read_row(gb, [ne, 2 * i], e)?;
                let (gate_b, up_b) = if n.gate_up_interleaved {
                    (
                        row.iter().step_by(2).copied().collect(),
                        row.iter().skip(1).step_by(2).copied().collect(),
                    )
                } else {
                    (row[..i].to_vec(), row[i..].to_vec())
                };
                Some(ExpertBias {
                    gate: gate_b,
                    up: up_b,
                    down: self.read_row(db, [ne, h], e)?,
                })
            }
            (None, None) => None,
            _ => {
                return Err(ModelError::Other(format!(
                    "{}: only one of the gate_up/down biases is named",
                    n.gate_up_blocks
                )));
            }
        };
        Ok(ExpertF32 {
            gate,
            up,
            down: down_w,
            bias,
        })
    }
}

fn check_expert_index(g: &Geometry, layer: usize, expert: usize) -> Result<(), ModelError> {
    if layer >= g.num_layers || g.mlp_kind(layer) != MlpKind::Moe || expert >= g.num_experts {
        return Err(ModelError::Other(format!(
            "expert {expert} of layer {layer} does not exist: the model has {} layers \
             (MoE: {:?}) with {} experts each",
            g.num_layers,
            g.moe_layers().collect::<Vec<_>>(),
            g.num_experts
        )));
    }
    Ok(())
}

/// Routed experts larger than this (as f32) are converted on every use
/// instead of being kept: a real model's experts are far bigger than RAM.
pub const F32_CACHE_LIMIT_BYTES: u64 = 1 << 30;

/// Fetches experts from any [`ExpertWeights`], checks their shapes, and
/// keeps them when the whole model's experts fit in [`F32_CACHE_LIMIT_BYTES`].
pub struct ExpertCache {
    source: Arc<dyn ExpertWeights>,
    geometry: Geometry,
    /// `[layer * num_experts + expert]` when caching.
    slots: Option<Vec<OnceLock<Arc<ExpertF32>>>>,
}

impl ExpertCache {
    pub fn new(source: Arc<dyn ExpertWeights>, g: &Geometry) -> Self {
        let bytes = g.routed_expert_params() * 4;
        let slots = (bytes <= F32_CACHE_LIMIT_BYTES).then(|| {
            (0..g.num_layers * g.num_experts)
                .map(|_| OnceLock::new())
                .collect()
        });
        ExpertCache {
            source,
            geometry: g.clone(),
            slots,
        }
    }

    pub fn describe(&self) -> String {
        self.source.describe()
    }

    pub fn get(&self, layer: usize, expert: usize) -> Result<Arc<ExpertF32>, ModelError> {
        check_expert_index(&self.geometry, layer, expert)?;
        let slot = self
            .slots
            .as_ref()
            .map(|s| &s[layer * self.geometry.num_experts + expert]);
        if let Some(w) = slot.and_then(|s| s.get()) {
            return Ok(w.clone());
        }
        let w = self.source.expert_f32(layer, expert)?;
        let (h, i) = (self.geometry.hidden, self.geometry.expert_intermediate);
        for (what, len) in [
            ("gate", w.gate.len()),
            ("up", w.up.len()),
            ("down", w.down.len()),
        ] {
            if len != h * i {
                return Err(ModelError::Other(format!(
                    "{}: expert {expert} of layer {layer}: {what} has {len} values, \
                     the model needs {} ({i} x {h}); the expert source does not match this model",
                    self.source.describe(),
                    h * i
                )));
            }
        }
        let w = Arc::new(w);
        if let Some(s) = slot {
            // Another thread may have filled it meanwhile; both values are equal.
            let _ = s.set(w.clone());
        }
        Ok(w)
    }
}
