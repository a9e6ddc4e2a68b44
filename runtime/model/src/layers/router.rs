//! The MoE router of `Qwen3MoeSparseMoeBlock`: softmax over all expert
//! logits in f32, the top-k experts, and (when `norm_topk_prob`) their
//! weights renormalised to sum to one.

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
    fn ties_prefer_lower_expert_index() {
        let r = route(&[1.0, 5.0, 5.0, 5.0], 2, true);
        assert_eq!(r.iter().map(|c| c.0).collect::<Vec<_>>(), [1, 2]);
        assert!((r[0].1 - 0.5).abs() < 1e-6);
    }
}
