//! The reference engine's prefix cache: a prompt served from cached blocks
//! gives logits bit-identical to a cold prefill of the whole prompt (at
//! block boundaries, with a partly matching last block, across two
//! conversations sharing a prefix, after evictions, with blocks restored
//! from the RAM tier, under a changed setting), greedy generation is
//! unchanged, and a cancelled prefill or a bypassing request stores
//! nothing. Blocks are not whole prefill chunks: the engine prefills in
//! chunks of 7 tokens, so resumed prefills start mid-chunk and their chunks
//! fall elsewhere than a cold prefill's.

use super::*;
use std::sync::atomic::{AtomicBool, Ordering};

/// Tokens per block in these tests.
const B: usize = 16;
/// The prefill chunk: not a divisor of the block.
const CHUNK: usize = 7;

fn block_bytes(e: &ReferenceEngine) -> u64 {
    let g = e.geometry();
    (g.num_layers * 2 * B * g.kv_dim() * 4) as u64
}

/// A cache of `primary` first-tier blocks and `secondary` RAM-tier blocks.
fn tiered_engine(primary: usize, secondary: usize) -> ReferenceEngine {
    let mut e = engine(512);
    e.set_prefill_chunk(CHUNK);
    let bb = block_bytes(&e);
    e.set_prefix_cache(PrefixSizes {
        primary_bytes: primary as u64 * bb,
        secondary_bytes: secondary as u64 * bb,
        block_tokens: B,
    });
    let s = e.prefix_cache_stats().unwrap();
    assert_eq!(s.capacity_blocks, (primary + secondary) as u64);
    e
}

fn cached_engine(pool_blocks: usize) -> ReferenceEngine {
    tiered_engine(pool_blocks, 0)
}

/// `n` tokens of a sequence seeded by `seed`.
fn text(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(131) + seed * 977 + 7) % 512)
        .collect()
}

/// The last logits of a cold prefill of `prompt` in one chunk.
fn cold_last(prompt: &[u32]) -> Vec<f32> {
    let mut cold = engine(512);
    cold.set_prefill_chunk(512);
    cold.prompt_logits(prompt).unwrap().pop().unwrap()
}

/// `prompt` through the cached path: (last logits, cached tokens), checked
/// bit for bit against a cold prefill of the whole prompt.
fn served(e: &mut ReferenceEngine, prompt: &[u32], want_cached: usize) {
    let (logits, cached) = e.prefill_logits(prompt, true).unwrap();
    assert_eq!(
        cached,
        want_cached,
        "cached tokens of a {}-token prompt",
        prompt.len()
    );
    let cold = cold_last(prompt);
    assert!(
        logits
            .iter()
            .map(|v| v.to_bits())
            .eq(cold.iter().map(|v| v.to_bits())),
        "{}-token prompt with {cached} cached tokens differs from a cold prefill",
        prompt.len()
    );
}

#[test]
fn hits_at_block_boundaries_and_partial_blocks_are_bit_identical_to_cold() {
    let mut e = cached_engine(64);
    let p = text(70, 1); // 4 whole blocks + 6 tokens
    served(&mut e, &p, 0);
    served(&mut e, &p, 64);
    // Exactly 4 blocks: the last is recomputed for the logits.
    served(&mut e, &p[..64], 48);
    // One token past a block boundary.
    served(&mut e, &p[..49], 48);
    // A prompt that matches 2.5 blocks then differs: 2 blocks reused.
    let mut q = p[..40].to_vec();
    q.extend(text(30, 2));
    served(&mut e, &q, 32);
    // The conversation goes on: the earlier prompt plus a reply and a new
    // message reuses all 4 of its blocks.
    let mut next = p.clone();
    next.extend(text(50, 3));
    served(&mut e, &next, 64);
    served(&mut e, &next, 112);
}

#[test]
fn two_conversations_sharing_a_system_prompt_each_reuse_it() {
    let mut e = cached_engine(64);
    let system = text(40, 4);
    let conv = |seed| {
        let mut c = system.clone();
        c.extend(text(37, seed));
        c
    };
    let (a, b) = (conv(5), conv(6));
    served(&mut e, &a, 0);
    // B shares the 2 whole blocks of the system prompt.
    served(&mut e, &b, 32);
    // Each then finds its own blocks.
    served(&mut e, &a, 64);
    served(&mut e, &b, 64);
    let s = e.prefix_cache_stats().unwrap();
    assert_eq!(s.blocks_held, 2 + 2 + 2);
    assert_eq!((s.hits, s.misses), (3, 1));
}

#[test]
fn after_eviction_a_miss_recomputes_the_same_logits() {
    // Room for 3 blocks: each 4-block prompt evicts the other's blocks.
    let mut e = cached_engine(3);
    let (a, b) = (text(70, 7), text(70, 8));
    served(&mut e, &a, 0);
    served(&mut e, &b, 0);
    assert!(e.prefix_cache_stats().unwrap().evictions >= 3);
    served(&mut e, &a, 0);
    served(&mut e, &a, 48);
}

#[test]
fn greedy_generation_is_unchanged_and_reports_cached_tokens() {
    let p = text(60, 9);
    let mut plain = engine(512);
    let (want, _) = run(&mut plain, &request(&p, 12));
    let mut e = cached_engine(64);
    let mut req = request(&p, 12);
    req.cache_prompt = true;
    for cached in [0, 48] {
        let (got, o) = run(&mut e, &req);
        assert_eq!(got, want);
        assert_eq!(o.stats.cached_tokens, cached);
    }
    // The second turn: prompt + its reply + more; decode never stored
    // anything (the reply's KV came from decode, not prefill).
    let mut turn2 = p.clone();
    turn2.extend(&want);
    turn2.extend(text(20, 10));
    let (want2, _) = run(&mut plain, &request(&turn2, 8));
    req.prompt = turn2;
    req.max_new_tokens = 8;
    let (got2, o) = run(&mut e, &req);
    assert_eq!(got2, want2);
    assert_eq!(o.stats.cached_tokens, 48);
    // Bypassing the cache: nothing reused, nothing stored.
    let held = e.prefix_cache_stats().unwrap().blocks_held;
    req.cache_prompt = false;
    let (got2b, o) = run(&mut e, &req);
    assert_eq!(got2b, want2);
    assert_eq!(o.stats.cached_tokens, 0);
    let s = e.prefix_cache_stats().unwrap();
    assert_eq!((s.bypassed, s.blocks_held), (1, held));
}

#[test]
fn a_cancelled_prefill_stores_nothing() {
    let mut e = cached_engine(64);
    let p = text(480, 11);
    let flag = Arc::new(AtomicBool::new(false));
    let mut req = request(&p, 4);
    req.cache_prompt = true;
    req.cancel = CancelToken::new(flag.clone());
    // The cancel token is set once 3 of the 69 chunks are done.
    e.cancel_after_chunks = Some((3, flag.clone()));
    let (tokens, o) = run(&mut e, &req);
    e.cancel_after_chunks = None;
    assert!(flag.load(Ordering::Relaxed));
    assert_eq!((o.finish, tokens.len()), (FinishReason::Cancelled, 0));
    assert_eq!(
        req.live.prefilled(),
        3 * CHUNK as u64,
        "cancelled mid-prefill"
    );
    assert_eq!(e.prefix_cache_stats().unwrap().blocks_held, 0);
    // Cancelled during the last chunk (all 69 ran): still nothing stored.
    flag.store(false, Ordering::Relaxed);
    e.cancel_after_chunks = Some((480_usize.div_ceil(CHUNK), flag.clone()));
    let (tokens, o) = run(&mut e, &req);
    e.cancel_after_chunks = None;
    assert_eq!((o.finish, tokens.len()), (FinishReason::Cancelled, 0));
    assert_eq!(req.live.prefilled(), p.len() as u64);
    assert_eq!(e.prefix_cache_stats().unwrap().blocks_held, 0);
    // The next request finds nothing and is exact.
    served(&mut e, &p, 0);
    assert_eq!(e.prefix_cache_stats().unwrap().blocks_held, 30);
}

#[test]
fn a_changed_setting_invalidates_the_cache() {
    let mut e = cached_engine(64);
    let p = text(50, 12);
    served(&mut e, &p, 0);
    served(&mut e, &p, 48);
    // Blocks computed in f32 are not the BF16 emulation's.
    e.set_activations(Activations::Bf16);
    let (logits, cached) = e.prefill_logits(&p, true).unwrap();
    assert_eq!(cached, 0);
    let mut cold = engine(512);
    cold.set_activations(Activations::Bf16);
    let want = cold.prompt_logits(&p).unwrap().pop().unwrap();
    assert_eq!(logits, want);
    assert_eq!(e.prefix_cache_stats().unwrap().invalidations, 1);
    // Back to f32 (invalidated again); a new prefill chunk changes nothing
    // (the prefill is chunk invariant): the blocks stay and are exact.
    e.set_activations(Activations::F32);
    served(&mut e, &p, 0);
    e.set_prefill_chunk(5);
    served(&mut e, &p, 48);
    let s = e.prefix_cache_stats().unwrap();
    assert_eq!((s.invalidations, s.block_tokens), (2, B as u64));
}

/// Blocks demoted to the RAM tier are restored from it bit for bit; a
/// chain spanning both tiers too; with no first tier the RAM tier carries
/// the cache; when the RAM tier is full its least recently used leaves go.
#[test]
fn blocks_restored_from_the_ram_tier_are_bit_identical_to_cold() {
    // 2 first-tier blocks, 8 in the RAM tier.
    let mut e = tiered_engine(2, 8);
    let (a, b) = (text(70, 21), text(70, 22)); // 4 whole blocks each
    served(&mut e, &a, 0);
    served(&mut e, &b, 0);
    let s = e.prefix_cache_stats().unwrap();
    assert!(s.demotions >= 2, "{s:?}");
    assert_eq!(s.location, "host+host-ram");
    // a's blocks: in the RAM tier now.
    served(&mut e, &a, 64);
    let s = e.prefix_cache_stats().unwrap();
    assert!(
        s.tiers[1].hits >= 1 && s.tiers[1].blocks_restored >= 2,
        "{s:?}"
    );
    // a conversation going on: its chain spans both tiers.
    let mut next = a.clone();
    next.extend(text(40, 23));
    served(&mut e, &next, 64);
    served(&mut e, &next, 96);
    // No first tier: the RAM tier alone, evicting leaves when full.
    let mut r = tiered_engine(0, 5);
    served(&mut r, &a, 0);
    served(&mut r, &a, 64);
    served(&mut r, &b, 0);
    let s = r.prefix_cache_stats().unwrap();
    assert_eq!((s.location.as_str(), s.evictions), ("host-ram", 3));
    served(&mut r, &b, 64);
    served(&mut r, &a, 16);
}

/// The restored blocks are what the prefill reads: corrupting a held block
/// changes the logits of the next hit (so the bit-identity above is not
/// a recomputation in disguise).
#[test]
fn restored_blocks_are_read_by_the_prefill() {
    let mut e = cached_engine(64);
    let p = text(40, 13);
    served(&mut e, &p, 0);
    e.prefix.as_mut().unwrap().corrupt_for_test();
    let (logits, cached) = e.prefill_logits(&p, true).unwrap();
    assert_eq!(cached, 32);
    assert_ne!(logits, cold_last(&p));
}

/// A restart through the cache's file: the next engine finds every block
/// of both tiers and its hits are bit-identical to a cold prefill; a
/// smaller cache takes the most recent conversation; a changed setting's
/// file, a damaged file and a file without the cache are refused.
#[test]
fn a_restart_through_the_file_is_bit_identical_to_cold() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("prefix.krspc");
    let model = "test model";
    let (a, b) = (text(70, 31), text(70, 32)); // 4 whole blocks each
    {
        let mut e = tiered_engine(2, 8);
        assert_eq!(e.set_prefix_file(&path, model).unwrap().in_file, 0);
        served(&mut e, &a, 0);
        served(&mut e, &b, 0);
        let saved = e.save_prefix_file().unwrap().unwrap();
        assert_eq!(saved.blocks, 8);
    }
    let mut e = tiered_engine(2, 8);
    let loaded = e.set_prefix_file(&path, model).unwrap();
    assert_eq!((loaded.in_file, loaded.blocks), (8, 8));
    served(&mut e, &a, 64);
    served(&mut e, &b, 64);
    let mut next = b.clone();
    next.extend(text(40, 33));
    served(&mut e, &next, 64);
    // The restored bytes are the ones read: a corrupted file's blocks
    // change the logits (the file's own checksum is bypassed here).
    e.prefix.as_mut().unwrap().corrupt_for_test();
    let (logits, cached) = e.prefill_logits(&a, true).unwrap();
    assert_eq!(cached, 64);
    assert_ne!(logits, cold_last(&a));

    // Room for one conversation: the most recent (b) is the one kept.
    let mut small = tiered_engine(0, 4);
    assert_eq!(small.set_prefix_file(&path, model).unwrap().blocks, 4);
    served(&mut small, &b, 64);
    served(&mut small, &a, 0);

    // Another model, another setting, no cache: refused, by name.
    let err = tiered_engine(2, 8)
        .set_prefix_file(&path, "another model")
        .unwrap_err();
    assert!(err.to_string().contains("different model"), "{err}");
    let mut bf16 = tiered_engine(2, 8);
    bf16.set_activations(Activations::Bf16);
    let err = bf16.set_prefix_file(&path, model).unwrap_err();
    assert!(err.to_string().contains("different binding"), "{err}");
    let err = engine(512).set_prefix_file(&path, model).unwrap_err();
    assert!(err.to_string().contains("prefix cache is off"), "{err}");
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
    let mut damaged = tiered_engine(2, 8);
    let err = damaged.set_prefix_file(&path, model).unwrap_err();
    assert!(err.to_string().contains("damaged"), "{err}");
    assert_eq!(damaged.prefix_cache_stats().unwrap().blocks_held, 0);
}
