//! Partial rotary (`rope_partial_bf16`): the optional per-head RMSNorm, then
//! RoPE on the leading `rotary_dim` dimensions of each head only.

use half::bf16;

use crate::ops::rope::QkvGeom;

/// In place on the q and k heads: with `norm = Some((q_norm, k_norm, eps))`
/// each head is RMS-normalised over all `head_dim` values (f64) and scaled
/// by its weight; then elements `i` and `i + rotary_dim/2` (`i <
/// rotary_dim/2`) rotate by `f32(pos) * inv_freq[i]` with cos/sin times
/// `scale` (f32, each product rounded, as `rope_table`); elements from
/// `rotary_dim` on pass through. One rounding to bf16.
pub fn rope_partial(
    qkv: &mut [bf16],
    geom: QkvGeom,
    start_pos: u32,
    norm: Option<(&[bf16], &[bf16], f32)>,
    inv_freq: &[f32],
    scale: f32,
    rotary_dim: usize,
) {
    let d = geom.head_dim;
    let half = rotary_dim / 2;
    assert_eq!(inv_freq.len(), half, "rope_partial: inv_freq length");
    for t in 0..geom.n_tokens {
        let pos = (start_pos as usize + t) as f32;
        for hh in 0..geom.n_q_heads + geom.n_kv_heads {
            let x = &mut qkv[t * geom.row_stride() + hh * d..][..d];
            let v: Vec<f32> = match norm {
                Some((qn, kn, eps)) => {
                    let w = if hh < geom.n_q_heads { qn } else { kn };
                    let ss: f64 = x.iter().map(|e| e.to_f64() * e.to_f64()).sum();
                    let inv = 1.0 / (ss / d as f64 + eps as f64).sqrt();
                    (0..d)
                        .map(|i| (x[i].to_f64() * inv * w[i].to_f64()) as f32)
                        .collect()
                }
                None => x.iter().map(|e| e.to_f32()).collect(),
            };
            for (i, &f) in inv_freq.iter().enumerate() {
                let angle = pos * f;
                let (c, s) = (angle.cos() * scale, angle.sin() * scale);
                let (a, b) = (v[i], v[i + half]);
                x[i] = bf16::from_f32(a * c - b * s);
                x[i + half] = bf16::from_f32(b * c + a * s);
            }
            for i in rotary_dim..d {
                x[i] = bf16::from_f32(v[i]);
            }
        }
    }
}
