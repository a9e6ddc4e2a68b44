use crate::ops::moe::RouterMode;

/// Softmax + top-k (ties: lower index) + optional renormalization, f32.
/// Returns (ids, weights), both `[n_tokens, k]`.
pub fn router_topk(
    logits: &[f32],
    n_experts: usize,
    k: usize,
    normalize: bool,
) -> (Vec<u32>, Vec<f32>) {
    router_topk_with(
        logits,
        None,
        n_experts,
        k,
        RouterMode::SoftmaxTopK { normalize },
    )
}

/// The router kernels' contract: `bias` (if any) added to each row in f32,
/// then per `mode` softmax-then-top-k (optionally renormalised) or
/// top-k-then-softmax; the order is a stable descending sort (ties: lower
/// index), sums over the k taken in selection order. Returns (ids,
/// weights), both `[n_tokens, k]`.
pub fn router_topk_with(
    logits: &[f32],
    bias: Option<&[f32]>,
    n_experts: usize,
    k: usize,
    mode: RouterMode,
) -> (Vec<u32>, Vec<f32>) {
    if let RouterMode::SigmoidGrouped {
        groups,
        topk_groups,
        normalize,
        scale,
    } = mode
    {
        return sigmoid_grouped(
            logits,
            bias,
            n_experts,
            k,
            (groups, topk_groups),
            normalize,
            scale,
        );
    }
    let mut ids = Vec::new();
    let mut ws = Vec::new();
    for row in logits.chunks(n_experts) {
        let v: Vec<f32> = match bias {
            Some(b) => row.iter().zip(b).map(|(x, b)| x + b).collect(),
            None => row.to_vec(),
        };
        // Softmax-first ranks probabilities, top-k-first the logits.
        let ranked = match mode {
            RouterMode::SoftmaxTopK { .. } => softmax(&v),
            RouterMode::TopKSoftmax => v,
            RouterMode::SigmoidGrouped { .. } => unreachable!("returned above"),
        };
        let mut order: Vec<usize> = (0..n_experts).collect();
        // Stable sort: equal values keep ascending index order.
        order.sort_by(|a, b| ranked[*b].total_cmp(&ranked[*a]));
        let sel = &order[..k];
        let picked: Vec<f32> = sel.iter().map(|&i| ranked[i]).collect();
        let w = match mode {
            RouterMode::SoftmaxTopK { normalize: true } => {
                let s: f32 = picked.iter().sum();
                picked.iter().map(|p| p / s).collect()
            }
            RouterMode::SoftmaxTopK { normalize: false } => picked,
            RouterMode::TopKSoftmax => softmax(&picked),
            RouterMode::SigmoidGrouped { .. } => unreachable!("returned above"),
        };
        ids.extend(sel.iter().map(|&i| i as u32));
        ws.extend(w);
    }
    (ids, ws)
}

/// [`RouterMode::SigmoidGrouped`]: `s = 1 / (1 + exp(-x))`; choice
/// `s + bias`; groups scored by their two best choices, all but the best
/// `topk_groups` zeroed; the top-k choices (stable sort) weighted by `s`,
/// summed in selection order.
fn sigmoid_grouped(
    logits: &[f32],
    bias: Option<&[f32]>,
    n_experts: usize,
    k: usize,
    (groups, topk_groups): (usize, usize),
    normalize: bool,
    scale: f32,
) -> (Vec<u32>, Vec<f32>) {
    let per = n_experts / groups;
    let (mut ids, mut ws) = (Vec::new(), Vec::new());
    for row in logits.chunks(n_experts) {
        let s: Vec<f32> = row.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect();
        let mut c: Vec<f32> = match bias {
            Some(b) => s.iter().zip(b).map(|(s, b)| s + b).collect(),
            None => s.clone(),
        };
        if topk_groups < groups {
            let score: Vec<f32> = c
                .chunks(per)
                .map(|g| {
                    let mut v = g.to_vec();
                    v.sort_by(|a, b| b.total_cmp(a));
                    v[0] + v[1]
                })
                .collect();
            let mut order: Vec<usize> = (0..groups).collect();
            order.sort_by(|a, b| score[*b].total_cmp(&score[*a]));
            for &g in &order[topk_groups..] {
                c[g * per..(g + 1) * per].fill(0.0);
            }
        }
        let mut order: Vec<usize> = (0..n_experts).collect();
        order.sort_by(|a, b| c[*b].total_cmp(&c[*a]));
        let sel = &order[..k];
        let sum: f32 = sel.iter().map(|&i| s[i]).sum();
        ids.extend(sel.iter().map(|&i| i as u32));
        ws.extend(sel.iter().map(|&i| {
            let w = if normalize {
                s[i] / (sum + 1e-20)
            } else {
                s[i]
            };
            w * scale
        }));
    }
    (ids, ws)
}

/// `exp(x - max) / sum`, f32, sum in index order.
fn softmax(x: &[f32]) -> Vec<f32> {
    let m = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = x.iter().map(|v| (v - m).exp()).collect();
    let z: f32 = e.iter().sum();
    e.iter().map(|v| v / z).collect()
}

/// Stable grouping by expert: (counts, offsets, row_pair, pair_row).
pub fn moe_group(ids: &[u32], n_experts: usize) -> (Vec<u32>, Vec<u32>, Vec<u32>, Vec<u32>) {
    let mut counts = vec![0u32; n_experts];
    for &e in ids {
        if (e as usize) < n_experts {
            counts[e as usize] += 1;
        }
    }
    let mut offsets = vec![0u32; n_experts + 1];
    for e in 0..n_experts {
        offsets[e + 1] = offsets[e] + counts[e];
    }
    let mut next = offsets.clone();
    let mut row_pair = vec![u32::MAX; ids.len()];
    let mut pair_row = vec![u32::MAX; ids.len()];
    for (p, &e) in ids.iter().enumerate() {
        if (e as usize) < n_experts {
            let r = next[e as usize];
            next[e as usize] += 1;
            row_pair[r as usize] = p as u32;
            pair_row[p] = r;
        }
    }
    (counts, offsets, row_pair, pair_row)
}

/// `residual[t] += sum_j w[p] * y[pair_row[p]]`, sum in j order in f32.
pub fn moe_combine(
    residual: &mut [f32],
    y: &[f32],
    pair_row: &[u32],
    weights: &[f32],
    k: usize,
    hidden: usize,
) {
    let n_pairs = pair_row.len();
    for (t, res) in residual.chunks_mut(hidden).enumerate() {
        for (c, r) in res.iter_mut().enumerate() {
            let mut acc = 0f32;
            for j in 0..k {
                let p = t * k + j;
                let row = pair_row[p] as usize;
                acc += if row < n_pairs {
                    weights[p] * y[row * hidden + c]
                } else {
                    f32::NAN
                };
            }
            *r += acc;
        }
    }
}
