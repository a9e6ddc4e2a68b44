//! Prefill with HCS: layer groups outside, prompt chunks inside (white
//! paper §4.1), so each group's non-resident experts cross PCIe once per
//! prompt however many chunks it has.
//!
//! Every chunk's residual stream is kept between groups (`tokens * hidden`
//! f32: the per-request transient that calibration measures). Chunk c at
//! layer l sees the KV of chunks < c at layer l, written earlier in the same
//! group, so the math of each (chunk, layer) is exactly the all-resident
//! path's and the outputs are bit-identical.
//!
//! If those hidden states do not fit (memory another process took since
//! calibration, or a prompt longer than calibrated), the prompt is split
//! into spans that each stream through all groups in turn: half the tokens
//! per span, then a quarter, ... down to one chunk, after which the request
//! fails with an out-of-memory error and the engine stays usable. A span
//! reads the KV the earlier spans wrote, so the output is still
//! bit-identical; each span crosses PCIe once more, the price of fitting.
//!
//! The request's cancel token is looked at before every chunk of every
//! group; once set, the prompt stops there (no `after` calls), and the
//! reclaimable tier is reloaded as after any prefill.
//!
//! No token is fully prefilled before the last group, so the live count of
//! prefilled tokens is the work done in token equivalents: after each
//! (group, chunk), the span's tokens × layers run so far / all layers. It
//! rises at every chunk of every group and reaches the prompt's length
//! exactly when its last group is done.
//!
//! Several prompts can share one pass ([`Model::prefill_streamed_packed`],
//! continuous batching under HCS): their remaining tokens, oldest first,
//! fill the chunks one after another, and a chunk holding more than one
//! prompt's tokens runs as a packed pass (`Positions::Packed`: the rows'
//! GEMMs, norms, routing and experts together, RoPE, KV and attention per
//! segment, as all resident). Each group's experts then cross PCIe once
//! for all of them instead of once per prompt: four 1,000-token prompts
//! at 6 GiB cost one ~0.1 s pass, not four. Every row is what the prompt's
//! own chunk computes (row-invariant kernels), so the result is still
//! bit-identical to all resident.

use crate::error::{GpuError, Result};
use crate::forward::{Model, PackedSegment, Positions, SeqKv};
use crate::scratch::Scratch;
use cudarc::driver::CudaSlice;
use krasis_model::{CancelToken, LiveProgress};

/// Swaps chunk `c`'s residual into the scratch for the duration of `f`.
fn with_chunk<T>(
    m: &mut Model,
    buf: &mut CudaSlice<f32>,
    f: impl FnOnce(&mut Model) -> Result<T>,
) -> Result<T> {
    std::mem::swap(&mut m.scratch.residual, buf);
    let r = f(m);
    std::mem::swap(&mut m.scratch.residual, buf);
    r
}

impl Model {
    /// Decoder layers of each MoE group, in order; dense layers join the
    /// group of the MoE layer before them (or the first group).
    fn group_layers(&self) -> Vec<Vec<usize>> {
        let Some(hcs) = self.hcs.as_ref() else {
            return vec![(0..self.geometry.num_layers).collect()];
        };
        let mut groups: Vec<Vec<usize>> = vec![Vec::new(); hcs.num_groups().max(1)];
        let mut current = 0;
        for l in 0..self.geometry.num_layers {
            if let crate::weights::MlpWeights::Moe { moe_index, .. } = &self.weights.layers[l].mlp {
                current = hcs.group_of(*moe_index);
            }
            groups[current].push(l);
        }
        groups
    }

    /// Streams `tokens[from..]` through the layer groups (positions
    /// `0..from` are in the KV; chunks and spans counted from `from`) into
    /// the sequence's KV (`kv`); `Ok(false)` when `cancel`
    /// stopped it. `live` counts progress (see the module comment);
    /// `after(m, start, len)` runs for each chunk once the last group is
    /// done, with its hidden states in `scratch.residual`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn prefill_streamed(
        &mut self,
        tokens: &[u32],
        from: usize,
        kv: crate::forward::SeqKv,
        cancel: &CancelToken,
        live: &LiveProgress,
        mut after: impl FnMut(&mut Model, usize, usize) -> Result<()>,
    ) -> Result<bool> {
        let (cap, h) = (self.scratch.cap, self.geometry.hidden);
        let mut span = self.prefill_span.unwrap_or(tokens.len() - from).max(1);
        let mut start = from;
        while start < tokens.len() {
            if cancel.is_cancelled() {
                return Ok(false);
            }
            let len = span.min(tokens.len() - start);
            let prompt = PassPrompt {
                tokens: &tokens[..start + len],
                from: start,
                kv,
                cancel,
                live,
            };
            let chunks = pass_chunks(&[(start, start + len, kv)], cap);
            // Only this allocation is retried: nothing has been computed,
            // staged or reported for the span yet.
            let mut bufs = match alloc_hidden(&self.gpu, &chunks, h) {
                Ok(b) => b,
                Err(e) if is_out_of_memory(&e) => match smaller_span(len, cap) {
                    Some(s) => {
                        tracing::warn!(
                            tokens = len,
                            retry_tokens = s,
                            error = %e,
                            "the prompt's hidden states do not fit; streaming it in smaller spans"
                        );
                        span = s;
                        continue;
                    }
                    None => {
                        let (free, total) = self.gpu.mem_info().unwrap_or((0, 0));
                        return Err(GpuError::OutOfMemory {
                            what: format!(
                                "the hidden states of one {len}-token prefill chunk (prompt of {} \
                                 tokens, already split down to single chunks): {e}; free VRAM \
                                 (another process, or a lower --vram-limit) or raise \
                                 --safety-margin-mib so calibration keeps room for it",
                                tokens.len()
                            ),
                            requested: len * h * 4,
                            free,
                            total,
                        });
                    }
                },
                Err(e) => return Err(e),
            };
            let mut each = |m: &mut Model, c: &PassChunk| {
                let s = c.segs[0].1;
                after(m, s.start, s.len)
            };
            if !self.prefill_pass(&[prompt], &chunks, &mut bufs, &mut each)? {
                return Ok(false);
            }
            start += len;
        }
        Ok(true)
    }

    /// Several prompts' remaining tokens in one streamed pass (oldest
    /// first; the module comment says why). `Ok(None)`: their hidden
    /// states do not fit together, nothing was computed, and the caller
    /// prefills them one at a time instead (each can then split into
    /// spans). `Ok(Some(false))`: every prompt was cancelled and the pass
    /// stopped; a prompt cancelled while others go on is computed to the
    /// end and left to the caller. `after(m, chunk)` runs for each chunk
    /// once the last group is done, with its hidden states in
    /// `scratch.residual`.
    pub(crate) fn prefill_streamed_packed(
        &mut self,
        prompts: &[PassPrompt<'_>],
        mut after: impl FnMut(&mut Model, &PassChunk) -> Result<()>,
    ) -> Result<Option<bool>> {
        let (cap, h) = (self.scratch.cap, self.geometry.hidden);
        let spans: Vec<(usize, usize, SeqKv)> = prompts
            .iter()
            .map(|p| (p.from, p.tokens.len(), p.kv))
            .collect();
        let chunks = pass_chunks(&spans, cap);
        let mut bufs = match alloc_hidden(&self.gpu, &chunks, h) {
            Ok(b) => b,
            Err(e) if is_out_of_memory(&e) => {
                tracing::warn!(
                    prompts = prompts.len(),
                    tokens = chunks.iter().map(PassChunk::rows).sum::<usize>(),
                    error = %e,
                    "the prompts' hidden states do not fit in one streamed pass; prefilling them one at a time"
                );
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        self.prefill_pass(prompts, &chunks, &mut bufs, &mut after)
            .map(Some)
    }

    /// The pass's chunks through every layer group, with the reclaimable
    /// tier lent as staging for the pass; `Ok(false)` when cancelled.
    fn prefill_pass(
        &mut self,
        prompts: &[PassPrompt<'_>],
        chunks: &[PassChunk],
        bufs: &mut [CudaSlice<f32>],
        after: &mut dyn FnMut(&mut Model, &PassChunk) -> Result<()>,
    ) -> Result<bool> {
        let (Some(hcs), Some(table)) = (self.hcs.as_mut(), self.experts.as_mut()) else {
            return Err(GpuError::Hcs("streamed prefill without HCS".into()));
        };
        hcs.begin_prefill(&self.gpu, table)?;
        let r = self.stream_groups(prompts, chunks, bufs, after);
        // The reclaimable tier comes back even when a chunk failed or the
        // request was cancelled, so the next request starts from the same
        // state.
        let restored = match (self.hcs.as_mut(), self.experts.as_mut()) {
            (Some(h), Some(table)) => h.restore(&self.gpu, &self.kernels, table),
            _ => Ok(()),
        };
        r.and_then(|done| restored.map(|_| done))
    }

    /// Chunk `c`'s positions: a chunk of one prompt is that prompt's
    /// prefill chunk; one of several is a packed pass, its segments put in
    /// `scratch.packed`.
    fn chunk_positions(&mut self, c: &PassChunk) -> Positions {
        if let [(_, s)] = c.segs.as_slice() {
            return Positions::Prefill {
                start: s.start,
                base: s.base,
                slot: s.slot,
            };
        }
        self.scratch.packed = c.segs.iter().map(|&(_, s)| s).collect();
        #[cfg(any(test, feature = "fault-injection"))]
        if self.fault == crate::forward::Fault::PackedBase {
            let segs = &mut self.scratch.packed;
            segs[1].base = segs[0].base;
        }
        Positions::Packed
    }

    /// `Ok(false)`: every prompt's `cancel` was set before some chunk of
    /// some group; the staged copies already queued finish on the copy
    /// stream before the caller's reload, which is ordered after them.
    fn stream_groups(
        &mut self,
        prompts: &[PassPrompt<'_>],
        chunks: &[PassChunk],
        bufs: &mut [CudaSlice<f32>],
        after: &mut dyn FnMut(&mut Model, &PassChunk) -> Result<()>,
    ) -> Result<bool> {
        for (c, chunk) in chunks.iter().enumerate() {
            let ids: Vec<u32> = chunk
                .segs
                .iter()
                .flat_map(|&(p, s)| prompts[p].tokens[s.start..s.start + s.len].iter().copied())
                .collect();
            upload_ids(&self.gpu, &mut self.scratch, &ids)?;
            let at = self.chunk_positions(chunk);
            with_chunk(self, &mut bufs[c], |m| m.embed(ids.len(), at))?;
        }
        let groups = self.group_layers();
        let hcs_groups = groups.len();
        let layers = groups.iter().map(Vec::len).sum::<usize>().max(1);
        // Layer-tokens run so far, per prompt.
        let mut layer_tokens = vec![0usize; prompts.len()];
        self.with_hcs(|h, gpu| h.stage_group(gpu, 0))?;
        for (gi, group) in groups.iter().enumerate() {
            if gi + 1 < hcs_groups {
                self.with_hcs(|h, gpu| h.stage_group(gpu, gi + 1))?;
            }
            self.with_hcs(|h, gpu| h.wait_staged(gpu, gi))?;
            for (c, chunk) in chunks.iter().enumerate() {
                if prompts.iter().all(|p| p.cancel.is_cancelled()) {
                    return Ok(false);
                }
                let at = self.chunk_positions(chunk);
                with_chunk(self, &mut bufs[c], |m| {
                    for &l in group {
                        m.layer(l, chunk.rows(), at)?;
                    }
                    Ok(())
                })?;
                for &(p, s) in &chunk.segs {
                    layer_tokens[p] += s.len * group.len();
                    let pr = &prompts[p];
                    pr.live.set_prefilled(pr.from + layer_tokens[p] / layers);
                }
            }
            self.with_hcs(|h, gpu| h.computed(gpu, gi))?;
        }
        for (c, chunk) in chunks.iter().enumerate() {
            with_chunk(self, &mut bufs[c], |m| after(m, chunk))?;
        }
        // The chunk buffers are freed when the caller drops them; cudarc
        // frees asynchronously on the stream, after this work.
        Ok(true)
    }

    fn with_hcs(
        &mut self,
        f: impl FnOnce(&mut crate::hcs::Hcs, &crate::device::Gpu) -> Result<()>,
    ) -> Result<()> {
        match self.hcs.as_mut() {
            Some(h) => f(h, &self.gpu),
            None => Ok(()),
        }
    }
}

/// One prompt of a streamed pass: its tokens up to where this pass ends
/// (positions `0..from` are already in its KV, `kv`), its cancel token and
/// its live progress.
pub(crate) struct PassPrompt<'a> {
    pub tokens: &'a [u32],
    pub from: usize,
    pub kv: SeqKv,
    pub cancel: &'a CancelToken,
    pub live: &'a LiveProgress,
}

/// A chunk of a streamed pass: at most the scratch's rows, the consecutive
/// tokens of one or more prompts (`(prompt index, segment)`, segments in
/// row order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PassChunk {
    pub segs: Vec<(usize, PackedSegment)>,
}

impl PassChunk {
    pub fn rows(&self) -> usize {
        self.segs.iter().map(|(_, s)| s.len).sum()
    }
}

/// The chunks of `cap` rows that cover each prompt's `(from, end, kv)`
/// tokens in order, every chunk full but the last.
fn pass_chunks(prompts: &[(usize, usize, SeqKv)], cap: usize) -> Vec<PassChunk> {
    let cap = cap.max(1);
    let mut chunks: Vec<PassChunk> = Vec::new();
    let mut rows = cap;
    for (p, &(from, end, kv)) in prompts.iter().enumerate() {
        let mut start = from;
        while start < end {
            if rows == cap {
                chunks.push(PassChunk { segs: Vec::new() });
                rows = 0;
            }
            let len = (end - start).min(cap - rows);
            let seg = PackedSegment {
                row: rows,
                len,
                start,
                base: kv.base,
                slot: kv.slot,
            };
            chunks.last_mut().expect("a chunk").segs.push((p, seg));
            rows += len;
            start += len;
        }
    }
    chunks
}

/// One f32 hidden-state buffer per chunk.
fn alloc_hidden(
    gpu: &crate::device::Gpu,
    chunks: &[PassChunk],
    hidden: usize,
) -> Result<Vec<CudaSlice<f32>>> {
    chunks
        .iter()
        .map(|c| gpu.alloc::<f32>(c.rows() * hidden, "hidden states of the prompt"))
        .collect()
}

/// Out of VRAM or over the engine's limit: worth retrying smaller.
fn is_out_of_memory(e: &GpuError) -> bool {
    matches!(e, GpuError::OutOfMemory { .. } | GpuError::OverLimit { .. })
}

/// The span to retry with after `len` tokens did not fit: half of it in
/// whole chunks of `cap`, or `None` once it is a single chunk.
fn smaller_span(len: usize, cap: usize) -> Option<usize> {
    let cap = cap.max(1);
    (len > cap).then(|| (len / 2).div_ceil(cap).max(1) * cap)
}

fn upload_ids(gpu: &crate::device::Gpu, sc: &mut Scratch, ids: &[u32]) -> Result<()> {
    gpu.stream
        .memcpy_htod(ids, &mut sc.ids.slice_mut(0..ids.len()))
        .map_err(GpuError::driver("copying prompt tokens to the GPU"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_halve_in_whole_chunks_down_to_one_chunk() {
        // 8,000 tokens with 1,024-token chunks: 4,096, 2,048, 1,024, stop.
        assert_eq!(smaller_span(8000, 1024), Some(4096));
        assert_eq!(smaller_span(4096, 1024), Some(2048));
        assert_eq!(smaller_span(2048, 1024), Some(1024));
        assert_eq!(smaller_span(1024, 1024), None);
        assert_eq!(smaller_span(700, 1024), None);
        // Never below one chunk, never zero.
        assert_eq!(smaller_span(1500, 1024), Some(1024));
        assert_eq!(smaller_span(3, 0), Some(1));
    }

    /// `(start, len)` of each chunk of a one-prompt pass.
    fn spans(chunks: &[PassChunk]) -> Vec<(usize, usize)> {
        chunks
            .iter()
            .map(|c| {
                assert_eq!(c.segs.len(), 1);
                let s = c.segs[0].1;
                assert_eq!((s.row, s.base, s.slot), (0, 9, 2));
                (s.start, s.len)
            })
            .collect()
    }

    /// A sequence at arena row 9 in slot 2.
    const KV: SeqKv = SeqKv { base: 9, slot: 2 };

    #[test]
    fn chunks_of_a_span_cover_it_exactly_with_absolute_positions() {
        assert_eq!(
            spans(&pass_chunks(&[(4096, 6596, KV)], 1024)),
            vec![(4096, 1024), (5120, 1024), (6144, 452)]
        );
        assert_eq!(spans(&pass_chunks(&[(0, 10, KV)], 1024)), vec![(0, 10)]);
        let c = spans(&pass_chunks(&[(100, 7877, KV)], 512));
        assert_eq!(c.first().unwrap().0, 100);
        assert_eq!(c.iter().map(|x| x.1).sum::<usize>(), 7777);
        assert!(c.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0));
    }

    #[test]
    fn packed_chunks_fill_every_row_in_prompt_order() {
        // Three prompts (one resuming at 256 after a cached prefix) in
        // chunks of 1,000 rows: full chunks but the last, a prompt split
        // across chunks at its own positions, each segment at its KV base
        // and slot (prompt p in slot 3 - p here).
        let kv = |base, slot| SeqKv { base, slot };
        let c = pass_chunks(
            &[
                (0, 700, kv(0, 3)),
                (256, 1256, kv(5000, 2)),
                (0, 900, kv(9000, 1)),
            ],
            1000,
        );
        let seg = |p: usize, row, len, start, base| {
            (
                p,
                PackedSegment {
                    row,
                    len,
                    start,
                    base,
                    slot: 3 - p,
                },
            )
        };
        assert_eq!(
            c,
            vec![
                PassChunk {
                    segs: vec![seg(0, 0, 700, 0, 0), seg(1, 700, 300, 256, 5000)]
                },
                PassChunk {
                    segs: vec![seg(1, 0, 700, 556, 5000), seg(2, 700, 300, 0, 9000)]
                },
                PassChunk {
                    segs: vec![seg(2, 0, 600, 300, 9000)]
                },
            ]
        );
        assert_eq!(
            c.iter().map(PassChunk::rows).collect::<Vec<_>>(),
            [1000, 1000, 600]
        );
        // A prompt with nothing left adds no segment.
        assert_eq!(pass_chunks(&[(5, 5, KV)], 8), Vec::<PassChunk>::new());
    }

    #[test]
    fn only_memory_errors_are_retried() {
        let over = GpuError::OverLimit {
            what: "x".into(),
            requested: 1,
            left: 0,
            limit: 1,
        };
        assert!(is_out_of_memory(&over));
        assert!(!is_out_of_memory(&GpuError::Hcs("x".into())));
    }
}
