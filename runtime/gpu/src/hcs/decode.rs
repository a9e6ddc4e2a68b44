//! One decode token's routed experts of one MoE layer through HCS.
//!
//! Kernels read expert addresses through a table and ids; here the table is
//! the token's own `top_k` addresses (`sel_dev`) and the ids are `0..top_k`,
//! so the launch shape never changes with where experts live. The address
//! list a kernel reads only ever names bytes that are already on the GPU:
//! hits first (misses masked out and their entries null), then, after the
//! compute stream has waited for the copy event, the complete list.

use super::{Hcs, Placement, ev};
use crate::device::addr;
use crate::error::{GpuError, Result};
use crate::forward::Ctx;
use crate::scratch::Scratch;
use cudarc::driver::result;

impl Hcs {
    pub(crate) fn decode_experts(
        &mut self,
        cx: &Ctx<'_>,
        sc: &mut Scratch,
        moe_index: usize,
    ) -> Result<()> {
        let s = &cx.gpu.stream;
        let ffn = cx.ffn()?;
        let k = self.top_k;
        // SAFETY: ids_host holds k pinned u32; the copy is complete once
        // ev_ids has been waited on, before the host reads it.
        unsafe {
            result::memcpy_dtoh_async(
                &mut self.ids_host.as_mut_slice()[..k],
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
        let mut ids = [0u32; 16];
        ids[..k].copy_from_slice(&self.ids_host.as_slice()[..k]);
        let mut placements = std::mem::take(&mut self.placements);
        self.res
            .route(moe_index, &ids[..k], &mut placements)
            .map_err(GpuError::Hcs)?;
        let (mut hit_mask, mut miss_mask) = (0u32, 0u32);
        let mut misses = std::mem::take(&mut self.misses);
        misses.clear();
        {
            let sel = &mut self.sel_host.as_mut_slice()[moe_index * 2 * k..(moe_index + 1) * 2 * k];
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
        let sel = &self.sel_host.as_slice()[moe_index * 2 * k..(moe_index + 1) * 2 * k];
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
