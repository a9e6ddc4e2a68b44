//! Live figures of a running CUDA generation (`GenerateRequest::live`),
//! all-resident and under HCS: the prefilled-token count rises chunk by
//! chunk (layer group by layer group under HCS) and ends at the prompt's
//! length; decode publishes its figures so far at most every ~100 ms, with
//! VRAM, pinned host memory and (HCS) this request's traffic; the final
//! published figures are the engine's own; and publishing changes nothing
//! the engine computes.
//!
//! On a machine without an NVIDIA driver each test prints `SKIPPED (no
//! CUDA device): <name> (no NVIDIA driver)`.

mod support;

use krasis_common::status::EngineStats;
use krasis_gpu::CudaEngine;
use krasis_model::{Engine, FinishReason};
use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use support::{
    cuda, cuda_options, generate_all, gpu_or_skip, greedy_request, no_resident_options, synth,
    tokens,
};

const CONTEXT: usize = 4096;
const CHUNK: usize = 32;
/// Decoded tokens of the slow-client request (1 ms per token: > 400 ms).
const DECODE: usize = 400;

/// The prefilled counts a watcher thread sees while `prompt` prefills.
fn watch_prefill(e: &mut CudaEngine, prompt: &[u32]) -> Vec<u64> {
    let req = greedy_request(prompt, 1);
    let (live, done) = (req.live.clone(), Arc::new(AtomicBool::new(false)));
    let d = done.clone();
    let watcher = std::thread::spawn(move || {
        let mut seen = vec![0u64];
        while !d.load(Ordering::Relaxed) {
            let p = live.prefilled();
            if p != *seen.last().unwrap() {
                seen.push(p);
            }
            std::thread::yield_now();
        }
        seen
    });
    generate_all(e, &req);
    done.store(true, Ordering::Relaxed);
    let mut seen = watcher.join().unwrap();
    if *seen.last().unwrap() != req.live.prefilled() {
        seen.push(req.live.prefilled());
    }
    seen
}

fn live_figures(label: &str, e: &mut CudaEngine) {
    let hcs = e.hcs_active();
    let vocab = e.info().vocab_size;
    // Before any request nothing is reported as traffic (the calibration
    // prompts at load are not requests).
    let idle = e.stats().expect("stats");
    let h = idle.hcs.as_ref().expect("HCS figures");
    assert!(
        h.cold_bytes_per_token == 0.0 && h.cold_experts_per_token == 0.0,
        "{label}: traffic before any request: {h:?}"
    );
    let prompt = tokens(CONTEXT - 600, vocab, 21);
    let n = prompt.len() as u64;
    generate_all(e, &greedy_request(&prompt, 1)); // warm-up
    let seen = watch_prefill(e, &prompt);
    eprintln!("{label}: prefilled counts seen: {seen:?}");
    assert_eq!(*seen.last().unwrap(), n, "{label}: ends at the prompt");
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "{label}: not increasing: {seen:?}"
    );
    let between = seen.iter().filter(|&&v| v > 0 && v < n).count();
    assert!(between >= 3, "{label}: {between} intermediate counts");
    if !hcs {
        assert!(
            seen.iter().all(|&v| v % CHUNK as u64 == 0 || v == n),
            "{label}: all-resident counts are chunk ends: {seen:?}"
        );
    }

    // A slow client keeps decode running; the callback looks at what the
    // engine has published so far.
    let short = tokens(64, vocab, 22);
    let want = generate_all(e, &greedy_request(&short, DECODE)).0;
    let req = greedy_request(&short, DECODE);
    let live = req.live.clone();
    let mut got = Vec::new();
    let mut snapshots: Vec<(Duration, EngineStats)> = Vec::new();
    let mut first_token: Option<Instant> = None;
    let o = e
        .generate(&req, &mut |t| {
            got.push(t);
            let t0 = *first_token.get_or_insert_with(Instant::now);
            if let Some(s) = live.engine()
                && snapshots.last().is_none_or(|(_, last)| *last != s)
            {
                snapshots.push((t0.elapsed(), s));
            }
            std::thread::sleep(Duration::from_millis(1));
            ControlFlow::Continue(())
        })
        .expect("generate");
    let decode = first_token.unwrap().elapsed();
    assert_eq!(o.finish, FinishReason::Length);
    assert_eq!(got, want, "{label}: publishing changed the output");
    eprintln!(
        "{label}: {} distinct snapshots during {decode:?} of decode",
        snapshots.len()
    );
    let (first_at, first) = snapshots
        .first()
        .unwrap_or_else(|| panic!("{label}: nothing published during decode"));
    assert!(
        *first_at >= Duration::from_millis(90),
        "{label}: first publish after {first_at:?} (throttled to ~100 ms)"
    );
    let periods = decode.as_secs_f64() / 0.1;
    assert!(
        (snapshots.len() as f64) <= periods + 2.0,
        "{label}: {} snapshots in {decode:?}",
        snapshots.len()
    );
    let pinned = first.pinned_host_bytes.expect("pinned host bytes");
    let mut at_least = e.load_report().host_weight_bytes as u64;
    if hcs {
        at_least += e.expert_cache().expect("cache").data().len() as u64;
    }
    assert!(
        pinned > 0 && pinned >= at_least,
        "{label}: pinned {pinned} B, expected at least {at_least} B"
    );
    assert!(first.vram.is_some(), "{label}: no VRAM figures");
    for (at, s) in &snapshots {
        let h = s.hcs.as_ref().expect("HCS figures");
        assert!(
            (0.0..=1.0).contains(&h.hit_rate) && h.cold_bytes_per_token >= 0.0,
            "{label} at {at:?}: {h:?}"
        );
        if !hcs {
            assert_eq!(
                h.cold_bytes_per_token, 0.0,
                "{label}: all resident, yet cold"
            );
        }
    }
    // The last figures published are the engine's own after the request.
    let last = req.live.engine().expect("final figures");
    let after = e.stats().expect("stats");
    assert_eq!(last.hcs, after.hcs, "{label}: final HCS figures");
    assert_eq!(last.pinned_host_bytes, after.pinned_host_bytes);
}

#[test]
fn live_all_resident() {
    if !gpu_or_skip("live_all_resident") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny");
    let mut e = cuda(
        &model,
        &cuda_options(&tmp.path().join("cache"), CONTEXT, CHUNK),
    );
    assert!(!e.hcs_active(), "the tiny model's experts all fit");
    live_figures("all resident", &mut e);
}

#[test]
fn live_hcs() {
    if !gpu_or_skip("live_hcs") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny");
    let opts = no_resident_options(&tmp.path().join("cache"), CONTEXT, CHUNK);
    let mut e = cuda(&model, &opts);
    assert!(e.hcs_active(), "HCS was not forced on");
    live_figures("HCS", &mut e);
}
