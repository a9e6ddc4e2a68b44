//! Cancelling a CUDA generation through `GenerateRequest::cancel`: before
//! it starts, between prefill chunks (all-resident prefill, and HCS
//! streamed prefill: layer groups × chunks), and during decode. A cancelled
//! prefill returns `Cancelled` with no token long before the prompt would
//! have finished, and the next request's output is bit-identical to the
//! same request's before it (the engine is deterministic: no float
//! atomics), with the HCS reclaimable tier reloaded.
//!
//! On a machine without an NVIDIA driver each test prints `SKIPPED (no
//! CUDA device): <name> (no NVIDIA driver)`.

mod support;

use krasis_gpu::CudaEngine;
use krasis_model::{CancelToken, Engine, FinishReason, GenerateRequest};
use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;
use support::{
    cuda, cuda_options, generate_all, gpu_or_skip, greedy_request, no_resident_options, synth,
    tokens,
};

const CONTEXT: usize = 8192;
const CHUNK: usize = 32;

fn request(prompt: &[u32], max: usize) -> (GenerateRequest, Arc<AtomicBool>) {
    let flag = Arc::new(AtomicBool::new(false));
    let req = GenerateRequest {
        cancel: CancelToken::new(flag.clone()),
        ..greedy_request(prompt, max)
    };
    (req, flag)
}

/// What a request gives on a clean engine: its greedy tokens and the
/// prompt logits of the same prompt.
fn fingerprint(e: &mut CudaEngine, prompt: &[u32]) -> (Vec<u32>, Vec<Vec<f32>>) {
    let (toks, o) = generate_all(e, &request(prompt, 16).0);
    assert_eq!(o.finish, FinishReason::Length);
    (toks, e.prompt_logits(prompt).expect("prompt logits"))
}

fn cancels_cleanly(label: &str, e: &mut CudaEngine) {
    let vocab = e.info().vocab_size;
    let long = tokens(CONTEXT - 200, vocab, 11);
    let short = tokens(300, vocab, 12);
    let before = fingerprint(e, &short);

    // Already cancelled: nothing runs.
    let (req, flag) = request(&long, 4);
    flag.store(true, Ordering::Relaxed);
    let (toks, o) = generate_all(e, &req);
    assert_eq!(
        (o.finish, toks.len(), o.stats.generated_tokens),
        (FinishReason::Cancelled, 0, 0)
    );

    // The full prefill, timed (after a warm-up of the same length).
    generate_all(e, &request(&long, 1).0);
    let t = Instant::now();
    let (toks, o) = generate_all(e, &request(&long, 1).0);
    let full = t.elapsed();
    assert_eq!((toks.len(), o.finish), (1, FinishReason::Length));

    // Cancelled from another thread a tenth of the way in.
    let (req, flag) = request(&long, 4);
    let delay = full / 10;
    let setter = std::thread::spawn(move || {
        std::thread::sleep(delay);
        flag.store(true, Ordering::Relaxed);
    });
    let t = Instant::now();
    let (toks, o) = generate_all(e, &req);
    let took = t.elapsed();
    setter.join().unwrap();
    eprintln!(
        "{label}: prefill of {} tokens in chunks of {CHUNK}: {full:?}; cancelled after {delay:?}, returned in {took:?}",
        long.len()
    );
    assert_eq!(o.finish, FinishReason::Cancelled, "{label}");
    assert_eq!(
        (toks.len(), o.stats.generated_tokens),
        (0, 0),
        "{label}: tokens after cancel"
    );
    assert!(
        took < full / 2,
        "{label}: the cancelled prefill took {took:?} of a full {full:?}"
    );

    // Cancelled during decode: the tokens before it are the normal ones.
    let (req, flag) = request(&short, 16);
    let mut seen = Vec::new();
    let o = e
        .generate(&req, &mut |t| {
            seen.push(t);
            if seen.len() == 3 {
                flag.store(true, Ordering::Relaxed);
            }
            ControlFlow::Continue(())
        })
        .expect("generate");
    assert_eq!(
        (o.finish, o.stats.generated_tokens),
        (FinishReason::Cancelled, 3),
        "{label}"
    );
    assert_eq!(
        seen,
        before.0[..3],
        "{label}: tokens before a decode cancel"
    );

    // The engine is as before.
    let after = fingerprint(e, &short);
    assert_eq!(
        after.0, before.0,
        "{label}: greedy tokens after the cancels"
    );
    assert!(
        after.1 == before.1,
        "{label}: prompt logits after the cancels differ"
    );
}

#[test]
fn cancel_all_resident() {
    if !gpu_or_skip("cancel_all_resident") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny");
    let mut e = cuda(
        &model,
        &cuda_options(&tmp.path().join("cache"), CONTEXT, CHUNK),
    );
    assert!(!e.hcs_active(), "the tiny model's experts all fit");
    cancels_cleanly("all resident", &mut e);
}

#[test]
fn cancel_hcs_streamed_prefill() {
    if !gpu_or_skip("cancel_hcs_streamed_prefill") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny");
    let opts = no_resident_options(&tmp.path().join("cache"), CONTEXT, CHUNK);
    let mut e = cuda(&model, &opts);
    assert!(e.hcs_active(), "HCS was not forced on");
    cancels_cleanly("HCS", &mut e);
    let s = e.hcs_stats().expect("HCS stats");
    eprintln!(
        "HCS: {}/{} experts on the GPU, {} resident-tier slots",
        s.resident_experts, s.total_experts, s.resident_tier_slots
    );
}
