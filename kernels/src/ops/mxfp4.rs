//! MXFP4 expert kernels over the expert-cache format v2 layout
//! (`cuda/mxfp4.cu`): batched decode GEMVs through a device-side expert
//! pointer table with the expert activation (SwiGLU or gpt-oss's clamped
//! SwiGLU) and optional biases fused, the grouped prefill GEMMs reading the
//! same blocks in place (`grouped.rs`, `cuda/mxfp4_gemm.cu`; not the
//! engine's until verified on the device), and the dequantization to bf16 +
//! bias and activation kernels of the per-expert GEMM path prefill runs
//! today.
//!
//! Expert format (`/work/notes`' layout contract, `runtime/cache/src/layout.rs`,
//! precision `mxfp4`, group 32), the checkpoint's own bits: `w13_q`
//! `[2I, H]` and `w2_q` `[H, I]` E2M1 codes two per byte (element `2j` in
//! the low nibble of byte `j`), E8M0 scale bytes `w13_s` `[2I, H/32]` and
//! `w2_s` `[H, I/32]` (value `e2m1(code) * 2^(s-127)`), and, when the
//! architecture has expert biases, bf16 `w13_b` `[2I]` and `w2_b` `[H]`.
//! `w13` rows `0..I` are gate rows, `I..2I` up rows (the cache builder
//! de-interleaves gpt-oss's gate/up rows).
//!
//! The pointer table, slot mask, NaN-on-bad-id and PDL contracts are those
//! of the INT4 kernels ([`crate::ops::int4`]).

use std::ffi::c_void;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

use crate::launch::{
    Elem, KArgs, builder, by_elem, cfg, check_len, dim_u32, ensure, launch_dependent, shape_err,
    submit, submit_pdl,
};
use crate::{Kernels, Result};

mod grouped;

pub use grouped::{MXFP4_GROUPED_ROWS, mxfp4_grouped_tiles};

/// Values per E8M0 scale (the MX block size).
pub const MXFP4_BLOCK: usize = 32;
/// Largest hidden size of the MXFP4 decode GEMVs.
pub const MXFP4_DECODE_MAX_HIDDEN: usize = 8192;
/// Largest expert FFN width of the MXFP4 decode GEMVs.
pub const MXFP4_DECODE_MAX_INTER: usize = 4096;
/// Largest top-k of the MXFP4 decode GEMVs.
pub const MXFP4_DECODE_MAX_TOPK: usize = 16;

/// Byte alignment of every array inside an expert block (layout contract).
const ARRAY_ALIGN: usize = 256;
/// Dynamic shared memory the down GEMV may use to stage `act` (it stages
/// the top-k rows in chunks of experts that fit).
const W2_SMEM_BUDGET: usize = 160 * 1024;
/// Shared bytes per staged expert per 128-K tile (4 lanes x 36 u32).
const W2_SMEM_PER_TILE: usize = 4 * 36 * 4;
/// Most work items (expert, K-part) of one down-GEMV block.
const W2_MAX_ITEMS: usize = 128;
/// Shared bytes of a down-GEMV warp's weight ring per 128-K tile of its
/// work item: 2 slots x 2 row halves x 32 lanes x 16 bytes (`cuda/mxfp4.cu`).
const W2_RING_PER_TILE: usize = 2 * 2 * 32 * 16;

/// A down-GEMV block's shape: its warps, the experts whose activations it
/// stages per chunk, and its dynamic shared memory (the staged activations,
/// then one weight ring per warp).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct W2Plan {
    warps: usize,
    jc: usize,
    smem: usize,
}

/// The most warps (up to `max_warps`, one per work item at most) whose
/// rings fit `room` shared bytes beside at least one expert's activations,
/// the rest of `room` (up to [`W2_SMEM_BUDGET`]) staging as many experts as
/// fit. `None` when not even one warp fits. The warp count changes which
/// warp runs an item, never an item's arithmetic or the reduction order.
fn w2_plan(
    items: usize,
    max_warps: usize,
    gpw: usize,
    ng: usize,
    top_k: usize,
    room: usize,
) -> Option<W2Plan> {
    let per_expert = ng * W2_SMEM_PER_TILE;
    let mut warps = items.min(max_warps).max(1);
    loop {
        let ring = warps * gpw * W2_RING_PER_TILE;
        if ring + per_expert <= room {
            let jc = ((room - ring).min(W2_SMEM_BUDGET) / per_expert).clamp(1, top_k);
            return Some(W2Plan {
                warps,
                jc,
                smem: jc * per_expert + ring,
            });
        }
        if warps == 1 {
            return None;
        }
        warps = warps.div_ceil(2);
    }
}

/// The expert activation fused into [`Kernels::mxfp4_w13_act`] and
/// [`Kernels::bias_act_rows`], applied to `gate`, `up` (bias included).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExpertActivation {
    /// `silu(gate) * up` (qwen3_moe).
    Swiglu,
    /// gpt-oss: `gate = min(gate, limit)`, `up = clamp(up, -limit, limit)`,
    /// `(up + 1) * gate * sigmoid(alpha * gate)` (`limit` 7.0, `alpha`
    /// 1.702 in gpt-oss). A NaN input stays NaN.
    ClampedSwiglu { limit: f32, alpha: f32 },
}

impl ExpertActivation {
    /// (kind, limit, alpha) as the kernels take them.
    fn args(self, k: &'static str) -> Result<(u32, f32, f32)> {
        match self {
            ExpertActivation::Swiglu => Ok((0, 0.0, 0.0)),
            ExpertActivation::ClampedSwiglu { limit, alpha } => {
                ensure(
                    k,
                    limit.is_finite() && limit > 0.0 && alpha.is_finite(),
                    || {
                        format!(
                            "clamped SwiGLU needs a finite limit > 0 and a finite alpha, got {limit}, {alpha}"
                        )
                    },
                )?;
                Ok((1, limit, alpha))
            }
        }
    }
}

/// Byte offsets of the six arrays inside one MXFP4 expert block, plus the
/// matrix dims. Mirrors `krasis_cache::layout::ExpertLayout` for precision
/// `mxfp4` (format v2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mxfp4Layout {
    pub hidden: usize,
    pub intermediate: usize,
    /// Whether `w13_b` and `w2_b` are present (size 0 otherwise).
    pub has_bias: bool,
    pub w13_q: usize,
    pub w13_s: usize,
    pub w13_b: usize,
    pub w2_q: usize,
    pub w2_s: usize,
    pub w2_b: usize,
}

impl Mxfp4Layout {
    /// The format-v2 layout: arrays in contract order, each 256-byte
    /// aligned. `None` unless both dims are positive multiples of 32.
    pub fn new(hidden: usize, intermediate: usize, has_bias: bool) -> Option<Self> {
        let (h, i) = (hidden, intermediate);
        if h == 0 || i == 0 || !h.is_multiple_of(MXFP4_BLOCK) || !i.is_multiple_of(MXFP4_BLOCK) {
            return None;
        }
        let align = |x: usize| x.div_ceil(ARRAY_ALIGN) * ARRAY_ALIGN;
        let mut l = Mxfp4Layout {
            hidden: h,
            intermediate: i,
            has_bias,
            w13_q: 0,
            w13_s: 0,
            w13_b: 0,
            w2_q: 0,
            w2_s: 0,
            w2_b: 0,
        };
        l.w13_s = align(l.w13_q + l.sizes()[0]);
        l.w13_b = align(l.w13_s + l.sizes()[1]);
        l.w2_q = align(l.w13_b + l.sizes()[2]);
        l.w2_s = align(l.w2_q + l.sizes()[3]);
        l.w2_b = align(l.w2_s + l.sizes()[4]);
        Some(l)
    }

    /// Byte sizes of w13_q, w13_s, w13_b, w2_q, w2_s, w2_b.
    fn sizes(&self) -> [usize; 6] {
        let (h, i) = (self.hidden, self.intermediate);
        let b = usize::from(self.has_bias);
        [
            i * h,
            2 * i * (h / MXFP4_BLOCK),
            b * 2 * i * 2,
            h * i / 2,
            h * (i / MXFP4_BLOCK),
            b * h * 2,
        ]
    }

    fn offsets(&self) -> [usize; 6] {
        [
            self.w13_q, self.w13_s, self.w13_b, self.w2_q, self.w2_s, self.w2_b,
        ]
    }

    /// Bytes the arrays span from the block start.
    pub fn used_bytes(&self) -> usize {
        let (o, s) = (self.offsets(), self.sizes());
        // Empty (bias) arrays take no room, wherever their offset is.
        (0..6)
            .filter(|&a| s[a] > 0)
            .map(|a| o[a] + s[a])
            .max()
            .unwrap_or(0)
    }

    /// Checks what the kernels rely on: dims multiples of 32, every array
    /// 16-byte aligned, arrays disjoint.
    pub fn validate(&self, k: &'static str) -> Result<()> {
        let (h, i) = (self.hidden, self.intermediate);
        ensure(
            k,
            h > 0 && i > 0 && h.is_multiple_of(MXFP4_BLOCK) && i.is_multiple_of(MXFP4_BLOCK),
            || format!("hidden = {h} and intermediate = {i} must be positive multiples of 32"),
        )?;
        const NAMES: [&str; 6] = ["w13_q", "w13_s", "w13_b", "w2_q", "w2_s", "w2_b"];
        let (o, s) = (self.offsets(), self.sizes());
        for a in 0..6 {
            if s[a] > 0 && !o[a].is_multiple_of(16) {
                return Err(shape_err(
                    k,
                    format!("offset {} = {} is not 16-byte aligned", NAMES[a], o[a]),
                ));
            }
            for b in a + 1..6 {
                if s[a] > 0 && s[b] > 0 && o[a] < o[b] + s[b] && o[b] < o[a] + s[a] {
                    return Err(shape_err(
                        k,
                        format!("arrays {} and {} of {self:?} overlap", NAMES[a], NAMES[b]),
                    ));
                }
            }
        }
        Ok(())
    }

    fn common_decode_checks(&self, k: &'static str, top_k: usize) -> Result<()> {
        self.validate(k)?;
        let (h, i) = (self.hidden, self.intermediate);
        ensure(
            k,
            h <= MXFP4_DECODE_MAX_HIDDEN && i <= MXFP4_DECODE_MAX_INTER,
            || {
                format!(
                    "hidden = {h}, intermediate = {i} exceed the {MXFP4_DECODE_MAX_HIDDEN} x {MXFP4_DECODE_MAX_INTER} the MXFP4 decode GEMVs support (dequantize + GEMM instead)"
                )
            },
        )?;
        ensure(k, (1..=MXFP4_DECODE_MAX_TOPK).contains(&top_k), || {
            format!("top_k = {top_k} must be in 1..=16")
        })
    }
}

impl Kernels {
    /// Decode gate/up GEMV with bias and activation fused: for pair
    /// `p = t*top_k + j`, expert `e = table[ids[p]]`,
    /// `act[p, i] = activation(g, u)` with `g = W13_e[i, :] · x[t, :] + b13[i]`,
    /// `u = W13_e[I + i, :] · x[t, :] + b13[I + i]` (biases only when the
    /// layout has them), all f32.
    ///
    /// - `x`: bf16 `[n_tokens, H]`; `table`: u64 `[n_table]`; `ids`: u32
    ///   `[n_tokens*top_k]`; `act`: f32 `[n_tokens*top_k, I]`.
    /// - `slot_mask`: as [`Kernels::int4_w13_swiglu`]: a masked-out pair
    ///   reads neither `ids[p]` nor its table entry and leaves its row.
    /// - `after_tail_fetch`: as [`Kernels::int4_w13_swiglu`] (always a
    ///   programmatic dependent on sm_90+, waiting first unless it follows
    ///   [`Kernels::tail_fetch`]).
    ///
    /// `H <= 8192`, `I <= 4096`, `top_k <= 16`. A bad id or base gives NaN.
    #[allow(clippy::too_many_arguments)]
    pub fn mxfp4_w13_act(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<bf16>,
        table: &impl DevicePtr<u64>,
        ids: &impl DevicePtr<u32>,
        n_tokens: usize,
        top_k: usize,
        layout: &Mxfp4Layout,
        slot_mask: u32,
        after_tail_fetch: bool,
        activation: ExpertActivation,
        act: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.mxfp4_w13_act_form(
            stream,
            x,
            table,
            ids,
            n_tokens,
            top_k,
            layout,
            slot_mask,
            after_tail_fetch,
            activation,
            None,
            act,
        )
    }

    /// [`Kernels::mxfp4_w13_act`] with the NCL 3 form chosen by the caller:
    /// `staged` `Some(true)` takes the entry point that stages the weights in
    /// shared memory (refused where the layout is not NCL 3 or three blocks do
    /// not fit an SM), `Some(false)` the register form, `None` the wrapper's
    /// choice. Both forms compute the same bits; the kernel tests compare them.
    #[allow(clippy::too_many_arguments)]
    pub fn mxfp4_w13_act_form(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<bf16>,
        table: &impl DevicePtr<u64>,
        ids: &impl DevicePtr<u32>,
        n_tokens: usize,
        top_k: usize,
        layout: &Mxfp4Layout,
        slot_mask: u32,
        after_tail_fetch: bool,
        activation: ExpertActivation,
        staged: Option<bool>,
        act: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        const NAMES: [&str; 4] = [
            "mxfp4_w13_act_1",
            "mxfp4_w13_act_2",
            "mxfp4_w13_act_3",
            "mxfp4_w13_act_4",
        ];
        layout.common_decode_checks(NAMES[0], top_k)?;
        let (h, i) = (layout.hidden, layout.intermediate);
        // NCL = 128-K tiles per warp; <= 16 warps split K.
        let ng = h.div_ceil(128);
        let ncl = ng.div_ceil(8).min(4);
        let warps = ng.div_ceil(ncl) as u32;
        // NCL 3 stages each warp's weights in shared memory where three such
        // blocks fit an SM (`cuda/mxfp4.cu`, w13_act_body): gate/up x 3 tiles
        // x 2 row halves x 32 lanes x 16 bytes. The same bits either way.
        let stage_bytes = warps * (2 * 3 * 2 * 32 * 16);
        let fits = ncl == 3 && self.blocks_fit_sm("mxfp4_w13_act_3s", 3, stage_bytes)?;
        ensure("mxfp4_w13_act_3s", staged != Some(true) || fits, || {
            format!(
                "the staged form needs NCL 3 (H {h} gives {ncl}) and three blocks of {stage_bytes} \
                 bytes of shared memory per SM; use the register form"
            )
        })?;
        let staged = staged.unwrap_or(fits);
        let (k, smem) = if staged {
            ("mxfp4_w13_act_3s", stage_bytes)
        } else {
            (NAMES[ncl - 1], 0)
        };
        let (kind, limit, alpha) = activation.args(k)?;
        let n_pairs = n_tokens * top_k;
        check_len(k, "x", x.len(), n_tokens * h)?;
        check_len(k, "ids", ids.len(), n_pairs)?;
        check_len(k, "act", act.len(), n_pairs * i)?;
        let n_table = dim_u32(k, "n_table", table.len())?;
        let (np, kk, hh, ii) = (
            dim_u32(k, "n_pairs", n_pairs)?,
            top_k as u32,
            h as u32,
            i as u32,
        );
        let (oq, os, ob) = (
            layout.w13_q as u64,
            layout.w13_s as u64,
            layout.w13_b as u64,
        );
        let hb = u32::from(layout.has_bias);
        let (xp, _g1) = x.device_ptr(stream);
        let (tp, _g2) = table.device_ptr(stream);
        let (ip, _g3) = ids.device_ptr(stream);
        let (ap, _g4) = act.device_ptr_mut(stream);
        let f = self.func(k)?;
        if smem > 0 {
            self.allow_smem(k, f, smem)?;
        }
        // 16 gate + 16 up rows per block, K split over the warps; y = pair.
        let config = cfg((ii / 16, np, 1), 32 * warps, smem);
        // Wait for the grids before it first unless it follows the tail's
        // fetch (`cuda/int4.cu`, w13_swiglu).
        let wait_first = u32::from(!after_tail_fetch);
        let mut b = KArgs::new();
        b.arg(&xp).arg(&tp).arg(&n_table).arg(&ip).arg(&np).arg(&kk);
        b.arg(&hh).arg(&ii).arg(&oq).arg(&os).arg(&ob).arg(&hb);
        b.arg(&slot_mask).arg(&kind).arg(&limit).arg(&alpha);
        b.arg(&wait_first).arg(&ap);
        // SAFETY: the arguments match the kernel's parameter list in order
        // and type, and the buffer lengths were checked against the dims.
        unsafe { submit_pdl(k, stream, f, config, b, self.pdl()) }
    }

    /// Decode down GEMV fused with the weighted combine:
    /// `residual[t, n] += sum_j weights[p] * (W2_e[n, :] · act[p, :] + b2_e[n])`,
    /// `p = t*top_k + j`, `e = table[ids[p]]` (bias only when the layout has
    /// it); the sum over `j` is taken in f32 in `j` order and added once
    /// (deterministic). The contract of [`Kernels::int4_w2_combine`],
    /// including its programmatic dependent launch on sm_90+: `ids`,
    /// `table`, `weights` and the experts must not be written by the kernel
    /// launched right before this one.
    ///
    /// - `act`: f32 `[n_tokens*top_k, I]`; `weights`: f32 `[n_tokens*top_k]`;
    ///   `residual`: f32 `[n_tokens, H]`.
    ///
    /// `H <= 8192`, `I <= 4096`, `top_k <= 16`.
    #[allow(clippy::too_many_arguments)]
    pub fn mxfp4_w2_combine(
        &self,
        stream: &CudaStream,
        act: &impl DevicePtr<f32>,
        table: &impl DevicePtr<u64>,
        ids: &impl DevicePtr<u32>,
        weights: &impl DevicePtr<f32>,
        n_tokens: usize,
        top_k: usize,
        layout: &Mxfp4Layout,
        residual: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        const NAMES: [&str; 2] = ["mxfp4_w2_combine_2", "mxfp4_w2_combine_4"];
        const GPW: [usize; 2] = [2, 4];
        // 12 warps with 2-tile items: two blocks fit an SM (gpt-oss-20b: 62
        // KB of act and rings each, ~73 registers), so its 180 blocks per
        // token run in one wave instead of two; 24 warps a block (one per
        // SM) measured 22.1 -> 18.0 us at one token, 61.3 -> 50.4 at four
        // with 12 (kbench --mxfp4, H100, session 28).
        const MAX_WARPS: [usize; 2] = [12, 16];
        layout.common_decode_checks(NAMES[0], top_k)?;
        let (h, i) = (layout.hidden, layout.intermediate);
        let ng = i.div_ceil(128);
        // The smaller work item that keeps the block's items within 128.
        let v = usize::from(top_k * ng.div_ceil(GPW[0]) > W2_MAX_ITEMS);
        let k = NAMES[v];
        let items = top_k * ng.div_ceil(GPW[v]);
        ensure(k, items <= W2_MAX_ITEMS, || {
            format!("{items} work items exceed {W2_MAX_ITEMS}")
        })?;
        let f = self.func(k)?;
        // What a block may hold besides its static arrays (partials, table
        // entries, biases).
        let room = self.smem_optin().saturating_sub(self.static_smem(k)?) as usize;
        let plan = w2_plan(items, MAX_WARPS[v], GPW[v], ng, top_k, room);
        let Some(W2Plan { warps, jc, smem }) = plan else {
            return Err(shape_err(
                k,
                format!(
                    "one expert's staged activations ({} bytes) and a one-warp weight ring do \
                     not fit the {room} bytes of shared memory a block may use on this device",
                    ng * W2_SMEM_PER_TILE
                ),
            ));
        };
        let warps = warps as u32;
        let n_pairs = n_tokens * top_k;
        check_len(k, "act", act.len(), n_pairs * i)?;
        check_len(k, "ids", ids.len(), n_pairs)?;
        check_len(k, "weights", weights.len(), n_pairs)?;
        check_len(k, "residual", residual.len(), n_tokens * h)?;
        let n_table = dim_u32(k, "n_table", table.len())?;
        let (t, kk, hh, ii, jj) = (
            dim_u32(k, "n_tokens", n_tokens)?,
            top_k as u32,
            h as u32,
            i as u32,
            jc as u32,
        );
        let (oq, os, ob) = (layout.w2_q as u64, layout.w2_s as u64, layout.w2_b as u64);
        let hb = u32::from(layout.has_bias);
        // Past 48 KB of static (partials, table entries, biases) plus
        // dynamic shared memory a block must opt in; `allow_smem` reads the
        // kernel's own static size (a constant here went stale when the
        // entries and biases joined the partials).
        self.allow_smem(k, f, smem as u32)?;
        let (ap, _g1) = act.device_ptr(stream);
        let (tp, _g2) = table.device_ptr(stream);
        let (ip, _g3) = ids.device_ptr(stream);
        let (wp, _g4) = weights.device_ptr(stream);
        let (rp, _g5) = residual.device_ptr_mut(stream);
        // 16 output rows x all top_k experts per block; y = token.
        let config = cfg((hh / 16, t, 1), 32 * warps, smem as u32);
        if self.compute_capability().0 >= 9 {
            let mut args: [*mut c_void; 15] = [
                &ap as *const u64 as *mut c_void,
                &tp as *const u64 as *mut c_void,
                &n_table as *const u32 as *mut c_void,
                &ip as *const u64 as *mut c_void,
                &wp as *const u64 as *mut c_void,
                &t as *const u32 as *mut c_void,
                &kk as *const u32 as *mut c_void,
                &hh as *const u32 as *mut c_void,
                &ii as *const u32 as *mut c_void,
                &oq as *const u64 as *mut c_void,
                &os as *const u64 as *mut c_void,
                &ob as *const u64 as *mut c_void,
                &hb as *const u32 as *mut c_void,
                &jj as *const u32 as *mut c_void,
                &rp as *const u64 as *mut c_void,
            ];
            // SAFETY: the arguments match the kernel's parameter list in
            // order and type, point to locals that outlive the call, and
            // the buffer lengths were checked against the dims above.
            return unsafe { launch_dependent(k, stream, f, config, &mut args) };
        }
        let mut b = builder(stream, f);
        b.arg(&ap).arg(&tp).arg(&n_table).arg(&ip).arg(&wp).arg(&t);
        b.arg(&kk).arg(&hh).arg(&ii).arg(&oq).arg(&os).arg(&ob);
        b.arg(&hb).arg(&jj).arg(&rp);
        submit(k, b, config)
    }

    /// Dequantize `n` experts (`table[ids[x]]`, `x < n`) for prefill:
    /// `w13_out[x]` bf16 `[2I, H]`, `w2_out[x]` bf16 `[H, I]` (each value
    /// exact in f32, rounded once to bf16), and with biases `b13_out[x]`
    /// f32 `[2I]`, `b2_out[x]` f32 `[H]`. `biases` must be `Some` exactly
    /// when the layout has biases. A bad id gives NaN.
    #[allow(clippy::too_many_arguments)]
    pub fn mxfp4_dequant<B13: DevicePtrMut<f32>, B2: DevicePtrMut<f32>>(
        &self,
        stream: &CudaStream,
        table: &impl DevicePtr<u64>,
        ids: &impl DevicePtr<u32>,
        n: usize,
        layout: &Mxfp4Layout,
        w13_out: &mut impl DevicePtrMut<bf16>,
        w2_out: &mut impl DevicePtrMut<bf16>,
        biases: Option<(&mut B13, &mut B2)>,
    ) -> Result<()> {
        const K: &str = "mxfp4_dequant_bf16";
        layout.validate(K)?;
        let (h, i) = (layout.hidden, layout.intermediate);
        ensure(K, biases.is_some() == layout.has_bias, || {
            format!(
                "bias outputs given: {}, but the layout has biases: {}",
                biases.is_some(),
                layout.has_bias
            )
        })?;
        check_len(K, "ids", ids.len(), n)?;
        check_len(K, "w13_out", w13_out.len(), n * 2 * i * h)?;
        check_len(K, "w2_out", w2_out.len(), n * h * i)?;
        ensure(K, n <= 65535, || {
            format!("n = {n} experts exceeds 65535 per launch")
        })?;
        let n_table = dim_u32(K, "n_table", table.len())?;
        let threads = 3 * i * h / 32 + if layout.has_bias { 2 * i + h } else { 0 };
        let (hh, ii, nn) = (h as u32, i as u32, n as u32);
        let offs = layout.offsets().map(|o| o as u64);
        let hb = u32::from(layout.has_bias);
        let (tp, _g1) = table.device_ptr(stream);
        let (ip, _g2) = ids.device_ptr(stream);
        let (ap, _g3) = w13_out.device_ptr_mut(stream);
        let (bp, _g4) = w2_out.device_ptr_mut(stream);
        // Null bias pointers when absent: the kernel never reads them.
        let (b13p, b2p, _guards) = match biases {
            Some((b13, b2)) => {
                check_len(K, "b13_out", b13.len(), n * 2 * i)?;
                check_len(K, "b2_out", b2.len(), n * h)?;
                let (p13, g13) = b13.device_ptr_mut(stream);
                let (p2, g2) = b2.device_ptr_mut(stream);
                (p13, p2, Some((g13, g2)))
            }
            None => (0u64, 0u64, None),
        };
        let f = self.func(K)?;
        let mut b = builder(stream, f);
        b.arg(&tp).arg(&n_table).arg(&ip).arg(&nn).arg(&hh).arg(&ii);
        for o in &offs {
            b.arg(o);
        }
        b.arg(&hb).arg(&ap).arg(&bp).arg(&b13p).arg(&b2p);
        submit(
            K,
            b,
            cfg(
                (dim_u32(K, "blocks", threads.div_ceil(256))?, nn, 1),
                256,
                0,
            ),
        )
    }

    /// Prefill activation of one expert's gate/up GEMM output:
    /// `out[r, c] = bf16(activation(gu[r, c] + b13[c], gu[r, I + c] + b13[I + c]))`
    /// in f32 (bias terms only with `b13`).
    ///
    /// - `gate_up`: `[rows, 2I]` bf16 or f32; `b13`: f32 `[2I]` (one row of
    ///   [`Kernels::mxfp4_dequant`]'s `b13_out`); `out`: bf16 `[rows, I]`.
    #[allow(clippy::too_many_arguments)]
    pub fn bias_act_rows<T: Elem>(
        &self,
        stream: &CudaStream,
        gate_up: &impl DevicePtr<T>,
        b13: Option<&dyn DevicePtr<f32>>,
        rows: usize,
        inter: usize,
        activation: ExpertActivation,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        let k = by_elem::<T>("bias_act_rows_f32", "bias_act_rows_bf16");
        let (kind, limit, alpha) = activation.args(k)?;
        check_len(k, "gate_up", gate_up.len(), rows * 2 * inter)?;
        check_len(k, "out", out.len(), rows * inter)?;
        let (r, i) = (dim_u32(k, "rows", rows)?, dim_u32(k, "inter", inter)?);
        let f = self.func(k)?;
        let (gp, _g1) = gate_up.device_ptr(stream);
        let (op, _g2) = out.device_ptr_mut(stream);
        let (bp, hb, _g3) = match b13 {
            Some(b) => {
                check_len(k, "b13", b.len(), 2 * inter)?;
                let (p, g) = b.device_ptr(stream);
                (p, 1u32, Some(g))
            }
            None => (0u64, 0u32, None),
        };
        let mut b = builder(stream, f);
        b.arg(&gp).arg(&bp).arg(&hb).arg(&r).arg(&i);
        b.arg(&kind).arg(&limit).arg(&alpha).arg(&op);
        let blocks = (rows * inter).div_ceil(1024).clamp(1, 1 << 20) as u32;
        submit(k, b, cfg((blocks, 1, 1), 256, 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_down_gemv_fits_its_ring_and_activations_to_the_device() {
        // gpt-oss (I 2880: 23 tiles, 48 items of 2 tiles, top-4) on sm_90:
        // 12 warps, every expert staged at once, two blocks an SM.
        let sm90 = 232_448 - 9_344;
        let per_expert = 23 * W2_SMEM_PER_TILE;
        let p = w2_plan(48, 12, 2, 23, 4, sm90).unwrap();
        assert_eq!((p.warps, p.jc), (12, 4));
        assert_eq!(p.smem, 4 * per_expert + 12 * 2 * W2_RING_PER_TILE);
        assert!(2 * (p.smem + 9_344) <= 233_472, "two blocks per SM");
        // 24 warps where asked: the rings take 96 KB.
        let p = w2_plan(48, 24, 2, 23, 4, sm90).unwrap();
        assert_eq!((p.warps, p.jc), (24, 4));
        assert!(p.smem <= sm90);
        // A 99 KB device: the rings shrink to 12 warps, 3 experts a chunk.
        let sm89 = 101_376 - 9_344;
        let p = w2_plan(48, 24, 2, 23, 4, sm89).unwrap();
        assert_eq!((p.warps, p.jc), (12, 3));
        assert!(p.smem <= sm89);
        // Never more warps than items, and the act budget caps the chunk.
        let p = w2_plan(3, 24, 2, 1, 2, sm90).unwrap();
        assert_eq!((p.warps, p.jc), (3, 2));
        let p = w2_plan(128, 16, 4, 32, 16, sm90).unwrap();
        assert!(p.jc * 32 * W2_SMEM_PER_TILE <= W2_SMEM_BUDGET && p.smem <= sm90);
        // Nothing fits: refused, not launched.
        assert_eq!(w2_plan(48, 24, 2, 23, 4, 14_000), None);
    }

    #[test]
    fn layout_follows_the_v2_contract() {
        // gpt-oss-20b expert with biases.
        let l = Mxfp4Layout::new(2880, 2880, true).unwrap();
        assert_eq!(l.w13_q, 0);
        assert_eq!(l.w13_s, 2880 * 2880); // 2I * H/2 bytes, already 256-aligned
        assert_eq!(l.w13_b, l.w13_s + 2 * 2880 * 90);
        assert_eq!(l.w2_q, (l.w13_b + 2 * 2880 * 2).div_ceil(256) * 256);
        assert_eq!(l.w2_s, l.w2_q + 2880 * 2880 / 2);
        assert_eq!(l.w2_b, (l.w2_s + 2880 * 90).div_ceil(256) * 256);
        assert_eq!(l.used_bytes(), l.w2_b + 2880 * 2);
        for o in l.offsets() {
            assert_eq!(o % 256, 0);
        }
        assert!(l.validate("t").is_ok());
        // Without biases the b arrays are empty and w2_q follows w13_s.
        let n = Mxfp4Layout::new(2880, 2880, false).unwrap();
        assert_eq!(n.w2_q, n.w13_b);
        assert_eq!(n.used_bytes(), n.w2_s + 2880 * 90);
        assert!(Mxfp4Layout::new(2880, 100, false).is_none());
        assert!(Mxfp4Layout::new(0, 64, false).is_none());
    }

    #[test]
    fn layout_validation_refuses_bad_offsets() {
        let l = Mxfp4Layout::new(4096, 1408, true).unwrap();
        assert!(l.validate("t").is_ok());
        assert!(
            Mxfp4Layout {
                w2_q: l.w2_q + 8,
                ..l
            }
            .validate("t")
            .is_err(),
            "misaligned"
        );
        assert!(
            Mxfp4Layout {
                w13_b: l.w13_s + 16,
                ..l
            }
            .validate("t")
            .is_err(),
            "overlap"
        );
        assert!(
            Mxfp4Layout { hidden: 2000, ..l }.validate("t").is_err(),
            "not a multiple of 32"
        );
        // A zero-size bias array may sit anywhere.
        let n = Mxfp4Layout::new(4096, 1408, false).unwrap();
        assert!(Mxfp4Layout { w13_b: 8, ..n }.validate("t").is_ok());
    }

    #[test]
    fn clamped_swiglu_parameters_are_checked() {
        let bad = ExpertActivation::ClampedSwiglu {
            limit: f32::NAN,
            alpha: 1.0,
        };
        assert!(bad.args("t").is_err());
        assert_eq!(
            ExpertActivation::ClampedSwiglu {
                limit: 7.0,
                alpha: 1.702
            }
            .args("t")
            .unwrap(),
            (1, 7.0, 1.702)
        );
        assert_eq!(ExpertActivation::Swiglu.args("t").unwrap().0, 0);
    }

    /// Host model of the decode GEMVs' bit-level decode (`mx_factors` +
    /// `dqmx8` in cuda/mxfp4.cu, same constants): every code of a word,
    /// paired (j, j+4), times every non-NaN scale, must equal
    /// `E2M1[code] * 2^(s-127)` exactly. bf16 multiplies are modelled in
    /// f32 and rounded to bf16, which is exact here (the products have two
    /// significant bits), so this pins the shifts, masks and factors; the
    /// GPU tests pin the rest.
    #[test]
    fn decode_bit_trick_is_exact_for_every_code_and_scale() {
        use crate::reference::{E2M1, e8m0};
        let bf = |bits: u32| half::bf16::from_bits(bits as u16).to_f32();
        let mul = |a: f32, b: f32| half::bf16::from_f32(a * b).to_f32();
        for s in 0u32..=254 {
            let (f1, f2) = if s <= 128 {
                ((s + 126) << 7, 0x3F80u32)
            } else {
                (0x7F00, (s - 1) << 7)
            };
            // Every code in every nibble position, and mixed words (a bit
            // leaking between neighbours would show).
            let words = (0..16u32).map(|c| c * 0x1111_1111).chain([
                0x7654_3210,
                0xFEDC_BA98,
                0x08F1_E2D3,
                0xC4B5_A697,
            ]);
            for w in words {
                let mg = [w << 6, w << 2, w >> 2, w >> 6];
                for (j, m) in mg.iter().enumerate() {
                    let v = (m & 0x01C0_01C0) | ((w << (12 - 4 * j)) & 0x8000_8000);
                    for (half, code) in [(0, (w >> (4 * j)) & 15), (16, (w >> (4 * j + 16)) & 15)] {
                        let mut got = mul(bf((v >> half) & 0xFFFF), bf(f1));
                        if s > 128 {
                            got = mul(got, bf(f2));
                        }
                        let want = E2M1[code as usize] * e8m0(s as u8);
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "s {s}, word {w:#x}, pair {j}, code {code}"
                        );
                    }
                }
            }
        }
    }
}
