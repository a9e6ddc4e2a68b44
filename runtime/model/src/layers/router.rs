//! MoE routers: from a token's router logits (bias already added) to its
//! `(expert, weight)` pairs, per [`RouterKind`]:
//! - `SoftmaxTopK` (`Qwen3MoeSparseMoeBlock`): softmax over all expert
//!   logits in f32, the top-k experts, and (when `renormalize`, the config's
//!   `norm_topk_prob`) their weights renormalised to sum to one;
//! - `TopKSoftmax` (`GptOssTopKRouter`): the top-k logits, then a softmax
//!   over those k.

use crate::arch::RouterKind;

/// The `(expert, weight)` pairs of one token under `kind`, highest weight
/// first, ties to the lower expert index.
pub fn route_with(kind: RouterKind, logits: &[f32], top_k: usize) -> Vec<(usize, f32)> {
    match kind {
        RouterKind::SoftmaxTopK { renormalize } => route(logits, top_k, renormalize),
        RouterKind::TopKSoftmax => topk_softmax(logits, top_k),
    }
}

/// The `(expert, weight)` pairs of `experts` (a top-k set another engine
/// chose, maybe not this token's own top k) weighted as `kind` weights its
/// own choice: a softmax over the set's logits (`TopKSoftmax`), or the set's
/// full-softmax probabilities, renormalised when the router renormalises
/// (`SoftmaxTopK`). Highest weight first, ties to the lower expert index.
/// What the reference runs when it follows an engine's near-tie choice
/// (`reference::RouteFollow`).
pub fn route_selected(kind: RouterKind, logits: &[f32], experts: &[usize]) -> Vec<(usize, f32)> {
    let mut chosen: Vec<(usize, f32)> = match kind {
        RouterKind::SoftmaxTopK { renormalize } => {
            let p = softmax(logits);
            let mut c: Vec<(usize, f32)> = experts.iter().map(|&e| (e, p[e])).collect();
            if renormalize {
                let sum: f32 = c.iter().map(|x| x.1).sum();
                for x in &mut c {
                    x.1 /= sum;
                }
            }
            c
        }
        RouterKind::TopKSoftmax => {
            let l: Vec<f32> = experts.iter().map(|&e| logits[e]).collect();
            experts.iter().copied().zip(softmax(&l)).collect()
        }
    };
    chosen.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    chosen
}

/// The top-k logits and a softmax over them.
pub fn topk_softmax(logits: &[f32], top_k: usize) -> Vec<(usize, f32)> {
    assert!(
        top_k >= 1 && top_k <= logits.len(),
        "topk_softmax: top_k {top_k} outside 1..={}",
        logits.len()
    );
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let chosen: Vec<f32> = order[..top_k].iter().map(|&e| logits[e]).collect();
    order[..top_k]
        .iter()
        .copied()
        .zip(softmax(&chosen))
        .collect()
}

/// Numerically stable softmax.
pub fn softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut p: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let sum: f32 = p.iter().sum();
    for v in &mut p {
        *v /= sum;
    }
    p
}

/// Chosen `(expert, weight)` pairs, highest probability first; equal
/// probabilities are ordered by lower expert index first.
pub fn route(logits: &[f32], top_k: usize, norm_topk_prob: bool) -> Vec<(usize, f32)> {
    assert!(
        top_k >= 1 && top_k <= logits.len(),
        "route: top_k {top_k} outside 1..={}",
        logits.len()
    );
    let probs = softmax(logits);
    let mut order: Vec<usize> = (0..probs.len()).collect();
    // Stable sort by descending probability keeps lower indices first on ties.
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
    let mut chosen: Vec<(usize, f32)> = order[..top_k].iter().map(|&e| (e, probs[e])).collect();
    if norm_topk_prob {
        let sum: f32 = chosen.iter().map(|c| c.1).sum();
        for c in &mut chosen {
            c.1 /= sum;
        }
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_hand_values() {
        let p = softmax(&[0.0, 2f32.ln()]);
        assert!((p[0] - 1.0 / 3.0).abs() < 1e-6 && (p[1] - 2.0 / 3.0).abs() < 1e-6);
    }

    #[test]
    fn top2_of_four_with_and_without_renormalisation() {
        // Probabilities proportional to [1, 4, 2, 3] / 10.
        let logits: Vec<f32> = [1.0f32, 4.0, 2.0, 3.0].iter().map(|v| v.ln()).collect();
        let raw = route(&logits, 2, false);
        assert_eq!(raw.iter().map(|c| c.0).collect::<Vec<_>>(), [1, 3]);
        assert!((raw[0].1 - 0.4).abs() < 1e-6 && (raw[1].1 - 0.3).abs() < 1e-6);
        let norm = route(&logits, 2, true);
        assert!((norm[0].1 - 4.0 / 7.0).abs() < 1e-6 && (norm[1].1 - 3.0 / 7.0).abs() < 1e-6);
    }

    #[test]
    fn topk_then_softmax_over_the_chosen_only() {
        // Logits [ln 1, ln 4, ln 2, ln 3]: top-2 = experts 1, 3 with
        // softmax weights 4/7, 3/7 (the others never enter the softmax).
        let logits: Vec<f32> = [1.0f32, 4.0, 2.0, 3.0].iter().map(|v| v.ln()).collect();
        let r = route_with(RouterKind::TopKSoftmax, &logits, 2);
        assert_eq!(r.iter().map(|c| c.0).collect::<Vec<_>>(), [1, 3]);
        assert!((r[0].1 - 4.0 / 7.0).abs() < 1e-6 && (r[1].1 - 3.0 / 7.0).abs() < 1e-6);
        // Softmax-then-top-k without renormalisation differs: 0.4 and 0.3.
        let s = route_with(RouterKind::SoftmaxTopK { renormalize: false }, &logits, 2);
        assert!((s[0].1 - 0.4).abs() < 1e-6);
    }

    #[test]
    fn a_selected_set_is_weighted_as_the_router_weights_its_own() {
        let logits: Vec<f32> = [1.0f32, 4.0, 2.0, 3.0].iter().map(|v| v.ln()).collect();
        for kind in [
            RouterKind::TopKSoftmax,
            RouterKind::SoftmaxTopK { renormalize: true },
            RouterKind::SoftmaxTopK { renormalize: false },
        ] {
            // Its own top-2, given in either order, is exactly route_with.
            assert_eq!(
                route_selected(kind, &logits, &[3, 1]),
                route_with(kind, &logits, 2)
            );
        }
        // Another set: experts 2 and 3 (weights 2:3 after the softmax).
        let r = route_selected(RouterKind::TopKSoftmax, &logits, &[2, 3]);
        assert_eq!(r.iter().map(|c| c.0).collect::<Vec<_>>(), [3, 2]);
        assert!((r[0].1 - 0.6).abs() < 1e-6 && (r[1].1 - 0.4).abs() < 1e-6);
        let r = route_selected(
            RouterKind::SoftmaxTopK { renormalize: false },
            &logits,
            &[2, 3],
        );
        assert!((r[0].1 - 0.3).abs() < 1e-6 && (r[1].1 - 0.2).abs() < 1e-6);
    }

    #[test]
    fn ties_prefer_lower_expert_index() {
        let r = route(&[1.0, 5.0, 5.0, 5.0], 2, true);
        assert_eq!(r.iter().map(|c| c.0).collect::<Vec<_>>(), [1, 2]);
        assert!((r[0].1 - 0.5).abs() < 1e-6);
    }
}
