//! The attention block of one decoder layer, wired from the layer plan:
//! each part (q/k/v and o biases, q/k norms or table RoPE, sinks, a sliding
//! window) is launched only where the plan has it, so a plan without them
//! runs exactly the kernels it ran before they existed.
//!
//! **Activation format** (`AttentionSpec::activations`, the one place it is
//! decided; the CPU reference's emulation reads the same field): BF16, or
//! FP16 (gpt_oss). The FP16 path stores the input RMSNorm's output, the
//! fused QKV weight ([`Weight16::F16`]), q/k/v and the KV cache in FP16 and
//! runs the `_f16` kernels (f16 MMAs, P in f16); the attention output stays
//! BF16 for the BF16 o_proj. It keeps its FP16 values in the engine's
//! 2-byte scratch and cache buffers (`act.rs`), so both paths have the
//! same memory plan. The BF16 path launches what it launched before FP16
//! existed, with the same arguments.

use crate::blas::{Gemm, InType, OutType};
use crate::error::{GpuError, Result};
use crate::forward::{Ctx, Positions};
use crate::scratch::{KvCache, Scratch};
use crate::weights::Weight16;
use cudarc::driver::{CudaSlice, CudaViewMut, DevicePtr, DevicePtrMut};
use half::{bf16, f16};
use krasis_kernels::ops::attention::RingAttn;
use krasis_kernels::{Act16, KvBase, KvGeom, QkvGeom, StartPos};
use krasis_model::arch::AttentionKind;

/// `s`'s storage seen as FP16: the FP16 attention path keeps its normed
/// input, q/k/v and KV cache in the engine's 2-byte buffers, which no BF16
/// reader touches in between (`act::view_mut`).
fn as_f16(s: &mut CudaSlice<bf16>) -> CudaViewMut<'_, f16> {
    crate::act::view_mut::<f16>(s)
}

/// The input RMSNorm of layer `l`'s prefill into `scratch.normed`, rounded
/// to the attention's format (decode folds it into the QKV GEMV).
pub(crate) fn input_norm(cx: &Ctx<'_>, sc: &mut Scratch, l: usize, t: usize) -> Result<()> {
    let (g, s, kn) = (cx.g, &cx.gpu.stream, cx.kn);
    let (h, eps) = (g.hidden, g.rms_norm_eps);
    let lw = &cx.w.layers[l];
    match &lw.qkv {
        Weight16::Bf16(_) => {
            kn.rmsnorm::<f32>(s, &sc.residual, &lw.input_norm, t, h, eps, &mut sc.normed)?
        }
        Weight16::F16(_) => kn.rmsnorm_f32_to_f16(
            s,
            &sc.residual,
            &lw.input_norm,
            t,
            h,
            eps,
            &mut as_f16(&mut sc.normed),
        )?,
    }
    Ok(())
}

/// Attention block of layer `l`: reads `scratch.normed` (prefill; decode
/// normalizes the residual itself), adds the o_proj output (and its bias)
/// into `scratch.residual`.
///
/// The plan's parts, each only where the layer has it: q/k/v projected to
/// f32 and its bias added with one rounding to the attention's format;
/// q/k RMSNorm fused with RoPE, or RoPE from the model's frequency table;
/// plain causal attention over a linear KV cache, or (sliding window or
/// sinks) the ring kernels.
///
/// A prefill chunk is one sequence's, in its KV rows from `base` on; a
/// decode step has `t` rows of different sequences, each at its own
/// position and in its own KV rows (`scratch.pos`, `scratch.kv_base`).
/// Sliding layers keep a ring per sequence (`scratch::KvCache`): the
/// sequence's slot's, from `slot * ring` on (`scratch.ring_base` for a
/// decode row).
pub(crate) fn attention(
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    kv: &mut KvCache,
    l: usize,
    t: usize,
    at: Positions,
) -> Result<()> {
    let g = cx.g;
    let (h, q) = (g.hidden, g.q_dim());
    let (s, kn) = (&cx.gpu.stream, cx.kn);
    let lw = &cx.w.layers[l];
    let decode = matches!(at, Positions::Decode);
    let kvg = kv.geoms[l];
    let ring = kv.layer_ring(g, l);
    let (theta, eps) = (g.rope.theta as f32, g.rms_norm_eps);
    let nq = q + 2 * g.kv_dim();
    let no_rope =
        || GpuError::Unsupported("attention without q/k norms but no RoPE table loaded".into());
    // The q/k/v projection covers every row; RoPE, the KV append and
    // attention run per sequence: one segment for a prefill chunk or a
    // decode step, one per sequence of a packed prefill (no allocation:
    // this runs for every layer of every decode token).
    let n_segments = match at {
        Positions::Packed => sc.packed.len(),
        _ => 1,
    };
    // A sliding layer's ring holds the window of at most `piece` new keys
    // (`scratch::ring_rows`), so its prefill segments run in pieces of that
    // many tokens, each appended and then attended. The ring kernels' rows
    // are chunk-invariant, so the pieces give a whole segment's bits.
    let piece = match (g.layers[l].attention, decode) {
        (AttentionKind::Sliding { window }, false) if ring > 0 => ring + 1 - window,
        _ => usize::MAX,
    };
    match &lw.qkv {
        Weight16::Bf16(w) => {
            project_bf16(cx, sc, l, t, decode, w)?;
            for (r0, len, at) in
                (0..n_segments).flat_map(|i| pieces(segment(&sc.packed, at, t, i), piece))
            {
                let geom = cx.qkv_geom(len);
                let sp = start_pos(at, &sc.pos)?;
                let base = kv_base(at, (&sc.kv_base, &sc.ring_base), ring);
                let mut qkv = sc.qkv.slice_mut(r0 * nq..(r0 + len) * nq);
                match (&lw.qk_norm, &cx.w.rope) {
                    // Partial rotary (glm4_moe): its own kernel, with or without norm.
                    (n, Some(r)) if r.rotary_dim < g.head_dim => {
                        let norm = n.as_ref().map(|n| krasis_kernels::QkNormArgs {
                            q: &n.q,
                            k: &n.k,
                            eps,
                        });
                        kn.rope_partial(
                            s,
                            &mut qkv,
                            geom,
                            sp,
                            norm,
                            &r.inv_freq,
                            r.scale,
                            r.rotary_dim,
                        )?
                    }
                    (Some(n), _) => {
                        kn.qk_norm_rope(s, &mut qkv, geom, sp, &n.q, &n.k, theta, eps)?
                    }
                    (None, Some(r)) => {
                        kn.rope_table(s, &mut qkv, geom, sp, &r.inv_freq, r.scale)?
                    }
                    (None, None) => return Err(no_rope()),
                }
                // The BF16 buffers as they are.
                attend(
                    cx,
                    l,
                    at,
                    (sp, base),
                    geom,
                    &qkv,
                    (kvg, ring),
                    &mut kv.k[l],
                    &mut kv.v[l],
                    &mut sc.attn_ws,
                    &mut sc.attn.slice_mut(r0 * q..(r0 + len) * q),
                )?;
            }
        }
        Weight16::F16(w) => {
            project_f16(cx, sc, l, t, decode, w)?;
            for (r0, len, at) in
                (0..n_segments).flat_map(|i| pieces(segment(&sc.packed, at, t, i), piece))
            {
                let geom = cx.qkv_geom(len);
                let sp = start_pos(at, &sc.pos)?;
                let base = kv_base(at, (&sc.kv_base, &sc.ring_base), ring);
                let mut all = as_f16(&mut sc.qkv);
                let mut qkv = all.slice_mut(r0 * nq..(r0 + len) * nq);
                match (&lw.qk_norm, &cx.w.rope) {
                    // support.rs refuses both before anything is uploaded.
                    (_, Some(r)) if r.rotary_dim < g.head_dim => {
                        return Err(GpuError::Unsupported(
                            "partial rotary with FP16 attention (its kernel is BF16 only)".into(),
                        ));
                    }
                    (None, Some(r)) => {
                        kn.rope_table(s, &mut qkv, geom, sp, &r.inv_freq, r.scale)?
                    }
                    (Some(_), _) => {
                        return Err(GpuError::Unsupported(
                            "q/k RMSNorm with FP16 attention (the fused kernel is BF16 only)"
                                .into(),
                        ));
                    }
                    (None, None) => return Err(no_rope()),
                }
                let (mut kc, mut vc) = (as_f16(&mut kv.k[l]), as_f16(&mut kv.v[l]));
                attend(
                    cx,
                    l,
                    at,
                    (sp, base),
                    geom,
                    &qkv,
                    (kvg, ring),
                    &mut kc,
                    &mut vc,
                    &mut sc.attn_ws,
                    &mut sc.attn.slice_mut(r0 * q..(r0 + len) * q),
                )?;
            }
        }
    }
    if decode {
        cx.gemv::<bf16, f32>(
            &sc.attn.slice(..),
            &lw.o_proj,
            t,
            h,
            q,
            true,
            &mut sc.residual.slice_mut(..),
        )?;
    } else {
        cx.gemm(
            (t, h, q),
            cx.p(&sc.attn, 0),
            cx.p(&lw.o_proj, 0),
            cx.p(&sc.residual, 0),
            OutType::F32,
            1.0,
            "o_proj",
        )?;
    }
    if let Some(b) = &lw.o_bias {
        kn.add_bias_rows::<f32>(s, &mut sc.residual, b, t, h)?;
    }
    Ok(())
}

/// Segment `i` of a pass of `t` rows at `at`: (first row, rows, positions);
/// the whole pass unless it is packed (`packed`: the scratch's segments).
fn segment(
    packed: &[crate::forward::PackedSegment],
    at: Positions,
    t: usize,
    i: usize,
) -> (usize, usize, Positions) {
    match at {
        Positions::Packed => {
            let p = packed[i];
            let at = Positions::Prefill {
                start: p.start,
                base: p.base,
                slot: p.slot,
            };
            (p.row, p.len, at)
        }
        _ => (0, t, at),
    }
}

/// The pieces of at most `piece` rows of a segment `(first row, rows,
/// positions)`, each at its own positions; the segment itself when it has
/// no more rows (always for decode). No allocation.
fn pieces(
    (r0, len, at): (usize, usize, Positions),
    piece: usize,
) -> impl Iterator<Item = (usize, usize, Positions)> {
    (0..len.max(1)).step_by(piece.max(1)).map(move |a| {
        let at = match at {
            Positions::Prefill { start, base, slot } => Positions::Prefill {
                start: start + a,
                base,
                slot,
            },
            other => other,
        };
        (r0 + a, piece.min(len - a), at)
    })
}

/// Where a launch's positions come from: the prefill chunk's start, or
/// decode's device-side positions, one per row (graph-capturable).
fn start_pos(at: Positions, pos: &CudaSlice<u32>) -> Result<StartPos<'_>> {
    Ok(match at {
        Positions::Prefill { start, .. } => StartPos::Host(
            u32::try_from(start)
                .map_err(|_| GpuError::Unsupported(format!("position {start} exceeds u32")))?,
        ),
        Positions::Decode => StartPos::Device(pos),
        Positions::Packed => return Err(packed_whole()),
    })
}

/// A packed pass reaches the per-sequence kernels one segment at a time.
fn packed_whole() -> GpuError {
    GpuError::Unsupported("a packed prefill's positions are per segment".into())
}

/// Where a launch's sequences' KV rows start in a layer whose sequences
/// hold rings of `ring` rows (0: linear arena rows): the prefill's
/// sequence, or decode's device-side bases, one per row (the scratch's
/// arena and ring bases).
fn kv_base<'a>(
    at: Positions,
    (arena, rings): (&'a CudaSlice<u32>, &'a CudaSlice<u32>),
    ring: usize,
) -> KvBase<'a> {
    match (at, ring) {
        (Positions::Prefill { base, slot, .. }, _) => KvBase::Host(prefill_row(base, slot, ring)),
        // A packed pass never gets here whole: start_pos refuses it first.
        (Positions::Decode | Positions::Packed, 0) => KvBase::Device(arena),
        (Positions::Decode | Positions::Packed, _) => KvBase::Device(rings),
    }
}

/// A prefill chunk's first KV row in a layer of rings of `ring` rows: its
/// sequence's arena base (a full layer, ring 0) or its slot's ring.
fn prefill_row(base: usize, slot: usize, ring: usize) -> usize {
    match ring {
        0 => base,
        r => slot * r,
    }
}

/// The BF16 q/k/v projection into `scratch.qkv`: a BF16 GEMM (GEMV with
/// the input norm folded in, for decode), straight to BF16 without biases,
/// else to f32 and the bias added with one rounding.
fn project_bf16(
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    l: usize,
    t: usize,
    decode: bool,
    w: &CudaSlice<bf16>,
) -> Result<()> {
    let g = cx.g;
    let (h, n) = (g.hidden, g.q_dim() + 2 * g.kv_dim());
    let lw = &cx.w.layers[l];
    match (&lw.qkv_bias, decode) {
        // The input RMSNorm folded in (the caller skipped it).
        (None, true) => cx.norm_gemv::<bf16, bf16>(
            &sc.residual,
            &lw.input_norm,
            w,
            t,
            n,
            &mut sc.normed.slice_mut(..),
            &mut sc.qkv.slice_mut(..),
        ),
        (None, false) => cx.gemm(
            (t, n, h),
            cx.p(&sc.normed, 0),
            cx.p(w, 0),
            cx.p(&sc.qkv, 0),
            OutType::Bf16,
            0.0,
            "qkv projection",
        ),
        (Some(bias), _) => {
            let wide = sc.qkv_f32.as_mut().ok_or_else(|| {
                GpuError::Unsupported("q/k/v biases without their f32 scratch".into())
            })?;
            if decode {
                cx.norm_gemv::<bf16, f32>(
                    &sc.residual,
                    &lw.input_norm,
                    w,
                    t,
                    n,
                    &mut sc.normed.slice_mut(..),
                    &mut wide.slice_mut(..),
                )?;
            } else {
                cx.gemm(
                    (t, n, h),
                    cx.p(&sc.normed, 0),
                    cx.p(w, 0),
                    cx.p(wide, 0),
                    OutType::F32,
                    0.0,
                    "qkv projection",
                )?;
            }
            Ok(cx
                .kn
                .bias_cast_f32_to_bf16(&cx.gpu.stream, wide, bias, t, n, &mut sc.qkv)?)
        }
    }
}

/// The FP16 q/k/v projection into `scratch.qkv` (as f16): an f16 x f16
/// GEMM with f32 accumulation into the f32 scratch (decode: the f16 norm
/// GEMV, whose normed row is bit-identical to prefill's
/// `rmsnorm_f32_to_f16`), then the bias added in f32 and one rounding to
/// f16. Only with q/k/v biases (`support.rs` refuses FP16 without them).
fn project_f16(
    cx: &Ctx<'_>,
    sc: &mut Scratch,
    l: usize,
    t: usize,
    decode: bool,
    w: &CudaSlice<f16>,
) -> Result<()> {
    let g = cx.g;
    let (h, n) = (g.hidden, g.q_dim() + 2 * g.kv_dim());
    let (s, kn) = (&cx.gpu.stream, cx.kn);
    let lw = &cx.w.layers[l];
    let (Some(bias), Some(wide)) = (&lw.qkv_bias, sc.qkv_f32.as_mut()) else {
        return Err(GpuError::Unsupported(
            "FP16 attention without q/k/v biases and their f32 scratch".into(),
        ));
    };
    if decode {
        cx.norm_gemv::<f16, f32>(
            &sc.residual,
            &lw.input_norm,
            w,
            t,
            n,
            &mut as_f16(&mut sc.normed),
            &mut wide.slice_mut(..),
        )?;
    } else {
        crate::blas::gemm(
            &cx.gpu.blas,
            &Gemm {
                m: t,
                n,
                k: h,
                x: cx.p(&sc.normed, 0),
                w: cx.p(w, 0),
                y: cx.p(wide, 0),
                input: InType::F16,
                out: OutType::F32,
                beta: 0.0,
                ref_rows: crate::blas::DENSE_REF_ROWS,
            },
            "qkv projection (FP16)",
        )?;
    }
    Ok(kn.bias_cast_f32_to_f16(s, wide, bias, t, n, &mut as_f16(&mut sc.qkv))?)
}

/// The KV append and the attention of layer `l` over q/k/v (RoPE done)
/// and a KV cache in format `A` whose sequences hold rings of `ring` rows
/// (0: linear rows), into the BF16 `attn`.
#[allow(clippy::too_many_arguments)]
fn attend<A: Act16>(
    cx: &Ctx<'_>,
    l: usize,
    at: Positions,
    (sp, base): (StartPos<'_>, KvBase<'_>),
    geom: QkvGeom,
    qkv: &impl DevicePtr<A>,
    (kvg, ring): (KvGeom, usize),
    kc: &mut (impl DevicePtrMut<A> + DevicePtr<A>),
    vc: &mut (impl DevicePtrMut<A> + DevicePtr<A>),
    attn_ws: &mut CudaSlice<f32>,
    attn: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let g = cx.g;
    let (s, kn) = (&cx.gpu.stream, cx.kn);
    let lw = &cx.w.layers[l];
    let scale = 1.0 / (g.head_dim as f32).sqrt();
    let window = match g.layers[l].attention {
        AttentionKind::Full => 0,
        AttentionKind::Sliding { window } => window,
    };
    if window == 0 && lw.sinks.is_none() {
        kn.kv_append(s, qkv, geom, sp, kvg, base, kc, vc)?;
        match at {
            Positions::Prefill { start, base, .. }
                if cx.prefill_kernels.hopper_attention::<A>(geom.head_dim) =>
            {
                kn.attention_prefill_wgmma(s, qkv, geom, start, kvg, base, kc, vc, scale, attn)?
            }
            Positions::Prefill { start, base, .. } => {
                kn.attention_prefill(s, qkv, geom, start, kvg, base, kc, vc, scale, attn)?
            }
            Positions::Decode => {
                kn.attention_decode(s, qkv, geom, sp, kvg, base, kc, vc, scale, attn_ws, attn)?
            }
            Positions::Packed => return Err(packed_whole()),
        }
    } else {
        // Sinks or a window: the ring kernels, over the sequence's ring
        // (sliding layers) or its linear arena rows (full layers, ring 0).
        let ra = RingAttn {
            sinks: lw.sinks.as_ref(),
            window,
            ring,
        };
        kn.kv_append_ring(s, qkv, geom, sp, kvg, base, ring, kc, vc)?;
        match (at, base) {
            (Positions::Prefill { start, .. }, KvBase::Host(b)) => {
                kn.attention_prefill_ring(s, qkv, geom, start, kvg, b, kc, vc, scale, ra, attn)?
            }
            (Positions::Decode, _) => kn.attention_decode_ring(
                s, qkv, geom, sp, kvg, base, kc, vc, scale, ra, attn_ws, attn,
            )?,
            (Positions::Prefill { .. }, KvBase::Device(_)) => {
                return Err(GpuError::Unsupported(
                    "a prefill chunk's KV rows start at one host row".into(),
                ));
            }
            (Positions::Packed, _) => return Err(packed_whole()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sliding layer's prefill segment in pieces: every row once, in
    /// order, each piece at its own first position and the sequence's KV;
    /// a decode step (or a piece size past the rows) stays whole.
    #[test]
    fn pieces_cover_a_segment_at_their_own_positions() {
        let at = Positions::Prefill {
            start: 1000,
            base: 64,
            slot: 3,
        };
        let got: Vec<(usize, usize, usize)> = pieces((5, 1300, at), 512)
            .map(|(r0, len, at)| match at {
                Positions::Prefill { start, base, slot } => {
                    assert_eq!((base, slot), (64, 3));
                    (r0, len, start)
                }
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            got,
            vec![(5, 512, 1000), (517, 512, 1512), (1029, 276, 2024)]
        );
        assert_eq!(pieces((0, 300, at), usize::MAX).count(), 1);
        let decode: Vec<_> = pieces((0, 4, Positions::Decode), usize::MAX).collect();
        assert!(matches!(decode[..], [(0, 4, Positions::Decode)]));
    }

    /// A prefill chunk's KV rows: the arena's for a full layer, the slot's
    /// ring for a sliding one.
    #[test]
    fn a_prefill_reads_its_arena_rows_or_its_slots_ring() {
        assert_eq!(prefill_row(700, 2, 0), 700);
        assert_eq!(prefill_row(700, 2, 768), 2 * 768);
        assert_eq!(prefill_row(700, 0, 768), 0);
    }
}
