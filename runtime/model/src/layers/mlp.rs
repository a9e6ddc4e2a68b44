//! SwiGLU MLP (`Qwen3MoeMLP`, also each routed expert):
//! `down(silu(gate x) * up x)` with `gate`, `up` `[I, H]` and `down` `[H, I]`.

use super::linear::matmul;

/// `x * sigmoid(x)`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Weights of one SwiGLU MLP, borrowed.
#[derive(Debug, Clone, Copy)]
pub struct SwigluWeights<'a> {
    pub gate: &'a [f32],
    pub up: &'a [f32],
    pub down: &'a [f32],
    pub hidden: usize,
    pub intermediate: usize,
}

/// Applies the MLP to `n` tokens: `x` is `[n, hidden]`, returns `[n, hidden]`.
pub fn swiglu(w: SwigluWeights<'_>, x: &[f32]) -> Vec<f32> {
    let (h, i) = (w.hidden, w.intermediate);
    assert_eq!(w.gate.len(), i * h, "swiglu: gate is not [I, H]");
    assert_eq!(w.up.len(), i * h, "swiglu: up is not [I, H]");
    assert_eq!(w.down.len(), h * i, "swiglu: down is not [H, I]");
    assert_eq!(x.len() % h, 0, "swiglu: input is not [n, H]");
    let n = x.len() / h;
    let mut g = vec![0f32; n * i];
    let mut u = vec![0f32; n * i];
    matmul(w.gate, i, h, x, &mut g);
    matmul(w.up, i, h, x, &mut u);
    for (gv, uv) in g.iter_mut().zip(&u) {
        *gv = silu(*gv) * uv;
    }
    let mut out = vec![0f32; n * h];
    matmul(w.down, h, i, &g, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::assert_close;

    #[test]
    fn silu_hand_values() {
        assert_eq!(silu(0.0), 0.0);
        assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((silu(-2.0) + 0.238_405_84).abs() < 1e-6);
    }

    #[test]
    fn swiglu_hand_computed() {
        // H = 2, I = 1: gate row [1, 0], up row [0, 2], down column [1, -1].
        // x = [1, 3]: g = 1, u = 6, h = silu(1) * 6; out = [h, -h].
        let w = SwigluWeights {
            gate: &[1.0, 0.0],
            up: &[0.0, 2.0],
            down: &[1.0, -1.0],
            hidden: 2,
            intermediate: 1,
        };
        let h = silu(1.0) * 6.0;
        assert_close(&swiglu(w, &[1.0, 3.0]), &[h, -h], 1e-6);
        // A batch of two tokens gives the two single-token results.
        let two = swiglu(w, &[1.0, 3.0, 0.0, 0.0]);
        assert_close(&two, &[h, -h, 0.0, 0.0], 1e-6);
    }
}
