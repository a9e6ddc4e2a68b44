//! Layer-group streaming for prefill (white paper §4.1-4.3).
//!
//! The reclaimable tier's memory becomes two staging buffers of
//! `group_layers` whole MoE layers. Group g's non-resident experts are
//! copied into buffer g % 2 (runs of consecutive experts coalesce into one
//! copy, since an expert's offset in the buffer equals its offset in the
//! host layer region); the copy of group g + 1 overlaps group g's compute
//! over every chunk and waits only for group g - 1's compute to release its
//! buffer. Resident experts are read where they are. The pointer table for
//! every MoE layer is written once per prefill, so kernels see the same
//! bytes as the all-resident path and produce identical results.

use super::Hcs;
use crate::device::Gpu;
use crate::error::{GpuError, Result};
use crate::experts::ExpertTable;

impl Hcs {
    pub fn group_layers(&self) -> usize {
        self.shape.group_layers
    }

    /// MoE group of MoE layer `moe_index`.
    pub fn group_of(&self, moe_index: usize) -> usize {
        moe_index / self.shape.group_layers
    }

    pub fn num_groups(&self) -> usize {
        self.moe_layers.len().div_ceil(self.shape.group_layers)
    }

    /// Starts a prefill: lends the reclaimable tier (after the compute
    /// stream is done with it) and points every MoE layer's table entries
    /// at resident slots or at the staging slot their group will use.
    pub fn begin_prefill(&mut self, gpu: &Gpu, table: &mut ExpertTable) -> Result<()> {
        // This prefill's kernels write the grouped scratch, which the last
        // reload may still be filling.
        self.settle(gpu)?;
        self.copy_after_compute(gpu)?;
        self.res.lend_reclaimable();
        let (e, g) = (self.num_experts, self.shape.group_layers);
        let base = crate::device::addr(&self.staging, &gpu.stream);
        let mut ptrs = Vec::with_capacity(self.moe_layers.len() * e);
        for m in 0..self.moe_layers.len() {
            let buf = (m / g) % 2;
            let layer_base = base + ((buf * g + m % g) * e * self.stride) as u64;
            for x in 0..e {
                ptrs.push(match self.res.resident_slot(m, x) {
                    Some(slot) => self.slot_addr[slot],
                    None => layer_base + (x * self.stride) as u64,
                });
            }
        }
        table.write_all(gpu, &ptrs)
    }

    /// Copies group `group`'s non-resident experts into its staging buffer
    /// on the copy stream, after the group that used that buffer last has
    /// finished computing.
    pub fn stage_group(&mut self, gpu: &Gpu, group: usize) -> Result<()> {
        let b = group % 2;
        if group >= 2 {
            self.copy
                .wait(&self.ev_computed[b])
                .map_err(GpuError::driver("waiting for a staging buffer"))?;
        }
        let (e, g) = (self.num_experts, self.shape.group_layers);
        let base = crate::device::addr(&self.staging, &gpu.stream);
        let first = group * g;
        let last = (first + g).min(self.moe_layers.len());
        for m in first..last {
            let layer_base = base + ((b * g + m % g) * e * self.stride) as u64;
            let mut x = 0;
            while x < e {
                if self.res.resident_slot(m, x).is_some() {
                    x += 1;
                    continue;
                }
                let run = (x..e)
                    .take_while(|&y| self.res.resident_slot(m, y).is_none())
                    .count();
                let first_src = self.host_expert(m, x)?;
                // Experts of a layer are contiguous in the host backing.
                // SAFETY: `run` experts from `x` lie inside the layer's
                // region (checked through the last one).
                self.host_expert(m, x + run - 1)?;
                let src =
                    unsafe { std::slice::from_raw_parts(first_src.as_ptr(), run * self.stride) };
                // SAFETY: the destination run lies inside staging buffer b,
                // which no kernel reads until ev_staged[b] completes.
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(
                        layer_base + (x * self.stride) as u64,
                        src,
                        self.copy.cu_stream(),
                    )
                }
                .map_err(GpuError::driver("streaming experts for prefill"))?;
                self.copies.prefill_bytes += src.len() as u64;
                x += run;
            }
        }
        self.ev_staged[b]
            .record(&self.copy)
            .map_err(GpuError::driver("recording a staged group"))
    }

    /// The compute stream waits until group `group` is staged.
    pub fn wait_staged(&self, gpu: &Gpu, group: usize) -> Result<()> {
        gpu.stream
            .wait(&self.ev_staged[group % 2])
            .map_err(GpuError::driver("waiting for staged experts"))
    }

    /// Marks group `group`'s compute (every chunk) as issued.
    pub fn computed(&self, gpu: &Gpu, group: usize) -> Result<()> {
        self.ev_computed[group % 2]
            .record(&gpu.stream)
            .map_err(GpuError::driver("recording a computed group"))
    }
}
