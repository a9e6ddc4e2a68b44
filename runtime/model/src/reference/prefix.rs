//! The reference engine's prefix cache: the shared index
//! ([`crate::prefix_cache`]) over blocks of its f32 KV in two host-memory
//! pools, the first tier (`host`) and the RAM tier blocks are demoted to
//! (`host-ram`), with exactly the CUDA engine's rules. A block is
//! `block_tokens` positions of every layer's keys and values (`[layer][K
//! rows | V rows]`, `block * kv_dim` f32 each), copied out of the
//! sequence's KV after a prefill completed and back in when a later prompt
//! starts with the same blocks. The engine's chunked prefill is
//! bit-identical to one batch whatever the chunk boundaries (every
//! operation but attention is per token, and attention reads earlier
//! positions from the KV), so blocks need not be whole chunks: a prompt
//! resumed after restored blocks gives the logits a cold prefill gives, bit
//! for bit (`tests/prefix.rs`).

use super::ReferenceEngine;
use super::kv::KvCache;
use crate::prefix_cache::persist::{self, BlockBytes, KvIdentity, Loaded, PersistError, Saved};
use crate::prefix_cache::{Demotion, Hit, Place, PrefixCache, Tier};
use std::hash::{Hash, Hasher};
use std::time::Instant;

/// The sizes of a [`HostPrefix`]: bytes of each tier's pool and the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixSizes {
    pub primary_bytes: u64,
    pub secondary_bytes: u64,
    pub block_tokens: usize,
}

pub(super) struct HostPrefix {
    pub index: PrefixCache,
    /// One vector per slot and tier, allocated when first stored into.
    pools: [Vec<Vec<f32>>; 2],
    /// The file the cache is saved to and loaded from, with what this
    /// engine's KV is computed by besides its binding
    /// ([`ReferenceEngine::set_prefix_file`]).
    file: Option<(std::path::PathBuf, KvIdentity)>,
}

/// The pools' bytes, as the cache's file moves them (native-endian f32:
/// the file is bound to the executable).
struct Pools<'a>(&'a mut [Vec<Vec<f32>>; 2]);

impl BlockBytes for Pools<'_> {
    fn read(&mut self, place: Place, out: &mut [u8]) -> Result<(), String> {
        let block = &self.0[pool(place.tier)][place.slot];
        let bytes: &[u8] = bytemuck::cast_slice(block);
        if bytes.len() != out.len() {
            return Err(format!(
                "{:?} slot {} holds {} bytes, not a block's {}",
                place.tier,
                place.slot,
                bytes.len(),
                out.len()
            ));
        }
        out.copy_from_slice(bytes);
        Ok(())
    }
    fn write(&mut self, place: Place, bytes: &[u8]) -> Result<(), String> {
        self.0[pool(place.tier)][place.slot] = bytes
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes(c.try_into().expect("4 bytes")))
            .collect();
        Ok(())
    }
}

fn pool(tier: Tier) -> usize {
    match tier {
        Tier::Primary => 0,
        Tier::Secondary => 1,
    }
}

impl HostPrefix {
    pub fn new(sizes: PrefixSizes, layers: usize, kv_dim: usize) -> Self {
        let block_bytes = (layers * 2 * sizes.block_tokens * kv_dim * 4) as u64;
        let slots = |b: u64| (b / block_bytes.max(1)) as usize;
        let (p, s) = (slots(sizes.primary_bytes), slots(sizes.secondary_bytes));
        HostPrefix {
            index: PrefixCache::new(
                sizes.block_tokens,
                block_bytes,
                ("host", p),
                ("host-ram", s),
            ),
            pools: [vec![Vec::new(); p], vec![Vec::new(); s]],
            file: None,
        }
    }

    /// Shifts every held value (tests: shows the restored bytes are used).
    #[cfg(test)]
    pub fn corrupt_for_test(&mut self) {
        self.pools
            .iter_mut()
            .flatten()
            .flatten()
            .for_each(|v| *v += 1.0);
    }

    /// Copies the hit's blocks into positions `0..hit.tokens` of `kv`, per
    /// tier.
    fn restore(&mut self, hit: &Hit, kv: &mut KvCache) {
        let b = self.index.block_tokens();
        for tier in Tier::ALL {
            let t = Instant::now();
            let mut any = false;
            for (i, slot) in hit.in_tier(tier) {
                any = true;
                let block = &self.pools[pool(tier)][slot];
                let per = block.len() / (2 * kv.num_layers());
                for layer in 0..kv.num_layers() {
                    let base = 2 * layer * per;
                    kv.write(
                        layer,
                        i * b,
                        &block[base..base + per],
                        &block[base + per..base + 2 * per],
                    );
                }
            }
            if any {
                self.index
                    .record_restore_ms(tier, t.elapsed().as_secs_f64() * 1e3);
            }
        }
    }

    /// Stores the whole blocks of `prompt` (prefilled to its end in `kv`)
    /// that follow `hit`, then publishes them.
    fn store(&mut self, prompt: &[u32], hit: &Hit, kv: &KvCache) {
        let t = Instant::now();
        let pools = &mut self.pools;
        let plan = self.index.plan_store(prompt, hit, &mut |d: Demotion| {
            let block = std::mem::take(&mut pools[0][d.from]);
            pools[1][d.to] = block;
            true
        });
        let b = self.index.block_tokens();
        for s in &plan.blocks {
            let block = &mut self.pools[pool(s.place.tier)][s.place.slot];
            block.clear();
            for layer in 0..kv.num_layers() {
                let (k, v) = kv.rows(layer, s.block * b, b);
                block.extend_from_slice(k);
                block.extend_from_slice(v);
            }
        }
        self.index.publish(plan);
        self.index.record_store_ms(t.elapsed().as_secs_f64() * 1e3);
    }
}

impl ReferenceEngine {
    /// Holds prompt-prefix KV in host memory: blocks of `sizes.block_tokens`
    /// tokens, up to `sizes.primary_bytes` in the first tier and
    /// `sizes.secondary_bytes` in the RAM tier its least recently used
    /// blocks are demoted to (both 0 turn the cache off and drop what it
    /// held). Requests then reuse the longest cached prefix of their prompt
    /// unless they ask not to (`GenerateRequest::cache_prompt`).
    pub fn set_prefix_cache(&mut self, sizes: PrefixSizes) {
        let on = sizes.primary_bytes > 0 || sizes.secondary_bytes > 0;
        let g = &self.geometry;
        self.prefix = on.then(|| HostPrefix::new(sizes, g.num_layers, g.kv_dim()));
    }

    /// Binds the prefix cache to `path` (`serve --prefix-cache-file`):
    /// loads the blocks it holds now (the most recent that fit; none when
    /// there is no file yet) and writes them there at
    /// [`crate::Engine::save_prefix_cache`]. `model` is the content identity
    /// of the model and its expert source (`Checkpoint::content_identity`).
    /// A file written for another model, setting, block, executable or
    /// engine is refused, as is a damaged one; so is a file without the
    /// cache on.
    pub fn set_prefix_file(
        &mut self,
        path: &std::path::Path,
        model: &str,
    ) -> Result<Loaded, PersistError> {
        let binding = self.prefix_binding();
        let g = &self.geometry;
        let Some(p) = self.prefix.as_mut() else {
            return Err(PersistError::Engine {
                path: path.to_path_buf(),
                reason: "the prefix cache is off, so there is nothing to keep in a file; turn \
                         it on (--prefix-cache) or drop --prefix-cache-file"
                    .into(),
            });
        };
        let identity = KvIdentity {
            engine: "reference".into(),
            model: model.into(),
            formats: format!("f32 KV, {} layers x {} KV dims", g.num_layers, g.kv_dim()),
            device: format!("cpu ({})", std::env::consts::ARCH),
            build: persist::build_identity().map_err(|source| PersistError::Io {
                path: path.to_path_buf(),
                source,
            })?,
            block_tokens: p.index.block_tokens() as u64,
            block_bytes: p.index.block_bytes(),
            binding,
        };
        p.index.bind(binding);
        let loaded = persist::load(&mut p.index, &mut Pools(&mut p.pools), &identity, path)?;
        p.file = Some((path.to_path_buf(), identity));
        Ok(loaded)
    }

    /// Writes the prefix cache to its file, when it has one.
    pub fn save_prefix_file(&mut self) -> Result<Option<Saved>, PersistError> {
        let Some(p) = self.prefix.as_mut() else {
            return Ok(None);
        };
        let Some((path, identity)) = &p.file else {
            return Ok(None);
        };
        persist::save(&p.index, &mut Pools(&mut p.pools), identity, path).map(Some)
    }

    /// The prefix cache's figures, when it is on.
    pub fn prefix_cache_stats(&self) -> Option<krasis_common::status::PrefixCacheStats> {
        self.prefix.as_ref().map(|p| p.index.stats())
    }

    /// What the cached KV depends on besides the model: everything a
    /// setter can change between requests that changes the keys and values
    /// a prefill writes (the activation emulation, its rounding points, a
    /// planted fault). The prefill chunk is not among them (the prefill is
    /// chunk invariant), nor the block size (fixed per cache).
    fn prefix_binding(&self) -> u64 {
        #[cfg(any(test, feature = "fault-injection"))]
        let fault = format!("{:?}", self.fault);
        #[cfg(not(any(test, feature = "fault-injection")))]
        let fault = "";
        let mut h = std::collections::hash_map::DefaultHasher::new();
        format!("{:?}/{:?}/{fault}", self.activations, self.rounding).hash(&mut h);
        h.finish()
    }

    /// Looks `prompt` up and restores the hit into its sequence's `kv`;
    /// `None` when the cache is off or the request bypasses it.
    pub(super) fn reuse_prefix(
        &mut self,
        prompt: &[u32],
        use_cache: bool,
        kv: &mut KvCache,
    ) -> Option<Hit> {
        let binding = self.prefix_binding();
        let p = self.prefix.as_mut()?;
        if !use_cache {
            p.index.note_bypass();
            return None;
        }
        p.index.bind(binding);
        let hit = p.index.lookup(prompt);
        p.restore(&hit, kv);
        Some(hit)
    }

    /// After `prompt`'s prefill (into `kv`) completed: stores its new whole
    /// blocks (any prefill rows form a block: the prefill is chunk
    /// invariant).
    pub(super) fn store_prefix(&mut self, prompt: &[u32], hit: Option<&Hit>, kv: &KvCache) {
        if let (Some(p), Some(hit)) = (self.prefix.as_mut(), hit) {
            p.store(prompt, hit, kv);
        }
    }
}
