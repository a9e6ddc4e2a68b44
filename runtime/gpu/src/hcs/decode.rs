//! One decode step's routed experts of one MoE layer through HCS.
//!
//! Kernels read expert addresses through a table and ids; here the table is
//! the step's own addresses, one per (row, expert) pair (`sel_dev`), and the
//! ids are `0..rows * top_k`, so the launch shape never changes with where
//! experts live. The address list a kernel reads only ever names bytes that
//! are already on the GPU: for one row, hits first (misses masked out and
//! their entries null) while the misses copy, then, after the compute stream
//! has waited for the copy event, the complete list; for several rows, the
//! complete list after the copies (the kernels' slot mask is per expert
//! rank, not per row, so rows cannot mask their own misses; the overlap is
//! the one-row path's).

use super::{Hcs, Placement, ev};
use crate::device::addr;
use crate::error::{GpuError, Result};
use crate::forward::Ctx;
use crate::scratch::Scratch;
use cudarc::driver::result;

impl Hcs {
    /// The routed experts of MoE layer `moe_index` for the `rows` decode
    /// rows whose routes are in `scratch.topk_ids`/`topk_w`, added into
    /// their residual rows.
    pub(crate) fn decode_experts(
        &mut self,
        cx: &Ctx<'_>,
        sc: &mut Scratch,
        moe_index: usize,
        rows: usize,
    ) -> Result<()> {
        let k = self.top_k;
        let n = rows * k;
        if rows == 0 || n > self.pairs {
            return Err(GpuError::Hcs(format!(
                "a decode step of {rows} rows; the exchange buffers hold {} pairs of {k} experts",
                self.pairs
            )));
        }
        let s = &cx.gpu.stream;
        // SAFETY: ids_host holds `pairs >= n` pinned u32; the copy is
        // complete once ev_ids has been waited on, before the host reads it.
        unsafe {
            result::memcpy_dtoh_async(
                &mut self.ids_host.as_mut_slice()[..n],
                addr(&sc.topk_ids, s),
                s.cu_stream(),
            )
        }
        .map_err(GpuError::driver("reading selected experts"))?;
        self.ev_ids
            .record(s)
            .map_err(GpuError::driver("recording the router event"))?;
        self.ev_ids
            .synchronize()
            .map_err(GpuError::driver("waiting for the router"))?;
        if rows == 1 {
            self.decode_one(cx, sc, moe_index)
        } else {
            self.decode_rows(cx, sc, moe_index, rows)
        }
    }

    /// One row: the hits' gate/up GEMV runs while the misses copy.
    fn decode_one(&mut self, cx: &Ctx<'_>, sc: &mut Scratch, moe_index: usize) -> Result<()> {
        let s = &cx.gpu.stream;
        let ffn = cx.ffn()?;
        let k = self.top_k;
        let mut ids = [0u32; 16];
        ids[..k].copy_from_slice(&self.ids_host.as_slice()[..k]);
        let mut placements = std::mem::take(&mut self.placements);
        self.res
            .route(moe_index, &ids[..k], &mut placements)
            .map_err(GpuError::Hcs)?;
        let (mut hit_mask, mut miss_mask) = (0u32, 0u32);
        let mut misses = std::mem::take(&mut self.misses);
        misses.clear();
        let region = moe_index * 2 * self.pairs;
        {
            let sel = &mut self.sel_host.as_mut_slice()[region..region + 2 * k];
            for (j, p) in placements.iter().enumerate() {
                match *p {
                    Placement::Hit(slot) => {
                        hit_mask |= 1 << j;
                        sel[j] = self.slot_addr[slot];
                        sel[k + j] = self.slot_addr[slot];
                    }
                    Placement::Miss(slot) => {
                        miss_mask |= 1 << j;
                        sel[j] = 0;
                        sel[k + j] = self.slot_addr[slot];
                        misses.push((slot, moe_index, ids[j] as usize));
                    }
                }
            }
        }
        self.placements = placements;
        if !misses.is_empty() {
            self.copy_misses(cx, moe_index, &misses)?;
        }
        self.misses = misses;
        let base = addr(&self.sel_dev, s);
        let half = (k * 8) as u64;
        let sel = &self.sel_host.as_slice()[region..region + 2 * k];
        let up = |dst: u64, src: &[u64], what: &str| {
            // SAFETY: sel_host is pinned and this layer's entries are not
            // rewritten before the next token, by which time the copy ran.
            unsafe { result::memcpy_htod_async(dst, src, s.cu_stream()) }.map_err(GpuError::driver(
                format!("uploading {what} expert addresses"),
            ))
        };
        let iota = &self.iota;
        if hit_mask != 0 && miss_mask != 0 {
            up(base, &sel[..k], "resident")?;
            let table = self.sel_dev.slice(0..k);
            ffn.gate_up_act(cx, &sc.normed, &table, iota, 1, hit_mask, &mut sc.act)?;
        }
        if miss_mask != 0 {
            s.wait(&self.ev_copy)
                .map_err(GpuError::driver("waiting for expert copies"))?;
        }
        up(base + half, &sel[k..], "selected")?;
        let table = self.sel_dev.slice(k..2 * k);
        let mask = if hit_mask != 0 && miss_mask != 0 {
            miss_mask
        } else {
            u32::MAX
        };
        ffn.gate_up_act(cx, &sc.normed, &table, iota, 1, mask, &mut sc.act)?;
        ffn.down_combine(cx, &sc.act, &table, iota, &sc.topk_w, 1, &mut sc.residual)
    }

    /// Several rows (sequences) of one decode step: the distinct experts
    /// they selected are placed once (`Residency::route` over the union:
    /// each cold expert is copied once and serves every row that routed to
    /// it), then, after the copies, one gate/up and one down launch over
    /// every (row, expert) pair through a table of the pairs' addresses.
    /// The per-pair kernels compute each pair exactly as a one-row launch
    /// does (`kernels/tests/gpu/rows.rs`), wherever the expert sits.
    fn decode_rows(
        &mut self,
        cx: &Ctx<'_>,
        sc: &mut Scratch,
        moe_index: usize,
        rows: usize,
    ) -> Result<()> {
        let s = &cx.gpu.stream;
        let ffn = cx.ffn()?;
        let n = rows * self.top_k;
        let ids: Vec<u32> = self.ids_host.as_slice()[..n].to_vec();
        let distinct = distinct_experts(&ids);
        let mut placements = std::mem::take(&mut self.placements);
        self.res
            .route(moe_index, &distinct, &mut placements)
            .map_err(GpuError::Hcs)?;
        let mut misses = std::mem::take(&mut self.misses);
        misses.clear();
        let mut slot_of = std::collections::HashMap::with_capacity(distinct.len());
        for (&e, p) in distinct.iter().zip(&placements) {
            let slot = match *p {
                Placement::Hit(slot) => slot,
                Placement::Miss(slot) => {
                    misses.push((slot, moe_index, e as usize));
                    slot
                }
            };
            slot_of.insert(e, slot);
        }
        self.placements = placements;
        let region = moe_index * 2 * self.pairs;
        {
            let sel = &mut self.sel_host.as_mut_slice()[region..region + n];
            for (p, e) in ids.iter().enumerate() {
                sel[p] = self.slot_addr[slot_of[e]];
            }
        }
        if !misses.is_empty() {
            self.copy_misses(cx, moe_index, &misses)?;
            s.wait(&self.ev_copy)
                .map_err(GpuError::driver("waiting for expert copies"))?;
        }
        self.misses = misses;
        let sel = &self.sel_host.as_slice()[region..region + n];
        // SAFETY: sel_host is pinned and this layer's entries are not
        // rewritten before the next step, by which time the copy ran.
        unsafe { result::memcpy_htod_async(addr(&self.sel_dev, s), sel, s.cu_stream()) }
            .map_err(GpuError::driver("uploading selected expert addresses"))?;
        let table = self.sel_dev.slice(0..n);
        let iota = self.iota.slice(0..n);
        ffn.gate_up_act(cx, &sc.normed, &table, &iota, rows, u32::MAX, &mut sc.act)?;
        ffn.down_combine(
            cx,
            &sc.act,
            &table,
            &iota,
            &sc.topk_w,
            rows,
            &mut sc.residual,
        )
    }

    fn copy_misses(
        &mut self,
        cx: &Ctx<'_>,
        moe_index: usize,
        misses: &[(usize, usize, usize)],
    ) -> Result<()> {
        let (start, end) = match self.timing[moe_index].take() {
            Some((a, b)) => {
                self.copies.decode_copy_ms += a
                    .elapsed_ms(&b)
                    .map_err(GpuError::driver("reading expert copy timing"))?
                    as f64;
                (a, b)
            }
            None => (ev(cx.gpu, true)?, ev(cx.gpu, true)?),
        };
        start
            .record(&self.copy)
            .map_err(GpuError::driver("recording a copy start"))?;
        let bytes = self.copy_experts(misses)?;
        end.record(&self.copy)
            .map_err(GpuError::driver("recording a copy end"))?;
        self.ev_copy
            .record(&self.copy)
            .map_err(GpuError::driver("recording expert copies"))?;
        self.timing[moe_index] = Some((start, end));
        self.copies.decode_copies += misses.len() as u64;
        self.copies.decode_bytes += bytes;
        Ok(())
    }
}

/// The distinct experts of a step's selections, in first-selected order.
fn distinct_experts(ids: &[u32]) -> Vec<u32> {
    let mut seen = std::collections::HashSet::with_capacity(ids.len());
    ids.iter().copied().filter(|e| seen.insert(*e)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_steps_experts_are_placed_once_in_first_selected_order() {
        assert_eq!(distinct_experts(&[5, 2, 9, 2, 5, 7]), vec![5, 2, 9, 7]);
        assert_eq!(distinct_experts(&[]), Vec::<u32>::new());
        // Two rows routed to the same experts: one placement each.
        let mut r = crate::hcs::Residency::new(1, 16, &[], 0, 0, 4).unwrap();
        let mut out = Vec::new();
        let rows = [3u32, 4, 4, 3];
        r.route(0, &distinct_experts(&rows), &mut out).unwrap();
        assert_eq!(out.len(), 2);
        assert_eq!(r.counters.promotions, 2, "each cold expert copied once");
    }
}
