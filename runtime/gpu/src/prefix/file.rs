//! The CUDA engine's prefix cache file (`serve --prefix-cache-file`): the
//! shared format and rules (`krasis_model::prefix_cache::persist`) over the
//! VRAM pool and the page-locked host tier. Loading happens once at load,
//! saving at a graceful shutdown, both between requests, so plain
//! synchronous copies do (after the compute stream has finished every
//! store and demotion it queued).
//!
//! A gpt-oss block's sliding layers' KV is usable only where the prompt
//! that stored it still held its window (`prefix_window.rs`): that mark is
//! the block's tag in the file, restored with it.
//!
//! The identity binds the KV to the model's content and its expert cache,
//! the attention and MLP formats, the reuse granule, the GPU, driver, NVRTC
//! and cuBLASLt (a GEMM algorithm chosen on another card or library can
//! round differently), and the executable.

use super::TieredPrefix;
use crate::device::Gpu;
use crate::engine::CudaEngine;
use crate::error::{GpuError, Result};
use crate::prefix_window::WindowKeep;
use cudarc::driver::sys;
use krasis_model::prefix_cache::persist::{self, BlockBytes, KvIdentity, Loaded, Saved};
use krasis_model::prefix_cache::{Place, PrefixCache, Tier};
use std::path::Path;

/// The pools' bytes, moved by synchronous copies, and each block's mark of
/// holding its sliding layers' KV (its tag: 1 kept, 0 not).
struct PoolBytes<'a> {
    gpu: &'a Gpu,
    vram: Option<u64>,
    host: Option<*mut u8>,
    slot_bytes: usize,
    synced: bool,
    keep: Option<&'a mut WindowKeep>,
}

impl PoolBytes<'_> {
    /// The byte offset of `place`'s slot, once the stream is idle.
    fn prepare(&mut self, place: Place, len: usize) -> std::result::Result<usize, String> {
        if len != self.slot_bytes {
            return Err(format!(
                "a block of {len} bytes where a slot holds {}",
                self.slot_bytes
            ));
        }
        if !self.synced {
            self.gpu
                .ctx
                .bind_to_thread()
                .map_err(|e| format!("binding the CUDA context: {e}"))?;
            self.gpu
                .stream
                .synchronize()
                .map_err(|e| format!("waiting for the prefix cache's copies: {e}"))?;
            self.synced = true;
        }
        Ok(place.slot * self.slot_bytes)
    }
}

impl BlockBytes for PoolBytes<'_> {
    fn read(&mut self, place: Place, out: &mut [u8]) -> std::result::Result<(), String> {
        let at = self.prepare(place, out.len())?;
        match (place.tier, self.vram, self.host) {
            // SAFETY: the slot lies inside the pool (the index hands out
            // slots of its size) and the stream is idle.
            (Tier::Primary, Some(v), _) => {
                unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), v + at as u64, out.len()) }
                    .result()
                    .map_err(|e| format!("copying a block out of the VRAM pool: {e}"))
            }
            // SAFETY: as above; the host tier is plain (page-locked) memory.
            (Tier::Secondary, _, Some(h)) => {
                unsafe { std::ptr::copy_nonoverlapping(h.add(at), out.as_mut_ptr(), out.len()) };
                Ok(())
            }
            (t, ..) => Err(format!("a block in the absent {t:?} tier")),
        }
    }

    fn write(&mut self, place: Place, bytes: &[u8]) -> std::result::Result<(), String> {
        let at = self.prepare(place, bytes.len())?;
        match (place.tier, self.vram, self.host) {
            // SAFETY: as in `read`.
            (Tier::Primary, Some(v), _) => {
                unsafe { sys::cuMemcpyHtoD_v2(v + at as u64, bytes.as_ptr().cast(), bytes.len()) }
                    .result()
                    .map_err(|e| format!("copying a block into the VRAM pool: {e}"))
            }
            (Tier::Secondary, _, Some(h)) => {
                // SAFETY: as in `read`.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), h.add(at), bytes.len()) };
                Ok(())
            }
            (t, ..) => Err(format!("a block in the absent {t:?} tier")),
        }
    }

    fn tag(&self, place: Place) -> u8 {
        self.keep.as_ref().is_some_and(|k| k.is_kept(&place)) as u8
    }

    fn set_tag(&mut self, place: Place, tag: u8) {
        if let Some(k) = self.keep.as_deref_mut() {
            k.set_kept(&place, tag == 1);
        }
    }
}

impl TieredPrefix {
    /// The pools of this cache and its window marks, for the file.
    fn pools<'a>(&'a mut self, gpu: &'a Gpu) -> (&'a mut PrefixCache, PoolBytes<'a>) {
        let bytes = PoolBytes {
            gpu,
            vram: self.pool_addr(gpu, Tier::Primary),
            host: self.host.as_ref().map(|h| h.host),
            slot_bytes: self.slot_bytes() as usize,
            synced: false,
            keep: None,
        };
        let keep = self.ring.as_mut().map(|r| &mut r.keep);
        (&mut self.index, PoolBytes { keep, ..bytes })
    }
}

impl CudaEngine {
    /// What this engine's cached KV is computed by; `model`: the
    /// checkpoint's content identity (`Checkpoint::content_identity`).
    fn kv_identity(&self, p: &TieredPrefix, model: &str) -> Result<KvIdentity> {
        let g = &self.model.geometry;
        let info = &self.model.gpu.info;
        let experts = match self.expert_cache() {
            Some(c) => format!(
                "; experts {} (quantizer {}, {:?})",
                c.source().id(),
                c.header().quantizer_version,
                c.format()
            ),
            None => String::new(),
        };
        let (nv_major, nv_minor) = krasis_kernels::nvrtc_version()?;
        // SAFETY: a version query without arguments.
        let lt = unsafe { cudarc::cublaslt::sys::cublasLtGetVersion() };
        Ok(KvIdentity {
            engine: "cuda".into(),
            model: format!("{model}{experts}"),
            formats: format!(
                "bf16 KV; attention {}, MLP {}; reuse granule {}",
                g.attention.activations.name(),
                g.mlp.activations.name(),
                p.index.reuse_granule()
            ),
            device: format!(
                "{} (sm_{}{}), driver {}, NVRTC {nv_major}.{nv_minor}, cuBLASLt {lt}",
                info.name,
                info.compute_capability.0,
                info.compute_capability.1,
                info.driver_version
            ),
            build: persist::build_identity().map_err(|e| {
                GpuError::Unsupported(format!("reading this executable for its identity: {e}"))
            })?,
            block_tokens: p.index.block_tokens() as u64,
            block_bytes: p.index.block_bytes(),
            binding: self.prefix_binding(),
        })
    }

    /// Binds the prefix cache to `path` and loads the blocks it holds (the
    /// most recent that fit; none when there is no file yet); refused
    /// without the cache, for a file of another identity and for a damaged
    /// one.
    pub(crate) fn load_prefix_file(&mut self, path: &Path, model: &str) -> Result<Loaded> {
        let Some(p) = self.prefix.as_ref() else {
            return Err(GpuError::Unsupported(format!(
                "--prefix-cache-file {}: the prefix cache is off on this engine (see its \
                 'prefix cache:' line), so there is nothing to keep in a file; turn it on or \
                 drop --prefix-cache-file",
                path.display()
            )));
        };
        let identity = self.kv_identity(p, model)?;
        let binding = self.prefix_binding();
        let gpu = &self.model.gpu;
        let p = self.prefix.as_mut().expect("checked above");
        p.index.bind(binding);
        let (index, mut bytes) = p.pools(gpu);
        let loaded = persist::load(index, &mut bytes, &identity, path)?;
        p.file = Some((path.to_path_buf(), identity));
        Ok(loaded)
    }

    /// Writes the prefix cache to its file, when it has one.
    pub(crate) fn save_prefix_file(&mut self) -> Result<Option<Saved>> {
        let gpu = &self.model.gpu;
        let Some(p) = self.prefix.as_mut() else {
            return Ok(None);
        };
        p.collect_timing()?;
        let Some((path, identity)) = &p.file else {
            return Ok(None);
        };
        // `pools` borrows the whole cache (its index and window marks).
        let (path, identity) = (path.clone(), identity.clone());
        let (index, mut bytes) = p.pools(gpu);
        Ok(Some(persist::save(index, &mut bytes, &identity, &path)?))
    }
}
