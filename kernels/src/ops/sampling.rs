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

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, PushKernelArg};

use crate::launch::{Elem, builder, by_elem, cfg, check_len, dim_u32, ensure, shape_err, submit};
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

/// Most rows of one [`Kernels::sample_rows`] launch (`SAMPLE_MAX_ROWS` in
/// `cuda/sampling.cu`): a decode step's rows (the decode GEMVs' limit).
pub const SAMPLE_MAX_ROWS: usize = 8;

/// One row of a [`Kernels::sample_rows`] launch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleRow {
    pub params: SamplingParams,
    /// The Philox counter of this row's draw.
    pub step: u64,
    /// The row's counts row (and mask row).
    pub slot: usize,
    /// Whether the mask row `slot` applies.
    pub masked: bool,
}

/// A row's settings as the kernels read them (`SampleRow` in
/// `cuda/sampling.cu`: the same fields, order and 56-byte size).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct SampleRowArg {
    seed: u64,
    step: u64,
    slot: u32,
    masked: u32,
    greedy: u32,
    top_k: u32,
    presence: f32,
    frequency: f32,
    inv_t: f32,
    top_p: f32,
    min_p: f32,
    pad: u32,
}

impl SampleRowArg {
    fn new(r: &SampleRow, vocab: usize, kernel: &'static str) -> Result<Self> {
        let p = &r.params;
        let greedy = p.temperature == 0.0;
        Ok(SampleRowArg {
            seed: p.seed,
            step: r.step,
            slot: dim_u32(kernel, "slot", r.slot)?,
            masked: u32::from(r.masked),
            greedy: u32::from(greedy),
            top_k: if p.top_k as usize >= vocab {
                0
            } else {
                p.top_k
            },
            presence: p.presence_penalty,
            frequency: p.frequency_penalty,
            inv_t: if greedy { 1.0 } else { 1.0 / p.temperature },
            top_p: p.top_p,
            min_p: p.min_p,
            pad: 0,
        })
    }
}

/// Every row of a launch, by value in the kernel parameters
/// (`SampleRows` in `cuda/sampling.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct SampleRowsArg {
    r: [SampleRowArg; SAMPLE_MAX_ROWS],
}

// SAFETY: plain old data of fixed layout (`repr(C)`, no padding: 56-byte
// rows of 8-byte-aligned fields), matching the kernels' struct.
unsafe impl DeviceRepr for SampleRowsArg {}

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
    ///
    /// One row of [`Kernels::sample_rows`].
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
        let row = SampleRow {
            params: *params,
            step,
            slot: 0,
            masked: mask.is_some(),
        };
        let masks = mask.map(|m| (m, vocab.div_ceil(32)));
        self.sample_rows::<T>(
            stream,
            logits,
            vocab,
            vocab,
            &[row],
            counts,
            vocab,
            masks,
            workspace,
            out,
        )
    }

    /// [`Kernels::sample`] for each of `rows` (at most
    /// [`SAMPLE_MAX_ROWS`]) in one launch pair: row `r` reads logits row
    /// `r` (`logits[r * logit_stride..][..vocab]`), uses counts row
    /// `rows[r].slot` (`counts[slot * count_stride..][..vocab]`), its mask
    /// row `slot` (`masks = (buffer, words per row)`) when `masked`, and
    /// workspace row `r` (`workspace[r * sample_workspace_len(vocab)..]`),
    /// and writes `out[r]`. Each row's result is what [`Kernels::sample`]
    /// gives it alone. The rows' slots must differ (each increments its
    /// counts row).
    #[allow(clippy::too_many_arguments)]
    pub fn sample_rows<T: Elem>(
        &self,
        stream: &CudaStream,
        logits: &impl DevicePtr<T>,
        logit_stride: usize,
        vocab: usize,
        rows: &[SampleRow],
        counts: &mut impl DevicePtrMut<u32>,
        count_stride: usize,
        masks: Option<(&dyn DevicePtr<u32>, usize)>,
        workspace: &mut impl DevicePtrMut<u32>,
        out: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        let k = by_elem::<T>("sample_prepare_f32", "sample_prepare_bf16");
        let n = rows.len();
        ensure(k, (1..=SAMPLE_MAX_ROWS).contains(&n), || {
            format!("{n} rows: 1 to {SAMPLE_MAX_ROWS} per launch")
        })?;
        ensure(k, vocab > 0, || "vocab must be positive".into())?;
        ensure(k, logit_stride >= vocab && count_stride >= vocab, || {
            format!(
                "row strides (logits {logit_stride}, counts {count_stride}) below the vocab {vocab}"
            )
        })?;
        let ws_len = sample_workspace_len(vocab);
        check_len(k, "logits", logits.len(), (n - 1) * logit_stride + vocab)?;
        check_len(k, "workspace", workspace.len(), n * ws_len)?;
        check_len(k, "out", out.len(), n)?;
        let max_slot = rows.iter().map(|r| r.slot).max().unwrap_or(0);
        check_len(k, "counts", counts.len(), max_slot * count_stride + vocab)?;
        let mut arg = SampleRowsArg::default();
        for (i, r) in rows.iter().enumerate() {
            if let Err(msg) = r.params.validate() {
                return Err(shape_err(k, format!("row {i}: {msg}")));
            }
            ensure(k, rows[..i].iter().all(|o| o.slot != r.slot), || {
                format!(
                    "rows share counts slot {}: each row increments its own",
                    r.slot
                )
            })?;
            arg.r[i] = SampleRowArg::new(r, vocab, k)?;
        }
        let words = vocab.div_ceil(32);
        let (mp, m_stride, _gm) = match (
            masks,
            rows.iter().filter(|r| r.masked).map(|r| r.slot).max(),
        ) {
            (Some((m, stride)), Some(last)) => {
                ensure(k, stride >= words, || {
                    format!("mask rows of {stride} words below the vocab's {words}")
                })?;
                check_len(k, "masks", m.len(), last * stride + words)?;
                let (p, g) = m.device_ptr(stream);
                (p, stride, Some(g))
            }
            (None, Some(_)) => {
                return Err(shape_err(k, "a row is masked but no mask buffer was given"));
            }
            (_, None) => (0u64, 0, None),
        };
        let v = dim_u32(k, "vocab", vocab)?;
        let (ls, cs, ms, wss) = (
            dim_u32(k, "logit_stride", logit_stride)?,
            dim_u32(k, "count_stride", count_stride)?,
            dim_u32(k, "mask stride", m_stride)?,
            dim_u32(k, "workspace stride", ws_len)?,
        );
        let nblocks = (SAMPLE_PREP_BLOCKS as u32).min(v.div_ceil(256));
        let (lp, _g1) = logits.device_ptr(stream);
        let (cp, _g2) = counts.device_ptr_mut(stream);
        let (wp, _g3) = workspace.device_ptr_mut(stream);
        let (op, _g4) = out.device_ptr_mut(stream);
        let f = self.func(k)?;
        let mut b = builder(stream, f);
        b.arg(&lp).arg(&ls).arg(&cp).arg(&cs).arg(&mp).arg(&ms);
        b.arg(&wp).arg(&wss).arg(&v).arg(&arg);
        // x = the vocabulary's blocks, y = row.
        submit(k, b, cfg((nblocks, n as u32, 1), 256, 0))?;
        const S: &str = "sample_select";
        let f = self.func(S)?;
        let mut b = builder(stream, f);
        b.arg(&wp).arg(&wss).arg(&cp).arg(&cs).arg(&op);
        b.arg(&v).arg(&nblocks).arg(&arg);
        // One block per row.
        submit(S, b, cfg((n as u32, 1, 1), 1024, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels read `SampleRow` at these offsets (`cuda/sampling.cu`).
    #[test]
    fn row_arg_layout_matches_the_kernels() {
        assert_eq!(std::mem::size_of::<SampleRowArg>(), 56);
        assert_eq!(std::mem::align_of::<SampleRowArg>(), 8);
        assert_eq!(std::mem::offset_of!(SampleRowArg, slot), 16);
        assert_eq!(std::mem::offset_of!(SampleRowArg, top_k), 28);
        assert_eq!(std::mem::offset_of!(SampleRowArg, presence), 32);
        assert_eq!(std::mem::offset_of!(SampleRowArg, min_p), 48);
        assert_eq!(std::mem::size_of::<SampleRowsArg>(), 56 * SAMPLE_MAX_ROWS);
    }

    #[test]
    fn row_arg_carries_the_settings() {
        let r = SampleRow {
            params: SamplingParams {
                temperature: 0.5,
                top_k: 100,
                top_p: 0.9,
                min_p: 0.1,
                presence_penalty: 1.0,
                frequency_penalty: 0.5,
                seed: 7,
            },
            step: 3,
            slot: 2,
            masked: true,
        };
        let a = SampleRowArg::new(&r, 50, "k").unwrap();
        assert_eq!((a.seed, a.step, a.slot, a.masked), (7, 3, 2, 1));
        assert_eq!(
            (a.greedy, a.top_k, a.inv_t),
            (0, 0, 2.0),
            "top_k >= vocab is off"
        );
        let g = SampleRowArg::new(
            &SampleRow {
                params: SamplingParams::default(),
                ..r
            },
            50,
            "k",
        )
        .unwrap();
        assert_eq!((g.greedy, g.inv_t), (1, 1.0));
    }
}
