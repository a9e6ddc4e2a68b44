//! Prefill with HCS: layer groups outside, prompt chunks inside (white
//! paper §4.1), so each group's non-resident experts cross PCIe once per
//! prompt however many chunks it has.
//!
//! Every chunk's residual stream is kept between groups (`tokens * hidden`
//! f32: the per-request transient that calibration measures). Chunk c at
//! layer l sees the KV of chunks < c at layer l, written earlier in the same
//! group, so the math of each (chunk, layer) is exactly the all-resident
//! path's and the outputs are bit-identical.

use crate::error::{GpuError, Result};
use crate::forward::{Model, Positions};
use crate::scratch::Scratch;
use cudarc::driver::CudaSlice;

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

    pub(crate) fn prefill_streamed(
        &mut self,
        tokens: &[u32],
        mut after: impl FnMut(&mut Model, usize, usize) -> Result<()>,
    ) -> Result<()> {
        let hcs = self
            .hcs
            .as_mut()
            .ok_or_else(|| GpuError::Hcs("streamed prefill without HCS".into()))?;
        let table = self
            .experts
            .as_mut()
            .ok_or_else(|| GpuError::Hcs("streamed prefill without an expert table".into()))?;
        hcs.begin_prefill(&self.gpu, table)?;
        let r = self.stream_groups(tokens, &mut after);
        // The reclaimable tier comes back even when a chunk failed, so the
        // next request starts from the same state.
        let restored = match self.hcs.as_mut() {
            Some(h) => h.restore(&self.gpu),
            None => Ok(()),
        };
        r.and(restored)
    }

    fn stream_groups(
        &mut self,
        tokens: &[u32],
        after: &mut impl FnMut(&mut Model, usize, usize) -> Result<()>,
    ) -> Result<()> {
        let (cap, h) = (self.scratch.cap, self.geometry.hidden);
        let chunks: Vec<(usize, usize)> = (0..tokens.len())
            .step_by(cap)
            .map(|s| (s, (tokens.len() - s).min(cap)))
            .collect();
        let mut bufs = Vec::with_capacity(chunks.len());
        for &(_, len) in &chunks {
            bufs.push(
                self.gpu
                    .alloc::<f32>(len * h, "hidden states of the prompt")?,
            );
        }
        for (c, &(start, len)) in chunks.iter().enumerate() {
            let ids = &tokens[start..start + len];
            upload_ids(&self.gpu, &mut self.scratch, ids)?;
            with_chunk(self, &mut bufs[c], |m| {
                m.embed(len, Positions::Prefill(start))
            })?;
        }
        let groups = self.group_layers();
        let hcs_groups = groups.len();
        self.with_hcs(|h, gpu| h.stage_group(gpu, 0))?;
        for (gi, layers) in groups.iter().enumerate() {
            if gi + 1 < hcs_groups {
                self.with_hcs(|h, gpu| h.stage_group(gpu, gi + 1))?;
            }
            self.with_hcs(|h, gpu| h.wait_staged(gpu, gi))?;
            for (c, &(start, len)) in chunks.iter().enumerate() {
                with_chunk(self, &mut bufs[c], |m| {
                    for &l in layers {
                        m.layer(l, len, Positions::Prefill(start))?;
                    }
                    Ok(())
                })?;
            }
            self.with_hcs(|h, gpu| h.computed(gpu, gi))?;
        }
        for (c, &(start, len)) in chunks.iter().enumerate() {
            with_chunk(self, &mut bufs[c], |m| after(m, start, len))?;
        }
        // The chunk buffers are freed when this returns; the stream must be
        // done with them first (cudarc frees asynchronously on the stream).
        Ok(())
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

fn upload_ids(gpu: &crate::device::Gpu, sc: &mut Scratch, ids: &[u32]) -> Result<()> {
    gpu.stream
        .memcpy_htod(ids, &mut sc.ids.slice_mut(0..ids.len()))
        .map_err(GpuError::driver("copying prompt tokens to the GPU"))
}
