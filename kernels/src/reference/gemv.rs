use half::bf16;

use super::basic::rmsnorm_as;
use crate::launch::Act16;

/// `y[t, j] = y0[t, j] + sum_i x[t, i] * w[j, i]` (row-major `x` `[m, k]`,
/// `w` `[n, k]`, `y0` `[m, n]` or zeros), summed in f64 and rounded once
/// to f32. Callers widen bf16 inputs with [`super::to_f32`].
pub fn gemv(x: &[f32], w: &[f32], m: usize, n: usize, k: usize, y0: Option<&[f32]>) -> Vec<f32> {
    assert!(
        x.len() >= m * k && w.len() >= n * k,
        "gemv reference: short input"
    );
    let mut y = Vec::with_capacity(m * n);
    for t in 0..m {
        let xr = &x[t * k..][..k];
        for j in 0..n {
            let wr = &w[j * k..][..k];
            let mut s: f64 = y0.map_or(0.0, |y0| y0[t * n + j] as f64);
            for (&a, &b) in xr.iter().zip(wr) {
                s += a as f64 * b as f64;
            }
            y.push(s as f32);
        }
    }
    y
}

/// [`rmsnorm`] of the f32 `residual` `[m, k]` (f64 statistics), then
/// [`gemv`] of that bf16 vector: `(normed, y)`.
#[allow(clippy::too_many_arguments)]
pub fn gemv_rmsnorm(
    residual: &[f32],
    norm_w: &[bf16],
    eps: f32,
    w: &[f32],
    m: usize,
    n: usize,
    k: usize,
    y0: Option<&[f32]>,
) -> (Vec<bf16>, Vec<f32>) {
    gemv_rmsnorm_as(residual, norm_w, eps, w, m, n, k, y0)
}

/// [`gemv_rmsnorm`] with the normed vector rounded to `A` (f16:
/// `gemv_rmsnorm_f16`, whose weight `w` the caller widens from f16).
#[allow(clippy::too_many_arguments)]
pub fn gemv_rmsnorm_as<A: Act16>(
    residual: &[f32],
    norm_w: &[bf16],
    eps: f32,
    w: &[f32],
    m: usize,
    n: usize,
    k: usize,
    y0: Option<&[f32]>,
) -> (Vec<A>, Vec<f32>) {
    let normed = rmsnorm_as::<A>(&residual[..m * k], norm_w, k, eps);
    let x: Vec<f32> = normed.iter().map(|v| v.to_f32()).collect();
    let y = gemv(&x, w, m, n, k, y0);
    (normed, y)
}
