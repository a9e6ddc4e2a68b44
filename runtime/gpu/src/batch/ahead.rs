//! Decode ahead: the next decode step is queued on the GPU before the host
//! reads the tokens of the step in flight, so the host's work on a step's
//! tokens (its sampled ids read back, stop checks, the server turning them
//! into text and sending it) runs while the next step computes instead of
//! between two steps.
//!
//! Why it is exact: step t + 1 needs from the host only what it already
//! knows before step t's tokens are read. Its input ids are the samples
//! step t writes to `scratch.ids` (each row's sampler writes its row, the
//! forward pass reads that row), its KV bases are unchanged, its positions
//! are step t's plus one, and each row's sampler step index is one more.
//! Everything runs on one stream, so step t's ids are copied out before
//! step t + 1's samplers overwrite them, and the kernels run exactly as a
//! step the host waited for: the same tokens and logits.
//!
//! What a step queued ahead may waste: a sequence that step t ends (its
//! end of sequence, a stop string, a cancel) still runs a row in step
//! t + 1, whose token is dropped (`take_tokens`). Its KV write must stay in
//! the rows the sequence reserved, so a step goes ahead only when every
//! row has a row left for it (a sequence's last possible step, at
//! `max_tokens` or the context, never does), and its sampler's penalty
//! counts are cleared before a later sequence uses the slot (at that
//! sequence's first prefill chunk, on the same stream).
//!
//! Under HCS too: the step's tail lookups and copies run on the device
//! from the device's own state (`hcs/tail.rs`), and its counters come back
//! into one of two pinned sets in turn (`Tail::read_counters`), tallied
//! when the step's tokens are read; a prefill, which lends the tail's
//! memory, only starts once the step in flight has been read (below).
//!
//! When a step is not queued ahead, the step waits for its tokens as
//! before: with a grammar (a row's next mask depends on its token), logits
//! recording, step timing, or while a prompt waits to be prefilled (its
//! prefill runs in the next step first).

use super::{Phase, SeqEvent, SeqId};
use crate::engine::CudaEngine;
use crate::error::{GpuError, Result};
use cudarc::driver::{CudaEvent, PinnedHostSlice, sys};

/// A decode step queued on the stream whose sampled ids the host has not
/// read yet.
pub(crate) struct Ahead {
    rows: Vec<SeqId>,
    /// The pinned set its ids are copied into.
    buf: usize,
    /// The set its HCS tail counters are read back into (`None` without
    /// HCS), tallied when its ids are read.
    counters: Option<usize>,
}

/// Page-locked host rows of the steps queued ahead: two sets, so the step
/// in flight and the one queued behind it each copy into their own. The
/// engine turns cudarc's event tracking off (`device.rs`), so the pinned
/// slices record nothing themselves: `copied[i]` is recorded after set
/// `i`'s copies and waited for before the host reads its ids or rewrites
/// its positions.
pub(crate) struct PinnedRows {
    ids: [PinnedHostSlice<u32>; 2],
    pos: [PinnedHostSlice<u32>; 2],
    copied: [CudaEvent; 2],
    next: usize,
}

impl Drop for PinnedRows {
    /// A step left in flight may still copy into these sets: wait for each
    /// set's last copies before the memory is freed (after this).
    fn drop(&mut self) {
        for e in &self.copied {
            if let Err(err) = e.synchronize() {
                tracing::warn!(error = %err, "waiting for a pinned decode rows copy");
            }
        }
    }
}

impl CudaEngine {
    /// When a step is in flight: queues the next decode step of `rows` if
    /// it may go ahead (`no_prefill`: nothing waits to be prefilled), then
    /// reads the step in flight and reports its tokens. True when the next
    /// step is now the one in flight (this engine step is done).
    pub(super) fn step_ahead(
        &mut self,
        rows: &[SeqId],
        no_prefill: bool,
        events: &mut Vec<SeqEvent>,
    ) -> Result<bool> {
        let Some(a) = self.batch.ahead.take() else {
            return Ok(false);
        };
        let next = if no_prefill && a.rows == rows && self.may_chain(rows) {
            self.stats.decode_steps_ahead += 1;
            Some(self.queue_ahead(rows, 1)?)
        } else {
            None
        };
        self.finish_ahead(&a, events)?;
        self.batch.ahead = next;
        Ok(self.batch.ahead.is_some())
    }

    /// Whether a decode step of `rows` may be left in flight for the next
    /// engine step to read (see the module docs for what may not).
    pub(super) fn may_leave_ahead(&self, rows: &[SeqId]) -> bool {
        !rows.is_empty()
            && self.batch.timing.is_none()
            && rows.iter().all(|&id| {
                let s = self.seq(id);
                s.constraint.is_none() && s.record.is_none()
            })
    }

    /// Whether the step after the one in flight of `rows` may be queued
    /// now: every row has a KV row left for it.
    fn may_chain(&self, rows: &[SeqId]) -> bool {
        self.may_leave_ahead(rows)
            && rows.iter().all(|&id| {
                let s = self.seq(id);
                matches!(s.phase, Phase::Decode { pos, .. } if has_room_ahead(pos, s.rows))
            })
    }

    /// Queues a decode step of `rows` (`ahead` 1: after the step in
    /// flight, from its samples) and the copy of its sampled ids into a
    /// pinned set; leaves it for the next engine step to read.
    pub(super) fn queue_ahead(&mut self, rows: &[SeqId], ahead: usize) -> Result<Ahead> {
        self.pinned_rows()?;
        let q = self.queue_decode(rows, ahead)?;
        let buf = self.pinned_next();
        let m = rows.len();
        let md = &self.model;
        let p = self.batch.pinned.as_mut().expect("allocated above");
        md.gpu
            .stream
            .memcpy_dtoh(&md.scratch.ids.slice(0..m), &mut p.ids[buf])
            .and_then(|_| p.copied[buf].record(&md.gpu.stream))
            .map_err(GpuError::driver("queueing the sampled tokens' copy"))?;
        p.next ^= 1;
        Ok(Ahead {
            rows: rows.to_vec(),
            buf,
            counters: q.counters,
        })
    }

    /// Positions of a step queued ahead, through the pinned set it will
    /// use (an asynchronous copy: a pageable one may wait for the stream).
    /// Only `queue_ahead` queues such a step, after allocating the sets.
    pub(super) fn upload_positions_ahead(&mut self, pos: &[u32]) -> Result<()> {
        let buf = self.pinned_next();
        let p = self
            .batch
            .pinned
            .as_mut()
            .expect("queue_ahead allocated the pinned sets");
        // The set's last copies (two steps back) are done before it is
        // rewritten.
        p.copied[buf]
            .synchronize()
            .map_err(GpuError::driver("waiting for a pinned positions set"))?;
        let host = p.pos[buf]
            .as_mut_slice()
            .map_err(GpuError::driver("writing a pinned positions set"))?;
        host[..pos.len()].copy_from_slice(pos);
        let md = &mut self.model;
        md.gpu
            .stream
            .memcpy_htod(&p.pos[buf], &mut md.scratch.pos)
            .map_err(GpuError::driver("writing the decode positions"))
    }

    /// Reads the sampled ids of the step in flight `a` (waiting for it) and
    /// reports its tokens; rows of sequences that ended since are dropped.
    fn finish_ahead(&mut self, a: &Ahead, events: &mut Vec<SeqEvent>) -> Result<()> {
        let out = {
            let p = self.batch.pinned.as_ref().expect("a step went ahead");
            let ids = p.copied[a.buf]
                .synchronize()
                .and_then(|_| p.ids[a.buf].as_slice())
                .map_err(GpuError::driver("reading the sampled tokens"))?;
            ids[..a.rows.len()].to_vec()
        };
        // The counters' read-back was queued before the ids' copy, which
        // the wait above has seen land.
        self.tally_counters(a.counters);
        self.take_tokens(&a.rows, &out, events)?;
        if self.batch.seqs.is_empty()
            && let Some(h) = self.model.hcs.as_mut()
        {
            // A step that went ahead of its sequences' ends is no request's
            // traffic: the next request's figures are its own.
            h.take_stats();
        }
        Ok(())
    }

    fn pinned_next(&self) -> usize {
        self.batch.pinned.as_ref().map_or(0, |p| p.next)
    }

    /// The pinned sets, allocated at the first step that goes ahead (one
    /// entry per row of `scratch.pos`).
    fn pinned_rows(&mut self) -> Result<()> {
        if self.batch.pinned.is_some() {
            return Ok(());
        }
        let n = self.model.scratch.pos.len();
        let ctx = &self.model.gpu.ctx;
        let alloc = || {
            // SAFETY: plain page-locked memory (flags 0: cached, read by the
            // host); its ids are read only after a copy wrote them and its
            // positions are written before they are copied.
            unsafe { ctx.alloc_pinned_with_flags::<u32>(n, 0) }
                .map_err(GpuError::driver("allocating pinned decode rows"))
        };
        let event = || {
            ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(GpuError::driver("creating a pinned rows event"))
        };
        self.batch.pinned = Some(PinnedRows {
            ids: [alloc()?, alloc()?],
            pos: [alloc()?, alloc()?],
            copied: [event()?, event()?],
            next: 0,
        });
        Ok(())
    }
}

/// Whether a sequence fed at `pos` next, with `rows` KV rows reserved, has
/// a row left for the step after (position `pos + 1`).
pub(crate) fn has_room_ahead(pos: usize, rows: usize) -> bool {
    pos + 1 < rows
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::rows_needed;

    /// A sequence's last possible decode step never goes ahead of the one
    /// before it: its next position would be past its reserved rows.
    #[test]
    fn the_last_possible_step_has_no_room_ahead() {
        // Prompt 10, max_tokens 4: rows 0..=12 (the 4th token is never fed).
        let rows = rows_needed(10, 4, 1000);
        assert_eq!(rows, 13);
        // Token 1 comes from prefill; tokens 2, 3, 4 from the steps feeding
        // positions 10, 11, 12. The step feeding 12 is the last.
        assert!(has_room_ahead(10, rows));
        assert!(has_room_ahead(11, rows));
        assert!(!has_room_ahead(12, rows));
        // At the context: rows 0..16, the step feeding 15 is the last.
        let rows = rows_needed(10, 100, 16);
        assert!(has_room_ahead(14, rows));
        assert!(!has_room_ahead(15, rows));
    }
}
