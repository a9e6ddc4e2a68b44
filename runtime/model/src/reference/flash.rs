//! Causal attention as the CUDA engine's tensor-core prefill kernels
//! compute it (`kernels/cuda/attention_prefill.cu`, `attn_prefill_mma`), for
//! [`Activations::Bf16`](super::Activations::Bf16) only: an online softmax
//! over key tiles of [`KEY_TILE`] keys aligned at absolute position 0, in
//! the log2 domain (scores `q·k · (scale · log2 e)`, `exp2`), where each
//! tile's probabilities `P = exp2(s − m)` against the running maximum `m`
//! are rounded to BF16 for the `P·V` product while the row sum `l` adds the
//! f32 `P`; the accumulator and `l` are rescaled by `exp2(m_old − m_new)`
//! per tile, and the output is `o · (1 / l)` (rounded to BF16 by the
//! caller, as the kernel's store does). The f32 oracle keeps
//! [`causal_attention`](crate::layers::attention::causal_attention).

use super::Format;
use crate::arch::AttentionKind;
use crate::layers::attention::{AttnShape, per_query_head};
use crate::layers::linear::dot;
use std::ops::Range;

/// Keys per tile (`BN` of every `attn_prefill_mma_d*` instantiation).
pub const KEY_TILE: usize = 64;

/// One query head over the keys `visible`, as one row of
/// `attn_prefill_mma`. A sink logit starts the online softmax as its first
/// "key" (running maximum at the sink, row sum 1) and contributes no value.
#[allow(clippy::too_many_arguments)]
fn attend_head_tiled(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    visible: Range<usize>,
    kv_head: usize,
    shape: AttnShape,
    sink: Option<f32>,
    p_format: Format,
    out: &mut [f32],
) {
    let (d, kv_dim) = (shape.head_dim, shape.kv_dim());
    // ops/attention.rs: scale = 1 / sqrt(head_dim), sl2 = scale * LOG2_E.
    let sl2 = (1.0 / (d as f32).sqrt()) * std::f32::consts::LOG2_E;
    let col = kv_head * d..(kv_head + 1) * d;
    let (mut m, mut l) = match sink {
        Some(s) => (s * std::f32::consts::LOG2_E, 1f32),
        None => (f32::NEG_INFINITY, 0f32),
    };
    out.fill(0.0);
    let mut s = [0f32; KEY_TILE];
    // Tiles stay aligned at absolute position 0, as the kernel's are.
    let first_tile = visible.start / KEY_TILE * KEY_TILE;
    for t0 in (first_tile..visible.end).step_by(KEY_TILE) {
        let (n0, n1) = (t0.max(visible.start), (t0 + KEY_TILE).min(visible.end));
        let s = &mut s[..n1 - n0];
        let mut mx = f32::NEG_INFINITY;
        for (j, sj) in (n0..n1).zip(s.iter_mut()) {
            *sj = dot(q, &keys[j * kv_dim..][col.clone()]) * sl2;
            mx = mx.max(*sj);
        }
        let mn = m.max(mx);
        let al = (m - mn).exp2();
        m = mn;
        let mut ls = 0f32;
        for sj in s.iter_mut() {
            *sj = (*sj - mn).exp2();
            ls += *sj;
        }
        l = l * al + ls;
        for o in out.iter_mut() {
            *o *= al;
        }
        for (j, &p) in (n0..n1).zip(s.iter()) {
            let p = p_format.round(p);
            for (o, &v) in out.iter_mut().zip(&values[j * kv_dim..][col.clone()]) {
                *o += p * v;
            }
        }
    }
    let inv = 1.0 / l;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

/// [`causal_attention`](crate::layers::attention::causal_attention) with the
/// prefill kernel's tiling and rounding (see the module doc).
#[allow(clippy::too_many_arguments)]
pub fn causal_attention_tiled(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    start_pos: usize,
    shape: AttnShape,
    kind: AttentionKind,
    sinks: Option<&[f32]>,
    p_format: Format,
    out: &mut [f32],
) {
    per_query_head(q, start_pos, shape, kind, out, |qh, visible, h, o| {
        let sink = sinks.map(|s| s[h]);
        attend_head_tiled(
            qh,
            keys,
            values,
            visible,
            shape.kv_head(h),
            shape,
            sink,
            p_format,
            o,
        )
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::attention::causal_attention;

    /// Away from the BF16 rounding of P the tiled online softmax is the
    /// plain softmax: over 150 keys (3 tiles) it agrees to ~1e-2 relative.
    #[test]
    fn tiled_matches_plain_softmax_up_to_p_rounding() {
        let shape = AttnShape {
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 8,
        };
        let n = 150;
        let val = |i: usize| ((i * 7919 % 1000) as f32 / 500.0) - 1.0;
        let q: Vec<f32> = (0..n * 16).map(val).collect();
        let k: Vec<f32> = (0..n * 8).map(|i| val(i + 13)).collect();
        let v: Vec<f32> = (0..n * 8).map(|i| val(i + 101)).collect();
        let (mut a, mut b) = (vec![0f32; n * 16], vec![0f32; n * 16]);
        causal_attention(&q, &k, &v, 0, shape, &mut a);
        causal_attention_tiled(
            &q,
            &k,
            &v,
            0,
            shape,
            AttentionKind::Full,
            None,
            Format::Bf16,
            &mut b,
        );
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-2 * (1.0 + x.abs()), "{x} vs {y}");
        }
        // The first query sees one key: its value, exactly.
        assert_eq!(&b[..8], &v[..8]);
    }
}
