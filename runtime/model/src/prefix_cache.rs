//! The prefix cache's index, shared by every engine: which prompt prefixes
//! have their KV held, in which slot of the engine's block pool, and the
//! rules of reuse, eviction and publication. The engines own the bytes (the
//! CUDA engine a VRAM pool, the reference engine host vectors) and do the
//! copies; this module never sees them, so both engines follow exactly the
//! same rules (design: `docs/notes/prefix-cache.md`).
//!
//! - **Blocks.** A prompt is cut into blocks of `block_tokens` tokens from
//!   position 0; only whole blocks are held. The engine chooses the block
//!   size as the granularity at which resuming a prefill is bit-exact: its
//!   prefill chunk (a prefill resumed at a chunk boundary runs exactly the
//!   chunks a cold prefill runs).
//! - **Keys.** Block `i` of a prompt is keyed by its exact token ids and the
//!   identity of the entry holding block `i - 1` (a unique id, never
//!   reused), so a hit means the whole prefix up to and including the
//!   block is token-for-token the same. The hash only finds candidates; the
//!   tokens and the parent are compared exactly.
//! - **Reuse.** [`PrefixCache::lookup`] returns the longest chain of held
//!   blocks that leaves at least one prompt token to prefill (the last
//!   position's logits must be computed).
//! - **Transactions.** Blocks are stored only after a prefill completed:
//!   [`PrefixCache::plan_store`] reserves slots (evicting as needed), the
//!   engine copies the sequence's KV into them, and
//!   [`PrefixCache::publish`] makes them visible. A plan that is never
//!   published (the copy failed, the request was dropped) is reclaimed by
//!   the next call, so nothing partial is ever found.
//! - **Eviction.** Least recently used first, leaves only (an entry with
//!   held children stays, as its children are unreachable without it), and
//!   never the chain a store extends. A store that finds no slot stores
//!   fewer blocks; a request never fails for the cache.
//! - **Binding.** Cached KV is valid only for the engine state that
//!   computed it. Engines pass a binding (model settings that change the
//!   KV: activation emulation, planted faults, block size) to
//!   [`PrefixCache::bind`], which drops everything when it changes.

use krasis_common::status::PrefixCacheStats;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::hash::{Hash, Hasher};

/// A request's reuse: the slots of the held blocks that start its prompt,
/// in order (block `i` of the prompt in `slots[i]`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Hit {
    pub slots: Vec<usize>,
    /// Prompt tokens the blocks cover (`slots.len() * block_tokens`).
    pub tokens: usize,
    /// Entry ids of the chain (the parents of the blocks a store adds).
    uids: Vec<u64>,
}

/// Slots reserved for the blocks a completed prefill stores: the engine
/// copies prompt block `block` of the sequence's KV into `slot` for each,
/// then calls [`PrefixCache::publish`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorePlan {
    pub blocks: Vec<StoreBlock>,
    id: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreBlock {
    /// Block index in the prompt (positions `block * block_tokens ..`).
    pub block: usize,
    pub slot: usize,
}

#[derive(Debug)]
struct Entry {
    uid: u64,
    /// Entry id of the previous block (0: this is the prompt's first block).
    parent: u64,
    parent_slot: Option<usize>,
    tokens: Box<[u32]>,
    hash: u64,
    /// Published entries whose parent this is.
    children: usize,
    /// Last use (a hit through it, or its store).
    tick: u64,
}

/// Counters since the cache was made (cleared entries do not reset them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Counters {
    lookups: u64,
    hits: u64,
    misses: u64,
    bypassed: u64,
    cached_tokens: u64,
    blocks_stored: u64,
    evictions: u64,
    invalidations: u64,
}

pub struct PrefixCache {
    block_tokens: usize,
    block_bytes: u64,
    /// One entry per pool slot; `None`: free or reserved by the pending plan.
    slots: Vec<Option<Entry>>,
    free: Vec<usize>,
    /// Key hash → slots holding an entry with that hash.
    by_hash: HashMap<u64, Vec<usize>>,
    /// Evictable entries (published leaves), oldest first.
    lru: BTreeSet<(u64, usize)>,
    /// The reserved, unpublished entries of the last plan.
    pending: Vec<(usize, Entry)>,
    pending_id: u64,
    tick: u64,
    next_uid: u64,
    binding: Option<u64>,
    counters: Counters,
    restore_ms: f64,
    last_restore_ms: f64,
    store_ms: f64,
    location: &'static str,
}

impl std::fmt::Debug for PrefixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixCache")
            .field("block_tokens", &self.block_tokens)
            .field("slots", &self.slots.len())
            .field("held", &self.held())
            .finish()
    }
}

fn key_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

impl PrefixCache {
    /// An empty cache of `slots` blocks of `block_tokens` tokens, each
    /// `block_bytes` of the engine's pool in `location` (`vram`, `host`).
    pub fn new(
        block_tokens: usize,
        slots: usize,
        block_bytes: u64,
        location: &'static str,
    ) -> Self {
        assert!(
            block_tokens > 0,
            "a prefix cache block holds at least one token"
        );
        PrefixCache {
            block_tokens,
            block_bytes,
            slots: (0..slots).map(|_| None).collect(),
            // Popped from the end: slot 0 is used first.
            free: (0..slots).rev().collect(),
            by_hash: HashMap::new(),
            lru: BTreeSet::new(),
            pending: Vec::new(),
            pending_id: 0,
            tick: 0,
            next_uid: 1,
            binding: None,
            counters: Counters::default(),
            restore_ms: 0.0,
            last_restore_ms: 0.0,
            store_ms: 0.0,
            location,
        }
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Blocks held (published).
    pub fn held(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    /// Drops every entry when `binding` differs from the last one bound
    /// (true then). The first bind of a fresh cache drops nothing.
    pub fn bind(&mut self, binding: u64) -> bool {
        let changed = self.binding.is_some_and(|b| b != binding);
        self.binding = Some(binding);
        if changed {
            self.clear();
            self.counters.invalidations += 1;
        }
        changed
    }

    /// Drops every entry and any pending plan.
    pub fn clear(&mut self) {
        self.pending.clear();
        self.slots.iter_mut().for_each(|s| *s = None);
        self.free = (0..self.slots.len()).rev().collect();
        self.by_hash.clear();
        self.lru.clear();
    }

    /// A request that asked not to use the cache (counted only).
    pub fn note_bypass(&mut self) {
        self.counters.bypassed += 1;
    }

    /// The longest chain of held blocks starting `prompt` that leaves at
    /// least one token to prefill; the chain becomes the most recently used.
    pub fn lookup(&mut self, prompt: &[u32]) -> Hit {
        self.reclaim_pending();
        self.tick += 1;
        let b = self.block_tokens;
        let usable = prompt.len().saturating_sub(1) / b;
        let mut hit = Hit::default();
        let mut parent = 0u64;
        for block in prompt.chunks_exact(b).take(usable) {
            let Some(slot) = self.find(parent, block) else {
                break;
            };
            self.touch(slot);
            let e = self.slots[slot].as_ref().expect("found entries are held");
            parent = e.uid;
            hit.slots.push(slot);
            hit.uids.push(e.uid);
        }
        hit.tokens = hit.slots.len() * b;
        self.counters.lookups += 1;
        if hit.slots.is_empty() {
            self.counters.misses += 1;
        } else {
            self.counters.hits += 1;
            self.counters.cached_tokens += hit.tokens as u64;
        }
        hit
    }

    /// Reserves slots for the whole blocks of `prompt` (prefilled to its
    /// end) that follow `hit` and are not held yet, evicting least recently
    /// used leaves outside the prompt's own chain; stops at the first block
    /// it finds no slot for. Nothing is visible until [`Self::publish`].
    pub fn plan_store(&mut self, prompt: &[u32], hit: &Hit) -> StorePlan {
        self.reclaim_pending();
        self.pending_id += 1;
        let stale = hit.slots.iter().zip(&hit.uids).any(|(&s, &uid)| {
            self.slots.get(s).and_then(Option::as_ref).map(|e| e.uid) != Some(uid)
        });
        if stale {
            // The cache was cleared or rebound since the lookup.
            return StorePlan {
                blocks: Vec::new(),
                id: self.pending_id,
            };
        }
        let b = self.block_tokens;
        let mut parent = hit.uids.last().copied().unwrap_or(0);
        let mut parent_slot = hit.slots.last().copied();
        // The chain the new blocks hang from must stay.
        let mut keep: HashSet<usize> = hit.slots.iter().copied().collect();
        let mut blocks = Vec::new();
        for (i, block) in prompt.chunks_exact(b).enumerate().skip(hit.slots.len()) {
            if blocks.is_empty()
                && let Some(slot) = self.find(parent, block)
            {
                // Held already (the last whole block, which a lookup never
                // returns, or blocks another request stored meanwhile).
                self.touch(slot);
                keep.insert(slot);
                parent = self.slots[slot].as_ref().map_or(0, |e| e.uid);
                parent_slot = Some(slot);
                continue;
            }
            let Some(slot) = self.take_slot(&keep) else {
                break;
            };
            let uid = self.next_uid;
            self.next_uid += 1;
            self.pending.push((
                slot,
                Entry {
                    uid,
                    parent,
                    parent_slot,
                    tokens: block.into(),
                    hash: key_hash(parent, block),
                    children: 0,
                    tick: self.tick,
                },
            ));
            blocks.push(StoreBlock { block: i, slot });
            parent = uid;
            parent_slot = Some(slot);
        }
        StorePlan {
            blocks,
            id: self.pending_id,
        }
    }

    /// Makes the blocks of `plan` visible (their bytes are in the pool).
    /// False, with nothing published, for a plan that is no longer pending
    /// (another call reclaimed it).
    pub fn publish(&mut self, plan: StorePlan) -> bool {
        if plan.id != self.pending_id || plan.blocks.len() != self.pending.len() {
            return false;
        }
        for (slot, e) in std::mem::take(&mut self.pending) {
            if let Some(p) = e.parent_slot {
                let parent = self.slots[p].as_mut().expect("a parent is held");
                if parent.children == 0 {
                    self.lru.remove(&(parent.tick, p));
                }
                parent.children += 1;
            }
            self.by_hash.entry(e.hash).or_default().push(slot);
            self.lru.insert((e.tick, slot));
            self.slots[slot] = Some(e);
            self.counters.blocks_stored += 1;
        }
        true
    }

    /// Adds the time the engine spent restoring a hit's blocks.
    pub fn record_restore_ms(&mut self, ms: f64) {
        self.restore_ms += ms;
        self.last_restore_ms = ms;
    }

    /// Adds the time the engine spent copying a plan's blocks.
    pub fn record_store_ms(&mut self, ms: f64) {
        self.store_ms += ms;
    }

    pub fn stats(&self) -> PrefixCacheStats {
        let c = self.counters;
        let held = self.held() as u64;
        PrefixCacheStats {
            location: self.location.to_string(),
            block_tokens: self.block_tokens as u64,
            capacity_blocks: self.slots.len() as u64,
            capacity_bytes: self.slots.len() as u64 * self.block_bytes,
            blocks_held: held,
            bytes_held: held * self.block_bytes,
            lookups: c.lookups,
            hits: c.hits,
            misses: c.misses,
            bypassed: c.bypassed,
            cached_tokens: c.cached_tokens,
            blocks_stored: c.blocks_stored,
            evictions: c.evictions,
            invalidations: c.invalidations,
            restore_ms: self.restore_ms,
            last_restore_ms: self.last_restore_ms,
            store_ms: self.store_ms,
        }
    }

    fn find(&self, parent: u64, tokens: &[u32]) -> Option<usize> {
        self.by_hash
            .get(&key_hash(parent, tokens))?
            .iter()
            .copied()
            .find(|&s| {
                self.slots[s]
                    .as_ref()
                    .is_some_and(|e| e.parent == parent && *e.tokens == *tokens)
            })
    }

    /// Marks `slot` used now.
    fn touch(&mut self, slot: usize) {
        let tick = self.tick;
        let e = self.slots[slot].as_mut().expect("touched entries are held");
        if e.children == 0 && self.lru.remove(&(e.tick, slot)) {
            self.lru.insert((tick, slot));
        }
        e.tick = tick;
    }

    /// A free slot, or the least recently used evictable one not in `keep`.
    fn take_slot(&mut self, keep: &HashSet<usize>) -> Option<usize> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        let &(tick, slot) = self.lru.iter().find(|(_, s)| !keep.contains(s))?;
        self.lru.remove(&(tick, slot));
        self.evict(slot);
        Some(slot)
    }

    fn evict(&mut self, slot: usize) {
        let e = self.slots[slot].take().expect("evicted entries are held");
        debug_assert_eq!(e.children, 0, "only leaves are evicted");
        if let Some(v) = self.by_hash.get_mut(&e.hash) {
            v.retain(|&s| s != slot);
            if v.is_empty() {
                self.by_hash.remove(&e.hash);
            }
        }
        if let Some(p) = e.parent_slot
            && let Some(parent) = self.slots[p].as_mut()
        {
            parent.children -= 1;
            if parent.children == 0 {
                self.lru.insert((parent.tick, p));
            }
        }
        self.counters.evictions += 1;
    }

    /// Returns the slots of an unpublished plan.
    fn reclaim_pending(&mut self) {
        for (slot, _) in std::mem::take(&mut self.pending) {
            self.free.push(slot);
        }
    }
}

#[cfg(test)]
mod tests;
