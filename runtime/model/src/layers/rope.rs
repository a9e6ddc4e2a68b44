//! Rotary position embedding, Hugging Face `rotate_half` convention: element
//! `i` of a head is rotated together with element `i + head_dim/2` (not with
//! its neighbour), by the angle `pos * theta^(-2i/head_dim)`, or by YaRN's
//! blended frequencies with cos/sin scaled ([`RopeScaling::Yarn`]). With a
//! partial rotary ([`RopeSpec::rotary_dim`] `r`), only the first `r`
//! dimensions of each head rotate, `i` with `i + r/2` at frequencies over
//! `r`, and the rest pass through (transformers' `apply_rotary_pos_emb` of
//! glm4_moe: `q_rot, q_pass = q[..., :r], q[..., r:]`).

use crate::arch::{RopeScaling, RopeSpec};

/// Precomputed cos/sin tables for positions `0..max_positions`.
#[derive(Debug, Clone)]
pub struct Rope {
    head_dim: usize,
    /// The rotated dimensions of each head (`head_dim` unless partial).
    rotary_dim: usize,
    max_positions: usize,
    /// `[max_positions, rotary_dim / 2]`.
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    /// The inverse frequencies are computed in f32 and the angle as an f32
    /// product, exactly as `Qwen3MoeRotaryEmbedding` does, so large
    /// positions round the same way they do in transformers.
    pub fn new(head_dim: usize, theta: f64, max_positions: usize) -> Self {
        let spec = RopeSpec {
            theta,
            scaling: RopeScaling::None,
            rotary_dim: None,
        };
        Self::with_spec(head_dim, spec, max_positions)
    }

    /// Tables for a model's [`RopeSpec`].
    pub fn with_spec(head_dim: usize, spec: RopeSpec, max_positions: usize) -> Self {
        let rotary_dim = spec.rotary_dim.unwrap_or(head_dim);
        assert!(
            rotary_dim >= 2 && rotary_dim.is_multiple_of(2) && rotary_dim <= head_dim,
            "RoPE needs an even rotary dimension within head_dim {head_dim}, got {rotary_dim}"
        );
        let half = rotary_dim / 2;
        let (inv_freq, scale) = inv_freq(rotary_dim, spec);
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for pos in 0..max_positions {
            for &f in &inv_freq {
                let angle = pos as f32 * f;
                cos.push(angle.cos() * scale);
                sin.push(angle.sin() * scale);
            }
        }
        Rope {
            head_dim,
            rotary_dim,
            max_positions,
            cos,
            sin,
        }
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The rotated leading dimensions of each head.
    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// `(cos, sin)` rows of `pos`, each `rotary_dim / 2` long.
    pub fn tables(&self, pos: usize) -> (&[f32], &[f32]) {
        assert!(
            pos < self.max_positions,
            "position {pos} is beyond the {} precomputed RoPE positions",
            self.max_positions
        );
        let half = self.rotary_dim / 2;
        let r = pos * half..(pos + 1) * half;
        (&self.cos[r.clone()], &self.sin[r])
    }

    /// Rotates every head of `x` (`[heads, head_dim]`, row-major) for `pos`:
    /// `out = x * cos + rotate_half(x) * sin` with `rotate_half(x) = [-x2, x1]`
    /// over the first `rotary_dim` dimensions of each head.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        assert_eq!(
            x.len() % self.head_dim,
            0,
            "RoPE input is not a whole number of heads"
        );
        let half = self.rotary_dim / 2;
        let (cos, sin) = self.tables(pos);
        for head in x.chunks_exact_mut(self.head_dim) {
            let (x1, x2) = head[..self.rotary_dim].split_at_mut(half);
            for i in 0..half {
                let (a, b) = (x1[i], x2[i]);
                x1[i] = a * cos[i] - b * sin[i];
                x2[i] = b * cos[i] + a * sin[i];
            }
        }
    }
}

/// `theta^(2i/d)` in f32 as transformers computes `base ** (arange / dim)`.
fn pos_freqs(head_dim: usize, theta: f64) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| (theta as f32).powf((2 * i) as f32 / head_dim as f32))
        .collect()
}

/// The inverse frequencies and the cos/sin scale of `spec`, following
/// transformers' `_compute_default_rope_parameters` and
/// `_compute_yarn_parameters` operation by operation (f32 tensors, f64
/// scalars).
pub fn inv_freq(head_dim: usize, spec: RopeSpec) -> (Vec<f32>, f32) {
    let pos = pos_freqs(head_dim, spec.theta);
    match spec.scaling {
        RopeScaling::None => (pos.iter().map(|p| 1.0 / p).collect(), 1.0),
        RopeScaling::Yarn {
            factor,
            original_max_position,
            beta_fast,
            beta_slow,
            truncate,
        } => {
            let d = head_dim as f64;
            let correction_dim = |rotations: f64| {
                d * (original_max_position as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln()
                    / (2.0 * spec.theta.ln())
            };
            let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
            if truncate {
                (low, high) = (low.floor(), high.ceil());
            }
            let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
            if low == high {
                high += 0.001;
            }
            let inv = pos
                .iter()
                .enumerate()
                .map(|(i, &p)| {
                    let ramp = ((i as f32 - low as f32) / (high - low) as f32).clamp(0.0, 1.0);
                    let extrapolation_factor = 1.0 - ramp;
                    let extrapolated = 1.0 / p;
                    let interpolated = 1.0 / (factor as f32 * p);
                    interpolated * (1.0 - extrapolation_factor)
                        + extrapolated * extrapolation_factor
                })
                .collect();
            // get_mscale(factor) = 0.1 ln(factor) + 1 (factor > 1).
            let scale = if factor <= 1.0 {
                1.0
            } else {
                (0.1 * factor.ln() + 1.0) as f32
            };
            (inv, scale)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::assert_close;

    #[test]
    fn position_zero_is_identity() {
        let r = Rope::new(4, 10000.0, 4);
        let mut x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        r.apply(&mut x, 0);
        assert_close(&x, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], 0.0);
    }

    #[test]
    fn rotates_pairs_i_and_i_plus_half() {
        // head_dim 4, theta 100: inv_freq = [1, 100^(-1/2) = 0.1].
        let r = Rope::new(4, 100.0, 3);
        let mut x = [1.0, 2.0, 3.0, 4.0];
        r.apply(&mut x, 2);
        let (a0, a1) = (2.0f32, 0.2f32);
        let want = [
            1.0 * a0.cos() - 3.0 * a0.sin(),
            2.0 * a1.cos() - 4.0 * a1.sin(),
            3.0 * a0.cos() + 1.0 * a0.sin(),
            4.0 * a1.cos() + 2.0 * a1.sin(),
        ];
        assert_close(&x, &want, 1e-6);
    }

    #[test]
    fn preserves_norm_and_relative_angle() {
        // <R(p) q, R(p') k> depends only on p - p'.
        let r = Rope::new(8, 10000.0, 20);
        let q: Vec<f32> = (0..8).map(|i| (i as f32 * 0.7).sin()).collect();
        let k: Vec<f32> = (0..8).map(|i| (i as f32 * 1.3).cos()).collect();
        let dot_at = |pq: usize, pk: usize| {
            let (mut a, mut b) = (q.clone(), k.clone());
            r.apply(&mut a, pq);
            r.apply(&mut b, pk);
            a.iter().zip(&b).map(|(x, y)| x * y).sum::<f32>()
        };
        assert!((dot_at(5, 2) - dot_at(13, 10)).abs() < 1e-5);
        let mut a = q.clone();
        r.apply(&mut a, 7);
        let n = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>();
        assert!((n(&a) - n(&q)).abs() < 1e-5);
    }

    #[test]
    fn yarn_keeps_fast_dimensions_and_interpolates_slow_ones() {
        // gpt-oss: head_dim 64, theta 150000, factor 32 over 4096 positions.
        let spec = RopeSpec {
            theta: 150_000.0,
            scaling: RopeScaling::Yarn {
                factor: 32.0,
                original_max_position: 4096,
                beta_fast: 32.0,
                beta_slow: 1.0,
                truncate: false,
            },
            rotary_dim: None,
        };
        let (inv, scale) = inv_freq(64, spec);
        let (plain, one) = inv_freq(
            64,
            RopeSpec {
                theta: 150_000.0,
                scaling: RopeScaling::None,
                rotary_dim: None,
            },
        );
        assert_eq!(one, 1.0);
        assert!((scale - (0.1 * 32f32.ln() + 1.0)).abs() < 1e-6);
        // Dimension 0 rotates ~650 times in 4096 tokens (> beta_fast):
        // extrapolated, unchanged. The last rotates < once: interpolated.
        assert_eq!(inv[0], plain[0]);
        assert!((inv[31] - plain[31] / 32.0).abs() <= 1e-6 * plain[31]);
        // In between, strictly between the two.
        // (The ramp runs over dimensions 8.09..17.4 here.)
        assert!(inv[12] < plain[12] && inv[12] > plain[12] / 32.0);
        assert_eq!(inv[8], plain[8]);
        // And the tables carry the scale.
        let r = Rope::with_spec(64, spec, 2);
        assert!((r.tables(0).0[0] - scale).abs() < 1e-6);
    }

    /// glm4_moe's partial rotary (head_dim 8, factor 0.5): dims 0..4 rotate
    /// as a 4-dim head would (0 with 2, 1 with 3, frequencies over 4), dims
    /// 4..8 pass through unchanged.
    #[test]
    fn partial_rotary_rotates_the_leading_dims_only() {
        let spec = RopeSpec {
            theta: 100.0,
            scaling: RopeScaling::None,
            rotary_dim: Some(4),
        };
        let partial = Rope::with_spec(8, spec, 3);
        let full4 = Rope::new(4, 100.0, 3);
        let mut x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let mut lead = [1.0, 2.0, 3.0, 4.0];
        partial.apply(&mut x, 2);
        full4.apply(&mut lead, 2);
        assert_close(&x[..4], &lead, 0.0);
        assert_close(&x[4..], &[5.0, 6.0, 7.0, 8.0], 0.0);
        assert_eq!(partial.tables(2).0.len(), 2);
    }
}
