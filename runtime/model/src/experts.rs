//! Where the reference engine gets routed-expert weights from. The checkpoint
//! provides them in source precision; the INT4 cache crate provides a
//! dequantizing implementation, so quantization error is measured by running
//! the same reference engine over both.

use crate::error::ModelError;

/// One routed expert as f32, row-major: `gate` and `up` are `[I, H]`,
/// `down` is `[H, I]` (the Hugging Face `nn.Linear` weight layout).
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertF32 {
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
    /// Projection biases, for families whose experts have them
    /// (`ExpertSpec::bias`).
    pub bias: Option<ExpertBias>,
}

/// Biases of one routed expert.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertBias {
    /// `[I]` each, added to the gate and up projections.
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    /// `[H]`, added to the down projection.
    pub down: Vec<f32>,
}

pub trait ExpertWeights: Send + Sync {
    /// Short description for logs and reports ("checkpoint BF16", "INT4 cache v1").
    fn describe(&self) -> String;
    /// Weights of `expert` in decoder layer `layer` (a MoE layer index in
    /// `0..num_layers`, not an index among MoE layers).
    fn expert_f32(&self, layer: usize, expert: usize) -> Result<ExpertF32, ModelError>;
}
