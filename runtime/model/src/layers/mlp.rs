//! Gated MLP (`Qwen3MoeMLP`, each routed expert of every family):
//! `down(act(gate x + b_g, up x + b_u)) + b_d` with `gate`, `up` `[I, H]`,
//! `down` `[H, I]`, optional biases (gpt_oss experts), and the family's
//! [`Activation`]: SwiGLU `silu(g) * u`, or gpt_oss's clamped SwiGLU.

use super::linear::{add_bias_rows, matmul};
use crate::arch::Activation;
use crate::experts::ExpertBias;

/// `act(gate, up)` of one element.
pub fn activate(act: Activation, gate: f32, up: f32) -> f32 {
    match act {
        Activation::Swiglu => silu(gate) * up,
        Activation::ClampedSwiglu { limit, alpha } => {
            // transformers GptOssExperts: gate.clamp(max=limit),
            // up.clamp(-limit, limit), glu = gate * sigmoid(gate * alpha),
            // (up + 1) * glu.
            let g = gate.min(limit);
            let u = up.clamp(-limit, limit);
            let glu = g / (1.0 + (-g * alpha).exp());
            (u + 1.0) * glu
        }
    }
}

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
    pub activation: Activation,
    pub bias: Option<&'a ExpertBias>,
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
    if let Some(b) = w.bias {
        add_bias_rows(&mut g, &b.gate);
        add_bias_rows(&mut u, &b.up);
    }
    for (gv, uv) in g.iter_mut().zip(&u) {
        *gv = activate(w.activation, *gv, *uv);
    }
    let mut out = vec![0f32; n * h];
    matmul(w.down, h, i, &g, &mut out);
    if let Some(b) = w.bias {
        add_bias_rows(&mut out, &b.down);
    }
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
            activation: Activation::Swiglu,
            bias: None,
        };
        let h = silu(1.0) * 6.0;
        assert_close(&swiglu(w, &[1.0, 3.0]), &[h, -h], 1e-6);
        // A batch of two tokens gives the two single-token results.
        let two = swiglu(w, &[1.0, 3.0, 0.0, 0.0]);
        assert_close(&two, &[h, -h, 0.0, 0.0], 1e-6);
    }

    #[test]
    fn clamped_swiglu_hand_values() {
        let act = Activation::ClampedSwiglu {
            limit: 7.0,
            alpha: 1.702,
        };
        // Inside the limits: (u + 1) * g * sigmoid(1.702 g).
        let s = |x: f32| 1.0 / (1.0 + (-x).exp());
        assert!((activate(act, 1.0, 2.0) - 3.0 * s(1.702)).abs() < 1e-6);
        // gate clamps from above only, up from both sides.
        assert_eq!(activate(act, 10.0, 0.0), activate(act, 7.0, 0.0));
        assert_ne!(activate(act, -10.0, 0.0), activate(act, -7.0, 0.0));
        assert_eq!(activate(act, 1.0, -20.0), (-7.0 + 1.0) * s(1.702));
    }

    #[test]
    fn biases_add_before_the_activation_and_after_down() {
        // H = 1, I = 1, all weights 1, x = 0: only the biases act.
        let bias = ExpertBias {
            gate: vec![1.0],
            up: vec![2.0],
            down: vec![0.5],
        };
        let w = SwigluWeights {
            gate: &[1.0],
            up: &[1.0],
            down: &[1.0],
            hidden: 1,
            intermediate: 1,
            activation: Activation::Swiglu,
            bias: Some(&bias),
        };
        assert_close(&swiglu(w, &[0.0]), &[silu(1.0) * 2.0 + 0.5], 1e-6);
    }
}
