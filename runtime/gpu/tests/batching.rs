//! Continuous batching in the CUDA engine (`batch.rs`) on the tiny
//! synthetic model: a request's tokens and logits are bit-identical whether
//! it ran alone or beside 1..7 others (greedy and seeded sampling with
//! penalties; admitted together or while others decode, so prefill chunks
//! interleave with decode steps), all resident (CUDA graphs per row count)
//! and under HCS with streamed prefill (against the all-resident run); a
//! request that does not fit the KV arena waits and runs once a sequence
//! ends; cancelling one sequence mid-prefill or mid-decode (or ending it)
//! leaves the others untouched and gives its rows back; a prefix-cache hit
//! restored into a sequence's rows is bit-identical to a cold prefill; each
//! planted batching fault breaks the invariance; gpt_oss (rings per
//! sequence in its sliding layers, MXFP4 experts) batches the same way. On a machine without an
//! NVIDIA driver every test prints `SKIPPED (no CUDA device): <name> (no
//! NVIDIA driver)`.

mod support;

use krasis_common::options::PrefixCacheChoice;
use krasis_gpu::forward::Fault;
use krasis_gpu::{CudaEngine, CudaEngineOptions};
use krasis_model::batch::{Admission, Batch, SeqEvent, SeqId};
use krasis_model::{
    CancelToken, Engine, FinishReason, GenerateOutcome, GenerateRequest, ModelConfig,
    SamplingParams,
};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use support::{
    bits, cuda_options, generate_all, gpu_or_skip, greedy_request, load, no_resident_options,
    synth, tokens,
};

const CONTEXT: usize = 1024;
const CHUNK: usize = 32;
const ROWS: usize = 4096;

fn options(cache: &Path, parallel: usize) -> CudaEngineOptions {
    CudaEngineOptions {
        hcs: false,
        parallel: Some(parallel),
        kv_rows: Some(ROWS),
        ..cuda_options(cache, CONTEXT, CHUNK)
    }
}

/// HCS with nothing resident and no prior: every decode lookup goes
/// through the recency tail (the tiny model's 24 experts would otherwise
/// all fit in the prior), with decode prefetch on (off by default), so the
/// side stream's promotions and copies run beside every step. The tail
/// has half the experts' slots (by default it would take the whole tier,
/// room for all 24), so it evicts.
fn hcs_options(cache: &Path, parallel: usize) -> CudaEngineOptions {
    CudaEngineOptions {
        parallel: Some(parallel),
        kv_rows: Some(ROWS),
        hcs_tail_slots: Some(12),
        hcs_prior_cap: Some(0),
        hcs_prefetch: 4,
        ..no_resident_options(cache, CONTEXT, CHUNK)
    }
}

/// One request of a batch run and the step it is first offered at.
#[derive(Clone)]
struct Job {
    req: GenerateRequest,
    at: usize,
}

/// What one request produced.
#[derive(Debug, Clone)]
struct Run {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
    outcome: GenerateOutcome,
}

/// What a batch run saw besides the requests' results.
#[derive(Debug, Default)]
struct Trace {
    /// Steps that prefilled a prompt while other sequences decoded.
    interleaved: usize,
    /// The most rows of one decode step.
    widest: usize,
    /// Admissions answered `Wait`.
    waits: usize,
}

/// Where a batch run is, for [`run_batch`]'s `act`.
struct View<'a> {
    /// The sequence of each job admitted so far.
    ids: &'a HashMap<usize, SeqId>,
    /// Tokens each job produced so far.
    tokens: Vec<usize>,
}

/// Offers each job from its step on (in order; a `Wait` is offered again
/// next step), steps until every job ended, and returns each job's run.
/// `act` runs before every step (cancels; an `end` fills the job's run).
fn run_batch(
    e: &mut CudaEngine,
    jobs: &[Job],
    mut act: impl FnMut(&View<'_>, &mut CudaEngine, &mut Vec<Option<Run>>),
) -> (Vec<Run>, Trace) {
    e.set_step_timing(true).unwrap();
    let mut out: Vec<Option<Run>> = vec![None; jobs.len()];
    let mut partial: HashMap<SeqId, (usize, Vec<u32>)> = HashMap::new();
    let mut ids: HashMap<usize, SeqId> = HashMap::new();
    let mut next = 0;
    let mut trace = Trace::default();
    let mut events = Vec::new();
    for step in 0.. {
        while next < jobs.len() && jobs[next].at <= step {
            match e.admit_recording(jobs[next].req.clone()).expect("admit") {
                Admission::Admitted(id) => {
                    ids.insert(next, id);
                    partial.insert(id, (next, Vec::new()));
                    next += 1;
                }
                Admission::Wait => {
                    trace.waits += 1;
                    break;
                }
            }
        }
        let mut done = vec![0; jobs.len()];
        for (j, t) in partial.values() {
            done[*j] = t.len();
        }
        let view = View {
            ids: &ids,
            tokens: done,
        };
        act(&view, e, &mut out);
        // Sequences ended by `act` are no longer running.
        partial.retain(|_, (j, _)| out[*j].is_none());
        if next == jobs.len() && e.active() == 0 {
            break;
        }
        assert!(step < 100_000, "the batch does not finish");
        events.clear();
        e.step(&mut events).expect("step");
        let t = e.last_step_timing().expect("step timing");
        if t.prefill_tokens > 0 && t.decode_rows > 0 {
            trace.interleaved += 1;
        }
        trace.widest = trace.widest.max(t.decode_rows);
        for ev in events.drain(..) {
            match ev {
                SeqEvent::Token { seq, token } => {
                    partial.get_mut(&seq).expect("known").1.push(token)
                }
                SeqEvent::Done { seq, result } => {
                    let (j, tokens) = partial.remove(&seq).expect("known");
                    let outcome = result.expect("the sequence failed");
                    let logits = e.take_recorded(seq).expect("recorded logits");
                    out[j] = Some(Run {
                        tokens,
                        logits,
                        outcome,
                    });
                }
            }
        }
    }
    e.set_step_timing(false).unwrap();
    assert_eq!(e.kv_rows_used().0, 0, "rows still reserved after the batch");
    (out.into_iter().map(|r| r.expect("ended")).collect(), trace)
}

/// Eight requests of different lengths: greedy, and seeded sampling with
/// top-p and presence/frequency penalties (each sequence its own counts).
fn requests(vocab: usize) -> Vec<GenerateRequest> {
    (0..8)
        .map(|i| {
            let prompt = tokens(5 + 29 * i, vocab, 100 + i as u64);
            let mut r = greedy_request(&prompt, 12 + 3 * i);
            if i % 2 == 1 {
                r.sampling = SamplingParams {
                    temperature: 0.9,
                    top_p: 0.9,
                    top_k: 40,
                    seed: Some(7 + i as u64),
                    presence_penalty: 0.5,
                    frequency_penalty: 0.3,
                    ..SamplingParams::default()
                };
            }
            r
        })
        .collect()
}

/// Each request alone.
fn alone(e: &mut CudaEngine, reqs: &[GenerateRequest]) -> Vec<Run> {
    reqs.iter()
        .map(|r| {
            let (runs, _) = run_batch(
                e,
                &[Job {
                    req: r.clone(),
                    at: 0,
                }],
                |_, _, _| {},
            );
            runs.into_iter().next().unwrap()
        })
        .collect()
}

/// How many runs' logits are not bit-identical to the wanted ones.
fn differing(got: &[Run], want: &[Run]) -> usize {
    got.iter()
        .zip(want)
        .filter(|(g, w)| bits(&g.logits) != bits(&w.logits))
        .count()
}

fn same(label: &str, got: &Run, want: &Run) -> bool {
    let ok = got.tokens == want.tokens && bits(&got.logits) == bits(&want.logits);
    if !ok {
        eprintln!(
            "{label}: tokens {:?} vs alone {:?}; logits bit-identical: {}",
            got.tokens,
            want.tokens,
            bits(&got.logits) == bits(&want.logits)
        );
    }
    ok
}

/// With `fault` planted (copies skipped), some request alone differs from
/// all resident: the test that uses it can fail. The fault stays planted.
fn fault_differs(e: &mut CudaEngine, fault: Fault, reqs: &[GenerateRequest], want: &[Run]) {
    e.set_fault(fault).unwrap();
    let differ = differing(&alone(e, reqs), want);
    eprintln!(
        "{fault:?}: {differ} of {} requests differ from all resident",
        reqs.len()
    );
    assert!(
        differ > 0,
        "{fault:?} (copies skipped) changed nothing: the test cannot fail"
    );
}

/// Every run bit-identical to its wanted run (tokens and logits).
fn all_same(label: &str, got: &[Run], want: &[Run]) {
    assert_eq!(got.len(), want.len(), "{label}: run count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            same(&format!("{label} {i}"), g, w),
            "{label}: request {i} differs from all resident"
        );
    }
}

/// Request 0 beside 1..7 others, all admitted at once and admitted while
/// the others decode; every request of every run equals its run alone.
fn invariant(label: &str, e: &mut CudaEngine, reqs: &[GenerateRequest], alone: &[Run]) {
    for others in 1..reqs.len() {
        for staggered in [false, true] {
            let jobs: Vec<Job> = reqs[..=others]
                .iter()
                .enumerate()
                .map(|(i, r)| Job {
                    req: r.clone(),
                    at: if staggered { 4 * i } else { 0 },
                })
                .collect();
            let (runs, trace) = run_batch(e, &jobs, |_, _, _| {});
            let tag = format!("{label}: {} requests, staggered {staggered}", others + 1);
            for (i, r) in runs.iter().enumerate() {
                assert!(
                    same(&format!("{tag}, request {i}"), r, &alone[i]),
                    "{tag}: request {i} differs from alone"
                );
                assert_eq!(
                    r.outcome.finish, alone[i].outcome.finish,
                    "{tag}: request {i}"
                );
            }
            assert!(trace.widest >= 2, "{tag}: no decode step ran two rows");
            if staggered {
                assert!(
                    trace.interleaved > 0,
                    "{tag}: no prefill ran beside decoding sequences"
                );
            }
            eprintln!("{tag}: ok ({trace:?})");
        }
    }
}

#[test]
fn batch_invariance_all_resident() {
    if !gpu_or_skip("batch_invariance_all_resident") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny");
    let cache = tmp.path().join("cache");
    let mut e = load(&model, &options(&cache, 8));
    assert!(!e.hcs_active());
    assert_eq!(e.capacity(), 8);
    let reqs = requests(e.info().vocab_size);
    let alone = alone(&mut e, &reqs);
    // Alone through the batch is `generate`.
    for (r, a) in reqs.iter().zip(&alone) {
        let (toks, o) = generate_all(&mut e, r);
        assert_eq!(toks, a.tokens, "generate differs from the batch alone");
        assert_eq!(o.finish, a.outcome.finish);
    }
    invariant("all resident, graphs", &mut e, &reqs, &alone);
    e.set_cuda_graphs(false);
    invariant("all resident, eager", &mut e, &reqs[..4], &alone);
}

/// HCS with nothing resident, no prior and streamed prefill, against the
/// all-resident runs alone: bit-identical alone and beside others, with
/// decode misses promoted into the GPU-managed tail and guesses prefetched
/// into it; the same run with the tail's copies skipped
/// (`Fault::StaleTail`), or only the prefetch's (`Fault::StalePrefetch`),
/// differs.
#[test]
fn batch_invariance_under_hcs_streamed_prefill() {
    if !gpu_or_skip("batch_invariance_under_hcs_streamed_prefill") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny");
    let cache = tmp.path().join("cache");
    let reqs = {
        let mut resident = load(&model, &options(&cache, 8));
        let reqs = requests(resident.info().vocab_size);
        let runs = alone(&mut resident, &reqs);
        (reqs, runs)
    };
    let (reqs, want) = reqs;
    let mut e = load(&model, &hcs_options(&cache, 8));
    assert!(e.hcs_active(), "HCS was not forced on");
    let hcs_alone = alone(&mut e, &reqs);
    all_same("HCS alone", &hcs_alone, &want);
    invariant("HCS", &mut e, &reqs, &want);
    let s = e.hcs_stats().expect("HCS stats");
    eprintln!(
        "HCS: {}/{} experts on the GPU, last traffic {s:?}",
        s.resident_experts, s.total_experts
    );
    assert!(
        s.cold_experts_per_token > 0.0 && s.hit_rate > 0.0 && s.hit_rate < 1.0,
        "the decode tail was not exercised (every lookup hit or none did): {s:?}"
    );
    assert!(
        s.prefetched_experts_per_token > 0.0,
        "decode prefetch was not exercised: {s:?}"
    );
    // Four requests that prefill in one pass and end in the same step: the
    // figures are those steps' traffic, not the empty collection of the
    // sequences that ended after the first.
    let together: Vec<Job> = reqs[1..5]
        .iter()
        .map(|r| Job {
            req: GenerateRequest {
                max_new_tokens: 16,
                ..r.clone()
            },
            at: 0,
        })
        .collect();
    run_batch(&mut e, &together, |_, _, _| {});
    let s = e.hcs_stats().expect("HCS stats");
    assert!(
        s.cold_experts_per_token > 0.0 && s.hit_rate < 1.0,
        "four sequences ending together left step-less HCS figures: {s:?}"
    );
    for fault in [Fault::StaleTail, Fault::StalePrefetch] {
        fault_differs(&mut e, fault, &reqs, &want);
    }
    e.set_fault(Fault::None).unwrap();
    all_same("HCS after the fault", &alone(&mut e, &reqs), &want);
}

/// HCS with half the tiny model's experts in the reclaimable prior, the
/// rest through the decode tail, streamed prefill: every prefill lends the
/// prior and reloads it, and decode runs beside the reload (`Hcs::restore`
/// points each chunk of the prior at its slots once its copies land), each
/// request alone and beside others bit-identical to all resident. With the
/// reload's copies skipped but its slots pointed at (`Fault::SkipReload`),
/// the prior's experts are read from what prefill left in their slots and
/// requests differ; so do they when the tail's promotions are not marked
/// fresh (`Fault::UnmarkedFetch`: the w13 GEMV reads them while their
/// copies run).
#[test]
fn decode_beside_the_prior_reload_is_exact() {
    if !gpu_or_skip("decode_beside_the_prior_reload_is_exact") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny");
    let cache = tmp.path().join("cache");
    let (reqs, want) = {
        let mut resident = load(&model, &options(&cache, 8));
        let reqs = requests(resident.info().vocab_size);
        let runs = alone(&mut resident, &reqs);
        (reqs, runs)
    };
    let opts = CudaEngineOptions {
        parallel: Some(8),
        kv_rows: Some(ROWS),
        // The tail takes the whole tier by default: two tokens' worth
        // (3 MoE layers x top-2 x 2) leaves the rest to a prior.
        hcs_tail_slots: Some(12),
        hcs_prior_cap: Some(12),
        ..no_resident_options(&cache, CONTEXT, CHUNK)
    };
    let mut e = load(&model, &opts);
    assert!(e.hcs_active(), "HCS was not forced on");
    all_same("HCS with a prior, alone", &alone(&mut e, &reqs), &want);
    let s = e.hcs_stats().expect("HCS stats");
    eprintln!(
        "HCS with a prior: {}/{} experts on the GPU, last traffic {s:?}",
        s.resident_experts, s.total_experts
    );
    assert!(
        s.resident_experts >= 12 && s.resident_experts < s.total_experts,
        "the prior does not hold part of the experts: {s:?}"
    );
    assert!(
        s.reload_bytes > 0 && s.cold_experts_per_token > 0.0,
        "no reload or no tail traffic: {s:?}"
    );
    invariant("HCS with a prior", &mut e, &reqs, &want);
    // Prefetch is off here, so the w13 GEMV overlaps the tail's fetch: its
    // waits for the promoted experts are what keeps it exact.
    for fault in [Fault::SkipReload, Fault::UnmarkedFetch] {
        fault_differs(&mut e, fault, &reqs, &want);
    }
    e.set_fault(Fault::None).unwrap();
    all_same(
        "HCS with a prior after the fault",
        &alone(&mut e, &reqs),
        &want,
    );
}

/// A request whose rows are taken waits, then runs once a sequence ended
/// and gave its rows back; a full batch waits too.
#[test]
fn a_request_waits_for_rows_then_runs() {
    if !gpu_or_skip("a_request_waits_for_rows_then_runs") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny");
    let cache = tmp.path().join("cache");
    // The arena is one context: 700 + 400 rows do not fit together.
    let mut e = load(
        &model,
        &CudaEngineOptions {
            kv_rows: None,
            ..options(&cache, 2)
        },
    );
    assert_eq!(e.kv_rows_used(), (0, CONTEXT));
    let vocab = e.info().vocab_size;
    let a = greedy_request(&tokens(600, vocab, 1), 101);
    let b = greedy_request(&tokens(300, vocab, 2), 101);
    let want = alone(&mut e, &[a.clone(), b.clone()]);
    let (runs, trace) = run_batch(
        &mut e,
        &[Job { req: a, at: 0 }, Job { req: b, at: 1 }],
        |_, _, _| {},
    );
    assert!(trace.waits > 0, "b never waited");
    assert_eq!(trace.widest, 1, "a and b decoded together in a full arena");
    for (i, (g, w)) in runs.iter().zip(&want).enumerate() {
        assert!(same(&format!("waited {i}"), g, w));
    }
    // A full batch: the third request waits.
    let small = greedy_request(&tokens(10, vocab, 3), 4);
    let x = e.admit(small.clone()).unwrap();
    let y = e.admit(small.clone()).unwrap();
    assert!(matches!(
        (x, y),
        (Admission::Admitted(_), Admission::Admitted(_))
    ));
    assert_eq!(e.admit(small.clone()).unwrap(), Admission::Wait);
    // A request that can never fit is an error at once, nothing held.
    assert!(
        e.admit(greedy_request(&tokens(CONTEXT + 1, vocab, 4), 4))
            .is_err()
    );
    for id in [x, y] {
        let Admission::Admitted(id) = id else {
            unreachable!()
        };
        let o = e.end(id).expect("running");
        assert_eq!(o.finish, FinishReason::Cancelled);
    }
    assert_eq!((e.active(), e.kv_rows_used().0), (0, 0));
}

/// Cancelling one sequence mid-prefill and another mid-decode, and ending a
/// third from the caller's side, leaves the rest bit-identical to their
/// runs alone and gives every row back.
#[test]
fn cancel_and_end_leave_the_others_untouched() {
    if !gpu_or_skip("cancel_and_end_leave_the_others_untouched") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny");
    let cache = tmp.path().join("cache");
    for opts in [options(&cache, 6), hcs_options(&cache, 6)] {
        let mut e = load(&model, &opts);
        let label = if e.hcs_active() {
            "HCS"
        } else {
            "all resident"
        };
        let vocab = e.info().vocab_size;
        let reqs = requests(vocab);
        let want = alone(&mut e, &reqs[..3]);
        let flags: Vec<Arc<AtomicBool>> =
            (0..2).map(|_| Arc::new(AtomicBool::new(false))).collect();
        // Job 3: a long prompt cancelled during its prefill (after its
        // first chunk; with HCS, whose prefill of a prompt is one step,
        // before it); job 4 cancelled after its third token; job 5 ended
        // from the caller's side after its second.
        let mut long = greedy_request(&tokens(CHUNK * 12, vocab, 9), 8);
        long.cancel = CancelToken::new(flags[0].clone());
        let progress = long.live.clone();
        let mut dec = greedy_request(&tokens(40, vocab, 10), 30);
        dec.cancel = CancelToken::new(flags[1].clone());
        let ended = greedy_request(&tokens(50, vocab, 11), 30);
        let mut jobs: Vec<Job> = reqs[..3]
            .iter()
            .map(|r| Job {
                req: r.clone(),
                at: 0,
            })
            .collect();
        jobs.push(Job { req: long, at: 1 });
        jobs.push(Job { req: dec, at: 1 });
        jobs.push(Job { req: ended, at: 1 });
        let hcs = e.hcs_active();
        let mut ended_outcome = None;
        let mut cancelled_at = None;
        let (runs, _) = run_batch(&mut e, &jobs, |v, e, out| {
            let prefilled = progress.prefilled();
            if cancelled_at.is_none()
                && v.ids.contains_key(&3)
                && (hcs || (prefilled > 0 && (prefilled as usize) < CHUNK * 12))
            {
                flags[0].store(true, Ordering::Relaxed);
                cancelled_at = Some(prefilled);
            }
            if v.tokens[4] >= 3 {
                flags[1].store(true, Ordering::Relaxed);
            }
            if v.tokens[5] >= 2
                && out[5].is_none()
                && let Some(&id) = v.ids.get(&5)
            {
                let o = e.end(id).expect("job 5 running");
                ended_outcome = Some(o.clone());
                out[5] = Some(Run {
                    tokens: Vec::new(),
                    logits: e.take_recorded(id).unwrap_or_default(),
                    outcome: o,
                });
            }
        });
        eprintln!("{label}: job 3 cancelled with {cancelled_at:?} prompt tokens prefilled");
        assert!(
            cancelled_at.is_some(),
            "{label}: job 3 was not cancelled in its prefill"
        );
        for i in 0..3 {
            assert!(
                same(&format!("{label} {i}"), &runs[i], &want[i]),
                "{label}: request {i} changed"
            );
        }
        assert_eq!(runs[3].outcome.finish, FinishReason::Cancelled, "{label}");
        assert_eq!(
            runs[3].outcome.stats.generated_tokens, 0,
            "{label}: tokens after a prefill cancel"
        );
        assert_eq!(runs[4].outcome.finish, FinishReason::Cancelled, "{label}");
        assert!(
            runs[4].outcome.stats.generated_tokens > 0,
            "{label}: decode cancel before any token"
        );
        let o = ended_outcome.expect("job 5 ended from the caller's side");
        assert_eq!(
            (o.finish, o.stats.generated_tokens),
            (FinishReason::Cancelled, 2)
        );
        assert_eq!(
            (e.active(), e.kv_rows_used().0),
            (0, 0),
            "{label}: rows held after the batch"
        );
    }
}

/// A prompt served from the prefix cache into a sequence's rows (not row
/// 0: another sequence holds those; for gpt_oss, not the first ring
/// either: its sliding layers' window goes into the second slot's ring)
/// is bit-identical to a cold prefill (an engine whose cache the request
/// bypasses: gpt_oss's MXFP4 experts then take the cached engine's way).
#[test]
fn a_prefix_hit_into_a_sequences_rows_is_exact() {
    if !gpu_or_skip("a_prefix_hit_into_a_sequences_rows_is_exact") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    for model in [
        synth(tmp.path(), "tiny"),
        krasis_model::testutil::tiny_gpt_oss_checkpoint(),
    ] {
        let g = ModelConfig::load(&model).unwrap().geometry();
        // 64-token blocks: a 230-token prompt stores 3 whole blocks.
        const BLOCK: usize = 64;
        let pool = 64 * krasis_gpu::prefix::block_bytes(&g, BLOCK);
        let cached = |base| CudaEngineOptions {
            prefix_cache: PrefixCacheChoice::Bytes(pool),
            prefix_block: BLOCK,
            ..base
        };
        for base in [options(&cache, 4), hcs_options(&cache, 4)] {
            let mut e = load(&model, &cached(base));
            let mut cold = load(&model, &cached(options(&cache, 4)));
            let vocab = e.info().vocab_size;
            let prompt = tokens(230, vocab, 21);
            let mut req = greedy_request(&prompt, 10);
            req.cache_prompt = false;
            let want = alone(&mut cold, std::slice::from_ref(&req));
            req.cache_prompt = true;
            // Store the prompt's blocks.
            alone(&mut e, std::slice::from_ref(&req));
            // Another sequence first (it takes the arena's first rows and
            // the first slot), then the prompt again, from the cache.
            let other = greedy_request(&tokens(90, vocab, 22), 20);
            let (runs, _) = run_batch(
                &mut e,
                &[
                    Job { req: other, at: 0 },
                    Job {
                        req: req.clone(),
                        at: 2,
                    },
                ],
                |_, _, _| {},
            );
            let label = format!("{}: prefix hit into a sequence's rows", model.display());
            assert_eq!(runs[1].outcome.stats.cached_tokens, 3 * BLOCK, "{label}");
            assert!(same(&label, &runs[1], &want[0]), "{label}");
        }
    }
}

/// Each planted batching fault leaves a request alone unchanged and makes
/// some request beside others differ from its run alone: the invariance
/// test can fail. All resident and under HCS, where prompts admitted
/// together share one streamed pass (`Fault::PackedBase` reaches it only
/// there).
#[test]
fn planted_batch_faults_break_invariance() {
    if !gpu_or_skip("planted_batch_faults_break_invariance") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny");
    let cache = tmp.path().join("cache");
    for opts in [options(&cache, 4), hcs_options(&cache, 4)] {
        let mut e = load(&model, &opts);
        let label = if e.hcs_active() {
            "HCS"
        } else {
            "all resident"
        };
        let reqs: Vec<GenerateRequest> = requests(e.info().vocab_size)[..4]
            .iter()
            .map(|r| GenerateRequest {
                sampling: SamplingParams::greedy(),
                ..r.clone()
            })
            .collect();
        let want = alone(&mut e, &reqs);
        let jobs: Vec<Job> = reqs
            .iter()
            .map(|r| Job {
                req: r.clone(),
                at: 0,
            })
            .collect();
        for fault in Fault::BATCH {
            e.set_fault(fault).unwrap();
            let faulty_alone = alone(&mut e, &reqs[..1]);
            assert!(
                same(
                    &format!("{label}: {fault:?} alone"),
                    &faulty_alone[0],
                    &want[0]
                ),
                "{label}: {fault:?} changed a request alone"
            );
            let (runs, _) = run_batch(&mut e, &jobs, |_, _, _| {});
            let differ = differing(&runs, &want);
            eprintln!(
                "{label}: {fault:?}: {differ} of {} requests differ from alone",
                runs.len()
            );
            assert!(
                differ > 0,
                "{label}: {fault:?} did not break batch invariance: the test cannot fail"
            );
        }
        e.set_fault(Fault::None).unwrap();
        let (runs, _) = run_batch(&mut e, &jobs, |_, _, _| {});
        for (i, (g, w)) in runs.iter().zip(&want).enumerate() {
            assert!(same(&format!("{label}: after the faults {i}"), g, w));
        }
    }
}

/// gpt_oss (tiny-gpt-oss: sliding layers of window 16 in rings of 47 rows
/// per sequence, sink attention in every layer, MXFP4 experts, FP16
/// attention): a request's tokens and logits are bit-identical alone and
/// beside 1..3 others, admitted together (packed prefill, the MXFP4 experts
/// in place) and while others decode, all resident and under HCS with
/// streamed prefill (against the all-resident runs). The prompts (5-92
/// tokens) and their decodes wrap the rings. Each planted batching fault,
/// and rows given each other's rings (`Fault::SwapRowRings`), leaves a
/// request alone unchanged and breaks the invariance.
#[test]
fn gpt_oss_batch_invariance() {
    if !gpu_or_skip("gpt_oss_batch_invariance") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = krasis_model::testutil::tiny_gpt_oss_checkpoint();
    let cache = tmp.path().join("cache");
    let mut e = load(&model, &options(&cache, 4));
    assert_eq!(e.capacity(), 4);
    let reqs: Vec<GenerateRequest> = requests(e.info().vocab_size)[..4].to_vec();
    let want = alone(&mut e, &reqs);
    invariant("gpt-oss all resident", &mut e, &reqs, &want);
    let greedy: Vec<GenerateRequest> = reqs
        .iter()
        .map(|r| GenerateRequest {
            sampling: SamplingParams::greedy(),
            ..r.clone()
        })
        .collect();
    let greedy_want = alone(&mut e, &greedy);
    let jobs: Vec<Job> = greedy
        .iter()
        .map(|r| Job {
            req: r.clone(),
            at: 0,
        })
        .collect();
    for fault in Fault::BATCH.into_iter().chain([Fault::SwapRowRings]) {
        e.set_fault(fault).unwrap();
        let faulty_alone = alone(&mut e, &greedy[..1]);
        assert!(
            same(
                &format!("gpt-oss {fault:?} alone"),
                &faulty_alone[0],
                &greedy_want[0]
            ),
            "gpt-oss: {fault:?} changed a request alone"
        );
        let (runs, _) = run_batch(&mut e, &jobs, |_, _, _| {});
        let differ = differing(&runs, &greedy_want);
        eprintln!(
            "gpt-oss: {fault:?}: {differ} of {} requests differ from alone",
            runs.len()
        );
        assert!(
            differ > 0,
            "gpt-oss: {fault:?} did not break batch invariance: the test cannot fail"
        );
    }
    e.set_fault(Fault::None).unwrap();
    drop(e);
    let mut h = load(&model, &hcs_options(&cache, 4));
    assert!(h.hcs_active());
    invariant("gpt-oss HCS", &mut h, &reqs, &want);
}

/// gpt_oss prompts on both MXFP4 ways: two past
/// `MXFP4_IN_PLACE_MAX_TOKENS` (their experts dequantized, per-expert
/// GEMMs) and one short (in place), admitted together and staggered. A
/// packed pass holds prompts of one way, so each request's tokens and
/// logits are bit-identical to its run alone; the long prompts' sliding
/// layers run in 512-token pieces of 1,024-token chunks.
#[test]
fn gpt_oss_both_expert_ways_batch_invariance() {
    if !gpu_or_skip("gpt_oss_both_expert_ways_batch_invariance") {
        return;
    }
    const LONG_CONTEXT: usize = 4096;
    let tmp = tempfile::tempdir().unwrap();
    let model = krasis_model::testutil::tiny_gpt_oss_checkpoint();
    let cache = tmp.path().join("cache");
    let opts = CudaEngineOptions {
        hcs: false,
        parallel: Some(3),
        kv_rows: Some(3 * LONG_CONTEXT),
        ..cuda_options(&cache, LONG_CONTEXT, 1024)
    };
    let mut e = load(&model, &opts);
    let vocab = e.info().vocab_size;
    let long = krasis_gpu::expert_ffn::MXFP4_IN_PLACE_MAX_TOKENS;
    let reqs: Vec<GenerateRequest> = [(long + 64, 8), (long + 200, 10), (300, 12)]
        .iter()
        .enumerate()
        .map(|(i, &(n, new))| greedy_request(&tokens(n, vocab, 500 + i as u64), new))
        .collect();
    let want = alone(&mut e, &reqs);
    invariant("gpt-oss both expert ways", &mut e, &reqs, &want);
}

/// Decode ahead (`batch/ahead.rs`): sequences admitted without logits
/// recording, with step timing off, queue each decode step before the host
/// has read the one in flight. Their tokens are those of the recorded runs
/// alone (whose steps all wait: recording and step timing keep steps from
/// going ahead), with one sequence ended mid-run by a stop token (its next
/// row, already queued, is dropped), one ended from the caller's side and
/// the others at `max_tokens` (whose last step never goes ahead: no KV row
/// is left past it); the engine counts the steps that went ahead, and the
/// arena's rows all come back. Greedy and seeded sampling with penalties
/// (a step ahead samples with the next step index and the counts the step
/// before updated on the device). All resident, then under HCS (the tail's
/// lookups, copies and prefetch on the device, its counters read back into
/// alternating sets), against the all-resident runs.
#[test]
fn decode_ahead_gives_the_tokens_of_steps_waited_for() {
    if !gpu_or_skip("decode_ahead_gives_the_tokens_of_steps_waited_for") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = synth(tmp.path(), "tiny");
    let cache = tmp.path().join("cache");
    let mut e = load(&model, &options(&cache, 8));
    let mut reqs = requests(e.info().vocab_size);
    let want = alone(&mut e, &reqs);
    let ahead = |e: &CudaEngine| e.stats().expect("engine stats").decode_steps_ahead;
    assert_eq!(ahead(&e), 0, "a recorded, timed step went ahead");
    // Request 1 stops at the first occurrence of its 4th token.
    let stop = want[1].tokens[3];
    let stop_len = want[1].tokens.iter().position(|&t| t == stop).unwrap() + 1;
    reqs[1].stop_token_ids = vec![stop];
    decode_ahead_runs("all resident", &mut e, &reqs, &want, stop_len);
    drop(e);
    let mut h = load(&model, &hcs_options(&cache, 8));
    assert!(h.hcs_active(), "HCS was not forced on");
    decode_ahead_runs("HCS", &mut h, &reqs, &want, stop_len);
    let s = h.hcs_stats().expect("HCS stats");
    assert!(
        s.cold_experts_per_token > 0.0 && s.hit_rate < 1.0,
        "HCS: the decode tail was not exercised by the steps ahead: {s:?}"
    );
}

/// `decode_ahead_gives_the_tokens_of_steps_waited_for`'s runs on `e`.
fn decode_ahead_runs(
    engine: &str,
    e: &mut CudaEngine,
    reqs: &[GenerateRequest],
    want: &[Run],
    stop_len: usize,
) {
    let ahead = |e: &CudaEngine| e.stats().expect("engine stats").decode_steps_ahead;
    for (what, jobs) in [("alone", 1), ("beside others", reqs.len())] {
        let label = format!("{engine}, {what}");
        let before = ahead(e);
        let mut ids = Vec::new();
        for r in &reqs[..jobs] {
            match e.admit(r.clone()).expect("admit") {
                Admission::Admitted(id) => ids.push(id),
                Admission::Wait => panic!("{label}: no room for {} requests", jobs),
            }
        }
        let mut got: Vec<Vec<u32>> = vec![Vec::new(); jobs];
        let mut finish: Vec<Option<FinishReason>> = vec![None; jobs];
        let mut events = Vec::new();
        let mut ended_early = false;
        while e.active() > 0 {
            events.clear();
            e.step(&mut events).expect("step");
            for ev in events.drain(..) {
                let (j, ev) = (ids.iter().position(|&s| s == seq_of(&ev)).unwrap(), ev);
                match ev {
                    SeqEvent::Token { token, .. } => got[j].push(token),
                    SeqEvent::Done { result, .. } => {
                        finish[j] = Some(result.expect("the sequence failed").finish)
                    }
                }
            }
            // Request 2 ends from the caller's side after its 5th token.
            if jobs > 2 && !ended_early && got[2].len() >= 5 {
                let o = e.end(ids[2]).expect("request 2 was running");
                finish[2] = Some(o.finish);
                ended_early = true;
            }
        }
        for j in 0..jobs {
            let (want_tokens, want_finish) = match j {
                1 => (&want[1].tokens[..stop_len], FinishReason::Stop),
                2 => (&want[2].tokens[..got[2].len()], FinishReason::Cancelled),
                _ => (&want[j].tokens[..], want[j].outcome.finish),
            };
            assert_eq!(got[j], want_tokens, "{label}: request {j}'s tokens");
            assert_eq!(
                finish[j],
                Some(want_finish),
                "{label}: request {j}'s finish"
            );
        }
        if jobs > 2 {
            assert!(got[2].len() >= 5 && got[2].len() < want[2].tokens.len());
        }
        let went = ahead(e) - before;
        assert!(went > 0, "{label}: no decode step went ahead");
        eprintln!("{label}: ok, {went} decode steps went ahead");
        assert_eq!(e.kv_rows_used().0, 0, "{label}: rows still reserved");
    }
}

fn seq_of(ev: &SeqEvent) -> SeqId {
    match ev {
        SeqEvent::Token { seq, .. } | SeqEvent::Done { seq, .. } => *seq,
    }
}
