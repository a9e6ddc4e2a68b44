//! INT4 expert kernels over the expert-cache layout (`cuda/int4.cu`):
//! batched decode GEMVs through a device-side expert pointer table, and
//! dequantization for prefill GEMMs. The gate/up GEMV's input and the
//! dequantized weights are in the MLP block's 16-bit format (`Act16`: bf16,
//! or f16 for an FP16 MLP block, the `_f16` entry points).
//!
//! Expert format (cache format v2, precision "int4", group `g` in
//! {32, 64, 128}; `g = 128` is format v1): `w13_q` `[2I, H]` and `w2_q`
//! `[H, I]` nibble-packed row-major (element `k` of a row in byte `k/2`,
//! low nibble for even `k`), f16 scales `w13_s` `[2I, H/g]` and
//! `w2_s` `[H, I/g]`, value `(q - 8) * s`. `H` and `I` are multiples of `g`.
//!
//! The pointer table is a u64 `[n_table]` device array of expert-block base
//! addresses (e.g. one entry per expert of a layer, pointing into the cache
//! or a staging buffer); kernels read `table[ids[p]]`, so moving experts
//! only rewrites table entries, never the launch. Bases must be 16-byte
//! aligned (the cache aligns them to 4096). An id `>= n_table` or a
//! misaligned base makes that pair's output NaN rather than reading
//! arbitrary memory.

use std::ffi::c_void;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};

use crate::launch::{
    Act16, KArgs, builder, by_act, cfg, check_len, dim_u32, ensure, launch_dependent, submit,
    submit_pdl,
};
use crate::{Kernels, Result};

mod grouped;
mod grouped_sm90;
mod layout;

pub use grouped::{INT4_GROUPED_ROWS, int4_grouped_supports, int4_grouped_tiles};

use layout::W2_MAX_DYN_SMEM;
pub use layout::{
    INT4_DECODE_MAX_HIDDEN, INT4_DECODE_MAX_INTER, INT4_DECODE_MAX_TOPK, INT4_GROUPS, Int4Layout,
};

/// The g = 128 fast path (the code the a3b decode was tuned with) serves
/// H up to this and I up to `FAST_MAX_INTER`; past them, or for g < 128,
/// the general entry points run.
const FAST_MAX_HIDDEN: usize = 4096;
const FAST_MAX_INTER: usize = 2048;

impl Kernels {
    /// Decode gate/up GEMV with SwiGLU fused:
    /// for pair `p = t*top_k + j`, expert `e = table[ids[p]]`,
    /// `act[p, i] = silu(g) * u` with `g = W13_e[i, :] · x[t, :]`,
    /// `u = W13_e[I + i, :] · x[t, :]`, all f32.
    ///
    /// - `x`: `A` (bf16 or f16) `[n_tokens, H]` (normalized hidden state);
    ///   the dequantized weights meet it in the same format in the tensor
    ///   cores (both exact for the INT4 values `q - 8`), f32 accumulation.
    /// - `table`: u64 `[n_table]`; `ids`: u32 `[n_tokens*top_k]`.
    /// - `slot_mask`: pair `p` is computed only if bit `j = p % top_k` is
    ///   set. A masked-out pair reads neither `ids[p]` nor its table entry
    ///   (which may be null or garbage) and leaves its `act` row untouched.
    ///   `u32::MAX` computes every pair.
    /// - `after_tail_fetch`: the kernel launched right before this one on
    ///   `stream` is [`Kernels::tail_fetch`] (HCS decode). On sm_90+ this
    ///   one always launches as a programmatic dependent of the kernel
    ///   before it: after the fetch, pairs whose table entry is fresh wait
    ///   for the copy and the others are computed beside it; otherwise the
    ///   kernel waits for the grids before it first (its launch still
    ///   overlaps the previous kernel's tail).
    /// - `act`: f32 `[n_tokens*top_k, I]`.
    ///
    /// `H <= 8192` (Qwen3-30B-A3B 2048, gpt-oss 2880, Qwen3-235B 4096,
    /// GLM-4.5 5120, DeepSeek-V3 7168), any group of [`INT4_GROUPS`],
    /// `top_k <= 16`. `g = 128` with `H <= 4096` runs the fast path.
    #[allow(clippy::too_many_arguments)]
    pub fn int4_w13_swiglu<A: Act16>(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<A>,
        table: &impl DevicePtr<u64>,
        ids: &impl DevicePtr<u32>,
        n_tokens: usize,
        top_k: usize,
        layout: &Int4Layout,
        slot_mask: u32,
        after_tail_fetch: bool,
        act: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let rt = w13_row_tiles(layout, n_tokens);
        self.int4_w13_swiglu_tiled(
            stream,
            x,
            table,
            ids,
            n_tokens,
            top_k,
            layout,
            slot_mask,
            after_tail_fetch,
            rt,
            act,
        )
    }

    /// [`Kernels::int4_w13_swiglu`] with `row_tiles` 16-row tiles per
    /// block instead of the default choice (every choice gives the same
    /// bits). `row_tiles = 2` needs the fast path (`g = 128`) with
    /// `H <= 2048`.
    #[allow(clippy::too_many_arguments)]
    pub fn int4_w13_swiglu_tiled<A: Act16>(
        &self,
        stream: &CudaStream,
        x: &impl DevicePtr<A>,
        table: &impl DevicePtr<u64>,
        ids: &impl DevicePtr<u32>,
        n_tokens: usize,
        top_k: usize,
        layout: &Int4Layout,
        slot_mask: u32,
        after_tail_fetch: bool,
        row_tiles: usize,
        act: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        layout.check_w13("int4_w13_swiglu_1", top_k)?;
        let (h, i) = (layout.hidden, layout.intermediate);
        let (k, warps, general) = w13_entry(h, layout.group, A::F16);
        let r32 = w13_r32_entry(layout, A::F16);
        ensure(
            k,
            row_tiles == 1 || (row_tiles == 2 && r32.is_some()),
            || {
                format!(
                    "{row_tiles} row tiles per block: 1, or 2 with group 128 and H <= 2048 \
                 (H = {h}, I = {i}, group {})",
                    layout.group
                )
            },
        )?;
        let k = if row_tiles == 2 { r32.unwrap_or(k) } else { k };
        let warps = warps as u32;
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
        let (oq, os) = (layout.w13_q as u64, layout.w13_s as u64);
        let (xp, _g1) = x.device_ptr(stream);
        let (tp, _g2) = table.device_ptr(stream);
        let (ip, _g3) = ids.device_ptr(stream);
        let (ap, _g4) = act.device_ptr_mut(stream);
        let f = self.func(k)?;
        let gl = layout.gl();
        // 16 gate + 16 up rows per row tile, K split over the warps; y = pair.
        let config = cfg((ii / (16 * row_tiles as u32), np, 1), 32 * warps, 0);
        // Wait for the grids before it first unless it follows the tail's
        // fetch (`cuda/int4.cu`, w13_swiglu).
        let wait_first = u32::from(!after_tail_fetch);
        let mut b = KArgs::new();
        b.arg(&xp).arg(&tp).arg(&n_table).arg(&ip).arg(&np).arg(&kk);
        b.arg(&hh)
            .arg(&ii)
            .arg(&oq)
            .arg(&os)
            .arg(&slot_mask)
            .arg(&wait_first);
        if general {
            b.arg(&gl);
        }
        b.arg(&ap);
        // SAFETY: the arguments match the kernel's parameter list in order
        // and type, and the buffer lengths were checked against the dims.
        unsafe { submit_pdl(k, stream, f, config, b, self.pdl()) }
    }

    /// Decode down GEMV fused with the weighted combine:
    /// `residual[t, n] += sum_j weights[p] * (W2_e[n, :] · act[p, :])`,
    /// `p = t*top_k + j`, `e = table[ids[p]]`; the sum over `j` is taken in
    /// f32 in `j` order and added once (deterministic).
    ///
    /// - `act`: f32 `[n_tokens*top_k, I]` (from [`Kernels::int4_w13_swiglu`]).
    /// - `weights`: f32 `[n_tokens*top_k]` router weights.
    /// - `residual`: f32 `[n_tokens, H]`.
    ///
    /// `I <= 4096`, any group of [`INT4_GROUPS`], `top_k <= 16`. The block
    /// stages the token's `act` rows in `top_k * ceil(I/128) * 576` bytes of
    /// shared memory (27 KB for top-8, I 768; 207 KB for top-16, I 2880);
    /// past 44 KB it opts in to more, and past sm_90's 223 KiB (top-16 with
    /// I > 3072, top-8 is fine to 4096) the launch is refused.
    /// `g = 128` with `I <= 2048` runs the fast path.
    ///
    /// On sm_90+ this launches as a programmatic dependent of the previous
    /// kernel on `stream` (normally [`Kernels::int4_w13_swiglu`]): it may
    /// start while that kernel still runs and reads `ids`, `table`,
    /// `weights` and the expert weights at once, but `act` and `residual`
    /// only after that kernel has completed. So `ids`, `table`, `weights`
    /// and the experts must not be written by the kernel launched right
    /// before this one (a copy in between is fine: PDL applies only to a
    /// kernel directly after a kernel).
    #[allow(clippy::too_many_arguments)]
    pub fn int4_w2_combine(
        &self,
        stream: &CudaStream,
        act: &impl DevicePtr<f32>,
        table: &impl DevicePtr<u64>,
        ids: &impl DevicePtr<u32>,
        weights: &impl DevicePtr<f32>,
        n_tokens: usize,
        top_k: usize,
        layout: &Int4Layout,
        residual: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let tpb = w2_tokens_per_block(layout, n_tokens, top_k);
        self.int4_w2_combine_blocked(
            stream, act, table, ids, weights, n_tokens, top_k, layout, tpb, residual,
        )
    }

    /// [`Kernels::int4_w2_combine`] with `tpb` tokens per block instead of
    /// the default choice (every choice gives the same bits). `tpb > 1`
    /// needs `I <= 1024` and `tpb` tokens' act and partials in one block's
    /// shared memory.
    #[allow(clippy::too_many_arguments)]
    pub fn int4_w2_combine_blocked(
        &self,
        stream: &CudaStream,
        act: &impl DevicePtr<f32>,
        table: &impl DevicePtr<u64>,
        ids: &impl DevicePtr<u32>,
        weights: &impl DevicePtr<f32>,
        n_tokens: usize,
        top_k: usize,
        layout: &Int4Layout,
        tpb: usize,
        residual: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let per_token = layout.check_w2("int4_w2_combine_1", top_k)?;
        let (h, i) = (layout.hidden, layout.intermediate);
        let (single, _, max_warps, general) = w2_entry(i, layout.group);
        let items = w2_items(i, layout.group, top_k);
        let multi = w2_multi_entry(i, layout.group);
        let k = if tpb > 1 {
            multi.unwrap_or(single)
        } else {
            single
        };
        let smem = w2_block_smem(per_token, items, tpb);
        ensure(
            k,
            (1..=W2_MAX_TOKENS_PER_BLOCK).contains(&tpb)
                && (tpb == 1 || (multi.is_some() && smem <= W2_MAX_DYN_SMEM)),
            || {
                format!(
                    "{tpb} tokens per block: 1..={W2_MAX_TOKENS_PER_BLOCK}, more than one needs I <= 1024 (I = {i}) and {smem} bytes of shared memory within {W2_MAX_DYN_SMEM}"
                )
            },
        )?;
        let warps = items.min(max_warps) as u32;
        let n_pairs = n_tokens * top_k;
        check_len(k, "act", act.len(), n_pairs * i)?;
        check_len(k, "ids", ids.len(), n_pairs)?;
        check_len(k, "weights", weights.len(), n_pairs)?;
        check_len(k, "residual", residual.len(), n_tokens * h)?;
        let n_table = dim_u32(k, "n_table", table.len())?;
        let (t, kk, hh, ii) = (
            dim_u32(k, "n_tokens", n_tokens)?,
            top_k as u32,
            h as u32,
            i as u32,
        );
        let blocks_y = dim_u32(k, "blocks", n_tokens.div_ceil(tpb))?;
        let (oq, os, gl) = (layout.w2_q as u64, layout.w2_s as u64, layout.gl());
        let tpb32 = tpb as u32;
        let f = self.func(k)?;
        if smem > 44 * 1024 {
            use cudarc::driver::sys::CUfunction_attribute_enum as A;
            f.set_attribute(
                A::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(crate::KernelError::driver(format!(
                "`{k}`: {smem} bytes of shared memory"
            )))?;
        }
        let (ap, _g1) = act.device_ptr(stream);
        let (tp, _g2) = table.device_ptr(stream);
        let (ip, _g3) = ids.device_ptr(stream);
        let (wp, _g4) = weights.device_ptr(stream);
        let (rp, _g5) = residual.device_ptr_mut(stream);
        // 16 output rows x all top_k experts of tpb tokens per block.
        let config = cfg((hh / 16, blocks_y, 1), 32 * warps, smem as u32);
        let takes_gl = general || tpb > 1;
        if self.compute_capability().0 >= 9 {
            let mut args: Vec<*mut c_void> = vec![
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
            ];
            if takes_gl {
                args.push(&gl as *const u32 as *mut c_void);
            }
            if tpb > 1 {
                args.push(&tpb32 as *const u32 as *mut c_void);
            }
            args.push(&rp as *const u64 as *mut c_void);
            // SAFETY: the arguments match the kernel's parameter list in
            // order and type, point to locals that outlive the call, and
            // the buffer lengths were checked against the dims above.
            return unsafe { launch_dependent(k, stream, f, config, &mut args) };
        }
        let mut b = builder(stream, f);
        b.arg(&ap)
            .arg(&tp)
            .arg(&n_table)
            .arg(&ip)
            .arg(&wp)
            .arg(&t)
            .arg(&kk);
        b.arg(&hh).arg(&ii).arg(&oq).arg(&os);
        if takes_gl {
            b.arg(&gl);
        }
        if tpb > 1 {
            b.arg(&tpb32);
        }
        b.arg(&rp);
        submit(k, b, config)
    }

    /// Dequantize `n` experts (`table[ids[x]]`, `x < n`) to `A` (bf16 or
    /// f16): `w13_out[x]` = `[2I, H]`, `w2_out[x]` = `[H, I]`, both
    /// row-major (`(q - 8) * s` is exact in f32 and rounded once to `A`;
    /// in f16 a product past ±65504 becomes infinite).
    ///
    /// - `ids`: u32 `[n]`; `w13_out`: `[n, 2I, H]`; `w2_out`: `[n, H, I]`.
    #[allow(clippy::too_many_arguments)]
    pub fn int4_dequant<A: Act16>(
        &self,
        stream: &CudaStream,
        table: &impl DevicePtr<u64>,
        ids: &impl DevicePtr<u32>,
        n: usize,
        layout: &Int4Layout,
        w13_out: &mut impl DevicePtrMut<A>,
        w2_out: &mut impl DevicePtrMut<A>,
    ) -> Result<()> {
        let k = by_act::<A>("int4_dequant_bf16", "int4_dequant_f16");
        layout.validate(k)?;
        let (h, i) = (layout.hidden, layout.intermediate);
        check_len(k, "ids", ids.len(), n)?;
        check_len(k, "w13_out", w13_out.len(), n * 2 * i * h)?;
        check_len(k, "w2_out", w2_out.len(), n * h * i)?;
        ensure(k, n <= 65535, || {
            format!("n = {n} experts exceeds 65535 per launch")
        })?;
        let n_table = dim_u32(k, "n_table", table.len())?;
        let chunks = 3 * i * h / 32;
        let (hh, ii, nn, gl) = (h as u32, i as u32, n as u32, layout.gl());
        let offs = [
            layout.w13_q as u64,
            layout.w13_s as u64,
            layout.w2_q as u64,
            layout.w2_s as u64,
        ];
        let (tp, _g1) = table.device_ptr(stream);
        let (ip, _g2) = ids.device_ptr(stream);
        let (ap, _g3) = w13_out.device_ptr_mut(stream);
        let (bp, _g4) = w2_out.device_ptr_mut(stream);
        let f = self.func(k)?;
        let mut b = builder(stream, f);
        b.arg(&tp)
            .arg(&n_table)
            .arg(&ip)
            .arg(&nn)
            .arg(&hh)
            .arg(&ii)
            .arg(&gl);
        b.arg(&offs[0])
            .arg(&offs[1])
            .arg(&offs[2])
            .arg(&offs[3])
            .arg(&ap)
            .arg(&bp);
        submit(
            k,
            b,
            cfg((dim_u32(k, "blocks", chunks.div_ceil(256))?, nn, 1), 256, 0),
        )
    }
}

/// The w13 entry point for hidden `h`, group `g` and an f16 (else bf16)
/// `x`: (name, warps per block, whether it takes `gl`). K runs in
/// 128-wide tiles (the last one partial when `g < 128` and 128 does not
/// divide `h`), `NCL` tiles per warp.
fn w13_entry(h: usize, g: usize, f16: bool) -> (&'static str, usize, bool) {
    const FAST: [[&str; 4]; 2] = [
        [
            "int4_w13_swiglu_1",
            "int4_w13_swiglu_2",
            "int4_w13_swiglu_3",
            "int4_w13_swiglu_4",
        ],
        [
            "int4_w13_swiglu_1_f16",
            "int4_w13_swiglu_2_f16",
            "int4_w13_swiglu_3_f16",
            "int4_w13_swiglu_4_f16",
        ],
    ];
    const GEN8: [[&str; 4]; 2] = [
        [
            "int4_w13_swiglu_g1",
            "int4_w13_swiglu_g2",
            "int4_w13_swiglu_g3",
            "int4_w13_swiglu_g4",
        ],
        [
            "int4_w13_swiglu_g1_f16",
            "int4_w13_swiglu_g2_f16",
            "int4_w13_swiglu_g3_f16",
            "int4_w13_swiglu_g4_f16",
        ],
    ];
    const GEN16: [[&str; 2]; 2] = [
        ["int4_w13_swiglu_w16_3", "int4_w13_swiglu_w16_4"],
        ["int4_w13_swiglu_w16_3_f16", "int4_w13_swiglu_w16_4_f16"],
    ];
    let f = usize::from(f16);
    let tiles = h.div_ceil(128);
    if h <= FAST_MAX_HIDDEN {
        // <= 8 warps; for g = 128 this is today's NCL = ceil(H / 1024).
        let ncl = tiles.div_ceil(8);
        let name = if g == 128 {
            FAST[f][ncl - 1]
        } else {
            GEN8[f][ncl - 1]
        };
        (name, tiles.div_ceil(ncl), g != 128)
    } else {
        // <= 16 warps keep NCL at 3 or 4 (the registers of the 8-warp ones).
        let ncl = tiles.div_ceil(16);
        (GEN16[f][ncl - 3], tiles.div_ceil(ncl), true)
    }
}

/// The two-row-tile w13 entry point for `layout`, where there is one:
/// the fast path (g = 128, so 32 divides I) with NCL <= 2 (H <= 2048).
fn w13_r32_entry(layout: &Int4Layout, f16: bool) -> Option<&'static str> {
    const R32: [[&str; 2]; 2] = [
        ["int4_w13_swiglu_1_r32", "int4_w13_swiglu_2_r32"],
        ["int4_w13_swiglu_1_r32_f16", "int4_w13_swiglu_2_r32_f16"],
    ];
    let h = layout.hidden;
    let ncl = h.div_ceil(128).div_ceil(8);
    (layout.group == 128 && h <= 2048).then(|| R32[usize::from(f16)][ncl - 1])
}

/// Row tiles per w13 block for `n_tokens` rows: one token keeps 16 rows
/// per block (one wave of small blocks: it is latency bound); several
/// tokens take 32 where the layout allows, so each block's fixed work
/// (the pair's lookup, x staging, the reduction) serves twice the
/// weights (at M rows the kernel is issue bound: session 20).
pub fn w13_row_tiles(layout: &Int4Layout, n_tokens: usize) -> usize {
    if n_tokens >= 2 && w13_r32_entry(layout, false).is_some() {
        2
    } else {
        1
    }
}

/// The w2 entry point for width `i` and group `g`: (name, tiles per work
/// item, most warps per block, whether it takes `gl`). Tiles per item grow
/// with `I` so a block never has more than 64 items (top_k 16 x 4 parts).
fn w2_entry(i: usize, g: usize) -> (&'static str, usize, usize, bool) {
    const FAST: [&str; 2] = ["int4_w2_combine_1", "int4_w2_combine_2"];
    const GEN: [&str; 3] = [
        "int4_w2_combine_g1",
        "int4_w2_combine_g2",
        "int4_w2_combine_g3",
    ];
    const GPW: [usize; 3] = [2, 4, 8];
    const MAX_WARPS: [usize; 3] = [24, 16, 16];
    let tiles = i.div_ceil(128);
    let v = match tiles {
        0..=8 => 0,
        9..=16 => 1,
        _ => 2,
    };
    let fast = g == 128 && i <= FAST_MAX_INTER;
    let name = if fast { FAST[v] } else { GEN[v] };
    (name, GPW[v], MAX_WARPS[v], !fast)
}

/// The several-tokens-per-block w2 entry point, where there is one: I up
/// to 1024 (2-tile work items; wider items with two register sets leave
/// one block per SM and measured slower, see `int4.cu`).
fn w2_multi_entry(i: usize, g: usize) -> Option<&'static str> {
    (i.div_ceil(128) <= 8).then_some(if g == 128 {
        "int4_w2_combine_1_mt"
    } else {
        "int4_w2_combine_g1_mt"
    })
}

/// Most tokens per w2 block (the kernel's item digits and its table of
/// `tokens x top_k` expert bases are sized for it).
const W2_MAX_TOKENS_PER_BLOCK: usize = 4;

/// Tokens per w2 block for `n_tokens` rows: up to min(rows, 4), as many
/// as one block's shared memory holds.
pub fn w2_tokens_per_block(layout: &Int4Layout, n_tokens: usize, top_k: usize) -> usize {
    let i = layout.intermediate;
    if n_tokens < 2 || w2_multi_entry(i, layout.group).is_none() {
        return 1;
    }
    let Ok(per_token) = layout.check_w2("int4_w2_combine", top_k) else {
        return 1;
    };
    let items = w2_items(i, layout.group, top_k);
    let mut t = n_tokens.min(W2_MAX_TOKENS_PER_BLOCK);
    while t > 1 && w2_block_smem(per_token, items, t) > W2_MAX_DYN_SMEM {
        t -= 1;
    }
    t
}

/// Work items (expert, K-part) of one token in a w2 block.
fn w2_items(i: usize, g: usize, top_k: usize) -> usize {
    let (_, gpw, _, _) = w2_entry(i, g);
    top_k * i.div_ceil(128).div_ceil(gpw)
}

/// Dynamic shared memory of a w2 block of `tpb` tokens: each token's
/// staged act (`per_token`) and, with several tokens, their partials
/// (16 f32 rows per work item; one token keeps them in static memory).
fn w2_block_smem(per_token: usize, items: usize, tpb: usize) -> usize {
    if tpb > 1 {
        tpb * (per_token + items * 16 * 4)
    } else {
        per_token
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batched_block_shapes_stay_within_their_entry_points() {
        let a3b = Int4Layout::new(2048, 768, 128).unwrap();
        let glm = Int4Layout::new(4096, 1408, 128).unwrap();
        let oss = Int4Layout::new(2880, 2880, 32).unwrap();
        // One row: the one-token grid, always.
        for l in [&a3b, &glm, &oss] {
            assert_eq!(w2_tokens_per_block(l, 1, 8), 1);
        }
        // w13: 16 rows per block for one token; 32 for several where the
        // fast path has NCL <= 2 (H <= 2048) and 32 divides I.
        for l in [&a3b, &glm, &oss] {
            assert_eq!(w13_row_tiles(l, 1), 1);
        }
        assert_eq!(w13_row_tiles(&a3b, 2), 2);
        assert_eq!(w13_row_tiles(&a3b, 8), 2);
        assert_eq!(w13_row_tiles(&glm, 4), 1);
        assert_eq!(w13_row_tiles(&oss, 4), 1);
        assert_eq!(w13_r32_entry(&a3b, true), Some("int4_w13_swiglu_2_r32_f16"));
        let small = Int4Layout::new(1024, 512, 128).unwrap();
        assert_eq!(w13_r32_entry(&small, false), Some("int4_w13_swiglu_1_r32"));
        for f16 in [false, true] {
            for l in [&a3b, &small] {
                let name = w13_r32_entry(l, f16).unwrap();
                assert!(
                    crate::sources::MODULES
                        .iter()
                        .any(|m| m.kernels.contains(&name)),
                    "{name} not in sources"
                );
            }
        }
        // Up to 4 tokens per block within shared memory, only for I <= 1024.
        assert_eq!(w2_tokens_per_block(&a3b, 8, 8), 4);
        assert_eq!(w2_tokens_per_block(&a3b, 3, 8), 3);
        assert_eq!(w2_tokens_per_block(&glm, 8, 8), 1);
        assert_eq!(w2_tokens_per_block(&oss, 8, 4), 1);
        let wide = Int4Layout::new(2048, 1024, 32).unwrap();
        let t = w2_tokens_per_block(&wide, 8, 16);
        assert!((2..=4).contains(&t));
        let (_, gpw, _, _) = w2_entry(1024, 32);
        let items = 16 * 8usize.div_ceil(gpw);
        assert!(t * (wide.check_w2("t", 16).unwrap() + items * 64) <= W2_MAX_DYN_SMEM);
        // Every several-tokens entry point is compiled.
        for i in [128usize, 768, 1024] {
            for g in INT4_GROUPS {
                let name = w2_multi_entry(i, g).unwrap();
                assert!(
                    crate::sources::MODULES
                        .iter()
                        .any(|m| m.kernels.contains(&name)),
                    "{name} not in sources"
                );
            }
        }
        assert_eq!(w2_multi_entry(1152, 128), None);
    }

    #[test]
    fn entry_points_keep_the_fast_path_and_cover_every_family() {
        // g = 128 within today's limits: exactly today's choice.
        assert_eq!(w13_entry(2048, 128, false), ("int4_w13_swiglu_2", 8, false));
        assert_eq!(w13_entry(4096, 128, false), ("int4_w13_swiglu_4", 8, false));
        assert_eq!(w13_entry(640, 128, false), ("int4_w13_swiglu_1", 5, false));
        assert_eq!(w2_entry(768, 128), ("int4_w2_combine_1", 2, 24, false));
        assert_eq!(w2_entry(2048, 128), ("int4_w2_combine_2", 4, 16, false));
        // Smaller groups, partial tiles, wider shapes: the general ones.
        assert_eq!(w13_entry(2048, 64, false), ("int4_w13_swiglu_g2", 8, true));
        assert_eq!(w13_entry(2880, 32, false), ("int4_w13_swiglu_g3", 8, true));
        assert_eq!(
            w13_entry(5120, 128, false),
            ("int4_w13_swiglu_w16_3", 14, true)
        );
        assert_eq!(
            w13_entry(7168, 128, false),
            ("int4_w13_swiglu_w16_4", 14, true)
        );
        assert_eq!(
            w13_entry(8192, 32, false),
            ("int4_w13_swiglu_w16_4", 16, true)
        );
        assert_eq!(w2_entry(1408, 64), ("int4_w2_combine_g2", 4, 16, true));
        assert_eq!(w2_entry(2880, 32), ("int4_w2_combine_g3", 8, 16, true));
        assert_eq!(w2_entry(4096, 128), ("int4_w2_combine_g3", 8, 16, true));
        // Every (H, g) / (I, g) in range has an entry whose warps cover
        // every tile, at most 4 tiles per warp, and at most 64 w2 items.
        for g in INT4_GROUPS {
            for h in (g..=INT4_DECODE_MAX_HIDDEN).step_by(g) {
                let (_, warps, _) = w13_entry(h, g, false);
                // The f16 entry is the bf16 one's twin.
                let (bf, f16) = (w13_entry(h, g, false), w13_entry(h, g, true));
                let name = f16.0;
                assert_eq!(
                    (name.to_string(), f16.1, f16.2),
                    (format!("{}_f16", bf.0), bf.1, bf.2),
                    "H {h} g {g}"
                );
                assert!(
                    crate::sources::MODULES
                        .iter()
                        .any(|m| m.kernels.contains(&name)),
                    "{name} not in sources"
                );
                let ncl = h.div_ceil(128).div_ceil(warps);
                assert!(warps <= 16 && ncl <= 4, "H {h} g {g}");
            }
            for i in (g..=INT4_DECODE_MAX_INTER).step_by(g) {
                let (_, gpw, _, _) = w2_entry(i, g);
                assert!(16 * i.div_ceil(128).div_ceil(gpw) <= 64, "I {i} g {g}");
            }
        }
    }
}
