//! Continuous batching of the reference engine: a sequence's logits and
//! tokens beside others are bit for bit its logits and tokens alone; a new
//! prompt's prefill is interleaved one chunk per step with running decodes;
//! admission waits for KV (and a batch place) and refuses what never fits;
//! cancelling or ending one sequence frees its KV and leaves the others
//! exact; the prefix cache serves a sequence from blocks another running
//! sequence stored; a fatal error loses every sequence.

use super::*;
use crate::batch::{Admission, Batch, KvUsage, SeqEvent, SeqId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

fn admit(e: &mut ReferenceEngine, req: GenerateRequest) -> SeqId {
    match e.admit(req).unwrap() {
        Admission::Admitted(s) => s,
        Admission::Wait => panic!("the engine asked to wait"),
    }
}

/// What each sequence produced, and when.
#[derive(Default)]
struct Drained {
    tokens: HashMap<SeqId, Vec<u32>>,
    /// The step (counted from 1) of each of a sequence's tokens.
    steps: HashMap<SeqId, Vec<usize>>,
    outcomes: HashMap<SeqId, GenerateOutcome>,
}

impl Drained {
    /// One step; records its events.
    fn step(&mut self, e: &mut ReferenceEngine, n: usize) {
        let mut events = Vec::new();
        e.step(&mut events).unwrap();
        for ev in events {
            match ev {
                SeqEvent::Token { seq, token } => {
                    assert!(!self.outcomes.contains_key(&seq), "a token after the end");
                    self.tokens.entry(seq).or_default().push(token);
                    self.steps.entry(seq).or_default().push(n);
                }
                SeqEvent::Done { seq, result } => {
                    let o = result.unwrap();
                    assert_eq!(
                        o.stats.generated_tokens,
                        self.tokens.get(&seq).map_or(0, Vec::len),
                        "the outcome counts the tokens reported"
                    );
                    assert!(self.outcomes.insert(seq, o).is_none(), "two ends");
                }
            }
        }
    }

    /// Steps until no sequence runs.
    fn all(e: &mut ReferenceEngine) -> Self {
        let mut d = Drained::default();
        let mut n = 0;
        while e.active() > 0 {
            n += 1;
            d.step(e, n);
            assert!(n < 10_000, "the batch never drained");
        }
        d
    }
}

fn seeded(prompt: &[u32], max: usize, seed: u64) -> GenerateRequest {
    let mut r = request(prompt, max);
    r.sampling = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: Some(seed),
        presence_penalty: 0.3,
        ..SamplingParams::default()
    };
    r
}

/// Tokens and the logits each came from, run alone through `generate`.
fn alone(e: &mut ReferenceEngine, req: &GenerateRequest) -> (Vec<u32>, Vec<Vec<f32>>) {
    e.logits_log = Some(Vec::new());
    let (tokens, _) = run(e, req);
    let logits = e.logits_log.take().unwrap();
    (tokens, logits.into_iter().map(|(_, l)| l).collect())
}

fn bits(rows: &[Vec<f32>]) -> Vec<Vec<u32>> {
    rows.iter()
        .map(|r| r.iter().map(|v| v.to_bits()).collect())
        .collect()
}

#[test]
fn a_sequence_beside_others_is_bit_identical_to_alone() {
    let mut e = engine(256);
    e.set_prefill_chunk(16);
    let reqs = [
        request(&long_prompt(40), 12),
        seeded(&long_prompt(70)[20..], 10, 7),
        request(&PROMPT, 15),
        seeded(&long_prompt(33), 9, 11),
    ];
    let solo: Vec<_> = reqs.iter().map(|r| alone(&mut e, r)).collect();
    assert_eq!(e.kv_usage().used_tokens, 0);

    e.logits_log = Some(Vec::new());
    let ids: Vec<SeqId> = reqs.iter().map(|r| admit(&mut e, r.clone())).collect();
    let d = Drained::all(&mut e);
    let log = e.logits_log.take().unwrap();
    for (i, id) in ids.iter().enumerate() {
        let logits: Vec<Vec<f32>> = (log.iter())
            .filter(|(s, _)| s == id)
            .map(|(_, l)| l.clone())
            .collect();
        assert_eq!(d.tokens[id], solo[i].0, "request {i}: tokens");
        assert!(
            bits(&logits) == bits(&solo[i].1),
            "request {i}: logits differ beside others"
        );
        assert_eq!(d.outcomes[id].finish, FinishReason::Length);
    }
    // They really ran together: a later request's first token came before
    // an earlier one's last.
    assert!(d.steps[&ids[3]][0] < *d.steps[&ids[0]].last().unwrap());
}

/// A new prompt's prefill runs one chunk per step while a running sequence
/// keeps producing one token every step (its decode stalls by at most one
/// chunk), and both produce tokens before either finishes.
#[test]
fn a_prefill_is_interleaved_chunk_by_chunk_with_running_decodes() {
    let mut e = engine(256);
    e.set_prefill_chunk(16);
    let a = admit(&mut e, request(&PROMPT, 20));
    let mut d = Drained::default();
    d.step(&mut e, 1);
    d.step(&mut e, 2);
    assert_eq!(d.steps[&a], [1, 2]);
    let b = admit(&mut e, request(&long_prompt(100), 20));
    let mut n = 2;
    while e.active() > 0 {
        n += 1;
        d.step(&mut e, n);
    }
    // A decoded at every step until its 20th token.
    assert_eq!(d.steps[&a], (1..=20).collect::<Vec<_>>());
    // B's 7 chunks ran at steps 3..=9, its first token with the last.
    assert_eq!(d.steps[&b][0], 9);
    assert!(d.steps[&b][0] < *d.steps[&a].last().unwrap());
    assert_eq!(
        d.tokens[&b],
        run(&mut engine(256), &request(&long_prompt(100), 20)).0
    );
}

#[test]
fn admission_waits_for_kv_and_a_batch_place_and_refuses_what_never_fits() {
    let mut e = engine(256);
    assert_eq!(e.kv_tokens(), 256 * BATCH_CAPACITY, "the default budget");
    e.set_kv_tokens(64);
    let a = admit(&mut e, request(&PROMPT, 40)); // 46 tokens
    let used = KvUsage {
        used_tokens: 46,
        total_tokens: 64,
    };
    assert_eq!(e.kv_usage(), used);
    assert_eq!(e.admit(request(&PROMPT, 30)).unwrap(), Admission::Wait);
    assert_eq!(e.kv_usage(), used, "a wait reserves nothing");
    let err = e.admit(request(&PROMPT, 100)).unwrap_err();
    assert!(
        matches!(&err, EngineError::InvalidRequest(m) if m.contains("KV budget is 64")),
        "{err}"
    );
    // Bad requests are refused before any accounting.
    assert!(matches!(
        e.admit(request(&[], 4)),
        Err(EngineError::EmptyPrompt)
    ));
    let d = Drained::all(&mut e);
    assert_eq!(d.tokens[&a].len(), 40);
    assert_eq!(e.kv_usage().used_tokens, 0);
    let b = admit(&mut e, request(&PROMPT, 30));
    assert_eq!(Drained::all(&mut e).tokens[&b].len(), 30);

    // At most BATCH_CAPACITY sequences, whatever the KV.
    e.set_kv_tokens(1 << 20);
    for _ in 0..BATCH_CAPACITY {
        admit(&mut e, request(&PROMPT, 2));
    }
    assert_eq!(e.admit(request(&PROMPT, 2)).unwrap(), Admission::Wait);
    Drained::all(&mut e);
    // Through `generate`, a request that never fits is refused too.
    e.set_kv_tokens(8);
    let err = e
        .generate(&request(&PROMPT, 10), &mut |_| ControlFlow::Continue(()))
        .unwrap_err();
    assert!(matches!(err, EngineError::InvalidRequest(_)), "{err}");
}

fn cancellable(prompt: &[u32], max: usize) -> (GenerateRequest, Arc<AtomicBool>) {
    let flag = Arc::new(AtomicBool::new(false));
    let mut req = request(prompt, max);
    req.cancel = CancelToken::new(flag.clone());
    (req, flag)
}

#[test]
fn cancelling_or_ending_one_sequence_frees_its_kv_and_leaves_the_others_exact() {
    let mut e = engine(512);
    e.set_prefill_chunk(16);
    let want_a = run(&mut e, &request(&PROMPT, 30)).0;
    let a = admit(&mut e, request(&PROMPT, 30));
    let (rb, flag_b) = cancellable(&long_prompt(200), 8);
    let live_b = rb.live.clone();
    let b = admit(&mut e, rb);
    let (rc, flag_c) = cancellable(&long_prompt(50), 20);
    let c = admit(&mut e, rc);
    let d_req = request(&long_prompt(20), 20);
    let dd = admit(&mut e, d_req);
    let reserved = |e: &ReferenceEngine| e.kv_usage().used_tokens;
    assert_eq!(reserved(&e), 36 + 208 + 70 + 40);

    let mut d = Drained::default();
    let mut n = 0;
    let mut step = |e: &mut ReferenceEngine, d: &mut Drained| {
        n += 1;
        d.step(e, n);
    };
    // B cancelled mid-prefill (after 2 of its 13 chunks).
    while live_b.prefilled() < 32 {
        step(&mut e, &mut d);
    }
    flag_b.store(true, Ordering::Relaxed);
    step(&mut e, &mut d);
    let ob = &d.outcomes[&b];
    assert_eq!(
        (ob.finish, ob.stats.generated_tokens),
        (FinishReason::Cancelled, 0)
    );
    assert_eq!(live_b.prefilled(), 32, "no chunk after the cancel");
    assert_eq!(reserved(&e), 36 + 70 + 40);
    // C cancelled mid-decode, after its third token.
    while d.tokens.get(&c).map_or(0, Vec::len) < 3 {
        step(&mut e, &mut d);
    }
    flag_c.store(true, Ordering::Relaxed);
    step(&mut e, &mut d);
    let oc = &d.outcomes[&c];
    assert_eq!(
        (oc.finish, oc.stats.generated_tokens),
        (FinishReason::Cancelled, 3)
    );
    assert_eq!(reserved(&e), 36 + 40);
    // D ended by the caller after its second token.
    while d.tokens.get(&dd).map_or(0, Vec::len) < 2 {
        step(&mut e, &mut d);
    }
    let od = e.end(dd).unwrap();
    assert_eq!(
        (od.finish, od.stats.generated_tokens),
        (FinishReason::Cancelled, 2)
    );
    assert!(e.end(dd).is_none(), "ended once");
    assert_eq!(reserved(&e), 36);
    while e.active() > 0 {
        step(&mut e, &mut d);
    }
    assert_eq!(d.tokens[&a], want_a, "the survivor is exact");
    assert_eq!(reserved(&e), 0);
    assert!(
        !d.outcomes.contains_key(&dd),
        "an ended sequence has no Done"
    );
}

/// A break on a sequence's last token (it ended by itself in that step)
/// still ends the generation as cancelled, as `Engine::generate` says.
#[test]
fn a_break_on_the_last_token_is_a_cancel() {
    let mut e = engine(64);
    let mut seen = 0;
    let o = e
        .generate(&request(&PROMPT, 3), &mut |_| {
            seen += 1;
            if seen == 3 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
        .unwrap();
    assert_eq!(
        (o.finish, o.stats.generated_tokens),
        (FinishReason::Cancelled, 3)
    );
    assert_eq!(e.active(), 0);
}

/// Two running sequences sharing a system prompt: the second's prefill,
/// which begins after the first's completed, reuses the blocks the first
/// stored; a cancelled third stores nothing; all outputs are those of an
/// engine without a cache.
#[test]
fn the_prefix_cache_serves_running_sequences_from_each_other() {
    const B: usize = 16;
    let text = |n: usize, seed: u32| -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i.wrapping_mul(131) + seed * 977 + 7) % 512)
            .collect()
    };
    let mut e = engine(512);
    e.set_prefill_chunk(B);
    let g = e.geometry().clone();
    e.set_prefix_cache(PrefixSizes {
        primary_bytes: 64 * (g.num_layers * 2 * B * g.kv_dim() * 4) as u64,
        secondary_bytes: 0,
        block_tokens: B,
    });
    let mut cold = engine(512);
    cold.set_prefill_chunk(B);
    let system = text(40, 4);
    let conv = |seed| [system.clone(), text(37, seed)].concat();
    let cached = |p: &[u32]| {
        let mut r = request(p, 10);
        r.cache_prompt = true;
        r
    };
    let (pa, pb) = (conv(5), conv(6));
    let a = admit(&mut e, cached(&pa));
    let b = admit(&mut e, cached(&pb));
    let (mut rc, flag_c) = cancellable(&text(80, 9), 10);
    rc.cache_prompt = true;
    let live_c = rc.live.clone();
    let c = admit(&mut e, rc);
    let mut d = Drained::default();
    let mut n = 0;
    // C is cancelled after 2 of its 5 chunks.
    while e.active() > 0 {
        if live_c.prefilled() == 2 * B as u64 {
            flag_c.store(true, Ordering::Relaxed);
        }
        n += 1;
        d.step(&mut e, n);
    }
    assert_eq!(d.tokens[&a], run(&mut cold, &request(&pa, 10)).0);
    assert_eq!(d.tokens[&b], run(&mut cold, &request(&pb, 10)).0);
    assert_eq!(d.outcomes[&a].stats.cached_tokens, 0);
    assert_eq!(d.outcomes[&b].stats.cached_tokens, 32);
    assert_eq!(d.outcomes[&c].finish, FinishReason::Cancelled);
    // A's 4 whole blocks and B's 2 after the shared system prompt; none of C's.
    assert_eq!(e.prefix_cache_stats().unwrap().blocks_held, 4 + 2);
}

/// A fatal error in a step (a broken expert source) is the engine's: the
/// step returns it and every sequence is gone, its KV with it.
#[test]
fn a_fatal_step_error_loses_every_sequence() {
    let opts = ReferenceOptions {
        context_length: Some(16),
    };
    let mut e = ReferenceEngine::with_experts(&small_vocab(), opts, Arc::new(WrongShape)).unwrap();
    admit(&mut e, request(&PROMPT, 4));
    admit(&mut e, request(&PROMPT[..3], 4));
    let err = e.step(&mut Vec::new()).unwrap_err();
    assert!(err.is_fatal(), "{err}");
    assert_eq!((e.active(), e.kv_usage().used_tokens), (0, 0));
}
