//! Token selection on the GPU (`cuda/sampling.cu`): greedy argmax, and
//! seeded sampling with penalties, temperature, top-k, top-p and min-p, so
//! only the chosen id crosses to the host.
//!
//! Sampling semantics (the CPU reference implements the same):
//! 0. Any non-finite logit (±inf, NaN: an activation that overflowed its
//!    16-bit format) => no token: `out[0] = SAMPLE_NONFINITE` and no count
//!    changes. The engine refuses the step; it never becomes a token.
//! 1. `l[v] = logit[v] - presence * (count[v] > 0) - frequency * count[v]`;
//!    with a grammar mask, `l[v] = -inf` for every token it does not allow
//!    (weight 0 below; never the greedy pick while the mask allows any).
//! 2. temperature 0 => greedy argmax of `l` (ties: lowest id). Otherwise
//!    `l /= temperature`, `m = max l`, and each token gets the fixed-point
//!    weight `w[v] = min(floor(exp(l[v] - m) * 2^24), 2^24 - 1)`.
//!    Integer weights make every later sum exact, hence deterministic;
//!    tokens with probability under 2^-24 of the top token get weight 0 and
//!    are never sampled.
//! 3. top-k (k > 0): keep the k largest weights, ties by lowest id.
//! 4. top-p (< 1): of those, keep the tokens with `w >= tau`, `tau` the
//!    largest threshold whose kept mass is `>= ceil(p * kept_mass)`.
//! 5. min-p (> 0): keep only `w >= min_p * (2^24 - 1)`.
//! 6. `r` = 64 random bits from Philox4x32-10 (key = seed, counter =
//!    step); `target = (r * M) >> 64` with `M` the kept mass; the token is
//!    the first id (ascending) whose cumulative kept weight exceeds target.
//!
//! The chosen id is written to `out[0]` and `counts[id]` is incremented.

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};

use crate::launch::{Elem, builder, by_elem, cfg, check_len, dim_u32, ensure, submit};
use crate::{Kernels, Result};

/// Blocks of the penalty/temperature pass; their partial maxima, then their
/// argmax ids, follow the vocab entries in the workspace
/// (`PREP_MAX_BLOCKS` in `cuda/sampling.cu`).
pub const SAMPLE_PREP_BLOCKS: usize = 256;

/// What [`Kernels::sample`] writes instead of a token id when a logit is
/// not finite (`SAMPLE_NONFINITE` in `cuda/sampling.cu`; never a vocabulary
/// id).
pub const SAMPLE_NONFINITE: u32 = u32::MAX;

/// u32 elements of the workspace [`Kernels::sample`] needs.
pub fn sample_workspace_len(vocab: usize) -> usize {
    vocab + 2 * SAMPLE_PREP_BLOCKS
}

/// Per-request sampling settings (OpenAI-style).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = disabled.
    pub top_k: u32,
    /// 1.0 = disabled.
    pub top_p: f32,
    /// 0.0 = disabled.
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Rejects values the kernels cannot give a meaning to.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let finite = [
            self.temperature,
            self.top_p,
            self.min_p,
            self.presence_penalty,
            self.frequency_penalty,
        ]
        .iter()
        .all(|v| v.is_finite());
        if !finite {
            return Err(format!("sampling parameters must be finite: {self:?}"));
        }
        if self.temperature < 0.0 {
            return Err(format!("temperature = {} must be >= 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p = {} must be in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p = {} must be in [0, 1]", self.min_p));
        }
        Ok(())
    }
}

impl Kernels {
    /// Greedy argmax per row (ties: lowest id). NaN logits are never chosen
    /// unless the whole row is NaN (then id 0).
    ///
    /// - `logits`: f32 or bf16 `[rows, vocab]`; `out`: u32 `[rows]`.
    pub fn argmax<T: Elem>(
        &self,
        stream: &CudaStream,
        logits: &impl DevicePtr<T>,
        rows: usize,
        vocab: usize,
        out: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        let k = by_elem::<T>("argmax_f32", "argmax_bf16");
        ensure(k, vocab > 0, || "vocab must be positive".into())?;
        check_len(k, "logits", logits.len(), rows * vocab)?;
        check_len(k, "out", out.len(), rows)?;
        let (r, v) = (dim_u32(k, "rows", rows)?, dim_u32(k, "vocab", vocab)?);
        let (lp, _g1) = logits.device_ptr(stream);
        let (op, _g2) = out.device_ptr_mut(stream);
        let f = self.func(k)?;
        let mut b = builder(stream, f);
        b.arg(&lp).arg(&op).arg(&r).arg(&v);
        submit(k, b, cfg((r, 1, 1), 1024, 0))
    }

    /// Choose one token from `logits` per the module-level semantics.
    ///
    /// - `logits`: f32 or bf16 `[vocab]`.
    /// - `counts`: u32 `[vocab]` occurrences of each id in the generated
    ///   text so far (zero it per request); the chosen id is incremented.
    /// - `workspace`: u32, [`sample_workspace_len`] elements.
    /// - `step`: the Philox counter (e.g. the index of the generated token),
    ///   so a (seed, step) pair always draws the same number.
    /// - `mask`: u32 `[ceil(vocab / 32)]`, bit `v % 32` of word `v / 32`
    ///   allowing token `v` (the words of a grammar's
    ///   `krasis_model::structured::TokenMask`), or `None`. It must allow at
    ///   least one token.
    /// - `out`: u32 `[1]`, the chosen id, or [`SAMPLE_NONFINITE`] (and no
    ///   count changed) when a logit is not finite.
    #[allow(clippy::too_many_arguments)]
    pub fn sample<T: Elem>(
        &self,
        stream: &CudaStream,
        logits: &impl DevicePtr<T>,
        vocab: usize,
        params: &SamplingParams,
        step: u64,
        mask: Option<&dyn DevicePtr<u32>>,
        counts: &mut impl DevicePtrMut<u32>,
        workspace: &mut impl DevicePtrMut<u32>,
        out: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        let k = by_elem::<T>("sample_prepare_f32", "sample_prepare_bf16");
        if let Err(msg) = params.validate() {
            return Err(crate::launch::shape_err(k, msg));
        }
        ensure(k, vocab > 0, || "vocab must be positive".into())?;
        check_len(k, "logits", logits.len(), vocab)?;
        check_len(k, "counts", counts.len(), vocab)?;
        check_len(k, "workspace", workspace.len(), sample_workspace_len(vocab))?;
        check_len(k, "out", out.len(), 1)?;
        let v = dim_u32(k, "vocab", vocab)?;
        let greedy = u32::from(params.temperature == 0.0);
        let inv_t = if greedy == 1 {
            1.0f32
        } else {
            1.0 / params.temperature
        };
        let nblocks = (SAMPLE_PREP_BLOCKS as u32).min(v.div_ceil(256));
        let (lp, _g1) = logits.device_ptr(stream);
        let (cp, _g2) = counts.device_ptr_mut(stream);
        let (wp, _g3) = workspace.device_ptr_mut(stream);
        let (op, _g4) = out.device_ptr_mut(stream);
        let (mp, _g5) = match mask {
            Some(m) => {
                check_len(k, "mask", m.len(), vocab.div_ceil(32))?;
                let (p, g) = m.device_ptr(stream);
                (p, Some(g))
            }
            None => (0u64, None),
        };
        let f = self.func(k)?;
        let mut b = builder(stream, f);
        b.arg(&lp)
            .arg(&cp)
            .arg(&mp)
            .arg(&wp)
            .arg(&v)
            .arg(&params.presence_penalty)
            .arg(&params.frequency_penalty)
            .arg(&inv_t);
        submit(k, b, cfg((nblocks, 1, 1), 256, 0))?;
        const S: &str = "sample_select";
        let f = self.func(S)?;
        let top_k = if params.top_k as usize >= vocab {
            0
        } else {
            params.top_k
        };
        let mut b = builder(stream, f);
        b.arg(&wp)
            .arg(&cp)
            .arg(&op)
            .arg(&v)
            .arg(&nblocks)
            .arg(&greedy)
            .arg(&top_k);
        b.arg(&params.top_p)
            .arg(&params.min_p)
            .arg(&params.seed)
            .arg(&step);
        submit(S, b, cfg((1, 1, 1), 1024, 0))
    }
}
