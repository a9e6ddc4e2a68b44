//! The CPU reference engine: a plain f32 implementation of the Hugging Face
//! `Qwen3MoeForCausalLM` forward pass, written for obviousness rather than
//! speed. It is the oracle the CUDA engine and the INT4 expert cache are
//! measured against, and a working (slow) backend for tiny models.

mod batch;
mod experts;
#[cfg(any(test, feature = "fault-injection"))]
mod fault;
mod flash;
mod follow;
mod forward;
mod kv;
mod prefix;
pub use prefix::PrefixSizes;
mod trace;
mod weights;

pub use batch::BATCH_CAPACITY;
pub use experts::{CheckpointExperts, ExpertCache, F32_CACHE_LIMIT_BYTES, stored_expert_format};
#[cfg(any(test, feature = "fault-injection"))]
pub use fault::Fault;
pub use follow::{RouteFollow, kth_and_gap};
pub use trace::Trace;

use crate::arch::{ActFormat, Geometry, ModelConfig};
use crate::checkpoint::Checkpoint;
use crate::engine::{Engine, EngineError, EngineInfo, GenerateOutcome, GenerateRequest};
use crate::error::ModelError;
use crate::experts::ExpertWeights;
use crate::layers::rope::Rope;
use krasis_common::events::{ByteProgress, EventSink, task};
use kv::KvCache;
use std::collections::HashSet;
use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;
use weights::Weights;

/// Load-time choices of the reference engine.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReferenceOptions {
    /// Prompt + generated tokens the KV cache holds; `None` uses the model's
    /// `max_position_embeddings`, at most [`DEFAULT_CONTEXT_CAP`].
    pub context_length: Option<usize>,
}

/// Precision of the activations between operations.
///
/// The reference engine is the f32 oracle: [`Activations::F32`] is the
/// default and the only mode anything is checked against.
/// [`Activations::Bf16`] is a diagnostic emulation of the CUDA engine's
/// rounding: values are rounded to BF16 (round to nearest even) exactly where
/// the CUDA engine stores them as BF16 in its prefill path, or to FP16 where
/// it stores them as FP16 (a block's points when the model's description
/// says so: `AttentionSpec::activations`, `MlpSpec::activations`; see
/// [`Rounding::engine`]) (the RMSNorm outputs feeding the QKV, router, MLP
/// and LM-head GEMMs; q/k/v after the projection; q/k after q/k-norm +
/// RoPE; the attention output; the SwiGLU gate/up GEMM outputs and the
/// SwiGLU product; the routed experts' weights, which the prefill path
/// dequantizes from INT4 to the MLP block's format; the router, dense and
/// shared-expert weights where the engine converts them to FP16), while the
/// residual stream, every accumulation, the router logits and the router
/// softmax stay f32. Attention follows the tensor-core prefill kernel
/// (`flash.rs`): an online softmax over 64-key tiles in the log2 domain
/// whose probabilities are rounded to BF16 for the `P·V` product (the row
/// sum keeps them f32); RMSNorms sum their squares in f32 as the kernels
/// do. It tells whether a GPU/reference difference is what 16-bit
/// activations alone produce on that model. It follows the prefill path:
/// the CUDA decode path (chunks of at most 8 tokens) keeps the routed
/// experts' gate/up outputs and SwiGLU product in f32 (its INT4/MXFP4
/// GEMVs read the weights' own bits, so no dequantized-weight rounding
/// either); its other points are prefill's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Activations {
    #[default]
    F32,
    Bf16,
}

/// Number format a rounding point of [`Activations::Bf16`] stores in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Format {
    #[default]
    Bf16,
    /// IEEE half: 3 more mantissa bits than BF16, range ±65504 (values of
    /// larger magnitude become infinite, as a kernel's conversion would).
    F16,
    /// Not rounded.
    F32,
}

impl From<ActFormat> for Format {
    fn from(f: ActFormat) -> Self {
        match f {
            ActFormat::Bf16 => Format::Bf16,
            ActFormat::F16 => Format::F16,
        }
    }
}

impl Format {
    /// `x` as stored in this format.
    pub fn round(self, x: f32) -> f32 {
        match self {
            Format::Bf16 => half::bf16::from_f32(x).to_f32(),
            Format::F16 => half::f16::from_f32(x).to_f32(),
            Format::F32 => x,
        }
    }
}

/// Which rounding points of [`Activations::Bf16`] apply, and in which
/// format. [`Rounding::engine`] is the CUDA engine's prefill path for a
/// model (what every engine starts with and what the GPU check's emulation
/// runs); the others are diagnostics for measuring each point's share of
/// the error (`examples/gpt_oss_rounding.rs`). Nothing here changes
/// [`Activations::F32`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rounding {
    /// The input RMSNorm's output (the QKV GEMM input; the QKV weight is
    /// exact in either 16-bit format's normal range, see `ActFormat`).
    pub attn_in: Format,
    /// q after the projection (+ bias) and after q-norm + RoPE.
    pub q: Format,
    /// k after the projection (+ bias) and after k-norm + RoPE (the K cache).
    pub k: Format,
    /// v after the projection (+ bias) (the V cache).
    pub v: Format,
    /// `P` of the tiled attention's `P·V`.
    pub p: Format,
    /// The attention output (the o_proj GEMM input).
    pub attn_out: bool,
    /// The post-attention RMSNorm's output (router and expert/MLP input).
    pub mlp_in: Format,
    /// The router, dense-MLP and shared-expert weights as the engine
    /// stores them. A checkpoint's BF16 values are exact in BF16, so
    /// `Bf16` (like `F32`) uses them as loaded; `F16` rounds them as the
    /// engine's conversion does (exact in FP16's normal range, subnormal
    /// steps of 2^-24 below 2^-14, see `krasis_gpu::weights::to_f16`).
    pub mlp_weights: Format,
    /// The gate/up GEMM outputs of SwiGLU MLPs and experts.
    pub gate_up: Format,
    /// The SwiGLU activation product (the down GEMM input).
    pub act: Format,
    /// Routed expert weights as the prefill path dequantizes them (INT4
    /// `(q - 8) * s` rounded once to this format; MXFP4 values are exact in
    /// BF16).
    pub expert_weights: Format,
    /// The final RMSNorm's output (the LM head input).
    pub final_norm: bool,
    /// RMSNorm sums of squares in f32 as the kernels do (else as the oracle).
    pub norm_f32: bool,
}

impl Rounding {
    /// The CUDA engine's rounding points for a model of geometry `g`:
    /// every point, the attention block's (QKV input, q, k, v, P) in its
    /// [`AttentionSpec::activations`](crate::arch::AttentionSpec)
    /// format and the MLP block's (its input, weights, gate/up, SwiGLU
    /// product, dequantized experts) in its
    /// [`MlpSpec::activations`](crate::arch::MlpSpec) format: the
    /// description is the one place the engine reads them from too.
    pub fn engine(g: &Geometry) -> Self {
        let a = Format::from(g.attention.activations);
        let m = Format::from(g.mlp.activations);
        Rounding {
            attn_in: a,
            q: a,
            k: a,
            v: a,
            p: a,
            mlp_in: m,
            mlp_weights: m,
            gate_up: m,
            act: m,
            expert_weights: m,
            ..Self::all_bf16()
        }
    }

    /// Every point in BF16 (the CUDA engine before FP16 attention and MLP
    /// blocks, and its engine for all-BF16 models; diagnostics).
    pub fn all_bf16() -> Self {
        Rounding {
            attn_in: Format::Bf16,
            q: Format::Bf16,
            k: Format::Bf16,
            v: Format::Bf16,
            p: Format::Bf16,
            attn_out: true,
            mlp_in: Format::Bf16,
            mlp_weights: Format::Bf16,
            gate_up: Format::Bf16,
            act: Format::Bf16,
            expert_weights: Format::Bf16,
            final_norm: true,
            norm_f32: true,
        }
    }

    /// No rounding point at all (the tiled attention in f32 remains).
    pub fn none() -> Self {
        Rounding {
            attn_in: Format::F32,
            q: Format::F32,
            k: Format::F32,
            v: Format::F32,
            p: Format::F32,
            attn_out: false,
            mlp_in: Format::F32,
            mlp_weights: Format::F32,
            gate_up: Format::F32,
            act: Format::F32,
            expert_weights: Format::F32,
            final_norm: false,
            norm_f32: false,
        }
    }
}

/// Default context limit: RoPE tables and KV cache are allocated for the
/// whole context, and a CPU engine never reaches 256K-token contexts, so a
/// larger one must be asked for explicitly.
pub const DEFAULT_CONTEXT_CAP: usize = 32_768;

/// Prompt tokens per prefill batch unless [`ReferenceEngine::set_prefill_chunk`]
/// says otherwise. Chunks bound the activations of a long prompt and are
/// the unit of prefill a batch step runs (so also how long one step stalls
/// the running decodes, and where a cancel token is looked at); the
/// logits are bit-identical to one batch (a chunk's attention reads the
/// earlier chunks' keys and values from the KV cache, and every other
/// operation is per token).
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

pub struct ReferenceEngine {
    geometry: Geometry,
    weights: Weights,
    experts: ExpertCache,
    rope: Rope,
    /// Prompt + generated tokens a sequence may hold.
    context: usize,
    /// The running sequences, oldest admission first (`batch.rs`).
    seqs: Vec<batch::Seq>,
    /// The id the next admitted sequence gets.
    next_seq: u64,
    /// KV tokens the running sequences may reserve together
    /// ([`ReferenceEngine::set_kv_tokens`]).
    kv_tokens: usize,
    /// Ids `0..sampleable` have text; padded embedding rows are never sampled.
    sampleable: usize,
    activations: Activations,
    /// The rounding points [`Activations::Bf16`] applies (diagnostics).
    rounding: Rounding,
    /// `[capture point][token * H]` of the residual stream after every
    /// attention and MLP block, then the final normed hidden state, while
    /// [`ReferenceEngine::set_capture_residuals`] is on (diagnostics).
    residuals: Option<Vec<Vec<f32>>>,
    /// Prompt tokens per prefill batch (at least 1).
    prefill_chunk: usize,
    /// A deliberate bug planted in the forward pass (tests only).
    #[cfg(any(test, feature = "fault-injection"))]
    fault: Fault,
    /// Filled by the forward pass while [`ReferenceEngine::prompt_logits_traced`] runs.
    trace: Option<Trace>,
    /// Set only while [`ReferenceEngine::prompt_logits_following`] runs.
    follow: Option<RouteFollow>,
    /// KV of prompt prefixes kept for reuse ([`ReferenceEngine::set_prefix_cache`]).
    prefix: Option<prefix::HostPrefix>,
    /// Tests: sets this flag (a request's cancel token) once this many
    /// prefill chunks are done, so a cancel lands mid-prefill exactly.
    #[cfg(test)]
    cancel_after_chunks: Option<(usize, Arc<std::sync::atomic::AtomicBool>)>,
    /// Tests: the logits every sampled token came from, per sequence.
    #[cfg(test)]
    logits_log: Option<Vec<(crate::batch::SeqId, Vec<f32>)>>,
}

impl std::fmt::Debug for ReferenceEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReferenceEngine")
            .field("geometry", &self.geometry)
            .field("experts", &self.experts.describe())
            .field("context_length", &self.context)
            .field("kv_tokens", &self.kv_tokens)
            .field("sequences", &self.seqs.len())
            .field("activations", &self.activations)
            .field("prefill_chunk", &self.prefill_chunk)
            .finish()
    }
}

impl ReferenceEngine {
    /// Loads `dir` with routed experts read from the checkpoint itself.
    pub fn load(dir: &Path, opts: ReferenceOptions) -> Result<Self, ModelError> {
        Self::load_reporting(dir, opts, None)
    }

    /// [`ReferenceEngine::load`] that sends the byte progress of reading
    /// the non-expert weights ([`task::LOAD_WEIGHTS`], stored bytes) to
    /// `progress`. (Routed experts are read from the checkpoint when used.)
    pub fn load_reporting(
        dir: &Path,
        opts: ReferenceOptions,
        progress: Option<EventSink<'_>>,
    ) -> Result<Self, ModelError> {
        let config = ModelConfig::load(dir)?;
        let ckpt = Arc::new(Checkpoint::open(dir)?);
        if config.geometry().num_moe_layers() > 0 && !has_any_routed_expert(&config, &ckpt) {
            return Err(ModelError::Other(format!(
                "checkpoint in {} has no routed expert tensors (written with \
                 --experts-in-cache-only?); load it with an explicit expert source \
                 such as its INT4 expert cache",
                dir.display()
            )));
        }
        ckpt.validate_skipping(&config.expected_tensors(), &config.skipped_prefixes())?;
        let experts = Arc::new(CheckpointExperts::new(ckpt.clone(), &config));
        Self::build(dir, &config, &ckpt, experts, opts, progress)
    }

    /// Loads `dir` with routed experts from `experts` (e.g. the INT4 cache,
    /// to measure quantization error with the same engine). A checkpoint
    /// that holds no routed experts at all is accepted; one that holds some
    /// must hold all of them with the right shapes.
    pub fn with_experts(
        dir: &Path,
        opts: ReferenceOptions,
        experts: Arc<dyn ExpertWeights>,
    ) -> Result<Self, ModelError> {
        let config = ModelConfig::load(dir)?;
        let ckpt = Checkpoint::open(dir)?;
        let mut expected = config.expected_tensors();
        if !has_any_routed_expert(&config, &ckpt) {
            let names = routed_expert_names(&config);
            expected.retain(|(n, _)| !names.contains(n));
        }
        ckpt.validate_skipping(&expected, &config.skipped_prefixes())?;
        Self::build(dir, &config, &ckpt, experts, opts, None)
    }

    fn build(
        dir: &Path,
        config: &ModelConfig,
        ckpt: &Checkpoint,
        experts: Arc<dyn ExpertWeights>,
        opts: ReferenceOptions,
        progress: Option<EventSink<'_>>,
    ) -> Result<Self, ModelError> {
        let g = config.geometry();
        let context = match opts.context_length {
            None => g.max_position_embeddings.min(DEFAULT_CONTEXT_CAP),
            Some(0) => {
                return Err(ModelError::Other(
                    "context length 0 is not allowed; pass at least 1".into(),
                ));
            }
            Some(c) if c > g.max_position_embeddings => {
                return Err(ModelError::Other(format!(
                    "context length {c} exceeds the model's max_position_embeddings ({}); \
                     pass a context length of at most that",
                    g.max_position_embeddings
                )));
            }
            Some(c) => c,
        };
        let progress = progress.map(|s| {
            let total = dense_tensor_bytes(config, ckpt);
            ByteProgress::start(s, task::LOAD_WEIGHTS, total)
        });
        let weights = Weights::load(ckpt, config, progress.as_ref())?;
        if let Some(p) = progress {
            p.finish();
        }
        let sampleable = crate::tokenizer::sampleable_vocab(dir, g.vocab_size)?;
        Ok(ReferenceEngine {
            sampleable,
            rounding: Rounding::engine(&g),
            rope: Rope::with_spec(g.head_dim, g.rope, context),
            context,
            seqs: Vec::new(),
            next_seq: 0,
            kv_tokens: context * BATCH_CAPACITY,
            experts: ExpertCache::new(experts, &g),
            weights,
            geometry: g,
            activations: Activations::F32,
            residuals: None,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            #[cfg(any(test, feature = "fault-injection"))]
            fault: Fault::None,
            trace: None,
            follow: None,
            prefix: None,
            #[cfg(test)]
            cancel_after_chunks: None,
            #[cfg(test)]
            logits_log: None,
        })
    }

    /// Switches activation precision (see [`Activations`]); applies to the
    /// next forward pass. Every engine starts in [`Activations::F32`].
    pub fn set_activations(&mut self, activations: Activations) {
        self.activations = activations;
    }

    pub fn activations(&self) -> Activations {
        self.activations
    }

    /// Selects the rounding points of [`Activations::Bf16`] (a diagnostic;
    /// [`Rounding::engine`] of the model unless set).
    pub fn set_rounding(&mut self, rounding: Rounding) {
        self.rounding = rounding;
    }

    pub fn rounding(&self) -> Rounding {
        self.rounding
    }

    /// Starts (`true`, clearing what was captured) or stops recording the
    /// residual stream of every forward pass: for each layer the residual
    /// after its attention block and after its MLP block, then the final
    /// normed hidden state, each `[token * H]` appended to per pass.
    pub fn set_capture_residuals(&mut self, on: bool) {
        self.residuals = on.then(|| vec![Vec::new(); 2 * self.geometry.num_layers + 1]);
    }

    /// What [`ReferenceEngine::set_capture_residuals`] recorded since it was
    /// turned on (and clears it); empty when off.
    pub fn take_residuals(&mut self) -> Vec<Vec<f32>> {
        match self.residuals.as_mut() {
            Some(r) => r.iter_mut().map(std::mem::take).collect(),
            None => Vec::new(),
        }
    }

    /// Prompt tokens per prefill batch (see [`DEFAULT_PREFILL_CHUNK`]);
    /// 0 is taken as 1. Applies to prefills that begin after it. The
    /// outputs do not depend on it.
    pub fn set_prefill_chunk(&mut self, tokens: usize) {
        self.prefill_chunk = tokens.max(1);
    }

    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    /// Plants `fault` in the forward pass from the next request on
    /// ([`Fault::None`] removes it). Test builds only: this is how the
    /// witness tests show their comparison notices a wrong engine.
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn set_fault(&mut self, fault: Fault) {
        self.fault = fault;
    }

    /// [`Engine::prompt_logits`] plus per-position internals of the same
    /// pass, for diagnosing where logits are sensitive.
    pub fn prompt_logits_traced(
        &mut self,
        tokens: &[u32],
    ) -> Result<(Vec<Vec<f32>>, Trace), EngineError> {
        self.trace = Some(Trace::new(self.geometry.num_layers));
        let logits = self.prompt_logits(tokens);
        let trace = self.trace.take().expect("the trace is set above");
        Ok((logits?, trace))
    }

    /// [`ReferenceEngine::prompt_logits_traced`] taking `follow`'s expert
    /// sets wherever its own router is within the near-tie width of them
    /// (see [`RouteFollow`]); the trace records the sets it ran and marks
    /// the followed decisions (`Trace::followed`).
    pub fn prompt_logits_following(
        &mut self,
        tokens: &[u32],
        follow: RouteFollow,
    ) -> Result<(Vec<Vec<f32>>, Trace), EngineError> {
        self.follow = Some(follow);
        let out = self.prompt_logits_traced(tokens);
        self.follow = None;
        out
    }

    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// Where routed experts come from, for logs and reports.
    pub fn expert_source(&self) -> String {
        self.experts.describe()
    }

    /// Rejects an empty prompt, unknown ids, and a prompt longer than
    /// `limit` tokens.
    fn check_tokens(&self, tokens: &[u32], limit: usize) -> Result<(), EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let vocab = self.geometry.vocab_size;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::BadToken { id, vocab });
        }
        if tokens.len() > limit {
            return Err(EngineError::PromptTooLong {
                prompt: tokens.len(),
                context: self.context,
            });
        }
        Ok(())
    }

    /// A KV cache of `tokens` positions for one sequence.
    fn new_kv(&self, tokens: usize) -> KvCache {
        KvCache::new(self.geometry.num_layers, tokens, self.geometry.kv_dim())
    }

    /// Logits at every position of `tokens`, computed one token at a time
    /// through the KV cache as decode does (`prompt_logits` runs them as
    /// batched prefill chunks). Comparing the two checks the cache path.
    pub fn stepwise_logits(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>, EngineError> {
        self.check_tokens(tokens, self.context)?;
        let mut kv = self.new_kv(tokens.len());
        (0..tokens.len())
            .map(|pos| self.last_logits(&mut kv, &tokens[pos..pos + 1], pos))
            .collect()
    }

    /// Logits of the last position after running `tokens` from `start`.
    fn last_logits(
        &mut self,
        kv: &mut KvCache,
        tokens: &[u32],
        start: usize,
    ) -> Result<Vec<f32>, EngineError> {
        let hidden = self.forward(kv, tokens, start)?;
        let h = self.geometry.hidden;
        Ok(self.logits(&hidden[hidden.len() - h..]))
    }

    /// The last position's logits of `prompt` through the prefill
    /// [`Engine::generate`] runs (with `use_cache`, served from the prefix
    /// cache where it can, and stored into it), and the prompt tokens the
    /// cache served. What the exactness tests compare with a cold prefill.
    pub fn prefill_logits(
        &mut self,
        prompt: &[u32],
        use_cache: bool,
    ) -> Result<(Vec<f32>, usize), EngineError> {
        self.check_tokens(prompt, self.context)?;
        let mut req = batch::prompt_only(prompt);
        req.cache_prompt = use_cache;
        let mut seq = batch::Seq::new(
            crate::batch::SeqId(u64::MAX),
            req,
            self.new_kv(prompt.len()),
        );
        loop {
            if let batch::Prefill::Done(logits) = self.prefill_step(&mut seq)? {
                return Ok((logits, seq.cached_tokens()));
            }
        }
    }
}

fn routed_expert_names(config: &ModelConfig) -> HashSet<String> {
    let g = config.geometry();
    g.moe_layers()
        .flat_map(|l| config.routed_expert_tensor_names(l))
        .collect()
}

/// Stored bytes of the tensors [`Weights::load`] reads: every expected
/// tensor but the routed experts.
fn dense_tensor_bytes(config: &ModelConfig, ckpt: &Checkpoint) -> u64 {
    let routed = routed_expert_names(config);
    config
        .expected_tensors()
        .iter()
        .filter(|(n, _)| !routed.contains(n))
        .filter_map(|(n, _)| ckpt.get(n).ok())
        .map(|t| t.bytes.len() as u64)
        .sum()
}

fn has_any_routed_expert(config: &ModelConfig, ckpt: &Checkpoint) -> bool {
    routed_expert_names(config).iter().any(|n| ckpt.contains(n))
}

impl Engine for ReferenceEngine {
    fn info(&self) -> EngineInfo {
        EngineInfo {
            backend: "reference".into(),
            vocab_size: self.geometry.vocab_size,
            context_length: self.context,
        }
    }

    /// One request through the batch interface ([`crate::batch::generate_one`]):
    /// alone and beside others, the same code runs.
    fn generate(
        &mut self,
        req: &GenerateRequest,
        on_token: &mut dyn FnMut(u32) -> ControlFlow<()>,
    ) -> Result<GenerateOutcome, EngineError> {
        crate::batch::generate_one(self, req, on_token)
    }

    fn prompt_logits(&mut self, tokens: &[u32]) -> Result<Vec<Vec<f32>>, EngineError> {
        self.check_tokens(tokens, self.context)?;
        let v = self.geometry.vocab_size;
        let mut kv = self.new_kv(tokens.len());
        let mut rows = Vec::with_capacity(tokens.len());
        let chunk = self.prefill_chunk.max(1);
        for (i, c) in tokens.chunks(chunk).enumerate() {
            let hidden = self.forward(&mut kv, c, i * chunk)?;
            rows.extend(self.logits(&hidden).chunks_exact(v).map(<[f32]>::to_vec));
        }
        Ok(rows)
    }

    fn save_prefix_cache(
        &mut self,
    ) -> Result<Option<crate::prefix_cache::persist::Saved>, EngineError> {
        self.save_prefix_file()
            .map_err(|e| EngineError::Backend(e.to_string()))
    }

    fn stats(&self) -> Option<krasis_common::status::EngineStats> {
        let prefix_cache = self.prefix_cache_stats()?;
        Some(krasis_common::status::EngineStats {
            prefix_cache: Some(prefix_cache),
            ..Default::default()
        })
    }

    fn batch(&mut self) -> Option<&mut dyn crate::batch::Batch> {
        Some(self)
    }
}

#[cfg(test)]
mod tests;
