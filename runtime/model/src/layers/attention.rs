//! Causal grouped-query attention over a KV cache, as in Hugging Face
//! `eager_attention_forward`: scores `q·k / sqrt(head_dim)`, softmax in f32,
//! weighted sum of values. Query head `h` reads KV head `h / (heads / kv_heads)`
//! (`repeat_kv` repeats each KV head for consecutive query heads).
//!
//! Two extras of the layer plan: a sliding window
//! ([`AttentionKind::Sliding`]) limits the visible keys, and attention sinks
//! (gpt_oss) add one learned logit per query head to the softmax's
//! denominator (transformers concatenates it to the scores, subtracts the
//! row maximum over both, and drops its probability).

use super::linear::{PARALLEL_MIN_MACS, dot};
use crate::arch::AttentionKind;
use rayon::prelude::*;
use std::ops::Range;

/// Head layout of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl AttnShape {
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
    /// The KV head that query head `h` attends with.
    pub fn kv_head(&self, h: usize) -> usize {
        h / (self.num_heads / self.num_kv_heads)
    }
}

/// One query head over the key positions `visible` of `keys`/`values`
/// (`[positions, kv_dim]`), writing `head_dim` values to `out`. `sink`, when
/// given, is this head's sink logit: it joins the softmax and is dropped.
#[allow(clippy::too_many_arguments)]
pub fn attend_head(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    visible: Range<usize>,
    kv_head: usize,
    shape: AttnShape,
    sink: Option<f32>,
    out: &mut [f32],
) {
    let (d, kv_dim) = (shape.head_dim, shape.kv_dim());
    let n_keys = visible.end;
    assert_eq!(q.len(), d, "attend_head: q is not one head");
    assert!(
        visible.start < visible.end
            && keys.len() >= n_keys * kv_dim
            && values.len() >= n_keys * kv_dim,
        "attend_head: cache holds fewer than {n_keys} positions or {visible:?} is empty"
    );
    let scale = 1.0 / (d as f32).sqrt();
    let col = kv_head * d..(kv_head + 1) * d;
    let mut scores: Vec<f32> = visible
        .clone()
        .map(|j| dot(q, &keys[j * kv_dim..][col.clone()]) * scale)
        .collect();
    let max = scores
        .iter()
        .copied()
        .chain(sink)
        .fold(f32::NEG_INFINITY, f32::max);
    let mut sum = sink.map_or(0.0, |s| (s - max).exp());
    for s in &mut scores {
        *s = (*s - max).exp();
        sum += *s;
    }
    out.fill(0.0);
    for (j, &p) in visible.zip(scores.iter()) {
        let w = p / sum;
        for (o, &v) in out.iter_mut().zip(&values[j * kv_dim..][col.clone()]) {
            *o += w * v;
        }
    }
}

/// Causal attention for `n` consecutive query positions starting at
/// `start_pos`: `q` is `[n, q_dim]`, the caches already hold keys and values
/// of positions `0..start_pos + n`, and query `t` sees positions
/// `0..=start_pos + t`. Writes `[n, q_dim]` into `out`. Heads and positions
/// are independent, so they run in parallel.
pub fn causal_attention(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    start_pos: usize,
    shape: AttnShape,
    out: &mut [f32],
) {
    attention(
        q,
        keys,
        values,
        start_pos,
        shape,
        AttentionKind::Full,
        None,
        out,
    );
}

/// [`causal_attention`] with a layer's window and, when `sinks` is given
/// (`[num_heads]`), its attention sinks.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    start_pos: usize,
    shape: AttnShape,
    kind: AttentionKind,
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    if let Some(s) = sinks {
        assert_eq!(
            s.len(),
            shape.num_heads,
            "attention: one sink per query head"
        );
    }
    per_query_head(q, start_pos, shape, kind, out, |qh, visible, h, o| {
        let sink = sinks.map(|s| s[h]);
        attend_head(qh, keys, values, visible, shape.kv_head(h), shape, sink, o)
    });
}

/// Runs `head(q_head, visible_keys, head_index, out_head)` for every (query
/// position, head) of `q` (`[n, q_dim]`, positions `start_pos..start_pos +
/// n`; causal, limited to the window of a sliding `kind`), writing `out`
/// (`[n, q_dim]`). Heads and positions are independent, so they run in
/// parallel once the work is large enough. Shared by [`attention`] and the
/// reference engine's emulation of the tiled prefill kernel.
pub fn per_query_head(
    q: &[f32],
    start_pos: usize,
    shape: AttnShape,
    kind: AttentionKind,
    out: &mut [f32],
    head: impl Fn(&[f32], Range<usize>, usize, &mut [f32]) + Sync,
) {
    let d = shape.head_dim;
    assert_eq!(q.len() % shape.q_dim(), 0, "attention: q is not [n, q_dim]");
    assert_eq!(q.len(), out.len(), "attention: out is not [n, q_dim]");
    let one = |(i, (o, qh)): (usize, (&mut [f32], &[f32]))| {
        let (t, h) = (i / shape.num_heads, i % shape.num_heads);
        let pos = start_pos + t;
        head(qh, kind.first_key(pos)..pos + 1, h, o);
    };
    let n = q.len() / shape.q_dim();
    // Two multiply-adds (score, value) per query element and visible key.
    if 2 * q.len() * (start_pos + n) < PARALLEL_MIN_MACS {
        out.chunks_mut(d).zip(q.chunks(d)).enumerate().for_each(one);
    } else {
        out.par_chunks_mut(d)
            .zip(q.par_chunks(d))
            .enumerate()
            .for_each(one);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::assert_close;

    const ONE: AttnShape = AttnShape {
        num_heads: 1,
        num_kv_heads: 1,
        head_dim: 2,
    };

    #[test]
    fn single_key_returns_its_value() {
        let mut out = [0.0; 2];
        attend_head(
            &[5.0, -3.0],
            &[1.0, 2.0],
            &[7.0, 8.0],
            0..1,
            0,
            ONE,
            None,
            &mut out,
        );
        assert_close(&out, &[7.0, 8.0], 0.0);
    }

    #[test]
    fn two_keys_hand_computed_softmax() {
        // q = [1, 0], k0 = [0, 0], k1 = [2, 0], scale = 1/sqrt(2):
        // scores [0, sqrt(2)], p1 = 1 / (1 + e^-sqrt(2)).
        let keys = [0.0, 0.0, 2.0, 0.0];
        let values = [1.0, 0.0, 0.0, 1.0];
        let mut out = [0.0; 2];
        attend_head(&[1.0, 0.0], &keys, &values, 0..2, 0, ONE, None, &mut out);
        let p1 = 1.0 / (1.0 + (-(2.0f32).sqrt()).exp());
        assert_close(&out, &[1.0 - p1, p1], 1e-6);
    }

    #[test]
    fn a_sink_takes_probability_mass_and_is_dropped() {
        // One key of score 0 and a sink of logit ln 3: p(key) = 1 / (1 + 3).
        let mut out = [0.0; 2];
        let sink = Some(3f32.ln());
        attend_head(
            &[0.0, 0.0],
            &[1.0, 1.0],
            &[8.0, -4.0],
            0..1,
            0,
            ONE,
            sink,
            &mut out,
        );
        assert_close(&out, &[2.0, -1.0], 1e-6);
    }

    #[test]
    fn sliding_window_hides_keys_older_than_the_window() {
        // Window 2: position 2 sees keys 1 and 2 only (equal scores).
        let keys = [0.0; 3];
        let values = [100.0, 3.0, 5.0];
        let shape = AttnShape {
            num_heads: 1,
            num_kv_heads: 1,
            head_dim: 1,
        };
        let q = [1.0; 3];
        let mut out = [0.0; 3];
        let kind = AttentionKind::Sliding { window: 2 };
        attention(&q, &keys, &values, 0, shape, kind, None, &mut out);
        assert_close(&out, &[100.0, 51.5, 4.0], 1e-5);
        // Full attention at position 2 averages all three.
        causal_attention(&q, &keys, &values, 0, shape, &mut out);
        assert_close(&out[2..], &[36.0], 1e-5);
    }

    #[test]
    fn causal_mask_and_gqa_mapping() {
        // 2 query heads share 1 KV head; position 0 must ignore position 1.
        let shape = AttnShape {
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 1,
        };
        assert_eq!(shape.kv_head(1), 0);
        let keys = [0.0, 0.0];
        let values = [3.0, 5.0];
        let q = [1.0, 1.0, 1.0, 1.0]; // [n = 2, q_dim = 2]
        let mut out = [0.0; 4];
        causal_attention(&q, &keys, &values, 0, shape, &mut out);
        // Position 0 sees only value 3; position 1 averages 3 and 5 (equal scores).
        assert_close(&out, &[3.0, 3.0, 4.0, 4.0], 1e-6);
    }

    #[test]
    fn kv_head_groups_are_consecutive() {
        let s = AttnShape {
            num_heads: 8,
            num_kv_heads: 2,
            head_dim: 4,
        };
        let groups: Vec<usize> = (0..8).map(|h| s.kv_head(h)).collect();
        assert_eq!(groups, [0, 0, 0, 0, 1, 1, 1, 1]);
    }
}
