//! RMSNorm as in Hugging Face `Qwen3MoeRMSNorm`: the mean of squares is taken
//! in f32, then `x * rsqrt(mean + eps) * weight`.

/// Normalises `x` into `out` with `weight` (all of the same length).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(
        x.len(),
        weight.len(),
        "rms_norm: x and weight differ in length"
    );
    assert_eq!(x.len(), out.len(), "rms_norm: x and out differ in length");
    let scale = inv_rms(x, eps);
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * scale * w;
    }
}

/// Normalises `x` in place.
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    assert_eq!(
        x.len(),
        weight.len(),
        "rms_norm: x and weight differ in length"
    );
    let scale = inv_rms(x, eps);
    for (v, &w) in x.iter_mut().zip(weight) {
        *v = *v * scale * w;
    }
}

/// Normalises every row of a row-major `[rows, weight.len()]` matrix in place.
/// Used for the per-head q/k norms (rows = heads) and for batches of tokens.
pub fn rms_norm_rows(x: &mut [f32], weight: &[f32], eps: f32) {
    assert_eq!(
        x.len() % weight.len(),
        0,
        "rms_norm_rows: length is not a multiple of the row width"
    );
    for row in x.chunks_exact_mut(weight.len()) {
        rms_norm_in_place(row, weight, eps);
    }
}

/// `1 / sqrt(mean(x^2) + eps)`. The sum is accumulated in f64 so the result
/// does not depend on the summation order (the GPU reduces in a tree).
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let sum: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let mean = (sum / x.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::assert_close;

    #[test]
    fn matches_hand_computed_values() {
        // mean(x^2) = (1 + 4 + 9 + 16) / 4 = 7.5; rsqrt(7.5) = 0.365148.
        let x = [1.0, -2.0, 3.0, 4.0];
        let w = [1.0, 1.0, 0.5, 2.0];
        let mut out = [0.0; 4];
        rms_norm(&x, &w, 0.0, &mut out);
        let s = 1.0 / 7.5f32.sqrt();
        assert_close(&out, &[s, -2.0 * s, 1.5 * s, 8.0 * s], 1e-6);
    }

    #[test]
    fn eps_is_inside_the_square_root() {
        // All zeros: the result is 0 * rsqrt(eps) = 0, and with x = [1]
        // and eps = 3, 1 * rsqrt(1 + 3) = 0.5.
        let mut out = [9.0];
        rms_norm(&[1.0], &[1.0], 3.0, &mut out);
        assert_close(&out, &[0.5], 1e-7);
        let mut z = [0.0, 0.0];
        rms_norm_in_place(&mut z, &[1.0, 1.0], 1e-6);
        assert_close(&z, &[0.0, 0.0], 0.0);
    }

    #[test]
    fn rows_are_normalised_independently() {
        let mut x = [3.0, 4.0, 0.0, 2.0];
        rms_norm_rows(&mut x, &[1.0, 1.0], 0.0);
        // Row 0: mean = 12.5 -> [3, 4] / 3.5355; row 1: mean = 2 -> [0, 1.41421].
        let r = 12.5f32.sqrt();
        assert_close(&x, &[3.0 / r, 4.0 / r, 0.0, 2.0f32.sqrt()], 1e-6);
    }
}
