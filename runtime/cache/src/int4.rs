//! The cache as an [`ExpertWeights`] source for the CPU reference engine:
//! each expert is dequantized with the exact rule, so the reference engine
//! over this source computes what an exact INT4 GPU kernel must.

use crate::cache::ExpertCache;
use crate::quant::dequantize_expert;
use krasis_model::{ExpertF32, ExpertWeights, ModelError};
use std::sync::Arc;

#[derive(Debug, Clone)]
pub struct Int4Experts {
    cache: Arc<ExpertCache>,
}

impl Int4Experts {
    pub fn new(cache: Arc<ExpertCache>) -> Self {
        Int4Experts { cache }
    }
    pub fn cache(&self) -> &Arc<ExpertCache> {
        &self.cache
    }
}

impl ExpertWeights for Int4Experts {
    fn describe(&self) -> String {
        format!(
            "INT4 cache v{} ({})",
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
        Ok(dequantize_expert(&self.cache.layout(), block))
    }
}
