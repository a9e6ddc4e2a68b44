//! gpt-oss attention: learned per-head sinks and sliding windows over a
//! ring-indexed KV cache (the `*_ring` entry points of
//! `cuda/attention_*.cu` and `cuda/kv_cache.cu`).
//!
//! The contract, shared by the kernels, these wrappers and the CPU
//! reference (`reference::attention_ring`):
//! - Ring cache: a sequence's rows start at row `b` of the usual
//!   `[n_kv_heads][capacity][head_dim]` buffers (its [`KvBase`]) and hold a
//!   ring of `ring` rows: key position `p` lives in row `b + p % ring`. A
//!   sliding layer keeps only [`ring_min_capacity`] rows (or more) per
//!   sequence; `ring == 0` is the linear layout (row `b + p`), a full
//!   layer's, which still needs these kernels for its sinks. Continuous
//!   batching gives each running sequence its own ring (`b` = its slot x
//!   `ring`), and a row of a launch reads only its own sequence's rows, so
//!   its result does not depend on the others.
//! - Window (`window > 0`): the query at `pos` sees keys `j` with
//!   `0 <= pos - j < window`; `window == 0` is plain causal attention.
//! - Sinks: one logit per q head (in the units of the scaled scores
//!   `q·k * scale`) joins each row's softmax and its probability is dropped.
//!
//! A prefill chunk appends its `n` keys first ([`Kernels::kv_append_ring`])
//! and then attends, so the oldest key its first query needs is `n - 1`
//! positions older than the newest key written: every query's window is in
//! the ring iff `ring >= window + n - 1`. The wrappers refuse launches
//! that break this, and rings that leave the buffers.
//!
//! Separate entry points (not runtime flags in the plain kernels) keep the
//! qwen3 path's generated code unchanged.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

use super::{PREFILL_BLOCK_M, PrefillArgs, PrefillMma, check_decode, log2_scale};
use crate::launch::{
    Act16, KArgs, builder, by_act, cfg, check_len, dim_u32, ensure, shape_err, submit, submit_pdl,
};
use crate::ops::rope::{KvBase, KvGeom, QkvGeom, StartPos, kv_rows_ptr};
use crate::{Kernels, Result};

/// The attention of one gpt-oss layer. `Default` is plain causal attention
/// without sinks (over a ring cache; with capacity >= context that is the
/// linear cache).
#[derive(Debug, Clone, Copy, Default)]
pub struct RingAttn<'a> {
    /// f32 `[n_q_heads]`: each head's sink logit, or `None` for no sinks.
    pub sinks: Option<&'a CudaSlice<f32>>,
    /// Keys a query sees, itself included; 0 for full causal attention.
    pub window: usize,
    /// Rows of one sequence's ring (key position `p` in row `base + p %
    /// ring`); 0: linear rows from the sequence's base (a full layer).
    pub ring: usize,
}

/// Fewest ring rows a sliding layer with `window` needs when prefill chunks
/// hold up to `max_chunk` tokens (decode is a chunk of 1): the chunk's keys
/// are appended before its first query attends to `window - 1` older ones.
/// The engine may round it up (any capacity at least this works).
pub fn ring_min_capacity(window: usize, max_chunk: usize) -> usize {
    window + max_chunk.max(1) - 1
}

/// Fails unless a chunk of `n_tokens` queries with `window > 0` finds its
/// whole window in a ring of `capacity` rows.
pub(super) fn check_window_fits(
    k: &'static str,
    window: usize,
    n_tokens: usize,
    capacity: usize,
) -> Result<()> {
    let need = ring_min_capacity(window, n_tokens);
    ensure(k, capacity >= need, || {
        format!(
            "a ring KV cache of {capacity} rows cannot hold the {window}-key window of a \
             {n_tokens}-token chunk: it needs window + n_tokens - 1 = {need} rows"
        )
    })
}

/// Mirrors `attn_prefill_mma_ring_d*` in `cuda/attention_prefill.cu`; other
/// head dims run `attn_prefill_simt_ring`.
const PREFILL_MMA_RING: &[PrefillMma] = &[
    PrefillMma {
        head_dim: 64,
        name: "attn_prefill_mma_ring_d64",
        name_f16: "attn_prefill_mma_ring_d64_f16",
        block_n: 64,
        q_in_smem: false,
    },
    PrefillMma {
        head_dim: 128,
        name: "attn_prefill_mma_ring_d128",
        name_f16: "attn_prefill_mma_ring_d128_f16",
        block_n: 64,
        q_in_smem: false,
    },
];

impl RingAttn<'_> {
    fn check_sinks(&self, k: &'static str, n_q_heads: usize) -> Result<()> {
        if let Some(s) = self.sinks {
            check_len(k, "sinks", s.len(), n_q_heads)?;
        }
        Ok(())
    }

    fn window_u32(&self, k: &'static str) -> Result<u32> {
        dim_u32(k, "window", self.window)
    }
}

/// Fails unless the rows a launch of `n_tokens` at `start` touches are in
/// a buffer of `capacity` rows: a ring's `ring` rows from a host base, or
/// (ring 0) the linear rows as [`KvBase::check`] has them. A device base
/// is checked for its length (one per token) and read by the kernels,
/// which skip a row past the capacity.
fn check_rows(
    k: &'static str,
    base: &KvBase<'_>,
    start: &StartPos<'_>,
    n_tokens: usize,
    ring: usize,
    capacity: usize,
) -> Result<()> {
    match (ring, base) {
        (0, _) | (_, KvBase::Device(_)) => base.check(k, start, n_tokens, capacity),
        (r, KvBase::Host(b)) => ensure(k, b + r <= capacity, || {
            format!("a ring of {r} rows at KV row {b} exceeds the KV capacity {capacity}")
        }),
    }
}

impl Kernels {
    /// [`Kernels::kv_append`] into ring caches: token `t` at position `p`
    /// goes to row `b + p % ring` of its sequence's rows (`base`: the
    /// launch's, or one per decode row), `b + p` with `ring == 0`. Any
    /// position is valid in a ring; a chunk may not be longer than the ring
    /// (it would overwrite its own keys).
    #[allow(clippy::too_many_arguments)]
    pub fn kv_append_ring<A: Act16>(
        &self,
        stream: &CudaStream,
        qkv: &impl DevicePtr<A>,
        geom: QkvGeom,
        start: StartPos<'_>,
        kv: KvGeom,
        base: KvBase<'_>,
        ring: usize,
        k_cache: &mut impl DevicePtrMut<A>,
        v_cache: &mut impl DevicePtrMut<A>,
    ) -> Result<()> {
        // Copies 16-bit patterns: one entry point for both formats.
        const K: &str = "kv_append_ring_bf16";
        geom.validate(K)?;
        kv.validate(K, &geom)?;
        check_len(K, "qkv", qkv.len(), geom.len())?;
        check_len(K, "k_cache", k_cache.len(), kv.len())?;
        check_len(K, "v_cache", v_cache.len(), kv.len())?;
        ensure(K, ring == 0 || geom.n_tokens <= ring, || {
            format!(
                "a chunk of {} tokens would overwrite its own keys in a ring of {ring} rows",
                geom.n_tokens
            )
        })?;
        start.check(K, geom.n_tokens)?;
        check_rows(K, &base, &start, geom.n_tokens, ring, kv.capacity)?;
        let (t, nq, nkv, d, cap, ring) = (
            dim_u32(K, "n_tokens", geom.n_tokens)?,
            geom.n_q_heads as u32,
            geom.n_kv_heads as u32,
            geom.head_dim as u32,
            dim_u32(K, "capacity", kv.capacity)?,
            dim_u32(K, "ring", ring)?,
        );
        let f = self.func(K)?;
        let (pos_ptr, pos_base, _gp) = start.kernel_args(stream);
        let (base_ptr, base_rows, _gb) = base.kernel_args(stream);
        let (qp, _g1) = qkv.device_ptr(stream);
        let (kp, _g2) = k_cache.device_ptr_mut(stream);
        let (vp, _g3) = v_cache.device_ptr_mut(stream);
        let (kp, vp) = (
            kv_rows_ptr(kp, base_rows, geom.head_dim),
            kv_rows_ptr(vp, base_rows, geom.head_dim),
        );
        let mut b = KArgs::new();
        b.arg(&qp).arg(&kp).arg(&vp).arg(&pos_ptr).arg(&pos_base);
        b.arg(&base_ptr);
        b.arg(&t).arg(&nq).arg(&nkv).arg(&d).arg(&cap).arg(&ring);
        // SAFETY: the arguments match the kernel's parameters in order and
        // type; the kernel waits for the grid before it (pdl_wait) first.
        unsafe { submit_pdl(K, stream, f, cfg((t, nkv, 1), 64, 0), b, self.pdl()) }
    }

    /// [`Kernels::attention_prefill`] for a gpt-oss layer (module docs):
    /// query `t` at `start_pos + t` attends the keys of its window (all
    /// `0..=start_pos + t` with `window == 0`) read from the ring rows of
    /// the sequence whose rows start at `base`, with the head's sink in its
    /// softmax. The chunk's keys must already be appended
    /// ([`Kernels::kv_append_ring`]). `window > 0` needs `attn.ring >=
    /// window + n_tokens - 1`; `window == 0` needs `start_pos + n_tokens`
    /// rows (of the ring, or from `base` with ring 0). Head dims 64 and 128
    /// use tensor cores; others [`Kernels::attention_prefill_simt_ring`].
    #[allow(clippy::too_many_arguments)]
    pub fn attention_prefill_ring<A: Act16>(
        &self,
        stream: &CudaStream,
        qkv: &impl DevicePtr<A>,
        geom: QkvGeom,
        start_pos: usize,
        kv: KvGeom,
        base: usize,
        k_cache: &impl DevicePtr<A>,
        v_cache: &impl DevicePtr<A>,
        scale: f32,
        attn: RingAttn<'_>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        let Some(mma) = PREFILL_MMA_RING
            .iter()
            .find(|m| m.head_dim == geom.head_dim)
        else {
            return self.attention_prefill_simt_ring(
                stream, qkv, geom, start_pos, kv, base, k_cache, v_cache, scale, attn, out,
            );
        };
        let kn = mma.entry::<A>();
        let args = PrefillArgs::check(
            kn,
            qkv,
            geom,
            start_pos,
            kv,
            base,
            k_cache,
            v_cache,
            out,
            Some((attn.window, attn.ring)),
        )?;
        attn.check_sinks(kn, geom.n_q_heads)?;
        let window = attn.window_u32(kn)?;
        let ring = dim_u32(kn, "ring", attn.ring)?;
        let f = self.func(kn)?;
        let smem = mma.smem_bytes();
        self.allow_smem(kn, f, smem)?;
        let (qp, _g1) = qkv.device_ptr(stream);
        let (kp, _g2) = k_cache.device_ptr(stream);
        let (vp, _g3) = v_cache.device_ptr(stream);
        let (kp, vp) = (
            kv_rows_ptr(kp, base, geom.head_dim),
            kv_rows_ptr(vp, base, geom.head_dim),
        );
        let (op, _g4) = out.device_ptr_mut(stream);
        let (sp, _g5) = sinks_ptr(attn.sinks, stream);
        let sl2 = log2_scale(scale);
        let mut b = builder(stream, f);
        b.arg(&qp).arg(&kp).arg(&vp).arg(&op);
        b.arg(&args.t)
            .arg(&args.start)
            .arg(&args.nq)
            .arg(&args.nkv)
            .arg(&args.cap)
            .arg(&sl2)
            .arg(&sp)
            .arg(&window)
            .arg(&ring);
        let m_tiles = geom.n_tokens.div_ceil(PREFILL_BLOCK_M) as u32;
        submit(kn, b, cfg((m_tiles, args.nq, 1), 128, smem))
    }

    /// SIMT version of [`Kernels::attention_prefill_ring`] (any supported
    /// head dim); a second implementation for the tests.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_prefill_simt_ring<A: Act16>(
        &self,
        stream: &CudaStream,
        qkv: &impl DevicePtr<A>,
        geom: QkvGeom,
        start_pos: usize,
        kv: KvGeom,
        base: usize,
        k_cache: &impl DevicePtr<A>,
        v_cache: &impl DevicePtr<A>,
        scale: f32,
        attn: RingAttn<'_>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        let kn = by_act::<A>("attn_prefill_simt_ring", "attn_prefill_simt_ring_f16");
        let args = PrefillArgs::check(
            kn,
            qkv,
            geom,
            start_pos,
            kv,
            base,
            k_cache,
            v_cache,
            out,
            Some((attn.window, attn.ring)),
        )?;
        attn.check_sinks(kn, geom.n_q_heads)?;
        let window = attn.window_u32(kn)?;
        let ring = dim_u32(kn, "ring", attn.ring)?;
        let f = self.func(kn)?;
        let (qp, _g1) = qkv.device_ptr(stream);
        let (kp, _g2) = k_cache.device_ptr(stream);
        let (vp, _g3) = v_cache.device_ptr(stream);
        let (kp, vp) = (
            kv_rows_ptr(kp, base, geom.head_dim),
            kv_rows_ptr(vp, base, geom.head_dim),
        );
        let (op, _g4) = out.device_ptr_mut(stream);
        let (sp, _g5) = sinks_ptr(attn.sinks, stream);
        let sl2 = log2_scale(scale);
        let d = geom.head_dim as u32;
        let mut b = builder(stream, f);
        b.arg(&qp).arg(&kp).arg(&vp).arg(&op);
        b.arg(&args.t)
            .arg(&args.start)
            .arg(&args.nq)
            .arg(&args.nkv)
            .arg(&args.cap)
            .arg(&sl2)
            .arg(&d)
            .arg(&sp)
            .arg(&window)
            .arg(&ring);
        submit(kn, b, cfg((args.t.div_ceil(4), args.nq, 1), 128, 0))
    }

    /// [`Kernels::attention_decode`] for a gpt-oss layer: the splits divide
    /// the window's live keys (at most `window`, so a sliding layer's cost
    /// does not grow with the context), rows are read from the sequence's
    /// ring (`base`, `attn.ring`: module docs), and the combine kernel
    /// enters each head's sink once. Row `t` of the launch is its own
    /// sequence, as in [`Kernels::attention_decode`] (device positions and
    /// bases, one per row), and runs the splits it runs alone. `window > 0`
    /// needs a ring of at least `window` rows (or linear rows); `window ==
    /// 0` with a host position needs the position's row in the buffer (a
    /// device position cannot be checked: past its rows a full layer would
    /// read another sequence's or overwritten rows).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_decode_ring<A: Act16>(
        &self,
        stream: &CudaStream,
        qkv: &impl DevicePtr<A>,
        geom: QkvGeom,
        start: StartPos<'_>,
        kv: KvGeom,
        base: KvBase<'_>,
        k_cache: &impl DevicePtr<A>,
        v_cache: &impl DevicePtr<A>,
        scale: f32,
        attn: RingAttn<'_>,
        workspace: &mut impl DevicePtrMut<f32>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        let kn = by_act::<A>("attn_decode_split_ring", "attn_decode_split_ring_f16");
        let rows = geom.n_tokens;
        check_decode(kn, qkv, geom, kv, k_cache, v_cache, workspace, out)?;
        start.check(kn, rows)?;
        if let StartPos::Host(_) = start {
            ensure(kn, rows == 1, || {
                format!("{rows} decode rows need device positions (one each)")
            })?;
        }
        check_rows(kn, &base, &start, rows, attn.ring, kv.capacity)?;
        attn.check_sinks(kn, geom.n_q_heads)?;
        let window = attn.window_u32(kn)?;
        let span = match (attn.window, start) {
            (0, StartPos::Host(p)) => {
                if attn.ring > 0 {
                    ensure(kn, (p as usize) < attn.ring, || {
                        format!(
                            "position {p} of a full layer is outside its ring of {} rows",
                            attn.ring
                        )
                    })?;
                }
                p as usize + 1
            }
            (0, StartPos::Device(_)) if attn.ring > 0 => attn.ring,
            (0, StartPos::Device(_)) => kv.capacity,
            (w, start) => {
                if attn.ring > 0 {
                    check_window_fits(kn, w, 1, attn.ring)?;
                }
                match start {
                    StartPos::Host(p) => (p as usize + 1).min(w),
                    StartPos::Device(_) => w,
                }
            }
        };
        if span == 0 {
            return Err(shape_err(kn, "no keys to attend"));
        }
        let (splits, chunk) = self.decode_splits(&start, geom.n_kv_heads, span);
        let (nq, nkv, d, cap, ring) = (
            geom.n_q_heads as u32,
            geom.n_kv_heads as u32,
            geom.head_dim as u32,
            kv.capacity as u32,
            dim_u32(kn, "ring", attn.ring)?,
        );
        let nrows = dim_u32(kn, "rows", rows)?;
        let sl2 = log2_scale(scale);
        let (pos_ptr, pos_base, _gp) = start.kernel_args(stream);
        let (base_ptr, base_rows, _gb) = base.kernel_args(stream);
        let (qp, _g1) = qkv.device_ptr(stream);
        super::check_qkv_align(kn, qp)?;
        let (kp, _g2) = k_cache.device_ptr(stream);
        let (vp, _g3) = v_cache.device_ptr(stream);
        let (kp, vp) = (
            kv_rows_ptr(kp, base_rows, geom.head_dim),
            kv_rows_ptr(vp, base_rows, geom.head_dim),
        );
        let (wp, _g4) = workspace.device_ptr_mut(stream);
        let f = self.func(kn)?;
        let mut b = KArgs::new();
        b.arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&wp)
            .arg(&pos_ptr)
            .arg(&pos_base)
            .arg(&base_ptr);
        b.arg(&nq)
            .arg(&nkv)
            .arg(&d)
            .arg(&cap)
            .arg(&chunk)
            .arg(&splits)
            .arg(&sl2)
            .arg(&window)
            .arg(&ring);
        // As attention_decode: blocks run every grid-th split of their
        // (kv head, row).
        let grid = super::splits_grid(splits, nrows);
        // SAFETY: the arguments match the kernel's parameters in order and
        // type; the kernel waits for the grid before it (pdl_wait) first.
        unsafe {
            submit_pdl(
                kn,
                stream,
                f,
                cfg((grid, nkv, nrows), 128, 0),
                b,
                self.pdl(),
            )
        }?;

        const C: &str = "attn_decode_combine_ring";
        let (op, _g5) = out.device_ptr_mut(stream);
        let (sp, _g6) = sinks_ptr(attn.sinks, stream);
        let f = self.func(C)?;
        let mut b = KArgs::new();
        b.arg(&wp)
            .arg(&op)
            .arg(&pos_ptr)
            .arg(&pos_base)
            .arg(&nq)
            .arg(&d)
            .arg(&splits)
            .arg(&chunk)
            .arg(&sp)
            .arg(&window);
        // SAFETY: the arguments match the kernel's parameters in order and
        // type; the kernel waits for the grid before it (pdl_wait) first.
        unsafe { submit_pdl(C, stream, f, cfg((nq, nrows, 1), d, 0), b, self.pdl()) }
    }
}

/// The sinks' device pointer, or 0 (the kernels' "no sinks").
fn sinks_ptr<'a>(
    sinks: Option<&'a CudaSlice<f32>>,
    stream: &'a CudaStream,
) -> (u64, Option<cudarc::driver::SyncOnDrop<'a>>) {
    match sinks {
        Some(s) => {
            let (p, g) = s.device_ptr(stream);
            (p, Some(g))
        }
        None => (0, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_capacity_is_window_plus_chunk_minus_one() {
        assert_eq!(ring_min_capacity(128, 1), 128);
        assert_eq!(ring_min_capacity(128, 512), 639);
        assert_eq!(ring_min_capacity(2, 0), 2);
        assert!(check_window_fits("t", 128, 512, 639).is_ok());
        assert!(check_window_fits("t", 128, 512, 638).is_err());
        assert!(check_window_fits("t", 128, 1, 127).is_err());
    }
}
