//! The engine interface. The server, `generate`, `bench` and the witness
//! tests drive every backend (CPU reference, CUDA) through this trait, so a
//! backend is a drop-in and the same checks run against each.

use krasis_common::status::EngineStats;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Sampling settings for one request. `temperature == 0` is greedy.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    /// 1.0 disables top-p.
    pub top_p: f32,
    /// 0.0 disables min-p.
    pub min_p: f32,
    pub seed: Option<u64>,
    /// OpenAI semantics: subtract `presence_penalty` from the logit of every
    /// token generated so far, and `frequency_penalty * count`.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }
}

/// A flag the request side sets to stop a generation that is running: the
/// engine checks it between prefill chunks (and the server's token callback
/// between decoded tokens), so a client that disconnects or a shutdown does
/// not wait for a long prompt to finish prefilling. The default token is
/// never cancelled.
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Option<Arc<AtomicBool>>);

impl CancelToken {
    /// A token that reports cancellation once `flag` is set.
    pub fn new(flag: Arc<AtomicBool>) -> Self {
        CancelToken(Some(flag))
    }
    pub fn is_cancelled(&self) -> bool {
        self.0.as_ref().is_some_and(|f| f.load(Ordering::Relaxed))
    }
}

/// Live figures of one running generation, written by the engine thread and
/// read by the server's stats endpoint while the request runs (the launcher's
/// run screen polls it several times a second). The engine stores how many
/// prompt tokens it has prefilled after every prefill chunk, and publishes its
/// expert-cache and memory figures *so far in this request* at most every
/// ~100 ms of decode. The default handle has no reader and costs nothing to
/// write; clones share the same figures.
#[derive(Debug, Clone, Default)]
pub struct LiveProgress(Arc<LiveInner>);

#[derive(Debug, Default)]
struct LiveInner {
    prefilled: AtomicU64,
    engine: Mutex<Option<EngineStats>>,
}

impl LiveProgress {
    /// Prompt tokens prefilled so far (0 before the first chunk ends).
    pub fn set_prefilled(&self, tokens: usize) {
        self.0.prefilled.store(tokens as u64, Ordering::Relaxed);
    }
    pub fn prefilled(&self) -> u64 {
        self.0.prefilled.load(Ordering::Relaxed)
    }
    /// The engine's figures so far in this request (the same shape
    /// [`Engine::stats`] returns after it).
    pub fn publish_engine(&self, stats: EngineStats) {
        if let Ok(mut e) = self.0.engine.lock() {
            *e = Some(stats);
        }
    }
    pub fn engine(&self) -> Option<EngineStats> {
        self.0.engine.lock().ok().and_then(|e| e.clone())
    }
}

/// One generation: the prompt is prefilled, then up to `max_new_tokens`
/// tokens are decoded; generation ends early on any of `stop_token_ids`
/// (the stop token is reported but counts as the end), when the callback
/// breaks (stop string matched, client gone), or when `cancel` is set (also
/// during prefill; the outcome is then `Cancelled` with no token produced).
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    pub stop_token_ids: Vec<u32>,
    pub cancel: CancelToken,
    /// Where the engine reports progress while it runs.
    pub live: LiveProgress,
    /// Use the engine's prefix cache, when it has one: reuse the KV of the
    /// longest cached prefix of the prompt and, once the prefill completed,
    /// keep the prompt's whole blocks for later requests. `false` (the
    /// API's `cache_prompt: false`) prefills cold and stores nothing; the
    /// output is the same either way.
    pub cache_prompt: bool,
    /// A grammar the output must follow (issue 18: `response_format`,
    /// `tool_choice`). The engine starts its own [`Constraint`] from it at
    /// admission and, before every token it samples, allows only the
    /// tokens the constraint's mask allows; a token the constraint then
    /// refuses means the sampler ignored the mask, a fatal engine fault.
    /// The grammar's EOS ([`Grammar::eos`]) must be one of
    /// `stop_token_ids`, or an accepted output could not end.
    ///
    /// [`Constraint`]: crate::structured::Constraint
    /// [`Grammar::eos`]: crate::structured::Grammar::eos
    pub constraint: Option<crate::structured::Grammar>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was produced.
    Stop,
    /// `max_new_tokens` or the context length was reached.
    Length,
    /// The caller's callback asked to stop, or the request's
    /// [`CancelToken`] was set (possibly before any token).
    Cancelled,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerateStats {
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache (not prefilled).
    pub cached_tokens: usize,
    pub generated_tokens: usize,
    /// Restoring cached blocks, prefilling the rest and storing new blocks.
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
}

impl GenerateStats {
    /// Prompt tokens prefilled (not served from the prefix cache) per second.
    pub fn prefill_tok_s(&self) -> f64 {
        rate(
            self.prompt_tokens.saturating_sub(self.cached_tokens),
            self.prefill_seconds,
        )
    }
    /// Decode rate over the tokens after the first (the first comes from prefill).
    pub fn decode_tok_s(&self) -> f64 {
        rate(self.generated_tokens.saturating_sub(1), self.decode_seconds)
    }
}

fn rate(n: usize, s: f64) -> f64 {
    if s > 0.0 { n as f64 / s } else { 0.0 }
}

#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOutcome {
    pub finish: FinishReason,
    pub stats: GenerateStats,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    #[error("prompt has {prompt} tokens but the context holds {context}")]
    PromptTooLong { prompt: usize, context: usize },
    #[error("empty prompt")]
    EmptyPrompt,
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    BadToken { id: u32, vocab: usize },
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// A request the engine cannot run as given (e.g. sampling values out of
    /// the kernels' range); the engine is untouched.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("{0}")]
    Backend(String),
}

impl EngineError {
    /// True when the engine is in an unknown state after this error and must
    /// not run another request: a backend failure (a CUDA or cuBLAS error, a
    /// failed expert read in the middle of a forward pass). The other
    /// variants are refused or failed requests that leave the engine ready
    /// for the next one (an out-of-memory prefill is cleaned up by the
    /// engine before it returns). The server retires a faulted engine and
    /// the runtime exits with `krasis_common::status::EXIT_ENGINE_FAULT`.
    pub fn is_fatal(&self) -> bool {
        matches!(self, EngineError::Backend(_))
    }
}

/// Static facts about a loaded engine.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineInfo {
    /// "reference" or "cuda".
    pub backend: String,
    pub vocab_size: usize,
    /// Maximum prompt + generated tokens.
    pub context_length: usize,
}

pub trait Engine: Send {
    fn info(&self) -> EngineInfo;

    /// Prefills `req.prompt` and decodes. `on_token` is called with every
    /// generated token id (including a final stop token) as soon as it exists;
    /// returning `ControlFlow::Break(())` ends generation with `Cancelled`.
    ///
    /// `req.cancel` is checked before prefill starts, between prefill
    /// chunks, after the last one and before every decode step. Set during
    /// prefill, generation returns `Ok` with [`FinishReason::Cancelled`] and
    /// no token produced (`generated_tokens == 0`, `on_token` never called);
    /// set during decode, it ends with `Cancelled` after the tokens already
    /// passed to `on_token`. Either way the engine is ready for the next
    /// request, whose output does not depend on the cancelled one.
    fn generate(
        &mut self,
        req: &GenerateRequest,
        on_token: &mut dyn FnMut(u32) -> ControlFlow<()>,
    ) -> Result<GenerateOutcome, EngineError>;

    /// Logits (f32, `vocab_size` each) at every position of `tokens`, computed
    /// as one prefill from an empty cache. Used by correctness checks.
    fn prompt_logits(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>, EngineError>;

    /// Backend-specific live statistics (HCS, VRAM) for the stats endpoint.
    fn stats(&self) -> Option<krasis_common::status::EngineStats> {
        None
    }

    /// Writes the prefix cache to its file (`serve --prefix-cache-file`),
    /// when the engine has one; the server calls it at a graceful shutdown
    /// (never after a fault). `None`: no file.
    fn save_prefix_cache(
        &mut self,
    ) -> Result<Option<crate::prefix_cache::persist::Saved>, EngineError> {
        Ok(None)
    }

    /// The engine's continuous-batching interface, when it has one: the
    /// server then runs several requests together through it
    /// ([`crate::batch`]); without one it runs them one at a time through
    /// [`Engine::generate`].
    fn batch(&mut self) -> Option<&mut dyn crate::batch::Batch> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::EngineError;

    #[test]
    fn only_backend_failures_are_fatal() {
        assert!(EngineError::Backend("illegal memory access".into()).is_fatal());
        for e in [
            EngineError::InvalidRequest("top_p out of range".into()),
            EngineError::OutOfMemory("prefill".into()),
            EngineError::EmptyPrompt,
            EngineError::PromptTooLong {
                prompt: 9,
                context: 8,
            },
            EngineError::BadToken { id: 9, vocab: 8 },
        ] {
            assert!(!e.is_fatal(), "{e}");
        }
    }
}
