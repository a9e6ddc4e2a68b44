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

use crate::error::{GpuError, Result};
use crate::forward::{Model, Positions};
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
    /// the sequence's KV rows from `base` on; `Ok(false)` when `cancel`
    /// stopped it. `live` counts progress (see the module comment).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn prefill_streamed(
        &mut self,
        tokens: &[u32],
        from: usize,
        base: usize,
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
            let chunks = span_chunks(start, len, cap);
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
            let watch = (cancel, live);
            if !self.prefill_span(tokens, &chunks, base, &mut bufs, watch, &mut after)? {
                return Ok(false);
            }
            start += len;
        }
        Ok(true)
    }

    /// The span's chunks through every layer group, with the reclaimable
    /// tier lent as staging for the span; `Ok(false)` when cancelled.
    fn prefill_span(
        &mut self,
        tokens: &[u32],
        chunks: &[(usize, usize)],
        base: usize,
        bufs: &mut [CudaSlice<f32>],
        watch: (&CancelToken, &LiveProgress),
        after: &mut impl FnMut(&mut Model, usize, usize) -> Result<()>,
    ) -> Result<bool> {
        let (Some(hcs), Some(table)) = (self.hcs.as_mut(), self.experts.as_mut()) else {
            return Err(GpuError::Hcs("streamed prefill without HCS".into()));
        };
        hcs.begin_prefill(&self.gpu, table)?;
        let r = self.stream_groups(tokens, chunks, base, bufs, watch, after);
        // The reclaimable tier comes back even when a chunk failed or the
        // request was cancelled, so the next request starts from the same
        // state.
        let restored = match (self.hcs.as_mut(), self.experts.as_mut()) {
            (Some(h), Some(table)) => h.restore(&self.gpu, &self.kernels, table),
            _ => Ok(()),
        };
        r.and_then(|done| restored.map(|_| done))
    }

    /// `Ok(false)`: `cancel` was set before some chunk of some group; the
    /// staged copies already queued finish on the copy stream before the
    /// caller's reload, which is ordered after them.
    fn stream_groups(
        &mut self,
        tokens: &[u32],
        chunks: &[(usize, usize)],
        base: usize,
        bufs: &mut [CudaSlice<f32>],
        (cancel, live): (&CancelToken, &LiveProgress),
        after: &mut impl FnMut(&mut Model, usize, usize) -> Result<()>,
    ) -> Result<bool> {
        for (c, &(start, len)) in chunks.iter().enumerate() {
            let ids = &tokens[start..start + len];
            upload_ids(&self.gpu, &mut self.scratch, ids)?;
            with_chunk(self, &mut bufs[c], |m| {
                m.embed(len, Positions::Prefill { start, base })
            })?;
        }
        let groups = self.group_layers();
        let hcs_groups = groups.len();
        let span_start = chunks.first().map_or(0, |c| c.0);
        let layers = groups.iter().map(Vec::len).sum::<usize>().max(1);
        let mut layer_tokens = 0;
        self.with_hcs(|h, gpu| h.stage_group(gpu, 0))?;
        for (gi, group) in groups.iter().enumerate() {
            if gi + 1 < hcs_groups {
                self.with_hcs(|h, gpu| h.stage_group(gpu, gi + 1))?;
            }
            self.with_hcs(|h, gpu| h.wait_staged(gpu, gi))?;
            for (c, &(start, len)) in chunks.iter().enumerate() {
                if cancel.is_cancelled() {
                    return Ok(false);
                }
                with_chunk(self, &mut bufs[c], |m| {
                    for &l in group {
                        m.layer(l, len, Positions::Prefill { start, base })?;
                    }
                    Ok(())
                })?;
                layer_tokens += len * group.len();
                live.set_prefilled(span_start + layer_tokens / layers);
            }
            self.with_hcs(|h, gpu| h.computed(gpu, gi))?;
        }
        for (c, &(start, len)) in chunks.iter().enumerate() {
            with_chunk(self, &mut bufs[c], |m| after(m, start, len))?;
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

/// One f32 hidden-state buffer per chunk.
fn alloc_hidden(
    gpu: &crate::device::Gpu,
    chunks: &[(usize, usize)],
    hidden: usize,
) -> Result<Vec<CudaSlice<f32>>> {
    chunks
        .iter()
        .map(|&(_, n)| gpu.alloc::<f32>(n * hidden, "hidden states of the prompt"))
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

/// `(start, len)` of the prefill chunks covering `start..start + len`.
fn span_chunks(start: usize, len: usize, cap: usize) -> Vec<(usize, usize)> {
    let cap = cap.max(1);
    (start..start + len)
        .step_by(cap)
        .map(|s| (s, (start + len - s).min(cap)))
        .collect()
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

    #[test]
    fn chunks_of_a_span_cover_it_exactly_with_absolute_positions() {
        assert_eq!(
            span_chunks(4096, 2500, 1024),
            vec![(4096, 1024), (5120, 1024), (6144, 452)]
        );
        assert_eq!(span_chunks(0, 10, 1024), vec![(0, 10)]);
        let c = span_chunks(100, 7777, 512);
        assert_eq!(c.first().unwrap().0, 100);
        assert_eq!(c.iter().map(|x| x.1).sum::<usize>(), 7777);
        assert!(c.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0));
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
