use crate::ops::sampling::SamplingParams;

const W_ONE: f32 = 16_777_216.0;
const W_MAX: u32 = 16_777_215;

/// Philox4x32-10 keyed by `seed`, counter `(ctr, 0)`.
pub fn philox4x32_10(seed: u64, ctr: u64) -> [u32; 4] {
    let (mut c0, mut c1, mut c2, mut c3) = (ctr as u32, (ctr >> 32) as u32, 0u32, 0u32);
    let (mut k0, mut k1) = (seed as u32, (seed >> 32) as u32);
    for _ in 0..10 {
        let p0 = 0xD251_1F53u64 * c0 as u64;
        let p1 = 0xCD9E_8D57u64 * c2 as u64;
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        (c0, c1, c2, c3) = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0);
        k0 = k0.wrapping_add(0x9E37_79B9);
        k1 = k1.wrapping_add(0xBB67_AE85);
    }
    [c0, c1, c2, c3]
}

/// Step 0 of the sampling semantics (`ops::sampling`): a non-finite logit
/// means no token (`SAMPLE_NONFINITE`, counts unchanged).
pub fn refuses(logits: &[f32]) -> bool {
    logits.iter().any(|v| !v.is_finite())
}

/// Step 1-2 of the sampling semantics (`ops::sampling`): penalized,
/// temperature-scaled logits, NaN -> -inf. For temperature 0 the scale is 1.
pub fn prepared_logits(logits: &[f32], counts: &[u32], p: &SamplingParams) -> Vec<f32> {
    let inv_t = if p.temperature == 0.0 {
        1.0
    } else {
        1.0 / p.temperature
    };
    logits
        .iter()
        .zip(counts)
        .map(|(&l, &c)| {
            let pres = if c > 0 { p.presence_penalty } else { 0.0 };
            let v = (l - pres - p.frequency_penalty * c as f32) * inv_t;
            if v.is_nan() { f32::NEG_INFINITY } else { v }
        })
        .collect()
}

/// Step 1's grammar mask: every token whose bit (bit `v % 32` of word
/// `v / 32`) is clear gets `-inf` in the prepared logits.
pub fn apply_mask(prepared: &mut [f32], mask: &[u32]) {
    for (v, l) in prepared.iter_mut().enumerate() {
        if mask[v / 32] >> (v % 32) & 1 == 0 {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// Greedy choice over prepared logits (ties: lowest id; all -inf: 0).
pub fn argmax(l: &[f32]) -> u32 {
    let mut best = (f32::NEG_INFINITY, usize::MAX);
    for (i, &v) in l.iter().enumerate() {
        let v = if v.is_nan() { f32::NEG_INFINITY } else { v };
        if v > best.0 || (v == best.0 && i < best.1) {
            best = (v, i);
        }
    }
    if best.1 < l.len() { best.1 as u32 } else { 0 }
}

/// 24-bit integer weights `min(floor(exp(l - max) * 2^24), 2^24 - 1)`.
pub fn sample_weights(prepared: &[f32]) -> Vec<u32> {
    let m = prepared.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    prepared
        .iter()
        .map(|&l| {
            let e = (l - m).exp() * W_ONE;
            if e >= W_MAX as f32 {
                W_MAX
            } else if e.is_nan() {
                0
            } else {
                e as u32
            }
        })
        .collect()
}

/// Steps 3-6: top-k, top-p, min-p over integer weights, then the draw.
pub fn sample_from_weights(w: &[u32], p: &SamplingParams, step: u64) -> u32 {
    let v = w.len();
    let use_k = p.top_k > 0 && (p.top_k as usize) < v;
    let (tk, need_eq) = if use_k {
        let mut sorted = w.to_vec();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        let tk = sorted[p.top_k as usize - 1];
        let gt = w.iter().filter(|&&x| x > tk).count();
        (tk, p.top_k as usize - gt)
    } else {
        (0, 0)
    };
    let mut in_k = vec![true; v];
    if use_k {
        let mut eq = 0;
        for (i, &x) in w.iter().enumerate() {
            in_k[i] = x > tk
                || (x == tk && {
                    eq += 1;
                    eq <= need_eq
                });
        }
    }
    let mut tp = 0u32;
    if p.top_p < 1.0 {
        let mk: u64 = w
            .iter()
            .zip(&in_k)
            .filter(|(_, k)| **k)
            .map(|(x, _)| *x as u64)
            .sum();
        let target = ((p.top_p as f64 * mk as f64).ceil() as u64).max(1);
        let mut vals: Vec<u32> = w
            .iter()
            .zip(&in_k)
            .filter(|(_, k)| **k)
            .map(|(x, _)| *x)
            .collect();
        vals.sort_unstable_by(|a, b| b.cmp(a));
        let mut cum = 0u64;
        let mut idx = 0;
        while idx < vals.len() {
            let x = vals[idx];
            while idx < vals.len() && vals[idx] == x {
                cum += x as u64;
                idx += 1;
            }
            if cum >= target {
                tp = x;
                break;
            }
        }
    }
    let tm = if p.min_p > 0.0 {
        (p.min_p as f64 * W_MAX as f64).ceil() as u32
    } else {
        0
    };
    let thr = tp.max(tm);
    let kept = |i: usize| in_k[i] && w[i] >= thr;
    let total: u64 = (0..v).filter(|&i| kept(i)).map(|i| w[i] as u64).sum();
    if total == 0 {
        return 0;
    }
    let r = philox4x32_10(p.seed, step);
    let r64 = ((r[0] as u64) << 32) | r[1] as u64;
    let target = ((r64 as u128 * total as u128) >> 64) as u64;
    let mut cum = 0u64;
    for (i, &wi) in w.iter().enumerate() {
        if kept(i) {
            cum += wi as u64;
            if cum > target {
                return i as u32;
            }
        }
    }
    // target < total, so the loop always returns.
    unreachable!("cumulative weight reaches the total")
}
