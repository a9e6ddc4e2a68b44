//! `nn.Linear` without bias: `y = W x` with `W` row-major `[out, in]` (the
//! Hugging Face weight layout), for one token or a batch of tokens.

use rayon::prelude::*;

/// Output rows handed to one rayon task. Large enough that task overhead is
/// negligible, small enough that the LM head spreads over every core.
const ROWS_PER_TASK: usize = 64;

/// Below this many multiply-adds a product runs on the calling thread: waking
/// the pool costs more than the work (decode of a small model is hundreds of
/// such products per token).
pub const PARALLEL_MIN_MACS: usize = 1 << 17;

/// Dot product. On x86-64 CPUs with AVX2 and FMA (checked at run time) a
/// SIMD loop is used: the test builds run at opt-level 1, which does not
/// vectorise, and the LM head alone is ~20M multiply-adds per token.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot: lengths differ");
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above).
            return unsafe { dot_avx2_fma(a, b) };
        }
    }
    dot_scalar(a, b)
}

/// Portable dot product with eight independent accumulators, so the
/// dependency chain of a single accumulator does not bound its speed.
pub fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot: lengths differ");
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for ((s, &xv), &yv) in acc.iter_mut().zip(x).zip(y) {
            *s += xv * yv;
        }
    }
    let mut tail = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// # Safety
/// The CPU must support AVX2 and FMA; `a` and `b` must have equal lengths.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2_fma(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY (all loads): i + 8 <= n for every load, so reads stay in bounds.
    while i + 32 <= n {
        for (k, s) in acc.iter_mut().enumerate() {
            let j = i + 8 * k;
            *s = unsafe {
                _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(j)), _mm256_loadu_ps(pb.add(j)), *s)
            };
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = unsafe {
            _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i)),
                _mm256_loadu_ps(pb.add(i)),
                acc[0],
            )
        };
        i += 8;
    }
    let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds exactly 8 f32.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), s) };
    let mut sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
        + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for j in i..n {
        sum += a[j] * b[j];
    }
    sum
}

/// `out[t, r] = dot(w[r, :], x[t, :])` for `n = x.len() / in_dim` tokens.
/// `out` is row-major `[n, out_dim]`. Each weight row is read once for the
/// whole batch, which is what makes batched prefill cheaper than decode.
pub fn matmul(w: &[f32], out_dim: usize, in_dim: usize, x: &[f32], out: &mut [f32]) {
    assert_eq!(w.len(), out_dim * in_dim, "matmul: weight is not [out, in]");
    assert_eq!(x.len() % in_dim, 0, "matmul: input is not [n, in]");
    let n = x.len() / in_dim;
    assert_eq!(out.len(), n * out_dim, "matmul: output is not [n, out]");
    if n == 1 {
        let rows = |(o, wb): (&mut [f32], &[f32])| {
            for (o, row) in o.iter_mut().zip(wb.chunks_exact(in_dim)) {
                *o = dot(row, x);
            }
        };
        if w.len() < PARALLEL_MIN_MACS {
            out.chunks_mut(ROWS_PER_TASK)
                .zip(w.chunks(ROWS_PER_TASK * in_dim))
                .for_each(rows);
        } else {
            out.par_chunks_mut(ROWS_PER_TASK)
                .zip(w.par_chunks(ROWS_PER_TASK * in_dim))
                .for_each(rows);
        }
        return;
    }
    // Blocks of weight rows in parallel, each producing a [rows, n] block
    // that is then transposed into place.
    let block = |wb: &[f32]| {
        let rows = wb.len() / in_dim;
        let mut b = vec![0f32; rows * n];
        for (r, row) in wb.chunks_exact(in_dim).enumerate() {
            for (t, xt) in x.chunks_exact(in_dim).enumerate() {
                b[r * n + t] = dot(row, xt);
            }
        }
        b
    };
    let blocks: Vec<Vec<f32>> = if w.len() * n < PARALLEL_MIN_MACS {
        w.chunks(ROWS_PER_TASK * in_dim).map(block).collect()
    } else {
        w.par_chunks(ROWS_PER_TASK * in_dim).map(block).collect()
    };
    for (bi, b) in blocks.iter().enumerate() {
        let r0 = bi * ROWS_PER_TASK;
        let rows = b.len() / n;
        for t in 0..n {
            for r in 0..rows {
                out[t * out_dim + r0 + r] = b[r * n + t];
            }
        }
    }
}

/// Adds `bias` to every row of `x` (`[n, bias.len()]`).
pub fn add_bias_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::assert_close;

    #[test]
    fn simd_and_scalar_dot_agree_for_every_tail_length() {
        for n in 0..80 {
            let a: Vec<f32> = (0..n).map(|i| ((i * 37) % 11) as f32 - 5.0).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 13) % 7) as f32 * 0.25).collect();
            let exact: f64 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| f64::from(*x) * f64::from(*y))
                .sum();
            assert_eq!(dot(&a, &b) as f64, exact, "dot, n = {n}");
            assert_eq!(dot_scalar(&a, &b) as f64, exact, "dot_scalar, n = {n}");
        }
    }

    #[test]
    fn dot_matches_hand_sum_with_tail() {
        let a: Vec<f32> = (1..=11).map(|i| i as f32).collect();
        let b = vec![1.0; 11];
        assert_eq!(dot(&a, &b), 66.0);
        assert_eq!(dot(&[2.0, 3.0], &[4.0, -1.0]), 5.0);
    }

    #[test]
    fn matmul_single_and_batch() {
        // W = [[1, 2], [3, 4], [5, 6]]; x0 = [1, 1], x1 = [2, -1].
        let w = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut y = [0.0; 3];
        matmul(&w, 3, 2, &[1.0, 1.0], &mut y);
        assert_close(&y, &[3.0, 7.0, 11.0], 0.0);
        let mut y2 = [0.0; 6];
        matmul(&w, 3, 2, &[1.0, 1.0, 2.0, -1.0], &mut y2);
        assert_close(&y2, &[3.0, 7.0, 11.0, 0.0, 2.0, 4.0], 0.0);
    }

    #[test]
    fn batch_equals_row_by_row_across_blocks() {
        // More rows than one task block, so block stitching is exercised.
        let (out_dim, in_dim, n) = (150, 9, 3);
        let w: Vec<f32> = (0..out_dim * in_dim)
            .map(|i| ((i * 7919) % 13) as f32 - 6.0)
            .collect();
        let x: Vec<f32> = (0..n * in_dim).map(|i| (i % 5) as f32 * 0.5).collect();
        let mut batch = vec![0.0; n * out_dim];
        matmul(&w, out_dim, in_dim, &x, &mut batch);
        for t in 0..n {
            let mut one = vec![0.0; out_dim];
            matmul(
                &w,
                out_dim,
                in_dim,
                &x[t * in_dim..(t + 1) * in_dim],
                &mut one,
            );
            assert_close(&batch[t * out_dim..(t + 1) * out_dim], &one, 0.0);
        }
    }

    #[test]
    fn bias_is_added_per_row() {
        let mut x = [1.0, 2.0, 3.0, 4.0];
        add_bias_rows(&mut x, &[10.0, 20.0]);
        assert_close(&x, &[11.0, 22.0, 13.0, 24.0], 0.0);
    }
}
