//! A decode step of the running sequences (`batch.rs`'s step, part 3):
//! the rows' inputs, the forward pass and LM head (a captured CUDA graph
//! per row count), each row's sampler, and the tokens read back and fed
//! to their sequences. `ahead.rs` queues such a step before the host has
//! read the one in flight.

use super::{Phase, SeqEvent, SeqId};
use crate::engine::{CudaEngine, DecodeGraph, sampled_token};
use crate::error::{GpuError, Result};
use crate::forward::Positions;
use cudarc::driver::{CudaGraph, sys};
use krasis_kernels::SampleRow;
use krasis_model::batch::finish_after_token;

/// A decode step queued on the stream.
/// What the host writes for a decode step's rows ([`CudaEngine::row_inputs`]).
pub(super) struct RowInputs {
    pub ids: Vec<u32>,
    pub pos: Vec<u32>,
    pub base: Vec<u32>,
    pub ring_base: Vec<u32>,
}

pub(super) struct Queued {
    /// Whether it replayed a captured graph.
    pub graph: bool,
    /// The set its HCS tail counters are read back into (`None` without
    /// HCS); tallied once the host has read the step's tokens.
    pub counters: Option<usize>,
}

impl CudaEngine {
    /// The sampler over logits rows `first..first + rows.len()`, row
    /// `first + r` with `rows[r]`'s counts slot, settings, step and (when
    /// `masked`) its slot's grammar mask, into `scratch.ids[first + r]`:
    /// one launch pair for every row (`Kernels::sample_rows`).
    pub(super) fn launch_samples(&mut self, first: usize, rows: &[SampleRow]) -> Result<()> {
        #[cfg(any(test, feature = "fault-injection"))]
        let ignore_mask = self.model.fault == crate::forward::Fault::IgnoreMask;
        #[cfg(not(any(test, feature = "fault-injection")))]
        let ignore_mask = false;
        let rows: Vec<SampleRow> = rows
            .iter()
            .map(|r| SampleRow {
                masked: r.masked && !ignore_mask,
                ..*r
            })
            .collect();
        let m = &mut self.model;
        let (v, vocab, n) = (self.sampleable, m.geometry.vocab_size, rows.len());
        let sc = &mut m.scratch;
        let words = vocab.div_ceil(32);
        m.kernels.sample_rows::<f32>(
            &m.gpu.stream,
            &sc.logits.slice(first * vocab..(first + n) * vocab),
            vocab,
            v,
            &rows,
            &mut sc.counts,
            vocab,
            Some((&sc.masks as &dyn cudarc::driver::DevicePtr<u32>, words)),
            &mut sc
                .sample_ws
                .slice_mut(0..n * krasis_kernels::sample_workspace_len(v)),
            &mut sc.ids.slice_mut(first..first + n),
        )?;
        Ok(())
    }

    pub(super) fn record_logits(&mut self, id: SeqId, row: usize) -> Result<()> {
        if self.seq(id).record.is_none() {
            return Ok(());
        }
        let v = self.model.geometry.vocab_size;
        let mut host = vec![0f32; v];
        let m = &self.model;
        m.gpu
            .stream
            .memcpy_dtoh(&m.scratch.logits.slice(row * v..(row + 1) * v), &mut host)
            .map_err(GpuError::driver("reading logits"))?;
        if let Some(r) = self.seq_mut(id).record.as_mut() {
            r.push(host);
        }
        Ok(())
    }

    /// One decode step of the sequences `rows` (in this order), waited for
    /// and its tokens reported; returns whether it replayed a captured
    /// graph.
    pub(super) fn decode_step(
        &mut self,
        rows: &[SeqId],
        events: &mut Vec<SeqEvent>,
    ) -> Result<bool> {
        let m = rows.len();
        let q = self.queue_decode(rows, 0)?;
        let mut out = vec![0u32; m];
        {
            let md = &self.model;
            md.gpu
                .stream
                .memcpy_dtoh(&md.scratch.ids.slice(0..m), &mut out)
                .map_err(GpuError::driver("reading the sampled tokens"))?;
        }
        // The synchronous read above has passed the counters' copy.
        self.tally_counters(q.counters);
        self.take_tokens(rows, &out, events)?;
        Ok(q.graph)
    }

    /// Adds a step's HCS tail counters (the set its read-back went to) to
    /// the request's figures, once the stream has passed that read-back.
    pub(super) fn tally_counters(&mut self, set: Option<usize>) {
        if let (Some(h), Some(set)) = (self.model.hcs.as_mut(), set) {
            h.tally_step(set);
        }
    }

    /// The host's inputs of a decode step of `rows`: the token each row
    /// feeds back, its position plus `ahead` (1 for a step queued before
    /// the host has read the step in flight, `ahead.rs`), its KV base and
    /// its ring base (its slot's ring in the sliding layers; empty for a
    /// model without them), with the planted batching faults applied.
    pub(super) fn row_inputs(&self, rows: &[SeqId], ahead: usize) -> RowInputs {
        let m = rows.len();
        let ring = self.model.kv.ring;
        let mut r = RowInputs {
            ids: Vec::with_capacity(m),
            pos: Vec::with_capacity(m),
            base: Vec::with_capacity(m),
            ring_base: Vec::with_capacity(if ring > 0 { m } else { 0 }),
        };
        for &id in rows {
            let s = self.seq(id);
            let Phase::Decode { token, pos: p } = s.phase else {
                unreachable!("decoding")
            };
            r.ids.push(token);
            r.pos.push((p + ahead) as u32);
            r.base.push(s.base as u32);
            if ring > 0 {
                r.ring_base.push((s.slot * ring) as u32);
            }
        }
        #[cfg(any(test, feature = "fault-injection"))]
        if m >= 2 {
            match self.model.fault {
                crate::forward::Fault::SwapRowPositions => r.pos.swap(0, 1),
                crate::forward::Fault::ShiftRowKv => r.base[m - 1] += 1,
                crate::forward::Fault::SwapRowRings if ring > 0 => r.ring_base.swap(0, 1),
                _ => {}
            }
        }
        r
    }

    /// Queues a decode step of `rows`: its inputs written (all three from
    /// the host, or with `ahead` only the positions: the ids are the
    /// samples the step in flight writes to `scratch.ids` and the KV bases
    /// are unchanged), the forward pass, LM head and each row's sampler.
    pub(super) fn queue_decode(&mut self, rows: &[SeqId], ahead: usize) -> Result<Queued> {
        let m = rows.len();
        let RowInputs {
            ids,
            pos,
            base,
            ring_base,
        } = self.row_inputs(rows, ahead);
        if ahead == 0 {
            let md = &mut self.model;
            let s = &md.gpu.stream;
            let sc = &mut md.scratch;
            s.memcpy_htod(&ids, &mut sc.ids.slice_mut(0..m))
                .and_then(|_| s.memcpy_htod(&pos, &mut sc.pos.slice_mut(0..m)))
                .and_then(|_| s.memcpy_htod(&base, &mut sc.kv_base.slice_mut(0..m)))
                .and_then(|_| match ring_base.len() {
                    0 => Ok(()),
                    n => s.memcpy_htod(&ring_base, &mut sc.ring_base.slice_mut(0..n)),
                })
                .map_err(GpuError::driver("writing the decode rows"))?;
        } else {
            self.upload_positions_ahead(&pos)?;
        }
        let graph = self.decode_forward(m)?;
        // The grammars' masks are computed on the host while the GPU runs
        // the step's forward pass (it was only queued).
        let mut masked = Vec::with_capacity(m);
        for &id in rows {
            masked.push(self.upload_mask(id)?);
        }
        // The tail's counters come back with the sampled tokens.
        let counters = {
            let md = &mut self.model;
            match md.hcs.as_mut() {
                Some(h) => Some(h.read_counters(&md.gpu)?),
                None => None,
            }
        };
        let samples: Vec<SampleRow> = rows
            .iter()
            .zip(&masked)
            .map(|(&id, &masked)| {
                let s = self.seq(id);
                SampleRow {
                    params: s.params,
                    step: (s.stats.generated_tokens + ahead) as u64,
                    slot: s.slot,
                    masked,
                }
            })
            .collect();
        self.launch_samples(0, &samples)?;
        self.stats.decode_steps += 1;
        Ok(Queued { graph, counters })
    }

    /// The sampled ids `out` of a decode step of `rows`: each row's token
    /// reported and fed back, and the sequences it ends finished. A row
    /// whose sequence ended after the step was queued (a step queued
    /// ahead) is dropped.
    pub(super) fn take_tokens(
        &mut self,
        rows: &[SeqId],
        out: &[u32],
        events: &mut Vec<SeqEvent>,
    ) -> Result<()> {
        let context = self.context;
        for (r, (&id, &raw)) in rows.iter().zip(out).enumerate() {
            let live = self
                .batch
                .seqs
                .iter()
                .any(|s| s.id == id && matches!(s.phase, Phase::Decode { .. }));
            if !live {
                continue;
            }
            self.record_logits(id, r)?;
            let step = self.seq(id).stats.generated_tokens as u64;
            let token = sampled_token(raw, step)?;
            if !self.accept_token(id, token, events)? {
                continue;
            }
            let s = self.seq_mut(id);
            s.stats.generated_tokens += 1;
            if let Phase::Decode { token: t, pos } = &mut s.phase {
                *t = token;
                *pos += 1;
            }
            events.push(SeqEvent::Token { seq: id, token });
            let generated = s.stats.generated_tokens;
            if let Some(f) = finish_after_token(token, &s.req, generated, context) {
                self.finish(id, Ok(f), events)?;
            } else if self.seq_mut(id).publisher.due() {
                let s = self.seq(id);
                self.publish_live(&s.req.live);
            }
        }
        Ok(())
    }

    /// The forward pass and LM head of a decode step of `m` rows (ids,
    /// positions and KV bases written): the captured graph of `m` rows, or
    /// the launches (graphs off, or the first step of `m` rows). Under HCS
    /// the step is the same sequence plus the device-side tail lookups
    /// (`hcs/tail.rs`), so it is captured too.
    pub(super) fn decode_forward(&mut self, m: usize) -> Result<bool> {
        let eager = !self.cuda_graphs || !self.warmed[m - 1];
        if eager {
            self.model.forward_layers(m, Positions::Decode)?;
            self.model.lm_head_rows(m)?;
            self.warmed[m - 1] = true;
            return Ok(false);
        }
        if self.graphs[m - 1].is_none() {
            self.graphs[m - 1] = Some(DecodeGraph(self.capture_decode(m)?));
        }
        if let Some(g) = &self.graphs[m - 1] {
            g.0.launch()
                .map_err(GpuError::driver("replaying the decode graph"))?;
        }
        Ok(true)
    }

    pub(super) fn capture_decode(&mut self, rows: usize) -> Result<CudaGraph> {
        let m = &mut self.model;
        let stream = m.gpu.stream.clone();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(GpuError::driver("starting decode graph capture"))?;
        let body = m
            .forward_layers(rows, Positions::Decode)
            .and_then(|_| m.lm_head_rows(rows));
        let end = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        body?;
        let graph = end
            .map_err(GpuError::driver("instantiating the decode graph"))?
            .ok_or_else(|| GpuError::Unsupported("decode graph capture recorded nothing".into()))?;
        graph
            .upload()
            .map_err(GpuError::driver("uploading the decode graph"))?;
        Ok(graph)
    }
}
