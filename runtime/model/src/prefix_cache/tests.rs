//! The index's rules on token ids alone (the engines' exactness tests are in
//! `reference/tests/prefix.rs` and `runtime/gpu/tests/prefix_cache.rs`).

use super::*;

const B: usize = 4;

fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

/// One tier of `slots` blocks (`host`), no second tier.
fn one_tier(slots: usize, block_bytes: u64) -> PrefixCache {
    PrefixCache::new(B, block_bytes, ("host", slots), ("host-ram", 0))
}

fn two_tiers(primary: usize, secondary: usize) -> PrefixCache {
    PrefixCache::new(B, 10, ("vram", primary), ("host", secondary))
}

/// Looks up, then stores what follows, as an engine does after a prefill
/// (every demotion succeeds and is recorded in `moves`).
fn serve_moving(
    c: &mut PrefixCache,
    prompt: &[u32],
    moves: &mut Vec<Demotion>,
) -> (Hit, Vec<StoreBlock>) {
    let hit = c.lookup(prompt);
    let plan = c.plan_store(prompt, &hit, &mut |d| {
        moves.push(d);
        true
    });
    let blocks = plan.blocks.clone();
    assert!(c.publish(plan));
    (hit, blocks)
}

fn serve(c: &mut PrefixCache, prompt: &[u32]) -> (Hit, Vec<StoreBlock>) {
    serve_moving(c, prompt, &mut Vec::new())
}

fn tiers_of(hit: &Hit) -> Vec<Tier> {
    hit.blocks.iter().map(|p| p.tier).collect()
}

#[test]
fn a_prompt_reuses_whole_blocks_and_always_leaves_a_token_to_prefill() {
    let mut c = one_tier(16, 100);
    let p = toks(0..10); // 2 whole blocks + 2 tokens
    let (hit, stored) = serve(&mut c, &p);
    assert_eq!(hit.tokens, 0);
    assert_eq!(
        stored.iter().map(|s| s.block).collect::<Vec<_>>(),
        vec![0, 1]
    );
    // The same prompt again: both blocks.
    let (hit, stored) = serve(&mut c, &p);
    assert_eq!(hit.tokens, 8);
    assert!(stored.is_empty());
    // A prompt of exactly 2 blocks reuses only the first: its last token
    // must be prefilled for the logits; the second is held already.
    let (hit, stored) = serve(&mut c, &p[..8]);
    assert_eq!(hit.tokens, 4);
    assert!(stored.is_empty(), "{stored:?}");
    // A longer prompt reuses 2 and stores its third whole block.
    let longer = toks(0..13);
    let (hit, stored) = serve(&mut c, &longer);
    assert_eq!(hit.tokens, 8);
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].block, 2);
    // A prompt shorter than a block neither reuses nor stores.
    let (hit, stored) = serve(&mut c, &p[..3]);
    assert_eq!((hit.tokens, stored.len()), (0, 0));
    let s = c.stats();
    assert_eq!((s.lookups, s.hits, s.misses), (5, 3, 2));
    assert_eq!(s.cached_tokens, 8 + 4 + 8);
    assert_eq!(
        (s.blocks_held, s.bytes_held, s.capacity_bytes),
        (3, 300, 1600)
    );
    assert_eq!(s.location, "host");
    assert_eq!(s.tiers.len(), 1, "a tier of no slots is not listed");
    assert_eq!(s.tiers[0].blocks_restored, 2 + 1 + 2);
    assert_eq!(s.tiers[0].bytes_restored, 500);
}

#[test]
fn a_block_matches_only_after_the_same_prefix() {
    let mut c = one_tier(16, 1);
    let a = toks(0..9);
    serve(&mut c, &a);
    // Same second block, different first block: nothing is reused, and a
    // change inside the first block breaks the chain at the first block.
    let mut b = a.clone();
    b[1] = 99;
    assert_eq!(c.lookup(&b).tokens, 0);
    let mut d = a.clone();
    d[5] = 99;
    assert_eq!(c.lookup(&d).tokens, 4);
    // Two conversations sharing a first block: both chains are held and
    // each prompt gets its own second block.
    serve(&mut c, &d);
    assert_eq!(c.lookup(&a).tokens, 8);
    assert_eq!(c.lookup(&d).tokens, 8);
    assert_eq!(c.held(), 3);
}

#[test]
fn eviction_takes_least_recently_used_leaves_and_spares_the_extended_chain() {
    let mut c = one_tier(3, 1);
    let a = toks(0..9); // blocks a0 a1
    let b = toks(100..105); // block b0
    serve(&mut c, &a);
    serve(&mut c, &b);
    assert_eq!(c.held(), 3);
    // a is used again: b0 is now the least recently used leaf.
    assert_eq!(c.lookup(&a).tokens, 8);
    let d = toks(200..205);
    let (_, stored) = serve(&mut c, &d);
    assert_eq!(stored.len(), 1);
    assert_eq!(c.lookup(&b).tokens, 0, "b0 was evicted");
    assert_eq!(c.lookup(&a).tokens, 8);
    // Extending a by two blocks with a full pool: only leaves outside a's
    // chain may go (d0), so one block is stored, never a0 or a1.
    let longer = toks(0..17);
    let (hit, stored) = serve(&mut c, &longer);
    assert_eq!(hit.tokens, 8);
    assert_eq!(stored.len(), 1, "{stored:?}");
    assert_eq!(c.lookup(&longer).tokens, 12);
    assert_eq!(c.stats().evictions, 2);
    // A parent is never evicted before its children: with a0 a1 a2 held
    // and a new chain needing 3 slots, a2 goes first, then a1, then a0.
    let e = toks(300..313);
    let (_, stored) = serve(&mut c, &e);
    assert_eq!(stored.len(), 3);
    assert_eq!(c.lookup(&longer).tokens, 0);
    assert_eq!(c.lookup(&e).tokens, 12);
}

#[test]
fn nothing_is_visible_before_publish_and_an_abandoned_plan_is_reclaimed() {
    let mut c = one_tier(2, 1);
    let a = toks(0..9);
    let hit = c.lookup(&a);
    let plan = c.plan_store(&a, &hit, &mut |_| true);
    assert_eq!(plan.blocks.len(), 2);
    // Not published (a cancelled or failed request's copy): invisible...
    assert_eq!(c.lookup(&a).tokens, 0);
    // ...and the lookup reclaimed its slots, so the stale plan cannot
    // publish and the slots serve the next store.
    assert!(!c.publish(plan));
    let (_, stored) = serve(&mut c, &a);
    assert_eq!(stored.len(), 2);
    assert_eq!(c.lookup(&a).tokens, 8);
    assert_eq!(c.stats().evictions, 0);
}

#[test]
fn a_changed_binding_drops_everything() {
    let mut c = two_tiers(1, 4);
    assert!(!c.bind(1));
    let a = toks(0..9);
    serve(&mut c, &a);
    assert!(!c.bind(1));
    assert_eq!(c.lookup(&a).tokens, 8);
    let hit = c.lookup(&a);
    assert!(c.bind(2));
    assert_eq!(c.held(), 0);
    // A hit from before the change stores nothing.
    assert!(c.plan_store(&a, &hit, &mut |_| true).blocks.is_empty());
    assert_eq!(c.lookup(&a).tokens, 0);
    assert_eq!(c.stats().invalidations, 1);
}

#[test]
fn a_cache_without_slots_never_hits_and_never_stores() {
    let mut c = two_tiers(0, 0);
    let a = toks(0..9);
    let (hit, stored) = serve(&mut c, &a);
    assert_eq!((hit.tokens, stored.len()), (0, 0));
    assert_eq!(serve(&mut c, &a).0.tokens, 0);
}

/// Hash collisions cannot produce a hit: keys compare the tokens and the
/// parent exactly (checked by planting two entries under one hash).
#[test]
fn a_hash_collision_is_not_a_hit() {
    let mut c = one_tier(4, 1);
    let a = toks(0..5);
    serve(&mut c, &a);
    let other = toks(50..55);
    // Move a's entry under the hash of `other`'s first block.
    let h_other = key_hash(0, &other[..B]);
    let i = c.lookup(&toks(0..5)).chain[0].0;
    let h_a = c.entries[i].as_ref().unwrap().hash;
    let v = c.by_hash.remove(&h_a).unwrap();
    c.by_hash.insert(h_other, v);
    assert_eq!(c.lookup(&other).tokens, 0);
}

/// The primary tier full, its least recently used blocks move to the
/// secondary one (the engine asked to copy each first), so a chain spans
/// both tiers and a hit restores each block from where it is.
#[test]
fn a_full_primary_tier_demotes_its_least_recently_used_blocks() {
    let mut c = two_tiers(2, 8);
    let a = toks(0..9); // a0 a1
    let mut moves = Vec::new();
    serve_moving(&mut c, &a, &mut moves);
    assert!(moves.is_empty());
    let b = toks(100..109); // b0 b1: a0 a1 go down
    let (_, stored) = serve_moving(&mut c, &b, &mut moves);
    assert!(stored.iter().all(|s| s.place.tier == Tier::Primary));
    assert_eq!(moves.len(), 2);
    let hit = c.lookup(&a);
    assert_eq!(hit.tokens, 8);
    assert_eq!(tiers_of(&hit), vec![Tier::Secondary, Tier::Secondary]);
    // The demotions named the slots a's blocks were in and are in now.
    let mut from: Vec<usize> = moves.iter().map(|m| m.from).collect();
    from.sort();
    assert_eq!(from, vec![0, 1]);
    let to: HashSet<usize> = moves.iter().map(|m| m.to).collect();
    assert_eq!(to, hit.blocks.iter().map(|p| p.slot).collect());
    // a extended: its new block enters the primary tier, demoting b's
    // least recently used block (never a's own chain); the chain now spans
    // both tiers.
    let longer = toks(0..13);
    let (hit, stored) = serve_moving(&mut c, &longer, &mut moves);
    assert_eq!(hit.tokens, 8);
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].place.tier, Tier::Primary);
    assert_eq!(moves.len(), 3);
    let hit = c.lookup(&longer);
    assert_eq!(
        tiers_of(&hit),
        vec![Tier::Secondary, Tier::Secondary, Tier::Primary]
    );
    assert_eq!(c.lookup(&b).tokens, 8, "b is held across the tiers");
    let s = c.stats();
    assert_eq!(s.location, "vram+host");
    assert_eq!(s.demotions, 3);
    assert_eq!(s.evictions, 0);
    assert_eq!((s.tiers[0].blocks_held, s.tiers[1].blocks_held), (2, 3));
    assert_eq!(s.tiers[0].evictions, 3);
    assert_eq!(s.tiers[1].blocks_in, 3);
    assert!(s.tiers[1].hits >= 3 && s.tiers[0].hits >= 2);
}

/// Without a primary tier the secondary one carries the cache; when it is
/// full its least recently used leaves are dropped, never a parent.
#[test]
fn without_a_primary_tier_blocks_go_straight_to_the_secondary() {
    let mut c = two_tiers(0, 3);
    let a = toks(0..9);
    let (_, stored) = serve(&mut c, &a);
    assert!(stored.iter().all(|s| s.place.tier == Tier::Secondary));
    assert_eq!(c.lookup(&a).tokens, 8);
    let b = toks(100..109);
    serve(&mut c, &b);
    // a1 (leaf, least recently used) went; a0 stays until it is a leaf.
    assert_eq!(c.lookup(&a).tokens, 4);
    assert_eq!(c.lookup(&b).tokens, 8);
    let s = c.stats();
    assert_eq!((s.evictions, s.demotions, s.blocks_held), (1, 0, 3));
    assert_eq!(s.location, "host");
}

/// A hit's chain is never demoted or dropped by its own store, however
/// small the primary tier: the new blocks go to the secondary tier.
#[test]
fn the_extended_chain_stays_where_it_is() {
    let mut c = two_tiers(2, 8);
    let a = toks(0..9);
    serve(&mut c, &a);
    let longer = toks(0..17);
    let mut moves = Vec::new();
    let (hit, stored) = serve_moving(&mut c, &longer, &mut moves);
    assert_eq!(tiers_of(&hit), vec![Tier::Primary, Tier::Primary]);
    assert!(moves.is_empty(), "{moves:?}");
    assert_eq!(stored.len(), 2);
    assert!(stored.iter().all(|s| s.place.tier == Tier::Secondary));
    assert_eq!(c.lookup(&longer).tokens, 16);
}

/// A demotion the engine could not copy drops the block instead (when it is
/// a leaf), and nothing points at the secondary slot.
#[test]
fn a_failed_demotion_drops_the_block() {
    let mut c = two_tiers(1, 4);
    let a = toks(0..5); // a0
    serve(&mut c, &a);
    let b = toks(100..105);
    let hit = c.lookup(&b);
    let plan = c.plan_store(&b, &hit, &mut |_| false);
    assert_eq!(plan.blocks.len(), 1);
    assert_eq!(plan.blocks[0].place.tier, Tier::Primary);
    assert!(c.publish(plan));
    assert_eq!(c.lookup(&a).tokens, 0, "a0 was dropped, not moved");
    let s = c.stats();
    assert_eq!((s.evictions, s.demotions), (1, 0));
    assert_eq!(s.tiers[1].blocks_held, 0);
}

/// With a reuse granule of 2 blocks (an engine exact only over whole
/// prefill chunks): a store reaches only whole granules, a hit covers a
/// whole number of them, and a chain ending inside a granule is used up to
/// its start.
#[test]
fn a_reuse_granule_bounds_hits_and_stores_to_whole_granules() {
    let mut c = one_tier(16, 100);
    c.set_reuse_granule(2 * B);
    assert_eq!(c.reuse_granule(), 8);
    // 14 tokens: one whole granule (blocks 0, 1); block 2 lies in an
    // incomplete granule and is not stored.
    let (hit, stored) = serve(&mut c, &toks(0..14));
    assert_eq!(hit.tokens, 0);
    assert_eq!(
        stored.iter().map(|s| s.block).collect::<Vec<_>>(),
        vec![0, 1]
    );
    // 20 tokens sharing the first 14: the hit is the granule (8 tokens);
    // the store adds blocks 2 and 3 (the second granule, now complete).
    let (hit, stored) = serve(&mut c, &toks(0..20));
    assert_eq!(hit.tokens, 8);
    assert_eq!(
        stored.iter().map(|s| s.block).collect::<Vec<_>>(),
        vec![2, 3]
    );
    // 15 tokens: blocks 0..3 are held, but a hit of 3 blocks would end
    // inside the second granule, and a hit must leave a token: 8 tokens.
    let (hit, _) = serve(&mut c, &toks(0..15));
    assert_eq!(hit.tokens, 8);
    // 17 tokens: both granules.
    let (hit, _) = serve(&mut c, &toks(0..17));
    assert_eq!(hit.tokens, 16);
}

#[test]
#[should_panic(expected = "not a multiple")]
fn a_reuse_granule_must_be_whole_blocks() {
    one_tier(4, 100).set_reuse_granule(B + 1);
}

/// `lookup_where` keeps the longest chain the engine can resume after
/// (here: one ending on an even slot) and counts only that as cached.
#[test]
fn a_lookup_stops_where_the_engine_cannot_resume() {
    let mut c = one_tier(4, 100);
    let p = toks(0..13); // 3 whole blocks + 1 token
    serve(&mut c, &p);
    let slots = |h: &Hit| h.blocks.iter().map(|pl| pl.slot).collect::<Vec<_>>();
    // Stored in slots 0, 1, 2; resumable only after a chain ending on an
    // even slot: blocks 0..3 end on slot 2.
    let even = &mut |pl: &[Place]| pl.last().is_some_and(|l| l.slot % 2 == 0);
    let hit = c.lookup_where(&p, even);
    assert_eq!((hit.tokens, slots(&hit)), (12, vec![0, 1, 2]));
    // Ending on an odd slot: back to block 0 (slot 0).
    let odd_last = &mut |pl: &[Place]| pl.len() != 3 && pl.last().is_some_and(|l| l.slot % 2 == 0);
    let hit = c.lookup_where(&p, odd_last);
    assert_eq!((hit.tokens, slots(&hit)), (4, vec![0]));
    // Nothing resumable: a miss, counted as one.
    let misses = c.stats().misses;
    let hit = c.lookup_where(&p, &mut |_| false);
    assert_eq!(hit.tokens, 0);
    assert_eq!(c.stats().misses, misses + 1);
    // The truncated hits counted only their blocks.
    assert_eq!(c.stats().cached_tokens, 12 + 4);
}

/// A store after a hit shorter than the held chain lists the held blocks
/// it passed (with their places) before the new ones, so an engine can
/// complete them.
#[test]
fn a_store_lists_the_held_blocks_past_the_hit() {
    let mut c = one_tier(8, 100);
    let p = toks(0..13); // 3 whole blocks + 1 token
    let (_, stored) = serve(&mut c, &p);
    let mut q = p.clone();
    q.extend(toks(50..58)); // 5 whole blocks + 1 token
    let hit = c.lookup_where(&q, &mut |pl| pl.len() == 1);
    assert_eq!(hit.tokens, 4);
    let plan = c.plan_store(&q, &hit, &mut |_| true);
    let held: Vec<(usize, Place)> = plan.held.iter().map(|s| (s.block, s.place)).collect();
    let want: Vec<(usize, Place)> = stored[1..].iter().map(|s| (s.block, s.place)).collect();
    assert_eq!(held, want);
    assert_eq!(
        plan.blocks.iter().map(|s| s.block).collect::<Vec<_>>(),
        vec![3, 4]
    );
    assert!(c.publish(plan));
}
