//! The shared transformer layers as plain functions over f32 slices.
//!
//! These are the definitions the reference engine runs and the GPU kernels
//! are tested against, so each one is written to be obviously equal to the
//! Hugging Face computation rather than fast. Where work is embarrassingly
//! parallel (matrix rows, attention heads) rayon spreads it over the cores.

pub mod attention;
pub mod linear;
pub mod mlp;
pub mod norm;
pub mod rope;
pub mod router;

/// Asserts two slices are element-wise within `tol` (unit tests only).
#[cfg(test)]
pub(crate) fn assert_close(got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol, "element {i}: got {g}, want {w}");
    }
}
