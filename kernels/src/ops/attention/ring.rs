//! gpt-oss attention: learned per-head sinks and sliding windows over a
//! ring-indexed KV cache (the `*_ring` entry points of
//! `cuda/attention_*.cu` and `cuda/kv_cache.cu`).
//!
//! The contract, shared by the kernels, these wrappers and the CPU
//! reference (`reference::attention_ring`):
//! - Ring cache: key position `p` lives in row `p % capacity` of the usual
//!   `[n_kv_heads][capacity][head_dim]` buffers. A sliding layer keeps only
//!   [`ring_min_capacity`] rows (or more); a full layer keeps the whole
//!   context, where `p % capacity == p`.
//! - Window (`window > 0`): the query at `pos` sees keys `j` with
//!   `0 <= pos - j < window`; `window == 0` is plain causal attention.
//! - Sinks: one logit per q head (in the units of the scaled scores
//!   `q·k * scale`) joins each row's softmax and its probability is dropped.
//!
//! A prefill chunk appends its `n` keys first ([`Kernels::kv_append_ring`])
//! and then attends, so the oldest key its first query needs is `n - 1`
//! positions older than the newest key written: every query's window is in
//! the ring iff `capacity >= window + n - 1`. The wrappers refuse launches
//! that break this.
//!
//! Separate entry points (not runtime flags in the plain kernels) keep the
//! qwen3 path's generated code unchanged.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PushKernelArg};
use half::bf16;

use super::{PREFILL_BLOCK_M, PrefillArgs, PrefillMma, check_decode, log2_scale};
use crate::launch::{
    Act16, KArgs, builder, by_act, cfg, check_len, dim_u32, ensure, shape_err, submit, submit_pdl,
};
use crate::ops::rope::{KvGeom, QkvGeom, StartPos};
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

impl Kernels {
    /// [`Kernels::kv_append`] into a ring cache: token `t` goes to row
    /// `(start + t) % capacity`. Any position is valid; a chunk may not be
    /// longer than the ring (it would overwrite its own keys).
    #[allow(clippy::too_many_arguments)]
    pub fn kv_append_ring<A: Act16>(
        &self,
        stream: &CudaStream,
        qkv: &impl DevicePtr<A>,
        geom: QkvGeom,
        start: StartPos<'_>,
        kv: KvGeom,
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
        ensure(K, geom.n_tokens <= kv.capacity, || {
            format!(
                "a chunk of {} tokens would overwrite its own keys in a ring of {} rows",
                geom.n_tokens, kv.capacity
            )
        })?;
        let (t, nq, nkv, d, cap) = (
            dim_u32(K, "n_tokens", geom.n_tokens)?,
            geom.n_q_heads as u32,
            geom.n_kv_heads as u32,
            geom.head_dim as u32,
            dim_u32(K, "capacity", kv.capacity)?,
        );
        start.check(K, geom.n_tokens)?;
        let f = self.func(K)?;
        let (pos_ptr, pos_base, _gp) = start.kernel_args(stream);
        let (qp, _g1) = qkv.device_ptr(stream);
        let (kp, _g2) = k_cache.device_ptr_mut(stream);
        let (vp, _g3) = v_cache.device_ptr_mut(stream);
        let mut b = KArgs::new();
        b.arg(&qp).arg(&kp).arg(&vp).arg(&pos_ptr).arg(&pos_base);
        b.arg(&t).arg(&nq).arg(&nkv).arg(&d).arg(&cap);
        // SAFETY: the arguments match the kernel's parameters in order and
        // type; the kernel waits for the grid before it (pdl_wait) first.
        unsafe { submit_pdl(K, stream, f, cfg((t, nkv, 1), 64, 0), b, self.pdl()) }
    }

    /// [`Kernels::attention_prefill`] for a gpt-oss layer (module docs):
    /// query `t` at `start_pos + t` attends the keys of its window (all
    /// `0..=start_pos + t` with `window == 0`) read from ring rows, with the
    /// head's sink in its softmax. The chunk's keys must already be
    /// appended ([`Kernels::kv_append_ring`]). `window > 0` needs
    /// `capacity >= window + n_tokens - 1`; `window == 0` needs
    /// `start_pos + n_tokens <= capacity`. Head dims 64 and 128 use tensor
    /// cores; others [`Kernels::attention_prefill_simt_ring`].
    #[allow(clippy::too_many_arguments)]
    pub fn attention_prefill_ring<A: Act16>(
        &self,
        stream: &CudaStream,
        qkv: &impl DevicePtr<A>,
        geom: QkvGeom,
        start_pos: usize,
        kv: KvGeom,
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
                stream, qkv, geom, start_pos, kv, k_cache, v_cache, scale, attn, out,
            );
        };
        let kn = mma.entry::<A>();
        let args = PrefillArgs::check(
            kn,
            qkv,
            geom,
            start_pos,
            kv,
            0,
            k_cache,
            v_cache,
            out,
            Some(attn.window),
        )?;
        attn.check_sinks(kn, geom.n_q_heads)?;
        let window = attn.window_u32(kn)?;
        let f = self.func(kn)?;
        let smem = mma.smem_bytes();
        crate::launch::allow_smem(kn, f, smem)?;
        let (qp, _g1) = qkv.device_ptr(stream);
        let (kp, _g2) = k_cache.device_ptr(stream);
        let (vp, _g3) = v_cache.device_ptr(stream);
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
            .arg(&window);
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
            0,
            k_cache,
            v_cache,
            out,
            Some(attn.window),
        )?;
        attn.check_sinks(kn, geom.n_q_heads)?;
        let window = attn.window_u32(kn)?;
        let f = self.func(kn)?;
        let (qp, _g1) = qkv.device_ptr(stream);
        let (kp, _g2) = k_cache.device_ptr(stream);
        let (vp, _g3) = v_cache.device_ptr(stream);
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
            .arg(&window);
        submit(kn, b, cfg((args.t.div_ceil(4), args.nq, 1), 128, 0))
    }

    /// [`Kernels::attention_decode`] for a gpt-oss layer: the splits divide
    /// the window's live keys (at most `window`, so a sliding layer's cost
    /// does not grow with the context), rows are read modulo capacity, and
    /// the combine kernel enters each head's sink once. `window > 0` needs
    /// `capacity >= window`; `window == 0` with a host position needs
    /// `pos < capacity` (a device position cannot be checked: past the
    /// capacity a full layer would read overwritten rows).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_decode_ring<A: Act16>(
        &self,
        stream: &CudaStream,
        qkv: &impl DevicePtr<A>,
        geom: QkvGeom,
        start: StartPos<'_>,
        kv: KvGeom,
        k_cache: &impl DevicePtr<A>,
        v_cache: &impl DevicePtr<A>,
        scale: f32,
        attn: RingAttn<'_>,
        workspace: &mut impl DevicePtrMut<f32>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        let kn = by_act::<A>("attn_decode_split_ring", "attn_decode_split_ring_f16");
        check_decode(kn, qkv, geom, kv, k_cache, v_cache, workspace, out)?;
        // One sequence per ring cache, one token per launch.
        ensure(kn, geom.n_tokens == 1, || {
            format!(
                "ring decode takes one token, got n_tokens = {}",
                geom.n_tokens
            )
        })?;
        start.check(kn, 1)?;
        attn.check_sinks(kn, geom.n_q_heads)?;
        let window = attn.window_u32(kn)?;
        let span = match (attn.window, start) {
            (0, StartPos::Host(p)) => {
                ensure(kn, (p as usize) < kv.capacity, || {
                    format!("position {p} is outside the KV capacity {}", kv.capacity)
                })?;
                p as usize + 1
            }
            (0, StartPos::Device(_)) => kv.capacity,
            (w, start) => {
                check_window_fits(kn, w, 1, kv.capacity)?;
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
        let (nq, nkv, d, cap) = (
            geom.n_q_heads as u32,
            geom.n_kv_heads as u32,
            geom.head_dim as u32,
            kv.capacity as u32,
        );
        let sl2 = log2_scale(scale);
        let (pos_ptr, pos_base, _gp) = start.kernel_args(stream);
        let (qp, _g1) = qkv.device_ptr(stream);
        super::check_qkv_align(kn, qp)?;
        let (kp, _g2) = k_cache.device_ptr(stream);
        let (vp, _g3) = v_cache.device_ptr(stream);
        let (wp, _g4) = workspace.device_ptr_mut(stream);
        let f = self.func(kn)?;
        let mut b = KArgs::new();
        b.arg(&qp)
            .arg(&kp)
            .arg(&vp)
            .arg(&wp)
            .arg(&pos_ptr)
            .arg(&pos_base);
        b.arg(&nq)
            .arg(&nkv)
            .arg(&d)
            .arg(&cap)
            .arg(&chunk)
            .arg(&splits)
            .arg(&sl2)
            .arg(&window);
        // One row: a block per split (`splits_grid`).
        let grid = super::splits_grid(splits, 1);
        // SAFETY: the arguments match the kernel's parameters in order and
        // type; the kernel waits for the grid before it (pdl_wait) first.
        unsafe { submit_pdl(kn, stream, f, cfg((grid, nkv, 1), 128, 0), b, self.pdl()) }?;

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
        unsafe { submit_pdl(C, stream, f, cfg((nq, 1, 1), d, 0), b, self.pdl()) }
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
