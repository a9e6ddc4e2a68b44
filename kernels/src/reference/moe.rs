/// Softmax + top-k (ties: lower index) + optional renormalization, f32.
/// Returns (ids, weights), both `[n_tokens, k]`.
pub fn router_topk(
    logits: &[f32],
    n_experts: usize,
    k: usize,
    normalize: bool,
) -> (Vec<u32>, Vec<f32>) {
    let mut ids = Vec::new();
    let mut ws = Vec::new();
    for row in logits.chunks(n_experts) {
        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = row.iter().map(|v| (v - m).exp()).collect();
        let z: f32 = e.iter().sum();
        let p: Vec<f32> = e.iter().map(|v| v / z).collect();
        let mut order: Vec<usize> = (0..n_experts).collect();
        // Stable sort: equal probabilities keep ascending index order.
        order.sort_by(|a, b| p[*b].total_cmp(&p[*a]));
        let sel = &order[..k];
        let s: f32 = sel.iter().map(|&i| p[i]).sum();
        for &i in sel {
            ids.push(i as u32);
            ws.push(if normalize { p[i] / s } else { p[i] });
        }
    }
    (ids, ws)
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
