//! The reference engine's prefix cache: the shared index
//! ([`crate::prefix_cache`]) over blocks of its f32 KV held in host memory.
//! A block is `prefill_chunk` tokens of every layer's keys and values
//! (`[layer][K rows | V rows]`, `block * kv_dim` f32 each), copied out of the
//! sequence's KV after a prefill completed and back in when a later prompt
//! starts with the same blocks. The engine's chunked prefill is
//! bit-identical to one batch whatever the chunk boundaries, and blocks are
//! whole chunks anyway, so a prompt resumed after restored blocks gives the
//! logits a cold prefill gives, bit for bit (`tests/prefix.rs`).

use super::ReferenceEngine;
use super::kv::KvCache;
use crate::prefix_cache::{Hit, PrefixCache};
use std::hash::{Hash, Hasher};
use std::time::Instant;

pub(super) struct HostPrefix {
    pub index: PrefixCache,
    /// Pool bytes asked for; the block count follows from the block size.
    budget: u64,
    /// One vector per slot, allocated when first stored into.
    pool: Vec<Vec<f32>>,
}

impl HostPrefix {
    /// A cache of `budget` bytes of blocks of `block_tokens` tokens.
    pub fn new(budget: u64, block_tokens: usize, layers: usize, kv_dim: usize) -> Self {
        let block_bytes = (layers * 2 * block_tokens * kv_dim * 4) as u64;
        let slots = (budget / block_bytes.max(1)) as usize;
        HostPrefix {
            index: PrefixCache::new(block_tokens, slots, block_bytes, "host"),
            budget,
            pool: vec![Vec::new(); slots],
        }
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Shifts every held value (tests: shows the restored bytes are used).
    #[cfg(test)]
    pub fn corrupt_for_test(&mut self) {
        self.pool.iter_mut().flatten().for_each(|v| *v += 1.0);
    }

    /// Copies the hit's blocks into positions `0..hit.tokens` of `kv`.
    fn restore(&mut self, hit: &Hit, kv: &mut KvCache) {
        let t = Instant::now();
        let b = self.index.block_tokens();
        for (i, &slot) in hit.slots.iter().enumerate() {
            let block = &self.pool[slot];
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
        self.index
            .record_restore_ms(t.elapsed().as_secs_f64() * 1e3);
    }

    /// Stores the whole blocks of `prompt` (prefilled to its end in `kv`)
    /// that follow `hit`, then publishes them.
    fn store(&mut self, prompt: &[u32], hit: &Hit, kv: &KvCache) {
        let t = Instant::now();
        let plan = self.index.plan_store(prompt, hit);
        let b = self.index.block_tokens();
        for s in &plan.blocks {
            let block = &mut self.pool[s.slot];
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
    /// Holds up to `bytes` of prompt-prefix KV in host memory (whole blocks
    /// of the prefill chunk; 0 turns the cache off and drops what it held).
    /// Requests then reuse the longest cached prefix of their prompt unless
    /// they ask not to (`GenerateRequest::cache_prompt`).
    pub fn set_prefix_cache(&mut self, bytes: u64) {
        self.prefix = (bytes > 0).then(|| self.new_prefix(bytes));
    }

    fn new_prefix(&self, bytes: u64) -> HostPrefix {
        let g = &self.geometry;
        HostPrefix::new(bytes, self.prefill_chunk, g.num_layers, g.kv_dim())
    }

    /// The prefix cache's figures, when it is on.
    pub fn prefix_cache_stats(&self) -> Option<krasis_common::status::PrefixCacheStats> {
        self.prefix.as_ref().map(|p| p.index.stats())
    }

    /// What the cached KV depends on besides the model: everything a
    /// setter can change between requests that changes the keys and values
    /// a prefill writes (the activation emulation, its rounding points, a
    /// planted fault) and the block size (the prefill chunk).
    fn prefix_binding(&self) -> u64 {
        #[cfg(any(test, feature = "fault-injection"))]
        let fault = format!("{:?}", self.fault);
        #[cfg(not(any(test, feature = "fault-injection")))]
        let fault = "";
        let mut h = std::collections::hash_map::DefaultHasher::new();
        format!(
            "{:?}/{:?}/{}/{fault}",
            self.activations, self.rounding, self.prefill_chunk
        )
        .hash(&mut h);
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
        let chunk = self.prefill_chunk;
        if self
            .prefix
            .as_ref()
            .is_some_and(|p| p.index.block_tokens() != chunk)
        {
            // The chunk changed: blocks of the old size are useless.
            let bytes = self.prefix.as_ref().map_or(0, HostPrefix::budget);
            self.prefix = Some(self.new_prefix(bytes));
        }
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

    /// After `prompt`'s prefill (in chunks of `chunk` tokens, into `kv`)
    /// completed: stores its new whole blocks. Nothing when the block size
    /// changed since its lookup (the hit's blocks are of the old size).
    pub(super) fn store_prefix(
        &mut self,
        prompt: &[u32],
        hit: Option<&Hit>,
        chunk: usize,
        kv: &KvCache,
    ) {
        if let (Some(p), Some(hit)) = (self.prefix.as_mut(), hit)
            && p.index.block_tokens() == chunk
        {
            p.store(prompt, hit, kv);
        }
    }
}
