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

use krasis_common::status::{EngineStats, HcsStats, VramStats};
use krasis_model::{
    Engine, EngineError, EngineInfo, FinishReason, GenerateOutcome, GenerateRequest, GenerateStats,
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
    /// Tokens handed to callbacks, across all requests.
    pub produced: Arc<AtomicUsize>,
    /// Prefill chunks run, across all requests.
    pub prefill_chunks: Arc<AtomicUsize>,
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
            produced: Arc::new(AtomicUsize::new(0)),
            prefill_chunks: Arc::new(AtomicUsize::new(0)),
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

    /// Sleeps this long before each token, like a real decode step.
    pub fn with_token_delay(mut self, d: Duration) -> Self {
        self.token_delay = d;
        self
    }
}

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

impl Engine for ScriptedEngine {
    fn info(&self) -> EngineInfo {
        EngineInfo {
            backend: "scripted".into(),
            vocab_size: self.vocab_size,
            context_length: self.context_length,
        }
    }

    fn generate(
        &mut self,
        req: &GenerateRequest,
        on_token: &mut dyn FnMut(u32) -> ControlFlow<()>,
    ) -> Result<GenerateOutcome, EngineError> {
        if req.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if req.prompt.len() >= self.context_length {
            return Err(EngineError::PromptTooLong {
                prompt: req.prompt.len(),
                context: self.context_length,
            });
        }
        if let Some(fail) = &mut self.failure
            && let Some(e) = fail(&req.prompt)
        {
            return Err(e);
        }
        let start = Instant::now();
        let mut stats = GenerateStats {
            prompt_tokens: req.prompt.len(),
            ..Default::default()
        };
        if req.cache_prompt {
            let shared = (self.last_cached_prompt.iter())
                .zip(&req.prompt)
                .take_while(|(a, b)| a == b)
                .count();
            stats.cached_tokens = shared.min(req.prompt.len() - 1);
            self.last_cached_prompt = req.prompt.clone();
        }
        let mut prefilled = 0;
        for chunk in req.prompt.chunks(self.prefill_chunk) {
            if req.cancel.is_cancelled() {
                stats.prefill_seconds = start.elapsed().as_secs_f64();
                return Ok(GenerateOutcome {
                    finish: FinishReason::Cancelled,
                    stats,
                });
            }
            if !self.chunk_delay.is_zero() {
                std::thread::sleep(self.chunk_delay);
            }
            self.prefill_chunks.fetch_add(1, Ordering::Relaxed);
            prefilled += chunk.len();
            req.live.set_prefilled(prefilled);
        }
        stats.prefill_seconds = start.elapsed().as_secs_f64();
        let start = Instant::now();
        let script = (self.responder)(&req.prompt);
        let limit = req
            .max_new_tokens
            .min(self.context_length - req.prompt.len());
        let mut finish = FinishReason::Length;
        for (i, &tok) in script.iter().enumerate() {
            if i == limit {
                break;
            }
            if req.cancel.is_cancelled() {
                finish = FinishReason::Cancelled;
                break;
            }
            if !self.token_delay.is_zero() {
                std::thread::sleep(self.token_delay);
            }
            stats.generated_tokens += 1;
            self.produced.fetch_add(1, Ordering::Relaxed);
            if self.cache_figures {
                req.live
                    .publish_engine(cache_figures(LIVE_HIT_RATE, LIVE_FREE_BYTES, None));
            }
            if on_token(tok).is_break() {
                finish = FinishReason::Cancelled;
                break;
            }
            if req.stop_token_ids.contains(&tok) {
                finish = FinishReason::Stop;
                break;
            }
        }
        // A script that ends before the limit is a model that stopped.
        if finish == FinishReason::Length && script.len() < limit {
            finish = FinishReason::Stop;
        }
        stats.decode_seconds = start.elapsed().as_secs_f64();
        Ok(GenerateOutcome { finish, stats })
    }

    fn prompt_logits(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>, EngineError> {
        Ok(vec![vec![0.0; self.vocab_size]; tokens.len()])
    }

    fn stats(&self) -> Option<EngineStats> {
        self.cache_figures
            .then(|| cache_figures(LAST_HIT_RATE, TOTAL_BYTES, Some(PINNED_BYTES)))
    }
}
