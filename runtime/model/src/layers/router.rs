//! MoE routers: from a token's router logits (bias already added) to its
//! `(expert, weight)` pairs, per [`RouterKind`]:
//! - `SoftmaxTopK` (`Qwen3MoeSparseMoeBlock`): softmax over all expert
//!   logits in f32, the top-k experts, and (when `renormalize`, the config's
//!   `norm_topk_prob`) their weights renormalised to sum to one;
//! - `TopKSoftmax` (`GptOssTopKRouter`): the top-k logits, then a softmax
//!   over those k;
//! - `SigmoidGroupedTopK` (`Glm4MoeMoE.route_tokens_to_experts`, DeepSeek-V3's
//!   "noaux_tc"): sigmoid scores, group-limited choice on scores plus the
//!   selection bias, weights from the bias-free scores.

use crate::arch::RouterKind;
use std::borrow::Cow;

/// The `(expert, weight)` pairs of one token under `kind`, highest weight
/// first, ties to the lower expert index. `selection_bias` is the layer's
/// per-expert choice bias ([`crate::arch::RouterSpec::selection_bias`]).
pub fn route_with(
    kind: RouterKind,
    logits: &[f32],
    selection_bias: Option<&[f32]>,
    top_k: usize,
) -> Vec<(usize, f32)> {
    match kind {
        RouterKind::SoftmaxTopK { renormalize } => route(logits, top_k, renormalize),
        RouterKind::TopKSoftmax => topk_softmax(logits, top_k),
        RouterKind::SigmoidGroupedTopK { .. } => {
            let choice = choice_scores(kind, logits, selection_bias);
            let mut order: Vec<usize> = (0..choice.len()).collect();
            order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]));
            route_selected(kind, logits, &order[..top_k.min(order.len())])
        }
    }
}

/// The k-th largest of `values` and the gap to the next (k-th minus
/// (k+1)-th; ∞ when every value is chosen).
pub fn kth_and_gap(values: &[f32], top_k: usize) -> (f32, f32) {
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let kth = sorted[top_k - 1];
    let gap = sorted.get(top_k).map_or(f32::INFINITY, |next| kth - next);
    (kth, gap)
}

/// How close one routing decision was to going another way: the k-th
/// choice score ([`choice_scores`]) and the decision's gap. For the
/// softmax routers that is the k-th minus the (k+1)-th logit. The
/// group-limited router also decides which groups stay, and a near-tie
/// between the `topk_groups`-th group's score and the next one's switches
/// experts whose own choice scores may be far apart, so its gap is the
/// smaller of the experts' and the groups'. (What `RouteFollow` and the
/// GPU check measure near-ties by.)
pub fn decision_gap(
    kind: RouterKind,
    logits: &[f32],
    selection_bias: Option<&[f32]>,
    top_k: usize,
) -> (f32, f32) {
    let choice = choice_scores(kind, logits, selection_bias);
    let (kth, gap) = kth_and_gap(&choice, top_k);
    match kind {
        RouterKind::SigmoidGroupedTopK {
            groups,
            topk_groups,
            ..
        } if topk_groups < groups => {
            let mut gs = group_scores(&biased_scores(logits, selection_bias), groups);
            gs.sort_by(|a, b| b.total_cmp(a));
            (kth, gap.min(gs[topk_groups - 1] - gs[topk_groups]))
        }
        _ => (kth, gap),
    }
}

/// `sigmoid(logit) + selection bias` of every expert (before any group
/// is masked).
fn biased_scores(logits: &[f32], selection_bias: Option<&[f32]>) -> Vec<f32> {
    let mut choice: Vec<f32> = logits.iter().map(|&l| sigmoid(l)).collect();
    if let Some(b) = selection_bias {
        for (c, &b) in choice.iter_mut().zip(b) {
            *c += b;
        }
    }
    choice
}

/// Each of `groups` equal groups' score: the sum of its two best choice
/// scores.
fn group_scores(choice: &[f32], groups: usize) -> Vec<f32> {
    choice
        .chunks_exact(choice.len() / groups)
        .map(|g| {
            let mut v = g.to_vec();
            v.sort_by(|a, b| b.total_cmp(a));
            v.iter().take(2).sum()
        })
        .collect()
}

/// The scores `kind` chooses its top-k by (what a near-tie is measured
/// on): the logits themselves for the softmax routers (the softmax is
/// monotone), and for `SigmoidGroupedTopK` `sigmoid(logit) + bias` with
/// the experts outside the best `topk_groups` groups set to 0, as
/// transformers' `masked_fill(~score_mask, 0.0)` does.
pub fn choice_scores<'a>(
    kind: RouterKind,
    logits: &'a [f32],
    selection_bias: Option<&[f32]>,
) -> Cow<'a, [f32]> {
    let RouterKind::SigmoidGroupedTopK {
        groups,
        topk_groups,
        ..
    } = kind
    else {
        return Cow::Borrowed(logits);
    };
    let n = logits.len();
    assert!(
        groups >= 1 && n.is_multiple_of(groups) && topk_groups >= 1 && topk_groups <= groups,
        "grouped router: {n} experts in {groups} groups, keeping {topk_groups}"
    );
    let mut choice = biased_scores(logits, selection_bias);
    if topk_groups < groups {
        let per = n / groups;
        let group_score = group_scores(&choice, groups);
        let mut order: Vec<usize> = (0..groups).collect();
        order.sort_by(|&a, &b| group_score[b].total_cmp(&group_score[a]));
        for &g in &order[topk_groups..] {
            choice[g * per..(g + 1) * per].fill(0.0);
        }
    }
    Cow::Owned(choice)
}

/// `1 / (1 + e^-x)` in f32, as torch's `sigmoid`.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
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
        RouterKind::SigmoidGroupedTopK {
            renormalize, scale, ..
        } => {
            let mut c: Vec<(usize, f32)> =
                experts.iter().map(|&e| (e, sigmoid(logits[e]))).collect();
            let den = if renormalize {
                c.iter().map(|x| x.1).sum::<f32>() + 1e-20
            } else {
                1.0
            };
            for x in &mut c {
                x.1 = x.1 / den * scale;
            }
            c
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
        let r = route_with(RouterKind::TopKSoftmax, &logits, None, 2);
        assert_eq!(r.iter().map(|c| c.0).collect::<Vec<_>>(), [1, 3]);
        assert!((r[0].1 - 4.0 / 7.0).abs() < 1e-6 && (r[1].1 - 3.0 / 7.0).abs() < 1e-6);
        // Softmax-then-top-k without renormalisation differs: 0.4 and 0.3.
        let s = route_with(
            RouterKind::SoftmaxTopK { renormalize: false },
            &logits,
            None,
            2,
        );
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
                route_with(kind, &logits, None, 2)
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

    /// 8 experts in 4 groups of 2, keep 2 groups, top-2, a selection bias of
    /// +2 on expert 2: group scores (sum of each group's two choice scores)
    /// keep groups {2,3} and {0,1}; expert 6 (the best score 0.95) is in a
    /// dropped group; expert 2 is chosen for its bias, weighted by its
    /// bias-free score; renormalised, then scaled by 2.5.
    /// A near-tie between groups is a near-tie of the decision even where
    /// the chosen experts' own scores are far from the next ones: 4
    /// experts in 2 groups keeping 1, top-1. Scores (logit 0 → 0.5):
    /// group 0 {0.9, 0.1}, group 1 {0.51, 0.48}: group sums 1.0 vs 0.99.
    #[test]
    fn grouped_decision_gap_is_the_smaller_of_experts_and_groups() {
        let kind = RouterKind::SigmoidGroupedTopK {
            groups: 2,
            topk_groups: 1,
            renormalize: true,
            scale: 1.0,
        };
        let logit = |p: f32| (p / (1.0 - p)).ln();
        let l = [logit(0.9), logit(0.1), logit(0.51), logit(0.48)];
        let (kth, gap) = decision_gap(kind, &l, None, 1);
        // Experts: 0.9 against 0.1 (group 1 masked to 0): 0.8 apart.
        assert!((kth - 0.9).abs() < 1e-6);
        // Groups: 1.0 against 0.99.
        assert!((gap - 0.01).abs() < 1e-5, "{gap}");
        // Keeping every group there is no group decision.
        let all = RouterKind::SigmoidGroupedTopK {
            groups: 2,
            topk_groups: 2,
            renormalize: true,
            scale: 1.0,
        };
        let (_, gap) = decision_gap(all, &l, None, 1);
        assert!((gap - 0.39).abs() < 1e-5, "{gap}");
        // The softmax routers: the logits' own gap.
        let soft = RouterKind::SoftmaxTopK { renormalize: true };
        assert_eq!(decision_gap(soft, &[0.5, 2.0, 1.0], None, 2), (1.0, 0.5));
    }

    #[test]
    fn sigmoid_grouped_topk_hand_case() {
        let logits = [0.0f32, 1.0, -1.0, 2.0, 0.5, -2.0, 3.0, -3.0];
        let mut bias = [0f32; 8];
        bias[2] = 2.0;
        let kind = RouterKind::SigmoidGroupedTopK {
            groups: 4,
            topk_groups: 2,
            renormalize: true,
            scale: 2.5,
        };
        let r = route_with(kind, &logits, Some(&bias), 2);
        assert_eq!(r.iter().map(|c| c.0).collect::<Vec<_>>(), [3, 2]);
        let (s2, s3) = (1.0 / (1.0 + 1f32.exp()), 1.0 / (1.0 + (-2f32).exp()));
        assert!((r[0].1 - 2.5 * s3 / (s2 + s3)).abs() < 1e-6, "{r:?}");
        assert!((r[1].1 - 2.5 * s2 / (s2 + s3)).abs() < 1e-6, "{r:?}");
        let c = choice_scores(kind, &logits, Some(&bias));
        assert_eq!(&c[4..], &[0.0; 4]);
        // Every group kept: expert 6 wins a place instead of expert 3.
        let all = RouterKind::SigmoidGroupedTopK {
            groups: 4,
            topk_groups: 4,
            renormalize: false,
            scale: 1.0,
        };
        let r = route_with(all, &logits, Some(&bias), 2);
        assert_eq!(r.iter().map(|c| c.0).collect::<Vec<_>>(), [6, 2]);
        assert!((r[0].1 - sigmoid(3.0)).abs() < 1e-7 && (r[1].1 - s2).abs() < 1e-7);
        // Following another engine's set weights it the same way.
        assert_eq!(
            route_selected(kind, &logits, &[2, 3]),
            route_with(kind, &logits, Some(&bias), 2)
        );
    }
}
