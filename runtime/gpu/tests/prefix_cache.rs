//! The CUDA engine's prefix cache (`prefix.rs`) on the tiny synthetic
//! model, with blocks (64 tokens) that are not whole prefill chunks (the
//! cached engines prefill in chunks of 100, so a hit resumes mid-chunk and
//! the chunks fall elsewhere than a cold prefill's): a prompt served from
//! cached blocks gives prefill and decode logits bit-identical to a cold
//! prefill of the whole prompt in one chunk on an engine without a cache
//! (at block boundaries, with a partly matching last block, for two
//! conversations sharing a prefix, after evictions, with blocks restored
//! from the page-locked host tier and with a chain spanning both tiers, all
//! resident and under HCS with streamed prefill); a cancelled prefill
//! stores nothing; a bypassing request neither reads nor stores; a planted
//! fault invalidates the blocks; gpt_oss's sliding layers resume where
//! their window was kept (and a hit without its window restored differs).
//! On a machine without an NVIDIA driver
//! every test prints `SKIPPED (no CUDA device): <name> (no NVIDIA driver)`.

mod support;

use krasis_common::options::PrefixCacheChoice;
use krasis_gpu::{CudaEngine, CudaEngineOptions};
use krasis_model::{CancelToken, Engine, FinishReason, ModelConfig};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use support::{
    bits, cuda_options, generate_all, gpu_or_skip, greedy_request, load, no_resident_options,
    synth, tokens,
};

const CONTEXT: usize = 1024;
/// Tokens per block.
const B: usize = 64;
/// The cached engines' prefill chunk: not a multiple of the block.
const CHUNK: usize = 100;
/// The cold engine's chunk: every prompt here in one.
const COLD_CHUNK: usize = 1024;
/// Greedy tokens compared after each prefill (the first from prefill).
const N: usize = 6;

fn block_bytes(model: &Path) -> u64 {
    let g = ModelConfig::load(model).expect("config").geometry();
    krasis_gpu::prefix::block_bytes(&g, B)
}

/// `opts` with a VRAM pool of `vram` blocks and a host tier of `host`.
fn with_tiers(model: &Path, opts: CudaEngineOptions, vram: u64, host: u64) -> CudaEngineOptions {
    let bb = block_bytes(model);
    CudaEngineOptions {
        prefix_cache: PrefixCacheChoice::Bytes(vram * bb),
        prefix_cache_host: PrefixCacheChoice::Bytes(host * bb),
        prefix_block: B,
        ..opts
    }
}

struct Pair {
    cached: CudaEngine,
    /// The same model without a prefix cache, all resident, one chunk.
    cold: CudaEngine,
}

impl Pair {
    fn new(model: &Path, cache: &Path, cached: CudaEngineOptions) -> Self {
        let cold = CudaEngineOptions {
            hcs: false,
            ..cuda_options(cache, CONTEXT, COLD_CHUNK)
        };
        let p = Self::with_cold(model, cached, cold);
        assert!(p.cold.prefix_cache_stats().is_none());
        p
    }

    /// [`Pair::new`] with the cold engine's options given: gpt_oss's cold
    /// engine has a cache too (its MXFP4 experts take the way every
    /// prompt takes with the cache on: `CudaEngine::mxfp4_in_place_for`),
    /// which its cold prefills bypass (`greedy_logits`).
    fn with_cold(model: &Path, cached: CudaEngineOptions, cold: CudaEngineOptions) -> Self {
        let cached = load(model, &cached);
        let cold = load(model, &cold);
        assert_eq!(cached.load_report().prefill_chunk, CHUNK);
        assert_eq!(cold.load_report().prefill_chunk, COLD_CHUNK);
        assert_eq!(cached.load_report().prefix_block_tokens, B);
        assert!(cached.prefix_cache_stats().is_some(), "no prefix cache");
        Pair { cached, cold }
    }

    /// `prompt` through the cache: `want` tokens served, and the greedy
    /// tokens with their prefill and decode logits bit-identical to a cold
    /// prefill of the whole prompt.
    fn served(&mut self, label: &str, prompt: &[u32], want: usize) {
        let (t, l, cached) = self
            .cached
            .greedy_logits_cached(prompt, N, true)
            .expect("cached greedy");
        assert_eq!(
            cached,
            want,
            "{label}: cached tokens of a {}-token prompt",
            prompt.len()
        );
        let (ct, cl) = self.cold.greedy_logits(prompt, N).expect("cold greedy");
        assert_eq!(t, ct, "{label}: greedy tokens");
        assert!(
            bits(&l) == bits(&cl),
            "{label}: {}-token prompt with {cached} cached tokens: logits differ from a cold prefill",
            prompt.len()
        );
    }

    fn report(&self, what: &str) -> krasis_common::status::PrefixCacheStats {
        let s = self.cached.prefix_cache_stats().unwrap();
        eprintln!(
            "{what}: {} hits, {} cached tokens, {} blocks held ({} bytes, {}), {} demotions, {} \
             evictions, restore {:.3} ms total, store {:.3} ms",
            s.hits,
            s.cached_tokens,
            s.blocks_held,
            s.bytes_held,
            s.location,
            s.demotions,
            s.evictions,
            s.restore_ms,
            s.store_ms
        );
        for t in &s.tiers {
            eprintln!(
                "  {}: {} hits, {} blocks restored ({} bytes) in {:.3} ms (last {:.3} ms), {} in, {} out",
                t.location,
                t.hits,
                t.blocks_restored,
                t.bytes_restored,
                t.restore_ms,
                t.last_restore_ms,
                t.blocks_in,
                t.evictions
            );
        }
        s
    }
}

/// The sequence of hits the reference engine's test walks through
/// (`krasis_model` `reference/tests/prefix.rs`), in blocks of 64.
fn hits_are_exact(what: &str, p: &mut Pair) {
    let vocab = p.cold.info().vocab_size;
    let prompt = tokens(330, vocab, 1); // 5 blocks + 10 tokens
    p.served(what, &prompt, 0);
    p.served(what, &prompt, 320);
    // Exactly 5 blocks: the last is recomputed for the logits.
    p.served(what, &prompt[..320], 256);
    p.served(what, &prompt[..257], 256);
    // 2 blocks + 22 tokens match, then it differs.
    let mut q = prompt[..150].to_vec();
    q.extend(tokens(90, vocab, 2));
    p.served(what, &q, 128);
    // The conversation goes on.
    let mut next = prompt.clone();
    next.extend(tokens(150, vocab, 3));
    p.served(what, &next, 320);
    p.served(what, &next, 448);
    // Another conversation with the same 150-token system prompt.
    let system = tokens(150, vocab, 4);
    let conv = |seed| {
        let mut c = system.clone();
        c.extend(tokens(70, vocab, seed));
        c
    };
    p.served(what, &conv(5), 0);
    p.served(what, &conv(6), 128);
    p.served(what, &conv(5), 192);
    let s = p.report(what);
    assert!(s.restore_ms > 0.0, "{what}: restores were not timed");
}

fn tiny(tmp: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    (synth(tmp, "tiny"), tmp.join("cache"))
}

fn all_resident(cache: &Path) -> CudaEngineOptions {
    CudaEngineOptions {
        hcs: false,
        ..cuda_options(cache, CONTEXT, CHUNK)
    }
}

#[test]
fn prefix_hits_are_bit_identical_all_resident() {
    if !gpu_or_skip("prefix_hits_are_bit_identical_all_resident") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (model, cache) = tiny(tmp.path());
    let opts = with_tiers(&model, all_resident(&cache), 64, 0);
    let mut p = Pair::new(&model, &cache, opts);
    assert!(!p.cached.hcs_active());
    hits_are_exact("all resident", &mut p);
}

#[test]
fn prefix_hits_are_bit_identical_under_streamed_prefill() {
    if !gpu_or_skip("prefix_hits_are_bit_identical_under_streamed_prefill") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (model, cache) = tiny(tmp.path());
    let opts = with_tiers(&model, no_resident_options(&cache, CONTEXT, CHUNK), 64, 0);
    let mut p = Pair::new(&model, &cache, opts);
    assert!(p.cached.hcs_active(), "HCS was not forced on");
    hits_are_exact("HCS, streamed prefill", &mut p);
    // Resumed prefills streamed one chunk per span too.
    p.cached.set_prefill_span(Some(CHUNK));
    let vocab = p.cold.info().vocab_size;
    let prompt = tokens(500, vocab, 7);
    p.served("one-chunk spans", &prompt, 0);
    p.served("one-chunk spans", &prompt, 448);
}

/// Blocks demoted from a 2-block VRAM pool to the host tier are restored
/// from it bit for bit (the kernel reading mapped host memory), alone and
/// in chains spanning both tiers; all resident and under streamed prefill.
#[test]
fn blocks_restored_from_the_host_tier_are_bit_identical() {
    if !gpu_or_skip("blocks_restored_from_the_host_tier_are_bit_identical") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (model, cache) = tiny(tmp.path());
    for (what, base) in [
        ("host tier, all resident", all_resident(&cache)),
        (
            "host tier, streamed prefill",
            no_resident_options(&cache, CONTEXT, CHUNK),
        ),
    ] {
        let mut p = Pair::new(&model, &cache, with_tiers(&model, base, 2, 32));
        hits_are_exact(what, &mut p);
        let s = p.report(what);
        assert_eq!(s.location, "vram+host");
        assert!(s.demotions > 0, "{what}: nothing was demoted");
        let host = &s.tiers[1];
        assert!(
            host.hits > 0 && host.blocks_restored > 0 && host.restore_ms > 0.0,
            "{what}: no timed restore from the host tier: {host:?}"
        );
        assert_eq!(
            host.bytes_restored,
            host.blocks_restored * block_bytes(&model)
        );
    }
}

/// No VRAM pool: the host tier carries the cache (what `auto` does when not
/// every expert fits), under streamed prefill.
#[test]
fn the_host_tier_alone_serves_hits_under_streamed_prefill() {
    if !gpu_or_skip("the_host_tier_alone_serves_hits_under_streamed_prefill") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (model, cache) = tiny(tmp.path());
    let opts = with_tiers(&model, no_resident_options(&cache, CONTEXT, CHUNK), 0, 64);
    let mut p = Pair::new(&model, &cache, opts);
    assert_eq!(p.cached.load_report().prefix_cache_bytes, 0);
    hits_are_exact("host tier only", &mut p);
    let s = p.report("host tier only");
    assert_eq!((s.location.as_str(), s.demotions), ("host", 0));
}

/// gpt_oss (tiny-gpt-oss: sliding window 16 in rings of 128 rows, two
/// 64-token blocks per sequence; sinks; MXFP4 experts): a block keeps its
/// sliding layers' KV where the prompt that stored it (or a later one that
/// passed it) still had it in its ring at its end, and a prompt resumes
/// only after a chain whose last block keeps it. So a conversation that
/// goes on hits its whole previous prompt, the same prompt hits again, a
/// prompt ending inside another's blocks hits once a prompt ending there
/// completed them, and a second conversation sharing a 150-token system
/// prompt reuses nothing (the first ended elsewhere). Every served prompt's
/// prefill and decode logits are bit-identical to a cold prefill (one
/// chunk; that engine has a cache too, bypassed, so its experts take the
/// way the cached one's do). The steps and their cached tokens:
/// `krasis_model::testutil::gpt_oss_window_steps`.
fn gpt_oss_hits_are_exact(what: &str, p: &mut Pair) {
    let vocab = p.cold.info().vocab_size;
    let steps =
        krasis_model::testutil::gpt_oss_window_steps(|n, seed| tokens(n, vocab, seed.into()));
    for (i, (prompt, want)) in steps.iter().enumerate() {
        p.served(&format!("{what} step {i}"), prompt, *want);
    }
    let s = p.report(what);
    assert!(s.restore_ms > 0.0, "{what}: restores were not timed");
}

fn gpt_oss_pair(model: &Path, cache: &Path, cached: CudaEngineOptions) -> Pair {
    let cold = with_tiers(
        model,
        CudaEngineOptions {
            hcs: false,
            ..cuda_options(cache, CONTEXT, COLD_CHUNK)
        },
        64,
        0,
    );
    let p = Pair::with_cold(model, cached, cold);
    // Each sequence's ring is two whole blocks.
    assert_eq!(
        p.cached.load_report().kv_bytes,
        {
            let g = ModelConfig::load(model).unwrap().geometry();
            let sliding = g
                .layers
                .iter()
                .filter(|l| {
                    matches!(
                        l.attention,
                        krasis_model::arch::AttentionKind::Sliding { .. }
                    )
                })
                .count();
            let per_pos = 2 * g.kv_dim() * 2;
            let seqs = p.cached.load_report().parallel;
            ((g.num_layers - sliding) * CONTEXT + sliding * seqs * 2 * B) * per_pos
        },
        "KV bytes: full layers' context and rings of 128 rows"
    );
    p
}

#[test]
fn gpt_oss_prefix_hits_are_bit_identical() {
    if !gpu_or_skip("gpt_oss_prefix_hits_are_bit_identical") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = krasis_model::testutil::tiny_gpt_oss_checkpoint();
    let cache = tmp.path().join("cache");
    for (what, base, vram, host) in [
        ("gpt-oss all resident", all_resident(&cache), 64, 0),
        ("gpt-oss host tier", all_resident(&cache), 2, 32),
        (
            "gpt-oss host tier, streamed prefill",
            no_resident_options(&cache, CONTEXT, CHUNK),
            2,
            32,
        ),
    ] {
        let mut p = gpt_oss_pair(&model, &cache, with_tiers(&model, base, vram, host));
        gpt_oss_hits_are_exact(what, &mut p);
        if host > 0 {
            assert!(p.report(what).demotions > 0, "{what}: nothing was demoted");
        }
    }
    // A restart through the prefix cache file keeps which blocks hold
    // their window: the whole prompt resumes (all marks lost would give 0),
    // a prompt ending in block 4 does not (all marks set would give 256:
    // block 3's window was never stored), every output exact.
    let filed = CudaEngineOptions {
        prefix_cache_file: Some(tmp.path().join("prefix.krspc")),
        ..with_tiers(&model, all_resident(&cache), 2, 32)
    };
    let mut p = gpt_oss_pair(&model, &cache, filed.clone());
    let vocab = p.cold.info().vocab_size;
    let prompt = tokens(330, vocab, 61);
    p.served("gpt-oss before the restart", &prompt, 0);
    let saved = p
        .cached
        .save_prefix_cache()
        .expect("saved")
        .expect("a file");
    assert_eq!(saved.blocks, 5);
    p.cached = load(&model, &filed);
    p.served("gpt-oss after the restart", &prompt, 320);
    p.served("gpt-oss, block 3 without its window", &prompt[..320], 0);
    p.served("gpt-oss, block 3 now with it", &prompt[..320], 256);
}

/// The window restore is what makes a gpt_oss hit exact: with it skipped
/// (`Fault::SkipRingRestore`), a hit after another prompt ran in the same
/// slot (its ring holds that prompt's keys) differs from a cold prefill;
/// without the fault the same steps are bit-identical.
#[test]
fn gpt_oss_prefix_hits_need_the_window_restored() {
    if !gpu_or_skip("gpt_oss_prefix_hits_need_the_window_restored") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = krasis_model::testutil::tiny_gpt_oss_checkpoint();
    let cache = tmp.path().join("cache");
    let mut p = gpt_oss_pair(
        &model,
        &cache,
        with_tiers(&model, all_resident(&cache), 64, 0),
    );
    let vocab = p.cold.info().vocab_size;
    let prompt = tokens(330, vocab, 31);
    let other = tokens(330, vocab, 32);
    p.served("store", &prompt, 0);
    p.served("another prompt in the slot", &other, 0);
    p.cached
        .set_fault(krasis_gpu::forward::Fault::SkipRingRestore)
        .unwrap();
    let (_, l, cached) = p
        .cached
        .greedy_logits_cached(&prompt, N, true)
        .expect("cached greedy");
    assert_eq!(cached, 320);
    let (_, cl) = p.cold.greedy_logits(&prompt, N).expect("cold greedy");
    assert!(
        bits(&l) != bits(&cl),
        "a hit without its window restored equals a cold prefill: the test cannot fail"
    );
    p.cached
        .set_fault(krasis_gpu::forward::Fault::None)
        .unwrap();
    p.served("another prompt again", &other, 320);
    p.served("the window restored", &prompt, 320);
}

#[test]
fn after_eviction_a_miss_recomputes_the_same_logits() {
    if !gpu_or_skip("after_eviction_a_miss_recomputes_the_same_logits") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (model, cache) = tiny(tmp.path());
    // 1 VRAM block and 2 host blocks: each 4-block prompt evicts the
    // other's blocks from both tiers.
    let mut p = Pair::new(
        &model,
        &cache,
        with_tiers(&model, all_resident(&cache), 1, 2),
    );
    let vocab = p.cold.info().vocab_size;
    let (a, b) = (tokens(270, vocab, 8), tokens(270, vocab, 9));
    p.served("eviction", &a, 0);
    p.served("eviction", &b, 0);
    assert!(p.cached.prefix_cache_stats().unwrap().evictions >= 3);
    p.served("eviction", &a, 0);
    p.served("eviction", &a, 192);
}

/// Through `generate`: tokens equal to a cold engine's with the hit in the
/// outcome; `cache_prompt: false` neither reads nor stores; a cancelled
/// prefill (HCS streaming, cancelled from another thread once it started)
/// stores nothing; a planted fault invalidates every block.
#[test]
fn generate_bypass_cancel_and_invalidation() {
    if !gpu_or_skip("generate_bypass_cancel_and_invalidation") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (model, cache) = tiny(tmp.path());
    let opts = with_tiers(&model, no_resident_options(&cache, CONTEXT, CHUNK), 4, 32);
    let mut p = Pair::new(&model, &cache, opts);
    let vocab = p.cold.info().vocab_size;
    let prompt = tokens(300, vocab, 10);
    let (want, _) = generate_all(&mut p.cold, &greedy_request(&prompt, 12));
    let mut req = greedy_request(&prompt, 12);
    req.cache_prompt = true;
    for cached in [0, 256] {
        let (got, o) = generate_all(&mut p.cached, &req);
        assert_eq!(got, want);
        assert_eq!(o.stats.cached_tokens, cached);
    }
    // One token only: the store is queued after the last synchronisation
    // and its timing is read at the end of the request.
    let short = tokens(140, vocab, 11);
    let mut one = greedy_request(&short, 1);
    one.cache_prompt = true;
    for cached in [0, 128] {
        let (got, o) = generate_all(&mut p.cached, &one);
        assert_eq!((got.len(), o.stats.cached_tokens), (1, cached));
    }
    let held = p.cached.prefix_cache_stats().unwrap().blocks_held;
    req.cache_prompt = false;
    let (got, o) = generate_all(&mut p.cached, &req);
    assert_eq!((got, o.stats.cached_tokens), (want.clone(), 0));
    let s = p.cached.prefix_cache_stats().unwrap();
    assert_eq!((s.bypassed, s.blocks_held), (1, held));

    // Cancelled mid-prefill: nothing of the prompt is stored. (Retried
    // with new prompts should the whole prefill beat the other thread.)
    let mut cancelled_mid_prefill = 0;
    for seed in 0..5 {
        let long = tokens(CONTEXT - 64, vocab, 100 + seed);
        let flag = Arc::new(AtomicBool::new(false));
        let mut req = greedy_request(&long, 4);
        req.cache_prompt = true;
        req.cancel = CancelToken::new(flag.clone());
        let live = req.live.clone();
        let setter = std::thread::spawn(move || {
            while live.prefilled() == 0 {
                std::thread::yield_now();
            }
            flag.store(true, Ordering::Relaxed);
        });
        let before = p.cached.prefix_cache_stats().unwrap().blocks_stored;
        let (toks, o) = generate_all(&mut p.cached, &req);
        setter.join().unwrap();
        assert_eq!(o.finish, FinishReason::Cancelled);
        if toks.is_empty() {
            cancelled_mid_prefill += 1;
            let after = p.cached.prefix_cache_stats().unwrap().blocks_stored;
            assert_eq!(after, before, "a cancelled prefill stored blocks");
            // The same prompt then misses and is exact.
            p.served("after a cancel", &long, 0);
            break;
        }
    }
    assert!(
        cancelled_mid_prefill > 0,
        "no attempt was cancelled during its prefill"
    );

    // A planted fault changes the KV: the blocks are dropped, and the
    // faulty engine's prefill is its own (bit-identical to itself cold).
    p.served("before a fault", &prompt, 256);
    p.cached
        .set_fault(krasis_gpu::forward::Fault::RopeSign)
        .expect("plant");
    let (_, _, cached) = p
        .cached
        .greedy_logits_cached(&prompt, N, true)
        .expect("faulty");
    assert_eq!(cached, 0, "blocks from before the fault were reused");
    p.cached
        .set_fault(krasis_gpu::forward::Fault::None)
        .expect("remove");
    p.served("after the fault", &prompt, 0);
    p.served("after the fault", &prompt, 256);
    assert_eq!(p.cached.prefix_cache_stats().unwrap().invalidations, 2);
}

/// The tiers are allocated at load from the options and said in the load
/// report: explicit sizes; `auto` all resident (one context's KV in VRAM)
/// and with HCS not holding every expert (no VRAM pool, the host tier
/// alone); `Off` has none; a block size that is not a multiple of 64 is
/// refused.
#[test]
fn the_tiers_follow_the_options() {
    if !gpu_or_skip("the_tiers_follow_the_options") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (model, cache) = tiny(tmp.path());
    let bb = block_bytes(&model);
    let e = load(&model, &with_tiers(&model, all_resident(&cache), 5, 7));
    let r = e.load_report();
    assert_eq!(
        (r.prefix_cache_bytes, r.prefix_host_bytes),
        (5 * bb, 7 * bb)
    );
    drop(e);
    let auto = |base: CudaEngineOptions| CudaEngineOptions {
        prefix_cache: PrefixCacheChoice::Auto,
        prefix_cache_host: PrefixCacheChoice::Auto,
        prefix_block: B,
        ..base
    };
    let e = load(&model, &auto(all_resident(&cache)));
    let r = e.load_report();
    // Auto on a card with room: one context's KV, and a host tier.
    assert_eq!(r.prefix_cache_bytes, r.kv_bytes as u64);
    assert!(r.prefix_host_bytes > 0);
    drop(e);
    let e = load(&model, &auto(no_resident_options(&cache, CONTEXT, CHUNK)));
    assert!(e.hcs_active());
    let r = e.load_report();
    assert_eq!(r.prefix_cache_bytes, 0, "auto gave HCS's VRAM to the cache");
    assert!(r.prefix_host_bytes > 0);
    drop(e);
    let e = load(&model, &all_resident(&cache));
    assert!(e.prefix_cache_stats().is_none());
    assert_eq!(e.load_report().prefix_cache_bytes, 0);
    drop(e);
    let bad = CudaEngineOptions {
        prefix_block: 100,
        ..with_tiers(&model, all_resident(&cache), 5, 0)
    };
    let err = CudaEngine::load(&model, &bad).err().expect("refused");
    assert!(err.to_string().contains("multiple of 64"), "{err}");
}

/// With `whole_chunk_reuse` a hit covers whole prefill chunks and a store
/// only blocks of complete chunks: with 64-token blocks and 128-token
/// chunks, a 200-token prompt stores 128 tokens (not 192), a 400-token
/// prompt sharing them gets 128 cached tokens, then 384 once it stored its
/// own complete chunks. By default (any block boundary) the same prompts
/// get 192 and 384. Every output bit-identical to a cold prefill.
#[test]
fn whole_chunk_reuse_when_asked_any_block_by_default() {
    if !gpu_or_skip("whole_chunk_reuse_when_asked_any_block_by_default") {
        return;
    }
    const CH: usize = 128;
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny");
    let cache = tmp.path().join("cache");
    let bb = block_bytes(&model);
    let with = |whole: bool| CudaEngineOptions {
        prefix_cache: PrefixCacheChoice::Bytes(32 * bb),
        prefix_block: B,
        hcs: false,
        whole_chunk_reuse: whole,
        ..cuda_options(&cache, CONTEXT, CH)
    };
    let cached = load(&model, &with(true));
    assert_eq!(cached.load_report().prefill_chunk, CH);
    let cold = load(
        &model,
        &CudaEngineOptions {
            hcs: false,
            ..cuda_options(&cache, CONTEXT, COLD_CHUNK)
        },
    );
    let mut pair = Pair { cached, cold };
    let vocab = pair.cached.info().vocab_size;
    let long = tokens(450, vocab, 41);
    pair.served("200 tokens, cold", &long[..200], 0);
    assert_eq!(pair.report("whole chunks").blocks_held, 2);
    pair.served("400 tokens sharing 200", &long[..400], CH);
    pair.served("450 tokens sharing 400", &long[..450], 3 * CH);
    pair.cached = load(&model, &with(false));
    pair.served("200 tokens, cold (any block)", &long[..200], 0);
    assert_eq!(pair.report("any block").blocks_held, 3);
    pair.served("400 tokens sharing 200 (any block)", &long[..400], 3 * B);
    pair.served("450 tokens sharing 400 (any block)", &long[..450], 6 * B);
}

/// A restart through the cache's file (`serve --prefix-cache-file`): an
/// all-resident engine saves blocks of both tiers (some demoted to the
/// host tier); a fresh engine under HCS with streamed prefill loads them
/// and its hits are bit-identical to a cold prefill; a smaller cache takes
/// the most recent conversation; another block size is refused by name.
#[test]
fn a_restart_through_the_file_is_bit_identical() {
    if !gpu_or_skip("a_restart_through_the_file_is_bit_identical") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (model, cache) = tiny(tmp.path());
    let file = tmp.path().join("prefix.krspc");
    let with_file = |opts: CudaEngineOptions| CudaEngineOptions {
        prefix_cache_file: Some(file.clone()),
        ..opts
    };
    let first = with_file(with_tiers(&model, all_resident(&cache), 3, 16));
    let mut p = Pair::new(&model, &cache, first);
    let vocab = p.cold.info().vocab_size;
    let (a, b) = (tokens(330, vocab, 51), tokens(330, vocab, 52)); // 5 blocks each
    p.served("a, cold", &a, 0);
    p.served("b, cold", &b, 0);
    let s = p.report("before the restart");
    assert!(s.demotions > 0 && s.blocks_held == 10, "{s:?}");
    let saved = p
        .cached
        .save_prefix_cache()
        .expect("saved")
        .expect("a file");
    assert_eq!(saved.blocks, 10);
    assert!(file.exists());

    let streamed = with_file(with_tiers(
        &model,
        no_resident_options(&cache, CONTEXT, CHUNK),
        3,
        16,
    ));
    p.cached = load(&model, &streamed);
    assert!(p.cached.hcs_active());
    assert_eq!(p.report("after the restart").blocks_held, 10);
    p.served("a after the restart", &a, 320);
    p.served("b after the restart", &b, 320);
    let mut next = a.clone();
    next.extend(tokens(100, vocab, 53));
    p.served("a's conversation goes on", &next, 320);
    p.served("and again", &next, 384);

    // Room for one conversation: the most recent (b) is the one kept.
    p.cached = load(
        &model,
        &with_file(with_tiers(&model, all_resident(&cache), 0, 5)),
    );
    assert_eq!(p.report("a smaller cache").blocks_held, 5);
    p.served("b in the smaller cache", &b, 320);
    p.served("a in the smaller cache", &a, 0);

    let other_block = CudaEngineOptions {
        prefix_block: 128,
        ..with_file(with_tiers(&model, all_resident(&cache), 3, 16))
    };
    let err = CudaEngine::load(&model, &other_block)
        .err()
        .expect("refused");
    assert!(err.to_string().contains("--prefix-block"), "{err}");
}
