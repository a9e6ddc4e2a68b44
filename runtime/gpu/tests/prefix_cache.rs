//! The CUDA engine's prefix cache (`prefix.rs`) on the tiny synthetic
//! model: a prompt served from cached blocks gives prefill and decode
//! logits bit-identical to a cold prefill of the whole prompt on an engine
//! without a cache (at block boundaries, with a partly matching last block,
//! for two conversations sharing a prefix, after evictions, all resident
//! and under HCS with streamed prefill); a cancelled prefill stores
//! nothing; a bypassing request neither reads nor stores; a planted fault
//! invalidates the blocks. On a machine without an NVIDIA driver every test
//! prints `SKIPPED (no CUDA device): <name> (no NVIDIA driver)`.

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
/// Prefill chunk = block.
const B: usize = 32;
/// Greedy tokens compared after each prefill (the first from prefill).
const N: usize = 6;

/// `opts` with a pool of `blocks` blocks.
fn with_pool(model: &Path, opts: CudaEngineOptions, blocks: u64) -> CudaEngineOptions {
    let g = ModelConfig::load(model).expect("config").geometry();
    CudaEngineOptions {
        prefix_cache: PrefixCacheChoice::Bytes(blocks * krasis_gpu::prefix::block_bytes(&g, B)),
        ..opts
    }
}

struct Pair {
    cached: CudaEngine,
    /// The same model without a prefix cache, all resident.
    cold: CudaEngine,
}

impl Pair {
    fn new(model: &Path, cache: &Path, cached: CudaEngineOptions) -> Self {
        let cached = load(model, &cached);
        let cold = load(
            model,
            &CudaEngineOptions {
                hcs: false,
                ..cuda_options(cache, CONTEXT, B)
            },
        );
        assert_eq!(cached.load_report().prefill_chunk, B);
        assert!(cached.prefix_cache_stats().is_some(), "no prefix cache");
        assert!(cold.prefix_cache_stats().is_none());
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
}

/// The sequence of hits the reference engine's test walks through
/// (`krasis_model` `reference/tests/prefix.rs`), in blocks of 32.
fn hits_are_exact(what: &str, p: &mut Pair) {
    let vocab = p.cold.info().vocab_size;
    let prompt = tokens(230, vocab, 1); // 7 blocks + 6 tokens
    p.served(what, &prompt, 0);
    p.served(what, &prompt, 224);
    // Exactly 7 blocks: the last is recomputed for the logits.
    p.served(what, &prompt[..224], 192);
    p.served(what, &prompt[..193], 192);
    // 3 blocks + 4 tokens match, then it differs.
    let mut q = prompt[..100].to_vec();
    q.extend(tokens(90, vocab, 2));
    p.served(what, &q, 96);
    // The conversation goes on.
    let mut next = prompt.clone();
    next.extend(tokens(150, vocab, 3));
    p.served(what, &next, 224);
    p.served(what, &next, 352);
    // Another conversation with the same 80-token system prompt.
    let system = tokens(80, vocab, 4);
    let conv = |seed| {
        let mut c = system.clone();
        c.extend(tokens(70, vocab, seed));
        c
    };
    p.served(what, &conv(5), 0);
    p.served(what, &conv(6), 64);
    p.served(what, &conv(5), 128);
    let s = p.cached.prefix_cache_stats().unwrap();
    eprintln!(
        "{what}: {} hits, {} cached tokens, {} blocks held ({} bytes), restore {:.3} ms total (last {:.3} ms), store {:.3} ms",
        s.hits,
        s.cached_tokens,
        s.blocks_held,
        s.bytes_held,
        s.restore_ms,
        s.last_restore_ms,
        s.store_ms
    );
    assert!(s.restore_ms > 0.0, "{what}: restores were not timed");
}

#[test]
fn prefix_hits_are_bit_identical_all_resident() {
    if !gpu_or_skip("prefix_hits_are_bit_identical_all_resident") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny");
    let cache = tmp.path().join("cache");
    let opts = CudaEngineOptions {
        hcs: false,
        ..cuda_options(&cache, CONTEXT, B)
    };
    let mut p = Pair::new(&model, &cache, with_pool(&model, opts, 64));
    assert!(!p.cached.hcs_active());
    hits_are_exact("all resident", &mut p);
}

#[test]
fn prefix_hits_are_bit_identical_under_streamed_prefill() {
    if !gpu_or_skip("prefix_hits_are_bit_identical_under_streamed_prefill") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny");
    let cache = tmp.path().join("cache");
    let opts = no_resident_options(&cache, CONTEXT, B);
    let mut p = Pair::new(&model, &cache, with_pool(&model, opts, 64));
    assert!(p.cached.hcs_active(), "HCS was not forced on");
    hits_are_exact("HCS, streamed prefill", &mut p);
    // Resumed prefills streamed one chunk per span too.
    p.cached.set_prefill_span(Some(B));
    let vocab = p.cold.info().vocab_size;
    let prompt = tokens(300, vocab, 7);
    p.served("one-chunk spans", &prompt, 0);
    p.served("one-chunk spans", &prompt, 288);
}

#[test]
fn after_eviction_a_miss_recomputes_the_same_logits() {
    if !gpu_or_skip("after_eviction_a_miss_recomputes_the_same_logits") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny");
    let cache = tmp.path().join("cache");
    let opts = CudaEngineOptions {
        hcs: false,
        ..cuda_options(&cache, CONTEXT, B)
    };
    // Room for 3 blocks: each 4-block prompt evicts the other's.
    let mut p = Pair::new(&model, &cache, with_pool(&model, opts, 3));
    let vocab = p.cold.info().vocab_size;
    let (a, b) = (tokens(140, vocab, 8), tokens(140, vocab, 9));
    p.served("eviction", &a, 0);
    p.served("eviction", &b, 0);
    assert!(p.cached.prefix_cache_stats().unwrap().evictions >= 3);
    p.served("eviction", &a, 0);
    p.served("eviction", &a, 96);
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
    let model = synth(tmp.path(), "tiny");
    let cache = tmp.path().join("cache");
    let opts = no_resident_options(&cache, CONTEXT, B);
    let mut p = Pair::new(&model, &cache, with_pool(&model, opts, 64));
    let vocab = p.cold.info().vocab_size;
    let prompt = tokens(200, vocab, 10);
    let (want, _) = generate_all(&mut p.cold, &greedy_request(&prompt, 12));
    let mut req = greedy_request(&prompt, 12);
    req.cache_prompt = true;
    for cached in [0, 192] {
        let (got, o) = generate_all(&mut p.cached, &req);
        assert_eq!(got, want);
        assert_eq!(o.stats.cached_tokens, cached);
    }
    // One token only: the store is queued after the last synchronisation
    // and its timing is read at the end of the request.
    let short = tokens(100, vocab, 11);
    let mut one = greedy_request(&short, 1);
    one.cache_prompt = true;
    for cached in [0, 96] {
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
        let before = p.cached.prefix_cache_stats().unwrap().blocks_held;
        let (toks, o) = generate_all(&mut p.cached, &req);
        setter.join().unwrap();
        assert_eq!(o.finish, FinishReason::Cancelled);
        if toks.is_empty() {
            cancelled_mid_prefill += 1;
            let after = p.cached.prefix_cache_stats().unwrap().blocks_held;
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
    p.served("before a fault", &prompt, 192);
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
    p.served("after the fault", &prompt, 192);
    assert_eq!(p.cached.prefix_cache_stats().unwrap().invalidations, 2);
}

/// The pool is allocated at load from the options and said in the load
/// report; `Off` has none, and a model the cache cannot handle refuses an
/// explicit size.
#[test]
fn the_pool_follows_the_options() {
    if !gpu_or_skip("the_pool_follows_the_options") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny");
    let cache = tmp.path().join("cache");
    let opts = cuda_options(&cache, CONTEXT, B);
    let e = load(&model, &with_pool(&model, opts.clone(), 5));
    let g = ModelConfig::load(&model).unwrap().geometry();
    assert_eq!(
        e.load_report().prefix_cache_bytes,
        5 * krasis_gpu::prefix::block_bytes(&g, B)
    );
    drop(e);
    let e = load(
        &model,
        &CudaEngineOptions {
            prefix_cache: PrefixCacheChoice::Auto,
            ..opts.clone()
        },
    );
    // Auto on a card with room: one context's KV.
    assert_eq!(
        e.load_report().prefix_cache_bytes,
        e.load_report().kv_bytes as u64
    );
    drop(e);
    let e = load(&model, &opts);
    assert!(e.prefix_cache_stats().is_none());
    assert_eq!(e.load_report().prefix_cache_bytes, 0);
}
