//! The cache as an [`ExpertWeights`] source for the CPU reference engine:
//! each expert is decoded with the exact rule of its format (INT4 dequantized,
//! MXFP4 decoded with its biases), so the reference engine over this source
//! computes what an exact GPU kernel over the same cache must.

use crate::cache::ExpertCache;
use crate::layout::ExpertFormat;
use krasis_model::{ExpertF32, ExpertWeights, ModelError};
use std::sync::Arc;

#[derive(Debug, Clone)]
pub struct CacheExperts {
    cache: Arc<ExpertCache>,
}

impl CacheExperts {
    pub fn new(cache: Arc<ExpertCache>) -> Self {
        CacheExperts { cache }
    }
    pub fn cache(&self) -> &Arc<ExpertCache> {
        &self.cache
    }
}

impl ExpertWeights for CacheExperts {
    fn describe(&self) -> String {
        format!(
            "{} cache v{} ({})",
            self.cache.format(),
            crate::format::FORMAT_VERSION,
            self.cache.path().display()
        )
    }

    fn expert_f32(&self, layer: usize, expert: usize) -> Result<ExpertF32, ModelError> {
        let block = self.cache.try_expert_bytes(layer, expert).ok_or_else(|| {
            ModelError::Other(format!(
                "{}: no expert {expert} in layer {layer} (the cache has {} experts in MoE layers {:?})",
                self.describe(),
                self.cache.num_experts(),
                self.cache.moe_layers()
            ))
        })?;
        let layout = self.cache.layout();
        match layout.format {
            ExpertFormat::Int4 { .. } => Ok(crate::quant::dequantize_expert(&layout, block)),
            ExpertFormat::Mxfp4 => crate::mxfp4::dequantize_expert(&layout, block).map_err(|e| {
                ModelError::Other(format!(
                    "{}: expert {expert} of layer {layer}: {e}",
                    self.cache.path().display()
                ))
            }),
        }
    }
}
