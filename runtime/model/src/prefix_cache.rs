//! The prefix cache's index, shared by every engine: which prompt prefixes
//! have their KV held, in which slot of which of the engine's two block
//! pools, and the rules of reuse, eviction, demotion and publication. The
//! engines own the bytes (the CUDA engine a VRAM pool and a page-locked
//! host pool, the reference engine two host pools) and do the copies; this
//! module never sees them, so both engines follow exactly the same rules
//! (design: `docs/notes/prefix-cache.md`).
//!
//! - **Blocks.** A prompt is cut into blocks of `block_tokens` tokens from
//!   position 0; only whole blocks are held. Any prefill rows may form a
//!   block (the engines' prefills are chunk-boundary invariant), so the
//!   block size is the engine's `--prefix-block`, independent of its
//!   prefill chunk.
//! - **Keys.** Block `i` of a prompt is keyed by its exact token ids and the
//!   identity of the entry holding block `i - 1` (a unique id, never
//!   reused), so a hit means the whole prefix up to and including the
//!   block is token-for-token the same. The hash only finds candidates; the
//!   tokens and the parent are compared exactly.
//! - **Tiers.** Every held block is in one tier: [`Tier::Primary`] (the
//!   engine's fast pool) or [`Tier::Secondary`] (the RAM tier). New blocks
//!   enter the primary tier; when it is full, its least recently used block
//!   is *demoted* (the engine copies it to a secondary slot, the index moves
//!   it there), so a chain may span both tiers and a hit restores each
//!   block from wherever it is. A primary tier of no slots stores straight
//!   into the secondary.
//! - **Reuse.** [`PrefixCache::lookup`] returns the longest chain of held
//!   blocks that leaves at least one prompt token to prefill (the last
//!   position's logits must be computed).
//! - **Transactions.** Blocks are stored only after a prefill completed:
//!   [`PrefixCache::plan_store`] reserves slots (demoting and evicting as
//!   needed), the engine copies the sequence's KV into them, and
//!   [`PrefixCache::publish`] makes them visible. A plan that is never
//!   published (the copy failed, the request was dropped) is reclaimed by
//!   the next call, so nothing partial is ever found. A demotion is
//!   complete when `plan_store` returns (the engine copied the block when
//!   asked, before any later copy on its stream).
//! - **Eviction.** Least recently used first, never the chain a store
//!   extends. Dropping a block (from the secondary tier, or from the
//!   primary when there is no secondary room) takes leaves only (an entry
//!   with held children stays: its children are unreachable without it);
//!   demotion may move any block, as it stays held. A store that finds no
//!   slot stores fewer blocks; a request never fails for the cache.
//! - **Binding.** Cached KV is valid only for the engine state that
//!   computed it. Engines pass a binding (model settings that change the
//!   KV: activation emulation, planted faults) to [`PrefixCache::bind`],
//!   which drops everything when it changes.

use krasis_common::status::{PrefixCacheStats, PrefixTierStats};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::hash::{Hash, Hasher};

/// Which of the engine's pools holds a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// The fast pool (CUDA: VRAM; reference: host memory).
    Primary,
    /// The RAM tier blocks are demoted to (CUDA: page-locked host memory).
    Secondary,
}

impl Tier {
    pub const ALL: [Tier; 2] = [Tier::Primary, Tier::Secondary];

    /// The tier's position in [`Tier::ALL`] (per-tier tables index by it).
    pub fn index(self) -> usize {
        match self {
            Tier::Primary => 0,
            Tier::Secondary => 1,
        }
    }
}

/// A held block's tier and slot in that tier's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Place {
    pub tier: Tier,
    pub slot: usize,
}

/// A request's reuse: the places of the held blocks that start its prompt,
/// in order (block `i` of the prompt at `blocks[i]`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Hit {
    pub blocks: Vec<Place>,
    /// Prompt tokens the blocks cover (`blocks.len() * block_tokens`).
    pub tokens: usize,
    /// (entry index, entry id) of the chain (the parents of the blocks a
    /// store adds).
    chain: Vec<(usize, u64)>,
}

impl Hit {
    /// `(prompt block, slot)` of the hit's blocks in `tier`.
    pub fn in_tier(&self, tier: Tier) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.blocks
            .iter()
            .enumerate()
            .filter(move |(_, p)| p.tier == tier)
            .map(|(i, p)| (i, p.slot))
    }
}

/// Places reserved for the blocks a completed prefill stores: the engine
/// copies prompt block `block` of the sequence's KV into `place` for each,
/// then calls [`PrefixCache::publish`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorePlan {
    pub blocks: Vec<StoreBlock>,
    /// The prompt's blocks past the hit that were held already (before the
    /// first new one), with their places: an engine that keeps part of a
    /// block's KV only for some blocks may complete them (the CUDA
    /// engine's sliding layers); their bytes are the same for every prompt
    /// that starts with their tokens.
    pub held: Vec<StoreBlock>,
    id: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreBlock {
    /// Block index in the prompt (positions `block * block_tokens ..`).
    pub block: usize,
    pub place: Place,
}

/// A held block moving from primary slot `from` to secondary slot `to`: the
/// engine copies the bytes (before any later write to `from`) and returns
/// whether it could.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Demotion {
    pub from: usize,
    pub to: usize,
}

#[derive(Debug)]
struct Entry {
    uid: u64,
    /// Entry id of the previous block (0: this is the prompt's first block).
    parent_uid: u64,
    /// Entry index of the previous block.
    parent: Option<usize>,
    tokens: Box<[u32]>,
    hash: u64,
    /// Published entries whose parent this is.
    children: usize,
    /// Last use (a hit through it, or its store).
    tick: u64,
    place: Place,
}

/// A reserved, unpublished block: its parent is held (an entry index) or
/// the pending block before it.
#[derive(Debug)]
struct Pending {
    uid: u64,
    parent_uid: u64,
    parent: Option<usize>,
    parent_pending: bool,
    tokens: Box<[u32]>,
    hash: u64,
    place: Place,
}

#[derive(Debug, Default)]
struct TierState {
    location: &'static str,
    /// Entry index per slot; `None`: free or reserved by the pending plan.
    slots: Vec<Option<usize>>,
    free: Vec<usize>,
    /// Entries that may leave this tier (demoted or dropped), oldest first.
    lru: BTreeSet<(u64, usize)>,
    hits: u64,
    blocks_restored: u64,
    blocks_in: u64,
    evictions: u64,
    restore_ms: f64,
    last_restore_ms: f64,
}

impl TierState {
    fn new(location: &'static str, slots: usize) -> Self {
        TierState {
            location,
            slots: vec![None; slots],
            // Popped from the end: slot 0 is used first.
            free: (0..slots).rev().collect(),
            ..TierState::default()
        }
    }

    fn held(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }
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
    demotions: u64,
    invalidations: u64,
}

pub struct PrefixCache {
    block_tokens: usize,
    /// Tokens a hit and a store come in (a multiple of the block; the
    /// block by default): see [`Self::set_reuse_granule`].
    granule: usize,
    block_bytes: u64,
    tiers: [TierState; 2],
    /// Held entries by index (freed indices are reused; ids never are).
    entries: Vec<Option<Entry>>,
    free_entries: Vec<usize>,
    /// Key hash → entry indices with that hash.
    by_hash: HashMap<u64, Vec<usize>>,
    pending: Vec<Pending>,
    pending_id: u64,
    tick: u64,
    next_uid: u64,
    binding: Option<u64>,
    counters: Counters,
    store_ms: f64,
}

impl std::fmt::Debug for PrefixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixCache")
            .field("block_tokens", &self.block_tokens)
            .field("primary", &self.capacity(Tier::Primary))
            .field("secondary", &self.capacity(Tier::Secondary))
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
    /// An empty cache of blocks of `block_tokens` tokens, each
    /// `block_bytes` of the engine's pools: `primary` = (location, slots)
    /// of the fast pool (`vram`, `host`), `secondary` the RAM tier's (0
    /// slots: none).
    pub fn new(
        block_tokens: usize,
        block_bytes: u64,
        primary: (&'static str, usize),
        secondary: (&'static str, usize),
    ) -> Self {
        assert!(
            block_tokens > 0,
            "a prefix cache block holds at least one token"
        );
        PrefixCache {
            block_tokens,
            granule: block_tokens,
            block_bytes,
            tiers: [
                TierState::new(primary.0, primary.1),
                TierState::new(secondary.0, secondary.1),
            ],
            entries: Vec::new(),
            free_entries: Vec::new(),
            by_hash: HashMap::new(),
            pending: Vec::new(),
            pending_id: 0,
            tick: 0,
            next_uid: 1,
            binding: None,
            counters: Counters::default(),
            store_ms: 0.0,
        }
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Makes every hit cover, and every store reach, a multiple of
    /// `tokens` (a multiple of the block) from the prompt's start: an
    /// engine whose prefill is exact only over whole chunks of one grid
    /// sets its prefill chunk, so a resumed prefill runs the chunks a cold
    /// one runs and every stored block comes from a complete chunk.
    pub fn set_reuse_granule(&mut self, tokens: usize) {
        assert!(
            tokens > 0 && tokens.is_multiple_of(self.block_tokens),
            "a reuse granule of {tokens} tokens is not a multiple of the {}-token block",
            self.block_tokens
        );
        self.granule = tokens;
    }

    pub fn reuse_granule(&self) -> usize {
        self.granule
    }

    /// Slots of `tier`'s pool.
    pub fn capacity(&self, tier: Tier) -> usize {
        self.tiers[tier.index()].slots.len()
    }

    /// Blocks held (published), in both tiers.
    pub fn held(&self) -> usize {
        self.tiers.iter().map(TierState::held).sum()
    }

    /// Blocks held in `tier`.
    pub fn held_in(&self, tier: Tier) -> usize {
        self.tiers[tier.index()].held()
    }

    /// The binding the held blocks were computed under (none bound yet).
    pub fn bound(&self) -> Option<u64> {
        self.binding
    }

    /// Bytes of one block in the engine's pools.
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
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
        for t in &mut self.tiers {
            t.slots.iter_mut().for_each(|s| *s = None);
            t.free = (0..t.slots.len()).rev().collect();
            t.lru.clear();
        }
        self.entries.clear();
        self.free_entries.clear();
        self.by_hash.clear();
    }

    /// A request that asked not to use the cache (counted only).
    pub fn note_bypass(&mut self) {
        self.counters.bypassed += 1;
    }

    /// The longest chain of held blocks starting `prompt` that leaves at
    /// least one token to prefill; the chain becomes the most recently used.
    pub fn lookup(&mut self, prompt: &[u32]) -> Hit {
        self.lookup_where(prompt, &mut |_| true)
    }

    /// [`Self::lookup`] for an engine that can resume a prompt only after
    /// some chains: the longest chain (in whole granules) whose places
    /// satisfy `resumable` (the CUDA engine keeps gpt-oss's sliding-window
    /// KV only for the blocks at the end of each prompt it stored, and a
    /// resumed prefill needs the window before the hit's end). Blocks past
    /// it are neither used nor touched.
    pub fn lookup_where(
        &mut self,
        prompt: &[u32],
        resumable: &mut dyn FnMut(&[Place]) -> bool,
    ) -> Hit {
        self.reclaim_pending();
        self.tick += 1;
        let b = self.block_tokens;
        let usable = prompt.len().saturating_sub(1) / self.granule * self.granule / b;
        let mut hit = Hit::default();
        let mut parent = 0u64;
        for block in prompt.chunks_exact(b).take(usable) {
            let Some(i) = self.find(parent, block) else {
                break;
            };
            let e = self.entry(i);
            parent = e.uid;
            hit.blocks.push(e.place);
            hit.chain.push((i, e.uid));
        }
        // A chain that ends inside a granule is used up to its start, and
        // only as far as the engine can resume.
        let per = (self.granule / b).max(1);
        let mut whole = hit.blocks.len() / per * per;
        while whole > 0 && !resumable(&hit.blocks[..whole]) {
            whole -= per;
        }
        hit.blocks.truncate(whole);
        hit.chain.truncate(whole);
        for &(i, _) in &hit.chain {
            self.touch(i);
        }
        hit.tokens = hit.blocks.len() * b;
        self.counters.lookups += 1;
        if hit.blocks.is_empty() {
            self.counters.misses += 1;
        } else {
            self.counters.hits += 1;
            self.counters.cached_tokens += hit.tokens as u64;
        }
        for t in Tier::ALL {
            let n = hit.in_tier(t).count() as u64;
            let ts = &mut self.tiers[t.index()];
            ts.blocks_restored += n;
            ts.hits += u64::from(n > 0);
        }
        hit
    }

    /// Reserves places for the whole blocks of `prompt` (prefilled to its
    /// end) that follow `hit` and are not held yet, demoting (through
    /// `demote`) and evicting least recently used blocks outside the
    /// prompt's own chain; stops at the first block it finds no place for.
    /// Nothing is visible until [`Self::publish`].
    pub fn plan_store(
        &mut self,
        prompt: &[u32],
        hit: &Hit,
        demote: &mut dyn FnMut(Demotion) -> bool,
    ) -> StorePlan {
        self.reclaim_pending();
        self.pending_id += 1;
        let id = self.pending_id;
        let stale = hit.chain.iter().any(|&(i, uid)| {
            self.entries.get(i).and_then(Option::as_ref).map(|e| e.uid) != Some(uid)
        });
        if stale {
            // The cache was cleared or rebound since the lookup.
            return StorePlan {
                blocks: Vec::new(),
                held: Vec::new(),
                id,
            };
        }
        let b = self.block_tokens;
        let mut parent_uid = hit.chain.last().map_or(0, |c| c.1);
        let mut parent = hit.chain.last().map(|c| c.0);
        // The chain the new blocks hang from must stay where it is.
        let mut keep: HashSet<usize> = hit.chain.iter().map(|c| c.0).collect();
        let mut blocks = Vec::new();
        let mut held = Vec::new();
        let complete = prompt.len() / self.granule * self.granule;
        for (i, block) in prompt[..complete]
            .chunks_exact(b)
            .enumerate()
            .skip(hit.chain.len())
        {
            if blocks.is_empty()
                && let Some(e) = self.find(parent_uid, block)
            {
                // Held already (the last whole block, which a lookup never
                // returns, or blocks another request stored meanwhile).
                self.touch(e);
                keep.insert(e);
                parent_uid = self.entry(e).uid;
                parent = Some(e);
                held.push(StoreBlock {
                    block: i,
                    place: self.entry(e).place,
                });
                continue;
            }
            let Some(place) = self.take_place(&keep, demote) else {
                break;
            };
            let uid = self.next_uid;
            self.next_uid += 1;
            self.pending.push(Pending {
                uid,
                parent_uid,
                parent,
                parent_pending: !blocks.is_empty(),
                tokens: block.into(),
                hash: key_hash(parent_uid, block),
                place,
            });
            blocks.push(StoreBlock { block: i, place });
            parent_uid = uid;
            parent = None;
        }
        StorePlan { blocks, held, id }
    }

    /// Makes the blocks of `plan` visible (their bytes are in the pools).
    /// False, with nothing published, for a plan that is no longer pending
    /// (another call reclaimed it).
    pub fn publish(&mut self, plan: StorePlan) -> bool {
        if plan.id != self.pending_id || plan.blocks.len() != self.pending.len() {
            return false;
        }
        let mut prev: Option<usize> = None;
        for p in std::mem::take(&mut self.pending) {
            let parent = if p.parent_pending { prev } else { p.parent };
            let idx = self.alloc_entry(Entry {
                uid: p.uid,
                parent_uid: p.parent_uid,
                parent,
                tokens: p.tokens,
                hash: p.hash,
                children: 0,
                tick: self.tick,
                place: p.place,
            });
            if let Some(par) = parent {
                self.relist(par, |e| e.children += 1);
            }
            self.by_hash.entry(p.hash).or_default().push(idx);
            let t = &mut self.tiers[p.place.tier.index()];
            t.slots[p.place.slot] = Some(idx);
            t.blocks_in += 1;
            self.list(idx);
            self.counters.blocks_stored += 1;
            prev = Some(idx);
        }
        true
    }

    /// Adds the time the engine spent restoring a hit's blocks from `tier`.
    pub fn record_restore_ms(&mut self, tier: Tier, ms: f64) {
        let t = &mut self.tiers[tier.index()];
        t.restore_ms += ms;
        t.last_restore_ms = ms;
    }

    /// Adds the time the engine spent copying a plan's blocks (and the
    /// demotions it made).
    pub fn record_store_ms(&mut self, ms: f64) {
        self.store_ms += ms;
    }

    pub fn stats(&self) -> PrefixCacheStats {
        let c = self.counters;
        let bb = self.block_bytes;
        let tiers: Vec<PrefixTierStats> = self
            .tiers
            .iter()
            .filter(|t| !t.slots.is_empty())
            .map(|t| PrefixTierStats {
                location: t.location.to_string(),
                capacity_blocks: t.slots.len() as u64,
                capacity_bytes: t.slots.len() as u64 * bb,
                blocks_held: t.held() as u64,
                bytes_held: t.held() as u64 * bb,
                hits: t.hits,
                blocks_restored: t.blocks_restored,
                bytes_restored: t.blocks_restored * bb,
                restore_ms: t.restore_ms,
                last_restore_ms: t.last_restore_ms,
                blocks_in: t.blocks_in,
                evictions: t.evictions,
            })
            .collect();
        let sum = |f: fn(&PrefixTierStats) -> u64| tiers.iter().map(f).sum::<u64>();
        let restore_ms = tiers.iter().map(|t| t.restore_ms).sum();
        PrefixCacheStats {
            location: tiers
                .iter()
                .map(|t| t.location.as_str())
                .collect::<Vec<_>>()
                .join("+"),
            block_tokens: self.block_tokens as u64,
            capacity_blocks: sum(|t| t.capacity_blocks),
            capacity_bytes: sum(|t| t.capacity_bytes),
            blocks_held: sum(|t| t.blocks_held),
            bytes_held: sum(|t| t.bytes_held),
            lookups: c.lookups,
            hits: c.hits,
            misses: c.misses,
            bypassed: c.bypassed,
            cached_tokens: c.cached_tokens,
            blocks_stored: c.blocks_stored,
            evictions: c.evictions,
            demotions: c.demotions,
            invalidations: c.invalidations,
            restore_ms,
            last_restore_ms: tiers.iter().map(|t| t.last_restore_ms).fold(0.0, f64::max),
            store_ms: self.store_ms,
            tiers,
        }
    }

    fn entry(&self, i: usize) -> &Entry {
        self.entries[i].as_ref().expect("indexed entries are held")
    }

    fn alloc_entry(&mut self, e: Entry) -> usize {
        match self.free_entries.pop() {
            Some(i) => {
                self.entries[i] = Some(e);
                i
            }
            None => {
                self.entries.push(Some(e));
                self.entries.len() - 1
            }
        }
    }

    fn find(&self, parent: u64, tokens: &[u32]) -> Option<usize> {
        self.by_hash
            .get(&key_hash(parent, tokens))?
            .iter()
            .copied()
            .find(|&i| {
                self.entries[i]
                    .as_ref()
                    .is_some_and(|e| e.parent_uid == parent && *e.tokens == *tokens)
            })
    }

    /// Whether entry `i` may leave its tier: demoted from the primary tier
    /// (when there is a secondary one), or else dropped as a leaf.
    fn evictable(&self, i: usize) -> bool {
        let e = self.entry(i);
        (e.place.tier == Tier::Primary && !self.tiers[1].slots.is_empty()) || e.children == 0
    }

    fn list(&mut self, i: usize) {
        if self.evictable(i) {
            let e = self.entry(i);
            let key = (e.tick, i);
            self.tiers[e.place.tier.index()].lru.insert(key);
        }
    }

    fn unlist(&mut self, i: usize) {
        let e = self.entry(i);
        let key = (e.tick, i);
        self.tiers[e.place.tier.index()].lru.remove(&key);
    }

    /// Changes entry `i` with its LRU membership kept right.
    fn relist(&mut self, i: usize, f: impl FnOnce(&mut Entry)) {
        self.unlist(i);
        f(self.entries[i].as_mut().expect("indexed entries are held"));
        self.list(i);
    }

    /// Marks entry `i` used now.
    fn touch(&mut self, i: usize) {
        let tick = self.tick;
        self.relist(i, |e| e.tick = tick);
    }

    /// The oldest entry of `tier`'s LRU outside `keep` (and, with
    /// `leaf_only`, without children).
    fn oldest(&self, tier: Tier, keep: &HashSet<usize>, leaf_only: bool) -> Option<usize> {
        self.tiers[tier.index()]
            .lru
            .iter()
            .map(|&(_, i)| i)
            .find(|i| !keep.contains(i) && (!leaf_only || self.entry(*i).children == 0))
    }

    /// A place for a new block: a free primary slot; else the primary
    /// slot of its least recently used block, demoted to the secondary
    /// tier (or dropped when that has no room and it is a leaf); else,
    /// when the primary tier has none to give, a secondary slot.
    fn take_place(
        &mut self,
        keep: &HashSet<usize>,
        demote: &mut dyn FnMut(Demotion) -> bool,
    ) -> Option<Place> {
        let primary = |slot| Place {
            tier: Tier::Primary,
            slot,
        };
        if let Some(s) = self.tiers[0].free.pop() {
            return Some(primary(s));
        }
        if !self.tiers[1].slots.is_empty()
            && let Some(v) = self.oldest(Tier::Primary, keep, false)
            && let Some(to) = self.secondary_slot(keep)
        {
            let from = self.entry(v).place.slot;
            if demote(Demotion { from, to }) {
                self.relist(v, |e| {
                    e.place = Place {
                        tier: Tier::Secondary,
                        slot: to,
                    }
                });
                self.tiers[0].slots[from] = None;
                self.tiers[0].evictions += 1;
                let t = &mut self.tiers[1];
                t.slots[to] = Some(v);
                t.blocks_in += 1;
                self.counters.demotions += 1;
                return Some(primary(from));
            }
            // The engine could not copy it: the secondary slot stays free
            // and the block is dropped below if it is a leaf.
            self.tiers[1].free.push(to);
        }
        if let Some(v) = self.oldest(Tier::Primary, keep, true) {
            let slot = self.entry(v).place.slot;
            self.drop_entry(v);
            return Some(primary(slot));
        }
        self.secondary_slot(keep).map(|slot| Place {
            tier: Tier::Secondary,
            slot,
        })
    }

    /// A free secondary slot, or the slot of its least recently used leaf
    /// outside `keep` (dropped).
    fn secondary_slot(&mut self, keep: &HashSet<usize>) -> Option<usize> {
        if let Some(s) = self.tiers[1].free.pop() {
            return Some(s);
        }
        let v = self.oldest(Tier::Secondary, keep, true)?;
        let slot = self.entry(v).place.slot;
        self.drop_entry(v);
        Some(slot)
    }

    /// Drops leaf entry `i`; its slot is the caller's (not made free).
    fn drop_entry(&mut self, i: usize) {
        self.unlist(i);
        let e = self.entries[i].take().expect("dropped entries are held");
        debug_assert_eq!(e.children, 0, "only leaves are dropped");
        self.free_entries.push(i);
        if let Some(v) = self.by_hash.get_mut(&e.hash) {
            v.retain(|&x| x != i);
            if v.is_empty() {
                self.by_hash.remove(&e.hash);
            }
        }
        let t = &mut self.tiers[e.place.tier.index()];
        t.slots[e.place.slot] = None;
        t.evictions += 1;
        if let Some(p) = e.parent
            && self.entries[p]
                .as_ref()
                .is_some_and(|pe| pe.uid == e.parent_uid)
        {
            self.relist(p, |pe| pe.children -= 1);
        }
        self.counters.evictions += 1;
    }

    /// Returns the places of an unpublished plan.
    fn reclaim_pending(&mut self) {
        for p in std::mem::take(&mut self.pending) {
            self.tiers[p.place.tier.index()].free.push(p.place.slot);
        }
    }
}

pub mod persist;

#[cfg(test)]
mod tests;
