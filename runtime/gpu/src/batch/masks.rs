//! Grammar-constrained sampling (structured output, issue 18) in the
//! batching engine.
//!
//! Each constrained sequence holds its [`Constraint`](krasis_model::structured::Constraint)
//! (started at admission). Before a token of it is sampled, its mask for that
//! token is computed on the host and queued into its slot's row of
//! `scratch.masks`, and the sampler gives every token outside it `-inf`
//! (`kernels/cuda/sampling.cu`). In a decode step the masks are computed
//! after the step's forward pass is queued, so the host work overlaps the
//! GPU's; only the ~19 KB upload per row sits between the LM head and the
//! sampler. The sampled token then advances the constraint; a token it
//! refuses means the sampler ignored the mask, a fatal engine fault (the
//! engine is retired, never reused).
//!
//! A grammar that cannot give a mask (an internal error of the constraint
//! engine) ends its sequence alone with that error: its token of this step
//! was sampled without a mask and is dropped, never reported.

use super::Seq;
use crate::engine::CudaEngine;
use crate::error::{GpuError, Result};
use krasis_model::EngineError;
use krasis_model::batch::{SeqEvent, SeqId};

impl CudaEngine {
    /// Computes `id`'s mask for its next token and queues it into its
    /// slot's row of `scratch.masks`; whether the sampler must apply it
    /// (false: no grammar, a lazy grammar outside its matches, or a mask
    /// error, kept for [`CudaEngine::accept_token`]).
    pub(super) fn upload_mask(&mut self, id: SeqId) -> Result<bool> {
        let vocab = self.model.geometry.vocab_size;
        let s: &mut Seq = self.seq_mut(id);
        let (slot, mask) = match s.constraint.as_mut().map(|c| c.mask()) {
            None | Some(Ok(None)) => return Ok(false),
            Some(Ok(Some(m))) => (s.slot, m),
            Some(Err(e)) => {
                s.mask_error = Some(EngineError::InvalidRequest(e.to_string()));
                return Ok(false);
            }
        };
        let w = vocab.div_ceil(32);
        // Only the tokenizer's words are written: the rows start zeroed and
        // nothing writes past them, so tokens of a padded embedding stay
        // refused without a padded copy per token.
        let words = &mask.words()[..mask.words().len().min(w)];
        let m = &mut self.model;
        m.gpu
            .stream
            .memcpy_htod(
                words,
                &mut m.scratch.masks.slice_mut(slot * w..slot * w + words.len()),
            )
            .map_err(GpuError::driver("writing a grammar mask"))?;
        Ok(true)
    }

    /// `token`, sampled for `id`, against its grammar: true to report it.
    /// False when the sequence ended instead (its mask failed; the token
    /// is dropped). A token the grammar refuses is a fatal fault.
    pub(super) fn accept_token(
        &mut self,
        id: SeqId,
        token: u32,
        events: &mut Vec<SeqEvent>,
    ) -> Result<bool> {
        let s = self.seq_mut(id);
        if let Some(e) = s.mask_error.take() {
            self.finish(id, Err(e), events)?;
            return Ok(false);
        }
        if let Some(c) = s.constraint.as_mut() {
            c.commit(token).map_err(|e| {
                GpuError::Engine(EngineError::Backend(format!(
                    "the sampler ignored the grammar's mask: {e}"
                )))
            })?;
        }
        Ok(true)
    }
}
