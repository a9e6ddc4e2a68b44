//! The CUDA engine's prefix cache: the shared index
//! ([`krasis_model::prefix_cache`]) over two pools of KV blocks, a VRAM
//! pool (the first tier) and page-locked host memory (the RAM tier its
//! least recently used blocks are demoted to).
//!
//! A block is `--prefix-block` prompt positions of every layer's K and V,
//! laid out `[layer][K, V][kv_head][position][head_dim]` in 16-bit (the KV
//! cache's format, copied as bits). A sequence's KV stays contiguous (its
//! rows `[base, base + len)` of every layer's `[kv_head][rows][head_dim]`
//! arena, `arena.rs`); one `kv_blocks_copy`
//! launch per tier moves all of a hit's blocks into it (the host tier is
//! mapped into the device, so the kernel reads it over PCIe: no DMA call
//! per block and layer), and one per tier stores a prefill's new blocks.
//! A demotion is one device-to-host DMA copy of a whole slot. Everything
//! runs on the compute stream, so every read of a slot is ordered after the
//! copy that wrote it, and a slot is overwritten only after the copies that
//! read it.
//!
//! Sliding-window layers (gpt-oss) keep each sequence's keys in a ring
//! (`scratch::KvCache`), so a block holds their KV only when the prompt
//! that stored it still had it in its ring; their copies are separate
//! launches over the rings, and a prompt resumes only where the window
//! before the hit's end is held (`prefix_window.rs`: the rules).
//!
//! Exactness: the prefill is chunk-boundary invariant (`blas.rs`,
//! `attention_prefill.cu`, `moe::routed_experts`; the ring attention's rows
//! too), so a prompt resumed at any block boundary after its restored
//! blocks computes every row as a cold prefill of the whole prompt does,
//! over bit-identical KV (a sliding layer reads only the restored window),
//! and its logits are bit-identical. Decode's KV is never stored (decode
//! kernels differ from prefill's). gpt-oss's MXFP4 experts take one way for
//! every prompt while the cache is on (`CudaEngine::mxfp4_in_place_for`).
//!
//! Sizes ([`pool_bytes`], [`host_bytes`]): the VRAM pool is allocated at
//! load after calibration and before the expert placement; `auto` gives it
//! VRAM only when every expert is resident anyway (measured on the H200,
//! `benchmarks/results/2026-12-02-issue15-prefix-cache-vram.md`: at 6 GiB
//! the pool got 2-5 blocks and cut a later turn's TTFT by 8-16% while
//! those bytes are expert slots; there the host tier carries the cache).

use crate::device::Gpu;
use crate::error::{GpuError, Result};
use crate::forward::ptr;
use crate::prefix_window::WindowKeep;
use crate::scratch::KvCache;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, result, sys};
use krasis_common::options::PrefixCacheChoice;
use krasis_kernels::{BlockCopy, KvBlockGeom};
use krasis_model::Geometry;
use krasis_model::arch::AttentionKind;
use krasis_model::prefix_cache::{Demotion, Hit, Place, PrefixCache, Tier};
use std::sync::Arc;

mod file;

/// Bytes of one block of `block_tokens` positions of every layer's K and V.
pub fn block_bytes(g: &Geometry, block_tokens: usize) -> u64 {
    (g.num_layers * 2 * g.num_kv_heads * block_tokens * g.head_dim * 2) as u64
}

/// Why this model cannot have the cache on this engine, if it cannot: a
/// layer kind whose KV the blocks do not hold. Every attention kind is
/// handled (the match is exhaustive, so a new kind must be decided here):
/// full layers' linear rows, and sliding layers' rings (`RingPart`).
pub fn unsupported(g: &Geometry) -> Option<String> {
    g.layers.iter().find_map(|l| match l.attention {
        AttentionKind::Full | AttentionKind::Sliding { .. } => None::<String>,
    })
}

/// Whole blocks of `bytes`; an explicit size of less than a block is
/// refused, naming the block.
fn whole_blocks(what: &str, b: u64, block: u64, block_tokens: usize) -> Result<u64> {
    if b < block {
        return Err(GpuError::Unsupported(format!(
            "a prefix cache {what} of {b} bytes holds no block: one block ({block_tokens} tokens, \
             --prefix-block) of this model's KV is {block} bytes"
        )));
    }
    Ok(b / block * block)
}

/// The VRAM pool for `choice`. `Auto`: the smaller of one context's KV
/// (`kv_bytes`) and half of `spare`, the VRAM left above calibration's
/// floor once every expert is resident (`None`: not every expert fits, so
/// no pool: those bytes are worth more as expert slots and the host tier
/// carries the cache), in whole blocks. `Bytes(b)`: its whole blocks
/// (`0`: none). `Off`: none (the cache is off). An explicit size on a model
/// the cache does not handle is refused.
pub fn pool_bytes(
    choice: PrefixCacheChoice,
    g: &Geometry,
    block_tokens: usize,
    kv_bytes: u64,
    spare: Option<u64>,
) -> Result<u64> {
    let block = block_bytes(g, block_tokens).max(1);
    match choice {
        PrefixCacheChoice::Off | PrefixCacheChoice::Bytes(0) => Ok(0),
        PrefixCacheChoice::Auto => Ok(match (unsupported(g), spare) {
            (None, Some(spare)) => kv_bytes.min(spare / 2) / block * block,
            _ => 0,
        }),
        PrefixCacheChoice::Bytes(b) => {
            if let Some(why) = unsupported(g) {
                return Err(GpuError::Unsupported(why));
            }
            whole_blocks("VRAM pool", b, block, block_tokens)
        }
    }
}

/// The host tier for `choice`. `Auto`: the smaller of four contexts' KV
/// and a quarter of the host's available memory (`available`), in whole
/// blocks. `Bytes(b)`: its whole blocks. `Off`, `0`: none.
pub fn host_bytes(
    choice: PrefixCacheChoice,
    g: &Geometry,
    block_tokens: usize,
    kv_bytes: u64,
    available: u64,
) -> Result<u64> {
    let block = block_bytes(g, block_tokens).max(1);
    match choice {
        PrefixCacheChoice::Off | PrefixCacheChoice::Bytes(0) => Ok(0),
        PrefixCacheChoice::Auto => Ok(match unsupported(g) {
            None => (4 * kv_bytes).min(available / 4) / block * block,
            Some(_) => 0,
        }),
        PrefixCacheChoice::Bytes(b) => {
            if let Some(why) = unsupported(g) {
                return Err(GpuError::Unsupported(why));
            }
            whole_blocks("host tier", b, block, block_tokens)
        }
    }
}

/// The host's available memory now (what `auto` sizes the host tier by).
pub fn host_available() -> u64 {
    use sysinfo::{MemoryRefreshKind, RefreshKind, System};
    System::new_with_specifics(
        RefreshKind::nothing().with_memory(MemoryRefreshKind::nothing().with_ram()),
    )
    .available_memory()
}

/// Page-locked host memory mapped into the device: the host tier's slots.
struct HostPool {
    host: *mut u8,
    dev: sys::CUdeviceptr,
    stream: Arc<CudaStream>,
}

// SAFETY: only the device reads and writes the allocation (through the
// compute stream); the host pointer is kept to free it.
unsafe impl Send for HostPool {}

impl HostPool {
    fn new(stream: &Arc<CudaStream>, bytes: usize) -> Result<Self> {
        stream
            .context()
            .bind_to_thread()
            .map_err(GpuError::driver("binding the CUDA context"))?;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: a fresh allocation, written by the device before any read.
        let host = unsafe { result::malloc_host(bytes, flags) }.map_err(GpuError::driver(
            format!("allocating {bytes} bytes of page-locked host memory for the prefix cache"),
        ))? as *mut u8;
        // Owned from here, so an error below frees it.
        let mut pool = HostPool {
            host,
            dev: 0,
            stream: stream.clone(),
        };
        // SAFETY: allocated with DEVICEMAP in this context.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut pool.dev, host as *mut _, 0) }
            .result()
            .map_err(GpuError::driver(
                "mapping the prefix cache's host tier into the device",
            ))?;
        Ok(pool)
    }
}

impl Drop for HostPool {
    fn drop(&mut self) {
        let _ = self.stream.context().bind_to_thread();
        // Copies reading or writing the pool must be done before it goes.
        let _ = self.stream.synchronize();
        // SAFETY: allocated by malloc_host in new().
        let _ = unsafe { result::free_host(self.host as *mut std::ffi::c_void) };
    }
}

pub(crate) struct TieredPrefix {
    pub index: PrefixCache,
    /// The full layers' blocks (linear arena rows).
    geom: KvBlockGeom,
    /// Whether the model has full layers (else only `ring` launches run).
    full: bool,
    vram: Option<CudaSlice<u16>>,
    host: Option<HostPool>,
    /// Device addresses of every full layer's K and V cache (0 for a
    /// sliding layer: `ring`'s).
    layer_k: CudaSlice<u64>,
    layer_v: CudaSlice<u64>,
    /// The sliding layers' side, for a model that has them.
    ring: Option<RingPart>,
    /// (slot, block) pairs of one launch; room for the launches of one
    /// restore or store (a whole context per tier, and the rings' blocks).
    pairs: CudaSlice<u32>,
    /// Timing events around the last restore per tier and the last store
    /// (read once the stream has passed them).
    restore_ev: [Option<(CudaEvent, CudaEvent)>; 2],
    store_ev: Option<(CudaEvent, CudaEvent)>,
    /// The file the cache is saved to and loaded from, with what the KV is
    /// computed by (`file.rs`).
    file: Option<(
        std::path::PathBuf,
        krasis_model::prefix_cache::persist::KvIdentity,
    )>,
    /// Planted fault (tests): a hit's ring blocks are not restored.
    #[cfg(any(test, feature = "fault-injection"))]
    pub skip_ring_restore: bool,
}

/// The sliding layers' side of the cache (gpt-oss): a block's positions of
/// a sliding layer live in the sequence's ring (`scratch::KvCache`, whole
/// blocks: block `b` at ring block `b % (ring / B)`), so only some blocks
/// keep their sliding KV, and a prompt resumes only where the window
/// before the hit's end is kept (`prefix_window.rs`: the rules).
struct RingPart {
    /// Blocks in the sliding layers' buffers (`ring` rows per sequence).
    geom: KvBlockGeom,
    /// Device addresses of every sliding layer's K and V (0: full layer).
    layer_k: CudaSlice<u64>,
    layer_v: CudaSlice<u64>,
    /// Which slots' blocks keep their sliding KV.
    keep: WindowKeep,
}

/// `(slot, block)` of the `(tier, slot, block)` entries in `tier`.
fn in_tier(list: &[(Tier, usize, usize)], tier: Tier) -> Vec<(usize, usize)> {
    list.iter()
        .filter(|e| e.0 == tier)
        .map(|e| (e.1, e.2))
        .collect()
}

/// Which layers a block copy moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    /// The full layers, linear rows from the sequence's arena base.
    Full,
    /// The sliding layers, the sequence's ring.
    Ring,
}

/// The two tiers' sizes and the block, as decided at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizes {
    pub vram_bytes: u64,
    pub host_bytes: u64,
    pub block_tokens: usize,
}

impl TieredPrefix {
    /// Pools of `sizes` over the blocks of `kv`: its full layers of one
    /// capacity (the arena), its sliding layers (if any) rings of whole
    /// blocks.
    pub fn new(gpu: &Gpu, g: &Geometry, kv: &KvCache, sizes: Sizes) -> Result<Self> {
        let bt = sizes.block_tokens;
        let sliding: Vec<bool> = g
            .layers
            .iter()
            .map(|l| matches!(l.attention, AttentionKind::Sliding { .. }))
            .collect();
        let capacity_of = |want_sliding: bool| -> Result<Option<usize>> {
            let mut caps = kv
                .geoms
                .iter()
                .zip(&sliding)
                .filter(|&(_, &s)| s == want_sliding)
                .map(|(k, _)| k.capacity);
            let first = caps.next();
            if caps.any(|c| Some(c) != first) {
                return Err(GpuError::Unsupported(
                    "a prefix cache over layers of one kind with different KV capacities".into(),
                ));
            }
            Ok(first)
        };
        let full_capacity = capacity_of(false)?;
        let geom = KvBlockGeom {
            layers: g.num_layers,
            heads: g.num_kv_heads,
            head_dim: g.head_dim,
            block_tokens: bt,
            capacity: full_capacity.unwrap_or(0),
            ring: 0,
        };
        let block = block_bytes(g, bt);
        let (vs, hs) = (
            (sizes.vram_bytes / block) as usize,
            (sizes.host_bytes / block) as usize,
        );
        let vram = (vs > 0)
            .then(|| gpu.alloc::<u16>(vs * geom.slot_elems(), "prefix cache VRAM pool"))
            .transpose()?;
        let host = (hs > 0)
            .then(|| HostPool::new(&gpu.stream, hs * block as usize))
            .transpose()?;
        // Addresses of the layers of one kind, 0 for the others.
        let table = |bufs: &[CudaSlice<half::bf16>], want_sliding: bool| {
            let a: Vec<u64> = bufs
                .iter()
                .zip(&sliding)
                .map(|(b, &s)| if s == want_sliding { ptr(gpu, b, 0) } else { 0 })
                .collect();
            gpu.upload(&a, "prefix cache layer table")
        };
        let ring = match capacity_of(true)? {
            None => None,
            Some(capacity) => {
                if kv.ring == 0 || !kv.ring.is_multiple_of(bt.max(1)) {
                    return Err(GpuError::Unsupported(format!(
                        "the sliding layers' rings of {} rows are not whole {bt}-token prefix \
                         blocks (a load with the prefix cache on rounds them to --prefix-block)",
                        kv.ring
                    )));
                }
                let back = crate::scratch::max_window(g).saturating_sub(1);
                Some(RingPart {
                    geom: KvBlockGeom {
                        capacity,
                        ring: kv.ring,
                        ..geom
                    },
                    layer_k: table(&kv.k, true)?,
                    layer_v: table(&kv.v, true)?,
                    keep: WindowKeep::new(bt, back, kv.ring, (vs, hs)),
                })
            }
        };
        let max_pairs =
            (geom.capacity / bt.max(1)).max(1) + ring.as_ref().map_or(0, |r| r.geom.ring_blocks());
        Ok(TieredPrefix {
            index: PrefixCache::new(bt, block, ("vram", vs), ("host", hs)),
            geom,
            full: full_capacity.is_some(),
            vram,
            host,
            layer_k: table(&kv.k, false)?,
            layer_v: table(&kv.v, false)?,
            ring,
            pairs: gpu.alloc_zeros::<u32>(4 * max_pairs, "prefix cache block list")?,
            restore_ev: [None, None],
            store_ev: None,
            file: None,
            #[cfg(any(test, feature = "fault-injection"))]
            skip_ring_restore: false,
        })
    }

    pub fn vram_bytes(&self) -> u64 {
        self.index.capacity(Tier::Primary) as u64 * self.slot_bytes()
    }

    pub fn host_bytes(&self) -> u64 {
        self.index.capacity(Tier::Secondary) as u64 * self.slot_bytes()
    }

    fn slot_bytes(&self) -> u64 {
        self.geom.slot_elems() as u64 * 2
    }

    /// Device address of `tier`'s pool.
    fn pool_addr(&self, gpu: &Gpu, tier: Tier) -> Option<u64> {
        match tier {
            Tier::Primary => self.vram.as_ref().map(|v| ptr(gpu, v, 0)),
            Tier::Secondary => self.host.as_ref().map(|h| h.dev),
        }
    }

    /// The rows of `part` of the sequence whose arena rows start at `base`
    /// and whose ring is its sampler slot `slot`'s: (geometry, first row).
    fn part_rows(&self, part: Part, (base, slot): (usize, usize)) -> Result<(KvBlockGeom, usize)> {
        match (part, &self.ring) {
            (Part::Full, _) => Ok((self.geom, base)),
            (Part::Ring, Some(r)) => Ok((r.geom, slot * r.geom.ring)),
            (Part::Ring, None) => Err(GpuError::Unsupported(
                "a prefix cache ring copy on a model without sliding layers".into(),
            )),
        }
    }

    /// The longest held chain starting `prompt` that this engine can
    /// resume after (`PrefixCache::lookup_where`): with sliding layers,
    /// one whose last window's blocks keep their sliding KV ([`RingPart`]).
    pub fn lookup(&mut self, prompt: &[u32]) -> Hit {
        let TieredPrefix { index, ring, .. } = self;
        match ring {
            None => index.lookup(prompt),
            Some(r) => index.lookup_where(prompt, &mut |chain: &[Place]| r.keep.resumable(chain)),
        }
    }

    /// Queues one launch moving `pairs` (slot, block) of `tier` for `part`
    /// of the sequence at `at` (arena base, slot), its list at `offset`
    /// pairs into the pair buffer.
    #[allow(clippy::too_many_arguments)]
    fn launch(
        &mut self,
        gpu: &Gpu,
        kernels: &krasis_kernels::Kernels,
        (tier, part): (Tier, Part),
        at: (usize, usize),
        pairs: &[(usize, usize)],
        offset: usize,
        dir: BlockCopy,
    ) -> Result<()> {
        let (geom, base) = self.part_rows(part, at)?;
        let blocks = geom.blocks_after(base);
        let slots = self.index.capacity(tier);
        let row = |b: usize| match geom.ring_blocks() {
            0 => b,
            rb => b % rb,
        };
        if let Some(&(s, b)) = pairs.iter().find(|&&(s, b)| s >= slots || row(b) >= blocks) {
            return Err(GpuError::Unsupported(format!(
                "prefix cache copy of slot {s} (of {slots}) and block {b} (of the {blocks} after \
                 KV row {base}, {part:?} layers)"
            )));
        }
        let pool = self.pool_addr(gpu, tier).ok_or_else(|| {
            GpuError::Unsupported(format!("a prefix cache copy to the absent {tier:?} tier"))
        })?;
        let flat: Vec<u32> = pairs
            .iter()
            .flat_map(|&(s, b)| [s as u32, b as u32])
            .collect();
        let mut dst = self.pairs.slice_mut(2 * offset..2 * (offset + pairs.len()));
        gpu.stream
            .memcpy_htod(&flat, &mut dst)
            .map_err(GpuError::driver("copying a prefix cache block list"))?;
        let list = self.pairs.slice(2 * offset..2 * (offset + pairs.len()));
        let (lk, lv) = match (part, &self.ring) {
            (Part::Ring, Some(r)) => (&r.layer_k, &r.layer_v),
            _ => (&self.layer_k, &self.layer_v),
        };
        Ok(kernels.kv_blocks_copy(
            &gpu.stream,
            lk,
            lv,
            geom,
            base,
            pool,
            slots,
            &list,
            pairs.len(),
            dir,
        )?)
    }

    /// Queues the copies of the hit's blocks into positions `0..hit.tokens`
    /// of the sequence at `at` (its arena base and slot): one launch per
    /// tier and layer kind holding any of them (the sliding layers: only
    /// the window before the hit's end, into the sequence's ring).
    pub fn restore(
        &mut self,
        gpu: &Gpu,
        kernels: &krasis_kernels::Kernels,
        at: (usize, usize),
        hit: &Hit,
    ) -> Result<()> {
        // The timings of earlier copies are read first (several sequences'
        // prefills interleave, each restoring and storing).
        self.collect_timing()?;
        let window: Vec<(Tier, usize, usize)> = match &self.ring {
            Some(r) => r.keep.window(hit).collect(),
            None => Vec::new(),
        };
        #[cfg(any(test, feature = "fault-injection"))]
        let window = if self.skip_ring_restore {
            Vec::new()
        } else {
            window
        };
        let mut offset = 0;
        for tier in Tier::ALL {
            let full: Vec<(usize, usize)> = match self.full {
                true => hit.in_tier(tier).map(|(b, s)| (s, b)).collect(),
                false => Vec::new(),
            };
            let ring = in_tier(&window, tier);
            if full.is_empty() && ring.is_empty() {
                continue;
            }
            let a = timing_event(gpu)?;
            for (part, pairs) in [(Part::Full, &full), (Part::Ring, &ring)] {
                if !pairs.is_empty() {
                    let dir = BlockCopy::ToSequence;
                    self.launch(gpu, kernels, (tier, part), at, pairs, offset, dir)?;
                    offset += pairs.len();
                }
            }
            let b = timing_event(gpu)?;
            self.restore_ev[tier.index()] = Some((a, b));
        }
        Ok(())
    }

    /// Queues the demotions a store needs and the copies of `prompt`'s new
    /// whole blocks (prefilled to its end in the KV of the sequence at
    /// `at`: its arena base and slot) into the pools, and publishes them:
    /// every later read is ordered after these copies on the same stream.
    /// A sliding layer's ring holds only the prompt's last ring's worth of
    /// positions: the blocks wholly inside it keep their sliding KV, new
    /// ones and held ones past the hit that lacked it (`StorePlan::held`:
    /// the same bytes, from any prompt that starts with their tokens).
    pub fn store(
        &mut self,
        gpu: &Gpu,
        kernels: &krasis_kernels::Kernels,
        at: (usize, usize),
        prompt: &[u32],
        hit: &Hit,
    ) -> Result<()> {
        self.collect_timing()?;
        let a = timing_event(gpu)?;
        let slot_bytes = self.slot_bytes() as usize;
        let (vram, host) = (
            self.pool_addr(gpu, Tier::Primary),
            self.pool_addr(gpu, Tier::Secondary),
        );
        let mut failed = None;
        let stream = gpu.stream.cu_stream();
        let TieredPrefix { index, ring, .. } = self;
        let mut keep = ring.as_mut().map(|r| &mut r.keep);
        let plan = index.plan_store(prompt, hit, &mut |d: Demotion| {
            let (Some(v), Some(h)) = (vram, host) else {
                return false;
            };
            // SAFETY: both slots lie inside their pools (the index hands
            // out slots of the pools' sizes); the copy is ordered on the
            // compute stream before any later write of either slot.
            let r = unsafe {
                sys::cuMemcpyAsync(
                    h + (d.to * slot_bytes) as u64,
                    v + (d.from * slot_bytes) as u64,
                    slot_bytes,
                    stream,
                )
            }
            .result();
            match r {
                Ok(()) => {
                    // The slot's bytes moved, its sliding KV with them.
                    if let Some(k) = keep.as_deref_mut() {
                        k.demoted(d);
                    }
                    true
                }
                Err(e) => {
                    failed.get_or_insert(e);
                    false
                }
            }
        });
        if let Some(e) = failed {
            return Err(GpuError::Driver {
                what: "demoting a prefix cache block to the host tier".into(),
                source: e,
            });
        }
        // The blocks whose sliding KV the sequence's ring still holds.
        let window = match self.ring.as_mut() {
            Some(r) => r.keep.stored(&plan, prompt.len()),
            None => Vec::new(),
        };
        let mut offset = 0;
        let mut copies = || -> Result<()> {
            for tier in Tier::ALL {
                let full: Vec<(usize, usize)> = match self.full {
                    true => plan
                        .blocks
                        .iter()
                        .filter(|s| s.place.tier == tier)
                        .map(|s| (s.place.slot, s.block))
                        .collect(),
                    false => Vec::new(),
                };
                let ring = in_tier(&window, tier);
                for (part, pairs) in [(Part::Full, &full), (Part::Ring, &ring)] {
                    if !pairs.is_empty() {
                        let dir = BlockCopy::ToPool;
                        self.launch(gpu, kernels, (tier, part), at, pairs, offset, dir)?;
                        offset += pairs.len();
                    }
                }
            }
            Ok(())
        };
        if let Err(e) = copies() {
            // `stored` marked held blocks as keeping their window before
            // the copies that give it to them: drop every block rather
            // than leave a mark without its bytes.
            self.index.clear();
            return Err(e);
        }
        let b = timing_event(gpu)?;
        self.store_ev = Some((a, b));
        self.index.publish(plan);
        Ok(())
    }

    /// Adds the copy times of the last restores and store to the counters,
    /// waiting for the copies if the stream has not passed them yet (a
    /// request that ends right after its first token: the store was queued
    /// after the last synchronisation).
    pub fn collect_timing(&mut self) -> Result<()> {
        let evs = self.restore_ev.iter().flatten().chain(&self.store_ev);
        for (_, end) in evs {
            end.synchronize()
                .map_err(GpuError::driver("waiting for prefix cache copies"))?;
        }
        for tier in Tier::ALL {
            if let Some((a, b)) = self.restore_ev[tier.index()].take() {
                let ms = a
                    .elapsed_ms(&b)
                    .map_err(GpuError::driver("reading prefix restore timing"))?;
                self.index.record_restore_ms(tier, ms as f64);
            }
        }
        if let Some((a, b)) = self.store_ev.take() {
            let ms = a
                .elapsed_ms(&b)
                .map_err(GpuError::driver("reading prefix store timing"))?;
            self.index.record_store_ms(ms as f64);
        }
        Ok(())
    }
}

fn timing_event(gpu: &Gpu) -> Result<CudaEvent> {
    gpu.stream
        .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(GpuError::driver("recording a prefix cache timing event"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use krasis_model::synth::preset_geometry;

    #[test]
    fn the_vram_pool_is_auto_only_when_every_expert_is_resident() {
        let g = preset_geometry("a3b").unwrap();
        let block = block_bytes(&g, 256);
        // a3b: 48 layers x 2 x 4 KV heads x 128 x 2 bytes per position.
        assert_eq!(block, 256 * 48 * 2 * 4 * 128 * 2);
        let kv = 32768 / 256 * block;
        let auto = PrefixCacheChoice::Auto;
        // Plenty of memory: one context's KV.
        assert_eq!(pool_bytes(auto, &g, 256, kv, Some(1 << 40)).unwrap(), kv);
        // Tight: half the spare memory, in whole blocks.
        let spare = 10 * block + 3;
        assert_eq!(
            pool_bytes(auto, &g, 256, kv, Some(spare)).unwrap(),
            5 * block
        );
        // Less than a block, or not every expert resident: none.
        assert_eq!(pool_bytes(auto, &g, 256, kv, Some(block)).unwrap(), 0);
        assert_eq!(pool_bytes(auto, &g, 256, kv, None).unwrap(), 0);
        for none in [PrefixCacheChoice::Off, PrefixCacheChoice::Bytes(0)] {
            assert_eq!(pool_bytes(none, &g, 256, kv, Some(1 << 40)).unwrap(), 0);
        }
        // An explicit size takes its whole blocks, resident experts or not.
        assert_eq!(
            pool_bytes(PrefixCacheChoice::Bytes(3 * block + 5), &g, 256, kv, None).unwrap(),
            3 * block
        );
        let e = pool_bytes(PrefixCacheChoice::Bytes(block - 1), &g, 256, kv, None).unwrap_err();
        assert!(e.to_string().contains("holds no block"), "{e}");
    }

    #[test]
    fn the_host_tier_takes_four_contexts_within_a_quarter_of_the_host() {
        let g = preset_geometry("a3b").unwrap();
        let block = block_bytes(&g, 256);
        let kv = 128 * block;
        let auto = PrefixCacheChoice::Auto;
        assert_eq!(host_bytes(auto, &g, 256, kv, 1 << 50).unwrap(), 4 * kv);
        assert_eq!(
            host_bytes(auto, &g, 256, kv, 40 * block + 7).unwrap(),
            10 * block
        );
        assert_eq!(
            host_bytes(PrefixCacheChoice::Off, &g, 256, kv, 1 << 50).unwrap(),
            0
        );
        assert_eq!(
            host_bytes(PrefixCacheChoice::Bytes(2 * block), &g, 256, kv, 0).unwrap(),
            2 * block
        );
        let e = host_bytes(PrefixCacheChoice::Bytes(5), &g, 256, kv, 0).unwrap_err();
        assert!(e.to_string().contains("host tier of 5 bytes"), "{e}");
    }

    /// The registry's `prefix_cache_backends` says cuda exactly for the
    /// families whose every preset this engine's cache handles.
    #[test]
    fn the_registry_lists_the_cuda_cache_where_it_handles_the_layers() {
        for a in krasis_model::arch::registry::ARCHITECTURES {
            let listed = a
                .options
                .prefix_cache_backends
                .contains(&krasis_common::Backend::Cuda);
            for p in a.presets {
                let g = preset_geometry(p.name).unwrap();
                assert_eq!(
                    listed,
                    unsupported(&g).is_none(),
                    "{} {}",
                    a.model_type,
                    p.name
                );
            }
        }
    }

    /// Sliding-window models have the cache: auto sizes and explicit ones
    /// as for any model.
    #[test]
    fn sliding_window_models_have_the_cache_on_this_engine() {
        let g = preset_geometry("gpt-oss-20b").unwrap();
        assert!(unsupported(&g).is_none());
        let block = block_bytes(&g, 256);
        let auto = PrefixCacheChoice::Auto;
        let kv = 64 * block;
        assert_eq!(pool_bytes(auto, &g, 256, kv, Some(1 << 40)).unwrap(), kv);
        assert_eq!(host_bytes(auto, &g, 256, kv, 1 << 40).unwrap(), 4 * kv);
        let size = PrefixCacheChoice::Bytes(3 * block);
        assert_eq!(pool_bytes(size, &g, 256, kv, None).unwrap(), 3 * block);
    }
}
