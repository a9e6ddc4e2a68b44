//! Per-position internals of one forward pass, recorded only by
//! [`ReferenceEngine::prompt_logits_traced`](super::ReferenceEngine::prompt_logits_traced):
//! what to look at when a few positions are far more sensitive than the rest,
//! and the routing `krasis-runtime bench --check` classifies GPU/reference
//! differences with (`experts`, `router_margin`, `router_kth`).
//!
//! Every per-token vector is appended to by each forward pass of the traced
//! call, so a prompt prefilled in several chunks gives the same trace as one
//! batch.

use crate::arch::RouterKind;
use crate::layers::attention::AttnShape;
use crate::layers::linear::dot;
use crate::layers::router::{decision_gap, route_with};

/// Indexed `[layer][token]` unless noted; all values are f32 diagnostics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trace {
    /// RMS of the residual stream entering each layer (the input RMSNorm's input).
    pub layer_input_rms: Vec<Vec<f32>>,
    /// RMS of the residual after attention (the post-attention RMSNorm's input).
    pub mlp_input_rms: Vec<Vec<f32>>,
    /// `[token]`: RMS of the residual entering the final RMSNorm.
    pub final_rms: Vec<f32>,
    /// Largest softmax probability over all heads and visible keys.
    pub attn_peak: Vec<Vec<f32>>,
    /// Routed experts run, best first; empty for dense layers. (Under
    /// [`ReferenceEngine::prompt_logits_following`](super::ReferenceEngine::prompt_logits_following)
    /// a followed decision holds the other engine's set.)
    pub experts: Vec<Vec<Vec<usize>>>,
    /// The decision took the other engine's set (always false unless
    /// following).
    pub followed: Vec<Vec<bool>>,
    /// Router logit of the k-th best expert minus that of the (k+1)-th: how
    /// far the token is from switching experts (∞ when every expert is
    /// selected). Empty for dense layers.
    pub router_margin: Vec<Vec<f32>>,
    /// Router logit of the k-th best expert, so a margin can be judged
    /// relative to the logits' size (`bench --check` calls a margin below
    /// max(0.01, 1% of |k-th logit|) a near-tie). Empty for dense layers.
    pub router_kth: Vec<Vec<f32>>,
}

impl Trace {
    pub(super) fn new(layers: usize) -> Self {
        Trace {
            layer_input_rms: vec![Vec::new(); layers],
            mlp_input_rms: vec![Vec::new(); layers],
            final_rms: Vec::new(),
            attn_peak: vec![Vec::new(); layers],
            experts: vec![Vec::new(); layers],
            followed: vec![Vec::new(); layers],
            router_margin: vec![Vec::new(); layers],
            router_kth: vec![Vec::new(); layers],
        }
    }

    /// Records the routing of `[n, num_experts]` router logits (the tokens
    /// of the current forward pass, appended after the earlier chunks'):
    /// the experts run (`ran[t]`, the own top-k when `None`), whether each
    /// was followed, and the own decision's gap and k-th choice score
    /// (`layers::router::decision_gap` under the router `kind` with the
    /// layer's selection bias).
    pub(super) fn record_router(
        &mut self,
        layer: usize,
        logits: &[f32],
        ran: Option<&[(Vec<usize>, bool)]>,
        (ne, top_k): (usize, usize),
        (kind, selection_bias): (RouterKind, Option<&[f32]>),
    ) {
        for (t, l) in logits.chunks_exact(ne).enumerate() {
            let (experts, followed) = match ran {
                Some(r) => r[t].clone(),
                None => (
                    route_with(kind, l, selection_bias, top_k)
                        .iter()
                        .map(|c| c.0)
                        .collect(),
                    false,
                ),
            };
            self.experts[layer].push(experts);
            self.followed[layer].push(followed);
            let (kth, gap) = decision_gap(kind, l, selection_bias, top_k);
            self.router_kth[layer].push(kth);
            self.router_margin[layer].push(gap);
        }
    }
}

/// RMS of each `h`-wide row of `x`.
pub(super) fn rms_rows(x: &[f32], h: usize) -> Vec<f32> {
    x.chunks_exact(h)
        .map(|r| {
            let ss: f64 = r.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
            (ss / h as f64).sqrt() as f32
        })
        .collect()
}

/// Per query position of `q` (`[n, q_dim]`, positions `start..start + n`):
/// the largest attention probability over heads.
pub(super) fn attention_peaks(q: &[f32], keys: &[f32], start: usize, shape: AttnShape) -> Vec<f32> {
    let (d, kvd) = (shape.head_dim, shape.kv_dim());
    let scale = 1.0 / (d as f32).sqrt();
    q.chunks_exact(shape.q_dim())
        .enumerate()
        .map(|(t, qt)| {
            let mut peak = 0f32;
            for (hq, qh) in qt.chunks_exact(d).enumerate() {
                let col = shape.kv_head(hq) * d..(shape.kv_head(hq) + 1) * d;
                let scores: Vec<f32> = (0..=start + t)
                    .map(|j| dot(qh, &keys[j * kvd..][col.clone()]) * scale)
                    .collect();
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let sum: f32 = scores.iter().map(|s| (s - max).exp()).sum();
                peak = peak.max(1.0 / sum);
            }
            peak
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOFTMAX: (RouterKind, Option<&[f32]>) =
        (RouterKind::SoftmaxTopK { renormalize: false }, None);

    #[test]
    fn router_records_append_per_chunk_with_gap_and_kth() {
        let mut t = Trace::new(2);
        // Layer 1, top-2 of 4: a chunk of two tokens, then one of one.
        t.record_router(
            1,
            &[0.1, 0.9, 0.5, 0.45, 2.0, -1.0, 3.0, 0.0],
            None,
            (4, 2),
            SOFTMAX,
        );
        t.record_router(1, &[1.0, 1.0, 0.2, 0.3], None, (4, 2), SOFTMAX);
        assert!(t.experts[0].is_empty() && t.router_kth[0].is_empty());
        assert_eq!(t.experts[1], vec![vec![1, 2], vec![2, 0], vec![0, 1]]);
        assert_eq!(t.router_kth[1], vec![0.5, 2.0, 1.0]);
        let want = [0.05, 2.0, 0.7];
        for (m, w) in t.router_margin[1].iter().zip(want) {
            assert!((m - w).abs() < 1e-6, "{:?}", t.router_margin[1]);
        }
        // Every expert selected: no runner-up.
        t.record_router(0, &[0.3, 0.1], None, (2, 2), SOFTMAX);
        assert_eq!(t.followed[1], vec![false; 3]);
        // A followed decision records the set it ran, gap and k-th its own.
        t.record_router(
            1,
            &[1.0, 0.99, 0.2, 0.3],
            Some(&[(vec![0, 3], true)]),
            (4, 2),
            SOFTMAX,
        );
        assert_eq!(t.experts[1][3], vec![0, 3]);
        assert!(t.followed[1][3]);
        assert!((t.router_margin[1][3] - 0.69).abs() < 1e-6);
        assert_eq!(t.router_margin[0], vec![f32::INFINITY]);
        assert_eq!(t.router_kth[0], vec![0.1]);
    }
}
