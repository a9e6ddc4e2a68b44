//! Continuous batching's packed prefill under HCS: the prompts waiting
//! together stream through the layer groups in one pass
//! (`crate::streamed`), so the non-resident experts cross PCIe once for all
//! of them instead of once per prompt (`docs/notes/batching-cuda.md`).

use super::Phase;
use crate::engine::CudaEngine;
use crate::error::{GpuError, Result};
use crate::streamed::PassPrompt;
use krasis_model::batch::{SeqEvent, SeqId};
use krasis_model::{CancelToken, FinishReason, LiveProgress};

/// What the pass needs of one waiting sequence (copied out of the batch,
/// which the pass's engine calls borrow).
struct Member {
    id: SeqId,
    prompt: Vec<u32>,
    next: usize,
    kv: crate::forward::SeqKv,
    cancel: CancelToken,
    live: LiveProgress,
}

impl CudaEngine {
    /// Under HCS: the whole remaining prompts of `ids` (oldest first) in
    /// one streamed pass (`streamed.rs`), so the non-resident experts
    /// cross PCIe once for all of them. Each prompt's last hidden row is
    /// kept when its chunk is done; after the pass each sequence gets its
    /// LM head row from it, its first token and its prefix store, oldest
    /// first, as alone. When the hidden states do not fit together, the
    /// oldest prefills alone (the others wait for the next steps).
    pub(super) fn streamed_packed_work(
        &mut self,
        ids: &[SeqId],
        events: &mut Vec<SeqEvent>,
    ) -> Result<usize> {
        for &id in ids {
            self.begin_prefill(id)?;
        }
        let members: Vec<Member> = ids
            .iter()
            .map(|&id| {
                let s = self.seq(id);
                let Phase::Prefill { next, .. } = s.phase else {
                    unreachable!("prefilling")
                };
                Member {
                    id,
                    prompt: s.req.prompt.clone(),
                    next,
                    kv: s.kv(),
                    cancel: s.req.cancel.clone(),
                    live: s.req.live.clone(),
                }
            })
            .collect();
        let prompts: Vec<PassPrompt<'_>> = members
            .iter()
            .map(|m| PassPrompt {
                tokens: &m.prompt,
                from: m.next,
                kv: m.kv,
                cancel: &m.cancel,
                live: &m.live,
            })
            .collect();
        // Every member's prompt is longer than `gemv_tokens` and takes the
        // same MXFP4 way (`packable`): the pass takes the way each would
        // take alone.
        let in_place = members
            .iter()
            .all(|m| self.mxfp4_in_place_for(m.prompt.len()));
        let h = self.model.geometry.hidden;
        let md = &mut self.model;
        let mut last = md.gpu.alloc::<f32>(
            members.len() * h,
            "the last hidden rows of a packed streamed prefill",
        )?;
        md.grouped_prefill = true;
        md.mxfp4_in_place = in_place;
        let done = md.prefill_streamed_packed(&prompts, |m, chunk| {
            for &(p, seg) in &chunk.segs {
                if seg.start + seg.len == prompts[p].tokens.len() {
                    let row = seg.row + seg.len - 1;
                    m.gpu
                        .stream
                        .memcpy_dtod(
                            &m.scratch.residual.slice(row * h..(row + 1) * h),
                            &mut last.slice_mut(p * h..(p + 1) * h),
                        )
                        .map_err(GpuError::driver("keeping a prompt's last hidden row"))?;
                }
            }
            Ok(())
        })?;
        let tokens: usize = members.iter().map(|m| m.prompt.len() - m.next).sum();
        drop(prompts);
        match done {
            None => return self.prefill_step(ids[0], events),
            Some(false) => {
                for m in &members {
                    self.finish(m.id, Ok(FinishReason::Cancelled), events)?;
                }
                return Ok(0);
            }
            Some(true) => {}
        }
        for (p, mb) in members.iter().enumerate() {
            // No token once cancelled, and nothing stored.
            if mb.cancel.is_cancelled() {
                self.finish(mb.id, Ok(FinishReason::Cancelled), events)?;
                continue;
            }
            let md = &mut self.model;
            md.gpu
                .stream
                .memcpy_dtod(
                    &last.slice(p * h..(p + 1) * h),
                    &mut md.scratch.residual.slice_mut(0..h),
                )
                .map_err(GpuError::driver("restoring a prompt's last hidden row"))?;
            md.lm_head(0, 1)?;
            let token = self.prefilled(mb.id)?;
            self.first_token(mb.id, token, events)?;
        }
        Ok(tokens)
    }
}
