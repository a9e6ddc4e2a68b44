use crate::launch::Act16;
use crate::ops::rope::{KvGeom, QkvGeom};

/// Exact (f64) causal GQA attention: query `t` at position `start_pos + t`
/// attends keys `0..=start_pos + t`. Returns f32 `[n_tokens, n_q * d]`.
/// q, K and V in either 16-bit format (`Act16`), widened exactly.
pub fn attention<A: Act16>(
    qkv: &[A],
    geom: QkvGeom,
    start_pos: usize,
    kv: KvGeom,
    k_cache: &[A],
    v_cache: &[A],
    scale: f32,
) -> Vec<f32> {
    // With every position below the capacity, ring rows are linear rows.
    attention_ring(qkv, geom, start_pos, kv, k_cache, v_cache, scale, None, 0)
}

/// Exact (f64) gpt-oss attention (`ops::attention::ring` has the contract):
/// query `t` at `pos = start_pos + t` attends keys `j` with
/// `0 <= pos - j < window` (`window == 0`: all `j <= pos`), key `j` read from
/// ring row `j % capacity`; `sinks[h]` (if any) is one more logit in head
/// `h`'s softmax (max and denominator) with no value, as transformers does.
/// Returns f32 `[n_tokens, n_q * d]`.
#[allow(clippy::too_many_arguments)]
pub fn attention_ring<A: Act16>(
    qkv: &[A],
    geom: QkvGeom,
    start_pos: usize,
    kv: KvGeom,
    k_cache: &[A],
    v_cache: &[A],
    scale: f32,
    sinks: Option<&[f32]>,
    window: usize,
) -> Vec<f32> {
    let d = geom.head_dim;
    let group = geom.n_q_heads / geom.n_kv_heads;
    let mut out = vec![0f32; geom.n_tokens * geom.n_q_heads * d];
    for t in 0..geom.n_tokens {
        let pos = start_pos + t;
        let first = if window == 0 {
            0
        } else {
            (pos + 1).saturating_sub(window)
        };
        let keys = first..=pos;
        for h in 0..geom.n_q_heads {
            let q = &qkv[t * geom.row_stride() + h * d..][..d];
            let kvh = h / group;
            let row = |p: usize| (kvh * kv.capacity + p % kv.capacity) * d;
            let scores: Vec<f64> = keys
                .clone()
                .map(|p| {
                    q.iter()
                        .zip(&k_cache[row(p)..][..d])
                        .map(|(a, b)| a.to_f64() * b.to_f64())
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let sink = sinks.map(|s| s[h] as f64);
            let m = scores
                .iter()
                .chain(sink.as_ref())
                .cloned()
                .fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - m).exp());
            let mut acc = vec![0f64; d];
            for (p, w) in keys.clone().zip(&e) {
                for (a, v) in acc.iter_mut().zip(&v_cache[row(p)..][..d]) {
                    *a += w * v.to_f64();
                }
            }
            let o = &mut out[(t * geom.n_q_heads + h) * d..][..d];
            for (oi, a) in o.iter_mut().zip(&acc) {
                *oi = (a / z) as f32;
            }
        }
    }
    out
}

/// Copy k/v heads of token `t` into the ring caches at row
/// `(start_pos + t) % capacity` (`kv_append_ring_bf16`).
pub fn kv_append_ring<A: Act16>(
    qkv: &[A],
    geom: QkvGeom,
    start_pos: usize,
    kv: KvGeom,
    k_cache: &mut [A],
    v_cache: &mut [A],
) {
    let d = geom.head_dim;
    for t in 0..geom.n_tokens {
        let r = (start_pos + t) % kv.capacity;
        let src = &qkv[t * geom.row_stride()..];
        for h in 0..geom.n_kv_heads {
            let dst = (h * kv.capacity + r) * d;
            k_cache[dst..dst + d].copy_from_slice(&src[(geom.n_q_heads + h) * d..][..d]);
            v_cache[dst..dst + d]
                .copy_from_slice(&src[(geom.n_q_heads + geom.n_kv_heads + h) * d..][..d]);
        }
    }
}
