//! The forward pass: one chunk of prompt tokens (prefill) or one decode
//! step (one token of each of up to `parallel` sequences, one row each)
//! through every layer, entirely on the GPU.
//!
//! Per layer: RMSNorm → fused QKV GEMM (+ bias) → q/k RMSNorm + RoPE (or
//! table RoPE) → KV append → attention (causal, or sliding window / sinks
//! over ring KV buffers) → o_proj GEMM accumulated straight into the f32
//! residual (cuBLAS beta = 1, + bias) → RMSNorm → MLP. A MoE MLP is a
//! router GEMM with f32 output, the plan's top-k (+ bias), then the routed
//! experts (`moe.rs`); a dense MLP is gate/up GEMM → SwiGLU → down GEMM
//! into the residual.
//!
//! Decode replaces cuBLAS by the GEMV kernels (`cuda/gemv.cu`), which
//! stream a projection's weights at HBM rate where cuBLAS at M = 1 does
//! not, and fold each RMSNorm into the projection it feeds (the kernel
//! still writes `scratch.normed`, which the routed experts read). The LM
//! head of decode rows takes the same path.
//!
//! A decode step of M rows (continuous batching, `batch.rs`) runs every
//! row through the same launches with m = M: the GEMVs, the router, the
//! experts and the sampler compute each row exactly as a one-row launch
//! (row invariance, `kernels/tests/gpu/rows.rs`); RoPE, the KV append and
//! attention read each row's position and its sequence's KV rows from
//! `scratch.pos` / `scratch.kv_base`. So a sequence's logits do not depend
//! on the other rows: batch invariance.
//!
//! Precision: weights BF16 (experts INT4 or MXFP4), GEMM inputs BF16, every
//! accumulation and the residual stream f32, router logits f32. The
//! attention block's activations are in the model's
//! `AttentionSpec::activations` format: BF16, or FP16 (gpt_oss: its YaRN
//! scaling multiplies every score by 1.81 with no q/k norm, and BF16 there
//! exceeds the GPU check's bound), where the input RMSNorm's output, the
//! fused QKV weight (converted from BF16 at upload), q/k/v, the KV cache
//! and the softmax probabilities of `P·V` are FP16 and the MMAs f16 x f16
//! with f32 accumulation; the attention output stays BF16 (`attention.rs`).
//! The MLP block's are in `MlpSpec::activations`: BF16, or FP16 (glm4_moe:
//! its MLP outputs are large against the residual), where the
//! post-attention RMSNorm's output (the router's and every MLP's input),
//! the router, dense and shared-expert weights, the grouped experts' input
//! rows and SwiGLU product (and, on the dequantizing path, the dequantized
//! experts and gate/up outputs) are FP16 (`mlp.rs`, `moe.rs`,
//! `expert_ffn.rs`); decode's INT4 GEMVs keep the experts' gate/up and
//! SwiGLU product in f32 either way.

use crate::blas::{Gemm, InType, OutType, gemm};
use crate::device::Gpu;
use crate::error::{GpuError, Result};
use crate::expert_ffn::ExpertFfn;
use crate::experts::ExpertTable;
use crate::scratch::{KvCache, LOGIT_ROWS, Scratch};
use crate::weights::{Embedding, MlpWeights, ModelWeights};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr};
use half::bf16;
use krasis_kernels::{Act16, GemvForm, GemvOut, Kernels, QkvGeom};
use krasis_model::Geometry;

/// The form of every LM head GEMV (decode rows and a prefill's last token):
/// on tensor cores its time is flat in the rows (an 8-row step's head cost
/// 2.5x a one-row one on the CUDA cores) for ~1 us more at one row of a
/// ~150-270 us stream (`kernels/cuda/gemv_tc.cu`). One form for every row
/// count keeps a sequence's logits independent of the batch.
pub(crate) const LM_HEAD_FORM: GemvForm = GemvForm::TensorCores;

/// Everything resident on the device for one model.
pub struct Model {
    pub gpu: Gpu,
    pub kernels: Kernels,
    pub geometry: Geometry,
    pub weights: ModelWeights,
    pub experts: Option<ExpertTable>,
    /// The routed-expert arithmetic (format and activation).
    pub ffn: Option<ExpertFfn>,
    pub kv: KvCache,
    pub scratch: Scratch,
    /// Prompts of at most this many tokens run their routed experts through
    /// the expert GEMV kernels.
    pub gemv_tokens: usize,
    /// Set by every prefill: the prompt is longer than `gemv_tokens` (and
    /// the grouped scratch exists), so every chunk of it, whatever its
    /// length, runs the grouped expert path (`moe::routed_experts`).
    pub grouped_prefill: bool,
    /// Set by every prefill: MXFP4 experts of this prompt are computed in
    /// place by the grouped MXFP4 GEMMs, not dequantized (a short prompt on
    /// an engine where no row is shared across prompts:
    /// `expert_ffn::MXFP4_IN_PLACE_MAX_TOKENS`). Other formats ignore it.
    pub mxfp4_in_place: bool,
    /// The prefill kernels of this device, the same for every chunk.
    pub prefill_kernels: crate::prefill_kernels::PrefillKernels,
    /// The GPU expert cache when not every expert is resident.
    pub hcs: Option<crate::hcs::Hcs>,
    /// When set, prefill adds each token's selected experts here
    /// (`[moe layer][expert]`), for heatmaps.
    pub routes: Option<Vec<Vec<u64>>>,
    /// When set, the router's choice of every token at every MoE layer is
    /// copied to the host here (`bench --check` only: a sync per layer).
    pub token_routes: Option<crate::moe::RouteLog>,
    /// Streamed prefill takes at most this many prompt tokens through the
    /// layer groups at a time (`None`: the whole prompt, split further only
    /// when its hidden states do not fit).
    pub prefill_span: Option<usize>,
    /// The planted bug this model runs with (tests only; see [`Fault`]).
    #[cfg(any(test, feature = "fault-injection"))]
    pub fault: Fault,
}

impl Drop for Model {
    /// A prefill's reload of the reclaimable prior may still be running on
    /// the copy stream (`Hcs::restore` does not wait for it), into staging
    /// and prefill's grouped scratch, whose frees are queued on the compute
    /// stream when the fields drop next: order them after the reload.
    fn drop(&mut self) {
        if let Err(e) = self.settle_experts() {
            tracing::warn!("waiting for the expert reload before freeing the engine: {e}");
        }
    }
}

/// A deliberate bug planted in the CUDA engine (compiled with `cfg(test)`
/// or the `fault-injection` feature, which only dev-dependencies enable),
/// set with `CudaEngine::set_fault`. Each is applied by the engine's own
/// setup or launches, so the GPU check against the CPU reference must fail
/// with it: that is what shows the check can fail.
#[cfg(any(test, feature = "fault-injection"))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Fault {
    /// The correct engine.
    #[default]
    None,
    /// RoPE by `-angle`: the second half of every q/k-norm weight is
    /// negated at upload (of the rotated part, with a partial rotary).
    /// With `D` negating a head's second half, the
    /// kernel then stores `D R(-a) x` for q and k, and `D` cancels in
    /// `q . k`, so attention is exactly that of a RoPE sign error.
    RopeSign,
    /// KV heads 0 and 1 swap their k and v rows in the fused QKV weight,
    /// so query heads of group 0 attend with KV head 1 and vice versa.
    SwapGqa,
    /// The last (lowest-ranked) of each token's top-k experts gets routing
    /// weight 0 on the device after the router (a dropped expert).
    DropExpert,
    /// The router kernel is launched without the layer's selection bias
    /// (glm4_moe's `e_score_correction_bias`), choosing by the sigmoid
    /// scores alone.
    IgnoreSelectionBias,
    /// MoE layers skip their shared expert.
    NoSharedExpert,
    /// Batching only: a decode step of two or more rows gives rows 0 and
    /// 1 each other's positions (RoPE and attention length of another
    /// sequence). One sequence alone is unchanged, so only the batch
    /// invariance tests see it (not in [`Fault::ALL`]).
    SwapRowPositions,
    /// Batching only: a decode step of two or more rows reads and writes
    /// its last row's KV one row past its sequence's first row (a wrong KV
    /// slice offset). Not in [`Fault::ALL`].
    ShiftRowKv,
    /// Batching only, sliding-window models: a decode step of two or more
    /// rows gives rows 0 and 1 each other's rings in the sliding layers
    /// (a wrong ring base). Not in [`Fault::ALL`] nor [`Fault::BATCH`]
    /// (a model without sliding layers has no rings); the gpt-oss
    /// batching test sees it.
    SwapRowRings,
    /// Prefix cache, sliding-window models: a hit restores its blocks into
    /// the full layers but not the window before its end into the
    /// sequence's rings (they keep what the slot's last sequence left).
    /// Not in [`Fault::ALL`]; the gpt-oss prefix cache test sees it.
    SkipRingRestore,
    /// Batching only: a packed prefill pass of two or more sequences gives
    /// its second segment the first segment's KV rows (a wrong segment
    /// base). Not in [`Fault::ALL`].
    PackedBase,
    /// HCS only: decode promotes misses into the recency tail but never
    /// copies them, so a promoted expert's GEMVs read whatever its slot
    /// held before. Not in [`Fault::ALL`] (all-resident engines have no
    /// tail); the HCS batching test sees it.
    StaleTail,
    /// HCS only: decode prefetch promotes its guesses into the tail but
    /// never copies them, so a right guess's GEMVs read whatever its slot
    /// held before. Not in [`Fault::ALL`]; the HCS batching test sees it.
    StalePrefetch,
    /// HCS only: decode's tail lookup does not mark its promotions fresh,
    /// so the w13 GEMV launched to overlap the fetch reads those slots
    /// before their copies land. Not in [`Fault::ALL`]; the HCS reload test
    /// (prefetch off, where the overlap runs) sees it.
    UnmarkedFetch,
    /// HCS only: a prefill's reload of the reclaimable prior points decode
    /// at the prior's slots without copying the experts into them, so the
    /// prior's GEMVs read what prefill left there. Not in [`Fault::ALL`];
    /// the HCS reload test sees it.
    SkipReload,
    /// Structured output: the sampler draws as if no grammar mask were
    /// uploaded (a sampler that ignores the mask). Not in [`Fault::ALL`]:
    /// it changes no logit; a constrained request sees it, as a fatal
    /// fault once the grammar refuses the token.
    IgnoreMask,
}

#[cfg(any(test, feature = "fault-injection"))]
impl Fault {
    /// The planted bugs of the continuous-batching step, which change a
    /// sequence's output only beside others (the batch invariance tests).
    pub const BATCH: [Fault; 3] = [
        Fault::SwapRowPositions,
        Fault::ShiftRowKv,
        Fault::PackedBase,
    ];

    /// Every planted bug a single sequence sees (not `None`, not
    /// [`Fault::BATCH`]).
    pub const ALL: [Fault; 5] = [
        Fault::RopeSign,
        Fault::SwapGqa,
        Fault::DropExpert,
        Fault::IgnoreSelectionBias,
        Fault::NoSharedExpert,
    ];

    /// The planted bugs that change what a model of geometry `g` computes
    /// on this engine (`RopeSign` is planted in the q/k norm weights).
    pub fn applicable(g: &Geometry) -> Vec<Fault> {
        Self::ALL
            .into_iter()
            .filter(|f| match f {
                Fault::None => true,
                Fault::RopeSign => g.attention.qk_norm,
                Fault::SwapGqa => g.num_kv_heads >= 2,
                Fault::DropExpert => g.num_moe_layers() > 0,
                Fault::IgnoreSelectionBias => g.num_moe_layers() > 0 && g.router.selection_bias,
                Fault::NoSharedExpert => g.num_moe_layers() > 0 && g.shared_intermediate.is_some(),
                Fault::SwapRowPositions
                | Fault::ShiftRowKv
                | Fault::SwapRowRings
                | Fault::SkipRingRestore
                | Fault::PackedBase
                | Fault::StaleTail
                | Fault::StalePrefetch
                | Fault::UnmarkedFetch
                | Fault::SkipReload
                | Fault::IgnoreMask => false,
            })
            .collect()
    }
}

/// [`Fault::DropExpert`]: zeroes the routing weight of the last top-k slot
/// of each of the `t` tokens (`scratch.topk_w` is `[t, top_k]`) with one
/// strided memset on the compute stream (captured by decode graphs).
#[cfg(any(test, feature = "fault-injection"))]
fn drop_last_expert(cx: &Ctx<'_>, sc: &mut Scratch, t: usize) -> Result<()> {
    let k = cx.g.top_k;
    let dst = cx.p(&sc.topk_w, k - 1);
    // SAFETY: rows 0..t of the [cap, top_k] f32 buffer, element k - 1 of
    // each: t 4-byte writes at a pitch of top_k * 4 bytes, inside it.
    unsafe {
        cudarc::driver::sys::cuMemsetD2D32Async(dst, k * 4, 0, 1, t, cx.gpu.stream.cu_stream())
    }
    .result()
    .map_err(GpuError::driver("dropping an expert (planted fault)"))
}

/// Where the positions of a forward pass come from.
#[derive(Debug, Clone, Copy)]
pub enum Positions {
    /// A prefill chunk of one sequence: its first token at absolute
    /// position `start`, the sequence's KV rows starting at row `base` of
    /// the arena (`arena.rs`) and, in sliding layers, the ring of its
    /// sampler slot `slot` (`scratch::KvCache`).
    Prefill {
        start: usize,
        base: usize,
        slot: usize,
    },
    /// A decode step: row r at the position in `scratch.pos[r]`, its
    /// sequence's KV rows from `scratch.kv_base[r]` on (sliding layers:
    /// from `scratch.ring_base[r]`).
    Decode,
    /// Prefill chunks of several sequences in one pass (`scratch.packed`:
    /// each segment's rows, first position and KV base). The GEMMs, norms,
    /// router and grouped experts run over all rows at once (their rows
    /// do not depend on the row count: `blas.rs`); RoPE, the KV append and
    /// attention run per segment, each exactly as that sequence's own
    /// prefill chunk. Continuous batching's packed prefill (`batch.rs`),
    /// all resident or streamed (`streamed.rs`).
    Packed,
}

/// Where one sequence's KV lives: its rows of the arena from `base` on
/// (full layers, `arena.rs`) and the ring of its sampler slot `slot`
/// (sliding layers, `scratch::KvCache`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqKv {
    pub base: usize,
    pub slot: usize,
}

/// One sequence's rows of a [`Positions::Packed`] pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedSegment {
    /// First row of the pass.
    pub row: usize,
    /// Rows (tokens).
    pub len: usize,
    /// Absolute position of the first token in its sequence.
    pub start: usize,
    /// The sequence's first KV row in the arena.
    pub base: usize,
    /// The sequence's sampler slot, whose ring it holds in sliding layers.
    pub slot: usize,
}

/// `(first row, rows)` of the GEMV launches covering `m` rows of `k`
/// inputs: the kernel stages a launch's `x` in shared memory, so at most
/// `GEMV_MAX_MK / k` rows (and `GEMV_MAX_TOKENS`) per launch.
pub(crate) fn gemv_rows(m: usize, k: usize) -> Vec<(usize, usize)> {
    let per = (krasis_kernels::GEMV_MAX_MK / k.max(1)).clamp(1, krasis_kernels::GEMV_MAX_TOKENS);
    (0..m).step_by(per).map(|r| (r, per.min(m - r))).collect()
}

/// Device address of element `offset` of `s`.
pub(crate) fn ptr<T>(gpu: &Gpu, s: &CudaSlice<T>, offset: usize) -> u64 {
    let (p, _g) = s.device_ptr(&gpu.stream);
    p + (offset * std::mem::size_of::<T>()) as u64
}

/// The read-only parts of a [`Model`] a forward pass uses.
pub(crate) struct Ctx<'a> {
    pub gpu: &'a Gpu,
    pub kn: &'a Kernels,
    pub g: &'a Geometry,
    pub w: &'a ModelWeights,
    pub experts: Option<&'a ExpertTable>,
    pub ffn: Option<&'a ExpertFfn>,
    /// The HCS decode tail over `experts` (decode only; `hcs/tail.rs`).
    pub tail: Option<crate::hcs::TailLaunch<'a>>,
    /// `Fault::StaleTail` (tests only; always false otherwise): the tail's
    /// promotions are not copied.
    pub stale_tail: bool,
    /// `Fault::StalePrefetch` (tests only; always false otherwise): the
    /// prefetch's promotions are not copied.
    pub stale_prefetch: bool,
    /// `Fault::UnmarkedFetch` (tests only; always false otherwise): the
    /// tail's promotions are not marked fresh.
    pub unmarked_fetch: bool,
    pub gemv_tokens: usize,
    pub grouped_prefill: bool,
    pub mxfp4_in_place: bool,
    pub prefill_kernels: crate::prefill_kernels::PrefillKernels,
}

impl Ctx<'_> {
    /// The expert FFN of a model with MoE layers.
    pub(crate) fn ffn(&self) -> Result<&ExpertFfn> {
        self.ffn
            .ok_or_else(|| GpuError::Unsupported("MoE layer but no expert format loaded".into()))
    }

    pub(crate) fn qkv_geom(&self, t: usize) -> QkvGeom {
        QkvGeom {
            n_tokens: t,
            n_q_heads: self.g.num_heads,
            n_kv_heads: self.g.num_kv_heads,
            head_dim: self.g.head_dim,
        }
    }

    /// `y[m,n] (+)= x[m,k] · w[n,k]ᵀ` on device addresses, BF16 inputs.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm(
        &self,
        dims: (usize, usize, usize),
        x: u64,
        w: u64,
        y: u64,
        out: OutType,
        beta: f32,
        what: &str,
    ) -> Result<()> {
        self.gemm_as(InType::Bf16, dims, x, w, y, out, beta, what)
    }

    /// [`Ctx::gemm`] with `input` inputs (an FP16 block's GEMMs). Dense
    /// sites: the algorithm is chosen for [`crate::blas::DENSE_REF_ROWS`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm_as(
        &self,
        input: InType,
        (m, n, k): (usize, usize, usize),
        x: u64,
        w: u64,
        y: u64,
        out: OutType,
        beta: f32,
        what: &str,
    ) -> Result<()> {
        let ref_rows = crate::blas::DENSE_REF_ROWS;
        gemm(
            &self.gpu.blas,
            &Gemm {
                m,
                n,
                k,
                x,
                w,
                y,
                input,
                out,
                beta,
                ref_rows,
            },
            what,
        )
    }

    /// Decode rows `0..m`: `y = w · rmsnorm(residual)` with the model's
    /// eps through the fused GEMV, which also writes the normed rows to
    /// `normed` (in `A`, the format of `w`: bf16, or f16 for an FP16
    /// block). In as few launches as the kernel's shared memory allows
    /// ([`gemv_rows`]); rows are independent of how they are grouped.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn norm_gemv<A: Act16, O: GemvOut<A>>(
        &self,
        residual: &CudaSlice<f32>,
        norm: &CudaSlice<bf16>,
        w: &impl DevicePtr<A>,
        m: usize,
        n: usize,
        normed: &mut CudaViewMut<'_, A>,
        y: &mut CudaViewMut<'_, O>,
    ) -> Result<()> {
        self.norm_gemv_form(residual, norm, w, m, n, GemvForm::CudaCores, normed, y)
    }

    /// [`Ctx::norm_gemv`] in the given form (the LM head's is
    /// [`LM_HEAD_FORM`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn norm_gemv_form<A: Act16, O: GemvOut<A>>(
        &self,
        residual: &CudaSlice<f32>,
        norm: &CudaSlice<bf16>,
        w: &impl DevicePtr<A>,
        m: usize,
        n: usize,
        form: GemvForm,
        normed: &mut CudaViewMut<'_, A>,
        y: &mut CudaViewMut<'_, O>,
    ) -> Result<()> {
        let (h, eps) = (self.g.hidden, self.g.rms_norm_eps);
        for (r0, rows) in gemv_rows(m, h) {
            self.kn.gemv_rmsnorm_form::<A, O>(
                &self.gpu.stream,
                &residual.slice(r0 * h..),
                norm,
                eps,
                w,
                rows,
                n,
                h,
                false,
                form,
                &mut normed.slice_mut(r0 * h..),
                &mut y.slice_mut(r0 * n..),
            )?;
        }
        Ok(())
    }

    /// Decode rows `0..m`: `y (+)= x · wᵀ` (`x` `[m, k]`, `w` `[n, k]`)
    /// through the GEMV in as few launches as its shared memory allows.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemv<A: Act16, O: GemvOut<A>>(
        &self,
        x: &CudaView<'_, A>,
        w: &impl DevicePtr<A>,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
        y: &mut CudaViewMut<'_, O>,
    ) -> Result<()> {
        for (r0, rows) in gemv_rows(m, k) {
            self.kn.gemv::<A, O>(
                &self.gpu.stream,
                &x.slice(r0 * k..),
                w,
                rows,
                n,
                k,
                accumulate,
                &mut y.slice_mut(r0 * n..),
            )?;
        }
        Ok(())
    }

    pub(crate) fn p<T>(&self, s: &CudaSlice<T>, offset: usize) -> u64 {
        ptr(self.gpu, s, offset)
    }
}

/// The mutable parts of a [`Model`] a forward pass uses.
pub(crate) struct Mut<'a> {
    pub sc: &'a mut Scratch,
    pub kv: &'a mut KvCache,
    pub routes: Option<&'a mut Vec<Vec<u64>>>,
    pub token_routes: Option<&'a mut crate::moe::RouteLog>,
}

impl Model {
    pub(crate) fn split_all(&mut self) -> (Ctx<'_>, Mut<'_>) {
        let tail = match (&self.hcs, &self.experts) {
            (Some(h), Some(t)) => h.tail_args(&self.gpu, t),
            _ => None,
        };
        (
            Ctx {
                gpu: &self.gpu,
                kn: &self.kernels,
                g: &self.geometry,
                w: &self.weights,
                experts: self.experts.as_ref(),
                ffn: self.ffn.as_ref(),
                tail,
                #[cfg(any(test, feature = "fault-injection"))]
                stale_tail: self.fault == Fault::StaleTail,
                #[cfg(not(any(test, feature = "fault-injection")))]
                stale_tail: false,
                #[cfg(any(test, feature = "fault-injection"))]
                stale_prefetch: matches!(self.fault, Fault::StaleTail | Fault::StalePrefetch),
                #[cfg(not(any(test, feature = "fault-injection")))]
                stale_prefetch: false,
                #[cfg(any(test, feature = "fault-injection"))]
                unmarked_fetch: self.fault == Fault::UnmarkedFetch,
                #[cfg(not(any(test, feature = "fault-injection")))]
                unmarked_fetch: false,
                gemv_tokens: self.gemv_tokens,
                grouped_prefill: self.grouped_prefill,
                mxfp4_in_place: self.mxfp4_in_place,
                prefill_kernels: self.prefill_kernels,
            },
            Mut {
                sc: &mut self.scratch,
                kv: &mut self.kv,
                routes: self.routes.as_mut(),
                token_routes: self.token_routes.as_mut(),
            },
        )
    }

    pub(crate) fn split(&mut self) -> (Ctx<'_>, &mut Scratch, &mut KvCache) {
        let (cx, m) = self.split_all();
        (cx, m.sc, m.kv)
    }

    /// Under HCS, the compute stream waits for the last prefill's reload of
    /// the reclaimable prior (`Hcs::restore`) if it has not yet: before a
    /// decode step reads the decode table, outside any graph capture.
    pub(crate) fn settle_experts(&mut self) -> Result<()> {
        match self.hcs.as_mut() {
            Some(h) => h.settle(&self.gpu),
            None => Ok(()),
        }
    }

    /// Runs `t` tokens (already in `scratch.ids[..t]`) through every layer;
    /// leaves the final residual stream in `scratch.residual[..t]`.
    pub fn forward_layers(&mut self, t: usize, at: Positions) -> Result<()> {
        self.embed(t, at)?;
        for l in 0..self.geometry.num_layers {
            self.layer(l, t, at)?;
        }
        Ok(())
    }

    /// Embeds `scratch.ids[..t]` into `scratch.residual[..t]`.
    pub(crate) fn embed(&mut self, t: usize, at: Positions) -> Result<()> {
        let (cx, sc, _) = self.split();
        if t == 0 || t > sc.cap {
            return Err(GpuError::Unsupported(format!(
                "forward pass of {t} tokens (the scratch holds 1..={})",
                sc.cap
            )));
        }
        if matches!(at, Positions::Decode) && t > sc.seqs {
            return Err(GpuError::Unsupported(format!(
                "a decode step of {t} rows (the scratch holds {} sequences)",
                sc.seqs
            )));
        }
        let g = cx.g;
        let (s, v, h) = (&cx.gpu.stream, g.vocab_size, g.hidden);
        match &cx.w.embed {
            Embedding::Tied(e) => cx.kn.embed(s, e, v, h, &sc.ids, t, &mut sc.residual)?,
            Embedding::Untied { embed, .. } => {
                cx.kn.embed(s, embed, v, h, &sc.ids, t, &mut sc.residual)?
            }
        }
        Ok(())
    }

    /// Decoder layer `l` over the `t` tokens in `scratch.residual`.
    pub(crate) fn layer(&mut self, l: usize, t: usize, at: Positions) -> Result<()> {
        #[cfg(any(test, feature = "fault-injection"))]
        let fault = self.fault;
        let (cx, m) = self.split_all();
        let Mut {
            sc,
            kv,
            routes,
            token_routes,
        } = m;
        let lw = &cx.w.layers[l];
        // Decode folds both norms into the projections after them.
        let decode = matches!(at, Positions::Decode);
        if !decode {
            crate::attention::input_norm(&cx, sc, l, t)?;
        }
        crate::attention::attention(&cx, sc, kv, l, t, at)?;
        if !decode {
            crate::mlp::post_attention_norm(&cx, sc, l, t)?;
        }
        match &lw.mlp {
            MlpWeights::Moe {
                moe_index, shared, ..
            } => {
                #[cfg(any(test, feature = "fault-injection"))]
                let ignore_bias = fault == Fault::IgnoreSelectionBias;
                #[cfg(not(any(test, feature = "fault-injection")))]
                let ignore_bias = false;
                crate::moe::router(&cx, sc, l, t, at, ignore_bias)?;
                #[cfg(any(test, feature = "fault-injection"))]
                if fault == Fault::DropExpert {
                    drop_last_expert(&cx, sc, t)?;
                }
                if let Some(r) = routes {
                    crate::moe::record_routes(&cx, sc, t, &mut r[*moe_index])?;
                }
                if let Some(log) = token_routes {
                    crate::moe::log_token_routes(&cx, sc, l, *moe_index, t, at, log)?;
                }
                crate::moe::routed_experts(&cx, sc, *moe_index, t, at)?;
                // transformers adds the shared expert to the routed output
                // unscaled; here both accumulate into the f32 residual,
                // routed first. It reads `scratch.normed`, which the
                // router (GEMV in decode) wrote and the experts left as is.
                #[cfg(any(test, feature = "fault-injection"))]
                let shared = shared.as_ref().filter(|_| fault != Fault::NoSharedExpert);
                if let Some(w) = shared {
                    crate::mlp::swiglu_mlp(&cx, sc, w, t, decode, None)?;
                }
            }
            MlpWeights::Dense(w) => {
                crate::mlp::swiglu_mlp(&cx, sc, w, t, decode, Some(&lw.post_attention_norm))?;
            }
        }
        Ok(())
    }

    /// Final RMSNorm and the LM head of a decode step's rows `0..rows`
    /// into `scratch.logits[..rows]` (f32), through the GEMV: each row's
    /// logits are those of a one-row launch (batch invariance; cuBLAS picks
    /// its kernels by shape).
    pub fn lm_head_rows(&mut self, rows: usize) -> Result<()> {
        let (cx, sc, _) = self.split();
        if rows == 0 || rows > sc.seqs {
            return Err(GpuError::Unsupported(format!(
                "decode LM head over {rows} rows (the scratch holds {} sequences)",
                sc.seqs
            )));
        }
        let g = cx.g;
        cx.norm_gemv_form::<bf16, f32>(
            &sc.residual,
            &cx.w.final_norm,
            cx.w.lm_head(),
            rows,
            g.vocab_size,
            LM_HEAD_FORM,
            &mut sc.normed.slice_mut(..),
            &mut sc.logits.slice_mut(..),
        )
    }

    /// Final RMSNorm of residual rows `first..first+rows` and the LM head
    /// into `scratch.logits[..rows]` (f32). `rows <= LOGIT_ROWS`.
    pub fn lm_head(&mut self, first: usize, rows: usize) -> Result<()> {
        let (cx, sc, _) = self.split();
        if rows == 0 || rows > LOGIT_ROWS || first + rows > sc.cap {
            return Err(GpuError::Unsupported(format!(
                "LM head over rows {first}..{} (at most {LOGIT_ROWS} rows within {})",
                first + rows,
                sc.cap
            )));
        }
        let g = cx.g;
        let h = g.hidden;
        let src = sc.residual.slice(first * h..(first + rows) * h);
        if rows == 1 {
            // One row (a prefill's last token): the GEMV streams the head
            // faster than cuBLAS (144.6 vs 150.5 us for 151,936 x 2048 on
            // an H200) and takes the final norm with it; in the decode
            // steps' form, so a token's logits come from the same kernel
            // whichever path produced them.
            return Ok(cx.kn.gemv_rmsnorm_form::<bf16, f32>(
                &cx.gpu.stream,
                &src,
                &cx.w.final_norm,
                g.rms_norm_eps,
                cx.w.lm_head(),
                1,
                g.vocab_size,
                h,
                false,
                LM_HEAD_FORM,
                &mut sc.normed,
                &mut sc.logits,
            )?);
        }
        cx.kn.rmsnorm::<f32>(
            &cx.gpu.stream,
            &src,
            &cx.w.final_norm,
            rows,
            h,
            g.rms_norm_eps,
            &mut sc.normed,
        )?;
        cx.gemm(
            (rows, g.vocab_size, h),
            cx.p(&sc.normed, 0),
            cx.p(cx.w.lm_head(), 0),
            cx.p(&sc.logits, 0),
            OutType::F32,
            0.0,
            "LM head",
        )
    }
}
