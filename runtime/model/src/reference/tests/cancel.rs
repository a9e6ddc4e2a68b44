//! Cancellation and live progress of the reference engine: a cancel token
//! stops prefill between chunks and decode between steps, and the request's
//! live figures count prefilled tokens chunk by chunk.

use super::*;
use std::sync::atomic::{AtomicBool, Ordering};

fn cancellable(prompt: &[u32], max: usize) -> (GenerateRequest, Arc<AtomicBool>) {
    let flag = Arc::new(AtomicBool::new(false));
    let mut req = request(prompt, max);
    req.cancel = CancelToken::new(flag.clone());
    (req, flag)
}

#[test]
fn cancel_before_start_produces_nothing() {
    let mut e = engine(64);
    let (req, flag) = cancellable(&PROMPT, 5);
    flag.store(true, Ordering::Relaxed);
    let mut called = false;
    let o = e
        .generate(&req, &mut |_| {
            called = true;
            ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(o.finish, FinishReason::Cancelled);
    assert_eq!(o.stats.generated_tokens, 0);
    assert_eq!(o.stats.prompt_tokens, PROMPT.len());
    assert!(!called, "a token was produced after cancellation");
}

#[test]
fn cancel_during_decode_stops_before_the_next_step() {
    let mut e = engine(64);
    let (req, flag) = cancellable(&PROMPT, 10);
    let mut seen = Vec::new();
    let o = e
        .generate(&req, &mut |t| {
            seen.push(t);
            if seen.len() == 3 {
                flag.store(true, Ordering::Relaxed);
            }
            ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(
        (o.finish, o.stats.generated_tokens),
        (FinishReason::Cancelled, 3)
    );
    let (full, _) = run(&mut e, &request(&PROMPT, 10));
    assert_eq!(
        seen,
        full[..3],
        "the tokens before the cancel are the normal ones"
    );
}

/// A long prompt cancelled from another thread shortly after it starts
/// returns `Cancelled` long before its prefill would have finished, with no
/// token; the next request then gives exactly what a fresh engine gives.
#[test]
fn cancel_during_prefill_returns_early_and_leaves_the_engine_clean() {
    let prompt = long_prompt(1536);
    let mut e = engine(2048);
    e.set_prefill_chunk(32);
    let t = Instant::now();
    let (full_tokens, full) = run(&mut e, &request(&prompt, 1));
    let full_s = t.elapsed().as_secs_f64();
    assert_eq!((full_tokens.len(), full.finish), (1, FinishReason::Length));

    let (req, flag) = cancellable(&prompt, 4);
    let delay = std::time::Duration::from_secs_f64(full_s / 10.0);
    let setter = std::thread::spawn(move || {
        std::thread::sleep(delay);
        flag.store(true, Ordering::Relaxed);
    });
    let mut produced = Vec::new();
    let t = Instant::now();
    let o = e
        .generate(&req, &mut |tok| {
            produced.push(tok);
            ControlFlow::Continue(())
        })
        .unwrap();
    let cancelled_s = t.elapsed().as_secs_f64();
    setter.join().unwrap();
    eprintln!(
        "prefill of {} tokens: {full_s:.3}s; cancelled after {:.3}s in {cancelled_s:.3}s",
        prompt.len(),
        delay.as_secs_f64()
    );
    assert_eq!(o.finish, FinishReason::Cancelled);
    assert_eq!(o.stats.generated_tokens, 0);
    assert!(
        produced.is_empty(),
        "tokens after a cancelled prefill: {produced:?}"
    );
    assert!(
        cancelled_s < full_s / 2.0,
        "cancelled prefill took {cancelled_s:.3}s of a full {full_s:.3}s"
    );

    // A shorter prompt next: the cancelled prompt's keys and values are
    // still in the cache beyond it and must not be read.
    let next = long_prompt(300)[250..].to_vec();
    let mut fresh = engine(2048);
    assert_eq!(
        e.prompt_logits(&next).unwrap(),
        fresh.prompt_logits(&next).unwrap()
    );
    let (after, o) = run(&mut e, &request(&next, 8));
    let (want, _) = run(&mut fresh, &request(&next, 8));
    assert_eq!((after, o.finish), (want, FinishReason::Length));
}

/// The request's live progress counts prefilled tokens chunk by chunk: a
/// watcher on another thread sees intermediate chunk boundaries while a long
/// prompt prefills (and cancels once it has seen two), and a finished
/// request reports the whole prompt.
#[test]
fn live_progress_counts_prefilled_chunks() {
    let prompt = long_prompt(1536);
    let chunk = 32;
    let mut e = engine(2048);
    e.set_prefill_chunk(chunk);

    let req = request(&prompt, 2);
    assert_eq!(req.live.prefilled(), 0);
    run(&mut e, &req);
    assert_eq!(req.live.prefilled(), prompt.len() as u64);

    let (req, flag) = cancellable(&prompt, 2);
    let live = req.live.clone();
    let finished = Arc::new(AtomicBool::new(false));
    let fin = finished.clone();
    let n = prompt.len() as u64;
    let watcher = std::thread::spawn(move || {
        let mut seen = vec![0u64];
        while !fin.load(Ordering::Relaxed) {
            let p = live.prefilled();
            if p != *seen.last().unwrap() {
                seen.push(p);
                if seen.iter().filter(|&&v| v > 0 && v < n).count() >= 2 {
                    flag.store(true, Ordering::Relaxed);
                }
            }
            std::thread::yield_now();
        }
        seen
    });
    let o = e
        .generate(&req, &mut |_| ControlFlow::Continue(()))
        .unwrap();
    finished.store(true, Ordering::Relaxed);
    let seen = watcher.join().unwrap();
    assert_eq!(o.finish, FinishReason::Cancelled, "values seen: {seen:?}");
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "not increasing: {seen:?}"
    );
    assert!(
        seen.iter().all(|v| v % chunk as u64 == 0),
        "not at chunk boundaries: {seen:?}"
    );
    let last = req.live.prefilled();
    assert!(last > 0 && last < n, "cancelled after {last} of {n} tokens");
}
