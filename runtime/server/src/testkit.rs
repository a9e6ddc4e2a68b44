//! A scripted [`Engine`] for tests: it answers each prompt with tokens chosen
//! by a responder function, so server behaviour (tool-call round trips, stop
//! strings, cancellation, panics, engine errors, queueing) is tested
//! deterministically while the real tokenizer, chat template and output
//! parsers all run. Like the real engines it honours the request's
//! [`CancelToken`](krasis_model::CancelToken) between (simulated) prefill
//! chunks and decode steps, and reports its progress through the request's
//! [`LiveProgress`](krasis_model::LiveProgress) as they do. It stands in for
//! a prefix cache too: a request with `cache_prompt` reports as cached the
//! tokens its prompt shares with the previous such request's (at most all
//! but its last), as a real engine reports its hit.
//!
//! It batches like the real engines ([`Batch`]): up to
//! [`ScriptedEngine::with_capacity`] sequences, each reserving prompt +
//! `max_new_tokens` (within the context) of a KV budget
//! ([`ScriptedEngine::with_kv_tokens`]) at admission; a step runs one
//! simulated prefill chunk of the oldest sequence still prefilling, then
//! one token of every decoding sequence (one `token_delay` per step, as one
//! batched decode step), so the server's scheduler is tested
//! deterministically. [`ScriptedEngine::without_batching`] hides the batch
//! interface, for the server's one-at-a-time path.

use krasis_common::status::{EngineStats, HcsStats, VramStats};
use krasis_model::batch::generate_one;
use krasis_model::{
    Admission, Batch, Engine, EngineError, EngineInfo, FinishReason, GenerateOutcome,
    GenerateRequest, GenerateStats, KvUsage, SeqEvent, SeqId,
};
use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Maps a prompt to the tokens the "model" will produce (it may panic, to
/// test panic handling).
pub type Responder = Box<dyn FnMut(&[u32]) -> Vec<u32> + Send>;

/// Chooses an error for a prompt (`None`: generate normally).
pub type Failure = Box<dyn FnMut(&[u32]) -> Option<EngineError> + Send>;

pub struct ScriptedEngine {
    responder: Responder,
    context_length: usize,
    vocab_size: usize,
    token_delay: Duration,
    prefill_chunk: usize,
    chunk_delay: Duration,
    failure: Option<Failure>,
    cache_figures: bool,
    /// The last prompt of a request with `cache_prompt`.
    last_cached_prompt: Vec<u32>,
    capacity: usize,
    kv_tokens: usize,
    batching: bool,
    seqs: Vec<Seq>,
    next_seq: u64,
    /// Tokens handed to callbacks, across all requests.
    pub produced: Arc<AtomicUsize>,
    /// Prefill chunks run, across all requests.
    pub prefill_chunks: Arc<AtomicUsize>,
    /// `save_prefix_cache` calls on an idle engine.
    pub saves: Arc<AtomicUsize>,
}

impl ScriptedEngine {
    pub fn new(vocab_size: usize, context_length: usize, responder: Responder) -> Self {
        ScriptedEngine {
            responder,
            context_length,
            vocab_size,
            token_delay: Duration::ZERO,
            prefill_chunk: usize::MAX,
            chunk_delay: Duration::ZERO,
            failure: None,
            cache_figures: false,
            last_cached_prompt: Vec::new(),
            capacity: DEFAULT_CAPACITY,
            kv_tokens: DEFAULT_CAPACITY * context_length,
            batching: true,
            seqs: Vec::new(),
            next_seq: 0,
            produced: Arc::new(AtomicUsize::new(0)),
            prefill_chunks: Arc::new(AtomicUsize::new(0)),
            saves: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Prefills in chunks of `chunk` prompt tokens taking `delay` each,
    /// looking at the request's cancel token before every chunk.
    pub fn with_prefill(mut self, chunk: usize, delay: Duration) -> Self {
        self.prefill_chunk = chunk.max(1);
        self.chunk_delay = delay;
        self
    }

    /// Fails the prompts `failure` picks with the error it returns.
    pub fn with_failure(mut self, failure: Failure) -> Self {
        self.failure = Some(failure);
        self
    }

    /// Reports expert-cache and VRAM figures like the CUDA engine: after a
    /// request [`Engine::stats`] has [`LAST_HIT_RATE`] and pinned memory,
    /// and while one decodes, [`LIVE_HIT_RATE`] and [`LIVE_FREE_BYTES`] are
    /// published after every token (pinned memory is not).
    pub fn with_cache_figures(mut self) -> Self {
        self.cache_figures = true;
        self
    }

    /// Sleeps this long before each token, like a real decode step (one
    /// step of every decoding sequence when batched).
    pub fn with_token_delay(mut self, d: Duration) -> Self {
        self.token_delay = d;
        self
    }

    /// Runs at most `n` sequences together (default [`DEFAULT_CAPACITY`]).
    pub fn with_capacity(mut self, n: usize) -> Self {
        self.capacity = n.max(1);
        self
    }

    /// The KV tokens running sequences may reserve together (default:
    /// a whole context for each of the capacity's sequences).
    pub fn with_kv_tokens(mut self, tokens: usize) -> Self {
        self.kv_tokens = tokens;
        self
    }

    /// No batch interface: the server runs one request at a time through
    /// [`Engine::generate`].
    pub fn without_batching(mut self) -> Self {
        self.batching = false;
        self
    }
}

/// Sequences a scripted engine runs together unless told otherwise.
pub const DEFAULT_CAPACITY: usize = 8;

/// The figures [`ScriptedEngine::with_cache_figures`] reports.
pub const LAST_HIT_RATE: f64 = 0.25;
pub const LIVE_HIT_RATE: f64 = 0.75;
pub const LIVE_FREE_BYTES: u64 = 3 << 30;
pub const PINNED_BYTES: u64 = 5 << 20;
const TOTAL_BYTES: u64 = 8 << 30;

fn cache_figures(hit_rate: f64, free_bytes: u64, pinned: Option<u64>) -> EngineStats {
    EngineStats {
        hcs: Some(HcsStats {
            hit_rate,
            ..HcsStats::default()
        }),
        vram: Some(VramStats {
            total_bytes: TOTAL_BYTES,
            free_bytes,
            ..VramStats::default()
        }),
        pinned_host_bytes: pinned,
        ..EngineStats::default()
    }
}

/// One admitted sequence.
struct Seq {
    id: SeqId,
    req: GenerateRequest,
    /// KV tokens reserved at admission.
    reserved: usize,
    /// The error the failure function chose for it, raised at its prefill.
    failure: Option<EngineError>,
    prefilled: Option<usize>,
    /// The tokens it will produce, once its prefill is done.
    script: Option<Vec<u32>>,
    /// The request's grammar: a scripted token it does not allow ends the
    /// sequence with an error (the script is the model; it cannot pick
    /// another token, and a grammar is never ignored).
    constraint: Option<krasis_model::structured::Constraint>,
    stats: GenerateStats,
    started: Option<Instant>,
    first_token: Option<Instant>,
}

impl Seq {
    fn outcome(&self, finish: FinishReason) -> GenerateOutcome {
        let mut stats = self.stats.clone();
        if self.script.is_none()
            && let Some(t) = self.started
        {
            stats.prefill_seconds = t.elapsed().as_secs_f64();
        }
        if let Some(t) = self.first_token {
            stats.decode_seconds = t.elapsed().as_secs_f64();
        }
        GenerateOutcome { finish, stats }
    }

    /// The most tokens it may produce.
    fn limit(&self, context: usize) -> usize {
        self.req.max_new_tokens.min(context - self.req.prompt.len())
    }
}

impl ScriptedEngine {
    /// One prefill chunk of `seq`; at its end the script is made (the
    /// responder may panic there, as a real engine may in a step).
    fn prefill_chunk(&mut self, seq: &mut Seq) -> Result<(), EngineError> {
        let done = match seq.prefilled {
            Some(done) => done,
            None => {
                seq.started = Some(Instant::now());
                if let Some(e) = seq.failure.take() {
                    return Err(e);
                }
                if seq.req.cache_prompt {
                    let shared = (self.last_cached_prompt.iter())
                        .zip(&seq.req.prompt)
                        .take_while(|(a, b)| a == b)
                        .count();
                    seq.stats.cached_tokens = shared.min(seq.req.prompt.len() - 1);
                    self.last_cached_prompt = seq.req.prompt.clone();
                }
                0
            }
        };
        if !self.chunk_delay.is_zero() {
            std::thread::sleep(self.chunk_delay);
        }
        self.prefill_chunks.fetch_add(1, Ordering::Relaxed);
        let end = done
            .saturating_add(self.prefill_chunk)
            .min(seq.req.prompt.len());
        seq.req.live.set_prefilled(end);
        seq.prefilled = Some(end);
        if end == seq.req.prompt.len() {
            seq.stats.prefill_seconds = seq.started.map_or(0.0, |t| t.elapsed().as_secs_f64());
            seq.script = Some((self.responder)(&seq.req.prompt));
        }
        Ok(())
    }

    /// The next token of a decoding `seq`, or how it ended without one.
    fn next_token(
        &mut self,
        seq: &mut Seq,
        events: &mut Vec<SeqEvent>,
    ) -> Result<Option<FinishReason>, EngineError> {
        let script = seq.script.as_ref().expect("decoding after prefill");
        let i = seq.stats.generated_tokens;
        let limit = seq.limit(self.context_length);
        let Some(&tok) = script.get(i) else {
            // A script that ends before the limit is a model that stopped.
            return Ok(Some(FinishReason::Stop));
        };
        // Under a grammar the script's token must be allowed; where the mask
        // allows exactly one token (the grammar's EOS after a last call),
        // that token is what any sampler draws, so it replaces the script's.
        let scripted = tok;
        let mut tok = tok;
        if let Some(c) = seq.constraint.as_mut() {
            let refused = || {
                EngineError::InvalidRequest(format!(
                    "the script's token {i} ({scripted}) breaks the request's grammar"
                ))
            };
            if let Some(m) = c.mask().map_err(|_| refused())?
                && !m.is_allowed(tok)
            {
                let only: Vec<u32> = m.allowed().take(2).collect();
                match only[..] {
                    [t] => tok = t,
                    _ => return Err(refused()),
                }
            }
            c.commit(tok).map_err(|_| refused())?;
        }
        seq.stats.generated_tokens += 1;
        seq.first_token.get_or_insert_with(Instant::now);
        self.produced.fetch_add(1, Ordering::Relaxed);
        if self.cache_figures {
            seq.req
                .live
                .publish_engine(cache_figures(LIVE_HIT_RATE, LIVE_FREE_BYTES, None));
        }
        events.push(SeqEvent::Token {
            seq: seq.id,
            token: tok,
        });
        Ok(if seq.req.stop_token_ids.contains(&tok) {
            Some(FinishReason::Stop)
        } else if i + 1 == limit {
            Some(FinishReason::Length)
        } else if i + 1 == script.len() {
            Some(FinishReason::Stop)
        } else {
            None
        })
    }
}

fn done(seq: &Seq, result: Result<GenerateOutcome, EngineError>, events: &mut Vec<SeqEvent>) {
    events.push(SeqEvent::Done {
        seq: seq.id,
        result,
    });
}

impl Batch for ScriptedEngine {
    fn capacity(&self) -> usize {
        self.capacity
    }

    fn admit(&mut self, req: GenerateRequest) -> Result<Admission, EngineError> {
        if req.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        krasis_model::batch::check_constraint(&req)?;
        if req.prompt.len() >= self.context_length {
            return Err(EngineError::PromptTooLong {
                prompt: req.prompt.len(),
                context: self.context_length,
            });
        }
        let reserved = match req.max_new_tokens {
            0 => 0,
            n => (req.prompt.len() + n).min(self.context_length),
        };
        if reserved > self.kv_tokens {
            return Err(EngineError::InvalidRequest(format!(
                "the request needs {reserved} KV tokens but the engine's KV budget is {}",
                self.kv_tokens
            )));
        }
        let used: usize = self.seqs.iter().map(|s| s.reserved).sum();
        if self.seqs.len() >= self.capacity || used + reserved > self.kv_tokens {
            return Ok(Admission::Wait);
        }
        let failure = self.failure.as_mut().and_then(|f| f(&req.prompt));
        let id = SeqId(self.next_seq);
        self.next_seq += 1;
        self.seqs.push(Seq {
            id,
            constraint: req.constraint.as_ref().map(|g| g.start()),
            stats: GenerateStats {
                prompt_tokens: req.prompt.len(),
                ..Default::default()
            },
            req,
            reserved,
            failure,
            prefilled: None,
            script: None,
            started: None,
            first_token: None,
        });
        Ok(Admission::Admitted(id))
    }

    fn step(&mut self, events: &mut Vec<SeqEvent>) -> Result<(), EngineError> {
        let mut seqs = std::mem::take(&mut self.seqs);
        seqs.retain(|s| {
            let finish = if s.req.max_new_tokens == 0 {
                FinishReason::Length
            } else if s.req.cancel.is_cancelled() {
                FinishReason::Cancelled
            } else {
                return true;
            };
            done(s, Ok(s.outcome(finish)), events);
            false
        });
        let mut ended = Vec::new();
        if let Some(seq) = seqs.iter_mut().find(|s| s.script.is_none()) {
            if let Err(e) = self.prefill_chunk(seq) {
                if e.is_fatal() {
                    // Every sequence is lost with the engine (`seqs` is dropped).
                    return Err(e);
                }
                done(seq, Err(e), events);
                ended.push(seq.id);
            } else if seq.script.is_some() && seq.req.cancel.is_cancelled() {
                // No token after a cancel, also one during the last chunk.
                done(seq, Ok(seq.outcome(FinishReason::Cancelled)), events);
                ended.push(seq.id);
            }
        }
        let decoding = seqs
            .iter()
            .any(|s| s.script.is_some() && !ended.contains(&s.id));
        if decoding && !self.token_delay.is_zero() {
            std::thread::sleep(self.token_delay);
        }
        for seq in seqs.iter_mut() {
            if seq.script.is_none() || ended.contains(&seq.id) {
                continue;
            }
            match self.next_token(seq, events) {
                Ok(None) => {}
                Ok(Some(finish)) => {
                    done(seq, Ok(seq.outcome(finish)), events);
                    ended.push(seq.id);
                }
                Err(e) => {
                    done(seq, Err(e), events);
                    ended.push(seq.id);
                }
            }
        }
        seqs.retain(|s| !ended.contains(&s.id));
        self.seqs = seqs;
        Ok(())
    }

    fn end(&mut self, seq: SeqId) -> Option<GenerateOutcome> {
        let i = self.seqs.iter().position(|s| s.id == seq)?;
        let s = self.seqs.remove(i);
        Some(s.outcome(FinishReason::Cancelled))
    }

    fn active(&self) -> usize {
        self.seqs.len()
    }

    fn kv_usage(&self) -> KvUsage {
        KvUsage {
            used_tokens: self.seqs.iter().map(|s| s.reserved).sum(),
            total_tokens: self.kv_tokens,
        }
    }
}

impl Engine for ScriptedEngine {
    fn info(&self) -> EngineInfo {
        EngineInfo {
            backend: "scripted".into(),
            vocab_size: self.vocab_size,
            context_length: self.context_length,
        }
    }

    /// One request through the batch interface, as the reference engine does.
    fn generate(
        &mut self,
        req: &GenerateRequest,
        on_token: &mut dyn FnMut(u32) -> ControlFlow<()>,
    ) -> Result<GenerateOutcome, EngineError> {
        generate_one(self, req, on_token)
    }

    fn prompt_logits(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>, EngineError> {
        Ok(vec![vec![0.0; self.vocab_size]; tokens.len()])
    }

    fn stats(&self) -> Option<EngineStats> {
        self.cache_figures
            .then(|| cache_figures(LAST_HIT_RATE, TOTAL_BYTES, Some(PINNED_BYTES)))
    }

    /// Counts the call; refused while sequences run (as the CUDA engine
    /// does), so a save before the scheduler drained them shows.
    fn save_prefix_cache(
        &mut self,
    ) -> Result<Option<krasis_model::prefix_cache::persist::Saved>, EngineError> {
        if !self.seqs.is_empty() {
            return Err(EngineError::InvalidRequest(format!(
                "saved with {} sequence(s) running",
                self.seqs.len()
            )));
        }
        self.saves.fetch_add(1, Ordering::Relaxed);
        Ok(None)
    }

    fn batch(&mut self) -> Option<&mut dyn Batch> {
        if self.batching { Some(self) } else { None }
    }
}
