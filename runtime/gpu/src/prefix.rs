//! The CUDA engine's prefix cache: the shared index
//! ([`krasis_model::prefix_cache`]) over a VRAM pool of KV blocks.
//!
//! A block is `prefill_chunk` prompt positions of every layer's K and V,
//! laid out `[layer][K, V][kv_head][position][head_dim]` in 16-bit (the KV
//! cache's format, copied as bits). A sequence's KV stays contiguous (its
//! rows `[base, base + len)` of every layer's `[kv_head][rows][head_dim]`
//! arena, `arena.rs`), so a block moves between it and the pool as one
//! pitched 2D copy per layer and K/V (`kv_head` rows of `block * head_dim`
//! elements), device to device on the compute stream: every read of a
//! block is stream-ordered after the copy that wrote it, and a block
//! restored into one sequence's rows is the block another sequence stored
//! from its own.
//!
//! Exactness: a block is a whole prefill chunk, so a prompt resumed after
//! its restored blocks runs exactly the chunks `[kC, (k+1)C)` a cold
//! prefill of the whole prompt runs, over bit-identical KV, and its logits
//! are bit-identical (the engine's chunked prefill is not boundary-invariant
//! bit for bit: cuBLAS picks its kernels by shape). Decode's KV is never
//! stored (decode kernels differ from prefill's).
//!
//! The pool is allocated once at load, after calibration and before the
//! expert placement, so it comes out of what HCS would otherwise hold
//! ([`pool_bytes`] is the rule).

use crate::device::Gpu;
use crate::error::{GpuError, Result};
use crate::forward::ptr;
use crate::scratch::KvCache;
use cudarc::driver::{CudaEvent, CudaSlice, sys};
use half::bf16;
use krasis_common::options::PrefixCacheChoice;
use krasis_model::Geometry;
use krasis_model::arch::AttentionKind;
use krasis_model::prefix_cache::{Hit, PrefixCache};

/// Bytes of one block of `block_tokens` positions of every layer's K and V.
pub fn block_bytes(g: &Geometry, block_tokens: usize) -> u64 {
    (g.num_layers * 2 * g.num_kv_heads * block_tokens * g.head_dim * 2) as u64
}

/// Why this model cannot have the cache on this engine, if it cannot.
pub fn unsupported(g: &Geometry) -> Option<String> {
    g.layers
        .iter()
        .any(|l| matches!(l.attention, AttentionKind::Sliding { .. }))
        .then(|| {
            "the cuda backend's prefix cache does not handle sliding-window attention layers \
             (their ring KV overwrites a prompt's early blocks during prefill); pass \
             --prefix-cache off"
                .to_string()
        })
}

/// The pool size for `choice`: `Auto` takes the smaller of one context's
/// KV (`kv_bytes`) and a quarter of `spare` (free VRAM above calibration's
/// floor), in whole blocks; `Bytes` its whole blocks. 0: no cache (also
/// `Auto` on a model the cache does not handle, or with less than a block;
/// `Bytes` is refused then).
pub fn pool_bytes(
    choice: PrefixCacheChoice,
    g: &Geometry,
    block_tokens: usize,
    kv_bytes: u64,
    spare: u64,
) -> Result<u64> {
    let block = block_bytes(g, block_tokens).max(1);
    match choice {
        PrefixCacheChoice::Off => Ok(0),
        PrefixCacheChoice::Auto => Ok(match unsupported(g) {
            Some(_) => 0,
            None => kv_bytes.min(spare / 4) / block * block,
        }),
        PrefixCacheChoice::Bytes(b) => {
            if let Some(why) = unsupported(g) {
                return Err(GpuError::Unsupported(why));
            }
            if b < block {
                return Err(GpuError::Unsupported(format!(
                    "a prefix cache of {b} bytes holds no block: one block ({block_tokens} \
                     tokens, the prefill chunk) of this model's KV is {block} bytes"
                )));
            }
            Ok(b / block * block)
        }
    }
}

pub(crate) struct VramPrefix {
    pub index: PrefixCache,
    pool: CudaSlice<bf16>,
    /// Elements of one block.
    block_elems: usize,
    /// Timing events around the last restore and store (read once the
    /// stream has passed them).
    restore_ev: Option<(CudaEvent, CudaEvent)>,
    store_ev: Option<(CudaEvent, CudaEvent)>,
}

impl VramPrefix {
    /// A pool of `bytes` (whole blocks) for `block_tokens`-token blocks.
    pub fn new(gpu: &Gpu, g: &Geometry, block_tokens: usize, bytes: u64) -> Result<Self> {
        let block = block_bytes(g, block_tokens);
        let slots = (bytes / block) as usize;
        let block_elems = (block / 2) as usize;
        let pool = gpu.alloc::<bf16>(slots * block_elems, "prefix cache pool")?;
        Ok(VramPrefix {
            index: PrefixCache::new(block_tokens, slots, block, "vram"),
            pool,
            block_elems,
            restore_ev: None,
            store_ev: None,
        })
    }

    pub fn bytes(&self) -> u64 {
        self.index.stats().capacity_bytes
    }

    /// Queues the copies of the hit's blocks into positions
    /// `0..hit.tokens` of the sequence whose KV rows start at `base`.
    pub fn restore(
        &mut self,
        gpu: &Gpu,
        g: &Geometry,
        kv: &KvCache,
        base: usize,
        hit: &Hit,
    ) -> Result<()> {
        if hit.slots.is_empty() {
            return Ok(());
        }
        // The timing of an earlier restore is read first (it is before this
        // one on the stream; several sequences' prefills interleave).
        self.collect_timing()?;
        let a = timing_event(gpu)?;
        for (i, &slot) in hit.slots.iter().enumerate() {
            self.copy_block(gpu, g, kv, base, i, slot, Direction::ToSequence)?;
        }
        let b = timing_event(gpu)?;
        self.restore_ev = Some((a, b));
        Ok(())
    }

    /// Queues the copies of `prompt`'s new whole blocks (prefilled to its
    /// end in the sequence's KV rows from `base` on) into the pool and
    /// publishes them: every later read is ordered after these copies on
    /// the same stream.
    pub fn store(
        &mut self,
        gpu: &Gpu,
        g: &Geometry,
        kv: &KvCache,
        base: usize,
        prompt: &[u32],
        hit: &Hit,
    ) -> Result<()> {
        let plan = self.index.plan_store(prompt, hit);
        if plan.blocks.is_empty() {
            return Ok(());
        }
        self.collect_timing()?;
        let a = timing_event(gpu)?;
        for s in &plan.blocks {
            self.copy_block(gpu, g, kv, base, s.block, s.slot, Direction::ToPool)?;
        }
        let b = timing_event(gpu)?;
        self.store_ev = Some((a, b));
        self.index.publish(plan);
        Ok(())
    }

    /// Adds the copy times of the last restore and store to the counters,
    /// waiting for the copies if the stream has not passed them yet (a
    /// request that ends right after its first token: the store was queued
    /// after the last synchronisation).
    pub fn collect_timing(&mut self) -> Result<()> {
        for (_, end) in self.restore_ev.iter().chain(&self.store_ev) {
            end.synchronize()
                .map_err(GpuError::driver("waiting for prefix cache copies"))?;
        }
        if let Some((a, b)) = self.restore_ev.take() {
            let ms = a
                .elapsed_ms(&b)
                .map_err(GpuError::driver("reading prefix restore timing"))?;
            self.index.record_restore_ms(ms as f64);
        }
        if let Some((a, b)) = self.store_ev.take() {
            let ms = a
                .elapsed_ms(&b)
                .map_err(GpuError::driver("reading prefix store timing"))?;
            self.index.record_store_ms(ms as f64);
        }
        Ok(())
    }

    /// One block between prompt block `block` of the KV of the sequence
    /// whose rows start at `base` and pool slot `slot`: per layer, K then
    /// V, `kv_head` rows of `block_tokens * head_dim` elements.
    #[allow(clippy::too_many_arguments)]
    fn copy_block(
        &self,
        gpu: &Gpu,
        g: &Geometry,
        kv: &KvCache,
        base: usize,
        block: usize,
        slot: usize,
        dir: Direction,
    ) -> Result<()> {
        let (b, d, h) = (self.index.block_tokens(), g.head_dim, g.num_kv_heads);
        let row = b * d * 2;
        for l in 0..g.num_layers {
            let cap = kv.geoms[l].capacity;
            if base + (block + 1) * b > cap {
                return Err(GpuError::Unsupported(format!(
                    "prefix block {block} of the sequence at KV row {base} is past layer {l}'s {cap} rows"
                )));
            }
            for (which, buf) in [&kv.k[l], &kv.v[l]].into_iter().enumerate() {
                let seq = ptr(gpu, buf, (base + block * b) * d);
                let pool = ptr(
                    gpu,
                    &self.pool,
                    slot * self.block_elems + (2 * l + which) * h * b * d,
                );
                let (seq_pitch, pool_pitch) = (cap * d * 2, row);
                let (src, sp, dst, dp) = match dir {
                    Direction::ToPool => (seq, seq_pitch, pool, pool_pitch),
                    Direction::ToSequence => (pool, pool_pitch, seq, seq_pitch),
                };
                copy_2d(gpu, (src, sp), (dst, dp), row, h)?;
            }
        }
        Ok(())
    }
}

#[derive(Clone, Copy)]
enum Direction {
    ToPool,
    ToSequence,
}

fn timing_event(gpu: &Gpu) -> Result<CudaEvent> {
    gpu.stream
        .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(GpuError::driver("recording a prefix cache timing event"))
}

/// `height` rows of `width` bytes from `src` (address, pitch) to `dst`,
/// device to device on the compute stream.
fn copy_2d(
    gpu: &Gpu,
    src: (u64, usize),
    dst: (u64, usize),
    width: usize,
    height: usize,
) -> Result<()> {
    let p = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: src.0,
        srcArray: std::ptr::null_mut(),
        srcPitch: src.1,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst.0,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst.1,
        WidthInBytes: width,
        Height: height,
    };
    // SAFETY: both regions are inside live device allocations the engine
    // owns (`copy_block` computes them from the buffers' own geometry), the
    // descriptor outlives the call (the driver reads it before returning),
    // and the copy is ordered on the compute stream with every kernel that
    // reads or writes either region.
    unsafe { sys::cuMemcpy2DAsync_v2(&p, gpu.stream.cu_stream()) }
        .result()
        .map_err(GpuError::driver("copying a prefix cache block"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use krasis_model::synth::preset_geometry;

    #[test]
    fn the_pool_rule_takes_whole_blocks_within_a_quarter_of_the_spare_memory() {
        let g = preset_geometry("a3b").unwrap();
        let block = block_bytes(&g, 2048);
        // a3b: 48 layers x 2 x 4 KV heads x 128 x 2 bytes per position.
        assert_eq!(block, 2048 * 48 * 2 * 4 * 128 * 2);
        let kv = 32768 / 2048 * block;
        // Plenty of memory: one context's KV.
        assert_eq!(
            pool_bytes(PrefixCacheChoice::Auto, &g, 2048, kv, 1 << 40).unwrap(),
            kv
        );
        // Tight: a quarter of the spare memory, in whole blocks.
        let spare = 10 * block + 3;
        assert_eq!(
            pool_bytes(PrefixCacheChoice::Auto, &g, 2048, kv, spare).unwrap(),
            2 * block
        );
        // Less than a block: none.
        assert_eq!(
            pool_bytes(PrefixCacheChoice::Auto, &g, 2048, kv, block).unwrap(),
            0
        );
        assert_eq!(
            pool_bytes(PrefixCacheChoice::Off, &g, 2048, kv, 1 << 40).unwrap(),
            0
        );
        assert_eq!(
            pool_bytes(PrefixCacheChoice::Bytes(3 * block + 5), &g, 2048, kv, 0).unwrap(),
            3 * block
        );
        let e = pool_bytes(PrefixCacheChoice::Bytes(block - 1), &g, 2048, kv, 0).unwrap_err();
        assert!(e.to_string().contains("holds no block"), "{e}");
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

    #[test]
    fn sliding_window_models_have_no_cache_on_this_engine() {
        let g = preset_geometry("gpt-oss-20b").unwrap();
        assert!(unsupported(&g).is_some());
        assert_eq!(
            pool_bytes(PrefixCacheChoice::Auto, &g, 512, 1 << 30, 1 << 40).unwrap(),
            0
        );
        let e =
            pool_bytes(PrefixCacheChoice::Bytes(1 << 30), &g, 512, 1 << 30, 1 << 40).unwrap_err();
        assert!(e.to_string().contains("--prefix-cache off"), "{e}");
        assert!(unsupported(&preset_geometry("a3b").unwrap()).is_none());
    }
}
