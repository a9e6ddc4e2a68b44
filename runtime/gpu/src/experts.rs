//! Routed experts on the device, addressed through a pointer table.
//!
//! Kernels never see where an expert lives: they read
//! `table[moe_layer * num_experts + expert]`, the device address of that
//! expert's block (INT4 or MXFP4, layout in `krasis_cache::layout`). In this engine
//! every expert is resident and the table is written once at load; an expert
//! cache that moves experts in and out on demand only has to rewrite entries
//! of this table (and keep the blocks they point to alive), never the
//! kernels or their launch shapes.

use crate::device::{Gpu, addr};
use crate::error::{GpuError, Result};
use cudarc::driver::{CudaSlice, CudaView};
use krasis_cache::{ExpertCache, ExpertLayout};
use krasis_common::events::{ByteProgress, EventSink, task};

/// Device bytes of the expert pointer table (one address per expert).
pub fn pointer_table_bytes(moe_layers: usize, num_experts: usize) -> usize {
    (moe_layers * num_experts).max(1) * std::mem::size_of::<u64>()
}

pub struct ExpertTable {
    pub layout: ExpertLayout,
    pub num_experts: usize,
    /// Decoder-layer index of each MoE layer, in table order.
    pub moe_layers: Vec<usize>,
    /// `[num_moe_layers * num_experts]` device addresses.
    ptrs: CudaSlice<u64>,
    /// The same addresses on the host (for checks and reports).
    host_ptrs: Vec<u64>,
    /// Backing storage of resident experts: one allocation per MoE layer.
    _resident: Vec<CudaSlice<u8>>,
    pub resident_bytes: usize,
}

impl ExpertTable {
    /// Uploads every expert of every MoE layer of `cache`, sending the
    /// bytes uploaded to `progress` ([`task::UPLOAD_EXPERTS`]).
    pub fn upload_all(
        gpu: &Gpu,
        cache: &ExpertCache,
        progress: Option<EventSink<'_>>,
    ) -> Result<Self> {
        let layout = cache.layout();
        let num_experts = cache.num_experts();
        let moe_layers: Vec<usize> = cache.moe_layers().to_vec();
        let need = num_experts * layout.expert_stride;
        let progress = progress.map(|s| {
            ByteProgress::start(s, task::UPLOAD_EXPERTS, (moe_layers.len() * need) as u64)
        });
        let mut resident = Vec::with_capacity(moe_layers.len());
        let mut host_ptrs = Vec::with_capacity(moe_layers.len() * num_experts);
        let mut resident_bytes = 0;
        for &layer in &moe_layers {
            let bytes = cache.layer_bytes(layer);
            if bytes.len() < need {
                return Err(GpuError::Cache(format!(
                    "layer {layer} region of {} holds {} bytes but {num_experts} experts of stride {} need {need}",
                    cache.path().display(),
                    bytes.len(),
                    layout.expert_stride
                )));
            }
            let dev = gpu.upload(&bytes[..need], &format!("experts of layer {layer}"))?;
            let base = addr(&dev, &gpu.stream);
            host_ptrs.extend((0..num_experts).map(|e| base + (e * layout.expert_stride) as u64));
            resident_bytes += need;
            resident.push(dev);
            if let Some(p) = &progress {
                p.add(need as u64);
            }
        }
        if let Some(p) = progress {
            p.finish();
        }
        let ptrs = gpu.upload(&host_ptrs, "expert pointer table")?;
        Ok(ExpertTable {
            layout,
            num_experts,
            moe_layers,
            ptrs,
            host_ptrs,
            _resident: resident,
            resident_bytes,
        })
    }

    /// A table with no resident backing: HCS and streamed prefill write its
    /// entries ([`ExpertTable::write_all`]) to point at their own slots.
    pub fn unbacked(gpu: &Gpu, cache: &ExpertCache) -> Result<Self> {
        let num_experts = cache.num_experts();
        let moe_layers: Vec<usize> = cache.moe_layers().to_vec();
        let host_ptrs = vec![0u64; moe_layers.len() * num_experts];
        let ptrs = gpu.upload(&host_ptrs, "expert pointer table")?;
        Ok(ExpertTable {
            layout: cache.layout(),
            num_experts,
            moe_layers,
            ptrs,
            host_ptrs,
            _resident: Vec::new(),
            resident_bytes: 0,
        })
    }

    /// Replaces every entry, ordered on the compute stream (kernels queued
    /// after this call see the new addresses).
    pub fn write_all(&mut self, gpu: &Gpu, ptrs: &[u64]) -> Result<()> {
        if ptrs.len() != self.host_ptrs.len() {
            return Err(GpuError::Cache(format!(
                "pointer table update of {} entries for a table of {}",
                ptrs.len(),
                self.host_ptrs.len()
            )));
        }
        self.host_ptrs.copy_from_slice(ptrs);
        gpu.stream
            .memcpy_htod(ptrs, &mut self.ptrs)
            .map_err(crate::error::GpuError::driver(
                "writing the expert pointer table",
            ))
    }

    /// Device address of the whole table (`[num_moe_layers * num_experts]`
    /// u64): the HCS decode tail rewrites entries on the device
    /// (`hcs/tail.rs`), so under HCS [`ExpertTable::host_ptrs`] is the
    /// placement last written from the host, not the live one.
    pub fn base(&self, gpu: &Gpu) -> u64 {
        crate::device::addr(&self.ptrs, &gpu.stream)
    }

    /// The `num_experts` device addresses of MoE layer `moe_index`.
    pub fn layer(&self, moe_index: usize) -> CudaView<'_, u64> {
        let n = self.num_experts;
        self.ptrs.slice(moe_index * n..(moe_index + 1) * n)
    }

    pub fn host_ptrs(&self) -> &[u64] {
        &self.host_ptrs
    }
}
