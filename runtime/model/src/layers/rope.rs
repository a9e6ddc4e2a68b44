//! Rotary position embedding, Hugging Face `rotate_half` convention: element
//! `i` of a head is rotated together with element `i + head_dim/2` (not with
//! its neighbour), by the angle `pos * theta^(-2i/head_dim)`.

/// Precomputed cos/sin tables for positions `0..max_positions`.
#[derive(Debug, Clone)]
pub struct Rope {
    head_dim: usize,
    max_positions: usize,
    /// `[max_positions, head_dim / 2]`.
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    /// The inverse frequencies are computed in f32 and the angle as an f32
    /// product, exactly as `Qwen3MoeRotaryEmbedding` does, so large
    /// positions round the same way they do in transformers.
    pub fn new(head_dim: usize, theta: f64, max_positions: usize) -> Self {
        assert!(
            head_dim >= 2 && head_dim.is_multiple_of(2),
            "RoPE needs an even head_dim, got {head_dim}"
        );
        let half = head_dim / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32))
            .collect();
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for pos in 0..max_positions {
            for &f in &inv_freq {
                let angle = pos as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        Rope {
            head_dim,
            max_positions,
            cos,
            sin,
        }
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// `(cos, sin)` rows of `pos`, each `head_dim / 2` long.
    pub fn tables(&self, pos: usize) -> (&[f32], &[f32]) {
        assert!(
            pos < self.max_positions,
            "position {pos} is beyond the {} precomputed RoPE positions",
            self.max_positions
        );
        let half = self.head_dim / 2;
        let r = pos * half..(pos + 1) * half;
        (&self.cos[r.clone()], &self.sin[r])
    }

    /// Rotates every head of `x` (`[heads, head_dim]`, row-major) for `pos`:
    /// `out = x * cos + rotate_half(x) * sin` with `rotate_half(x) = [-x2, x1]`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        assert_eq!(
            x.len() % self.head_dim,
            0,
            "RoPE input is not a whole number of heads"
        );
        let half = self.head_dim / 2;
        let (cos, sin) = self.tables(pos);
        for head in x.chunks_exact_mut(self.head_dim) {
            let (x1, x2) = head.split_at_mut(half);
            for i in 0..half {
                let (a, b) = (x1[i], x2[i]);
                x1[i] = a * cos[i] - b * sin[i];
                x2[i] = b * cos[i] + a * sin[i];
            }
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
}
