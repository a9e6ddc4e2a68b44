use half::bf16;

use crate::ops::rope::{KvGeom, QkvGeom};

/// Exact (f64) causal GQA attention: query `t` at position `start_pos + t`
/// attends keys `0..=start_pos + t`. Returns f32 `[n_tokens, n_q * d]`.
pub fn attention(
    qkv: &[bf16],
    geom: QkvGeom,
    start_pos: usize,
    kv: KvGeom,
    k_cache: &[bf16],
    v_cache: &[bf16],
    scale: f32,
) -> Vec<f32> {
    let d = geom.head_dim;
    let group = geom.n_q_heads / geom.n_kv_heads;
    let mut out = vec![0f32; geom.n_tokens * geom.n_q_heads * d];
    for t in 0..geom.n_tokens {
        let pos = start_pos + t;
        for h in 0..geom.n_q_heads {
            let q = &qkv[t * geom.row_stride() + h * d..][..d];
            let kvh = h / group;
            let key = |p: usize| &k_cache[(kvh * kv.capacity + p) * d..][..d];
            let val = |p: usize| &v_cache[(kvh * kv.capacity + p) * d..][..d];
            let scores: Vec<f64> = (0..=pos)
                .map(|p| {
                    q.iter()
                        .zip(key(p))
                        .map(|(a, b)| a.to_f64() * b.to_f64())
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = e.iter().sum();
            let o = &mut out[(t * geom.n_q_heads + h) * d..][..d];
            for (i, oi) in o.iter_mut().enumerate() {
                let acc: f64 = (0..=pos).map(|p| e[p] * val(p)[i].to_f64()).sum();
                *oi = (acc / z) as f32;
            }
        }
    }
    out
}
